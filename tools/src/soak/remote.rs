//! The soak across two processes: `soak --listen ADDR` runs the server
//! reactors behind an acceptor on ADDR, `soak --connect ADDR` the client
//! reactors, which dial every connection to it, as `bench --listen` and
//! `--connect` split a bench. There is no control connection: both ends
//! take `--connections` and `--server-reactors` from their own flags
//! (connection `i` goes to server reactor `i % --server-reactors`), and
//! each end prints its own report. The server's report counts what it
//! checks on the request path; it ends once `--connections` connections
//! have been served and closed, or when its time runs out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::*;

/// How the soak's two sides are placed.
pub(super) enum Ends {
    /// Both in this process, over loopback.
    Local,
    /// The server side here, on this address.
    Listen(String),
    /// The client side here, against the server at this address.
    Connect(String),
}

impl Ends {
    pub(super) fn of(args: &SoakArgs) -> Self {
        match (&args.listen, &args.connect) {
            (Some(a), _) => Ends::Listen(a.clone()),
            (None, Some(a)) => Ends::Connect(a.clone()),
            (None, None) => Ends::Local,
        }
    }

    /// Whether the other side is in another process.
    pub(super) fn remote(&self) -> bool {
        !matches!(self, Ends::Local)
    }

    /// Whether `side` runs in this process.
    pub(super) fn runs(&self, side: Side) -> bool {
        match self {
            Ends::Local => true,
            Ends::Listen(_) => side == Side::Server,
            Ends::Connect(_) => side == Side::Client,
        }
    }
}

/// How long a `--listen` server waits for its client beyond the soak's
/// own `--duration` + `--drain`: the client's dials and set-up.
const LISTEN_SLACK: Duration = Duration::from_secs(60);

/// Run the soak's sides that `args` places in this process.
pub(super) fn run<D: SoakDriver, A: Attach<D>>(
    args: &SoakArgs,
    lay: &Layout,
    make: impl Fn(Side) -> Result<D, String>,
    attacher: impl Fn(u64, u64) -> A,
) -> Result<Outcome, String> {
    match Ends::of(args) {
        Ends::Local => run_soak(args, lay, make, attacher),
        Ends::Listen(addr) => serve(args, lay, &addr, make, attacher),
        Ends::Connect(addr) => {
            let drivers = (0..lay.client_cpus.len())
                .map(|_| make(Side::Client))
                .collect::<Result<Vec<_>, _>>()?;
            run_clients(args, lay, drivers, &addr, &attacher)
        }
    }
}

/// The server side alone: serve until `--connections` connections have
/// closed (each orderly close counts; any other end is a failed
/// connection), or until `--duration` + `--drain` + [`LISTEN_SLACK`].
fn serve<D: SoakDriver, A: Attach<D>>(
    args: &SoakArgs,
    lay: &Layout,
    addr: &str,
    make: impl Fn(Side) -> Result<D, String>,
    attacher: impl Fn(u64, u64) -> A,
) -> Result<Outcome, String> {
    let at = crate::bench::resolve_addr(addr)?;
    let listener = TcpListener::bind(at).map_err(|e| format!("binding --listen {at}: {e}"))?;
    let drivers = (0..lay.server_cpus.len())
        .map(|_| make(Side::Server))
        .collect::<Result<Vec<_>, _>>()?;
    let closed = Arc::new(AtomicU64::new(0));
    let (servers, acceptor) = start_servers(args, lay, listener, drivers, &attacher, |s| {
        s.count_closes(Arc::clone(&closed))
    })?;
    eprintln!(
        "starwire soak: serving {} connections on {}",
        args.connections,
        acceptor.local_addr()
    );
    let give_up =
        Instant::now() + LISTEN_SLACK + Duration::from_secs_f64(args.duration + args.drain);
    let want = args.connections as u64;
    while closed.load(Ordering::Relaxed) < want && Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(20));
    }
    let served = stop_servers(servers);
    drop(acceptor);
    let (mut counts, faults, driver) = served?;
    let ended = closed.load(Ordering::Relaxed);
    // Connections that never came or never ended are failures.
    counts.failed += want.saturating_sub(ended);
    Ok(Outcome {
        counts,
        round_trips: None,
        faults,
        driver,
    })
}

/// Counts the connections a server side saw end, across its reactors.
#[derive(Debug, Clone, Default)]
pub(super) struct Closes(Option<Arc<AtomicU64>>);

impl Closes {
    /// Whether this server counts (runs in a process of its own).
    pub(super) fn counting(&self) -> bool {
        self.0.is_some()
    }

    pub(super) fn note(&self) {
        if let Some(c) = &self.0 {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl SoakServer {
    /// Count every connection that ends in `closed`.
    fn count_closes(mut self, closed: Arc<AtomicU64>) -> Self {
        self.closes = Closes(Some(closed));
        self
    }
}

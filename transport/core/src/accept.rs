//! Accepting and dialing shard connections.
//!
//! A task serving several shards listens on one port; each shard is one
//! reactor. The [`Acceptor`] is one thread that waits in `poll(2)` on the
//! listener and on every accepted socket whose [preamble](crate::preamble)
//! has not arrived yet. It reads each preamble without blocking and
//! without taking a byte past it, closes a socket that sends something
//! else, says nothing within [`AcceptConfig::preamble_timeout`] or closes
//! first, and routes each good one to the reactor of its shard: the
//! stream goes into that reactor's ring of the M:N queue
//! ([`starwire_queue`], one producer: the acceptor) and the reactor's
//! [`ReactorWaker`] is woken. The reactor's
//! [`Endpoint`](crate::endpoint::Endpoint) attaches it on its next turn.
//! A slow or silent peer holds up only itself, and at most
//! [`AcceptConfig::max_pending`] sockets wait at once: past that the
//! oldest is closed to make room (a peer that dials properly writes its
//! preamble at once, so the oldest is the likeliest to be stuck).
//!
//! [`dial`] is the other end: connect, write the preamble, and retry with
//! backoff ([`retry`](crate::retry)) until a deadline while the name does
//! not resolve or nobody listens yet (a PS task may start after its
//! workers).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use starwire_queue::{Consumer, Producer};
use thiserror::Error;

use crate::preamble::{Preamble, PreambleReader};
use crate::reactor::ReactorWaker;
use crate::retry::{Backoff, Retry};

/// Slots of each reactor's ring of routed streams. A full ring keeps the
/// stream at the acceptor (counted as pending) until the reactor drains it.
pub const INBOX_CAPACITY: usize = 64;

/// How long a stream the acceptor holds back, because its reactor's ring
/// was full, waits before the next try.
const RETRY_FULL: Duration = Duration::from_millis(1);

/// Connections accepted per wake-up of the listener, so that a flood of
/// connects cannot starve the preambles already waiting.
const ACCEPT_BURST: usize = 64;

/// A stream whose preamble named a shard, on its way to the reactor that
/// serves the shard. In blocking mode, as a dialer's stream is; the
/// driver that attaches it sets what it needs.
#[derive(Debug)]
pub struct Routed {
    /// The connected socket, positioned after the preamble.
    pub stream: TcpStream,
    /// Who dialed.
    pub peer: SocketAddr,
    /// The shard its preamble named.
    pub shard: u32,
    /// Its place among the task's [`AcceptConfig::max_connections`]:
    /// held for as long as the connection lives (the endpoint keeps it).
    pub permit: ConnPermit,
}

/// One of a task's open connections, counted against
/// [`AcceptConfig::max_connections`] from accept until it is dropped.
#[derive(Debug)]
pub struct ConnPermit(Arc<AtomicUsize>);

impl ConnPermit {
    /// A permit of `open`, counted at once.
    fn new(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self(open.clone())
    }
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Limits of an [`Acceptor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptConfig {
    /// How long an accepted socket may take to send its preamble.
    pub preamble_timeout: Duration,
    /// Most sockets held at once before their reactor has them (waiting
    /// for their preamble, or for room in their reactor's ring).
    pub max_pending: usize,
    /// Most connections open at once, from accept until their reactor
    /// ends them (`--max-connections`): past it a new one is closed at
    /// once.
    pub max_connections: usize,
}

/// The default of [`AcceptConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

impl Default for AcceptConfig {
    /// A 10 s preamble timeout, 1024 pending sockets, 1024 connections.
    fn default() -> Self {
        Self {
            preamble_timeout: Duration::from_secs(10),
            max_pending: 1024,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// An acceptor that could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AcceptError {
    /// No reactor to route to.
    #[error("an acceptor needs at least one reactor")]
    NoReactors,
    /// The wakers do not match the rings, one per reactor.
    #[error("{wakers} reactor wakers for {reactors} reactors")]
    Wakers {
        /// Wakers given.
        wakers: usize,
        /// Reactors (rings) of the queue.
        reactors: usize,
    },
    /// The listener could not be set up.
    #[error("listener: {0}")]
    Listener(#[source] io::Error),
    /// The eventfd that stops the acceptor could not be made.
    #[error("eventfd: {0}")]
    EventFd(#[source] nix::Error),
    /// The thread could not be spawned.
    #[error("spawning the accept thread: {0}")]
    Spawn(#[source] io::Error),
}

/// The M:N queue from the acceptor to `reactors` reactors: the acceptor's
/// [`Producer`] and, at position `i`, the [`Consumer`] that reactor `i`
/// (shard `i`) drains ([`Endpoint::with_inbox`]).
///
/// The reactors park on their eventfds, not on the queue, and the
/// acceptor wakes them through their [`ReactorWaker`]s, so the queue's own
/// wake-up check is left out ([`starwire_queue::grid_polling`]).
///
/// [`Endpoint::with_inbox`]: crate::endpoint::Endpoint::with_inbox
pub fn inboxes(reactors: usize) -> Result<(Producer<Routed>, Vec<Consumer<Routed>>), AcceptError> {
    if reactors == 0 {
        return Err(AcceptError::NoReactors);
    }
    let (mut tx, rx) = starwire_queue::grid_polling(1, reactors, INBOX_CAPACITY);
    Ok((tx.pop().ok_or(AcceptError::NoReactors)?, rx))
}

/// What an acceptor did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AcceptStats {
    /// Sockets accepted.
    pub accepted: u64,
    /// Streams handed to their reactor's ring.
    pub routed: u64,
    /// Closed: no preamble within the timeout.
    pub timed_out: u64,
    /// Closed: bytes that are not a preamble.
    pub bad_preamble: u64,
    /// Closed: a preamble naming a shard no reactor serves.
    pub unknown_shard: u64,
    /// Closed: the peer closed (or the socket failed) before its preamble.
    pub lost: u64,
    /// Closed to keep within [`AcceptConfig::max_pending`].
    pub evicted: u64,
    /// Closed at once: [`AcceptConfig::max_connections`] were open.
    pub refused: u64,
}

#[derive(Debug, Default)]
struct Counters {
    refused: AtomicU64,
    accepted: AtomicU64,
    routed: AtomicU64,
    timed_out: AtomicU64,
    bad_preamble: AtomicU64,
    unknown_shard: AtomicU64,
    lost: AtomicU64,
    evicted: AtomicU64,
}

impl Counters {
    fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> AcceptStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        AcceptStats {
            accepted: get(&self.accepted),
            routed: get(&self.routed),
            timed_out: get(&self.timed_out),
            bad_preamble: get(&self.bad_preamble),
            unknown_shard: get(&self.unknown_shard),
            lost: get(&self.lost),
            evicted: get(&self.evicted),
            refused: get(&self.refused),
        }
    }
}

/// The accept thread of one listening task. See the module
/// documentation. Dropping it stops the thread and closes the sockets it
/// still holds.
#[derive(Debug)]
pub struct Acceptor {
    stop: Arc<EventFd>,
    counters: Arc<Counters>,
    join: Option<JoinHandle<()>>,
    addr: SocketAddr,
}

impl Acceptor {
    /// Accept on `listener` until dropped, routing each stream by its
    /// preamble's shard `s` to ring `s` of `tx` (see [`inboxes`]) and
    /// waking `wakers[s]`.
    pub fn spawn(
        listener: TcpListener,
        tx: Producer<Routed>,
        wakers: Vec<ReactorWaker>,
        cfg: AcceptConfig,
    ) -> Result<Self, AcceptError> {
        if wakers.len() != tx.consumers() {
            return Err(AcceptError::Wakers {
                wakers: wakers.len(),
                reactors: tx.consumers(),
            });
        }
        let addr = listener.local_addr().map_err(AcceptError::Listener)?;
        listener
            .set_nonblocking(true)
            .map_err(AcceptError::Listener)?;
        let stop = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(AcceptError::EventFd)?;
        let stop = Arc::new(stop);
        let counters = Arc::new(Counters::default());
        let mut state = AcceptLoop {
            listener,
            stop: stop.clone(),
            tx,
            wakers,
            cfg,
            counters: counters.clone(),
            pending: VecDeque::new(),
            held: Vec::new(),
            open: Arc::new(AtomicUsize::new(0)),
        };
        let join = std::thread::Builder::new()
            .name("starwire-accept".into())
            .spawn(move || state.run())
            .map_err(AcceptError::Spawn)?;
        Ok(Self {
            stop,
            counters,
            join: Some(join),
            addr,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it did so far.
    pub fn stats(&self) -> AcceptStats {
        self.counters.snapshot()
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // An eventfd write fails only when its counter would overflow,
        // which leaves it readable: the thread sees the stop either way.
        let _ = self.stop.write(1);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// An accepted socket waiting for its preamble.
#[derive(Debug)]
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    reader: PreambleReader,
    permit: ConnPermit,
}

/// What reading from a pending socket found.
enum Progress {
    /// The preamble is not complete yet.
    Wait,
    /// It named this shard.
    Shard(u32),
    /// The socket is closed for the reason logged.
    Closed,
}

/// The accept thread's state.
struct AcceptLoop {
    listener: TcpListener,
    stop: Arc<EventFd>,
    tx: Producer<Routed>,
    wakers: Vec<ReactorWaker>,
    cfg: AcceptConfig,
    counters: Arc<Counters>,
    /// Oldest first: every deadline is its accept time plus the same
    /// timeout, so the front expires first.
    pending: VecDeque<Pending>,
    /// Streams whose reactor's ring was full, in arrival order.
    held: Vec<Routed>,
    /// Connections open: pending, held, and with their reactors.
    open: Arc<AtomicUsize>,
}

impl AcceptLoop {
    fn run(&mut self) {
        loop {
            let now = Instant::now();
            self.expire(now);
            self.deliver_held();
            let Some((stop, listener, ready)) = self.wait(now) else {
                continue;
            };
            if stop {
                return;
            }
            for i in (0..ready.len()).rev() {
                if !ready[i] {
                    continue;
                }
                match self.read_preamble(i) {
                    Progress::Wait => {}
                    Progress::Shard(shard) => {
                        if let Some(p) = self.pending.remove(i) {
                            self.route(p, shard);
                        }
                    }
                    Progress::Closed => {
                        self.pending.remove(i);
                    }
                }
            }
            if listener {
                self.accept(Instant::now());
            }
        }
    }

    /// Close the sockets whose preamble is overdue at `now`.
    fn expire(&mut self, now: Instant) {
        while self.pending.front().is_some_and(|p| p.deadline <= now) {
            if let Some(p) = self.pending.pop_front() {
                tracing::debug!(
                    peer = %p.peer,
                    got = p.reader.received(),
                    "closing a connection: no preamble within {:?}",
                    self.cfg.preamble_timeout
                );
                Counters::add(&self.counters.timed_out);
            }
        }
    }

    /// Retry the streams held back by a full ring, each reactor's in
    /// order, and wake the reactors they are for (a full ring is drained
    /// on its reactor's next turn).
    fn deliver_held(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let mut full = vec![false; self.wakers.len()];
        let mut woken = vec![false; self.wakers.len()];
        for r in std::mem::take(&mut self.held) {
            let shard = r.shard as usize;
            woken[shard] = true;
            if full[shard] {
                self.held.push(r);
                continue;
            }
            match self.tx.push_to(shard, r) {
                Ok(()) => Counters::add(&self.counters.routed),
                Err(back) => {
                    full[shard] = true;
                    self.held.push(back);
                }
            }
        }
        for (waker, _) in self.wakers.iter().zip(woken).filter(|(_, w)| *w) {
            waker.wake();
        }
    }

    /// Wait for the stop eventfd, the listener or a pending socket, until
    /// the next preamble deadline. Returns whether the stop and the
    /// listener fired, and which pending sockets are readable; `None` when
    /// the wait failed (interrupted).
    fn wait(&self, now: Instant) -> Option<(bool, bool, Vec<bool>)> {
        let mut fds = Vec::with_capacity(2 + self.pending.len());
        fds.push(PollFd::new(self.stop.as_fd(), PollFlags::POLLIN));
        fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
        for p in &self.pending {
            fds.push(PollFd::new(p.stream.as_fd(), PollFlags::POLLIN));
        }
        let mut timeout = self
            .pending
            .front()
            .map(|p| p.deadline.saturating_duration_since(now));
        if !self.held.is_empty() {
            timeout = Some(timeout.map_or(RETRY_FULL, |t| t.min(RETRY_FULL)));
        }
        // Round up, so a wait for a deadline does not end just before it.
        let timeout = match timeout {
            None => PollTimeout::NONE,
            Some(t) => {
                let ms = t.as_micros().div_ceil(1000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
        };
        if let Err(e) = nix::poll::poll(&mut fds, timeout) {
            if e != nix::errno::Errno::EINTR {
                tracing::warn!("acceptor poll: {e}");
                std::thread::sleep(RETRY_FULL);
            }
            return None;
        }
        let fired = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let ready = fds[2..].iter().map(fired).collect();
        Some((fired(&fds[0]), fired(&fds[1]), ready))
    }

    /// Read what pending socket `i` has of its preamble (never more).
    fn read_preamble(&mut self, i: usize) -> Progress {
        let p = &mut self.pending[i];
        let mut buf = [0u8; Preamble::LEN];
        let want = p.reader.remaining();
        let n = match (&p.stream).read(&mut buf[..want]) {
            Ok(0) => {
                tracing::debug!(peer = %p.peer, "connection closed before its preamble");
                Counters::add(&self.counters.lost);
                return Progress::Closed;
            }
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                return Progress::Wait;
            }
            Err(e) => {
                tracing::debug!(peer = %p.peer, "connection failed before its preamble: {e}");
                Counters::add(&self.counters.lost);
                return Progress::Closed;
            }
        };
        match p.reader.handle_bytes(&buf[..n]) {
            Ok((_, None)) => Progress::Wait,
            Ok((_, Some(pre))) => Progress::Shard(pre.shard),
            Err(e) => {
                tracing::warn!(peer = %p.peer, "rejected connection: {e}");
                Counters::add(&self.counters.bad_preamble);
                Progress::Closed
            }
        }
    }

    /// Hand `p` to the reactor of `shard`, or hold it while that
    /// reactor's ring is full.
    fn route(&mut self, p: Pending, shard: u32) {
        let Some(waker) = self.wakers.get(shard as usize) else {
            tracing::warn!(
                peer = %p.peer,
                shard,
                "rejected connection for shard {shard}: {} shards here",
                self.wakers.len()
            );
            Counters::add(&self.counters.unknown_shard);
            return;
        };
        if let Err(e) = p.stream.set_nonblocking(false) {
            tracing::warn!(peer = %p.peer, "setting up a connection: {e}");
            Counters::add(&self.counters.lost);
            return;
        }
        let r = Routed {
            stream: p.stream,
            peer: p.peer,
            shard,
            permit: p.permit,
        };
        // Behind streams already held for a full ring, so each reactor
        // gets its streams in the order their preambles completed.
        if self.held.iter().any(|h| h.shard == shard) {
            self.held.push(r);
            return;
        }
        match self.tx.push_to(shard as usize, r) {
            Ok(()) => {
                waker.wake();
                Counters::add(&self.counters.routed);
            }
            Err(back) => {
                waker.wake();
                self.held.push(back);
            }
        }
    }

    /// Accept what the listener has (up to [`ACCEPT_BURST`]), making room
    /// within [`AcceptConfig::max_pending`].
    fn accept(&mut self, now: Instant) {
        for _ in 0..ACCEPT_BURST {
            let (stream, peer) = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    // Out of descriptors, say: the listener stays readable,
                    // so back off rather than spin.
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(RETRY_FULL);
                    return;
                }
            };
            Counters::add(&self.counters.accepted);
            if self.open.load(Ordering::Relaxed) >= self.cfg.max_connections {
                tracing::warn!(
                    %peer,
                    "refused connection: {} connections are open (--max-connections)",
                    self.cfg.max_connections
                );
                Counters::add(&self.counters.refused);
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!(%peer, "setting up a connection: {e}");
                Counters::add(&self.counters.lost);
                continue;
            }
            if !self.make_room(peer) {
                continue;
            }
            self.pending.push_back(Pending {
                stream,
                peer,
                deadline: now + self.cfg.preamble_timeout,
                reader: PreambleReader::new(),
                permit: ConnPermit::new(&self.open),
            });
        }
    }

    /// Keep within [`AcceptConfig::max_pending`] for one more socket, from
    /// `peer`: close the oldest waiting for its preamble. False when none
    /// waits (every socket held waits for a full ring): `peer`'s is
    /// refused.
    fn make_room(&mut self, peer: SocketAddr) -> bool {
        let cap = self.cfg.max_pending.max(1);
        while self.pending.len() + self.held.len() >= cap {
            let Some(old) = self.pending.pop_front() else {
                tracing::warn!(
                    %peer,
                    "refused connection: {} connections wait for their reactors",
                    self.held.len()
                );
                Counters::add(&self.counters.evicted);
                return false;
            };
            tracing::warn!(
                peer = %old.peer,
                "closing a connection without its preamble: {cap} connections are pending"
            );
            Counters::add(&self.counters.evicted);
        }
        true
    }
}

/// A connection [`dial`] could not make, or an address [`resolve`] could
/// not look up.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DialError {
    /// The address did not resolve before the deadline; the last lookup's
    /// error.
    #[error("resolving {addr}: {source} ({attempts} attempt(s))")]
    Resolve {
        /// The address.
        addr: String,
        /// Lookups made.
        attempts: u32,
        /// Why the last one failed.
        #[source]
        source: io::Error,
    },
    /// No address accepted before the deadline; the last attempt's error.
    #[error("connecting to {addr}: {source} ({attempts} attempt(s))")]
    Connect {
        /// The address.
        addr: String,
        /// Rounds of connection attempts made.
        attempts: u32,
        /// Why the last one failed.
        #[source]
        source: io::Error,
    },
    /// The preamble could not be written.
    #[error("writing the preamble to {addr}: {source}")]
    Preamble {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Longest single connect attempt of [`dial`].
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why one attempt of [`dial`] or [`resolve`] failed.
enum Failed {
    /// The lookup failed or found nothing.
    Resolve(io::Error),
    /// No address accepted the connection.
    Connect(io::Error),
}

impl Failed {
    fn into_error(self, addr: &str, attempts: u32) -> DialError {
        let addr = addr.to_owned();
        match self {
            Failed::Resolve(source) => DialError::Resolve {
                addr,
                attempts,
                source,
            },
            Failed::Connect(source) => DialError::Connect {
                addr,
                attempts,
                source,
            },
        }
    }
}

fn lookup(addr: &str) -> Result<Vec<SocketAddr>, Failed> {
    let found: Vec<SocketAddr> = addr.to_socket_addrs().map_err(Failed::Resolve)?.collect();
    if found.is_empty() {
        return Err(Failed::Resolve(io::Error::new(
            io::ErrorKind::NotFound,
            "no address",
        )));
    }
    Ok(found)
}

/// Run `attempt` until it succeeds, a retry of [`Backoff::CONNECT`] gives
/// up at `deadline`, or it fails for good (`Ok(Err(..))`). Each failure
/// that will be retried is a warning naming `addr`, the attempt and the
/// pause.
fn retrying<T>(
    addr: &str,
    deadline: Instant,
    mut attempt: impl FnMut() -> Result<Result<T, DialError>, Failed>,
) -> Result<T, DialError> {
    let mut retry = Retry::new(Backoff::CONNECT, deadline);
    loop {
        let failed = match attempt() {
            Ok(done) => return done,
            Err(failed) => failed,
        };
        let Some(wait) = retry.handle_failure(Instant::now()) else {
            return Err(failed.into_error(addr, retry.failures()));
        };
        let (step, source) = match &failed {
            Failed::Resolve(e) => ("resolving", e),
            Failed::Connect(e) => ("connecting to", e),
        };
        tracing::warn!(
            addr,
            attempt = retry.failures(),
            "{step} {addr}: {source}; attempt {} failed, retrying in {} ms",
            retry.failures(),
            wait.as_millis()
        );
        std::thread::sleep(wait);
    }
}

/// Look `addr` (`host:port`) up, retrying with backoff while the name does
/// not resolve, until `deadline`. Each retry is logged as a warning.
pub fn resolve(addr: &str, deadline: Instant) -> Result<Vec<SocketAddr>, DialError> {
    retrying(addr, deadline, || lookup(addr).map(Ok))
}

/// Connect to shard `shard` of the task listening at `addr` and write the
/// preamble. While the name does not resolve or no address accepts, it
/// retries with backoff ([`Backoff::CONNECT`]), looking the name up again
/// each time, until `deadline`; each retry is logged as a warning. The
/// stream is blocking, with `TCP_NODELAY`.
pub fn dial(addr: &str, shard: u32, deadline: Instant) -> Result<TcpStream, DialError> {
    retrying(addr, deadline, || {
        let mut last = None;
        for a in lookup(addr)? {
            match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
                Ok(mut s) => {
                    let sent = s
                        .write_all(&Preamble { shard }.emit())
                        .and_then(|()| s.set_nodelay(true))
                        .map(|()| s)
                        .map_err(|source| DialError::Preamble {
                            addr: addr.to_owned(),
                            source,
                        });
                    return Ok(sent);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(Failed::Connect(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "no address")
        })))
    })
}

//! The PS side's I/O: one reactor per shard. Each reactor owns its shard's
//! protocol state (a [`PsServer`] over a [`PsHandler`]) and the connections
//! of every worker to that shard, and serves pull, push and control
//! requests run-to-completion on its core: decoding, the embedding lookup
//! or optimizer update, and encoding the reply all happen inside the
//! reactor's turn, with no lock and no hand-off. What to do with each
//! request is the sans-IO [`PsServer`]'s; this module accepts connections,
//! drives their sessions with the reactor's `now`, and parks.

use std::net::TcpStream;
use std::os::fd::BorrowedFd;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use starwire_transport::reactor::{park_in_shared_driver, ParkEnd, ParkWaker, Shard};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{ConnConfig, ConnError, DrivenTransport, Session, Transport, TurnStats};

use crate::link::Binder;
use crate::psserver::{PsHandler, PsServer};

/// One shard reactor's state. See the module documentation.
#[derive(Debug)]
pub struct PsReactor<H, B: Binder> {
    index: usize,
    server: PsServer<H>,
    conn_cfg: ConnConfig,
    binder: Option<B>,
    inbox: Receiver<TcpStream>,
    /// Connections by key (the slot index the server knows them by).
    sessions: Vec<Option<Session<B::Link>>>,
    /// Connections that ended (closed by the worker or broken).
    pub closed_connections: u64,
}

impl<H: PsHandler, B: Binder> PsReactor<H, B> {
    /// A shard reactor that finishes once `expected_workers` workers have
    /// sent `DONE` (0: never). `binder` makes transports of the sockets the
    /// acceptor sends to `inbox`; without one (the backend failed to start
    /// on this thread) the reactor finishes at once.
    pub fn new(
        index: usize,
        handler: H,
        conn_cfg: ConnConfig,
        binder: Option<B>,
        inbox: Receiver<TcpStream>,
        expected_workers: usize,
    ) -> Self {
        Self {
            index,
            server: PsServer::new(handler, expected_workers),
            conn_cfg,
            binder,
            inbox,
            sessions: Vec::new(),
            closed_connections: 0,
        }
    }

    /// The shard state, e.g. to read counters after the run.
    pub fn handler(&self) -> &H {
        self.server.handler()
    }

    /// The shard's protocol state.
    pub fn server(&self) -> &PsServer<H> {
        &self.server
    }

    /// The shard index.
    pub fn index(&self) -> usize {
        self.index
    }

    fn accept(&mut self) -> bool {
        let mut any = false;
        while let Ok(stream) = self.inbox.try_recv() {
            let Some(binder) = self.binder.as_mut() else {
                continue;
            };
            let t = match binder.bind(stream) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(shard = self.index, "binding a connection: {e}");
                    continue;
                }
            };
            let s = Session::new(self.conn_cfg.clone(), t);
            let key = match self.sessions.iter().position(Option::is_none) {
                Some(i) => {
                    self.sessions[i] = Some(s);
                    i
                }
                None => {
                    self.sessions.push(Some(s));
                    self.sessions.len() - 1
                }
            };
            self.server.handle_open(key);
            any = true;
        }
        any
    }
}

/// One turn of connection `key`'s session at `now`: its requests go
/// through `server`, whose replies are written and flushed. An error ends
/// the connection: the caller tells `server` ([`PsServer::handle_close`])
/// and drops the session.
pub fn turn_session<H: PsHandler, T: Transport>(
    server: &mut PsServer<H>,
    key: usize,
    s: &mut Session<T>,
    now: Instant,
) -> Result<TurnStats, ConnError> {
    let mut ended = None;
    let r = s.turn(now, &mut |conn, m| {
        if let Err(e) = server.handle_message(key, conn, m) {
            ended.get_or_insert(e);
        }
    });
    match (r, ended) {
        (Ok(_), Some(e)) => Err(ConnError::Protocol(e.reason())),
        (r, _) => r,
    }
}

/// Queue the replies of the barriers `server` releases on their sessions
/// (`sessions[key]`); they leave on the sessions' next turn. Returns
/// whether there was any.
pub fn send_released<H: PsHandler, T: Transport>(
    server: &mut PsServer<H>,
    sessions: &mut [Option<Session<T>>],
) -> bool {
    let mut any = false;
    while let Some(r) = server.poll_release() {
        if let Some(Some(s)) = sessions.get_mut(r.conn) {
            // A full queue or closed connection fails the worker's
            // barrier through its own connection error.
            let _ = s.conn().respond(r.id, Opcode::Rpc, Status::Ok, r.body());
        }
        any = true;
    }
    any
}

impl<H: PsHandler, B: Binder> Shard for PsReactor<H, B> {
    fn turn(&mut self, now: Instant) -> bool {
        let mut busy = self.accept();
        for (key, slot) in self.sessions.iter_mut().enumerate() {
            let Some(s) = slot else { continue };
            match turn_session(&mut self.server, key, s, now) {
                Ok(st) => busy |= st.busy(),
                Err(e) => {
                    // The worker left or broke the protocol: this
                    // connection ends, the shard serves the others.
                    if !matches!(e, ConnError::Closed) {
                        tracing::debug!(shard = self.index, key, "connection ended: {e}");
                    }
                    self.closed_connections += 1;
                    self.server.handle_close(key, s.conn_ref());
                    *slot = None;
                    busy = true;
                }
            }
        }
        if let Some(s) = self.sessions.iter().flatten().next() {
            busy |= s.transport().end_turn();
        }
        busy | send_released(&mut self.server, &mut self.sessions)
    }

    fn wake_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        for s in self.sessions.iter().flatten() {
            out.push(s.transport().wake_fd());
        }
    }

    fn write_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        out.extend(
            self.sessions
                .iter()
                .flatten()
                .filter_map(|s| s.transport().write_fd()),
        );
    }

    /// Parks in the connections' ring when they share one (uring).
    fn park(&self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        let live = self.sessions.iter().flatten();
        park_in_shared_driver(live.map(|s| s.transport()), waker, timeout)
    }

    fn finished(&self) -> bool {
        if self.binder.is_none() {
            return true;
        }
        self.server.finished()
            && self
                .sessions
                .iter()
                .flatten()
                .all(|s| !s.conn_ref().wants_transmit() && !s.transport().tx_pending())
    }
}

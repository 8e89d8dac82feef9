//! The PS side's I/O: one reactor per shard. Each reactor owns its shard's
//! protocol state (a [`PsServer`] over a [`PsHandler`]) and one driver with
//! the connections of every worker to that shard, and serves pull, push
//! and control requests run-to-completion on its core: decoding, the
//! embedding lookup or optimizer update, and encoding the reply all happen
//! inside the reactor's turn, with no lock and no hand-off. What to do with
//! each request is the sans-IO [`PsServer`]'s; this module accepts
//! connections, turns their sessions with the reactor's `now`, and parks
//! the way the driver says.

use std::net::TcpStream;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use starwire_transport::reactor::{park_driver, park_fds, ParkWaker, Parked, ReactorState};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{ConnConfig, ConnError, ConnId, Driver, Sessions, StreamDriver};

use crate::psserver::{PsHandler, PsServer, ServeError};

/// One shard reactor's state. See the module documentation.
#[derive(Debug)]
pub struct PsReactor<H, D> {
    index: usize,
    server: PsServer<H>,
    conn_cfg: ConnConfig,
    /// Every connection of the shard, on the reactor's driver; `None` when
    /// the backend failed to start on this thread (the reactor then
    /// finishes at once). The server knows a connection by its
    /// [`ConnId::index`].
    sessions: Option<Sessions<D>>,
    inbox: Receiver<TcpStream>,
    /// Connections that ended (closed by the worker or broken).
    pub closed_connections: u64,
}

impl<H: PsHandler, D: StreamDriver> PsReactor<H, D> {
    /// A shard reactor that finishes once `expected_workers` workers have
    /// sent `DONE` (0: never). The sockets the acceptor sends to `inbox`
    /// are attached to `driver`; without one (the backend failed to start
    /// on this thread) the reactor finishes at once.
    pub fn new(
        index: usize,
        handler: H,
        conn_cfg: ConnConfig,
        driver: Option<D>,
        inbox: Receiver<TcpStream>,
        expected_workers: usize,
    ) -> Self {
        Self {
            index,
            server: PsServer::new(handler, expected_workers),
            conn_cfg,
            sessions: driver.map(Sessions::new),
            inbox,
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
            let Some(sessions) = self.sessions.as_mut() else {
                continue;
            };
            let id = match sessions.driver_mut().attach_stream(stream) {
                Ok(id) => id,
                Err(e) => {
                    tracing::warn!(shard = self.index, "attaching a connection: {e}");
                    continue;
                }
            };
            sessions.insert(id, self.conn_cfg.clone());
            self.server.handle_open(id.index());
            any = true;
        }
        any
    }
}

/// What one [`turn`] of a shard's connections did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardTurn {
    /// Anything moved: frames in or out, a connection ended, a barrier
    /// released.
    pub busy: bool,
    /// Connections that ended (the worker left, or broke the protocol).
    pub closed: u64,
}

/// One turn of every connection of `sessions` at `now`: requests go
/// through `server`, whose replies are written and submitted. A connection
/// that failed, or whose worker broke the protocol, ends (removed from
/// `sessions`, `server` told); the others are served on. Then the replies
/// of the barriers `server` releases are queued; they leave on the next
/// turn.
pub fn turn<H: PsHandler, D: Driver>(
    server: &mut PsServer<H>,
    sessions: &mut Sessions<D>,
    now: Instant,
) -> ShardTurn {
    let mut broken: Vec<(ConnId, ServeError)> = Vec::new();
    let st = sessions.turn(now, &mut |id, conn, m| {
        // A connection that broke the protocol is not served further.
        if broken.iter().any(|(b, _)| *b == id) {
            return;
        }
        if let Err(e) = server.handle_message(id.index(), conn, m) {
            broken.push((id, e));
        }
    });
    let mut t = ShardTurn {
        busy: st.busy(),
        closed: 0,
    };
    for (id, e) in broken {
        tracing::debug!(key = id.index(), "connection ended: {}", e.reason());
        if let Some(conn) = sessions.remove(id) {
            server.handle_close(id.index(), &conn);
            t.closed += 1;
        }
    }
    while let Some((id, conn, e)) = sessions.poll_failed() {
        // The worker left (or its connection broke): this connection ends,
        // the shard serves the others.
        if !matches!(e, ConnError::Closed) {
            tracing::debug!(key = id.index(), "connection ended: {e}");
        }
        server.handle_close(id.index(), &conn);
        t.closed += 1;
    }
    while let Some(r) = server.poll_release() {
        if let Some(conn) = u32::try_from(r.conn)
            .ok()
            .and_then(|i| sessions.conn(ConnId::new(i)))
        {
            // A full queue or closed connection fails the worker's
            // barrier through its own connection error.
            let _ = conn.respond(r.id, Opcode::Rpc, Status::Ok, r.body());
        }
        t.busy = true;
    }
    t.busy |= t.closed > 0;
    t
}

impl<H: PsHandler, D: StreamDriver + Send> ReactorState for PsReactor<H, D> {
    fn turn(&mut self, now: Instant) -> bool {
        let accepted = self.accept();
        let Some(sessions) = self.sessions.as_mut() else {
            return accepted;
        };
        let t = turn(&mut self.server, sessions, now);
        self.closed_connections += t.closed;
        accepted | t.busy
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.sessions.as_ref().and_then(Sessions::poll_timeout)
    }

    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        match self.sessions.as_mut() {
            Some(s) => park_driver(s.driver_mut(), waker, timeout),
            None => Parked::Poll(park_fds(waker, &[], &[], timeout)),
        }
    }

    fn finished(&self) -> bool {
        let Some(s) = self.sessions.as_ref() else {
            return true;
        };
        self.server.finished()
            && s.ids().all(|id| {
                !s.conn_ref(id).is_some_and(|c| c.wants_transmit()) && !s.driver().tx_pending(id)
            })
    }
}

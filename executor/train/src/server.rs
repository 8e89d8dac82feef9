//! The PS side's I/O: one reactor per shard, each an
//! [`Endpoint`](starwire_transport::Endpoint) whose [`ShardService`] owns
//! the shard's protocol state (a [`PsServer`] over a [`PsHandler`]). Pull,
//! push and control requests are served run-to-completion on the shard's
//! core: decoding, the embedding lookup or optimizer update, and encoding
//! the reply all happen inside the reactor's turn, with no lock and no
//! hand-off. What to do with each request is the sans-IO [`PsServer`]'s;
//! accepting, turning the sessions and parking are the endpoint's.

use std::time::Instant;

use starwire_transport::endpoint::LINGER;
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{ConnError, ConnId, Connection, Driver, Incoming, Service, Sessions};

use crate::psserver::{PsHandler, PsServer};

/// One shard's logic over the connections of every worker. See the
/// module documentation. The server knows a connection by its
/// [`ConnId::index`].
#[derive(Debug)]
pub struct ShardService<H> {
    index: usize,
    server: PsServer<H>,
    closed_connections: u64,
    /// Connections attached and not yet ended.
    open: usize,
    /// When every expected worker was done: the shard then waits (at most
    /// [`LINGER`]) for them to hang up, so a worker still waiting on
    /// another shard's reply never sees this one close under it.
    done_at: Option<Instant>,
    /// The wait for the workers to hang up ran out.
    gave_up_waiting: bool,
}

impl<H: PsHandler> ShardService<H> {
    /// Shard `index` over `handler`, finished once `expected_workers`
    /// workers have sent `DONE` (0: never).
    pub fn new(index: usize, handler: H, expected_workers: usize) -> Self {
        Self {
            index,
            server: PsServer::new(handler, expected_workers),
            closed_connections: 0,
            open: 0,
            done_at: None,
            gave_up_waiting: false,
        }
    }

    /// Answer a `WAIT_STEP` more than `n` steps ahead of the global step
    /// at once, with an error ([`PsServer::with_max_wait_steps`]).
    #[must_use]
    pub fn with_max_wait_steps(mut self, n: u64) -> Self {
        self.server = self.server.with_max_wait_steps(n);
        self
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

    /// Connections that ended (closed by the worker, broken, or ended for
    /// breaking the protocol).
    pub fn closed_connections(&self) -> u64 {
        self.closed_connections
    }
}

impl<H: PsHandler, D: Driver> Service<D> for ShardService<H> {
    fn on_attach(&mut self, id: ConnId, _shard: u32, _now: Instant) {
        self.open += 1;
        self.server.handle_open(id.index());
    }

    /// A worker that broke the protocol loses its connection; the shard
    /// serves the others.
    fn on_message(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        self.server
            .handle_message(id.index(), conn, msg)
            .map_err(|e| ConnError::Protocol(e.reason()))
    }

    fn on_closed(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        error: &ConnError,
        _driver: &D,
        _now: Instant,
    ) {
        if !matches!(error, ConnError::Closed) {
            tracing::debug!(
                shard = self.index,
                key = id.index(),
                "connection ended: {error}"
            );
        }
        if let Some(w) = self.server.handle_close(id.index(), conn) {
            if self.server.exits_when_done() {
                tracing::warn!(
                    shard = self.index,
                    worker = w,
                    "worker {w}'s connection ended before it said DONE: its data is not all \
                     trained; the PS exits non-zero once the other workers are done, unless \
                     worker {w} rejoins and finishes first"
                );
            } else {
                tracing::warn!(
                    shard = self.index,
                    worker = w,
                    "worker {w}'s connection ended before it said DONE: waiting for it to \
                     rejoin; stopping the PS before it finishes exits non-zero"
                );
            }
        }
        self.closed_connections += 1;
        self.open = self.open.saturating_sub(1);
    }

    /// Answer the `WAIT_STEP` barriers the global step has reached.
    fn poll(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        if self.server.finished() {
            let since = *self.done_at.get_or_insert(now);
            if self.open > 0 && !self.gave_up_waiting && now >= since + LINGER {
                tracing::warn!(
                    shard = self.index,
                    open = self.open,
                    "every worker is done but {} connection(s) stayed open for {LINGER:?}",
                    self.open
                );
                self.gave_up_waiting = true;
            }
        }
        let mut any = false;
        while let Some(r) = self.server.poll_release() {
            if let Some(conn) = u32::try_from(r.conn)
                .ok()
                .and_then(|i| sessions.conn(ConnId::new(i)))
            {
                // A full queue or closed connection fails the worker's
                // barrier through its own connection error.
                let _ = conn.respond(r.id, Opcode::Rpc, Status::Ok, r.body());
            }
            any = true;
        }
        any
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.done_at
            .filter(|_| self.open > 0 && !self.gave_up_waiting)
            .map(|t| t + LINGER)
    }

    /// Every expected worker is done and has hung up (or stayed connected
    /// for [`LINGER`] after).
    fn finished(&self) -> bool {
        self.server.finished() && (self.open == 0 || self.gave_up_waiting)
    }
}

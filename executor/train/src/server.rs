//! The PS side's I/O: one reactor per shard, each an
//! [`Endpoint`](starwire_transport::Endpoint) whose [`ShardService`] owns
//! the shard's protocol state (a [`PsServer`] over a [`PsHandler`]). Pull,
//! push and control requests are served run-to-completion on the shard's
//! core: decoding, the embedding lookup or optimizer update, and encoding
//! the reply all happen inside the reactor's turn, with no lock and no
//! hand-off. What to do with each request is the sans-IO [`PsServer`]'s;
//! accepting, turning the sessions and parking are the endpoint's.

use std::time::{Duration, Instant};

use starwire_transport::endpoint::LINGER;
use starwire_transport::wire::Status;
use starwire_transport::{
    ConnError, ConnId, Connection, Driver, Incoming, MemoryBudget, Service, Sessions, TaskRole,
};

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
    /// With `--sync`: how long the barriers wait for a worker that died
    /// unfinished to rejoin before they fail naming it.
    dead_worker_wait: Option<Duration>,
    /// Workers that died unfinished and have not sent anything since, and
    /// when their connection ended.
    dead: Vec<(u32, Instant)>,
    /// Why every barrier now fails (a dead worker did not rejoin in time).
    broken: Option<String>,
    /// Room for the connections whose deferred replies a poll sends.
    flush_keys: Vec<usize>,
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
            dead_worker_wait: None,
            dead: Vec::new(),
            broken: None,
            flush_keys: Vec::new(),
        }
    }

    /// Answer a `WAIT_STEP` more than `n` steps ahead of the global step
    /// at once, with an error ([`PsServer::with_max_wait_steps`]).
    #[must_use]
    pub fn with_max_wait_steps(mut self, n: u64) -> Self {
        self.server = self.server.with_max_wait_steps(n);
        self
    }

    /// Charge the requests held behind barriers to the task's memory
    /// budget ([`PsServer::with_budget`]).
    #[must_use]
    pub fn with_budget(mut self, budget: MemoryBudget) -> Self {
        self.server = self.server.with_budget(budget);
        self
    }

    /// Synchronous SGD over `workers` workers (`--sync`,
    /// [`PsServer::with_sync`]). A step cannot complete without every
    /// worker: once a worker died unfinished and has not rejoined for
    /// `dead_worker_wait`, every barrier is answered with an error naming
    /// it, so the other workers fail instead of waiting for ever.
    #[must_use]
    pub fn with_sync(
        mut self,
        workers: usize,
        dead_worker_wait: Duration,
        budget: MemoryBudget,
    ) -> Self {
        self.server = self.server.with_sync(workers, budget);
        self.dead_worker_wait = Some(dead_worker_wait);
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

    /// Before a checkpoint of the stopped shard: see
    /// [`Service::rewind_kept`](crate::psserver::Service::rewind_kept).
    pub fn rewind_kept(&mut self) {
        self.server.rewind_kept();
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

impl<H: PsHandler> ShardService<H> {
    /// With `--sync`, once a dead worker has not rejoined in time: answer
    /// every barrier held (and every later one) with an error naming it.
    fn fail_barriers<D: Driver>(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        if self.broken.is_none() {
            let wait = self.dead_worker_wait.unwrap_or(Duration::MAX);
            let late = |d: &&(u32, Instant)| d.1.checked_add(wait).is_some_and(|t| now >= t);
            if let Some(&(w, _)) = self.dead.iter().find(late) {
                self.broken = Some(format!(
                    "worker {w} died unfinished and did not rejoin within {wait:?}: a \
                     synchronous step cannot complete without it"
                ));
                tracing::error!(
                    shard = self.index,
                    worker = w,
                    "{}",
                    self.broken.as_deref().unwrap_or("")
                );
            }
        }
        let Some(why) = &self.broken else {
            return false;
        };
        let held = self.server.take_barriers();
        for &(c, id, opcode) in &held {
            if let Some(conn) = u32::try_from(c)
                .ok()
                .and_then(|i| sessions.conn(ConnId::new(i)))
            {
                let _ = conn.respond_error(id, opcode, Status::Cancelled, why);
            }
        }
        !held.is_empty()
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
        if !self.dead.is_empty() {
            // A dead worker that sends again has rejoined.
            if let Some(p) = conn.peer().filter(|p| p.role == TaskRole::Worker) {
                self.dead.retain(|d| d.0 != p.task_index);
            }
        }
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
        now: Instant,
    ) {
        if !matches!(error, ConnError::Closed) {
            tracing::debug!(
                shard = self.index,
                key = id.index(),
                "connection ended: {error}"
            );
        }
        if let Some(w) = self.server.handle_close(id.index(), conn) {
            if let Some(wait) = self.dead_worker_wait {
                self.dead.retain(|d| d.0 != w);
                self.dead.push((w, now));
                tracing::warn!(
                    shard = self.index,
                    worker = w,
                    "worker {w}'s connection ended before it said DONE: the synchronous steps \
                     wait {wait:?} for it to rejoin, then fail"
                );
            } else if self.server.exits_when_done() {
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

    /// Answer the `WAIT_STEP` barriers the global step has reached, and
    /// serve what their connections sent behind them; send the push
    /// replies deferred with no barrier held behind them.
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
        let mut any = self.fail_barriers(sessions, now);
        while let Some(r) = self.server.poll_release() {
            let Some(id) = u32::try_from(r.conn).ok().map(ConnId::new) else {
                continue;
            };
            if let Some(conn) = sessions.conn(id) {
                // A reply that cannot be queued would leave the worker
                // waiting: its connection ends, as in `on_message`.
                if let Err(e) = self.server.handle_release(&r, conn) {
                    sessions.end(id, ConnError::Protocol(e.reason()));
                }
            }
            any = true;
        }
        // Push replies deferred in the last turn with no barrier behind
        // them (the worker sent no wait after its push, or it has not come
        // in yet) go now.
        let mut keys = std::mem::take(&mut self.flush_keys);
        self.server.take_deferred(&mut keys);
        for &k in &keys {
            let Some(id) = u32::try_from(k).ok().map(ConnId::new) else {
                continue;
            };
            if let Some(conn) = sessions.conn(id) {
                if let Err(e) = self.server.flush_deferred(k, conn) {
                    sessions.end(id, ConnError::Protocol(e.reason()));
                }
            }
            any = true;
        }
        keys.clear();
        self.flush_keys = keys;
        any
    }

    fn next_deadline(&self) -> Option<Instant> {
        let linger = self
            .done_at
            .filter(|_| self.open > 0 && !self.gave_up_waiting)
            .map(|t| t + LINGER);
        let dead = self
            .dead_worker_wait
            .and_then(|wait| self.dead.iter().filter_map(|d| d.1.checked_add(wait)).min());
        // A deferred reply is sent by the next turn's poll: no park.
        let deferred = self.server.has_deferred().then(Instant::now);
        linger.into_iter().chain(dead).chain(deferred).min()
    }

    /// Every expected worker is done and has hung up (or stayed connected
    /// for [`LINGER`] after).
    fn finished(&self) -> bool {
        self.server.finished() && (self.open == 0 || self.gave_up_waiting)
    }
}

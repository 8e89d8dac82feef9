//! The worker's side of the network: send a set of requests to PS shards
//! and wait for every reply. The worker thread turns its own
//! [`Endpoint`], one connection per shard on one driver
//! (run-to-completion, no hand-off to a network thread); between turns it
//! busy-polls or, with polling off, parks the way the driver says.
//!
//! [`WorkerService`] plugs the sans-IO [`PsClient`] into the endpoint:
//! which requests are pending, which reply is whose and when an exchange
//! has failed are the client's; [`SessionNet`] starts an exchange and
//! turns the endpoint until it is done.

use std::time::{Duration, Instant};

use starwire_transport::reactor::{local_waker, IdlePolicy, ReactorWaker};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{
    ConnError, ConnId, Connection, Driver, DriverCounters, Endpoint, Event, Incoming, Payload,
    Service, Sessions,
};

use crate::psclient::{PsClient, ShardConns};
use crate::TrainError;

/// Longest park between two looks at the connections (a park also ends
/// on input, writability or the next deadline).
const MAX_PARK: Duration = Duration::from_millis(50);

/// One request of an exchange.
#[derive(Debug)]
pub struct Request {
    /// Destination shard.
    pub shard: usize,
    /// What it is.
    pub opcode: Opcode,
    /// The body.
    pub body: Payload,
}

/// One reply, in the order of the requests.
#[derive(Debug, Default)]
pub struct Reply {
    /// The shard's verdict.
    pub status: Option<Status>,
    /// The reply body (reused across exchanges).
    pub body: Vec<u8>,
}

/// Bytes moved by a worker, both directions, message bodies only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Traffic {
    /// Request bodies sent.
    pub sent: u64,
    /// Reply bodies received.
    pub received: u64,
    /// Requests sent.
    pub requests: u64,
}

/// A way to exchange requests with every shard.
pub trait Exchange {
    /// Send every request, then wait for all replies; `replies[i]` answers
    /// `reqs[i]`. A non-`Ok` status is reported in the reply, not as an
    /// error; errors mean the link is gone.
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError>;
    /// Bytes and requests so far.
    fn traffic(&self) -> Traffic;
    /// The counters of the driver the calling thread turns, if it turns
    /// one (read a few times a second for the metrics).
    fn driver_counters(&self) -> Option<DriverCounters> {
        None
    }
    /// Whether a shard knows this worker's requests as its own, in order
    /// (one ordered connection per shard, the sender's task index known):
    /// then a shard that keeps the worker's pulls for its next push
    /// drops them on an empty pull. The gRPC baseline's calls carry no
    /// sender and no order, so its shards keep nothing to drop.
    fn sender_known(&self) -> bool {
        true
    }
}

/// A worker's [`PsClient`] over its connections, one per shard, as an
/// endpoint's [`Service`]. A connection attached for shard `s` (the
/// global shard index) is shard `s`'s.
#[derive(Debug)]
pub struct WorkerService {
    client: PsClient,
    /// `ids[s]`: shard `s`'s connection, once attached.
    ids: Vec<Option<ConnId>>,
    /// By [`ConnId::index`]: the connection's shard.
    shard_of: Vec<Option<usize>>,
    /// `lost[s]`: why shard `s`'s connection ended, once it has.
    lost: Vec<Option<String>>,
    /// What failed the exchange (or the connecting), first failure first.
    error: Option<TrainError>,
}

impl WorkerService {
    /// A client of `shards` shards whose connections are opened at `now`:
    /// every handshake must complete, and later every request be
    /// answered, within `timeout`.
    pub fn new(shards: usize, timeout: Duration, now: Instant) -> Self {
        Self::with_client(shards, PsClient::new(shards, timeout, now))
    }

    /// A client of `shards` shards that holds the connections of those
    /// of `mine` only ([`PsClient::for_shards`]).
    pub fn for_shards(
        shards: usize,
        mine: impl IntoIterator<Item = usize>,
        timeout: Duration,
        now: Instant,
    ) -> Self {
        Self::with_client(shards, PsClient::for_shards(shards, mine, timeout, now))
    }

    fn with_client(shards: usize, client: PsClient) -> Self {
        Self {
            client,
            ids: vec![None; shards],
            shard_of: Vec::new(),
            lost: vec![None; shards],
            error: None,
        }
    }

    /// The client core.
    pub fn client(&self) -> &PsClient {
        &self.client
    }

    /// Start an exchange at `now` on the connections of `sessions` (see
    /// [`PsClient::start`]).
    pub fn start<D: Driver>(
        &mut self,
        sessions: &mut Sessions<D>,
        reqs: Vec<Request>,
        replies: Vec<Reply>,
        now: Instant,
    ) -> Result<(), TrainError> {
        let mut conns = Conns {
            ids: &self.ids,
            sessions,
        };
        self.client
            .start(&mut conns, reqs, replies, now)
            .map_err(|e| match e {
                // A request to a shard whose connection ended: say why.
                TrainError::Link(s, _) if self.lost.get(s).is_some_and(Option::is_some) => {
                    TrainError::Link(s, self.lost[s].clone().unwrap_or_default())
                }
                e => e,
            })
    }

    /// True once the exchange is done or has failed.
    pub fn is_settled(&self) -> bool {
        self.error.is_some() || self.client.is_done()
    }

    /// True once connecting is done or has failed.
    pub fn is_connected_or_failed(&self) -> bool {
        self.error.is_some() || self.client.is_connected()
    }

    /// What failed the exchange, if anything; the next exchange starts
    /// afresh.
    pub fn take_error(&mut self) -> Option<TrainError> {
        self.error.take()
    }

    /// End the exchange (done or failed) and hand back the replies.
    pub fn finish(&mut self) -> Vec<Reply> {
        self.client.finish()
    }

    fn shard(&self, id: ConnId) -> Option<usize> {
        self.shard_of.get(id.index()).copied().flatten()
    }

    fn fail(&mut self, e: TrainError) {
        self.error.get_or_insert(e);
    }
}

/// The connections of one worker by shard, for [`PsClient::start`].
struct Conns<'a, D> {
    ids: &'a [Option<ConnId>],
    sessions: &'a mut Sessions<D>,
}

impl<D: Driver> ShardConns for Conns<'_, D> {
    fn conn(&mut self, shard: usize) -> Option<&mut Connection> {
        let id = (*self.ids.get(shard)?)?;
        self.sessions.conn(id)
    }
}

impl<D: Driver> Service<D> for WorkerService {
    fn on_attach(&mut self, id: ConnId, shard: u32, _now: Instant) {
        let s = shard as usize;
        if let Some(slot) = self.ids.get_mut(s) {
            *slot = Some(id);
        }
        if self.shard_of.len() <= id.index() {
            self.shard_of.resize(id.index() + 1, None);
        }
        self.shard_of[id.index()] = Some(s);
    }

    fn on_message(
        &mut self,
        id: ConnId,
        _conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        if let Some(s) = self.shard(id) {
            self.client.handle_message(s, msg);
        }
        Ok(())
    }

    fn on_event(&mut self, id: ConnId, _conn: &mut Connection, ev: Event, _now: Instant) {
        let s = self.shard(id).unwrap_or_default();
        if let Err(e) = self.client.handle_event(s, ev) {
            self.fail(e);
        }
    }

    fn on_closed(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        error: &ConnError,
        _driver: &D,
        _now: Instant,
    ) {
        let s = self.shard(id).unwrap_or_default();
        // A PS that refuses a peer's proof closes at once and tells it
        // nothing (an unauthenticated peer learns nothing of the cluster),
        // as does one at its connection limit: the close may even come
        // before the PS's hello. Say what the likely causes are.
        let error = match error {
            ConnError::Transport(_) | ConnError::Closed if !conn.is_established() => {
                format!(
                    "{error} during the handshake (a PS closes a peer whose cluster token \
                     differs from its own, or that has none: STARWIRE_CLUSTER_TOKEN or \
                     --token-file; and any peer past its --max-connections, which its log \
                     warns of)"
                )
            }
            e => e.to_string(),
        };
        // A connection that owes the exchange nothing fails the next
        // request to its shard, not this exchange (see
        // [`PsClient::handle_event`]).
        if !self.client.is_connected() || self.client.is_waiting_on(s) {
            self.fail(TrainError::Link(s, error.clone()));
        }
        if let Some(l) = self.lost.get_mut(s) {
            *l = Some(error);
        }
    }

    /// The client's own deadline (connecting).
    fn poll(&mut self, _sessions: &mut Sessions<D>, now: Instant) -> bool {
        if let Err(e) = self.client.handle_timeout(now) {
            self.fail(e);
        }
        false
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.client.poll_timeout()
    }
}

/// [`Exchange`] over a worker's [`Endpoint`], turned by the calling
/// thread.
#[derive(Debug)]
pub struct SessionNet<D> {
    endpoint: Endpoint<D, WorkerService>,
    idle: IdlePolicy,
    /// What a park also waits on; nothing writes it, so only input and
    /// timeouts end a park.
    waker: ReactorWaker,
}

impl<D: Driver> SessionNet<D> {
    /// A client over `endpoint`, whose connections are attached; waits for
    /// every handshake. Busy-polls between turns when `polling`, else
    /// parks.
    pub fn new(endpoint: Endpoint<D, WorkerService>, polling: bool) -> Result<Self, TrainError> {
        let waker = local_waker().map_err(|e| TrainError::Internal(e.to_string()))?;
        let mut net = Self {
            endpoint,
            idle: if polling {
                IdlePolicy::BusyPoll
            } else {
                IdlePolicy::Park
            },
            waker,
        };
        net.run(WorkerService::is_connected_or_failed)?;
        Ok(net)
    }

    /// Close every connection politely.
    pub fn close(&mut self) {
        self.endpoint.close_all(Instant::now());
    }

    /// Turn until `done`; the failure the service saw, if any.
    fn run(&mut self, done: fn(&WorkerService) -> bool) -> Result<(), TrainError> {
        self.endpoint
            .run_until(&self.waker, self.idle, MAX_PARK, done);
        match self.endpoint.service_mut().take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl<D: Driver> Exchange for SessionNet<D> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let now = Instant::now();
        let (service, sessions) = self.endpoint.parts_mut();
        let r = service
            .start(sessions, reqs, std::mem::take(replies), now)
            .and_then(|()| {
                // Write everything before waiting on anything.
                self.endpoint.flush(now);
                self.run(WorkerService::is_settled)
            });
        *replies = self.endpoint.service_mut().finish();
        r
    }

    fn traffic(&self) -> Traffic {
        self.endpoint.service().client().traffic()
    }

    fn driver_counters(&self) -> Option<DriverCounters> {
        Some(self.endpoint.sessions().driver().counters())
    }
}

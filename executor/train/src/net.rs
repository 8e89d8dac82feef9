//! The worker's side of the network: send a set of requests to PS shards
//! and wait for every reply. The worker thread drives its own driver, with
//! one connection per shard (run-to-completion, no hand-off to a network
//! thread); between turns it busy-polls or, with polling off, parks the way
//! the driver says.
//!
//! [`SessionNet`] is the I/O shell around the sans-IO [`PsClient`]: it reads
//! the clock, turns the sessions ([`turn`]) and parks until input or the
//! next deadline; which requests are pending, which reply is whose and
//! when an exchange has failed are the client's.

use std::time::{Duration, Instant};

use starwire_transport::reactor::{local_waker, park_driver, Parked, ReactorWaker};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{Body, ConnConfig, ConnId, Connection, Driver, Sessions};

use crate::psclient::{PsClient, ShardConns};
use crate::TrainError;

/// Longest park between two looks at the sessions (a park also ends on
/// input, writability or the next deadline).
const MAX_PARK: Duration = Duration::from_millis(50);

/// One request of an exchange.
#[derive(Debug)]
pub struct Request {
    /// Destination shard.
    pub shard: usize,
    /// What it is.
    pub opcode: Opcode,
    /// The body.
    pub body: Body,
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
}

/// A worker's connections, one per shard, on one driver.
#[derive(Debug)]
pub struct ShardSessions<D> {
    sessions: Sessions<D>,
    /// `ids[s]`: shard `s`'s connection.
    ids: Vec<ConnId>,
    /// By [`ConnId::index`]: the connection's shard.
    shard_of: Vec<Option<usize>>,
}

impl<D: Driver> ShardSessions<D> {
    /// The connections `ids` of `driver` (`ids[s]`: shard `s`'s, just
    /// attached), each with `cfg`; their handshakes are queued.
    pub fn new(driver: D, ids: Vec<ConnId>, cfg: &ConnConfig) -> Self {
        let mut sessions = Sessions::new(driver);
        let mut shard_of = Vec::new();
        for (s, &id) in ids.iter().enumerate() {
            sessions.insert(id, cfg.clone());
            if shard_of.len() <= id.index() {
                shard_of.resize(id.index() + 1, None);
            }
            shard_of[id.index()] = Some(s);
        }
        Self {
            sessions,
            ids,
            shard_of,
        }
    }

    /// The sessions, e.g. for their timers.
    pub fn sessions(&self) -> &Sessions<D> {
        &self.sessions
    }

    /// The shard of `id`, one of `ids`.
    fn shard(&self, id: ConnId) -> usize {
        shard_of(&self.shard_of, id).unwrap_or_default()
    }
}

/// `id`'s shard in `map` (by [`ConnId::index`]).
fn shard_of(map: &[Option<usize>], id: ConnId) -> Option<usize> {
    map.get(id.index()).copied().flatten()
}

impl<D: Driver> ShardConns for ShardSessions<D> {
    fn conn(&mut self, shard: usize) -> Option<&mut Connection> {
        let id = *self.ids.get(shard)?;
        self.sessions.conn(id)
    }
}

/// One turn of a client's connections at `now`: one receive pass (the
/// responses to `client`), the events of every connection to `client`,
/// timers, what each connection has to write and one submission. Returns
/// whether anything moved; an error (a connection failed, a request or the
/// handshake timed out) fails the exchange.
pub fn turn<D: Driver>(
    client: &mut PsClient,
    net: &mut ShardSessions<D>,
    now: Instant,
) -> Result<bool, TrainError> {
    let ShardSessions {
        sessions,
        ids,
        shard_of: map,
    } = net;
    let st = sessions.turn(now, &mut |id, _, m| {
        if let Some(s) = shard_of(map, id) {
            client.handle_message(s, m);
        }
    });
    if let Some((id, _, e)) = sessions.poll_failed() {
        let s = shard_of(map, id).unwrap_or_default();
        return Err(TrainError::Link(s, e.to_string()));
    }
    for (s, &id) in ids.iter().enumerate() {
        let Some(conn) = sessions.conn(id) else {
            continue;
        };
        while let Some(ev) = conn.poll_event() {
            client.handle_event(s, ev)?;
        }
    }
    client.handle_timeout(now)?;
    Ok(st.busy())
}

/// [`Exchange`] over starwire sessions, one per shard, on one driver.
#[derive(Debug)]
pub struct SessionNet<D> {
    net: ShardSessions<D>,
    client: PsClient,
    polling: bool,
    /// What a park also waits on; nothing writes it, so only input and
    /// timeouts end a park.
    waker: ReactorWaker,
}

impl<D: Driver> SessionNet<D> {
    /// A client over `net`; waits for every handshake. Handshakes and,
    /// later, replies must come within `timeout`.
    pub fn new(
        net: ShardSessions<D>,
        polling: bool,
        timeout: Duration,
    ) -> Result<Self, TrainError> {
        let n = net.ids.len();
        let waker = local_waker().map_err(|e| TrainError::Internal(e.to_string()))?;
        let mut net = Self {
            net,
            client: PsClient::new(n, timeout, Instant::now()),
            polling,
            waker,
        };
        while !net.client.is_connected() {
            let now = Instant::now();
            if !net.turn(now)? {
                net.park(now);
            }
        }
        Ok(net)
    }

    /// Close every connection politely.
    pub fn close(&mut self) {
        let ShardSessions { sessions, ids, .. } = &mut self.net;
        for &id in ids.iter() {
            if let Some(c) = sessions.conn(id) {
                c.close();
            }
        }
        sessions.flush(Instant::now());
    }

    fn turn(&mut self, now: Instant) -> Result<bool, TrainError> {
        turn(&mut self.client, &mut self.net, now)
    }

    /// Send the exchange the client has started, then turn until it is
    /// done or failed.
    fn run(&mut self) -> Result<(), TrainError> {
        // Write everything before waiting on anything.
        self.net.sessions.flush(Instant::now());
        if let Some((id, _, e)) = self.net.sessions.poll_failed() {
            return Err(TrainError::Link(self.net.shard(id), e.to_string()));
        }
        while !self.client.is_done() {
            let now = Instant::now();
            if !self.turn(now)? && !self.client.is_done() {
                self.park(now);
            }
        }
        Ok(())
    }

    /// Wait the way the driver says for input, writability or the next
    /// deadline (at most [`MAX_PARK`]); spin once instead when polling.
    fn park(&mut self, now: Instant) {
        if self.polling {
            std::hint::spin_loop();
            return;
        }
        let next = self
            .net
            .sessions
            .poll_timeout()
            .into_iter()
            .chain(self.client.poll_timeout())
            .min();
        let max = next.map_or(MAX_PARK, |t| t.saturating_duration_since(now).min(MAX_PARK));
        let waker = self.waker.park_waker();
        if park_driver(self.net.sessions.driver_mut(), waker, max) == Parked::No {
            std::hint::spin_loop();
        }
    }
}

impl<D: Driver> Exchange for SessionNet<D> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let r = self
            .client
            .start(&mut self.net, reqs, std::mem::take(replies), Instant::now())
            .and_then(|()| self.run());
        *replies = self.client.finish();
        r
    }

    fn traffic(&self) -> Traffic {
        self.client.traffic()
    }
}

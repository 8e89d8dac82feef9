//! The worker's side of the protocol, sans-IO: [`PsClient`] sends an
//! exchange's requests to PS shards and gathers every reply.
//!
//! It never reads a clock or touches a socket. Requests go out as messages
//! queued on each shard's [`Connection`], each with the exchange's
//! deadline (`now + timeout`): the connection fails a request that is not
//! answered by then ([`RequestError::DeadlineExceeded`]), and the failure
//! comes back as an event. Responses and events come in through
//! [`PsClient::handle_message`] and [`PsClient::handle_event`]. The shell
//! that drives it (`net.rs`) reads the clock, turns the sessions and parks
//! until [`PsClient::poll_timeout`] or the sessions' next timer.

use std::time::{Duration, Instant};

use starwire_transport::{Connection, Event, Incoming, RequestError};

use crate::net::{Reply, Request, Traffic};
use crate::TrainError;

/// The connections a [`PsClient`] sends on, one per shard.
pub trait ShardConns {
    /// Shard `shard`'s connection.
    fn conn(&mut self, shard: usize) -> Option<&mut Connection>;
}

/// The client state machine. See the module documentation.
#[derive(Debug)]
pub struct PsClient {
    timeout: Duration,
    /// Until every handshake completed: when connecting gives up.
    connect_deadline: Option<Instant>,
    connected: Vec<bool>,
    /// `pending[shard]`: (request id, index of its reply).
    pending: Vec<Vec<(u64, usize)>>,
    outstanding: usize,
    replies: Vec<Reply>,
    traffic: Traffic,
}

impl PsClient {
    /// A client of `shards` shards whose connections were just opened at
    /// `now`: every handshake must complete, and later every request be
    /// answered, within `timeout`.
    pub fn new(shards: usize, timeout: Duration, now: Instant) -> Self {
        Self::for_shards(shards, 0..shards, timeout, now)
    }

    /// A client of `shards` shards that sends only to those of `mine`
    /// (one of a worker's network reactors, which holds those shards'
    /// connections): connecting waits for their handshakes alone.
    pub fn for_shards(
        shards: usize,
        mine: impl IntoIterator<Item = usize>,
        timeout: Duration,
        now: Instant,
    ) -> Self {
        let mut connected = vec![true; shards];
        for s in mine {
            if let Some(c) = connected.get_mut(s) {
                *c = false;
            }
        }
        let waiting = connected.iter().any(|&c| !c);
        Self {
            timeout,
            connect_deadline: waiting.then(|| now + timeout),
            connected,
            pending: vec![Vec::new(); shards],
            outstanding: 0,
            replies: Vec::new(),
            traffic: Traffic::default(),
        }
    }

    /// True once every shard's handshake completed.
    pub fn is_connected(&self) -> bool {
        self.connect_deadline.is_none()
    }

    /// Start an exchange at `now`: queue every request on its shard's
    /// connection with the deadline `now + timeout`. `replies` is reused
    /// for the replies (`replies[i]` answers `reqs[i]`); take them back
    /// with [`finish`](Self::finish) once [`is_done`](Self::is_done).
    pub fn start<C: ShardConns + ?Sized>(
        &mut self,
        conns: &mut C,
        reqs: Vec<Request>,
        mut replies: Vec<Reply>,
        now: Instant,
    ) -> Result<(), TrainError> {
        let n = reqs.len();
        replies.truncate(n);
        replies.resize_with(n, Reply::default);
        for r in &mut replies {
            r.status = None;
            r.body.clear();
        }
        self.replies = replies;
        self.pending.iter_mut().for_each(Vec::clear);
        self.outstanding = 0;
        let deadline = now + self.timeout;
        for (i, r) in reqs.into_iter().enumerate() {
            let shard = r.shard;
            let (Some(conn), Some(pending)) = (conns.conn(shard), self.pending.get_mut(shard))
            else {
                return Err(TrainError::Link(shard, "no such shard".into()));
            };
            self.traffic.sent += r.body.len() as u64;
            self.traffic.requests += 1;
            let id = conn
                .request(r.opcode, shard as u16, r.body, Some(deadline))
                .map_err(|e| TrainError::Link(shard, format!("send: {e}")))?;
            pending.push((id, i));
            self.outstanding += 1;
        }
        Ok(())
    }

    /// A message from `shard`: a response settles its request.
    pub fn handle_message(&mut self, shard: usize, m: Incoming<'_>) {
        let Incoming::Response {
            id, status, body, ..
        } = m
        else {
            return;
        };
        let Some(pending) = self.pending.get_mut(shard) else {
            return;
        };
        let Some(p) = pending.iter().position(|&(pid, _)| pid == id) else {
            return;
        };
        let (_, idx) = pending.swap_remove(p);
        if let Some(r) = self.replies.get_mut(idx) {
            r.status = Some(status);
            r.body.extend_from_slice(body);
        }
        self.traffic.received += body.len() as u64;
        self.outstanding -= 1;
    }

    /// An event of `shard`'s connection. A connection closed during the
    /// handshake or while the exchange waits on it, or a request of the
    /// exchange that failed (its deadline passed, the connection was
    /// lost), fails the exchange. A connection closed that owes nothing
    /// fails nothing yet: a PS whose shards finish one by one closes some
    /// while others still answer.
    pub fn handle_event(&mut self, shard: usize, ev: Event) -> Result<(), TrainError> {
        match ev {
            Event::Connected(_) => {
                if let Some(c) = self.connected.get_mut(shard) {
                    *c = true;
                }
                if self.connected.iter().all(|&c| c) {
                    self.connect_deadline = None;
                }
                Ok(())
            }
            Event::PeerClosed if !self.is_connected() => {
                Err(TrainError::Link(shard, "closed during handshake".into()))
            }
            Event::PeerClosed if self.is_waiting_on(shard) => {
                Err(TrainError::Link(shard, "PS closed the connection".into()))
            }
            Event::PeerClosed => Ok(()),
            Event::RequestFailed { id, error } => {
                let ours = self
                    .pending
                    .get(shard)
                    .is_some_and(|p| p.iter().any(|&(pid, _)| pid == id));
                match error {
                    _ if !ours => Ok(()),
                    RequestError::DeadlineExceeded => Err(TrainError::Link(
                        shard,
                        format!("no PS reply within {:?}: deadline exceeded", self.timeout),
                    )),
                    e => Err(TrainError::Link(shard, e.to_string())),
                }
            }
            _ => Ok(()),
        }
    }

    /// Fail connecting once its deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), TrainError> {
        match self.connect_deadline {
            Some(d) if d <= now => {
                let shard = self.connected.iter().position(|&c| !c).unwrap_or(0);
                Err(TrainError::Link(shard, "handshake timed out".into()))
            }
            _ => Ok(()),
        }
    }

    /// The next instant at which [`handle_timeout`](Self::handle_timeout)
    /// has work. The requests' deadlines are the connections'
    /// ([`Connection::poll_timeout`]).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.connect_deadline
    }

    /// True while a request of the exchange to `shard` waits for its
    /// reply.
    pub fn is_waiting_on(&self, shard: usize) -> bool {
        self.pending.get(shard).is_some_and(|p| !p.is_empty())
    }

    /// True once every request of the exchange has its reply.
    pub fn is_done(&self) -> bool {
        self.outstanding == 0
    }

    /// End the exchange (done or failed) and hand back the replies;
    /// responses still to come for it are ignored.
    pub fn finish(&mut self) -> Vec<Reply> {
        self.pending.iter_mut().for_each(Vec::clear);
        self.outstanding = 0;
        std::mem::take(&mut self.replies)
    }

    /// Bytes and requests so far.
    pub fn traffic(&self) -> Traffic {
        self.traffic
    }
}

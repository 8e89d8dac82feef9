//! The worker's side of the network: send a set of requests to PS shards
//! and wait for every reply. The worker thread drives its own sessions
//! (run-to-completion, no hand-off to a network thread), busy-polling or
//! parking in `poll(2)` on its sockets as the polling setting says.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{Body, ConnConfig, Event, Incoming, Session};

use crate::link::LinkTransport;
use crate::TrainError;

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

/// [`Exchange`] over starwire sessions, one per shard.
#[derive(Debug)]
pub struct SessionNet<T: LinkTransport> {
    sessions: Vec<Session<T>>,
    polling: bool,
    /// `pending[shard]`: (request id, index into the replies).
    pending: Vec<Vec<(u64, usize)>>,
    traffic: Traffic,
    timeout: Duration,
}

impl<T: LinkTransport> SessionNet<T> {
    /// Sessions over `transports` (index = shard); waits for every
    /// handshake.
    pub fn new(
        cfg: &ConnConfig,
        transports: Vec<T>,
        polling: bool,
        timeout: Duration,
    ) -> Result<Self, TrainError> {
        let n = transports.len();
        let mut net = Self {
            sessions: transports
                .into_iter()
                .map(|t| Session::new(cfg.clone(), t))
                .collect(),
            polling,
            pending: vec![Vec::new(); n],
            traffic: Traffic::default(),
            timeout,
        };
        let deadline = Instant::now() + timeout;
        loop {
            let mut all = true;
            for (i, s) in net.sessions.iter_mut().enumerate() {
                s.turn(Instant::now(), &mut |_, _| {})
                    .map_err(|e| TrainError::Link(i, e.to_string()))?;
                while let Some(ev) = s.poll_event() {
                    if let Event::PeerClosed = ev {
                        return Err(TrainError::Link(i, "closed during handshake".into()));
                    }
                }
                all &= s.conn_ref().is_established();
            }
            net.end_turn();
            if all {
                return Ok(net);
            }
            if Instant::now() > deadline {
                return Err(TrainError::Link(0, "handshake timed out".into()));
            }
            net.idle(Duration::from_millis(10));
        }
    }

    /// Close every connection politely.
    pub fn close(&mut self) {
        for s in &mut self.sessions {
            s.conn().close();
            let _ = s.flush(Instant::now());
        }
        self.end_turn();
    }

    fn end_turn(&self) -> bool {
        self.sessions
            .first()
            .is_some_and(|s| s.transport().end_turn())
    }

    fn idle(&self, max: Duration) {
        if self.polling {
            std::hint::spin_loop();
            return;
        }
        let fds: Vec<BorrowedFd<'_>> = self
            .sessions
            .iter()
            .map(|s| s.transport().wake_fd())
            .collect();
        let mut pfds: Vec<PollFd<'_>> = fds
            .iter()
            .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
            .collect();
        // A request the full socket did not take yet: wake when it can go.
        pfds.extend(
            self.sessions
                .iter()
                .filter_map(|s| s.transport().write_fd())
                .map(|fd| PollFd::new(fd, PollFlags::POLLOUT)),
        );
        let ms = u16::try_from(max.as_millis().max(1)).unwrap_or(u16::MAX);
        let _ = nix::poll::poll(&mut pfds, PollTimeout::from(ms));
    }
}

impl<T: LinkTransport> Exchange for SessionNet<T> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let n = reqs.len();
        if replies.len() < n {
            replies.resize_with(n, Reply::default);
        }
        replies.truncate(n);
        for r in replies.iter_mut() {
            r.status = None;
            r.body.clear();
        }
        let mut outstanding = 0usize;
        for (i, r) in reqs.into_iter().enumerate() {
            let s = self
                .sessions
                .get_mut(r.shard)
                .ok_or_else(|| TrainError::Link(r.shard, "no such shard".into()))?;
            self.traffic.sent += r.body.len() as u64;
            self.traffic.requests += 1;
            let id = s
                .conn()
                .request(r.opcode, r.shard as u16, r.body, None)
                .map_err(|e| TrainError::Link(r.shard, format!("send: {e}")))?;
            self.pending[r.shard].push((id, i));
            outstanding += 1;
        }
        // Write everything before waiting on anything.
        for (i, s) in self.sessions.iter_mut().enumerate() {
            s.flush(Instant::now())
                .map_err(|e| TrainError::Link(i, e.to_string()))?;
        }
        self.end_turn();
        let deadline = Instant::now() + self.timeout;
        while outstanding > 0 {
            let mut busy = false;
            for (si, s) in self.sessions.iter_mut().enumerate() {
                if self.pending[si].is_empty() && !s.conn_ref().wants_transmit() {
                    continue;
                }
                let pending = &mut self.pending[si];
                let traffic = &mut self.traffic;
                let mut on_msg = |_: &mut starwire_transport::Connection, m: Incoming<'_>| {
                    if let Incoming::Response {
                        id, status, body, ..
                    } = m
                    {
                        if let Some(p) = pending.iter().position(|&(pid, _)| pid == id) {
                            let (_, idx) = pending.swap_remove(p);
                            let r = &mut replies[idx];
                            r.status = Some(status);
                            r.body.extend_from_slice(body);
                            traffic.received += body.len() as u64;
                            outstanding -= 1;
                        }
                    }
                };
                let st = s
                    .turn(Instant::now(), &mut on_msg)
                    .map_err(|e| TrainError::Link(si, e.to_string()))?;
                busy |= st.busy();
                while let Some(ev) = s.poll_event() {
                    match ev {
                        Event::RequestFailed { error, .. } => {
                            return Err(TrainError::Link(si, error.to_string()))
                        }
                        Event::PeerClosed => {
                            return Err(TrainError::Link(si, "PS closed the connection".into()))
                        }
                        _ => {}
                    }
                }
            }
            busy |= self.end_turn();
            if !busy && outstanding > 0 {
                if Instant::now() > deadline {
                    return Err(TrainError::Link(
                        0,
                        "timed out waiting for PS replies".into(),
                    ));
                }
                self.idle(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }
}

//! The worker's side of the network: send a set of requests to PS shards
//! and wait for every reply. The worker thread drives its own sessions
//! (run-to-completion, no hand-off to a network thread), busy-polling or
//! parking in `poll(2)` on its sockets as the polling setting says.
//!
//! [`SessionNet`] is the I/O shell around the sans-IO [`PsClient`]: it reads
//! the clock, turns the sessions ([`turn`]) and parks until input or the
//! next deadline; which requests are pending, which reply is whose and
//! when an exchange has failed are the client's.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{Body, ConnConfig, Session, Transport};

use crate::link::LinkTransport;
use crate::psclient::PsClient;
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

/// One turn of a client's sessions at `now`: every session the client
/// expects something from (or that has frames to write, or a timer due)
/// receives, hands its responses and events to `client`, fires its timers
/// and writes. Returns whether anything moved; an error fails the
/// exchange.
pub fn turn<T: Transport>(
    client: &mut PsClient,
    sessions: &mut [Session<T>],
    now: Instant,
) -> Result<bool, TrainError> {
    let mut busy = false;
    for (si, s) in sessions.iter_mut().enumerate() {
        if !client.expects(si)
            && !s.conn_ref().wants_transmit()
            && !s.poll_timeout().is_some_and(|t| t <= now)
        {
            continue;
        }
        let st = s
            .turn(now, &mut |_, m| client.handle_message(si, m))
            .map_err(|e| TrainError::Link(si, e.to_string()))?;
        busy |= st.busy();
        while let Some(ev) = s.poll_event() {
            client.handle_event(si, ev)?;
        }
    }
    client.handle_timeout(now)?;
    Ok(busy)
}

/// [`Exchange`] over starwire sessions, one per shard.
#[derive(Debug)]
pub struct SessionNet<T: LinkTransport> {
    sessions: Vec<Session<T>>,
    client: PsClient,
    polling: bool,
}

impl<T: LinkTransport> SessionNet<T> {
    /// Sessions over `transports` (index = shard); waits for every
    /// handshake. Handshakes and, later, replies must come within
    /// `timeout`.
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
            client: PsClient::new(n, timeout, Instant::now()),
            polling,
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
        for s in &mut self.sessions {
            s.conn().close();
            let _ = s.flush(Instant::now());
        }
        self.end_turn();
    }

    fn turn(&mut self, now: Instant) -> Result<bool, TrainError> {
        let busy = turn(&mut self.client, &mut self.sessions, now)?;
        Ok(self.end_turn() | busy)
    }

    fn end_turn(&self) -> bool {
        self.sessions
            .first()
            .is_some_and(|s| s.transport().end_turn())
    }

    /// Send the exchange the client has started, then turn until it is
    /// done or failed.
    fn run(&mut self) -> Result<(), TrainError> {
        // Write everything before waiting on anything.
        let now = Instant::now();
        for (i, s) in self.sessions.iter_mut().enumerate() {
            s.flush(now)
                .map_err(|e| TrainError::Link(i, e.to_string()))?;
        }
        self.end_turn();
        while !self.client.is_done() {
            let now = Instant::now();
            if !self.turn(now)? && !self.client.is_done() {
                self.park(now);
            }
        }
        Ok(())
    }

    /// Wait for input, writability or the next deadline (at most
    /// [`MAX_PARK`]); spin once instead when polling.
    fn park(&self, now: Instant) {
        if self.polling {
            std::hint::spin_loop();
            return;
        }
        let next = self
            .sessions
            .iter()
            .filter_map(Session::poll_timeout)
            .chain(self.client.poll_timeout())
            .min();
        let max = next.map_or(MAX_PARK, |t| t.saturating_duration_since(now).min(MAX_PARK));
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
        // Round up: a deadline less than a millisecond away is not a
        // reason to spin.
        let ms = max.as_micros().div_ceil(1000);
        let _ = nix::poll::poll(
            &mut pfds,
            PollTimeout::from(u16::try_from(ms).unwrap_or(u16::MAX)),
        );
    }
}

impl<T: LinkTransport> Exchange for SessionNet<T> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let r = self
            .client
            .start(
                &mut self.sessions[..],
                reqs,
                std::mem::take(replies),
                Instant::now(),
            )
            .and_then(|()| self.run());
        *replies = self.client.finish();
        r
    }

    fn traffic(&self) -> Traffic {
        self.client.traffic()
    }
}

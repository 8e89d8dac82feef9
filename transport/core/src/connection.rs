//! The message layer: a sans-IO connection core.
//!
//! A [`Connection`] turns a [`Transport`](crate::Transport) (reliable ordered frames) into
//! reliable ordered *messages*: a handshake, request/response matching by
//! request id, one-way sends, deadlines and cancellation, credit-based flow
//! control, and chunking of messages longer than the backend's largest frame.
//! It never reads the clock and never does I/O itself: the caller passes
//! `now`, hands received frames to [`Connection::handle_frame`], and lets
//! [`Connection::poll_transmit`] write queued frames into the transport's
//! lent buffers. The same core runs over every backend.
//!
//! Flow control: the peer grants credits (in frames) in its `Hello` and in
//! the `credit` field of any later frame header (or a bare `Credit` frame).
//! Every data frame spends one credit; control frames spend none. A receiver
//! grants credits back as it consumes frames, automatically by default or
//! through [`Connection::grant`] when the application wants to hold them
//! until it has processed the requests it was given.
//!
//! The send queue is bounded. A full queue hands the message back to the
//! caller ([`SendError::QueueFull`]); nothing is dropped.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_wire::message::{Hello, Role, HELLO_FLAG_AUTH, MAX_JOB_NAME_LEN};
use starwire_wire::{Flags, FrameError, Header, Opcode, Status, HEADER_LEN};
use thiserror::Error;

use crate::auth::{self, ClusterToken, Nonce, Side};
use crate::budget::MemoryBudget;
use crate::driver::FrameTx;
use crate::transport::TransportError;

mod charge;
mod handshake;
mod payload;

pub use payload::Payload;

use charge::charge;

/// The protocol version carried in the handshake.
pub const PROTOCOL_VERSION: u16 = 2;

/// Longest body of a reply [`Connection::respond_error`] queues.
pub const MAX_ERROR_BODY: usize = 256;

/// The role of a task in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskRole {
    /// A parameter server.
    Ps,
    /// A worker (TensorFlow's `chief` is a worker).
    Worker,
}

/// Who is at one end of a connection: the task and its incarnation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerInfo {
    /// The task's role.
    pub role: TaskRole,
    /// The job name ("ps", "worker", or the launcher's name).
    pub job: String,
    /// The task index within its job.
    pub task_index: u32,
    /// A number that changes every time the task process starts, so that a
    /// restarted peer is detected on reconnect.
    pub incarnation: u64,
    /// How many shards (reactors) the task runs.
    pub shards: u16,
}

/// Settings for one connection.
#[derive(Debug, Clone)]
pub struct ConnConfig {
    /// This end.
    pub local: PeerInfo,
    /// The incarnation seen on the previous connection to the same peer, if
    /// any; a different one in the peer's handshake raises
    /// [`Event::PeerRestarted`].
    pub known_peer_incarnation: Option<u64>,
    /// Credits (frames) granted to the peer in the handshake.
    pub recv_window: u32,
    /// Most messages waiting in the send queue.
    pub send_queue_limit: usize,
    /// Largest message body accepted or sent.
    pub max_message_len: u32,
    /// Grant credits back as soon as frames are delivered. When false the
    /// application calls [`Connection::grant`].
    pub auto_credit: bool,
    /// Which end this is: it decides the order of the handshake's proofs
    /// (see [`crate::auth`]). The endpoint sets it.
    pub side: Side,
    /// The cluster token: with one, the peer must prove it holds the same
    /// before any of its messages is delivered, and a peer without one is
    /// refused.
    pub token: Option<ClusterToken>,
    /// Training flags (`name=value` lines) that the peer's must equal; a
    /// connection whose peer sends different ones fails at connect.
    /// Empty: nothing to compare.
    pub flags: Arc<str>,
    /// A connection whose handshake has not completed this long after it
    /// was opened fails ([`ConnError::TimedOut`]). The endpoint arms it.
    pub handshake_timeout: Option<Duration>,
    /// A connection that receives nothing and sends nothing for this long,
    /// or whose queued messages cannot leave for this long (a peer that
    /// stopped reading), fails. Enforced by [`Sessions`](crate::Sessions).
    pub idle_timeout: Option<Duration>,
    /// The budget queued and reassembled messages are charged to.
    pub budget: Option<MemoryBudget>,
    /// The cluster's worker count: a peer that says it is a worker with a
    /// task index not below it fails the handshake (a PS keeps state per
    /// worker index). None: any index.
    pub workers: Option<u32>,
}

impl ConnConfig {
    /// Defaults for `local`: a window of 256 frames, 4096 queued messages,
    /// 1 GiB messages, automatic credit.
    pub fn new(local: PeerInfo) -> Self {
        Self {
            local,
            known_peer_incarnation: None,
            recv_window: 256,
            send_queue_limit: 4096,
            max_message_len: 1 << 30,
            auto_credit: true,
            side: Side::Dialer,
            token: None,
            flags: Arc::from(""),
            handshake_timeout: None,
            idle_timeout: None,
            budget: None,
            workers: None,
        }
    }
}

/// An error that ends the connection.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConnError {
    /// The peer sent a malformed frame.
    #[error("framing error: {0}")]
    Frame(#[from] FrameError),
    /// The handshake failed.
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The peer broke the protocol (a data frame before the handshake, a
    /// frame beyond its credits, a chunk out of sequence...).
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    /// The backend failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The connection was closed (locally or by a `Goodbye`).
    #[error("connection closed")]
    Closed,
    /// The peer did not prove it holds the cluster token, or holds none.
    #[error("peer not authenticated: {0}")]
    Unauthenticated(&'static str),
    /// The peer's training flags differ from ours.
    #[error("training flags differ from the peer's: {0}")]
    FlagsDiffer(String),
    /// A deadline of the connection passed: the handshake, or the idle
    /// timeout.
    #[error("{0}")]
    TimedOut(&'static str),
    /// A message could not be held within the memory budget.
    #[error("memory budget exhausted: {0}")]
    OverBudget(&'static str),
}

/// Why one request failed. The connection may live on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RequestError {
    /// Its deadline passed before the response came.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The connection was lost; the request may or may not have run.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
}

/// A message handed back because it could not be queued.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SendError {
    /// The bounded send queue is full; the body is handed back.
    #[error("send queue full")]
    QueueFull(Payload),
    /// The message is longer than the configured maximum.
    #[error("message of {len} bytes exceeds the maximum {max}")]
    TooLarge {
        /// Payload length.
        len: usize,
        /// Configured maximum.
        max: u32,
        /// The body, handed back.
        body: Payload,
    },
    /// The connection is closed.
    #[error("connection closed")]
    Closed(Payload),
    /// The memory budget has no room for the body; it is handed back.
    #[error("memory budget exhausted")]
    OverBudget(Payload),
}

/// A message delivered by [`Connection::handle_frame`], borrowed in place
/// from the received frame (or from the reassembly buffer of a chunked one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming<'a> {
    /// A request (or a one-way message) from the peer.
    Request {
        /// The peer's request id; answer with [`Connection::respond`].
        id: u64,
        /// What it asks for.
        opcode: Opcode,
        /// The shard it is addressed to.
        shard: u16,
        /// True when no response is expected.
        oneway: bool,
        /// The body, borrowed.
        body: &'a [u8],
    },
    /// The response to one of our requests.
    Response {
        /// Our request id.
        id: u64,
        /// The opcode of the request.
        opcode: Opcode,
        /// The peer's verdict; non-`Ok` is a semantic error for this request.
        status: Status,
        /// The body, borrowed.
        body: &'a [u8],
    },
}

/// Something the connection reports outside the data path.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The handshake completed.
    Connected(PeerInfo),
    /// The peer's incarnation differs from the one seen before: it
    /// restarted and lost whatever state it held for us.
    PeerRestarted {
        /// The incarnation seen before.
        previous: u64,
        /// The peer as it is now.
        peer: PeerInfo,
    },
    /// A request of ours failed.
    RequestFailed {
        /// Our request id.
        id: u64,
        /// Why.
        error: RequestError,
    },
    /// The peer cancelled one of its requests; its response is not needed.
    PeerCancelled {
        /// The peer's request id.
        id: u64,
    },
    /// The peer said goodbye.
    PeerClosed,
}

#[derive(Debug)]
struct Outgoing {
    header: Header,
    body: Payload,
    /// Bytes of `body` already sent in earlier chunks.
    sent: usize,
    /// Whether any chunk has been sent.
    started: bool,
    /// Bytes charged to the budget for it.
    charged: usize,
}

#[derive(Debug)]
struct Reassembly {
    header: Header,
    buf: Vec<u8>,
    /// Bytes charged to the budget for `buf`.
    charged: usize,
}

/// The peer's `Hello`, kept until its `Auth` completes the handshake.
#[derive(Debug)]
struct PeerHello {
    info: PeerInfo,
    nonce: Nonce,
}

/// The connection state machine. See the module documentation.
#[derive(Debug)]
pub struct Connection {
    cfg: ConnConfig,
    max_frame_len: usize,
    peer: Option<PeerInfo>,
    closed: bool,
    next_id: u64,
    /// Our outstanding requests: id -> deadline.
    pending: HashMap<u64, Option<Instant>>,
    deadlines: BTreeSet<(Instant, u64)>,
    /// Control frames go before data, always.
    control: VecDeque<Outgoing>,
    queue: VecDeque<Outgoing>,
    /// Credits the peer granted us and we have not spent.
    send_credit: u32,
    /// Credits we owe the peer (frames consumed and not yet granted back).
    owed_credit: u32,
    /// Credits the peer may still spend before we grant more.
    peer_credit: u32,
    reassembly: Option<Reassembly>,
    events: VecDeque<Event>,
    scratch: Vec<Bytes>,
    /// This end's handshake nonce.
    nonce: Nonce,
    /// The peer's `Hello`, until its `Auth` came.
    peer_hello: Option<PeerHello>,
    /// Our `Auth` is queued.
    sent_auth: bool,
    handshake_deadline: Option<Instant>,
    /// An error found outside `handle_frame` (a deadline), for the caller.
    error: Option<ConnError>,
    /// Bytes charged to the budget, over the queue and the reassembly.
    charged: usize,
    /// Data frames written so far.
    data_frames_sent: u64,
    /// Responses that matched no pending request, dropped.
    unmatched_responses: u64,
}

impl Connection {
    /// A new connection over a backend whose frames are at most
    /// `max_frame_len` bytes. The handshake is queued at once.
    pub fn new(cfg: ConnConfig, max_frame_len: usize) -> Self {
        let mut c = Self {
            max_frame_len,
            peer: None,
            closed: false,
            next_id: 1,
            pending: HashMap::new(),
            deadlines: BTreeSet::new(),
            control: VecDeque::new(),
            queue: VecDeque::new(),
            send_credit: 0,
            owed_credit: 0,
            peer_credit: cfg.recv_window,
            reassembly: None,
            events: VecDeque::new(),
            scratch: Vec::new(),
            nonce: auth::nonce(),
            peer_hello: None,
            sent_auth: false,
            handshake_deadline: None,
            error: None,
            charged: 0,
            data_frames_sent: 0,
            unmatched_responses: 0,
            cfg,
        };
        let local = &c.cfg.local;
        let mut job = local.job.as_str();
        if job.len() > MAX_JOB_NAME_LEN {
            let mut end = MAX_JOB_NAME_LEN;
            while !job.is_char_boundary(end) {
                end -= 1;
            }
            tracing::warn!(
                job,
                "job name longer than {MAX_JOB_NAME_LEN} bytes is truncated in the handshake"
            );
            job = &job[..end];
        }
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            flags: if c.cfg.token.is_some() {
                HELLO_FLAG_AUTH
            } else {
                0
            },
            role: match local.role {
                TaskRole::Ps => Role::Ps,
                TaskRole::Worker => Role::Worker,
            },
            job_name: job,
            task_index: local.task_index,
            incarnation: local.incarnation,
            initial_credits: c.cfg.recv_window,
            max_frame_len: u32::try_from(max_frame_len).unwrap_or(u32::MAX),
            shard_count: local.shards,
            nonce: c.nonce,
        };
        let mut body = vec![0u8; hello.encoded_len()];
        hello.emit(&mut body);
        c.push_control(Header::new(Opcode::Hello, 0, 0), Payload::from(body));
        c
    }

    /// The peer, once the handshake completed.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.as_ref()
    }

    /// True once the handshake completed and until the connection closes.
    pub fn is_established(&self) -> bool {
        self.peer.is_some() && !self.closed
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Requests of ours still waiting for a response.
    pub fn pending_requests(&self) -> usize {
        self.pending.len()
    }

    /// Messages waiting in the send queue.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Data frames written so far: what a check that the peer still reads
    /// compares.
    pub fn data_frames_sent(&self) -> u64 {
        self.data_frames_sent
    }

    /// Responses received that matched no pending request and were
    /// dropped: a reply to a request that was cancelled or timed out (or
    /// failed with the connection), a second reply to one request, or one
    /// to an id never sent (a corrupted or made-up frame). Where no request
    /// is cancelled or times out (a soak), any is a failure.
    pub fn unmatched_responses(&self) -> u64 {
        self.unmatched_responses
    }

    /// Fail the connection ([`ConnError::TimedOut`]) if its handshake has
    /// not completed by `deadline`.
    pub fn set_handshake_deadline(&mut self, deadline: Instant) {
        self.handshake_deadline = Some(deadline);
    }

    /// The error that ended the connection outside
    /// [`handle_frame`](Self::handle_frame) (a deadline in
    /// [`handle_timeout`](Self::handle_timeout)), once.
    pub fn take_error(&mut self) -> Option<ConnError> {
        self.error.take()
    }

    /// Fail the connection with `e` (the caller found it breaking a bound
    /// of its own, such as the idle timeout); it comes back from
    /// [`take_error`](Self::take_error).
    pub fn fail(&mut self, e: ConnError) {
        if !self.closed {
            let e = self.fatal(e);
            self.error = Some(e);
        }
    }

    /// Credits the peer has granted us and we have not spent.
    pub fn send_credit(&self) -> u32 {
        self.send_credit
    }

    /// Queue a request. `deadline` fails it with
    /// [`RequestError::DeadlineExceeded`] if no response came by then.
    pub fn request(
        &mut self,
        opcode: Opcode,
        shard: u16,
        body: Payload,
        deadline: Option<Instant>,
    ) -> Result<u64, SendError> {
        self.check_send(&body)?;
        let id = self.next_id;
        self.next_id += 1;
        let mut h = Header::new(opcode, id, 0);
        h.shard_id = shard;
        self.enqueue(h, body)?;
        self.pending.insert(id, deadline);
        if let Some(d) = deadline {
            self.deadlines.insert((d, id));
        }
        Ok(id)
    }

    /// Queue a one-way message: no response, no request id.
    pub fn send_oneway(
        &mut self,
        opcode: Opcode,
        shard: u16,
        body: Payload,
    ) -> Result<(), SendError> {
        self.check_send(&body)?;
        let mut h = Header::new(opcode, 0, 0);
        h.flags = Flags::ONEWAY;
        h.shard_id = shard;
        self.enqueue(h, body)
    }

    /// Queue a short error reply to the peer's request `id`: `message`
    /// (cut to [`MAX_ERROR_BODY`] bytes) with a non-`Ok` `status`. It is
    /// charged to the budget even past its limit, so that a request that
    /// did not fit still gets its answer; the send queue's bound holds.
    pub fn respond_error(
        &mut self,
        id: u64,
        opcode: Opcode,
        status: Status,
        message: &str,
    ) -> Result<(), SendError> {
        let mut end = message.len().min(MAX_ERROR_BODY);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let body = Payload::from_bytes(Bytes::copy_from_slice(&message.as_bytes()[..end]));
        self.check_send(&body)?;
        if self.queue.len() >= self.cfg.send_queue_limit {
            return Err(SendError::QueueFull(body));
        }
        let mut h = Header::new(opcode, id, 0);
        h.flags = Flags::RESPONSE;
        h.status = status;
        let charged = body.len();
        if let Some(b) = &self.cfg.budget {
            b.charge(charged);
            self.charged += charged;
        }
        self.queue.push_back(Outgoing {
            header: h,
            body,
            sent: 0,
            started: false,
            charged,
        });
        Ok(())
    }

    /// Queue the response to the peer's request `id`.
    pub fn respond(
        &mut self,
        id: u64,
        opcode: Opcode,
        status: Status,
        body: Payload,
    ) -> Result<(), SendError> {
        self.check_send(&body)?;
        let mut h = Header::new(opcode, id, 0);
        h.flags = Flags::RESPONSE;
        h.status = status;
        self.enqueue(h, body)
    }

    /// Cancel our request `id`: it is forgotten here (a late response is
    /// discarded) and the peer is told, so it can skip the work. Returns
    /// false if the request was not pending.
    pub fn cancel(&mut self, id: u64) -> bool {
        let Some(deadline) = self.pending.remove(&id) else {
            return false;
        };
        if let Some(d) = deadline {
            self.deadlines.remove(&(d, id));
        }
        // Not yet sent: drop it from the queue instead of telling the peer.
        if !self.unqueue(id) && !self.closed {
            self.push_control(Header::new(Opcode::Cancel, id, 0), Payload::empty());
        }
        true
    }

    /// Drop request `id` from the send queue if none of it has left,
    /// giving its bytes back; whether it was there.
    fn unqueue(&mut self, id: u64) -> bool {
        let Some(pos) = self.queue.iter().position(|o| {
            o.header.request_id == id && !o.started && !o.header.flags.contains(Flags::RESPONSE)
        }) else {
            return false;
        };
        if let Some(o) = self.queue.remove(pos) {
            self.release(o.charged);
        }
        true
    }

    /// Grant the peer `n` more credits (with `auto_credit` off): call it as
    /// the application finishes with the frames it was given.
    pub fn grant(&mut self, n: u32) {
        self.owed_credit = self.owed_credit.saturating_add(n);
    }

    /// Close the connection: a `Goodbye` is queued and every pending request
    /// fails with [`RequestError::ConnectionLost`].
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.drop_queue();
        self.drop_reassembly();
        self.push_control(Header::new(Opcode::Goodbye, 0, 0), Payload::empty());
        self.fail_all("closed locally".into());
        self.closed = true;
    }

    /// The backend failed or the peer vanished: fail everything pending.
    pub fn handle_transport_error(&mut self, err: &TransportError) {
        if !self.closed {
            self.fail_all(err.to_string());
            self.closed = true;
            self.drop_queue();
            self.drop_reassembly();
            self.control.clear();
        }
    }

    /// The next instant at which [`handle_timeout`](Self::handle_timeout)
    /// has work (the earliest deadline).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let handshake = self
            .handshake_deadline
            .filter(|_| self.peer.is_none() && !self.closed);
        let requests = self.deadlines.first().map(|(d, _)| *d);
        match (handshake, requests) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Fail every request whose deadline is at or before `now`, and the
    /// connection if its handshake is overdue (see
    /// [`take_error`](Self::take_error)).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.peer.is_none() && !self.closed && self.handshake_deadline.is_some_and(|d| d <= now)
        {
            self.fail(ConnError::TimedOut(
                "no handshake within the handshake timeout",
            ));
            return;
        }
        while let Some(&(d, id)) = self.deadlines.first() {
            if d > now {
                break;
            }
            self.deadlines.pop_first();
            if self.pending.remove(&id).is_some() {
                // A request still queued when it expired is not sent: its
                // caller has given up on it, and the peer would work for
                // nothing.
                self.unqueue(id);
                self.events.push_back(Event::RequestFailed {
                    id,
                    error: RequestError::DeadlineExceeded,
                });
            }
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// True when frames are waiting to be written (and could be).
    pub fn wants_transmit(&self) -> bool {
        !self.control.is_empty()
            || self.should_grant()
            || (!self.queue.is_empty() && self.send_credit > 0 && self.peer.is_some())
    }

    /// Write as many queued frames into `t` as credits and the backend's
    /// room allow. Returns how many frames were written. The caller then
    /// flushes the driver (or transport).
    pub fn poll_transmit<T: FrameTx + ?Sized>(&mut self, t: &mut T) -> Result<usize, ConnError> {
        let mut frames = 0;
        // Control frames first: they spend no credit.
        while let Some(mut o) = self.control.pop_front() {
            o.header.credit = self.owed_credit;
            let r = self.write_frame(t, &mut o);
            match r {
                Ok(true) => {
                    self.commit_grant(o.header.credit);
                    frames += 1;
                }
                Ok(false) => {
                    self.control.push_front(o);
                    return Ok(frames);
                }
                Err(e) => return Err(e),
            }
        }
        // No message leaves before the peer proved who it is.
        if self.closed || self.peer.is_none() {
            return Ok(frames);
        }
        while self.send_credit > 0 {
            let Some(mut o) = self.queue.pop_front() else {
                break;
            };
            o.header.credit = self.owed_credit;
            match self.write_frame(t, &mut o) {
                Ok(true) => {}
                Ok(false) => {
                    self.queue.push_front(o);
                    return Ok(frames);
                }
                Err(e) => {
                    self.queue.push_front(o);
                    return Err(e);
                }
            }
            self.commit_grant(o.header.credit);
            frames += 1;
            self.data_frames_sent += 1;
            self.send_credit -= 1;
            if o.sent < o.body.len() {
                // More chunks to go; they keep the link until done so the
                // receiver reassembles one message at a time.
                self.queue.push_front(o);
            } else {
                self.release(o.charged);
            }
        }
        if self.should_grant() {
            let mut h = Header::new(Opcode::Credit, 0, 0);
            h.credit = self.owed_credit;
            if t.tx_gather(&h.to_bytes(), &[])? {
                self.commit_grant(h.credit);
                frames += 1;
            }
        }
        Ok(frames)
    }

    fn commit_grant(&mut self, granted: u32) {
        self.owed_credit -= granted;
        self.peer_credit = self.peer_credit.saturating_add(granted);
    }

    /// Handle one received frame. Control frames are consumed here; a data
    /// message is returned borrowed in place. A framing or protocol error
    /// ends the connection: the caller must drop the transport.
    ///
    /// A chunked message is reassembled into `reassembled` (owned by the
    /// caller, reused across calls) and lent from there.
    pub fn handle_frame<'a>(
        &mut self,
        frame: &'a [u8],
        reassembled: &'a mut Vec<u8>,
    ) -> Result<Option<Incoming<'a>>, ConnError> {
        if self.closed {
            return Err(ConnError::Closed);
        }
        let max_body =
            u32::try_from(self.max_frame_len.saturating_sub(HEADER_LEN)).unwrap_or(u32::MAX);
        let h = match Header::parse(frame, max_body, self.cfg.max_message_len) {
            Ok(h) => h,
            Err(e) => return Err(self.fatal(e.into())),
        };
        let Some(body) = frame.get(HEADER_LEN..HEADER_LEN + h.body_len as usize) else {
            return Err(self.fatal(
                FrameError::Truncated {
                    needed: h.frame_len(),
                    have: frame.len(),
                }
                .into(),
            ));
        };
        if frame.len() != h.frame_len() {
            return Err(
                self.fatal(FrameError::BadLength("frame longer than its header says").into())
            );
        }
        self.send_credit = self.send_credit.saturating_add(h.credit);
        match h.opcode {
            Opcode::Hello => return self.handle_hello(body).map(|()| None),
            Opcode::Auth => return self.handle_auth(body).map(|()| None),
            _ => {}
        }
        if self.peer.is_none() {
            return Err(self.fatal(ConnError::Protocol("frame before the handshake")));
        }
        match h.opcode {
            Opcode::Credit | Opcode::Ping => return Ok(None),
            Opcode::Goodbye => {
                self.events.push_back(Event::PeerClosed);
                self.fail_all("peer closed the connection".into());
                self.closed = true;
                // Nothing more is read or sent: what was queued, or half
                // reassembled, gives its bytes back to the budget now.
                self.drop_queue();
                self.drop_reassembly();
                return Ok(None);
            }
            Opcode::Cancel => {
                self.events
                    .push_back(Event::PeerCancelled { id: h.request_id });
                return Ok(None);
            }
            _ => {}
        }
        // A data frame: it spends one of the credits we granted.
        if self.peer_credit == 0 {
            return Err(self.fatal(ConnError::Protocol("frame beyond granted credits")));
        }
        self.peer_credit -= 1;
        if self.cfg.auto_credit {
            self.owed_credit += 1;
        }
        let more = h.flags.contains(Flags::MORE);
        let cont = h.flags.contains(Flags::CONTINUATION);
        if !more && !cont {
            if self.reassembly.is_some() {
                return Err(self.fatal(ConnError::Protocol(
                    "unchunked frame inside a chunked message",
                )));
            }
            return Ok(settle(
                &mut self.pending,
                &mut self.deadlines,
                &mut self.unmatched_responses,
                h,
                body,
            ));
        }
        if body.is_empty() {
            return Err(self.fatal(ConnError::Protocol("empty chunk")));
        }
        match (&mut self.reassembly, cont) {
            (None, false) => {
                if body.len() >= h.message_len as usize {
                    return Err(
                        self.fatal(ConnError::Protocol("first chunk holds the whole message"))
                    );
                }
                // First chunk. The untrusted message_len is bounded but not
                // allocated up front: room for at most 16 chunks like this
                // one, so a frame can make the receiver reserve at most 16
                // times its own size. Messages of up to 16 chunks (1 MiB
                // in 64 KiB frames) then never grow, and growing by
                // doubling copied each message about once more (7% of a
                // 1 MiB stream's time over io_uring).
                let room = (h.message_len as usize).min(body.len().max(1) * 16);
                if !self.charge(room) {
                    return Err(self.fatal(ConnError::OverBudget("a chunked message")));
                }
                let mut buf = Vec::with_capacity(room);
                buf.extend_from_slice(body);
                self.reassembly = Some(Reassembly {
                    header: h,
                    buf,
                    charged: room,
                });
                Ok(None)
            }
            (Some(r), true) => {
                let first = r.header;
                let same_flag = |f: Flags| first.flags.contains(f) == h.flags.contains(f);
                if first.request_id != h.request_id
                    || first.opcode != h.opcode
                    || !same_flag(Flags::RESPONSE)
                    || !same_flag(Flags::ONEWAY)
                    || first.status != h.status
                    || first.shard_id != h.shard_id
                    || first.message_len != h.message_len
                    || r.buf.len() + body.len() > first.message_len as usize
                {
                    return Err(
                        self.fatal(ConnError::Protocol("chunk does not continue its message"))
                    );
                }
                let cap = r.buf.capacity();
                r.buf.extend_from_slice(body);
                let grown = r.buf.capacity() - cap;
                r.charged += grown;
                if grown > 0 && !charge(&self.cfg.budget, &mut self.charged, grown) {
                    r.charged -= grown;
                    return Err(self.fatal(ConnError::OverBudget("a chunked message")));
                }
                if more {
                    return Ok(None);
                }
                if r.buf.len() != first.message_len as usize {
                    return Err(self.fatal(ConnError::Protocol(
                        "chunked message shorter than announced",
                    )));
                }
                let Some(r) = self.reassembly.take() else {
                    unreachable!("matched Some above");
                };
                self.release(r.charged);
                if first.flags.contains(Flags::RESPONSE)
                    && !self.pending.contains_key(&first.request_id)
                {
                    // A reply no request waits for (cancelled, timed out,
                    // or made up): dropped here with its buffer, which the
                    // caller would keep uncharged until its next message.
                    self.unmatched_responses += 1;
                    return Ok(None);
                }
                // The buffer goes to the caller, which drops it once the
                // message is handled.
                let header = r.header;
                *reassembled = r.buf;
                let body: &'a Vec<u8> = reassembled;
                Ok(settle(
                    &mut self.pending,
                    &mut self.deadlines,
                    &mut self.unmatched_responses,
                    header,
                    body,
                ))
            }
            _ => Err(self.fatal(ConnError::Protocol("chunk out of sequence"))),
        }
    }

    fn check_send(&self, body: &Payload) -> Result<(), SendError> {
        if self.closed {
            return Err(SendError::Closed(body.clone()));
        }
        if body.len() > self.cfg.max_message_len as usize {
            return Err(SendError::TooLarge {
                len: body.len(),
                max: self.cfg.max_message_len,
                body: body.clone(),
            });
        }
        Ok(())
    }

    fn enqueue(&mut self, header: Header, body: Payload) -> Result<(), SendError> {
        if self.queue.len() >= self.cfg.send_queue_limit {
            return Err(SendError::QueueFull(body));
        }
        let charged = if self.cfg.budget.is_some() {
            body.len()
        } else {
            0
        };
        if !self.charge(charged) {
            return Err(SendError::OverBudget(body));
        }
        self.queue.push_back(Outgoing {
            header,
            body,
            sent: 0,
            started: false,
            charged,
        });
        Ok(())
    }

    fn push_control(&mut self, header: Header, body: Payload) {
        self.control.push_back(Outgoing {
            header,
            body,
            sent: 0,
            started: false,
            charged: 0,
        });
    }

    fn should_grant(&self) -> bool {
        let w = self.cfg.recv_window;
        self.owed_credit > 0 && (self.owed_credit >= (w / 4).max(1) || self.peer_credit < w / 2)
    }

    /// Write the next frame (or chunk) of `o`. Ok(false) when the backend
    /// has no room; `o` is unchanged then.
    fn write_frame<T: FrameTx + ?Sized>(
        &mut self,
        t: &mut T,
        o: &mut Outgoing,
    ) -> Result<bool, ConnError> {
        let max_body = self.max_frame_len - HEADER_LEN;
        let total = o.body.len();
        let remaining = total - o.sent;
        let n = remaining.min(max_body);
        let mut h = o.header;
        let mut flags = h.flags;
        if n < remaining {
            flags = flags.with(Flags::MORE);
        }
        if o.started {
            flags = flags.with(Flags::CONTINUATION);
        }
        h.flags = flags;
        h.body_len = n as u32;
        h.message_len = total as u32;
        let head = h.to_bytes();
        o.body.slice(o.sent, n, &mut self.scratch);
        let ok = t.tx_gather(&head, &self.scratch);
        self.scratch.clear();
        if !ok? {
            return Ok(false);
        }
        o.sent += n;
        o.started = true;
        Ok(true)
    }

    fn fatal(&mut self, e: ConnError) -> ConnError {
        self.fail_all(e.to_string());
        self.closed = true;
        self.drop_queue();
        self.control.clear();
        self.drop_reassembly();
        e
    }

    /// Abandon a message being reassembled, giving its bytes back.
    fn drop_reassembly(&mut self) {
        if let Some(r) = self.reassembly.take() {
            self.release(r.charged);
        }
    }

    fn fail_all(&mut self, why: String) {
        let mut ids: Vec<u64> = self.pending.drain().map(|(id, _)| id).collect();
        ids.sort_unstable();
        self.deadlines.clear();
        for id in ids {
            self.events.push_back(Event::RequestFailed {
                id,
                error: RequestError::ConnectionLost(why.clone()),
            });
        }
    }
}

/// Turn a complete message into an [`Incoming`], settling the pending
/// table for a response. A response to a request that is no longer pending
/// (cancelled, past its deadline, already answered, or never sent) is
/// discarded and counted in `unmatched`.
fn settle<'a>(
    pending: &mut HashMap<u64, Option<Instant>>,
    deadlines: &mut BTreeSet<(Instant, u64)>,
    unmatched: &mut u64,
    h: Header,
    body: &'a [u8],
) -> Option<Incoming<'a>> {
    if h.flags.contains(Flags::RESPONSE) {
        let Some(deadline) = pending.remove(&h.request_id) else {
            *unmatched += 1;
            return None;
        };
        if let Some(d) = deadline {
            deadlines.remove(&(d, h.request_id));
        }
        Some(Incoming::Response {
            id: h.request_id,
            opcode: h.opcode,
            status: h.status,
            body,
        })
    } else {
        Some(Incoming::Request {
            id: h.request_id,
            opcode: h.opcode,
            shard: h.shard_id,
            oneway: h.flags.contains(Flags::ONEWAY),
            body,
        })
    }
}

//! The message layer: a sans-IO connection core.
//!
//! A [`Connection`] turns a [`Transport`] (reliable ordered frames) into
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
use std::time::Instant;

use bytes::Bytes;
use starwire_wire::message::{Hello, Role, MAX_JOB_NAME_LEN};
use starwire_wire::{Flags, FrameError, Header, Opcode, Status, HEADER_LEN};
use thiserror::Error;

use crate::driver::FrameTx;
use crate::transport::TransportError;

/// The protocol version carried in the handshake.
pub const PROTOCOL_VERSION: u16 = 1;

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
}

/// A message payload: owned segments sent back to back (a gather list), so
/// tensors held in `Bytes` reach a vectored write without a copy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    segs: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// An empty body.
    pub fn empty() -> Self {
        Self::default()
    }
    /// A body of one segment.
    pub fn from_bytes(b: impl Into<Bytes>) -> Self {
        let b = b.into();
        let len = b.len();
        Self { segs: vec![b], len }
    }
    /// Append a segment.
    pub fn push(&mut self, b: Bytes) {
        self.len += b.len();
        if !b.is_empty() {
            self.segs.push(b);
        }
    }
    /// Move `other`'s segments to the end of this body.
    pub fn append(&mut self, other: Payload) {
        self.len += other.len;
        self.segs.extend(other.segs);
    }
    /// Total length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The segments.
    pub fn segments(&self) -> &[Bytes] {
        &self.segs
    }
    /// The segments covering `[from, from + n)`, sliced without copying.
    fn slice(&self, from: usize, n: usize, out: &mut Vec<Bytes>) {
        out.clear();
        let mut skip = from;
        let mut want = n;
        for s in &self.segs {
            if want == 0 {
                break;
            }
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            let take = (s.len() - skip).min(want);
            out.push(s.slice(skip..skip + take));
            want -= take;
            skip = 0;
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Self::from_bytes(v)
    }
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
}

#[derive(Debug)]
struct Reassembly {
    header: Header,
    buf: Vec<u8>,
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
            flags: 0,
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
        if let Some(pos) = self.queue.iter().position(|o| {
            o.header.request_id == id && !o.started && !o.header.flags.contains(Flags::RESPONSE)
        }) {
            self.queue.remove(pos);
        } else if !self.closed {
            self.push_control(Header::new(Opcode::Cancel, id, 0), Payload::empty());
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
        self.queue.clear();
        self.push_control(Header::new(Opcode::Goodbye, 0, 0), Payload::empty());
        self.fail_all("closed locally".into());
        self.closed = true;
    }

    /// The backend failed or the peer vanished: fail everything pending.
    pub fn handle_transport_error(&mut self, err: &TransportError) {
        if !self.closed {
            self.fail_all(err.to_string());
            self.closed = true;
            self.queue.clear();
            self.control.clear();
        }
    }

    /// The next instant at which [`handle_timeout`](Self::handle_timeout)
    /// has work (the earliest deadline).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Fail every request whose deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&(d, id)) = self.deadlines.first() {
            if d > now {
                break;
            }
            self.deadlines.pop_first();
            if self.pending.remove(&id).is_some() {
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
            || (!self.queue.is_empty() && self.send_credit > 0)
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
        if self.closed {
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
            self.send_credit -= 1;
            if o.sent < o.body.len() {
                // More chunks to go; they keep the link until done so the
                // receiver reassembles one message at a time.
                self.queue.push_front(o);
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
        if h.opcode == Opcode::Hello {
            return self.handle_hello(body).map(|()| None);
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
            return Ok(settle(&mut self.pending, &mut self.deadlines, h, body));
        }
        match (&mut self.reassembly, cont) {
            (None, false) => {
                // First chunk. The untrusted message_len is bounded but not
                // allocated up front: room for at most 16 chunks like this
                // one, so a frame can make the receiver reserve at most 16
                // times its own size. Messages of up to 16 chunks (1 MiB
                // in 64 KiB frames) then never grow, and growing by
                // doubling copied each message about once more (7% of a
                // 1 MiB stream's time over io_uring).
                let room = (h.message_len as usize).min(body.len().max(1) * 16);
                let mut buf = Vec::with_capacity(room);
                buf.extend_from_slice(body);
                self.reassembly = Some(Reassembly { header: h, buf });
                Ok(None)
            }
            (Some(r), true) => {
                let first = r.header;
                if first.request_id != h.request_id
                    || first.opcode != h.opcode
                    || first.flags.contains(Flags::RESPONSE) != h.flags.contains(Flags::RESPONSE)
                    || first.message_len != h.message_len
                    || r.buf.len() + body.len() > first.message_len as usize
                {
                    return Err(
                        self.fatal(ConnError::Protocol("chunk does not continue its message"))
                    );
                }
                r.buf.extend_from_slice(body);
                if more {
                    return Ok(None);
                }
                if r.buf.len() != first.message_len as usize {
                    return Err(self.fatal(ConnError::Protocol(
                        "chunked message shorter than announced",
                    )));
                }
                let r = self.reassembly.take().expect("matched Some above");
                let header = r.header;
                *reassembled = r.buf;
                let body: &'a Vec<u8> = reassembled;
                Ok(settle(&mut self.pending, &mut self.deadlines, header, body))
            }
            _ => Err(self.fatal(ConnError::Protocol("chunk out of sequence"))),
        }
    }

    fn handle_hello(&mut self, body: &[u8]) -> Result<(), ConnError> {
        if self.peer.is_some() {
            return Err(self.fatal(ConnError::Protocol("second handshake")));
        }
        let hello = match Hello::parse(body) {
            Ok(h) => h,
            Err(e) => return Err(self.fatal(ConnError::Handshake(e.to_string()))),
        };
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(self.fatal(ConnError::Handshake(format!(
                "peer speaks protocol version {}, this build speaks {}",
                hello.protocol_version, PROTOCOL_VERSION
            ))));
        }
        if (hello.max_frame_len as usize) < HEADER_LEN + 64 {
            return Err(self.fatal(ConnError::Handshake(format!(
                "peer's maximum frame of {} bytes is too small",
                hello.max_frame_len
            ))));
        }
        self.max_frame_len = self.max_frame_len.min(hello.max_frame_len as usize);
        self.send_credit = self.send_credit.saturating_add(hello.initial_credits);
        let peer = PeerInfo {
            role: match hello.role {
                Role::Ps => TaskRole::Ps,
                Role::Worker => TaskRole::Worker,
            },
            job: hello.job_name.to_owned(),
            task_index: hello.task_index,
            incarnation: hello.incarnation,
            shards: hello.shard_count,
        };
        if let Some(previous) = self.cfg.known_peer_incarnation {
            if previous != peer.incarnation {
                self.events.push_back(Event::PeerRestarted {
                    previous,
                    peer: peer.clone(),
                });
            }
        }
        self.events.push_back(Event::Connected(peer.clone()));
        self.peer = Some(peer);
        Ok(())
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
        self.queue.push_back(Outgoing {
            header,
            body,
            sent: 0,
            started: false,
        });
        Ok(())
    }

    fn push_control(&mut self, header: Header, body: Payload) {
        self.control.push_back(Outgoing {
            header,
            body,
            sent: 0,
            started: false,
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
        self.queue.clear();
        self.control.clear();
        e
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
/// (cancelled, or past its deadline) is discarded.
fn settle<'a>(
    pending: &mut HashMap<u64, Option<Instant>>,
    deadlines: &mut BTreeSet<(Instant, u64)>,
    h: Header,
    body: &'a [u8],
) -> Option<Incoming<'a>> {
    if h.flags.contains(Flags::RESPONSE) {
        let deadline = pending.remove(&h.request_id)?;
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

//! The PS side: one reactor per shard. Each reactor owns its shard's state
//! (a [`PsHandler`]) and the connections of every worker to that shard, and
//! serves pull, push and control requests run-to-completion on its core:
//! decoding, the embedding lookup or optimizer update, and encoding the
//! reply all happen inside the reactor's turn, with no lock and no hand-off.

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::BorrowedFd;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_transport::reactor::{park_in_shared_driver, ParkEnd, ParkWaker, Shard};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{
    Body, ConnConfig, Connection, DrivenTransport, Incoming, Session, Transport,
};
use starwire_wire::ps::Control;

use crate::link::Binder;

/// Why a request failed; the status goes back to the worker, the connection
/// lives on.
#[derive(Debug)]
pub struct HandlerError {
    /// The status for the reply.
    pub status: Status,
    /// A human-readable reason, sent as the reply body.
    pub message: String,
}

/// A shard's state as the reactor sees it.
pub trait PsHandler: Send + 'static {
    /// Answer a pull into `out`.
    fn pull(&mut self, body: &[u8], out: &mut Vec<u8>) -> Result<(), HandlerError>;
    /// Apply a push and write its reply into `out`.
    fn push(&mut self, body: &[u8], out: &mut Vec<u8>) -> Result<(), HandlerError>;
    /// The shard's global step.
    fn global_step(&self) -> u64;
    /// Write the shard's checkpoint file into `dir`.
    fn checkpoint(&mut self, dir: &str) -> Result<(), String>;
    /// The shard's counters as JSON.
    fn stats(&self) -> serde_json::Value;
}

/// One shard reactor's state. See the module documentation.
#[derive(Debug)]
pub struct PsReactor<H, B: Binder> {
    index: usize,
    handler: H,
    conn_cfg: ConnConfig,
    binder: Option<B>,
    inbox: Receiver<TcpStream>,
    sessions: Vec<Option<Session<B::Link>>>,
    /// Per session slot: the worker said `DONE` or its connection ended.
    done: Vec<bool>,
    /// Barrier requests waiting for the global step: (session, id, step).
    waiting: Vec<(usize, u64, u64)>,
    expected_workers: usize,
    done_workers: usize,
    out: Vec<u8>,
    /// Replies handed to the transport, kept to reuse their buffers once it
    /// has sent and dropped them (see [`reuse_reply`]).
    lent: Vec<Bytes>,
    /// Requests served, by kind.
    pub served: HashMap<&'static str, u64>,
    /// Requests answered with an error status.
    pub failed: u64,
    /// Connections that ended (closed by the worker or broken).
    pub closed_connections: u64,
}

impl<H: PsHandler, B: Binder> PsReactor<H, B> {
    /// A shard reactor that finishes once `expected_workers` workers have
    /// sent `DONE` (0: never). `binder` makes transports of the sockets the
    /// acceptor sends to `inbox`; without one (the backend failed to start
    /// on this thread) the reactor finishes at once.
    pub fn new(
        index: usize,
        handler: H,
        conn_cfg: ConnConfig,
        binder: Option<B>,
        inbox: Receiver<TcpStream>,
        expected_workers: usize,
    ) -> Self {
        Self {
            index,
            handler,
            conn_cfg,
            binder,
            inbox,
            sessions: Vec::new(),
            done: Vec::new(),
            waiting: Vec::new(),
            expected_workers,
            done_workers: 0,
            out: Vec::new(),
            lent: Vec::new(),
            served: HashMap::new(),
            failed: 0,
            closed_connections: 0,
        }
    }

    /// The shard state, e.g. to read counters after the run.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The shard index.
    pub fn index(&self) -> usize {
        self.index
    }

    fn accept(&mut self) -> bool {
        let mut any = false;
        while let Ok(stream) = self.inbox.try_recv() {
            let Some(binder) = self.binder.as_mut() else {
                continue;
            };
            let t = match binder.bind(stream) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(shard = self.index, "binding a connection: {e}");
                    continue;
                }
            };
            let s = Session::new(self.conn_cfg.clone(), t);
            if let Some(i) = self.sessions.iter().position(Option::is_none) {
                self.sessions[i] = Some(s);
                self.done[i] = false;
            } else {
                self.sessions.push(Some(s));
                self.done.push(false);
            }
            any = true;
        }
        any
    }

    fn release_waiters(&mut self) -> bool {
        let step = self.handler.global_step();
        let mut any = false;
        let mut i = 0;
        while i < self.waiting.len() {
            let (si, id, n) = self.waiting[i];
            if step >= n {
                self.waiting.swap_remove(i);
                if let Some(Some(s)) = self.sessions.get_mut(si) {
                    let body = Body::from_bytes(Bytes::copy_from_slice(&step.to_le_bytes()));
                    // A full queue or closed connection fails the worker's
                    // barrier through its own connection error.
                    let _ = s.conn().respond(id, Opcode::Rpc, Status::Ok, body);
                }
                any = true;
            } else {
                i += 1;
            }
        }
        any
    }
}

/// What serving one request decided.
#[derive(Debug)]
pub enum Reply {
    /// Answer now with this status and body.
    Now(Status, Vec<u8>),
    /// Answer once the global step reaches this value (`WAIT_STEP`).
    Wait(u64),
    /// The worker is done (`DONE`); answer with an empty body.
    Done,
}

/// Serve one request against `handler`: the same for every backend. `out`
/// is a scratch buffer whose capacity is reused.
pub fn serve<H: PsHandler>(
    handler: &mut H,
    out: &mut Vec<u8>,
    opcode: Opcode,
    body: &[u8],
    served: &mut HashMap<&'static str, u64>,
    failed: &mut u64,
) -> Reply {
    serve_into(
        handler,
        out,
        Vec::with_capacity,
        opcode,
        body,
        served,
        failed,
    )
}

/// [`serve`], where `next(capacity)` gives the buffer that replaces `out`
/// once a reply leaves in it.
pub fn serve_into<H: PsHandler>(
    handler: &mut H,
    out: &mut Vec<u8>,
    next: impl FnOnce(usize) -> Vec<u8>,
    opcode: Opcode,
    body: &[u8],
    served: &mut HashMap<&'static str, u64>,
    failed: &mut u64,
) -> Reply {
    out.clear();
    let (kind, r) = match opcode {
        Opcode::SparsePull => ("pull", handler.pull(body, out)),
        Opcode::SparsePush => ("push", handler.push(body, out)),
        Opcode::Rpc => match Control::parse(body) {
            Ok(Control::WaitStep(n)) => return Reply::Wait(n),
            Ok(Control::Done) => return Reply::Done,
            Ok(Control::Stats) => {
                let v = handler.stats();
                (
                    "stats",
                    serde_json::to_writer(&mut *out, &v).map_err(|e| HandlerError {
                        status: Status::Internal,
                        message: e.to_string(),
                    }),
                )
            }
            Ok(Control::Checkpoint(dir)) => (
                "checkpoint",
                handler.checkpoint(dir).map_err(|message| HandlerError {
                    status: Status::Internal,
                    message,
                }),
            ),
            Err(e) => (
                "control",
                Err(HandlerError {
                    status: Status::UnknownMethod,
                    message: e.to_string(),
                }),
            ),
        },
        _ => (
            "other",
            Err(HandlerError {
                status: Status::UnknownMethod,
                message: format!("opcode {opcode:?} is not served by a PS shard"),
            }),
        ),
    };
    *served.entry(kind).or_default() += 1;
    match r {
        Ok(()) => {
            // The reply leaves as an owned `Bytes`; the next one starts
            // with (at least) the same capacity so it grows at most once.
            let cap = out.len();
            Reply::Now(Status::Ok, std::mem::replace(out, next(cap)))
        }
        Err(e) => {
            *failed += 1;
            Reply::Now(e.status, e.message.into_bytes())
        }
    }
}

/// At most this many sent replies are kept for their buffers.
const MAX_LENT: usize = 8;

/// A buffer of at least `cap` bytes for the next reply: the buffer of a
/// reply the transport has sent and dropped (its pages are mapped and warm,
/// so writing the next reply into it takes no page fault), or a new one.
fn reuse_reply(lent: &mut Vec<Bytes>, cap: usize) -> Vec<u8> {
    let mut i = 0;
    while i < lent.len() {
        if !lent[i].is_unique() {
            i += 1;
            continue;
        }
        // Only this clone is left: the transport is done with it.
        match lent.swap_remove(i).try_into_mut() {
            Ok(b) => {
                let mut v = Vec::from(b);
                if v.capacity() >= cap {
                    v.clear();
                    return v;
                }
            }
            Err(_) => continue,
        }
    }
    Vec::with_capacity(cap)
}

impl<H: PsHandler, B: Binder> Shard for PsReactor<H, B> {
    fn turn(&mut self, now: Instant) -> bool {
        let mut busy = self.accept();
        let Self {
            handler,
            sessions,
            done,
            out,
            lent,
            served,
            failed,
            waiting,
            done_workers,
            closed_connections,
            ..
        } = self;
        for (si, slot) in sessions.iter_mut().enumerate() {
            let Some(s) = slot else { continue };
            let mut broken = false;
            let is_done = &mut done[si];
            let mut on_msg = |conn: &mut Connection, m: Incoming<'_>| {
                let Incoming::Request {
                    id,
                    opcode,
                    oneway,
                    body,
                    ..
                } = m
                else {
                    return;
                };
                let next = |cap| reuse_reply(lent, cap);
                match serve_into(handler, out, next, opcode, body, served, failed) {
                    Reply::Now(status, bytes) if !oneway => {
                        let bytes = Bytes::from(bytes);
                        if status == Status::Ok && lent.len() < MAX_LENT {
                            lent.push(bytes.clone());
                        }
                        // A reply that cannot be queued would leave the
                        // worker waiting: end the connection instead.
                        broken |= conn
                            .respond(id, opcode, status, Body::from_bytes(bytes))
                            .is_err();
                    }
                    Reply::Now(..) => {}
                    // One barrier at a time per connection.
                    Reply::Wait(_) if waiting.iter().any(|w| w.0 == si) => broken = true,
                    Reply::Wait(n) => waiting.push((si, id, n)),
                    Reply::Done => {
                        if !std::mem::replace(is_done, true) {
                            *done_workers += 1;
                        }
                        if !oneway {
                            broken |= conn.respond(id, opcode, Status::Ok, Body::empty()).is_err();
                        }
                    }
                }
            };
            let r = s.turn(now, &mut on_msg);
            let r = match r {
                Ok(_) if broken => Err(starwire_transport::ConnError::Protocol(
                    "a reply could not be queued, or a second barrier was asked",
                )),
                r => r,
            };
            match r {
                Ok(st) => busy |= st.busy(),
                Err(e) => {
                    // The worker left or broke the protocol: this
                    // connection ends, the shard serves the others.
                    if !matches!(e, starwire_transport::ConnError::Closed) {
                        tracing::debug!(shard = si, "connection ended: {e}");
                    }
                    *closed_connections += 1;
                    waiting.retain(|w| w.0 != si);
                    // A worker that is gone will say nothing more: it
                    // counts as done, so the shard does not wait for ever.
                    // A peer that never completed the handshake was no
                    // worker and does not count.
                    let was_worker = s.conn_ref().peer().is_some();
                    if was_worker && !std::mem::replace(&mut done[si], true) {
                        *done_workers += 1;
                    }
                    *slot = None;
                    busy = true;
                }
            }
        }
        if let Some(s) = sessions.iter().flatten().next() {
            busy |= s.transport().end_turn();
        }
        busy | self.release_waiters()
    }

    fn wake_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        for s in self.sessions.iter().flatten() {
            out.push(s.transport().wake_fd());
        }
    }

    fn write_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        out.extend(
            self.sessions
                .iter()
                .flatten()
                .filter_map(|s| s.transport().write_fd()),
        );
    }

    /// Parks in the connections' ring when they share one (uring).
    fn park(&self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        let live = self.sessions.iter().flatten();
        park_in_shared_driver(live.map(|s| s.transport()), waker, timeout)
    }

    fn finished(&self) -> bool {
        if self.binder.is_none() {
            return true;
        }
        self.expected_workers > 0
            && self.done_workers >= self.expected_workers
            && self
                .sessions
                .iter()
                .flatten()
                .all(|s| !s.conn_ref().wants_transmit() && !s.transport().tx_pending())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sent_reply_buffer_is_reused_once_the_transport_dropped_it() {
        let mut lent = Vec::new();
        let mut v = Vec::with_capacity(4096);
        v.extend_from_slice(&[7u8; 3000]);
        let at = v.as_ptr();
        let sent = Bytes::from(v);
        lent.push(sent.clone());
        // Still held by the transport: a new buffer.
        let other = reuse_reply(&mut lent, 3000);
        assert_ne!(other.as_ptr(), at);
        assert_eq!(lent.len(), 1);
        drop(sent);
        // Sent and dropped: its buffer comes back, empty.
        let back = reuse_reply(&mut lent, 3000);
        assert_eq!(back.as_ptr(), at);
        assert!(back.is_empty() && back.capacity() >= 3000);
        assert!(lent.is_empty());
        // Too small for the next reply: dropped, and a new one is made.
        lent.push(Bytes::from(vec![1u8; 10]));
        assert!(reuse_reply(&mut lent, 3000).capacity() >= 3000);
        assert!(lent.is_empty());
    }
}

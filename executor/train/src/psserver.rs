//! The PS side of the protocol, sans-IO: what a shard does with each
//! request, whatever carries it.
//!
//! * [`Service`] serves one request against a [`PsHandler`] (decode, lookup
//!   or update, encode) and says how to answer it ([`Reply`]). Every
//!   backend uses it: the reactors through [`PsServer`], the lock-based
//!   backends (`inproc`, `grpc`) directly.
//! * [`PsServer`] is a shard's protocol state over its connections: it
//!   queues each reply on the connection the request came from, holds
//!   `WAIT_STEP` barriers until the global step reaches them
//!   ([`PsServer::poll_release`]), with the requests that came in behind a
//!   barrier on its connection, and counts the workers that are done and
//!   those whose connection ended before they said `DONE` (lost).
//!   Holding what follows a barrier lets a worker send a step's push, the
//!   wait for its turn and the next pull in one exchange: the pull is
//!   answered, in order, once the barrier is.
//!   It never reads a clock or touches a socket: messages come in through
//!   [`PsServer::handle_message`], replies go out as frames queued on the
//!   [`Connection`], and the reactor (`server.rs`) moves them.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use starwire_ps::Position;
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{Connection, Incoming, MemoryBudget, Payload, SendError, TaskRole};
use starwire_wire::ps::{write_push_response, Control, Limits, PushRequest};
use thiserror::Error;

use crate::syncstep::{step_marker, SyncStep};

/// Why a request failed; the status goes back to the worker, the connection
/// lives on.
#[derive(Debug)]
pub struct HandlerError {
    /// The status for the reply.
    pub status: Status,
    /// A human-readable reason, sent as the reply body.
    pub message: String,
}

/// A shard's state as the protocol sees it.
pub trait PsHandler: Send + 'static {
    /// Answer a pull into `out`.
    fn pull(&mut self, body: &[u8], out: &mut Vec<u8>) -> Result<(), HandlerError>;
    /// Apply a push and write its reply into `out`.
    fn push(&mut self, body: &[u8], out: &mut Vec<u8>) -> Result<(), HandlerError>;
    /// [`Self::pull`] of worker `worker` (its task index), when known: a
    /// shard whose optimizer reads what a push was computed on
    /// (`dc_asgd`, `--staleness-lr`) keeps it. With `shared`, the reply
    /// leaves as shared bytes, given to [`Self::pull_sent`] as it leaves,
    /// and what the shard keeps of the pull may refer to them rather than
    /// copy them.
    fn pull_from(
        &mut self,
        worker: Option<u32>,
        shared: bool,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HandlerError>;
    /// The reply of worker `worker`'s last [`Self::pull_from`] with
    /// `shared`, as it leaves.
    fn pull_sent(&mut self, worker: u32, reply: &Bytes);
    /// A push of worker `worker` (its task index), asynchronously: as
    /// [`push`](Self::push), applied with what the worker pulled last,
    /// unless the shard applied this push of the worker before (a
    /// restarted worker replaying a step; see `starwire_ps::applied`):
    /// then it is only acknowledged.
    fn push_from(
        &mut self,
        worker: u32,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HandlerError>;
    /// With `--sync`, a push of worker `worker` about to be kept for its
    /// step (`completes`: the step's last): false when the shard holds that
    /// push already (a restarted worker replaying its step), which is then
    /// only acknowledged. See `starwire_ps::applied`.
    fn number_push(&mut self, worker: u32, completes: bool) -> Result<bool, HandlerError>;
    /// The push [`number_push`](Self::number_push) let through was kept.
    fn push_kept(&mut self, worker: u32);
    /// With `--sync`, before a worker's push is kept: the error
    /// [`push`](Self::push) would refuse it with for what the shard holds
    /// (a variable it does not have, of another kind or width, gradients
    /// that are not finite), found without changing the shard's state. A
    /// push refused here is counted in the shard's errors (once: it never
    /// reaches the shard again); one that passes is counted with the merged
    /// push of its step.
    fn check_push(&mut self, body: &[u8]) -> Result<(), HandlerError>;
    /// The position of worker `worker`'s pushes the shard counts as
    /// applied (the default if it never heard from the worker).
    fn applied_position(&self, worker: u32) -> Position;
    /// Take worker `worker`'s applied position back to `to`: the pushes
    /// after it were kept for a step never applied.
    fn rewind_applied(&mut self, worker: u32, to: Position);
    /// Worker `worker`'s next push is the first of its step `step`
    /// (`RESUME_AT`, a restarted worker).
    fn resume_at(&mut self, worker: u32, step: u64) -> Result<(), String>;
    /// Whether global step `step` is a checkpoint step, as the first vote
    /// on it decided (`CHECKPOINT_VOTE`, asynchronous
    /// `--checkpoint-every-secs`).
    fn checkpoint_vote(&mut self, step: u64, want: bool) -> bool;
    /// The shard's global step.
    fn global_step(&self) -> u64;
    /// Write the shard's checkpoint file into `dir`; the reply, written
    /// into `out`, is the global step the file holds (`u64`
    /// little-endian), for the manifest.
    fn checkpoint(&mut self, dir: &str, out: &mut Vec<u8>) -> Result<(), String>;
    /// Write the shard's checkpoint file into its checkpoint directory's
    /// `steps/c/` when a push makes the global step `c`
    /// (`CHECKPOINT_AT`, `--checkpoint-every-secs`).
    fn checkpoint_at(&mut self, c: u64) -> Result<(), String>;
    /// The shard's counters as JSON.
    fn stats(&self) -> serde_json::Value;
}

/// What serving one request decided.
#[derive(Debug)]
pub enum Reply {
    /// Answer now with this status and body.
    Now(Status, Bytes),
    /// Answer once the global step reaches this value (`WAIT_STEP`).
    Wait(u64),
    /// The worker is done (`DONE`); answer with an empty body.
    Done,
}

/// A handler and what serving it keeps between requests: the scratch
/// buffer replies are written into, counters, and with `--sync` the
/// pushes of the step being gathered.
#[derive(Debug)]
pub struct Service<H> {
    handler: H,
    out: Vec<u8>,
    served: HashMap<&'static str, u64>,
    failed: u64,
    sync: Option<SyncStep>,
    /// With `--sync`, per worker: why its last push was refused, or its
    /// kept pushes dropped with a step the shard refused, until a push of
    /// it is kept again. Its `WAIT_STEP` cannot be reached without that
    /// push, so it is answered with this error instead of being held.
    refused: Vec<Option<Refusal>>,
    /// Workers' pull replies are kept by the shard as they leave
    /// ([`PsHandler::pull_sent`]).
    share_pulls: bool,
}

/// Who sent a request, as far as the transport can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sender {
    /// A transport that does not name its peers (the gRPC baseline).
    Anonymous,
    /// The worker of this task index.
    Worker(u32),
    /// A peer the handshake named as no worker.
    Peer,
}

/// Why a worker's `WAIT_STEP` fails at once (`--sync`): the status and
/// reason of the refusal.
type Refusal = (Status, String);

/// Worker `worker`'s refusal in `refused`, if it has one.
fn refusal(refused: &[Option<Refusal>], worker: Option<u32>) -> Option<(Status, &str)> {
    let (status, why) = refused.get(worker? as usize)?.as_ref()?;
    Some((*status, why.as_str()))
}

impl<H: PsHandler> Service<H> {
    /// Serve requests against `handler`.
    pub fn new(handler: H) -> Self {
        Self {
            handler,
            out: Vec::new(),
            served: HashMap::new(),
            failed: 0,
            sync: None,
            refused: Vec::new(),
            share_pulls: false,
        }
    }

    /// A worker's pull is served shared ([`PsHandler::pull_from`]) and its
    /// reply given to [`PsHandler::pull_sent`]: for a server whose replies
    /// leave as they are ([`PsServer`]), not for one whose caller takes
    /// the reply's buffer back (`inproc`).
    #[must_use]
    pub fn sharing_pull_replies(mut self) -> Self {
        self.share_pulls = true;
        self
    }

    /// Synchronous SGD over `workers` workers (`--sync`): the pushes of a
    /// step that name their worker ([`serve_from`](Self::serve_from)) are
    /// gathered and applied once, in worker-index order, when every worker
    /// has pushed the step ([`crate::syncstep`]), the pushes kept charged
    /// to `budget` (the task's `--memory-budget-mb`).
    #[must_use]
    pub fn with_sync(mut self, workers: usize, budget: MemoryBudget) -> Self {
        self.set_sync(workers, budget);
        self
    }

    /// What [`with_sync`](Self::with_sync) does, in place.
    fn set_sync(&mut self, workers: usize, budget: MemoryBudget) {
        // The shard checks the merged push against its own limits; each
        // worker's push is checked against the codec's defaults on arrival.
        self.sync = Some(SyncStep::new(workers, Limits::default(), budget));
        self.refused = vec![None; workers];
    }

    /// The shard state.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// Before a checkpoint of a shard stopped mid-step (`--sync`, SIGTERM):
    /// the pushes kept for the step being gathered are not in the shard's
    /// values, so the positions they moved go back to where they were. The
    /// checkpoint then counts only the steps it holds, and a worker
    /// restored from it pushes the step again.
    pub fn rewind_kept(&mut self) {
        if let Some(sync) = &self.sync {
            for (w, at) in sync.kept_from() {
                self.handler.rewind_applied(w, at);
            }
        }
    }

    /// With `--sync`: why a `WAIT_STEP` of worker `worker` for global step
    /// `n` fails now rather than being held: the worker's last push was
    /// refused, or its kept pushes were dropped with a step the shard
    /// refused, and the global step has not reached `n` (the step needs
    /// that worker's push again).
    pub fn barrier_refused(&self, worker: Option<u32>, n: u64) -> Option<(Status, &str)> {
        refusal(&self.refused, worker).filter(|_| self.handler.global_step() < n)
    }

    /// Requests served, by kind (`pull`, `push`, `stats`, ...).
    pub fn served(&self) -> &HashMap<&'static str, u64> {
        &self.served
    }

    /// Requests answered with an error status.
    pub fn failed(&self) -> u64 {
        self.failed
    }

    /// Serve one request of a sender the transport cannot name (the gRPC
    /// baseline's). A reply that leaves takes the scratch buffer with it;
    /// `next(capacity)` gives the buffer that replaces it.
    pub fn serve(
        &mut self,
        opcode: Opcode,
        body: &[u8],
        next: impl FnOnce(usize) -> Vec<u8>,
    ) -> Reply {
        self.serve_as(Sender::Anonymous, opcode, body, next)
    }

    /// Serve one request of worker `from` (its task index), or of a peer
    /// the handshake named as no worker (`None`): as
    /// [`serve`](Self::serve), and with [`with_sync`](Self::with_sync) a
    /// worker's push joins its step. What only workers send is refused
    /// from a peer that is not one: a push under `--sync` (it would move
    /// the global step past the gathered step's barriers),
    /// `CHECKPOINT_VOTE`, and `CHECKPOINT_AT` but from worker 0 (a vote or
    /// a checkpoint step of another peer's choosing would put off or drop
    /// the run's checkpoints).
    pub fn serve_from(
        &mut self,
        from: Option<u32>,
        opcode: Opcode,
        body: &[u8],
        next: impl FnOnce(usize) -> Vec<u8>,
    ) -> Reply {
        let sender = from.map_or(Sender::Peer, Sender::Worker);
        self.serve_as(sender, opcode, body, next)
    }

    fn serve_as(
        &mut self,
        sender: Sender,
        opcode: Opcode,
        body: &[u8],
        next: impl FnOnce(usize) -> Vec<u8>,
    ) -> Reply {
        let from = match sender {
            Sender::Worker(w) => Some(w),
            Sender::Anonymous | Sender::Peer => None,
        };
        let named = sender != Sender::Anonymous;
        let Self {
            handler,
            out,
            served,
            failed,
            sync,
            refused,
            share_pulls,
        } = self;
        let shared = from.filter(|_| *share_pulls && opcode == Opcode::SparsePull);
        out.clear();
        // A worker's pushes are numbered per worker (with --sync as its step
        // gathers them), so a restarted worker's replayed step is not
        // applied twice.
        let async_from = from.filter(|_| sync.is_none());
        let gathering = sync.is_some();
        let (kind, r) = match (opcode, sync.as_mut().zip(from)) {
            (Opcode::SparsePull, _) => {
                ("pull", handler.pull_from(from, shared.is_some(), body, out))
            }
            (Opcode::SparsePush, Some((sync, w))) => {
                let r = push_sync(handler, sync, refused, w, body, out);
                let why = r.as_ref().err().map(|e| (e.status, e.message.clone()));
                if let Some(slot) = refused.get_mut(w as usize) {
                    *slot = why;
                }
                ("push", r)
            }
            (Opcode::SparsePush, None) if gathering && named => (
                "push",
                Err(HandlerError {
                    status: Status::BadRequest,
                    message: "a push from a peer that is not a worker: --sync gathers each \
                              worker's pushes"
                        .into(),
                }),
            ),
            (Opcode::SparsePush, None) => match async_from {
                Some(w) => ("push", handler.push_from(w, body, out)),
                None => ("push", handler.push(body, out)),
            },
            (Opcode::Rpc, s) => match Control::parse(body) {
                Ok(Control::WaitStep(n)) => match refusal(refused, from) {
                    Some((status, why)) if handler.global_step() < n => {
                        *failed += 1;
                        let m = format!("WAIT_STEP {n} cannot be reached: {why}");
                        return Reply::Now(status, Bytes::from(m.into_bytes()));
                    }
                    _ => return Reply::Wait(n),
                },
                Ok(Control::Done) => {
                    if let Some((sync, w)) = s {
                        done_sync(handler, sync, refused, w, out);
                    }
                    return Reply::Done;
                }
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
                Ok(Control::CheckpointAt(_)) if named && from != Some(0) => (
                    "checkpoint",
                    Err(HandlerError {
                        status: Status::BadRequest,
                        message: "CHECKPOINT_AT from a peer that is not worker 0".into(),
                    }),
                ),
                Ok(Control::CheckpointAt(c)) => (
                    "checkpoint",
                    handler.checkpoint_at(c).map_err(|message| HandlerError {
                        status: Status::BadRequest,
                        message,
                    }),
                ),
                Ok(Control::CheckpointVote { .. }) if named && from.is_none() => (
                    "checkpoint",
                    Err(HandlerError {
                        status: Status::BadRequest,
                        message: "CHECKPOINT_VOTE from a peer that is not a worker".into(),
                    }),
                ),
                Ok(Control::CheckpointVote { step, want }) => {
                    out.push(u8::from(handler.checkpoint_vote(step, want)));
                    ("checkpoint", Ok(()))
                }
                Ok(Control::ResumeAt(step)) => (
                    "resume",
                    from.ok_or_else(|| "RESUME_AT from a peer that is not a worker".to_string())
                        .and_then(|w| handler.resume_at(w, step))
                        .map_err(|message| HandlerError {
                            status: Status::BadRequest,
                            message,
                        }),
                ),
                Ok(Control::Checkpoint(dir)) => (
                    "checkpoint",
                    handler
                        .checkpoint(dir, out)
                        .map_err(|message| HandlerError {
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
            (_, _) => (
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
                // The reply leaves as an owned buffer; the next one starts
                // with (at least) the same capacity so it grows at most once.
                let cap = out.len();
                let bytes = Bytes::from(std::mem::replace(out, next(cap)));
                if let Some(w) = shared {
                    handler.pull_sent(w, &bytes);
                }
                Reply::Now(Status::Ok, bytes)
            }
            Err(e) => {
                *failed += 1;
                Reply::Now(e.status, Bytes::from(e.message.into_bytes()))
            }
        }
    }
}

/// A worker's push of a synchronous step: kept until every worker has
/// pushed the step, then the step is applied. A push the shard holds
/// already (a restarted worker replaying the step it died in) is only
/// acknowledged. The reply carries the global step as it is after this
/// push.
///
/// A push is checked against the shard before it is kept
/// ([`PsHandler::check_push`]): one the shard would refuse fails with the
/// status an asynchronous push gets (`UnknownVariable`, `WrongShape`,
/// `NonFinite`), for its sender alone, and counts once in the shard's
/// errors. A refused push is not kept and
/// keeps no number: the worker's next push is numbered as this one was.
fn push_sync<H: PsHandler>(
    handler: &mut H,
    sync: &mut SyncStep,
    refused: &mut [Option<Refusal>],
    w: u32,
    body: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), HandlerError> {
    // A header that does not decode is the gatherer's error to report.
    if let Ok(completes) = PushRequest::peek_completes_step(body) {
        if !handler.number_push(w, completes)? {
            write_push_response(out, handler.global_step());
            return Ok(());
        }
    }
    let before = handler.applied_position(w);
    let kept = handler.check_push(body).and_then(|()| {
        sync.handle_push(w, body).map_err(|e| HandlerError {
            status: Status::BadRequest,
            message: e.to_string(),
        })
    });
    let complete = match kept {
        Ok(complete) => complete,
        Err(e) => {
            // `number_push` counted it: take the count back (the applied
            // position stays, only the next push's number goes back).
            handler.rewind_applied(w, before);
            return Err(e);
        }
    };
    sync.keeping(w, before);
    handler.push_kept(w);
    if complete {
        apply_step(handler, sync, refused, out)?;
    }
    write_push_response(out, handler.global_step());
    Ok(())
}

/// Worker `w` said `DONE`; if the step was waiting only for it, it is
/// applied. `DONE` has no error reply: an error is logged, and a step the
/// shard refused fails the barriers of the workers that pushed it
/// ([`apply_step`]).
fn done_sync<H: PsHandler>(
    handler: &mut H,
    sync: &mut SyncStep,
    refused: &mut [Option<Refusal>],
    w: u32,
    out: &mut Vec<u8>,
) {
    if sync.handle_done(w) {
        if let Err(e) = apply_step(handler, sync, refused, out) {
            tracing::error!(worker = w, "synchronous step: {}", e.message);
        }
    }
}

/// Apply the gathered step: the merged push, then one step marker per
/// other worker, so the global step moves by the worker count.
///
/// A merged push the shard refuses (a sum that is not finite) is not
/// applied, and the step's pushes are dropped: the applied positions they
/// moved go back to where they were before them, and every worker that
/// pushed the step is refused (its `WAIT_STEP` fails with the error): it
/// must push the step again. The error is the reply of the push that
/// completed the step, if a push did.
fn apply_step<H: PsHandler>(
    handler: &mut H,
    sync: &mut SyncStep,
    refused: &mut [Option<Refusal>],
    out: &mut Vec<u8>,
) -> Result<(), HandlerError> {
    let Some(merged) = sync.take_step() else {
        return Ok(());
    };
    let step = handler.global_step();
    let mut first = None;
    if let Err(e) = handler.push(merged, out) {
        let e = HandlerError {
            status: e.status,
            message: format!(
                "the synchronous step (every worker's push, summed): {}",
                e.message
            ),
        };
        if handler.global_step() == step {
            for (w, at) in sync.taken_from() {
                handler.rewind_applied(w, at);
                if let Some(slot) = refused.get_mut(w as usize) {
                    let why = format!(
                        "{}; not applied, and worker {w}'s pushes of it were dropped",
                        e.message
                    );
                    *slot = Some((e.status, why));
                }
            }
            return Err(e);
        }
        // Applied, but what its global step calls for after (a checkpoint
        // file) failed: the step stands, and the markers still move the
        // global step to where the barriers wait.
        first = Some(e);
    }
    let mut marker = Vec::new();
    for _ in 1..sync.workers() {
        out.clear();
        if let Err(e) = handler.push(step_marker(&mut marker), out) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Why a connection must end. The other connections are served on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A reply could not be queued (the send queue is full or the
    /// connection closed): the worker would wait for it for ever.
    #[error("{}", self.reason())]
    ReplyNotQueued,
}

impl ServeError {
    /// Why, in a few words.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ReplyNotQueued => "a reply could not be queued",
        }
    }
}

/// A `WAIT_STEP` barrier the global step has reached: answer request `id`
/// of connection `conn` with [`Release::body`]. Or, with `refused`, one
/// that cannot be reached ([`Service::barrier_refused`]): it is answered
/// with the refusal's error ([`PsServer::handle_release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// The connection the barrier came in on.
    pub conn: usize,
    /// Its request id.
    pub id: u64,
    /// The global step that released it.
    pub step: u64,
    /// It fails: its worker's push of the step it waits for was refused
    /// or dropped.
    pub refused: bool,
}

impl Release {
    /// The reply body: the global step, `u64` little-endian.
    pub fn body(&self) -> Payload {
        Payload::from_bytes(Bytes::copy_from_slice(&self.step.to_le_bytes()))
    }

    fn respond(&self, conn: &mut Connection) -> Result<(), ServeError> {
        conn.respond(self.id, Opcode::Rpc, Status::Ok, self.body())
            .map_err(|_| ServeError::ReplyNotQueued)
    }
}

/// At most this many sent replies are kept for their buffers.
const MAX_LENT: usize = 8;

/// At most this many requests are held behind a connection's barrier (a
/// worker's exchange sends one pull per shard fused, one per tensor
/// unfused); a request past it is answered with
/// [`Status::LimitExceeded`].
pub const MAX_HELD_REQUESTS: usize = 1024;

/// At most this many body bytes are held behind a connection's barrier.
pub const MAX_HELD_BYTES: usize = 64 << 20;

/// A request that came in behind its connection's barrier, kept to be
/// served in order once the barrier is answered.
#[derive(Debug)]
struct HeldRequest {
    id: u64,
    opcode: Opcode,
    oneway: bool,
    body: Vec<u8>,
}

/// What a shard keeps per connection.
#[derive(Debug, Default)]
struct ConnState {
    /// The worker said `DONE` on it.
    done: bool,
    /// A `WAIT_STEP` of it is held: what comes in after waits behind it.
    barrier: bool,
    /// The requests behind the barrier, in arrival order.
    held: VecDeque<HeldRequest>,
    /// Their body bytes.
    held_bytes: usize,
    /// It has sent a `WAIT_STEP`: its worker waits for its turns, so a
    /// push of it is likely followed by the wait for the next turn.
    waits: bool,
    /// Replies to its pushes not queued yet, (request id, reply): a push's
    /// reply waits for what follows it ([`PsServer::flush_deferred`]).
    deferred: Vec<(u64, Bytes)>,
}

/// The default of [`PsServer::with_max_wait_steps`] (`--max-wait-steps`).
pub const DEFAULT_MAX_WAIT_STEPS: u64 = 1 << 20;

/// A shard's protocol state over its connections. See the module
/// documentation. Connections are named by a key the caller chooses (the
/// reactor's slot index), announced with [`handle_open`](Self::handle_open).
#[derive(Debug)]
pub struct PsServer<H> {
    service: Service<H>,
    /// Replies handed to the transport, kept to reuse their buffers once it
    /// has sent and dropped them (see [`reuse_reply`]).
    lent: Vec<Bytes>,
    /// Per connection key: its state.
    conns: Vec<ConnState>,
    /// Barriers waiting for the global step: (connection, id, step, the
    /// worker that sent it).
    waiting: Vec<(usize, u64, u64, Option<u32>)>,
    /// Connections that may have deferred replies (see
    /// [`take_deferred`](Self::take_deferred)).
    deferred_conns: Vec<usize>,
    /// Every worker task seen, by task index: whether it said `DONE`
    /// (else its connection ended first: it is lost until it rejoins and
    /// says `DONE`). Counted by task, not by connection, so a worker that
    /// rejoins is not counted twice.
    workers: HashMap<u32, WorkerEnd>,
    expected_workers: usize,
    max_wait_steps: u64,
    /// The task's `--memory-budget-mb`, which the bodies held behind
    /// barriers are charged to ([`with_budget`](Self::with_budget)).
    budget: Option<MemoryBudget>,
}

/// The bodies still held go back to the budget (the task's other shards
/// go on with it).
impl<H> Drop for PsServer<H> {
    fn drop(&mut self) {
        let held: usize = self.conns.iter().map(|c| c.held_bytes).sum();
        if let (Some(b), 1..) = (&self.budget, held) {
            b.release(held);
        }
    }
}

/// How a worker task's connections to a shard ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkerEnd {
    Done,
    Lost,
}

impl<H: PsHandler> PsServer<H> {
    /// A shard that is finished once `expected_workers` workers are done
    /// (0: never).
    pub fn new(handler: H, expected_workers: usize) -> Self {
        Self {
            service: Service::new(handler).sharing_pull_replies(),
            lent: Vec::new(),
            conns: Vec::new(),
            waiting: Vec::new(),
            deferred_conns: Vec::new(),
            workers: HashMap::new(),
            expected_workers,
            max_wait_steps: DEFAULT_MAX_WAIT_STEPS,
            budget: None,
        }
    }

    /// Charge the bodies held behind barriers to `budget` (the task's
    /// `--memory-budget-mb`, which its connections' messages and replies
    /// are charged to): a request that would take it past its limit is
    /// answered [`Status::Overloaded`] instead of being held. Without
    /// one, only [`MAX_HELD_BYTES`] per connection bounds them.
    #[must_use]
    pub fn with_budget(mut self, budget: MemoryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Give back `n` held bytes to the budget.
    fn release_held(&self, n: usize) {
        if let (Some(b), 1..) = (&self.budget, n) {
            b.release(n);
        }
    }

    /// A `WAIT_STEP` for a step more than `n` steps ahead of the global
    /// step is answered with [`Status::LimitExceeded`] instead of being
    /// held (a barrier that far ahead would hold its request for ever).
    #[must_use]
    pub fn with_max_wait_steps(mut self, n: u64) -> Self {
        self.max_wait_steps = n;
        self
    }

    /// Synchronous SGD over `workers` workers ([`Service::with_sync`]).
    #[must_use]
    pub fn with_sync(mut self, workers: usize, budget: MemoryBudget) -> Self {
        self.service.set_sync(workers, budget);
        self
    }

    /// The shard state.
    pub fn handler(&self) -> &H {
        self.service.handler()
    }

    /// The request service and its counters.
    pub fn service(&self) -> &Service<H> {
        &self.service
    }

    /// Before a checkpoint of the stopped shard: see
    /// [`Service::rewind_kept`].
    pub fn rewind_kept(&mut self) {
        self.service.rewind_kept();
    }

    /// Connection `key` is new (a key may be reused once its connection
    /// was closed).
    pub fn handle_open(&mut self, key: usize) {
        let old = std::mem::take(self.conn_state(key));
        self.release_held(old.held_bytes);
    }

    /// One message from connection `key`: a request is served and its
    /// reply queued on `conn` (or held, for a barrier); a request behind a
    /// held barrier is held too, to be served once the barrier is
    /// answered ([`handle_release`](Self::handle_release)); anything else
    /// is ignored. An error ends the connection: the caller closes it and
    /// calls [`handle_close`](Self::handle_close).
    pub fn handle_message(
        &mut self,
        key: usize,
        conn: &mut Connection,
        m: Incoming<'_>,
    ) -> Result<(), ServeError> {
        let Incoming::Request {
            id,
            opcode,
            oneway,
            body,
            ..
        } = m
        else {
            return Ok(());
        };
        // A worker sends nothing behind its barrier but the rest of the
        // exchange (its pulls). A push behind it comes from a worker that
        // gave up on the barrier (its exchange failed): holding the push
        // could hold the very step the barrier waits for.
        while opcode == Opcode::SparsePush && self.conn_state(key).barrier {
            self.abandon_barrier(key, conn)?;
        }
        let state = self.conn_state(key);
        if !state.barrier {
            return self.serve_request(key, conn, id, opcode, oneway, body);
        }
        if state.held.len() >= MAX_HELD_REQUESTS
            || state.held_bytes.saturating_add(body.len()) > MAX_HELD_BYTES
        {
            if oneway {
                return Ok(());
            }
            self.service.failed += 1;
            let msg = format!(
                "more than {MAX_HELD_REQUESTS} requests or {MAX_HELD_BYTES} bytes behind a held \
                 WAIT_STEP"
            );
            return conn
                .respond_error(id, opcode, Status::LimitExceeded, &msg)
                .map_err(|_| ServeError::ReplyNotQueued);
        }
        if self
            .budget
            .as_ref()
            .is_some_and(|b| !b.try_charge(body.len()))
        {
            if oneway {
                return Ok(());
            }
            self.service.failed += 1;
            let msg = "the request does not fit in the PS's --memory-budget-mb behind a held \
                       WAIT_STEP now; retry";
            return conn
                .respond_error(id, opcode, Status::Overloaded, msg)
                .map_err(|_| ServeError::ReplyNotQueued);
        }
        let state = self.conn_state(key);
        state.held_bytes += body.len();
        state.held.push_back(HeldRequest {
            id,
            opcode,
            oneway,
            body: body.to_vec(),
        });
        Ok(())
    }

    /// Serve request `id` of connection `key` now: answer it, or hold it
    /// if it is a barrier the global step has not reached.
    ///
    /// The reply to an asynchronous push of a connection whose worker waits
    /// for its turns is deferred: that worker sends the push, the wait for
    /// its next turn and its next pulls in one exchange and needs every
    /// reply before it goes on, so the push's reply leaves with the wait's
    /// (when the barrier is answered) instead of waking the worker once
    /// more on its own. Anything else the connection sends, and the next
    /// turn of the reactor when nothing is held
    /// ([`take_deferred`](Self::take_deferred)), sends it first.
    fn serve_request(
        &mut self,
        key: usize,
        conn: &mut Connection,
        id: u64,
        opcode: Opcode,
        oneway: bool,
        body: &[u8],
    ) -> Result<(), ServeError> {
        let from = worker_index(conn);
        let reply = {
            let Self { service, lent, .. } = self;
            service.serve_from(from, opcode, body, |cap| reuse_reply(lent, cap))
        };
        let step = self.service.handler.global_step();
        let held_wait = matches!(reply, Reply::Wait(n) if n > step
            && n - step <= self.max_wait_steps);
        let state = self.conn_state(key);
        state.waits |= matches!(reply, Reply::Wait(_));
        let deferrable = state.waits
            && matches!(reply, Reply::Now(Status::Ok, _))
            && opcode == Opcode::SparsePush
            && !oneway
            && self.service.sync.is_none();
        if !held_wait && !deferrable {
            self.flush_deferred(key, conn)?;
        }
        let Self {
            service,
            lent,
            waiting,
            conns,
            deferred_conns,
            ..
        } = self;
        match reply {
            Reply::Now(..) if oneway => Ok(()),
            Reply::Now(status, bytes) => {
                if deferrable {
                    // A push's reply is a few bytes, written into a buffer
                    // sized for the largest reply: the copy is kept while
                    // the barrier holds, the buffer goes back for reuse.
                    let state = &mut conns[key];
                    if state.deferred.is_empty() {
                        deferred_conns.push(key);
                    }
                    state.deferred.push((id, Bytes::copy_from_slice(&bytes)));
                    if lent.len() < MAX_LENT {
                        lent.push(bytes);
                    }
                    return Ok(());
                }
                if status == Status::Ok && lent.len() < MAX_LENT {
                    lent.push(bytes.clone());
                }
                queue_reply(service, conn, id, opcode, status, bytes)
            }
            Reply::Wait(n) if n.saturating_sub(step) > self.max_wait_steps => {
                let msg = format!(
                    "WAIT_STEP {n} is more than --max-wait-steps {} ahead of the global step {step}",
                    self.max_wait_steps,
                );
                service.failed += 1;
                conn.respond_error(id, opcode, Status::LimitExceeded, &msg)
                    .map_err(|_| ServeError::ReplyNotQueued)
            }
            // Reached already: answered now, so nothing behind it waits
            // for a poll.
            Reply::Wait(n) if step >= n => Release {
                conn: key,
                id,
                step,
                refused: false,
            }
            .respond(conn),
            Reply::Wait(n) => {
                waiting.push((key, id, n, from));
                conns[key].barrier = true;
                Ok(())
            }
            Reply::Done => {
                conns[key].done = true;
                if let Some(w) = worker_index(conn) {
                    self.workers.insert(w, WorkerEnd::Done);
                }
                if oneway {
                    return Ok(());
                }
                conn.respond(id, opcode, Status::Ok, Payload::empty())
                    .map_err(|_| ServeError::ReplyNotQueued)
            }
        }
    }

    /// Queue connection `key`'s deferred push replies on `conn`, its
    /// connection, in the order of their pushes.
    pub fn flush_deferred(&mut self, key: usize, conn: &mut Connection) -> Result<(), ServeError> {
        let Some(state) = self.conns.get_mut(key) else {
            return Ok(());
        };
        if state.deferred.is_empty() {
            return Ok(());
        }
        let mut deferred = std::mem::take(&mut state.deferred);
        let mut r = Ok(());
        for (id, bytes) in deferred.drain(..) {
            if r.is_ok() {
                r = queue_reply(
                    &mut self.service,
                    conn,
                    id,
                    Opcode::SparsePush,
                    Status::Ok,
                    bytes,
                );
            }
        }
        // Keep the list's room for the connection's next step.
        self.conns[key].deferred = deferred;
        r
    }

    /// Move into `out` the connections whose deferred replies nothing
    /// holds (no barrier of theirs is held), to be sent with
    /// [`flush_deferred`](Self::flush_deferred); a connection whose barrier
    /// is held sends them when the barrier is answered.
    pub fn take_deferred(&mut self, out: &mut Vec<usize>) {
        let conns = &self.conns;
        out.extend(self.deferred_conns.drain(..).filter(|&k| {
            conns
                .get(k)
                .is_some_and(|c| !c.barrier && !c.deferred.is_empty())
        }));
    }

    /// True when a deferred reply waits for the next turn (on a connection
    /// whose barrier is not held): the reactor must not park.
    pub fn has_deferred(&self) -> bool {
        self.deferred_conns.iter().any(|&k| {
            self.conns
                .get(k)
                .is_some_and(|c| !c.barrier && !c.deferred.is_empty())
        })
    }

    /// Answer the barrier `r` ([`poll_release`](Self::poll_release)) on
    /// `conn`, its connection, then serve the requests held behind it in
    /// order, until one of them is a barrier that holds the rest again. An
    /// error ends the connection, as in
    /// [`handle_message`](Self::handle_message). A barrier that cannot be
    /// reached ([`Release::refused`]) is answered with its worker's
    /// refusal ([`Service::barrier_refused`]).
    pub fn handle_release(&mut self, r: &Release, conn: &mut Connection) -> Result<(), ServeError> {
        self.conn_state(r.conn).barrier = false;
        self.flush_deferred(r.conn, conn)?;
        if r.refused {
            let (status, why) = refusal(&self.service.refused, worker_index(conn))
                .unwrap_or((Status::Cancelled, "its push was refused"));
            let msg = format!("WAIT_STEP cannot be reached: {why}");
            self.service.failed += 1;
            conn.respond_error(r.id, Opcode::Rpc, status, &msg)
                .map_err(|_| ServeError::ReplyNotQueued)?;
        } else {
            r.respond(conn)?;
        }
        self.serve_held(r.conn, conn)
    }

    /// Answer connection `key`'s held barrier with [`Status::Cancelled`]
    /// (its worker gave up on it) and serve what is held behind it.
    fn abandon_barrier(&mut self, key: usize, conn: &mut Connection) -> Result<(), ServeError> {
        self.conn_state(key).barrier = false;
        self.flush_deferred(key, conn)?;
        if let Some(i) = self.waiting.iter().position(|w| w.0 == key) {
            let (_, id, n, _) = self.waiting.swap_remove(i);
            let msg = format!("WAIT_STEP {n} given up: a push came in behind it");
            conn.respond_error(id, Opcode::Rpc, Status::Cancelled, &msg)
                .map_err(|_| ServeError::ReplyNotQueued)?;
        }
        self.serve_held(key, conn)
    }

    /// Serve the requests held on connection `key`, in order, until one of
    /// them is a barrier that holds the rest again.
    fn serve_held(&mut self, key: usize, conn: &mut Connection) -> Result<(), ServeError> {
        loop {
            let state = self.conn_state(key);
            if state.barrier {
                return Ok(());
            }
            let Some(h) = state.held.pop_front() else {
                return Ok(());
            };
            state.held_bytes -= h.body.len();
            self.release_held(h.body.len());
            self.serve_request(key, conn, h.id, h.opcode, h.oneway, &h.body)?;
        }
    }

    /// Connection `key` ended (`conn` as it was last). Its barrier is
    /// dropped. A worker whose connection ends before it said `DONE` died
    /// unfinished: it is lost (its index is returned) until it rejoins and
    /// says `DONE`, and it counts toward [`finished`](Self::finished) so
    /// the shard does not wait for it for ever. A peer that never completed
    /// the handshake, or is no worker, does not count.
    pub fn handle_close(&mut self, key: usize, conn: &Connection) -> Option<u32> {
        self.waiting.retain(|w| w.0 != key);
        let ended = std::mem::take(self.conn_state(key));
        self.release_held(ended.held_bytes);
        let said_done = ended.done;
        let w = worker_index(conn)?;
        if said_done {
            return None;
        }
        if self.workers.get(&w) == Some(&WorkerEnd::Done) {
            return None;
        }
        self.workers.insert(w, WorkerEnd::Lost);
        Some(w)
    }

    /// The workers whose connection ended before they said `DONE` and that
    /// have not rejoined and said it since, by task index.
    pub fn lost(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .workers
            .iter()
            .filter(|(_, e)| **e == WorkerEnd::Lost)
            .map(|(w, _)| *w)
            .collect();
        v.sort_unstable();
        v
    }

    /// Whether this shard waits for its workers to finish (an expected
    /// count was given) rather than serving until stopped.
    pub fn exits_when_done(&self) -> bool {
        self.expected_workers > 0
    }

    /// Every barrier held and every request held behind one, as
    /// (connection, request id, opcode), to be answered with an error: the
    /// step they wait for will not come.
    pub fn take_barriers(&mut self) -> Vec<(usize, u64, Opcode)> {
        let mut out = Vec::new();
        let mut released = 0;
        for (c, id, _, _) in self.waiting.drain(..) {
            out.push((c, id, Opcode::Rpc));
            if let Some(state) = self.conns.get_mut(c) {
                state.barrier = false;
                released += std::mem::take(&mut state.held_bytes);
                let held = state.held.drain(..).filter(|h| !h.oneway);
                out.extend(held.map(|h| (c, h.id, h.opcode)));
            }
        }
        self.release_held(released);
        out
    }

    /// The next barrier the global step has reached, if any, or one that
    /// cannot be reached any more ([`Service::barrier_refused`]: its
    /// worker's push of the step was refused or dropped).
    pub fn poll_release(&mut self) -> Option<Release> {
        let step = self.service.handler().global_step();
        let service = &self.service;
        let i = self
            .waiting
            .iter()
            .position(|w| step >= w.2 || service.barrier_refused(w.3, w.2).is_some())?;
        let (conn, id, n, _) = self.waiting.swap_remove(i);
        Some(Release {
            conn,
            id,
            step,
            refused: step < n,
        })
    }

    /// True once every expected worker is done or lost.
    pub fn finished(&self) -> bool {
        self.expected_workers > 0 && self.workers.len() >= self.expected_workers
    }

    fn conn_state(&mut self, key: usize) -> &mut ConnState {
        if self.conns.len() <= key {
            self.conns.resize_with(key + 1, ConnState::default);
        }
        &mut self.conns[key]
    }

    /// Requests held behind connection `key`'s barrier.
    pub fn held(&self, key: usize) -> usize {
        self.conns.get(key).map_or(0, |c| c.held.len())
    }
}

/// Queue reply `bytes` to request `id` on `conn`. A reply over the task's
/// memory budget is answered with [`Status::Overloaded`] instead: other
/// connections' replies hold the budget, and the request is answered, not
/// dropped.
fn queue_reply<H>(
    service: &mut Service<H>,
    conn: &mut Connection,
    id: u64,
    opcode: Opcode,
    status: Status,
    bytes: Bytes,
) -> Result<(), ServeError> {
    match conn.respond(id, opcode, status, Payload::from_bytes(bytes)) {
        Ok(()) => Ok(()),
        Err(SendError::OverBudget(_)) => {
            service.failed += 1;
            conn.respond_error(
                id,
                opcode,
                Status::Overloaded,
                "the reply does not fit in the PS's --memory-budget-mb now; retry",
            )
            .map_err(|_| ServeError::ReplyNotQueued)
        }
        Err(_) => Err(ServeError::ReplyNotQueued),
    }
}

/// The task index of the worker at the other end of `conn`, if it is one.
fn worker_index(conn: &Connection) -> Option<u32> {
    conn.peer()
        .filter(|p| p.role == TaskRole::Worker)
        .map(|p| p.task_index)
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    use crate::handler::ShardHandler;
    use starwire_ps::{Init, OptimizerConfig, PsShard, ShardConfig, VarDef, VarKind};
    use starwire_transport::testing::MemTransport;
    use starwire_transport::{ConnConfig, PeerInfo, Side, Transport};
    use starwire_wire::ps::PushRequestWriter;

    fn dense_var() -> VarDef {
        VarDef {
            id: 0,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![2] },
            init: Init::Zeros,
        }
    }

    fn sgd_config() -> ShardConfig {
        ShardConfig {
            optimizer: OptimizerConfig::sgd(1.0),
            ..ShardConfig::default()
        }
    }

    fn sync_service() -> Service<ShardHandler> {
        Service::new(ShardHandler::new(
            PsShard::new(0, &[dense_var()], sgd_config()),
            0,
        ))
        .with_sync(2, MemoryBudget::new(1 << 20))
    }

    fn push(svc: &mut Service<ShardHandler>, w: u32, g: f32) {
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, true).dense(0, &[g, g]);
        let r = svc.serve_from(Some(w), Opcode::SparsePush, &b, Vec::with_capacity);
        assert!(matches!(r, Reply::Now(Status::Ok, _)), "{r:?}");
    }

    fn weights(svc: &Service<ShardHandler>) -> Vec<f32> {
        svc.handler().shard.dense(0).unwrap().values().to_vec()
    }

    /// With `--sync`, worker 1 pushed its step and died; restarted, it
    /// resumes at the step (`RESUME_AT`) and pushes it again. The replay is
    /// acknowledged, not gathered a second time: the step is applied once,
    /// with the push the shard kept, when worker 0's push completes it.
    #[test]
    fn a_replayed_sync_push_is_acknowledged_and_the_step_applied_once() {
        let mut svc = sync_service();
        push(&mut svc, 1, 1.0);
        let resume = Control::ResumeAt(0).encode();
        let r = svc.serve_from(Some(1), Opcode::Rpc, &resume, Vec::with_capacity);
        assert!(matches!(r, Reply::Now(Status::Ok, _)), "{r:?}");
        push(&mut svc, 1, 100.0);
        assert_eq!(svc.handler().global_step(), 0);
        push(&mut svc, 0, 2.0);
        assert_eq!(svc.handler().global_step(), 2);
        assert_eq!(weights(&svc), [-3.0, -3.0]);
        let held = &svc.handler().stats()["worker_steps"];
        assert_eq!(*held, serde_json::json!({"0": 1, "1": 1}));
        // The next step is gathered from both, as before.
        push(&mut svc, 1, 10.0);
        push(&mut svc, 0, 20.0);
        assert_eq!(svc.handler().global_step(), 4);
        assert_eq!(weights(&svc), [-33.0, -33.0]);
    }

    /// Stopped mid-step under `--sync` (SIGTERM), the shard's positions go
    /// back to the last step it applied before its checkpoint: worker 1's
    /// kept push of step 1 is not in the values, so the checkpoint must not
    /// count it, or worker 1, restored, would skip that step.
    #[test]
    fn a_checkpoint_mid_sync_step_does_not_count_the_kept_pushes() {
        let mut svc = sync_service();
        push(&mut svc, 1, 1.0);
        push(&mut svc, 0, 2.0);
        assert_eq!(svc.handler().global_step(), 2);
        push(&mut svc, 1, 10.0);
        let steps = |svc: &Service<ShardHandler>| svc.handler().stats()["worker_steps"].clone();
        assert_eq!(steps(&svc), serde_json::json!({"0": 1, "1": 2}));
        svc.rewind_kept();
        assert_eq!(steps(&svc), serde_json::json!({"0": 1, "1": 1}));
        assert_eq!(weights(&svc), [-3.0, -3.0], "values as of the step applied");
        // Without a step being gathered, nothing moves.
        let mut idle = sync_service();
        push(&mut idle, 0, 1.0);
        push(&mut idle, 1, 1.0);
        idle.rewind_kept();
        assert_eq!(steps(&idle), serde_json::json!({"0": 1, "1": 1}));
    }

    /// What only workers send is refused from a peer the handshake named
    /// as no worker: a `--sync` push (it used to be applied on its own,
    /// moving the global step past the barriers of the step being
    /// gathered), a checkpoint vote, and a checkpoint step but from worker
    /// 0. Each fails with `BadRequest` and changes nothing; from the
    /// workers they are served as before, and the gRPC baseline, whose
    /// transport names no sender, is served as before.
    #[test]
    fn what_only_workers_send_is_refused_from_other_peers() {
        let mut svc = sync_service();
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, true).dense(0, &[1.0, 1.0]);
        for _ in 0..2 {
            let r = svc.serve_from(None, Opcode::SparsePush, &b, Vec::with_capacity);
            assert_eq!(status(&r), Some(Status::BadRequest), "{r:?}");
        }
        assert_eq!(svc.handler().global_step(), 0);
        assert_eq!(weights(&svc), [0.0, 0.0]);
        push(&mut svc, 0, 1.0);
        push(&mut svc, 1, 1.0);
        assert_eq!(svc.handler().global_step(), 2);

        let at = Control::CheckpointAt(64).encode();
        let vote = Control::CheckpointVote {
            step: u64::MAX,
            want: false,
        }
        .encode();
        let refused_as_no_worker = |r: &Reply| match r {
            Reply::Now(Status::BadRequest, m) => m.windows(11).any(|w| w == b"from a peer"),
            _ => false,
        };
        for (from, body) in [(None, &at), (Some(1), &at), (None, &vote)] {
            let r = svc.serve_from(from, Opcode::Rpc, body, Vec::with_capacity);
            assert!(refused_as_no_worker(&r), "{from:?}: {r:?}");
        }
        // Worker 0's checkpoint step reaches the shard (which has no
        // checkpoint directory here, and says so); a worker's vote is
        // counted.
        for (from, body) in [(Some(0), &at), (Some(1), &vote)] {
            let r = svc.serve_from(from, Opcode::Rpc, body, Vec::with_capacity);
            assert!(!refused_as_no_worker(&r), "{from:?}: {r:?}");
        }
        let r = svc.serve_from(Some(1), Opcode::Rpc, &vote, Vec::with_capacity);
        assert_eq!(status(&r), Some(Status::Ok), "{r:?}");
        let mut anonymous = Service::new(ShardHandler::new(
            PsShard::new(0, &[dense_var()], sgd_config()),
            0,
        ));
        for body in [&at, &vote] {
            let r = anonymous.serve(Opcode::Rpc, body, Vec::with_capacity);
            assert!(!refused_as_no_worker(&r), "{r:?}");
        }
    }

    fn steps(svc: &Service<ShardHandler>) -> serde_json::Value {
        svc.handler().stats()["worker_steps"].clone()
    }

    fn serve(svc: &mut Service<ShardHandler>, w: u32, op: Opcode, body: &[u8]) -> Reply {
        svc.serve_from(Some(w), op, body, Vec::with_capacity)
    }

    fn status(r: &Reply) -> Option<Status> {
        match r {
            Reply::Now(s, _) => Some(*s),
            _ => None,
        }
    }

    /// With `--sync`, a push the shard would refuse (a variable it does
    /// not have, one of another width, a NaN) fails its sender at once,
    /// with the status an asynchronous push gets, and nothing of it is
    /// kept or counted: the other worker's push stands, the sender's
    /// barrier fails rather than waiting for a step that needs its push,
    /// and its push sent again completes the step as usual.
    #[test]
    fn a_sync_push_the_shard_would_refuse_fails_its_sender_and_keeps_nothing() {
        let mut unknown = Vec::new();
        PushRequestWriter::new(&mut unknown, true).rows(7, 2, &[3], &[1.0, 1.0]);
        let mut nan = Vec::new();
        PushRequestWriter::new(&mut nan, true).dense(0, &[1.0, f32::NAN]);
        let mut wide = Vec::new();
        PushRequestWriter::new(&mut wide, true).dense(0, &[1.0; 3]);
        let wait = |n| Control::WaitStep(n).encode();
        for (bad, want) in [
            (unknown, Status::UnknownVariable),
            (nan, Status::NonFinite),
            (wide, Status::WrongShape),
        ] {
            let mut svc = sync_service();
            push(&mut svc, 1, 1.0);
            let r = serve(&mut svc, 0, Opcode::SparsePush, &bad);
            assert_eq!(status(&r), Some(want), "{r:?}");
            assert_eq!(svc.handler().global_step(), 0);
            assert_eq!(weights(&svc), [0.0, 0.0]);
            assert_eq!(steps(&svc), serde_json::json!({"0": 0, "1": 1}));
            let r = serve(&mut svc, 0, Opcode::Rpc, &wait(2));
            assert_eq!(status(&r), Some(want), "{r:?}");
            assert!(matches!(
                serve(&mut svc, 1, Opcode::Rpc, &wait(2)),
                Reply::Wait(2)
            ));
            // Worker 0's push again: the step is worker 1's and this one.
            push(&mut svc, 0, 2.0);
            assert_eq!(svc.handler().global_step(), 2);
            assert_eq!(weights(&svc), [-3.0, -3.0]);
            assert_eq!(steps(&svc), serde_json::json!({"0": 1, "1": 1}));
            assert!(matches!(
                serve(&mut svc, 0, Opcode::Rpc, &wait(4)),
                Reply::Wait(4)
            ));
            assert!(matches!(
                serve(&mut svc, 0, Opcode::Rpc, &wait(2)),
                Reply::Wait(2)
            ));
        }
    }

    /// A `--sync` push the shard refuses on arrival is counted in the
    /// shard's errors once, as a refused asynchronous push is (its bytes
    /// too); the barrier it then fails is the service's failure only, and
    /// the step applied after counts no error.
    #[test]
    fn a_sync_push_refused_on_arrival_counts_once_in_the_shard_s_errors() {
        let mut nan = Vec::new();
        PushRequestWriter::new(&mut nan, true).dense(0, &[1.0, f32::NAN]);
        let shard = |svc: &Service<ShardHandler>| svc.handler().shard.stats();
        let mut svc = sync_service();
        push(&mut svc, 1, 1.0);
        let before = shard(&svc);
        assert_eq!(before.errors, 0);
        let r = serve(&mut svc, 0, Opcode::SparsePush, &nan);
        assert_eq!(status(&r), Some(Status::NonFinite), "{r:?}");
        let after = shard(&svc);
        assert_eq!(after.errors, 1);
        assert_eq!(after.request_bytes - before.request_bytes, nan.len() as u64);
        assert_eq!(svc.handler().stats()["errors"], 1);
        let r = serve(&mut svc, 0, Opcode::Rpc, &Control::WaitStep(2).encode());
        assert_eq!(status(&r), Some(Status::NonFinite), "{r:?}");
        assert_eq!(shard(&svc).errors, 1, "the barrier is the service's");
        assert_eq!(svc.failed(), 2);
        // Sent again, the push is kept and the step applied: the merged
        // push and one step marker, no error.
        push(&mut svc, 0, 2.0);
        let s = shard(&svc);
        assert_eq!((s.errors, s.pushes), (1, 2));
        // As an asynchronous shard counts the same push.
        let mut async_svc = Service::new(ShardHandler::new(
            PsShard::new(0, &[dense_var()], sgd_config()),
            0,
        ));
        let r = serve(&mut async_svc, 0, Opcode::SparsePush, &nan);
        assert_eq!(status(&r), Some(Status::NonFinite), "{r:?}");
        let s = async_svc.handler().shard.stats();
        assert_eq!((s.errors, s.request_bytes), (1, nan.len() as u64));
    }

    /// A merged step the shard refuses (finite pushes whose sum is not) is
    /// not applied: the push that completed it fails, no position counts
    /// it, and every worker that pushed it finds its barrier failed, not
    /// held for a step that will not come. Sent again, the step applies.
    #[test]
    fn a_sync_step_whose_sum_is_not_finite_is_not_applied_nor_counted() {
        let wait = Control::WaitStep(2).encode();
        let mut svc = sync_service();
        push(&mut svc, 1, f32::MAX);
        assert!(matches!(
            serve(&mut svc, 1, Opcode::Rpc, &wait),
            Reply::Wait(2)
        ));
        let mut max = Vec::new();
        PushRequestWriter::new(&mut max, true).dense(0, &[f32::MAX; 2]);
        let r = serve(&mut svc, 0, Opcode::SparsePush, &max);
        assert_eq!(status(&r), Some(Status::NonFinite), "{r:?}");
        assert_eq!(svc.handler().global_step(), 0);
        assert_eq!(weights(&svc), [0.0, 0.0]);
        assert_eq!(steps(&svc), serde_json::json!({"0": 0, "1": 0}));
        for w in [0, 1] {
            assert_eq!(
                svc.barrier_refused(Some(w), 2).map(|r| r.0),
                Some(Status::NonFinite)
            );
            let r = serve(&mut svc, w, Opcode::Rpc, &wait);
            assert_eq!(status(&r), Some(Status::NonFinite), "{r:?}");
        }
        push(&mut svc, 1, 1.0);
        push(&mut svc, 0, 2.0);
        assert_eq!(svc.handler().global_step(), 2);
        assert_eq!(weights(&svc), [-3.0, -3.0]);
        assert_eq!(steps(&svc), serde_json::json!({"0": 1, "1": 1}));
        assert!(svc.barrier_refused(Some(0), 4).is_none());

        // Completed by `DONE`, which has no error reply: the step is not
        // applied either, and its worker's barrier fails.
        let mut svc = sync_service();
        let mut part = Vec::new();
        PushRequestWriter::new(&mut part, false).dense(0, &[f32::MAX; 2]);
        let r = serve(&mut svc, 0, Opcode::SparsePush, &part);
        assert_eq!(status(&r), Some(Status::Ok), "{r:?}");
        push(&mut svc, 0, f32::MAX);
        assert_eq!(steps(&svc), serde_json::json!({"0": 1}));
        let done = Control::Done.encode();
        assert!(matches!(
            serve(&mut svc, 1, Opcode::Rpc, &done),
            Reply::Done
        ));
        assert_eq!(svc.handler().global_step(), 0);
        assert_eq!(steps(&svc), serde_json::json!({"0": 0}));
        let r = serve(&mut svc, 0, Opcode::Rpc, &wait);
        assert_eq!(status(&r), Some(Status::NonFinite), "{r:?}");
        // The step's pushes are asked for again, each numbered afresh.
        push(&mut svc, 0, 1.0);
        assert_eq!(svc.handler().global_step(), 2);
        assert_eq!(weights(&svc), [-1.0, -1.0]);
        assert_eq!(steps(&svc), serde_json::json!({"0": 1}));
    }

    /// One end of an in-memory connection, for a [`PsServer`] to serve.
    struct End {
        conn: Connection,
        link: MemTransport,
    }

    impl End {
        /// Write what the connection has queued to the link.
        fn send(&mut self) {
            self.conn.poll_transmit(&mut self.link).unwrap();
            self.link.flush(Instant::now()).unwrap();
        }

        /// Hand each message received to `f`.
        fn recv(&mut self, mut f: impl FnMut(&mut Connection, Incoming<'_>)) {
            let End { conn, link } = self;
            let mut whole = Vec::new();
            let mut sink = |frame: &[u8]| {
                if let Some(m) = conn.handle_frame(frame, &mut whole).unwrap() {
                    f(conn, m);
                }
            };
            link.rx_burst(Instant::now(), usize::MAX, &mut sink)
                .unwrap();
        }

        /// Send a request; its id.
        fn request(&mut self, opcode: Opcode, body: Vec<u8>) -> u64 {
            let id = self.conn.request(opcode, 0, Payload::from(body), None);
            self.send();
            id.unwrap()
        }

        /// The responses received: (request id, status, body).
        fn responses(&mut self) -> Vec<(u64, Status, Vec<u8>)> {
            let mut out = Vec::new();
            self.recv(|_, m| match m {
                Incoming::Response {
                    id, status, body, ..
                } => out.push((id, status, body.to_vec())),
                Incoming::Request { .. } => panic!("a request to the worker: {m:?}"),
            });
            out
        }
    }

    /// A PS's end and worker `worker`'s end of a connection, handshake
    /// done.
    fn connected(worker: u32) -> (End, End) {
        const FRAME: usize = 1 << 16;
        let info = |role, task_index| PeerInfo {
            role,
            job: "t".into(),
            task_index,
            incarnation: 1,
            shards: 1,
        };
        let (a, b) = MemTransport::pair(FRAME, 64);
        let mut ps_cfg = ConnConfig::new(info(TaskRole::Ps, 0));
        ps_cfg.side = Side::Acceptor;
        let mut ps = End {
            conn: Connection::new(ps_cfg, FRAME),
            link: a,
        };
        let w_cfg = ConnConfig::new(info(TaskRole::Worker, worker));
        let mut w = End {
            conn: Connection::new(w_cfg, FRAME),
            link: b,
        };
        for _ in 0..4 {
            ps.send();
            w.send();
            ps.recv(|_, m| panic!("before the handshake: {m:?}"));
            w.recv(|_, m| panic!("before the handshake: {m:?}"));
        }
        assert!(ps.conn.is_established() && w.conn.is_established());
        (ps, w)
    }

    /// Serve what connection `key` (`end`, the PS's end) received, and
    /// send the replies.
    fn serve_conn(server: &mut PsServer<ShardHandler>, key: usize, end: &mut End) {
        end.recv(|conn, m| server.handle_message(key, conn, m).unwrap());
        end.send();
    }

    /// With `--sync`, worker 1's barrier is held on its connection, a pull
    /// held behind it, when worker 0's push completes a step the shard
    /// refuses (a sum that is not finite): [`PsServer::poll_release`] gives
    /// the barrier as refused, and [`PsServer::handle_release`] answers it
    /// with the refusal, then serves the pull held behind it. Sent again,
    /// the step is applied and the next barrier released as usual.
    #[test]
    fn a_held_sync_barrier_failed_through_poll_release_answers_the_refusal() {
        let shard = PsShard::new(0, &[dense_var()], sgd_config());
        let mut server =
            PsServer::new(ShardHandler::new(shard, 0), 2).with_sync(2, MemoryBudget::new(1 << 20));
        let (mut ps0, mut w0) = connected(0);
        let (mut ps1, mut w1) = connected(1);
        server.handle_open(0);
        server.handle_open(1);
        let dense = |g: f32| {
            let mut b = Vec::new();
            PushRequestWriter::new(&mut b, true).dense(0, &[g, g]);
            b
        };
        let mut pull = Vec::new();
        starwire_wire::ps::PullRequestWriter::new(&mut pull).dense(0);
        let wait = Control::WaitStep(2).encode();

        let push1 = w1.request(Opcode::SparsePush, dense(f32::MAX));
        let wait1 = w1.request(Opcode::Rpc, wait.clone());
        let pull1 = w1.request(Opcode::SparsePull, pull.clone());
        serve_conn(&mut server, 1, &mut ps1);
        assert_eq!(server.held(1), 1, "the pull waits behind the barrier");
        assert!(server.poll_release().is_none());
        let got = w1.responses();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].0, got[0].1), (push1, Status::Ok));

        let push0 = w0.request(Opcode::SparsePush, dense(f32::MAX));
        serve_conn(&mut server, 0, &mut ps0);
        let got = w0.responses();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].0, got[0].1), (push0, Status::NonFinite));
        assert_eq!(server.handler().global_step(), 0);

        let r = server.poll_release().expect("the held barrier fails");
        assert_eq!((r.conn, r.id, r.refused), (1, wait1, true));
        assert!(server.poll_release().is_none(), "released once");
        server.handle_release(&r, &mut ps1.conn).unwrap();
        ps1.send();
        let got = w1.responses();
        let ids: Vec<u64> = got.iter().map(|g| g.0).collect();
        assert_eq!(ids, [wait1, pull1], "the refusal, then the held pull");
        assert_eq!(got[0].1, Status::NonFinite);
        let why = String::from_utf8_lossy(&got[0].2);
        assert!(why.contains("WAIT_STEP cannot be reached"), "{why}");
        assert!(
            why.contains("worker 1's pushes of it were dropped"),
            "{why}"
        );
        assert_eq!(got[1].1, Status::Ok);
        assert_eq!(server.held(1), 0);
        // Worker 0's push and worker 1's barrier.
        assert_eq!(server.service().failed(), 2);

        // Both push the step again: it is applied, and worker 1's next
        // barrier is released with the global step.
        w1.request(Opcode::SparsePush, dense(1.0));
        let wait1 = w1.request(Opcode::Rpc, wait);
        serve_conn(&mut server, 1, &mut ps1);
        assert_eq!(w1.responses().len(), 1);
        assert!(server.poll_release().is_none());
        w0.request(Opcode::SparsePush, dense(2.0));
        serve_conn(&mut server, 0, &mut ps0);
        assert_eq!(w0.responses()[0].1, Status::Ok);
        let r = server
            .poll_release()
            .expect("the step releases the barrier");
        assert_eq!((r.conn, r.id, r.refused, r.step), (1, wait1, false, 2));
        server.handle_release(&r, &mut ps1.conn).unwrap();
        ps1.send();
        let got = w1.responses();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].0, got[0].1), (wait1, Status::Ok));
        assert_eq!(got[0].2, 2u64.to_le_bytes());
        let w = server.handler().shard.dense(0).unwrap().values().to_vec();
        assert_eq!(w, [-3.0, -3.0]);
        assert_eq!(server.service().failed(), 2);
    }

    /// The bodies held behind a barrier are charged to the task's memory
    /// budget: a request that does not fit is answered `Overloaded`, not
    /// held (they used to be copied outside it, up to 64 MiB on each
    /// connection), and what is held goes back as it is served, when its
    /// connection ends, and when the server goes.
    #[test]
    fn requests_held_behind_a_barrier_are_charged_to_the_budget() {
        let budget = MemoryBudget::new(100);
        let shard = PsShard::new(0, &[dense_var()], sgd_config());
        let mut server = PsServer::new(ShardHandler::new(shard, 0), 2).with_budget(budget.clone());
        let (mut ps, mut w) = connected(0);
        server.handle_open(0);
        let mut pull = Vec::new();
        starwire_wire::ps::PullRequestWriter::new(&mut pull).dense(0);
        let mut big = Vec::new();
        let keys: Vec<u64> = (0..16).collect();
        starwire_wire::ps::PullRequestWriter::new(&mut big).rows(0, &keys);
        assert!(pull.len() < 50 && big.len() > 100 - pull.len());

        let wait = w.request(Opcode::Rpc, Control::WaitStep(1).encode());
        let held = w.request(Opcode::SparsePull, pull.clone());
        let refused = w.request(Opcode::SparsePull, big);
        serve_conn(&mut server, 0, &mut ps);
        assert_eq!(server.held(0), 1);
        assert_eq!(budget.used(), pull.len());
        let got = w.responses();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].0, got[0].1), (refused, Status::Overloaded));

        // The step comes: the barrier and the held pull are answered, and
        // the pull's bytes go back.
        let (mut ps1, mut w1) = connected(1);
        server.handle_open(1);
        let mut push = Vec::new();
        PushRequestWriter::new(&mut push, true).dense(0, &[1.0, 1.0]);
        w1.request(Opcode::SparsePush, push);
        serve_conn(&mut server, 1, &mut ps1);
        assert_eq!(w1.responses()[0].1, Status::Ok);
        let r = server.poll_release().expect("the barrier is released");
        server.handle_release(&r, &mut ps.conn).unwrap();
        ps.send();
        let ids: Vec<u64> = w.responses().iter().map(|g| g.0).collect();
        assert_eq!(ids, [wait, held]);
        assert_eq!(budget.used(), 0);

        // Held when the connection ends, or when the server goes.
        for close in [true, false] {
            w.request(Opcode::Rpc, Control::WaitStep(9).encode());
            w.request(Opcode::SparsePull, pull.clone());
            serve_conn(&mut server, 0, &mut ps);
            assert_eq!(budget.used(), pull.len());
            if close {
                server.handle_close(0, &ps.conn);
                server.handle_open(0);
                assert_eq!(budget.used(), 0);
            }
        }
        drop(server);
        assert_eq!(budget.used(), 0);
    }

    /// A worker's pull reply, served by a service that shares them (a
    /// network server's), is held by DC-ASGD's record of the pull until
    /// the worker's push is applied; without sharing (`inproc`) it is not.
    #[test]
    fn a_shared_pull_reply_is_held_by_the_record_until_the_push() {
        use starwire_ps::OptimizerKind;
        use starwire_wire::ps::PullRequestWriter;
        let service = |share: bool| {
            let var = VarDef {
                id: 0,
                name: "emb".into(),
                kind: VarKind::Embedding { dim: 4 },
                init: Init::Uniform { scale: 0.1 },
            };
            let cfg = ShardConfig {
                optimizer: OptimizerConfig::with_kind(OptimizerKind::DcAsgd, 0.5),
                ..ShardConfig::default()
            };
            let s = Service::new(ShardHandler::new(PsShard::new(0, &[var], cfg), 0));
            if share {
                s.sharing_pull_replies()
            } else {
                s
            }
        };
        let mut pull = Vec::new();
        PullRequestWriter::new(&mut pull).rows(0, &[3, 5]);
        let mut push = Vec::new();
        PushRequestWriter::new(&mut push, true).rows(0, 4, &[3, 5], &[0.5; 8]);
        for share in [true, false] {
            let mut svc = service(share);
            let Reply::Now(Status::Ok, reply) =
                svc.serve_from(Some(1), Opcode::SparsePull, &pull, Vec::with_capacity)
            else {
                panic!("the pull failed");
            };
            assert_eq!(reply.is_unique(), !share, "share {share}");
            let r = svc.serve_from(Some(1), Opcode::SparsePush, &push, Vec::with_capacity);
            assert!(matches!(r, Reply::Now(Status::Ok, _)), "{r:?}");
            assert!(reply.is_unique(), "share {share}: released by the push");
        }
    }

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

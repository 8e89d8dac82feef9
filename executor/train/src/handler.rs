//! [`PsHandler`] for a [`PsShard`]: the glue between a shard reactor and the
//! sans-IO parameter-server state.

use std::path::Path;

use bytes::Bytes;
use starwire_ps::{write_atomic, Position, PsError, PsShard};
use starwire_transport::wire::Status;

use crate::cluster::periodic::{create_step_dir, is_checkpoint_step, step_dir};
use crate::deltas::DeltaExport;
use crate::psserver::{HandlerError, PsHandler};
use crate::telemetry::ShardTelemetry;

/// The file name of shard `i`'s checkpoint inside a checkpoint directory.
pub fn shard_file(i: usize) -> String {
    format!("shard-{i:04}.ckpt")
}

fn status(e: &PsError) -> Status {
    match e {
        PsError::UnknownVariable(_) => Status::UnknownVariable,
        PsError::ShapeMismatch { .. } | PsError::KindMismatch { .. } => Status::WrongShape,
        PsError::ReplyTooLarge { .. } | PsError::TableFull(_) => Status::LimitExceeded,
        PsError::OutOfMemory { .. } => Status::Overloaded,
        PsError::NonFinite { .. } => Status::NonFinite,
        _ => Status::BadRequest,
    }
}

fn err(e: PsError) -> HandlerError {
    HandlerError {
        status: status(&e),
        message: e.to_string(),
    }
}

/// Which global steps are checkpoint steps, as shard 0 decides them for
/// every worker alike (`CHECKPOINT_VOTE`, asynchronous
/// `--checkpoint-every-secs`): each worker votes at each of its candidate
/// steps, wanting a checkpoint once the time has passed by its clock. The
/// first vote on a step decides it: yes when that vote, or one since the
/// last yes, wanted one. A want that comes after its step was decided is
/// kept for the next step decided.
#[derive(Debug, Default, Clone)]
pub struct CheckpointVotes {
    decided: std::collections::BTreeMap<u64, bool>,
    wanted: bool,
    /// Decisions were dropped (past [`VOTES_KEPT`]): a step older than the
    /// oldest kept may have been decided, and worker 0 may be past it.
    pruned: bool,
}

/// Decisions kept: a worker votes on a step at most this many candidate
/// steps behind the one decided last (the barrier of a yes holds the
/// fastest worker until every one has reached it).
const VOTES_KEPT: usize = 1024;

impl CheckpointVotes {
    /// A vote on `step`; the decision. A step older than the oldest
    /// decision kept, once some were dropped, is answered no (its decision
    /// is gone, and a yes now could ask for a checkpoint at a global step
    /// already passed); its want goes to the next step decided.
    pub fn handle_vote(&mut self, step: u64, want: bool) -> bool {
        if let Some(&d) = self.decided.get(&step) {
            self.wanted |= want && !d;
            return d;
        }
        if self.pruned
            && self
                .decided
                .first_key_value()
                .is_some_and(|(&k, _)| step < k)
        {
            self.wanted |= want;
            return false;
        }
        let d = want || self.wanted;
        self.wanted = false;
        self.decided.insert(step, d);
        if self.decided.len() > VOTES_KEPT {
            self.decided.pop_first();
            self.pruned = true;
        }
        d
    }
}

/// A shard as served by a reactor.
#[derive(Debug)]
pub struct ShardHandler {
    /// The shard's state.
    pub shard: PsShard,
    /// Its index in the cluster.
    pub index: usize,
    /// The PS task's `--checkpoint-dir`: the only place a `CHECKPOINT`
    /// request may write to (a peer does not choose paths on the PS).
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// Write the shard's file into `checkpoint_dir`'s step directory
    /// whenever a push makes the global step a multiple of this
    /// (`--checkpoint-every-steps`; 0: never). See `cluster::periodic`.
    pub checkpoint_every: u64,
    /// The incarnation of the PS task serving the shard, as its handshake
    /// tells it (reported in `STATS`, so a worker sees a restart).
    pub incarnation: u64,
    /// The global step the shard was restored at (0: started afresh),
    /// reported in `STATS`: a worker rolls back to its position at that
    /// step after a restart.
    pub restored_step: u64,
    /// A checkpoint step asked for by `CHECKPOINT_AT` and not reached yet.
    pub checkpoint_next: Option<u64>,
    /// The decisions of `CHECKPOINT_VOTE` (asynchronous
    /// `--checkpoint-every-secs`; asked of shard 0).
    pub votes: CheckpointVotes,
    /// Incremental checkpoints (`--delta-every-steps`; none: not written).
    pub deltas: Option<DeltaExport>,
    /// Where the shard publishes its counters and logs its progress (none:
    /// not published).
    pub telemetry: Option<ShardTelemetry>,
}

impl ShardHandler {
    /// Shard `index` over `shard`, with no checkpoint directory, deltas or
    /// telemetry (set the fields that a task needs).
    pub fn new(shard: PsShard, index: usize) -> Self {
        Self {
            restored_step: shard.global_step(),
            shard,
            index,
            checkpoint_dir: None,
            checkpoint_every: 0,
            checkpoint_next: None,
            votes: CheckpointVotes::default(),
            deltas: None,
            incarnation: 0,
            telemetry: None,
        }
    }

    fn publish(&mut self) {
        if let Some(t) = &mut self.telemetry {
            t.publish(&self.shard);
        }
    }
}

impl ShardHandler {
    /// The push that completed checkpoint step `step` was applied and no
    /// barrier of it is released yet: the shard holds exactly the steps of
    /// the checkpoint, so its file goes into the step's directory now.
    fn write_step(&self, step: u64) -> Result<(), HandlerError> {
        let Some(own) = &self.checkpoint_dir else {
            return Ok(());
        };
        let dir = step_dir(own, step);
        let path = dir.join(shard_file(self.index));
        create_step_dir(own, step)
            .map(drop)
            .map_err(|e| e.to_string())
            .and_then(|()| write_atomic(&path, |w| self.shard.save(w)).map_err(|e| e.to_string()))
            .map_err(|e| HandlerError {
                status: Status::Internal,
                message: format!("checkpoint at global step {step}: {}: {e}", path.display()),
            })
    }
}

impl ShardHandler {
    /// Write the shard's delta if `step` is a delta step.
    fn write_delta(&mut self, step: u64) -> Result<(), HandlerError> {
        let (Some(d), Some(own)) = (&mut self.deltas, &self.checkpoint_dir) else {
            return Ok(());
        };
        if !d.is_delta_step(step) {
            return Ok(());
        }
        d.write(&self.shard, self.index, own)
            .map_err(|e| HandlerError {
                status: Status::Internal,
                message: format!("delta at global step {step}: {e}"),
            })
    }
}

impl ShardHandler {
    /// A push, numbered as worker `worker`'s when given (asynchronous
    /// runs), then the checkpoint or delta its step calls for.
    fn push_as(
        &mut self,
        worker: Option<u32>,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HandlerError> {
        let before = self.shard.global_step();
        let r = match worker {
            Some(w) => self.shard.handle_worker_push(w, body, out),
            None => self.shard.handle_push(body, out).map(|()| true),
        }
        .map_err(err);
        // A push acknowledged without being applied touched nothing.
        if let (Some(d), false) = (&mut self.deltas, matches!(r, Ok(false))) {
            d.record_push(&self.shard, body);
        }
        self.publish();
        let step = self.shard.global_step();
        if step != before
            && (is_checkpoint_step(step, self.checkpoint_every)
                || self.checkpoint_next == Some(step))
        {
            self.checkpoint_next = self.checkpoint_next.filter(|&c| c > step);
            self.write_step(step)?;
            if let Some(d) = &mut self.deltas {
                d.full_written(step);
            }
        } else if step != before {
            self.write_delta(step)?;
        }
        r.map(|_| ())
    }
}

impl PsHandler for ShardHandler {
    fn pull(&mut self, body: &[u8], out: &mut Vec<u8>) -> Result<(), HandlerError> {
        self.pull_from(None, false, body, out)
    }

    fn pull_from(
        &mut self,
        worker: Option<u32>,
        shared: bool,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HandlerError> {
        let r = match worker.filter(|_| shared) {
            Some(w) => self.shard.handle_pull_shared(w, body, out),
            None => self.shard.handle_pull_from(worker, body, out),
        };
        if let Some(d) = &mut self.deltas {
            d.record_pull(&self.shard, body);
        }
        self.publish();
        r.map_err(err)
    }

    fn pull_sent(&mut self, worker: u32, reply: &Bytes) {
        self.shard.attach_pull_reply(worker, reply);
    }

    fn push(&mut self, body: &[u8], out: &mut Vec<u8>) -> Result<(), HandlerError> {
        self.push_as(None, body, out)
    }

    fn push_from(
        &mut self,
        worker: u32,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HandlerError> {
        self.push_as(Some(worker), body, out)
    }

    fn number_push(&mut self, worker: u32, completes: bool) -> Result<bool, HandlerError> {
        self.shard.handle_numbered(worker, completes).map_err(err)
    }

    fn push_kept(&mut self, worker: u32) {
        self.shard.handle_kept(worker);
    }

    fn check_push(&mut self, body: &[u8]) -> Result<(), HandlerError> {
        let r = self.shard.handle_push_check(body).map_err(err);
        if r.is_err() {
            self.publish();
        }
        r
    }

    fn applied_position(&self, worker: u32) -> Position {
        self.shard.applied_position(worker).unwrap_or_default()
    }

    fn rewind_applied(&mut self, worker: u32, to: Position) {
        self.shard.rewind_applied(worker, to);
    }

    fn resume_at(&mut self, worker: u32, step: u64) -> Result<(), String> {
        self.shard
            .handle_resume(worker, step)
            .map_err(|e| e.to_string())
    }

    fn checkpoint_vote(&mut self, step: u64, want: bool) -> bool {
        self.votes.handle_vote(step, want)
    }

    fn global_step(&self) -> u64 {
        self.shard.global_step()
    }

    fn checkpoint(&mut self, dir: &str, out: &mut Vec<u8>) -> Result<(), String> {
        let Some(own) = &self.checkpoint_dir else {
            return Err("this PS task was started without --checkpoint-dir".into());
        };
        if Path::new(dir) != own.as_path() {
            return Err(format!(
                "checkpoint directory {dir:?} is not this PS task's --checkpoint-dir {}",
                own.display()
            ));
        }
        let path = own.join(shard_file(self.index));
        starwire_ps::create_dir_durable(own).map_err(|e| format!("{dir}: {e}"))?;
        write_atomic(&path, |w| self.shard.save(w))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let step = self.shard.global_step();
        if let Some(d) = &mut self.deltas {
            d.full_written(step);
        }
        out.extend_from_slice(&step.to_le_bytes());
        Ok(())
    }

    fn checkpoint_at(&mut self, c: u64) -> Result<(), String> {
        if self.checkpoint_dir.is_none() {
            return Err("this PS task was started without --checkpoint-dir".into());
        }
        let step = self.shard.global_step();
        if c <= step {
            return Err(format!(
                "CHECKPOINT_AT {c}: the global step is already {step}"
            ));
        }
        self.checkpoint_next = Some(c);
        Ok(())
    }

    fn stats(&self) -> serde_json::Value {
        let s = self.shard.stats();
        let mut rows = 0u64;
        let mut evicted = 0u64;
        let mut filtered = 0u64;
        for v in self.shard.vars() {
            if let starwire_ps::Var::Table(t) = v {
                let ts = t.stats();
                rows += t.len() as u64;
                evicted += ts.evicted;
                filtered += ts.filtered_pulls;
            }
        }
        serde_json::json!({
            "shard": self.index,
            "incarnation": self.incarnation,
            "restored_step": self.restored_step,
            "global_step": self.shard.global_step(),
            "worker_steps": self
                .shard
                .applied_steps()
                .applied()
                .map(|(w, p)| (w.to_string(), serde_json::Value::from(p.steps)))
                .collect::<serde_json::Map<_, _>>(),
            "pulls": s.pulls,
            "pushes": s.pushes,
            "errors": s.errors,
            "request_bytes": s.request_bytes,
            "response_bytes": s.response_bytes,
            "rows": rows,
            "evicted": evicted,
            "filtered_pulls": filtered,
            "pull_records_dropped": self.shard.pull_records_dropped(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{CheckpointVotes, VOTES_KEPT};

    /// Every vote on a step gets the first one's answer; a want that comes
    /// too late goes to the next step decided, and only to that one.
    #[test]
    fn the_first_vote_decides_and_a_late_want_moves_on() {
        let mut v = CheckpointVotes::default();
        assert!(!v.handle_vote(32, false));
        assert!(!v.handle_vote(32, true), "decided already");
        assert!(v.handle_vote(64, false), "the late want");
        assert!(v.handle_vote(64, true));
        assert!(!v.handle_vote(96, false), "one checkpoint per want");
        assert!(v.handle_vote(128, true));
        assert!(v.handle_vote(128, false));
    }

    /// A worker far behind votes on a step whose decision was dropped: the
    /// answer is no (a yes could make worker 0 ask for a checkpoint at a
    /// global step already passed), and its want goes to the next step.
    #[test]
    fn a_step_older_than_the_decisions_kept_is_a_no() {
        let mut v = CheckpointVotes::default();
        let last = (VOTES_KEPT as u64 + 1) * 16;
        for c in (16..=last).step_by(16) {
            assert!(!v.handle_vote(c, false));
        }
        // Step 16's decision (no) was dropped; a want on it is too late.
        assert!(!v.handle_vote(16, true), "an evicted step");
        assert!(!v.handle_vote(16, true), "still no, and not recorded");
        assert!(v.handle_vote(last + 16, false), "the want moved on");
        // A kept decision still stands, and a new step is decided.
        assert!(!v.handle_vote(last, true));
        assert!(v.handle_vote(last + 32, false), "that late want too");
        assert!(!v.handle_vote(last + 48, false));
    }
}

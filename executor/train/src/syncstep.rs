//! Synchronous SGD on one shard (`--sync`), as TensorFlow's
//! `SyncReplicasOptimizer` does it: the pushes of one step are gathered
//! from every worker and applied once, summed in worker-index order.
//!
//! Applying each push as it arrives would make the model depend on the
//! order the workers' pushes reach the shard (floating-point sums do not
//! commute bit for bit, and an adaptive optimizer's slots see one update
//! per push). Gathered, a step is the same sum whatever the arrival order,
//! so two runs of the same seed end with the same bytes.
//!
//! [`SyncStep`] is sans-IO: it holds the items of each worker's pushes of
//! the step being gathered and, once every worker still training has sent
//! its last push of the step (the one flagged `completes_step`), gives one
//! push request holding worker 0's items, then worker 1's, and so on. The
//! shard applies it as any push: the items of one variable are summed in
//! that order before the optimizer runs once. The shard's global step then
//! moves by the worker count, as it does when every worker's push is
//! applied on its own, so barriers and checkpoint steps keep their meaning.
//! A worker that said `DONE` is not waited for.
//!
//! What it keeps is bounded: the step's items by the codec's item limit
//! (the merged push must parse), and its bytes by the PS task's memory
//! budget (`--memory-budget-mb`): a step may keep at most the budget's
//! limit, whatever else the task's connections hold at the moment, so
//! whether a push fits does not depend on the traffic. A push past either
//! is refused, and only its sender fails. The bytes kept are counted in
//! the budget until the step is taken, so the connections' messages and
//! replies see the room they take.
//!
//! What needs the shard's variables (each item's variable, its kind and
//! width, finite gradients) is checked by the server against the shard
//! before a push is given here (`PsShard::handle_push_check`), so such a
//! push too fails only its sender, and nothing of it is kept (the shard
//! counts it in its errors, once). A merged step the
//! shard still refuses (a sum of finite gradients that is not finite) is
//! not applied: its pushes are dropped, the applied positions they moved
//! go back ([`SyncStep::taken_from`]), and every worker that pushed it is
//! told so at its barrier (`crate::psserver`).

use starwire_ps::Position;
use starwire_transport::MemoryBudget;
use starwire_wire::ps::{
    push_request_header_len, DecodeError, Limits, PushRequest, PushRequestWriter,
};
use thiserror::Error;

/// A push the gatherer refuses; it goes back to its sender as an error.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SyncError {
    /// The push does not decode.
    #[error("push: {0}")]
    Decode(#[from] DecodeError),
    /// The sender's task index is not one of the cluster's workers.
    #[error("worker {worker} pushed, but the cluster has {workers} workers")]
    UnknownWorker {
        /// The sender.
        worker: u32,
        /// Workers in the cluster.
        workers: usize,
    },
    /// A push after the worker's last push of the step, before the step
    /// was applied (a worker waits at the barrier between two steps).
    #[error(
        "worker {0} pushed again after completing its synchronous step, before every worker \
         completed it"
    )]
    AheadOfStep(u32),
    /// A push from a worker that said `DONE`.
    #[error("worker {0} pushed after it said DONE")]
    AfterDone(u32),
    /// The push would take the step past the items one push may hold.
    #[error(
        "worker {worker}'s push would make the synchronous step {items} items, past the {max} \
         one push may hold"
    )]
    TooManyItems {
        /// The sender.
        worker: u32,
        /// The step's items with this push.
        items: u64,
        /// The limit.
        max: u32,
    },
    /// The push's bytes would take the step past the task's memory budget.
    #[error(
        "worker {worker}'s push ({bytes} bytes) would make the synchronous step's pushes more \
         than the PS's --memory-budget-mb ({kept} bytes kept already)"
    )]
    OverBudget {
        /// The sender.
        worker: u32,
        /// Its push's items, in bytes.
        bytes: usize,
        /// Bytes kept for the step already.
        kept: usize,
    },
}

/// One worker's share of the step being gathered.
#[derive(Debug, Default, Clone)]
struct Share {
    /// The items of its pushes of the step, in the order they came (one
    /// connection per worker and shard keeps its order).
    items: Vec<u8>,
    n_items: u32,
    /// Its last push of the step came.
    complete: bool,
    /// It said `DONE`: no step waits for it.
    done: bool,
}

/// The pushes of one synchronous step on a shard. See the module
/// documentation.
#[derive(Debug)]
pub struct SyncStep {
    shares: Vec<Share>,
    limits: Limits,
    /// The merged push of the last completed step (kept for its capacity).
    merged: Vec<u8>,
    /// Where the kept items' bytes are charged.
    budget: MemoryBudget,
    /// Items kept for the step, over every share.
    items: u64,
    /// Bytes kept for the step (charged to `budget`).
    kept: usize,
    /// Per worker with pushes kept for the step: the shard's applied
    /// position of its pushes before the first of them, which a checkpoint
    /// taken before the step is applied must go back to.
    before: Vec<Option<Position>>,
    /// `before` of the step taken last ([`SyncStep::taken_from`]).
    taken: Vec<Option<Position>>,
}

impl SyncStep {
    /// Gather the pushes of `workers` workers, each checked against
    /// `limits` as the shard checks a push, charging what it keeps to
    /// `budget`.
    pub fn new(workers: usize, limits: Limits, budget: MemoryBudget) -> Self {
        Self {
            shares: vec![Share::default(); workers],
            limits,
            merged: Vec::new(),
            budget,
            items: 0,
            kept: 0,
            before: vec![None; workers],
            taken: vec![None; workers],
        }
    }

    /// Worker `w`'s push is about to be kept, the shard's applied position
    /// of its pushes being `at` (recorded for its first push of the step).
    pub fn keeping(&mut self, w: u32, at: Position) {
        if let Some(b) = self.before.get_mut(w as usize) {
            b.get_or_insert(at);
        }
    }

    /// The workers with pushes kept for the step being gathered, and the
    /// applied position of each before them ([`Self::keeping`]).
    pub fn kept_from(&self) -> impl Iterator<Item = (u32, Position)> + '_ {
        self.before
            .iter()
            .enumerate()
            .filter_map(|(w, b)| b.map(|p| (w as u32, p)))
    }

    /// The workers whose pushes the step taken last
    /// ([`take_step`](Self::take_step)) holds, and the applied position of
    /// each before them: where they go back to if the shard refuses the
    /// step.
    pub fn taken_from(&self) -> impl Iterator<Item = (u32, Position)> + '_ {
        self.taken
            .iter()
            .enumerate()
            .filter_map(|(w, b)| b.map(|p| (w as u32, p)))
    }

    /// Workers gathered from.
    pub fn workers(&self) -> usize {
        self.shares.len()
    }

    fn share(&mut self, w: u32) -> Result<&mut Share, SyncError> {
        let workers = self.shares.len();
        self.shares
            .get_mut(w as usize)
            .ok_or(SyncError::UnknownWorker { worker: w, workers })
    }

    /// A push from worker `w`. Its items are kept for the step; true when
    /// the step is now complete ([`take_step`](Self::take_step) gives it).
    pub fn handle_push(&mut self, w: u32, body: &[u8]) -> Result<bool, SyncError> {
        let req = PushRequest::parse(body, &self.limits)?;
        let s = self.share(w)?;
        if s.done {
            return Err(SyncError::AfterDone(w));
        }
        if s.complete {
            return Err(SyncError::AheadOfStep(w));
        }
        let items = self.items + req.len() as u64;
        if items > u64::from(self.limits.max_items) {
            return Err(SyncError::TooManyItems {
                worker: w,
                items,
                max: self.limits.max_items,
            });
        }
        let body = &body[push_request_header_len()..];
        if self.kept + body.len() > self.budget.limit() {
            return Err(SyncError::OverBudget {
                worker: w,
                bytes: body.len(),
                kept: self.kept,
            });
        }
        // Counted even past the limit (the step's bound is the check
        // above): other messages then find less room, and may retry.
        self.budget.charge(body.len());
        self.items = items;
        self.kept += body.len();
        let s = &mut self.shares[w as usize];
        s.items.extend_from_slice(body);
        s.n_items += req.len() as u32;
        s.complete = req.completes_step;
        Ok(self.step_complete())
    }

    /// Worker `w` said `DONE`: no step waits for it any more. True when
    /// that completes the step being gathered.
    pub fn handle_done(&mut self, w: u32) -> bool {
        match self.share(w) {
            Ok(s) => {
                s.done = true;
                self.step_complete()
            }
            Err(_) => false,
        }
    }

    /// Every worker still training has completed the step, and one has.
    fn step_complete(&self) -> bool {
        self.shares.iter().all(|s| s.complete || s.done) && self.shares.iter().any(|s| s.complete)
    }

    /// The completed step as one push request (every worker's items in
    /// worker-index order, flagged `completes_step`), and the gathering of
    /// the next step begins; `None` while a worker's push is missing.
    pub fn take_step(&mut self) -> Option<&[u8]> {
        if !self.step_complete() {
            return None;
        }
        let mut n = 0u32;
        PushRequestWriter::new(&mut self.merged, true);
        for s in &mut self.shares {
            self.merged.extend_from_slice(&s.items);
            // At most `max_items` in all: `handle_push` kept no more.
            n += s.n_items;
            s.items.clear();
            s.n_items = 0;
            s.complete = false;
        }
        // The item count of the header (wire format: docs/WIRE.md).
        self.merged[4..8].copy_from_slice(&n.to_le_bytes());
        self.budget.release(std::mem::take(&mut self.kept));
        self.items = 0;
        std::mem::swap(&mut self.before, &mut self.taken);
        self.before.fill(None);
        Some(&self.merged)
    }
}

impl Drop for SyncStep {
    fn drop(&mut self) {
        self.budget.release(self.kept);
    }
}

/// An empty push that completes a step: how a gathered step moves the
/// shard's global step once per worker after its merged push.
pub fn step_marker(buf: &mut Vec<u8>) -> &[u8] {
    PushRequestWriter::new(buf, true);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_wire::ps::PushItem;

    fn push(var: u32, g: f32, last: bool) -> Vec<u8> {
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, last).dense(var, &[g, g]);
        b
    }

    fn budget() -> MemoryBudget {
        MemoryBudget::new(1 << 20)
    }

    fn items(body: &[u8]) -> Vec<(u32, f32)> {
        let r = PushRequest::parse(body, &Limits::default()).unwrap();
        assert!(r.completes_step);
        r.items()
            .map(|i| match i {
                PushItem::Dense { var, grad } => (var, grad.to_vec()[0]),
                _ => panic!("not dense"),
            })
            .collect()
    }

    /// Whatever order the pushes arrive in, the step is worker 0's items,
    /// then worker 1's, then worker 2's.
    #[test]
    fn a_step_is_merged_in_worker_order_whatever_the_arrival_order() {
        let mut s = SyncStep::new(3, Limits::default(), budget());
        assert!(!s.handle_push(2, &push(1, 2.0, true)).unwrap());
        assert!(!s.handle_push(1, &push(1, 1.0, false)).unwrap());
        assert!(s.take_step().is_none());
        assert!(!s.handle_push(0, &push(1, 0.0, true)).unwrap());
        assert!(s.handle_push(1, &push(2, 1.5, true)).unwrap());
        let m = items(s.take_step().unwrap());
        assert_eq!(m, [(1, 0.0), (1, 1.0), (2, 1.5), (1, 2.0)]);
        // The next step starts empty.
        assert!(s.take_step().is_none());
        assert!(!s.handle_push(0, &push(1, 5.0, true)).unwrap());
    }

    /// A worker that said `DONE` is not waited for; one that pushes past
    /// its step, after `DONE`, or is no worker of the cluster is refused.
    #[test]
    fn done_workers_are_not_waited_for_and_bad_pushes_are_refused() {
        let mut s = SyncStep::new(2, Limits::default(), budget());
        assert!(!s.handle_push(0, &push(1, 1.0, true)).unwrap());
        assert_eq!(
            s.handle_push(0, &push(1, 1.0, true)),
            Err(SyncError::AheadOfStep(0))
        );
        assert!(s.handle_done(1));
        assert_eq!(items(s.take_step().unwrap()), [(1, 1.0)]);
        assert_eq!(
            s.handle_push(1, &push(1, 1.0, true)),
            Err(SyncError::AfterDone(1))
        );
        assert!(matches!(
            s.handle_push(2, &push(1, 1.0, true)),
            Err(SyncError::UnknownWorker { worker: 2, .. })
        ));
        assert!(matches!(
            s.handle_push(0, &[1, 2, 3]),
            Err(SyncError::Decode(_))
        ));
        // Every worker done and nothing pushed: no step to apply.
        assert!(!s.handle_done(0));
        assert!(s.take_step().is_none());
        let mut b = Vec::new();
        let r = PushRequest::parse(step_marker(&mut b), &Limits::default()).unwrap();
        assert!(r.completes_step && r.is_empty());
    }

    /// A worker that pushes without completing its step is refused once
    /// the step would hold more items than one push may, or more bytes than
    /// the budget has left; the step it refused still merges, and what was
    /// kept is given back to the budget.
    #[test]
    fn what_a_step_keeps_is_bounded_in_items_and_bytes() {
        let limits = Limits {
            max_items: 4,
            ..Limits::default()
        };
        let budget = budget();
        let mut s = SyncStep::new(2, limits, budget.clone());
        for _ in 0..4 {
            assert!(!s.handle_push(1, &push(1, 1.0, false)).unwrap());
        }
        let kept = budget.used();
        assert!(kept > 0);
        assert!(matches!(
            s.handle_push(1, &push(1, 1.0, false)),
            Err(SyncError::TooManyItems {
                worker: 1,
                items: 5,
                max: 4
            })
        ));
        assert!(matches!(
            s.handle_push(0, &push(1, 1.0, true)),
            Err(SyncError::TooManyItems { worker: 0, .. })
        ));
        assert_eq!(budget.used(), kept, "a refused push keeps nothing");
        assert!(!s.handle_done(0));
        assert!(s.handle_push(1, step_marker(&mut Vec::new())).unwrap());
        assert_eq!(items(s.take_step().unwrap()).len(), 4);
        assert_eq!(budget.used(), 0, "taken, the step gives its bytes back");
        let mut s = SyncStep::new(2, limits, budget.clone());
        assert!(!s.handle_push(1, &push(1, 1.0, false)).unwrap());
        assert!(budget.used() > 0);
        drop(s);
        assert_eq!(budget.used(), 0, "dropped, the step gives its bytes back");

        // Bytes: a budget with room for two pushes' items, which other
        // connections fill meanwhile: whether a push fits depends on the
        // step alone, and what it keeps is counted beside theirs.
        let one = push(1, 1.0, false).len() - push_request_header_len();
        let budget = MemoryBudget::new(2 * one);
        budget.charge(2 * one);
        let mut s = SyncStep::new(2, Limits::default(), budget.clone());
        assert!(!s.handle_push(1, &push(1, 1.0, false)).unwrap());
        assert!(!s.handle_push(1, &push(1, 2.0, false)).unwrap());
        assert!(matches!(
            s.handle_push(1, &push(1, 3.0, false)),
            Err(SyncError::OverBudget { worker: 1, .. })
        ));
        assert_eq!(budget.used(), 4 * one);
        // An empty push that completes the step always fits.
        assert!(!s.handle_push(1, step_marker(&mut Vec::new())).unwrap());
        assert!(s.handle_done(0));
        assert_eq!(items(s.take_step().unwrap()), [(1, 1.0), (1, 2.0)]);
        assert_eq!(
            budget.used(),
            2 * one,
            "taken, the step gives its bytes back"
        );
    }
}

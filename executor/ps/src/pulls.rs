//! What each worker last pulled from a shard, for the rules that treat a
//! push by what it was computed on ([`OptimizerConfig::tracks_pulls`]): a
//! staleness-aware rate needs each row's update count at the pull, DC-ASGD
//! also its values (the paper's `w_bak`).
//!
//! The shard keeps them per worker, as the paper's parameter server does,
//! rather than having the push carry them: the wire format and the push's
//! size stay as they are, and a worker's pushes to a shard arrive on the
//! connection its pulls came on, in order, so the last pull before a push
//! is the one the push was computed on. The memory is one step's pull per
//! worker: the record starts again at the first pull after a push. Pushes
//! of an unknown sender (the gRPC baseline, a merged synchronous step)
//! find no record and are applied as they are.
//!
//! [`OptimizerConfig::tracks_pulls`]: crate::OptimizerConfig::tracks_pulls

use rustc_hash::FxHashMap;

use crate::optim::Pulled;

/// Workers with a larger task index are not tracked (their pushes are
/// applied as they are): bounds the memory a peer's index can claim.
pub(crate) const MAX_TRACKED_WORKERS: u32 = 1 << 12;

/// No values kept for an entry.
const NO_VALUES: u32 = u32::MAX;

/// One worker's last pull.
#[derive(Debug, Default)]
pub(crate) struct WorkerPulls {
    /// A push came after the pull: the next pull starts a new record.
    pushed: bool,
    /// (variable index, key; 0 for a dense variable) -> entry.
    index: FxHashMap<(u32, u64), u32>,
    /// Per entry: the update count at the pull and the offset of its
    /// values in `values` (or [`NO_VALUES`]).
    entries: Vec<(u64, u32)>,
    values: Vec<f32>,
}

impl WorkerPulls {
    /// A pull is about to be recorded.
    pub(crate) fn begin_pull(&mut self) {
        if std::mem::take(&mut self.pushed) {
            self.index.clear();
            self.entries.clear();
            self.values.clear();
        }
    }

    /// Variable `var`'s row `key` was pulled after `updates` updates,
    /// holding `values`. A row pulled twice before a push keeps its first
    /// record (the older values, which the gradient may have used).
    pub(crate) fn record(&mut self, var: u32, key: u64, updates: u64, values: Option<&[f32]>) {
        let next = self.entries.len() as u32;
        if *self.index.entry((var, key)).or_insert(next) != next {
            return;
        }
        let offset = match values {
            Some(v) => {
                let o = self.values.len() as u32;
                self.values.extend_from_slice(v);
                o
            }
            None => NO_VALUES,
        };
        self.entries.push((updates, offset));
    }

    /// What a push to `var`'s row `key`, which has had `updates` updates
    /// (`width` floats), was computed on.
    pub(crate) fn pulled(&self, var: u32, key: u64, updates: u64, width: usize) -> Pulled<'_> {
        let Some(&e) = self.index.get(&(var, key)) else {
            return Pulled::default();
        };
        let (then, offset) = self.entries[e as usize];
        Pulled {
            staleness: Some(updates.saturating_sub(then)),
            values: (offset != NO_VALUES)
                .then(|| self.values.get(offset as usize..offset as usize + width))
                .flatten(),
        }
    }

    /// A push was applied: the record is used up.
    pub(crate) fn end_push(&mut self) {
        self.pushed = true;
    }
}

/// Every tracked worker's last pull.
#[derive(Debug, Default)]
pub(crate) struct Pulls {
    by_worker: Vec<WorkerPulls>,
}

impl Pulls {
    /// Worker `w`'s record (created empty), unless `w` is not tracked.
    pub(crate) fn worker_mut(&mut self, w: u32) -> Option<&mut WorkerPulls> {
        if w >= MAX_TRACKED_WORKERS {
            return None;
        }
        let w = w as usize;
        if self.by_worker.len() <= w {
            self.by_worker.resize_with(w + 1, WorkerPulls::default);
        }
        Some(&mut self.by_worker[w])
    }

    /// Worker `w`'s record, if it has one.
    pub(crate) fn worker(&self, w: u32) -> Option<&WorkerPulls> {
        self.by_worker.get(w as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_uses_the_first_pull_and_the_next_pull_starts_again() {
        let mut p = Pulls::default();
        assert!(p.worker_mut(MAX_TRACKED_WORKERS).is_none());
        let w = p.worker_mut(3).unwrap();
        w.begin_pull();
        w.record(1, 7, 2, Some(&[1.0, 2.0]));
        w.record(1, 7, 5, Some(&[9.0, 9.0]));
        w.record(0, 0, 4, None);
        let got = w.pulled(1, 7, 6, 2);
        assert_eq!(got.staleness, Some(4));
        assert_eq!(got.values, Some(&[1.0f32, 2.0][..]));
        assert_eq!(w.pulled(0, 0, 4, 3).values, None);
        assert_eq!(w.pulled(1, 8, 6, 2), Pulled::default());
        w.end_push();
        // Pushes after the same pull (no fusion) still see it.
        assert_eq!(w.pulled(0, 0, 9, 3).staleness, Some(5));
        w.begin_pull();
        assert_eq!(w.pulled(1, 7, 6, 2), Pulled::default());
        assert!(p.worker(3).is_some() && p.worker(4).is_none());
    }
}

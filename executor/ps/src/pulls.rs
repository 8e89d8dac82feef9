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
//! A worker pushes its rows' gradients in the order it pulled them, so a
//! push is matched with its pull by position (one comparison of the key
//! lists); a key map is built only for a push in another order.
//!
//! [`OptimizerConfig::tracks_pulls`]: crate::OptimizerConfig::tracks_pulls

use rustc_hash::FxHashMap;

use crate::optim::Pulled;

/// Workers with a larger task index are not tracked (their pushes are
/// applied as they are): bounds the memory a peer's index can claim.
pub(crate) const MAX_TRACKED_WORKERS: u32 = 1 << 12;

/// What one worker pulled of one variable (a dense variable is one row,
/// key 0), in pull order.
#[derive(Debug, Default)]
pub(crate) struct VarPulls {
    pub(crate) keys: Vec<u64>,
    /// Each row's update count at the pull.
    updates: Vec<u64>,
    /// Each row's values at the pull (empty when not kept).
    values: Vec<f32>,
    /// Key -> first position, built on demand.
    index: FxHashMap<u64, u32>,
    indexed: bool,
}

impl VarPulls {
    fn clear(&mut self) {
        self.keys.clear();
        self.updates.clear();
        self.values.clear();
        self.index.clear();
        self.indexed = false;
    }

    /// What the row at position `j` was pulled as, for an update of a
    /// row that has had `updates` updates (`width` floats).
    pub(crate) fn at(&self, j: usize, updates: u64, width: usize) -> Pulled<'_> {
        Pulled {
            staleness: self.updates.get(j).map(|&u| updates.saturating_sub(u)),
            values: self.values.get(j * width..(j + 1) * width),
        }
    }

    /// The position of `key`'s first pull.
    fn position(&mut self, key: u64) -> Option<usize> {
        if !self.indexed {
            for (j, &k) in self.keys.iter().enumerate() {
                self.index.entry(k).or_insert(j as u32);
            }
            self.indexed = true;
        }
        self.index.get(&key).map(|&j| j as usize)
    }
}

/// One worker's last pull.
#[derive(Debug, Default)]
pub(crate) struct WorkerPulls {
    /// A push came after the pull: the next pull starts a new record.
    pushed: bool,
    /// By variable index.
    vars: Vec<VarPulls>,
}

impl WorkerPulls {
    /// A pull is about to be recorded.
    pub(crate) fn begin_pull(&mut self) {
        if std::mem::take(&mut self.pushed) {
            self.vars.iter_mut().for_each(VarPulls::clear);
        }
    }

    /// Variable `var`'s row `key` was pulled after `updates` updates,
    /// holding `values`. A row pulled twice before a push is found at its
    /// first pull (the older values, which the gradient may have used).
    pub(crate) fn record(&mut self, var: u32, key: u64, updates: u64, values: Option<&[f32]>) {
        let var = var as usize;
        if self.vars.len() <= var {
            self.vars.resize_with(var + 1, VarPulls::default);
        }
        let v = &mut self.vars[var];
        v.keys.push(key);
        v.updates.push(updates);
        if let Some(values) = values {
            v.values.extend_from_slice(values);
        }
        v.indexed = false;
    }

    /// What variable `var` was pulled as, if it was.
    pub(crate) fn var(&self, var: u32) -> Option<&VarPulls> {
        self.vars.get(var as usize).filter(|v| !v.keys.is_empty())
    }

    /// What a push to `var`'s row `key`, which has had `updates` updates
    /// (`width` floats), was computed on.
    pub(crate) fn pulled(&mut self, var: u32, key: u64, updates: u64, width: usize) -> Pulled<'_> {
        let Some(v) = self.vars.get_mut(var as usize) else {
            return Pulled::default();
        };
        match v.position(key) {
            Some(j) => v.at(j, updates, width),
            None => Pulled::default(),
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

    /// Take worker `w`'s record out (to read it while the variables
    /// change); [`Self::put_back`] returns it.
    pub(crate) fn take(&mut self, w: u32) -> Option<WorkerPulls> {
        self.by_worker.get_mut(w as usize).map(std::mem::take)
    }

    /// Return a record [`Self::take`] took.
    pub(crate) fn put_back(&mut self, w: u32, rec: WorkerPulls) {
        if let Some(r) = self.by_worker.get_mut(w as usize) {
            *r = rec;
        }
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
        w.record(1, 9, 0, Some(&[3.0, 4.0]));
        w.record(1, 7, 5, Some(&[9.0, 9.0]));
        w.record(0, 0, 4, None);
        let got = w.pulled(1, 7, 6, 2);
        assert_eq!(got.staleness, Some(4));
        assert_eq!(got.values, Some(&[1.0f32, 2.0][..]));
        assert_eq!(w.var(1).unwrap().keys, [7, 9, 7]);
        assert_eq!(
            w.var(1).unwrap().at(1, 1, 2).values,
            Some(&[3.0f32, 4.0][..])
        );
        assert_eq!(w.pulled(0, 0, 4, 3).values, None);
        assert_eq!(w.pulled(1, 8, 6, 2), Pulled::default());
        assert_eq!(w.pulled(5, 8, 6, 2), Pulled::default());
        w.end_push();
        // Pushes after the same pull (no fusion) still see it.
        assert_eq!(w.pulled(0, 0, 9, 3).staleness, Some(5));
        w.begin_pull();
        assert_eq!(w.pulled(1, 7, 6, 2), Pulled::default());
        assert!(w.var(1).is_none());
        let rec = p.take(3).unwrap();
        assert!(p.take(4).is_none());
        p.put_back(3, rec);
    }
}

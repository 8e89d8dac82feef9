//! Pushes applied with what their worker pulled ([`crate::pulls`]): the
//! staleness-aware rate and DC-ASGD.

use super::EmbeddingTable;
use crate::pulls::WorkerPulls;

impl EmbeddingTable {
    /// Record the rows of `keys` (those that have one) in `rec` as pulled,
    /// with their values when the optimizer compensates with them.
    pub(crate) fn record_pulled(
        &self,
        var: u32,
        keys: impl Iterator<Item = u64>,
        rec: &mut WorkerPulls,
    ) {
        let values = self.opt.kind.needs_pulled_values();
        for k in keys {
            if let Some((s, row)) = self.rows.get(k) {
                rec.record(var, k, s.updates, values.then(|| &row[..self.dim]));
            }
        }
    }

    /// [`Self::apply_accumulated_at`] for a push whose worker's pull is
    /// `rec` (variable index `var`): each row's update is given its
    /// staleness and pulled values. Returns the rows updated.
    pub(crate) fn apply_accumulated_stale(
        &mut self,
        step: u64,
        var: u32,
        rec: &WorkerPulls,
    ) -> u64 {
        let dim = self.dim;
        let keys = std::mem::take(&mut self.scratch.acc_keys);
        let mut applied = 0;
        for (i, key) in keys.iter().enumerate() {
            let Some(s) = self.rows.map.get_mut(key) else {
                self.stats.ignored_pushes += 1;
                continue;
            };
            let pulled = rec.pulled(var, *key, s.updates, dim);
            s.updates += 1;
            s.last_access = s.last_access.max(step);
            let (index, t) = (s.index, s.updates);
            let g = &self.scratch.acc_grads[i * dim..(i + 1) * dim];
            let (w, slots) = self.rows.arena.row_mut(index).split_at_mut(dim);
            self.opt.apply_stale(w, slots, g, t, step, pulled);
            applied += 1;
        }
        self.scratch.acc_keys = keys;
        self.scratch.acc_index.clear();
        self.scratch.acc_keys.clear();
        self.scratch.acc_grads.clear();
        applied
    }
}

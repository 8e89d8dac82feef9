//! Pushes applied with what their worker pulled ([`crate::pulls`]): the
//! staleness-aware rate and DC-ASGD.

use starwire_wire::ps::{F32s, U64s};

use super::EmbeddingTable;
use crate::pulls::{keeps_updates, VarPulls, WorkerPulls};

/// True when `keys` are `pulled`'s keys, in order: a push of the rows its
/// worker pulled, matched by position.
pub(crate) fn same_keys(keys: U64s<'_>, pulled: Option<&VarPulls>) -> bool {
    pulled.is_some_and(|v| {
        if keys.len() != v.keys.len() {
            return false;
        }
        // On a little-endian host the recorded keys' bytes are the wire's:
        // one comparison of the two byte strings, not a decode per key.
        if cfg!(target_endian = "little") {
            return keys.as_bytes() == bytemuck::cast_slice::<u64, u8>(&v.keys);
        }
        keys.iter().eq(v.keys.iter().copied())
    })
}

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
        let updates = keeps_updates(&self.opt);
        for k in keys {
            if let Some((s, row)) = self.rows.get(k) {
                let u = updates.then_some(s.updates);
                rec.record(var, k, u, values.then(|| &row[..self.dim]));
            }
        }
    }

    /// [`Self::record_pulled`] for a rows pull item of `keys` just
    /// answered with `reply` (its rows, key after key). Without a
    /// frequency filter every key of an answered pull has a row, so when
    /// the record is the keys and values alone (DC-ASGD without a
    /// staleness-aware rate) it is copied from the request and the reply
    /// rather than looked up again: with `in_reply`, the byte offset of
    /// `reply` in the reply body to be attached, the values are read from
    /// that body ([`WorkerPulls::attach_reply`]), else copied.
    pub(crate) fn record_pulled_rows(
        &self,
        var: u32,
        keys: U64s<'_>,
        reply: F32s<'_>,
        in_reply: Option<usize>,
        rec: &mut WorkerPulls,
    ) {
        let copy = self.policy.filter_freq <= 1
            && self.opt.kind.needs_pulled_values()
            && !keeps_updates(&self.opt)
            && reply.len() == keys.len() * self.dim;
        if copy {
            match in_reply {
                Some(at) => rec.record_rows_in_reply(var, keys, reply, at),
                None => rec.record_rows(var, keys, reply),
            }
        } else {
            self.record_pulled(var, keys.iter(), rec);
        }
    }

    /// [`Self::apply_accumulated_at`] for a push whose worker's pull is
    /// `rec` (variable index `var`): each row's update is given its
    /// staleness and pulled values. Returns the rows updated.
    pub(crate) fn apply_accumulated_stale(
        &mut self,
        step: u64,
        var: u32,
        rec: &mut WorkerPulls,
    ) -> u64 {
        let dim = self.dim;
        let keys = std::mem::take(&mut self.scratch.acc_keys);
        let positional = rec.var(var).is_some_and(|v| v.keys == keys);
        let mut applied = 0;
        for (i, key) in keys.iter().enumerate() {
            let Some(index) = self.rows.map.get(*key).map(|h| h.index) else {
                self.stats.ignored_pushes += 1;
                continue;
            };
            let m = &mut self.rows.meta[index as usize];
            let before = m.updates;
            m.updates += 1;
            m.last_access = m.last_access.max(step);
            let t = m.updates;
            let pulled = match rec.var(var).filter(|_| positional) {
                Some(v) => v.at(i, before, dim),
                None => rec.pulled(var, *key, before, dim),
            };
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

    /// [`Self::push_rows_direct`] for a push item whose keys are those of
    /// `pulled`, in order ([`same_keys`]).
    pub(crate) fn push_rows_direct_stale(&mut self, grads: F32s<'_>, step: u64, pulled: &VarPulls) {
        let dim = self.dim;
        self.push_rows_direct_by(grads, |opt, w, slots, g, j, t| {
            // `prepare_direct` counted this update: `t - 1` before it.
            let p = pulled.at(j, t - 1, dim);
            opt.apply_stale(w, slots, g, t, step, p);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(keys: &[u64]) -> Vec<u8> {
        keys.iter().flat_map(|k| k.to_le_bytes()).collect()
    }

    #[test]
    fn same_keys_means_the_same_keys_in_the_same_order() {
        let mut rec = WorkerPulls::default();
        rec.begin_pull(0, [], &mut Vec::new(), crate::pulls::MAX_RECORD_BYTES);
        for k in [7u64, 1 << 40, 3] {
            rec.record(0, k, None, None);
        }
        let pulled = rec.var(0);
        let check = |keys: &[u64]| {
            let b = le(keys);
            same_keys(U64s::new(&b).unwrap(), pulled)
        };
        assert!(check(&[7, 1 << 40, 3]));
        assert!(!check(&[7, 3, 1 << 40]), "another order");
        assert!(!check(&[7, 1 << 40]), "fewer");
        assert!(!check(&[7, 1 << 40, 3, 3]), "more");
        assert!(!check(&[7, (1 << 40) + 1, 3]), "one key differs");
        // Keys not 8-aligned in memory compare the same.
        let mut odd = vec![0u8];
        odd.extend_from_slice(&le(&[7, 1 << 40, 3]));
        assert!(same_keys(U64s::new(&odd[1..]).unwrap(), pulled));
        assert!(!same_keys(U64s::new(&le(&[7])).unwrap(), None));
    }
}

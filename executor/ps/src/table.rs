//! [`EmbeddingTable`]: one shard's piece of a hash embedding table, with
//! DeepRec EmbeddingVariable semantics (create on first pull, frequency
//! filter, time-to-live eviction counted in global steps).

use rustc_hash::FxHashMap;

use rustc_hash::FxHashSet;

use crate::optim::OptimizerConfig;
use crate::proto::F32s;
use crate::var::VarDef;

/// Keys are already well-mixed feature hashes, so the map uses FxHash (one
/// multiply) rather than SipHash.
type Map<V> = FxHashMap<u64, V>;

/// One row: `dim` weights followed by the optimizer slots, plus the
/// bookkeeping for eviction and Adam's per-row bias correction.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    /// `dim * (1 + slots)` floats: weights, then each slot.
    pub(crate) data: Box<[f32]>,
    /// Global step of the last pull or update.
    pub(crate) last_access: u64,
    /// Number of optimizer updates applied to this row.
    pub(crate) updates: u64,
}

/// A key not admitted yet (`filter_freq > 1`): how often it was pulled and when last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) count: u32,
    pub(crate) last_seen: u64,
}

/// Admission and eviction policy of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TablePolicy {
    /// A key gets a row on its `filter_freq`-th pull (0 or 1: on the first);
    /// [`crate::PsShard`] counts a key at most once per pull request.
    pub filter_freq: u32,
    /// Rows (and pending filter counters) not pulled or updated in the last
    /// `steps_to_live` global steps are removed by [`EmbeddingTable::evict`]; 0 = never.
    pub steps_to_live: u64,
    /// At most this many keys are counted by the frequency filter at once.
    /// When the counter map is full, pulls of further new keys are filtered
    /// without being counted (see [`TableStats::filter_overflow`]); counters
    /// leave the map when their key is admitted or evicted by the TTL.
    pub filter_capacity: usize,
}

impl Default for TablePolicy {
    fn default() -> Self {
        Self {
            filter_freq: 0,
            steps_to_live: 0,
            filter_capacity: 1 << 22,
        }
    }
}

/// Counters of a table (cumulative since creation or restore).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TableStats {
    /// Rows created (first pull after admission).
    pub admitted: u64,
    /// Pulls of a key that has no row yet because of the frequency filter (answered with zeros).
    pub filtered_pulls: u64,
    /// Pulls of a new key that the full filter counter map could not count.
    pub filter_overflow: u64,
    /// Rows removed by [`EmbeddingTable::evict`].
    pub evicted: u64,
    /// Gradient rows pushed for keys that have no row (filtered or evicted); ignored.
    pub ignored_pushes: u64,
}

/// This shard's piece of one embedding table.
#[derive(Debug, Clone)]
pub struct EmbeddingTable {
    pub(crate) def: VarDef,
    pub(crate) dim: usize,
    pub(crate) seed: u64,
    pub(crate) opt: OptimizerConfig,
    pub(crate) policy: TablePolicy,
    pub(crate) rows: Map<Row>,
    pub(crate) pending: Map<Pending>,
    pub(crate) stats: TableStats,
    // Push accumulation (duplicate keys summed before the update).
    acc_index: Map<u32>,
    acc_keys: Vec<u64>,
    acc_grads: Vec<f32>,
    // Keys without a row counted by the filter in the current pull request.
    counted: FxHashSet<u64>,
}

impl EmbeddingTable {
    /// An empty table for `def` (which must be an embedding).
    pub fn new(
        def: VarDef,
        dim: usize,
        seed: u64,
        opt: OptimizerConfig,
        policy: TablePolicy,
    ) -> Self {
        Self {
            def,
            dim,
            seed,
            opt,
            policy,
            rows: Map::default(),
            pending: Map::default(),
            stats: TableStats::default(),
            acc_index: Map::default(),
            acc_keys: Vec::new(),
            acc_grads: Vec::new(),
            counted: FxHashSet::default(),
        }
    }

    /// Row width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The variable this table holds.
    pub fn def(&self) -> &VarDef {
        &self.def
    }

    /// Number of rows held.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when no row is held.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Number of keys counted by the frequency filter and not admitted yet.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Counters.
    pub fn stats(&self) -> TableStats {
        self.stats
    }

    /// The weights of `key`, if it has a row (no side effects).
    pub fn get(&self, key: u64) -> Option<&[f32]> {
        self.rows.get(&key).map(|r| &r.data[..self.dim])
    }

    /// The optimizer slots of `key` (slot after slot), if it has a row.
    pub fn slots(&self, key: u64) -> Option<&[f32]> {
        self.rows.get(&key).map(|r| &r.data[self.dim..])
    }

    /// Pull `key` at global step `step`: creates the row if the key is
    /// admitted, refreshes its access time and returns its weights; `None`
    /// while the frequency filter holds the key back (the caller uses zeros).
    /// Every call counts towards the filter.
    pub fn pull(&mut self, key: u64, step: u64) -> Option<&[f32]> {
        self.pull_row(key, step, false)
    }

    /// [`Self::pull`] for a pull request: a key without a row advances its
    /// filter counter at most once until [`Self::end_request`]; further
    /// occurrences in the same request are answered with zeros (and counted
    /// as filtered pulls) without counting.
    pub(crate) fn pull_once(&mut self, key: u64, step: u64) -> Option<&[f32]> {
        self.pull_row(key, step, true)
    }

    /// Forget the keys counted by [`Self::pull_once`] in the current request.
    pub(crate) fn end_request(&mut self) {
        if !self.counted.is_empty() {
            self.counted.clear();
        }
    }

    fn pull_row(&mut self, key: u64, step: u64, once: bool) -> Option<&[f32]> {
        use std::collections::hash_map::Entry;
        let dim = self.dim;
        // One hash lookup for an existing row; a new row goes into the slot
        // that lookup found.
        let row = match self.rows.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => {
                if once && self.policy.filter_freq > 1 && !self.counted.insert(key) {
                    self.stats.filtered_pulls += 1;
                    return None;
                }
                if !admit(&mut self.pending, &mut self.stats, &self.policy, key, step) {
                    return None;
                }
                let slots = self.opt.slots();
                let mut data = vec![0.0f32; dim * (1 + slots)].into_boxed_slice();
                let (w, s) = data.split_at_mut(dim);
                self.def.init_values(self.seed, key, w);
                self.opt.init_slots(s);
                self.stats.admitted += 1;
                v.insert(Row {
                    data,
                    last_access: step,
                    updates: 0,
                })
            }
        };
        row.last_access = row.last_access.max(step);
        Some(&row.data[..dim])
    }

    /// Add `grad` (one row, `dim` floats) to the gradient accumulated for
    /// `key` in the current push.
    pub(crate) fn accumulate(&mut self, key: u64, grad: F32s<'_>) {
        let dim = self.dim;
        let next = self.acc_keys.len() as u32;
        let slot = *self.acc_index.entry(key).or_insert(next);
        if slot == next {
            self.acc_keys.push(key);
            let base = self.acc_grads.len();
            self.acc_grads.resize(base + dim, 0.0);
            grad.copy_to(&mut self.acc_grads[base..]);
        } else {
            let base = slot as usize * dim;
            grad.add_to(&mut self.acc_grads[base..base + dim]);
        }
    }

    /// True when gradients are waiting in the accumulator.
    pub(crate) fn has_accumulated(&self) -> bool {
        !self.acc_keys.is_empty()
    }

    /// Apply the accumulated gradients without refreshing access times.
    #[cfg(test)]
    fn apply_accumulated(&mut self) -> u64 {
        self.apply_at(None)
    }

    fn apply_at(&mut self, step: Option<u64>) -> u64 {
        let dim = self.dim;
        let mut applied = 0;
        for (i, key) in self.acc_keys.iter().enumerate() {
            let g = &self.acc_grads[i * dim..(i + 1) * dim];
            match self.rows.get_mut(key) {
                Some(row) => {
                    row.updates += 1;
                    if let Some(s) = step {
                        row.last_access = row.last_access.max(s);
                    }
                    let (w, slots) = row.data.split_at_mut(dim);
                    self.opt.apply(w, slots, g, row.updates);
                    applied += 1;
                }
                None => self.stats.ignored_pushes += 1,
            }
        }
        self.acc_index.clear();
        self.acc_keys.clear();
        self.acc_grads.clear();
        applied
    }

    /// Apply the accumulated gradients, refreshing the access time of the
    /// updated rows to `step`; returns the number of rows updated.
    pub(crate) fn apply_accumulated_at(&mut self, step: u64) -> u64 {
        self.apply_at(Some(step))
    }

    /// Remove rows and pending filter counters not pulled or updated in the
    /// last `steps_to_live` global steps (`global_step - last_access >=
    /// steps_to_live`). Returns the number of rows removed. No-op when
    /// `steps_to_live` is 0.
    pub fn evict(&mut self, global_step: u64) -> usize {
        let ttl = self.policy.steps_to_live;
        if ttl == 0 {
            return 0;
        }
        let before = self.rows.len();
        self.rows
            .retain(|_, r| global_step.saturating_sub(r.last_access) < ttl);
        self.pending
            .retain(|_, p| global_step.saturating_sub(p.last_seen) < ttl);
        let n = before - self.rows.len();
        self.stats.evicted += n as u64;
        n
    }
}

/// Count one pull of `key`, which has no row; true when it is admitted now.
fn admit(
    pending: &mut Map<Pending>,
    stats: &mut TableStats,
    policy: &TablePolicy,
    key: u64,
    step: u64,
) -> bool {
    let need = policy.filter_freq;
    if need <= 1 {
        return true;
    }
    let count = if let Some(p) = pending.get_mut(&key) {
        p.count += 1;
        p.last_seen = step;
        p.count
    } else if pending.len() < policy.filter_capacity {
        pending.insert(
            key,
            Pending {
                count: 1,
                last_seen: step,
            },
        );
        1
    } else {
        stats.filter_overflow += 1;
        stats.filtered_pulls += 1;
        return false;
    };
    if count >= need {
        pending.remove(&key);
        true
    } else {
        stats.filtered_pulls += 1;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::var::{Init, VarKind};

    /// One gradient row of 4 equal floats, encoded.
    fn grad(x: f32) -> Vec<u8> {
        [x; 4].iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn table(filter_freq: u32, steps_to_live: u64, cap: usize) -> EmbeddingTable {
        let def = VarDef {
            id: 3,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 4 },
            init: Init::Uniform { scale: 0.1 },
        };
        EmbeddingTable::new(
            def,
            4,
            9,
            OptimizerConfig::sgd(1.0),
            TablePolicy {
                filter_freq,
                steps_to_live,
                filter_capacity: cap,
            },
        )
    }

    #[test]
    fn created_on_first_pull_with_seeded_values() {
        let mut t = table(0, 0, 16);
        let r = t.pull(11, 0).unwrap().to_vec();
        let mut want = vec![0.0; 4];
        t.def().init_values(9, 11, &mut want);
        assert_eq!(r, want);
        assert_eq!(t.len(), 1);
        assert_eq!(t.stats().admitted, 1);
    }

    #[test]
    fn filter_admits_on_nth_pull_and_ignores_pushes_before() {
        let mut t = table(3, 0, 16);
        assert!(t.pull(5, 0).is_none());
        t.accumulate(5, F32s::new(&grad(1.0)).unwrap());
        assert_eq!(t.apply_accumulated(), 0);
        assert_eq!(t.stats().ignored_pushes, 1);
        assert!(t.pull(5, 1).is_none());
        assert_eq!(t.pending_len(), 1);
        assert!(t.pull(5, 2).is_some());
        assert_eq!(t.pending_len(), 0);
        assert_eq!(t.stats().filtered_pulls, 2);
        assert_eq!(t.stats().admitted, 1);
    }

    #[test]
    fn filter_counter_map_is_bounded() {
        let mut t = table(2, 0, 2);
        for k in 1..=5 {
            assert!(t.pull(k, 0).is_none());
        }
        assert_eq!(t.pending_len(), 2);
        assert_eq!(t.stats().filter_overflow, 3);
        // Keys 1 and 2 are counted, so they are admitted on the next pull.
        assert!(t.pull(1, 1).is_some());
        assert!(t.pull(5, 1).is_none());
    }

    #[test]
    fn ttl_evicts_stale_rows_only() {
        let mut t = table(0, 10, 16);
        t.pull(1, 0);
        t.pull(2, 5);
        t.accumulate(1, F32s::new(&grad(0.5)).unwrap());
        t.apply_accumulated_at(8);
        assert_eq!(t.evict(14), 0);
        assert_eq!(t.evict(15), 1); // row 2: last access 5
        assert!(t.get(2).is_none());
        assert!(t.get(1).is_some());
        assert_eq!(t.evict(18), 1);
        assert_eq!(t.stats().evicted, 2);
        // Re-created with the same initial values.
        let again = t.pull(2, 20).unwrap().to_vec();
        let mut want = vec![0.0; 4];
        t.def().init_values(9, 2, &mut want);
        assert_eq!(again, want);
    }

    #[test]
    fn duplicate_keys_are_summed() {
        let mut t = table(0, 0, 16);
        let before = t.pull(7, 0).unwrap().to_vec();
        t.accumulate(7, F32s::new(&grad(1.0)).unwrap());
        t.accumulate(7, F32s::new(&grad(2.0)).unwrap());
        assert_eq!(t.apply_accumulated(), 1);
        let after = t.get(7).unwrap();
        for (a, b) in after.iter().zip(&before) {
            assert!((a - (b - 3.0)).abs() < 1e-6);
        }
    }
}

//! [`EmbeddingTable`]: one shard's piece of a hash embedding table, with
//! DeepRec EmbeddingVariable semantics (create on first pull, frequency
//! filter, time-to-live eviction counted in global steps).

use starwire_wire::ps::{put_f32s, F32s, U64s};

use crate::optim::OptimizerConfig;
use crate::prefetch;
use crate::pulls::MAX_TRACKED_WORKERS;
use crate::var::VarDef;

mod counters;
mod defaults;
mod keymap;
pub(crate) mod prefault;
mod rows;
mod stale;
use crate::keyhash::{KeyMapOf, KeySet};
use counters::Counted;
pub(crate) use counters::Counters;
use defaults::Defaults;
use rows::alloc;
use rows::Held;
pub(crate) use rows::Rows;
pub use rows::{NoRoom, TableFull};
pub(crate) use stale::same_keys;

/// Keys come from peers: a seeded hash ([`crate::keyhash`]).
type Map<V> = KeyMapOf<V>;

/// Marks a key that has no row in [`EmbeddingTable::resolve`]'s output.
const NO_ROW: u32 = u32::MAX;

/// A key not admitted yet (`filter_freq > 1`): how often it was pulled and when last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) count: u32,
    pub(crate) last_seen: u64,
}

/// DeepRec's `default_value_dim` default: a table's default value matrix
/// has 4096 rows.
pub const DEFAULT_VALUE_DIM: usize = 4096;

/// Admission, eviction and initialisation policy of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TablePolicy {
    /// A key gets a row on its `filter_freq`-th pull (0 or 1: on the first);
    /// [`crate::PsShard`] counts a key at most once per pull request.
    pub filter_freq: u32,
    /// Rows (and pending filter counters) not pulled or updated in the last
    /// `steps_to_live` global steps are removed by [`EmbeddingTable::evict`]; 0 = never.
    pub steps_to_live: u64,
    /// At most this many keys are counted by the frequency filter at once.
    /// When the counters are full, a new key's counter takes the place of
    /// one chosen by CLOCK ([`counters`], [`TableStats::filter_overflow`]);
    /// counters also leave when their key is admitted or evicted by the
    /// TTL.
    pub filter_capacity: usize,
    /// DeepRec `default_value_dim`: a new row copies row
    /// `key % default_value_dim` of the table's default value matrix,
    /// whose row `i` holds the initial values of key `i` (see
    /// [`crate::var`]). 0: every row gets the initial values of its own
    /// key (one initialiser run per new row).
    pub default_value_dim: usize,
    /// Most rows the table (this shard's piece of it) holds; a pull that
    /// needs more is refused ([`TableFull`]).
    pub max_rows: usize,
}

/// The default of [`TablePolicy::max_rows`] (`--max-rows`).
pub const DEFAULT_MAX_ROWS: usize = 100_000_000;

impl Default for TablePolicy {
    fn default() -> Self {
        Self {
            filter_freq: 0,
            steps_to_live: 0,
            filter_capacity: 1 << 22,
            default_value_dim: DEFAULT_VALUE_DIM,
            max_rows: DEFAULT_MAX_ROWS,
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
    /// Counters of the frequency filter dropped to make room for a new
    /// key's, the map being full (or, with a capacity of 0, pulls of new
    /// keys not counted).
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
    pub(crate) rows: Rows,
    pub(crate) pending: Counters,
    pub(crate) stats: TableStats,
    defaults: Option<std::sync::Arc<Defaults>>,
    scratch: Box<Scratch>,
}

/// Buffers of one request, reused (not state).
#[derive(Debug, Clone, Default)]
struct Scratch {
    // Push accumulation (duplicate keys summed before the update).
    acc_index: Map<u32>,
    acc_keys: Vec<u64>,
    acc_grads: Vec<f32>,
    // Keys without a row counted by the filter in the current pull request.
    counted: KeySet,
    // Row indices of the keys of one pull.
    resolved: Vec<u32>,
    // The new rows of one pull: position in `resolved` and key.
    fresh: Vec<(usize, u64)>,
    // Row indices and update counts of the rows of one push.
    targets: Vec<(u32, u64)>,
    // One bit per row index: the rows of the push item being checked for
    // repeats (all clear between items).
    marks: Vec<u64>,
    // One gradient row decoded from a push item.
    grad_row: Vec<f32>,
    // `prepare_direct` accepted a push item whose update is still to come.
    direct_ready: bool,
    // The rows `prepare_direct` counted an update for: each row index and
    // its access step before, to give the counts back if the push is
    // refused.
    direct_undo: Vec<(u32, u64)>,
    // By worker: its last rows pull of the table, whose rows its push of
    // the same keys updates without looking them up again.
    pulled: Vec<PulledRows>,
}

/// A worker's last rows pull of a table: its keys, in order, and the row
/// each had ([`NO_ROW`] for none), under the key -> row assignment of
/// [`Rows::epoch`] `epoch`.
#[derive(Debug, Clone, Default)]
struct PulledRows {
    epoch: u64,
    keys: Vec<u64>,
    rows: Vec<u32>,
}

impl PulledRows {
    /// The rows of `keys` when they are this pull's keys, in order, and
    /// no key has lost its row since (`epoch` is still the table's).
    fn rows_of(&self, keys: U64s<'_>, epoch: u64) -> Option<&[u32]> {
        if self.epoch != epoch || self.keys.len() != keys.len() || self.rows.len() != keys.len() {
            return None;
        }
        // On a little-endian host the kept keys' bytes are the wire's:
        // one comparison of the two byte strings.
        let same = if cfg!(target_endian = "little") {
            keys.as_bytes() == bytemuck::cast_slice::<u64, u8>(&self.keys)
        } else {
            keys.iter().eq(self.keys.iter().copied())
        };
        same.then_some(&self.rows[..])
    }
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
        let defaults = Defaults::shared(&def, seed, policy.default_value_dim, dim);
        Self {
            def,
            dim,
            seed,
            opt,
            policy,
            rows: Rows::with_capacity(dim * (1 + opt.slots()), 0),
            pending: Counters::default(),
            stats: TableStats::default(),
            defaults,
            scratch: Box::default(),
        }
    }

    /// Make room for `rows` rows (a capacity hint: a table holds whatever
    /// rows its pulls create): the key map takes them without growing,
    /// and, unless the frequency filter may keep keys out, a thread of
    /// [`prefault`] maps and faults in the arena's blocks for that many
    /// rows rather than the pulls that create the rows. Both are done
    /// when the first row comes, so a table never pulled holds nothing;
    /// [`Self::take_prefault`] starts the blocks sooner, and then they are
    /// faulted in whether or not a row comes. Give a number of
    /// rows the table will reach (the training data's sample holds a
    /// lower bound): pages faulted in for rows never made are memory held
    /// for nothing. At most `max_rows`, which the table never passes.
    pub(crate) fn reserve(&mut self, rows: usize) {
        let rows = rows.min(self.policy.max_rows.saturating_sub(self.rows.next as usize));
        self.rows.reserve(rows, self.policy.filter_freq <= 1);
    }

    /// The reserved rows' blocks ([`Self::reserve`]), for
    /// [`prefault::spawn`] to start before the table's first row.
    pub(crate) fn take_prefault(&mut self) -> Option<prefault::Order> {
        self.rows.take_order()
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
        self.rows.get(key).map(|(_, r)| &r[..self.dim])
    }

    /// The optimizer slots of `key` (slot after slot), if it has a row.
    pub fn slots(&self, key: u64) -> Option<&[f32]> {
        self.rows.get(key).map(|(_, r)| &r[self.dim..])
    }

    /// Pull `key` at global step `step`: creates the row if the key is
    /// admitted, refreshes its access time and returns its weights; `None`
    /// while the frequency filter holds the key back (the caller uses zeros).
    /// Every call counts towards the filter. An error when a new row has no
    /// room ([`TablePolicy::max_rows`], memory).
    pub fn pull(&mut self, key: u64, step: u64) -> Result<Option<&[f32]>, TableFull> {
        self.pull_row(key, step, false)
    }

    /// [`Self::pull`] for a pull request: a key without a row advances its
    /// filter counter at most once until [`Self::end_request`]; further
    /// occurrences in the same request are answered with zeros (and counted
    /// as filtered pulls) without counting.
    pub(crate) fn pull_once(&mut self, key: u64, step: u64) -> Result<Option<&[f32]>, TableFull> {
        self.pull_row(key, step, true)
    }

    /// Forget the keys counted by [`Self::pull_once`] in the current request.
    pub(crate) fn end_request(&mut self) {
        if !self.scratch.counted.is_empty() {
            self.scratch.counted.clear();
        }
    }

    fn pull_row(&mut self, key: u64, step: u64, once: bool) -> Result<Option<&[f32]>, TableFull> {
        let (index, new) = self.resolve(key, step, once)?;
        if new {
            self.init_row(index, key);
        }
        self.rows.touch(index, step);
        Ok((index != NO_ROW).then(|| &self.rows.arena.row(index)[..self.dim]))
    }

    /// How many of `keys` have no row: those a pull could create. Each
    /// distinct key counts once.
    pub(crate) fn count_missing(
        &self,
        keys: impl Iterator<Item = u64>,
        seen: &mut KeySet,
    ) -> usize {
        keys.filter(|&k| !self.rows.map.contains_key(k) && seen.insert(k))
            .count()
    }

    /// The row index of `key` for a pull at `step` ([`NO_ROW`] while the
    /// filter holds it back), creating the row if the key is admitted now
    /// (a new row's access time is `step`; the caller refreshes an
    /// existing row's with [`Rows::touch`]); true when the row is new:
    /// its floats are stale or zero until [`Self::init_row`].
    fn resolve(&mut self, key: u64, step: u64, once: bool) -> Result<(u32, bool), TableFull> {
        self.rows.reserve_before_insert();
        let rows = &mut self.rows;
        let max_rows = self.policy.max_rows;
        let len = rows.map.len();
        // One probe for an existing row; a new row goes into the position
        // that probe found.
        let found = rows.map.find(key);
        if let Some(keymap::Found::At(at)) = found {
            return Ok((rows.map.slot_mut(at).index, false));
        }
        if once && self.policy.filter_freq > 1 && !self.scratch.counted.insert(key) {
            self.stats.filtered_pulls += 1;
            return Ok((NO_ROW, false));
        }
        if !admit(&mut self.pending, &mut self.stats, &self.policy, key, step) {
            return Ok((NO_ROW, false));
        }
        let full = |why| TableFull {
            var: self.def.id,
            rows: len,
            why,
        };
        if len >= max_rows {
            return Err(full(NoRoom::MaxRows));
        }
        let index = alloc(&mut rows.arena, &mut rows.next, &mut rows.free).map_err(full)?;
        // Admitted and given a row: its counter is done with. A refusal
        // above keeps it (at the threshold: the key's next pull with room
        // admits it).
        if self.policy.filter_freq > 1 {
            self.pending.remove(key);
        }
        self.stats.admitted += 1;
        rows.start_meta(index, 0, step);
        rows.map.insert_at(found, key, Held { index });
        Ok((index, true))
    }

    /// Give the new row `index` of `key` its initial weights and slots.
    fn init_row(&mut self, index: u32, key: u64) {
        let (w, s) = self.rows.arena.row_mut(index).split_at_mut(self.dim);
        match self.defaults.as_deref() {
            Some(d) => w.copy_from_slice(d.row(key)),
            None => self.def.init_values(self.seed, key, w),
        }
        self.opt.init_slots(s);
    }

    /// Answer a rows pull item: append the rows of `keys` (zeros for keys
    /// the filter holds back) to `out` as little-endian floats, with
    /// [`Self::pull_once`]'s semantics for every key.
    ///
    /// Two passes: the first resolves every key to its row (creating the
    /// admitted new ones), the second initialises the new rows and copies
    /// the rows. The probes of the first pass do not depend on one
    /// another, so their cache misses overlap (each key's probe is
    /// prefetched a few keys ahead) instead of alternating with the
    /// copies; a new row's default values, at a random place in a matrix
    /// of a megabyte per table, are prefetched in the second pass.
    ///
    /// A pull of `worker` keeps its keys and their rows, so that its push
    /// of the same keys ([`Self::prepare_direct`]) updates those rows
    /// without reading the key map again.
    pub(crate) fn pull_rows_into(
        &mut self,
        keys: U64s<'_>,
        step: u64,
        out: &mut Vec<u8>,
        worker: Option<u32>,
    ) -> Result<(), TableFull> {
        let mut resolved = std::mem::take(&mut self.scratch.resolved);
        let mut fresh = std::mem::take(&mut self.scratch.fresh);
        let mut pulled = self.take_pulled(worker);
        resolved.clear();
        fresh.clear();
        pulled.keys.clear();
        pulled.rows.clear();
        let mut r = Ok(());
        for (k, ahead) in prefetch::probe_ahead(|| keys.iter()) {
            self.rows.map.prefetch(ahead);
            match self.resolve(k, step, true) {
                Ok((i, new)) => {
                    if new {
                        fresh.push((resolved.len(), k));
                    }
                    resolved.push(i);
                }
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        if r.is_ok() && worker.is_some() {
            pulled.epoch = self.rows.epoch;
            pulled.keys.extend(keys.iter());
            pulled.rows.extend_from_slice(&resolved);
        }
        self.put_pulled(worker, pulled);
        if r.is_ok() {
            let dim = self.dim;
            out.reserve(4 * dim * resolved.len());
            // `fresh` is in position order: one cursor for the new row
            // being prefetched, one for the next to initialise.
            let (mut to_fetch, mut to_init) = (0, 0);
            for (i, &index) in resolved.iter().enumerate() {
                let a = i + prefetch::DISTANCE;
                self.rows.prefetch(resolved.get(a).copied(), dim);
                if let Some(d) = self.defaults.as_deref() {
                    while fresh.get(to_fetch).is_some_and(|&(p, _)| p < a) {
                        to_fetch += 1;
                    }
                    if let Some(&(_, key)) = fresh.get(to_fetch).filter(|&&(p, _)| p == a) {
                        prefetch::row(d.row(key));
                        to_fetch += 1;
                    }
                }
                if let Some(&(_, key)) = fresh.get(to_init).filter(|&&(p, _)| p == i) {
                    self.init_row(index, key);
                    to_init += 1;
                }
                if index == NO_ROW {
                    out.resize(out.len() + 4 * dim, 0);
                } else {
                    self.rows.touch(index, step);
                    put_f32s(out, &self.rows.arena.row(index)[..dim]);
                }
            }
        } else {
            // The rows made before the refusal stay: they get their values.
            for &(p, key) in &fresh {
                self.init_row(resolved[p], key);
            }
            // And the rows found, their access.
            for &index in &resolved {
                self.rows.touch(index, step);
            }
        }
        self.scratch.resolved = resolved;
        self.scratch.fresh = fresh;
        r
    }

    /// Worker `worker`'s last rows pull, taken out (empty for an
    /// untracked worker); [`Self::put_pulled`] puts it back.
    fn take_pulled(&mut self, worker: Option<u32>) -> PulledRows {
        let Some(w) = worker.filter(|&w| w < MAX_TRACKED_WORKERS) else {
            return PulledRows::default();
        };
        let w = w as usize;
        let by_worker = &mut self.scratch.pulled;
        if by_worker.len() <= w {
            by_worker.resize_with(w + 1, PulledRows::default);
        }
        std::mem::take(&mut by_worker[w])
    }

    /// Return what [`Self::take_pulled`] took.
    fn put_pulled(&mut self, worker: Option<u32>, pulled: PulledRows) {
        if let Some(slot) = worker.and_then(|w| self.scratch.pulled.get_mut(w as usize)) {
            *slot = pulled;
        }
    }

    /// Add `grad` (one row, `dim` floats) to the gradient accumulated for
    /// `key` in the current push.
    pub(crate) fn accumulate(&mut self, key: u64, grad: F32s<'_>) {
        let dim = self.dim;
        let next = self.scratch.acc_keys.len() as u32;
        let slot = *self.scratch.acc_index.entry(key).or_insert(next);
        if slot == next {
            self.scratch.acc_keys.push(key);
            let base = self.scratch.acc_grads.len();
            self.scratch.acc_grads.resize(base + dim, 0.0);
            grad.copy_to(&mut self.scratch.acc_grads[base..]);
        } else {
            let base = slot as usize * dim;
            grad.add_to(&mut self.scratch.acc_grads[base..base + dim]);
        }
    }

    /// True when every accumulated gradient is finite.
    pub(crate) fn accumulated_finite(&self) -> bool {
        crate::shard::all_finite(&self.scratch.acc_grads)
    }

    /// Drop the accumulated gradients, and a prepared direct update (its
    /// rows' update counts and access steps go back to what they were),
    /// without applying them.
    pub(crate) fn discard_accumulated(&mut self) {
        if std::mem::take(&mut self.scratch.direct_ready) {
            self.undo_direct();
        }
        self.scratch.acc_index.clear();
        self.scratch.acc_keys.clear();
        self.scratch.acc_grads.clear();
    }

    /// Whether a push item's rows can be updated straight from the
    /// request by [`Self::push_rows_direct`]: every key has a row and no
    /// row comes twice (a worker's pushes, which carry unique keys).
    /// Nothing may be accumulated for the table.
    ///
    /// When it can, each row's update is counted now (its update count
    /// and access step at `step`, as [`Self::apply_accumulated_at`] counts
    /// them) and its index and count kept, so the update itself finds the
    /// rows without probing the key map again: by then the probes of the
    /// request's other items have pushed this one's out of the cache.
    /// The weights change only in [`Self::push_rows_direct`];
    /// [`Self::discard_accumulated`] gives the counts back. When it
    /// cannot, nothing changes: `None`.
    ///
    /// `grads` are the item's gradients (one row of `dim` floats per
    /// key): when it can, the answer is whether they are all finite, each
    /// row checked in the loop that probes its key. That loop mostly waits
    /// on the probes' cache misses, so the check costs little there,
    /// where a pass of its own read the whole item once more.
    ///
    /// When the keys are those of `worker`'s last rows pull of the table,
    /// in order (a worker pushes the keys it pulled), and no key of the
    /// table lost its row since ([`Rows::epoch`]), the rows that pull
    /// found are taken as they are: the key map is not read at all, and
    /// the update bookkeeping ahead ([`rows::Meta`], by row index) is
    /// prefetched. Otherwise each key is looked up.
    pub(crate) fn prepare_direct(
        &mut self,
        keys: U64s<'_>,
        grads: F32s<'_>,
        step: u64,
        worker: Option<u32>,
    ) -> Option<bool> {
        debug_assert!(!self.has_accumulated());
        debug_assert_eq!(keys.len() * self.dim, grads.len());
        let dim = self.dim;
        let in_place = grads.try_as_slice();
        let mut finite = true;
        let mut targets = std::mem::take(&mut self.scratch.targets);
        let mut undo = std::mem::take(&mut self.scratch.direct_undo);
        targets.clear();
        undo.clear();
        let pulled = self.take_pulled(worker);
        let known = pulled.rows_of(keys, self.rows.epoch);
        let marks = &mut self.scratch.marks;
        marks.resize((self.rows.next as usize).div_ceil(64), 0);
        let meta = &mut self.rows.meta;
        let map = &self.rows.map;
        // As in `apply_at`: the lookups first, their misses overlapping.
        let mut direct = true;
        for (j, (k, ahead)) in prefetch::probe_ahead(|| keys.iter()).enumerate() {
            let row = match known {
                Some(rows) => {
                    if let Some(m) = rows
                        .get(j + prefetch::PROBE_DISTANCE)
                        .and_then(|&a| meta.get(a as usize))
                    {
                        prefetch::entry(m);
                    }
                    // A key the filter held back at the pull may have a
                    // row by now.
                    Some(rows[j]).filter(|&i| i != NO_ROW)
                }
                None => {
                    map.prefetch(ahead);
                    None
                }
            };
            let Some(index) = row.or_else(|| map.get(k).map(|h| h.index)) else {
                direct = false;
                break;
            };
            let (word, bit) = ((index / 64) as usize, 1u64 << (index % 64));
            if marks[word] & bit != 0 {
                direct = false;
                break;
            }
            marks[word] |= bit;
            let m = &mut meta[index as usize];
            undo.push((index, m.last_access));
            m.updates += 1;
            m.last_access = m.last_access.max(step);
            let j = targets.len();
            targets.push((index, m.updates));
            finite &= match in_place.and_then(|all| all.get(j * dim..(j + 1) * dim)) {
                Some(row) => crate::shard::all_finite(row),
                None => grads.slice(j * dim, (j + 1) * dim).all_finite(),
            };
        }
        for &(index, _) in &targets {
            marks[(index / 64) as usize] = 0;
        }
        self.put_pulled(worker, pulled);
        self.scratch.targets = targets;
        self.scratch.direct_undo = undo;
        if !direct {
            self.undo_direct();
        }
        self.scratch.direct_ready = direct;
        direct.then_some(finite)
    }

    /// Give back the update counts and access steps `prepare_direct`
    /// took (its keys are unique, so each row is restored once).
    fn undo_direct(&mut self) {
        for &(index, last_access) in &self.scratch.direct_undo {
            let m = &mut self.rows.meta[index as usize];
            m.updates -= 1;
            m.last_access = last_access;
        }
        self.scratch.direct_undo.clear();
        self.scratch.targets.clear();
    }

    /// Apply a push item's row gradients (`grads`: one row of `dim`
    /// floats per key, in the keys' order) straight from the request to
    /// the rows [`Self::prepare_direct`] accepted and counted. The result
    /// is that of [`Self::accumulate`] then [`Self::apply_accumulated_at`]
    /// without the accumulator's hash map and copy.
    /// Does nothing unless a prepared update is pending.
    pub(crate) fn push_rows_direct(&mut self, grads: F32s<'_>, step: u64) {
        self.push_rows_direct_by(grads, |opt, w, slots, g, _, t| {
            opt.apply(w, slots, g, t, step);
        });
    }

    /// The loop of [`Self::push_rows_direct`]: `apply(optimizer, weights,
    /// slots, gradient, j, t)` for the `j`-th prepared row, whose update
    /// count (this update included) is `t`.
    pub(crate) fn push_rows_direct_by(
        &mut self,
        grads: F32s<'_>,
        mut apply: impl FnMut(&OptimizerConfig, &mut [f32], &mut [f32], &[f32], usize, u64),
    ) {
        if !std::mem::take(&mut self.scratch.direct_ready) {
            return;
        }
        let dim = self.dim;
        let targets = std::mem::take(&mut self.scratch.targets);
        debug_assert_eq!(targets.len() * dim, grads.len());
        let mut g = std::mem::take(&mut self.scratch.grad_row);
        g.resize(dim, 0.0);
        let in_place = grads.try_as_slice();
        let stride = self.rows.arena.stride;
        for (j, &(index, t)) in targets.iter().enumerate() {
            let ahead = targets.get(j + prefetch::DISTANCE).map(|&(ahead, _)| ahead);
            self.rows.arena.prefetch(ahead, stride);
            let grad = match in_place.and_then(|all| all.get(j * dim..(j + 1) * dim)) {
                Some(row) => row,
                None => {
                    grads.slice(j * dim, (j + 1) * dim).copy_to(&mut g);
                    &g[..]
                }
            };
            let (w, slots) = self.rows.arena.row_mut(index).split_at_mut(dim);
            apply(&self.opt, w, slots, grad, j, t);
        }
        self.scratch.grad_row = g;
        self.scratch.targets = targets;
        self.scratch.direct_undo.clear();
    }

    /// True when gradients are waiting in the accumulator.
    pub(crate) fn has_accumulated(&self) -> bool {
        !self.scratch.acc_keys.is_empty()
    }

    /// Apply the accumulated gradients without refreshing access times.
    #[cfg(test)]
    fn apply_accumulated(&mut self) -> u64 {
        self.apply_at(None)
    }

    fn apply_at(&mut self, step: Option<u64>) -> u64 {
        let dim = self.dim;
        // As in `pull_rows_into`: the probes first (their misses overlap),
        // then the updates.
        let mut targets = std::mem::take(&mut self.scratch.targets);
        targets.clear();
        let keys = &self.scratch.acc_keys;
        for (key, ahead) in prefetch::probe_ahead(|| keys.iter().copied()) {
            self.rows.map.prefetch(ahead);
            targets.push(match self.rows.map.get(key) {
                Some(h) => {
                    let m = &mut self.rows.meta[h.index as usize];
                    m.updates += 1;
                    if let Some(step) = step {
                        m.last_access = m.last_access.max(step);
                    }
                    (h.index, m.updates)
                }
                None => (NO_ROW, 0),
            });
        }
        let mut applied = 0;
        let stride = self.rows.arena.stride;
        for (i, &(index, t)) in targets.iter().enumerate() {
            let ahead = targets.get(i + prefetch::DISTANCE).map(|&(ahead, _)| ahead);
            self.rows.arena.prefetch(ahead, stride);
            if index == NO_ROW {
                self.stats.ignored_pushes += 1;
                continue;
            }
            let g = &self.scratch.acc_grads[i * dim..(i + 1) * dim];
            let (w, slots) = self.rows.arena.row_mut(index).split_at_mut(dim);
            self.opt.apply(w, slots, g, t, step.unwrap_or(0));
            applied += 1;
        }
        self.scratch.targets = targets;
        self.scratch.acc_index.clear();
        self.scratch.acc_keys.clear();
        self.scratch.acc_grads.clear();
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
        let n = self
            .rows
            .retain(|s| global_step.saturating_sub(s.last_access) < ttl);
        self.pending
            .retain(|_, p| global_step.saturating_sub(p.last_seen) < ttl);
        self.stats.evicted += n as u64;
        n
    }
}

/// Count one pull of `key`, which has no row; true when it is admitted now.
/// The key's counter stays: the caller removes it once the key has its
/// row, so that a key refused a row (no room) is not counted again from
/// zero.
fn admit(
    pending: &mut Counters,
    stats: &mut TableStats,
    policy: &TablePolicy,
    key: u64,
    step: u64,
) -> bool {
    let need = policy.filter_freq;
    if need <= 1 {
        return true;
    }
    let count = match pending.count(key, step, policy.filter_capacity) {
        Counted::Now(n) => n,
        Counted::Replaced => {
            stats.filter_overflow += 1;
            1
        }
        Counted::Refused => {
            stats.filter_overflow += 1;
            stats.filtered_pulls += 1;
            return false;
        }
    };
    if count >= need {
        true
    } else {
        stats.filtered_pulls += 1;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::rows::{Arena, SMALL_PAGE_BLOCKS};
    use super::*;
    use crate::var::{Init, VarKind};

    /// One gradient row of 4 equal floats, encoded.
    fn grad(x: f32) -> Vec<u8> {
        [x; 4].iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// A 4-wide SGD table of seed 9 with `policy`.
    fn table_with(policy: TablePolicy) -> EmbeddingTable {
        let def = VarDef {
            id: 3,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 4 },
            init: Init::Uniform { scale: 0.1 },
        };
        EmbeddingTable::new(def, 4, 9, OptimizerConfig::sgd(1.0), policy)
    }

    fn table(filter_freq: u32, steps_to_live: u64, cap: usize) -> EmbeddingTable {
        table_with(TablePolicy {
            filter_freq,
            steps_to_live,
            filter_capacity: cap,
            ..TablePolicy::default()
        })
    }

    fn table_with_defaults(default_value_dim: usize) -> EmbeddingTable {
        table_with(TablePolicy {
            default_value_dim,
            ..TablePolicy::default()
        })
    }

    #[test]
    fn new_rows_copy_row_key_mod_default_value_dim_of_the_default_matrix() {
        let mut t = table_with_defaults(8);
        let mut want = vec![0.0; 4];
        for k in [3u64, 11, 8 * 1000 + 3, u64::MAX - 4] {
            // u64::MAX - 4 = 8 * m + 3 as well.
            t.def().init_values(9, 3, &mut want);
            assert_eq!(t.pull(k, 0).expect("room").unwrap(), &want[..], "key {k}");
        }
        t.def().init_values(9, 5, &mut want);
        assert_eq!(t.pull(13, 0).expect("room").unwrap(), &want[..]);
        let mut other = vec![0.0; 4];
        t.def().init_values(9, 3, &mut other);
        assert_ne!(want, other, "distinct default rows differ");
        assert_eq!(t.stats().admitted, 5);
    }

    #[test]
    fn default_value_dim_zero_initialises_every_key_itself() {
        let mut t = table_with_defaults(0);
        let mut want = vec![0.0; 4];
        for k in [3u64, 11, 1 << 40] {
            t.def().init_values(9, k, &mut want);
            assert_eq!(t.pull(k, 0).expect("room").unwrap(), &want[..], "key {k}");
        }
    }

    #[test]
    fn a_row_recreated_after_eviction_gets_its_default_row_again() {
        let mut t = table_with(TablePolicy {
            steps_to_live: 2,
            default_value_dim: 8,
            ..TablePolicy::default()
        });
        let first = t.pull(21, 0).expect("room").unwrap().to_vec();
        t.accumulate(21, F32s::new(&grad(1.0)).unwrap());
        t.apply_accumulated();
        assert_ne!(t.pull(21, 0).expect("room").unwrap(), &first[..]);
        assert_eq!(t.evict(10), 1);
        assert_eq!(t.pull(21, 10).expect("room").unwrap(), &first[..]);
    }

    #[test]
    fn created_on_first_pull_with_seeded_values() {
        let mut t = table(0, 0, 16);
        let r = t.pull(11, 0).expect("room").unwrap().to_vec();
        let mut want = vec![0.0; 4];
        t.def().init_values(9, 11, &mut want);
        assert_eq!(r, want);
        assert_eq!(t.len(), 1);
        assert_eq!(t.stats().admitted, 1);
    }

    #[test]
    fn arena_blocks_past_the_small_page_ones_ask_for_huge_pages_and_clone_keeps_both() {
        let stride = 5;
        let mut a = Arena::with_shift(stride, 2, 0);
        let rows = (SMALL_PAGE_BLOCKS + 3) * a.block_rows();
        for i in 0..rows as u32 {
            a.ensure(i).expect("memory");
            let r = a.row_mut(i);
            assert!(r.iter().all(|&x| x == 0.0), "row {i} starts zeroed");
            r.iter_mut()
                .enumerate()
                .for_each(|(j, x)| *x = (i as usize * stride + j) as f32);
        }
        assert_eq!(a.blocks.len(), SMALL_PAGE_BLOCKS + 3);
        let huge = |a: &Arena| -> Vec<bool> { a.blocks.iter().map(|b| b.huge).collect() };
        let want: Vec<bool> = (0..a.blocks.len())
            .map(|b| b >= SMALL_PAGE_BLOCKS)
            .collect();
        assert_eq!(huge(&a), want);
        let c = a.clone();
        assert_eq!(huge(&c), want, "the clone's blocks");
        a.row_mut(0)[0] = -1.0;
        for i in 0..rows as u32 {
            let want: Vec<f32> = (0..stride)
                .map(|j| (i as usize * stride + j) as f32)
                .collect();
            assert_eq!(c.row(i), want.as_slice(), "clone, row {i}");
            if i > 0 {
                assert_eq!(a.row(i), want.as_slice(), "row {i}");
            }
        }
        assert_eq!(c.blocks.len(), a.blocks.len());
    }

    #[test]
    fn rows_keep_their_values_as_the_arena_grows_past_blocks() {
        // Three blocks and a bit: every row, created in one block and read
        // after later blocks were added, still holds what was written.
        let mut t = table(0, 0, 16);
        // Small blocks, so three are quick to fill in a debug build.
        t.rows.arena = Arena::with_shift(t.rows.arena.stride, 4, 0);
        let n = 3 * t.rows.arena.block_rows() as u64 + 5;
        for k in 1..=n {
            t.pull(k, 0).expect("room");
            t.accumulate(k, F32s::new(&grad(k as f32)).unwrap());
            t.apply_accumulated();
        }
        assert_eq!(t.len(), n as usize);
        let mut want = vec![0.0; 4];
        for k in (1..=n).step_by(97).chain([n]) {
            t.def().init_values(9, k, &mut want);
            let got = t.pull(k, 0).expect("room").unwrap();
            for (g, w) in got.iter().zip(&want) {
                // SGD with lr 1: the row moved by minus its gradient.
                assert_eq!(*g, w - k as f32, "key {k}");
            }
        }
    }

    #[test]
    fn reserved_rows_are_mapped_ahead_and_later_rows_still_grow_the_arena() {
        let mut t = table(0, 0, 16);
        // 16 rows per block.
        t.rows.arena = Arena::with_shift(t.rows.arena.stride, 4, 0);
        t.reserve(40);
        // The blocks are ordered, and wait for the first row.
        assert!(t.rows.arena.blocks.is_empty());
        assert_eq!(t.rows.arena.supply.as_ref().map(|s| s.left), Some(3));
        assert!(t.rows.order.is_some());
        t.pull(1, 0).expect("room");
        assert!(t.rows.order.is_none(), "started by the first row");
        // The first row took the supply's first block, faulted in.
        assert_eq!(t.rows.arena.blocks.len(), 1);
        assert_eq!(t.rows.arena.populated, 16);
        let n = 70u64;
        for k in 1..=n {
            t.pull(k, 0).expect("room");
            t.accumulate(k, F32s::new(&grad(k as f32)).unwrap());
            t.apply_accumulated();
        }
        // Three blocks came from the thread (40 rows faulted in), two
        // more were mapped here.
        assert!(t.rows.arena.supply.is_none());
        assert_eq!(t.rows.arena.blocks.len(), 5);
        assert!(t.rows.arena.populated >= 40);
        let mut want = vec![0.0; 4];
        for k in 1..=n {
            t.def().init_values(9, k, &mut want);
            let got = t.get(k).expect("row");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(*g, w - k as f32, "key {k}");
            }
        }
        // Rows held already: nothing more to order.
        t.reserve(0);
        t.reserve(10);
        assert!(t.take_prefault().is_none(), "the fifth block holds row 79");
        assert_eq!(t.rows.arena.blocks.len(), 5);
        // Taken before the first row, the order is started by its taker.
        let mut e = table(0, 0, 16);
        e.rows.arena = Arena::with_shift(e.rows.arena.stride, 4, 0);
        e.reserve(20);
        prefault::spawn(e.take_prefault().into_iter().collect());
        e.pull(1, 0).expect("room");
        assert_eq!(e.rows.arena.populated, 16);
        // With the frequency filter, reserved keys may never get rows:
        // nothing is mapped ahead.
        let mut f = table(2, 0, 16);
        f.reserve(1000);
        assert!(f.take_prefault().is_none());
        for _ in 0..2 {
            f.pull(1, 0).expect("room");
            f.end_request();
        }
        assert!(f.get(1).is_some());
        assert!(f.rows.arena.populated < 1000);
    }

    #[test]
    fn a_supply_whose_thread_never_ran_leaves_the_arena_to_map_its_own() {
        let mut t = table(0, 0, 16);
        t.rows.arena = Arena::with_shift(t.rows.arena.stride, 4, 0);
        t.reserve(40);
        drop(t.take_prefault().expect("an order"));
        for k in 1..=20u64 {
            t.pull(k, 0).expect("room");
        }
        assert!(t.rows.arena.supply.is_none());
        assert_eq!(t.rows.arena.blocks.len(), 2);
        assert_eq!(t.len(), 20);
    }

    #[test]
    fn filter_admits_on_nth_pull_and_ignores_pushes_before() {
        let mut t = table(3, 0, 16);
        assert!(t.pull(5, 0).expect("room").is_none());
        t.accumulate(5, F32s::new(&grad(1.0)).unwrap());
        assert_eq!(t.apply_accumulated(), 0);
        assert_eq!(t.stats().ignored_pushes, 1);
        assert!(t.pull(5, 1).expect("room").is_none());
        assert_eq!(t.pending_len(), 1);
        assert!(t.pull(5, 2).expect("room").is_some());
        assert_eq!(t.pending_len(), 0);
        assert_eq!(t.stats().filtered_pulls, 2);
        assert_eq!(t.stats().admitted, 1);
    }

    /// A key the filter admits when the table has no room for it keeps
    /// its count: its next pull with room admits it.
    #[test]
    fn a_key_admitted_into_a_full_table_keeps_its_count() {
        let mut t = table_with(TablePolicy {
            filter_freq: 2,
            max_rows: 1,
            ..TablePolicy::default()
        });
        t.pull(1, 0).expect("room");
        assert!(t.pull(1, 0).expect("room").is_some());
        assert!(t.pull(5, 1).expect("counted").is_none());
        let e = t.pull(5, 2).unwrap_err();
        assert_eq!((e.var, e.rows, e.why), (3, 1, NoRoom::MaxRows));
        let count = |t: &EmbeddingTable| t.pending.get(5).map(|p| p.count);
        assert_eq!(count(&t), Some(2));
        assert_eq!((t.len(), t.stats().admitted), (1, 1));
        // With room (a larger cap), the key's next pull admits it.
        t.policy.max_rows = 2;
        assert!(t.pull(5, 3).expect("room").is_some());
        assert_eq!((count(&t), t.pending_len(), t.len()), (None, 0, 2));
    }

    /// The counters are bounded; a full map makes room for a new key by
    /// dropping the oldest counter not pulled again (it used to refuse
    /// every new key once full, so a key that came after the first
    /// `filter_capacity` was never admitted).
    #[test]
    fn filter_counter_map_is_bounded_and_takes_new_keys() {
        let mut t = table(2, 0, 2);
        for k in 1..=5 {
            assert!(t.pull(k, 0).expect("room").is_none());
        }
        assert_eq!(t.pending_len(), 2);
        assert_eq!(t.stats().filter_overflow, 3);
        // Keys 4 and 5 are counted, so 5 is admitted on its next pull; 1
        // is counted from 1 again.
        assert!(t.pull(5, 1).expect("room").is_some());
        assert!(t.pull(1, 1).expect("room").is_none());
        assert!(t.pull(1, 2).expect("room").is_some());
    }

    #[test]
    fn ttl_evicts_stale_rows_only() {
        let mut t = table(0, 10, 16);
        t.pull(1, 0).expect("room");
        t.pull(2, 5).expect("room");
        t.accumulate(1, F32s::new(&grad(0.5)).unwrap());
        t.apply_accumulated_at(8);
        assert_eq!(t.evict(14), 0);
        assert_eq!(t.evict(15), 1); // row 2: last access 5
        assert!(t.get(2).is_none());
        assert!(t.get(1).is_some());
        assert_eq!(t.evict(18), 1);
        assert_eq!(t.stats().evicted, 2);
        // Re-created with the same initial values.
        let again = t.pull(2, 20).expect("room").unwrap().to_vec();
        let mut want = vec![0.0; 4];
        t.def().init_values(9, 2, &mut want);
        assert_eq!(again, want);
    }

    #[test]
    fn a_reused_row_index_starts_fresh() {
        let mut t = table(0, 10, 16);
        t.opt = OptimizerConfig::adagrad(0.5);
        t.rows = Rows::with_capacity(4 * 2, 0);
        t.pull(1, 0).expect("room");
        t.accumulate(1, F32s::new(&grad(1.0)).unwrap());
        t.apply_accumulated_at(0);
        assert_ne!(t.slots(1).unwrap(), [0.1; 4]);
        assert_eq!(t.evict(10), 1);
        // Key 2 takes key 1's index: its weights and slots are its own.
        let row = t.pull(2, 11).expect("room").unwrap().to_vec();
        let mut want = vec![0.0; 4];
        t.def().init_values(9, 2, &mut want);
        assert_eq!(row, want);
        assert_eq!(t.slots(2).unwrap(), [0.1; 4]);
        assert_eq!(t.rows.get(2).unwrap().0.updates, 0);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn rows_pull_item_matches_single_pulls() {
        let mut a = table(2, 0, 16);
        let mut b = table(2, 0, 16);
        let keys: Vec<u64> = vec![5, 6, 5, 7, 6];
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        for step in 0..3 {
            let mut out = Vec::new();
            a.pull_rows_into(U64s::new(&bytes).unwrap(), step, &mut out, None)
                .expect("room");
            a.end_request();
            let mut want = Vec::new();
            for &k in &keys {
                match b.pull_once(k, step).expect("room") {
                    Some(r) => put_f32s(&mut want, r),
                    None => want.resize(want.len() + 16, 0),
                }
            }
            b.end_request();
            assert_eq!(out, want, "step {step}");
            assert_eq!(a.stats(), b.stats());
        }
        assert_eq!(a.len(), 3);
    }

    #[test]
    fn a_rows_pull_of_new_and_repeated_keys_matches_single_pulls() {
        // Past the prefetch distance, with repeats: every new row is
        // initialised before any occurrence of its key is copied.
        let mut a = table_with_defaults(8);
        let mut b = table_with_defaults(8);
        let keys: Vec<u64> = (0..40u64).map(|i| (i * 7) % 23).collect();
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        let mut out = Vec::new();
        a.pull_rows_into(U64s::new(&bytes).unwrap(), 0, &mut out, None)
            .expect("room");
        let mut want = Vec::new();
        for &k in &keys {
            put_f32s(&mut want, b.pull(k, 0).expect("room").unwrap());
        }
        assert_eq!(out, want);
        assert_eq!(a.len(), 23);
    }

    #[test]
    fn rows_a_refused_pull_made_hold_their_initial_values() {
        let mut t = table_with(TablePolicy {
            max_rows: 2,
            default_value_dim: 8,
            ..TablePolicy::default()
        });
        let bytes: Vec<u8> = [1u64, 2, 3].iter().flat_map(|k| k.to_le_bytes()).collect();
        let mut out = Vec::new();
        let e = t.pull_rows_into(U64s::new(&bytes).unwrap(), 0, &mut out, None);
        assert_eq!(e.map_err(|e| e.why), Err(NoRoom::MaxRows));
        let mut want = vec![0.0; 4];
        for k in [1u64, 2] {
            t.def().init_values(9, k, &mut want);
            assert_eq!(t.get(k).unwrap(), &want[..], "key {k}");
        }
        assert!(t.get(3).is_none());
    }

    #[test]
    fn a_direct_push_reads_gradients_in_place_or_decoded_alike() {
        // The same push from a 4-aligned buffer (read in place) and from
        // one a byte off (decoded row by row) changes the rows alike.
        let keys: Vec<u64> = (1..=20).collect();
        let key_bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        let floats: Vec<f32> = (0..keys.len() * 4)
            .map(|i| (i % 7) as f32 * 0.25 - 0.5)
            .collect();
        let grads: Vec<u8> = floats.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut shifted = vec![0u8; grads.len() + 1];
        shifted[1..].copy_from_slice(&grads);
        // A 4-aligned view of the same bytes on a little-endian target.
        let grads: &[u8] = if cfg!(target_endian = "little") {
            bytemuck::cast_slice(&floats)
        } else {
            &grads
        };
        let mut tables = [table(0, 0, 16), table(0, 0, 16)];
        for t in &mut tables {
            t.opt = OptimizerConfig::adagrad(0.5);
            t.rows = Rows::with_capacity(4 * 2, 0);
            for &k in &keys {
                t.pull(k, 0).expect("room");
            }
        }
        let aligned = F32s::new(grads).unwrap();
        let offset = F32s::new(&shifted[1..]).unwrap();
        assert!(offset.try_as_slice().is_none());
        assert_eq!(
            aligned.try_as_slice().is_some(),
            cfg!(target_endian = "little")
        );
        for (t, g) in tables.iter_mut().zip([aligned, offset]) {
            for step in 0..2 {
                let keys = U64s::new(&key_bytes).unwrap();
                assert_eq!(t.prepare_direct(keys, g, step, None), Some(true));
                t.push_rows_direct(g, step);
            }
        }
        // A non-finite row is reported, read in place or decoded; the
        // counts taken go back.
        let mut bad = floats.clone();
        bad[13 * 4 + 2] = f32::NAN;
        let bad_bytes: Vec<u8> = bad.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut bad_shifted = vec![0u8; bad_bytes.len() + 1];
        bad_shifted[1..].copy_from_slice(&bad_bytes);
        let bad_aligned: &[u8] = if cfg!(target_endian = "little") {
            bytemuck::cast_slice(&bad)
        } else {
            &bad_bytes
        };
        for (t, g) in tables.iter_mut().zip([bad_aligned, &bad_shifted[1..]]) {
            let keys = U64s::new(&key_bytes).unwrap();
            let g = F32s::new(g).unwrap();
            assert_eq!(t.prepare_direct(keys, g, 2, None), Some(false));
            t.discard_accumulated();
            assert_eq!(t.rows.get(14).map(|(s, _)| s.updates), Some(2));
        }
        for &k in &keys {
            let bits = |t: &EmbeddingTable| -> Vec<u32> {
                let (_, row) = t.rows.get(k).expect("row");
                row.iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&tables[0]), bits(&tables[1]), "key {k}");
            assert_ne!(tables[0].get(k), Some(&[0.0; 4][..]));
        }
    }

    #[test]
    fn a_push_after_its_workers_pull_updates_as_one_from_an_unknown_worker() {
        // Worker 1 pushes what it pulled (its pull's rows used), also
        // after another worker's pull grew the map and after eviction
        // moved the entries; an unknown sender's push (looked up) and a
        // worker pushing keys it did not pull in that order (rows looked
        // up) change the rows alike.
        let keys: Vec<u64> = (1..=40).collect();
        let key_bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        let reversed: Vec<u8> = keys.iter().rev().flat_map(|k| k.to_le_bytes()).collect();
        let floats: Vec<f32> = (0..keys.len() * 4).map(|i| (i % 5) as f32 * 0.5).collect();
        let grads: Vec<u8> = floats.iter().flat_map(|x| x.to_le_bytes()).collect();
        let rev_grads: Vec<u8> = floats
            .chunks(4)
            .rev()
            .flatten()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut tables = [table(0, 3, 16), table(0, 3, 16), table(0, 3, 16)];
        for (n, t) in tables.iter_mut().enumerate() {
            t.opt = OptimizerConfig::adagrad(0.5);
            t.rows = Rows::with_capacity(4 * 2, 0);
            // Table 1's pushes come from an unknown sender; table 2's
            // worker pushes its keys in another order.
            let worker = (n != 1).then_some(1);
            for step in 0..6u64 {
                let mut out = Vec::new();
                t.pull_rows_into(U64s::new(&key_bytes).unwrap(), step, &mut out, worker)
                    .expect("room");
                t.end_request();
                if step == 2 {
                    // Another worker's pull of many new keys grows the map.
                    let more: Vec<u8> = (1000..3000u64).flat_map(|k| k.to_le_bytes()).collect();
                    t.pull_rows_into(U64s::new(&more).unwrap(), step, &mut out, Some(2))
                        .expect("room");
                    t.end_request();
                }
                if step == 4 {
                    // The other worker's rows are evicted: entries move.
                    assert_eq!(t.evict(step + 2), 2000);
                }
                let (k, g) = if n == 2 {
                    (&reversed, &rev_grads)
                } else {
                    (&key_bytes, &grads)
                };
                let g = F32s::new(g).unwrap();
                let k = U64s::new(k).unwrap();
                assert_eq!(t.prepare_direct(k, g, step, worker), Some(true));
                t.push_rows_direct(g, step);
            }
        }
        for &k in &keys {
            let row = |t: &EmbeddingTable| -> Vec<u32> {
                let (s, row) = t.rows.get(k).expect("row");
                assert_eq!(s.updates, 6, "key {k}");
                row.iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(row(&tables[0]), row(&tables[1]), "key {k}");
            assert_eq!(row(&tables[0]), row(&tables[2]), "key {k}");
        }
    }

    #[test]
    fn a_pulled_row_that_lost_its_key_is_not_updated_for_it() {
        // Worker 1 pulls keys 1 and 2; key 2 is evicted and key 3 takes
        // its row; worker 1's push of 1 and 2 must not update key 3's
        // row for key 2.
        let mut t = table(0, 10, 16);
        let le = |keys: &[u64]| -> Vec<u8> { keys.iter().flat_map(|k| k.to_le_bytes()).collect() };
        let mut out = Vec::new();
        let pulled = le(&[1, 2]);
        t.pull_rows_into(U64s::new(&pulled).unwrap(), 0, &mut out, Some(1))
            .expect("room");
        let row2 = t.rows.get(2).expect("row").0.index;
        t.pull_rows_into(U64s::new(&le(&[1])).unwrap(), 20, &mut out, Some(2))
            .expect("room");
        assert_eq!(t.evict(20), 1);
        t.pull_rows_into(U64s::new(&le(&[3])).unwrap(), 20, &mut out, Some(2))
            .expect("room");
        let (s3, before) = t.rows.get(3).map(|(s, r)| (s, r.to_vec())).expect("row");
        assert_eq!(s3.index, row2, "key 3 reuses key 2's row");
        let g = grad(1.0).repeat(2);
        let g = F32s::new(&g).unwrap();
        // Key 2 has no row: not a direct push, and nothing counted.
        assert_eq!(
            t.prepare_direct(U64s::new(&pulled).unwrap(), g, 21, Some(1)),
            None
        );
        t.push_rows_direct(g, 21);
        assert_eq!(
            t.rows.get(3).map(|(s, r)| (s, r.to_vec())),
            Some((s3, before))
        );
        assert_eq!(t.rows.get(1).map(|(s, _)| s.updates), Some(0));
        // Once key 2 has a row again, the same push is direct and updates
        // key 2's new row, not key 3's.
        t.pull_rows_into(U64s::new(&pulled).unwrap(), 22, &mut out, Some(1))
            .expect("room");
        assert_eq!(
            t.prepare_direct(U64s::new(&pulled).unwrap(), g, 23, Some(1)),
            Some(true)
        );
        t.push_rows_direct(g, 23);
        let after = |k: u64| t.rows.get(k).map(|(s, _)| (s.updates, s.last_access));
        assert_eq!(after(1), Some((1, 23)));
        assert_eq!(after(2), Some((1, 23)));
        assert_eq!(after(3), Some((0, 20)));
    }

    #[test]
    fn duplicate_keys_are_summed() {
        let mut t = table(0, 0, 16);
        let before = t.pull(7, 0).expect("room").unwrap().to_vec();
        t.accumulate(7, F32s::new(&grad(1.0)).unwrap());
        t.accumulate(7, F32s::new(&grad(2.0)).unwrap());
        assert_eq!(t.apply_accumulated(), 1);
        let after = t.get(7).unwrap();
        for (a, b) in after.iter().zip(&before) {
            assert!((a - (b - 3.0)).abs() < 1e-6);
        }
    }
}

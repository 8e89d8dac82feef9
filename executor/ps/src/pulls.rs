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
//! worker between its pull and its push (below): the record starts again
//! at the first pull after a push. Pushes of an unknown sender (the gRPC
//! baseline, a merged synchronous step) find no record and are applied as
//! they are; a shard serving a synchronous run records none
//! ([`crate::PsShard::set_recorded_workers`]).
//!
//! A pull of no items drops its worker's record at once
//! ([`Pulls::drop_record`]): a worker sends one after pulls that no push
//! of its own follows (worker 0's evaluation between epochs sends one
//! after each batch's pulls, in the same exchange), so those are not held
//! until its next push. Training never sends an empty pull, and a shard
//! that does not know this answers it as any pull: the wire format is
//! unchanged.
//!
//! A worker pushes its rows' gradients in the order it pulled them, so a
//! push is matched with its pull by position (one comparison of the key
//! lists); a key map is built only for a push in another order (or after
//! pulls no push followed), and finds each row at its last pull.
//!
//! A rows item of a table without a frequency filter is recorded from the
//! pull's request and reply (its keys, and its rows as the reply carries
//! them), with no lookup of the table: every key then has a row, so the
//! reply's rows are exactly the rows' values at the pull. Where the reply
//! leaves as shared bytes (a network server's,
//! [`crate::PsShard::handle_pull_shared`]), the record keeps a reference
//! to them rather than a copy of the rows
//! ([`WorkerPulls::attach_reply`]); else the rows are copied. The update
//! counts are kept only when the rate reads them ([`keeps_updates`]).
//!
//! A variable's record is used up once a push of it is applied, and its
//! buffers go back to a pool the shard's next pull, of any worker, records
//! into ([`Pulls::release`], [`Pulls::begin_pull`]). Only the workers
//! between a pull and its push (a few, with `--bounded-delay`) then hold a
//! record, so many workers' records reuse a few warm buffers rather than
//! each worker faulting in and keeping its own.
//!
//! A worker that pulls and does not push (a bug, or a peer that means
//! harm) would grow its record by every pull. A pull that pulls again a
//! variable the record holds since its last push (a new step's pull, or
//! a `--prefetch` window's) while the record holds more than
//! [`MAX_RECORD_BYTES`] drops the record instead, its buffers freed, and
//! is recorded alone: the worker's push is matched with its last pull,
//! as always, and rows it pulled only before are applied as they are.
//! One step's pulls are never dropped, however large: without fusion
//! they come one variable per request, each variable once. A worker's
//! record then holds at most that plus one pull of each variable (which
//! the codec's limits bound), and a shard's records at most that per
//! recorded worker.
//!
//! [`OptimizerConfig::tracks_pulls`]: crate::OptimizerConfig::tracks_pulls

use crate::keyhash::KeyMapOf;
use bytes::Bytes;
use starwire_wire::ps::{F32s, U64s};

use crate::optim::{OptimizerConfig, Pulled, StalenessLr};

/// Workers with a larger task index are not tracked (their pushes are
/// applied as they are): bounds the memory a peer's index can claim.
pub(crate) const MAX_TRACKED_WORKERS: u32 = 1 << 12;

/// The bytes of keys, update counts and values one worker's record may
/// hold when a pull of a variable it holds already begins; past them the
/// record is dropped and the pull recorded alone. A step's pull is far
/// below it (4096 examples of 26 fields of width 64 are under 30 MiB
/// whole, before the shards split them), so a `--prefetch` window of a
/// few steps does not reach it, only a worker that keeps pulling without
/// pushing.
pub(crate) const MAX_RECORD_BYTES: usize = 64 << 20;

/// True when the records keep each row's update count: only a
/// staleness-aware rate reads it (a push's staleness scales nothing
/// otherwise).
pub(crate) fn keeps_updates(opt: &OptimizerConfig) -> bool {
    opt.staleness_lr != StalenessLr::None
}

/// What one worker pulled of one variable (a dense variable is one row,
/// key 0), in pull order.
#[derive(Debug, Default)]
pub(crate) struct VarPulls {
    pub(crate) keys: Vec<u64>,
    /// Each row's update count at the pull (empty when not kept).
    updates: Vec<u64>,
    /// Each row's values at the pull (empty when not kept, or when they
    /// are in `reply`).
    values: Vec<f32>,
    /// The values as the pull's reply carries them: the reply's bytes of
    /// them, native aligned `f32`s (attached after the pull is answered).
    reply: Option<Bytes>,
    /// Until the reply is attached: the values' byte offset in it and
    /// their count of floats.
    in_reply: Option<(usize, usize)>,
    /// Key -> last position, built on demand.
    index: KeyMapOf<u32>,
    indexed: bool,
}

impl VarPulls {
    /// Holds no allocation: a variable not recorded since its buffers went
    /// back to the pool.
    fn unallocated(&self) -> bool {
        self.keys.capacity() == 0
            && self.updates.capacity() == 0
            && self.values.capacity() == 0
            && self.index.capacity() == 0
    }

    /// The bytes of what it holds: keys, update counts and values (in its
    /// own buffer or in a reply it refers to, whose buffer it keeps
    /// alive).
    fn held_bytes(&self) -> usize {
        let floats = self.values.len()
            + self.reply.as_ref().map_or(0, |r| r.len() / 4)
            + self.in_reply.map_or(0, |(_, n)| n);
        8 * (self.keys.len() + self.updates.len()) + 4 * floats
    }

    fn clear(&mut self) {
        self.keys.clear();
        self.updates.clear();
        self.values.clear();
        self.reply = None;
        self.in_reply = None;
        self.index.clear();
        self.indexed = false;
    }

    /// What the row at position `j` was pulled as, for an update of a
    /// row that has had `updates` updates (`width` floats).
    pub(crate) fn at(&self, j: usize, updates: u64, width: usize) -> Pulled<'_> {
        Pulled {
            staleness: self.updates.get(j).map(|&u| updates.saturating_sub(u)),
            values: self.values().get(j * width..(j + 1) * width),
        }
    }

    /// Values read from an attached reply copied into `values`, so that
    /// more can follow them (a later reply does not hold these).
    fn own_values(&mut self) {
        if self.reply.is_some() {
            let kept = self.values().to_vec();
            self.values = kept;
            self.reply = None;
        }
    }

    /// Every row's values at the pull, in pull order (empty when not kept,
    /// or kept in a reply not attached).
    pub(crate) fn values(&self) -> &[f32] {
        match &self.reply {
            Some(r) => F32s::new(r).and_then(|f| f.try_as_slice()).unwrap_or(&[]),
            None => &self.values,
        }
    }

    /// The position of `key`'s last pull.
    fn position(&mut self, key: u64) -> Option<usize> {
        if !self.indexed {
            for (j, &k) in self.keys.iter().enumerate() {
                self.index.insert(k, j as u32);
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
    /// A pull of `vars` variables, of which it pulls those at `pulled`
    /// (indices), is about to be recorded: after a push the record
    /// starts again, its buffers going to `spare`, and each variable
    /// without buffers takes some from `spare`. A record with no push
    /// since it began that holds one of `pulled` already and more than
    /// `limit` bytes starts again too, its buffers freed rather than
    /// pooled: true then.
    pub(crate) fn begin_pull(
        &mut self,
        vars: usize,
        pulled: impl IntoIterator<Item = usize>,
        spare: &mut Vec<VarPulls>,
        limit: usize,
    ) -> bool {
        let mut dropped = false;
        if std::mem::take(&mut self.pushed) {
            for v in &mut self.vars {
                recycle(spare, v);
            }
        } else if self.held_bytes() > limit
            && pulled
                .into_iter()
                .any(|i| self.vars.get(i).is_some_and(|v| !v.keys.is_empty()))
        {
            for v in &mut self.vars {
                *v = VarPulls::default();
            }
            dropped = true;
        }
        if self.vars.len() < vars {
            self.vars.resize_with(vars, VarPulls::default);
        }
        for v in &mut self.vars {
            if v.unallocated() {
                match spare.pop() {
                    Some(s) => *v = s,
                    None => break,
                }
            }
        }
        dropped
    }

    /// The bytes its variables' records hold.
    pub(crate) fn held_bytes(&self) -> usize {
        self.vars.iter().map(VarPulls::held_bytes).sum()
    }

    fn var_mut(&mut self, var: u32) -> &mut VarPulls {
        let var = var as usize;
        if self.vars.len() <= var {
            self.vars.resize_with(var + 1, VarPulls::default);
        }
        let v = &mut self.vars[var];
        v.indexed = false;
        v
    }

    /// Variable `var`'s row `key` was pulled after `updates` updates (if
    /// kept), holding `values`. A row pulled twice before a push is found
    /// at its last pull: the pulls a push is computed on are the worker's
    /// last before it, and an earlier one may be of no step (pulls no push
    /// follows, whose worker sent no empty pull after them). A variable's
    /// rows are recorded all with or all without update counts and
    /// values.
    pub(crate) fn record(
        &mut self,
        var: u32,
        key: u64,
        updates: Option<u64>,
        values: Option<&[f32]>,
    ) {
        let v = self.var_mut(var);
        v.keys.push(key);
        v.updates.extend(updates);
        if let Some(values) = values {
            v.values.extend_from_slice(values);
        }
    }

    /// Variable `var`'s rows `keys` were pulled holding `values` (one row
    /// after another, as a pull reply carries them), update counts not
    /// kept.
    pub(crate) fn record_rows(&mut self, var: u32, keys: U64s<'_>, values: F32s<'_>) {
        let v = self.var_mut(var);
        debug_assert!(v.updates.is_empty());
        v.keys.extend(keys.iter());
        values.extend_into(&mut v.values);
    }

    /// As [`Self::record_rows`], `values` being at byte offset `at` of the
    /// reply [`Self::attach_reply`] will give. A variable recorded already
    /// in this pull has these values copied after the ones kept.
    pub(crate) fn record_rows_in_reply(
        &mut self,
        var: u32,
        keys: U64s<'_>,
        values: F32s<'_>,
        at: usize,
    ) {
        let v = self.var_mut(var);
        if !v.keys.is_empty() {
            // Pulled before (in this request, or in one whose reply is
            // attached and whose push has not come): copied after it.
            v.own_values();
            return self.record_rows(var, keys, values);
        }
        v.keys.extend(keys.iter());
        v.in_reply = Some((at, values.len()));
    }

    /// The reply of the pull just recorded, as it leaves: the values
    /// recorded in it are read from it from now on, without a copy, where
    /// they are native aligned `f32`s; else (or if `reply` is not the
    /// pull's) they are copied out of it now.
    pub(crate) fn attach_reply(&mut self, reply: &Bytes) {
        for v in &mut self.vars {
            let Some((at, n)) = v.in_reply.take() else {
                continue;
            };
            let range = at..at.saturating_add(n.saturating_mul(4));
            let view = reply.get(range.clone()).and_then(F32s::new);
            // Values copied after these (a variable pulled in two items)
            // have the reply's copied in front of them.
            let alone = v.values.is_empty();
            if alone && view.is_some_and(|f| f.try_as_slice().is_some()) {
                v.reply = Some(reply.slice(range));
            } else {
                let later = std::mem::take(&mut v.values);
                if let Some(f) = view {
                    f.extend_into(&mut v.values);
                }
                v.values.extend_from_slice(&later);
            }
        }
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
#[derive(Debug)]
pub(crate) struct Pulls {
    by_worker: Vec<WorkerPulls>,
    /// Cleared variable records whose push was applied, for the next pull
    /// to record into.
    spare: Vec<VarPulls>,
    /// [`MAX_RECORD_BYTES`], smaller in tests.
    limit: usize,
    /// Records dropped past it.
    dropped: u64,
}

impl Default for Pulls {
    fn default() -> Self {
        Self {
            by_worker: Vec::new(),
            spare: Vec::new(),
            limit: MAX_RECORD_BYTES,
            dropped: 0,
        }
    }
}

impl Pulls {
    /// Worker `w`'s record, about to record a pull of the variables at
    /// `pulled` of a shard holding `vars` ([`WorkerPulls::begin_pull`],
    /// with the shard's pool). `None` when `w` is not tracked.
    pub(crate) fn begin_pull(
        &mut self,
        w: u32,
        vars: usize,
        pulled: impl IntoIterator<Item = usize>,
    ) -> Option<&mut WorkerPulls> {
        if w >= MAX_TRACKED_WORKERS {
            return None;
        }
        let w = w as usize;
        if self.by_worker.len() <= w {
            self.by_worker.resize_with(w + 1, WorkerPulls::default);
        }
        let rec = &mut self.by_worker[w];
        if rec.begin_pull(vars, pulled, &mut self.spare, self.limit) {
            self.dropped += 1;
        }
        Some(rec)
    }

    /// Worker `w`'s pushes of variables `vars` were applied: their records
    /// are used up, and their buffers go back to the pool. A later push of
    /// one of them before the next pull finds no record (as a push of an
    /// unknown sender); the worker's other variables keep theirs (pushes
    /// without fusion come one variable at a time).
    pub(crate) fn release(&mut self, w: u32, vars: &[usize]) {
        let Some(rec) = self.by_worker.get_mut(w as usize) else {
            return;
        };
        for &i in vars {
            if let Some(v) = rec.vars.get_mut(i) {
                recycle(&mut self.spare, v);
            }
        }
    }

    /// Worker `w`'s record is dropped whole (it sent a pull of no items:
    /// see the module documentation): its buffers go back to the pool, and
    /// its next pull starts a new record.
    pub(crate) fn drop_record(&mut self, w: u32) {
        let Some(rec) = self.by_worker.get_mut(w as usize) else {
            return;
        };
        rec.pushed = false;
        for v in &mut rec.vars {
            recycle(&mut self.spare, v);
        }
    }

    /// Worker `w`'s record, if it has one.
    pub(crate) fn get_mut(&mut self, w: u32) -> Option<&mut WorkerPulls> {
        self.by_worker.get_mut(w as usize)
    }

    /// Take worker `w`'s record out (to read it while the variables
    /// change); [`Self::put_back`] returns it.
    pub(crate) fn take(&mut self, w: u32) -> Option<WorkerPulls> {
        self.by_worker.get_mut(w as usize).map(std::mem::take)
    }

    /// Records dropped because they held more than [`MAX_RECORD_BYTES`].
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// A smaller limit than [`MAX_RECORD_BYTES`], for tests.
    #[cfg(test)]
    pub(crate) fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// The keys all records hold (a dense variable counts as one).
    #[cfg(test)]
    pub(crate) fn recorded_keys(&self) -> usize {
        let vars = self.by_worker.iter().flat_map(|w| &w.vars);
        vars.map(|v| v.keys.len()).sum()
    }

    /// Return a record [`Self::take`] took.
    pub(crate) fn put_back(&mut self, w: u32, rec: WorkerPulls) {
        if let Some(r) = self.by_worker.get_mut(w as usize) {
            *r = rec;
        }
    }
}

/// Empty `v` and give its buffers, if it holds any, to `spare`, where the
/// shard's next pull records into them.
fn recycle(spare: &mut Vec<VarPulls>, v: &mut VarPulls) {
    v.clear();
    if !v.unallocated() {
        spare.push(std::mem::take(v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_uses_the_last_pull_and_the_next_pull_starts_again() {
        let mut p = Pulls::default();
        assert!(p.begin_pull(MAX_TRACKED_WORKERS, 2, []).is_none());
        let w = p.begin_pull(3, 2, []).unwrap();
        w.record(1, 7, Some(2), Some(&[1.0, 2.0]));
        w.record(1, 9, Some(0), Some(&[3.0, 4.0]));
        w.record(1, 7, Some(5), Some(&[9.0, 9.0]));
        w.record(0, 0, Some(4), None);
        let got = w.pulled(1, 7, 6, 2);
        assert_eq!(got.staleness, Some(1));
        assert_eq!(got.values, Some(&[9.0f32, 9.0][..]));
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
        w.begin_pull(0, [], &mut Vec::new(), MAX_RECORD_BYTES);
        assert_eq!(w.pulled(1, 7, 6, 2), Pulled::default());
        assert!(w.var(1).is_none());
        let rec = p.take(3).unwrap();
        assert!(p.take(4).is_none());
        p.put_back(3, rec);
    }

    /// Worker 0's evaluation between epochs pulls on its training
    /// connection after its last push, and no push follows: its next
    /// step's push is matched with that step's pull, not the evaluation's.
    #[test]
    fn a_push_after_pulls_no_push_followed_uses_its_step_s_pull() {
        let mut p = Pulls::default();
        let w = p.begin_pull(0, 2, []).unwrap();
        w.record(1, 7, Some(1), Some(&[1.0]));
        w.record(0, 0, Some(1), Some(&[1.0]));
        w.end_push();
        // The evaluation: a new record, then the next step's pull.
        let w = p.begin_pull(0, 2, []).unwrap();
        w.record(1, 7, Some(3), Some(&[3.0]));
        w.record(1, 8, Some(3), Some(&[3.5]));
        w.record(0, 0, Some(3), Some(&[3.0]));
        let w = p.begin_pull(0, 2, []).unwrap();
        w.record(1, 9, Some(4), Some(&[4.5]));
        w.record(1, 7, Some(5), Some(&[5.0]));
        w.record(0, 0, Some(5), Some(&[5.0]));
        let got = w.pulled(1, 7, 6, 1);
        assert_eq!((got.staleness, got.values), (Some(1), Some(&[5.0f32][..])));
        let got = w.pulled(0, 0, 6, 1);
        assert_eq!((got.staleness, got.values), (Some(1), Some(&[5.0f32][..])));
        assert_eq!(w.pulled(1, 9, 6, 1).values, Some(&[4.5f32][..]));
    }

    #[test]
    fn a_pushed_variable_s_buffers_go_to_the_next_pull_of_any_worker() {
        let mut p = Pulls::default();
        let w = p.begin_pull(1, 3, []).unwrap();
        w.record(0, 0, None, Some(&[1.0]));
        w.record(2, 7, None, Some(&[2.0, 3.0]));
        w.record(2, 8, None, Some(&[4.0, 5.0]));
        let cap = w.vars[2].values.capacity();
        let rec = p.take(1).unwrap();
        p.put_back(1, rec);
        // A push of variable 2 alone: its record is used up, variable 0's
        // stays for a later push (no fusion).
        p.release(1, &[2]);
        // Worker 2's first pull records into them: no allocation.
        let w2 = p.begin_pull(2, 3, []).unwrap();
        assert_eq!(w2.vars.iter().filter(|v| !v.unallocated()).count(), 1);
        let got = w2.vars.iter().find(|v| !v.unallocated()).unwrap();
        assert!(got.keys.is_empty() && got.values.capacity() >= cap);
        w2.record(1, 9, None, Some(&[6.0]));
        assert_eq!(w2.pulled(1, 9, 0, 1).values, Some(&[6.0f32][..]));
        let w = p.begin_pull(1, 3, []).unwrap();
        assert!(w.var(2).is_none());
        assert!(w.vars[2].unallocated(), "worker 1 gave its buffers away");
        assert_eq!(w.pulled(0, 0, 1, 1).values, Some(&[1.0f32][..]));
        // After a push, the next pull of worker 1 pools what it still held.
        w.end_push();
        let w = p.begin_pull(1, 3, []).unwrap();
        assert!(w.var(0).is_none());
        // Variable 0's buffers went to the pool and came back empty: one
        // variable holds buffers, none are left over.
        assert_eq!(w.vars.iter().filter(|v| !v.unallocated()).count(), 1);
        assert!(p.spare.is_empty());
        // An untracked worker releases nothing and panics not.
        p.release(MAX_TRACKED_WORKERS + 1, &[0, 5]);
        p.release(1, &[99]);
    }

    /// A dropped record gives its buffers to the pool, which the next
    /// pull of any worker records into; the worker's next pull starts a
    /// new record.
    #[test]
    fn a_dropped_record_s_buffers_go_to_the_pool() {
        let mut p = Pulls::default();
        let w = p.begin_pull(0, 2, []).unwrap();
        w.record(0, 0, None, Some(&[1.0]));
        w.record(1, 7, None, Some(&[2.0, 3.0]));
        p.drop_record(0);
        assert_eq!(p.recorded_keys(), 0);
        assert_eq!(p.spare.len(), 2);
        let w1 = p.begin_pull(1, 2, []).unwrap();
        assert!(w1.vars.iter().all(|v| !v.unallocated()));
        assert!(p.spare.is_empty());
        let w = p.begin_pull(0, 2, []).unwrap();
        assert!(w.var(1).is_none());
        w.record(1, 8, None, Some(&[4.0, 5.0]));
        assert_eq!(w.var(1).unwrap().keys, [8]);
        // A worker with no record: nothing to drop, no panic.
        p.drop_record(MAX_TRACKED_WORKERS + 1);
        p.drop_record(3);
    }

    fn le<T: Copy>(xs: &[T], to: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
        xs.iter().flat_map(|&x| to(x)).collect()
    }

    #[test]
    fn rows_recorded_from_a_reply_match_rows_recorded_one_by_one() {
        let keys = le(&[7u64, 9, 7, 4], |k| k.to_le_bytes().to_vec());
        let vals = [1.0f32, 2.0, 3.0, 4.0, 9.0, 9.0, -0.0, f32::MIN_POSITIVE];
        let bytes = le(&vals, |x| x.to_le_bytes().to_vec());
        let mut bulk = WorkerPulls::default();
        bulk.begin_pull(0, [], &mut Vec::new(), MAX_RECORD_BYTES);
        bulk.record_rows(2, U64s::new(&keys).unwrap(), F32s::new(&bytes).unwrap());
        let mut one = WorkerPulls::default();
        one.begin_pull(0, [], &mut Vec::new(), MAX_RECORD_BYTES);
        for (j, k) in [7u64, 9, 7, 4].into_iter().enumerate() {
            one.record(2, k, None, Some(&vals[2 * j..2 * j + 2]));
        }
        assert_eq!(bulk.var(2).unwrap().keys, one.var(2).unwrap().keys);
        for (key, last) in [(7u64, 2usize), (9, 1), (4, 3)] {
            let got = bulk.pulled(2, key, 3, 2);
            assert_eq!(got, one.pulled(2, key, 3, 2));
            // No update counts: no staleness, the values of the last pull.
            assert_eq!(got.staleness, None);
            let want = &vals[2 * last..2 * last + 2];
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got.values.unwrap()), bits(want));
        }
        assert_eq!(
            bulk.var(2).unwrap().at(2, 0, 2).values,
            Some(&[9.0f32, 9.0][..])
        );
        // A second pull before the push appends; a push then starts again.
        bulk.record_rows(
            2,
            U64s::new(&keys[..8]).unwrap(),
            F32s::new(&bytes[..8]).unwrap(),
        );
        assert_eq!(bulk.var(2).unwrap().keys, [7, 9, 7, 4, 7]);
        assert_eq!(bulk.pulled(2, 7, 0, 2).values, Some(&[1.0f32, 2.0][..]));
        bulk.end_push();
        bulk.begin_pull(0, [], &mut Vec::new(), MAX_RECORD_BYTES);
        assert!(bulk.var(2).is_none());
        // Values not 4-aligned in memory are decoded, to the same record.
        let mut odd = vec![0u8];
        odd.extend_from_slice(&bytes);
        let unaligned = F32s::new(&odd[1..]).unwrap();
        assert!(unaligned.try_as_slice().is_none());
        bulk.record_rows(2, U64s::new(&keys).unwrap(), unaligned);
        for (key, last) in [(7u64, 2usize), (9, 1), (4, 3)] {
            let got = bulk.pulled(2, key, 3, 2).values.unwrap();
            let want = &vals[2 * last..2 * last + 2];
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn only_a_staleness_aware_rate_keeps_update_counts() {
        let mut opt = OptimizerConfig::with_kind(crate::OptimizerKind::DcAsgd, 0.5);
        assert!(!keeps_updates(&opt));
        opt.staleness_lr = StalenessLr::Sqrt;
        assert!(keeps_updates(&opt));
    }
}

//! Incremental checkpoints, as PS-Plus exports them for online learning:
//! a delta file holds only the embedding rows touched since a full
//! checkpoint (its *base*), every dense variable whole (they are small),
//! and each table's counters and pending frequency-filter counters.
//!
//! * [`TouchedRows`] records the keys of the pulls and pushes a shard
//!   serves (a pull can add a row, or move its last access step; a push
//!   changes it), read from the request bodies, so the shard's own
//!   request path is left as it is. Only keys with a row once the request
//!   is served are kept: a key the filter held back, or a push of a key
//!   with no row, changed no row, and a request never removes a row of
//!   its own keys. So what is kept grows with the rows, not with the
//!   keys peers send.
//! * [`PsShard::save_delta`] writes the rows of those keys; a recorded key
//!   with no row now (filtered, or evicted after its last touch) is listed
//!   as removed.
//! * [`PsShard::apply_delta`] reads a delta onto a shard restored from its
//!   base (the shard's global step must be the delta's base step): the
//!   shard then holds the state the delta was taken from.
//!
//! A row evicted by `steps_to_live` without being touched since the base is
//! not in the delta: with eviction, take full checkpoints. The byte layout
//! is in `docs/CHECKPOINT.md`.

use std::io::{Read, Write};

use rustc_hash::{FxHashMap, FxHashSet};
use starwire_wire::ps::{Limits, PullRequest, PushItem, PushRequest, U64s};

use crate::checkpoint::{
    mismatch, opt_code, put_applied, put_pending, put_row, put_var_head, read_applied, read_dense,
    read_pending, read_row, read_table_stats, read_var_head, CrcWriter, Cursor,
};
use crate::error::CheckpointError;
use crate::keyhash::KeySet;
use crate::shard::{PsShard, Var};
use crate::table::{Counters, Rows};

/// The first eight bytes of a delta file.
pub const DELTA_MAGIC: [u8; 8] = *b"SWPSDELT";
/// The delta format version this build writes.
pub const DELTA_VERSION: u32 = 2;
/// The first version, without each worker's applied steps; still read.
pub const DELTA_VERSION_1: u32 = 1;

/// The keys of every table a shard's requests touched since the last full
/// checkpoint. See the module documentation.
#[derive(Debug, Default, Clone)]
pub struct TouchedRows {
    keys: FxHashMap<u32, KeySet>,
    limits: Limits,
}

impl TouchedRows {
    /// Record requests checked against `limits` (the shard's).
    pub fn new(limits: Limits) -> Self {
        Self {
            keys: FxHashMap::default(),
            limits,
        }
    }

    /// A pull request `shard` was given, `served` or refused (a refused
    /// pull keeps the rows it made before the refusal, a full table): of
    /// its keys, those with a row now are recorded. A recorded key with
    /// no row when the delta is written (evicted since) is listed as
    /// removed. One that does not decode changed nothing (the shard
    /// refuses it too), nor does an item of a variable that is no table
    /// of the shard: neither is recorded, so what is kept grows only with
    /// the rows the tables hold.
    pub fn record_pull(&mut self, shard: &PsShard, body: &[u8]) {
        let Ok(req) = PullRequest::parse(body, &self.limits) else {
            return;
        };
        for item in req.items() {
            if let Some(keys) = item.keys() {
                self.record(shard, item.var(), keys);
            }
        }
    }

    /// Record those of `keys` of table `var` of `shard` that have a row.
    /// (Every key of a served request was recorded before: a peer's pulls
    /// of keys the filter holds back, or pushes of keys with no row, grew
    /// the set without bound until the next full checkpoint.)
    fn record(&mut self, shard: &PsShard, var: u32, keys: U64s<'_>) {
        let Some(table) = shard.table(var) else {
            return;
        };
        let set = self.keys.entry(var).or_default();
        set.extend(keys.iter().filter(|&k| table.get(k).is_some()));
    }

    /// A push request `shard` was given and did not acknowledge as
    /// unapplied (served, or refused): as [`record_pull`](Self::record_pull),
    /// since a refusal may come after some of its rows were made or updated
    /// (a full table); recording a row that did not change costs only its
    /// place in the delta.
    pub fn record_push(&mut self, shard: &PsShard, body: &[u8]) {
        let Ok(req) = PushRequest::parse(body, &self.limits) else {
            return;
        };
        for item in req.items() {
            let (var, keys) = match item {
                PushItem::Dense { .. } => continue,
                PushItem::Rows { var, keys, .. } | PushItem::Pooled { var, keys, .. } => {
                    (var, keys)
                }
            };
            self.record(shard, var, keys);
        }
    }

    /// Keys recorded, over all tables.
    pub fn len(&self) -> usize {
        self.keys.values().map(KeySet::len).sum()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget every key (a full checkpoint was written: it is the new base).
    pub fn clear(&mut self) {
        self.keys.clear();
    }

    fn sorted(&self, var: u32) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .keys
            .get(&var)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }
}

impl PsShard {
    /// Write a delta of this shard against the full checkpoint at global
    /// step `base`: the rows of `touched`'s keys, every dense variable, and
    /// each table's counters and pending counters.
    pub fn save_delta(
        &self,
        base: u64,
        touched: &TouchedRows,
        w: &mut dyn Write,
    ) -> Result<(), CheckpointError> {
        let mut w = CrcWriter::new(w);
        w.put(&DELTA_MAGIC)?;
        w.u32(DELTA_VERSION)?;
        w.u32(0)?;
        w.u64(self.shard_index as u64)?;
        w.u64(self.global_step)?;
        w.u64(base)?;
        w.u64(self.cfg.seed)?;
        w.u8(opt_code(self.cfg.optimizer.kind))?;
        w.put(&[0, 0, 0])?;
        w.u32(self.vars.len() as u32)?;
        let slots = self.cfg.optimizer.slots() as u32;
        for v in &self.vars {
            put_var_head(&mut w, v, slots)?;
            let Var::Table(t) = v else {
                continue;
            };
            let keys = touched.sorted(t.def.id);
            let (present, removed): (Vec<u64>, Vec<u64>) =
                keys.into_iter().partition(|&k| t.rows.get(k).is_some());
            w.u64(present.len() as u64)?;
            w.u64(t.pending.len() as u64)?;
            w.u64(removed.len() as u64)?;
            for k in present {
                put_row(&mut w, &t.rows, k)?;
            }
            put_pending(&mut w, &t.pending)?;
            for k in removed {
                w.u64(k)?;
            }
        }
        put_applied(&mut w, &self.applied)?;
        w.finish()?;
        Ok(())
    }

    /// Apply a delta written by [`save_delta`](Self::save_delta) of a shard
    /// with the same variables, index, seed and optimizer, whose base is
    /// this shard's global step. On any error the shard is unchanged.
    pub fn apply_delta(&mut self, r: &mut dyn Read) -> Result<(), CheckpointError> {
        let mut data = Vec::new();
        r.read_to_end(&mut data)?;
        let d = DeltaHeader::parse(&data)?;
        if d.shard_index != self.shard_index as u64 {
            return Err(mismatch(format!(
                "shard index {}, this shard is {}",
                d.shard_index, self.shard_index
            )));
        }
        if d.seed != self.cfg.seed || d.optimizer != opt_code(self.cfg.optimizer.kind) {
            return Err(mismatch("seed or optimizer differs".into()));
        }
        if d.base != self.global_step {
            return Err(mismatch(format!(
                "a delta against global step {}, this shard is at {}",
                d.base, self.global_step
            )));
        }
        if d.n_vars as usize != self.vars.len() {
            return Err(mismatch(format!(
                "{} variables, this shard has {}",
                d.n_vars,
                self.vars.len()
            )));
        }
        let mut c = Cursor::new(&data[..data.len() - 4], DeltaHeader::LEN);
        let slots = self.cfg.optimizer.slots();
        let mut vars = self.vars.clone();
        for v in &mut vars {
            read_var_head(&mut c, v, slots)?;
            match v {
                Var::Dense(dv) => read_dense(&mut c, dv)?,
                Var::Table(t) => {
                    let id = t.def.id;
                    let stats = read_table_stats(&mut c)?;
                    let n_rows = c.u64("row count")?;
                    let n_pending = c.u64("pending count")?;
                    let n_removed = c.u64("removed count")?;
                    let row_floats = t.dim * (1 + slots);
                    let n_rows = c.fits(n_rows, 24 + 4 * row_floats, "rows")?;
                    let mut changed = Vec::with_capacity(n_rows);
                    let mut prev = None;
                    for _ in 0..n_rows {
                        let mut row = vec![0.0f32; row_floats];
                        let (key, last_access, updates) =
                            read_row(&mut c, id, &mut prev, &mut row)?;
                        changed.push((key, last_access, updates, row));
                    }
                    let pending = read_pending(&mut c, n_pending, id)?;
                    let n_removed = c.fits(n_removed, 8, "removed keys")?;
                    let mut gone = FxHashSet::default();
                    for _ in 0..n_removed {
                        gone.insert(c.u64("removed key")?);
                    }
                    gone.extend(changed.iter().map(|r| r.0));
                    // The rows the delta does not name are the base's.
                    let keep = t.rows.len().saturating_sub(gone.len()) + changed.len();
                    let mut rows = Rows::with_capacity(row_floats, keep);
                    let room = |e| {
                        CheckpointError::Corrupt(format!("variable {id}: no room for a row: {e:?}"))
                    };
                    for k in t.rows.keys().filter(|k| !gone.contains(k)) {
                        if let Some((s, data)) = t.rows.get(k) {
                            rows.insert(k, s.last_access, s.updates, data)
                                .map_err(room)?;
                        }
                    }
                    for (k, last_access, updates, data) in &changed {
                        rows.insert(*k, *last_access, *updates, data)
                            .map_err(room)?;
                    }
                    t.stats = stats;
                    t.rows = rows;
                    let (pending, dropped) = Counters::restored(pending, t.policy.filter_capacity);
                    t.pending = pending;
                    t.stats.filter_overflow += dropped;
                }
            }
        }
        let applied = if d.version == DELTA_VERSION_1 {
            self.applied.clone()
        } else {
            read_applied(&mut c)?
        };
        if c.left() != 0 {
            return Err(CheckpointError::Corrupt(format!(
                "{} bytes after the last record",
                c.left()
            )));
        }
        self.vars = vars;
        self.global_step = d.step;
        self.applied = applied;
        Ok(())
    }
}

/// The header of a delta file, checked (magic, version, CRC), as
/// `starwire`'s readers show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaHeader {
    /// The format version ([`DELTA_VERSION`] or [`DELTA_VERSION_1`]).
    pub version: u32,
    /// The shard.
    pub shard_index: u64,
    /// The global step the delta brings its base to.
    pub step: u64,
    /// The global step of the full checkpoint it applies to.
    pub base: u64,
    /// The job's seed.
    pub seed: u64,
    /// The optimizer code (as in a full checkpoint).
    pub optimizer: u8,
    /// Variables that follow.
    pub n_vars: u32,
}

impl DeltaHeader {
    const LEN: usize = 56;

    /// Check a whole delta file's magic, version and CRC, and read its
    /// header.
    pub fn parse(data: &[u8]) -> Result<Self, CheckpointError> {
        if data.len() < Self::LEN + 4 {
            return Err(CheckpointError::Truncated("delta header"));
        }
        if data[..8] != DELTA_MAGIC {
            return Err(CheckpointError::BadMagic);
        }
        let (body, tail) = data.split_at(data.len() - 4);
        let mut c = Cursor::new(body, 8);
        let version = c.u32("version")?;
        if version != DELTA_VERSION && version != DELTA_VERSION_1 {
            return Err(CheckpointError::BadVersion(version));
        }
        let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        let computed = crc32c::crc32c(body);
        if stored != computed {
            return Err(CheckpointError::Checksum { stored, computed });
        }
        c.zeros(4, "header")?;
        let h = Self {
            version,
            shard_index: c.u64("shard index")?,
            step: c.u64("global step")?,
            base: c.u64("base step")?,
            seed: c.u64("seed")?,
            optimizer: c.u8("optimizer")?,
            n_vars: {
                c.zeros(3, "header")?;
                c.u32("variable count")?
            },
        };
        Ok(h)
    }
}

//! Checkpoints: [`PsShard::save`] / [`PsShard::restore`] of a shard's whole
//! state, the JSON [`Manifest`] of a checkpoint and [`write_atomic`].
//!
//! The byte layout, versioning and atomicity rules are in
//! `docs/CHECKPOINT.md`. In short: a magic, a version, a header, every
//! variable in id order (embedding rows and pending filter counters sorted by
//! key, so the same state always gives the same bytes), and a CRC-32C of
//! everything before it.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::keyhash::KeyMapOf;
use serde::{Deserialize, Serialize};

use crate::applied::{AppliedSteps, Position};
use crate::error::CheckpointError;
use crate::optim::OptimizerKind;
use crate::shard::{DenseVar, PsShard, Var};
use crate::table::{Counters, Pending, Rows, TableStats};

/// File magic.
pub const MAGIC: [u8; 8] = *b"SWPSCKPT";
/// Current format version.
pub const FORMAT_VERSION: u32 = 2;
/// The first version, without each worker's applied steps; still read.
pub const FORMAT_VERSION_1: u32 = 1;

pub(crate) const VAR_DENSE: u8 = 1;
pub(crate) const VAR_TABLE: u8 = 2;

pub(crate) fn opt_code(k: OptimizerKind) -> u8 {
    match k {
        OptimizerKind::Sgd => 1,
        OptimizerKind::Adagrad => 2,
        OptimizerKind::Adam => 3,
        OptimizerKind::Ftrl => 4,
        OptimizerKind::AdagradDecay => 5,
        OptimizerKind::DcAsgd => 6,
    }
}

/// A writer that computes the CRC-32C of what goes through it, with its own
/// buffer so small fields do not each reach the underlying writer.
/// A writer that keeps the CRC-32C of what went through it, for the
/// file's last four bytes ([`finish`](Self::finish)).
pub(crate) struct CrcWriter<'w> {
    inner: &'w mut dyn Write,
    crc: u32,
    buf: Vec<u8>,
}

impl<'w> CrcWriter<'w> {
    pub(crate) fn new(inner: &'w mut dyn Write) -> Self {
        Self {
            inner,
            crc: 0,
            buf: Vec::with_capacity(1 << 16),
        }
    }
    pub(crate) fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.crc = crc32c::crc32c_append(self.crc, b);
        self.buf.extend_from_slice(b);
        if self.buf.len() >= 1 << 16 {
            self.inner.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }
    pub(crate) fn u8(&mut self, v: u8) -> io::Result<()> {
        self.put(&[v])
    }
    pub(crate) fn u32(&mut self, v: u32) -> io::Result<()> {
        self.put(&v.to_le_bytes())
    }
    pub(crate) fn u64(&mut self, v: u64) -> io::Result<()> {
        self.put(&v.to_le_bytes())
    }
    pub(crate) fn f32s(&mut self, v: &[f32]) -> io::Result<()> {
        for x in v {
            self.put(&x.to_le_bytes())?;
        }
        Ok(())
    }
    pub(crate) fn finish(mut self) -> io::Result<()> {
        let crc = self.crc;
        self.buf.extend_from_slice(&crc.to_le_bytes());
        self.inner.write_all(&self.buf)?;
        self.inner.flush()
    }
}

/// A checked reader over a file's bytes.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8], pos: usize) -> Self {
        Self { buf, pos }
    }
    pub(crate) fn bytes(
        &mut self,
        n: usize,
        what: &'static str,
    ) -> Result<&'a [u8], CheckpointError> {
        if n > self.buf.len() - self.pos {
            return Err(CheckpointError::Truncated(what));
        }
        let b = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(b)
    }
    pub(crate) fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, CheckpointError> {
        Ok(self.bytes(1, what)?[0])
    }
    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, CheckpointError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, CheckpointError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.bytes(8, what)?);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn zeros(&mut self, n: usize, what: &'static str) -> Result<(), CheckpointError> {
        if self.bytes(n, what)?.iter().any(|&b| b != 0) {
            return Err(CheckpointError::Corrupt(format!(
                "reserved bytes set in {what}"
            )));
        }
        Ok(())
    }
    pub(crate) fn f32s(
        &mut self,
        out: &mut [f32],
        what: &'static str,
    ) -> Result<(), CheckpointError> {
        let b = self.bytes(out.len() * 4, what)?;
        for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }
    /// Check that `n` records of `size` bytes fit in what is left.
    pub(crate) fn fits(
        &self,
        n: u64,
        size: usize,
        what: &'static str,
    ) -> Result<usize, CheckpointError> {
        let n = usize::try_from(n).map_err(|_| CheckpointError::Truncated(what))?;
        match n.checked_mul(size) {
            Some(len) if len <= self.left() => Ok(n),
            _ => Err(CheckpointError::Truncated(what)),
        }
    }
}

pub(crate) fn mismatch(s: String) -> CheckpointError {
    CheckpointError::Mismatch(s)
}

/// The record of variable `v` up to its rows: a dense variable whole; a
/// table's id, kind, width, slot count and counters (its rows follow, as
/// the full checkpoint or the delta lists them).
pub(crate) fn put_var_head(w: &mut CrcWriter<'_>, v: &Var, slots: u32) -> io::Result<()> {
    match v {
        Var::Dense(d) => {
            w.u32(d.def.id)?;
            w.u8(VAR_DENSE)?;
            w.put(&[0, 0, 0])?;
            w.u32(d.values.len() as u32)?;
            w.u32(slots)?;
            w.u64(d.updates)?;
            w.f32s(&d.values)?;
            w.f32s(&d.slots)
        }
        Var::Table(t) => {
            w.u32(t.def.id)?;
            w.u8(VAR_TABLE)?;
            w.put(&[0, 0, 0])?;
            w.u32(t.dim as u32)?;
            w.u32(slots)?;
            let s = t.stats;
            for c in [
                s.admitted,
                s.filtered_pulls,
                s.filter_overflow,
                s.evicted,
                s.ignored_pushes,
            ] {
                w.u64(c)?;
            }
            Ok(())
        }
    }
}

/// Row `k` of `rows` (key, last access, updates, weights and slots), if
/// the table holds it.
pub(crate) fn put_row(w: &mut CrcWriter<'_>, rows: &Rows, k: u64) -> io::Result<()> {
    let Some((s, data)) = rows.get(k) else {
        return Ok(());
    };
    w.u64(k)?;
    w.u64(s.last_access)?;
    w.u64(s.updates)?;
    w.f32s(data)
}

/// Every pending filter counter, by key.
pub(crate) fn put_pending(w: &mut CrcWriter<'_>, pending: &Counters) -> io::Result<()> {
    let mut all: Vec<(u64, Pending)> = pending.iter().collect();
    all.sort_unstable_by_key(|&(k, _)| k);
    for (k, p) in all {
        w.u64(k)?;
        w.u32(p.count)?;
        w.u32(0)?;
        w.u64(p.last_seen)?;
    }
    Ok(())
}

/// A variable's record head as [`put_var_head`] starts it (id, kind,
/// width, slot count), checked against `v` and the optimizer's `slots`.
pub(crate) fn read_var_head(
    c: &mut Cursor<'_>,
    v: &Var,
    slots: usize,
) -> Result<(), CheckpointError> {
    let id = c.u32("variable id")?;
    let kind = c.u8("variable kind")?;
    c.zeros(3, "variable header")?;
    let width = c.u32("variable width")? as usize;
    let nslots = c.u32("slot count")? as usize;
    if id != v.id() {
        return Err(mismatch(format!("variable {id}, expected {}", v.id())));
    }
    if nslots != slots {
        return Err(mismatch(format!(
            "variable {id}: {nslots} slots, expected {slots}"
        )));
    }
    let fits = match v {
        Var::Dense(d) => kind == VAR_DENSE && width == d.values.len(),
        Var::Table(t) => kind == VAR_TABLE && width == t.dim,
    };
    if !fits {
        return Err(mismatch(format!(
            "variable {id}: kind {kind} width {width}"
        )));
    }
    Ok(())
}

/// A dense variable's body: its update count, values and slots.
pub(crate) fn read_dense(c: &mut Cursor<'_>, d: &mut DenseVar) -> Result<(), CheckpointError> {
    d.updates = c.u64("dense updates")?;
    c.f32s(&mut d.values, "dense values")?;
    c.f32s(&mut d.slots, "dense slots")
}

/// A table's counters, as [`put_var_head`] writes them.
pub(crate) fn read_table_stats(c: &mut Cursor<'_>) -> Result<TableStats, CheckpointError> {
    let mut s = [0u64; 5];
    for x in &mut s {
        *x = c.u64("table counters")?;
    }
    Ok(TableStats {
        admitted: s[0],
        filtered_pulls: s[1],
        filter_overflow: s[2],
        evicted: s[3],
        ignored_pushes: s[4],
    })
}

/// One row as [`put_row`] writes it, its data into `data`: its key, last
/// access step and update count. Keys must strictly increase over a
/// table's rows (`prev`, the last key read).
pub(crate) fn read_row(
    c: &mut Cursor<'_>,
    id: u32,
    prev: &mut Option<u64>,
    data: &mut [f32],
) -> Result<(u64, u64, u64), CheckpointError> {
    let key = c.u64("row key")?;
    if prev.is_some_and(|p| p >= key) {
        return Err(CheckpointError::Corrupt(format!(
            "variable {id}: row keys not strictly increasing"
        )));
    }
    *prev = Some(key);
    let last_access = c.u64("row access step")?;
    let updates = c.u64("row updates")?;
    c.f32s(data, "row data")?;
    Ok((key, last_access, updates))
}

/// `n` pending filter counters as [`put_pending`] writes them.
pub(crate) fn read_pending(
    c: &mut Cursor<'_>,
    n: u64,
    id: u32,
) -> Result<KeyMapOf<Pending>, CheckpointError> {
    let n = c.fits(n, 24, "pending counters")?;
    let mut pending = KeyMapOf::default();
    pending.reserve(n);
    for _ in 0..n {
        let key = c.u64("pending key")?;
        let count = c.u32("pending count")?;
        c.zeros(4, "pending counter")?;
        let last_seen = c.u64("pending step")?;
        if pending.insert(key, Pending { count, last_seen }).is_some() {
            return Err(CheckpointError::Corrupt(format!(
                "variable {id}: duplicate pending key"
            )));
        }
    }
    Ok(pending)
}

/// Each worker's applied position, by increasing task index (format
/// version 2, after the variables).
pub(crate) fn put_applied(w: &mut CrcWriter<'_>, applied: &AppliedSteps) -> io::Result<()> {
    w.u32(applied.applied().count() as u32)?;
    w.u32(0)?;
    for (worker, p) in applied.applied() {
        w.u32(worker)?;
        w.u32(p.parts)?;
        w.u64(p.steps)?;
    }
    Ok(())
}

/// The highest worker task index a shard file or delta may record: a
/// restored shard keeps the applied steps in a vector indexed by task
/// index, so an index read from a file must not size it beyond reason.
pub const MAX_WORKER_INDEX: u32 = (1 << 16) - 1;

/// The record [`put_applied`] writes.
pub(crate) fn read_applied(c: &mut Cursor<'_>) -> Result<AppliedSteps, CheckpointError> {
    let n = c.u32("worker count")?;
    c.zeros(4, "worker header")?;
    let n = c.fits(n.into(), 16, "workers")?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let worker = c.u32("worker")?;
        let parts = c.u32("worker parts")?;
        let steps = c.u64("worker steps")?;
        if worker > MAX_WORKER_INDEX {
            return Err(CheckpointError::Corrupt(format!(
                "worker {worker}: task index above {MAX_WORKER_INDEX}"
            )));
        }
        if v.last().is_some_and(|&(prev, _)| prev >= worker) {
            return Err(CheckpointError::Corrupt(
                "workers not strictly increasing".into(),
            ));
        }
        v.push((worker, Position { steps, parts }));
    }
    Ok(AppliedSteps::restored(&v))
}

/// What a shard file's header names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardHeader {
    /// Its format version.
    pub version: u32,
    /// The shard.
    pub shard_index: u64,
    /// Its global step.
    pub global_step: u64,
}

/// Read a shard file's header from its first bytes alone (magic, version,
/// shard index, global step), without reading the rest or checking the
/// CRC: enough to see which shard and step a file holds.
pub fn read_header(r: &mut dyn Read) -> Result<ShardHeader, CheckpointError> {
    let mut b = [0u8; 32];
    r.read_exact(&mut b).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => CheckpointError::Truncated("header"),
        _ => CheckpointError::Io(e),
    })?;
    if b[..8] != MAGIC {
        return Err(CheckpointError::BadMagic);
    }
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if version != FORMAT_VERSION && version != FORMAT_VERSION_1 {
        return Err(CheckpointError::BadVersion(version));
    }
    Ok(ShardHeader {
        version,
        shard_index: u64_at(16),
        global_step: u64_at(24),
    })
}

/// A whole shard file checked (length, magic, version, CRC): its version
/// and the bytes before the CRC.
pub(crate) fn checked_body(data: &[u8]) -> Result<(u32, &[u8]), CheckpointError> {
    if data.len() < 16 {
        return Err(CheckpointError::Truncated("header"));
    }
    if data[..8] != MAGIC {
        return Err(CheckpointError::BadMagic);
    }
    let version = u32::from_le_bytes([data[8], data[9], data[10], data[11]]);
    if version != FORMAT_VERSION && version != FORMAT_VERSION_1 {
        return Err(CheckpointError::BadVersion(version));
    }
    let (body, tail) = data.split_at(data.len() - 4);
    let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(CheckpointError::Checksum { stored, computed });
    }
    Ok((version, body))
}

impl PsShard {
    /// Write the whole shard state: every variable, row, optimizer slot,
    /// pending filter counter, table counter, and the global step.
    pub fn save(&self, w: &mut dyn Write) -> Result<(), CheckpointError> {
        let mut w = CrcWriter {
            inner: w,
            crc: 0,
            buf: Vec::with_capacity(1 << 16),
        };
        w.put(&MAGIC)?;
        w.u32(FORMAT_VERSION)?;
        w.u32(0)?;
        w.u64(self.shard_index as u64)?;
        w.u64(self.global_step)?;
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
            w.u64(t.rows.len() as u64)?;
            w.u64(t.pending.len() as u64)?;
            let mut keys: Vec<u64> = t.rows.keys().collect();
            keys.sort_unstable();
            for k in keys {
                put_row(&mut w, &t.rows, k)?;
            }
            put_pending(&mut w, &t.pending)?;
        }
        put_applied(&mut w, &self.applied)?;
        w.finish()?;
        Ok(())
    }

    /// Replace this shard's state with a checkpoint written by [`PsShard::save`]
    /// of a shard built with the same variables, shard index, seed and
    /// optimizer kind. On any error the shard is unchanged.
    pub fn restore(&mut self, r: &mut dyn Read) -> Result<(), CheckpointError> {
        let mut data = Vec::new();
        r.read_to_end(&mut data)?;
        let (version, body) = checked_body(&data)?;
        let mut c = Cursor { buf: body, pos: 12 };
        c.zeros(4, "header")?;
        let shard_index = c.u64("shard index")?;
        let global_step = c.u64("global step")?;
        let seed = c.u64("seed")?;
        let opt = c.u8("optimizer")?;
        c.zeros(3, "header")?;
        let n_vars = c.u32("variable count")?;
        if shard_index != self.shard_index as u64 {
            return Err(mismatch(format!(
                "shard index {shard_index}, this shard is {}",
                self.shard_index
            )));
        }
        if seed != self.cfg.seed {
            return Err(mismatch(format!(
                "seed {seed}, this shard has {}",
                self.cfg.seed
            )));
        }
        if opt != opt_code(self.cfg.optimizer.kind) {
            return Err(mismatch(format!("optimizer code {opt}")));
        }
        if n_vars as usize != self.vars.len() {
            return Err(mismatch(format!(
                "{n_vars} variables, this shard has {}",
                self.vars.len()
            )));
        }
        let slots = self.cfg.optimizer.slots();
        let mut vars = self.vars.clone();
        for v in &mut vars {
            read_var_head(&mut c, v, slots)?;
            match v {
                Var::Dense(d) => read_dense(&mut c, d)?,
                Var::Table(t) => {
                    let id = t.def.id;
                    t.stats = read_table_stats(&mut c)?;
                    let n_rows = c.u64("row count")?;
                    let n_pending = c.u64("pending count")?;
                    let row_floats = t.dim * (1 + slots);
                    let n_rows = c.fits(n_rows, 24 + 4 * row_floats, "rows")?;
                    let mut rows = Rows::with_capacity(row_floats, n_rows);
                    // The width comes from the file when the shard was built
                    // from its layout: allocate a row only once a row's bytes
                    // are known to be there.
                    let mut data = vec![0.0f32; if n_rows > 0 { row_floats } else { 0 }];
                    let mut prev = None;
                    for _ in 0..n_rows {
                        let (key, last_access, updates) =
                            read_row(&mut c, id, &mut prev, &mut data)?;
                        // Keys strictly increase, so the key is new.
                        rows.insert(key, last_access, updates, &data).map_err(|e| {
                            CheckpointError::Corrupt(format!(
                                "variable {id}: no room for row {key}: {e:?}"
                            ))
                        })?;
                    }
                    let (pending, dropped) = Counters::restored(
                        read_pending(&mut c, n_pending, id)?,
                        t.policy.filter_capacity,
                    );
                    t.pending = pending;
                    t.stats.filter_overflow += dropped;
                    t.rows = rows;
                }
            }
        }
        let applied = if version == FORMAT_VERSION_1 {
            AppliedSteps::default()
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
        self.global_step = global_step;
        self.applied = applied;
        Ok(())
    }
}

/// Progress of one worker at checkpoint time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerProgress {
    /// Worker index.
    pub worker: u32,
    /// Current epoch.
    pub epoch: u64,
    /// Offset into the worker's data (examples or bytes, as the reader defines it).
    pub offset: u64,
    /// Steps done by this worker.
    pub steps: u64,
    /// Examples this worker trained into the model up to this position,
    /// over every epoch (0 in manifests written before it was recorded).
    #[serde(default)]
    pub examples: u64,
    /// Examples (or lines) dealt to a worker at a time when `offset` was
    /// taken: the share `offset` counts into (1 in manifests written
    /// before shares were dealt in blocks).
    #[serde(default = "one")]
    pub deal_block: u64,
    /// Workers the data was dealt to when `offset` was taken: the shares
    /// `offset` counts into are one of that many (`None` in manifests
    /// written before it was recorded: not known, so not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<u64>,
}

fn one() -> u64 {
    1
}

impl WorkerProgress {
    /// Most steps a position may hold: more than any run takes (a million
    /// steps a second for 12 days), and small enough that a step count
    /// times the workers, as the checkpoint steps are numbered, cannot
    /// overflow.
    pub const MAX_STEPS: u64 = 1 << 40;
    /// Most examples (or bytes, for `offset`) a position may count.
    pub const MAX_EXAMPLES: u64 = 1 << 56;

    /// Parse a progress file and [`check`](Self::check) it.
    pub fn from_json(b: &[u8]) -> Result<Self, CheckpointError> {
        let p: Self = serde_json::from_slice(b)?;
        p.check()?;
        Ok(p)
    }

    /// Refuse counts no run reaches: the manifest and progress files are
    /// plain JSON with no checksum, and a worker resumes from them.
    pub fn check(&self) -> Result<(), CheckpointError> {
        let bad = |what: &str, v: u64, max: u64| {
            Err(CheckpointError::Corrupt(format!(
                "worker {}'s position: {what} {v} is past {max}",
                self.worker
            )))
        };
        if self.steps > Self::MAX_STEPS {
            return bad("steps", self.steps, Self::MAX_STEPS);
        }
        for (what, v) in [
            ("epoch", self.epoch),
            ("offset", self.offset),
            ("examples", self.examples),
            ("deal_block", self.deal_block),
        ] {
            if v > Self::MAX_EXAMPLES {
                return bad(what, v, Self::MAX_EXAMPLES);
            }
        }
        if let Some(n) = self.workers {
            if n <= u64::from(self.worker) {
                return Err(CheckpointError::Corrupt(format!(
                    "worker {}'s position: counted in {n} worker(s)' shares, which have no worker {}",
                    self.worker, self.worker
                )));
            }
        }
        Ok(())
    }
}

/// Description of a whole checkpoint (all shards), written last as
/// `manifest.json`: a checkpoint directory without a manifest is incomplete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the shard files.
    pub format_version: u32,
    /// Global step of the checkpoint.
    pub global_step: u64,
    /// Number of shards (one file each).
    pub shard_count: usize,
    /// Initialisation seed.
    pub seed: u64,
    /// Model description, filled by the runtime (free-form JSON).
    pub model: serde_json::Value,
    /// Shard file names, indexed by shard.
    pub shard_files: Vec<String>,
    /// Per-worker progress.
    pub workers: Vec<WorkerProgress>,
    /// Each shard's global step as its file holds it, indexed by shard;
    /// restore checks every file against it. Empty in manifests that
    /// predate it (nothing to check).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shard_steps: Vec<u64>,
}

impl Manifest {
    /// Serialise as pretty JSON.
    pub fn to_json(&self) -> Result<String, CheckpointError> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Parse and check the format version.
    pub fn from_json(s: &str) -> Result<Self, CheckpointError> {
        let m: Manifest = serde_json::from_str(s)?;
        if m.format_version != FORMAT_VERSION && m.format_version != FORMAT_VERSION_1 {
            return Err(CheckpointError::BadVersion(m.format_version));
        }
        if m.shard_files.len() != m.shard_count {
            return Err(CheckpointError::Corrupt(format!(
                "manifest lists {} shard files for {} shards",
                m.shard_files.len(),
                m.shard_count
            )));
        }
        if !m.shard_steps.is_empty() && m.shard_steps.len() != m.shard_count {
            return Err(CheckpointError::Corrupt(format!(
                "manifest lists {} shard steps for {} shards",
                m.shard_steps.len(),
                m.shard_count
            )));
        }
        for p in &m.workers {
            p.check()?;
        }
        Ok(m)
    }
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Create directory `dir` and the missing ones above it, durably: each
/// directory created is fsynced into its parent, so that after a power
/// loss a file written into `dir` (and fsynced, as [`write_atomic`] does)
/// is found by its path. Directories that existed are left alone.
pub fn create_dir_durable(dir: &Path) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    while !d.as_os_str().is_empty() && !d.exists() {
        missing.push(d);
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    fs::create_dir_all(dir)?;
    for m in missing {
        let parent = match m.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// Write `path` atomically: `f` writes into a temporary file in the same
/// directory, which is flushed and fsynced, renamed over `path`, and the
/// directory is fsynced. Readers see the old file or the new one, never a
/// partial one; after a crash a stray `.*.tmp.*` file may remain.
pub fn write_atomic<F>(path: &Path, f: F) -> Result<(), CheckpointError>
where
    F: FnOnce(&mut dyn Write) -> Result<(), CheckpointError>,
{
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        name.to_string_lossy(),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut w = BufWriter::new(file);
        f(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()?;
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

//! The PS checkpoint readers: a shard file through [`ShardLayout::parse`]
//! and [`PsShard::restore`] (into the fuzzed shard of [`crate::ps`] and
//! into the empty shard of the file's own layout), a delta file through
//! [`DeltaHeader::parse`] and [`PsShard::apply_delta`] onto a shard
//! restored from the delta's base.
//!
//! An input is one file; its magic says which. Both formats end with a
//! CRC-32C of everything before it, so [`Checkpoint`]'s `prepare` writes
//! the CRC of the mutated bytes again seven times in eight (the readers
//! past the CRC are reached) and leaves it as mutated otherwise (the CRC
//! check itself). Beyond "no panic" a run checks:
//!
//! * a shard file the fuzzed shard restores also parses as a layout, and
//!   a restored shard saved again parses to the same layout (at the
//!   current version) and restores to the same bytes;
//! * a refused file or delta leaves the shard byte-for-byte unchanged;
//! * an applied delta brings the shard to the delta's step, gives the
//!   same bytes applied onto a shard of the base file's layout, and the
//!   result saved restores to the same bytes;
//! * no single allocation of a run is larger than [`alloc_bound`] of the
//!   input's length (measured where [`crate::peak::Counting`] is the
//!   global allocator): the readers check every count against the bytes
//!   left before they allocate for it.
//!
//! An input whose first byte past white space is `{` is a JSON file
//! instead, and goes to both JSON readers: [`Manifest::from_json`] (the
//! checkpoint's `manifest.json`) and [`WorkerProgress::from_json`] (a
//! worker's position). [`CheckpointFiles`] mutates JSON as text (numbers
//! set to the readers' limits and past them, keys renamed, values of
//! another type), and its CRC is left alone. An accepted manifest or
//! position must hold what the readers promise (shard files and steps for
//! every shard, a known format version, every position within
//! [`WorkerProgress::check`]) and come back equal through `to_json` (or
//! `serde_json`) and the reader; a refused one must be refused with a
//! typed error that says why: [`CheckpointError::Manifest`] exactly when
//! `serde_json` refuses the text, else [`CheckpointError::BadVersion`] or
//! [`CheckpointError::Corrupt`] for the check that fails.
//!
//! ```text
//! cargo run --release -p starwire-wire-fuzz --bin fuzz-checkpoint -- --seconds 30 --seed 1
//! ```

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::Rng;
use starwire_ps::checkpoint::{Manifest, WorkerProgress, FORMAT_VERSION, FORMAT_VERSION_1};
use starwire_ps::delta::{DeltaHeader, TouchedRows, DELTA_MAGIC};
use starwire_ps::layout::ShardLayout;
use starwire_ps::{CheckpointError, PsShard};
use starwire_wire::ps::{PullRequestWriter, PushRequestWriter};

use crate::driver::{self, Spec};
use crate::mutate::{delete, duplicate, flip_bit, insert_random, splice, truncate};
use crate::ps::{new_shard, LIMITS};
use crate::{peak, Mutation, Mutator};

/// The largest single allocation a run of an input of `len` bytes may
/// make: the file read whole, its restored state saved again (a delta's
/// onto its base), with room for a growing `Vec` to double, for the
/// checkpoint writer's 64 KiB buffer and for the applied steps of the
/// highest worker index a file may name.
pub fn alloc_bound(len: usize) -> usize {
    (4 << 20) + 16 * len
}

/// A short name of a checkpoint error's kind.
pub fn error_kind(e: &CheckpointError) -> &'static str {
    match e {
        CheckpointError::Io(_) => "Io",
        CheckpointError::BadMagic => "BadMagic",
        CheckpointError::BadVersion(_) => "BadVersion",
        CheckpointError::Checksum { .. } => "Checksum",
        CheckpointError::Truncated(_) => "Truncated",
        CheckpointError::Corrupt(_) => "Corrupt",
        CheckpointError::Mismatch(_) => "Mismatch",
        CheckpointError::Manifest(_) => "Manifest",
        _ => "other",
    }
}

fn save(s: &PsShard) -> Vec<u8> {
    let mut b = Vec::new();
    s.save(&mut b).expect("save to a Vec cannot fail");
    b
}

/// A pull then a push of `keys` on both tables and the dense variable, the
/// push completing a step; recorded in `touched`.
fn step(s: &mut PsShard, touched: &mut TouchedRows, keys: &[u64]) {
    let (mut req, mut out) = (Vec::new(), Vec::new());
    PullRequestWriter::new(&mut req)
        .rows(1, keys)
        .rows(2, keys)
        .dense(3);
    s.handle_pull(&req, &mut out).expect("seed pull");
    touched.record_pull(s, &req);
    let g4: Vec<f32> = (0..keys.len() * 4).map(|i| i as f32 * 0.01).collect();
    let g2: Vec<f32> = (0..keys.len() * 2).map(|i| 0.3 - i as f32 * 0.02).collect();
    PushRequestWriter::new(&mut req, true)
        .rows(1, 4, keys, &g4)
        .rows(2, 2, keys, &g2)
        .dense(3, &[0.1; 6]);
    s.handle_push(&req, &mut out).expect("seed push");
    touched.record_push(s, &req);
}

/// The shard files and deltas the seeds and the target start from.
#[derive(Debug, Clone)]
pub struct Files {
    /// The base: a shard file of [`new_shard`] after a few steps (rows,
    /// Adam slots, pending filter counters).
    pub base: Vec<u8>,
    /// A delta against `base` (changed rows, rows evicted since, pending
    /// counters).
    pub delta: Vec<u8>,
    /// The shard file at the delta's step.
    pub after: Vec<u8>,
    /// A shard file of a fresh shard (no rows).
    pub fresh: Vec<u8>,
    /// An empty delta against `base` (nothing touched).
    pub empty_delta: Vec<u8>,
    /// JSON files: manifests (current, and one of the first format
    /// without the fields added since) and worker positions.
    pub json: Vec<Vec<u8>>,
}

/// Manifests and worker positions as the PS writes them, and as older
/// versions did (without `shard_steps`, `examples` and `deal_block`).
fn json_seeds() -> Vec<Vec<u8>> {
    let workers = vec![
        WorkerProgress {
            worker: 0,
            epoch: 2,
            offset: 4096,
            steps: 900,
            examples: 123_456,
            deal_block: 4096,
            workers: Some(2),
        },
        WorkerProgress {
            worker: 1,
            epoch: 1,
            offset: 0,
            steps: WorkerProgress::MAX_STEPS,
            examples: WorkerProgress::MAX_EXAMPLES,
            deal_block: 1,
            workers: None,
        },
    ];
    let m = Manifest {
        format_version: FORMAT_VERSION,
        global_step: 1800,
        shard_count: 2,
        seed: 0x5eed,
        model: serde_json::json!({
            "name": "wdl", "embedding_dim": 8, "lr": 0.025, "tables": [1, 2],
            "nested": {"x": null, "y": [true, -1.5e-7]}
        }),
        shard_files: vec!["shard-00000.bin".into(), "shard-00001.bin".into()],
        workers: workers.clone(),
        shard_steps: vec![1800, 1799],
    };
    let mut out = Vec::new();
    if let Ok(j) = m.to_json() {
        out.push(j.into_bytes());
    }
    out.push(
        br#"{"format_version":1,"global_step":7,"shard_count":1,"seed":3,"model":null,
"shard_files":["s0"],"workers":[{"worker":3,"epoch":0,"offset":10,"steps":7}]}"#
            .to_vec(),
    );
    for w in &workers {
        if let Ok(j) = serde_json::to_vec(w) {
            out.push(j);
        }
    }
    out.push(br#"{"worker":4,"epoch":1,"offset":99,"steps":12}"#.to_vec());
    out
}

impl Files {
    /// Build them.
    pub fn new() -> Self {
        let mut s = new_shard();
        let fresh = save(&s);
        let mut touched = TouchedRows::new(LIMITS);
        for i in 0..4u64 {
            // Keys seen twice are admitted; the once-seen stay pending.
            step(&mut s, &mut touched, &[1, 2, 3, 10 + i]);
        }
        let base = save(&s);
        let base_step = s.global_step();
        let mut empty_delta = Vec::new();
        s.save_delta(base_step, &TouchedRows::new(LIMITS), &mut empty_delta)
            .expect("delta to a Vec");
        touched.clear();
        for i in 0..5u64 {
            // Rows 1 and 2 go untouched long enough to be evicted.
            step(&mut s, &mut touched, &[3, 20, 21, 30 + i]);
        }
        let mut delta = Vec::new();
        s.save_delta(base_step, &touched, &mut delta)
            .expect("delta to a Vec");
        Self {
            base,
            delta,
            after: save(&s),
            fresh,
            empty_delta,
            json: json_seeds(),
        }
    }

    /// The seed corpus.
    pub fn corpus(&self) -> Vec<Vec<u8>> {
        let mut v = vec![
            self.base.clone(),
            self.delta.clone(),
            self.after.clone(),
            self.fresh.clone(),
            self.empty_delta.clone(),
        ];
        v.extend(self.json.iter().cloned());
        v
    }
}

impl Default for Files {
    fn default() -> Self {
        Self::new()
    }
}

/// The CRC-32C of a file's bytes before its last four, written into them.
pub fn fix_crc(data: &mut [u8]) {
    if let Some(at) = data.len().checked_sub(4) {
        let crc = crc32c::crc32c(&data[..at]);
        data[at..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// What one input did: the file kind, and each reader's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A shard file: the layout's, the fuzzed shard's and the layout
    /// shard's result ("ok" or an error kind).
    Shard(&'static str, &'static str, &'static str),
    /// A delta file: the header's and the apply's result.
    Delta(&'static str, &'static str),
    /// A JSON file: the manifest reader's and the position reader's
    /// result.
    Json(&'static str, &'static str),
}

/// Whether `input` is a JSON file: its first byte past white space is
/// `{`.
pub fn is_json(input: &[u8]) -> bool {
    input.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

fn kind<T>(r: &Result<T, CheckpointError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(e) => error_kind(e),
    }
}

/// `s` restored from `file`, which must succeed.
fn restored(mut s: PsShard, file: &[u8]) -> Result<PsShard, String> {
    s.restore(&mut &file[..])
        .map_err(|e| format!("a saved shard does not restore: {e}"))?;
    Ok(s)
}

/// Check that `saved`, a restored shard written again, restores into
/// `fresh` and saves to the same bytes.
fn fixpoint(fresh: PsShard, saved: &[u8]) -> Result<(), String> {
    if save(&restored(fresh, saved)?) != saved {
        return Err("a saved shard restores to other bytes".into());
    }
    Ok(())
}

/// The readers on one file, with the oracles of the module docs; `Err`
/// says which failed.
pub fn run(files: &Files, input: &[u8]) -> Result<Outcome, String> {
    peak::reset();
    let o = if input.starts_with(&DELTA_MAGIC) {
        run_delta(files, input)?
    } else if is_json(input) {
        run_json(input)?
    } else {
        run_shard(input)?
    };
    let largest = peak::largest();
    if largest > alloc_bound(input.len()) {
        return Err(format!(
            "an allocation of {largest} bytes for an input of {} bytes",
            input.len()
        ));
    }
    Ok(o)
}

fn run_shard(input: &[u8]) -> Result<Outcome, String> {
    let layout = ShardLayout::parse(input);
    let mut typed = new_shard();
    let before = save(&typed);
    let r = typed.restore(&mut &input[..]);
    match (&r, &layout) {
        (Ok(()), Err(e)) => return Err(format!("restored a file whose layout is refused: {e}")),
        (Ok(()), Ok(l)) => {
            let saved = save(&typed);
            let again = ShardLayout::parse(&saved)
                .map_err(|e| format!("a saved shard's layout is refused: {e}"))?;
            if again != at_current_version(l) {
                return Err(format!("layout {l:?} saved again reads {again:?}"));
            }
            fixpoint(new_shard(), &saved)?;
        }
        (Err(_), _) => {
            if save(&typed) != before {
                return Err(format!("a refused file changed the shard: {r:?}"));
            }
        }
    }
    let by_layout = match &layout {
        Ok(l) => {
            let mut s = l
                .shard()
                .map_err(|e| format!("a parsed layout gives no shard: {e}"))?;
            let r = s.restore(&mut &input[..]);
            if r.is_ok() {
                let saved = save(&s);
                let again = ShardLayout::parse(&saved)
                    .map_err(|e| format!("a saved layout shard's layout is refused: {e}"))?;
                if again != at_current_version(l) {
                    return Err(format!("layout {l:?} saved again reads {again:?}"));
                }
                fixpoint(l.shard().map_err(|e| e.to_string())?, &saved)?;
            }
            kind(&r)
        }
        Err(_) => "-",
    };
    Ok(Outcome::Shard(kind(&layout), kind(&r), by_layout))
}

/// `l` as a shard restored from its file writes it: at the current
/// version (a version 1 file has no workers, and none are written).
fn at_current_version(l: &ShardLayout) -> ShardLayout {
    ShardLayout {
        version: starwire_ps::checkpoint::FORMAT_VERSION,
        ..l.clone()
    }
}

fn run_delta(files: &Files, input: &[u8]) -> Result<Outcome, String> {
    let header = DeltaHeader::parse(input);
    let mut s = restored(new_shard(), &files.base)?;
    let r = s.apply_delta(&mut &input[..]);
    match (&r, &header) {
        (Ok(()), Err(e)) => return Err(format!("applied a delta whose header is refused: {e}")),
        (Ok(()), Ok(h)) => {
            if s.global_step() != h.step {
                return Err(format!(
                    "a delta to step {} left the shard at {}",
                    h.step,
                    s.global_step()
                ));
            }
            let saved = save(&s);
            // The path of `starwire checkpoint`: the base restored into a
            // shard of its own layout, the delta applied onto it.
            let l = ShardLayout::parse(&files.base).map_err(|e| e.to_string())?;
            let mut by_layout = restored(l.shard().map_err(|e| e.to_string())?, &files.base)?;
            by_layout
                .apply_delta(&mut &input[..])
                .map_err(|e| format!("a delta the shard took is refused by its layout: {e}"))?;
            if save(&by_layout) != saved {
                return Err("a delta applied by layout gives other bytes".into());
            }
            fixpoint(new_shard(), &saved)?;
        }
        (Err(_), _) => {
            if save(&s) != files.base {
                return Err(format!("a refused delta changed the shard: {r:?}"));
            }
        }
    }
    Ok(Outcome::Delta(kind(&header), kind(&r)))
}

/// `a` and `b` equal, floats allowed to differ in their last bit
/// (`serde_json` parses floats fast, not always correctly rounded).
fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() && y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap_or(0.0), y.as_f64().unwrap_or(0.0));
            x == y || x.to_bits().abs_diff(y.to_bits()) <= 1
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// `back`, read from what `m` wrote, equals `m` (its free-form model as
/// [`same_json`] says).
fn same_manifest(m: &Manifest, back: &Manifest) -> bool {
    let mut b = back.clone();
    b.model = m.model.clone();
    b == *m && same_json(&m.model, &back.model)
}

/// What [`Manifest::from_json`] promises of a manifest it accepts.
fn check_manifest(m: &Manifest) -> Result<(), String> {
    if m.format_version != FORMAT_VERSION && m.format_version != FORMAT_VERSION_1 {
        return Err(format!("accepted format version {}", m.format_version));
    }
    if m.shard_files.len() != m.shard_count
        || !(m.shard_steps.is_empty() || m.shard_steps.len() == m.shard_count)
    {
        return Err(format!(
            "accepted {} shard files and {} shard steps for {} shards",
            m.shard_files.len(),
            m.shard_steps.len(),
            m.shard_count
        ));
    }
    for w in &m.workers {
        w.check()
            .map_err(|e| format!("accepted a position that fails its check: {e}"))?;
    }
    Ok(())
}

fn run_json(input: &[u8]) -> Result<Outcome, String> {
    let manifest = match std::str::from_utf8(input) {
        Err(_) => "NotUtf8",
        Ok(text) => {
            let r = Manifest::from_json(text);
            let plain = serde_json::from_str::<Manifest>(text);
            match (&r, plain) {
                (Ok(m), _) => {
                    check_manifest(m)?;
                    let j = m
                        .to_json()
                        .map_err(|e| format!("an accepted manifest does not write: {e}"))?;
                    let back = Manifest::from_json(&j)
                        .map_err(|e| format!("a written manifest is refused: {e}\n{j}"))?;
                    if !same_manifest(m, &back) {
                        return Err(format!("manifest {m:?} reads back as {back:?}"));
                    }
                    let v = serde_json::to_value(m)
                        .map_err(|e| format!("an accepted manifest is no JSON value: {e}"))?;
                    let back: Manifest = serde_json::from_value(v)
                        .map_err(|e| format!("a manifest's JSON value is refused: {e}"))?;
                    if !same_manifest(m, &back) {
                        return Err(format!("manifest {m:?} comes back as {back:?}"));
                    }
                }
                (Err(CheckpointError::Manifest(_)), Err(_)) => {}
                (Err(e @ CheckpointError::Manifest(_)), Ok(_)) => {
                    return Err(format!(
                        "refused as no manifest ({e}) what serde_json reads"
                    ));
                }
                (Err(e), Err(p)) => {
                    return Err(format!("refused with {e} what serde_json refuses ({p})"));
                }
                (Err(CheckpointError::BadVersion(v)), Ok(p)) => {
                    if *v != p.format_version || check_manifest(&p).is_ok() {
                        return Err(format!("refused {p:?} as of version {v}"));
                    }
                }
                (Err(e @ CheckpointError::Corrupt(_)), Ok(p)) => {
                    if check_manifest(&p).is_ok() {
                        return Err(format!("refused {p:?} as corrupt: {e}"));
                    }
                }
                (Err(e), Ok(_)) => return Err(format!("a manifest refused with {e}")),
            }
            kind(&r)
        }
    };
    let r = WorkerProgress::from_json(input);
    let plain = serde_json::from_slice::<WorkerProgress>(input);
    match (&r, plain) {
        (Ok(p), _) => {
            p.check()
                .map_err(|e| format!("accepted a position that fails its check: {e}"))?;
            for j in [serde_json::to_vec(p), serde_json::to_vec_pretty(p)] {
                let j = j.map_err(|e| format!("an accepted position does not write: {e}"))?;
                let back = WorkerProgress::from_json(&j)
                    .map_err(|e| format!("a written position is refused: {e}"))?;
                if back != *p {
                    return Err(format!("position {p:?} reads back as {back:?}"));
                }
            }
        }
        (Err(CheckpointError::Manifest(_)), Err(_)) => {}
        (Err(e @ CheckpointError::Corrupt(_)), Ok(p)) if p.check().is_err() => {
            let _ = e;
        }
        (Err(e), p) => return Err(format!("a position refused with {e} (serde_json: {p:?})")),
    }
    Ok(Outcome::Json(manifest, kind(&r)))
}

const INTERESTING: [u64; 14] = [
    0,
    1,
    2,
    3,
    4,
    0x7f,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// Mutations of a checkpoint file: its fields are little-endian `u32`
/// and `u64` at 4-aligned offsets (versions, counts, widths, keys, steps),
/// so most overwrite one of those with a boundary value or nudge it.
#[derive(Debug)]
pub struct CheckpointFiles;

/// Numbers at and past the limits of the JSON readers, and values of
/// other types.
const JSON_VALUES: [&str; 24] = [
    "0",
    "1",
    "2",
    "-1",
    "4294967295",
    "4294967296",
    "1099511627776",
    "1099511627777",
    "72057594037927936",
    "72057594037927937",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "1e400",
    "-0",
    "0.5",
    "1e2",
    "null",
    "true",
    "\"x\"",
    "[]",
    "{}",
    "[\"a\",\"b\"]",
    "[1,2,3]",
];

/// The keys of the two formats.
const JSON_KEYS: [&str; 14] = [
    "format_version",
    "global_step",
    "shard_count",
    "seed",
    "model",
    "shard_files",
    "workers",
    "shard_steps",
    "worker",
    "epoch",
    "offset",
    "steps",
    "examples",
    "deal_block",
];

/// The spans of `data`'s scalar tokens (numbers, `true`, `false`,
/// `null`) when `strings` is false, of its quoted strings (quotes
/// included) when it is true.
fn json_tokens(data: &[u8], strings: bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < data.len() {
        let c = data[i];
        if c == b'"' {
            let start = i;
            i += 1;
            while i < data.len() && data[i] != b'"' {
                i += if data[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(data.len());
            if strings {
                out.push((start, i));
            }
        } else if c == b'-' || c.is_ascii_alphanumeric() {
            let start = i;
            while i < data.len() && (data[i].is_ascii_alphanumeric() || b"+-.".contains(&data[i])) {
                i += 1;
            }
            if !strings {
                out.push((start, i));
            }
        } else {
            i += 1;
        }
    }
    out
}

/// One mutation of a JSON file as text: a value set to one of
/// [`JSON_VALUES`], a key or string renamed to one of [`JSON_KEYS`], an
/// object or array closed early, or a structural byte inserted.
fn mutate_json(r: &mut SmallRng, max_len: usize, data: &mut Vec<u8>) {
    let pick = |r: &mut SmallRng, spans: &[(usize, usize)]| {
        (!spans.is_empty()).then(|| spans[r.gen_range(0..spans.len())])
    };
    let (spans, text) = match r.gen_range(0..5) {
        0 | 1 => (
            json_tokens(data, false),
            JSON_VALUES[r.gen_range(0..JSON_VALUES.len())].to_string(),
        ),
        2 => (
            json_tokens(data, true),
            format!("\"{}\"", JSON_KEYS[r.gen_range(0..JSON_KEYS.len())]),
        ),
        3 => {
            let at = r.gen_range(0..=data.len());
            let b = [b'}', b']', b',', b'{', b'[', b':', b'"'][r.gen_range(0..7)];
            if data.len() < max_len {
                data.insert(at, b);
            }
            return;
        }
        _ => {
            // A value replaced by a whole object or array of the file.
            let starts: Vec<usize> = (0..data.len())
                .filter(|&i| data[i] == b'{' || data[i] == b'[')
                .collect();
            let (Some(&a), Some((s, e))) = (
                starts.get(r.gen_range(0..starts.len().max(1))),
                pick(r, &json_tokens(data, false)),
            ) else {
                return;
            };
            let close = if data[a] == b'{' { b'}' } else { b']' };
            let Some(end) = data[a..].iter().position(|&b| b == close) else {
                return;
            };
            let piece = data[a..=a + end].to_vec();
            (vec![(s, e)], String::from_utf8_lossy(&piece).into_owned())
        }
    };
    if let Some((s, e)) = pick(r, &spans) {
        if data.len() - (e - s) + text.len() <= max_len {
            data.splice(s..e, text.into_bytes());
        }
    }
}

impl Mutation for CheckpointFiles {
    fn apply(r: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        if is_json(data) && r.gen_bool(0.75) {
            return mutate_json(r, max_len, data);
        }
        let len = data.len();
        match r.gen_range(0..12) {
            0 | 1 if len > 0 => flip_bit(r, data),
            // A 4-aligned u32 or u64 field.
            2..=5 if len >= 8 => {
                let width = if r.gen_bool(0.5) { 4 } else { 8 };
                let at = 4 * r.gen_range(0..=(len - width) / 4);
                let mut cur = [0u8; 8];
                cur[..width].copy_from_slice(&data[at..at + width]);
                let v = if r.gen_bool(0.6) {
                    INTERESTING[r.gen_range(0..INTERESTING.len())]
                } else {
                    u64::from_le_bytes(cur).wrapping_add_signed(r.gen_range(-3..=3))
                };
                data[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
            6 if len > 0 => truncate(r, data),
            7 if !corpus.is_empty() => splice(r, data, corpus),
            // Whole records: rows are 24 bytes and a multiple of 4 floats.
            8 if len > 0 => duplicate(r, data, 0, 96, max_len),
            9 if len > 0 => delete(r, data, 0, 96),
            10 => insert_random(r, data, 8),
            // The version: the first or an unknown one.
            _ if len >= 12 => {
                let v: u32 = [1, 2, 3, 0][r.gen_range(0..4)];
                data[8..12].copy_from_slice(&v.to_le_bytes());
            }
            _ => {}
        }
    }
}

/// The checkpoint readers as a driver target (`fuzz-checkpoint`).
#[derive(Debug, Default)]
pub struct Checkpoint {
    files: Files,
    runs: u64,
    accepted: u64,
    outcomes: BTreeMap<String, u64>,
}

impl driver::Target for Checkpoint {
    const SPEC: Spec = Spec {
        name: "fuzz-checkpoint",
        seed: 0x434b,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/checkpoint"),
        max_len: 1 << 15,
        max_len_flag: false,
        corpus_flags: true,
        max_corpus: 2048,
        failure_prefix: "crash",
    };
    type Mutation = CheckpointFiles;
    type Case = ();
    type Key = Outcome;

    fn seeds(&self) -> Vec<Vec<u8>> {
        self.files.corpus()
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<CheckpointFiles>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) {
        m.mutate(input, corpus);
        if !is_json(input) && !m.rng().gen_ratio(1, 8) {
            fix_crc(input);
        }
    }

    fn run(&mut self, _: &(), input: &[u8]) -> Result<Outcome, String> {
        self.runs += 1;
        let o = run(&self.files, input)?;
        if matches!(
            o,
            Outcome::Shard(_, "ok", _)
                | Outcome::Delta(_, "ok")
                | Outcome::Json("ok", _)
                | Outcome::Json(_, "ok")
        ) {
            self.accepted += 1;
        }
        *self.outcomes.entry(format!("{o:?}")).or_default() += 1;
        Ok(o)
    }

    fn progress(&self) -> String {
        format!(
            "accepted {}  outcomes {}",
            self.accepted,
            self.outcomes.len()
        )
    }

    fn summary(&self) -> Vec<String> {
        let mut v: Vec<(&String, &u64)> = self.outcomes.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        let mut lines = vec![format!(
            "runs {} | restored or applied {} | outcomes by count:",
            self.runs, self.accepted
        )];
        lines.extend(v.into_iter().take(16).map(|(k, n)| format!("{n:>9}  {k}")));
        lines
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        run(&self.files, input).map(drop)
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        let r = run(&self.files, input);
        println!("{r:?}");
        r.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use starwire_ps::checkpoint::MAGIC;

    use super::*;

    #[test]
    fn seeds_are_accepted_whole() {
        let f = Files::new();
        assert!(f.delta.starts_with(&DELTA_MAGIC) && f.base.starts_with(&MAGIC));
        let l = ShardLayout::parse(&f.base).unwrap();
        assert!(l.vars.iter().any(|v| v.rows > 0 && v.pending > 0), "{l:?}");
        assert_eq!(
            run(&f, &f.base),
            Ok(Outcome::Shard("ok", "ok", "ok")),
            "base"
        );
        assert_eq!(run(&f, &f.delta), Ok(Outcome::Delta("ok", "ok")));
        assert_eq!(run(&f, &f.empty_delta), Ok(Outcome::Delta("ok", "ok")));
        // Rows evicted untouched since the base are not in a delta (see
        // `starwire_ps::delta`): the step is the file's, the rows need not be.
        let mut s = new_shard();
        s.restore(&mut f.base.as_slice()).unwrap();
        s.apply_delta(&mut f.delta.as_slice()).unwrap();
        let after = ShardLayout::parse(&f.after).unwrap();
        assert_eq!(s.global_step(), after.global_step);
    }

    #[test]
    fn a_broken_crc_is_refused_and_a_fixed_one_is_not() {
        let f = Files::new();
        let mut b = f.base.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        assert_eq!(run(&f, &b), Ok(Outcome::Shard("Checksum", "Checksum", "-")));
        fix_crc(&mut b);
        assert_eq!(run(&f, &b), Ok(Outcome::Shard("ok", "ok", "ok")));
    }

    #[test]
    fn json_seeds_are_accepted_and_broken_ones_refused_by_kind() {
        let f = Files::new();
        let kinds: Vec<Outcome> = f.json.iter().map(|j| run(&f, j).unwrap()).collect();
        assert_eq!(
            kinds,
            [
                Outcome::Json("ok", "Manifest"),
                Outcome::Json("ok", "Manifest"),
                Outcome::Json("Manifest", "ok"),
                Outcome::Json("Manifest", "ok"),
                Outcome::Json("Manifest", "ok"),
            ]
        );
        let too_many = br#"{"worker":4,"epoch":1,"offset":99,"steps":1099511627777}"#;
        assert_eq!(run(&f, too_many), Ok(Outcome::Json("Manifest", "Corrupt")));
        let text = String::from_utf8(f.json[0].clone()).unwrap();
        let v7 = text.replacen("\"format_version\": 2", "\"format_version\": 7", 1);
        assert_eq!(
            run(&f, v7.as_bytes()),
            Ok(Outcome::Json("BadVersion", "Manifest"))
        );
        let files = text.replacen("\"shard_count\": 2", "\"shard_count\": 3", 1);
        assert_eq!(
            run(&f, files.as_bytes()),
            Ok(Outcome::Json("Corrupt", "Manifest"))
        );
    }

    #[test]
    fn json_mutations_hold_the_oracles() {
        let f = Files::new();
        let mut m = Mutator::<CheckpointFiles>::new(9, 1 << 15);
        let mut seen = std::collections::HashSet::new();
        for i in 0..3_000 {
            let mut d = f.json[i % f.json.len()].clone();
            m.mutate(&mut d, &f.json);
            match run(&f, &d) {
                Ok(o) => {
                    seen.insert(o);
                }
                Err(e) => panic!("input {i}: {e}\n{}", String::from_utf8_lossy(&d)),
            }
        }
        for o in [
            Outcome::Json("Corrupt", "Manifest"),
            Outcome::Json("Manifest", "Corrupt"),
            Outcome::Json("ok", "Manifest"),
            Outcome::Json("Manifest", "ok"),
        ] {
            assert!(seen.contains(&o), "{o:?} never reached: {seen:?}");
        }
    }

    #[test]
    fn short_run_holds_the_oracles() {
        let f = Files::new();
        let corpus = f.corpus();
        let mut m = Mutator::<CheckpointFiles>::new(5, 1 << 15);
        let mut ok = 0;
        for i in 0..1_500 {
            let mut d = corpus[i % corpus.len()].clone();
            m.mutate(&mut d, &corpus);
            fix_crc(&mut d);
            match run(&f, &d) {
                Ok(Outcome::Shard(_, "ok", _) | Outcome::Delta(_, "ok")) => ok += 1,
                Ok(_) => {}
                Err(e) => panic!("input {i}: {e}"),
            }
        }
        assert!(ok > 0 && ok < 1_500, "{ok}");
    }
}

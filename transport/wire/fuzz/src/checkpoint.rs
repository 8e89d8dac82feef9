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
//! ```text
//! cargo run --release -p starwire-wire-fuzz --bin fuzz-checkpoint -- --seconds 30 --seed 1
//! ```

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::Rng;
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
    touched.record_pull(s, &req, true);
    let g4: Vec<f32> = (0..keys.len() * 4).map(|i| i as f32 * 0.01).collect();
    let g2: Vec<f32> = (0..keys.len() * 2).map(|i| 0.3 - i as f32 * 0.02).collect();
    PushRequestWriter::new(&mut req, true)
        .rows(1, 4, keys, &g4)
        .rows(2, 2, keys, &g2)
        .dense(3, &[0.1; 6]);
    s.handle_push(&req, &mut out).expect("seed push");
    touched.record_push(s, &req, true);
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
        }
    }

    /// The seed corpus.
    pub fn corpus(&self) -> Vec<Vec<u8>> {
        vec![
            self.base.clone(),
            self.delta.clone(),
            self.after.clone(),
            self.fresh.clone(),
            self.empty_delta.clone(),
        ]
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

impl Mutation for CheckpointFiles {
    fn apply(r: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
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
        if !m.rng().gen_ratio(1, 8) {
            fix_crc(input);
        }
    }

    fn run(&mut self, _: &(), input: &[u8]) -> Result<Outcome, String> {
        self.runs += 1;
        let o = run(&self.files, input)?;
        if matches!(o, Outcome::Shard(_, "ok", _) | Outcome::Delta(_, "ok")) {
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

//! The PS codec ([`starwire_wire::ps`]) fuzzed through the request
//! handlers [`PsShard::handle_pull`] and [`PsShard::handle_push`].
//!
//! An input is one selector byte (bit 0: 0 = pull, 1 = push) followed by a
//! request body. [`Target`] feeds it to a small shard with a frequency
//! filter, TTL eviction and Adam slots, and checks more than "no panic":
//!
//! * an accepted request parses, and its items written again with the
//!   codec's writers give back the same bytes (one encoding per message);
//! * a successful pull's response parses and has one reply per item;
//! * a successful push's response parses and carries the shard's step;
//! * a rejected request leaves the shard state byte-for-byte unchanged
//!   (checked on a sample of errors: it costs a checkpoint per check).
//!
//! [`seeds`] builds valid fused and unfused requests of every item kind;
//! [`Requests`] mutates them with a view of the layout (4-byte aligned count
//! fields, tags, item counts). [`Handlers`] is the target of the driver
//! `fuzz-ps-proto`:
//!
//! ```text
//! cargo run --release -p starwire-wire-fuzz --bin fuzz-ps-proto -- --seconds 30 --seed 1
//! ```

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::Rng;
use starwire_ps::{Init, OptimizerConfig, PsError, PsShard, ShardConfig, VarDef, VarKind};
use starwire_wire::ps::{
    parse_push_response, DecodeError, Limits, PullItem, PullRequest, PullRequestWriter,
    PullResponse, PushItem, PushRequest, PushRequestWriter,
};

use crate::driver::{self, Spec};
use crate::mutate::{delete, duplicate, flip_bit, insert_random, splice, truncate};
use crate::{Mutation, Mutator};

/// Selector byte of a pull input.
pub const PULL: u8 = 0;
/// Selector byte of a push input.
pub const PUSH: u8 = 1;

/// Variables of the fuzzed shard: two tables and a dense variable.
pub fn vars() -> Vec<VarDef> {
    vec![
        VarDef {
            id: 1,
            name: "emb4".into(),
            kind: VarKind::Embedding { dim: 4 },
            init: Init::Uniform { scale: 0.1 },
        },
        VarDef {
            id: 2,
            name: "emb2".into(),
            kind: VarKind::Embedding { dim: 2 },
            init: Init::Normal { std: 0.1 },
        },
        VarDef {
            id: 3,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![2, 3] },
            init: Init::GlorotUniform,
        },
    ]
}

/// Limits of the fuzzed shard: small, so `Oversized` is reachable.
pub const LIMITS: Limits = Limits {
    max_items: 64,
    max_keys: 4096,
    max_elems: 1 << 16,
};

/// A fresh small shard.
pub fn new_shard() -> PsShard {
    PsShard::new(
        0,
        &vars(),
        ShardConfig {
            seed: 1,
            optimizer: OptimizerConfig::adam(0.01),
            filter_freq: 2,
            steps_to_live: 5,
            evict_interval: 3,
            filter_capacity: 1024,
            // Small, so fuzzed keys share default rows.
            default_value_dim: 16,
            limits: LIMITS,
            // Small, so fuzzed pulls reach both bounds.
            max_reply_bytes: 1 << 16,
            max_rows: 64,
        },
    )
}

/// What one input did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The request was handled.
    Ok {
        /// Push (true) or pull.
        push: bool,
        /// Items in the request (capped at 4 for signatures).
        items: usize,
    },
    /// The request was rejected; the discriminant of the error.
    Err(&'static str),
}

/// A short name of an error's kind.
pub fn error_kind(e: &PsError) -> &'static str {
    use DecodeError as D;
    match e {
        PsError::Decode(d) => match d {
            D::Truncated { .. } => "Truncated",
            D::BadVersion(_) => "BadVersion",
            D::BadKind { .. } => "BadKind",
            D::BadTag(_) => "BadTag",
            D::Reserved(_) => "Reserved",
            D::LengthOverflow(_) => "LengthOverflow",
            D::Oversized { .. } => "Oversized",
            D::BadOffsets(_) => "BadOffsets",
            D::Trailing(_) => "Trailing",
            _ => "Decode(other)",
        },
        PsError::UnknownVariable(_) => "UnknownVariable",
        PsError::ShapeMismatch { .. } => "ShapeMismatch",
        PsError::KindMismatch { .. } => "KindMismatch",
        _ => "other",
    }
}

/// The fuzzed shard and reused buffers.
#[derive(Debug)]
pub struct Target {
    /// The shard.
    pub shard: PsShard,
    out: Vec<u8>,
    before: Vec<u8>,
    after: Vec<u8>,
}

impl Default for Target {
    fn default() -> Self {
        Self::new()
    }
}

impl Target {
    /// A target with a fresh shard.
    pub fn new() -> Self {
        Self {
            shard: new_shard(),
            out: Vec::new(),
            before: Vec::new(),
            after: Vec::new(),
        }
    }

    /// Run one input. With `check_unchanged`, a rejected request is checked
    /// to leave the state unchanged. Panics (which the driver catches) when
    /// an oracle fails.
    pub fn run(&mut self, input: &[u8], check_unchanged: bool) -> Outcome {
        let Some((&sel, body)) = input.split_first() else {
            return Outcome::Err("empty");
        };
        let push = sel & 1 == PUSH;
        if check_unchanged {
            self.before.clear();
            self.shard
                .save(&mut self.before)
                .expect("save to a Vec cannot fail");
        }
        let step = self.shard.global_step();
        let r = if push {
            self.shard.handle_push(body, &mut self.out)
        } else {
            self.shard.handle_pull(body, &mut self.out)
        };
        match r {
            Ok(()) => {
                if push {
                    let s = parse_push_response(&self.out).expect("push response must parse");
                    assert_eq!(s, self.shard.global_step());
                    let req = PushRequest::parse(body, &LIMITS).expect("accepted push parses");
                    assert_eq!(s, step + u64::from(req.completes_step));
                    assert_eq!(rewrite_push(&req), body, "push encodes one way");
                    Outcome::Ok {
                        push,
                        items: req.len().min(4),
                    }
                } else {
                    let big = Limits {
                        max_items: u32::MAX,
                        max_keys: u32::MAX,
                        max_elems: u64::MAX,
                    };
                    let resp =
                        PullResponse::parse(&self.out, &big).expect("pull response must parse");
                    let req = PullRequest::parse(body, &LIMITS).expect("accepted pull parses");
                    assert_eq!(resp.len(), req.len());
                    assert_eq!(rewrite_pull(&req), body, "pull encodes one way");
                    assert_eq!(resp.global_step, step);
                    Outcome::Ok {
                        push,
                        items: req.len().min(4),
                    }
                }
            }
            Err(e) => {
                assert!(self.out.is_empty(), "output left after an error");
                assert_eq!(self.shard.global_step(), step);
                if check_unchanged {
                    self.after.clear();
                    self.shard
                        .save(&mut self.after)
                        .expect("save to a Vec cannot fail");
                    assert!(
                        self.before == self.after,
                        "rejected request changed the state: {e}"
                    );
                }
                Outcome::Err(error_kind(&e))
            }
        }
    }
}

/// `req` written again, item by item, with the codec's writer.
fn rewrite_pull(req: &PullRequest<'_>) -> Vec<u8> {
    let mut b = Vec::new();
    let mut w = PullRequestWriter::new(&mut b);
    for item in req.items() {
        match item {
            PullItem::Dense { var } => w.dense(var),
            PullItem::Rows { var, keys } => w.rows(var, &keys.to_vec()),
            PullItem::Pooled { var, offsets, keys } => {
                w.pooled(var, &offsets.to_vec(), &keys.to_vec())
            }
        };
    }
    b
}

/// `req` written again, item by item, with the codec's writer.
fn rewrite_push(req: &PushRequest<'_>) -> Vec<u8> {
    let mut b = Vec::new();
    let mut w = PushRequestWriter::new(&mut b, req.completes_step);
    for item in req.items() {
        match item {
            PushItem::Dense { var, grad } => w.dense(var, &grad.to_vec()),
            PushItem::Rows {
                var,
                dim,
                keys,
                grads,
            } => w.rows(var, dim, &keys.to_vec(), &grads.to_vec()),
            PushItem::Pooled {
                var,
                dim,
                offsets,
                keys,
                grads,
            } => w.pooled(var, dim, &offsets.to_vec(), &keys.to_vec(), &grads.to_vec()),
        };
    }
    b
}

/// Run one input on a fresh shard (the libFuzzer-style entry point).
pub fn fuzz_one(data: &[u8]) {
    let _ = Target::new().run(data, true);
}

pub mod seeds {
    //! Valid requests of every item kind, fused and unfused.

    use starwire_wire::ps::{PullRequestWriter, PushRequestWriter};

    use super::{PULL, PUSH};

    fn with(sel: u8, body: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(body.len() + 1);
        v.push(sel);
        v.extend_from_slice(body);
        v
    }

    /// The seed corpus.
    pub fn corpus() -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut b = Vec::new();
        let keys: Vec<u64> = (1..=12).map(|k| k * 0x9E37_79B9).collect();
        let offs = [0u32, 3, 3, 7, 12];
        // Unfused pulls.
        PullRequestWriter::new(&mut b).dense(3);
        out.push(with(PULL, &b));
        PullRequestWriter::new(&mut b).rows(1, &keys);
        out.push(with(PULL, &b));
        PullRequestWriter::new(&mut b).pooled(2, &offs, &keys);
        out.push(with(PULL, &b));
        PullRequestWriter::new(&mut b);
        out.push(with(PULL, &b));
        // Fused pull.
        PullRequestWriter::new(&mut b)
            .dense(3)
            .rows(1, &keys[..5])
            .pooled(2, &offs, &keys)
            .rows(2, &keys[4..]);
        out.push(with(PULL, &b));
        // Unfused pushes.
        let g4: Vec<f32> = (0..keys.len() * 4).map(|i| i as f32 * 0.01).collect();
        let g2: Vec<f32> = (0..4 * 2).map(|i| 0.5 - i as f32 * 0.1).collect();
        PushRequestWriter::new(&mut b, true).dense(3, &[0.1; 6]);
        out.push(with(PUSH, &b));
        PushRequestWriter::new(&mut b, false).rows(1, 4, &keys, &g4);
        out.push(with(PUSH, &b));
        PushRequestWriter::new(&mut b, true).pooled(2, 2, &offs, &keys, &g2);
        out.push(with(PUSH, &b));
        PushRequestWriter::new(&mut b, true);
        out.push(with(PUSH, &b));
        // Fused push.
        PushRequestWriter::new(&mut b, true)
            .dense(3, &[0.1; 6])
            .rows(1, 4, &keys[..3], &g4[..12])
            .pooled(2, 2, &offs, &keys, &g2)
            .rows(1, 4, &keys[..3], &g4[..12]);
        out.push(with(PUSH, &b));
        out
    }
}

const INTERESTING_U32: [u32; 12] = [
    0,
    1,
    2,
    3,
    4,
    5,
    0x7f,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    0xffff_ffff,
];

/// Mutations aware of the request layout: the pull/push selector,
/// 4-byte aligned count fields, item tags and the item count.
#[derive(Debug)]
pub struct Requests;

impl Mutation for Requests {
    fn apply(r: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        let len = data.len();
        match r.gen_range(0..12) {
            // Flip the pull/push selector.
            0 if len > 0 => data[0] ^= 1,
            1 if len > 0 => flip_bit(r, data),
            // A 4-aligned u32 of the body (counts, dims, var ids, offsets).
            2..=4 if len >= 5 => {
                let slots = (len - 1) / 4;
                let at = 1 + 4 * r.gen_range(0..slots);
                let v = if r.gen_bool(0.7) {
                    INTERESTING_U32[r.gen_range(0..INTERESTING_U32.len())]
                } else {
                    let cur =
                        u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
                    cur.wrapping_add_signed(r.gen_range(-3..=3))
                };
                data[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
            // An item tag (first byte of a 4-aligned word).
            5 if len >= 5 => {
                let at = 1 + 4 * r.gen_range(0..(len - 1) / 4);
                data[at] = r.gen_range(0..5);
            }
            6 if len > 0 => truncate(r, data),
            7 if !corpus.is_empty() => splice(r, data, corpus),
            // Past the selector byte.
            8 if len > 1 => duplicate(r, data, 1, 64, max_len),
            9 if len > 1 => delete(r, data, 1, 32),
            10 => insert_random(r, data, 12),
            // Re-count the items so a mutated item list still parses that far.
            _ if len >= 9 => {
                let n = r.gen_range(0..6u32);
                data[5..9].copy_from_slice(&n.to_le_bytes());
            }
            _ => {}
        }
    }
}

/// Inputs a shard serves before the driver starts a fresh one: long
/// enough for state (filter counts, eviction, optimizer slots) to build
/// up, short enough that it stays small.
const SHARD_LIFE: u64 = 50_000;

/// The request handlers of a long-lived [`Target`] as a driver target
/// (`fuzz-ps-proto`). One run in 16 also checks that a rejected request
/// leaves the shard unchanged. A failed oracle panics.
#[derive(Debug, Default)]
pub struct Handlers {
    target: Target,
    runs: u64,
    accepted: u64,
    kinds: BTreeMap<&'static str, u64>,
}

impl driver::Target for Handlers {
    const SPEC: Spec = Spec {
        name: "fuzz-ps-proto",
        seed: 0x5053,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/ps"),
        max_len: 1 << 14,
        max_len_flag: false,
        corpus_flags: false,
        max_corpus: 4096,
        failure_prefix: "crash",
    };
    type Mutation = Requests;
    /// Check that a rejected request leaves the state unchanged.
    type Case = bool;
    type Key = Outcome;

    fn seeds(&self) -> Vec<Vec<u8>> {
        seeds::corpus()
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<Requests>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> bool {
        m.mutate(input, corpus);
        m.rng().gen_ratio(1, 16)
    }

    fn run(&mut self, &check: &bool, input: &[u8]) -> Result<Outcome, String> {
        if self.runs > 0 && self.runs % SHARD_LIFE == 0 {
            self.target = Target::new();
        }
        self.runs += 1;
        let o = self.target.run(input, check);
        match o {
            Outcome::Ok { .. } => self.accepted += 1,
            Outcome::Err(k) => *self.kinds.entry(k).or_default() += 1,
        }
        Ok(o)
    }

    fn progress(&self) -> String {
        format!(
            "accepted {}  rejected {}",
            self.accepted,
            self.kinds.values().sum::<u64>()
        )
    }

    fn summary(&self) -> Vec<String> {
        let t = &self.target.shard;
        vec![
            format!(
                "accepted {} | errors by kind: {:?}",
                self.accepted, self.kinds
            ),
            format!("shard: global step {} | {:?}", t.global_step(), t.stats()),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        // With the check that a refused request changed nothing.
        self.run(&true, input).map(drop)
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        println!("{:?}", Target::new().run(input, true));
        true
    }
}

/// Feed `iters` mutated inputs, starting from the seeds; used by the test and
/// as a smoke run. Returns how many were accepted.
pub fn smoke(seed: u64, iters: usize) -> usize {
    let corpus = seeds::corpus();
    let mut m = Mutator::<Requests>::new(seed, 1 << 14);
    let mut t = Target::new();
    let mut ok = 0;
    let mut input = Vec::new();
    for i in 0..iters {
        input.clear();
        input.extend_from_slice(&corpus[i % corpus.len()]);
        if i % 8 != 0 {
            m.mutate(&mut input, &corpus);
        }
        if matches!(t.run(&input, i % 4 == 0), Outcome::Ok { .. }) {
            ok += 1;
        }
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_accepted() {
        let mut t = Target::new();
        for (i, s) in seeds::corpus().iter().enumerate() {
            assert!(matches!(t.run(s, true), Outcome::Ok { .. }), "seed {i}");
        }
    }

    #[test]
    fn short_run_holds_the_oracles() {
        let ok = smoke(3, 5_000);
        assert!(ok > 625, "{ok}");
        assert!(ok < 5_000);
    }
}

//! Synthetic Criteo-like click data drawn from a logistic model with known
//! true weights.
//!
//! # The features
//! * 13 numeric fields. Field `j` is missing with probability
//!   `NUMERIC_MISSING[j]`; otherwise it is the count
//!   `max(0, floor(exp(mu_j + sigma_j z)) - 1)` with `z ~ N(0, 1)` (a
//!   discretised log-normal, heavy-tailed like Criteo's counts). Field 1
//!   (`I2`) is `-1` with probability 5%, as negative values occur there in
//!   the real data.
//! * 26 categorical fields. Field `f` is missing with probability
//!   `CATEGORICAL_MISSING[f]`; otherwise its id is drawn from a Zipf law over
//!   `vocab` ids (default 10^5, rank `k` (0-based) has probability
//!   proportional to `(k + 1)^-s`, default `s = 1.1`), sampled by inverse CDF
//!   (exact for the 1024 most frequent ids, from the integral of the power
//!   law for the tail; see `ZipfTable`). The value string is 8 lowercase hex
//!   characters of `fmix32(id ^ salt(f))`, a bijection of the id within the
//!   field, so distinct ids never share a string; the key is
//!   [`feature_hash`]`(f, string)`.
//!
//! # The true model
//! `P(click) = sigmoid(b + sum_j u_j t_j + sum_f w_{f, id_f})` where `t_j` is
//! the transformed numeric value ([`transform_count`], 0 if missing), `u_j ~
//! N(0, numeric_weight_std^2)`, and `w_{f,k} = c_f * id_weight_std * N(0, 1)`
//! for ids of rank `k < weighted_ids` (the frequent ones, seen often enough
//! to be learnable) and 0 for the long tail, which is pure noise that a
//! learner must learn to ignore. `c_f ~ U(0.25, 1.75)` gives the fields
//! different importance. All weights come from `seed`. The bias `b` is found
//! at construction by bisection so that the mean click probability over
//! 20 000 calibration examples is `target_ctr` (default 0.25).
//!
//! # Tuning of the defaults
//! `weighted_ids = 50`, `id_weight_std = 0.28`, `numeric_weight_std = 0.25`:
//! the 50 weighted ids of a field carry about half of its draws, so each is
//! seen thousands of times per epoch and the signal is learnable, while the
//! ~650 000 distinct keys of an epoch are mostly noise. With the default seed,
//! on 100 000 eval examples, the true model's AUC is 0.839; the reference
//! logistic regression ([`crate::reference`], Adagrad lr 0.5, initial
//! accumulator 0.1, batches of 256) reaches 0.831 after 2 epochs of 200 000
//! (gap 0.008; 0.006 to 0.009 over seeds 1 to 5, whose oracle AUCs range
//! 0.79 to 0.83). Reproduce with
//! `cargo run -p starwire-data --release --example reference`.
//!
//! # Streams and splitting
//! Example `i` of a stream (train, eval) is drawn from its own generator
//! seeded with `xxh3(stream, i; seed)`, so it is the same whoever draws it:
//! worker `w` of `W` takes its [`Deal`] of each epoch's indices (blocks of
//! consecutive indices, block `j` to worker `j % W`), and every epoch
//! repeats the same examples (like re-reading a file). Train and eval
//! share the true weights but use different streams.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use rand::{Rng, RngCore, SeedableRng};
use rand_distr::StandardNormal;
use rand_xoshiro::Xoshiro256PlusPlus;
use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::batch::{transform_count, Batch, NUM_CATEGORICAL, NUM_NUMERIC};
use crate::criteo::DataError;
use crate::deal::Deal;
use crate::hash::{feature_hash, MISSING_KEY};
use crate::metrics::auc;

/// Probability that numeric field `j` is missing.
pub const NUMERIC_MISSING: [f32; NUM_NUMERIC] = [
    0.45, 0.0, 0.2, 0.2, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.75, 0.2,
];
const NUMERIC_MU: [f64; NUM_NUMERIC] = [
    0.5, 1.5, 2.0, 1.5, 7.0, 3.5, 1.5, 2.5, 4.0, 0.3, 1.0, 0.3, 2.0,
];
const NUMERIC_SIGMA: [f64; NUM_NUMERIC] = [
    1.0, 1.2, 1.0, 0.8, 1.5, 1.3, 1.0, 0.9, 1.2, 0.7, 1.0, 0.8, 1.1,
];
/// Probability that categorical field `f` is missing.
pub const CATEGORICAL_MISSING: [f32; NUM_CATEGORICAL] = [
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0,
    0.44, 0.44, 0.0, 0.76, 0.0, 0.03, 0.44, 0.44,
];

/// Largest accepted vocabulary per field.
pub const MAX_VOCAB: u32 = 1 << 24;
/// Largest accepted `weighted_ids` (the true weights are kept in memory).
pub const MAX_WEIGHTED_IDS: u32 = 1 << 20;
/// Examples drawn at construction to calibrate the bias.
pub const CALIBRATION_EXAMPLES: u64 = 20_000;

/// Which stream of examples a [`Synthetic`] draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Training examples.
    Train,
    /// Evaluation examples (disjoint draws from the same model).
    Eval,
    /// The examples the bias was calibrated on.
    Calibration,
}

impl Stream {
    fn id(self) -> u64 {
        match self {
            Stream::Train => 0,
            Stream::Eval => 1,
            Stream::Calibration => 2,
        }
    }
}

/// Parameters of the synthetic data set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticSpec {
    /// Seed of the true weights and of every example.
    pub seed: u64,
    /// Training examples per epoch (all workers together).
    pub examples_per_epoch: u64,
    /// Ids per categorical field.
    pub vocab: u32,
    /// Zipf exponent of the id distribution.
    pub zipf_exponent: f64,
    /// Ids (the most frequent ones) that have a non-zero true weight.
    pub weighted_ids: u32,
    /// Standard deviation of a weighted id's true weight (before `c_f`).
    pub id_weight_std: f32,
    /// Standard deviation of a numeric field's true weight.
    pub numeric_weight_std: f32,
    /// Mean click probability the bias is calibrated to.
    pub target_ctr: f64,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        Self {
            seed: 0x5747_4952_4531,
            examples_per_epoch: 200_000,
            vocab: 100_000,
            zipf_exponent: 1.1,
            weighted_ids: 50,
            id_weight_std: 0.28,
            numeric_weight_std: 0.25,
            target_ctr: 0.25,
        }
    }
}

/// Inverse-CDF sampler of a Zipf law over `0..n` (id `k` has weight
/// `(k + 1)^-s`).
///
/// The `ZIPF_HEAD` most frequent ids are drawn exactly: a guide table
/// narrows the uniform draw to a few ids and a binary search over their
/// cumulative weights (a few KiB, always in cache) picks one. The long tail
/// is drawn from the midpoint-rule integral of the same power law, inverted
/// in closed form (`x^-s` integrated from `head + 1/2`), and rounded to the
/// nearest rank: per-id probabilities there are within a fraction of a
/// percent of the exact law, and a draw costs one `powf` instead of cache
/// misses in a 400 KiB table. Hand-written: `rand_distr::Zipf` samples by
/// rejection with several `powf` per draw and its output is not pinned.
#[derive(Debug)]
struct ZipfTable {
    n: u32,
    /// `cdf[k]` = P(id <= k) * 2^32 for the head ids, rounded.
    cdf: Vec<u32>,
    /// `guide[b]` = the first head id k with `cdf[k] > b << GUIDE_SHIFT`
    /// (capped at the last head id); one more entry than buckets.
    guide: Vec<u32>,
    /// Draws `u >= tail_start` go to the tail (2^32 when there is none).
    tail_start: u64,
    /// Tail inversion: `rank = (a + b * (u - tail_start))^c`, or for
    /// `s == 1`, `rank = a * exp(b * (u - tail_start))`.
    a: f64,
    b: f64,
    c: f64,
    log_tail: bool,
}

/// Ids drawn exactly from the cumulative table.
const ZIPF_HEAD: u32 = 1024;
const GUIDE_BITS: u32 = 12;
const GUIDE_SHIFT: u32 = 32 - GUIDE_BITS;

impl ZipfTable {
    fn new(n: u32, s: f64) -> Self {
        let head = n.min(ZIPF_HEAD);
        let weights: Vec<f64> = (1..=head).map(|k| f64::from(k).powf(-s)).collect();
        let head_mass: f64 = weights.iter().sum();
        // Mass of ranks head+1..=n as the integral of x^-s over
        // [head + 1/2, n + 1/2].
        let (lo, hi) = (f64::from(head) + 0.5, f64::from(n) + 0.5);
        let log_tail = (s - 1.0).abs() < 1e-9;
        let tail_mass = if head == n {
            0.0
        } else if log_tail {
            (hi / lo).ln()
        } else {
            (hi.powf(1.0 - s) - lo.powf(1.0 - s)) / (1.0 - s)
        };
        let total = head_mass + tail_mass;
        let scale = (1u64 << 32) as f64;
        let mut acc = 0.0;
        let cdf: Vec<u32> = weights
            .iter()
            .map(|w| {
                acc += w;
                ((acc / total) * scale).round().min(f64::from(u32::MAX)) as u32
            })
            .collect();
        let last = head as usize - 1;
        let tail_start = if head == n {
            1u64 << 32
        } else {
            u64::from(cdf[last])
        };
        let mut guide = Vec::with_capacity((1 << GUIDE_BITS) + 1);
        let mut k = 0usize;
        for b in 0..(1u32 << GUIDE_BITS) {
            let start = b << GUIDE_SHIFT;
            while k < last && cdf[k] <= start {
                k += 1;
            }
            guide.push(k as u32);
        }
        guide.push(last as u32);
        // Tail mass per unit of u.
        let per_u = total / scale;
        let (a, b, c) = if log_tail {
            (lo, per_u, 0.0)
        } else {
            (lo.powf(1.0 - s), (1.0 - s) * per_u, 1.0 / (1.0 - s))
        };
        Self {
            n,
            cdf,
            guide,
            tail_start,
            a,
            b,
            c,
            log_tail,
        }
    }

    /// The id of the uniform draw `u`.
    #[inline]
    fn sample(&self, u: u32) -> u32 {
        if u64::from(u) >= self.tail_start {
            let v = (u64::from(u) - self.tail_start) as f64;
            let x = if self.log_tail {
                self.a * (self.b * v).exp()
            } else {
                (self.a + self.b * v).powf(self.c)
            };
            // Rank x rounds to the nearest integer rank; ids are rank - 1.
            let head = self.cdf.len() as f64;
            return (x.round() - 1.0).clamp(head, f64::from(self.n - 1)) as u32;
        }
        let b = (u >> GUIDE_SHIFT) as usize;
        let (lo, hi) = (self.guide[b] as usize, self.guide[b + 1] as usize);
        // The answer, the first k with cdf[k] > u, lies in lo..=hi.
        (lo + self.cdf[lo..hi].partition_point(|&c| c <= u)) as u32
    }
}

/// A bijective 32-bit mixer (the MurmurHash3 finaliser).
#[inline]
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The 8-hex-character value string of id `id` in categorical field `field`.
#[inline]
pub fn category_string(field: u32, id: u32) -> [u8; 8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let salt = fmix32(field.wrapping_mul(0x9E37_79B9).wrapping_add(0x7F4A_7C15));
    let v = fmix32(id ^ salt);
    let mut out = [0u8; 8];
    for (i, c) in out.iter_mut().enumerate() {
        *c = HEX[((v >> (28 - 4 * i)) & 0xf) as usize];
    }
    out
}

/// The key of id `id` in categorical field `field`.
#[inline]
pub fn category_key(field: u32, id: u32) -> u64 {
    feature_hash(field, &category_string(field, id))
}

/// One example before transformation: raw counts and ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawExample {
    /// Clicked.
    pub label: bool,
    /// `I1..I13`, `None` when missing.
    pub counts: [Option<i64>; NUM_NUMERIC],
    /// Ids of `C1..C26` (rank in the Zipf law), `None` when missing.
    pub ids: [Option<u32>; NUM_CATEGORICAL],
}

/// The true model and the feature distributions of a [`SyntheticSpec`].
#[derive(Debug)]
pub struct TrueModel {
    spec: SyntheticSpec,
    bias: f32,
    numeric_weights: [f32; NUM_NUMERIC],
    /// `weighted_ids` weights per field, field-major.
    id_weights: Vec<f32>,
    /// Key -> weight for the weighted ids, for [`TrueModel::oracle_prob`].
    key_weights: FxHashMap<u64, f32>,
    /// Keys of the `head_ids` most frequent ids per field, field-major.
    head_keys: Vec<u64>,
    head_ids: u32,
    zipf: ZipfTable,
}

/// Keys of this many of the most frequent ids per field are precomputed.
const HEAD_KEYS: u32 = 1024;

impl TrueModel {
    /// Draw the true weights of `spec` and calibrate the bias.
    pub fn new(spec: SyntheticSpec) -> Result<Self, DataError> {
        if spec.vocab == 0 || spec.vocab > MAX_VOCAB {
            return Err(DataError::Spec("vocab must be in 1..=2^24"));
        }
        if spec.weighted_ids > spec.vocab || spec.weighted_ids > MAX_WEIGHTED_IDS {
            return Err(DataError::Spec(
                "weighted_ids must not exceed vocab nor 2^20",
            ));
        }
        if !(spec.zipf_exponent.is_finite() && spec.zipf_exponent > 0.0) {
            return Err(DataError::Spec("zipf_exponent must be positive"));
        }
        if !(spec.target_ctr > 0.0 && spec.target_ctr < 1.0) {
            return Err(DataError::Spec("target_ctr must be in (0, 1)"));
        }
        if !(spec.id_weight_std.is_finite() && spec.numeric_weight_std.is_finite()) {
            return Err(DataError::Spec("weight scales must be finite"));
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(spec.seed);
        let mut numeric_weights = [0f32; NUM_NUMERIC];
        for w in &mut numeric_weights {
            *w = spec.numeric_weight_std * rng.sample::<f32, _>(StandardNormal);
        }
        let per_field = spec.weighted_ids as usize;
        let mut id_weights = Vec::with_capacity(per_field * NUM_CATEGORICAL);
        let mut key_weights = FxHashMap::default();
        key_weights.reserve(per_field * NUM_CATEGORICAL);
        for f in 0..NUM_CATEGORICAL as u32 {
            let importance: f32 = rng.gen_range(0.25..1.75);
            for id in 0..spec.weighted_ids {
                let w = importance * spec.id_weight_std * rng.sample::<f32, _>(StandardNormal);
                id_weights.push(w);
                key_weights.insert(category_key(f, id), w);
            }
        }
        let head_ids = spec.vocab.min(HEAD_KEYS);
        let head_keys = (0..NUM_CATEGORICAL as u32)
            .flat_map(|f| (0..head_ids).map(move |id| category_key(f, id)))
            .collect();
        let mut model = Self {
            spec,
            bias: 0.0,
            numeric_weights,
            id_weights,
            key_weights,
            head_keys,
            head_ids,
            zipf: ZipfTable::new(spec.vocab, spec.zipf_exponent),
        };
        model.bias = model.calibrate_bias();
        Ok(model)
    }

    fn calibrate_bias(&self) -> f32 {
        let mut raw = RawExample::default();
        let logits: Vec<f64> = (0..CALIBRATION_EXAMPLES)
            .map(|i| {
                let mut rng = self.example_rng(Stream::Calibration, i);
                f64::from(self.draw_features(&mut rng, &mut raw, &mut [0.0; NUM_NUMERIC]))
            })
            .collect();
        let mean_ctr =
            |b: f64| logits.iter().map(|&z| sigmoid64(z + b)).sum::<f64>() / logits.len() as f64;
        let (mut lo, mut hi) = (-30.0f64, 30.0f64);
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if mean_ctr(mid) < self.spec.target_ctr {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (0.5 * (lo + hi)) as f32
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &SyntheticSpec {
        &self.spec
    }

    /// The calibrated bias.
    pub fn bias(&self) -> f32 {
        self.bias
    }

    /// The true weights of the 13 transformed numeric features.
    pub fn numeric_weights(&self) -> &[f32; NUM_NUMERIC] {
        &self.numeric_weights
    }

    /// The true weight of id `id` in categorical field `field` (0 for an id
    /// of the unweighted tail or out of range).
    pub fn id_weight(&self, field: usize, id: u32) -> f32 {
        if field >= NUM_CATEGORICAL || id >= self.spec.weighted_ids {
            return 0.0;
        }
        self.id_weights[field * self.spec.weighted_ids as usize + id as usize]
    }

    /// The true weight of a key (0 for a key of no weighted id).
    pub fn key_weight(&self, key: u64) -> f32 {
        self.key_weights.get(&key).copied().unwrap_or(0.0)
    }

    fn example_rng(&self, stream: Stream, index: u64) -> Xoshiro256PlusPlus {
        let mut input = [0u8; 16];
        input[..8].copy_from_slice(&stream.id().to_le_bytes());
        input[8..].copy_from_slice(&index.to_le_bytes());
        Xoshiro256PlusPlus::seed_from_u64(xxh3_64_with_seed(&input, self.spec.seed))
    }

    /// Draw the features of one example into `raw` (label untouched) and
    /// their transformed numeric values into `numeric`; return the logit
    /// without the bias.
    #[inline]
    fn draw_features(
        &self,
        rng: &mut Xoshiro256PlusPlus,
        raw: &mut RawExample,
        numeric: &mut [f32; NUM_NUMERIC],
    ) -> f32 {
        let mut logit = 0f32;
        for j in 0..NUM_NUMERIC {
            raw.counts[j] = if rng.gen::<f32>() < NUMERIC_MISSING[j] {
                None
            } else if j == 1 && rng.gen::<f32>() < 0.05 {
                Some(-1)
            } else {
                let z: f64 = rng.sample(StandardNormal);
                // Clamp the exponent: counts stay well inside i64.
                let c = (NUMERIC_MU[j] + NUMERIC_SIGMA[j] * z)
                    .min(40.0)
                    .exp()
                    .floor() as i64
                    - 1;
                Some(c.max(0))
            };
            numeric[j] = raw.counts[j].map_or(0.0, transform_count);
            logit += self.numeric_weights[j] * numeric[j];
        }
        let per_field = self.spec.weighted_ids as usize;
        for (f, (slot, &missing)) in raw.ids.iter_mut().zip(&CATEGORICAL_MISSING).enumerate() {
            *slot = if rng.gen::<f32>() < missing {
                None
            } else {
                let id = self.zipf.sample(rng.next_u32());
                if (id as usize) < per_field {
                    logit += self.id_weights[f * per_field + id as usize];
                }
                Some(id)
            };
        }
        logit
    }

    /// Draw example `index` of `stream` into `raw`.
    pub fn draw(&self, stream: Stream, index: u64, raw: &mut RawExample) {
        self.draw_transformed(stream, index, raw, &mut [0.0; NUM_NUMERIC]);
    }

    #[inline]
    fn draw_transformed(
        &self,
        stream: Stream,
        index: u64,
        raw: &mut RawExample,
        numeric: &mut [f32; NUM_NUMERIC],
    ) {
        let mut rng = self.example_rng(stream, index);
        let logit = self.bias + self.draw_features(&mut rng, raw, numeric);
        raw.label = rng.gen::<f64>() < sigmoid64(f64::from(logit));
    }

    /// The key of id `id` of categorical field `field` (from the table for
    /// frequent ids).
    #[inline]
    fn key(&self, field: usize, id: u32) -> u64 {
        if id < self.head_ids {
            self.head_keys[field * self.head_ids as usize + id as usize]
        } else {
            category_key(field as u32, id)
        }
    }

    /// Append `raw`, transformed and hashed, to `batch`.
    pub fn push(&self, raw: &RawExample, batch: &mut Batch) {
        let mut numeric = [0f32; NUM_NUMERIC];
        for (t, c) in numeric.iter_mut().zip(&raw.counts) {
            *t = c.map_or(0.0, transform_count);
        }
        self.push_transformed(raw, &numeric, batch);
    }

    #[inline]
    fn push_transformed(&self, raw: &RawExample, numeric: &[f32; NUM_NUMERIC], batch: &mut Batch) {
        batch.labels.push(if raw.label { 1.0 } else { 0.0 });
        batch.numeric.extend_from_slice(numeric);
        batch.keys.extend(
            raw.ids
                .iter()
                .enumerate()
                .map(|(f, id)| id.map_or(MISSING_KEY, |id| self.key(f, id))),
        );
        batch.len += 1;
    }

    /// The true click probability of example `i` of `batch`.
    ///
    /// # Panics
    /// If `i >= batch.len`.
    pub fn oracle_prob(&self, batch: &Batch, i: usize) -> f32 {
        let mut logit = self.bias;
        for (w, x) in self.numeric_weights.iter().zip(batch.numeric_row(i)) {
            logit += w * x;
        }
        for &k in batch.key_row(i) {
            if k != MISSING_KEY {
                logit += self.key_weight(k);
            }
        }
        sigmoid64(f64::from(logit)) as f32
    }

    /// The AUC of the true model on `batch`.
    pub fn oracle_auc(&self, batch: &Batch) -> f64 {
        let probs: Vec<f32> = (0..batch.len).map(|i| self.oracle_prob(batch, i)).collect();
        auc(&batch.labels, &probs)
    }
}

#[inline]
fn sigmoid64(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// A generator of one stream of synthetic examples (or one worker's share).
#[derive(Debug, Clone)]
pub struct Synthetic {
    model: Arc<TrueModel>,
    stream: Stream,
    examples: u64,
    deal: Deal,
    next: u64,
}

impl Synthetic {
    /// The training stream: `spec.examples_per_epoch` examples per epoch.
    pub fn train(spec: SyntheticSpec) -> Result<Self, DataError> {
        let n = spec.examples_per_epoch;
        Ok(Self::new(Arc::new(TrueModel::new(spec)?), Stream::Train, n))
    }

    /// The evaluation stream of `n` examples: the same true model as
    /// [`Synthetic::train`] of the same spec, different examples.
    pub fn eval(spec: SyntheticSpec, n: u64) -> Result<Self, DataError> {
        Ok(Self::new(Arc::new(TrueModel::new(spec)?), Stream::Eval, n))
    }

    /// A generator of `examples` examples of `stream` drawn from `model`.
    pub fn new(model: Arc<TrueModel>, stream: Stream, examples: u64) -> Self {
        Self {
            model,
            stream,
            examples,
            deal: Deal::default(),
            next: 0,
        }
    }

    /// The evaluation stream of `n` examples sharing this generator's model
    /// (cheaper than [`Synthetic::eval`], which rebuilds the model).
    pub fn eval_stream(&self, n: u64) -> Self {
        Self::new(self.model.clone(), Stream::Eval, n)
    }

    /// Keep only one worker's share: the example indices `deal` gives it.
    /// Rewinds.
    pub fn split(mut self, deal: Deal) -> Self {
        self.deal = deal;
        self.next = deal.first();
        self
    }

    /// The true model.
    pub fn model(&self) -> &Arc<TrueModel> {
        &self.model
    }

    /// The stream drawn.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Number of examples per epoch of this worker's share.
    pub fn share_len(&self) -> u64 {
        self.deal.share(self.examples)
    }

    /// Start the epoch again (the same examples come back).
    pub fn rewind(&mut self) {
        self.next = self.deal.first();
    }

    /// Clear `batch` and fill it with up to `max` examples of this share.
    /// Returns the number drawn; 0 at the end of the epoch.
    pub fn next_batch(&mut self, max: usize, batch: &mut Batch) -> usize {
        batch.clear();
        let mut raw = RawExample::default();
        let mut numeric = [0f32; NUM_NUMERIC];
        while batch.len < max && self.next < self.examples {
            self.model
                .draw_transformed(self.stream, self.next, &mut raw, &mut numeric);
            self.model.push_transformed(&raw, &numeric, batch);
            self.next = self.deal.next(self.next);
        }
        batch.len
    }

    /// Draw the rest of this epoch's share into one batch.
    pub fn collect_epoch(&mut self) -> Batch {
        let remaining = self.share_len() as usize;
        let mut all = Batch::with_capacity(remaining.min(1 << 24));
        let mut b = Batch::with_capacity(4096);
        while self.next_batch(4096, &mut b) > 0 {
            all.extend_from(&b);
        }
        all
    }

    /// Write this share's examples of one epoch, in order, as Criteo TSV.
    /// Reading the output with [`crate::CriteoReader`] gives exactly the
    /// batches [`Synthetic::next_batch`] gives. Does not move the cursor.
    pub fn write_criteo_to<W: Write>(&self, out: W) -> Result<u64, DataError> {
        let mut out = BufWriter::with_capacity(1 << 20, out);
        let mut raw = RawExample::default();
        let mut line = Vec::with_capacity(512);
        let mut written = 0;
        let mut i = self.deal.first();
        while i < self.examples {
            self.model.draw(self.stream, i, &mut raw);
            format_line(&raw, &mut line);
            out.write_all(&line)?;
            written += 1;
            i = self.deal.next(i);
        }
        out.flush()?;
        Ok(written)
    }

    /// [`Synthetic::write_criteo_to`] a new file at `path`.
    pub fn write_criteo(&self, path: impl AsRef<Path>) -> Result<u64, DataError> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|source| DataError::Open {
            path: path.to_owned(),
            source,
        })?;
        self.write_criteo_to(file)
    }
}

/// Write the first `n` training examples of `spec` to `path` as Criteo TSV.
pub fn write_criteo(path: impl AsRef<Path>, n: u64, spec: SyntheticSpec) -> Result<u64, DataError> {
    Synthetic::train(SyntheticSpec {
        examples_per_epoch: n,
        ..spec
    })?
    .write_criteo(path)
}

/// Format one example as a Criteo TSV line with its newline.
fn format_line(raw: &RawExample, line: &mut Vec<u8>) {
    line.clear();
    line.push(if raw.label { b'1' } else { b'0' });
    let mut digits = [0u8; 20];
    for c in &raw.counts {
        line.push(b'\t');
        if let Some(c) = *c {
            if c < 0 {
                line.push(b'-');
            }
            let mut v = c.unsigned_abs();
            let mut n = digits.len();
            loop {
                n -= 1;
                digits[n] = b'0' + (v % 10) as u8;
                v /= 10;
                if v == 0 {
                    break;
                }
            }
            line.extend_from_slice(&digits[n..]);
        }
    }
    for (f, id) in raw.ids.iter().enumerate() {
        line.push(b'\t');
        if let Some(id) = *id {
            line.extend_from_slice(&category_string(f as u32, id));
        }
    }
    line.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criteo::{CriteoReader, ReaderOptions};

    fn small_spec(n: u64) -> SyntheticSpec {
        SyntheticSpec {
            examples_per_epoch: n,
            ..Default::default()
        }
    }

    #[test]
    fn zipf_table_matches_law() {
        for (n, exponent) in [(1000u32, 1.1f64), (100_000, 1.1), (100_000, 1.0), (50, 0.8)] {
            let z = ZipfTable::new(n, exponent);
            assert_eq!(z.sample(0), 0);
            assert_eq!(z.sample(u32::MAX), n - 1);
            let mut prev = 0;
            for i in 0..=100_000u64 {
                let id = z.sample((i * u64::from(u32::MAX) / 100_000) as u32);
                assert!(id >= prev && id < n, "not monotone at {i}");
                prev = id;
            }
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
            let draws = 400_000;
            let mut counts = vec![0u32; n as usize];
            for _ in 0..draws {
                counts[z.sample(rng.next_u32()) as usize] += 1;
            }
            let weight = |k: u32| f64::from(k + 1).powf(-exponent);
            let total: f64 = (0..n).map(weight).sum();
            // Single frequent ids, and ranges of tail ids, against the law.
            let ranges = [
                (0, 1),
                (1, 2),
                (9, 10),
                (100, 200),
                (1000, 2000),
                (5000, 20_000),
                (20_000, n),
            ];
            for (lo, hi) in ranges {
                if lo >= hi || hi > n {
                    continue;
                }
                let p: f64 = (lo..hi).map(weight).sum::<f64>() / total;
                let got =
                    counts[lo as usize..hi as usize].iter().sum::<u32>() as f64 / draws as f64;
                let sd = (p * (1.0 - p) / draws as f64).sqrt();
                assert!(
                    (got - p).abs() < 5.0 * sd + 1e-4,
                    "n {n} ids {lo}..{hi}: {got} vs {p}"
                );
            }
        }
    }

    #[test]
    fn category_strings_are_distinct_hex() {
        let mut seen = std::collections::HashSet::new();
        for id in 0..50_000 {
            let s = category_string(3, id);
            assert!(s
                .iter()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
            assert!(seen.insert(s));
        }
        assert_ne!(category_string(3, 7), category_string(4, 7));
    }

    #[test]
    fn click_rate_is_calibrated() {
        let mut g = Synthetic::train(small_spec(20_000)).unwrap();
        let b = g.collect_epoch();
        assert_eq!(b.len, 20_000);
        let ctr = b.labels.iter().sum::<f32>() / b.len as f32;
        assert!((ctr - 0.25).abs() < 0.03, "ctr {ctr}");
        // Some numeric and categorical values are missing, some are not.
        let missing_num = b.numeric.iter().filter(|&&x| x == 0.0).count();
        assert!(missing_num > 0 && missing_num < b.numeric.len() / 2);
        let missing_cat = b.keys.iter().filter(|&&k| k == MISSING_KEY).count();
        assert!(missing_cat > 0 && missing_cat < b.keys.len() / 4);
        assert!(b.numeric.iter().any(|&x| x < 0.0));
    }

    #[test]
    fn deterministic_and_epochs_repeat() {
        let mut a = Synthetic::train(small_spec(3000)).unwrap();
        let mut b = Synthetic::train(small_spec(3000)).unwrap();
        let ea = a.collect_epoch();
        assert_eq!(ea, b.collect_epoch());
        a.rewind();
        assert_eq!(ea, a.collect_epoch());
        let other = Synthetic::train(SyntheticSpec {
            seed: 99,
            ..small_spec(3000)
        })
        .unwrap()
        .collect_epoch();
        assert_ne!(ea.labels, other.labels);
    }

    #[test]
    fn eval_shares_model_not_examples() {
        let train = Synthetic::train(small_spec(2000)).unwrap();
        let eval = Synthetic::eval(small_spec(2000), 2000).unwrap();
        assert_eq!(train.model().bias(), eval.model().bias());
        assert_eq!(
            train.model().numeric_weights(),
            eval.model().numeric_weights()
        );
        let mut e1 = eval.clone();
        let mut e2 = train.eval_stream(2000);
        let b1 = e1.collect_epoch();
        assert_eq!(b1, e2.collect_epoch());
        assert_ne!(b1.keys, train.clone().collect_epoch().keys);
    }

    #[test]
    fn workers_get_disjoint_shares() {
        let whole = Synthetic::train(small_spec(1001)).unwrap();
        let all = whole.clone().collect_epoch();
        let mut total = 0;
        // Dealt 7 at a time: 143 blocks, the last one whole; worker 0
        // takes blocks 0, 3, .., 141.
        for w in 0..3 {
            let deal = Deal::new(w, 3, 7).unwrap();
            let mut g = whole.clone().split(deal);
            assert_eq!(g.share_len(), if w < 2 { 336 } else { 329 });
            let mut b = Batch::default();
            let mut i = deal.first() as usize;
            let mut taken = 0;
            // Batches of 7 read whole blocks.
            while g.next_batch(7, &mut b) > 0 {
                assert_eq!(b.len, 7);
                for r in 0..b.len {
                    assert_eq!(b.key_row(r), all.key_row(i));
                    assert_eq!(b.numeric_row(r), all.numeric_row(i));
                    assert_eq!(b.labels[r], all.labels[i]);
                    i = deal.next(i as u64) as usize;
                    taken += 1;
                }
            }
            assert_eq!(taken, g.share_len());
            total += taken;
            g.rewind();
            assert_eq!(g.collect_epoch().key_row(0), all.key_row(7 * w));
        }
        assert_eq!(total, 1001);
    }

    #[test]
    fn criteo_file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("synthetic.tsv");
        assert_eq!(
            write_criteo(&path, 2500, SyntheticSpec::default()).unwrap(),
            2500
        );
        let mut gen = Synthetic::train(small_spec(2500)).unwrap();
        let mut reader = CriteoReader::open(&path, ReaderOptions::default()).unwrap();
        let (mut a, mut b) = (Batch::default(), Batch::default());
        let mut n = 0;
        loop {
            let got = gen.next_batch(700, &mut a);
            assert_eq!(reader.next_batch(700, &mut b).unwrap(), got);
            assert_eq!(a, b);
            if got == 0 {
                break;
            }
            n += got;
        }
        assert_eq!(n, 2500);
        assert_eq!(reader.counters().skipped, 0);
    }

    #[test]
    fn push_matches_next_batch() {
        let mut g = Synthetic::train(small_spec(50)).unwrap();
        let model = g.model().clone();
        let want = g.collect_epoch();
        let mut b = Batch::default();
        let mut raw = RawExample::default();
        for i in 0..50 {
            model.draw(Stream::Train, i, &mut raw);
            model.push(&raw, &mut b);
        }
        assert_eq!(b, want);
        // Tail ids (beyond the precomputed head keys) hash the same way.
        let tail = RawExample {
            ids: [Some(HEAD_KEYS + 5); NUM_CATEGORICAL],
            ..raw
        };
        let mut b = Batch::default();
        model.push(&tail, &mut b);
        assert_eq!(b.keys[3], category_key(3, HEAD_KEYS + 5));
        assert_eq!(model.key(3, 7), category_key(3, 7));
    }

    #[test]
    fn oracle_uses_true_weights() {
        let mut g = Synthetic::train(small_spec(1)).unwrap();
        let model = g.model().clone();
        let mut raw = RawExample::default();
        model.draw(Stream::Train, 0, &mut raw);
        let mut logit = model.bias();
        for (j, c) in raw.counts.iter().enumerate() {
            logit += model.numeric_weights()[j] * c.map_or(0.0, transform_count);
        }
        for (f, id) in raw.ids.iter().enumerate() {
            if let Some(id) = id {
                logit += model.id_weight(f, *id);
            }
        }
        let b = g.collect_epoch();
        let p = model.oracle_prob(&b, 0);
        assert!((p - 1.0 / (1.0 + (-logit).exp())).abs() < 1e-5);
        assert_eq!(model.id_weight(0, model.spec().weighted_ids), 0.0);
        assert_ne!(model.id_weight(0, 0), 0.0);
    }

    #[test]
    fn bad_specs_are_errors() {
        for spec in [
            SyntheticSpec {
                vocab: 0,
                ..Default::default()
            },
            SyntheticSpec {
                vocab: u32::MAX,
                ..Default::default()
            },
            SyntheticSpec {
                weighted_ids: 200_000,
                ..Default::default()
            },
            SyntheticSpec {
                vocab: MAX_VOCAB,
                weighted_ids: MAX_WEIGHTED_IDS + 1,
                ..Default::default()
            },
            SyntheticSpec {
                target_ctr: 1.0,
                ..Default::default()
            },
            SyntheticSpec {
                zipf_exponent: f64::NAN,
                ..Default::default()
            },
        ] {
            assert!(matches!(TrueModel::new(spec), Err(DataError::Spec(_))));
        }
    }
}

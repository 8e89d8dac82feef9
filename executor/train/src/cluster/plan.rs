//! The plan every task of a cluster computes alike from the configuration:
//! the model, which PS holds each variable, and the shards' variables.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use starwire_data::{Batch, SyntheticSpec, TrueModel};
use starwire_graph::{Model, ModelKind, ModelSpec, VarKind as GVarKind, VarSpec};
use starwire_ps::assign::{assign_with, estimate, AssignOptions, AssignmentReport, Location};
use starwire_ps::{OptimizerKind, VarDef, VarStats};

use super::TrainConfig;
use crate::source::{DataSource, Reader};
use crate::worker::Layout;
use crate::TrainError;

/// What every task of a cluster computes identically from the
/// configuration: the model, where each variable lives, and the
/// variables each shard holds.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The model.
    pub model: Model,
    /// The true model of the synthetic data (shared by train and eval).
    pub truth: Arc<TrueModel>,
    /// Shards of the cluster.
    pub shards: usize,
    /// Variables of each shard.
    pub shard_vars: Vec<Vec<VarDef>>,
    /// The worker's view.
    pub layout: Layout,
    /// The per-PS loads of the variable assignment.
    pub assignment: AssignmentReport,
    /// The estimates the assignment worked from.
    pub stats: Vec<VarStats>,
    /// By variable id: the distinct keys of a table in the assignment
    /// sample (0 for a dense variable), a lower bound of its rows.
    pub sample_keys: Vec<u64>,
    /// By variable id: the distinct keys a table is expected to see over
    /// an epoch ([`expected_keys`]; the sample's count for data read from
    /// files), which its shards reserve rows for.
    pub expected_keys: Vec<u64>,
    /// Every worker's batches of an epoch, counted when first needed
    /// (`--sync`, checkpoints during the run) and shared by the workers
    /// of this process.
    pub shares: super::shares::ShareCache,
}

fn to_def(v: &VarSpec) -> VarDef {
    use starwire_graph::Init as G;
    use starwire_ps::{Init as P, VarKind as K};
    VarDef {
        id: v.id.0,
        name: v.name.clone(),
        kind: match &v.kind {
            GVarKind::Dense { shape } => K::Dense {
                shape: shape.clone(),
            },
            GVarKind::Embedding { dim } => K::Embedding { dim: *dim },
        },
        init: match v.init {
            G::Zeros => P::Zeros,
            G::Uniform { scale } => P::Uniform { scale },
            G::Normal { std } => P::Normal { std },
            G::GlorotUniform => P::GlorotUniform,
        },
    }
}

fn slots(k: OptimizerKind) -> usize {
    k.slots()
}

/// How far [`expected_keys`] extrapolates: to at most this many times
/// the examples of the sample.
pub const EXTRAPOLATION: f64 = 10.0;

/// Examples read to estimate table sizes and traffic for variable
/// assignment.
pub const ASSIGNMENT_SAMPLE: usize = 20_000;

fn synthetic_spec(cfg: &TrainConfig) -> SyntheticSpec {
    SyntheticSpec {
        seed: cfg.seed,
        examples_per_epoch: cfg.train_examples,
        ..SyntheticSpec::default()
    }
}

/// Size and expected-traffic estimates of every variable, from the key
/// counts of a sample of `n` examples.
fn var_stats(
    cfg: &TrainConfig,
    model: &Model,
    counts: &HashMap<u32, HashMap<u64, u64>>,
    n: usize,
) -> Vec<VarStats> {
    let s = slots(cfg.optimizer);
    model
        .variables()
        .iter()
        .map(|v| match &v.kind {
            GVarKind::Embedding { dim } => {
                // Sorted: a float sum in hash-map order would differ between
                // processes, and every task must compute the same assignment.
                let mut c: Vec<u64> = counts
                    .get(&v.id.0)
                    .map(|m| m.values().copied().collect())
                    .unwrap_or_default();
                c.sort_unstable();
                VarStats {
                    id: v.id.0,
                    name: v.name.clone(),
                    embedding: true,
                    bytes: estimate::table_bytes(c.len() as u64, *dim, s),
                    expected_requests: estimate::table_requests(
                        &c,
                        n as u64,
                        cfg.batch_size as u64,
                    ),
                }
            }
            GVarKind::Dense { shape } => VarStats {
                id: v.id.0,
                name: v.name.clone(),
                embedding: false,
                bytes: estimate::dense_bytes(shape.iter().product(), s),
                expected_requests: 1.0,
            },
        })
        .collect()
}

/// How large a table must be to be sharded over every PS: more than half
/// a PS's fair share of the bytes (every table with one PS).
pub fn shard_threshold(stats: &[VarStats], ps: usize) -> u64 {
    let total: u64 = stats.iter().map(|v| v.bytes).sum();
    if ps <= 1 {
        0
    } else {
        total / (2 * ps as u64)
    }
}

/// Build the model and assign its variables to PS tasks.
pub fn plan(cfg: &TrainConfig) -> Result<Plan, TrainError> {
    if cfg.ps == 0 || cfg.workers == 0 || cfg.batch_size == 0 || cfg.embedding_dim == 0 {
        return Err(TrainError::Config(
            "--ps, --workers, --batch-size and --embedding-dim must be at least 1".into(),
        ));
    }
    let spec = match cfg.model {
        ModelKind::Lr => ModelSpec::lr(cfg.embedding_dim),
        ModelKind::Wdl => ModelSpec::wdl(cfg.embedding_dim),
    };
    let model = Model::build(spec).map_err(|e| TrainError::Internal(e.to_string()))?;
    let truth = Arc::new(TrueModel::new(synthetic_spec(cfg))?);

    // Key counts per variable from a sample of the training data.
    let mut reader = Reader::train(
        &cfg.train,
        &truth,
        cfg.train_examples,
        Default::default(),
        true,
    )?;
    let mut batch = Batch::with_capacity(ASSIGNMENT_SAMPLE);
    let n = reader.next_batch(ASSIGNMENT_SAMPLE, &mut batch)?;
    let nf = model.spec().num_fields;
    let mut counts: HashMap<u32, HashMap<u64, u64>> = HashMap::new();
    for l in model.lookups() {
        let c = counts.entry(l.var.0).or_default();
        for b in 0..n {
            for &f in &l.fields {
                let k = batch.keys[b * nf + f];
                if k != starwire_data::MISSING_KEY {
                    *c.entry(k).or_default() += 1;
                }
            }
        }
    }
    // The same count over the sample's first half, for the growth rate
    // of `expected_keys`.
    let mut half: HashMap<u32, HashSet<u64>> = HashMap::new();
    for l in model.lookups() {
        let c = half.entry(l.var.0).or_default();
        for b in 0..n / 2 {
            for &f in &l.fields {
                let k = batch.keys[b * nf + f];
                if k != starwire_data::MISSING_KEY {
                    c.insert(k);
                }
            }
        }
    }
    let stats = var_stats(cfg, &model, &counts, n);
    let sample_keys: Vec<u64> = model
        .variables()
        .iter()
        .map(|v| counts.get(&v.id.0).map_or(0, |c| c.len() as u64))
        .collect();
    let expected_keys = model
        .variables()
        .iter()
        .zip(&sample_keys)
        .map(|(v, &all)| match cfg.train {
            DataSource::Synthetic => {
                let h = half.get(&v.id.0).map_or(0, |c| c.len() as u64);
                expected_keys(all, h, n as u64, cfg.train_examples)
            }
            // The size of a data set of files is not known ahead.
            _ => all,
        })
        .collect();
    // "Large" tables are sharded over every PS by key: those that would by
    // themselves hold more than half a PS's fair share of the bytes.
    let threshold = shard_threshold(&stats, cfg.ps);
    let assignment = assign_with(
        &stats,
        cfg.ps,
        cfg.assignment,
        &AssignOptions {
            shard_threshold_bytes: threshold,
        },
    );
    let report = assignment.report();

    let r = cfg.ps_reactors.max(1);
    let shards = cfg.ps * r;
    let mut shard_vars: Vec<Vec<VarDef>> = vec![Vec::new(); shards];
    let mut home_shard = vec![None; model.variables().len()];
    let mut next_on_ps = vec![0usize; cfg.ps];
    for v in model.variables() {
        let def = to_def(v);
        match assignment.location(v.id.0) {
            Some(Location::Ps(p)) => {
                let s = p * r + next_on_ps[p] % r;
                next_on_ps[p] += 1;
                // A dense variable, or a table small enough to live whole on
                // one shard: the worker routes all its keys there.
                home_shard[v.id.0 as usize] = Some(s);
                shard_vars[s].push(def);
            }
            Some(Location::Sharded) | None => {
                for sv in &mut shard_vars {
                    sv.push(def.clone());
                }
            }
        }
    }
    let layout = Layout {
        shards,
        home_shard,
        num_dense: model.spec().num_dense,
        num_fields: nf,
    };
    Ok(Plan {
        model,
        truth,
        shards,
        shard_vars,
        layout,
        assignment: report,
        stats,
        sample_keys,
        expected_keys,
        shares: Default::default(),
    })
}

/// The distinct keys of a table over `examples` examples, from `all`
/// distinct keys in a sample of `n` examples and `half` in its first
/// half: the count of distinct keys grows as a power of the examples
/// read, `all * (examples / n)^a` with `a = log2(all / half)`, at most 1.
/// With a heavy-tailed key distribution the exponent falls as more is
/// read, so the estimate errs high the further it reaches: it reaches at
/// most [`EXTRAPOLATION`] times the sample (a table reserves memory for
/// these rows, and a low estimate only leaves rows to be made as they
/// come). `all` when the sample is all there is.
pub fn expected_keys(all: u64, half: u64, n: u64, examples: u64) -> u64 {
    if n == 0 || half == 0 || all <= half || examples <= n {
        return all;
    }
    let a = (all as f64 / half as f64).log2().min(1.0);
    let reach = (examples as f64 / n as f64).min(EXTRAPOLATION);
    let e = all as f64 * reach.powf(a);
    (e as u64).max(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_keys_extrapolates_the_samples_growth_at_most_ten_times_over() {
        // Nothing to extrapolate from, or to.
        assert_eq!(expected_keys(500, 0, 1000, 10_000), 500);
        assert_eq!(expected_keys(500, 500, 1000, 10_000), 500);
        assert_eq!(expected_keys(500, 300, 1000, 1000), 500);
        assert_eq!(expected_keys(0, 0, 0, 10_000), 0);
        // Every key new (a = 1): linear, up to ten times the sample.
        assert_eq!(expected_keys(200, 100, 1000, 4000), 800);
        assert_eq!(expected_keys(200, 100, 1000, 1_000_000), 2000);
        // Half as many new keys in the second half: a = log2(1.5).
        let e = expected_keys(150, 100, 1000, 4000);
        let want = 150.0 * 4f64.powf(1.5f64.log2());
        assert!((e as f64 - want).abs() <= 1.0, "{e} against {want}");
        assert!(e > 150 && e < 600);
    }
}

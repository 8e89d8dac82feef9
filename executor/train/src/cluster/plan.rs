//! The plan every task of a cluster computes alike from the configuration:
//! the model, which PS holds each variable, and the shards' variables.

use std::collections::HashMap;
use std::sync::Arc;

use starwire_data::{Batch, SyntheticSpec, TrueModel};
use starwire_graph::{Model, ModelKind, ModelSpec, VarKind as GVarKind, VarSpec};
use starwire_ps::assign::{assign_with, estimate, AssignOptions, AssignmentReport, Location};
use starwire_ps::{OptimizerKind, VarDef, VarStats};

use super::TrainConfig;
use crate::source::Reader;
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
    let mut reader = Reader::train(&cfg.train, &truth, cfg.train_examples, 0, 1, true)?;
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
    let stats = var_stats(cfg, &model, &counts, n);
    let sample_keys = model
        .variables()
        .iter()
        .map(|v| counts.get(&v.id.0).map_or(0, |c| c.len() as u64))
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
    })
}

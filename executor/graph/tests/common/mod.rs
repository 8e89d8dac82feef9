//! Shared test helpers: random tensors, batches, parameter stores and a
//! finite-difference gradient checker.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_graph::*;

pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// A random tensor with entries in `±[0.1, 1)` (away from ReLU's kink).
pub fn rand_tensor(rng: &mut SmallRng, shape: Vec<usize>) -> Tensor {
    let n = shape.iter().product();
    let data = (0..n)
        .map(|_| {
            let v: f32 = rng.gen_range(0.1..1.0);
            if rng.gen_bool(0.5) {
                v
            } else {
                -v
            }
        })
        .collect();
    Tensor::new(shape, data).unwrap()
}

pub fn labels(rng: &mut SmallRng, b: usize) -> Tensor {
    let data = (0..b)
        .map(|_| f32::from(u8::from(rng.gen_bool(0.5))))
        .collect();
    Tensor::new(vec![b, 1], data).unwrap()
}

/// Every perturbable value of a feed: `(which, element)` addresses.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Dense(usize),
    Lookup(usize),
}

fn tensor_mut(feeds: &mut GraphFeeds, s: Slot) -> &mut Tensor {
    match s {
        Slot::Dense(i) => &mut feeds.dense[i].1,
        Slot::Lookup(i) => match &mut feeds.lookups[i] {
            LookupFeed::Rows { rows, .. } => rows,
            LookupFeed::Pooled(t) => t,
            LookupFeed::WireRows { .. } => panic!("finite differences perturb tensor feeds"),
        },
    }
}

fn analytic(out: &RunOutput, feeds: &GraphFeeds, s: Slot) -> Tensor {
    match s {
        Slot::Dense(i) => {
            let var = feeds.dense[i].0;
            out.dense_grads
                .iter()
                .find(|(v, _)| *v == var)
                .expect("gradient for every fed variable")
                .1
                .clone()
        }
        Slot::Lookup(i) => match &out.lookup_grads[i] {
            LookupGrad::Rows(t) | LookupGrad::Pooled(t) => t.clone(),
        },
    }
}

/// Checks every gradient of `run` against central differences of its loss.
/// Returns how many elements were checked.
pub fn fd_check(run: impl Fn(&GraphFeeds) -> RunOutput, feeds: &GraphFeeds) -> usize {
    let base = run(feeds);
    let slots: Vec<Slot> = (0..feeds.dense.len())
        .map(Slot::Dense)
        .chain((0..feeds.lookups.len()).map(Slot::Lookup))
        .collect();
    let eps = 1e-2f32;
    let mut checked = 0;
    for s in slots {
        let grad = analytic(&base, feeds, s);
        let mut f = feeds.clone();
        assert_eq!(grad.shape(), tensor_mut(&mut f, s).shape(), "{s:?}");
        for e in 0..grad.len() {
            let orig = tensor_mut(&mut f, s).data()[e];
            tensor_mut(&mut f, s).data_mut()[e] = orig + eps;
            let up = run(&f).loss;
            tensor_mut(&mut f, s).data_mut()[e] = orig - eps;
            let down = run(&f).loss;
            tensor_mut(&mut f, s).data_mut()[e] = orig;
            let num = (up - down) / (2.0 * eps);
            let ana = grad.data()[e];
            assert!(
                (num - ana).abs() <= 2e-4 + 2e-3 * ana.abs(),
                "{s:?}[{e}]: numeric {num} vs analytic {ana}"
            );
            checked += 1;
        }
    }
    checked
}

/// One example's categorical keys: per field, its (possibly empty) key list.
pub type Example = Vec<Vec<u64>>;

/// A random batch: numeric features, labels and keys (0..=2 keys per field,
/// drawn from a small vocabulary so keys repeat).
pub struct Batch {
    pub numeric: Tensor,
    pub labels: Tensor,
    pub keys: Vec<Example>,
}

pub fn batch(rng: &mut SmallRng, spec: &ModelSpec, b: usize) -> Batch {
    let keys = (0..b)
        .map(|_| {
            (0..spec.num_fields)
                .map(|f| {
                    let n = rng.gen_range(0..=2);
                    (0..n)
                        .map(|_| (f as u64) << 32 | rng.gen_range(0..4u64))
                        .collect()
                })
                .collect()
        })
        .collect();
    Batch {
        numeric: rand_tensor(rng, vec![b, spec.num_dense]),
        labels: labels(rng, b),
        keys,
    }
}

/// The parameters of a model, as a PS would hold them.
pub struct Store {
    pub dense: HashMap<VarId, Tensor>,
    pub rows: HashMap<(VarId, u64), Vec<f32>>,
    pub dims: HashMap<VarId, usize>,
    pub seed: u64,
}

impl Store {
    pub fn new(model: &Model, seed: u64) -> Self {
        let mut r = rng(seed);
        let mut dense = HashMap::new();
        let mut dims = HashMap::new();
        for v in model.variables() {
            match &v.kind {
                VarKind::Dense { shape } => {
                    dense.insert(v.id, rand_tensor(&mut r, shape.clone()));
                }
                VarKind::Embedding { dim } => {
                    dims.insert(v.id, *dim);
                }
            }
        }
        Self {
            dense,
            rows: HashMap::new(),
            dims,
            seed,
        }
    }

    /// The row of `key` in `var`, created deterministically on first use.
    pub fn row(&mut self, var: VarId, key: u64) -> Vec<f32> {
        let dim = self.dims[&var];
        let seed = self.seed;
        self.rows
            .entry((var, key))
            .or_insert_with(|| {
                let mut r = rng(seed ^ key.wrapping_mul(0x9e37_79b9) ^ u64::from(var.0) << 48);
                rand_tensor(&mut r, vec![dim]).into_data()
            })
            .clone()
    }
}

/// The ragged layout of one lookup over a batch: unique keys, index, offsets.
pub struct Layout {
    pub unique: Vec<u64>,
    pub index: Vec<u32>,
    pub offsets: Vec<u32>,
}

pub fn layout(spec: &LookupSpec, keys: &[Example]) -> Layout {
    let mut all = Vec::new();
    let mut offsets = vec![0u32];
    for ex in keys {
        for &f in &spec.fields {
            all.extend_from_slice(&ex[f]);
        }
        offsets.push(all.len() as u32);
    }
    let (unique, index) = dedup(&all);
    Layout {
        unique,
        index,
        offsets,
    }
}

/// The feeds of one step under `protocol`, plus the layouts used.
pub fn step_feeds(p: &Partitioned, store: &mut Store, batch: &Batch) -> (StepFeeds, Vec<Layout>) {
    let dense = p
        .pulls()
        .dense
        .iter()
        .map(|d| (d.var, store.dense[&d.var].clone()))
        .collect();
    let mut layouts = Vec::new();
    let mut lookups = Vec::new();
    for l in &p.pulls().lookups {
        let lay = layout(&l.spec, &batch.keys);
        let mut data = Vec::new();
        for &k in &lay.unique {
            data.extend(store.row(l.spec.var, k));
        }
        let rows = Tensor::new(vec![lay.unique.len(), l.dim], data).unwrap();
        lookups.push(match l.form {
            PullForm::Rows => LookupFeed::Rows {
                rows,
                index: lay.index.clone(),
                offsets: lay.offsets.clone(),
            },
            PullForm::Pooled => LookupFeed::Pooled(
                combine(&rows, &lay.index, &lay.offsets, l.spec.combiner).unwrap(),
            ),
        });
        layouts.push(lay);
    }
    (
        StepFeeds {
            numeric: batch.numeric.clone(),
            labels: batch.labels.clone(),
            dense,
            lookups,
        },
        layouts,
    )
}

pub fn graph_feeds(f: StepFeeds) -> GraphFeeds {
    GraphFeeds {
        inputs: vec![f.numeric, f.labels],
        dense: f.dense,
        lookups: f.lookups,
    }
}

pub fn run_graph(g: &Arc<Graph>, exec: &Executor, f: &GraphFeeds) -> RunOutput {
    g.run(exec, f.clone(), true).expect("run")
}

pub fn small_lr() -> ModelSpec {
    ModelSpec {
        kind: ModelKind::Lr,
        num_dense: 3,
        num_fields: 4,
        embedding_dim: 2,
        hidden: vec![],
    }
}

pub fn small_wdl() -> ModelSpec {
    ModelSpec {
        kind: ModelKind::Wdl,
        num_dense: 3,
        num_fields: 4,
        embedding_dim: 2,
        hidden: vec![4, 3],
    }
}

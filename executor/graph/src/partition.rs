//! Partitioning a model into the worker subgraph of one protocol, and the
//! per-step API the runtime calls.

use std::hash::BuildHasher;
use std::sync::Arc;

use rustc_hash::FxBuildHasher;

use crate::error::GraphError;
use crate::exec::Executor;
use crate::graph::{Graph, GraphFeeds, LookupFeed, LookupGrad, Op, VarId};
use crate::model::{LookupSpec, Model};
use crate::run::RunBuffers;
use crate::tensor::Tensor;

/// How embeddings travel between PS and worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// `star_server`: the worker pulls unique rows and pools them itself;
    /// it pushes per-row gradients.
    StarServer,
    /// `star_server_lite`: the PS pools; the worker gets `[B,D]` and pushes
    /// the gradient w.r.t. it.
    StarServerLite,
}

/// In which form a lookup is pulled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PullForm {
    /// Unique rows `[U,D]` (feed [`LookupFeed::Rows`]).
    Rows,
    /// The pooled `[B,D]` tensor (feed [`LookupFeed::Pooled`]).
    Pooled,
}

/// One dense variable the worker pulls whole.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DensePull {
    /// The variable.
    pub var: VarId,
    /// Its shape.
    pub shape: Vec<usize>,
}

/// One lookup the worker pulls.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LookupPull {
    /// The lookup (its `index` is its position in [`StepFeeds::lookups`]).
    pub spec: LookupSpec,
    /// The row width.
    pub dim: usize,
    /// Rows or pooled.
    pub form: PullForm,
}

/// What one step must pull before it can run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pulls {
    /// Dense variables, in the order [`StepOutput::dense_grads`] returns them.
    pub dense: Vec<DensePull>,
    /// Lookups, by index.
    pub lookups: Vec<LookupPull>,
}

/// The worker subgraph for one protocol.
#[derive(Debug, Clone)]
pub struct Partitioned {
    protocol: Protocol,
    graph: Arc<Graph>,
    pulls: Pulls,
}

/// What the runtime feeds one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepFeeds {
    /// Numeric features `[B, num_dense]`.
    pub numeric: Tensor,
    /// Labels `[B, 1]`.
    pub labels: Tensor,
    /// Every dense variable of [`Pulls::dense`], any order.
    pub dense: Vec<(VarId, Tensor)>,
    /// One feed per lookup, indexed by [`LookupSpec::index`].
    pub lookups: Vec<LookupFeed>,
}

/// What one training step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The mean loss of the batch.
    pub loss: f32,
    /// The predicted probabilities, one per example.
    pub probs: Vec<f32>,
    /// Per dense variable, in [`Pulls::dense`] order, its gradient.
    pub dense_grads: Vec<(VarId, Tensor)>,
    /// Per lookup, its gradient: rows for `StarServer`, pooled for `StarServerLite`.
    pub lookup_grads: Vec<LookupGrad>,
}

/// Cuts `model` for `protocol`: with `StarServer` the worker runs the whole
/// graph; with `StarServerLite` every embedding lookup (with its combiner)
/// moves to the PS and the worker graph reads its pooled output instead.
pub fn partition(model: &Model, protocol: Protocol) -> Partitioned {
    let graph = match protocol {
        Protocol::StarServer => Arc::clone(model.graph()),
        // The rewrite only swaps leaves for leaves with the same slots, so a
        // graph that checked once checks again.
        Protocol::StarServerLite => Arc::new(
            model
                .graph()
                .with_pooled_lookups()
                .expect("rewriting lookup leaves keeps a valid graph valid"),
        ),
    };
    let form = match protocol {
        Protocol::StarServer => PullForm::Rows,
        Protocol::StarServerLite => PullForm::Pooled,
    };
    let dense = graph
        .dense_vars()
        .map(|(var, shape)| DensePull {
            var,
            shape: shape.to_vec(),
        })
        .collect();
    let lookups = graph
        .lookup_nodes()
        .zip(model.lookups())
        .map(|(op, spec)| {
            let dim = match op {
                Op::EmbeddingLookup { dim, .. } | Op::Pooled { dim, .. } => *dim,
                _ => unreachable!("lookup slots hold lookup nodes"),
            };
            LookupPull {
                spec: spec.clone(),
                dim,
                form,
            }
        })
        .collect();
    Partitioned {
        protocol,
        graph,
        pulls: Pulls { dense, lookups },
    }
}

impl Partitioned {
    /// The protocol it was cut for.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// What each step must pull, and in which form.
    pub fn pulls(&self) -> &Pulls {
        &self.pulls
    }

    /// The worker graph.
    pub fn graph(&self) -> &Arc<Graph> {
        &self.graph
    }

    fn graph_feeds(feeds: StepFeeds) -> GraphFeeds {
        GraphFeeds {
            inputs: vec![feeds.numeric, feeds.labels],
            dense: feeds.dense,
            lookups: feeds.lookups,
        }
    }

    /// One training step: forward, loss, backward.
    pub fn forward_backward(
        &self,
        exec: &Executor,
        feeds: StepFeeds,
    ) -> Result<StepOutput, GraphError> {
        self.forward_backward_with(exec, feeds, &mut RunBuffers::default())
    }

    /// [`Self::forward_backward`] writing into the buffers of an earlier
    /// step (see [`RunBuffers`]); hand this step's rows gradients back with
    /// [`RunBuffers::give_back`] once they are sent.
    pub fn forward_backward_with(
        &self,
        exec: &Executor,
        feeds: StepFeeds,
        bufs: &mut RunBuffers,
    ) -> Result<StepOutput, GraphError> {
        let out = self
            .graph
            .run_with(exec, Self::graph_feeds(feeds), true, bufs)?;
        Ok(StepOutput {
            loss: out.loss,
            probs: out.probs,
            dense_grads: out.dense_grads,
            lookup_grads: out.lookup_grads,
        })
    }

    /// Forward only (evaluation): the predicted probabilities.
    pub fn forward(&self, exec: &Executor, feeds: StepFeeds) -> Result<Vec<f32>, GraphError> {
        Ok(self.graph.run(exec, Self::graph_feeds(feeds), false)?.probs)
    }
}

/// Deduplicates keys: the unique keys in first-seen order, and per key its
/// position among them. Keys are hashed with the Fx hasher (keys are already
/// hashes; a DoS-resistant hasher buys nothing here). A batch has far fewer
/// than `u32::MAX` keys; positions past that would not fit the `u32` index.
pub fn dedup(keys: &[u64]) -> (Vec<u64>, Vec<u32>) {
    let (mut unique, mut index) = (Vec::new(), Vec::new());
    Dedup::default().run(keys, &mut unique, &mut index);
    (unique, index)
}

/// [`dedup`] with its table kept between calls, for a caller that
/// deduplicates every step.
///
/// The table is open addressing with linear probing, at most half full,
/// and holds positions only: a slot names a unique key by its position in
/// the output, where the probe compares it. It is 4 bytes a slot, cleared
/// by one fill, and a probe is a load and a compare, where a general map
/// hashes into groups of tags and stores every key a second time.
#[derive(Debug, Default, Clone)]
pub struct Dedup {
    /// By slot: 0 when free, else the position of its key plus one.
    slots: Vec<u32>,
}

impl Dedup {
    /// Overwrite `unique` and `index` with [`dedup`]'s two results for `keys`.
    pub fn run(&mut self, keys: &[u64], unique: &mut Vec<u64>, index: &mut Vec<u32>) {
        let cap = (2 * keys.len()).next_power_of_two().max(16);
        self.slots.clear();
        self.slots.resize(cap, 0);
        let mask = cap - 1;
        unique.clear();
        index.clear();
        index.reserve(keys.len());
        unique.reserve(keys.len());
        for &k in keys {
            // The low bits pick the slot: the Fx hasher rotates its best
            // mixed bits there, as hash tables take them.
            let mut i = FxBuildHasher.hash_one(k) as usize & mask;
            let p = loop {
                match self.slots[i] {
                    0 => {
                        let next = unique.len() as u32;
                        self.slots[i] = next + 1;
                        unique.push(k);
                        break next;
                    }
                    s if unique[(s - 1) as usize] == k => break s - 1,
                    _ => i = (i + 1) & mask,
                }
            };
            index.push(p);
        }
    }
}

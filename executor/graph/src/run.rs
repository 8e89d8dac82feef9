//! One run of a [`Graph`]: its values, the tasks the executor runs, and the
//! buffers one run leaves for the next.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::GraphError;
use crate::exec::{Executor, TaskSet};
use crate::graph::{invalid, Graph, GraphFeeds, LookupFeed, LookupGrad, Op, Plan, RunOutput};
use crate::ops;
use crate::tensor::Tensor;
use crate::wire_rows::{RowSource, WireRows};

impl Graph {
    /// Runs the graph forward, and backward too if `backward`.
    pub fn run(
        self: &Arc<Self>,
        exec: &Executor,
        feeds: GraphFeeds,
        backward: bool,
    ) -> Result<RunOutput, GraphError> {
        self.run_with(exec, feeds, backward, &mut RunBuffers::default())
    }

    /// [`Graph::run`] writing the large outputs (pooled lookups, sums,
    /// concatenations, rows gradients) into the buffers `bufs` kept from
    /// an earlier run, and keeping this run's for the next.
    pub fn run_with(
        self: &Arc<Self>,
        exec: &Executor,
        feeds: GraphFeeds,
        backward: bool,
        bufs: &mut RunBuffers,
    ) -> Result<RunOutput, GraphError> {
        let mut state = RunState::new(Arc::clone(self), feeds, backward)?;
        let n = self.nodes.len();
        bufs.fwd.resize_with(n, Vec::new);
        bufs.grads.resize_with(n, Vec::new);
        state.spare_fwd = bufs
            .fwd
            .iter_mut()
            .map(|b| Mutex::new(std::mem::take(b)))
            .collect();
        state.spare_grads = bufs
            .grads
            .iter_mut()
            .map(|b| Mutex::new(std::mem::take(b)))
            .collect();
        let state = Arc::new(state);
        exec.run(Arc::clone(&state));
        match Arc::try_unwrap(state) {
            // Every task has run and the executor let go of the state: the
            // gradients move out instead of being copied, and the forward
            // values are kept as the next run's buffers.
            Ok(mut state) => {
                let grads = std::mem::take(&mut state.grads)
                    .into_iter()
                    .map(OnceLock::into_inner)
                    .collect();
                let out = state.output(grads);
                for (i, b) in bufs.fwd.iter_mut().enumerate() {
                    if self.nodes[i].op.reuses_buffer() {
                        if let Some(t) = state.fwd[i].take() {
                            *b = t.into_data();
                        }
                    }
                }
                bufs.feeds
                    .resize_with(self.lookups.len(), RowsFeedBuffers::default);
                for (&node, b) in self.lookups.iter().zip(&mut bufs.feeds) {
                    if let Some(f) = state.rows[node].take() {
                        *b = RowsFeedBuffers {
                            rows: match f.rows {
                                FeedRows::Tensor(t) => t.into_data(),
                                // Dropped: the replies' owner takes their
                                // buffers back.
                                FeedRows::Wire(_) => Vec::new(),
                            },
                            index: f.index,
                            offsets: f.offsets,
                        };
                    }
                }
                out
            }
            Err(state) => {
                let grads = state.grads.iter().map(|g| g.get().cloned()).collect();
                state.output(grads)
            }
        }
    }
}

/// Output buffers one run leaves for the next: a node's output has the
/// same size from one training step to the next, so a run that writes
/// into the previous run's buffer neither allocates nor faults in fresh
/// pages. Empty buffers (the default) make a run allocate as usual.
#[derive(Debug, Default)]
pub struct RunBuffers {
    /// By node: its last forward value's elements.
    fwd: Vec<Vec<f32>>,
    /// By node: a buffer for its gradient (rows gradients of lookups,
    /// given back with [`RunBuffers::give_back`]).
    grads: Vec<Vec<f32>>,
    /// By lookup slot: the buffers of its last rows feed.
    feeds: Vec<RowsFeedBuffers>,
}

/// The buffers of a [`LookupFeed::Rows`](crate::LookupFeed::Rows), kept
/// from a run for the next step's feed to be built in (contents are
/// stale; only the allocations are meant to be reused).
#[derive(Debug, Default)]
pub struct RowsFeedBuffers {
    /// The rows' elements.
    pub rows: Vec<f32>,
    /// Per occurrence, its row.
    pub index: Vec<u32>,
    /// Ragged per-example offsets.
    pub offsets: Vec<u32>,
}

impl RunBuffers {
    /// Keep the rows gradients of `graph`'s lookups, from a run's
    /// [`RunOutput::lookup_grads`], for the next run to write into.
    pub fn give_back(&mut self, graph: &Graph, lookup_grads: Vec<LookupGrad>) {
        self.grads.resize_with(graph.nodes.len(), Vec::new);
        for (&node, g) in graph.lookups.iter().zip(lookup_grads) {
            if let LookupGrad::Rows(t) = g {
                self.grads[node] = t.into_data();
            }
        }
    }

    /// Take the buffers of lookup slot `slot`'s rows feed of the last run
    /// (empty ones when that run had none, or failed).
    pub fn take_rows_feed(&mut self, slot: usize) -> RowsFeedBuffers {
        self.feeds
            .get_mut(slot)
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

impl Op {
    /// Whether the op's forward kernel writes into a kept buffer.
    fn reuses_buffer(&self) -> bool {
        matches!(self, Op::EmbeddingLookup { .. } | Op::AddN | Op::Concat)
    }
}

struct RowsFeed {
    rows: FeedRows,
    index: Vec<u32>,
    offsets: Vec<u32>,
}

/// The unique rows of a rows feed.
enum FeedRows {
    Tensor(Tensor),
    Wire(WireRows),
}

impl FeedRows {
    fn source(&self) -> &dyn RowSource {
        match self {
            FeedRows::Tensor(t) => t,
            FeedRows::Wire(w) => w,
        }
    }

    fn count(&self) -> usize {
        self.source().shape2().0
    }

    fn shape(&self) -> Vec<usize> {
        let (u, d) = self.source().shape2();
        vec![u, d]
    }
}

/// The values of one run. Each slot is written once (by the task that owns
/// it) and read by later tasks; `OnceLock` gives the happens-before edge.
struct RunState {
    graph: Arc<Graph>,
    backward: bool,
    fwd: Vec<OnceLock<Tensor>>,
    probs: OnceLock<Tensor>,
    rows: Vec<Option<RowsFeed>>,
    contrib: Vec<Vec<OnceLock<Tensor>>>,
    grads: Vec<OnceLock<Tensor>>,
    error: OnceLock<GraphError>,
    /// By node: the buffer its forward kernel writes into, taken once by
    /// the node's own task (see [`RunBuffers`]).
    spare_fwd: Vec<Mutex<Vec<f32>>>,
    /// By node: the buffer its gradient is written into, likewise.
    spare_grads: Vec<Mutex<Vec<f32>>>,
}

/// Take node `i`'s buffer out of `spares` (empty when there is none).
fn take_spare(spares: &[Mutex<Vec<f32>>], i: usize) -> Vec<f32> {
    spares
        .get(i)
        .map(|m| std::mem::take(&mut *m.lock().unwrap_or_else(|e| e.into_inner())))
        .unwrap_or_default()
}

fn shape(op: &'static str, detail: String) -> GraphError {
    GraphError::Shape { op, detail }
}

/// The batch size `B` of a run: set by the first batch-shaped feed (an
/// `Input` matrix, a lookup's offsets or a pooled lookup), checked against
/// every later one. Only variables may differ (and be broadcast).
#[derive(Default)]
struct Batch(Option<(usize, String)>);

impl Batch {
    /// Checks that `what` (a feed of node kind `op`) has `rows` examples.
    fn check(&mut self, op: &'static str, what: String, rows: usize) -> Result<(), GraphError> {
        match &self.0 {
            None => {
                self.0 = Some((rows, what));
                Ok(())
            }
            Some((b, _)) if *b == rows => Ok(()),
            Some((b, first)) => Err(shape(
                op,
                format!("{what} has {rows} examples, but {first} has {b}"),
            )),
        }
    }
}

impl RunState {
    /// Checks every feed against the graph and places it.
    fn new(graph: Arc<Graph>, feeds: GraphFeeds, backward: bool) -> Result<Self, GraphError> {
        let n = graph.nodes.len();
        let fwd: Vec<OnceLock<Tensor>> = (0..n).map(|_| OnceLock::new()).collect();
        let mut rows: Vec<Option<RowsFeed>> = (0..n).map(|_| None).collect();
        let mut batch = Batch::default();

        if feeds.inputs.len() != graph.inputs.len() {
            return Err(GraphError::MissingFeed(format!(
                "{} inputs expected, {} given",
                graph.inputs.len(),
                feeds.inputs.len()
            )));
        }
        for (slot, t) in feeds.inputs.into_iter().enumerate() {
            let node = graph.inputs[slot];
            let Op::Input { cols, .. } = graph.nodes[node].op else {
                unreachable!("inputs only lists Input nodes")
            };
            match t.as_matrix() {
                Some((b, c)) if c == cols => batch.check("Input", format!("input {slot}"), b)?,
                _ => {
                    return Err(shape(
                        "Input",
                        format!("slot {slot}: expected [B,{cols}], got {:?}", t.shape()),
                    ))
                }
            }
            let _ = fwd[node].set(t);
        }

        for (var, t) in feeds.dense {
            let Some(&(_, node)) = graph.vars.iter().find(|(v, _)| *v == var) else {
                return Err(GraphError::UnknownVariable(var));
            };
            let Op::Variable { shape: want, .. } = &graph.nodes[node].op else {
                unreachable!("vars only lists Variable nodes")
            };
            if t.shape() != want.as_slice() {
                return Err(shape(
                    "Variable",
                    format!("{var:?}: expected {want:?}, got {:?}", t.shape()),
                ));
            }
            if fwd[node].set(t).is_err() {
                return Err(GraphError::DuplicateFeed(format!("{var:?}")));
            }
        }
        if let Some(&(var, _)) = graph.vars.iter().find(|(_, i)| fwd[*i].get().is_none()) {
            return Err(GraphError::MissingFeed(format!("dense variable {var:?}")));
        }

        if feeds.lookups.len() != graph.lookups.len() {
            return Err(GraphError::MissingFeed(format!(
                "{} lookups expected, {} given",
                graph.lookups.len(),
                feeds.lookups.len()
            )));
        }
        for (slot, feed) in feeds.lookups.into_iter().enumerate() {
            let node = graph.lookups[slot];
            match (&graph.nodes[node].op, feed) {
                (
                    Op::EmbeddingLookup { dim, .. },
                    LookupFeed::Rows {
                        rows: r,
                        index,
                        offsets,
                    },
                ) => {
                    match r.as_matrix() {
                        Some((_, d)) if d == *dim => {}
                        _ => {
                            return Err(shape(
                                "EmbeddingLookup",
                                format!(
                                    "lookup {slot}: rows must be [U,{dim}], got {:?}",
                                    r.shape()
                                ),
                            ))
                        }
                    }
                    ops::check_ragged(slot, r.shape()[0], &index, &offsets)?;
                    let what = format!("lookup {slot} (offsets)");
                    batch.check("EmbeddingLookup", what, offsets.len() - 1)?;
                    rows[node] = Some(RowsFeed {
                        rows: FeedRows::Tensor(r),
                        index,
                        offsets,
                    });
                }
                (
                    Op::EmbeddingLookup { dim, .. },
                    LookupFeed::WireRows {
                        rows: r,
                        index,
                        offsets,
                    },
                ) => {
                    if r.dim() != *dim {
                        return Err(shape(
                            "EmbeddingLookup",
                            format!(
                                "lookup {slot}: rows must be [U,{dim}], got [{},{}]",
                                r.rows(),
                                r.dim()
                            ),
                        ));
                    }
                    ops::check_ragged(slot, r.rows(), &index, &offsets)?;
                    let what = format!("lookup {slot} (offsets)");
                    batch.check("EmbeddingLookup", what, offsets.len() - 1)?;
                    rows[node] = Some(RowsFeed {
                        rows: FeedRows::Wire(r),
                        index,
                        offsets,
                    });
                }
                (Op::Pooled { dim, .. }, LookupFeed::Pooled(t)) => {
                    match t.as_matrix() {
                        Some((b, d)) if d == *dim => {
                            batch.check("Pooled", format!("lookup {slot}"), b)?
                        }
                        _ => {
                            return Err(shape(
                                "Pooled",
                                format!("lookup {slot}: expected [B,{dim}], got {:?}", t.shape()),
                            ))
                        }
                    }
                    let _ = fwd[node].set(t);
                }
                (Op::EmbeddingLookup { .. }, _) => {
                    return Err(GraphError::WrongFeedForm {
                        index: slot,
                        expected: "rows",
                    })
                }
                _ => {
                    return Err(GraphError::WrongFeedForm {
                        index: slot,
                        expected: "pooled",
                    })
                }
            }
        }

        Ok(Self {
            contrib: graph
                .nodes
                .iter()
                .map(|nd| nd.inputs.iter().map(|_| OnceLock::new()).collect())
                .collect(),
            grads: (0..n).map(|_| OnceLock::new()).collect(),
            probs: OnceLock::new(),
            error: OnceLock::new(),
            spare_fwd: Vec::new(),
            spare_grads: Vec::new(),
            fwd,
            rows,
            backward,
            graph,
        })
    }

    fn plan(&self) -> &Plan {
        if self.backward {
            &self.graph.full
        } else {
            &self.graph.forward
        }
    }

    fn value(&self, node: usize) -> Result<&Tensor, GraphError> {
        self.fwd[node]
            .get()
            .ok_or_else(|| invalid(format!("value of node {node} missing")))
    }

    fn input(&self, node: usize, k: usize) -> Result<&Tensor, GraphError> {
        self.value(self.graph.nodes[node].inputs[k].index())
    }

    /// The feed of lookup node `i`.
    fn bags(&self, i: usize) -> Result<ops::Bags<'_>, GraphError> {
        let (Op::EmbeddingLookup { combiner, .. }, Some(f)) =
            (&self.graph.nodes[i].op, self.rows[i].as_ref())
        else {
            return Err(invalid("lookup rows missing"));
        };
        Ok(ops::Bags {
            rows: f.rows.source(),
            index: &f.index,
            offsets: &f.offsets,
            combiner: *combiner,
        })
    }

    fn forward(&self, i: usize) -> Result<(), GraphError> {
        let node = &self.graph.nodes[i];
        let out = match &node.op {
            Op::Input { .. } | Op::Variable { .. } | Op::Pooled { .. } => return Ok(()),
            // Pooled by the `AddN` that sums it (see `Graph::fused`).
            Op::EmbeddingLookup { .. } if self.graph.fused[i] => return Ok(()),
            Op::EmbeddingLookup { combiner, .. } => {
                let f = self.rows[i]
                    .as_ref()
                    .ok_or_else(|| invalid("lookup rows missing"))?;
                let out = take_spare(&self.spare_fwd, i);
                ops::combine_into(f.rows.source(), &f.index, &f.offsets, *combiner, out)
            }
            Op::MatMul => ops::matmul(self.input(i, 0)?, self.input(i, 1)?)?,
            Op::Add => ops::add(self.input(i, 0)?, self.input(i, 1)?)?,
            Op::Relu => ops::relu(self.input(i, 0)?),
            Op::AddN if self.graph.fused[i] => {
                let parts = node
                    .inputs
                    .iter()
                    .map(|x| self.bags(x.index()))
                    .collect::<Result<Vec<_>, _>>()?;
                ops::sum_combined_into(&parts, take_spare(&self.spare_fwd, i))?
            }
            Op::AddN => {
                let parts = (0..node.inputs.len())
                    .map(|k| self.input(i, k))
                    .collect::<Result<Vec<_>, _>>()?;
                ops::add_n(&parts, take_spare(&self.spare_fwd, i))?
            }
            Op::Concat => {
                let parts = (0..node.inputs.len())
                    .map(|k| self.input(i, k))
                    .collect::<Result<Vec<_>, _>>()?;
                ops::concat(&parts, take_spare(&self.spare_fwd, i))?
            }
            Op::SigmoidCrossEntropy => {
                let (loss, probs) =
                    ops::sigmoid_cross_entropy(self.input(i, 0)?, self.input(i, 1)?)?;
                let _ = self.probs.set(probs);
                loss
            }
        };
        let _ = self.fwd[i].set(out);
        Ok(())
    }

    /// The gradient of node `i`: 1 for the loss, else the sum of its
    /// consumers' contributions in a fixed order.
    ///
    /// A single contribution is borrowed, not copied. An `AddN` consumer
    /// stores one contribution (its own gradient) for all its inputs.
    fn gradient(&self, i: usize) -> Result<Cow<'_, Tensor>, GraphError> {
        if i == self.graph.loss {
            return Ok(Cow::Owned(Tensor::scalar(1.0)));
        }
        let mut acc: Option<Cow<'_, Tensor>> = None;
        for &(c, k) in &self.graph.grad_sources[i] {
            let k = if matches!(self.graph.nodes[c].op, Op::AddN) {
                0
            } else {
                k
            };
            let g = self.contrib[c][k]
                .get()
                .ok_or_else(|| invalid(format!("gradient from node {c} missing")))?;
            match &mut acc {
                None => acc = Some(Cow::Borrowed(g)),
                Some(a) => {
                    if a.shape() != g.shape() {
                        return Err(shape("gradient", "contributions differ in shape".into()));
                    }
                    a.to_mut()
                        .data_mut()
                        .iter_mut()
                        .zip(g.data())
                        .for_each(|(x, y)| *x += y);
                }
            }
        }
        acc.ok_or_else(|| invalid(format!("node {i} has no gradient source")))
    }

    fn backward(&self, i: usize) -> Result<(), GraphError> {
        let g = self.gradient(i)?;
        let graph = &self.graph;
        let node = &graph.nodes[i];
        let wants = |k: usize| graph.needs_grad[node.inputs[k].index()];
        let put = |k: usize, t: Tensor| {
            let _ = self.contrib[i][k].set(t);
        };
        match &node.op {
            Op::Input { .. } => {}
            Op::Variable { .. } | Op::Pooled { .. } => {
                let _ = self.grads[i].set(g.into_owned());
            }
            Op::EmbeddingLookup { combiner, .. } => {
                let f = self.rows[i]
                    .as_ref()
                    .ok_or_else(|| invalid("lookup rows missing"))?;
                let rg = ops::scatter_pooled_grad_into(
                    &g,
                    &f.index,
                    &f.offsets,
                    f.rows.count(),
                    *combiner,
                    take_spare(&self.spare_grads, i),
                )?;
                let _ = self.grads[i].set(rg);
            }
            Op::MatMul => {
                let (a, b) = (self.input(i, 0)?, self.input(i, 1)?);
                if wants(0) {
                    put(0, ops::matmul_grad_lhs(&g, b)?);
                }
                if wants(1) {
                    put(1, ops::matmul_grad_rhs(a, &g)?);
                }
            }
            Op::Add => {
                let (a, b) = (self.input(i, 0)?, self.input(i, 1)?);
                if wants(1) {
                    put(1, ops::add_grad_rhs(a, b, &g)?);
                }
                if wants(0) {
                    put(0, g.into_owned());
                }
            }
            Op::AddN => {
                // Every input's contribution is `g`; `gradient` reads it
                // from position 0 for all of them.
                put(0, g.into_owned());
            }
            Op::Relu => {
                if wants(0) {
                    put(0, ops::relu_grad(self.value(i)?, &g));
                }
            }
            Op::Concat => {
                let mut start = 0;
                for k in 0..node.inputs.len() {
                    let w = self.input(i, k)?.shape()[1];
                    if wants(k) {
                        put(k, ops::concat_grad(&g, start, w)?);
                    }
                    start += w;
                }
            }
            Op::SigmoidCrossEntropy => {
                let probs = self
                    .probs
                    .get()
                    .ok_or_else(|| invalid("probabilities missing"))?;
                if wants(0) {
                    put(
                        0,
                        ops::sigmoid_cross_entropy_grad(probs, self.input(i, 1)?, g.data()[0]),
                    );
                }
            }
        }
        Ok(())
    }

    /// Pooling (or scattering the gradient of) lookup node `i`'s rows.
    fn pooling_cost(&self, i: usize) -> u64 {
        match (&self.graph.nodes[i].op, &self.rows[i]) {
            (Op::EmbeddingLookup { dim, .. }, Some(f)) => (f.index.len() as u64) * (*dim as u64),
            _ => 0,
        }
    }

    fn input_elems(&self, i: usize) -> u64 {
        let node = &self.graph.nodes[i];
        (0..node.inputs.len())
            .filter_map(|k| self.input(i, k).ok())
            .map(|t| t.len() as u64)
            .sum()
    }

    /// The run's result; `grads` holds every node's gradient (taken from
    /// [`RunState::grads`]).
    fn output(&self, mut grads: Vec<Option<Tensor>>) -> Result<RunOutput, GraphError> {
        if let Some(e) = self.error.get() {
            return Err(e.clone());
        }
        let graph = &self.graph;
        let loss = self.value(graph.loss)?.data()[0];
        let probs = self
            .probs
            .get()
            .ok_or_else(|| invalid("probabilities missing"))?
            .data()
            .to_vec();
        let (mut dense_grads, mut lookup_grads) = (Vec::new(), Vec::new());
        if self.backward {
            for &(var, node) in &graph.vars {
                let g = match grads[node].take() {
                    Some(g) => g,
                    None => Tensor::zeros(self.value(node)?.shape().to_vec())?,
                };
                dense_grads.push((var, g));
            }
            for &node in &graph.lookups {
                let g = grads[node].take();
                lookup_grads.push(match (&graph.nodes[node].op, &self.rows[node]) {
                    (Op::EmbeddingLookup { .. }, Some(f)) => LookupGrad::Rows(match g {
                        Some(g) => g,
                        None => Tensor::zeros(f.rows.shape())?,
                    }),
                    _ => LookupGrad::Pooled(match g {
                        Some(g) => g,
                        None => Tensor::zeros(self.value(node)?.shape().to_vec())?,
                    }),
                });
            }
        }
        Ok(RunOutput {
            loss,
            probs,
            dense_grads,
            lookup_grads,
        })
    }
}

impl TaskSet for RunState {
    fn len(&self) -> usize {
        self.plan().successors.len()
    }

    fn successors(&self, task: usize) -> &[u32] {
        &self.plan().successors[task]
    }

    fn predecessors(&self, task: usize) -> u32 {
        self.plan().predecessors[task]
    }

    fn cost(&self, task: usize) -> u64 {
        let n = self.graph.nodes.len();
        let (i, factor) = if task < n {
            (task, 1)
        } else {
            (self.graph.bwd_node[task - n], 2)
        };
        match &self.graph.nodes[i].op {
            Op::MatMul => match (self.input(i, 0), self.input(i, 1)) {
                (Ok(a), Ok(b)) => {
                    let (m, k) = a.as_matrix().unwrap_or((0, 0));
                    let cols = b.as_matrix().map_or(0, |(_, c)| c);
                    factor * 2 * (m as u64) * (k as u64) * (cols as u64)
                }
                _ => 0,
            },
            // A fused lookup's forward is done by its `AddN`.
            Op::EmbeddingLookup { .. } if factor == 1 && self.graph.fused[i] => 0,
            Op::EmbeddingLookup { .. } => self.pooling_cost(i),
            Op::AddN if factor == 1 && self.graph.fused[i] => {
                let inputs = &self.graph.nodes[i].inputs;
                inputs.iter().map(|x| self.pooling_cost(x.index())).sum()
            }
            _ => factor * self.input_elems(i),
        }
    }

    fn run(&self, task: usize) {
        if self.error.get().is_some() {
            return;
        }
        let n = self.graph.nodes.len();
        let r = if task < n {
            self.forward(task)
        } else {
            self.backward(self.graph.bwd_node[task - n])
        };
        if let Err(e) = r {
            let _ = self.error.set(e);
        }
    }

    fn panicked(&self, task: usize) {
        let n = self.graph.nodes.len();
        let node = if task < n {
            task
        } else {
            self.graph.bwd_node[task - n]
        };
        let _ = self.error.set(GraphError::KernelPanicked(node));
    }
}

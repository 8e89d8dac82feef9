//! The dataflow graph: ops, the builder and the autodiff plan ([`crate::run`]
//! runs it).

use crate::error::GraphError;
use crate::ops::Combiner;
use crate::tensor::Tensor;
use crate::wire_rows::WireRows;

/// The id of a variable stored on the parameter servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VarId(pub u32);

/// A node of a graph under construction or built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    /// The node's position in the graph (nodes are in topological order).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// An operation. Arities: leaves take no input; `MatMul`, `Add` and
/// `SigmoidCrossEntropy` take two; `Relu` one; `Concat` one or more.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Op {
    /// A fed dense matrix `[B, cols]` (numeric features, labels); no gradient.
    Input {
        /// Position in [`GraphFeeds::inputs`].
        slot: usize,
        /// The column count.
        cols: usize,
    },
    /// A dense variable, fed from a pull; its gradient is returned.
    Variable {
        /// The variable.
        var: VarId,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// Embedding lookup done on the worker (`star_server`): fed unique rows
    /// `[U, dim]` and a ragged key layout, outputs `[B, dim]`; the gradient is
    /// returned per unique row.
    EmbeddingLookup {
        /// The embedding variable.
        var: VarId,
        /// Position in [`GraphFeeds::lookups`].
        slot: usize,
        /// The row width.
        dim: usize,
        /// How rows of one example are pooled.
        combiner: Combiner,
    },
    /// Embedding lookup done on the PS (`star_server_lite`): fed the pooled
    /// `[B, dim]` tensor; the gradient w.r.t. it is returned.
    Pooled {
        /// The embedding variable.
        var: VarId,
        /// Position in [`GraphFeeds::lookups`].
        slot: usize,
        /// The row width.
        dim: usize,
        /// The combiner the PS applied.
        combiner: Combiner,
    },
    /// `[M,K] x [K,N]`.
    MatMul,
    /// Elementwise sum; the right operand may be a bias `[N]` or `[1,N]`.
    Add,
    /// Elementwise sum of two or more tensors of one shape (TensorFlow's
    /// `add_n`). Every input's gradient is the output's, which the inputs
    /// read in place rather than as copies.
    AddN,
    /// `max(x, 0)`.
    Relu,
    /// Concatenation of matrices along columns.
    Concat,
    /// Mean sigmoid cross-entropy of logits `[B,1]` against labels `[B,1]`;
    /// outputs the loss `[1]` and keeps the probabilities.
    SigmoidCrossEntropy,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "Input",
            Op::Variable { .. } => "Variable",
            Op::EmbeddingLookup { .. } => "EmbeddingLookup",
            Op::Pooled { .. } => "Pooled",
            Op::MatMul => "MatMul",
            Op::Add => "Add",
            Op::AddN => "AddN",
            Op::Relu => "Relu",
            Op::Concat => "Concat",
            Op::SigmoidCrossEntropy => "SigmoidCrossEntropy",
        }
    }

    fn arity_ok(&self, n: usize) -> bool {
        match self {
            Op::Input { .. }
            | Op::Variable { .. }
            | Op::EmbeddingLookup { .. }
            | Op::Pooled { .. } => n == 0,
            Op::MatMul | Op::Add | Op::SigmoidCrossEntropy => n == 2,
            Op::Relu => n == 1,
            Op::Concat => n >= 1,
            Op::AddN => n >= 2,
        }
    }

    /// Whether the op is a leaf whose gradient the run returns.
    fn is_param(&self) -> bool {
        matches!(
            self,
            Op::Variable { .. } | Op::EmbeddingLookup { .. } | Op::Pooled { .. }
        )
    }
}

/// One node: an op and its inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The op.
    pub op: Op,
    /// The inputs, all earlier in the graph.
    pub inputs: Vec<NodeId>,
}

/// Builds a graph node by node; nodes are numbered in insertion order, which
/// is therefore a topological order.
#[derive(Debug, Default, Clone)]
pub struct GraphBuilder {
    pub(crate) nodes: Vec<Node>,
}

impl GraphBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds any node; arity and input ids are checked by [`GraphBuilder::build`].
    pub fn node(&mut self, op: Op, inputs: Vec<NodeId>) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(Node { op, inputs });
        id
    }

    /// A fed input `[B, cols]`.
    pub fn input(&mut self, slot: usize, cols: usize) -> NodeId {
        self.node(Op::Input { slot, cols }, vec![])
    }

    /// A dense variable.
    pub fn variable(&mut self, var: VarId, shape: Vec<usize>) -> NodeId {
        self.node(Op::Variable { var, shape }, vec![])
    }

    /// An embedding lookup.
    pub fn lookup(&mut self, var: VarId, slot: usize, dim: usize, combiner: Combiner) -> NodeId {
        self.node(
            Op::EmbeddingLookup {
                var,
                slot,
                dim,
                combiner,
            },
            vec![],
        )
    }

    /// `a x b`.
    pub fn matmul(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.node(Op::MatMul, vec![a, b])
    }

    /// `a + b` (with bias broadcast).
    pub fn add(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.node(Op::Add, vec![a, b])
    }

    /// `parts[0] + parts[1] + ...`, all of one shape (at least two parts).
    pub fn add_n(&mut self, parts: Vec<NodeId>) -> NodeId {
        self.node(Op::AddN, parts)
    }

    /// `relu(x)`.
    pub fn relu(&mut self, x: NodeId) -> NodeId {
        self.node(Op::Relu, vec![x])
    }

    /// Column concatenation.
    pub fn concat(&mut self, parts: Vec<NodeId>) -> NodeId {
        self.node(Op::Concat, parts)
    }

    /// The loss node.
    pub fn sigmoid_cross_entropy(&mut self, logits: NodeId, labels: NodeId) -> NodeId {
        self.node(Op::SigmoidCrossEntropy, vec![logits, labels])
    }

    /// Checks the graph and plans its forward and backward passes. `loss`
    /// must be a `SigmoidCrossEntropy` node.
    pub fn build(self, loss: NodeId) -> Result<Graph, GraphError> {
        Graph::new(self.nodes, loss)
    }
}

/// What the runtime feeds for one lookup.
#[derive(Debug, Clone, PartialEq)]
pub enum LookupFeed {
    /// `star_server`: the unique rows `[U,D]`, per key occurrence the row it
    /// reads, and ragged offsets (`B+1` entries) of occurrences per example.
    Rows {
        /// Unique rows `[U, D]`.
        rows: Tensor,
        /// Per key occurrence, its row in `rows`.
        index: Vec<u32>,
        /// `B+1` offsets into `index`.
        offsets: Vec<u32>,
    },
    /// [`LookupFeed::Rows`] with the rows read in place from pull replies
    /// instead of a tensor.
    WireRows {
        /// Unique rows `[U, D]`.
        rows: WireRows,
        /// Per key occurrence, its row in `rows`.
        index: Vec<u32>,
        /// `B+1` offsets into `index`.
        offsets: Vec<u32>,
    },
    /// `star_server_lite`: the post-combiner pooled tensor `[B,D]`.
    Pooled(Tensor),
}

/// The gradient of one lookup.
#[derive(Debug, Clone, PartialEq)]
pub enum LookupGrad {
    /// `[U,D]`, summed per unique row, combiner applied.
    Rows(Tensor),
    /// `[B,D]`, w.r.t. the pooled tensor.
    Pooled(Tensor),
}

/// Everything one run of a graph reads.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphFeeds {
    /// One matrix per `Input` slot.
    pub inputs: Vec<Tensor>,
    /// One tensor per `Variable`, any order.
    pub dense: Vec<(VarId, Tensor)>,
    /// One feed per lookup slot.
    pub lookups: Vec<LookupFeed>,
}

/// What one run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutput {
    /// The mean loss.
    pub loss: f32,
    /// The predicted probabilities, one per example.
    pub probs: Vec<f32>,
    /// Per `Variable` (graph order), its gradient; empty for forward-only runs.
    pub dense_grads: Vec<(VarId, Tensor)>,
    /// Per lookup slot, its gradient; empty for forward-only runs.
    pub lookup_grads: Vec<LookupGrad>,
}

/// The task DAG of one kind of run.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) successors: Vec<Vec<u32>>,
    pub(crate) predecessors: Vec<u32>,
}

impl Plan {
    fn new(successors: Vec<Vec<u32>>) -> Self {
        let mut predecessors = vec![0u32; successors.len()];
        for s in successors.iter().flatten() {
            predecessors[*s as usize] += 1;
        }
        Self {
            successors,
            predecessors,
        }
    }
}

/// A checked graph with its forward and forward+backward plans.
#[derive(Debug, Clone)]
pub struct Graph {
    pub(crate) nodes: Vec<Node>,
    pub(crate) loss: usize,
    /// Per node, whether it has a backward task.
    pub(crate) needs_grad: Vec<bool>,
    /// Per node, the `(consumer, input position)` pairs whose gradient
    /// contributions sum to its gradient, in a fixed order.
    pub(crate) grad_sources: Vec<Vec<(usize, usize)>>,
    /// Backward task -> node.
    pub(crate) bwd_node: Vec<usize>,
    pub(crate) forward: Plan,
    pub(crate) full: Plan,
    pub(crate) inputs: Vec<usize>,
    pub(crate) vars: Vec<(VarId, usize)>,
    pub(crate) lookups: Vec<usize>,
    /// Per node: an `AddN` whose inputs are all `EmbeddingLookup`s that
    /// feed nothing else (the `lr` model's fields), or one of those
    /// lookups. Such an `AddN` pools its lookups' rows straight into its
    /// sum, and the lookups have no forward value of their own: the `F`
    /// pooled `[B,D]` tensors are never written and read back.
    pub(crate) fused: Vec<bool>,
}

pub(crate) fn invalid(msg: impl Into<String>) -> GraphError {
    GraphError::InvalidGraph(msg.into())
}

/// Puts `node` into `by_slot[slot]`, rejecting duplicates.
fn claim_slot(
    by_slot: &mut Vec<Option<usize>>,
    slot: usize,
    node: usize,
    what: &str,
) -> Result<(), GraphError> {
    if slot > 1 << 20 {
        return Err(invalid(format!("{what} slot {slot} too large")));
    }
    if by_slot.len() <= slot {
        by_slot.resize(slot + 1, None);
    }
    if by_slot[slot].replace(node).is_some() {
        return Err(invalid(format!("{what} slot {slot} used twice")));
    }
    Ok(())
}

fn dense_slots(by_slot: Vec<Option<usize>>, what: &str) -> Result<Vec<usize>, GraphError> {
    by_slot
        .into_iter()
        .enumerate()
        .map(|(s, n)| n.ok_or_else(|| invalid(format!("{what} slot {s} has no node"))))
        .collect()
}

impl Graph {
    fn new(nodes: Vec<Node>, loss: NodeId) -> Result<Self, GraphError> {
        let n = nodes.len();
        if n > u32::MAX as usize / 2 {
            return Err(invalid("too many nodes"));
        }
        let loss = loss.index();
        match nodes.get(loss) {
            Some(Node {
                op: Op::SigmoidCrossEntropy,
                ..
            }) => {}
            _ => return Err(invalid("the loss node must be a SigmoidCrossEntropy")),
        }
        let (mut inputs, mut lookups) = (Vec::new(), Vec::new());
        let mut vars = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            if !node.op.arity_ok(node.inputs.len()) {
                return Err(invalid(format!(
                    "node {i}: {} cannot take {} inputs",
                    node.op.name(),
                    node.inputs.len()
                )));
            }
            if node.inputs.iter().any(|x| x.index() >= i) {
                return Err(invalid(format!("node {i}: input is not an earlier node")));
            }
            match &node.op {
                Op::Input { slot, .. } => claim_slot(&mut inputs, *slot, i, "input")?,
                Op::EmbeddingLookup { slot, .. } | Op::Pooled { slot, .. } => {
                    claim_slot(&mut lookups, *slot, i, "lookup")?
                }
                Op::Variable { var, .. } => {
                    if vars.iter().any(|(v, _)| v == var) {
                        return Err(invalid(format!("variable {var:?} has two nodes")));
                    }
                    vars.push((*var, i));
                }
                _ => {}
            }
        }
        let inputs = dense_slots(inputs, "input")?;
        let lookups = dense_slots(lookups, "lookup")?;

        // Which nodes the loss depends on, and which depend on a parameter.
        let mut reaches_loss = vec![false; n];
        reaches_loss[loss] = true;
        for i in (0..n).rev() {
            if reaches_loss[i] {
                for x in &nodes[i].inputs {
                    reaches_loss[x.index()] = true;
                }
            }
        }
        let mut requires_grad = vec![false; n];
        for i in 0..n {
            requires_grad[i] =
                nodes[i].op.is_param() || nodes[i].inputs.iter().any(|x| requires_grad[x.index()]);
        }
        let needs_grad: Vec<bool> = (0..n)
            .map(|i| requires_grad[i] && reaches_loss[i])
            .collect();

        let mut grad_sources = vec![Vec::new(); n];
        let mut consumers: Vec<Vec<u32>> = vec![Vec::new(); n];
        for (c, node) in nodes.iter().enumerate() {
            for (k, x) in node.inputs.iter().enumerate() {
                let x = x.index();
                if needs_grad[c] && needs_grad[x] {
                    grad_sources[x].push((c, k));
                }
                if !consumers[x].contains(&(c as u32)) {
                    consumers[x].push(c as u32);
                }
            }
        }
        let mut fused = vec![false; n];
        for (c, node) in nodes.iter().enumerate() {
            let sole_lookup = |x: &NodeId| {
                matches!(nodes[x.index()].op, Op::EmbeddingLookup { .. })
                    && consumers[x.index()] == [c as u32]
            };
            if matches!(node.op, Op::AddN) && node.inputs.iter().all(sole_lookup) {
                fused[c] = true;
                node.inputs.iter().for_each(|x| fused[x.index()] = true);
            }
        }
        let mut bwd_task = vec![None; n];
        let mut bwd_node = Vec::new();
        for i in (0..n).filter(|&i| needs_grad[i]) {
            bwd_task[i] = Some((n + bwd_node.len()) as u32);
            bwd_node.push(i);
        }
        let forward = Plan::new(consumers.clone());
        let mut full_succ = consumers;
        full_succ.resize(n + bwd_node.len(), Vec::new());
        if let Some(t) = bwd_task[loss] {
            full_succ[loss].push(t);
        }
        for (i, sources) in grad_sources.iter().enumerate() {
            let Some(t) = bwd_task[i] else { continue };
            for &(c, _) in sources {
                let ct = bwd_task[c].expect("a gradient source has a backward task") as usize;
                if !full_succ[ct].contains(&t) {
                    full_succ[ct].push(t);
                }
            }
        }
        Ok(Self {
            full: Plan::new(full_succ),
            forward,
            nodes,
            loss,
            needs_grad,
            grad_sources,
            bwd_node,
            inputs,
            vars,
            lookups,
            fused,
        })
    }

    /// The nodes, in topological order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The loss node.
    pub fn loss(&self) -> NodeId {
        NodeId(self.loss as u32)
    }

    /// The number of `Input` slots.
    pub fn num_inputs(&self) -> usize {
        self.inputs.len()
    }

    /// The dense variables, in graph order, with their shapes.
    pub fn dense_vars(&self) -> impl Iterator<Item = (VarId, &[usize])> + '_ {
        self.vars.iter().map(|&(v, i)| match &self.nodes[i].op {
            Op::Variable { shape, .. } => (v, shape.as_slice()),
            _ => unreachable!("vars only lists Variable nodes"),
        })
    }

    /// The lookup node of each lookup slot.
    pub fn lookup_nodes(&self) -> impl Iterator<Item = &Op> + '_ {
        self.lookups.iter().map(|&i| &self.nodes[i].op)
    }

    /// The same graph with every `EmbeddingLookup` replaced by a `Pooled`
    /// node fed by the PS (the `star_server_lite` rewrite).
    pub(crate) fn with_pooled_lookups(&self) -> Result<Self, GraphError> {
        let nodes = self
            .nodes
            .iter()
            .map(|n| match n.op {
                Op::EmbeddingLookup {
                    var,
                    slot,
                    dim,
                    combiner,
                } => Node {
                    op: Op::Pooled {
                        var,
                        slot,
                        dim,
                        combiner,
                    },
                    inputs: vec![],
                },
                _ => n.clone(),
            })
            .collect();
        Self::new(nodes, self.loss())
    }
}

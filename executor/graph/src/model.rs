//! The two models: logistic regression (`lr`) and wide & deep (`wdl`).

use std::sync::Arc;

use crate::error::GraphError;
use crate::graph::{Graph, GraphBuilder, NodeId, VarId};
use crate::ops::Combiner;

/// Which model to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// Logistic regression: one sum-pooled hash embedding per categorical field
    /// (added together) and the numeric fields, as TensorFlow's linear model.
    Lr,
    /// Wide & deep.
    Wdl,
}

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelSpec {
    /// The model.
    pub kind: ModelKind,
    /// Numeric fields per example (13 for Criteo).
    pub num_dense: usize,
    /// Categorical fields per example (26 for Criteo).
    pub num_fields: usize,
    /// Embedding width `D` (`lr`'s per-field embeddings and `wdl`'s deep embeddings).
    pub embedding_dim: usize,
    /// `wdl`'s hidden layer widths; ignored by `lr`.
    pub hidden: Vec<usize>,
}

impl ModelSpec {
    /// Criteo-shaped `lr` with embedding width `dim`.
    pub fn lr(dim: usize) -> Self {
        Self {
            kind: ModelKind::Lr,
            num_dense: 13,
            num_fields: 26,
            embedding_dim: dim,
            hidden: Vec::new(),
        }
    }

    /// Criteo-shaped `wdl` with embedding width `dim` and hidden layers `[64, 32]`.
    pub fn wdl(dim: usize) -> Self {
        Self {
            kind: ModelKind::Wdl,
            num_dense: 13,
            num_fields: 26,
            embedding_dim: dim,
            hidden: vec![64, 32],
        }
    }
}

/// How the PS initialises a variable (it draws with its own seed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// Uniform in `[-scale, scale]`.
    Uniform {
        /// The half-width.
        scale: f32,
    },
    /// Normal with mean 0.
    Normal {
        /// The standard deviation.
        std: f32,
    },
    /// Glorot/Xavier uniform for a `[fan_in, fan_out]` matrix:
    /// `scale = sqrt(6 / (fan_in + fan_out))`.
    GlorotUniform,
}

/// The kind and shape of a variable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum VarKind {
    /// A dense tensor pulled whole.
    Dense {
        /// Its shape.
        shape: Vec<usize>,
    },
    /// A hash embedding table of rows of width `dim`, keyed by `u64`.
    Embedding {
        /// The row width.
        dim: usize,
    },
}

/// One variable of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct VarSpec {
    /// Its id (dense, from 0, in declaration order).
    pub id: VarId,
    /// Its name (`lr_emb_0`, `wide_w`, `emb_3`, `mlp_w0`, ...).
    pub name: String,
    /// Its kind and shape.
    pub kind: VarKind,
    /// How the PS initialises it.
    pub init: Init,
}

/// One embedding lookup of a model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LookupSpec {
    /// Its position in [`crate::StepFeeds::lookups`].
    pub index: usize,
    /// The embedding variable it reads.
    pub var: VarId,
    /// The categorical fields whose keys it looks up (all keys of these fields
    /// of one example form that example's bag).
    pub fields: Vec<usize>,
    /// How the bag is pooled.
    pub combiner: Combiner,
}

/// A built model: its variables, its lookups and its graph.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    vars: Vec<VarSpec>,
    lookups: Vec<LookupSpec>,
    graph: Arc<Graph>,
}

/// `Input` slot of the numeric features `[B, num_dense]`.
pub const NUMERIC_SLOT: usize = 0;
/// `Input` slot of the labels `[B, 1]`.
pub const LABELS_SLOT: usize = 1;

/// Collects variables and lookups while the graph is built.
struct Decl {
    g: GraphBuilder,
    vars: Vec<VarSpec>,
    lookups: Vec<LookupSpec>,
}

impl Decl {
    fn declare(&mut self, name: String, kind: VarKind, init: Init) -> VarId {
        let id = VarId(self.vars.len() as u32);
        self.vars.push(VarSpec {
            id,
            name,
            kind,
            init,
        });
        id
    }

    fn dense(&mut self, name: impl Into<String>, shape: Vec<usize>, init: Init) -> NodeId {
        let id = self.declare(
            name.into(),
            VarKind::Dense {
                shape: shape.clone(),
            },
            init,
        );
        self.g.variable(id, shape)
    }

    fn embedding(
        &mut self,
        name: impl Into<String>,
        dim: usize,
        init: Init,
        fields: Vec<usize>,
        combiner: Combiner,
    ) -> NodeId {
        let var = self.declare(name.into(), VarKind::Embedding { dim }, init);
        let index = self.lookups.len();
        self.lookups.push(LookupSpec {
            index,
            var,
            fields,
            combiner,
        });
        self.g.lookup(var, index, dim, combiner)
    }

    /// `x W + b` with a fresh `[in, out]` weight and `[out]` bias.
    fn linear(&mut self, x: NodeId, name: &str, fan_in: usize, out: usize, init: Init) -> NodeId {
        let w = self.dense(format!("{name}_w"), vec![fan_in, out], init);
        let b = self.dense(format!("{name}_b"), vec![out], Init::Zeros);
        let y = self.g.matmul(x, w);
        self.g.add(y, b)
    }
}

/// The largest accepted width or field count (`embedding_dim`, ...): specs
/// are configuration, but a typo should not allocate terabytes.
pub const MAX_WIDTH: usize = 1 << 16;

impl Model {
    /// Builds the model described by `spec`.
    pub fn build(spec: ModelSpec) -> Result<Self, GraphError> {
        let bad = |what: &str| Err(GraphError::InvalidGraph(format!("model spec: {what}")));
        let dims_ok = |d: usize| d > 0 && d <= MAX_WIDTH;
        if !dims_ok(spec.num_dense) {
            return bad("num_dense must be in 1..=65536");
        }
        if !dims_ok(spec.num_fields) {
            return bad("num_fields must be in 1..=65536");
        }
        if !dims_ok(spec.embedding_dim) {
            return bad("embedding_dim must be in 1..=65536");
        }
        if spec.kind == ModelKind::Wdl && !spec.hidden.iter().all(|&h| dims_ok(h)) {
            return bad("hidden widths must be in 1..=65536");
        }
        let mut m = Decl {
            g: GraphBuilder::new(),
            vars: Vec::new(),
            lookups: Vec::new(),
        };
        let numeric = m.g.input(NUMERIC_SLOT, spec.num_dense);
        let labels = m.g.input(LABELS_SLOT, 1);
        let all_fields: Vec<usize> = (0..spec.num_fields).collect();
        let (d, nd) = (spec.embedding_dim, spec.num_dense);
        let logit = match spec.kind {
            ModelKind::Lr => {
                // One variable per categorical column, as TensorFlow's linear
                // model declares them: each field's keys are sum-pooled in its
                // own table and the fields' pooled vectors are added.
                let mut parts: Vec<NodeId> = (0..spec.num_fields)
                    .map(|f| {
                        m.embedding(
                            format!("lr_emb_{f}"),
                            d,
                            Init::Normal { std: 0.01 },
                            vec![f],
                            Combiner::Sum,
                        )
                    })
                    .collect();
                // TensorFlow's linear model sums the columns with `add_n`.
                let e = if parts.len() == 1 {
                    parts.remove(0)
                } else {
                    m.g.add_n(parts)
                };
                let x = m.g.concat(vec![numeric, e]);
                m.linear(x, "lr", nd + d, 1, Init::Zeros)
            }
            ModelKind::Wdl => {
                let wide_e = m.embedding("wide_emb", 1, Init::Zeros, all_fields, Combiner::Sum);
                let wide_x = m.linear(numeric, "wide", nd, 1, Init::Zeros);
                let wide = m.g.add(wide_x, wide_e);
                let mut parts = vec![numeric];
                for f in 0..spec.num_fields {
                    parts.push(m.embedding(
                        format!("emb_{f}"),
                        d,
                        Init::Uniform { scale: 0.05 },
                        vec![f],
                        Combiner::Mean,
                    ));
                }
                let mut h = m.g.concat(parts);
                let mut width = nd + spec.num_fields * d;
                for (l, &out) in spec.hidden.iter().enumerate() {
                    let y = m.linear(h, &format!("mlp{l}"), width, out, Init::GlorotUniform);
                    h = m.g.relu(y);
                    width = out;
                }
                let deep = m.linear(h, "out", width, 1, Init::GlorotUniform);
                m.g.add(wide, deep)
            }
        };
        let loss = m.g.sigmoid_cross_entropy(logit, labels);
        let graph = Arc::new(m.g.build(loss)?);
        Ok(Self {
            spec,
            vars: m.vars,
            lookups: m.lookups,
            graph,
        })
    }

    /// The spec it was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Every variable, in id order.
    pub fn variables(&self) -> &[VarSpec] {
        &self.vars
    }

    /// Every lookup, in index order.
    pub fn lookups(&self) -> &[LookupSpec] {
        &self.lookups
    }

    /// The whole graph, lookups done on the worker.
    pub fn graph(&self) -> &Arc<Graph> {
        &self.graph
    }
}

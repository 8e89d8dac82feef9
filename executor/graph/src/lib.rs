//! The worker-side compute of starwire: a dataflow graph of tensor ops with
//! reverse-mode gradients, a lock-free executor, the two models (`lr` and
//! `wdl`) and their partitioning for the `star_server` and `star_server_lite`
//! protocols. Pure compute: no I/O, no clock, no other starwire crate.
//!
//! # The graph
//!
//! A [`Graph`] is a list of [`Node`]s in topological order, built with a
//! [`GraphBuilder`] and checked by [`GraphBuilder::build`] (arity, inputs
//! earlier than their consumer, one node per variable, dense input and lookup
//! slots, a [`Op::SigmoidCrossEntropy`] loss). Tensors are row-major `f32`
//! ([`Tensor`]). Leaves are fed per run ([`GraphFeeds`]): `Input` matrices,
//! dense `Variable`s pulled from the PS, and per lookup either unique rows
//! plus a ragged key layout ([`Op::EmbeddingLookup`]) or an already pooled
//! tensor ([`Op::Pooled`]). Every feed is checked before anything runs; a
//! missing, duplicate, misshapen or wrong-form feed, a key index past the
//! fed rows, or batch-shaped feeds (`Input` matrices, lookup offsets with
//! `B+1` entries, pooled lookups) that disagree on the batch size `B`, is a
//! [`GraphError`]. Only dense variables may be broadcast over the batch.
//!
//! # Autodiff
//!
//! Reverse mode, as a second set of tasks in the same DAG rather than as
//! extra graph nodes. Building the graph marks the nodes that both depend on a
//! parameter (a variable or lookup) and feed the loss; each gets a backward
//! task. The loss's backward task waits for the loss's forward task (so for
//! the whole forward pass it depends on) and seeds gradient 1; every other
//! backward task waits for the backward tasks of its consumers, sums their
//! contributions to it in a fixed order (consumer, then input position), and
//! writes its own contribution to each input that needs one. Leaves store
//! their gradient: the gradient itself for dense variables and pooled
//! lookups, and for row lookups the pooled gradient scattered back to the
//! unique rows (scaled by `1/count` for `Mean`, summed per row).
//!
//! # The executor
//!
//! [`Executor`] runs the task DAG with per-task atomic counts of unfinished
//! predecessors and lock-free `SegQueue`s (no global lock). With
//! `Executor::new(0)` everything runs inline on the calling thread,
//! run-to-completion (the reactor case). With `threads > 0`, a task whose
//! cost, computed from its actual inputs when it becomes ready, is at least
//! the handoff threshold ([`DEFAULT_HANDOFF_FLOPS`], about 1 MFLOP; see
//! [`Executor::with_threshold`]) is handed to a compute thread: in practice
//! the big `MatMul`s of `wdl`'s first layer and their gradients at batch
//! sizes in the hundreds. Everything else (element-wise ops, concats,
//! lookups, the loss, small matmuls) runs inline on the calling thread. Every
//! kernel is single-threaded and sums in a fixed order, and gradient
//! contributions are summed in a fixed order, so results are bit-identical
//! whatever the thread count or interleaving.
//!
//! # The models
//!
//! [`Model::build`] from a [`ModelSpec`]; feeds use `Input` slots
//! [`NUMERIC_SLOT`] and [`LABELS_SLOT`].
//!
//! * `lr` (TensorFlow's linear model): one hash embedding per categorical
//!   field, `lr_emb_0..lr_emb_{F-1}` (width `D`), each looked up with the keys
//!   of its field and `Sum`-pooled to `[B,D]`; the `F` pooled vectors are
//!   summed by one `AddN` (TensorFlow's `add_n`), concatenated after the numeric input, then
//!   `x lr_w [13+D,1] + lr_b [1]`. With 26 fields it has 28 variables.
//! * `wdl`: wide = `wide_emb` (width 1, `Sum` over all fields) +
//!   `numeric x wide_w [13,1] + wide_b`; deep = `emb_0..emb_{F-1}` (one per
//!   field, `Mean`), concatenated after the numeric input, through ReLU layers
//!   `mlp{l}_w/b` of widths `hidden`, then `out_w [h,1] + out_b`; logit = wide
//!   + deep. With 26 fields it has 35 variables.
//!
//! Both end in a mean sigmoid cross-entropy; the probabilities are returned
//! too. [`Model::variables`] describes each variable and how the PS should
//! initialise it; [`Model::lookups`] says which fields feed which lookup.
//!
//! # Partitioning
//!
//! [`partition`] cuts a model for a [`Protocol`]. Dense variables are always
//! pulled whole and their gradients pushed. With [`Protocol::StarServer`]
//! the worker runs the lookups: the runtime [`dedup`]s a lookup's keys, pulls
//! the unique rows, feeds [`LookupFeed::Rows`] (or [`LookupFeed::WireRows`],
//! the same rows read in place from the pull replies), and pushes
//! [`LookupGrad::Rows`]. With [`Protocol::StarServerLite`] each lookup node
//! is replaced by a [`Op::Pooled`] leaf: the PS pools, the runtime feeds
//! [`LookupFeed::Pooled`] and pushes [`LookupGrad::Pooled`]; [`combine`] and
//! [`scatter_pooled_grad`] are the two halves of the moved computation.
//! [`Partitioned::pulls`] lists what to pull and in which form.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod exec;
mod graph;
mod model;
mod ops;
mod partition;
mod run;
mod tensor;
mod wire_rows;

pub use error::{GraphError, TensorError};
pub use exec::{Executor, DEFAULT_HANDOFF_FLOPS};
pub use graph::{
    Graph, GraphBuilder, GraphFeeds, LookupFeed, LookupGrad, Node, NodeId, Op, RunOutput, VarId,
};
pub use model::{
    Init, LookupSpec, Model, ModelKind, ModelSpec, VarKind, VarSpec, LABELS_SLOT, MAX_WIDTH,
    NUMERIC_SLOT,
};
pub use ops::{check_ragged, combine, scatter_pooled_grad, Combiner};
pub use partition::{
    dedup, partition, Dedup, DensePull, LookupPull, Partitioned, Protocol, PullForm, Pulls,
    StepFeeds, StepOutput,
};
pub use run::{RowsFeedBuffers, RunBuffers};
pub use tensor::Tensor;
pub use wire_rows::WireRows;

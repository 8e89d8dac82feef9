//! Error types of the crate.

use crate::graph::VarId;

/// A tensor could not be built from the given shape and data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The data length is not the product of the shape.
    #[error("tensor of shape {shape:?} needs {expected} elements, got {got}")]
    LenMismatch {
        /// The requested shape.
        shape: Vec<usize>,
        /// The product of the shape.
        expected: usize,
        /// The data length given.
        got: usize,
    },
    /// The product of the shape overflows `usize`.
    #[error("tensor shape {0:?} overflows")]
    ShapeOverflow(Vec<usize>),
}

/// Everything that can go wrong while building or running a graph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// A tensor could not be built.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// An op got inputs of incompatible shapes.
    #[error("{op}: {detail}")]
    Shape {
        /// The op that rejected its inputs.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// A feed the graph needs was not given.
    #[error("missing feed: {0}")]
    MissingFeed(String),
    /// The same feed was given twice.
    #[error("duplicate feed: {0}")]
    DuplicateFeed(String),
    /// A dense feed names a variable the graph does not read.
    #[error("feed for unknown variable {0:?}")]
    UnknownVariable(VarId),
    /// A lookup feed has the wrong form for the protocol (rows vs pooled).
    #[error("lookup {index}: expected a {expected} feed")]
    WrongFeedForm {
        /// The lookup index.
        index: usize,
        /// The form the graph expects: `"rows"` or `"pooled"`.
        expected: &'static str,
    },
    /// A key occurrence points past the rows that were fed.
    #[error("lookup {index}: key index {key_index} out of range for {rows} rows")]
    KeyIndexOutOfRange {
        /// The lookup index.
        index: usize,
        /// The offending entry of `index`.
        key_index: u32,
        /// The number of unique rows fed.
        rows: usize,
    },
    /// The ragged offsets of a lookup feed are malformed.
    #[error("lookup {index}: bad offsets: {detail}")]
    BadOffsets {
        /// The lookup index.
        index: usize,
        /// What was wrong.
        detail: String,
    },
    /// A model spec or a graph under construction is invalid.
    #[error("invalid graph: {0}")]
    InvalidGraph(String),
    /// The operating system refused to start a compute thread.
    #[error("starting compute thread {} of {threads}: {reason}", index + 1)]
    ThreadSpawn {
        /// The thread that did not start, from 0.
        index: usize,
        /// The threads asked for.
        threads: usize,
        /// Why (the I/O error).
        reason: String,
    },
    /// A kernel panicked (a bug); the run was abandoned.
    #[error("kernel of node {0} panicked")]
    KernelPanicked(usize),
}

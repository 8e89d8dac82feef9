//! Error types of the shard and checkpoints.

use starwire_wire::ps::DecodeError;

use crate::optim::OptimizerConfigError;
use crate::table::TableFull;

/// Why [`crate::PsShard::try_new`] refused to build a shard.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardConfigError {
    /// A hyper-parameter of [`crate::ShardConfig::optimizer`] is out of
    /// range.
    #[error(transparent)]
    Optimizer(#[from] OptimizerConfigError),
    /// Two variables share this id.
    #[error("duplicate variable id {0}")]
    DuplicateVariable(u32),
}

/// An error from [`crate::PsShard::handle_pull`] or [`crate::PsShard::handle_push`].
///
/// Whatever the error, the shard state is unchanged: every item is validated
/// before any is applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PsError {
    /// The request body is malformed.
    #[error("decode: {0}")]
    Decode(#[from] DecodeError),
    /// The variable id is not held by this shard.
    #[error("unknown variable {0}")]
    UnknownVariable(u32),
    /// Sizes in the request do not match the variable.
    #[error(
        "shape mismatch on variable {var}: expected {expected} elements per {what}, got {got}"
    )]
    ShapeMismatch {
        /// Variable id.
        var: u32,
        /// What was measured (`"tensor"`, `"row"`).
        what: &'static str,
        /// Expected count.
        expected: u64,
        /// Count found in the request.
        got: u64,
    },
    /// The item kind does not fit the variable kind (rows on a dense variable, ...).
    #[error("kind mismatch on variable {var}: {item} item on a {var_kind} variable")]
    KindMismatch {
        /// Variable id.
        var: u32,
        /// The item kind (`"dense"`, `"rows"`, `"pooled"`).
        item: &'static str,
        /// The variable kind (`"dense"`, `"embedding"`).
        var_kind: &'static str,
    },
    /// The pull's reply would be larger than
    /// [`ShardConfig::max_reply_bytes`](crate::ShardConfig::max_reply_bytes).
    #[error(
        "the reply would be at least {at_least} bytes, more than the PS's --max-reply-bytes {max}"
    )]
    ReplyTooLarge {
        /// Bytes counted when the bound was passed.
        at_least: u64,
        /// The bound.
        max: u64,
    },
    /// A table could not take the rows a pull needs.
    #[error(transparent)]
    TableFull(#[from] TableFull),
    /// An allocation the request needs was refused.
    #[error("out of memory for the {what}")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
    },
    /// A pushed gradient (after summing the request's duplicates) holds NaN
    /// or an infinity; no variable was changed.
    #[error("variable {var}: the pushed gradient is not finite (NaN or infinity)")]
    NonFinite {
        /// Variable id.
        var: u32,
    },
    /// The sender's worker task index is beyond what a shard tracks per
    /// worker ([`MAX_WORKER_INDEX`](crate::checkpoint::MAX_WORKER_INDEX)).
    #[error("worker task index {0} is above {max}", max = crate::checkpoint::MAX_WORKER_INDEX)]
    WorkerIndex(u32),
    /// A restarted worker resumes past the steps this shard applied.
    #[error(transparent)]
    ResumeAhead(#[from] crate::applied::ResumeAhead),
}

/// An error while saving or restoring a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Reading or writing failed.
    #[error("checkpoint i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The file does not start with the checkpoint magic.
    #[error("not a starwire PS checkpoint (bad magic)")]
    BadMagic,
    /// The format version is not supported.
    #[error("unsupported checkpoint version {0}")]
    BadVersion(u32),
    /// The trailing CRC-32C does not match the content.
    #[error("checkpoint checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Stored checksum.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// The checkpoint is shorter than its contents say.
    #[error("truncated checkpoint while reading {0}")]
    Truncated(&'static str),
    /// The content is well formed but inconsistent (bad tag, bad sizes, ...).
    #[error("corrupt checkpoint: {0}")]
    Corrupt(String),
    /// The checkpoint does not describe the variables this shard was built with.
    #[error("checkpoint does not match this shard: {0}")]
    Mismatch(String),
    /// The manifest JSON is invalid.
    #[error("manifest: {0}")]
    Manifest(#[from] serde_json::Error),
}

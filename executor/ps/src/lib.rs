//! The parameter-server side of starwire, sans-IO: bytes in, bytes out.
//!
//! A [`PsShard`] is the state of one PS reactor (a *shard*; shards = PS
//! tasks × reactors per PS). It owns the dense variables assigned to it
//! ([`assign`]) and its piece of every embedding table (the keys `k` with
//! [`assign::shard_of`]`(k, shards) == shard_index`). The runtime does
//! all networking and hands each request body to [`PsShard::handle_pull`] or
//! [`PsShard::handle_push`], which write the response body into a reused
//! buffer. Nothing here reads a clock or touches a socket.
//!
//! # Protocol
//!
//! [`starwire_wire::ps`] defines the messages (layouts in its docs). A
//! pull carries items of three kinds and the response carries one reply
//! per item, in order:
//!
//! * `Dense { var }`: the whole dense variable.
//! * `Rows { var, keys }` (DeepRec `star_server`): the rows of the worker's
//!   deduplicated keys; the worker pushes back one gradient row per key.
//! * `Pooled { var, offsets, keys }` (`star_server_lite`): the worker sends
//!   each example's keys and receives, per example, the SUM of this shard's
//!   rows of those keys; the push carries one pooled gradient per example,
//!   which the shard adds to every key of that example.
//!
//! With fusion a worker sends one pull and one push per shard per step with
//! many items; without, one item per message. The codec is the same.
//!
//! # Semantics
//!
//! * **Initialisation**: a row is created on its first (admitted) pull with
//!   values that depend only on `(seed, var id, key)` (see [`var`]), so
//!   neither the shard nor the order of creation matters. As in DeepRec,
//!   with `default_value_dim = N > 0` (default [`DEFAULT_VALUE_DIM`]) a new
//!   row copies row `key % N` of the table's default value matrix, whose
//!   row `i` holds the initial values of key `i`; `N = 0` initialises each
//!   key by itself.
//! * **Frequency filter** (`filter_freq`): a key gets a row on its
//!   `filter_freq`-th pull *request*: a key counts at most once per request,
//!   however often it occurs in it (across items too), so the `Pooled`
//!   protocol, which sends every occurrence of a key in a batch, admits at
//!   the same pace as the `Rows` protocol, which sends deduplicated keys.
//!   Until then pulls return zeros (every occurrence of the key counts as a
//!   filtered pull) and pushes for it are ignored and counted.
//! * **Time to live** (`steps_to_live`): rows neither pulled nor updated in
//!   the last `steps_to_live` global steps are removed by eviction, which the
//!   shard runs every `evict_interval` global steps.
//! * **Optimizers** ([`optim`]): SGD, Adagrad, Adam; duplicate keys of one
//!   push (also across its items) are summed and the update is applied once
//!   per row per push; Adam's bias correction uses a per-row update count.
//! * **Global step**: the shard's clock. It advances by one for every push
//!   with `completes_step` set (the runtime sets it on the last push of each
//!   worker step to each shard), so with `W` workers it advances `W` times per
//!   synchronous round. Pull responses and push responses carry it.
//! * **Errors**: a malformed or inconsistent request returns a typed
//!   [`PsError`] and leaves the shard unchanged: every item is validated
//!   before any is applied.
//!
//! [`checkpoint`] saves and restores a shard (format in `docs/CHECKPOINT.md`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod applied;
pub mod assign;
pub mod checkpoint;
pub mod delta;
mod error;
mod keyhash;
pub mod layout;
pub mod optim;
mod prefetch;
mod pulls;
mod shard;
mod table;
pub mod var;

pub use applied::{AppliedSteps, Position, ResumeAhead};
pub use assign::{shard_of, AssignmentReport, Strategy, VarStats, VariableAssignment};
pub use checkpoint::{create_dir_durable, write_atomic, Manifest, WorkerProgress};
pub use error::{CheckpointError, PsError, ShardConfigError};
pub use optim::{OptimizerConfig, OptimizerConfigError, OptimizerKind, Pulled, StalenessLr};
pub use shard::{
    DenseVar, PsShard, ShardConfig, ShardReport, ShardStats, Var, DEFAULT_MAX_REPLY_BYTES,
};
pub use table::{
    EmbeddingTable, NoRoom, TableFull, TablePolicy, TableStats, DEFAULT_MAX_ROWS, DEFAULT_VALUE_DIM,
};
pub use var::{Init, VarDef, VarKind};

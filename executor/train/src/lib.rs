//! starwire's distributed trainer: parameter servers and workers over the
//! starwire transport.
//!
//! * [`server`]: a PS task runs one reactor per shard; each owns a
//!   [`starwire_ps::PsShard`] (its dense variables and its key range of every
//!   sharded table) and serves pull, push and control requests
//!   run-to-completion on its core.
//! * [`worker`]: a worker reads its share of the data, deduplicates keys,
//!   pulls rows (`star_server`) or pooled vectors (`star_server_lite`) from
//!   every shard, runs the partitioned graph ([`starwire_graph`]) and pushes
//!   gradients, with one fused request per shard per step (`--tensor-fuse
//!   on`) or one request per tensor (`off`).
//! * [`cluster`]: the assignment of variables to PS tasks, the local
//!   loopback cluster of `starwire train`, and the single roles of
//!   `starwire ps` / `starwire worker`.
//!
//! The protocol itself is sans-IO, as the transport's `Connection` is:
//! [`psclient`] (a worker's exchanges: requests, replies, and deadlines
//! given `now`) and [`psserver`] (a shard's requests, barriers and
//! finished workers) take messages and events in and queue replies and
//! requests on connections; neither reads a clock or touches a socket.
//! [`net`] and [`server`] plug them into the transport's session layer as
//! `Service`s of an `Endpoint`, which accepts, dials, turns the sessions
//! and parks; `tests/protocol.rs` runs the same endpoints over in-memory
//! connections on a virtual clock.
//!
//! What runs where: on a PS, every request (decode, lookup or optimizer
//! update, encode) runs inline on the shard's reactor; a shard is never
//! touched by another thread, so nothing is locked. On a worker, the worker
//! thread runs the graph inline and either drives its own connections
//! (`--worker-handoff off`) or hands its requests to the worker's network
//! reactors through the M:N queue ([`handoff`], `on`); the graph executor
//! hands a matrix product above its FLOP threshold to compute threads when
//! `--compute-threads` is non-zero.
#![deny(unsafe_code)]

pub mod backend;
pub mod cluster;
pub mod deltas;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod handler;
pub mod handoff;
pub mod inproc;
mod locked;
pub mod net;
pub mod psclient;
pub mod psserver;
pub mod server;
pub mod source;
pub mod staleness;
pub mod syncstep;
pub mod telemetry;
pub mod worker;

use std::path::PathBuf;

use thiserror::Error;

pub use cluster::{run_local, run_ps_task, run_worker_task, BackendKind, TrainConfig, TrainReport};

fn join_indices(v: &[u32]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A training failure.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TrainError {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The backend could not be set up (no io_uring, a memlock limit...).
    #[error("{0} backend: {1}")]
    Backend(&'static str, String),
    /// Connecting to a PS failed.
    #[error("connecting to {0}: {1}")]
    Connect(String, std::io::Error),
    /// Connecting to a PS shard (connect and preamble) failed.
    #[error(transparent)]
    Dial(#[from] starwire_transport::accept::DialError),
    /// A PS task could not listen on its address.
    #[error("listening on {addr}: {source}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A PS task's acceptor could not start.
    #[error("PS acceptor: {0}")]
    Accept(#[from] starwire_transport::accept::AcceptError),
    /// A connection to a shard failed.
    #[error("link to shard {0}: {1}")]
    Link(usize, String),
    /// A shard answered with an error.
    #[error("PS error: {0}")]
    Remote(String),
    /// Reading the data failed.
    #[error("data: {0}")]
    Data(#[from] starwire_data::DataError),
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Placing or pinning a reactor failed.
    #[error("reactor placement: {0}")]
    Placement(#[from] starwire_placement::PlacementError),
    /// An I/O error (listening, threads).
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// A PS task would serve unauthenticated peers beyond this host.
    #[error("{0}")]
    Insecure(String),
    /// Workers whose connections ended before they said `DONE` and that
    /// did not rejoin and finish: their data is not all trained.
    #[error("worker(s) {} died unfinished: their connections ended before they said DONE", join_indices(.0))]
    WorkersLost(Vec<u32>),
    /// A checkpoint's manifest and one of its shard files disagree.
    #[error("checkpoint {path}: the manifest says shard {shard} is at global step {manifest}, its file holds step {file}")]
    CheckpointMismatch {
        /// The shard file.
        path: PathBuf,
        /// The shard.
        shard: usize,
        /// The shard's step in the manifest.
        manifest: u64,
        /// The step in the shard's file.
        file: u64,
    },
    /// A shard answers again after its connection failed, from a PS task
    /// of another incarnation (the task restarted): whatever it held
    /// since its checkpoint is gone, and the worker rolls back to it.
    #[error("PS shard {shard} restarted (incarnation {previous}, now {now})")]
    PeerRestarted {
        /// The shard.
        shard: usize,
        /// Its incarnation before.
        previous: u64,
        /// Its incarnation now.
        now: u64,
    },
    /// A bug or an impossible state, reported instead of a panic.
    #[error("internal: {0}")]
    Internal(String),
}

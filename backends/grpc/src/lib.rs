//! The gRPC baseline: starwire's message layer served over tonic.
//!
//! This is what stock TensorFlow does between workers and parameter servers
//! (and what DeepRec calls `protocol="grpc"`): every request is a unary gRPC
//! call over HTTP/2, the pull/push messages are protobuf. starwire measures
//! its own transports against it in the same run (`starwire bench --backends
//! grpc,tcp`, `starwire report`).
//!
//! The configuration is fixed so that figures are comparable
//! (docs/backends/grpc.md):
//!
//! - tonic's default channel ([`tonic::transport::Endpoint`] defaults), one
//!   HTTP/2 connection per client;
//! - a tokio multi-thread runtime with [`WORKER_THREADS`] (2) workers on each
//!   side; a server's handler runs on those workers, possibly concurrently;
//! - `TCP_NODELAY` on both ends;
//! - default HTTP/2 flow-control windows;
//! - a message limit of [`GrpcConfig::max_message_len`] (64 MiB by default,
//!   tonic's own default of 4 MiB would refuse a 4 MiB tensor with its
//!   protobuf framing).
//!
//! A server bounds what its peers may hold: at most
//! [`GrpcConfig::max_connections`] connections, counted from accept
//! (authenticated or not), at most [`GrpcConfig::max_concurrent_streams`]
//! calls at once on each, and, with [`GrpcConfig::idle_timeout`], a
//! connection that moves no byte, or cannot write, for that long is closed.
//!
//! With a cluster token ([`GrpcConfig::token`]) every connection proves
//! it both ways before HTTP/2 starts (see `auth.rs` and docs/SECURITY.md);
//! without one, connections are open to anyone who can reach them.
//!
//! The API is blocking, so callers need no async knowledge: a [`Handler`]
//! answers requests on the server, a [`GrpcClient`] makes calls (one at a
//! time, a batch at once with [`GrpcClient::call_many`], or a window of `K`
//! outstanding with [`GrpcClient::call_pipelined`]). The blocking calls must
//! not be made from inside a tokio runtime.
#![deny(unsafe_code)]

mod auth;
mod budget;
mod client;
mod server;

pub use client::{GrpcClient, NextCall, SparseRows};
pub use server::{ConnectionServer, GrpcServer};

use std::time::Duration;

use starwire_transport::auth::stream::StreamAuthError;
use starwire_transport::ClusterToken;

/// The generated protobuf messages and tonic service
/// (`proto/starwire_grpc.proto`).
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod proto {
    tonic::include_proto!("starwire.grpc.v1");
}

/// Tokio worker threads of every gRPC runtime (client and server).
pub const WORKER_THREADS: usize = 2;

/// Default of [`GrpcConfig::max_concurrent_streams`]: the session
/// backends' per-connection window (256 frames in flight, `ConnConfig`'s
/// `recv_window`).
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;

/// Default of [`GrpcConfig::max_connections`] (the PS's
/// `--max-connections` default).
pub const DEFAULT_MAX_CONNECTIONS: usize = starwire_transport::accept::DEFAULT_MAX_CONNECTIONS;

/// The gRPC method path of the generic call (for tests that speak to the
/// server below the typed client).
pub const CALL_PATH: &str = "/starwire.grpc.v1.MessageLayer/Call";

/// Settings of a server or client. Everything else is fixed (see the crate
/// docs).
#[derive(Debug, Clone)]
pub struct GrpcConfig {
    /// Largest encoded message accepted or sent, in bytes. Larger ones are
    /// refused by tonic with `OutOfRange`/`ResourceExhausted`, never
    /// allocated.
    pub max_message_len: usize,
    /// The cluster token: with one, each connection proves it both ways
    /// before any call; a server closes a peer that does not.
    pub token: Option<ClusterToken>,
    /// How long a connection may take to prove the token, in all (not per
    /// read); then, on a server, how long it may take to send its HTTP/2
    /// preface.
    pub handshake_timeout: Duration,
    /// Most calls (HTTP/2 streams) open at once on one connection of a
    /// server (`SETTINGS_MAX_CONCURRENT_STREAMS`): each may hold a request
    /// of up to [`Self::max_message_len`] being read and its reply being
    /// sent. A client queues calls beyond it; a peer that opens more has
    /// them refused.
    pub max_concurrent_streams: u32,
    /// Most connections a [`GrpcServer`] holds at once, from accept
    /// (before the token's handshake) until they close; one past it is
    /// closed at accept, with a warning.
    pub max_connections: usize,
    /// A server's connection that receives and sends nothing for this
    /// long, or whose writes cannot leave for this long (a peer that reads
    /// nothing), or whose replies wait this long with none leaving (a peer
    /// that keeps its flow-control window shut), is closed. `None`: never. No HTTP/2 keep-alive pings are
    /// sent, so a dead peer is closed by this too.
    pub idle_timeout: Option<Duration>,
    /// Most bytes a [`GrpcServer`]'s calls hold at once, over all its
    /// connections: requests being received or served, replies not yet
    /// written to their sockets. A request or reply past it is answered
    /// `Overloaded` (see [`HandlerError::Wire`]). `None`: no bound but
    /// the others (as stock gRPC).
    pub memory_budget: Option<usize>,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            max_message_len: 64 << 20,
            token: None,
            handshake_timeout: Duration::from_secs(10),
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: None,
            memory_budget: None,
        }
    }
}

/// The connection a call came in on, unique among a server's connections
/// for the server's life (the numbers are not reused): tells the calls of
/// one client from those of another ([`Handler::handle_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub u64);

/// What a [`Handler`] returns when it refuses or fails a request; becomes a
/// gRPC status on the wire and a [`GrpcError::Status`] at the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// The opcode means nothing to this handler.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// The payload is malformed or inconsistent.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The variable or key does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The handler does not serve this method.
    #[error("{0} is not served here")]
    Unsupported(&'static str),
    /// The request is beyond one of the server's bounds (a reply larger
    /// than it allows, ...); retrying it fails the same way.
    #[error("limit exceeded: {0}")]
    LimitExceeded(String),
    /// The handler failed.
    #[error("internal error: {0}")]
    Internal(String),
    /// A message-layer status no gRPC code stands for (`Overloaded`,
    /// `NonFinite`, ...). The client gets it back in
    /// [`GrpcError::Status`]'s `wire`, from the call's
    /// [`WIRE_STATUS_METADATA`] entry, as the other backends carry it in
    /// their reply header.
    #[error("{}: {message}", status.describe())]
    Wire {
        /// The status.
        status: starwire_wire::Status,
        /// What the handler said.
        message: String,
    },
}

/// The metadata key of a [`HandlerError::Wire`] status: its wire code in
/// decimal.
pub const WIRE_STATUS_METADATA: &str = "starwire-status";

impl HandlerError {
    fn into_status(self) -> tonic::Status {
        let msg = self.to_string();
        match self {
            HandlerError::UnknownOpcode(_) | HandlerError::Unsupported(_) => {
                tonic::Status::unimplemented(msg)
            }
            HandlerError::BadRequest(_) => tonic::Status::invalid_argument(msg),
            HandlerError::NotFound(_) => tonic::Status::not_found(msg),
            HandlerError::LimitExceeded(_) => tonic::Status::resource_exhausted(msg),
            HandlerError::Internal(_) => tonic::Status::internal(msg),
            HandlerError::Wire { status, .. } => {
                use starwire_wire::Status as W;
                let code = match status {
                    W::Overloaded | W::LimitExceeded => tonic::Code::ResourceExhausted,
                    W::NonFinite | W::BadRequest | W::WrongShape => tonic::Code::InvalidArgument,
                    W::UnknownVariable => tonic::Code::NotFound,
                    W::UnknownMethod => tonic::Code::Unimplemented,
                    _ => tonic::Code::Internal,
                };
                let mut s = tonic::Status::new(code, msg);
                s.metadata_mut().insert(
                    WIRE_STATUS_METADATA,
                    tonic::metadata::MetadataValue::from(status.to_u16()),
                );
                s
            }
        }
    }
}

/// The server side of the message layer. Called for every request, possibly
/// concurrently from the runtime's workers (as stock gRPC does).
pub trait Handler: Send + Sync + 'static {
    /// A generic request (`Rpc`, `Tensors`, ...): `opcode` is a known
    /// starwire wire opcode (the server answers unknown ones itself).
    fn handle(&self, opcode: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError>;

    /// [`Self::handle`] for a request that came in on connection `conn`:
    /// what the server calls. Override it to tell clients apart (each
    /// client has its own connection); by default the connection is
    /// ignored.
    fn handle_on(
        &self,
        conn: ConnectionId,
        opcode: u8,
        payload: &[u8],
    ) -> Result<Vec<u8>, HandlerError> {
        let _ = conn;
        self.handle(opcode, payload)
    }

    /// Rows of `var` for `keys`: `keys.len()` rows of equal width, row-major.
    fn sparse_pull(&self, var: u64, keys: &[u64]) -> Result<Vec<f32>, HandlerError> {
        let _ = (var, keys);
        Err(HandlerError::Unsupported("SparsePull"))
    }

    /// Gradients for rows of `var`: `grads` holds `keys.len()` rows of
    /// `dim` values (checked by the server before the call).
    fn sparse_push(
        &self,
        var: u64,
        keys: &[u64],
        dim: usize,
        grads: &[f32],
    ) -> Result<(), HandlerError> {
        let _ = (var, keys, dim, grads);
        Err(HandlerError::Unsupported("SparsePush"))
    }

    /// The whole dense variable `var`.
    fn dense_pull(&self, var: u64) -> Result<Vec<f32>, HandlerError> {
        let _ = var;
        Err(HandlerError::Unsupported("DensePull"))
    }

    /// A gradient for the whole dense variable `var`.
    fn dense_push(&self, var: u64, grads: &[f32]) -> Result<(), HandlerError> {
        let _ = (var, grads);
        Err(HandlerError::Unsupported("DensePush"))
    }
}

/// Errors of the gRPC baseline.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GrpcError {
    /// The tokio runtime could not be started.
    #[error("starting the gRPC runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The listener could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A socket handed in could not be set up.
    #[error("setting up the connection socket: {0}")]
    Socket(#[source] std::io::Error),
    /// The channel could not connect.
    #[error("connecting to {addr}: {source}")]
    Connect {
        /// The peer.
        addr: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The call failed with a gRPC status: refused by the handler, a
    /// malformed or oversized message, or the connection gone
    /// (`Unavailable`).
    #[error("gRPC status {code:?}: {message}")]
    Status {
        /// The status code.
        code: tonic::Code,
        /// The status message.
        message: String,
        /// The message-layer status the handler answered, when it gave
        /// one ([`HandlerError::Wire`]).
        wire: Option<starwire_wire::Status>,
    },
    /// The request is larger than [`GrpcConfig::max_message_len`]; it was
    /// not sent.
    #[error("request of {len} bytes is over the {max}-byte message limit")]
    TooLarge {
        /// Encoded request length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The server's answer is inconsistent (e.g. rows of unequal width).
    #[error("bad reply: {0}")]
    BadReply(String),
    /// The server task failed.
    #[error("gRPC server: {0}")]
    Serve(#[source] tonic::transport::Error),
    /// The connection's proof of the cluster token failed (either end's),
    /// or the peer did not answer it.
    #[error("the cluster token handshake failed: {0}")]
    Auth(#[source] StreamAuthError),
}

impl GrpcError {
    /// The gRPC status code, for [`GrpcError::Status`].
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            GrpcError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The handler's message-layer status, for a [`GrpcError::Status`]
    /// from a [`HandlerError::Wire`].
    pub fn wire_status(&self) -> Option<starwire_wire::Status> {
        match self {
            GrpcError::Status { wire, .. } => *wire,
            _ => None,
        }
    }
}

impl From<tonic::Status> for GrpcError {
    /// A call's status. `Cancelled` becomes `Unavailable`: this client
    /// never cancels a call and the server never answers `Cancelled`, so it
    /// comes only from the transport, when the connection closed under a
    /// call in flight (hyper's `Canceled`, "operation was canceled"), and
    /// that is the connection gone, as when it closed before the call.
    fn from(s: tonic::Status) -> Self {
        let code = match s.code() {
            tonic::Code::Cancelled => tonic::Code::Unavailable,
            c => c,
        };
        let wire = s
            .metadata()
            .get(WIRE_STATUS_METADATA)
            .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
            .map(starwire_wire::Status::from_u16);
        GrpcError::Status {
            code,
            message: s.message().to_owned(),
            wire,
        }
    }
}

fn runtime(name: &str) -> Result<tokio::runtime::Runtime, GrpcError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(GrpcError::Runtime)
}

#[cfg(test)]
mod tests {
    use super::GrpcError;

    /// A call the transport cancelled (the connection closed under it) is
    /// the connection gone, `Unavailable`, as when it closed before the
    /// call; other codes pass through. Seen in CI: the peer-shutdown
    /// conformance test got `Cancelled` when the shutdown met the call in
    /// flight.
    #[test]
    fn a_transport_cancelled_call_is_unavailable() {
        let e = GrpcError::from(tonic::Status::cancelled("operation was canceled"));
        assert_eq!(e.code(), Some(tonic::Code::Unavailable));
        for code in [
            tonic::Code::Unavailable,
            tonic::Code::InvalidArgument,
            tonic::Code::ResourceExhausted,
            tonic::Code::NotFound,
        ] {
            let e = GrpcError::from(tonic::Status::new(code, "x"));
            assert_eq!(e.code(), Some(code));
        }
    }

    /// The checked-in copy of the generated code (used where protoc is
    /// missing) must match what protoc makes of the .proto today.
    #[test]
    fn checked_in_generated_code_matches_the_proto() {
        let fresh = include_str!(concat!(env!("OUT_DIR"), "/starwire.grpc.v1.rs"));
        let copy = include_str!("../generated/starwire.grpc.v1.rs");
        if env!("STARWIRE_GRPC_PROTOC") == "1" {
            assert!(
                fresh == copy,
                "generated/starwire.grpc.v1.rs is stale: copy it from OUT_DIR"
            );
        } else {
            eprintln!("protoc not installed: generated code not regenerated, not compared");
        }
    }
}

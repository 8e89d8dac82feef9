//! starwire's transport core.
//!
//! Three layers (see `docs/ARCHITECTURE.md`):
//!
//! * the **driver layer**, [`Driver`]: one per reactor, serving every
//!   connection of that reactor (a [`ConnId`] each): reliable, ordered
//!   frames moved in bursts through memory the driver lends, one receive
//!   pass and one submission per turn. Drivers whose connections are
//!   independent point-to-point links (TCP sockets, the in-memory pairs of
//!   tests) are [`Links`] of a [`Transport`];
//! * the **message layer** on top, [`Connection`]: a sans-IO core that does
//!   the handshake, request/response matching, deadlines, cancellation,
//!   credit-based flow control and chunking, the same for every driver.
//!   [`Sessions`] holds those of every connection of one [`Driver`] and
//!   runs a reactor's turn over them;
//! * the **session layer** the PS shards and workers run on: an
//!   [`Endpoint`] (a driver, its sessions and a role's [`Service`]) that a
//!   reactor or a plain thread turns, the [`accept::Acceptor`] that routes
//!   each accepted stream by its [`preamble`] to the reactor owning its
//!   shard, and [`accept::dial`].
//!
//! Around them: the [`reactor`]s (one thread per network core; how one
//! parks is its driver's to say), Send/Recv [`fusion`] (used by `starwire
//! bench --mode fuse`), the in-memory and fault-injecting test backends in
//! [`testing`], and the [`conformance`] suite every driver runs.
#![deny(unsafe_code)]

pub mod accept;
pub mod auth;
pub mod budget;
pub mod conformance;
pub mod connection;
pub mod driver;
pub mod endpoint;
pub mod fusion;
pub mod preamble;
pub mod reactor;
pub mod retry;
pub mod session;
pub mod socket;
pub mod testing;
pub mod transport;

pub use auth::{ClusterToken, Side};
pub use budget::MemoryBudget;
pub use connection::{
    ConnConfig, ConnError, Connection, Event, Incoming, Payload, PeerInfo, RequestError, SendError,
    TaskRole, PROTOCOL_VERSION,
};
pub use driver::{
    ConnId, ConnTx, Driver, DriverCounters, FrameTx, Link, Links, Sleep, StreamDriver,
};
pub use endpoint::{Endpoint, Service};
pub use session::{Sessions, TurnStats};
pub use starwire_wire as wire;
pub use transport::{Transport, TransportError};

//! starwire's transport core.
//!
//! Two layers (see `docs/ARCHITECTURE.md`):
//!
//! * the **backend layer**, [`Transport`]: reliable, ordered frames between
//!   two endpoints, moved in bursts through buffers the backend lends;
//! * the **message layer** on top, [`Connection`]: a sans-IO core that does
//!   the handshake, request/response matching, deadlines, cancellation,
//!   credit-based flow control and chunking, the same for every backend.
//!   [`Sessions`] runs those of every connection of one [`Driver`] (the
//!   per-core object a reactor drives) for a reactor's turn.
//!
//! On top, the **session layer** every role runs on: an [`Endpoint`] (a
//! driver, its sessions and a role's [`Service`]) that a reactor or a
//! plain thread turns, the [`accept::Acceptor`] that routes each accepted
//! stream by its [`preamble`] to the reactor owning its shard, and
//! [`accept::dial`].
//!
//! Around them: Send/Recv [`fusion`], the in-memory and fault-injecting test
//! backends in [`testing`], and the [`conformance`] suite every backend runs.
#![deny(unsafe_code)]

pub mod accept;
pub mod conformance;
pub mod connection;
pub mod driver;
pub mod endpoint;
pub mod fusion;
pub mod preamble;
pub mod reactor;
pub mod session;
pub mod socket;
pub mod testing;
pub mod transport;

pub use connection::{
    Body, ConnConfig, ConnError, Connection, Event, Incoming, PeerInfo, RequestError, SendError,
    TaskRole, PROTOCOL_VERSION,
};
pub use driver::{ConnId, ConnTx, Driver, FrameTx, Link, Links, Sleep, StreamDriver};
pub use endpoint::{Endpoint, Service};
pub use session::{Sessions, TurnStats};
pub use starwire_wire as wire;
pub use transport::{Transport, TransportError};

//! The RDMA backend for starwire: a sans-IO ring protocol over
//! reliable-connected RDMA write-with-immediate, driven per core.
//!
//! * [`verbs`]: the verbs model — [`MemoryRegion`], [`Completion`] (with
//!   its `qp_num`), [`WcStatus`], [`VerbsError`] (one variant per verb) and
//!   the [`Verbs`] trait: one protection domain, one completion queue and
//!   the queue pairs of one driver, exactly the verbs the ring needs.
//! * [`mem`]: [`RegisteredMem`], the bytes of a registered region. The NIC
//!   may access them at any time, so they are reached through a raw pointer:
//!   checked copies are safe, lending a range as a slice is `unsafe`. The
//!   crate's `unsafe` code lives there and in the two ring methods that
//!   lend ranges the protocol keeps from the NIC, which rely on the
//!   contract of the `unsafe trait` [`Verbs`] (implemented by
//!   `unsafe impl` for [`SimNic`]).
//! * [`SimNic`] on a [`SimFabric`]: in-memory NICs whose RC queue pairs
//!   report into one completion queue per NIC, with faithful error
//!   semantics (remote access errors, receiver-not-ready retry exhaustion,
//!   the per-QP error state and flushes, CQ overrun). Hosts without an RDMA
//!   device run every test over it; `starwire-verbs` implements [`Verbs`]
//!   over `ibv_post_send` / `ibv_post_recv` / `ibv_poll_cq`.
//! * [`bootstrap`]: [`QpEndpoint`], the side-channel message that tells a
//!   peer our queue pair, port address and receive ring, parsed without
//!   I/O.
//! * [`RdmaDriver`]: the [`Driver`](starwire_transport::Driver) of one
//!   reactor. Each connection is a queue pair and a [`RingConn`]: frames
//!   are encoded in place in a registered staging region, written into the
//!   peer's receive ring with one write-with-immediate each, and lent in
//!   place from the local ring; ring bytes and receive WRs flow back as
//!   credits. A receive pass polls the shared completion queue once; a
//!   flush stages every connection's writes behind one doorbell.
//!
//! Nothing here reads the clock or blocks. Protocol and driver notes:
//! `docs/backends/rdma.md`.
#![deny(unsafe_code)]

pub mod bootstrap;
mod driver;
pub mod imm;
#[allow(unsafe_code)]
pub mod mem;
mod ring;
mod sim;
pub mod verbs;

pub use bootstrap::{EndpointError, QpEndpoint, MAX_QPN};
pub use driver::{RdmaDriver, RdmaStats};
pub use imm::{Imm, SLOT};
pub use mem::{RangeError, RegisteredMem};
pub use ring::{
    RemoteRing, RingConfig, RingConn, RingError, RingFault, RingStats, WorkRequest, MIN_RECV_DEPTH,
};
pub use sim::{SimConfig, SimFabric, SimNic};
pub use verbs::{
    Access, Completion, DoorbellError, Errno, LocalSlice, MemoryRegion, QpCaps, QpState,
    RemoteSlice, Verbs, VerbsError, WcOpcode, WcStatus,
};

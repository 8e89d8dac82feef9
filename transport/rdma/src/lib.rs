//! The RDMA backend core for starwire: a sans-IO ring protocol over
//! reliable-connected RDMA write-with-immediate.
//!
//! * [`verbs`]: the verbs model — [`MemoryRegion`], [`Completion`],
//!   [`WcStatus`], [`VerbsError`] (one variant per verb) and the
//!   [`QueuePair`] trait, exactly the verbs the ring needs.
//! * [`mem`]: [`RegisteredMem`], the bytes of a registered region. The NIC
//!   may access them at any time, so they are reached through a raw pointer:
//!   checked copies are safe, lending a range as a slice is `unsafe`. The
//!   crate's `unsafe` code lives there and in the two ring methods that
//!   lend ranges the protocol keeps from the NIC.
//! * [`SimRcQp`]: an in-memory connected RC pair with faithful error
//!   semantics (remote access errors, receiver-not-ready retry exhaustion,
//!   the error state and flushes). This host has no RDMA device, so every
//!   test runs over it; the verbs driver (a later issue) implements
//!   [`QueuePair`] over `ibv_post_send` / `ibv_post_recv` / `ibv_poll_cq`.
//! * [`PreparedRing`] → [`RingTransport`]: the
//!   [`Transport`](starwire_transport::Transport) implementation. Frames are
//!   encoded in place in a registered staging region, written into the
//!   peer's receive ring with one write-with-immediate each (one doorbell
//!   per flush), and lent in place from the local ring; ring bytes and
//!   receive WRs flow back as credits.
//!
//! Nothing here reads the clock or blocks. Protocol and driver notes:
//! `docs/backends/rdma.md`.
#![deny(unsafe_code)]

pub mod imm;
#[allow(unsafe_code)]
pub mod mem;
mod ring;
mod sim;
pub mod verbs;

pub use imm::{Imm, SLOT};
pub use mem::{RangeError, RegisteredMem};
pub use ring::{
    PreparedRing, RemoteRing, RingConfig, RingError, RingFault, RingStats, RingTransport,
    WorkRequest, MIN_RECV_DEPTH,
};
pub use sim::{SimConfig, SimRcQp};
pub use verbs::{
    Completion, Errno, LocalSlice, MemoryRegion, QpCaps, QpState, QueuePair, RemoteSlice,
    VerbsError, WcOpcode, WcStatus,
};

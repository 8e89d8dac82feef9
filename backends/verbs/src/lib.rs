//! The RDMA verbs backend of starwire: `starwire-rdma`'s ring protocol
//! (`RdmaDriver`) on real reliable-connected queue pairs, through the
//! system's libibverbs (bindings from `rdma-sys`).
//!
//! * [`devices`] lists devices, ports, link layers, GIDs and the limits the
//!   rings depend on (`starwire info`); with no device it fails with
//!   [`DeviceError::NoDevice`], whose text is the one users see:
//!   `no RDMA device found (ibv_get_device_list: ...); use the tcp backend`.
//! * [`VerbsDevice`] is one opened port of a device and its one protection
//!   domain, shared by every reactor using that port.
//! * [`VerbsNic`] is the verbs of one reactor (one completion channel and
//!   completion queue for all its queue pairs) and implements
//!   `starwire_rdma::Verbs`, so [`VerbsRdma`] (`RdmaDriver<VerbsNic>`)
//!   runs the ring protocol on real queue pairs, parking its reactor on the
//!   completion channel.
//! * [`prepare`], [`connect_qp`]/[`finish`] and [`connect_local`] set a
//!   connection up: queue pair in Init, receives posted, endpoints
//!   exchanged, RTR, RTS ([`prepare_reserved`] for a connection whose
//!   handle was reserved first).
//! * [`SideChannelAuth`] proves the cluster token on a side channel
//!   (`starwire_transport::auth::stream`, purpose [`AUTH_PURPOSE`])
//!   without blocking, before anything is allocated for the connection.
//! * [`VerbsDriver`] is the reactor's driver: [`VerbsRdma`] plus the TCP
//!   side channels of connections being set up, stepped by the reactor's
//!   turns (`StreamDriver::attach_stream_as` starts one, proving the
//!   token first when there is one).
//!
//! Every `unsafe` block of the crate is in the `sys` module; the one other
//! `unsafe` is `nic`'s `unsafe impl Verbs for VerbsNic`, the promise of
//! the `Verbs` contract that the ring's lent slices rely on. User
//! documentation: `docs/backends/rdma.md`.
#![deny(unsafe_code)]

mod auth;
mod device;
mod driver;
mod error;
mod nic;
mod setup;
mod sys;

pub use auth::{SideChannelAuth, PURPOSE as AUTH_PURPOSE};
pub use device::{
    devices, mtu_bytes, DeviceInfo, DeviceResult, DeviceSpec, Gid, LinkLayer, PortInfo,
    VerbsDevice, DEFAULT_GID_INDEX, DEFAULT_PORT,
};
pub use driver::{VerbsCounters, VerbsDriver, SETUP_TIMEOUT};
pub use error::{DeviceError, NoDeviceReason};
pub use nic::{NicConfig, NicStats, VerbsNic};
pub use setup::{
    connect_local, connect_qp, finish, prepare, prepare_reserved, Pending, SetupError, VerbsRdma,
};

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
//!
//! Every `unsafe` line of the crate is in the `sys` module. User
//! documentation: `docs/backends/rdma.md`.
#![deny(unsafe_code)]

mod device;
mod error;
mod sys;

pub use device::{
    devices, mtu_bytes, DeviceInfo, DeviceResult, DeviceSpec, Gid, LinkLayer, PortInfo,
    VerbsDevice, DEFAULT_GID_INDEX, DEFAULT_PORT,
};
pub use error::{DeviceError, NoDeviceReason};

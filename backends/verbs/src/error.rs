//! [`DeviceError`]: opening a device, or setting a queue pair up, failed.
//! Failures of the data path are `starwire_rdma::VerbsError`s.

use std::fmt;

use thiserror::Error;

use crate::sys::strerror;

/// Why no RDMA device could be used at all.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoDeviceReason {
    /// `ibv_get_device_list` failed (`ENOSYS`: the kernel has no
    /// InfiniBand/uverbs support).
    GetDeviceList {
        /// Its errno.
        errno: i32,
    },
    /// It succeeded and found none.
    NoDevices,
}

impl fmt::Display for NoDeviceReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::GetDeviceList { errno } => {
                write!(f, "ibv_get_device_list: {}", strerror(*errno))
            }
            Self::NoDevices => f.write_str("no devices"),
        }
    }
}

/// Opening a device or setting a queue pair up failed: one variant per
/// failing verb, with its errno.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// No device at all: the host has no RDMA support, or no device.
    #[error("no RDMA device found ({0}); use the tcp backend")]
    NoDevice(NoDeviceReason),
    /// The device asked for by name is not among those found.
    #[error("RDMA device {name:?} not found (found: {found})")]
    UnknownDevice {
        /// The name asked for.
        name: String,
        /// The devices found, comma-separated.
        found: String,
    },
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({device}): {}", strerror(*errno))]
    Open {
        /// The device.
        device: String,
        /// Its errno.
        errno: i32,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device({device}): {}", strerror(*errno))]
    QueryDevice {
        /// The device.
        device: String,
        /// Its errno.
        errno: i32,
    },
    /// `ibv_query_port` failed (`EINVAL`: no such port).
    #[error("ibv_query_port({device}, port {port}): {}", strerror(*errno))]
    QueryPort {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// Its errno.
        errno: i32,
    },
    /// The port is not `ACTIVE` (no link, or no subnet manager on
    /// InfiniBand).
    #[error("{device} port {port} is {state}, not PORT_ACTIVE")]
    PortNotActive {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// `ibv_port_state_str` of its state.
        state: String,
    },
    /// `ibv_query_gid` failed or found an empty entry (RoCE addresses every
    /// packet by GID, so the index must name one).
    #[error(
        "{device} port {port} has no GID at index {index}{}; `starwire info` lists the GID table",
        errno.map(|e| format!(" (ibv_query_gid: {})", strerror(e))).unwrap_or_default()
    )]
    NoGid {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// The GID index asked for.
        index: u32,
        /// The errno of `ibv_query_gid`, if it failed.
        errno: Option<i32>,
    },
    /// The GID index does not fit the `u8` `sgid_index` of a queue pair's
    /// address vector, so no queue pair could use it.
    #[error("--gid-index {index} is above 255, the largest GID index a queue pair can use")]
    GidIndexTooLarge {
        /// The GID index asked for.
        index: u32,
    },
    /// `ibv_create_comp_channel` failed.
    #[error("ibv_create_comp_channel({device}): {}", strerror(*errno))]
    CreateChannel {
        /// The device.
        device: String,
        /// Its errno.
        errno: i32,
    },
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq({device}, {cqe} entries): {}", strerror(*errno))]
    CreateCq {
        /// The device.
        device: String,
        /// Entries asked for.
        cqe: u32,
        /// Its errno.
        errno: i32,
    },
    /// `ibv_modify_qp` to `state` failed (`EINVAL` for a peer address the
    /// port cannot reach: a GID index of the wrong RoCE version, an MTU
    /// above the port's).
    #[error("ibv_modify_qp(qp {qpn:#x}) to {state}: {}", strerror(*errno))]
    ModifyQp {
        /// The queue pair.
        qpn: u32,
        /// The state asked for (`INIT`, `RTR`, `RTS`).
        state: &'static str,
        /// Its errno.
        errno: i32,
    },
    /// No queue pair with this number was created here, or it is not in
    /// the Init state.
    #[error("qp {0:#x} is not a queue pair of this reactor waiting to connect")]
    NotInit(u32),
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd({device}): {}", strerror(*errno))]
    AllocPd {
        /// The device.
        device: String,
        /// Its errno.
        errno: i32,
    },
}

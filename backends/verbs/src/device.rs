//! Device discovery ([`devices`], for `starwire info`) and opening one
//! port of a device for use ([`VerbsDevice`]).

use std::fmt;
use std::net::Ipv6Addr;
use std::sync::Arc;

use crate::error::{DeviceError, NoDeviceReason};
use crate::sys::{Context, DeviceAttr, DeviceList, Pd, PortAttr};

/// The first port of a device (verbs number ports from 1).
pub const DEFAULT_PORT: u8 = 1;
/// GID index 0: on InfiniBand the port GID, on RoCE the link-local
/// (RoCE v1, or v2 on most NICs) entry.
pub const DEFAULT_GID_INDEX: u32 = 0;
/// GID table entries `starwire info` reads per port at most.
const GIDS_LISTED: u32 = 32;

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: packets are routed by LID (and GID across subnets).
    InfiniBand,
    /// Ethernet (RoCE, Soft-RoCE `rdma_rxe`, iWARP): by GID.
    Ethernet,
    /// Not reported.
    Unspecified,
}

impl LinkLayer {
    fn from_raw(v: u8) -> Self {
        match v {
            1 => Self::InfiniBand,
            2 => Self::Ethernet,
            _ => Self::Unspecified,
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InfiniBand => "InfiniBand",
            Self::Ethernet => "Ethernet",
            Self::Unspecified => "unspecified",
        })
    }
}

/// A 128-bit GID, shown like an IPv6 address (which a RoCE v2 GID is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zero: an empty GID table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Ipv6Addr::from(self.0))
    }
}

/// `enum ibv_mtu` (1..=5) in bytes; 0 for a value outside it.
pub fn mtu_bytes(mtu: u8) -> u32 {
    match mtu {
        1..=5 => 128 << mtu,
        _ => 0,
    }
}

/// One port of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// `ibv_port_state_str` of its state (`PORT_ACTIVE` when usable).
    pub state: String,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Local identifier (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// Largest message the port carries.
    pub max_msg_size: u32,
    /// Non-empty GID table entries (the first few): index and GID.
    pub gids: Vec<(u32, Gid)>,
}

/// One device and the limits starwire's rings depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Firmware version.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// Queue pairs the device can hold.
    pub max_qp: u32,
    /// Work requests per queue (bounds a connection's send and receive
    /// depth).
    pub max_qp_wr: u32,
    /// Completion-queue entries (bounds the connections per reactor).
    pub max_cqe: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Ports.
    pub ports: Vec<PortInfo>,
}

/// A device found but unreadable.
pub type DeviceResult = Result<DeviceInfo, DeviceError>;

/// Every device libibverbs finds, with its ports and GIDs. Fails with
/// [`DeviceError::NoDevice`] when there is none (`ibv_get_device_list`
/// failing, as it does with `ENOSYS` on a kernel without RDMA support, or
/// an empty list); a device that cannot be opened or queried is listed
/// with its error.
pub fn devices() -> Result<Vec<DeviceResult>, DeviceError> {
    let list = device_list()?;
    Ok((0..list.len()).map(|i| describe(&list, i)).collect())
}

fn device_list() -> Result<DeviceList, DeviceError> {
    let list = DeviceList::get()
        .map_err(|errno| DeviceError::NoDevice(NoDeviceReason::GetDeviceList { errno }))?;
    if list.len() == 0 {
        return Err(DeviceError::NoDevice(NoDeviceReason::NoDevices));
    }
    Ok(list)
}

fn open_index(list: &DeviceList, i: usize) -> Result<(Context, DeviceAttr), DeviceError> {
    let device = list.name(i).unwrap_or_default();
    let ctx = list.open(i).map_err(|errno| DeviceError::Open {
        device: device.clone(),
        errno,
    })?;
    let attr = ctx
        .query_device()
        .map_err(|errno| DeviceError::QueryDevice { device, errno })?;
    Ok((ctx, attr))
}

fn query_port(ctx: &Context, port: u8) -> Result<PortAttr, DeviceError> {
    ctx.query_port(port)
        .map_err(|errno| DeviceError::QueryPort {
            device: ctx.name().to_owned(),
            port,
            errno,
        })
}

fn describe(list: &DeviceList, i: usize) -> DeviceResult {
    let (ctx, attr) = open_index(list, i)?;
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt {
        let p = query_port(&ctx, port)?;
        let gids = (0..p.gid_tbl_len.min(GIDS_LISTED))
            .filter_map(|index| {
                let gid = Gid(ctx.query_gid(port, index).ok()?);
                (!gid.is_zero()).then_some((index, gid))
            })
            .collect();
        ports.push(PortInfo {
            port,
            state: p.state,
            link_layer: LinkLayer::from_raw(p.link_layer),
            active_mtu: mtu_bytes(p.active_mtu),
            lid: p.lid,
            max_msg_size: p.max_msg_sz,
            gids,
        });
    }
    Ok(DeviceInfo {
        name: ctx.name().to_owned(),
        fw_ver: attr.fw_ver,
        node_guid: attr.node_guid,
        max_qp: attr.max_qp,
        max_qp_wr: attr.max_qp_wr,
        max_cqe: attr.max_cqe,
        max_mr_size: attr.max_mr_size,
        ports,
    })
}

/// `index` as the `sgid_index` of a queue pair's address vector (a `u8`):
/// an index above 255 is refused rather than silently replaced.
pub(crate) fn sgid_index(index: u32) -> Result<u8, DeviceError> {
    u8::try_from(index).map_err(|_| DeviceError::GidIndexTooLarge { index })
}

/// Which device, port and GID to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device name; `None` takes the first device found.
    pub name: Option<String>,
    /// Port number (from 1).
    pub port: u8,
    /// Index of the local GID in the port's table (the source GID of every
    /// packet; what the peer addresses us by).
    pub gid_index: u32,
}

impl Default for DeviceSpec {
    fn default() -> Self {
        Self {
            name: None,
            port: DEFAULT_PORT,
            gid_index: DEFAULT_GID_INDEX,
        }
    }
}

/// The device-wide state of one port: the open context and its one
/// protection domain, shared (cheaply cloned) by every reactor that uses
/// the port.
#[derive(Clone)]
pub struct VerbsDevice {
    inner: Arc<Inner>,
}

struct Inner {
    pd: Arc<Pd>,
    attr: DeviceAttr,
    port: u8,
    port_attr: PortAttr,
    gid_index: u32,
    /// `gid_index` as the `u8` a queue pair's address vector holds.
    sgid_index: u8,
    gid: Gid,
}

impl fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsDevice")
            .field("name", &self.name())
            .field("port", &self.inner.port)
            .field("gid_index", &self.inner.gid_index)
            .field("gid", &self.inner.gid)
            .finish()
    }
}

impl VerbsDevice {
    /// Open the device, check its port is active and its GID entry
    /// exists, and allocate the protection domain.
    pub fn open(spec: &DeviceSpec) -> Result<Self, DeviceError> {
        let sgid_index = sgid_index(spec.gid_index)?;
        let list = device_list()?;
        let names: Vec<String> = (0..list.len()).filter_map(|i| list.name(i)).collect();
        let index =
            match &spec.name {
                None => 0,
                Some(want) => names.iter().position(|n| n == want).ok_or_else(|| {
                    DeviceError::UnknownDevice {
                        name: want.clone(),
                        found: names.join(", "),
                    }
                })?,
            };
        let (ctx, attr) = open_index(&list, index)?;
        drop(list);
        let device = ctx.name().to_owned();
        let port_attr = query_port(&ctx, spec.port)?;
        if !port_attr.active {
            return Err(DeviceError::PortNotActive {
                device,
                port: spec.port,
                state: port_attr.state,
            });
        }
        let no_gid = |errno| DeviceError::NoGid {
            device: device.clone(),
            port: spec.port,
            index: spec.gid_index,
            errno,
        };
        let gid = Gid(ctx
            .query_gid(spec.port, spec.gid_index)
            .map_err(|e| no_gid(Some(e)))?);
        if gid.is_zero() && LinkLayer::from_raw(port_attr.link_layer) == LinkLayer::Ethernet {
            return Err(no_gid(None));
        }
        let ctx = Arc::new(ctx);
        let pd = Pd::alloc(&ctx).map_err(|errno| DeviceError::AllocPd {
            device: device.clone(),
            errno,
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                pd: Arc::new(pd),
                attr,
                port: spec.port,
                port_attr,
                gid_index: spec.gid_index,
                sgid_index,
                gid,
            }),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        self.inner.pd.context().name()
    }

    /// The port in use.
    pub fn port(&self) -> u8 {
        self.inner.port
    }

    /// The local GID index in use.
    pub fn gid_index(&self) -> u32 {
        self.inner.gid_index
    }

    /// The local GID.
    pub fn gid(&self) -> Gid {
        self.inner.gid
    }

    /// The port's LID (0 on Ethernet).
    pub fn lid(&self) -> u16 {
        self.inner.port_attr.lid
    }

    /// The port's link layer.
    pub fn link_layer(&self) -> LinkLayer {
        LinkLayer::from_raw(self.inner.port_attr.link_layer)
    }

    /// The port's active MTU (`enum ibv_mtu`).
    pub fn active_mtu(&self) -> u8 {
        self.inner.port_attr.active_mtu
    }

    /// The port's largest message.
    pub fn max_msg_size(&self) -> u32 {
        self.inner.port_attr.max_msg_sz
    }

    /// Work requests per queue the device allows.
    pub fn max_qp_wr(&self) -> u32 {
        self.inner.attr.max_qp_wr
    }

    /// Completion-queue entries the device allows.
    pub fn max_cqe(&self) -> u32 {
        self.inner.attr.max_cqe
    }

    /// The local GID index as a queue pair's `sgid_index`
    /// ([`open`](Self::open) refused one that does not fit).
    pub(crate) fn sgid_index(&self) -> u8 {
        self.inner.sgid_index
    }

    /// The device's protection domain.
    pub(crate) fn pd(&self) -> &Arc<Pd> {
        &self.inner.pd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtus_and_gids_read_as_users_write_them() {
        assert_eq!(mtu_bytes(1), 256);
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        assert_eq!(mtu_bytes(0), 0);
        assert_eq!(mtu_bytes(6), 0);
        let mut raw = [0u8; 16];
        raw[..2].copy_from_slice(&[0xfe, 0x80]);
        raw[15] = 1;
        assert_eq!(Gid(raw).to_string(), "fe80::1");
        assert!(Gid::default().is_zero());
    }

    #[test]
    fn gid_indexes_above_255_are_refused_before_any_device_is_opened() {
        assert_eq!(sgid_index(0), Ok(0));
        assert_eq!(sgid_index(255), Ok(255));
        for index in [256, 1000, u32::MAX] {
            let e = sgid_index(index).unwrap_err();
            assert_eq!(e, DeviceError::GidIndexTooLarge { index });
            assert!(e.to_string().contains("--gid-index"), "{e}");
            let spec = DeviceSpec {
                gid_index: index,
                ..DeviceSpec::default()
            };
            assert_eq!(VerbsDevice::open(&spec).unwrap_err(), e);
        }
    }

    /// The path every host without RDMA takes (this project's CI hosts:
    /// `ibv_get_device_list` fails with `ENOSYS`): a typed error with the
    /// exact user-facing text, no panic. On a host with devices the
    /// listing must succeed instead.
    #[test]
    fn no_device_is_a_typed_error_with_the_documented_text() {
        match devices() {
            Ok(list) => assert!(!list.is_empty(), "an empty list is NoDevice"),
            Err(DeviceError::NoDevice(reason)) => {
                let text = DeviceError::NoDevice(reason.clone()).to_string();
                let why = match &reason {
                    NoDeviceReason::GetDeviceList { errno } => {
                        format!("ibv_get_device_list: {}", crate::sys::strerror(*errno))
                    }
                    NoDeviceReason::NoDevices => "no devices".to_owned(),
                };
                assert_eq!(
                    text,
                    format!("no RDMA device found ({why}); use the tcp backend")
                );
                let e = VerbsDevice::open(&DeviceSpec::default()).unwrap_err();
                assert_eq!(e.to_string(), text);
            }
            Err(other) => panic!("expected NoDevice, got {other}"),
        }
        let enosys = DeviceError::NoDevice(NoDeviceReason::GetDeviceList {
            errno: libc::ENOSYS,
        });
        assert_eq!(
            enosys.to_string(),
            "no RDMA device found (ibv_get_device_list: Function not implemented); \
             use the tcp backend"
        );
        assert_eq!(
            DeviceError::NoDevice(NoDeviceReason::NoDevices).to_string(),
            "no RDMA device found (no devices); use the tcp backend"
        );
    }
}

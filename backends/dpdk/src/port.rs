//! A DPDK port: chosen by index, configured with rx/tx queue pairs whose
//! rings fill from one mempool sized from their depths, started, and
//! waited on until its link is up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use starwire_datagram::udp::MacAddr;

use crate::eal::Eal;
use crate::error::DpdkError;
use crate::ffi;

/// Mbufs a queue pair needs beyond its rings: the link's pending
/// transmit packets, one receive burst, and packets waiting in the
/// software demultiplexer for another link of the queue.
pub const SOFTWARE_MBUFS_PER_QUEUE: u32 = 1024;
/// The af_xdp poll-mode driver needs at least this many mbufs per
/// receive queue, whatever the descriptor count asked for.
pub const AF_XDP_RX_MBUFS: u32 = 2048;
/// Per-lcore mbuf cache of the pool.
const POOL_CACHE: u32 = 64;
/// Cache slack in the default pool size: the caches of a few lcores.
const CACHE_SLACK: u32 = 4 * POOL_CACHE;

/// How to set up a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortConfig {
    /// The port index (`--dpdk-port`).
    pub port: u16,
    /// Queue pairs wanted (one per reactor); the port gets at most what
    /// its driver offers, and [`Port::info`] says how many it has.
    pub queues: u16,
    /// Receive descriptors per queue.
    pub rx_desc: u16,
    /// Transmit descriptors per queue.
    pub tx_desc: u16,
    /// Mbufs in the pool; `None` sizes it from the queue depths.
    pub mbufs: Option<u32>,
    /// How long to wait for the link to come up.
    pub link_timeout: Duration,
}

impl Default for PortConfig {
    fn default() -> Self {
        Self {
            port: 0,
            queues: 1,
            rx_desc: 1024,
            tx_desc: 1024,
            mbufs: None,
            link_timeout: Duration::from_secs(5),
        }
    }
}

/// The state of a port's link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStatus {
    /// Link up.
    pub up: bool,
    /// Speed in Mbit/s as the driver reports it (0 when unknown).
    pub speed_mbps: u32,
    /// Full duplex.
    pub full_duplex: bool,
}

/// What a probed port is, before or after it is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The port index.
    pub port: u16,
    /// The device name (`net_ring0`, `net_af_xdp0`, a PCI address).
    pub name: String,
    /// The poll-mode driver.
    pub driver: String,
    /// The port's MAC address.
    pub mac: MacAddr,
    /// The port's MTU.
    pub mtu: u16,
    /// The largest MTU the driver allows.
    pub max_mtu: u16,
    /// The link right now.
    pub link: LinkStatus,
    /// Receive queues the driver offers.
    pub max_rx_queues: u16,
    /// Transmit queues the driver offers.
    pub max_tx_queues: u16,
    /// The port's NUMA node (-1 when unknown).
    pub socket: i32,
}

impl DeviceInfo {
    /// Describe port `port` of the running EAL.
    pub fn probe(_eal: &Eal, port: u16) -> Result<Self, DpdkError> {
        if !ffi::port_is_valid(port) {
            return Err(DpdkError::NoPort {
                port,
                available: ffi::port_count(),
            });
        }
        let q = |call| {
            move |(errno, reason)| DpdkError::PortQuery {
                port,
                call,
                errno,
                reason,
            }
        };
        let dev = ffi::dev_info(port).map_err(q("rte_eth_dev_info_get"))?;
        let mac = ffi::mac_addr(port).map_err(q("rte_eth_macaddr_get"))?;
        let mtu = ffi::mtu(port).map_err(q("rte_eth_dev_get_mtu"))?;
        let link = ffi::link(port).map_err(q("rte_eth_link_get_nowait"))?;
        Ok(Self {
            port,
            name: dev.name,
            driver: dev.driver,
            mac: MacAddr(mac),
            mtu,
            max_mtu: dev.max_mtu,
            link: LinkStatus {
                up: link.up,
                speed_mbps: link.speed_mbps,
                full_duplex: link.full_duplex,
            },
            max_rx_queues: dev.max_rx_queues,
            max_tx_queues: dev.max_tx_queues,
            socket: dev.socket,
        })
    }

    /// Every port of the running EAL.
    pub fn probe_all(eal: &Eal) -> Vec<Result<Self, DpdkError>> {
        (0..eal.ports()).map(|p| Self::probe(eal, p)).collect()
    }

    /// Queue pairs a port set up with `cfg` gets.
    pub fn queues_for(&self, cfg: &PortConfig) -> u16 {
        cfg.queues
            .min(self.max_rx_queues)
            .min(self.max_tx_queues)
            .max(1)
    }

    /// The fewest mbufs that fill `queues` queue pairs of depths `rx_desc`
    /// and `tx_desc` on this port's driver, with room for the software
    /// side.
    pub fn mbufs_needed(&self, queues: u16, rx_desc: u16, tx_desc: u16) -> (u32, String) {
        let rx = if self.driver == "net_af_xdp" {
            u32::from(rx_desc).max(AF_XDP_RX_MBUFS)
        } else {
            u32::from(rx_desc)
        };
        let per_queue = rx + u32::from(tx_desc) + SOFTWARE_MBUFS_PER_QUEUE;
        let why = format!(
            "{queues} queue pair(s) x ({rx} rx + {tx_desc} tx + {SOFTWARE_MBUFS_PER_QUEUE} in software{})",
            if self.driver == "net_af_xdp" {
                format!("; net_af_xdp needs at least {AF_XDP_RX_MBUFS} per receive queue")
            } else {
                String::new()
            }
        );
        (u32::from(queues) * per_queue, why)
    }
}

/// Counters of a port: `rte_eth_stats` (the extended ones are
/// [`Port::xstats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PortStats {
    /// Packets received.
    pub ipackets: u64,
    /// Packets sent.
    pub opackets: u64,
    /// Bytes received.
    pub ibytes: u64,
    /// Bytes sent.
    pub obytes: u64,
    /// Packets the NIC dropped for want of receive descriptors.
    pub imissed: u64,
    /// Receive errors.
    pub ierrors: u64,
    /// Transmit errors.
    pub oerrors: u64,
    /// Receive failures for want of mbufs.
    pub rx_nombuf: u64,
}

/// One rx/tx queue pair of an open port, owned by one link at a time.
#[derive(Debug)]
pub struct PortQueue(pub(crate) ffi::Queue);

impl PortQueue {
    /// The port index.
    pub fn port(&self) -> u16 {
        self.0.device().port()
    }

    /// The queue index on the port.
    pub fn index(&self) -> u16 {
        self.0.index()
    }
}

/// An open, started port with its link up. The port stops and closes when
/// the `Port` and every [`PortQueue`] taken from it are gone.
#[derive(Debug)]
pub struct Port {
    info: DeviceInfo,
    queues: u16,
    rx_desc: u16,
    tx_desc: u16,
    dev: Arc<ffi::Device>,
    free: Vec<ffi::Queue>,
}

impl Port {
    /// Open and start port `cfg.port` of `eal` and wait for its link.
    pub fn open(eal: &Eal, cfg: &PortConfig) -> Result<Self, DpdkError> {
        let port = cfg.port;
        let info = DeviceInfo::probe(eal, port)?;
        let queues = info.queues_for(cfg);
        let (need, why) = info.mbufs_needed(queues, cfg.rx_desc, cfg.tx_desc);
        let mbufs = match cfg.mbufs {
            Some(asked) if asked < need => {
                return Err(DpdkError::TooFewMbufs {
                    port,
                    asked,
                    need,
                    why,
                })
            }
            Some(asked) => asked,
            // A power of two minus one is the ring size DPDK wastes least on.
            None => ((need + CACHE_SLACK).next_power_of_two() - 1).max(need + CACHE_SLACK),
        };
        // The af_xdp PMD registers the pool as its UMEM: from the first
        // object's page, `populated_size` frames of the object size. A pool
        // that keeps each object within a page (what DPDK does without
        // hugepages) spreads the objects wider than that, and the kernel
        // takes every descriptor past the UMEM's end as invalid: neither
        // sent nor completed, so its mbuf is lost too.
        let packed = info.driver == "net_af_xdp";
        let pool = ffi::Mempool::new(
            &format!("starwire_p{port}"),
            mbufs,
            POOL_CACHE,
            info.socket,
            packed,
        )
        .map_err(|(errno, reason)| DpdkError::Mempool {
            port,
            mbufs,
            errno,
            reason,
        })?;
        let setup = ffi::DeviceSetup {
            queues,
            rx_desc: cfg.rx_desc,
            tx_desc: cfg.tx_desc,
        };
        let dev = ffi::Device::start(port, setup, Arc::new(pool), info.socket).map_err(|e| {
            let (step, errno, reason) = match e {
                ffi::SetupError::Configure(e, s) => ("rte_eth_dev_configure".to_owned(), e, s),
                ffi::SetupError::AdjustDesc(e, s) => {
                    ("rte_eth_dev_adjust_nb_rx_tx_desc".to_owned(), e, s)
                }
                ffi::SetupError::RxQueue(q, e, s) => (format!("rte_eth_rx_queue_setup({q})"), e, s),
                ffi::SetupError::TxQueue(q, e, s) => (format!("rte_eth_tx_queue_setup({q})"), e, s),
                ffi::SetupError::Start(e, s) => ("rte_eth_dev_start".to_owned(), e, s),
            };
            DpdkError::PortSetup {
                port,
                step,
                errno,
                reason,
            }
        })?;
        let dev = Arc::new(dev);
        let mut free = dev
            .take_queues()
            .expect("a device just started hands its queues out");
        free.reverse();
        let (rx_desc, tx_desc) = dev.descriptors();
        let mut port = Self {
            info,
            queues,
            rx_desc,
            tx_desc,
            dev,
            free,
        };
        port.wait_link(cfg.link_timeout)?;
        tracing::info!(
            port = port.info.port,
            name = %port.info.name,
            driver = %port.info.driver,
            mac = %port.info.mac,
            mtu = port.info.mtu,
            queues,
            mbufs,
            "DPDK port started"
        );
        Ok(port)
    }

    fn wait_link(&mut self, timeout: Duration) -> Result<(), DpdkError> {
        let port = self.info.port;
        let start = Instant::now();
        loop {
            let l = ffi::link(port).map_err(|(errno, reason)| DpdkError::PortQuery {
                port,
                call: "rte_eth_link_get_nowait",
                errno,
                reason,
            })?;
            self.info.link = LinkStatus {
                up: l.up,
                speed_mbps: l.speed_mbps,
                full_duplex: l.full_duplex,
            };
            if l.up {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(DpdkError::LinkDown {
                    port,
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What the port is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Queue pairs configured.
    pub fn queues(&self) -> u16 {
        self.queues
    }

    /// Receive and transmit descriptors per queue.
    pub fn descriptors(&self) -> (u16, u16) {
        (self.rx_desc, self.tx_desc)
    }

    /// Mbufs in the port's pool.
    pub fn mbufs(&self) -> u32 {
        self.dev.pool().size()
    }

    /// Mbufs free in the pool right now.
    pub fn mbufs_available(&self) -> u32 {
        self.dev.pool().available()
    }

    /// Take the next queue pair not yet taken.
    pub fn take_queue(&mut self) -> Option<PortQueue> {
        self.free.pop().map(PortQueue)
    }

    /// The port's counters.
    pub fn stats(&self) -> Result<PortStats, DpdkError> {
        let port = self.info.port;
        let s = ffi::stats(port).map_err(|(errno, reason)| DpdkError::PortQuery {
            port,
            call: "rte_eth_stats_get",
            errno,
            reason,
        })?;
        Ok(PortStats {
            ipackets: s.ipackets,
            opackets: s.opackets,
            ibytes: s.ibytes,
            obytes: s.obytes,
            imissed: s.imissed,
            ierrors: s.ierrors,
            oerrors: s.oerrors,
            rx_nombuf: s.rx_nombuf,
        })
    }

    /// The port's extended counters, by name.
    pub fn xstats(&self) -> Result<Vec<(String, u64)>, DpdkError> {
        let port = self.info.port;
        ffi::xstats(port).map_err(|(errno, reason)| DpdkError::PortQuery {
            port,
            call: "rte_eth_xstats_get",
            errno,
            reason,
        })
    }
}

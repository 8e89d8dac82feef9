//! The DPDK port of a process, opened once for every role that runs in
//! it: the EAL, the port and its queue pairs. With one queue pair per
//! reactor (`ContextConfig::queues`, as many as the port offers) each
//! link leases a pair of its own ([`QueueSet`], steered by `rte_flow` or
//! in software); with one, every link shares it ([`SharedQueue`]). Each
//! link is bound to a UDP port of its own, so the links of both ends of a
//! connection in one process (a `net_ring` port that loops back to
//! itself) are told apart by destination port.

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use starwire_datagram::udp::UdpEndpoint;
use starwire_datagram::{DatagramDriver, ReliableConfig};

use crate::eal::{eal_args, Eal};
use crate::error::DpdkError;
use crate::link::{DpdkLink, LinkConfig, SharedQueue};
use crate::port::{Port, PortConfig, PortStats};
use crate::steer::{probe_steering, QueueSet, Steering};

/// The datagram driver of one reactor over DPDK.
pub type DpdkDriver = DatagramDriver<DpdkLink>;

/// Where the process's DPDK runs: what `--eal`, `--dpdk-port` and
/// `--dpdk-ip` say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextConfig {
    /// EAL arguments; `None`: `STARWIRE_EAL_ARGS`.
    pub eal: Option<String>,
    /// The port index.
    pub port: u16,
    /// This end's IPv4 address on the port; `None`: the local address of
    /// each bootstrap connection, or loopback where there is none.
    pub ip: Option<Ipv4Addr>,
    /// The UDP port of the first link; later links take the next ones.
    /// `None`: 20000.
    pub first_udp_port: Option<u16>,
    /// Queue pairs to set up, one per reactor of the process (`None`:
    /// one, shared by every link); the port gets at most what its driver
    /// offers.
    pub queues: Option<u16>,
    /// The process makes one link at a time (it runs one reactor): with
    /// one queue pair, the link leases it and uses it without the shared
    /// queue's lock, and a second link at once fails with `QueuesTaken`.
    pub one_link: bool,
}

/// The DPDK port of this process (see the module). [`close`](Self::close)
/// stops the port when the command is done (an af_xdp port detaches its
/// XDP program from the interface then).
#[derive(Debug)]
pub struct DpdkContext {
    open: Mutex<Option<Opened>>,
    ip: Option<Ipv4Addr>,
    next_udp: AtomicU16,
}

#[derive(Debug)]
struct Opened {
    // The queues before the port: links' leases go back to the set first.
    queues: Queues,
    port: Port,
}

/// The queue pairs the links of the process use.
#[derive(Debug)]
enum Queues {
    /// One pair, shared under a lock.
    Single(SharedQueue),
    /// A pair per link (one pair for a process that makes one link at a
    /// time).
    Set(QueueSet),
}

static CONTEXT: OnceLock<Result<DpdkContext, DpdkError>> = OnceLock::new();
/// The configuration the context opens with, set by the command before
/// its runs.
static CONFIG: OnceLock<ContextConfig> = OnceLock::new();

/// First UDP port the links of this process bind, unless configured.
const FIRST_UDP_PORT: u16 = 20_000;
/// UDP ports tried for a new link (ports of links that ended are free
/// again).
const UDP_PORT_TRIES: usize = 64;

impl DpdkContext {
    /// Remember the configuration [`get`](Self::get) opens the port with
    /// (the first call counts).
    pub fn configure(cfg: ContextConfig) {
        let _ = CONFIG.set(cfg);
    }

    /// The context: on the first call, initialise the EAL and open the
    /// port the configuration names (else `STARWIRE_EAL_ARGS` and port 0);
    /// later calls return the first outcome.
    pub fn get() -> Result<&'static DpdkContext, DpdkError> {
        let r = CONTEXT.get_or_init(|| {
            let c = CONFIG.get().cloned().unwrap_or_default();
            let eal = Eal::init(&eal_args(c.eal.as_deref()))?;
            let cfg = PortConfig {
                port: c.port,
                queues: c.queues.unwrap_or(1).max(1),
                ..PortConfig::default()
            };
            let mut port = Port::open(eal, &cfg)?;
            let queues_open = port.queues();
            let (probed, mut why) = probe_steering(c.port, queues_open);
            let queues = match probed {
                Steering::Single if c.one_link => Queues::Set(QueueSet::new(&mut port, probed)?),
                Steering::Single => Queues::Single(SharedQueue::new(
                    port.take_queue()
                        .ok_or(DpdkError::NoQueue { port: c.port })?,
                )),
                _ => Queues::Set(QueueSet::new(&mut port, probed)?),
            };
            let steering = match &queues {
                Queues::Single(_) => Steering::Single,
                Queues::Set(s) => {
                    if let Some(refused) = s.rte_flow_refused() {
                        why = format!("{why}, but rte_flow_create refused it: {refused}");
                    }
                    s.steering()
                }
            };
            tracing::info!(
                port = c.port,
                queues = queues_open,
                asked = cfg.queues,
                steering = steering.as_str(),
                %why,
                "DPDK steering"
            );
            Ok(DpdkContext {
                open: Mutex::new(Some(Opened { queues, port })),
                ip: c.ip,
                next_udp: AtomicU16::new(c.first_udp_port.unwrap_or(FIRST_UDP_PORT)),
            })
        });
        r.as_ref().map_err(Clone::clone)
    }

    /// Make the calling thread an EAL thread (reactor threads call this
    /// first, so mempool caches work); a failure is logged, and the thread
    /// goes on without a cache.
    pub fn register_thread(&self) {
        if let Some(eal) = Eal::get() {
            if let Err(e) = eal.register_thread() {
                tracing::warn!(%e, "reactor thread not registered with the EAL");
            }
        }
    }

    /// Stop and close the port, if this process opened it, once every
    /// link is gone (the command's runs are over); links made later fail.
    pub fn close() {
        if let Some(Ok(ctx)) = CONTEXT.get() {
            let opened = ctx.lock().take();
            if let Some(o) = &opened {
                tracing::debug!(
                    stats = ?o.port.stats(),
                    xstats = ?o.port.xstats(),
                    "closing the DPDK port"
                );
            }
            drop(opened);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Opened>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How the packets of the process's links reach them (`None` once the
    /// port is closed).
    pub fn steering(&self) -> Option<Steering> {
        self.lock().as_ref().map(|o| match &o.queues {
            Queues::Single(_) => Steering::Single,
            Queues::Set(s) => s.steering(),
        })
    }

    /// A new link on a queue pair of its own (or the shared one), bound
    /// to a UDP port of its own, at
    /// `ip` (without a configured address, the first bootstrap connection's
    /// local address replaces it); its connections' peers are set by the
    /// bootstrap.
    pub fn link(&self, ip: Ipv4Addr) -> Result<DpdkLink, DpdkError> {
        let open = self.lock();
        let Some(Opened { port, queues }) = open.as_ref() else {
            return Err(DpdkError::PortClosed);
        };
        let info = port.info();
        let mut last = DpdkError::PortClosed;
        for _ in 0..UDP_PORT_TRIES {
            let udp = self.next_udp.fetch_add(1, Ordering::Relaxed);
            let local = UdpEndpoint {
                mac: info.mac,
                ip,
                port: udp,
            };
            let cfg = LinkConfig {
                ip_from_bootstrap: self.ip.is_none(),
                ..LinkConfig::new(local, local)
            };
            let made = match queues {
                Queues::Single(q) => DpdkLink::shared(q, info.mtu, cfg),
                Queues::Set(set) => DpdkLink::steered(set, info.mtu, cfg),
            };
            match made {
                Ok(link) => return Ok(link),
                Err(e @ DpdkError::UdpPortInUse { .. }) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// A driver over a new [`link`](Self::link).
    pub fn driver(&self, ip: Ipv4Addr, cfg: ReliableConfig) -> Result<DpdkDriver, DpdkError> {
        DatagramDriver::new(self.link(ip)?, cfg).map_err(|e| DpdkError::Driver(e.to_string()))
    }

    /// This end's IPv4 address when no connection names it: the
    /// configured one, else loopback (in-process runs).
    pub fn ip_or_loopback(&self) -> Ipv4Addr {
        self.ip.unwrap_or(Ipv4Addr::LOCALHOST)
    }

    /// The configured IPv4 address, if any.
    pub fn ip(&self) -> Option<Ipv4Addr> {
        self.ip
    }

    /// This end's IPv4 address: the configured one, else the local
    /// address of the bootstrap connection.
    pub fn ip_for(&self, stream: &TcpStream) -> Result<Ipv4Addr, DpdkError> {
        if let Some(ip) = self.ip {
            return Ok(ip);
        }
        let local = stream
            .local_addr()
            .map_err(|e| DpdkError::Bootstrap(e.to_string()))?;
        match local.ip() {
            IpAddr::V4(ip) => Ok(ip),
            IpAddr::V6(ip) => Err(DpdkError::Bootstrap(format!(
                "the bootstrap connection is IPv6 ({ip}); give --dpdk-ip"
            ))),
        }
    }

    /// The context, if this process has opened it; unlike
    /// [`get`](Self::get) this never initialises the EAL (a metrics
    /// scrape asks it, and must not open a port the command never used).
    pub fn opened() -> Option<&'static DpdkContext> {
        CONTEXT.get().and_then(|r| r.as_ref().ok())
    }

    /// The port's index (`None` once closed).
    pub fn port_index(&self) -> Option<u16> {
        self.lock().as_ref().map(|o| o.port.info().port)
    }

    /// The port's counters (`None` once closed, or when DPDK cannot read
    /// them).
    pub fn port_stats(&self) -> Option<PortStats> {
        self.lock().as_ref().and_then(|o| o.port.stats().ok())
    }

    /// The port's extended counters by name, as its driver reports them
    /// (`rte_eth_xstats_get`; `None` once closed, or when DPDK cannot read
    /// them).
    pub fn port_xstats(&self) -> Option<Vec<(String, u64)>> {
        self.lock().as_ref().and_then(|o| o.port.xstats().ok())
    }
}

/// Closes the DPDK port of the process ([`DpdkContext::close`]) when
/// dropped: a command holds one for its duration.
#[derive(Debug)]
pub struct CloseOnDrop;

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        DpdkContext::close();
    }
}

//! The DPDK side of the command line (feature `dpdk`): the EAL and port
//! flags, what `starwire info` shows about them, the port a process opens
//! once for its runs, and the bootstrap over TCP through which two ends
//! learn each other's addresses and connection ids.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};
use starwire_datagram::udp::UdpEndpoint;
use starwire_datagram::{DatagramDriver, DatagramLink, Impaired, ReliableConfig};
use starwire_dpdk::{
    DeviceInfo, DpdkLink, Eal, LinkConfig, Port, PortConfig, SharedQueue, EAL_ARGS_ENV,
};
use starwire_transport::ConnId;

/// Where DPDK runs: the EAL arguments and the port.
#[derive(Debug, Clone, clap::Args)]
pub struct DpdkArgs {
    /// DPDK EAL arguments, one string (e.g. "--no-huge --no-pci
    /// --no-shconf -m 512 --vdev=net_ring0"); default: STARWIRE_EAL_ARGS.
    #[arg(long, allow_hyphen_values = true)]
    pub eal: Option<String>,
    /// The DPDK port index.
    #[arg(long, default_value_t = 0)]
    pub dpdk_port: u16,
    /// This end's IPv4 address on the DPDK port (default: the local
    /// address of the TCP connection the ends bootstrap over).
    #[arg(long)]
    pub dpdk_ip: Option<Ipv4Addr>,
}

/// `starwire info`'s DPDK section. The EAL is initialised (once, for the
/// process) only when arguments are given: DPDK's defaults want
/// hugepages and PCI devices.
pub fn info_json(a: &DpdkArgs) -> Value {
    let args = starwire_dpdk::eal_args(a.eal.as_deref());
    let source = match (&a.eal, std::env::var_os(EAL_ARGS_ENV)) {
        (Some(_), _) => "--eal",
        (None, Some(_)) => EAL_ARGS_ENV,
        (None, None) => "none",
    };
    if args.trim().is_empty() {
        return json!({"eal_args": null, "source": source, "ports": null,
            "note": format!("give --eal \"ARGS\" or {EAL_ARGS_ENV} to probe ports")});
    }
    let eal = match Eal::init(&args) {
        Ok(eal) => eal,
        Err(e) => return json!({"eal_args": args, "source": source, "error": e.to_string()}),
    };
    let cfg = PortConfig {
        port: a.dpdk_port,
        ..PortConfig::default()
    };
    let ports: Vec<Value> = DeviceInfo::probe_all(eal)
        .into_iter()
        .enumerate()
        .map(|(i, r)| match r {
            Ok(d) => {
                let queues = d.queues_for(&cfg);
                let (mbufs, why) = d.mbufs_needed(queues, cfg.rx_desc, cfg.tx_desc);
                json!({
                    "port": d.port,
                    "name": d.name,
                    "driver": d.driver,
                    "mac": d.mac.to_string(),
                    "mtu": d.mtu,
                    "link": {"up": d.link.up, "speed_mbps": d.link.speed_mbps,
                             "full_duplex": d.link.full_duplex},
                    "max_queues": {"rx": d.max_rx_queues, "tx": d.max_tx_queues},
                    "socket": d.socket,
                    "setup": {"queues": queues, "rx_desc": cfg.rx_desc, "tx_desc": cfg.tx_desc,
                              "mbufs_needed": mbufs, "mbufs_why": why},
                    "selected": d.port == a.dpdk_port,
                })
            }
            Err(e) => json!({"port": i, "error": e.to_string()}),
        })
        .collect();
    json!({"eal_args": args, "source": source, "ports": ports})
}

/// The text form of [`info_json`].
pub fn print_info(d: &Value) {
    let s = crate::info::text;
    println!("\ndpdk");
    if let Some(e) = d.get("error") {
        println!(
            "  EAL args       {} (from {})",
            s(&d["eal_args"]),
            s(&d["source"])
        );
        println!("  EAL            FAILED: {}", s(e));
        return;
    }
    if d["eal_args"].is_null() {
        println!("  EAL args       none: {}", s(&d["note"]));
        return;
    }
    println!(
        "  EAL args       {} (from {})",
        s(&d["eal_args"]),
        s(&d["source"])
    );
    let ports = d["ports"].as_array().cloned().unwrap_or_default();
    if ports.is_empty() {
        println!("  ports          none probed (add a device, e.g. --vdev=net_ring0)");
    }
    for p in ports {
        if let Some(e) = p.get("error") {
            println!("  port {}         {}", s(&p["port"]), s(e));
            continue;
        }
        let st = &p["setup"];
        println!(
            "  port {}{}       {} (driver {}), MAC {}, MTU {}, link {} {} Mbit/s; queues rx {} tx {} \
             (starwire sets up {}, {} rx + {} tx descriptors), mbufs {} ({})",
            s(&p["port"]),
            if p["selected"] == true { "*" } else { " " },
            s(&p["name"]),
            s(&p["driver"]),
            s(&p["mac"]),
            s(&p["mtu"]),
            if p["link"]["up"] == true { "up" } else { "down" },
            s(&p["link"]["speed_mbps"]),
            s(&p["max_queues"]["rx"]),
            s(&p["max_queues"]["tx"]),
            s(&st["queues"]),
            s(&st["rx_desc"]),
            s(&st["tx_desc"]),
            s(&st["mbufs_needed"]),
            s(&st["mbufs_why"]),
        );
    }
}

/// The DPDK port of this process, opened once for every run: the EAL, the
/// port and its first queue pair, shared by the links of the process
/// (both ends of a run in one process on `net_ring` loop back through it,
/// each link bound to its own UDP port). [`close`](Self::close) stops the
/// port when the command is done (an af_xdp port detaches its XDP
/// program from the interface then).
#[derive(Debug)]
pub struct DpdkContext {
    open: Mutex<Option<Opened>>,
    ip: Option<Ipv4Addr>,
    next_udp: AtomicU16,
}

#[derive(Debug)]
struct Opened {
    port: Port,
    queue: SharedQueue,
}

static CONTEXT: OnceLock<Result<DpdkContext, String>> = OnceLock::new();
/// The flags the context opens with, set by the command before its runs.
static ARGS: OnceLock<DpdkArgs> = OnceLock::new();

/// First UDP port the links of this process bind.
const FIRST_UDP_PORT: u16 = 20_000;

impl DpdkContext {
    /// Remember the flags [`get`](Self::get) opens the port with (the
    /// first call counts).
    pub fn configure(a: &DpdkArgs) {
        let _ = ARGS.set(a.clone());
    }

    /// The context: on the first call, initialise the EAL and open the
    /// port the configured flags name (else `STARWIRE_EAL_ARGS` and port
    /// 0); later calls return the first outcome.
    pub fn get() -> Result<&'static DpdkContext, String> {
        let r = CONTEXT.get_or_init(|| {
            let a = ARGS.get().cloned().unwrap_or(DpdkArgs {
                eal: None,
                dpdk_port: 0,
                dpdk_ip: None,
            });
            let args = starwire_dpdk::eal_args(a.eal.as_deref());
            let eal = Eal::init(&args).map_err(|e| e.to_string())?;
            let cfg = PortConfig {
                port: a.dpdk_port,
                ..PortConfig::default()
            };
            let mut port = Port::open(eal, &cfg).map_err(|e| e.to_string())?;
            let queue = port
                .take_queue()
                .ok_or_else(|| format!("DPDK port {}: no queue pair", a.dpdk_port))?;
            Ok(DpdkContext {
                open: Mutex::new(Some(Opened {
                    port,
                    queue: SharedQueue::new(queue),
                })),
                ip: a.dpdk_ip,
                next_udp: AtomicU16::new(FIRST_UDP_PORT),
            })
        });
        r.as_ref().map_err(Clone::clone)
    }

    /// Make the calling thread an EAL thread (reactor threads call this
    /// first).
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
            drop(opened);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Opened>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new link on the shared queue, bound to a UDP port of its own, at
    /// `ip`; its connections' peers are set by [`bootstrap`].
    pub fn link(&self, ip: Ipv4Addr) -> Result<DpdkLink, String> {
        let open = self.lock();
        let Some(Opened { port, queue }) = open.as_ref() else {
            return Err("the DPDK port is closed".into());
        };
        let info = port.info();
        let mut last = None;
        // Ports of links that ended are free again; try a few.
        for _ in 0..64 {
            let udp = self.next_udp.fetch_add(1, Ordering::Relaxed);
            let local = UdpEndpoint {
                mac: info.mac,
                ip,
                port: udp,
            };
            match DpdkLink::shared(queue, info.mtu, LinkConfig::new(local, local)) {
                Ok(link) => return Ok(link),
                Err(e) => last = Some(e),
            }
        }
        Err(format!("no free UDP port on the DPDK queue: {last:?}"))
    }

    /// A driver over a new [`link`](Self::link).
    pub fn driver(&self, ip: Ipv4Addr, cfg: ReliableConfig) -> Result<DpdkDriver, String> {
        DatagramDriver::new(self.link(ip)?, cfg).map_err(|e| format!("dpdk driver: {e}"))
    }

    /// This end's IPv4 address when no connection names it: `--dpdk-ip`,
    /// else loopback (in-process runs).
    pub fn ip_or_loopback(&self) -> Ipv4Addr {
        self.ip.unwrap_or(Ipv4Addr::LOCALHOST)
    }

    /// This end's IPv4 address: `--dpdk-ip`, else the local address of
    /// the bootstrap connection.
    pub fn ip_for(&self, stream: &TcpStream) -> Result<Ipv4Addr, String> {
        if let Some(ip) = self.ip {
            return Ok(ip);
        }
        match stream.local_addr().map_err(|e| e.to_string())?.ip() {
            IpAddr::V4(ip) => Ok(ip),
            IpAddr::V6(ip) => Err(format!(
                "the bootstrap connection is IPv6 ({ip}); give --dpdk-ip"
            )),
        }
    }

    /// The port's counters (`None` once closed, or when DPDK cannot
    /// read them).
    pub fn port_stats(&self) -> Option<starwire_dpdk::PortStats> {
        self.lock().as_ref().and_then(|o| o.port.stats().ok())
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

/// The datagram driver of one reactor over DPDK.
pub type DpdkDriver = DatagramDriver<DpdkLink>;

/// A link whose connections the bootstrap can point at their peers: a
/// [`DpdkLink`], or one under a fault injector.
pub trait OnDpdk: DatagramLink {
    /// The DPDK link.
    fn dpdk(&self) -> &DpdkLink;
    /// The DPDK link, mutably.
    fn dpdk_mut(&mut self) -> &mut DpdkLink;
}

impl OnDpdk for DpdkLink {
    fn dpdk(&self) -> &DpdkLink {
        self
    }
    fn dpdk_mut(&mut self) -> &mut DpdkLink {
        self
    }
}

impl OnDpdk for Impaired<DpdkLink> {
    fn dpdk(&self) -> &DpdkLink {
        self.inner()
    }
    fn dpdk_mut(&mut self) -> &mut DpdkLink {
        self.inner_mut()
    }
}

/// Magic word of a bootstrap line.
const HELLO: &str = "starwire-dpdk-hello";
/// Bootstrap protocol version.
const HELLO_VERSION: u32 = 1;

/// What each end tells the other over the bootstrap connection: where its
/// datagrams go and the connection ids to address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The sender's MAC, IPv4 address and UDP port.
    pub endpoint: UdpEndpoint,
    /// Its connection ids, in connection order.
    pub ids: Vec<u32>,
}

impl Hello {
    fn line(&self) -> String {
        let ids: Vec<String> = self.ids.iter().map(u32::to_string).collect();
        format!(
            "{HELLO} {HELLO_VERSION} {} {} {} {}\n",
            self.endpoint.mac,
            self.endpoint.ip,
            self.endpoint.port,
            if ids.is_empty() {
                "-".to_owned()
            } else {
                ids.join(",")
            }
        )
    }

    fn parse(line: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("bad DPDK bootstrap line {:?}: {why}", line.trim_end());
        let w: Vec<&str> = line.split_whitespace().collect();
        let [magic, version, mac, ip, port, ids] = w[..] else {
            return Err(bad("expected 6 fields"));
        };
        if magic != HELLO || version != HELLO_VERSION.to_string() {
            return Err(bad("not a starwire DPDK hello of this version"));
        }
        let ids = if ids == "-" {
            Vec::new()
        } else {
            ids.split(',')
                .map(|x| x.parse::<u32>().map_err(|_| bad("connection id")))
                .collect::<Result<_, _>>()?
        };
        Ok(Hello {
            endpoint: UdpEndpoint {
                mac: mac.parse().map_err(|e| bad(&format!("{e}")))?,
                ip: ip.parse().map_err(|_| bad("IPv4 address"))?,
                port: port.parse().map_err(|_| bad("UDP port"))?,
            },
            ids,
        })
    }
}

/// How long a bootstrap exchange may take.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);

/// Exchange hellos over `stream`: prepare `n` connections on `driver`,
/// send where they are, read the peer's, send each connection's packets
/// to the peer's address and connect it to the peer's connection of the
/// same index. Returns the connections, in order.
pub fn bootstrap<L: OnDpdk>(
    driver: &mut DatagramDriver<L>,
    stream: &TcpStream,
    n: usize,
) -> Result<Vec<ConnId>, String> {
    let mut conns = Vec::with_capacity(n);
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let (c, id) = driver.prepare().map_err(|e| e.to_string())?;
        conns.push(c);
        ids.push(id);
    }
    let mine = Hello {
        endpoint: driver.link().dpdk().config().local,
        ids,
    };
    stream
        .set_read_timeout(Some(BOOTSTRAP_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut w = stream;
    w.write_all(mine.line().as_bytes())
        .map_err(|e| format!("DPDK bootstrap: {e}"))?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(|e| format!("DPDK bootstrap: {e}"))?;
    let peer = Hello::parse(&line)?;
    if peer.ids.len() != n {
        return Err(format!(
            "DPDK bootstrap: the peer has {} connections, this end {n}",
            peer.ids.len()
        ));
    }
    for (&c, &id) in conns.iter().zip(&peer.ids) {
        driver.link_mut().dpdk_mut().add_peer(id, peer.endpoint);
        driver.connect(c, id).map_err(|e| e.to_string())?;
    }
    tracing::debug!(local = %mine.endpoint, peer = %peer.endpoint, n, "DPDK bootstrap done");
    Ok(conns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_lines_round_trip_and_refuse_garbage() {
        let h = Hello {
            endpoint: UdpEndpoint {
                mac: "02:00:00:00:00:07".parse().unwrap(),
                ip: Ipv4Addr::new(10, 1, 2, 3),
                port: 20001,
            },
            ids: vec![0, 1, 1 << 20],
        };
        assert_eq!(Hello::parse(&h.line()), Ok(h.clone()));
        let none = Hello { ids: vec![], ..h };
        assert_eq!(Hello::parse(&none.line()), Ok(none));
        for bad in [
            "",
            "starwire-dpdk-hello 2 02:00:00:00:00:07 10.1.2.3 1 0",
            "starwire-dpdk-hello 1 02:00:00:00:00 10.1.2.3 1 0",
            "starwire-dpdk-hello 1 02:00:00:00:00:07 10.1.2 1 0",
            "starwire-dpdk-hello 1 02:00:00:00:00:07 10.1.2.3 70000 0",
            "starwire-dpdk-hello 1 02:00:00:00:00:07 10.1.2.3 1 0,x",
        ] {
            assert!(Hello::parse(bad).is_err(), "{bad}");
        }
    }
}

//! The DPDK side of the command line (feature `dpdk`): the EAL and port
//! flags and what `starwire info` shows about them. The port a process
//! opens once for its runs, and the bootstrap over TCP through which two
//! ends learn each other's addresses and connection ids, are
//! `starwire-dpdk`'s ([`DpdkContext`], [`bootstrap`]), which the trainer
//! shares.

use std::net::Ipv4Addr;

use serde_json::{json, Value};
pub use starwire_dpdk::{bootstrap, CloseOnDrop, ContextConfig, DpdkContext, DpdkDriver, OnDpdk};
use starwire_dpdk::{DeviceInfo, Eal, PortConfig, EAL_ARGS_ENV};

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
    /// Queue pairs to set up on the DPDK port, one per reactor of this
    /// process (default: bench and soak, their reactors in this process;
    /// train, ps and worker, 1). With two or more each reactor's link has
    /// a pair of its own, steered by rte_flow where the port supports it,
    /// else demultiplexed in software; with 1 every link shares it.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub dpdk_queues: Option<u16>,
}

impl DpdkArgs {
    /// What the process's [`DpdkContext`] opens with.
    pub fn context_config(&self) -> ContextConfig {
        ContextConfig {
            eal: self.eal.clone(),
            port: self.dpdk_port,
            ip: self.dpdk_ip,
            first_udp_port: None,
            queues: self.dpdk_queues,
            one_link: false,
        }
    }

    /// Set the process's [`DpdkContext`] up from these flags (before its
    /// first use).
    pub fn configure(&self) {
        DpdkContext::configure(self.context_config());
    }

    /// Like [`configure`](Self::configure), with `reactors` queue pairs
    /// unless `--dpdk-queues` says otherwise: a command that knows how
    /// many reactors it runs gives each a queue pair (and a process of one
    /// reactor, one link at a time, uses its pair without a lock).
    pub fn configure_for(&self, reactors: usize) {
        let mut c = self.context_config();
        c.queues = c
            .queues
            .or(Some(u16::try_from(reactors.max(1)).unwrap_or(u16::MAX)));
        c.one_link = reactors <= 1;
        DpdkContext::configure(c);
    }
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
        queues: a.dpdk_queues.unwrap_or(1),
        ..PortConfig::default()
    };
    let ports: Vec<Value> = DeviceInfo::probe_all(eal)
        .into_iter()
        .enumerate()
        .map(|(i, r)| match r {
            Ok(d) => {
                let queues = d.queues_for(&cfg);
                let (mbufs, why) = d.mbufs_needed(queues, cfg.rx_desc, cfg.tx_desc);
                // Validated on the port as probed (not yet configured); a
                // run logs the steering it chose once the port is started.
                let (steering, steering_why) = starwire_dpdk::probe_steering(d.port, queues);
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
                              "mbufs_needed": mbufs, "mbufs_why": why,
                              "steering": steering.as_str(), "steering_why": steering_why},
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
             (starwire sets up {}, {} rx + {} tx descriptors), mbufs {} ({}); steering {} ({})",
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
            s(&st["steering"]),
            s(&st["steering_why"]),
        );
    }
}

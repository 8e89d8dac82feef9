//! RDMA in `starwire info`: the devices under `/sys/class/infiniband` and,
//! with the `verbs` feature, what libibverbs reports of each (ports, link
//! layer, GIDs, the limits the rings depend on), or why there is none.

use std::path::Path;

use serde_json::{json, Value};

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

/// The `rdma` section of `starwire info --json`.
pub fn devices_json() -> Value {
    let dir = Path::new("/sys/class/infiniband");
    let mut sysfs = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let node = read_trim(e.path().join("device/numa_node"));
            sysfs.push(json!({ "name": name, "numa_node": node }));
        }
    }
    sysfs.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    json!({
        "present": dir.exists(),
        "devices": sysfs,
        "backend_compiled_in": cfg!(all(feature = "verbs", target_os = "linux")),
        "verbs": verbs_json(),
    })
}

#[cfg(all(feature = "verbs", target_os = "linux"))]
fn verbs_json() -> Value {
    let list = match starwire_verbs::devices() {
        Ok(list) => list,
        Err(e) => return json!({ "devices": [], "error": e.to_string() }),
    };
    let devs: Vec<Value> = list
        .into_iter()
        .map(|d| match d {
            Err(e) => json!({ "error": e.to_string() }),
            Ok(d) => json!({
                "name": d.name,
                "fw_ver": d.fw_ver,
                "node_guid": format!("{:016x}", d.node_guid),
                "max_qp": d.max_qp,
                "max_qp_wr": d.max_qp_wr,
                "max_cqe": d.max_cqe,
                "max_mr_size": d.max_mr_size,
                "ports": d.ports.iter().map(|p| json!({
                    "port": p.port,
                    "state": p.state,
                    "link_layer": p.link_layer.to_string(),
                    "active_mtu": p.active_mtu,
                    "lid": p.lid,
                    "max_msg_size": p.max_msg_size,
                    "gids": p.gids.iter().map(|(i, g)| json!({
                        "index": i, "gid": g.to_string()
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            }),
        })
        .collect();
    json!({ "devices": devs, "error": null })
}

#[cfg(not(all(feature = "verbs", target_os = "linux")))]
fn verbs_json() -> Value {
    Value::Null
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The RDMA lines of `starwire info`.
pub fn print(r: &Value) {
    let v = &r["verbs"];
    if let Some(e) = v["error"].as_str() {
        println!("  RDMA devices   none: {e}");
        return;
    }
    if let Some(devs) = v["devices"].as_array() {
        for d in devs {
            if let Some(e) = d["error"].as_str() {
                println!("  RDMA device    unusable: {e}");
                continue;
            }
            println!(
                "  RDMA device    {} (fw {}, max_qp {}, max_qp_wr {}, max_cqe {}, max_mr_size {})",
                s(&d["name"]),
                s(&d["fw_ver"]),
                s(&d["max_qp"]),
                s(&d["max_qp_wr"]),
                s(&d["max_cqe"]),
                s(&d["max_mr_size"])
            );
            for p in d["ports"].as_array().cloned().unwrap_or_default() {
                println!(
                    "    port {}       {}, link layer {}, MTU {}, LID {}, max message {}",
                    s(&p["port"]),
                    s(&p["state"]),
                    s(&p["link_layer"]),
                    s(&p["active_mtu"]),
                    s(&p["lid"]),
                    s(&p["max_msg_size"])
                );
                for g in p["gids"].as_array().cloned().unwrap_or_default() {
                    println!("      GID {:<4}     {}", s(&g["index"]), s(&g["gid"]));
                }
            }
        }
        return;
    }
    let devs = r["devices"].as_array().cloned().unwrap_or_default();
    if devs.is_empty() {
        println!(
            "  RDMA devices   none (/sys/class/infiniband {})",
            if r["present"] == true {
                "empty"
            } else {
                "absent"
            }
        );
    }
    for d in devs {
        println!(
            "  RDMA device    {} (numa node {})",
            s(&d["name"]),
            s(&d["numa_node"])
        );
    }
}

/// Where the verbs backend runs: `--rdma-device`, `--rdma-port`,
/// `--gid-index`, and in one process the second device
/// `--rdma-peer-device`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RdmaArgs {
    /// The device of this end.
    #[command(flatten)]
    pub device: RdmaDeviceArgs,
    /// In one process (bench, soak): the device of the server side
    /// (default: --rdma-device, connected to itself).
    #[arg(long)]
    pub rdma_peer_device: Option<String>,
}

/// The device flags of a verbs task (`train`, `ps`, `worker`: every task
/// of a process uses this one device).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RdmaDeviceArgs {
    /// RDMA device of the verbs backend (default: the first found).
    #[arg(long)]
    pub rdma_device: Option<String>,
    /// Port of the RDMA device.
    #[arg(long, default_value_t = 1)]
    pub rdma_port: u8,
    /// Index of the local GID in the port's GID table (RoCE: picks the
    /// address and RoCE version; `starwire info` lists the table).
    #[arg(long, default_value_t = 0)]
    pub gid_index: u32,
}

impl Default for RdmaArgs {
    fn default() -> Self {
        Self {
            device: RdmaDeviceArgs {
                rdma_device: None,
                rdma_port: 1,
                gid_index: 0,
            },
            rdma_peer_device: None,
        }
    }
}

/// This process's verbs flags and whether it is a `--listen` server:
/// bench's two ends take their devices from here (a server's end is on
/// its own host: `--rdma-device`; in one process: `--rdma-peer-device`).
static PROCESS: std::sync::OnceLock<(RdmaArgs, bool)> = std::sync::OnceLock::new();

/// Record this process's verbs flags (once; bench's `main`).
pub fn set_process_args(a: &RdmaArgs, listening: bool) {
    let _ = PROCESS.set((a.clone(), listening));
}

#[cfg(all(feature = "verbs", target_os = "linux"))]
pub mod verbs {
    //! Opening the devices and making a reactor's driver (whose
    //! connections are set up over the session layer's TCP connections).

    use starwire_rdma::{RdmaDriver, RingConfig};
    use starwire_verbs::{DeviceSpec, NicConfig, VerbsDevice, VerbsDriver, VerbsNic};

    use super::RdmaArgs;

    fn open(a: &RdmaArgs, name: &Option<String>) -> Result<VerbsDevice, String> {
        VerbsDevice::open(&DeviceSpec {
            name: name.clone(),
            port: a.device.rdma_port,
            gid_index: a.device.gid_index,
        })
        .map_err(|e| e.to_string())
    }

    fn process() -> (RdmaArgs, bool) {
        super::PROCESS.get().cloned().unwrap_or_default()
    }

    /// The device of this process's client end.
    pub fn open_client() -> Result<VerbsDevice, String> {
        let (a, _) = process();
        open(&a, &a.device.rdma_device)
    }

    /// The device of this process's server end: `--rdma-device` on a
    /// `--listen` server, else `--rdma-peer-device` (default
    /// `--rdma-device`).
    pub fn open_server() -> Result<VerbsDevice, String> {
        let (a, listening) = process();
        let name = if listening {
            a.device.rdma_device.clone()
        } else {
            a.rdma_peer_device.clone().or(a.device.rdma_device.clone())
        };
        open(&a, &name)
    }

    /// The client side's device and the server side's (the same one when
    /// no peer device is named).
    pub fn open_pair(a: &RdmaArgs) -> Result<(VerbsDevice, VerbsDevice), String> {
        let spec = |name: &Option<String>| DeviceSpec {
            name: name.clone(),
            port: a.device.rdma_port,
            gid_index: a.device.gid_index,
        };
        let client = VerbsDevice::open(&spec(&a.device.rdma_device)).map_err(|e| e.to_string())?;
        let server = match &a.rdma_peer_device {
            None => client.clone(),
            Some(_) => VerbsDevice::open(&spec(&a.rdma_peer_device)).map_err(|e| e.to_string())?,
        };
        Ok((client, server))
    }

    /// `STARWIRE_RDMA_ACK_TIMEOUT`: the local ACK timeout exponent (RC
    /// waits 4.096 µs × 2^N for an ACK before it retransmits; 14 by
    /// default, about 67 ms). An emulated or overloaded responder may need
    /// more: a retransmission is a cost on hardware and a risk on
    /// Soft-RoCE.
    fn ack_timeout() -> Result<Option<u8>, String> {
        let Some(v) = starwire_config::process_env("STARWIRE_RDMA_ACK_TIMEOUT") else {
            return Ok(None);
        };
        match v.trim().parse::<u8>() {
            Ok(t) if (1..=31).contains(&t) => Ok(Some(t)),
            _ => Err(format!(
                "STARWIRE_RDMA_ACK_TIMEOUT={v:?}: expected 1 to 31 (4.096 us x 2^N)"
            )),
        }
    }

    /// Rings that hold two frames of `max_payload` bytes (and headers),
    /// 64 KiB to 64 MiB; larger messages are chunked by the message layer.
    pub fn ring_len(max_payload: usize) -> usize {
        (2 * (max_payload + 4096))
            .next_power_of_two()
            .clamp(64 << 10, 64 << 20)
    }

    /// One reactor's driver on `dev` for up to `connections` connections
    /// with rings of `ring_len` bytes.
    pub fn driver(
        dev: &VerbsDevice,
        connections: usize,
        ring_len: usize,
    ) -> Result<VerbsDriver, String> {
        let ring = RingConfig {
            ring_len,
            staging_len: ring_len,
            recv_depth: 64,
            max_frame_len: None,
        };
        let mut cfg = NicConfig {
            max_send_wr: 64,
            max_recv_wr: 128,
            ..NicConfig::default()
        };
        cfg.cq_depth = u32::try_from(connections.max(1) * (64 + 64)).unwrap_or(u32::MAX);
        if let Some(t) = ack_timeout()? {
            cfg.timeout = t;
        }
        let nic = VerbsNic::new(dev, cfg).map_err(|e| e.to_string())?;
        let rdma = RdmaDriver::new(nic, ring).map_err(|e| e.to_string())?;
        Ok(VerbsDriver::new(rdma))
    }
}

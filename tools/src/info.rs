//! `starwire info`: what this binary and this machine offer, and the
//! effective settings with their sources.

use std::path::Path;

use serde_json::{json, Value};
use starwire_config::{
    parse_host_list, ClusterConfig, ClusterFlags, ClusterSpec, EndpointMap, FlagOverride,
    Overrides, Settings, TF_CONFIG,
};
use starwire_placement::{CpuSet, Topology};

use crate::failure::Failure;

/// Options of `starwire info`.
#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// Parameter servers, `host:port,host:port`.
    #[arg(long, visible_alias = "ps_hosts")]
    pub ps_hosts: Option<String>,
    /// Workers, `host:port,host:port` (worker 0 is the chief).
    #[arg(long, visible_alias = "worker_hosts")]
    pub worker_hosts: Option<String>,
    /// This task's job: ps, worker or chief.
    #[arg(long, visible_alias = "job_name")]
    pub job_name: Option<String>,
    /// This task's index within its job.
    #[arg(long, visible_alias = "task_index")]
    pub task_index: Option<u32>,
    /// Busy polling for both roles (overrides WORKER_/PS_ENABLE_POLLING).
    #[arg(long, value_parser = crate::parse_on_off)]
    pub polling: Option<bool>,
    /// Busy polling of the ps (overrides PS_ENABLE_POLLING).
    #[arg(long, value_parser = crate::parse_on_off)]
    pub ps_polling: Option<bool>,
    /// Busy polling of workers (overrides WORKER_ENABLE_POLLING).
    #[arg(long, value_parser = crate::parse_on_off)]
    pub worker_polling: Option<bool>,
    /// Reactor cores of both roles (overrides NETWORK_*_CORE_NUMBER).
    #[arg(long)]
    pub cores: Option<usize>,
    /// Reactor cores of the ps (overrides NETWORK_PS_CORE_NUMBER).
    #[arg(long)]
    pub ps_cores: Option<usize>,
    /// Reactor cores of workers (overrides NETWORK_WORKER_CORE_NUMBER).
    #[arg(long)]
    pub worker_cores: Option<usize>,
    /// Pin reactors to cores (overrides *_DISABLE_PIN_CORES, negated).
    #[arg(long, value_parser = crate::parse_on_off)]
    pub pin_cores: Option<bool>,
    /// Idle busy-poll time before parking (overrides STARWIRE_IDLE_POLL_US).
    #[arg(long)]
    pub idle_poll_us: Option<u64>,
    /// Check that a backend is compiled in (e.g. --backend uring).
    #[arg(long, value_delimiter = ',')]
    pub backend: Vec<crate::backend::Backend>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Where DPDK runs (feature `dpdk`).
    #[cfg(feature = "dpdk")]
    #[command(flatten)]
    pub dpdk: crate::dpdk::DpdkArgs,
}

fn overrides(a: &InfoArgs) -> Overrides {
    let mut o = Overrides::default();
    let both_polling = a.polling.map(|v| FlagOverride::new("--polling", v));
    o.ps.enable_polling = a
        .ps_polling
        .map(|v| FlagOverride::new("--ps-polling", v))
        .or_else(|| both_polling.clone());
    o.worker.enable_polling = a
        .worker_polling
        .map(|v| FlagOverride::new("--worker-polling", v))
        .or(both_polling);
    let both_cores = a.cores.map(|v| FlagOverride::new("--cores", v));
    o.ps.core_number = a
        .ps_cores
        .map(|v| FlagOverride::new("--ps-cores", v))
        .or_else(|| both_cores.clone());
    o.worker.core_number = a
        .worker_cores
        .map(|v| FlagOverride::new("--worker-cores", v))
        .or(both_cores);
    let pin = a.pin_cores.map(|v| FlagOverride::new("--pin-cores", !v));
    o.ps.disable_pin_cores = pin.clone();
    o.worker.disable_pin_cores = pin;
    o.idle_poll_us = a
        .idle_poll_us
        .map(|v| FlagOverride::new("--idle-poll-us", v));
    o
}

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

fn kernel_release() -> Option<String> {
    read_trim("/proc/sys/kernel/osrelease")
}

fn kernel_at_least(release: &str, major: u32, minor: u32) -> Option<bool> {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let a: u32 = it.next()?.parse().ok()?;
    let b: u32 = it.next()?.parse().ok()?;
    Some((a, b) >= (major, minor))
}

fn io_uring_info() -> Value {
    let release = kernel_release();
    let disabled = read_trim("/proc/sys/kernel/io_uring_disabled");
    let meaning = match disabled.as_deref() {
        Some("0") => "enabled for all processes",
        Some("1") => "restricted to the io_uring_group / CAP_SYS_ADMIN",
        Some("2") => "disabled",
        Some(_) => "unknown value",
        None => "sysctl absent (kernel < 6.6: enabled unless built without io_uring)",
    };
    json!({
        "kernel": release,
        "kernel_supports_io_uring": release.as_deref().and_then(|r| kernel_at_least(r, 5, 1)),
        "io_uring_disabled": disabled,
        "status": meaning,
        "backend_compiled_in": cfg!(all(feature = "uring", target_os = "linux")),
        "hint": crate::backend::missing_backend_hint("uring"),
        "backend": uring_backend(),
    })
}

/// What the uring backend probed and what a ring with the default settings
/// gets: ops, setup flags, fallbacks, the registered pool's pages (the
/// huge-page attempt) and the memlock check.
#[cfg(all(feature = "uring", target_os = "linux"))]
fn uring_backend() -> Value {
    let probed = match starwire_uring::probe() {
        Ok(f) => f,
        Err(e) => return json!({ "usable": false, "error": format!("io_uring unavailable: {e}") }),
    };
    let cfg = starwire_uring::UringConfig::from_env();
    let ring = match starwire_uring::UringDriver::new(&cfg) {
        Ok(d) => {
            let st = d.stats();
            json!({
                "ok": true,
                "registered_bytes": st.registered_bytes,
                "tx_pool_pages": st.tx_pages,
                "file_slots": st.file_slots,
            })
        }
        Err(e) => json!({ "ok": false, "error": e.to_string() }),
    };
    json!({
        "usable": probed.unusable().is_none(),
        "unusable_reason": probed.unusable(),
        "features": probed.to_json(),
        "fallbacks": probed.fallbacks,
        "sqpoll": cfg.sqpoll_idle_ms.is_some(),
        "defer_taskrun": cfg.defer_taskrun,
        // Where a parking reactor sleeps (`Sleep::Own`: the ring's own wait).
        "park": if probed.defer_taskrun && cfg.defer_taskrun && cfg.sqpoll_idle_ms.is_none() {
            "ring"
        } else {
            "poll"
        },
        "recv_mode": match starwire_uring::RecvMode::from_env() {
            Some(m) => m.name(),
            None => "spin when the reactor polls, single when it parks",
        },
        "zero_copy": cfg.zero_copy,
        "zero_copy_threshold": cfg.zero_copy_threshold,
        "max_frame_len": cfg.max_frame_len,
        "tx_slot_len": cfg.tx_slot_len,
        "rx_direct_min": cfg.rx_direct_min,
        "recv_chunk_len": cfg.recv_chunk_len,
        "rx_conn_buf_len": cfg.rx_conn_buf_len,
        "zero_copy_loopback": cfg.zero_copy_loopback,
        "zero_copy_note": "a connection whose zero-copy sends come back copied \
                           (always on loopback and veth) switches to plain sends; \
                           bench and soak count them; loopback connections send \
                           plainly unless zero_copy_loopback",
        "ring": ring,
    })
}

#[cfg(not(all(feature = "uring", target_os = "linux")))]
fn uring_backend() -> Value {
    Value::Null
}

fn huge_pages() -> Value {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |k: &str| -> Option<u64> {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim_start_matches(':').split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    json!({
        "total": field("HugePages_Total"),
        "free": field("HugePages_Free"),
        "size_kb": field("Hugepagesize"),
        "transparent": read_trim("/sys/kernel/mm/transparent_hugepage/enabled"),
    })
}

fn memlock() -> Value {
    use nix::sys::resource::{getrlimit, Resource};
    let show = |v: u64| {
        if v == libc::RLIM_INFINITY {
            json!("unlimited")
        } else {
            json!(v)
        }
    };
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, hard)) => json!({ "soft_bytes": show(soft), "hard_bytes": show(hard) }),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

fn topology() -> Value {
    let usable = CpuSet::process_affinity()
        .map(|c| c.to_cpulist())
        .unwrap_or_else(|e| format!("? ({e})"));
    match Topology::detect() {
        Ok(t) => json!({
            "source": if cfg!(feature = "hwloc") { "hwloc" } else { "sysfs" },
            "usable_cpus": usable,
            "numa_nodes": t.numa_nodes.iter().map(|n| json!({
                "id": n.id, "cpus": n.cpus.to_cpulist()
            })).collect::<Vec<_>>(),
            "nics": t.devices.iter().map(|d| json!({
                "name": d.name, "numa_node": d.numa_node, "local_cpus": d.local_cpus.to_cpulist()
            })).collect::<Vec<_>>(),
        }),
        Err(e) => json!({ "usable_cpus": usable, "error": e.to_string() }),
    }
}

/// The cluster from the flags or TF_CONFIG, if any was given: `(spec,
/// description of this task)`.
fn cluster(a: &InfoArgs) -> Result<Option<(ClusterSpec, Option<String>)>, String> {
    let flags = ClusterFlags {
        ps_hosts: a.ps_hosts.clone(),
        worker_hosts: a.worker_hosts.clone(),
        job_name: a.job_name.clone(),
        task_index: a.task_index,
    };
    let tf = starwire_config::process_env(TF_CONFIG).filter(|s| !s.trim().is_empty());
    if flags == ClusterFlags::default() && tf.is_none() {
        return Ok(None);
    }
    if flags.job_name.is_none() && flags.task_index.is_none() && tf.is_none() {
        // Host lists only: enough for the connection counts.
        let ps = match &flags.ps_hosts {
            Some(v) => parse_host_list("--ps-hosts", v).map_err(|e| e.to_string())?,
            None => Vec::new(),
        };
        let workers = match &flags.worker_hosts {
            Some(v) => parse_host_list("--worker-hosts", v).map_err(|e| e.to_string())?,
            None => Vec::new(),
        };
        let spec = ClusterSpec::new(ps, workers).map_err(|e| e.to_string())?;
        return Ok(Some((spec, None)));
    }
    let c = ClusterConfig::resolve(&flags, tf.as_deref()).map_err(|e| e.to_string())?;
    Ok(Some((c.spec, Some(format!("{:?}", c.task)))))
}

/// Run `starwire info`. An invalid cluster, setting or endpoint map is a
/// usage error, as it is for `ps` and `worker`.
pub fn main(a: InfoArgs) -> Result<(), Failure> {
    // The DPDK flags are those of the backends; `info` probes the port
    // and has no address to give it.
    #[cfg(feature = "dpdk")]
    if a.dpdk.dpdk_ip.is_some() {
        return Err(Failure::Usage(
            "--dpdk-ip applies to bench, soak, train, ps and worker; info probes the port \
             without an address"
                .into(),
        ));
    }
    let o = overrides(&a);
    let cluster = cluster(&a).map_err(Failure::Usage)?;
    let settings = match &cluster {
        Some((spec, _)) => Settings::from_process_env(spec, &o),
        None => Settings::resolve(1, 1, &starwire_config::process_env, &o),
    }
    .map_err(|e| Failure::Usage(e.to_string()))?;
    // A malformed map is an error naming the file and line.
    let map = EndpointMap::from_process_env()
        .map_err(|e| Failure::Usage(format!("endpoint map: {e}")))?;
    let mapped = match (&map, &cluster) {
        (Some(m), Some((spec, _))) => {
            Some(m.apply(spec).map_err(|e| Failure::Usage(e.to_string()))?)
        }
        _ => None,
    };
    let settings_rows: Vec<Value> = settings
        .rows()
        .iter()
        .map(|r| {
            json!({
                "variable": r.variable,
                "value": r.value,
                "source": r.source.to_string(),
                "note": r.note,
            })
        })
        .collect();
    let cluster_json = cluster.as_ref().map(|(spec, task)| {
        json!({
            "ps": spec.ps().iter().map(ToString::to_string).collect::<Vec<_>>(),
            "workers": spec.workers().iter().map(ToString::to_string).collect::<Vec<_>>(),
            "task": task,
        })
    });
    let map_json = map.as_ref().map(|m| {
        json!({
            "path": m.path().display().to_string(),
            "entries": m.iter().map(|(g, f)| json!({"grpc": g.to_string(), "fast": f.to_string()})).collect::<Vec<_>>(),
        })
    });
    let info = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "backends": {
            "compiled_in": crate::backend::compiled_in().split(", ").collect::<Vec<_>>(),
            "baseline": "raw",
            "not_compiled_in": {
                "uring": crate::backend::missing_backend_hint("uring"),
                "verbs": crate::backend::missing_backend_hint("verbs"),
                "dpdk": crate::backend::missing_backend_hint("dpdk"),
                "grpc": crate::backend::missing_backend_hint("grpc"),
            },
        },
        "io_uring": io_uring_info(),
        "dpdk": dpdk_info(&a),
        "rdma": crate::rdma::devices_json(),
        "huge_pages": huge_pages(),
        "memlock": memlock(),
        "topology": topology(),
        "settings": settings_rows,
        "cluster": cluster_json,
        "endpoint_map": map_json,
        "mapped_cluster": mapped.as_ref().map(|s| json!({
            "ps": s.ps().iter().map(ToString::to_string).collect::<Vec<_>>(),
            "workers": s.workers().iter().map(ToString::to_string).collect::<Vec<_>>(),
        })),
    });
    if a.json {
        println!("{info}");
        return Ok(());
    }
    print_text(&info, &settings);
    Ok(())
}

#[cfg(feature = "dpdk")]
fn dpdk_info(a: &InfoArgs) -> Value {
    crate::dpdk::info_json(&a.dpdk)
}

#[cfg(not(feature = "dpdk"))]
fn dpdk_info(_: &InfoArgs) -> Value {
    Value::Null
}

/// A JSON value as `info` prints it (`-` for none).
#[cfg(feature = "dpdk")]
pub(crate) fn text(v: &Value) -> String {
    s(v)
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn print_text(i: &Value, settings: &Settings) {
    println!("starwire {}", s(&i["version"]));
    println!("\nbackends");
    println!("  tcp      compiled in (starwire-tcp: non-blocking sockets, vectored writes)");
    println!("  raw      benchmark baseline (plain sockets, no starwire code)");
    let u = &i["io_uring"];
    let ub = &u["backend"];
    for b in ["uring", "verbs", "dpdk", "grpc"] {
        if b == "uring" && u["backend_compiled_in"] == true {
            let state = if ub["usable"] == true {
                "usable".to_owned()
            } else {
                format!(
                    "UNUSABLE: {}; use the tcp backend",
                    s(&ub["unusable_reason"]).replace("null", &s(&ub["error"]))
                )
            };
            println!("  uring    compiled in (starwire-uring: io_uring), {state}");
            continue;
        }
        if b == "dpdk" && cfg!(feature = "dpdk") {
            println!(
                "  dpdk     compiled in (starwire-dpdk: DatagramDriver over a DPDK queue pair); \
                 see the dpdk section below"
            );
            continue;
        }
        if b == "verbs" && i["rdma"]["backend_compiled_in"] == true {
            println!("  verbs    compiled in (starwire-verbs; needs an RDMA device, listed below)");
            continue;
        }
        let compiled = i["backends"]["compiled_in"]
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x == b));
        if compiled {
            let what = if b == "grpc" {
                "the gRPC baseline (tonic), for comparison only"
            } else {
                "see the backend's section below"
            };
            println!("  {b:<8} compiled in ({what})");
            continue;
        }
        println!(
            "  {b:<8} not compiled in: {}",
            s(&i["backends"]["not_compiled_in"][b])
        );
    }
    println!("\nkernel");
    println!("  release        {}", s(&u["kernel"]));
    println!(
        "  io_uring       io_uring_disabled={} ({}); kernel >= 5.1: {}",
        s(&u["io_uring_disabled"]),
        s(&u["status"]),
        s(&u["kernel_supports_io_uring"])
    );
    if u["backend_compiled_in"] == true && !ub.is_null() {
        let f = &ub["features"];
        println!(
            "  uring ops      send/recv {} sendmsg {} send_zc {} sendmsg_zc {} async_cancel {}",
            s(&f["ops"]["send_recv"]),
            s(&f["ops"]["sendmsg"]),
            s(&f["ops"]["send_zc"]),
            s(&f["ops"]["sendmsg_zc"]),
            s(&f["ops"]["async_cancel"])
        );
        println!(
            "  uring setup    pbuf_ring {} (incremental {}) recv_multishot {} single_issuer {} \
             coop_taskrun {} defer_taskrun {} (used: {}) sqpoll {}",
            s(&f["pbuf_ring"]),
            s(&f["pbuf_incremental"]),
            s(&f["recv_multishot"]),
            s(&f["setup"]["single_issuer"]),
            s(&f["setup"]["coop_taskrun"]),
            s(&f["setup"]["defer_taskrun"]),
            s(&ub["defer_taskrun"]),
            s(&ub["sqpoll"])
        );
        let fb = ub["fallbacks"].as_array().cloned().unwrap_or_default();
        println!(
            "  uring fallback {}",
            if fb.is_empty() {
                "none".to_owned()
            } else {
                fb.iter().map(s).collect::<Vec<_>>().join("; ")
            }
        );
        println!(
            "  uring park     {}",
            if ub["park"] == "ring" {
                "in the ring: one io_uring_enter submits, waits and runs the completions' work"
            } else {
                "poll(2) on the ring's descriptor (no DEFER_TASKRUN, or SQPOLL)"
            }
        );
        let r = &ub["ring"];
        if r["ok"] == true {
            println!(
                "  uring buffers  {} bytes registered, {}",
                s(&r["registered_bytes"]),
                s(&r["tx_pool_pages"])
            );
        } else {
            println!("  uring ring     {}", s(&r["error"]));
        }
        println!(
            "  uring zc       zero-copy sends from {} bytes; copied ones (veth) switch the \
             connection to plain sends; loopback peers: {}",
            s(&ub["zero_copy_threshold"]),
            if ub["zero_copy_loopback"].as_bool() == Some(true) {
                "tried too (always copied)"
            } else {
                "plain sends (the kernel would copy)"
            }
        );
        println!(
            "  uring frames   up to {} bytes ({}-byte registered slots; longer frames sent \
             by reference); frames of {} bytes or more received straight into their buffer",
            s(&ub["max_frame_len"]),
            s(&ub["tx_slot_len"]),
            s(&ub["rx_direct_min"])
        );
        println!(
            "  uring recv     {} (STARWIRE_URING_RECV=single|multishot|spin; single receives \
             take at most {} B; single and spin receive into a {}-byte buffer per connection, \
             multishot from the provided buffers); ring fd and sockets registered ({} file slots)",
            s(&ub["recv_mode"]),
            s(&ub["recv_chunk_len"]),
            s(&ub["rx_conn_buf_len"]),
            s(&ub["ring"]["file_slots"])
        );
    }
    crate::rdma::print(&i["rdma"]);
    let h = &i["huge_pages"];
    println!(
        "  huge pages     total {}, free {}, size {} kB; transparent: {}",
        s(&h["total"]),
        s(&h["free"]),
        s(&h["size_kb"]),
        s(&h["transparent"])
    );
    let m = &i["memlock"];
    println!(
        "  memlock limit  soft {}, hard {} (bytes)",
        s(&m["soft_bytes"]),
        s(&m["hard_bytes"])
    );
    #[cfg(feature = "dpdk")]
    crate::dpdk::print_info(&i["dpdk"]);
    let t = &i["topology"];
    println!("\ntopology ({})", s(&t["source"]));
    println!("  usable cpus    {}", s(&t["usable_cpus"]));
    for n in t["numa_nodes"].as_array().cloned().unwrap_or_default() {
        println!("  NUMA node {}    cpus {}", s(&n["id"]), s(&n["cpus"]));
    }
    for d in t["nics"].as_array().cloned().unwrap_or_default() {
        println!(
            "  NIC {:<10} numa node {}, local cpus {}",
            s(&d["name"]),
            s(&d["numa_node"]),
            s(&d["local_cpus"])
        );
    }
    if !t["error"].is_null() {
        println!("  error: {}", s(&t["error"]));
    }
    println!("\nsettings (value and source)");
    for line in settings.to_string().lines() {
        println!("  {line}");
    }
    if let Some(c) = i["cluster"].as_object() {
        println!("\ncluster");
        println!("  ps       {}", s(&c["ps"]));
        println!("  workers  {}", s(&c["workers"]));
        println!("  task     {}", s(&c["task"]));
    }
    println!("\nendpoint map");
    match i["endpoint_map"].as_object() {
        None => println!(
            "  none (no .endpoint_map in $TF_SEASTAR_ENDPOINT_MAP_PATH or the working directory)"
        ),
        Some(m) => {
            println!("  file {}", s(&m["path"]));
            for e in m["entries"].as_array().cloned().unwrap_or_default() {
                println!("  {} -> {}", s(&e["grpc"]), s(&e["fast"]));
            }
        }
    }
}

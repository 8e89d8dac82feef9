//! End-to-end tests of the `starwire` binary. Short runs only (CI has two
//! cores); no timing is asserted.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::{
    bare, free_port, json_lines, num, run, run_with, stderr_lines, text, wait, wait_for, BIN,
};

const CONTRACT: &[&str] = &[
    "backend",
    "mode",
    "size",
    "inflight",
    "iters",
    "p50_us",
    "p99_us",
    "p999_us",
    "min_us",
    "max_us",
    "p9999_us",
    "avg_us",
    "stdev_us",
    "msgs_per_s",
    "gbps",
    "polling",
    "client_core",
    "server_core",
];

fn check_line(v: &Value) {
    for k in CONTRACT {
        assert!(v.get(k).is_some(), "field {k} missing in {v}");
    }
    assert!(v["iters"].as_u64().unwrap_or(0) > 0, "{v}");
    match v["mode"].as_str() {
        Some("lat") | Some("rate") => {
            let (min, p50, p99, p999, max) = (
                num(v, "min_us"),
                num(v, "p50_us"),
                num(v, "p99_us"),
                num(v, "p999_us"),
                num(v, "max_us"),
            );
            assert!(min > 0.0 && min <= p50, "{v}");
            assert!(p50 <= p99 && p99 <= p999 && p999 <= max, "{v}");
            let (p9999, avg) = (num(v, "p9999_us"), num(v, "avg_us"));
            assert!(p999 <= p9999 && p9999 <= max, "{v}");
            assert!(min <= avg && avg <= max && num(v, "stdev_us") >= 0.0, "{v}");
            assert!(num(v, "msgs_per_s") > 0.0, "{v}");
        }
        Some("bw") => {
            assert!(num(v, "msgs_per_s") > 0.0, "{v}");
            assert!(num(v, "gbps") > 0.0, "{v}");
        }
        Some("fuse") => {
            assert!(num(v, "fused_steps_per_s") > 0.0, "{v}");
            assert!(num(v, "unfused_steps_per_s") > 0.0, "{v}");
        }
        other => panic!("unexpected mode {other:?}"),
    }
}

#[test]
fn bench_json_all_modes_raw_and_tcp() {
    let out = run(&[
        "bench",
        "--backends",
        "raw,tcp",
        "--mode",
        "lat,rate,bw,fuse",
        "--sizes",
        "64,4096",
        "--iters",
        "50",
        "--warmup",
        "5",
        "--tensors",
        "16",
        "--json",
    ]);
    let lines = json_lines(&out);
    for v in &lines {
        check_line(v);
    }
    let count = |b: &str, m: &str| {
        lines
            .iter()
            .filter(|v| v["backend"] == b && v["mode"] == m)
            .count()
    };
    for m in ["lat", "rate", "bw"] {
        assert_eq!(count("raw", m), 2, "raw {m}");
        assert_eq!(count("tcp", m), 2, "tcp {m}");
    }
    assert_eq!(count("tcp", "fuse"), 2);
    assert_eq!(count("raw", "fuse"), 0, "fuse does not apply to raw");
    assert!(text(&out.stderr).contains("fuse mode does not apply"));
}

#[test]
fn bench_polling_off_and_repeat_report_medians() {
    let out = run(&[
        "bench",
        "--mode",
        "lat",
        "--sizes",
        "64",
        "--iters",
        "30",
        "--polling",
        "off",
        "--repeat",
        "2",
        "--json",
    ]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2);
    for v in &lines {
        check_line(v);
        assert_eq!(v["polling"], false);
        assert_eq!(v["repeat"], 2);
    }
}

#[test]
fn bench_table_output() {
    let out = run(&["bench", "--mode", "rate", "--sizes", "64", "--iters", "50"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("rtt_p50[us]") && s.contains("msgs/s"), "{s}");
    assert!(
        s.contains("rtt_avg[us]") && s.contains("rtt_stdev[us]"),
        "{s}"
    );
    assert!(
        s.contains("rtt_p99.99[us]") && s.contains("1way_p50[us]"),
        "{s}"
    );
    assert!(s.lines().any(|l| l.trim_start().starts_with("raw")), "{s}");
    assert!(s.lines().any(|l| l.trim_start().starts_with("tcp")), "{s}");
}

#[test]
fn bench_many_connections_carry_traffic_on_each() {
    let out = run_with(
        &[
            "bench",
            "--backends",
            "tcp",
            "--mode",
            "lat,rate,bw",
            "--sizes",
            "64",
            "--connections",
            "4",
            "--iters",
            "200",
            "--warmup",
            "20",
            "--json",
        ],
        &[("RUST_LOG", "starwire=debug")],
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 3, "{lines:?}");
    for v in &lines {
        check_line(v);
        assert_eq!(v["connections"], 4, "{v}");
        assert!(v["iters"].as_u64().unwrap_or(0) >= 200, "{v}");
    }
    // Every connection of every run carried requests, not just its
    // handshake: the client's debug line lists each connection's counters.
    let err = text(&out.stderr);
    let client: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("bench client counters"))
        .collect();
    assert_eq!(client.len(), 3, "{err}");
    for l in client {
        let written: Vec<u64> = l
            .split("bytes_written: ")
            .skip(1)
            .map(|t| t.split(|c: char| !c.is_ascii_digit()).next().unwrap_or(""))
            .map(|n| n.parse().unwrap_or(0))
            .collect();
        assert_eq!(written.len(), 4, "{l}");
        // The handshake alone is about 100 bytes; 220 requests of 96 bytes
        // or more spread over four connections put thousands on each.
        assert!(written.iter().all(|&b| b >= 1000), "{l}");
    }
}

#[test]
fn bench_connections_are_refused_where_they_do_not_apply() {
    for (args, want) in [
        (vec!["bench", "--connections", "2"], "raw baseline"),
        (
            vec![
                "bench",
                "--backends",
                "tcp",
                "--mode",
                "fuse",
                "--connections",
                "2",
            ],
            "fuse mode uses one",
        ),
        (
            vec!["bench", "--backends", "tcp", "--connections", "0"],
            "expected 1 to",
        ),
    ] {
        let out = run(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = text(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn unknown_backend_names_the_missing_feature() {
    if !cfg!(feature = "uring") {
        let out = run(&["bench", "--backends", "uring"]);
        assert!(!out.status.success());
        let e = text(&out.stderr);
        assert!(
            e.contains("uring backend is not compiled in") && e.contains("--features uring"),
            "{e}"
        );
    }
    if !cfg!(feature = "verbs") {
        let out = run(&["bench", "--backends", "tcp,verbs"]);
        assert!(!out.status.success());
        let e = text(&out.stderr);
        assert!(
            e.contains("verbs backend is not compiled in") && e.contains("--features verbs"),
            "{e}"
        );
    }
    if !cfg!(feature = "dpdk") {
        let out = run(&["soak", "--backend", "dpdk", "--duration", "1"]);
        assert!(!out.status.success());
        let e = text(&out.stderr);
        assert!(e.contains("--features dpdk"), "{e}");
    }
}

/// A command that needs an RDMA device, on a host without one (this
/// project's CI hosts: `ibv_get_device_list` fails with ENOSYS), says why
/// and exits 1, without a panic.
#[cfg(feature = "verbs")]
#[test]
fn verbs_without_a_device_exits_1_with_the_reason() {
    let has_device = std::path::Path::new("/sys/class/infiniband")
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some());
    if has_device {
        return;
    }
    for args in [
        &["soak", "--backend", "verbs", "--duration", "1"][..],
        &["bench", "--backends", "tcp,verbs"][..],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let e = text(&out.stderr);
        assert!(!e.contains("panicked"), "{e}");
        let reason = if e.contains("(no devices)") {
            "no devices"
        } else {
            "ibv_get_device_list: Function not implemented"
        };
        assert!(
            e.contains(&format!(
                "no RDMA device found ({reason}); use the tcp backend"
            )),
            "{args:?}: {e}"
        );
    }
    // info still exits 0 and says why there is none.
    let out = run(&["info"]);
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("RDMA devices   none: no RDMA device found"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn info_shows_settings_with_sources() {
    let out = Command::new(BIN)
        .args([
            "info",
            "--ps-hosts",
            "127.0.0.1:2222",
            "--worker-hosts",
            "127.0.0.1:2223,127.0.0.1:2224",
            "--job-name",
            "worker",
            "--task-index",
            "1",
            "--polling",
            "on",
        ])
        .env("PS_DISABLE_PIN_CORES", "false")
        .env_remove("TF_CONFIG")
        .env_remove("TF_SEASTAR_ENDPOINT_MAP_PATH")
        .output()
        .expect("run");
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}\n{}", text(&out.stderr));
    assert!(
        s.contains("WORKER_ENABLE_POLLING") && s.contains("flag --polling"),
        "{s}"
    );
    assert!(s.contains("env PS_DISABLE_PIN_CORES"), "{s}");
    assert!(s.contains("io_uring") && s.contains("memlock"), "{s}");
    let out = run(&["info", "--json"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).expect("info JSON");
    assert_eq!(v["backends"]["compiled_in"][0], "tcp");
    if cfg!(feature = "uring") {
        assert_eq!(v["backends"]["compiled_in"][1], "uring");
        let b = &v["io_uring"]["backend"];
        // This kernel has io_uring; the probe and a real ring are shown.
        assert_eq!(b["usable"], true, "{b}");
        assert_eq!(b["ring"]["ok"], true, "{b}");
        assert!(b["ring"]["tx_pool_pages"].is_string(), "{b}");
        assert!(b["fallbacks"].is_array(), "{b}");
        // This kernel has DEFER_TASKRUN: a parking reactor sleeps in the ring.
        assert_eq!(b["park"], "ring", "{b}");
        let out = run(&["info"]);
        let t = text(&out.stdout);
        assert!(
            t.contains("uring buffers")
                && t.contains("uring fallback")
                && t.contains("uring park     in the ring"),
            "{t}"
        );
    }
    assert!(
        v["settings"].as_array().is_some_and(|a| a.len() == 7),
        "{v}"
    );
}

#[test]
fn info_fails_on_a_malformed_endpoint_map() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(".endpoint_map");
    std::fs::write(&path, "10.0.0.1:2222=10.1.0.1:3333\nthis line is broken\n").expect("write");
    let out = Command::new(BIN)
        .arg("info")
        .env("TF_SEASTAR_ENDPOINT_MAP_PATH", dir.path())
        .env_remove("TF_CONFIG")
        .output()
        .expect("run");
    // A configuration error: a usage error, as for ps and worker.
    assert_eq!(out.status.code(), Some(2));
    let e = text(&out.stderr);
    assert!(
        e.contains(&format!("{}:2", path.display())),
        "error must name file and line: {e}"
    );
}

#[test]
fn soak_passes_without_faults() {
    // A bar no round trip can miss: each is answered within --duration
    // and --drain (5 s), or lost.
    let out = run(&[
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "8",
        "--duration",
        "3",
        "--max-latency-ms",
        "60000",
        "--json",
    ]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}\n{}", text(&out.stderr));
    let v: Value = serde_json::from_str(s.trim()).expect("soak JSON");
    for k in [
        "messages",
        "lost",
        "duplicated",
        "corrupted",
        "out_of_order",
        "rss_start_kb",
        "rss_end_kb",
    ] {
        assert!(v.get(k).is_some(), "{k} missing: {v}");
    }
    assert!(v["messages"].as_u64().unwrap_or(0) > 0, "{v}");
    for k in ["lost", "duplicated", "corrupted", "out_of_order"] {
        assert_eq!(v[k], 0, "{k}: {v}");
    }
    for k in ["measured_s", "msgs_per_s", "gbps"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {v}");
    }
    check_soak_latency(&v);
    assert_eq!(v["max_latency_ms"].as_f64(), Some(60000.0), "{v}");
}

/// A soak report's `latency_us`: a round trip for every answered request,
/// its percentiles in order.
fn check_soak_latency(v: &Value) {
    let l = &v["latency_us"];
    let count = l["count"].as_u64().unwrap_or(0);
    assert!(count > 0, "{v}");
    assert_eq!(Some(count), v["answered"].as_u64(), "{v}");
    let (p50, p99, p999, max) = (num(l, "p50"), num(l, "p99"), num(l, "p999"), num(l, "max"));
    assert!(p50 > 0.0 && p50 <= p99 && p99 <= p999 && p999 <= max, "{v}");
}

/// A bar of a nanosecond, which no round trip over loopback meets: the
/// soak loses nothing and still fails (exit status 1), saying why on
/// stderr; the text report shows the percentiles and the result.
#[test]
fn soak_fails_when_the_p99_is_over_max_latency_ms() {
    let out = run(&[
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "2",
        "--duration",
        "1",
        "--max-latency-ms",
        "0.000001",
    ]);
    let (s, e) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{s}\n{e}");
    assert!(s.contains("  lost         0\n"), "{s}");
    let line = s
        .lines()
        .find(|l| l.trim_start().starts_with("latency "))
        .unwrap_or_else(|| panic!("no latency line in\n{s}"));
    for k in [
        "p50 ",
        "p99 ",
        "p99.9 ",
        "max ",
        "round trips",
        "--max-latency-ms",
    ] {
        assert!(line.contains(k), "{k}: {line}");
    }
    assert!(s.contains("result       FAIL"), "{s}");
    assert!(
        e.contains("--max-latency-ms 0.000001: p99 latency") && e.contains("over the bar"),
        "{e}"
    );
}

#[test]
fn soak_through_a_fault_injector_that_injects_nothing_passes() {
    // The faulty links on both ends (the server's attached from the
    // acceptor's routed streams), several reactors a side: with every
    // probability zero the soak must pass, so the --faults plumbing alone
    // loses nothing.
    let out = run(&[
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "6",
        "--client-reactors",
        "3",
        "--server-reactors",
        "2",
        "--duration",
        "2",
        "--faults",
        "drop=0,corrupt=0",
        "--json",
    ]);
    let s = text(&out.stdout);
    assert!(out.status.success(), "{s}\n{}", text(&out.stderr));
    let v: Value = serde_json::from_str(s.trim()).expect("soak JSON");
    assert!(v["messages"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(v["answered"], v["messages"], "{v}");
    assert_eq!(
        (v["client_reactors"].clone(), v["server_reactors"].clone()),
        (3.into(), 2.into()),
        "{v}"
    );
    assert_eq!(v["faults_injected"]["dropped"], 0, "{v}");
}

#[test]
fn faulted_soak_fails_and_reports_loss() {
    let t0 = Instant::now();
    let out = run(&[
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "4",
        "--duration",
        "2",
        "--drain",
        "1",
        "--faults",
        "drop=0.05",
        "--json",
    ]);
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "a faulted soak must not hang"
    );
    assert!(!out.status.success(), "a faulted soak must fail");
    let v: Value = serde_json::from_str(text(&out.stdout).trim()).expect("soak JSON");
    assert!(v["lost"].as_u64().unwrap_or(0) > 0, "{v}");
}

#[test]
fn two_processes_over_loopback() {
    // Find a free port, then let the server bind it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Command::new(BIN)
        .args(["bench", "--listen", &addr])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn server");
    // Retry until the server listens.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = loop {
        let out = run(&[
            "bench",
            "--connect",
            &addr,
            "--backends",
            "raw,tcp",
            "--mode",
            "lat,bw",
            "--sizes",
            "64",
            "--iters",
            "30",
            "--json",
        ]);
        if out.status.success() || Instant::now() > deadline {
            break out;
        }
        if !text(&out.stderr).contains("connecting to the bench server") {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // The server serves client after client until it is stopped.
    for client in 0..2 {
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 4, "client {client}");
        for v in &lines {
            check_line(v);
            // The server measures its own process with --cpu-util.
            assert_eq!(v["server_cpu_pct"].is_number(), client == 1, "{v}");
        }
        if client == 0 {
            out = run(&[
                "bench",
                "--connect",
                &addr,
                "--backends",
                "tcp",
                "--mode",
                "lat,bw",
                "--sizes",
                "64,128",
                "--iters",
                "30",
                "--cpu-util",
                "--json",
            ]);
        }
    }
    assert!(server.try_wait().expect("server status").is_none());
    let term = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .expect("run kill");
    assert!(term.success());
    let status = server.wait().expect("server ends on SIGTERM");
    assert!(!status.success());
}

#[test]
fn a_listen_hosts_own_cores_are_the_server_core_reported() {
    // The client's plan puts the server on core 0; the server host pins to
    // its own core 1 (`--cores 0,1`), and the results must say so.
    let addr = format!("127.0.0.1:{}", free_port());
    let mut server = bare(&["bench", "--listen", &addr, "--one-off", "--cores", "0,1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let err = stderr_lines(&mut server);
    wait_for(&err, "waiting for a client", Duration::from_secs(20));
    let out = run(&[
        "bench",
        "--connect",
        &addr,
        "--cores",
        "0,0",
        "--polling",
        "off",
        "--backends",
        "raw,tcp",
        "--mode",
        "lat,rate",
        "--sizes",
        "64",
        "--iters",
        "30",
        "--json",
    ]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 4);
    for v in &lines {
        check_line(v);
        assert_eq!(v["client_core"], 0, "{v}");
        assert_eq!(v["server_core"], 1, "{v}");
    }
    assert!(wait(&mut server, Duration::from_secs(30)).success());
}

#[test]
fn bench_without_warmup_measures_every_iteration_after_the_handshake() {
    // The starwire backends start the clock of a run without warm-up once
    // its connections are established; every requested iteration is
    // measured, and the run completes on every mode.
    let out = run(&[
        "bench",
        "--backends",
        "raw,tcp",
        "--mode",
        "lat,rate,bw,fuse",
        "--sizes",
        "64",
        "--iters",
        "25",
        "--warmup",
        "0",
        "--polling",
        "off",
        "--json",
    ]);
    let lines = json_lines(&out);
    // raw has no fuse mode.
    assert_eq!(lines.len(), 7);
    for v in &lines {
        check_line(v);
        assert_eq!(v["iters"], 25, "{v}");
    }
}

#[test]
fn train_json_contract_and_flags() {
    let out = run(&[
        "train",
        "--json",
        "--train-examples",
        "8192",
        "--eval-examples",
        "2048",
        "--epochs",
        "1",
        "--batch-size",
        "256",
        "--tensor-fuse",
        "off",
        "--protocol",
        "star_server_lite",
        "--placement",
        "anneal",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let last = stdout.lines().last().expect("a JSON line");
    let v: Value = serde_json::from_str(last).expect("last line is JSON");
    for k in [
        "samples_per_s",
        "auc",
        "logloss",
        "steps",
        "backend",
        "protocol",
        "placement",
    ] {
        assert!(v.get(k).is_some(), "missing {k}: {v}");
    }
    assert!(v["placement"].get("sharded_vars").is_some(), "{v}");
    assert_eq!(v["protocol"], "star_server_lite");
    assert_eq!(v["backend"], "tcp");
    assert_eq!(v["tensor_fuse"], false);
    assert_eq!(v["worker_handoff"], false);
    assert_eq!(v["samples"].as_u64(), Some(8192));
    assert!(num(&v, "auc") > 0.5);
    // Defaults: min(8, 2 workers, usable CPUs) PS reactors and one network
    // thread per worker, none pinned, none polling.
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ps = (0..2.min(ncpu)).map(|i| ("ps", i));
    let want: Vec<Value> = ps
        .chain([("worker", 0), ("worker", 1)])
        .map(|(role, index)| {
            serde_json::json!({"role": role, "index": index, "cpu": null, "polling": false})
        })
        .collect();
    assert_eq!(v["reactors"], Value::Array(want), "{v}");
}

/// The local cluster cuts NETWORK_PS_CORE_NUMBER's default, min(8,
/// workers), down to the usable CPUs; a value given is kept.
#[test]
fn train_fits_the_default_ps_reactors_to_the_cpus() {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let shards = |env: &[(&str, &str)]| {
        let args = [
            &["train", "--json", "--quiet", "--workers", "4"],
            TINY_TRAIN,
        ]
        .concat();
        let out = run_with(&args, &net_env(env));
        assert!(out.status.success(), "{env:?}: {}", text(&out.stderr));
        let v: Value = serde_json::from_str(text(&out.stdout).lines().last().unwrap()).unwrap();
        assert!(num(&v, "auc") > 0.5, "{v}");
        v["shards"].as_u64().expect("shards")
    };
    assert_eq!(shards(&[]), 4.min(ncpu) as u64);
    assert_eq!(shards(&[("NETWORK_PS_CORE_NUMBER", "4")]), 4);
}

/// Every network variable, so the runner's environment does not leak in.
fn net_env<'a>(overrides: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![
        ("PS_ENABLE_POLLING", "false"),
        ("WORKER_ENABLE_POLLING", "false"),
        ("PS_DISABLE_PIN_CORES", "true"),
        ("WORKER_DISABLE_PIN_CORES", "true"),
        ("STARWIRE_IDLE_POLL_US", "0"),
    ];
    env.retain(|(k, _)| !overrides.iter().any(|(o, _)| o == k));
    env.extend_from_slice(overrides);
    env
}

const TINY_TRAIN: &[&str] = &[
    "--train-examples",
    "4096",
    "--eval-examples",
    "1024",
    "--epochs",
    "1",
    "--batch-size",
    "256",
];

/// `--worker-handoff on`: each worker's NETWORK_WORKER_CORE_NUMBER
/// network reactors are listed (pinned ones on CPUs of the same plan);
/// inproc has none to hand requests to.
#[test]
fn train_worker_handoff_lists_the_network_reactors() {
    let env = net_env(&[
        ("WORKER_DISABLE_PIN_CORES", "false"),
        ("NETWORK_WORKER_CORE_NUMBER", "2"),
        ("NETWORK_PS_CORE_NUMBER", "2"),
    ]);
    let args = [&["train", "--json", "--worker-handoff", "on"], TINY_TRAIN].concat();
    let out = run_with(&args, &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_str(text(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["worker_handoff"], true, "{v}");
    let reactors = v["reactors"].as_array().expect("reactors");
    let listed: Vec<(&str, u64, bool)> = reactors
        .iter()
        .map(|r| {
            let role = r["role"].as_str().unwrap();
            (role, r["index"].as_u64().unwrap(), r["cpu"].is_u64())
        })
        .collect();
    // Two shards: two network reactors per worker, pinned; the PS ones not.
    assert_eq!(
        listed,
        [
            ("ps", 0, false),
            ("ps", 1, false),
            ("worker", 0, true),
            ("worker", 1, true),
            ("worker", 2, true),
            ("worker", 3, true),
        ]
    );
    let out = run_with(
        &[
            &["train", "--backend", "inproc", "--worker-handoff", "on"],
            TINY_TRAIN,
        ]
        .concat(),
        &env,
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--worker-handoff"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn train_places_pinned_reactors_on_different_cpus() {
    let env = net_env(&[
        ("PS_ENABLE_POLLING", "1"),
        ("WORKER_ENABLE_POLLING", "1"),
        ("PS_DISABLE_PIN_CORES", "0"),
        ("WORKER_DISABLE_PIN_CORES", "false"),
        ("NETWORK_PS_CORE_NUMBER", "1"),
        ("STARWIRE_IDLE_POLL_US", "200"),
    ]);
    let out = run_with(&[&["train", "--json"], TINY_TRAIN].concat(), &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_str(text(&out.stdout).lines().last().unwrap()).unwrap();
    let reactors = v["reactors"].as_array().expect("reactors");
    let roles: Vec<(&str, u64)> = reactors
        .iter()
        .map(|r| (r["role"].as_str().unwrap(), r["index"].as_u64().unwrap()))
        .collect();
    assert_eq!(roles, [("ps", 0), ("worker", 0), ("worker", 1)]);
    assert!(reactors.iter().all(|r| r["polling"] == true), "{v}");
    let cpus: Vec<u64> = reactors
        .iter()
        .map(|r| r["cpu"].as_u64().expect("pinned"))
        .collect();
    // Planned together: distinct CPUs while there are CPUs for each.
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let distinct = cpus.len().min(ncpu);
    let mut first = cpus[..distinct].to_vec();
    first.sort_unstable();
    first.dedup();
    assert_eq!(first.len(), distinct, "{cpus:?} on {ncpu} cpus");
}

#[test]
fn train_text_summarises_the_reactors() {
    let env = net_env(&[
        ("PS_ENABLE_POLLING", "TRUE"),
        ("NETWORK_PS_CORE_NUMBER", "2"),
        ("PS_DISABLE_PIN_CORES", "0"),
    ]);
    let args = [&["train", "--device", "starwire-no-such-nic0"], TINY_TRAIN].concat();
    let out = run_with(&args, &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("reactors:"))
        .unwrap_or_else(|| panic!("no reactors line in {stdout}"));
    assert!(
        line.contains("2 ps (cpus ")
            && line.contains("; polling), 2 worker (unpinned; no polling)"),
        "{line}"
    );
    // An unknown NIC is a warning, not an error.
    assert!(
        text(&out.stderr).contains("starwire-no-such-nic0"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn train_rejects_bad_flags_with_clear_errors() {
    let out = run(&["train", "--protocol", "grpc"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--backend"),
        "{}",
        text(&out.stderr)
    );
    // Without the feature: how to get it (a usage error, exit 2); with
    // it, on this host without a device, why not (a run-time error, 1).
    let out = run(&["train", "--backend", "verbs", "--epochs", "1"]);
    let (code, want) = if cfg!(feature = "verbs") {
        (1, "no RDMA device found")
    } else {
        (2, "verbs backend is not compiled in")
    };
    assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(want), "{}", text(&out.stderr));
    for (var, value) in [
        ("WORKER_DISABLE_PIN_CORES", "maybe"),
        ("STARWIRE_IDLE_POLL_US", "10us"),
        ("NETWORK_WORKER_CORE_NUMBER", "0"),
    ] {
        let out = run_with(&["train"], &net_env(&[(var, value)]));
        assert!(!out.status.success(), "{var}={value}");
        let err = text(&out.stderr);
        assert!(err.contains(var) && err.contains(value), "{err}");
    }
    let out = run(&["train", "--train", "criteo:/nonexistent/x.tsv"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("/nonexistent/x.tsv"),
        "{}",
        text(&out.stderr)
    );
}

/// `ps` and `worker` take the cluster's size from its spec: the local
/// cluster's `--ps` and `--workers` are not theirs, so they are refused
/// rather than ignored.
#[test]
fn ps_and_worker_refuse_the_local_cluster_size_flags() {
    for cmd in ["ps", "worker"] {
        for flag in ["--ps", "--workers"] {
            let out = run(&[cmd, flag, "4"]);
            assert_eq!(out.status.code(), Some(2), "{cmd} {flag}");
            assert!(
                text(&out.stderr).contains(&format!("unexpected argument '{flag}'")),
                "{cmd} {flag}: {}",
                text(&out.stderr)
            );
        }
        let help = text(&run(&[cmd, "--help"]).stdout);
        assert!(
            !help.contains("--workers <") && !help.contains("--ps <"),
            "{help}"
        );
    }
}

/// The section of `help` under `heading`, up to the next heading.
fn help_section<'h>(help: &'h str, heading: &str) -> &'h str {
    let at = help
        .find(&format!("\n{heading}:\n"))
        .unwrap_or_else(|| panic!("no {heading:?} in {help}"));
    let rest = &help[at + heading.len() + 3..];
    // Headings start a line; flags are indented.
    let end = rest
        .match_indices('\n')
        .map(|(i, _)| i + 1)
        .find(|&i| rest[i..].starts_with(|c: char| c.is_ascii_alphabetic()))
        .unwrap_or(rest.len());
    &rest[..end]
}

/// `ps` and `worker` share their flags (a launch script gives every task
/// the same); each one's `--help` groups the flags only the other role
/// uses under a heading saying it ignores them, and `train`, which runs
/// both roles, has no such heading.
#[test]
fn ps_and_worker_help_group_the_other_roles_flags() {
    let worker_only = [
        "--eval <",
        "--eval-examples <",
        "--skip-bad-lines",
        "--worker-handoff <",
        "--compute-threads <",
        "--prefetch <",
    ];
    let ps_only = [
        "--filter-capacity <",
        "--insecure",
        "--max-connections <",
        "--idle-timeout-secs <",
        "--memory-budget-mb <",
        "--max-reply-bytes <",
        "--max-rows <",
        "--max-wait-steps <",
    ];
    let help = |cmd: &str| {
        let out = run(&[cmd, "--help"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let flags = |section: &str| -> Vec<String> {
        section
            .lines()
            .filter_map(|l| l.strip_prefix("      --"))
            .map(|l| format!("--{}", l.split(' ').next().unwrap_or("")))
            .collect()
    };
    let names = |want: &[&str]| -> Vec<String> {
        want.iter()
            .map(|f| f.trim_end_matches(" <").to_string())
            .collect()
    };
    let ps = help("ps");
    let ignored = help_section(&ps, "Worker options (a ps task accepts and ignores them)");
    assert_eq!(flags(ignored), names(&worker_only), "{ignored}");
    let own = help_section(&ps, "PS options");
    let mut want = vec!["--bind".to_string(), "--exit-when-done".to_string()];
    want.extend(names(&ps_only));
    assert_eq!(flags(own), want, "{own}");
    let worker = help("worker");
    let ignored = help_section(&worker, "PS options (a worker accepts and ignores them)");
    assert_eq!(flags(ignored), names(&ps_only), "{ignored}");
    assert_eq!(
        flags(help_section(&worker, "Worker options")),
        names(&worker_only)
    );
    let train = help("train");
    assert!(
        !train.contains("Worker options") && !train.contains("PS options"),
        "{train}"
    );
    for f in worker_only.iter().chain(&ps_only) {
        assert!(train.contains(&format!("      {f}")), "train: {f}");
    }
}

#[test]
fn ps_and_worker_processes_train_across_processes() {
    across_processes(false);
    // The worker hands its requests to one network reactor per shard.
    across_processes(true);
}

fn across_processes(handoff: bool) {
    let port = |l: std::net::TcpListener| l.local_addr().unwrap().port();
    let p0 = port(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let w0 = port(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let hosts = [
        "--ps-hosts".to_owned(),
        format!("127.0.0.1:{p0}"),
        "--worker-hosts".to_owned(),
        format!("127.0.0.1:{w0}"),
        "--task-index".to_owned(),
        "0".to_owned(),
        "--train-examples".to_owned(),
        "8192".to_owned(),
        "--eval-examples".to_owned(),
        "2048".to_owned(),
        "--epochs".to_owned(),
        "1".to_owned(),
        "--json".to_owned(),
        "--worker-handoff".to_owned(),
        if handoff { "on" } else { "off" }.to_owned(),
    ];
    // Every task reads the same variables: 2 shards on the PS, pinned;
    // the worker polls and floats.
    let env = net_env(&[
        ("NETWORK_PS_CORE_NUMBER", "2"),
        ("NETWORK_WORKER_CORE_NUMBER", "2"),
        ("PS_DISABLE_PIN_CORES", "false"),
        ("WORKER_ENABLE_POLLING", "true"),
    ]);
    let mut ps = Command::new(BIN)
        .args(["ps", "--exit-when-done"])
        .args(&hosts)
        .envs(env.iter().copied())
        .env_remove("TF_CONFIG")
        .env_remove("TF_SEASTAR_ENDPOINT_MAP_PATH")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let w = run_with(
        &[
            &["worker"],
            &hosts.iter().map(String::as_str).collect::<Vec<_>>()[..],
        ]
        .concat(),
        &env,
    );
    assert!(w.status.success(), "handoff {handoff}: {}", text(&w.stderr));
    let v: Value = serde_json::from_str(text(&w.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["samples"].as_u64(), Some(8192));
    assert!(num(&v, "auc") > 0.5);
    assert_eq!(v["worker_handoff"], handoff);
    let worker =
        |index| serde_json::json!({"role": "worker", "index": index, "cpu": null, "polling": true});
    let want = if handoff {
        serde_json::json!([worker(0), worker(1)])
    } else {
        serde_json::json!([worker(0)])
    };
    assert_eq!(v["reactors"], want);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = ps.try_wait().unwrap() {
            assert!(st.success(), "ps exit {st}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ps did not exit after the worker was done"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = ps.wait_with_output().unwrap();
    let v: Value = serde_json::from_str(text(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["shards"].as_array().map(Vec::len), Some(2), "{v}");
    let reactors = v["reactors"].as_array().expect("reactors");
    assert_eq!(reactors.len(), 2, "{v}");
    for (i, r) in reactors.iter().enumerate() {
        assert_eq!(r["role"], "ps");
        assert_eq!(r["index"], i);
        assert_eq!(r["polling"], false);
        assert!(r["cpu"].is_u64(), "pinned: {r}");
    }
}

/// Runs `starwire ARGS`, which must fail with a usage error (exit 2)
/// naming `flag`.
fn usage_error_naming(args: &[&str], flag: &str) {
    let out = run(args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(flag), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

#[test]
fn place_refuses_a_zipf_exponent_that_is_not_a_finite_positive_number() {
    for v in ["nan", "inf", "0", "-1.1"] {
        usage_error_naming(&["place", &format!("--zipf={v}")], "--zipf");
    }
    for v in ["0", "1000001", "18446744073709551615"] {
        usage_error_naming(&["place", "--vars", v], "--vars");
    }
}

#[test]
fn reference_refuses_rates_and_tolerances_that_are_not_finite_positive_numbers() {
    for v in ["nan", "inf", "0", "-0.5"] {
        usage_error_naming(
            &["reference", "--solver", "adagrad", &format!("--lr={v}")],
            "--lr",
        );
        usage_error_naming(&["reference", &format!("--tolerance={v}")], "--tolerance");
    }
}

#[test]
fn train_refuses_thread_prefetch_and_default_value_counts_past_their_bounds() {
    for (flag, value) in [
        ("--compute-threads", "100000"),
        ("--compute-threads", "1025"),
        ("--default-value-dim", "999999999999"),
        ("--default-value-dim", "65537"),
        ("--prefetch", "1000000000"),
        ("--prefetch", "1025"),
    ] {
        usage_error_naming(&["train", "--steps", "1", flag, value], flag);
    }
}

#[test]
fn train_help_says_bounded_delay_is_off_on_grpc() {
    let out = run(&["train", "--help"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let help = text(&out.stdout);
    let words: Vec<&str> = help.split_whitespace().collect();
    let flat = words.join(" ");
    let at = flat
        .find("--bounded-delay <N|off>")
        .expect("--bounded-delay");
    let end = flat[at..].find("--turn-steps <K>").expect("--turn-steps");
    let entry = &flat[at..at + end];
    assert!(entry.contains("with --backend grpc always off"), "{entry}");
}

#[test]
fn soak_refuses_unbounded_durations_and_zero_counts() {
    for (flag, value) in [
        ("--duration", "1e300"),
        ("--duration", "86401"),
        ("--duration", "inf"),
        ("--duration", "nan"),
        ("--duration", "0"),
        ("--drain", "1e300"),
        ("--drain", "inf"),
        ("--drain", "nan"),
        ("--drain", "-1"),
        ("--inflight", "0"),
        ("--inflight", "65537"),
        ("--client-reactors", "0"),
        ("--server-reactors", "0"),
        ("--max-latency-ms", "0"),
        ("--max-latency-ms", "-1"),
        ("--max-latency-ms", "nan"),
        ("--max-latency-ms", "inf"),
    ] {
        usage_error_naming(
            &["soak", "--connections", "1", &format!("{flag}={value}")],
            flag,
        );
    }
    for value in ["0", "513", "100000000"] {
        usage_error_naming(&["soak", "--connections", value], "--connections");
    }
}

/// An `.endpoint_map` that never ends (a device), or is larger than any
/// cluster's, is refused unread, naming the file.
#[cfg(unix)]
#[test]
fn info_refuses_an_endless_or_huge_endpoint_map() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(".endpoint_map");
    std::os::unix::fs::symlink("/dev/zero", &path).expect("symlink");
    let info = || {
        let mut child = Command::new(BIN)
            .arg("info")
            .env("TF_SEASTAR_ENDPOINT_MAP_PATH", dir.path())
            .env_remove("TF_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run");
        let status = common::wait(&mut child, Duration::from_secs(60));
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
            .expect("stderr");
        (status, err)
    };
    let (status, err) = info();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains(&path.display().to_string()) && err.contains("not a regular file"),
        "{err}"
    );
    std::fs::remove_file(&path).expect("rm");
    let line = "10.0.0.1:2222=10.1.0.1:3333\n";
    std::fs::write(&path, line.repeat((2 << 20) / line.len())).expect("write");
    let (status, err) = info();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("larger than 1048576 bytes"), "{err}");
}

#[test]
fn place_compares_strategies_on_a_zipf_model() {
    let out = run(&["place", "--ps", "4", "--vars", "24", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 3);
    let mm = |v: &Value| num(v, "bytes_max_over_mean");
    // Greedy by bytes never balances bytes worse than round-robin.
    assert!(mm(&lines[1]) <= mm(&lines[0]), "{lines:?}");
    assert!(
        num(&lines[2], "cost") <= num(&lines[1], "cost"),
        "{lines:?}"
    );
}

/// The JSON report of a 60-step `train --lr 0.1` with `extra` flags,
/// evaluated on `eval` examples; the run must succeed.
fn train_60_steps(extra: &[&str], eval: &str) -> Value {
    let mut args = vec![
        "train",
        "--steps",
        "60",
        "--lr",
        "0.1",
        "--eval-examples",
        eval,
        "--json",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    let out = run(&args);
    assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
    json_lines(&out).remove(0)
}

#[test]
fn ftrl_adagrad_decay_and_dc_asgd_train_and_bad_hyper_parameters_are_usage_errors() {
    for extra in [
        &[
            "--optimizer",
            "ftrl",
            "--l1-regularization-strength",
            "0.001",
            "--beta",
            "1",
        ][..],
        &[
            "--optimizer",
            "adagrad_decay",
            "--accumulator-decay-step",
            "20",
        ][..],
        &[
            "--optimizer",
            "dc_asgd",
            "--dc-lambda",
            "4",
            "--workers",
            "3",
        ][..],
        &["--staleness-lr", "sqrt", "--workers", "3"][..],
    ] {
        let v = train_60_steps(extra, "4000");
        assert!(num(&v, "auc") > 0.6, "{extra:?}: {v}");
    }
    // Staleness in the report; the rate scaled and warmed up.
    let out = run(&[
        "train",
        "--steps",
        "40",
        "--workers",
        "3",
        "--eval-examples",
        "2000",
        "--lr-scaling",
        "sqrt",
        "--lr-warmup-steps",
        "30",
        "--json",
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = &json_lines(&out)[0];
    let st = &v["staleness"];
    assert!(num(st, "pushes") > 0.0, "{v}");
    assert!(num(st, "max") >= num(st, "p99"), "{st}");
    assert!(num(st, "mean") <= num(st, "max"), "{st}");
    for (flag, value) in [
        ("--lr-scaling", "cubic"),
        ("--beta", "-1"),
        ("--l2-regularization-strength", "nan"),
        ("--accumulator-decay-rate", "1.5"),
        ("--optimizer", "lamb"),
        ("--dc-lambda", "-1"),
        ("--staleness-lr", "cubic"),
    ] {
        let out = run(&["train", "--steps", "1", &format!("{flag}={value}")]);
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(
            text(&out.stderr).contains(flag),
            "{flag}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn a_sync_run_of_more_than_32_workers_defaults_to_a_smaller_batch_and_reports_it() {
    let batch = |extra: &[&str]| train_60_steps(extra, "2000")["batch_size"].clone();
    assert_eq!(batch(&["--workers", "4", "--sync"]), 512);
    assert_eq!(batch(&["--workers", "40"]), 512);
    assert_eq!(batch(&["--workers", "40", "--sync"]), 512 * 32 / 40);
    assert_eq!(
        batch(&["--workers", "40", "--sync", "--batch-size", "64"]),
        64
    );
}

#[test]
fn bounded_delay_trains_is_reported_and_is_off_by_default_for_few_workers_and_sync() {
    let train = |extra: &[&str]| train_60_steps(extra, "2000");
    for delay in ["0", "2"] {
        let v = train(&["--workers", "4", "--bounded-delay", delay]);
        assert_eq!(v["bounded_delay"].to_string(), delay, "{v}");
        assert!(num(&v, "auc") > 0.6, "{v}");
        assert_eq!(num(&v, "steps"), 60.0, "{v}");
    }
    assert!(train(&["--workers", "4"])["bounded_delay"].is_null());
    assert!(train(&["--workers", "4", "--sync"])["bounded_delay"].is_null());
    let v = train(&["--workers", "32", "--optimizer", "adagrad"]);
    assert_eq!(v["bounded_delay"], 4, "{v}");
    // Steps in a row: ceil(5 / CPUs) by default when 32 workers outnumber
    // the CPUs, as given otherwise; none without a bound.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let k = if cpus >= 32 { 1 } else { 5u64.div_ceil(cpus) };
    assert_eq!(v["turn_steps"], k, "{v}");
    let v = train(&[
        "--workers",
        "4",
        "--bounded-delay",
        "2",
        "--turn-steps",
        "2",
    ]);
    assert_eq!(
        (num(&v, "turn_steps"), num(&v, "steps")),
        (2.0, 60.0),
        "{v}"
    );
    assert!(train(&["--workers", "4"])["turn_steps"].is_null());
    assert!(train(&["--workers", "32", "--bounded-delay", "off"])["bounded_delay"].is_null());
    for bad in [
        &["--bounded-delay=-1"][..],
        &["--bounded-delay=soon"][..],
        &["--bounded-delay", "2", "--sync"][..],
        &["--turn-steps", "2"][..],
        &["--turn-steps", "0", "--bounded-delay", "2"][..],
    ] {
        let mut args = vec!["train", "--steps", "1"];
        args.extend_from_slice(bad);
        let out = run(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let flag = if bad[0] == "--turn-steps" {
            "--turn-steps"
        } else {
            "--bounded-delay"
        };
        assert!(
            text(&out.stderr).contains(flag),
            "{bad:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn data_writes_criteo_and_reference_trains_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t.tsv");
    let fs = f.to_str().unwrap();
    let out = run(&["data", "--out", fs, "--examples", "4096"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines = std::fs::read_to_string(&f).unwrap();
    assert_eq!(lines.lines().count(), 4096);
    assert!(lines.lines().all(|l| l.split('\t').count() == 40));
    let src = format!("criteo:{fs}");
    let out = run(&[
        "reference",
        "--train",
        &src,
        "--eval",
        &src,
        "--epochs",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = &json_lines(&out)[0];
    assert_eq!(v["samples"].as_u64(), Some(4096));
    assert!(num(v, "auc") > 0.6, "{v}");
    // L-BFGS by default: how converged, and no oracle for a file.
    assert_eq!(v["solver"], "lbfgs", "{v}");
    assert_eq!(v["converged"], true, "{v}");
    assert!(
        num(v, "passes") >= 1.0 && num(v, "grad_norm") <= 1e-5,
        "{v}"
    );
    assert!(
        v["validation"].as_array().is_some_and(|a| !a.is_empty()),
        "{v}"
    );
    assert!(v["oracle_auc"].is_null(), "{v}");
    let out = run(&[
        "reference",
        "--train",
        &src,
        "--eval",
        &src,
        "--solver",
        "adagrad",
        "--epochs",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = &json_lines(&out)[0];
    assert_eq!(v["samples"].as_u64(), Some(4096));
    assert!(v["converged"].is_null(), "{v}");
    let out = run(&[
        "reference",
        "--train-examples",
        "3000",
        "--eval-examples",
        "2000",
        "--l2",
        "1e-3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = &json_lines(&out)[0];
    assert!(num(v, "oracle_auc") > 0.7, "{v}");
    assert_eq!(num(v, "l2"), 1e-3, "{v}");
}

#[test]
fn reference_skips_bad_lines_as_train_does() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t.tsv");
    let fs = f.to_str().unwrap();
    let out = run(&["data", "--out", fs, "--examples", "1000"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut lines: Vec<String> = std::fs::read_to_string(&f)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    // Line 501: an empty label, then the right number of columns.
    lines.insert(500, "\t".repeat(39));
    std::fs::write(&f, lines.join("\n") + "\n").unwrap();
    let src = format!("criteo:{fs}");
    let args = [
        "reference",
        "--train",
        &src,
        "--eval",
        &src,
        "--l2",
        "1e-3",
        "--json",
    ];
    let out = run(&args);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains("t.tsv") && err.contains("bad line 501"),
        "{err}"
    );
    let mut skip = args.to_vec();
    skip.push("--skip-bad-lines");
    let out = run(&skip);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = &json_lines(&out)[0];
    assert_eq!(v["samples"].as_u64(), Some(1000), "{v}");
    assert_eq!(v["eval_examples"].as_u64(), Some(1000), "{v}");
    // Once in the training data, once in the evaluation.
    assert_eq!(v["skipped_lines"].as_u64(), Some(2), "{v}");
}

#[cfg(feature = "uring")]
#[test]
fn bench_uring_all_modes_with_syscalls_per_msg() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp,uring",
        "--mode",
        "lat,rate,bw,fuse",
        "--sizes",
        "64,200000",
        "--iters",
        "40",
        "--warmup",
        "5",
        "--tensors",
        "8",
        "--json",
    ]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 16, "{lines:?}");
    for v in &lines {
        check_line(v);
        let spm = v["syscalls_per_msg"].as_f64();
        assert!(spm.is_some_and(|x| x > 0.0), "syscalls_per_msg: {v}");
    }
    assert!(lines
        .iter()
        .any(|v| v["backend"] == "uring" && v["mode"] == "bw"));
    let out = run(&[
        "bench",
        "--backends",
        "uring",
        "--mode",
        "rate",
        "--iters",
        "20",
    ]);
    assert!(
        text(&out.stdout).contains("sys/msg"),
        "{}",
        text(&out.stdout)
    );
}

#[cfg(feature = "uring")]
#[test]
fn bench_uring_many_connections_share_one_ring() {
    let out = run_with(
        &[
            "bench",
            "--backends",
            "uring",
            "--mode",
            "rate,bw",
            "--sizes",
            "4096",
            "--connections",
            "8",
            "--iters",
            "400",
            "--warmup",
            "40",
            "--json",
        ],
        &[("RUST_LOG", "starwire=debug")],
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    for v in &lines {
        check_line(v);
        assert_eq!(v["connections"], 8, "{v}");
        assert!(
            v["syscalls_per_msg"].as_f64().is_some_and(|x| x > 0.0),
            "{v}"
        );
    }
    // All eight connections of a side on one ring: its counters once (the
    // tcp test above checks that every connection carries traffic; the
    // load generator is the same code).
    let err = text(&out.stderr);
    for l in err.lines().filter(|l| l.contains("bench client counters")) {
        assert_eq!(l.matches("UringStats").count(), 1, "{l}");
    }
}

#[cfg(feature = "uring")]
#[test]
fn soak_over_uring_passes_polling_and_parked() {
    for polling in ["on", "off"] {
        let out = run(&[
            "soak",
            "--backend",
            "uring",
            "--connections",
            "16",
            "--duration",
            "2",
            "--polling",
            polling,
            "--json",
        ]);
        let s = text(&out.stdout);
        assert!(out.status.success(), "{s}\n{}", text(&out.stderr));
        let v: Value = serde_json::from_str(s.trim()).expect("soak JSON");
        assert_eq!(v["backend"], "uring");
        assert!(v["messages"].as_u64().unwrap_or(0) > 0, "{v}");
        for k in [
            "lost",
            "duplicated",
            "corrupted",
            "out_of_order",
            "connections_failed",
        ] {
            assert_eq!(v[k], 0, "{k}: {v}");
        }
    }
}

#[cfg(feature = "grpc")]
#[test]
fn bench_json_all_modes_grpc() {
    let out = run(&[
        "bench",
        "--backends",
        "grpc,tcp",
        "--mode",
        "lat,rate,bw,fuse",
        "--sizes",
        "64,4096",
        "--iters",
        "40",
        "--warmup",
        "4",
        "--inflight",
        "8",
        "--tensors",
        "8",
        "--json",
    ]);
    let lines = json_lines(&out);
    for v in &lines {
        check_line(v);
    }
    for m in ["lat", "rate", "bw", "fuse"] {
        let n = lines
            .iter()
            .filter(|v| v["backend"] == "grpc" && v["mode"] == m)
            .count();
        assert_eq!(n, 2, "grpc {m}");
    }
}

#[cfg(not(feature = "grpc"))]
#[test]
fn bench_grpc_without_the_feature_says_how_to_get_it() {
    let out = run(&["bench", "--backends", "grpc"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--features grpc"),
        "{}",
        text(&out.stderr)
    );
}

/// A `--repeat` past the bench's bound of runs is a usage error before
/// any run is listed (it sized the list first, and ran out of memory).
#[test]
fn report_refuses_a_repeat_past_the_run_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("rep");
    let out = run(&[
        "report",
        "--out",
        out_dir.to_str().unwrap(),
        "--repeat",
        "10000000000",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("runs"), "{err}");
}

#[test]
fn report_quick_writes_markdown_json_and_svg_plots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_dir = dir.path().join("rep");
    let out = run(&["report", "--out", out_dir.to_str().unwrap(), "--quick"]);
    assert!(
        out.status.success(),
        "starwire report failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let read =
        |n: &str| std::fs::read_to_string(out_dir.join(n)).unwrap_or_else(|e| panic!("{n}: {e}"));
    let json: Value = serde_json::from_str(&read("report.json")).expect("report.json parses");
    let lines = json["bench"].as_array().expect("bench array");
    for v in lines {
        check_line(v);
    }
    let backends: Vec<&str> = json["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap())
        .collect();
    for b in &backends {
        for m in ["lat", "rate", "bw"] {
            assert!(
                lines.iter().any(|v| v["backend"] == *b && v["mode"] == m),
                "{b} {m} missing"
            );
        }
    }
    assert!(backends.contains(&"raw") && backends.contains(&"tcp"));
    #[cfg(feature = "grpc")]
    assert!(backends.contains(&"grpc"));
    assert!(json["machine"]["kernel"]
        .as_str()
        .is_some_and(|k| !k.is_empty()));
    // The train section: every starwire backend, fusion on and off, then
    // the bound without a network.
    let train = json["train"].as_array().expect("train rows");
    assert_eq!(train.len(), 2 * (backends.len() - 1) + 1, "{train:?}");
    assert_eq!(train.last().unwrap()["backend"], "inproc");
    for t in train {
        assert!(t["error"].is_null(), "{t}");
        assert!(t["samples_per_s"].as_f64().is_some_and(|x| x > 0.0), "{t}");
    }
    let md = read("report.md");
    assert!(md.contains("| kernel |") && md.contains("| CPU |") && md.contains("| polling |"));
    assert!(md.contains("tcp ÷ raw"), "{md}");
    assert!(md.contains("÷ inproc (no network)"), "{md}");
    for svg in ["latency.svg", "rate.svg"] {
        let s = read(svg);
        assert!(
            s.starts_with("<svg") && s.trim_end().ends_with("</svg>"),
            "{svg}"
        );
        assert!(s.contains("<polyline"), "{svg} has no line");
        for b in &backends {
            assert!(
                s.contains(&format!(">{b}<")) || s.contains(&format!(">{b} <")) || s.contains(b),
                "{svg}: {b}"
            );
        }
    }
    let t = read("train.svg");
    assert!(t.starts_with("<svg") && t.trim_end().ends_with("</svg>"));
}

/// EAL arguments of a DPDK port in the process, no hugepages or devices.
#[cfg(feature = "dpdk")]
const NET_RING: &str = "--no-huge --no-pci --no-shconf -m 512 --vdev=net_ring0";

/// `info` probes the port and gives it no address: `--dpdk-ip` (a flag of
/// the backends' DPDK group) is refused rather than ignored.
#[cfg(feature = "dpdk")]
#[test]
fn info_refuses_dpdk_ip() {
    let out = run(&["info", "--dpdk-ip", "10.0.0.1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--dpdk-ip applies to"),
        "{}",
        text(&out.stderr)
    );
}

/// Bench and soak over DPDK on a net_ring port, both ends in one process
/// (each run is a process of its own: the EAL initialises once).
#[cfg(feature = "dpdk")]
#[test]
fn bench_and_soak_run_over_dpdk_on_net_ring() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp,dpdk",
        "--eal",
        NET_RING,
        "--mode",
        "lat,rate",
        "--iters",
        "300",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    let got: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["backend"].as_str().unwrap().to_owned(),
                r["mode"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for want in [
        ("tcp", "lat"),
        ("dpdk", "lat"),
        ("tcp", "rate"),
        ("dpdk", "rate"),
    ] {
        assert!(
            got.contains(&(want.0.to_owned(), want.1.to_owned())),
            "{want:?} in {got:?}"
        );
    }
    for r in rows.iter().filter(|r| r["backend"] == "dpdk") {
        assert!(r["msgs_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["iters"], 300, "{r}");
        // The backend's counters: both ends received data and acks, at
        // least one packet per frame, and the one port (both ends share
        // it) took at least the packets the drivers sent.
        assert!(r["pps"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["packets_per_frame"].as_f64().unwrap() >= 1.0, "{r}");
        assert!(r["retransmits"].as_u64().is_some(), "{r}");
        assert!(r["cpu_us_per_msg"].as_f64().unwrap() > 0.0, "{r}");
        let port = &r["port_stats"];
        assert!(port["ipackets"].as_u64().unwrap() >= 2 * 300, "{r}");
        assert!(port["opackets"].as_u64().unwrap() >= 2 * 300, "{r}");
        assert_eq!(port["imissed"], 0, "{r}");
        assert_eq!(port["rx_nombuf"], 0, "{r}");
        // The xstats that moved: ethdev's generic ones name the same
        // packets, and nothing that stayed at zero is listed.
        let x = r["port_xstats"].as_object().expect("port_xstats");
        assert!(x["rx_good_packets"].as_u64().unwrap() >= 2 * 300, "{r}");
        assert!(x.values().all(|v| v.as_u64().unwrap() > 0), "{r}");
        // A queue pair per reactor; net_ring has no rte_flow.
        assert_eq!(r["steering"], "software", "{r}");
    }
    for r in rows.iter().filter(|r| r["backend"] == "tcp") {
        for f in [
            "pps",
            "packets_per_frame",
            "retransmits",
            "cpu_us_per_msg",
            "port_stats",
            "port_xstats",
            "steering",
        ] {
            assert!(r[f].is_null(), "{f} of tcp: {r}");
        }
    }

    let out = run(&[
        "soak",
        "--backend",
        "dpdk",
        "--eal",
        NET_RING,
        "--connections",
        "8",
        "--duration",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(r["passed"], true, "{r}");
    assert_eq!(r["backend"], "dpdk");
    assert!(r["messages"].as_u64().unwrap() > 0, "{r}");

    // Two reactors a side, a queue pair each: every packet lands on its
    // sender's queue and is handed to its receiver in software.
    let out = run(&[
        "soak",
        "--backend",
        "dpdk",
        "--eal",
        NET_RING,
        "--client-reactors",
        "2",
        "--server-reactors",
        "2",
        "--dpdk-queues",
        "4",
        "--connections",
        "8",
        "--duration",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(r["passed"], true, "{r}");
    assert_eq!(r["client_reactors"], 2, "{r}");
    assert!(r["messages"].as_u64().unwrap() > 0, "{r}");

    // Faults injected under both DPDK links are repaired by the
    // reliability core: unlike tcp's, this soak must pass.
    let out = run(&[
        "soak",
        "--backend",
        "dpdk",
        "--eal",
        NET_RING,
        "--connections",
        "8",
        "--duration",
        "2",
        "--faults",
        "drop=0.05,reorder=0.05,corrupt=0.01,seed=3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(r["passed"], true, "{r}");
    assert_eq!(r["lost"], 0, "{r}");
    let f = &r["faults_injected"];
    for k in ["dropped", "reordered", "corrupted"] {
        assert!(f[k].as_u64().unwrap() > 0, "{k} injected: {r}");
    }

    // A bad EAL argument is the command's error, with DPDK's reason.
    let out = run(&[
        "bench",
        "--backends",
        "dpdk",
        "--eal",
        "--no-huge --starwire-bogus",
    ]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("EAL initialisation") && e.contains("--starwire-bogus"),
        "{e}"
    );
}

/// `train --backend dpdk` on one net_ring port shared by every PS reactor
/// and worker of the process, each connection bootstrapped over its TCP
/// stream: the same synchronous run as over tcp learns the same model.
#[cfg(feature = "dpdk")]
#[test]
fn train_over_dpdk_on_net_ring_matches_tcp() {
    let train = |extra: &[&str]| {
        let mut args = vec!["train", "--steps", "100", "--sync", "--json", "--quiet"];
        args.extend_from_slice(extra);
        let out = run(&args);
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
        let v: Value = serde_json::from_str(text(&out.stdout).trim()).expect("report JSON");
        v
    };
    let tcp = train(&["--backend", "tcp"]);
    let dpdk = train(&["--backend", "dpdk", "--eal", NET_RING]);
    assert_eq!(dpdk["backend"], "dpdk", "{dpdk}");
    assert_eq!(dpdk["steps"], tcp["steps"], "{dpdk}");
    let (a, b) = (num(&tcp, "auc"), num(&dpdk, "auc"));
    assert!(b > 0.6, "{dpdk}");
    assert!((a - b).abs() < 0.005, "auc tcp {a} dpdk {b}");
}

/// The local cluster's task counts and reactor cores are bounded where
/// they are given: a typo's thousands of threads fail at the flag or the
/// variable, not as descriptors running out mid-start.
#[test]
fn train_refuses_task_and_core_counts_past_their_bounds() {
    for (flag, value) in [("--ps", "100000"), ("--workers", "1025"), ("--ps", "0")] {
        usage_error_naming(&["train", flag, value], flag);
    }
    for var in ["NETWORK_PS_CORE_NUMBER", "NETWORK_WORKER_CORE_NUMBER"] {
        let out = run_with(&["train", "--quiet"], &net_env(&[(var, "5000")]));
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{var}: {err}");
        assert!(err.contains(var) && err.contains("1024"), "{var}: {err}");
        assert!(!err.contains("panicked"), "{var}: {err}");
    }
}

/// Values checkable alone are usage errors (exit 2) naming their flag:
/// a metrics address that is not HOST:PORT, a data stream that is not
/// train or eval, a data spec the true model cannot be built from.
#[test]
fn metrics_addresses_and_data_specs_are_usage_errors() {
    for cmd in ["train", "soak", "bench"] {
        for bad in ["bogus", ":9100", "localhost:http", "localhost:70000"] {
            usage_error_naming(&[cmd, "--metrics-addr", bad], "--metrics-addr");
        }
    }
    let out = std::env::temp_dir().join(format!("sw-data-{}.tsv", std::process::id()));
    let out = out.to_str().unwrap();
    usage_error_naming(&["data", "--out", out, "--stream", "foo"], "--stream");
    for (flag, value) in [("--vocab", "0"), ("--ctr", "2")] {
        usage_error_naming(&["data", "--out", out, flag, value], flag);
    }
    assert!(!std::path::Path::new(out).exists(), "nothing written");
}

/// Values the trainer and the reference would refuse mid-run are usage
/// errors (exit 2) naming their flag: an embedding wider than a model
/// takes, an L2 strength below 0 or not finite, a connection limit of 0.
#[test]
fn train_and_reference_refuse_out_of_range_values_by_flag() {
    for dim in ["0", "65537", "70000"] {
        usage_error_naming(&["train", "--embedding-dim", dim], "--embedding-dim");
    }
    for l2 in ["-1", "nan", "inf"] {
        usage_error_naming(&["reference", &format!("--l2={l2}")], "--l2");
    }
    for cmd in ["train", "ps"] {
        usage_error_naming(&[cmd, "--max-connections", "0"], "--max-connections");
    }
}

/// `train` refuses a `--max-connections` below what each of its PS tasks
/// holds, (workers + the evaluator) x shards per task, naming the count;
/// at that count the run starts and ends.
#[test]
fn train_refuses_fewer_connections_than_its_cluster_holds() {
    let env = net_env(&[("NETWORK_PS_CORE_NUMBER", "1")]);
    let small = [
        "train",
        "--quiet",
        "--steps",
        "4",
        "--train-examples",
        "4096",
        "--eval-examples",
        "512",
        "--max-connections",
    ];
    let out = run_with(&[&small[..], &["2"]].concat(), &env);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--max-connections 3 or more"), "{err}");
    let out = run_with(&[&small[..], &["3"]].concat(), &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// `soak` reads an invalid DeepRec variable as `train` does: a usage
/// error (exit 2) naming the variable, before any traffic.
#[test]
fn soak_refuses_an_invalid_deeprec_variable_as_a_usage_error() {
    for (var, value) in [
        ("NETWORK_PS_CORE_NUMBER", "0"),
        ("NETWORK_WORKER_CORE_NUMBER", "two"),
        ("WORKER_ENABLE_POLLING", "yes"),
        ("PS_DISABLE_PIN_CORES", ""),
    ] {
        let out = run_with(
            &["soak", "--connections", "1", "--duration", "0.1"],
            &net_env(&[(var, value)]),
        );
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value:?}: {err}");
        assert!(err.contains(var), "{var}={value:?}: {err}");
    }
}

/// `soak` takes each side's polling from its role's variable when
/// `--polling` is not given, and runs at most one reactor per connection,
/// saying so, whether the count came from a flag or a variable.
#[test]
fn soak_follows_the_deeprec_variables_and_caps_reactors_at_the_connections() {
    let out = run_with(
        &[
            "soak",
            "--connections",
            "2",
            "--client-reactors",
            "3",
            "--duration",
            "0.3",
            "--drain",
            "2",
            "--max-size",
            "1024",
            "--json",
        ],
        &net_env(&[("NETWORK_PS_CORE_NUMBER", "4")]),
    );
    let (s, err) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{s}\n{err}");
    let v: Value = serde_json::from_str(s.trim()).expect("soak JSON");
    assert_eq!(
        (v["client_reactors"].as_u64(), v["server_reactors"].as_u64()),
        (Some(2), Some(2)),
        "{v}"
    );
    // The variables say no polling, and no flag overrides them.
    assert_eq!(v["idle_policy"], "park", "{v}");
    assert!(
        err.contains("3 client reactors (flag --client-reactors)"),
        "{err}"
    );
    assert!(
        err.contains("4 server reactors (env NETWORK_PS_CORE_NUMBER)"),
        "{err}"
    );
}

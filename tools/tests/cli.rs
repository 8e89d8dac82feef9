//! End-to-end tests of the `starwire` binary. Short runs only (CI has two
//! cores); no timing is asserted.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_starwire");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("TF_CONFIG")
        .env_remove("TF_SEASTAR_ENDPOINT_MAP_PATH")
        .output()
        .expect("run starwire")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

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
    "msgs_per_s",
    "gbps",
    "polling",
    "client_core",
    "server_core",
];

fn json_lines(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "starwire failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON {l:?}: {e}")))
        .collect()
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

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
    assert!(s.contains("t_p50[us]") && s.contains("msgs/s"), "{s}");
    assert!(s.lines().any(|l| l.trim_start().starts_with("raw")), "{s}");
    assert!(s.lines().any(|l| l.trim_start().starts_with("tcp")), "{s}");
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
    let out = run(&["bench", "--backends", "tcp,verbs"]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("--features verbs") && e.contains("libibverbs-dev"),
        "{e}"
    );
    let out = run(&["soak", "--backend", "dpdk", "--duration", "1"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--features dpdk"));
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
        let out = run(&["info"]);
        let t = text(&out.stdout);
        assert!(
            t.contains("uring buffers") && t.contains("uring fallback"),
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
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains(&format!("{}:2", path.display())),
        "error must name file and line: {e}"
    );
}

#[test]
fn soak_passes_without_faults() {
    let out = run(&[
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "8",
        "--duration",
        "3",
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
    let out = loop {
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
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 4);
    for v in &lines {
        check_line(v);
    }
    let status = server.wait().expect("server exits after its client");
    assert!(status.success());
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

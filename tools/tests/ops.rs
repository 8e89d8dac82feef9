//! Operability of the `starwire` binary: the metrics endpoint scraped
//! during a run, progress lines and their flags. Short runs only.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;

use common::{run, starwire, stderr_lines};

/// `GET path` on `addr`: the status code and the body.
fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    Ok((status, body))
}

/// The families a scrape during `train` must show.
const NAMES: &[&str] = &[
    "starwire_ps_requests_total{shard=\"0\",kind=\"pull\"}",
    "starwire_ps_requests_total{shard=\"0\",kind=\"push\"}",
    "starwire_ps_rows{shard=\"0\",table=",
    "starwire_transport_bytes_total{backend=\"tcp\",direction=\"sent\"}",
    "starwire_transport_bytes_total{backend=\"tcp\",direction=\"received\"}",
    "starwire_transport_syscalls_total{backend=\"tcp\"}",
    "starwire_worker_samples_total{worker=\"0\"}",
    "starwire_worker_samples_total{worker=\"1\"}",
    "starwire_request_duration_seconds_bucket{le=",
    "starwire_request_duration_seconds_count",
    "starwire_step_duration_seconds_bucket{le=",
    "starwire_step_duration_seconds_sum",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
];

/// The value of the sample that starts with `name` (labels included).
fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn train_serves_metrics_while_it_runs() {
    let mut child = starwire(&[
        "train",
        "--steps",
        "100000",
        "--batch-size",
        "32",
        "--eval-examples",
        "500",
        "--log-every",
        "0",
        "--metrics-addr",
        "127.0.0.1:0",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("run starwire");
    let lines = stderr_lines(&mut child);
    let deadline = Instant::now() + Duration::from_secs(120);
    let addr = loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("a line naming the metrics address");
        if let Some(url) = line.split("metrics on http://").nth(1) {
            break url.trim_end_matches("/metrics").to_owned();
        }
    };
    let (status, body) = get(&addr, "/healthz").expect("GET /healthz");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, _) = get(&addr, "/nope").expect("GET /nope");
    assert_eq!(status, 404);
    // Scrape until the workers have trained: every family is there from
    // the start, the samples count up.
    let mut last = String::new();
    while Instant::now() < deadline {
        let (status, body) = get(&addr, "/metrics").expect("GET /metrics during the run");
        assert_eq!(status, 200);
        last = body;
        let trained =
            sample(&last, "starwire_worker_samples_total{worker=\"0\"}").is_some_and(|n| n > 0.0);
        // The PS publishes its counters on its own turns: a worker's count
        // can show before the shard's count of the push it sent.
        let pushed = sample(
            &last,
            "starwire_ps_requests_total{shard=\"0\",kind=\"push\"}",
        )
        .is_some_and(|n| n > 0.0);
        if trained && pushed && NAMES.iter().all(|n| last.contains(n)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = child.kill();
    let _ = child.wait();
    for n in NAMES {
        assert!(last.contains(n), "no {n} in the scrape:\n{last}");
    }
    assert!(
        sample(
            &last,
            "starwire_ps_requests_total{shard=\"0\",kind=\"push\"}"
        )
        .unwrap()
            > 0.0
    );
    assert!(sample(&last, "process_resident_memory_bytes").unwrap() > 0.0);
    assert!(
        last.contains("# TYPE starwire_step_duration_seconds histogram"),
        "{last}"
    );
}

fn short_train(extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train",
        "--steps",
        "40",
        "--batch-size",
        "64",
        "--train-examples",
        "4000",
        "--eval-examples",
        "500",
        "--log-every",
        "10",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = starwire(&args).output().expect("run starwire");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn progress_goes_to_stderr_with_json_and_quiet_hides_it() {
    let out = short_train(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    for w in 0..2 {
        assert!(
            err.contains(&format!("worker worker={w} step=10 ")),
            "no progress of worker {w}:\n{err}"
        );
    }
    assert!(err.contains("ps shard=0 global_step="), "{err}");
    // Piped stderr: no colour codes.
    assert!(!err.contains('\u{1b}'), "{err}");
    // --json owns stdout: one JSON object.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    serde_json::from_str::<serde_json::Value>(stdout.trim()).expect("a JSON report");

    let out = short_train(&["--quiet"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("progress"), "--quiet showed progress:\n{err}");
}

#[test]
fn json_log_format_writes_one_object_per_line() {
    let out = short_train(&["--log-format", "json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    let progress: Vec<serde_json::Value> = err
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .filter(|v: &serde_json::Value| v["target"] == "progress")
        .collect();
    assert!(
        progress
            .iter()
            .any(|v| v["message"] == "worker" && v["step"] == 10 && v["worker"] == 0),
        "{err}"
    );
}

#[test]
fn usage_errors_exit_2_and_name_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["train", "--backend", "foo"], "--backend"),
        (&["bench", "--backends", "foo"], "--backends"),
        (&["soak", "--backend", "foo"], "--backend"),
        (&["soak", "--backend", "grpc"], "--backend tcp"),
        (&["train", "--ps", "0"], "--ps"),
        (&["train", "--workers", "0"], "--workers"),
        (&["train", "--batch-size", "0"], "--batch-size"),
        (&["place", "--ps", "0"], "--ps"),
        (&["soak", "--duration", "0"], "--duration"),
        (&["bench", "--metrics-addr", "127.0.0.1:0"], "--listen"),
        (
            &["worker", "--ps-hosts", "a:1", "--worker-hosts", "b:1"],
            "task",
        ),
        // info resolves the cluster as ps and worker do.
        (&["info", "--ps-hosts", "a:1,,b:1"], "--ps-hosts"),
        (&["info", "--task-index", "1"], "--ps-hosts"),
        (
            &[
                "info",
                "--ps-hosts",
                "a:1",
                "--worker-hosts",
                "b:1",
                "--job-name",
                "ps",
                "--task-index",
                "3",
            ],
            "task",
        ),
    ];
    for (args, flag) in cases {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} does not name {flag}: {err}");
    }
}

/// The hint for a backend this binary lacks names the tcp backend, not a
/// flag: `bench` spells it `--backends`, `train`, `soak` and `info`
/// `--backend`, and each prints the same hint.
#[test]
fn backend_hints_name_no_flag_a_command_lacks() {
    // Built in, dpdk trains (tests/cli.rs runs it) and so does verbs (a
    // host without a device is a run-time error, tested in cli.rs).
    let mut names = Vec::new();
    if !cfg!(feature = "dpdk") {
        names.push("dpdk");
    }
    if !cfg!(feature = "verbs") {
        names.push("verbs");
    }
    for name in names {
        for cmd in ["train", "soak", "info"] {
            let out = run(&[cmd, "--backend", name]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
            assert!(err.contains("or use the tcp backend"), "{cmd}: {err}");
            assert!(!err.contains("--backends"), "{cmd}: {err}");
        }
    }
}

#[test]
fn run_time_errors_exit_1() {
    // A criteo file that is not there: the flags are fine, the run fails.
    let out = run(&["train", "--train", "criteo:/nonexistent/starwire.tsv"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/starwire.tsv"), "{err}");
}

#[test]
fn version_names_the_commit_and_completions_cover_the_commands() {
    let out = run(&["--version"]);
    assert!(out.status.success());
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(
        v.starts_with("starwire 0.") && v.contains("(commit "),
        "{v}"
    );
    for shell in ["bash", "zsh", "fish"] {
        let out = run(&["completions", shell]);
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8_lossy(&out.stdout);
        for cmd in ["train", "bench", "soak", "completions"] {
            assert!(script.contains(cmd), "{shell} script lacks {cmd}");
        }
        assert!(script.contains("metrics-addr"), "{shell}");
    }
    let out = run(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_bad_criteo_line_names_the_file_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("day_0.tsv");
    std::fs::write(&path, "1\t2\tthree\n").unwrap();
    let src = format!("criteo:{}", path.display());
    let out = run(&["train", "--train", &src, "--eval-examples", "10"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{}: bad line 1", path.display())),
        "{err}"
    );
}

/// Run `soak` with `args` and a metrics endpoint; scrape until every one
/// of `names` has a sample above zero. Returns the last scrape and every
/// stderr line of the run (stderr is a pipe: plain progress lines).
fn soak_scrape(args: &[&str], names: &[&str]) -> (String, Vec<String>) {
    let mut all = vec!["soak", "--metrics-addr", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let mut child = starwire(&all)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run starwire");
    let lines = stderr_lines(&mut child);
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let addr = loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("a line naming the metrics address");
        let url = line.split("metrics on http://").nth(1).map(str::to_owned);
        seen.push(line);
        if let Some(url) = url {
            break url.trim_end_matches("/metrics").to_owned();
        }
    };
    let mut last = String::new();
    while Instant::now() < deadline {
        let Ok((200, body)) = get(&addr, "/metrics") else {
            break;
        };
        last = body;
        if names
            .iter()
            .all(|n| sample(&last, n).is_some_and(|v| v > 0.0))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let status = child.wait().expect("soak ends");
    seen.extend(lines.iter());
    assert!(status.success(), "{}", seen.join("\n"));
    (last, seen)
}

#[test]
fn soak_publishes_its_drivers_counters_and_logs_plain_progress() {
    let names = [
        "starwire_transport_syscalls_total{backend=\"tcp\"}",
        "starwire_soak_messages_total{outcome=\"answered\"}",
    ];
    let (scrape, lines) = soak_scrape(
        &[
            "--backend",
            "tcp",
            "--connections",
            "4",
            "--duration",
            "6",
            "--drain",
            "1",
        ],
        &names,
    );
    for n in names {
        assert!(
            sample(&scrape, n).is_some_and(|v| v > 0.0),
            "no {n} in the scrape:\n{scrape}"
        );
    }
    // tcp keeps no retransmission count: no such series.
    assert!(
        !scrape.contains("starwire_transport_retransmits"),
        "{scrape}"
    );
    // Not a terminal: whole progress lines with an ETA, no bar.
    let all = lines.join("\n");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("soak: sending ") && l.contains("/6 s") && l.contains("eta")),
        "{all}"
    );
    assert!(!all.contains('\r'), "{all:?}");
}

#[test]
fn soak_quiet_logs_no_progress() {
    let out = starwire(&[
        "--quiet",
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "2",
        "--duration",
        "6",
        "--drain",
        "1",
    ])
    .output()
    .expect("run starwire");
    assert!(out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!e.contains("soak: sending"), "{e}");
}

/// The reliable-datagram counters of a DPDK soak over a net_ring port,
/// with loss under the link so that packets are sent again.
#[cfg(feature = "dpdk")]
#[test]
fn dpdk_soak_publishes_packets_and_retransmissions() {
    let names = [
        "starwire_transport_packets_total{backend=\"dpdk\",direction=\"sent\"}",
        "starwire_transport_packets_total{backend=\"dpdk\",direction=\"received\"}",
        "starwire_transport_retransmits_total{backend=\"dpdk\"}",
        // Losses halve congestion windows.
        "starwire_transport_cwnd_reductions_total{backend=\"dpdk\"}",
        // The port's own counters, read from DPDK at the scrape.
        "starwire_dpdk_port_packets_total{port=\"0\",direction=\"received\"}",
        "starwire_dpdk_port_xstats_total{port=\"0\",name=\"rx_good_packets\"}",
    ];
    let (scrape, _) = soak_scrape(
        &[
            "--backend",
            "dpdk",
            "--eal",
            "--no-huge --no-pci --no-shconf -m 512 --vdev=net_ring0",
            "--connections",
            "8",
            "--duration",
            "3",
            "--faults",
            "drop=0.01,seed=3",
        ],
        &names,
    );
    for n in names {
        assert!(
            sample(&scrape, n).is_some_and(|v| v > 0.0),
            "no {n} in the scrape:\n{scrape}"
        );
    }
    assert!(
        scrape.contains("starwire_transport_retransmit_timeouts_total{backend=\"dpdk\"}"),
        "{scrape}"
    );
    // Kept by every datagram driver, 0 while no reader falls behind.
    assert!(
        scrape.contains("starwire_transport_backlog_drops_total{backend=\"dpdk\"}"),
        "{scrape}"
    );
    assert!(
        scrape.contains("starwire_dpdk_port_dropped_packets_total{port=\"0\",reason=\"imissed\"}"),
        "{scrape}"
    );
}

/// The metrics address a child logs (`metrics on http://ADDR/metrics`).
fn metrics_addr(lines: &std::sync::mpsc::Receiver<String>) -> String {
    let seen = common::wait_for(lines, "metrics on http://", Duration::from_secs(60));
    let line = seen.last().expect("the line");
    let url = line.split("metrics on http://").nth(1).expect("an address");
    url.trim_end_matches("/metrics").to_owned()
}

fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the child's threads")
        .count()
}

/// More scrapers than the endpoint serves at once, all silent: the
/// process gains no thread for them (the endpoint polls its connections
/// from its one thread) and closes those past its cap at once.
#[test]
fn silent_metrics_clients_take_no_threads() {
    let listen = format!("127.0.0.1:{}", common::free_port());
    let mut child = starwire(&[
        "bench",
        "--listen",
        &listen,
        "--metrics-addr",
        "127.0.0.1:0",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("run starwire");
    let lines = stderr_lines(&mut child);
    let addr = metrics_addr(&lines);
    assert_eq!(get(&addr, "/healthz").expect("GET /healthz").0, 200);
    let before = threads(child.id());
    let silent: Vec<TcpStream> = (0..32)
        .map(|_| TcpStream::connect(&addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = threads(child.id());
    // Past the cap of 4: closed at accept (an EOF, perhaps after a 503).
    let mut last = silent.last().expect("a client");
    last.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut resp = Vec::new();
    let closed = last.read_to_end(&mut resp);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        during <= before,
        "{before} threads before 32 silent clients, {during} with them"
    );
    assert!(closed.is_ok(), "{closed:?}");
    let resp = String::from_utf8_lossy(&resp);
    assert!(
        resp.is_empty() || resp.starts_with("HTTP/1.1 503 "),
        "{resp}"
    );
}

/// A scraper that pipelines requests and never reads the answers does
/// not keep `soak` from ending (the endpoint's stop waits for no client).
#[test]
fn a_stuck_scraper_does_not_hold_the_process_at_exit() {
    let mut child = starwire(&[
        "soak",
        "--backend",
        "tcp",
        "--connections",
        "1",
        "--duration",
        "3",
        "--drain",
        "1",
        "--metrics-addr",
        "127.0.0.1:0",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("run starwire");
    let lines = stderr_lines(&mut child);
    let addr = metrics_addr(&lines);
    let mut stuck = TcpStream::connect(&addr).expect("connect");
    stuck
        .set_write_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    // Far more answer than the socket buffers hold; a server that answers
    // pipelined requests blocks writing them.
    let reqs = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(20_000);
    let _ = stuck.write_all(reqs.as_bytes());
    let status = common::wait(&mut child, Duration::from_secs(120));
    assert!(status.success(), "{status:?}");
    drop(stuck);
}

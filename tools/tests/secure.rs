//! The cluster token on the command line: listeners that refuse to serve
//! beyond the host without one, and a worker whose token or training
//! flags differ from its PS's failing at connect with a reason.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

mod common;

use common::{free_port, text, BIN};

const TOKEN: &str = "cli-test-cluster-token-0123456789";

fn command(args: &[&str], token: Option<&str>) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("TF_CONFIG")
        .env_remove("TF_SEASTAR_ENDPOINT_MAP_PATH")
        .env_remove("STARWIRE_CLUSTER_TOKEN");
    if let Some(t) = token {
        c.env("STARWIRE_CLUSTER_TOKEN", t);
    }
    c
}

fn run(args: &[&str], token: Option<&str>) -> Output {
    command(args, token).output().expect("run starwire")
}

#[test]
fn listeners_beyond_loopback_need_a_token_or_insecure() {
    let w = format!("127.0.0.1:{}", free_port());
    let any = format!("0.0.0.0:{}", free_port());
    let out = run(
        &[
            "ps",
            "--ps-hosts",
            &any,
            "--worker-hosts",
            &w,
            "--task-index",
            "0",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("without a cluster token") && err.contains("--insecure"),
        "{err}"
    );
    let out = run(&["bench", "--listen", &any], None);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // A token too short to be a secret is refused before anything starts.
    let out = run(
        &[
            "ps",
            "--ps-hosts",
            &any,
            "--worker-hosts",
            &w,
            "--task-index",
            "0",
        ],
        Some("short"),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("at least 16"),
        "{}",
        text(&out.stderr)
    );
}

/// A PS of a one-worker cluster on loopback, with `token`.
fn ps(hosts: &[String], token: Option<&str>) -> Child {
    let args: Vec<&str> = ["ps"]
        .into_iter()
        .chain(hosts.iter().map(String::as_str))
        .collect();
    command(&args, token)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ps")
}

#[test]
fn a_worker_with_another_token_or_other_flags_fails_at_connect() {
    let hosts: Vec<String> = [
        "--ps-hosts",
        &format!("127.0.0.1:{}", free_port()),
        "--worker-hosts",
        &format!("127.0.0.1:{}", free_port()),
        "--task-index",
        "0",
        "--train-examples",
        "4096",
        "--epochs",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = ps(&hosts, Some(TOKEN));
    let worker = |extra: &[&str], token: Option<&str>| {
        let args: Vec<&str> = ["worker"]
            .into_iter()
            .chain(hosts.iter().map(String::as_str))
            .chain(extra.iter().copied())
            .collect();
        run(&args, token)
    };
    std::thread::sleep(Duration::from_millis(300));
    let out = worker(&["--embedding-dim", "16"], Some(TOKEN));
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("training flags differ")
            && err.contains("--embedding-dim (16 here, 8 at the peer)"),
        "{err}"
    );
    let out = worker(&[], Some("another-token-of-the-same-length"));
    assert!(!out.status.success(), "a worker with another token trained");
    let out = worker(&[], None);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "a worker without a token trained");
    assert!(err.contains("cluster token"), "{err}");
    // The PS served none of them, and still waits for its worker.
    assert!(p.try_wait().expect("wait").is_none(), "the PS exited");
    p.kill().expect("kill");
    let out = p.wait_with_output().expect("ps output");
    assert!(!text(&out.stderr).contains("every worker is done"));
}

/// A `bench --connect` run of a few raw and tcp messages against `addr`.
fn bench_client(addr: &str, token: Option<&str>) -> Output {
    let mut c = command(
        &[
            "bench",
            "--connect",
            addr,
            "--backends",
            "raw,tcp",
            "--mode",
            "lat",
            "--sizes",
            "64",
            "--iters",
            "50",
            "--warmup",
            "0",
            "--json",
        ],
        token,
    );
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bench client");
    // A client that waits for a server that never answers must not hang
    // the test: the handshake gives up after 10 s.
    let t0 = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "bench client hung");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn a_bench_server_with_a_token_serves_only_a_client_that_proves_it() {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut server = command(&["bench", "--listen", &addr, "--one-off"], Some(TOKEN))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bench server");
    std::thread::sleep(Duration::from_millis(500));
    // Without the token, or with another one: the control connection is
    // closed before the plan is read, and the one-off server waits on.
    for t in [None, Some("another-token-of-the-same-length")] {
        let out = bench_client(&addr, t);
        assert!(
            !out.status.success(),
            "a client with token {t:?} was served"
        );
        assert!(
            server.try_wait().expect("wait").is_none(),
            "the server ended"
        );
    }
    let out = bench_client(&addr, Some(TOKEN));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines = text(&out.stdout);
    assert_eq!(lines.lines().count(), 2, "{lines}");
    let out = server.wait_with_output().expect("server output");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert_eq!(
        err.matches("closed a bench-control connection before serving it")
            .count(),
        2,
        "{err}"
    );
    assert!(err.contains("peer=127.0.0.1:"), "{err}");
}

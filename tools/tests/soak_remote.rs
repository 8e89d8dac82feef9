//! `starwire soak --listen` and `--connect`: the server and client sides
//! of a soak in two processes, over tcp on loopback. Short runs; nothing
//! about timing is asserted.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

mod common;

/// Three connections to two server reactors.
const THREE: &[&str] = &["--connections", "3", "--server-reactors", "2"];

fn soak(extra: &[&str]) -> Command {
    soak_of(THREE, extra)
}

/// A one-second tcp soak with `shape`'s connections and reactors.
fn soak_of(shape: &[&str], extra: &[&str]) -> Command {
    let mut c = common::bare(&["soak"]);
    c.args(["--backend", "tcp", "--duration", "1", "--json"])
        .args(shape)
        .args(extra)
        .env_remove("STARWIRE_CLUSTER_TOKEN");
    c
}

fn report(stdout: &[u8]) -> Value {
    let s = String::from_utf8_lossy(stdout);
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("bad soak JSON {s:?}: {e}"))
}

/// A soak server in one process (`server` added to its flags), its client
/// (`client` added) in another: each one's output, and the server's log.
fn two_processes(shape: &[&str], server: &[&str], client: &[&str]) -> (Output, Output, String) {
    let mut listen = vec!["--listen", "127.0.0.1:0"];
    listen.extend_from_slice(server);
    let mut server = soak_of(shape, &listen)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the soak server");
    // The server says where it listens before it serves.
    let stderr = server.stderr.take().expect("server stderr");
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the server ended before it listened")
            .expect("server stderr");
        if let Some(at) = line
            .split(" on ")
            .nth(1)
            .filter(|_| line.contains("serving"))
        {
            break at.trim().to_owned();
        }
    };
    // Keep draining the server's log so it never blocks on a full pipe.
    let log = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let mut connect = vec!["--connect", addr.as_str()];
    connect.extend_from_slice(client);
    let client = soak_of(shape, &connect)
        .output()
        .expect("run the soak client");
    let served = server.wait_with_output().expect("soak server");
    let log = log.join().expect("server log").join("\n");
    (client, served, log)
}

#[test]
fn a_soak_across_two_processes_passes_on_both_sides() {
    let (client, served, log) = two_processes(THREE, &[], &[]);
    let (c, s) = (report(&client.stdout), report(&served.stdout));
    assert!(
        client.status.success() && served.status.success(),
        "client {c}\n{}\nserver {s}\n{log}",
        String::from_utf8_lossy(&client.stderr)
    );
    assert_eq!(
        (c["side"].as_str(), s["side"].as_str()),
        (Some("client"), Some("server"))
    );
    for v in [&c, &s] {
        assert_eq!(v["passed"], true, "{v}");
        for k in [
            "lost",
            "duplicated",
            "corrupted",
            "rejected",
            "unmatched_responses",
            "out_of_order",
            "connections_failed",
        ] {
            assert_eq!(v[k], 0, "{k}: {v}");
        }
    }
    let sent = c["messages"].as_u64().unwrap_or(0);
    assert!(sent > 0, "{c}");
    assert_eq!(
        s["messages"].as_u64(),
        Some(sent),
        "the server saw every request"
    );
    assert_eq!(s["answered"].as_u64(), Some(sent), "and answered each");
    assert_eq!(s["server_reactors"], 2);
    // The client measures a round trip for each answer; the server, which
    // sends no requests, reports none.
    let l = &c["latency_us"];
    assert_eq!(l["count"].as_u64(), Some(sent), "{c}");
    let p = |k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{k}: {c}"));
    assert!(
        p("p50") > 0.0 && p("p50") <= p("p99") && p("p99") <= p("p999") && p("p999") <= p("max"),
        "{c}"
    );
    assert!(s.get("latency_us").is_none(), "{s}");
}

/// Faults under the server only: it finds corrupted requests and answers
/// them `BadRequest`; the client, in a process of its own and without
/// faults, must fail on those answers too (it passed, counting any answer
/// that was not `Ok` as fine, and any status garbled on the way with it).
#[test]
fn a_client_fails_on_answers_that_are_not_ok() {
    // Two connections, few and large messages, so that the few flipped
    // bits land in bodies (a header hit fails the connection instead,
    // which the client saw already).
    let shape = [
        "--connections",
        "2",
        "--server-reactors",
        "1",
        "--client-reactors",
        "1",
        "--max-size",
        "1000000",
    ];
    let (client, served, log) = two_processes(&shape, &["--faults", "corrupt=0.005,seed=3"], &[]);
    let (c, s) = (report(&client.stdout), report(&served.stdout));
    let why = format!(
        "client {c}\n{}\nserver {s}\n{log}",
        String::from_utf8_lossy(&client.stderr)
    );
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k}: {why}"));
    assert!(n(&s["faults_injected"], "corrupted") > 0, "{why}");
    assert_eq!(served.status.code(), Some(1), "{why}");
    assert_eq!(s["passed"], false, "{why}");
    assert_eq!(client.status.code(), Some(1), "{why}");
    assert_eq!(c["passed"], false, "{why}");
    assert_eq!(c["faults_injected"], Value::Null, "{why}");
    if n(&c, "connections_failed") == 0 && n(&c, "lost") == 0 {
        // No header was hit (with this seed, the usual run): every failure
        // is a rejected request, counted by the server as corrupted and by
        // the client as rejected, its only failure.
        assert!(n(&c, "rejected") > 0, "{why}");
        assert_eq!(n(&c, "rejected"), n(&s, "corrupted"), "{why}");
        assert_eq!(n(&c, "corrupted"), 0, "{why}");
    }
}

#[test]
fn listen_and_connect_exclude_each_other() {
    let out = soak(&["--listen", "127.0.0.1:0", "--connect", "127.0.0.1:1"])
        .output()
        .expect("run starwire");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn a_non_loopback_listen_needs_a_token() {
    let out = soak(&["--listen", "0.0.0.0:0"])
        .output()
        .expect("run starwire");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

//! `starwire soak --listen` and `--connect`: the server and client sides
//! of a soak in two processes, over tcp on loopback. Short runs; nothing
//! about timing is asserted.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::Value;

mod common;

fn soak(extra: &[&str]) -> Command {
    let mut c = common::bare(&["soak"]);
    c.args([
        "--backend",
        "tcp",
        "--connections",
        "3",
        "--server-reactors",
        "2",
        "--duration",
        "1",
        "--json",
    ])
    .args(extra)
    .env_remove("STARWIRE_CLUSTER_TOKEN");
    c
}

fn report(stdout: &[u8]) -> Value {
    let s = String::from_utf8_lossy(stdout);
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("bad soak JSON {s:?}: {e}"))
}

#[test]
fn a_soak_across_two_processes_passes_on_both_sides() {
    let mut server = soak(&["--listen", "127.0.0.1:0"])
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
    let client = soak(&["--connect", &addr])
        .output()
        .expect("run the soak client");
    let served = server.wait_with_output().expect("soak server");
    let log = log.join().expect("server log").join("\n");
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

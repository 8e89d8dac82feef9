//! What the end-to-end tests of the `starwire` binary share: running it
//! with a clean environment, reading its JSON lines and stderr, waiting
//! for it with a bound, and loopback ports.

// Each test file is its own crate and uses only some of these.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{mpsc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_starwire");

/// The binary with no cluster, endpoint map or log filter from the
/// caller's environment.
pub fn bare(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("TF_CONFIG")
        .env_remove("TF_SEASTAR_ENDPOINT_MAP_PATH")
        .env_remove("RUST_LOG");
    c
}

/// [`bare`], and no pinning or polling (the tests share two cores with
/// each other), no standard input.
pub fn starwire(args: &[&str]) -> Command {
    let mut c = bare(args);
    c.env("PS_ENABLE_POLLING", "false")
        .env("WORKER_ENABLE_POLLING", "false")
        .env("PS_DISABLE_PIN_CORES", "true")
        .env("WORKER_DISABLE_PIN_CORES", "true")
        .stdin(Stdio::null());
    c
}

/// Runs `starwire ARGS` ([`bare`]) to completion.
pub fn run(args: &[&str]) -> Output {
    run_with(args, &[])
}

/// [`run`] with extra environment variables.
pub fn run_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    bare(args)
        .envs(env.iter().copied())
        .output()
        .expect("run starwire")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The JSON lines of a run that must have succeeded.
pub fn json_lines(out: &Output) -> Vec<Value> {
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

pub fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

/// A loopback port nobody listens on (just released), never one this test
/// process was given before: the kernel may hand a port just released to
/// the next bind, and two calls returning the same one named one endpoint
/// twice in a cluster (a test failed so, "endpoint ... is listed twice").
pub fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        if given.insert(port) {
            return port;
        }
    }
}

/// The child's stderr, line by line as it comes.
pub fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let err = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The lines still to come from the stderr of a child that has exited:
/// read to the pipe's end, at most `limit`. (The reading thread may not
/// have passed on the last lines when the child's exit is seen, so a
/// `try_iter` then can miss them.)
pub fn rest_of(rx: &mpsc::Receiver<String>, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => out.push(l),
            // The pipe's end, or the limit.
            Err(_) => break,
        }
    }
    out
}

/// Waits for a line containing `what`, at most `limit`; the lines seen.
pub fn wait_for(rx: &mpsc::Receiver<String>, what: &str, limit: Duration) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => {
                let hit = l.contains(what);
                seen.push(l);
                if hit {
                    return seen;
                }
            }
            Err(_) => break,
        }
    }
    panic!("no line with {what:?} within {limit:?}: {seen:#?}");
}

/// Waits for `child` to exit, at most `limit` (then kills it and fails).
pub fn wait(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("the task did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

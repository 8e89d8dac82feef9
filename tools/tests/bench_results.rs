//! `starwire bench` prints each result when it is done: a sweep whose
//! server dies half-way keeps, on stdout, the results that came before.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use common::{free_port, run, starwire, stderr_lines, text, wait_for};
use serde_json::Value;

/// A relay of the control connection between a bench client and the
/// `--listen` server at `server`: it passes the server's first `dones`
/// `done` messages, then cuts both sides, as a server that dies does. The
/// run after them has measured (its data connections go to the server
/// directly), but the client never hears how it ended. Returns the
/// relay's address, for `--connect`.
fn cut_after(server: &str, dones: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("relay listener");
    let addr = listener.local_addr().expect("relay address").to_string();
    let server = server.to_owned();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().expect("the bench client");
        let upstream = TcpStream::connect(&server).expect("the bench server");
        let (mut from_client, mut to_server) = (
            client.try_clone().expect("clone"),
            upstream.try_clone().expect("clone"),
        );
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_client, &mut to_server);
        });
        let mut to_client = &client;
        let mut passed = 0;
        for line in BufReader::new(&upstream).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("{\"done\"") {
                if passed == dones {
                    break;
                }
                passed += 1;
            }
            if writeln!(to_client, "{line}").is_err() {
                break;
            }
        }
        let _ = client.shutdown(Shutdown::Both);
        let _ = upstream.shutdown(Shutdown::Both);
    });
    addr
}

/// The sizes of the result lines of `stdout`: JSON lines, or the table's
/// rows.
fn sizes(stdout: &str, json: bool) -> Vec<u64> {
    if json {
        return stdout
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"));
                v["size"].as_u64().expect("size")
            })
            .collect();
    }
    stdout
        .lines()
        .filter(|l| l.split_whitespace().next() == Some("tcp"))
        .map(|l| l.split_whitespace().nth(2).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn a_sweep_whose_server_dies_keeps_the_results_that_finished() {
    for json in [true, false] {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut server = starwire(&["bench", "--listen", &addr, "--one-off"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the server");
        let err = stderr_lines(&mut server);
        wait_for(&err, "waiting for a client", Duration::from_secs(20));
        // Four sizes; the server is gone after two.
        let relay = cut_after(&addr, 2);
        let mut args = vec![
            "bench",
            "--connect",
            &relay,
            "--backends",
            "tcp",
            "--sizes",
            "64,128,256,512",
            "--iters",
            "50",
            "--polling",
            "off",
        ];
        if json {
            args.push("--json");
        }
        let out = run(&args);
        // It waits for the third run's data connections, which will not
        // come.
        let _ = server.kill();
        let _ = server.wait();
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
        assert!(stderr.contains("bench server"), "{stderr}");
        assert_eq!(sizes(&stdout, json), [64, 128], "{stdout}\n{stderr}");
        if !json {
            // The table's header over them, and its rule under them.
            assert!(stdout.contains("\n backend "), "{stdout}");
            let last = stdout.lines().last().unwrap_or_default();
            assert!(last.starts_with("---"), "{stdout}");
        }
    }
}

/// A size given twice is one result, the median of all its runs, as it
/// was before results were printed as they finish (each listing then
/// finished a group of its own).
#[test]
fn a_size_given_twice_is_one_result() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp",
        "--mode",
        "lat",
        "--sizes",
        "64,64",
        "--iters",
        "200",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["size"], 64);
}

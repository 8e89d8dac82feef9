//! `starwire bench --rate`: the open-loop schedule end to end over
//! loopback, and its refusals. Counts and fields only; no timing is
//! asserted.

mod common;

use common::{json_lines, num, run, text};

/// Exactly `--iters` measured at a rate, over the session layer (parked
/// and polling reactors, several connections), the raw baseline and the
/// gRPC baseline.
#[test]
fn a_rate_measures_exactly_iters_and_says_what_it_offered() {
    let mut backends = vec!["raw", "tcp"];
    if cfg!(all(feature = "uring", target_os = "linux")) {
        backends.push("uring");
    }
    if cfg!(feature = "grpc") {
        backends.push("grpc");
    }
    for (polling, conns) in [("on", "1"), ("off", "3")] {
        let list: Vec<&str> = backends
            .iter()
            .copied()
            // raw with polling off is refused a rate; raw and grpc take
            // one connection.
            .filter(|&b| polling == "on" || !matches!(b, "raw" | "grpc"))
            .collect();
        let list = list.join(",");
        let out = run(&[
            "bench",
            "--backends",
            &list,
            "--mode",
            "lat,rate",
            "--connections",
            conns,
            "--rate",
            "20000",
            "--iters",
            "60",
            "--warmup",
            "10",
            "--polling",
            polling,
            "--json",
        ]);
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 2 * list.split(',').count(), "{lines:?}");
        for v in &lines {
            assert_eq!(v["iters"], 60, "{v}");
            assert_eq!(num(v, "offered_rate"), 20000.0, "{v}");
            assert!(num(v, "msgs_per_s") > 0.0, "{v}");
            assert!(num(v, "p99_us") > 0.0, "{v}");
        }
    }
}

/// A rate slow enough for a parked reactor to sleep between due times
/// (5 ms apart): it wakes for each and the run measures them all.
#[test]
fn a_slow_rate_over_a_parked_reactor_measures_exactly_iters() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp",
        "--mode",
        "lat",
        "--rate",
        "200",
        "--iters",
        "10",
        "--warmup",
        "2",
        "--polling",
        "off",
        "--json",
    ]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["iters"], 10, "{}", lines[0]);
    assert_eq!(num(&lines[0], "offered_rate"), 200.0, "{}", lines[0]);
}

/// The closed loop says it offered nothing; the table notes the rate.
#[test]
fn the_closed_loop_has_no_offered_rate_and_the_table_notes_one() {
    let closed = run(&["bench", "--backends", "tcp", "--iters", "20", "--json"]);
    for v in &json_lines(&closed) {
        assert!(v["offered_rate"].is_null(), "{v}");
    }
    let table = run(&[
        "bench",
        "--backends",
        "tcp",
        "--iters",
        "20",
        "--rate",
        "5000",
        "--quiet",
    ]);
    assert!(table.status.success(), "{}", text(&table.stderr));
    let out = text(&table.stdout);
    assert!(out.contains("open loop, 5000 msgs/s offered"), "{out}");
}

#[test]
fn a_bad_rate_is_a_usage_error_naming_the_flag() {
    let cases: Vec<Vec<&str>> = vec![
        vec!["--rate", "0"],
        vec!["--rate", "-5"],
        vec!["--rate", "NaN"],
        vec!["--rate", "fast"],
        vec!["--rate", "100", "--mode", "bw", "--iters", "5"],
        vec!["--rate", "100", "--mode", "fuse", "--iters", "5"],
        vec!["--rate", "100", "--polling", "off", "--iters", "5"],
        // No --iters or --duration: the schedule's length is not given.
        vec!["--rate", "100"],
        // A server's load is its client's.
        vec!["--rate", "100", "--iters", "5", "--listen", "127.0.0.1:0"],
    ];
    for args in cases {
        let mut all = vec!["bench"];
        all.extend(&args);
        let out = run(&all);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("--rate"), "{args:?}: {err}");
    }
}

//! `starwire bench --warmup` as a count or a time, and `--interval`
//! reports among the `--json` result lines. Short loopback runs; the only
//! timing asserted is a lower bound (a time warm-up cannot end early).

mod common;

use std::time::{Duration, Instant};

use common::{json_lines, num, run, text};
use serde_json::Value;

/// The interval reports and the result lines of a `--json` bench, in the
/// order printed.
fn split(lines: Vec<Value>) -> (Vec<Value>, Vec<Value>) {
    lines.into_iter().partition(|v| v.get("interval").is_some())
}

#[test]
fn a_time_warmup_and_intervals_are_json_lines_on_stdout() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp",
        "--mode",
        "rate",
        "--sizes",
        "64",
        "--duration",
        "0.5",
        "--warmup",
        "100ms",
        "--interval",
        "0.2",
        "--polling",
        "off",
        "--json",
    ]);
    let lines = json_lines(&out);
    // The result line comes when its run is done, after its intervals.
    let last = lines.last().expect("a result line").clone();
    assert!(last.get("interval").is_none(), "{last}");
    let (intervals, results) = split(lines);
    assert_eq!(results.len(), 1, "{results:?}");
    let r = &results[0];
    assert!(r["warmup"].is_null(), "a time warm-up has no count: {r}");
    assert_eq!(num(r, "warmup_s"), 0.1, "{r}");
    assert!(num(r, "msgs_per_s") > 0.0, "{r}");
    // 0.5 s in intervals of 0.2 s: two full ones and the rest.
    assert!(intervals.len() >= 2, "{intervals:?}");
    let mut to = 0.0;
    for v in &intervals {
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 1, "one key, `interval`: {v}");
        let i = &v["interval"];
        assert_eq!(
            (&i["backend"], &i["mode"], &i["size"]),
            (&Value::from("tcp"), &Value::from("rate"), &Value::from(64)),
            "{v}"
        );
        assert_eq!(num(i, "from_s"), to, "intervals follow each other: {v}");
        to = num(i, "to_s");
        assert!(to > num(i, "from_s"), "{v}");
        assert!(num(i, "msgs_per_s") > 0.0 && num(i, "gbps") > 0.0, "{v}");
        // rate records round trips.
        assert!(num(i, "p50_us") <= num(i, "p99_us"), "{v}");
        assert!(num(i, "p99_us") <= num(i, "max_us"), "{v}");
    }
    let err = text(&out.stderr);
    assert!(
        !err.contains("[tcp rate 64 B]"),
        "with --json no text intervals: {err}"
    );
}

#[test]
fn without_json_the_intervals_stay_text_on_stderr() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp",
        "--mode",
        "bw",
        "--duration",
        "0.3",
        "--warmup",
        "50ms",
        "--interval",
        "0.1",
        "--polling",
        "off",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (stdout, err) = (text(&out.stdout), text(&out.stderr));
    assert!(!stdout.contains("interval"), "{stdout}");
    assert!(err.contains("[tcp bw 64 B]"), "{err}");
}

#[test]
fn every_client_waits_out_a_time_warmup_before_its_iterations() {
    let mut backends = vec!["raw", "tcp"];
    if cfg!(feature = "grpc") {
        backends.push("grpc");
    }
    let list = backends.join(",");
    let started = Instant::now();
    let lines = json_lines(&run(&[
        "bench",
        "--backends",
        &list,
        "--mode",
        "lat,fuse",
        "--tensors",
        "4",
        "--iters",
        "20",
        "--warmup",
        "300ms",
        "--polling",
        "off",
        "--json",
    ]));
    // lat on each backend, fuse on all but raw; each warms up (fuse: each
    // of its two phases) for 300 ms before 20 iterations.
    let runs = 2 * backends.len() - 1;
    let phases = backends.len() + 2 * (backends.len() - 1);
    assert_eq!(lines.len(), runs, "{lines:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(300) * phases as u32,
        "{:?}",
        started.elapsed()
    );
    for v in &lines {
        assert_eq!(
            (v["warmup"].is_null(), num(v, "warmup_s")),
            (true, 0.3),
            "{v}"
        );
        assert_eq!(num(v, "iters"), 20.0, "{v}");
    }
}

#[test]
fn a_count_warmup_is_reported_as_one() {
    let lines = json_lines(&run(&[
        "bench",
        "--backends",
        "raw,tcp",
        "--iters",
        "50",
        "--warmup",
        "7",
        "--polling",
        "off",
        "--json",
    ]));
    assert_eq!(lines.len(), 2);
    for v in &lines {
        assert_eq!(
            (num(v, "warmup"), v["warmup_s"].is_null()),
            (7.0, true),
            "{v}"
        );
        assert_eq!(num(v, "iters"), 50.0, "{v}");
    }
}

#[test]
fn a_warmup_that_is_neither_is_a_usage_error_naming_the_flag() {
    for bad in ["1.5", "2h", "0s", "-1s"] {
        let arg = format!("--warmup={bad}");
        let out = run(&["bench", &arg]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--warmup"), "{bad}: {err}");
    }
}

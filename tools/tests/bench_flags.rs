//! `starwire bench`'s perftest- and iperf3-style flags: --all-sizes,
//! --bidirectional, --interval, --cpu-util and --histogram. Short runs
//! only; no timing is asserted.

mod common;

use common::{json_lines, num, run, text};

#[test]
fn all_sizes_runs_2_bytes_to_8_mib() {
    let out = run(&[
        "bench",
        "--backends",
        "tcp",
        "--all-sizes",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--polling",
        "off",
        "--json",
    ]);
    let sizes: Vec<u64> = json_lines(&out)
        .iter()
        .map(|v| v["size"].as_u64().expect("size"))
        .collect();
    let want: Vec<u64> = (1..=23).map(|k| 1u64 << k).collect();
    assert_eq!(sizes, want);
}

#[test]
fn all_sizes_and_sizes_conflict() {
    let out = run(&["bench", "--all-sizes", "--sizes", "64"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--sizes"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bidirectional_echoes_and_counts_both_ways() {
    let args = |bidi: bool| {
        let mut a = vec![
            "bench",
            "--backends",
            "raw,tcp",
            "--mode",
            "rate,bw",
            "--sizes",
            "1024",
            "--iters",
            "200",
            "--json",
        ];
        if bidi {
            a.push("--bidirectional");
        }
        run(&a)
    };
    let lines = json_lines(&args(true));
    assert_eq!(lines.len(), 4);
    for v in &lines {
        assert_eq!(v["bidirectional"], true, "{v}");
        // Both directions: Gb/s = 2 x msgs/s x size x 8.
        let want = 2.0 * num(v, "msgs_per_s") * 1024.0 * 8.0 / 1e9;
        assert!((num(v, "gbps") - want).abs() <= want * 1e-9, "{v}");
    }
    for v in &json_lines(&args(false)) {
        assert_eq!(v["bidirectional"], false, "{v}");
        let want = num(v, "msgs_per_s") * 1024.0 * 8.0 / 1e9;
        assert!((num(v, "gbps") - want).abs() <= want * 1e-9, "{v}");
    }
}

#[test]
fn bidirectional_fuse_is_a_usage_error() {
    let out = run(&["bench", "--mode", "fuse", "--bidirectional"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--bidirectional"));
}

#[test]
fn interval_reports_during_a_duration_run() {
    let out = run(&[
        "bench",
        "--backends",
        "raw,tcp",
        "--mode",
        "lat,bw",
        "--duration",
        "1",
        "--interval",
        "0.25",
        "--polling",
        "off",
    ]);
    // Text on stderr without --json (with it, JSON lines on stdout: see
    // bench_warmup.rs).
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    for run in ["raw lat 64 B", "tcp lat 64 B", "raw bw 64 B", "tcp bw 64 B"] {
        let reports: Vec<&str> = err
            .lines()
            .filter(|l| l.starts_with(&format!("[{run}]")))
            .collect();
        // Four intervals of 0.25 s in one second, give or take the last.
        assert!(reports.len() >= 3, "{run}: {err}");
        assert!(reports.iter().all(|l| l.contains("msgs/s")), "{err}");
        if run.contains("lat") {
            assert!(reports.iter().all(|l| l.contains("rtt p50")), "{err}");
        }
    }
    assert!(
        err.contains("0.00-0.2"),
        "the first interval starts at 0: {err}"
    );
}

#[test]
fn interval_must_be_positive() {
    let out = run(&["bench", "--interval", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--interval"));
}

#[test]
fn cpu_util_reports_a_share_of_a_core() {
    // The kernel brings a running thread's CPU time up to date at its
    // ticks (4 ms at 250 Hz) and switches: a run of a few milliseconds (300
    // messages of bw took under 1 ms) can count up to a tick per thread
    // more than it used, 423% of a core once on a 2-vCPU host. Runs of
    // 20 000 messages take tens of milliseconds or more.
    let out = run(&[
        "bench",
        "--backends",
        "tcp",
        "--mode",
        "lat,bw",
        "--iters",
        "20000",
        "--cpu-util",
        "--json",
    ]);
    for v in &json_lines(&out) {
        let p = num(v, "cpu_pct");
        // Two reactors of one process: up to two cores, more than idle.
        assert!(p > 0.0 && p <= 400.0, "{v}");
        assert!(
            v["server_cpu_pct"].is_null(),
            "one process over loopback: {v}"
        );
    }
    let table = run(&["bench", "--backends", "tcp", "--iters", "100", "--cpu-util"]);
    assert!(table.status.success());
    assert!(
        text(&table.stdout).contains("cpu%"),
        "{}",
        text(&table.stdout)
    );
    let plain = run(&["bench", "--backends", "tcp", "--iters", "100", "--json"]);
    assert!(json_lines(&plain)[0]["cpu_pct"].is_null());
}

/// The tags and counts of an HdrHistogram interval log, read as text (the
/// hdrhistogram crate's reader is tested in the bench's unit tests).
fn log_entries(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|l| l.strip_prefix("Tag="))
        .map(|l| {
            let mut f = l.split(',');
            let tag = f.next().unwrap().to_owned();
            let hist = f.nth(3).unwrap().to_owned();
            (tag, hist)
        })
        .collect()
}

#[test]
fn histogram_file_has_one_tagged_histogram_per_lat_and_rate_result() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rtt.hlog");
    let out = run(&[
        "bench",
        "--backends",
        "raw,tcp",
        "--mode",
        "lat,rate,bw",
        "--sizes",
        "64,4096",
        "--iters",
        "100",
        "--repeat",
        "2",
        "--histogram",
        path.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(json_lines(&out).len(), 12);
    let log = std::fs::read_to_string(&path).unwrap();
    assert!(log.contains("#[BaseTime:"), "{log}");
    let tags: Vec<String> = log_entries(&log).into_iter().map(|(t, _)| t).collect();
    let mut want = Vec::new();
    for mode in ["lat", "rate"] {
        for size in [64, 4096] {
            for b in ["raw", "tcp"] {
                want.push(format!("{b}-{mode}-{size}"));
            }
        }
    }
    assert_eq!(tags, want, "{log}");
    for (_, h) in log_entries(&log) {
        assert!(h.starts_with("HISTF"), "a compressed V2 histogram: {h}");
    }
}

#[test]
fn histogram_to_an_unwritable_path_fails_before_measuring() {
    let out = run(&[
        "bench",
        "--histogram",
        "/nonexistent-dir/x.hlog",
        "--duration",
        "30",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--histogram"),
        "{}",
        text(&out.stderr)
    );
}

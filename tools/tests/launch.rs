//! Launching `starwire ps` and `starwire worker` as a launcher does: in
//! any order, with TensorFlow's flag spellings or `TF_CONFIG`, names that
//! do not resolve yet, `--bind` and `--connect-timeout`. Short runs only;
//! no timing is asserted beyond the bounds the flags set.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{free_port, rest_of, starwire, stderr_lines, text, wait};

const TINY: &[&str] = &[
    "--train-examples",
    "4096",
    "--eval-examples",
    "1024",
    "--epochs",
    "1",
    "--json",
];

#[test]
fn a_worker_started_before_its_ps_connects_once_the_ps_appears() {
    let (p, w) = (free_port(), free_port());
    let ps_addr = format!("127.0.0.1:{p}");
    // The worker with TensorFlow's spellings, the PS with TF_CONFIG: the
    // way two launchers would start them.
    let mut worker = starwire(
        &[
            &[
                "worker",
                "--ps_hosts",
                &ps_addr,
                "--worker_hosts",
                &format!("127.0.0.1:{w}"),
                "--job_name",
                "chief",
                "--task_index",
                "0",
                "--connect-timeout",
                "60",
            ][..],
            TINY,
        ]
        .concat(),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn worker");
    let lines = stderr_lines(&mut worker);
    // The worker warns, naming the address and the attempt, while nobody
    // listens.
    let deadline = Instant::now() + Duration::from_secs(30);
    let warning = loop {
        let line = lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("a retry warning before the PS starts");
        if line.contains("WARN") && line.contains(&ps_addr) {
            break line;
        }
    };
    assert!(
        warning.contains("connecting to") && warning.contains("attempt"),
        "{warning}"
    );
    let tf_config = format!(
        r#"{{"cluster": {{"ps": ["{ps_addr}"], "chief": ["127.0.0.1:{w}"]}},
            "task": {{"type": "ps", "index": 0}}}}"#
    );
    let ps = starwire(&[&["ps", "--bind", "127.0.0.1", "--exit-when-done"][..], TINY].concat())
        .env("TF_CONFIG", &tf_config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ps");
    let st = wait(&mut worker, Duration::from_secs(120));
    let rest: Vec<String> = rest_of(&lines, Duration::from_secs(10));
    let mut out = String::new();
    std::io::Read::read_to_string(&mut worker.stdout.take().unwrap(), &mut out).unwrap();
    assert!(st.success(), "worker: {st}\n{}", rest.join("\n"));
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["samples"].as_u64(), Some(4096), "{v}");
    let ps = ps.wait_with_output().expect("ps");
    assert!(ps.status.success(), "ps: {}", text(&ps.stderr));
}

#[test]
fn a_ps_that_never_resolves_or_never_listens_fails_after_the_connect_timeout() {
    let t0 = Instant::now();
    let out: Output = starwire(&[
        "worker",
        "--ps-hosts",
        "starwire-ps-0.starwire-ps.invalid:2222",
        "--worker-hosts",
        "127.0.0.1:2223",
        "--task-index",
        "0",
        "--connect-timeout",
        "1",
    ])
    .output()
    .expect("run");
    assert!(t0.elapsed() >= Duration::from_secs(1));
    assert_eq!(out.status.code(), Some(1), "a run-time error");
    let err = text(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("starwire: error: resolving starwire-ps-0.starwire-ps.invalid:2222: ")
            && last.ends_with("gave up after --connect-timeout 1 s"),
        "{err}"
    );
    // Each retry was a warning naming the address and the attempt.
    let warnings = err
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("starwire-ps-0.starwire-ps.invalid:2222"))
        .count();
    assert!(warnings >= 3, "{err}");
    assert!(err.contains("attempt 1 failed"), "{err}");
    // A name that resolves to where nobody listens: the same bound.
    let ps = format!("127.0.0.1:{}", free_port());
    let out = starwire(&[
        "worker",
        "--ps-hosts",
        &ps,
        "--worker-hosts",
        "127.0.0.1:2223",
        "--task-index",
        "0",
        "--connect-timeout",
        "1",
    ])
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("starwire: error: connecting to {ps}: "))
            && last.ends_with("gave up after --connect-timeout 1 s"),
        "{err}"
    );
}

#[test]
fn a_bind_address_this_host_lacks_is_named_with_the_fix() {
    let (p, w) = (free_port(), free_port());
    // 192.0.2.1 (TEST-NET-1) is no address of this host.
    let out = starwire(&[
        "ps",
        "--ps-hosts",
        &format!("127.0.0.1:{p}"),
        "--worker-hosts",
        &format!("127.0.0.1:{w}"),
        "--task-index",
        "0",
        "--bind",
        "192.0.2.1",
        // A non-loopback bind needs a token or --insecure (checked before
        // the bind); this test is about the bind.
        "--insecure",
    ])
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("listening on 192.0.2.1:{p}: "))
            && err.contains(&format!("--bind 0.0.0.0:{p}")),
        "{err}"
    );
}

#[test]
fn job_name_is_accepted_when_it_fits_the_subcommand() {
    let cluster = ["--ps-hosts", "127.0.0.1:1", "--worker-hosts", "127.0.0.1:2"];
    let out = starwire(
        &[
            &["ps"][..],
            &cluster,
            &["--job-name", "worker", "--task-index", "0"],
        ]
        .concat(),
    )
    .output()
    .expect("run");
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let err = text(&out.stderr);
    assert!(
        err.contains("--job-name \"worker\"") && err.contains("starwire ps"),
        "{err}"
    );
    // `--job-name ps` without `--task-index`: the error names both flags.
    let out = starwire(&[&["ps"][..], &cluster, &["--job_name", "ps"]].concat())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("--job-name") && err.contains("--task-index"),
        "{err}"
    );
    // A TF_CONFIG task of the other role names the command to run.
    let out = starwire(&["ps"])
        .env(
            "TF_CONFIG",
            r#"{"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                "task": {"type": "worker", "index": 0}}"#,
        )
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("/job:worker/task:0") && err.contains("starwire worker"),
        "{err}"
    );
}

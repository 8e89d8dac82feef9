//! `starwire report --out DIR`: the standard suite across every compiled-in
//! backend, in one run, written as `report.md` (tables with ratios to `raw`
//! and `grpc`), `report.json` (every figure, with bench's field names) and
//! SVG plots.
//!
//! The suite: latency over sizes 64 B to 1 MiB, rate over 1 to 64 in
//! flight, bandwidth, fusion, and a comm-bound `train`, each case run
//! several times and shown with its range. The train
//! section comes from a [`TrainSuite`] the caller hands in; a build without
//! one says so in the report and has no train figures.

mod markdown;
mod plot;

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::backend::Backend;
use crate::bench::{self, Cores, Mode, Plan, ResultLine};
use crate::progress::{Progress, Unit};

use markdown::markdown;

/// Latency sizes of the full suite: 64 B, then every power of 4 to 1 MiB.
const LAT_SIZES: &[usize] = &[64, 256, 1024, 4096, 16384, 65536, 262_144, 1_048_576];
/// In-flight counts of the rate sweep.
const RATE_INFLIGHT: &[usize] = &[1, 2, 4, 8, 16, 32, 64];
/// Payload of the rate sweep (the size of the rate comparison).
const RATE_SIZE: usize = 4096;
/// Bandwidth sizes.
const BW_SIZES: &[usize] = &[65536, 1_048_576];
/// Fusion: tensors per step and bytes per tensor.
const FUSE_TENSORS: usize = 100;
const FUSE_SIZE: usize = 256;

/// Options of `starwire report`.
#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// Directory for report.md, report.json and the SVG plots (created).
    #[arg(long)]
    pub out: PathBuf,
    /// A short suite (two sizes, two in-flight counts, few iterations): for
    /// CI and tests, not for figures.
    #[arg(long)]
    pub quick: bool,
    /// Backends to include (default: every one compiled in).
    #[arg(long, value_delimiter = ',')]
    pub backends: Option<Vec<Backend>>,
    /// Seconds each measurement runs in the full suite.
    #[arg(long, default_value_t = 0.5)]
    pub duration: f64,
    /// Alternate the backends this many times per point and report the
    /// median (the bench's `--repeat`): steadier figures on a shared machine.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Busy polling on (the default) or off.
    #[arg(long, value_parser = crate::parse_on_off)]
    pub polling: Option<bool>,
    /// Client and server cores, `C,S` (default 0,1 with two or more CPUs).
    #[arg(long, value_parser = bench::parse_cores)]
    pub cores: Option<Cores>,
}

/// One train measurement the report asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrainCase {
    /// Backend to train over (`starwire train --backend`).
    pub backend: &'static str,
    /// Tensor fusion on or off (`--tensor-fuse`).
    pub fusion: bool,
    /// Model (`--model`).
    pub model: String,
    /// `--embedding-dim`.
    pub embedding_dim: usize,
    /// `--batch-size`.
    pub batch_size: usize,
    /// Training steps to measure.
    pub steps: u64,
}

/// What one train run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainResult {
    /// Training samples per second.
    pub samples_per_s: f64,
    /// Steps measured.
    pub steps: u64,
}

/// The train section's source: `starwire train` connects one (the report
/// has no training code of its own).
pub trait TrainSuite {
    /// Run one case; an error is reported for that case, the others go on.
    fn run(&self, case: &TrainCase) -> Result<TrainResult, String>;
}

/// Training steps of a full-suite train case: enough that start-up and the
/// first steps' allocations do not decide the rate.
const TRAIN_STEPS: u64 = 1000;
/// Runs of each train case in the full suite (at least; `--repeat` more).
const TRAIN_RUNS: usize = 3;

/// One row of the train section of report.json.
#[derive(Debug, Clone, Serialize)]
struct TrainRow {
    #[serde(flatten)]
    case: TrainCase,
    /// Median over the runs that succeeded.
    samples_per_s: Option<f64>,
    /// Slowest and fastest of those runs.
    samples_per_s_min: Option<f64>,
    samples_per_s_max: Option<f64>,
    /// Runs that succeeded.
    runs: usize,
    steps: Option<u64>,
    /// The first failing run's error.
    error: Option<String>,
}

impl TrainRow {
    /// The row of `case` from its runs' results.
    fn new(case: TrainCase, results: Vec<Result<TrainResult, String>>) -> Self {
        let mut rates = Vec::new();
        let mut steps = None;
        let mut error = None;
        for r in results {
            match r {
                Ok(r) => {
                    rates.push(r.samples_per_s);
                    steps = Some(r.steps);
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        let lo = rates.iter().copied().reduce(f64::min);
        let hi = rates.iter().copied().reduce(f64::max);
        TrainRow {
            case,
            samples_per_s: crate::stats::median(rates.iter().map(|&r| Some(r))),
            samples_per_s_min: lo,
            samples_per_s_max: hi,
            runs: rates.len(),
            steps,
            error,
        }
    }

    fn range(&self) -> Option<(f64, f64)> {
        self.samples_per_s_min.zip(self.samples_per_s_max)
    }
}

/// Where and how the suite ran.
#[derive(Debug, Clone, Serialize)]
struct Machine {
    hostname: String,
    kernel: String,
    cpu_model: String,
    cpus: usize,
    /// /proc/loadavg when the suite started (other load skews every figure).
    load_avg: String,
    client_core: Option<usize>,
    server_core: Option<usize>,
    polling: bool,
    build: &'static str,
    starwire_version: &'static str,
    generated_utc: String,
    quick: bool,
    repeat: usize,
}

/// report.json.
#[derive(Debug, Serialize)]
struct ReportJson<'a> {
    machine: &'a Machine,
    backends: Vec<&'static str>,
    /// Every bench result line, with bench's JSON field names.
    bench: &'a [ResultLine],
    /// `null` when this build has no train.
    train: Option<&'a [TrainRow]>,
    train_note: Option<&'static str>,
}

const NO_TRAIN: &str = "train not available in this build";
/// The train backend without a network (the compute bound).
const INPROC: &str = "inproc";

fn read_trim(p: &str) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `YYYY-MM-DD HH:MM:SS` in UTC (civil-from-days; no date crate needed for
/// one timestamp).
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn machine(args: &ReportArgs, cores: (Option<usize>, Option<usize>), polling: bool) -> Machine {
    Machine {
        hostname: read_trim("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown".into()),
        kernel: read_trim("/proc/sys/kernel/osrelease").unwrap_or_else(|| "unknown".into()),
        cpu_model: cpu_model(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        load_avg: read_trim("/proc/loadavg")
            .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|| "unknown".into()),
        client_core: cores.0,
        server_core: cores.1,
        polling,
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        starwire_version: env!("CARGO_PKG_VERSION"),
        generated_utc: utc_now(),
        quick: args.quick,
        repeat: args.repeat,
    }
}

/// The plans of the suite, in run order.
fn plans(args: &ReportArgs, backends: &[Backend], m: &Machine) -> Vec<Plan> {
    let base = |modes: Vec<Mode>, sizes: Vec<usize>, inflight: Option<usize>| Plan {
        backends: backends.to_vec(),
        modes,
        sizes,
        inflight,
        iters: args.quick.then_some(30),
        duration_s: (!args.quick).then_some(args.duration),
        warmup: Some(if args.quick { 3 } else { 200 }),
        warmup_s: None,
        tensors: if args.quick { 8 } else { FUSE_TENSORS },
        repeat: args.repeat,
        polling: m.polling,
        client_core: m.client_core,
        server_core: m.server_core,
        connections: 1,
        interval_s: None,
        bidirectional: false,
        cpu_util: false,
    };
    let (lat, inflight, bw): (&[usize], &[usize], &[usize]) = if args.quick {
        (&[64, 4096], &[1, 8], &[65536])
    } else {
        (LAT_SIZES, RATE_INFLIGHT, BW_SIZES)
    };
    let mut out = vec![base(vec![Mode::Lat], lat.to_vec(), None)];
    for &k in inflight {
        out.push(base(vec![Mode::Rate], vec![RATE_SIZE], Some(k)));
    }
    out.push(base(vec![Mode::Bw], bw.to_vec(), None));
    out.push(base(vec![Mode::Fuse], vec![FUSE_SIZE], None));
    out
}

/// The train cases: every backend that can train (not the raw baseline),
/// fusion on and off; then `inproc` (no network: the PS and worker work
/// alone, the bound any transport can reach on this machine), fused.
fn train_cases(backends: &[Backend], quick: bool) -> Vec<TrainCase> {
    let case = |backend, fusion| TrainCase {
        backend,
        fusion,
        model: "lr".into(),
        embedding_dim: 64,
        batch_size: 512,
        steps: if quick { 10 } else { TRAIN_STEPS },
    };
    let mut out = Vec::new();
    // Training does not run over the backends that need a device (verbs)
    // or EAL arguments (dpdk) in the report.
    for &b in backends
        .iter()
        .filter(|&&b| b.trains() && !b.needs_device())
    {
        for fusion in [true, false] {
            out.push(case(b.name(), fusion));
        }
    }
    if !out.is_empty() {
        out.push(case(INPROC, true));
    }
    out
}

/// Run `starwire report`. `train` is the train section's source, `None` in
/// a build without `starwire train`.
pub fn main(args: ReportArgs, train: Option<&dyn TrainSuite>) -> Result<(), String> {
    if !(args.duration > 0.0 && args.duration.is_finite()) {
        return Err(format!(
            "--duration {}: expected positive seconds",
            args.duration
        ));
    }
    // dpdk needs EAL arguments and a port, verbs a device: a report
    // includes them only when --backends names them.
    let backends = args.backends.clone().unwrap_or_else(|| {
        Backend::compiled()
            .into_iter()
            .filter(|b| b.data_over_tcp() && !b.needs_device())
            .collect()
    });
    if backends.is_empty() {
        return Err("--backends must not be empty".into());
    }
    if args.repeat == 0 {
        return Err("--repeat must be at least 1".into());
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("creating {}: {e}", args.out.display()))?;
    let polling = args.polling.unwrap_or(true);
    let cores = bench::choose_cores(args.cores, None)?;
    let m = machine(&args, cores, polling);
    let t0 = Instant::now();
    let plans = plans(&args, &backends, &m);
    // Checked before anything is sized by them (`--repeat` sizes the list
    // of runs).
    for p in &plans {
        p.check()?;
    }
    let runs = if args.quick {
        1
    } else {
        args.repeat.max(TRAIN_RUNS)
    };
    // A train run takes many bench runs' time: each part has progress of
    // its own, so that each ETA is at the pace of its own items.
    let mut progress = Progress::new("starwire report: bench", Unit::Items, bench_runs(&plans));
    let mut lines = Vec::new();
    for plan in &plans {
        lines.extend(bench::run_loopback(plan, &mut progress)?);
    }
    progress.finish();
    let train_rows = train.map(|suite| {
        let cases = train_cases(&backends, args.quick);
        let total = (cases.len() * runs) as u64;
        let mut progress = Progress::new("starwire report: train", Unit::Items, total);
        // Runs alternate between the cases, as the bench's repetitions
        // alternate between backends: a slow spell of the machine then
        // touches every case, not one.
        let mut results: Vec<Vec<Result<TrainResult, String>>> = vec![Vec::new(); cases.len()];
        for run in 0..runs {
            for (case, out) in cases.iter().zip(results.iter_mut()) {
                progress.begin(&format!(
                    "train {} fusion {} run {}/{runs}",
                    case.backend,
                    if case.fusion { "on" } else { "off" },
                    run + 1
                ));
                out.push(suite.run(case));
                progress.end();
            }
        }
        cases
            .into_iter()
            .zip(results)
            .map(|(case, r)| TrainRow::new(case, r))
            .collect::<Vec<_>>()
    });
    write_all(&args.out, &m, &backends, &lines, train_rows.as_deref())?;
    eprintln!(
        "starwire report: wrote {} in {:.1}s",
        args.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The items of the bench part's progress: every measured run of `plans`.
fn bench_runs(plans: &[Plan]) -> u64 {
    plans.iter().map(Plan::measured_runs).sum()
}

fn write_file(dir: &Path, name: &str, contents: &str) -> Result<(), String> {
    let p = dir.join(name);
    std::fs::write(&p, contents).map_err(|e| format!("writing {}: {e}", p.display()))
}

fn write_all(
    dir: &Path,
    m: &Machine,
    backends: &[Backend],
    lines: &[ResultLine],
    train: Option<&[TrainRow]>,
) -> Result<(), String> {
    let json = ReportJson {
        machine: m,
        backends: backends.iter().map(|b| b.name()).collect(),
        bench: lines,
        train,
        train_note: train.is_none().then_some(NO_TRAIN),
    };
    let s = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    write_file(dir, "report.json", &(s + "\n"))?;
    let mut plots = vec![
        ("latency.svg", plot::latency(lines, backends)?),
        ("rate.svg", plot::rate(lines, backends)?),
        ("bandwidth.svg", plot::bandwidth(lines, backends)?),
        ("fusion.svg", plot::fusion(lines, backends)?),
    ];
    if let Some(rows) = train {
        let bars: Vec<plot::Bar> = rows
            .iter()
            .filter_map(|r| {
                r.samples_per_s.map(|v| {
                    let fuse = if r.case.fusion { "fused" } else { "unfused" };
                    plot::Bar {
                        label: format!("{} {fuse}", r.case.backend),
                        backend: r.case.backend.to_owned(),
                        light: !r.case.fusion,
                        value: v,
                        spread: r.range().filter(|_| r.runs > 1),
                    }
                })
            })
            .collect();
        plots.push(("train.svg", plot::train(&bars)?));
    }
    for (name, svg) in &plots {
        write_file(dir, name, svg)?;
    }
    let md = markdown(m, backends, lines, train, &plots);
    write_file(dir, "report.md", &md)
}

#[cfg(test)]
mod tests {
    use super::markdown::*;
    use super::*;

    #[test]
    fn utc_timestamp_has_the_right_shape() {
        let s = utc_now();
        assert_eq!(s.len(), 19, "{s}");
        assert!(s.starts_with("20"), "{s}");
        assert_eq!(&s[4..5], "-");
        assert_eq!(&s[13..14], ":");
    }

    #[test]
    fn train_cases_skip_raw_and_cover_fusion_on_and_off() {
        let cases = train_cases(&[Backend::Raw, Backend::Tcp], false);
        assert_eq!(cases.len(), 3);
        assert!(cases[..2].iter().all(|c| c.backend == "tcp"));
        assert!(cases[..2].iter().any(|c| c.fusion) && cases[..2].iter().any(|c| !c.fusion));
        // The bound comes last, fused.
        assert_eq!((cases[2].backend, cases[2].fusion), (INPROC, true));
        assert!(train_cases(&[Backend::Raw], false).is_empty());
        assert_eq!((cases[0].embedding_dim, cases[0].batch_size), (64, 512));
    }

    #[test]
    fn bench_progress_counts_every_measured_run() {
        let args = ReportArgs {
            out: PathBuf::from("unused"),
            quick: true,
            backends: None,
            duration: 0.5,
            repeat: 1,
            polling: None,
            cores: None,
        };
        let backends = [Backend::Raw, Backend::Tcp];
        let plans = plans(&args, &backends, &machine(&args, (None, None), true));
        // lat at 2 sizes, rate at 2 in-flight counts, bw at 1 size: two
        // backends each; fuse: tcp only (the raw baseline has none).
        assert_eq!(bench_runs(&plans), 2 * 2 + 2 * 2 + 2 + 1);
    }

    #[test]
    fn ratios_and_sizes_format() {
        assert_eq!(ratio(Some(10.0), Some(2.0)), "5.00×");
        assert_eq!(ratio(Some(1.0), None), "–");
        assert_eq!(ratio(Some(1.0), Some(0.0)), "–");
        assert_eq!(human_size(1 << 20), "1 MiB");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(100), "100 B");
    }

    /// A stand-in train source, to check that the section is written from
    /// what the source returns (errors included).
    struct Fixed;
    impl TrainSuite for Fixed {
        fn run(&self, case: &TrainCase) -> Result<TrainResult, String> {
            if case.fusion {
                Ok(TrainResult {
                    samples_per_s: 1000.0,
                    steps: case.steps,
                })
            } else {
                Err("boom".into())
            }
        }
    }

    #[test]
    fn train_section_comes_from_the_suite() {
        let dir = tempfile::tempdir().unwrap();
        let args = ReportArgs {
            out: dir.path().to_owned(),
            quick: true,
            backends: Some(vec![Backend::Tcp]),
            duration: 0.5,
            repeat: 1,
            polling: Some(false),
            cores: None,
        };
        main(args, Some(&Fixed)).unwrap();
        let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
        assert!(md.contains("| tcp | on | 10 | 1 | 1000.0 |"), "{md}");
        assert!(md.contains("boom"), "{md}");
        assert!(!md.contains(NO_TRAIN), "{md}");
        let svg = std::fs::read_to_string(dir.path().join("train.svg")).unwrap();
        assert!(svg.contains("<svg") && svg.contains("tcp fused"), "{svg}");
        for plot in ["latency.svg", "rate.svg", "bandwidth.svg", "fusion.svg"] {
            let svg = std::fs::read_to_string(dir.path().join(plot)).unwrap();
            assert!(svg.contains("<svg"), "{plot}");
            assert!(md.contains(&format!("]({plot})")), "{plot} in {md}");
        }
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
                .unwrap();
        assert_eq!(json["train"][0]["samples_per_s"], 1000.0);
        assert_eq!(json["train"][1]["error"], "boom");
        assert_eq!(json["train"][0]["runs"], 1);
    }

    fn row(backend: &'static str, fusion: bool, rates: &[f64]) -> TrainRow {
        let case = TrainCase {
            backend,
            fusion,
            model: "lr".into(),
            embedding_dim: 64,
            batch_size: 512,
            steps: 1000,
        };
        let results = rates
            .iter()
            .map(|&r| {
                Ok(TrainResult {
                    samples_per_s: r,
                    steps: 1000,
                })
            })
            .collect();
        TrainRow::new(case, results)
    }

    #[test]
    fn train_rows_keep_the_median_and_range_of_their_runs() {
        let r = row("tcp", true, &[300.0, 100.0, 200.0]);
        assert_eq!(r.samples_per_s, Some(200.0));
        assert_eq!(r.range(), Some((100.0, 300.0)));
        assert_eq!(r.runs, 3);
        let mixed = TrainRow::new(
            r.case.clone(),
            vec![
                Err("down".into()),
                Ok(TrainResult {
                    samples_per_s: 5.0,
                    steps: 1,
                }),
            ],
        );
        assert_eq!((mixed.runs, mixed.samples_per_s), (1, Some(5.0)));
        assert_eq!(mixed.error.as_deref(), Some("down"));
    }

    #[test]
    fn fusion_notes_say_faster_slower_or_within_the_range() {
        let notes = fusion_notes(&[
            row("tcp", true, &[90.0, 100.0, 110.0]),
            row("tcp", false, &[105.0, 120.0, 130.0]),
            row("uring", true, &[200.0, 210.0, 220.0]),
            row("uring", false, &[100.0, 110.0, 120.0]),
            row("grpc", true, &[50.0, 51.0, 52.0]),
            row("grpc", false, &[80.0, 81.0, 82.0]),
        ]);
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(
            notes[0].starts_with("tcp: fused and unfused overlap"),
            "{notes:?}"
        );
        assert!(
            notes[1].starts_with("uring: fusion faster, 1.91×"),
            "{notes:?}"
        );
        assert!(
            notes[2].starts_with("grpc: fusion slower, 0.63×"),
            "{notes:?}"
        );
    }
}

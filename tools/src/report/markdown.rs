//! The report's Markdown: one table per figure, each cell with its range
//! and its ratio to `raw` and to `grpc`, and the notes on fusion.

use std::fmt::Write as _;

use super::*;

pub(super) fn find(
    lines: &[ResultLine],
    b: Backend,
    mode: Mode,
    size: usize,
    inflight: Option<usize>,
) -> Option<&ResultLine> {
    lines.iter().find(|l| {
        l.backend == b
            && l.mode == mode
            && l.size == size
            && inflight.map_or(true, |k| l.inflight == k)
    })
}

pub(super) fn fmt_num(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(x) if x >= 10_000.0 => format!("{x:.0}"),
        Some(x) if x >= 100.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.3}"),
    }
}

pub(super) fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

pub(super) fn human_size(s: usize) -> String {
    match s {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// A table of one metric of one mode: one row per size (per in-flight
/// count for rate), per backend the metric, then the ratio of every other
/// backend to `raw` and to `grpc` (when those are present).
fn table(
    out: &mut String,
    backends: &[Backend],
    lines: &[ResultLine],
    mode: Mode,
    metric: fn(&ResultLine) -> Option<f64>,
    unit: &str,
) {
    let by_inflight = mode == Mode::Rate;
    let key_name = if by_inflight { "in flight" } else { "size" };
    let keys = keys_of(lines, mode, by_inflight);
    let bases: Vec<Backend> = backends
        .iter()
        .copied()
        .filter(|b| matches!(b.name(), "raw" | "grpc"))
        .collect();
    let mut head = format!("| {key_name} |");
    let mut rule = String::from("|---|");
    for b in backends {
        let _ = write!(head, " {b} {unit} |");
        rule.push_str("---:|");
    }
    for base in &bases {
        for b in backends.iter().filter(|b| *b != base && b.name() != "raw") {
            let _ = write!(head, " {b} ÷ {base} |");
            rule.push_str("---:|");
        }
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for (label, size, inflight) in &keys {
        let v = |b: Backend| find(lines, b, mode, *size, *inflight).and_then(metric);
        let mut row = format!("| {label} |");
        for &b in backends {
            let _ = write!(row, " {} |", fmt_num(v(b)));
        }
        for &base in &bases {
            for &b in backends.iter().filter(|b| **b != base && b.name() != "raw") {
                let _ = write!(row, " {} |", ratio(v(b), v(base)));
            }
        }
        let _ = writeln!(out, "{row}");
    }
    out.push('\n');
}

pub(super) fn keys_of(
    lines: &[ResultLine],
    mode: Mode,
    by_inflight: bool,
) -> Vec<(String, usize, Option<usize>)> {
    let mut keys: Vec<(String, usize, Option<usize>)> = Vec::new();
    for l in lines.iter().filter(|l| l.mode == mode) {
        let k = if by_inflight {
            (l.inflight.to_string(), l.size, Some(l.inflight))
        } else {
            (human_size(l.size), l.size, None)
        };
        if !keys.iter().any(|(_, s, i)| (*s, *i) == (k.1, k.2)) {
            keys.push(k);
        }
    }
    keys
}

pub(super) fn markdown(
    m: &Machine,
    backends: &[Backend],
    lines: &[ResultLine],
    train: Option<&[TrainRow]>,
    plots: &[(&str, String)],
) -> String {
    let mut o = String::new();
    let names: Vec<&str> = backends.iter().map(|b| b.name()).collect();
    let _ = writeln!(o, "# starwire report\n");
    let _ = writeln!(
        o,
        "Generated {} UTC by `starwire report` {} ({} build{}); backends: {}. \
         Every figure below was measured in this one run; report.json has them all.\n",
        m.generated_utc,
        m.starwire_version,
        m.build,
        if m.quick {
            ", --quick: not for figures"
        } else {
            ""
        },
        names.join(", ")
    );
    let placement = match (m.client_core, m.server_core) {
        (Some(c), Some(s)) => format!(
            "client on core {c}, server on core {s} (raw and tcp pinned; grpc pins its \
             calling thread, its two 2-worker tokio runtimes float)"
        ),
        _ => "unpinned (one usable CPU)".into(),
    };
    let _ = writeln!(o, "| machine | |\n|---|---|");
    let _ = writeln!(o, "| host | {} |", m.hostname);
    let _ = writeln!(o, "| kernel | {} |", m.kernel);
    let _ = writeln!(o, "| CPU | {} ({} CPUs) |", m.cpu_model, m.cpus);
    let _ = writeln!(o, "| load average at start | {} |", m.load_avg);
    let _ = writeln!(
        o,
        "| repetitions | {} (backends alternate; medians shown) |",
        m.repeat
    );
    let _ = writeln!(o, "| placement | {placement} |");
    let _ = writeln!(
        o,
        "| polling | {} |\n",
        if m.polling {
            "on (busy-polling reactors, non-blocking raw sockets)"
        } else {
            "off (parking reactors, blocking raw sockets)"
        }
    );
    let load1: f64 = m
        .load_avg
        .split_whitespace()
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0.0);
    if load1 >= 0.5 * m.cpus as f64 {
        let _ = writeln!(
            o,
            "**Note:** the machine was busy when the suite started (1-minute load \
             {load1:.2} on {} CPUs). Busy-polling backends pinned to two cores stall \
             whenever another process takes one of those cores, so raw and tcp lose \
             most when the machine is shared; gRPC's blocking threads lose less.\n",
            m.cpus
        );
    }
    let _ = writeln!(
        o,
        "Ratios: `X ÷ raw` and `X ÷ grpc` divide X's figure by the baseline's. For \
         latency lower is better (0.20× = five times faster); for rates and \
         bandwidth higher is better. The raw baseline is plain sockets with no \
         starwire code; grpc is the tonic baseline (docs/backends/grpc.md).\n"
    );

    let _ = writeln!(
        o,
        "## Latency (ping-pong, one outstanding): p50 round trip\n"
    );
    let _ = writeln!(
        o,
        "Round trips, not halves: perftest's `*_lat` tools report half a round \
         trip. The percentiles are over every repetition's round trips merged.\n"
    );
    table(&mut o, backends, lines, Mode::Lat, |l| l.p50_us, "µs");
    let _ = writeln!(o, "p99 round trip:\n");
    table(&mut o, backends, lines, Mode::Lat, |l| l.p99_us, "µs");
    if plots.iter().any(|(n, _)| *n == "latency.svg") {
        let _ = writeln!(
            o,
            "![latency against size: p50 solid, p99 dashed](latency.svg)\n"
        );
    }

    let size = keys_of(lines, Mode::Rate, true).first().map_or(0, |k| k.1);
    let _ = writeln!(
        o,
        "## Message rate ({} requests, each acked empty) against requests in flight\n",
        human_size(size)
    );
    table(
        &mut o,
        backends,
        lines,
        Mode::Rate,
        |l| l.msgs_per_s,
        "msgs/s",
    );
    let _ = writeln!(o, "![rate against in-flight](rate.svg)\n");

    let _ = writeln!(o, "## Bandwidth (one-way stream, 8 in flight, acked)\n");
    table(&mut o, backends, lines, Mode::Bw, |l| l.gbps, "Gb/s");
    let _ = writeln!(o, "![bandwidth against size](bandwidth.svg)\n");

    let _ = writeln!(o, "## Fusion (steps of N tensors to one peer)\n");
    let _ = writeln!(
        o,
        "Fused: each step's tensors travel as one `Tensors` message; unfused: one \
         message (for grpc one RPC) per tensor.\n"
    );
    let _ = writeln!(
        o,
        "| backend | tensors × bytes | fused steps/s | unfused steps/s | fused ÷ unfused |\n|---|---|---:|---:|---:|"
    );
    for l in lines.iter().filter(|l| l.mode == Mode::Fuse) {
        let _ = writeln!(
            o,
            "| {} | {} × {} | {} | {} | {} |",
            l.backend,
            l.tensors.unwrap_or(0),
            human_size(l.size),
            fmt_num(l.fused_steps_per_s),
            fmt_num(l.unfused_steps_per_s),
            ratio(l.fused_steps_per_s, l.unfused_steps_per_s)
        );
    }
    o.push('\n');
    let _ = writeln!(o, "![fused and unfused steps/s](fusion.svg)\n");

    let _ = writeln!(
        o,
        "## Train (comm-bound: `--model lr --embedding-dim 64 --batch-size 512`)\n"
    );
    match train {
        None => {
            let _ = writeln!(
                o,
                "**{NO_TRAIN}**: this binary has no `starwire train` connected to the \
                 report, so there are no train figures (and no train plot).\n"
            );
        }
        Some(rows) => {
            let grpc_off = rows
                .iter()
                .find(|r| r.case.backend == "grpc" && !r.case.fusion)
                .and_then(|r| r.samples_per_s);
            let bound = rows
                .iter()
                .find(|r| r.case.backend == INPROC)
                .and_then(|r| r.samples_per_s);
            let times = match rows.iter().map(|r| r.runs).max().unwrap_or(0) {
                1 => "once".to_owned(),
                n => format!("{n} times"),
            };
            let _ = writeln!(
                o,
                "Each case runs {times}, the cases taking turns; samples/s is the median, \
                 the range the slowest and fastest run.\n"
            );
            let _ = writeln!(
                o,
                "| backend | fusion | steps | runs | samples/s | range | ÷ grpc unfused (stock TF) | ÷ inproc (no network) | error |\n|---|---|---:|---:|---:|---|---:|---:|---|"
            );
            for r in rows {
                let range = match r.range() {
                    Some((lo, hi)) if r.runs > 1 => {
                        format!("{} – {}", fmt_num(Some(lo)), fmt_num(Some(hi)))
                    }
                    _ => "–".into(),
                };
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {range} | {} | {} | {} |",
                    r.case.backend,
                    if r.case.fusion { "on" } else { "off" },
                    r.steps.map_or("–".into(), |s| s.to_string()),
                    r.runs,
                    fmt_num(r.samples_per_s),
                    ratio(r.samples_per_s, grpc_off),
                    ratio(r.samples_per_s, bound),
                    r.error.as_deref().unwrap_or("")
                );
            }
            o.push('\n');
            for note in fusion_notes(rows) {
                let _ = writeln!(o, "- {note}");
            }
            let _ = writeln!(o, "\n![train samples/s per backend](train.svg)\n");
        }
    }
    let _ = writeln!(
        o,
        "Reproduce: `starwire report --out DIR` (a release build: `cargo run --release \
         --features grpc -- report --out DIR`)."
    );
    o
}

/// What the train rows say about fusion, per backend with both settings:
/// whether fused was faster, slower, or within the runs' range of unfused.
pub(super) fn fusion_notes(rows: &[TrainRow]) -> Vec<String> {
    let mut out = Vec::new();
    for on in rows.iter().filter(|r| r.case.fusion) {
        let Some(off) = rows
            .iter()
            .find(|r| !r.case.fusion && r.case.backend == on.case.backend)
        else {
            continue;
        };
        let (Some(a), Some(b), Some((a_lo, a_hi)), Some((b_lo, b_hi))) =
            (on.samples_per_s, off.samples_per_s, on.range(), off.range())
        else {
            continue;
        };
        let name = on.case.backend;
        let overlap = a_lo <= b_hi && b_lo <= a_hi;
        out.push(if overlap && on.runs > 1 && off.runs > 1 {
            format!(
                "{name}: fused and unfused overlap over their runs ({} and {} \
                 samples/s): no difference measured",
                fmt_num(Some(a)),
                fmt_num(Some(b))
            )
        } else {
            let basis = if on.runs > 1 && off.runs > 1 {
                "beyond the range of the runs"
            } else {
                "from one run each"
            };
            let how = if a >= b { "faster" } else { "slower" };
            format!("{name}: fusion {how}, {}, {basis}", ratio(Some(a), Some(b)))
        });
    }
    out
}

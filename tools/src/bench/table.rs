//! The perftest-style table of `starwire bench`: one line per result,
//! round-trip columns named `rtt_*` (a perftest `*_lat` user reads halves:
//! `1way_p50` is one), optional columns only when a line has them.

use std::fmt::Write as _;

use super::{Mode, Plan, ResultLine};

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(x) => format!("{x:.prec$}"),
        None => "-".to_owned(),
    }
}

/// The table's columns after `inflight`, for lat, rate and bw lines.
const LAT_COLUMNS: [&str; 9] = [
    "rtt_min",
    "rtt_p50",
    "rtt_avg",
    "rtt_stdev",
    "rtt_p99",
    "rtt_p99.9",
    "rtt_p99.99",
    "rtt_max",
    "1way_p50",
];

/// Print `lines` as the table (what `bench` prints without `--json`).
pub(super) fn print(plan: &Plan, lines: &[ResultLine]) {
    print!("{}", render(plan, lines));
}

/// The header's placement: the client core of the plan, and the server
/// core(s) the lines report (the server's own, which a `--listen` host's
/// `--cores` sets), naming the backends whose server end is not pinned.
fn placement(plan: &Plan, lines: &[ResultLine]) -> String {
    // Before any line (nothing ran), the plan's.
    let mut cores: Vec<usize> = lines.iter().filter_map(|l| l.server_core).collect();
    if lines.is_empty() {
        cores.extend(plan.server_core);
    }
    cores.sort_unstable();
    cores.dedup();
    let mut floating: Vec<&str> = Vec::new();
    for l in lines.iter().filter(|l| l.server_core.is_none()) {
        if !floating.contains(&l.backend.name()) {
            floating.push(l.backend.name());
        }
    }
    let server = match (cores.is_empty(), floating.is_empty()) {
        (true, _) => None,
        (false, true) => Some(format!("server core {}", join(&cores))),
        (false, false) => Some(format!(
            "server core {} ({} unpinned)",
            join(&cores),
            floating.join(", ")
        )),
    };
    match (plan.client_core, server) {
        (Some(c), Some(s)) => format!("client core {c}, {s}"),
        (Some(c), None) => format!("client core {c}, server unpinned"),
        (None, Some(s)) => format!("client unpinned, {s}"),
        (None, None) => "unpinned".to_owned(),
    }
}

fn join(cores: &[usize]) -> String {
    let all: Vec<String> = cores.iter().map(usize::to_string).collect();
    all.join("/")
}

/// The table of `lines`, every line ending in a newline.
pub(super) fn render(plan: &Plan, lines: &[ResultLine]) -> String {
    let mut out = String::new();
    let cores = placement(plan, lines);
    let sys = lines.iter().any(|l| l.syscalls_per_msg.is_some());
    let cpu = lines.iter().any(|l| l.cpu_pct.is_some());
    let srv_cpu = lines.iter().any(|l| l.server_cpu_pct.is_some());
    let pkts = lines
        .iter()
        .any(|l| l.pps.is_some() || l.retransmits.is_some());
    let mut head = format!(
        " {:<7} {:<5} {:>9} {:>8} {:>8}",
        "backend", "mode", "#bytes", "#iters", "inflight"
    );
    for c in LAT_COLUMNS {
        head.push_str(&format!(" {:>14}", format!("{c}[us]")));
    }
    head.push_str(&format!(" {:>12} {:>8}", "msgs/s", "Gb/s"));
    if sys {
        head.push_str(&format!(" {:>8}", "sys/msg"));
    }
    if cpu {
        head.push_str(&format!(" {:>6}", "cpu%"));
    }
    if srv_cpu {
        head.push_str(&format!(" {:>8}", "srv_cpu%"));
    }
    if pkts {
        head.push_str(&format!(
            " {:>10} {:>9} {:>7} {:>10}",
            "pkts/s", "pkt/frame", "rexmit", "cpu_us/msg"
        ));
    }
    let rule = "-".repeat(head.len());
    out.push_str(&format!("{rule}\n"));
    let conns = match plan.connections {
        0 | 1 => String::new(),
        n => format!("   {n} connections (inflight is per connection)"),
    };
    let bidi = if plan.bidirectional {
        "   bidirectional (rate and bw echoed; Gb/s both ways)"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        " starwire bench   polling {}   {cores}   repeat {} (median){conns}{bidi}",
        if plan.polling { "on" } else { "off" },
        plan.repeat.max(1)
    );
    let _ = writeln!(
        out,
        " rtt_* are round trips in us, merged over repetitions; 1way_p50 = rtt_p50 / 2 \
         of lat (a ping-pong; what perftest's *_lat report), - for rate{}",
        if cpu && !srv_cpu {
            "; cpu% is the whole process (over loopback both ends)"
        } else {
            ""
        }
    );
    out.push_str(&format!("{rule}\n"));
    out.push_str(&format!("{head}\n"));
    for l in lines {
        if l.mode == Mode::Fuse {
            let ratio = match (l.fused_steps_per_s, l.unfused_steps_per_s) {
                (Some(f), Some(u)) if u > 0.0 => format!("{:.1}x", f / u),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                " {:<7} {:<5} {:>9} {:>8} {:>8}   tensors/step {}   fused steps/s {}   \
                 unfused steps/s {}   fused/unfused {ratio}",
                l.backend.name(),
                l.mode.name(),
                l.size,
                l.iters,
                l.inflight,
                l.tensors.unwrap_or(0),
                fmt_opt(l.fused_steps_per_s, 1),
                fmt_opt(l.unfused_steps_per_s, 1),
            );
            continue;
        }
        let mut row = format!(
            " {:<7} {:<5} {:>9} {:>8} {:>8}",
            l.backend.name(),
            l.mode.name(),
            l.size,
            l.iters,
            l.inflight
        );
        for v in [
            l.min_us,
            l.p50_us,
            l.avg_us,
            l.stdev_us,
            l.p99_us,
            l.p999_us,
            l.p9999_us,
            l.max_us,
            // Only a ping-pong has a one-way latency: a rate round trip
            // is a request and an empty ack under load.
            l.p50_us.filter(|_| l.mode == Mode::Lat).map(|p| p / 2.0),
        ] {
            row.push_str(&format!(" {:>14}", fmt_opt(v, 2)));
        }
        row.push_str(&format!(
            " {:>12} {:>8}",
            fmt_opt(l.msgs_per_s, 0),
            fmt_opt(l.gbps, 3)
        ));
        if sys {
            row.push_str(&format!(" {:>8}", fmt_opt(l.syscalls_per_msg, 3)));
        }
        if cpu {
            row.push_str(&format!(" {:>6}", fmt_opt(l.cpu_pct, 1)));
        }
        if srv_cpu {
            row.push_str(&format!(" {:>8}", fmt_opt(l.server_cpu_pct, 1)));
        }
        if pkts {
            row.push_str(&format!(
                " {:>10} {:>9} {:>7} {:>10}",
                fmt_opt(l.pps, 0),
                fmt_opt(l.packets_per_frame, 2),
                l.retransmits.map_or("-".to_owned(), |r| r.to_string()),
                fmt_opt(l.cpu_us_per_msg, 2)
            ));
        }
        out.push_str(&format!("{row}\n"));
    }
    out.push_str(&format!("{rule}\n"));
    for l in lines {
        if let (Some(z), Some(c)) = (l.zc_sends, l.zc_copied) {
            if z > 0 {
                let _ = writeln!(
                    out,
                    " {} {} {} B: {z} zero-copy sends, {c} reported copied by the kernel \
                     (the connection then sends plainly; loopback always copies)",
                    l.backend.name(),
                    l.mode.name(),
                    l.size
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::hist::Rtts;
    use super::super::{result_line, Measured};
    use super::*;
    use crate::backend::Backend;

    fn plan(backends: Vec<Backend>, modes: Vec<Mode>) -> Plan {
        Plan {
            backends,
            modes,
            sizes: vec![64],
            inflight: None,
            iters: Some(10),
            duration_s: None,
            warmup: Some(1),
            tensors: 4,
            repeat: 1,
            polling: true,
            client_core: Some(0),
            server_core: Some(1),
            connections: 1,
            interval_s: None,
            bidirectional: false,
            cpu_util: false,
        }
    }

    /// A line of every run of `p`, each of ten 100 µs round trips.
    fn lines(p: &Plan) -> Vec<ResultLine> {
        let mut rtts = Rtts::new();
        for _ in 0..10 {
            rtts.record(100_000);
        }
        let m = Measured {
            iters: 10,
            elapsed: Duration::from_millis(1),
            rtts,
            ..Measured::default()
        };
        p.runs().iter().map(|r| result_line(p, r, &m)).collect()
    }

    /// The cell of `column` in the row of `mode`.
    fn cell(table: &str, mode: &str, column: &str) -> String {
        let head: Vec<&str> = table
            .lines()
            .find(|l| l.starts_with(" backend "))
            .expect("the column header")
            .split_whitespace()
            .collect();
        let at = head
            .iter()
            .position(|c| *c == column)
            .unwrap_or_else(|| panic!("no column {column} in {head:?}"));
        let row = table
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(mode))
            .unwrap_or_else(|| panic!("no {mode} row in\n{table}"));
        row.split_whitespace().nth(at).expect("a cell").to_owned()
    }

    #[test]
    fn the_one_way_latency_is_half_the_p50_of_lat_and_absent_for_rate() {
        let p = plan(vec![Backend::Tcp], vec![Mode::Lat, Mode::Rate]);
        let table = render(&p, &lines(&p));
        let half: f64 = cell(&table, "lat", "1way_p50[us]").parse().unwrap();
        // The histogram keeps 3 significant digits.
        assert!((half - 50.0).abs() <= 0.1, "{table}");
        assert_eq!(cell(&table, "rate", "1way_p50[us]"), "-", "{table}");
        // Rate keeps its round trips.
        let p50: f64 = cell(&table, "rate", "rtt_p50[us]").parse().unwrap();
        assert!((p50 - 100.0).abs() <= 0.2, "{table}");
    }

    #[test]
    fn the_header_names_the_server_core_the_lines_report() {
        let p = plan(vec![Backend::Raw, Backend::Tcp], vec![Mode::Lat]);
        let mut ls = lines(&p);
        assert!(render(&p, &ls).contains("client core 0, server core 1   "));
        // A --listen host that pinned to its own core 3.
        for l in &mut ls {
            l.server_core = Some(3);
        }
        let table = render(&p, &ls);
        assert!(table.contains("client core 0, server core 3   "), "{table}");
        // A backend whose server end floats is named.
        ls[0].server_core = None;
        let table = render(&p, &ls);
        assert!(
            table.contains("client core 0, server core 3 (raw unpinned)   "),
            "{table}"
        );
    }
}

//! The perftest-style table of `starwire bench`: one line per result,
//! round-trip columns named `rtt_*` (a perftest `*_lat` user reads halves:
//! `1way_p50` is one), optional columns only where the plan makes them.
//!
//! Rows are printed as results come ([`Table`]), so the columns are chosen
//! from the plan before the first one, and the header names the server
//! cores its `ready` messages reported.

use std::fmt::Write as _;

use super::{Mode, Plan, ResultLine};
use crate::backend::Backend;

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

/// Whether a backend's lines have `syscalls_per_msg`: the starwire
/// backends count theirs, the baselines do not.
fn counts_syscalls(b: Backend) -> bool {
    match b {
        Backend::Raw => false,
        #[cfg(feature = "grpc")]
        Backend::Grpc => false,
        _ => true,
    }
}

/// The optional columns, chosen from the plan before any line exists.
#[derive(Debug, Clone, Copy)]
struct Columns {
    /// `sys/msg`: a starwire backend is measured.
    sys: bool,
    /// `cpu%`: `--cpu-util`.
    cpu: bool,
    /// `srv_cpu%`: `--cpu-util` against a server in another process.
    srv_cpu: bool,
    /// The packet columns: a datagram backend (dpdk) is measured.
    pkts: bool,
}

impl Columns {
    fn of(plan: &Plan, remote: bool) -> Self {
        Self {
            sys: plan.backends.iter().any(|&b| counts_syscalls(b)),
            cpu: plan.cpu_util,
            srv_cpu: plan.cpu_util && remote,
            pkts: plan.backends.iter().any(|b| !b.data_over_tcp()),
        }
    }
}

/// The table of one bench, printed as it goes: each method returns the
/// text to print now. Rows wait for the header, and the header for the
/// `ready` of every backend of the first (mode, size), so that it names
/// each server core (a `--listen` host's own `--cores` decides them).
#[derive(Debug)]
pub(super) struct Table {
    plan: Plan,
    cols: Columns,
    /// The backends whose `ready` the header waits for.
    awaited: Vec<Backend>,
    /// Each backend's server core, from its first `ready`.
    servers: Vec<(Backend, Option<usize>)>,
    /// Rows that came before the header could be printed.
    held: Vec<ResultLine>,
    header_done: bool,
    /// Whether a row was made (printed or held).
    rows: bool,
    /// The notes printed under the table (offered rates, zero copy).
    notes: String,
}

impl Table {
    /// The table of `plan`; `remote`: the server is another process
    /// (`--connect`), which reports its own CPU use.
    pub(super) fn new(plan: &Plan, remote: bool) -> Self {
        let runs = plan.runs();
        let first = runs.iter().find(|r| !r.skipped()).map(|r| (r.mode, r.size));
        let mut awaited = Vec::new();
        for r in runs
            .iter()
            .filter(|r| !r.skipped() && Some((r.mode, r.size)) == first)
        {
            if !awaited.contains(&r.backend) {
                awaited.push(r.backend);
            }
        }
        Self {
            plan: plan.clone(),
            cols: Columns::of(plan, remote),
            awaited,
            servers: Vec::new(),
            held: Vec::new(),
            header_done: false,
            rows: false,
            notes: String::new(),
        }
    }

    /// A run of `backend` starts, its server end on `server_core`.
    pub(super) fn ready(&mut self, backend: Backend, server_core: Option<usize>) -> String {
        if !self.servers.iter().any(|(b, _)| *b == backend) {
            self.servers.push((backend, server_core));
        }
        let known = self
            .awaited
            .iter()
            .all(|a| self.servers.iter().any(|(b, _)| b == a));
        if self.header_done || !known {
            return String::new();
        }
        // Every server core is known: the header, and the rows it held.
        let mut out = self.header();
        for l in std::mem::take(&mut self.held) {
            out.push_str(&self.row_text(&l));
        }
        out
    }

    /// The row of `line`, once the header is out.
    pub(super) fn row(&mut self, line: &ResultLine) -> String {
        self.rows = true;
        self.note(line);
        if !self.header_done {
            self.held.push(line.clone());
            return String::new();
        }
        self.row_text(line)
    }

    /// Whether any row was made: a bench that failed before its first
    /// result prints no table.
    pub(super) fn has_rows(&self) -> bool {
        self.rows
    }

    /// The end of the table: the header and rows still held (a bench that
    /// ended before every backend reported), the closing rule and the
    /// notes, which sum up every row.
    pub(super) fn finish(&mut self) -> String {
        let mut out = String::new();
        if !self.header_done {
            out.push_str(&self.header());
        }
        for l in std::mem::take(&mut self.held) {
            out.push_str(&self.row_text(&l));
        }
        let _ = writeln!(out, "{}", self.rule());
        out.push_str(&std::mem::take(&mut self.notes));
        out
    }

    /// The column header line.
    fn head(&self) -> String {
        let cols = self.cols;
        let mut head = format!(
            " {:<7} {:<5} {:>9} {:>8} {:>8}",
            "backend", "mode", "#bytes", "#iters", "inflight"
        );
        for c in LAT_COLUMNS {
            let _ = write!(head, " {:>14}", format!("{c}[us]"));
        }
        let _ = write!(head, " {:>12} {:>8}", "msgs/s", "Gb/s");
        if cols.sys {
            let _ = write!(head, " {:>8}", "sys/msg");
        }
        if cols.cpu {
            let _ = write!(head, " {:>6}", "cpu%");
        }
        if cols.srv_cpu {
            let _ = write!(head, " {:>8}", "srv_cpu%");
        }
        if cols.pkts {
            let _ = write!(
                head,
                " {:>10} {:>9} {:>7} {:>10}",
                "pkts/s", "pkt/frame", "rexmit", "cpu_us/msg"
            );
        }
        head
    }

    fn rule(&self) -> String {
        "-".repeat(self.head().len())
    }

    fn header(&mut self) -> String {
        self.header_done = true;
        let plan = &self.plan;
        let cols = self.cols;
        let mut out = String::new();
        let rule = self.rule();
        let _ = writeln!(out, "{rule}");
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
            " starwire bench   polling {}   {}   repeat {} (median){conns}{bidi}",
            if plan.polling { "on" } else { "off" },
            placement(plan, &self.servers),
            plan.repeat.max(1)
        );
        let _ = writeln!(
            out,
            " rtt_* are round trips in us, merged over repetitions; 1way_p50 = rtt_p50 / 2 \
             of lat (a ping-pong; what perftest's *_lat report), - for rate{}",
            if cols.cpu && !cols.srv_cpu {
                "; cpu% is the whole process (over loopback both ends)"
            } else {
                ""
            }
        );
        let _ = writeln!(out, "{rule}");
        let _ = writeln!(out, "{}", self.head());
        out
    }

    /// Keep the notes of `l`: its offered rate (`--rate`), and its
    /// zero-copy sends, if it tried zero copy.
    fn note(&mut self, l: &ResultLine) {
        if let Some(r) = l.offered_rate {
            let _ = writeln!(
                self.notes,
                " {} {} {} B: open loop, {r} msgs/s offered ({} achieved); rtt_* count from \
                 when each request was due",
                l.backend.name(),
                l.mode.name(),
                l.size,
                fmt_opt(l.msgs_per_s, 0)
            );
        }
        if let (Some(z), Some(c)) = (l.zc_sends, l.zc_copied) {
            if z > 0 {
                let _ = writeln!(
                    self.notes,
                    " {} {} {} B: {z} zero-copy sends, {c} reported copied by the kernel \
                     (the connection then sends plainly; loopback always copies)",
                    l.backend.name(),
                    l.mode.name(),
                    l.size
                );
            }
        }
    }

    fn row_text(&self, l: &ResultLine) -> String {
        let cols = self.cols;
        if l.mode == Mode::Fuse {
            let ratio = match (l.fused_steps_per_s, l.unfused_steps_per_s) {
                (Some(f), Some(u)) if u > 0.0 => format!("{:.1}x", f / u),
                _ => "-".to_owned(),
            };
            return format!(
                " {:<7} {:<5} {:>9} {:>8} {:>8}   tensors/step {}   fused steps/s {}   \
                 unfused steps/s {}   fused/unfused {ratio}\n",
                l.backend.name(),
                l.mode.name(),
                l.size,
                l.iters,
                l.inflight,
                l.tensors.unwrap_or(0),
                fmt_opt(l.fused_steps_per_s, 1),
                fmt_opt(l.unfused_steps_per_s, 1),
            );
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
            let _ = write!(row, " {:>14}", fmt_opt(v, 2));
        }
        let _ = write!(
            row,
            " {:>12} {:>8}",
            fmt_opt(l.msgs_per_s, 0),
            fmt_opt(l.gbps, 3)
        );
        if cols.sys {
            let _ = write!(row, " {:>8}", fmt_opt(l.syscalls_per_msg, 3));
        }
        if cols.cpu {
            let _ = write!(row, " {:>6}", fmt_opt(l.cpu_pct, 1));
        }
        if cols.srv_cpu {
            let _ = write!(row, " {:>8}", fmt_opt(l.server_cpu_pct, 1));
        }
        if cols.pkts {
            let _ = write!(
                row,
                " {:>10} {:>9} {:>7} {:>10}",
                fmt_opt(l.pps, 0),
                fmt_opt(l.packets_per_frame, 2),
                l.retransmits.map_or("-".to_owned(), |r| r.to_string()),
                fmt_opt(l.cpu_us_per_msg, 2)
            );
        }
        row.push('\n');
        row
    }
}

/// The header's placement: the client core of the plan, and the server
/// core(s) the `ready` messages reported (the server's own, which a
/// `--listen` host's `--cores` sets), naming the backends whose server end
/// is not pinned.
fn placement(plan: &Plan, servers: &[(Backend, Option<usize>)]) -> String {
    // Before any run (nothing ran), the plan's.
    let mut cores: Vec<usize> = servers.iter().filter_map(|s| s.1).collect();
    if servers.is_empty() {
        cores.extend(plan.server_core);
    }
    cores.sort_unstable();
    cores.dedup();
    let mut floating: Vec<&str> = Vec::new();
    for (b, _) in servers.iter().filter(|s| s.1.is_none()) {
        if !floating.contains(&b.name()) {
            floating.push(b.name());
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::hist::Rtts;
    use super::super::{result_line, Measured};
    use super::*;

    fn plan(backends: Vec<Backend>, modes: Vec<Mode>) -> Plan {
        Plan {
            backends,
            modes,
            sizes: vec![64],
            inflight: None,
            iters: Some(10),
            duration_s: None,
            warmup: Some(1),
            warmup_s: None,
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

    /// The whole table of `lines`, each reported ready just before it
    /// came.
    fn render(p: &Plan, lines: &[ResultLine]) -> String {
        let mut t = Table::new(p, false);
        let mut out = String::new();
        for l in lines {
            out.push_str(&t.ready(l.backend, l.server_core));
            out.push_str(&t.row(l));
        }
        out + &t.finish()
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

    #[test]
    fn rows_come_as_results_do_under_columns_the_plan_chose() {
        let mut p = plan(vec![Backend::Raw, Backend::Tcp], vec![Mode::Lat]);
        p.sizes = vec![64, 128];
        p.cpu_util = true;
        let ls = lines(&p);
        let mut t = Table::new(&p, false);
        // The header waits for tcp's server core; raw's row waits for it.
        assert_eq!(t.ready(Backend::Raw, Some(1)), "");
        assert_eq!(t.row(&ls[0]), "");
        let first = t.ready(Backend::Tcp, Some(1));
        let head = first
            .lines()
            .find(|l| l.starts_with(" backend "))
            .expect("the header, before any tcp line");
        // tcp's syscall column and --cpu-util's, from the plan alone; no
        // server column over loopback, no packet columns without dpdk.
        assert!(head.contains("sys/msg") && head.contains("cpu%"), "{head}");
        assert!(
            !head.contains("srv_cpu%") && !head.contains("pkts/s"),
            "{head}"
        );
        let raw = first.lines().last().unwrap();
        assert!(raw.starts_with(" raw     lat"), "{first}");
        assert_eq!(
            raw.split_whitespace().count(),
            head.split_whitespace().count(),
            "a cell for every column:\n{first}"
        );
        // From then on each row alone, at once.
        let row = t.row(&ls[1]);
        assert!(
            row.starts_with(" tcp     lat") && row.lines().count() == 1,
            "{row}"
        );
        assert_eq!(t.ready(Backend::Raw, Some(1)), "");
        let third = t.row(&ls[2]);
        let end = t.finish();
        assert!(end.lines().all(|l| l.chars().all(|c| c == '-')), "{end}");
        // The same table as one rendered whole.
        assert_eq!(first + &row + &third + &end, render(&p, &ls[..3]));
    }

    #[test]
    fn a_bench_that_ends_early_prints_the_rows_it_holds() {
        let p = plan(vec![Backend::Raw, Backend::Tcp], vec![Mode::Lat]);
        let ls = lines(&p);
        let mut t = Table::new(&p, true);
        assert!(!t.has_rows());
        assert_eq!(t.ready(Backend::Raw, Some(3)), "");
        assert_eq!(t.row(&ls[0]), "");
        assert!(t.has_rows());
        // tcp never reported (its server died): the header says what the
        // runs that did reported.
        let end = t.finish();
        assert!(end.contains("client core 0, server core 3   "), "{end}");
        assert!(end.contains(" raw     lat"), "{end}");
        assert!(
            end.lines().last().unwrap().starts_with("---"),
            "closed: {end}"
        );
    }
}

//! The perftest-style table of `starwire bench`: one line per result,
//! round-trip columns named `rtt_*` (a perftest `*_lat` user reads halves:
//! `1way_p50` is one), optional columns only when a line has them.

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
    let cores = match (plan.client_core, plan.server_core) {
        (Some(c), Some(s)) => format!("client core {c}, server core {s}"),
        _ => "unpinned".to_owned(),
    };
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
    println!("{rule}");
    let conns = match plan.connections {
        0 | 1 => String::new(),
        n => format!("   {n} connections (inflight is per connection)"),
    };
    let bidi = if plan.bidirectional {
        "   bidirectional (rate and bw echoed; Gb/s both ways)"
    } else {
        ""
    };
    println!(
        " starwire bench   polling {}   {cores}   repeat {} (median){conns}{bidi}",
        if plan.polling { "on" } else { "off" },
        plan.repeat.max(1)
    );
    println!(
        " rtt_* are round trips in us, merged over repetitions; 1way_p50 = rtt_p50 / 2 \
         (what perftest's *_lat report){}",
        if cpu && !srv_cpu {
            "; cpu% is the whole process (over loopback both ends)"
        } else {
            ""
        }
    );
    println!("{rule}");
    println!("{head}");
    for l in lines {
        if l.mode == Mode::Fuse {
            let ratio = match (l.fused_steps_per_s, l.unfused_steps_per_s) {
                (Some(f), Some(u)) if u > 0.0 => format!("{:.1}x", f / u),
                _ => "-".to_owned(),
            };
            println!(
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
            l.p50_us.map(|p| p / 2.0),
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
        println!("{row}");
    }
    println!("{rule}");
    for l in lines {
        if let (Some(z), Some(c)) = (l.zc_sends, l.zc_copied) {
            if z > 0 {
                println!(
                    " {} {} {} B: {z} zero-copy sends, {c} reported copied by the kernel \
                     (the connection then sends plainly; loopback always copies)",
                    l.backend.name(),
                    l.mode.name(),
                    l.size
                );
            }
        }
    }
}

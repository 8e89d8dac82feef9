//! The packet figures of a row over a datagram backend (dpdk): packets
//! received per second over both ends, packets per frame, retransmits,
//! CPU time per message and the port's `rte_eth_stats` and xstats over
//! the run.
//! Stream backends have no packets of their own; their rows carry nulls.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ResultLine;

/// Counters of one end's datagram driver over a run (both ends report
/// theirs; the server's travel in its `done` message).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatagramCounters {
    /// Packets the driver took from its link: data and acknowledgements.
    pub packets_received: u64,
    /// Packets the driver handed to its link: data, retransmissions and
    /// acknowledgements.
    pub packets_sent: u64,
    /// Frames committed by the connections.
    pub frames_sent: u64,
    /// Data packets sent again.
    pub retransmits: u64,
}

impl DatagramCounters {
    fn add(self, o: Self) -> Self {
        Self {
            packets_received: self.packets_received + o.packets_received,
            packets_sent: self.packets_sent + o.packets_sent,
            frames_sent: self.frames_sent + o.frames_sent,
            retransmits: self.retransmits + o.retransmits,
        }
    }
}

/// The port's `rte_eth_stats` over a run: the difference of two reads.
/// In one process both ends share the port, so these count both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortCounters {
    /// Packets received.
    pub ipackets: u64,
    /// Packets sent.
    pub opackets: u64,
    /// Packets the device dropped for want of receive descriptors.
    pub imissed: u64,
    /// Receive failures for want of mbufs.
    pub rx_nombuf: u64,
}

impl PortCounters {
    fn add(self, o: Self) -> Self {
        Self {
            ipackets: self.ipackets + o.ipackets,
            opackets: self.opackets + o.opackets,
            imissed: self.imissed + o.imissed,
            rx_nombuf: self.rx_nombuf + o.rx_nombuf,
        }
    }
}

/// The port's extended counters (`rte_eth_xstats_get`) that moved over a
/// run, by the driver's names: the difference of two reads, counters that
/// stayed put left out (a port has dozens, most of them per-queue zeros).
pub type PortXstats = BTreeMap<String, u64>;

/// The xstats that moved between reads `a` and `b` of one port.
#[cfg(any(feature = "dpdk", test))]
pub fn xstats_delta(a: &[(String, u64)], b: &[(String, u64)]) -> PortXstats {
    let before: BTreeMap<&str, u64> = a.iter().map(|(n, v)| (n.as_str(), *v)).collect();
    b.iter()
        .filter_map(|(n, v)| {
            let d = v.saturating_sub(before.get(n.as_str()).copied().unwrap_or(0));
            (d > 0).then(|| (n.clone(), d))
        })
        .collect()
}

/// What the client end of a datagram run measured besides round trips.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientPackets {
    /// The client driver's counters.
    pub counters: DatagramCounters,
    /// Messages the client sent and received (two per request, warm-up
    /// included: the counters include it too).
    pub msgs: u64,
    /// CPU time of the client process over the run (over loopback the
    /// process holds both ends).
    pub cpu: Option<Duration>,
    /// The client port's counters over the run.
    pub port: Option<PortCounters>,
    /// The client port's xstats that moved over the run.
    pub xstats: Option<PortXstats>,
    /// How the client port's packets reach its reactors.
    pub steering: Option<&'static str>,
}

/// Set the packet fields of `line` from the client's figures and the
/// server's counters (`None` when the server sent none: then the figures
/// that need both ends stay null). The packet rate is the run's packets
/// per request times the measured request rate (`msgs_per_s`), so setup,
/// warm-up and close, which the counters include, do not dilute it.
pub fn set_packets(line: &mut ResultLine, c: &ClientPackets, server: Option<DatagramCounters>) {
    let requests = c.msgs / 2;
    line.retransmits = Some(c.counters.retransmits + server.map_or(0, |s| s.retransmits));
    line.port_stats = c.port;
    line.port_xstats = c.xstats.clone();
    line.steering = c.steering.map(str::to_owned);
    if c.msgs > 0 {
        line.cpu_us_per_msg = c.cpu.map(|t| t.as_secs_f64() * 1e6 / c.msgs as f64);
    }
    if let Some(s) = server {
        let both = c.counters.add(s);
        line.pps = line
            .msgs_per_s
            .filter(|_| requests > 0)
            .map(|r| both.packets_received as f64 / requests as f64 * r);
        line.packets_per_frame =
            (both.frames_sent > 0).then(|| both.packets_sent as f64 / both.frames_sent as f64);
    }
}

/// The packet fields of repetitions merged: medians of the rates, sums of
/// the counts.
pub fn merge_packets(out: &mut ResultLine, lines: &[ResultLine]) {
    out.pps = super::median(lines.iter().map(|l| l.pps));
    out.packets_per_frame = super::median(lines.iter().map(|l| l.packets_per_frame));
    out.cpu_us_per_msg = super::median(lines.iter().map(|l| l.cpu_us_per_msg));
    out.retransmits = lines
        .iter()
        .filter_map(|l| l.retransmits)
        .reduce(|a, b| a + b);
    out.port_stats = lines
        .iter()
        .filter_map(|l| l.port_stats)
        .reduce(PortCounters::add);
    out.port_xstats = lines
        .iter()
        .filter_map(|l| l.port_xstats.clone())
        .reduce(|mut a, b| {
            for (n, v) in b {
                *a.entry(n).or_default() += v;
            }
            a
        });
    out.steering = lines.iter().find_map(|l| l.steering.clone());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
    }

    #[test]
    fn xstats_delta_lists_what_moved() {
        let a = named(&[
            ("rx_good_packets", 10),
            ("rx_q0_errors", 0),
            ("tx_good_packets", 7),
        ]);
        let b = named(&[
            ("rx_good_packets", 25),
            ("rx_q0_errors", 0),
            ("tx_good_packets", 7),
            ("rx_missed_errors", 3),
        ]);
        let d = xstats_delta(&a, &b);
        // Unchanged counters are left out; one that appeared counts from 0.
        assert_eq!(
            d.into_iter().collect::<Vec<_>>(),
            vec![
                ("rx_good_packets".to_owned(), 15),
                ("rx_missed_errors".to_owned(), 3)
            ]
        );
        // A counter that went back (a port reset) is not a negative count.
        assert!(xstats_delta(&b, &a).is_empty());
    }
}

//! `starwire_dpdk_port_*` families: the DPDK port's own counters, read
//! at each scrape from the port the process opened (`rte_eth_stats_get`
//! and `rte_eth_xstats_get`). A process that never opened a port shows
//! none: a scrape does not initialise the EAL.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use crate::dpdk::DpdkContext;

/// The open DPDK port's counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct DpdkPortCollector;

/// One counter family of the port, one sample per `(label, value)`.
fn family(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    port: &str,
    samples: &[(&str, &str, u64)],
) -> std::fmt::Result {
    let mut f = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for &(key, value, n) in samples {
        let labels = [("port", port), (key, value)];
        ConstCounter::new(n).encode(f.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for DpdkPortCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(ctx) = DpdkContext::opened() else {
            return Ok(());
        };
        let Some(port) = ctx.port_index() else {
            return Ok(());
        };
        let port = port.to_string();
        if let Some(s) = ctx.port_stats() {
            let dir = "direction";
            family(
                &mut e,
                "starwire_dpdk_port_packets",
                "Packets the DPDK port received and sent (rte_eth_stats)",
                &port,
                &[(dir, "received", s.ipackets), (dir, "sent", s.opackets)],
            )?;
            family(
                &mut e,
                "starwire_dpdk_port_bytes",
                "Bytes the DPDK port received and sent (rte_eth_stats)",
                &port,
                &[(dir, "received", s.ibytes), (dir, "sent", s.obytes)],
            )?;
            family(
                &mut e,
                "starwire_dpdk_port_dropped_packets",
                "Packets the DPDK port dropped: imissed (no receive descriptor), \
                 rx_nombuf (no mbuf), ierrors and oerrors (rte_eth_stats)",
                &port,
                &[
                    ("reason", "imissed", s.imissed),
                    ("reason", "rx_nombuf", s.rx_nombuf),
                    ("reason", "ierrors", s.ierrors),
                    ("reason", "oerrors", s.oerrors),
                ],
            )?;
        }
        if let Some(x) = ctx.port_xstats() {
            let samples: Vec<(&str, &str, u64)> =
                x.iter().map(|(n, v)| ("name", n.as_str(), *v)).collect();
            family(
                &mut e,
                "starwire_dpdk_port_xstats",
                "The DPDK port's extended counters, named by its driver (rte_eth_xstats_get)",
                &port,
                &samples,
            )?;
        }
        Ok(())
    }
}

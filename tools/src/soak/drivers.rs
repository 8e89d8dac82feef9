//! What soak needs of a driver beyond the contract: its counters, faults
//! and set-up per backend.

use super::*;

/// A driver the soak can run over, with, maybe, fault counters.
pub(super) trait SoakDriver: Driver + Send + 'static {
    /// The faults injected on `conn` so far.
    fn fault_stats(&self, _conn: ConnId) -> FaultStats {
        FaultStats::default()
    }

    /// The faults injected under the whole driver so far (a datagram
    /// link shared by its connections), besides those of each connection.
    fn driver_fault_stats(&self) -> FaultStats {
        FaultStats::default()
    }

    /// Run first on the reactor thread that turns the driver.
    fn on_reactor_thread(&self) {}

    /// The driver's own counters for the report, if it has any.
    fn counters_json(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The DPDK datagram driver: reactor threads register with the EAL.
#[cfg(feature = "dpdk")]
impl SoakDriver for crate::dpdk::DpdkDriver {
    fn on_reactor_thread(&self) {
        if let Ok(ctx) = crate::dpdk::DpdkContext::get() {
            ctx.register_thread();
        }
    }
}

/// The DPDK datagram driver with faults injected under its link.
#[cfg(feature = "dpdk")]
impl SoakDriver
    for starwire_datagram::DatagramDriver<starwire_datagram::Impaired<starwire_dpdk::DpdkLink>>
{
    fn on_reactor_thread(&self) {
        if let Ok(ctx) = crate::dpdk::DpdkContext::get() {
            ctx.register_thread();
        }
    }

    fn driver_fault_stats(&self) -> FaultStats {
        let s = self.link().stats();
        FaultStats {
            dropped: s.lost,
            corrupted: s.corrupted,
            delayed: 0,
            reordered: s.reordered,
        }
    }
}

/// `--faults` as the rates of a fault injector under a datagram link:
/// drop is loss, corrupt flips bits, reorder and delay hold a packet back
/// behind later ones (delay_ms at most).
#[cfg(feature = "dpdk")]
pub(super) fn loss_config(f: FaultSpec) -> starwire_datagram::LossConfig {
    starwire_datagram::LossConfig {
        loss: f.drop,
        corrupt: f.corrupt,
        reorder: (f.reorder + f.delay).min(1.0),
        reorder_hold: f.delay_for,
        ..starwire_datagram::LossConfig::lossless(1500)
    }
}

/// A DPDK reactor has no interrupt to sleep on (it polls its queue, or
/// naps between polls): one reactor a side unless the flags ask for more
/// (each gets a queue pair of its own where the port has enough).
#[cfg(feature = "dpdk")]
pub(super) fn dpdk_reactors(mut args: SoakArgs) -> SoakArgs {
    if args.backend == "dpdk" {
        args.client_reactors.get_or_insert(1);
        args.server_reactors.get_or_insert(1);
    }
    args
}

/// The attacher of the DPDK backend: each soak connection's stream
/// carries the bootstrap of that one connection (addresses and ids), and
/// then only its close.
#[cfg(feature = "dpdk")]
pub(super) fn dpdk_attacher<L: crate::dpdk::OnDpdk>(
    _first: u64,
    _step: u64,
) -> fn(&mut starwire_datagram::DatagramDriver<L>, TcpStream) -> Result<ConnId, TransportError> {
    dpdk_attach
}

#[cfg(feature = "dpdk")]
pub(super) fn dpdk_attach<L: crate::dpdk::OnDpdk>(
    d: &mut starwire_datagram::DatagramDriver<L>,
    s: TcpStream,
) -> Result<ConnId, TransportError> {
    starwire_dpdk::bootstrap::attach_one(d, s)
}

#[cfg(all(feature = "uring", target_os = "linux"))]
impl SoakDriver for starwire_uring::UringDriver {}

impl SoakDriver for TcpDriver {}

#[cfg(all(feature = "verbs", target_os = "linux"))]
impl SoakDriver for starwire_verbs::VerbsDriver {
    fn counters_json(&self) -> Option<serde_json::Value> {
        let c = self.counters();
        Some(serde_json::json!({
            "doorbells_per_flush": c.doorbells_per_flush(),
            "wrs_per_frame": c.wrs_per_frame(),
            "credit_writes_per_frame": c.credit_writes_per_frame(),
            "flushes": c.flushes,
            "ibv_post_send": c.post_sends,
            "send_wrs": c.send_wrs,
            "inline_wrs": c.inline_wrs,
            "signaled_wrs": c.signaled_wrs,
            "frames_sent": c.frames_sent,
            "frames_received": c.frames_received,
            "credit_writes": c.credit_writes,
            "parks": c.parks,
            "cq_events": c.cq_events,
            "async_events": c.async_events,
        }))
    }
}

impl SoakDriver for Links<Faulty<TcpTransport>> {
    fn fault_stats(&self, conn: ConnId) -> FaultStats {
        self.link(conn).map(Faulty::stats).unwrap_or_default()
    }
}

/// A reactor's driver counters, labelled with its side and index.
pub(super) fn side_counters<D: SoakDriver>(
    sessions: &Sessions<D>,
    side: &str,
    reactor: usize,
) -> Option<serde_json::Value> {
    let mut v = sessions.driver().counters_json()?;
    v["side"] = side.into();
    v["reactor"] = reactor.into();
    Some(v)
}

/// The faults injected on every connection `sessions` holds.
pub(super) fn fault_counts<D: SoakDriver>(sessions: &Sessions<D>) -> FaultCounts {
    let mut f = FaultCounts::default();
    f.add(sessions.driver().driver_fault_stats());
    for id in sessions.ids() {
        f.add(sessions.driver().fault_stats(id));
    }
    f
}

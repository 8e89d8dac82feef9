//! The bench over DPDK (feature `dpdk`): the same load generator and echo
//! server as tcp and uring, each on an endpoint over one
//! `DatagramDriver<DpdkLink>`. The run's data listener carries no data:
//! the client makes one TCP connection to it, and the two ends exchange
//! their DPDK addresses and connection ids over it ([`bootstrap`]); then
//! every message goes through the DPDK port.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use starwire_datagram::ReliableConfig;
use starwire_transport::reactor::IdlePolicy;

use super::cpu::CpuMeter;
use super::packets::{self, DatagramCounters, PortCounters};
use super::sessions::{self, BenchDriver};
use super::{Measured, Run, ACCEPT_TIMEOUT};
use crate::dpdk::{bootstrap, DpdkContext, DpdkDriver};

impl BenchDriver for DpdkDriver {
    /// Kernel bypass: the datapath makes none.
    fn syscalls(&self) -> u64 {
        0
    }

    fn counters_text(&self) -> String {
        format!("{:?}; {:?}", self.stats(), self.link().stats())
    }

    fn datagram(&self) -> Option<DatagramCounters> {
        let (d, core) = (self.stats(), self.core_totals());
        Some(DatagramCounters {
            packets_received: d.packets_received,
            packets_sent: d.packets_sent,
            frames_sent: core.frames_sent,
            retransmits: core.retransmits,
        })
    }
}

/// The port's counters now, for a difference over a run.
fn port_counters(ctx: &DpdkContext) -> Option<PortCounters> {
    let s = ctx.port_stats()?;
    Some(PortCounters {
        ipackets: s.ipackets,
        opackets: s.opackets,
        imissed: s.imissed,
        rx_nombuf: s.rx_nombuf,
    })
}

fn port_delta(a: PortCounters, b: PortCounters) -> PortCounters {
    PortCounters {
        ipackets: b.ipackets.saturating_sub(a.ipackets),
        opackets: b.opackets.saturating_sub(a.opackets),
        imissed: b.imissed.saturating_sub(a.imissed),
        rx_nombuf: b.rx_nombuf.saturating_sub(a.rx_nombuf),
    }
}

/// Take the bootstrap connection from `data`, within [`ACCEPT_TIMEOUT`].
fn accept_bootstrap(data: &TcpListener) -> Result<TcpStream, String> {
    data.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + ACCEPT_TIMEOUT;
    loop {
        match data.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "the DPDK bootstrap connection did not arrive within {} s",
                        ACCEPT_TIMEOUT.as_secs()
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(format!("accepting the DPDK bootstrap connection: {e}")),
        }
    }
}

/// The server end of a run: `want` connections over DPDK. Returns the
/// server driver's packet counters.
pub fn serve(
    data: TcpListener,
    want: usize,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<Option<DatagramCounters>, String> {
    let ctx = DpdkContext::get().map_err(|e| e.to_string())?;
    let stream = accept_bootstrap(&data)?;
    let ip = ctx.ip_for(&stream).map_err(|e| e.to_string())?;
    let mut driver = ctx
        .driver(ip, ReliableConfig::default())
        .map_err(|e| e.to_string())?;
    let ids = bootstrap(&mut driver, &stream, want).map_err(|e| e.to_string())?;
    let res = sessions::serve_opened(driver, ids, run, core, idle, || {
        if let Ok(ctx) = DpdkContext::get() {
            ctx.register_thread();
        }
    });
    tracing::debug!(port = ?ctx.port_stats(), "dpdk bench server done");
    res
}

/// The client end of a run against the server's data listener at `addr`.
pub fn client(
    addr: SocketAddr,
    want: usize,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<Measured, String> {
    let ctx = DpdkContext::get().map_err(|e| e.to_string())?;
    let cpu = CpuMeter::start()?;
    let port_before = port_counters(ctx);
    let xstats_before = ctx.port_xstats();
    let stream = TcpStream::connect_timeout(&addr, ACCEPT_TIMEOUT)
        .map_err(|e| format!("DPDK bootstrap connection to {addr}: {e}"))?;
    stream.set_nodelay(true).ok();
    let ip = ctx.ip_for(&stream).map_err(|e| e.to_string())?;
    let mut driver = ctx
        .driver(ip, ReliableConfig::default())
        .map_err(|e| e.to_string())?;
    let ids = bootstrap(&mut driver, &stream, want).map_err(|e| e.to_string())?;
    let mut m = sessions::client_opened(driver, ids, run, core, idle, || {
        if let Ok(ctx) = DpdkContext::get() {
            ctx.register_thread();
        }
    })?;
    if let Some(p) = m.packets.as_mut() {
        p.cpu = cpu.cpu_time().ok();
        p.port = port_before
            .zip(port_counters(ctx))
            .map(|(a, b)| port_delta(a, b));
        p.xstats = xstats_before
            .zip(ctx.port_xstats())
            .map(|(a, b)| packets::xstats_delta(&a, &b));
        p.steering = ctx.steering().map(|s| s.as_str());
    }
    Ok(m)
}

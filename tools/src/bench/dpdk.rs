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

use super::sessions::{self, BenchDriver};
use super::{Measured, Run, ACCEPT_TIMEOUT};
use crate::dpdk::{bootstrap, DpdkContext, DpdkDriver};

impl BenchDriver for DpdkDriver {
    /// Kernel bypass: the datapath makes none.
    fn syscalls(&self) -> u64 {
        0
    }

    fn counters(&self) -> String {
        format!("{:?}; {:?}", self.stats(), self.link().stats())
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

/// The server end of a run: `want` connections over DPDK.
pub fn serve(
    data: TcpListener,
    want: usize,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<(), String> {
    let ctx = DpdkContext::get()?;
    let stream = accept_bootstrap(&data)?;
    let mut driver = ctx.driver(ctx.ip_for(&stream)?, ReliableConfig::default())?;
    let ids = bootstrap(&mut driver, &stream, want)?;
    let res = sessions::serve_opened(driver, ids, run, core, idle, || {
        if let Ok(ctx) = DpdkContext::get() {
            ctx.register_thread();
        }
    });
    tracing::debug!(port = %ctx.port_stats(), "dpdk bench server done");
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
    let ctx = DpdkContext::get()?;
    let stream = TcpStream::connect_timeout(&addr, ACCEPT_TIMEOUT)
        .map_err(|e| format!("DPDK bootstrap connection to {addr}: {e}"))?;
    stream.set_nodelay(true).ok();
    let mut driver = ctx.driver(ctx.ip_for(&stream)?, ReliableConfig::default())?;
    let ids = bootstrap(&mut driver, &stream, want)?;
    sessions::client_opened(driver, ids, run, core, idle, || {
        if let Ok(ctx) = DpdkContext::get() {
            ctx.register_thread();
        }
    })
}

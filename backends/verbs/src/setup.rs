//! Connecting: a queue pair created in Init, its receives posted, the
//! [`QpEndpoint`]s exchanged (in-process, or over a TCP side channel), the
//! queue pair taken to RTS and the ring protocol started.
//!
//! The TCP side channel is the connection the session layer already makes
//! to the cluster address (the acceptor's preamble names the shard); the
//! exchange runs on it and it is closed after. `rdma_cm` would take this
//! module's place (address and route resolution, the QPN/PSN exchange in
//! its private data, the state transitions) where the fabric runs it; see
//! `docs/backends/rdma.md`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use starwire_rdma::{EndpointError, QpEndpoint, RdmaDriver, RingError};
use starwire_transport::{ConnId, Driver};
use thiserror::Error;

use crate::error::DeviceError;
use crate::nic::VerbsNic;

/// The driver of one reactor over real verbs.
pub type VerbsDriver = RdmaDriver<VerbsNic>;

/// How long the side-channel exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Setting up a connection failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A verb of the setup failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The ring could not be prepared or connected.
    #[error(transparent)]
    Ring(#[from] RingError),
    /// The side channel failed.
    #[error("RDMA side channel: {0}")]
    SideChannel(#[from] std::io::Error),
    /// The peer's endpoint message is invalid.
    #[error("RDMA side channel: {0}")]
    Endpoint(#[from] EndpointError),
}

/// A connection being set up: its queue pair is in Init with its receives
/// posted; [`local`](Self::local) goes to the peer.
#[derive(Debug, Clone, Copy)]
pub struct Pending {
    /// The connection's handle on its driver.
    pub conn: ConnId,
    /// Its queue pair.
    pub qpn: u32,
    /// What to send to the peer.
    pub local: QpEndpoint,
}

/// Create a queue pair in Init and prepare the connection on it:
/// registered staging and ring, receive WRs posted before the peer can
/// learn the ring's rkey.
pub fn prepare(driver: &mut VerbsDriver) -> Result<Pending, SetupError> {
    let qpn = driver.verbs_mut().create_qp()?;
    let (conn, ring) = match driver.prepare(qpn) {
        Ok(r) => r,
        Err(e) => {
            let _ = starwire_rdma::Verbs::destroy_qp(driver.verbs_mut(), qpn);
            return Err(e.into());
        }
    };
    match driver.verbs().local_endpoint(qpn, ring) {
        Some(local) => Ok(Pending { conn, qpn, local }),
        None => {
            driver.detach(conn);
            Err(DeviceError::NotInit(qpn).into())
        }
    }
}

/// Take the queue pair to RTS against `peer` and start the ring protocol.
/// On error the connection is detached (queue pair destroyed, regions
/// deregistered).
pub fn finish(
    driver: &mut VerbsDriver,
    p: &Pending,
    peer: &QpEndpoint,
) -> Result<ConnId, SetupError> {
    let r = driver
        .verbs_mut()
        .connect_qp(p.qpn, peer)
        .map_err(SetupError::from)
        .and_then(|()| driver.connect(p.conn, peer.ring).map_err(SetupError::from));
    match r {
        Ok(()) => Ok(p.conn),
        Err(e) => {
            driver.detach(p.conn);
            Err(e)
        }
    }
}

/// Connect a new connection of `a` to a new connection of `b` in one
/// process (two devices, or two ports, of one host). The endpoints go
/// through their encoding, as over the side channel.
pub fn connect_local(
    a: &mut VerbsDriver,
    b: &mut VerbsDriver,
) -> Result<(ConnId, ConnId), SetupError> {
    let pa = prepare(a)?;
    let pb = match prepare(b) {
        Ok(p) => p,
        Err(e) => {
            a.detach(pa.conn);
            return Err(e);
        }
    };
    let ea = QpEndpoint::parse(&pa.local.to_bytes())?;
    let eb = QpEndpoint::parse(&pb.local.to_bytes())?;
    let ca = match finish(a, &pa, &eb) {
        Ok(c) => c,
        Err(e) => {
            b.detach(pb.conn);
            return Err(e);
        }
    };
    match finish(b, &pb, &ea) {
        Ok(cb) => Ok((ca, cb)),
        Err(e) => {
            a.detach(ca);
            Err(e)
        }
    }
}

/// Set a connection up over `stream`, the side channel to the peer, which
/// runs the same function: each side sends its endpoint and reads the
/// peer's, connects, then sends one byte and waits for the peer's, so
/// neither writes before the other's queue pair can receive.
pub fn connect_stream(
    driver: &mut VerbsDriver,
    stream: &mut TcpStream,
) -> Result<ConnId, SetupError> {
    stream.set_read_timeout(Some(EXCHANGE_TIMEOUT))?;
    stream.set_write_timeout(Some(EXCHANGE_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let p = prepare(driver)?;
    let exchanged = (|| -> Result<QpEndpoint, SetupError> {
        stream.write_all(&p.local.to_bytes())?;
        let mut peer = [0; QpEndpoint::ENCODED_LEN];
        stream.read_exact(&mut peer)?;
        Ok(QpEndpoint::parse(&peer)?)
    })();
    let peer = match exchanged {
        Ok(peer) => peer,
        Err(e) => {
            driver.detach(p.conn);
            return Err(e);
        }
    };
    let conn = finish(driver, &p, &peer)?;
    let ready = (|| -> std::io::Result<()> {
        stream.write_all(&[1])?;
        let mut b = [0];
        stream.read_exact(&mut b)?;
        if b[0] != 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("expected the ready byte 1, got {}", b[0]),
            ));
        }
        Ok(())
    })();
    if let Err(e) = ready {
        driver.detach(conn);
        return Err(e.into());
    }
    Ok(conn)
}

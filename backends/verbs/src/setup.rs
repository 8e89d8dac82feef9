//! Connecting: a queue pair created in Init, its receives posted, the
//! [`QpEndpoint`]s exchanged, the queue pair taken to RTS and the ring
//! protocol started. [`connect_local`] does it between two drivers of one
//! process; [`VerbsRdma`](crate::VerbsRdma) over a TCP side channel.

use starwire_rdma::{EndpointError, QpEndpoint, RdmaDriver, RingError};
use starwire_transport::auth::stream::StreamAuthError;
use starwire_transport::{ConnId, Driver};
use thiserror::Error;

use crate::error::DeviceError;
use crate::nic::VerbsNic;

/// The ring protocol over one reactor's real verbs.
pub type VerbsRdma = RdmaDriver<VerbsNic>;

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
    /// The peer did not prove the cluster token on the side channel (a
    /// wrong proof, another protocol, silence until the setup's deadline,
    /// or a closed stream); nothing was allocated for the connection.
    #[error("RDMA side channel: {0}")]
    Auth(#[from] StreamAuthError),
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

/// Create a queue pair in Init and prepare a new connection on it:
/// registered staging and ring, receive WRs posted before the peer can
/// learn the ring's rkey. A reservation ([`prepare_reserved`]), given
/// back on error.
pub fn prepare(driver: &mut VerbsRdma) -> Result<Pending, SetupError> {
    let conn = driver.reserve()?;
    prepare_reserved(driver, conn).inspect_err(|_| driver.detach(conn))
}

/// Create a queue pair in Init and prepare the connection `conn`
/// reserved earlier (`RdmaDriver::reserve`) on it: its handle stays, the
/// queue pair and memory come now. On error `conn` stays reserved and
/// nothing else is held.
pub fn prepare_reserved(driver: &mut VerbsRdma, conn: ConnId) -> Result<Pending, SetupError> {
    let qpn = driver.verbs_mut().create_qp()?;
    let ring = match driver.prepare_reserved(conn, qpn) {
        Ok(r) => r,
        Err(e) => {
            let _ = starwire_rdma::Verbs::destroy_qp(driver.verbs_mut(), qpn);
            return Err(e.into());
        }
    };
    match driver.verbs().local_endpoint(qpn, ring) {
        Some(local) => Ok(Pending { conn, qpn, local }),
        None => {
            // Back to a reservation: the queue pair and memory go, the
            // handle stays its owner's until it detaches it (the slot
            // just freed is the next one a reservation takes).
            driver.detach(conn);
            let again = driver.reserve();
            debug_assert_eq!(again.ok(), Some(conn));
            Err(DeviceError::NotInit(qpn).into())
        }
    }
}

/// Take the queue pair to RTR and RTS against `peer`. On error the
/// connection stays attached, for its owner to detach when it takes the
/// failure: detached here, its slot could go to a connection set up in
/// between, which the owner's detach would then end.
pub fn connect_qp(
    driver: &mut VerbsRdma,
    p: &Pending,
    peer: &QpEndpoint,
) -> Result<(), SetupError> {
    Ok(driver.verbs_mut().connect_qp(p.qpn, peer)?)
}

/// [`connect_qp`], then start the ring protocol (`RdmaDriver::connect`).
/// Call it only once the peer's queue pair is past RTR too: RC retries a
/// write into a queue pair still in Init, but not for long. On error the
/// connection is detached.
pub fn finish(
    driver: &mut VerbsRdma,
    p: &Pending,
    peer: &QpEndpoint,
) -> Result<ConnId, SetupError> {
    if let Err(e) = connect_qp(driver, p, peer) {
        driver.detach(p.conn);
        return Err(e);
    }
    match driver.connect(p.conn, peer.ring) {
        Ok(()) => Ok(p.conn),
        Err(e) => {
            driver.detach(p.conn);
            Err(e.into())
        }
    }
}

/// Connect a new connection of `a` to a new connection of `b` in one
/// process (two devices, or two ports, of one host). The endpoints go
/// through their encoding, as over the side channel; both queue pairs
/// reach RTS before either ring starts.
pub fn connect_local(a: &mut VerbsRdma, b: &mut VerbsRdma) -> Result<(ConnId, ConnId), SetupError> {
    let pa = prepare(a)?;
    let pb = match prepare(b) {
        Ok(p) => p,
        Err(e) => {
            a.detach(pa.conn);
            return Err(e);
        }
    };
    let started = (|| {
        let ea = QpEndpoint::parse(&pa.local.to_bytes())?;
        let eb = QpEndpoint::parse(&pb.local.to_bytes())?;
        connect_qp(a, &pa, &eb)?;
        connect_qp(b, &pb, &ea)?;
        a.connect(pa.conn, eb.ring)?;
        b.connect(pb.conn, ea.ring)?;
        Ok::<_, SetupError>(())
    })();
    if let Err(e) = started {
        a.detach(pa.conn);
        b.detach(pb.conn);
        return Err(e);
    }
    Ok((pa.conn, pb.conn))
}

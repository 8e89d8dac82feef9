//! [`VerbsDriver`]: the driver of one reactor over real verbs, whose
//! connections are set up over TCP side channels without blocking the
//! reactor.
//!
//! The side channel is the connection the session layer already makes to
//! the cluster address (`dial`, and the acceptor whose preamble picks the
//! shard). When the caller knows the cluster token
//! ([`attach_stream_as`](StreamDriver::attach_stream_as), as every
//! `Endpoint` attaches its streams), the connection first takes only a
//! handle (`RdmaDriver::reserve`: no queue pair, no registered memory, no
//! share of the completion queue) and the two ends run the token's stream
//! proof on the side channel ([`SideChannelAuth`], purpose
//! [`PURPOSE`](crate::auth::PURPOSE)); a peer that fails it, speaks
//! another protocol or stays silent until [`SETUP_TIMEOUT`] fails the
//! connection ([`SetupError::Auth`]) with nothing allocated. Once the
//! peer proved the token (at once without a token:
//! [`attach_stream`](StreamDriver::attach_stream), or
//! `attach_stream_as` with none) the driver creates the queue pair in
//! Init, posts its receives and writes our [`QpEndpoint`]; the reactor's
//! turns then read the peer's, take the queue pair to RTR and RTS, write
//! one ready byte and wait for the peer's, and only then start the ring,
//! so neither side writes before the other's queue pair can receive.
//! Until then the connection is reserved or prepared: frames queue behind
//! back-pressure. The whole exchange, proof included, must end within
//! [`SETUP_TIMEOUT`] of the first turn that sees it. Apart from the
//! proof's roles both sides run the same steps; nothing depends on the
//! order in which a side attaches its streams. `rdma_cm` would take this
//! module's place where the fabric runs it (`docs/backends/rdma.md`).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use starwire_rdma::{QpEndpoint, RdmaStats};
use starwire_transport::reactor::{ParkEnd, ParkWaker};
use starwire_transport::{
    ClusterToken, ConnId, Driver, DriverCounters, Side, Sleep, StreamDriver, TransportError,
};

use crate::auth::SideChannelAuth;
use crate::nic::VerbsNic;
use crate::setup::{connect_qp, prepare, prepare_reserved, Pending, SetupError, VerbsRdma};

/// How long a connection's side-channel exchange may take.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The ready byte each side writes once its queue pair is at RTS.
const READY: u8 = 1;

/// A connection whose side-channel exchange is under way.
#[derive(Debug)]
struct Setup {
    conn: ConnId,
    stream: TcpStream,
    phase: Phase,
    /// Set at the first turn that sees the setup.
    deadline: Option<Instant>,
}

/// Where a setup is.
#[derive(Debug)]
enum Phase {
    /// The peer is proving the cluster token; the connection is only
    /// reserved.
    Auth(SideChannelAuth),
    /// The queue pair exists; endpoints and ready bytes are exchanged.
    Qp(Exchange),
}

/// The endpoint and ready-byte exchange of a prepared connection.
#[derive(Debug)]
struct Exchange {
    pending: Pending,
    /// Bytes still to write (our endpoint, then the ready byte).
    out: Vec<u8>,
    /// The peer's endpoint and ready byte as read so far.
    got: [u8; QpEndpoint::ENCODED_LEN + 1],
    len: usize,
    /// The peer's endpoint, once read and our queue pair connected.
    peer: Option<QpEndpoint>,
}

/// What one step of a setup came to.
enum Step {
    Waiting,
    Done(QpEndpoint),
    Failed(SetupError),
}

impl Setup {
    /// Prove the token if that is under way (against the setup's
    /// deadline, once it has one), then prepare the connection and
    /// exchange endpoints.
    fn step(&mut self, rdma: &mut VerbsRdma, now: Instant) -> Step {
        if let Phase::Auth(auth) = &mut self.phase {
            match auth.step(&mut self.stream, now, self.deadline) {
                Ok(false) => return Step::Waiting,
                Ok(true) => match prepare_reserved(rdma, self.conn) {
                    Ok(pending) => self.phase = Phase::Qp(Exchange::new(pending)),
                    Err(e) => return Step::Failed(e),
                },
                Err(e) => return Step::Failed(e.into()),
            }
        }
        let Phase::Qp(x) = &mut self.phase else {
            return Step::Waiting;
        };
        match x.try_step(&mut self.stream, rdma) {
            Ok(Some(peer)) => Step::Done(peer),
            Ok(None) => Step::Waiting,
            Err(e) => Step::Failed(e),
        }
    }
}

impl Exchange {
    fn new(pending: Pending) -> Self {
        Self {
            pending,
            out: pending.local.to_bytes().to_vec(),
            got: [0; QpEndpoint::ENCODED_LEN + 1],
            len: 0,
            peer: None,
        }
    }

    /// Write what is owed, read what has come; connect the queue pair once
    /// the peer's endpoint is in.
    fn try_step(
        &mut self,
        stream: &mut TcpStream,
        rdma: &mut VerbsRdma,
    ) -> Result<Option<QpEndpoint>, SetupError> {
        loop {
            while !self.out.is_empty() {
                match stream.write(&self.out) {
                    Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                    Ok(n) => drop(self.out.drain(..n)),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            let want = if self.peer.is_none() {
                QpEndpoint::ENCODED_LEN
            } else {
                QpEndpoint::ENCODED_LEN + 1
            };
            if self.len < want {
                match stream.read(&mut self.got[self.len..want]) {
                    Ok(0) => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the peer closed the side channel during setup",
                        )
                        .into())
                    }
                    Ok(n) => self.len += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            match self.peer {
                None => {
                    // The peer's ring is checked before our queue pair
                    // goes to RTR / RTS and our ready byte is written.
                    let peer =
                        parse_peer(&self.got[..QpEndpoint::ENCODED_LEN], rdma.max_frame_len())?;
                    connect_qp(rdma, &self.pending, &peer)?;
                    self.peer = Some(peer);
                    self.out.push(READY);
                }
                Some(peer) => {
                    let b = self.got[QpEndpoint::ENCODED_LEN];
                    if b != READY {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("expected the ready byte {READY}, got {b}"),
                        )
                        .into());
                    }
                    return Ok(self.out.is_empty().then_some(peer));
                }
            }
        }
    }
}

/// The peer's endpoint message, its ring checked against the driver's
/// frame limit `max_frame` (`RdmaDriver::check_remote`), so a ring the
/// driver would refuse fails the setup before the queue pair is connected.
fn parse_peer(bytes: &[u8], max_frame: usize) -> Result<QpEndpoint, SetupError> {
    let peer = QpEndpoint::parse(bytes)?;
    peer.ring.check(max_frame)?;
    Ok(peer)
}

/// Counters of a [`VerbsDriver`] (or several, added up with
/// [`add`](Self::add)) and the ratios that matter under emulation, where
/// timings mean nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerbsCounters {
    /// Submissions (`Driver::flush` calls).
    pub flushes: u64,
    /// `ibv_post_send` calls: one doorbell per queue pair with work in a
    /// flush.
    pub post_sends: u64,
    /// Send work requests (data and credit writes).
    pub send_wrs: u64,
    /// Of those, sent inline.
    pub inline_wrs: u64,
    /// Of those, signalled.
    pub signaled_wrs: u64,
    /// Frames written (data writes).
    pub frames_sent: u64,
    /// Credit writes.
    pub credit_writes: u64,
    /// Frames received.
    pub frames_received: u64,
    /// Parks on the completion channel.
    pub parks: u64,
    /// Completion events read.
    pub cq_events: u64,
    /// Asynchronous events read (and logged).
    pub async_events: u64,
}

impl VerbsCounters {
    /// Add `o`'s counts to these.
    pub fn add(&mut self, o: &VerbsCounters) {
        self.flushes += o.flushes;
        self.post_sends += o.post_sends;
        self.send_wrs += o.send_wrs;
        self.inline_wrs += o.inline_wrs;
        self.signaled_wrs += o.signaled_wrs;
        self.frames_sent += o.frames_sent;
        self.credit_writes += o.credit_writes;
        self.frames_received += o.frames_received;
        self.parks += o.parks;
        self.cq_events += o.cq_events;
        self.async_events += o.async_events;
    }

    fn ratio(a: u64, b: u64) -> f64 {
        if b == 0 {
            0.0
        } else {
            a as f64 / b as f64
        }
    }

    /// `ibv_post_send` doorbells per flush.
    pub fn doorbells_per_flush(&self) -> f64 {
        Self::ratio(self.post_sends, self.flushes)
    }

    /// Send work requests per frame sent.
    pub fn wrs_per_frame(&self) -> f64 {
        Self::ratio(self.send_wrs, self.frames_sent)
    }

    /// Credit writes per frame received.
    pub fn credit_writes_per_frame(&self) -> f64 {
        Self::ratio(self.credit_writes, self.frames_received)
    }
}

impl std::fmt::Display for VerbsCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} doorbells per flush ({} ibv_post_send / {} flushes), {:.3} WRs per frame \
             ({} send WRs / {} frames sent; {} inline, {} signalled), {:.3} credit writes per \
             frame ({} / {} frames received), {} parks, {} CQ events, {} async events",
            self.doorbells_per_flush(),
            self.post_sends,
            self.flushes,
            self.wrs_per_frame(),
            self.send_wrs,
            self.frames_sent,
            self.inline_wrs,
            self.signaled_wrs,
            self.credit_writes_per_frame(),
            self.credit_writes,
            self.frames_received,
            self.parks,
            self.cq_events,
            self.async_events
        )
    }
}

/// The driver of one reactor over real verbs: the ring protocol
/// ([`VerbsRdma`], `RdmaDriver<VerbsNic>`) plus the side channels of the
/// connections being set up. See the module documentation.
#[derive(Debug)]
pub struct VerbsDriver {
    rdma: VerbsRdma,
    setups: Vec<Setup>,
    failed: Vec<(ConnId, TransportError)>,
}

impl VerbsDriver {
    /// A driver over `rdma`, with no connection being set up.
    pub fn new(rdma: VerbsRdma) -> Self {
        Self {
            rdma,
            setups: Vec::new(),
            failed: Vec::new(),
        }
    }

    /// The ring protocol driver.
    pub fn rdma(&self) -> &VerbsRdma {
        &self.rdma
    }

    /// The reactor's verbs.
    pub fn nic(&self) -> &VerbsNic {
        self.rdma.verbs()
    }

    /// The ring driver's counters.
    pub fn stats(&self) -> RdmaStats {
        self.rdma.stats()
    }

    /// What the guest run and `bench`/`soak` report: submissions,
    /// doorbells, work requests and credit writes against frames.
    pub fn counters(&self) -> VerbsCounters {
        let r = self.rdma.stats();
        let n = self.nic().stats();
        let rings = self.rdma.ring_totals();
        VerbsCounters {
            flushes: r.flushes,
            post_sends: n.post_sends,
            send_wrs: n.send_wrs,
            inline_wrs: n.inline_wrs,
            signaled_wrs: n.signaled_wrs,
            frames_sent: rings.data_writes,
            credit_writes: rings.credit_writes,
            frames_received: rings.frames_received,
            parks: r.parks,
            cq_events: n.cq_events,
            async_events: n.async_events,
        }
    }

    /// Connections whose side-channel exchange is under way.
    pub fn setting_up(&self) -> usize {
        self.setups.len()
    }

    /// Of those, the ones whose peer is still proving the cluster token
    /// (nothing allocated for them but their handle).
    pub fn authenticating(&self) -> usize {
        self.setups
            .iter()
            .filter(|s| matches!(s.phase, Phase::Auth(_)))
            .count()
    }

    /// Step every setup; true if any finished or failed.
    fn progress(&mut self, now: Instant) -> bool {
        let mut changed = false;
        let mut i = 0;
        while i < self.setups.len() {
            let s = &mut self.setups[i];
            let deadline = *s.deadline.get_or_insert(now + SETUP_TIMEOUT);
            let step = match s.step(&mut self.rdma, now) {
                Step::Waiting if now >= deadline => {
                    Step::Failed(SetupError::SideChannel(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no answer on the side channel within {SETUP_TIMEOUT:?}"),
                    )))
                }
                step => step,
            };
            let conn = s.conn;
            match step {
                Step::Waiting => {
                    i += 1;
                    continue;
                }
                Step::Done(peer) => {
                    if let Err(e) = self.rdma.connect(conn, peer.ring) {
                        self.failed
                            .push((conn, TransportError::Link(e.to_string())));
                    }
                }
                Step::Failed(e) => {
                    let peer = s.stream.peer_addr().ok();
                    tracing::warn!(%e, %conn, ?peer, "rdma connection setup failed");
                    self.failed
                        .push((conn, TransportError::Link(e.to_string())));
                }
            }
            self.setups.swap_remove(i);
            changed = true;
        }
        changed
    }

    /// Start a connection's setup on `stream`: with `auth`, the peer
    /// proves the token before anything but the handle is allocated.
    fn attach(
        &mut self,
        stream: TcpStream,
        auth: Option<SideChannelAuth>,
    ) -> Result<ConnId, TransportError> {
        let link = |e: &dyn std::fmt::Display| TransportError::Link(e.to_string());
        stream.set_nonblocking(true).map_err(|e| link(&e))?;
        let _ = stream.set_nodelay(true);
        let (conn, phase) = match auth {
            Some(a) => (self.rdma.reserve().map_err(|e| link(&e))?, Phase::Auth(a)),
            None => {
                let pending = prepare(&mut self.rdma).map_err(|e| link(&e))?;
                (pending.conn, Phase::Qp(Exchange::new(pending)))
            }
        };
        let mut setup = Setup {
            conn,
            stream,
            phase,
            deadline: None,
        };
        if let Step::Failed(e) = setup.step(&mut self.rdma, Instant::now()) {
            self.rdma.detach(conn);
            return Err(link(&e));
        }
        self.setups.push(setup);
        Ok(conn)
    }
}

impl StreamDriver for VerbsDriver {
    /// Prepare a connection (queue pair in Init, receives posted) and
    /// start the exchange on `stream`, which the driver keeps until the
    /// connection is set up. No proof of the cluster token is exchanged:
    /// [`attach_stream_as`](StreamDriver::attach_stream_as) with the token
    /// asks for one.
    fn attach_stream(&mut self, stream: TcpStream) -> Result<ConnId, TransportError> {
        self.attach(stream, None)
    }

    /// With a token, reserve the connection's handle and start the token's
    /// proof on `stream` as the `side` end; the queue pair and memory come
    /// once the peer has proved it. Without one, as
    /// [`attach_stream`](StreamDriver::attach_stream).
    fn attach_stream_as(
        &mut self,
        stream: TcpStream,
        side: Side,
        token: Option<&ClusterToken>,
    ) -> Result<ConnId, TransportError> {
        let auth = token.map(|t| SideChannelAuth::new(side, t));
        self.attach(stream, auth)
    }
}

impl Driver for VerbsDriver {
    fn max_frame_len(&self) -> usize {
        self.rdma.max_frame_len()
    }

    /// The RDMA driver's counters; system calls are the parks (each a
    /// `poll(2)`) and the completion events read, posting and polling
    /// bypass the kernel.
    fn counters(&self) -> DriverCounters {
        let c = self.counters();
        DriverCounters {
            syscalls: Some(c.parks + c.cq_events),
            ..self.rdma.counters()
        }
    }

    fn tx_reserve(
        &mut self,
        conn: ConnId,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransportError> {
        self.rdma.tx_reserve(conn, len)
    }

    fn tx_commit(&mut self, conn: ConnId, len: usize) {
        self.rdma.tx_commit(conn, len);
    }

    fn tx_pending(&self, conn: ConnId) -> bool {
        self.rdma.tx_pending(conn)
    }

    fn rx_burst(&mut self, now: Instant, max: usize, sink: &mut dyn FnMut(ConnId, &[u8])) -> usize {
        if !self.setups.is_empty() {
            self.progress(now);
        }
        self.rdma.rx_burst(now, max, sink)
    }

    fn flush(&mut self, now: Instant) -> bool {
        let set_up = !self.setups.is_empty() && self.progress(now);
        self.rdma.flush(now) || set_up
    }

    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        if let Some(f) = self.failed.pop() {
            return Some(f);
        }
        self.rdma.poll_failure()
    }

    fn detach(&mut self, conn: ConnId) {
        self.setups.retain(|s| s.conn != conn);
        self.failed.retain(|(c, _)| *c != conn);
        self.rdma.detach(conn);
    }

    /// A setup's deadline, so a silent side channel fails in time.
    fn poll_timeout(&self) -> Option<Instant> {
        self.setups.iter().filter_map(|s| s.deadline).min()
    }

    fn sleep(&self) -> Sleep {
        self.rdma.sleep()
    }

    /// The ring driver's park (completion channel, async events, waker),
    /// also woken by the side channels of connections being set up.
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        if !self.failed.is_empty() {
            return Some(ParkEnd::Input);
        }
        let fds: Vec<BorrowedFd<'_>> = self.setups.iter().map(|s| s.stream.as_fd()).collect();
        self.rdma.park_with(waker, &fds, timeout)
    }
}

#[cfg(test)]
mod tests {
    use starwire_rdma::{RemoteRing, RingError};

    use super::*;

    fn endpoint(ring: RemoteRing) -> [u8; QpEndpoint::ENCODED_LEN] {
        QpEndpoint {
            qpn: 0x1234,
            psn: 7,
            lid: 0,
            gid: [0; 16],
            gid_index: 0,
            mtu: 3,
            port: 1,
            ring,
        }
        .to_bytes()
    }

    /// `Exchange::try_step` parses the peer's endpoint with `parse_peer`
    /// before `connect_qp`: a ring the driver's `connect` would refuse
    /// fails the setup before the queue pair reaches RTR / RTS.
    #[test]
    fn a_peer_ring_the_driver_would_refuse_fails_the_endpoint_exchange() {
        let good = RemoteRing {
            rkey: 9,
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            recv_depth: 128,
        };
        let max_frame = 1 << 19;
        assert_eq!(parse_peer(&endpoint(good), max_frame).unwrap().ring, good);
        let bad = [
            RemoteRing {
                addr: u64::MAX - 63,
                ..good
            },
            RemoteRing { len: 1000, ..good },
            RemoteRing {
                recv_depth: 1,
                ..good
            },
            RemoteRing {
                len: 1 << 19,
                ..good
            },
        ];
        for ring in bad {
            let e = parse_peer(&endpoint(ring), max_frame).unwrap_err();
            assert!(
                matches!(e, SetupError::Ring(RingError::Remote(_))),
                "{ring:?}: {e}"
            );
        }
        assert!(matches!(
            parse_peer(&[0; QpEndpoint::ENCODED_LEN], max_frame),
            Err(SetupError::Endpoint(_))
        ));
    }
}

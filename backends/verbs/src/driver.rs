//! [`VerbsDriver`]: the driver of one reactor over real verbs, whose
//! connections are set up over TCP side channels without blocking the
//! reactor.
//!
//! The side channel is the connection the session layer already makes to
//! the cluster address (`dial`, and the acceptor whose preamble picks the
//! shard): [`attach_stream`](StreamDriver::attach_stream) takes it like
//! the TCP drivers do, creates the queue pair in Init, posts its receives
//! and writes our [`QpEndpoint`]; the reactor's turns then read the
//! peer's, take the queue pair to RTR and RTS, write one ready byte and
//! wait for the peer's, and only then start the ring, so neither side
//! writes before the other's queue pair can receive. Until then the
//! connection is prepared: frames queue behind back-pressure. Both sides
//! run the same steps; nothing depends on the order in which a side
//! attaches its streams. `rdma_cm` would take this module's place where
//! the fabric runs it (`docs/backends/rdma.md`).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use starwire_rdma::{QpEndpoint, RdmaStats};
use starwire_transport::reactor::{ParkEnd, ParkWaker};
use starwire_transport::{ConnId, Driver, DriverCounters, Sleep, StreamDriver, TransportError};

use crate::nic::VerbsNic;
use crate::setup::{connect_qp, prepare, Pending, SetupError, VerbsRdma};

/// How long a connection's side-channel exchange may take.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The ready byte each side writes once its queue pair is at RTS.
const READY: u8 = 1;

/// A connection whose side-channel exchange is under way.
#[derive(Debug)]
struct Setup {
    pending: Pending,
    stream: TcpStream,
    /// Bytes still to write (our endpoint, then the ready byte).
    out: Vec<u8>,
    /// The peer's endpoint and ready byte as read so far.
    got: [u8; QpEndpoint::ENCODED_LEN + 1],
    len: usize,
    /// The peer's endpoint, once read and our queue pair connected.
    peer: Option<QpEndpoint>,
    /// Set at the first turn that sees the setup.
    deadline: Option<Instant>,
}

/// What one step of a setup came to.
enum Step {
    Waiting,
    Done(QpEndpoint),
    Failed(SetupError),
}

impl Setup {
    /// Write what is owed, read what has come; connect the queue pair once
    /// the peer's endpoint is in.
    fn step(&mut self, rdma: &mut VerbsRdma) -> Step {
        match self.try_step(rdma) {
            Ok(Some(peer)) => Step::Done(peer),
            Ok(None) => Step::Waiting,
            Err(e) => Step::Failed(e),
        }
    }

    fn try_step(&mut self, rdma: &mut VerbsRdma) -> Result<Option<QpEndpoint>, SetupError> {
        loop {
            while !self.out.is_empty() {
                match self.stream.write(&self.out) {
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
                match self.stream.read(&mut self.got[self.len..want]) {
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
                    let peer = QpEndpoint::parse(&self.got[..QpEndpoint::ENCODED_LEN])?;
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

    /// Step every setup; true if any finished or failed.
    fn progress(&mut self, now: Instant) -> bool {
        let mut changed = false;
        let mut i = 0;
        while i < self.setups.len() {
            let s = &mut self.setups[i];
            let deadline = *s.deadline.get_or_insert(now + SETUP_TIMEOUT);
            let step = match s.step(&mut self.rdma) {
                Step::Waiting if now >= deadline => {
                    Step::Failed(SetupError::SideChannel(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no answer on the side channel within {SETUP_TIMEOUT:?}"),
                    )))
                }
                step => step,
            };
            let conn = s.pending.conn;
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
                    tracing::warn!(%e, %conn, "rdma connection setup failed");
                    self.failed
                        .push((conn, TransportError::Link(e.to_string())));
                }
            }
            self.setups.swap_remove(i);
            changed = true;
        }
        changed
    }
}

impl StreamDriver for VerbsDriver {
    /// Prepare a connection (queue pair in Init, receives posted) and
    /// start the exchange on `stream`, which the driver keeps until the
    /// connection is set up.
    fn attach_stream(&mut self, stream: TcpStream) -> Result<ConnId, TransportError> {
        let link = |e: &dyn std::fmt::Display| TransportError::Link(e.to_string());
        stream.set_nonblocking(true).map_err(|e| link(&e))?;
        let _ = stream.set_nodelay(true);
        let pending = prepare(&mut self.rdma).map_err(|e| link(&e))?;
        let mut setup = Setup {
            pending,
            stream,
            out: pending.local.to_bytes().to_vec(),
            got: [0; QpEndpoint::ENCODED_LEN + 1],
            len: 0,
            peer: None,
            deadline: None,
        };
        if let Step::Failed(e) = setup.step(&mut self.rdma) {
            self.rdma.detach(pending.conn);
            return Err(link(&e));
        }
        self.setups.push(setup);
        Ok(pending.conn)
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
        self.setups.retain(|s| s.pending.conn != conn);
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

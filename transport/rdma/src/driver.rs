//! [`RdmaDriver`]: the ring protocol of every connection of one reactor,
//! over one set of [`Verbs`] (one completion queue for all queue pairs).
//!
//! A turn is one receive pass and one submission. The receive pass polls
//! the shared completion queue until it is empty, hands each completion to
//! the connection its `wr_id` names (its slot; the completion's `qp_num`
//! must match), and then lends every connection's received frames in place
//! from its ring. The submission polls the queue again (send completions
//! free staging, credits arrive), stages every connection's credit message
//! and queued frames, and rings the doorbell once for all of them.

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use starwire_transport::reactor::{park_fds, ParkEnd, ParkWaker};
use starwire_transport::{ConnId, Driver, DriverCounters, Sleep, TransportError};

use crate::ring::{
    check_config, check_remote, wr_slot, PreparedRing, RemoteRing, RingConfig, RingConn, RingError,
    RingFault, RingStats, MAX_SLOTS,
};
use crate::verbs::{Completion, DoorbellError, Verbs, VerbsError};

/// Completions polled per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// Counters of a driver, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// `flush` calls.
    pub flushes: u64,
    /// Doorbells rung: at most one per flush, however many connections
    /// staged work requests in it.
    pub doorbells: u64,
    /// `poll_cq` calls.
    pub cq_polls: u64,
    /// Completions polled.
    pub completions: u64,
    /// Completions that named no connection of the driver (a slot that is
    /// free, or a `qp_num` that is not the slot's); ignored.
    pub stray_completions: u64,
    /// Parks that waited on the completion channel.
    pub parks: u64,
    /// Parks that found completions or input after arming the completion
    /// queue and returned at once.
    pub parks_skipped: u64,
}

fn add_ring_stats(t: &mut RingStats, s: &RingStats) {
    t.data_writes += s.data_writes;
    t.credit_writes += s.credit_writes;
    t.frames_received += s.frames_received;
    t.credits_received += s.credits_received;
    t.wraps += s.wraps;
    t.ring_stalls += s.ring_stalls;
    t.recv_stalls += s.recv_stalls;
}

// Connected is the common, hot case: kept inline in the slot vector
// rather than boxed, at the cost of larger free and prepared slots.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Slot {
    Free,
    /// A connection handle with nothing behind it yet: no queue pair, no
    /// registered memory, no share of the completion queue
    /// ([`RdmaDriver::reserve`]).
    Reserved,
    Prepared(PreparedRing),
    Connected(RingConn),
}

/// The RDMA backend's [`Driver`]: one per reactor, over the reactor's
/// [`Verbs`] (a protection domain, one completion queue, a queue pair per
/// connection). Every connection runs the ring protocol
/// ([`RingConn`]; `docs/backends/rdma.md`) with the sizes of one
/// [`RingConfig`].
///
/// A connection is set up in two steps around the out-of-band exchange:
/// [`prepare`](Self::prepare) takes a connected queue pair, registers the
/// connection's memory, posts its receive WRs and returns the
/// [`RemoteRing`] to send to the peer; [`connect`](Self::connect) starts
/// the protocol once the peer's arrives. Frames may be queued in between;
/// they leave once connected.
///
/// A connection whose peer must first prove something out of band (the
/// cluster token, over the side channel) can take its handle before any
/// resource: [`reserve`](Self::reserve) holds a slot and nothing else,
/// and [`prepare_reserved`](Self::prepare_reserved) later prepares it as
/// `prepare` would. A reserved connection behaves like a prepared one that
/// is not connected: its frames wait behind back-pressure, `detach` frees
/// it, and it counts in [`len`](Self::len).
///
/// Verbs with a completion channel ([`Verbs::can_sleep`]) park the reactor
/// in the driver's own wait ([`Sleep::Own`]): arm the completion queue,
/// check it once more, then `poll(2)` on the channel, the asynchronous
/// events and the reactor's waker. The simulator has none: [`Sleep::Never`],
/// its reactor polls.
#[derive(Debug)]
pub struct RdmaDriver<V> {
    verbs: V,
    cfg: RingConfig,
    max_frame: usize,
    slots: Vec<Slot>,
    free: Vec<u32>,
    failed: VecDeque<(ConnId, TransportError)>,
    /// Completion-queue entries the connections may occupy at once.
    cq_reserved: u64,
    wcs: [Completion; POLL_BATCH],
    /// Where the next receive pass starts, so no connection is always
    /// first.
    next: usize,
    stats: RdmaStats,
    /// The counters of connections detached so far, added up.
    retired: RingStats,
}

impl<V: Verbs> RdmaDriver<V> {
    /// A driver with no connection over `verbs`; every connection will
    /// use the sizes of `cfg` and carry frames of up to
    /// `cfg.max_frame_len` bytes (by default min(ring / 2, staging)).
    pub fn new(verbs: V, cfg: RingConfig) -> Result<Self, RingError> {
        let max_frame = check_config(&cfg)?;
        Ok(Self {
            verbs,
            cfg,
            max_frame,
            slots: Vec::new(),
            free: Vec::new(),
            failed: VecDeque::new(),
            cq_reserved: 0,
            wcs: [Completion::default(); POLL_BATCH],
            next: 0,
            stats: RdmaStats::default(),
            retired: RingStats::default(),
        })
    }

    /// Take the connected queue pair `qpn` as a new connection: register
    /// its staging region and receive ring in the protection domain and
    /// post its receive WRs. Returns its handle and what to send the peer.
    /// On error the queue pair stays the caller's and nothing stays
    /// registered.
    pub fn prepare(&mut self, qpn: u32) -> Result<(ConnId, RemoteRing), RingError> {
        let index = self.next_index()?;
        let prepared = self.prepare_ring(qpn, index)?;
        let local = prepared.local_ring();
        self.take_index(index, Slot::Prepared(prepared));
        Ok((ConnId::new(index), local))
    }

    /// A new connection's handle with nothing behind it: no queue pair,
    /// no registered memory, no share of the completion queue. Until
    /// [`prepare_reserved`](Self::prepare_reserved) it is like a prepared
    /// connection that is not connected: frames wait behind back-pressure
    /// and [`detach`](Driver::detach) frees the slot.
    pub fn reserve(&mut self) -> Result<ConnId, RingError> {
        let index = self.next_index()?;
        self.take_index(index, Slot::Reserved);
        Ok(ConnId::new(index))
    }

    /// Prepare the reserved connection `conn` on the connected queue pair
    /// `qpn`, as [`prepare`](Self::prepare) prepares a new one. Returns
    /// what to send the peer. On error `conn` stays reserved, the queue
    /// pair stays the caller's and nothing stays registered.
    pub fn prepare_reserved(&mut self, conn: ConnId, qpn: u32) -> Result<RemoteRing, RingError> {
        if !matches!(self.slots.get(conn.index()), Some(Slot::Reserved)) {
            return Err(RingError::NotReserved(conn));
        }
        let prepared = self.prepare_ring(qpn, conn.index() as u32)?;
        let local = prepared.local_ring();
        self.slots[conn.index()] = Slot::Prepared(prepared);
        Ok(local)
    }

    /// The slot a new connection would take.
    fn next_index(&self) -> Result<u32, RingError> {
        match self.free.last() {
            Some(&i) => Ok(i),
            None if self.slots.len() < MAX_SLOTS => Ok(self.slots.len() as u32),
            None => Err(RingError::TooManyConnections),
        }
    }

    /// Put `slot` at `index`, the one [`next_index`](Self::next_index)
    /// returned.
    fn take_index(&mut self, index: u32, slot: Slot) {
        if self.free.pop().is_none() {
            self.slots.push(Slot::Free);
        }
        self.slots[index as usize] = slot;
    }

    /// Register the ring and staging of a connection in slot `index` on
    /// `qpn` and post its receives, its share of the completion queue
    /// taken.
    fn prepare_ring(&mut self, qpn: u32, index: u32) -> Result<PreparedRing, RingError> {
        let caps = self.verbs.qp_caps(qpn).ok_or(RingError::UnknownQp(qpn))?;
        let share = u64::from(caps.max_send_wr) + u64::from(self.cfg.recv_depth);
        let depth = u64::from(self.verbs.cq_depth());
        if self.cq_reserved + share > depth {
            return Err(RingError::Config(format!(
                "CQ depth {depth} cannot hold another connection's {} send + {} receive \
                 completions ({} taken by the driver's connections)",
                caps.max_send_wr, self.cfg.recv_depth, self.cq_reserved
            )));
        }
        let prepared = PreparedRing::new(&mut self.verbs, qpn, index, &self.cfg, self.max_frame)?;
        self.cq_reserved += prepared.cq_share();
        Ok(prepared)
    }

    /// Start the ring protocol of the prepared connection `conn` against
    /// the peer's ring. A peer ring that cannot carry the driver's frames
    /// is refused, and the connection stays prepared.
    pub fn connect(&mut self, conn: ConnId, remote: RemoteRing) -> Result<(), RingError> {
        let Some(slot) = self.slots.get_mut(conn.index()) else {
            return Err(RingError::NotPrepared(conn));
        };
        if !matches!(slot, Slot::Prepared(_)) {
            return Err(RingError::NotPrepared(conn));
        }
        check_remote(&remote, self.max_frame)?;
        let Slot::Prepared(prepared) = std::mem::replace(slot, Slot::Free) else {
            return Err(RingError::NotPrepared(conn));
        };
        let (ring, failed) = prepared.connect(&mut self.verbs, remote, self.max_frame);
        *slot = Slot::Connected(ring);
        if let Some(e) = failed {
            self.failed.push_back((conn, e));
        }
        Ok(())
    }

    /// The check [`connect`](Self::connect) runs on the peer's ring
    /// ([`RemoteRing::check`] with the driver's frame limit), to run it
    /// earlier: before taking the queue pair to RTR and RTS and telling
    /// the peer we are ready.
    pub fn check_remote(&self, remote: &RemoteRing) -> Result<(), RingError> {
        check_remote(remote, self.max_frame)
    }

    /// The verbs.
    pub fn verbs(&self) -> &V {
        &self.verbs
    }

    /// The verbs, mutably: to create and connect queue pairs for new
    /// connections. Work requests posted through it on the driver's queue
    /// pairs would break their connections' accounting.
    pub fn verbs_mut(&mut self) -> &mut V {
        &mut self.verbs
    }

    /// The ring sizes every connection uses.
    pub fn config(&self) -> &RingConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> RdmaStats {
        self.stats
    }

    /// The ring state of `conn`, once connected.
    pub fn ring(&self, conn: ConnId) -> Option<&RingConn> {
        match self.slots.get(conn.index()) {
            Some(Slot::Connected(ring)) => Some(ring),
            _ => None,
        }
    }

    /// The counters of every ring the driver has connected, those
    /// detached since included, added up.
    pub fn ring_totals(&self) -> RingStats {
        let mut t = self.retired;
        for slot in &self.slots {
            if let Slot::Connected(ring) = slot {
                add_ring_stats(&mut t, &ring.stats());
            }
        }
        t
    }

    /// Connections held: reserved, prepared or connected.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// True when the driver holds no connection.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Poll the completion queue until it is empty (bounded by its depth)
    /// and hand each completion to its connection. True if any arrived.
    fn reap(&mut self) -> bool {
        let rounds = self.verbs.cq_depth() as usize / POLL_BATCH + 2;
        let mut any = false;
        for _ in 0..rounds {
            self.stats.cq_polls += 1;
            let n = match self.verbs.poll_cq(&mut self.wcs) {
                Ok(n) => n,
                Err(e) => {
                    // The queue every connection reports into is broken.
                    self.fail_all(&RingFault::Verbs(e));
                    return any;
                }
            };
            self.stats.completions += n as u64;
            for k in 0..n {
                let wc = self.wcs[k];
                self.dispatch(&wc);
            }
            any |= n > 0;
            if n < POLL_BATCH {
                break;
            }
        }
        any
    }

    fn dispatch(&mut self, wc: &Completion) {
        let i = wr_slot(wc.wr_id);
        match self.slots.get_mut(i) {
            Some(Slot::Connected(ring)) if ring.qpn() == wc.qp_num => {
                // A failed connection's flushed WRs tell nothing new.
                if ring.fault().is_some() {
                    return;
                }
                if let Err(f) = ring.on_completion(&mut self.verbs, wc) {
                    if let Some(e) = ring.fail(f) {
                        self.failed.push_back((ConnId::new(i as u32), e));
                    }
                }
            }
            Some(Slot::Prepared(prepared)) if prepared.qpn() == wc.qp_num => prepared.hold(*wc),
            _ => self.stats.stray_completions += 1,
        }
    }

    /// One submission: poll completions, then stage every connection's
    /// owed credits and the frames its credits allow, and ring the doorbell
    /// once if anything was staged. True if it took in completions or
    /// posted anything.
    fn submit(&mut self) -> bool {
        let reaped = self.reap();
        let mut posted = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Slot::Connected(ring) = slot else {
                continue;
            };
            if !ring.tx_pending() {
                continue;
            }
            match ring.post(&mut self.verbs) {
                Ok(n) => posted += n,
                Err(f) => {
                    if let Some(e) = ring.fail(f) {
                        self.failed.push_back((ConnId::new(i as u32), e));
                    }
                }
            }
        }
        if posted > 0 {
            match self.verbs.ring_doorbell() {
                Ok(()) => self.stats.doorbells += 1,
                Err(e) => self.fail_doorbell(e),
            }
        }
        reaped || posted > 0
    }

    /// [`Driver::park`], also ending when one of `extra` is readable (a
    /// driver that wraps this one and waits on descriptors of its own: the
    /// side channels of connections being set up).
    pub fn park_with(
        &mut self,
        waker: ParkWaker<'_>,
        extra: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Option<ParkEnd> {
        if !self.verbs.can_sleep() {
            return None;
        }
        self.submit();
        if let Err(e) = self.verbs.arm_cq() {
            tracing::warn!(%e, "rdma: cannot arm the completion queue; polling instead");
            return None;
        }
        if self.reap() || self.input_waiting() {
            self.stats.parks_skipped += 1;
            return Some(ParkEnd::Input);
        }
        self.stats.parks += 1;
        let mut fds = Vec::with_capacity(2 + extra.len());
        self.verbs.event_fds(&mut fds);
        fds.extend_from_slice(extra);
        let end = park_fds(waker, &fds, &[], timeout);
        drop(fds);
        self.verbs.take_events();
        Some(end)
    }

    /// Input the next receive pass would deliver, or a failure to report.
    fn input_waiting(&self) -> bool {
        !self.failed.is_empty()
            || self
                .slots
                .iter()
                .any(|s| matches!(s, Slot::Connected(ring) if ring.rx_pending()))
    }

    fn fail_all(&mut self, fault: &RingFault) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let first = match slot {
                Slot::Free | Slot::Reserved => None,
                Slot::Prepared(p) => p.fail(fault.clone()),
                Slot::Connected(ring) => ring.fail(fault.clone()),
            };
            if let Some(e) = first {
                self.failed.push_back((ConnId::new(i as u32), e));
            }
        }
    }

    /// The doorbell failed: every connection whose chain was refused
    /// fails (its unposted WRs will never complete), or every connection
    /// when an error names none.
    fn fail_doorbell(&mut self, e: DoorbellError) {
        for &e in e.errors() {
            let i = match e {
                VerbsError::PostSend { wr_id, .. } => wr_slot(wr_id),
                _ => return self.fail_all(&RingFault::Verbs(e)),
            };
            if let Some(Slot::Connected(ring)) = self.slots.get_mut(i) {
                if let Some(err) = ring.fail(RingFault::Verbs(e)) {
                    self.failed.push_back((ConnId::new(i as u32), err));
                }
            }
        }
    }
}

impl<V: Verbs> Driver for RdmaDriver<V> {
    /// The configured frame limit: at most half a ring, the staging length
    /// and the queue pairs' maximum message (checked per connection).
    fn max_frame_len(&self) -> usize {
        self.max_frame
    }

    /// Doorbells, and the rings' stalls for credit and for the peer's
    /// receive work requests (detached connections' included).
    fn counters(&self) -> DriverCounters {
        let rings = self.ring_totals();
        DriverCounters {
            doorbells: Some(self.stats.doorbells),
            credit_stalls: Some(rings.ring_stalls),
            receive_stalls: Some(rings.recv_stalls),
            ..DriverCounters::default()
        }
    }

    fn tx_reserve(
        &mut self,
        conn: ConnId,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransportError> {
        let ring = match self.slots.get_mut(conn.index()) {
            Some(Slot::Connected(ring)) => ring,
            // Not connected yet: frames wait in the message layer.
            Some(Slot::Prepared(p)) => return p.check().map(|()| None),
            Some(Slot::Reserved) => return Ok(None),
            _ => return Err(TransportError::Closed),
        };
        let healthy = ring.fault().is_none();
        match ring.reserve(&self.verbs, len) {
            Ok(true) => Ok(ring.reserved(&self.verbs)),
            Ok(false) => Ok(None),
            Err(e) => {
                if healthy {
                    if let Err(first) = ring.check() {
                        self.failed.push_back((conn, first));
                    }
                }
                Err(e)
            }
        }
    }

    fn tx_commit(&mut self, conn: ConnId, len: usize) {
        if let Some(Slot::Connected(ring)) = self.slots.get_mut(conn.index()) {
            ring.tx_commit(len);
        }
    }

    /// Frames committed and not yet posted, or credits due to the peer.
    fn tx_pending(&self, conn: ConnId) -> bool {
        self.ring(conn).is_some_and(RingConn::tx_pending)
    }

    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(ConnId, &[u8]),
    ) -> usize {
        self.reap();
        let n = self.slots.len();
        if n == 0 {
            return 0;
        }
        let start = self.next % n;
        self.next = start + 1;
        let mut delivered = 0;
        for k in 0..n {
            let i = (start + k) % n;
            let Slot::Connected(ring) = &mut self.slots[i] else {
                continue;
            };
            let id = ConnId::new(i as u32);
            let (got, fault) = ring.deliver(&self.verbs, max, &mut |f: &[u8]| sink(id, f));
            delivered += got;
            if let Some(e) = fault.and_then(|f| ring.fail(f)) {
                self.failed.push_back((id, e));
            }
        }
        delivered
    }

    /// Poll completions, then stage every connection's owed credits and
    /// the frames its credits allow, and ring the doorbell once if anything
    /// was staged.
    fn flush(&mut self, _now: Instant) -> bool {
        self.stats.flushes += 1;
        self.submit()
    }

    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        self.failed.pop_front()
    }

    /// Destroy the connection's queue pair (its completions go with it)
    /// and deregister its regions.
    fn detach(&mut self, conn: ConnId) {
        let Some(slot) = self.slots.get_mut(conn.index()) else {
            return;
        };
        let old = std::mem::replace(slot, Slot::Free);
        let qpn = match &old {
            Slot::Free => return,
            // Nothing was allocated for it.
            Slot::Reserved => None,
            Slot::Prepared(p) => Some(p.qpn()),
            Slot::Connected(ring) => Some(ring.qpn()),
        };
        // The queue pair goes first, so no work request can still reach
        // the regions when they are deregistered.
        if let Some(Err(e)) = qpn.map(|q| self.verbs.destroy_qp(q)) {
            tracing::warn!(%e, "rdma: destroying a connection's queue pair failed");
        }
        let share = match old {
            Slot::Free | Slot::Reserved => 0,
            Slot::Prepared(p) => {
                p.release(&mut self.verbs);
                p.cq_share()
            }
            Slot::Connected(ring) => {
                add_ring_stats(&mut self.retired, &ring.stats());
                ring.release(&mut self.verbs);
                ring.cq_share()
            }
        };
        self.cq_reserved -= share;
        self.free.push(conn.index() as u32);
        self.failed.retain(|(c, _)| *c != conn);
    }

    fn sleep(&self) -> Sleep {
        if self.verbs.can_sleep() {
            Sleep::Own
        } else {
            Sleep::Never
        }
    }

    /// Submit what is queued, arm the completion queue
    /// (`ibv_req_notify_cq`), poll it once more (a completion that arrived
    /// before the arming raises no event), and only then wait in `poll(2)`
    /// on the completion channel, the asynchronous events and the waker.
    /// After the wait the events are consumed and acknowledged.
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        self.park_with(waker, &[], timeout)
    }
}

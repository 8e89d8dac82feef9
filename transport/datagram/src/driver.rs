//! [`DatagramDriver`]: every connection of one reactor over one datagram
//! queue, each with its own [`ReliableCore`].
//!
//! DPDK-style hardware gives each core one receive and one transmit queue,
//! shared by all the core's connections. Packets carry the receiving end's
//! connection id (`dst_conn`, see [`crate::packet`]): its low bits are the
//! connection's slot in the driver, its high bits a generation that changes
//! whenever the slot is reused, so a receive pass routes each packet with
//! an index and a comparison, and a late packet of a closed connection
//! does not reach the next one. Packets whose id names no connected slot
//! are counted and dropped.
//!
//! The generation has 12 bits, so a slot's ids repeat every 4096 reuses.
//! A slot whose generation wraps is therefore parked for
//! [`DatagramDriver::reuse_quarantine`] before it is used again (other
//! slots serve meanwhile): no id comes back within that time of the end of
//! the connection that last had it, which outlasts every retransmission of
//! a peer that is not answered. The 32 bits of an id are all the packet
//! header has; more generation bits would be fewer slots, and would only
//! postpone the wrap.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::time::TimeSpec;
use starwire_transport::reactor::{ParkEnd, ParkWaker};
use starwire_transport::{ConnId, Driver, DriverCounters, Sleep, StreamDriver, TransportError};
use thiserror::Error;

use crate::core::{ConfigError, ConnIds, CoreStats, ReliableConfig, ReliableCore};
use crate::link::{DatagramLink, LinkError};
use crate::packet::{PacketError, PacketHeader};

/// Bits of a connection id that name its slot.
const SLOT_BITS: u32 = 20;
const SLOT_MASK: u32 = (1 << SLOT_BITS) - 1;
/// Generations a slot goes through before its ids repeat.
const GENERATIONS: u32 = 1 << (u32::BITS - SLOT_BITS);
/// Connections one driver can hold (slots parked after a generation
/// wrap, [`DatagramDriver::reuse_quarantine`], count).
pub const MAX_CONNECTIONS: usize = 1 << SLOT_BITS;
/// Longest a parked driver sleeps before its reactor polls again.
pub const IDLE_NAP: Duration = Duration::from_micros(20);

/// Setting up a driver or one of its connections failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DatagramError {
    /// The reliability configuration does not fit the link.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The connection is not one prepared and not yet connected.
    #[error("{0} is not a prepared connection of this driver")]
    NotPrepared(ConnId),
    /// The driver holds [`MAX_CONNECTIONS`] connections, slots parked
    /// after a generation wrap included.
    #[error("the driver already holds {MAX_CONNECTIONS} connections")]
    TooManyConnections,
}

/// Counters of a driver, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DatagramStats {
    /// `flush` calls.
    pub flushes: u64,
    /// Bursts that handed packets to the link (`tx_burst_flush`): at most
    /// one per flush, whatever the number of connections with packets.
    pub tx_bursts: u64,
    /// Packets in those bursts.
    pub packets_sent: u64,
    /// Receive passes (`rx_burst` on the link): one per `rx_burst`.
    pub rx_bursts: u64,
    /// Packets taken from the link.
    pub packets_received: u64,
    /// Packets dropped for a bad checksum.
    pub dropped_corrupt: u64,
    /// Packets dropped as malformed (bad magic, version, lengths, flags).
    pub dropped_malformed: u64,
    /// Packets whose `dst_conn` names no live connection of the driver
    /// (unknown, not yet connected, closed or failed).
    pub dropped_unknown_conn: u64,
}

#[derive(Debug)]
struct Slot {
    /// Changes whenever the slot is freed; part of the connection id.
    generation: u32,
    /// Prepared or connected.
    held: bool,
    /// The reliability core, once connected.
    core: Option<ReliableCore>,
    /// Why the connection failed, once reported by `poll_failure`.
    failure: Option<String>,
    /// Frames the current receive pass may still lend.
    budget: usize,
    /// Detached, its core winding down ([`ReliableCore::handle_close`]):
    /// the slot goes back to the free list once the core is done.
    lingering: bool,
}

impl Slot {
    fn id(&self, index: usize) -> u32 {
        (self.generation << SLOT_BITS) | index as u32
    }

    /// The core of a connection that has not failed.
    fn live(&mut self) -> Option<&mut ReliableCore> {
        if self.failure.is_some() {
            return None;
        }
        self.core.as_mut().filter(|c| c.check().is_ok())
    }
}

/// The datagram backend's [`Driver`]: one per reactor, over the reactor's
/// one [`DatagramLink`] (a DPDK queue pair, or [`LossyLink`] in tests).
/// Every connection runs its own [`ReliableCore`] with the settings of
/// one [`ReliableConfig`].
///
/// A connection is set up in two steps around the out-of-band exchange
/// (there is no handshake on the wire): [`prepare`](Self::prepare) takes a
/// slot and returns the connection id the peer must address, and
/// [`connect`](Self::connect) starts reliable delivery toward the peer's
/// id. Frames may be queued in between; they leave once connected.
///
/// A [`flush`](Driver::flush) runs every connection's timers and writes
/// every packet they have to send into one burst (one
/// [`DatagramLink::tx_burst_flush`]); when the link's transmit ring fills,
/// the rest waits for the next flush, which starts with the connection that
/// did not fit. An [`rx_burst`](Driver::rx_burst) takes one burst of up to
/// [`ReliableConfig::rx_batch`] packets from the link and routes each to
/// its connection. A DPDK queue has no receive interrupt, so a parked
/// driver naps and polls again ([`Driver::park`]).
///
/// [`LossyLink`]: crate::LossyLink
#[derive(Debug)]
pub struct DatagramDriver<L> {
    link: L,
    cfg: ReliableConfig,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Slots whose generation wrapped, oldest first, with the first `now`
    /// the driver saw after they were freed (none yet: not stamped): not
    /// reused until [`reuse_quarantine`](Self::reuse_quarantine) after it.
    parked: VecDeque<(u32, Option<Instant>)>,
    /// The latest `now` given to `flush` or `rx_burst`.
    last_now: Option<Instant>,
    failed: VecDeque<(ConnId, TransportError)>,
    /// Where the next flush starts writing packets.
    next_tx: usize,
    stats: DatagramStats,
    /// The reliability counters of connections already detached.
    retired: CoreStats,
    /// Slots whose `lingering` is set: an idle turn skips the scan of
    /// [`wind_down`](Self::wind_down) when there are none.
    lingering: usize,
    /// Prepared connections whose out-of-band exchange is under way,
    /// stepped by every flush.
    exchanges: Vec<(ConnId, Box<dyn Exchange<L>>)>,
}

/// A prepared connection's out-of-band exchange that is under way (the
/// DPDK bootstrap, over the TCP stream the connection came on): the
/// driver steps it on every [`flush`](Driver::flush) until it is done, so
/// a peer that is slow to answer, or never does, holds up nothing but its
/// own connection.
pub trait Exchange<L>: std::fmt::Debug + Send {
    /// Advance without blocking. `Ok(true)`: done (the exchange connected
    /// `conn`, [`DatagramDriver::connect`]); `Ok(false)`: waiting for the
    /// peer; an error fails the connection (it is reported by
    /// [`poll_failure`](Driver::poll_failure)).
    fn step(
        &mut self,
        driver: &mut DatagramDriver<L>,
        conn: ConnId,
        now: Instant,
    ) -> Result<bool, TransportError>;
}

impl<L: DatagramLink> DatagramDriver<L> {
    /// A driver with no connection over `link`; every connection will use
    /// `cfg`, with packets sized to the link's MTU.
    pub fn new(link: L, cfg: ReliableConfig) -> Result<Self, ConfigError> {
        // The checks of a core are the checks of the configuration.
        ReliableCore::new(cfg.clone(), link.mtu(), ConnIds { local: 0, peer: 0 })?;
        Ok(Self {
            link,
            cfg,
            slots: Vec::new(),
            free: Vec::new(),
            parked: VecDeque::new(),
            last_now: None,
            failed: VecDeque::new(),
            next_tx: 0,
            stats: DatagramStats::default(),
            retired: CoreStats::default(),
            lingering: 0,
            exchanges: Vec::new(),
        })
    }

    /// Run `exchange` for the prepared connection `conn` until it connects
    /// it or fails; it is dropped, unfinished, if `conn` is detached first.
    pub fn begin_exchange(&mut self, conn: ConnId, exchange: Box<dyn Exchange<L>>) {
        self.exchanges.push((conn, exchange));
    }

    /// Connections whose exchange is under way.
    pub fn exchanging(&self) -> usize {
        self.exchanges.len()
    }

    /// Step every exchange under way; one that fails fails its connection.
    fn step_exchanges(&mut self, now: Instant) {
        if self.exchanges.is_empty() {
            return;
        }
        let mut going = std::mem::take(&mut self.exchanges);
        going.retain_mut(|(conn, x)| match x.step(self, *conn, now) {
            Ok(done) => !done,
            Err(e) => {
                if let Some(slot) = self.slots.get_mut(conn.index()).filter(|s| s.held) {
                    if slot.failure.is_none() {
                        slot.failure = Some(e.to_string());
                        self.failed.push_back((*conn, e));
                    }
                }
                false
            }
        });
        // Exchanges begun while these stepped go after them.
        going.append(&mut self.exchanges);
        self.exchanges = going;
    }

    /// How long a slot whose generation wrapped is kept from reuse after
    /// the connection that had it was freed: the longest a peer goes on
    /// retransmitting to a connection that does not answer before it
    /// fails (`dead_after_timeouts` timeouts, each at most `rto_max`),
    /// and one `rto_max` more for the packets on their way. Within it,
    /// none of the slot's 4096 ids is handed out a second time.
    pub fn reuse_quarantine(&self) -> Duration {
        self.cfg
            .rto_max
            .saturating_mul(self.cfg.dead_after_timeouts.saturating_add(1))
    }

    /// The driver's clock is the `now` of its calls: slots parked since
    /// the last one are stamped with this one, which is no earlier than
    /// the moment they were freed.
    fn observe(&mut self, now: Instant) {
        let now = self.last_now.map_or(now, |t| t.max(now));
        self.last_now = Some(now);
        for (_, since) in self.parked.iter_mut().rev() {
            if since.is_some() {
                break;
            }
            *since = Some(now);
        }
    }

    /// The oldest parked slot, once its quarantine is over.
    fn unpark(&mut self) -> Option<usize> {
        let (Some((index, Some(since))), Some(now)) = (self.parked.front(), self.last_now) else {
            return None;
        };
        if now.saturating_duration_since(*since) < self.reuse_quarantine() {
            return None;
        }
        let index = *index as usize;
        self.parked.pop_front();
        Some(index)
    }

    /// Take a slot for a new connection. Returns its handle and the id the
    /// peer addresses its packets to (to send in the out-of-band exchange).
    /// A slot whose generation wrapped is not taken before its
    /// [`reuse_quarantine`](Self::reuse_quarantine) is over.
    pub fn prepare(&mut self) -> Result<(ConnId, u32), DatagramError> {
        let index = match self.free.pop() {
            Some(i) => i as usize,
            None => match self.unpark() {
                Some(i) => i,
                None if self.slots.len() < MAX_CONNECTIONS => {
                    self.slots.push(Slot {
                        generation: 0,
                        held: false,
                        core: None,
                        failure: None,
                        budget: 0,
                        lingering: false,
                    });
                    self.slots.len() - 1
                }
                None => return Err(DatagramError::TooManyConnections),
            },
        };
        let slot = &mut self.slots[index];
        slot.held = true;
        slot.failure = None;
        slot.lingering = false;
        Ok((ConnId::new(index as u32), slot.id(index)))
    }

    /// Start reliable delivery on the prepared connection `conn` toward the
    /// peer's connection `peer_id`.
    pub fn connect(&mut self, conn: ConnId, peer_id: u32) -> Result<(), DatagramError> {
        let index = conn.index();
        let mtu = self.link.mtu();
        let Some(slot) = self.slots.get_mut(index) else {
            return Err(DatagramError::NotPrepared(conn));
        };
        if !slot.held || slot.core.is_some() {
            return Err(DatagramError::NotPrepared(conn));
        }
        let ids = ConnIds {
            local: slot.id(index),
            peer: peer_id,
        };
        slot.core = Some(ReliableCore::new(self.cfg.clone(), mtu, ids)?);
        Ok(())
    }

    /// The id the peer addresses `conn`'s packets to.
    pub fn local_id(&self, conn: ConnId) -> Option<u32> {
        let slot = self.slots.get(conn.index()).filter(|s| s.held)?;
        Some(slot.id(conn.index()))
    }

    /// The reliability core of `conn`, once connected.
    pub fn core(&self, conn: ConnId) -> Option<&ReliableCore> {
        self.slots.get(conn.index())?.core.as_ref()
    }

    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The link, mutably.
    pub fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// The settings every connection uses.
    pub fn config(&self) -> &ReliableConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> DatagramStats {
        self.stats
    }

    /// The reliability counters summed over every connection this driver
    /// has held, detached ones included (frames, retransmissions, acks).
    pub fn core_totals(&self) -> CoreStats {
        let mut t = self.retired;
        for core in self.slots.iter().filter_map(|s| s.core.as_ref()) {
            t.accumulate(core.stats());
        }
        t
    }

    /// Connections held, prepared or connected (not those detached and
    /// still lingering).
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.held).count()
    }

    /// Detached connections whose cores still linger.
    pub fn lingering(&self) -> usize {
        self.lingering
    }

    /// Close the cores of connections detached since the last flush, and
    /// free the slots of those that are done.
    fn wind_down(&mut self, now: Instant) {
        if self.lingering == 0 {
            return;
        }
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if !slot.lingering {
                continue;
            }
            let done = match slot.core.as_mut() {
                Some(core) => {
                    core.handle_close(now);
                    core.is_wound_down(now)
                }
                None => true,
            };
            if done {
                slot.lingering = false;
                self.lingering -= 1;
                Self::free_slot(
                    slot,
                    i,
                    &mut self.free,
                    &mut self.parked,
                    &mut self.retired,
                    &mut self.link,
                );
            }
        }
    }

    /// Give slot `index` back: its core's counters retire, and its id
    /// changes, so packets still in flight to it are dropped as unknown;
    /// the link forgets the old id ([`DatagramLink::forget`]). A slot
    /// whose generation wraps is parked, stamped by the next call that
    /// brings a `now` (see [`reuse_quarantine`](Self::reuse_quarantine)).
    fn free_slot(
        slot: &mut Slot,
        index: usize,
        free: &mut Vec<u32>,
        parked: &mut VecDeque<(u32, Option<Instant>)>,
        retired: &mut CoreStats,
        link: &mut L,
    ) {
        if let Some(core) = slot.core.take() {
            retired.accumulate(core.stats());
        }
        link.forget(slot.id(index));
        slot.generation = (slot.generation + 1) % GENERATIONS;
        if slot.generation == 0 {
            parked.push_back((index as u32, None));
        } else {
            free.push(index as u32);
        }
    }

    /// True when the driver holds no connection.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Report connections whose core failed since the last call.
    fn take_failures(&mut self) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            // A lingering core belongs to no connection any more.
            if slot.failure.is_some() || slot.lingering {
                continue;
            }
            if let Some(Err(e)) = slot.core.as_ref().map(ReliableCore::check) {
                slot.failure = Some(match &e {
                    TransportError::Link(why) => why.clone(),
                    other => other.to_string(),
                });
                self.failed.push_back((ConnId::new(i as u32), e));
            }
        }
    }

    /// The link failed: every connection fails with it.
    fn fail_all(&mut self, e: &LinkError) {
        tracing::warn!(%e, "datagram link failed");
        let why = format!("datagram link: {e}");
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if slot.held && slot.failure.is_none() {
                slot.failure = Some(why.clone());
                self.failed
                    .push_back((ConnId::new(i as u32), TransportError::Link(why.clone())));
            }
        }
    }

    fn live(&mut self, conn: ConnId) -> Result<Option<&mut ReliableCore>, TransportError> {
        match self.slots.get_mut(conn.index()) {
            Some(Slot {
                held: true,
                failure: Some(why),
                ..
            }) => Err(TransportError::Link(why.clone())),
            Some(slot) if slot.held => Ok(slot.core.as_mut()),
            _ => Err(TransportError::Closed),
        }
    }
}

impl<L: DatagramLink> Driver for DatagramDriver<L> {
    fn max_frame_len(&self) -> usize {
        self.cfg.max_frame_len
    }

    /// Packets through the link, and the reliability cores'
    /// retransmissions, timeouts, congestion-window reductions and
    /// packets dropped for a full receive backlog (detached connections'
    /// included).
    fn counters(&self) -> DriverCounters {
        let core = self.core_totals();
        DriverCounters {
            packets_sent: Some(self.stats.packets_sent),
            packets_received: Some(self.stats.packets_received),
            retransmits: Some(core.retransmits),
            retransmit_timeouts: Some(core.timeouts),
            cwnd_reductions: Some(core.cwnd_reductions),
            backlog_drops: Some(core.dropped_backlog),
            ..DriverCounters::default()
        }
    }

    fn tx_reserve(
        &mut self,
        conn: ConnId,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransportError> {
        match self.live(conn)? {
            Some(core) => core.tx_reserve(len),
            // Not connected yet: frames wait in the message layer.
            None => Ok(None),
        }
    }

    fn tx_commit(&mut self, conn: ConnId, len: usize) {
        if let Ok(Some(core)) = self.live(conn) {
            core.tx_commit(len);
        }
    }

    /// Frames committed and not yet acknowledged by the peer.
    fn tx_pending(&self, conn: ConnId) -> bool {
        self.slots.get(conn.index()).is_some_and(|s| {
            s.failure.is_none()
                && s.core
                    .as_ref()
                    .is_some_and(|c| c.check().is_ok() && c.tx_pending())
        })
    }

    fn rx_burst(&mut self, now: Instant, max: usize, sink: &mut dyn FnMut(ConnId, &[u8])) -> usize {
        self.observe(now);
        // A connection detached since gives no frame more.
        self.wind_down(now);
        let Self {
            link,
            slots,
            stats,
            cfg,
            ..
        } = self;
        let mut delivered = 0;
        // Only a packet handed to a core can fail it here (timers run in
        // `flush`): a burst that handed none skips the failure scan.
        let mut handled = false;
        // Frames reassembled earlier go first, keeping each connection's
        // order; the rest of the budget is for this burst.
        for (i, slot) in slots.iter_mut().enumerate() {
            slot.budget = max;
            let Some(core) = slot.live() else { continue };
            let id = ConnId::new(i as u32);
            let n = core.deliver(max, &mut |f: &[u8]| sink(id, f));
            slot.budget -= n;
            delivered += n;
        }
        stats.rx_bursts += 1;
        let burst = link.rx_burst(now, cfg.rx_batch, &mut |pkt: &[u8]| {
            stats.packets_received += 1;
            let (hdr, payload) = match PacketHeader::decode(pkt) {
                Ok(x) => x,
                Err(PacketError::BadChecksum) => {
                    stats.dropped_corrupt += 1;
                    return;
                }
                Err(_) => {
                    stats.dropped_malformed += 1;
                    return;
                }
            };
            let index = (hdr.dst_conn & SLOT_MASK) as usize;
            let Some(slot) = slots.get_mut(index).filter(|s| s.id(index) == hdr.dst_conn) else {
                stats.dropped_unknown_conn += 1;
                return;
            };
            let core = match slot.core.as_mut() {
                Some(core) if slot.failure.is_none() && core.check().is_ok() => core,
                _ => {
                    stats.dropped_unknown_conn += 1;
                    return;
                }
            };
            let id = ConnId::new(index as u32);
            let before = slot.budget;
            handled = true;
            core.handle_parsed(
                now,
                &hdr,
                payload,
                &mut |f: &[u8]| sink(id, f),
                &mut slot.budget,
            );
            delivered += before - slot.budget;
        });
        // Frames the burst completed behind others that were waiting.
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let budget = slot.budget;
            let Some(core) = slot.live() else { continue };
            if budget == 0 || core.ready_frames() == 0 {
                continue;
            }
            let id = ConnId::new(i as u32);
            delivered += core.deliver(budget, &mut |f: &[u8]| sink(id, f));
        }
        match burst {
            Ok(_) if handled => self.take_failures(),
            Ok(_) => {}
            Err(e) => self.fail_all(&e),
        }
        delivered
    }

    /// Run every connection's timers, then write the packets they have to
    /// send (retransmissions, new data, due acknowledgements) into one
    /// burst.
    fn flush(&mut self, now: Instant) -> bool {
        self.stats.flushes += 1;
        self.observe(now);
        self.step_exchanges(now);
        self.wind_down(now);
        for slot in &mut self.slots {
            if let Some(core) = slot.live() {
                core.handle_timeout(now);
            }
        }
        let n = self.slots.len();
        let mtu = self.link.mtu();
        let start = if n == 0 { 0 } else { self.next_tx % n };
        let mut written = 0u64;
        let mut ring_full = false;
        let mut commit_error = None;
        'conns: for k in 0..n {
            let i = (start + k) % n;
            let Some(core) = self.slots[i].live() else {
                continue;
            };
            while core.wants_transmit(now) {
                let Some(buf) = self.link.tx_alloc(mtu) else {
                    // This connection goes first in the next burst.
                    self.next_tx = i;
                    ring_full = true;
                    break 'conns;
                };
                let Some(len) = core.poll_transmit(now, buf) else {
                    break;
                };
                if let Err(e) = self.link.tx_commit(len) {
                    commit_error = Some(e);
                    break 'conns;
                }
                written += 1;
            }
        }
        if !ring_full {
            self.next_tx = start + 1;
        }
        if let Some(e) = commit_error {
            self.fail_all(&e);
        }
        // Every flush offers the link its queued packets, new or not: a
        // device whose transmit ring was full keeps the rest queued, and
        // they leave with the next burst even when nothing new is written.
        match self.link.tx_burst_flush(now) {
            Ok(0) => {}
            Ok(sent) => {
                self.stats.tx_bursts += 1;
                self.stats.packets_sent += sent as u64;
            }
            Err(e) => self.fail_all(&e),
        }
        self.take_failures();
        written > 0
    }

    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        self.failed.pop_front()
    }

    /// Let the connection go. A core with a part left to play
    /// ([`ReliableCore::needs_linger`]: data received, whose
    /// acknowledgement the peer may still need, or frames of ours
    /// unacknowledged) lingers on in its slot, closed at the next flush:
    /// it acknowledges the peer's last packets (a `Goodbye` is complete
    /// for its sender only once acknowledged) and is freed once wound down,
    /// without reporting a failure. Otherwise the slot is freed at once.
    /// Either way its id then stops matching (a later connection in the
    /// slot gets another generation), so packets still in flight to it
    /// are dropped as unknown.
    fn detach(&mut self, conn: ConnId) {
        let index = conn.index();
        let Some(slot) = self.slots.get_mut(index) else {
            return;
        };
        if !slot.held {
            return;
        }
        slot.held = false;
        self.failed.retain(|(c, _)| *c != conn);
        self.exchanges.retain(|(c, _)| *c != conn);
        let linger =
            slot.failure.is_none() && slot.core.as_ref().is_some_and(ReliableCore::needs_linger);
        if linger {
            slot.lingering = true;
            self.lingering += 1;
        } else {
            Self::free_slot(
                slot,
                index,
                &mut self.free,
                &mut self.parked,
                &mut self.retired,
                &mut self.link,
            );
        }
    }

    /// A detached connection's core still owes its peer an
    /// acknowledgement or has frames unacknowledged (it lingers on after
    /// that, but only to answer retransmissions, which a stopping reactor
    /// need not wait for).
    fn winding_down(&self) -> bool {
        self.slots
            .iter()
            .filter(|s| s.lingering)
            .filter_map(|s| s.core.as_ref())
            .any(ReliableCore::owes_peer)
    }

    /// The earliest timer over the connections: a retransmission or
    /// delayed acknowledgement, or now when packets wait for room in the
    /// link's transmit ring.
    fn poll_timeout(&self) -> Option<Instant> {
        self.slots
            .iter()
            .filter(|s| s.failure.is_none())
            .filter_map(|s| s.core.as_ref())
            .filter_map(ReliableCore::poll_timeout)
            .min()
    }

    /// A datagram queue has no receive interrupt, so a park is a nap:
    /// the thread sleeps for at most [`IDLE_NAP`] and the reactor polls
    /// again. A polling thread that is descheduled for its whole time
    /// slice stalls its peer for that long; a napping one gives the core
    /// back and is run again soon after its timer, so on a core shared
    /// with other work it answers sooner.
    fn sleep(&self) -> Sleep {
        Sleep::Own
    }

    /// Sleep for `timeout`, at most [`IDLE_NAP`], in `ppoll(2)` on
    /// `waker`: work handed to the reactor (a wake-up) ends the nap at
    /// once instead of waiting for its end. `ppoll` takes the nap's
    /// length in nanoseconds, where `poll`'s milliseconds would stretch it
    /// fifty times. A failed wait (a signal) ends the nap early, as a
    /// timeout: the reactor just polls again.
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        let nap = TimeSpec::from_duration(timeout.min(IDLE_NAP));
        let mut fds = [PollFd::new(waker.fd, PollFlags::POLLIN)];
        let woke = matches!(ppoll(&mut fds, Some(nap), None), Ok(n) if n > 0)
            && fds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLIN));
        Some(if woke {
            ParkEnd::Waker
        } else {
            ParkEnd::Timeout
        })
    }
}

/// A link whose connections are set up over a TCP stream to the peer: the
/// two ends exchange their addresses and connection ids on it (a DPDK
/// link), and then the stream is done. Such a driver is a
/// [`StreamDriver`], so the roles that dial and accept streams (PS
/// reactors, workers) run over it unchanged.
pub trait StreamBootstrap: DatagramLink + Sized {
    /// Prepare one connection on `driver` and exchange addresses and ids
    /// with the peer over `stream`, connecting it toward the peer's: at
    /// once, or without blocking the reactor through
    /// [`DatagramDriver::begin_exchange`].
    fn bootstrap(
        driver: &mut DatagramDriver<Self>,
        stream: TcpStream,
    ) -> Result<ConnId, TransportError>;
}

impl<L: StreamBootstrap> StreamDriver for DatagramDriver<L> {
    fn attach_stream(&mut self, stream: TcpStream) -> Result<ConnId, TransportError> {
        L::bootstrap(self, stream)
    }
}

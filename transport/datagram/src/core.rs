//! [`ReliableCore`]: the sans-IO reliability protocol.
//!
//! The core owns no link and reads no clock. Callers feed it frames
//! ([`tx_reserve`](ReliableCore::tx_reserve) /
//! [`tx_commit`](ReliableCore::tx_commit)), received datagrams
//! ([`handle_packet`](ReliableCore::handle_packet)) and the time
//! ([`handle_timeout`](ReliableCore::handle_timeout)); it hands back packets
//! to send ([`poll_transmit`](ReliableCore::poll_transmit)), frames to
//! deliver ([`deliver`](ReliableCore::deliver)) and the next instant it needs
//! to be called ([`poll_timeout`](ReliableCore::poll_timeout)). See
//! `docs/backends/datagram.md` for the protocol.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use starwire_transport::TransportError;
use thiserror::Error;

use crate::packet::{PacketError, PacketFlags, PacketHeader, PACKET_HEADER_LEN, SACK_BITS};

/// A packet is deemed lost, and retransmitted without waiting for the
/// timer, once a packet transmitted this many transmissions after it has been
/// acknowledged (cumulatively or selectively). Tolerates that much reordering.
pub const FAST_RETRANSMIT_THRESHOLD: u64 = 3;
/// Largest allowed window: sequence numbers are compared modulo 2^32, so
/// everything in flight must stay well within half the space.
pub const MAX_WINDOW: u32 = 1 << 30;
/// Smallest MTU the core accepts.
pub const MIN_MTU: usize = PACKET_HEADER_LEN + 16;

/// Parameters of the reliability protocol. Both ends of a connection must
/// use the same `initial_seq` and `window`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReliableConfig {
    /// Sequence number of the first packet in each direction.
    pub initial_seq: u32,
    /// Largest frame (header included) accepted by `tx_reserve`.
    pub max_frame_len: usize,
    /// Send window and receive reorder buffer, in packets. Must hold the
    /// fragments of a `max_frame_len` frame.
    pub window: u32,
    /// Longest an acknowledgement of in-order data is delayed.
    pub ack_delay: Duration,
    /// In-order data packets after which an acknowledgement is sent at once.
    pub ack_every: u32,
    /// Retransmission timeout before the first RTT sample.
    pub rto_initial: Duration,
    /// Lower bound of the retransmission timeout.
    pub rto_min: Duration,
    /// Upper bound of the retransmission timeout, backoff included.
    pub rto_max: Duration,
    /// Consecutive retransmission timeouts without progress after which the
    /// peer is declared unreachable.
    pub dead_after_timeouts: u32,
    /// Packets a [`DatagramDriver`](crate::DatagramDriver) takes from its
    /// link per receive pass, for all its connections.
    pub rx_batch: usize,
}

impl Default for ReliableConfig {
    fn default() -> Self {
        Self {
            initial_seq: 0,
            max_frame_len: 64 * 1024,
            window: 256,
            ack_delay: Duration::from_micros(100),
            ack_every: 8,
            rto_initial: Duration::from_millis(5),
            rto_min: Duration::from_millis(1),
            rto_max: Duration::from_millis(500),
            dead_after_timeouts: 10,
            rx_batch: 64,
        }
    }
}

/// The connection ids a core's packets carry. Each end names the
/// connection with an id of its own; see [`crate::packet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnIds {
    /// Ours: packets we accept carry it as `dst_conn`, ours carry it as
    /// `src_conn`.
    pub local: u32,
    /// The peer's: packets we send carry it as `dst_conn`, packets we
    /// accept carry it as `src_conn`.
    pub peer: u32,
}

/// An inconsistent [`ReliableConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid reliability configuration: {0}")]
pub struct ConfigError(pub String);

/// Counters of one [`ReliableCore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Frames committed.
    pub frames_sent: u64,
    /// Frames delivered to a sink.
    pub frames_delivered: u64,
    /// Data packets sent for the first time.
    pub data_packets_sent: u64,
    /// Data packets sent again.
    pub retransmits: u64,
    /// Packets marked for retransmission by selective acknowledgements.
    pub fast_retransmits: u64,
    /// Standalone acknowledgement packets sent.
    pub acks_sent: u64,
    /// Datagrams handed to `handle_packet` or `handle_parsed`.
    pub packets_received: u64,
    /// Datagrams `handle_packet` dropped for a bad checksum (a driver
    /// verifies packets before routing them, and counts these itself).
    pub dropped_corrupt: u64,
    /// Datagrams `handle_packet` dropped as malformed (bad magic, version,
    /// lengths, flags).
    pub dropped_malformed: u64,
    /// Datagrams of another connection (ids other than [`ConnIds`]).
    pub dropped_foreign: u64,
    /// Acknowledgements ignored because they acknowledge unsent data.
    pub bad_acks: u64,
    /// Data packets already received (discarded).
    pub duplicates: u64,
    /// Data packets beyond the receive window (discarded).
    pub out_of_window: u64,
    /// Data packets buffered out of order.
    pub out_of_order: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// `tx_reserve` calls refused for a full window.
    pub window_full: u64,
}

impl CoreStats {
    /// Add `other`'s counters to these (totals over several connections).
    pub fn accumulate(&mut self, other: &CoreStats) {
        let CoreStats {
            frames_sent,
            frames_delivered,
            data_packets_sent,
            retransmits,
            fast_retransmits,
            acks_sent,
            packets_received,
            dropped_corrupt,
            dropped_malformed,
            dropped_foreign,
            bad_acks,
            duplicates,
            out_of_window,
            out_of_order,
            timeouts,
            window_full,
        } = *other;
        self.frames_sent += frames_sent;
        self.frames_delivered += frames_delivered;
        self.data_packets_sent += data_packets_sent;
        self.retransmits += retransmits;
        self.fast_retransmits += fast_retransmits;
        self.acks_sent += acks_sent;
        self.packets_received += packets_received;
        self.dropped_corrupt += dropped_corrupt;
        self.dropped_malformed += dropped_malformed;
        self.dropped_foreign += dropped_foreign;
        self.bad_acks += bad_acks;
        self.duplicates += duplicates;
        self.out_of_window += out_of_window;
        self.out_of_order += out_of_order;
        self.timeouts += timeouts;
        self.window_full += window_full;
    }
}

/// `a - b` in sequence space.
fn seq_diff(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

fn seq_lt(a: u32, b: u32) -> bool {
    seq_diff(a, b) < 0
}

#[derive(Debug)]
struct TxPacket {
    /// FIRST/LAST bits.
    flags: PacketFlags,
    data: Vec<u8>,
    sent_at: Option<Instant>,
    /// Transmission serial of the latest transmission (0: never sent).
    serial: u64,
    tx_count: u32,
    sacked: bool,
    /// Queued in `retx`.
    in_retx: bool,
}

#[derive(Debug)]
struct RxPacket {
    flags: PacketFlags,
    data: Vec<u8>,
}

const POOL_MAX: usize = 512;

/// The sans-IO reliability protocol: fragmentation, sequencing, cumulative
/// and selective acknowledgements, retransmission, windows and in-order
/// exactly-once reassembly. See the [module documentation](self).
pub struct ReliableCore {
    cfg: ReliableConfig,
    ids: ConnIds,
    mtu: usize,
    max_payload: usize,

    // Transmit side.
    stage: Vec<u8>,
    reserved: Option<usize>,
    /// Oldest unacknowledged sequence number; `snd_buf[0]`.
    snd_una: u32,
    /// Next sequence number to assign.
    snd_nxt: u32,
    /// Next never-transmitted sequence number.
    next_new: u32,
    snd_buf: VecDeque<TxPacket>,
    retx: VecDeque<u32>,
    /// Serial of the latest data transmission.
    tx_serial: u64,
    /// Highest serial known to have reached the peer.
    delivered_serial: u64,

    // Timers.
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    backoff: u32,
    rto_deadline: Option<Instant>,
    timeouts: u32,
    ack_deadline: Option<Instant>,
    rx_unacked: u32,
    last_now: Option<Instant>,

    // Receive side.
    rcv_nxt: u32,
    /// Slot `i` holds sequence number `rcv_nxt + i`; slot 0 is always empty.
    reorder: VecDeque<Option<RxPacket>>,
    assembling: bool,
    assembly: Vec<u8>,
    ready: VecDeque<Vec<u8>>,

    failed: Option<String>,
    /// When the application let the connection go ([`ReliableCore::handle_close`]).
    closed_at: Option<Instant>,
    pool: Vec<Vec<u8>>,
    stats: CoreStats,
}

impl fmt::Debug for ReliableCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReliableCore")
            .field("ids", &self.ids)
            .field("mtu", &self.mtu)
            .field("snd_una", &self.snd_una)
            .field("snd_nxt", &self.snd_nxt)
            .field("next_new", &self.next_new)
            .field("rcv_nxt", &self.rcv_nxt)
            .field("rto", &self.current_rto())
            .field("ready", &self.ready.len())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl ReliableCore {
    /// A core for a link with the given MTU, for the connection `ids`.
    pub fn new(cfg: ReliableConfig, mtu: usize, ids: ConnIds) -> Result<Self, ConfigError> {
        if mtu < MIN_MTU {
            return Err(ConfigError(format!(
                "MTU {mtu} below the minimum {MIN_MTU}"
            )));
        }
        let max_payload = (mtu - PACKET_HEADER_LEN).min(usize::from(u16::MAX));
        if cfg.window == 0 || cfg.window > MAX_WINDOW {
            return Err(ConfigError(format!(
                "window {} outside 1..={MAX_WINDOW}",
                cfg.window
            )));
        }
        let need = fragments(cfg.max_frame_len, max_payload);
        if u64::from(cfg.window) < need as u64 {
            return Err(ConfigError(format!(
                "window of {} packets cannot hold a {}-byte frame ({need} fragments of {max_payload})",
                cfg.window, cfg.max_frame_len
            )));
        }
        if cfg.rto_min.is_zero() || cfg.rto_min > cfg.rto_max {
            return Err(ConfigError("need 0 < rto_min <= rto_max".into()));
        }
        if cfg.dead_after_timeouts == 0 || cfg.ack_every == 0 || cfg.rx_batch == 0 {
            return Err(ConfigError(
                "dead_after_timeouts, ack_every and rx_batch must be positive".into(),
            ));
        }
        let rto = cfg.rto_initial.clamp(cfg.rto_min, cfg.rto_max);
        Ok(Self {
            ids,
            mtu,
            max_payload,
            stage: Vec::new(),
            reserved: None,
            snd_una: cfg.initial_seq,
            snd_nxt: cfg.initial_seq,
            next_new: cfg.initial_seq,
            snd_buf: VecDeque::new(),
            retx: VecDeque::new(),
            tx_serial: 0,
            delivered_serial: 0,
            srtt: None,
            rttvar: Duration::ZERO,
            rto,
            backoff: 0,
            rto_deadline: None,
            timeouts: 0,
            ack_deadline: None,
            rx_unacked: 0,
            last_now: None,
            rcv_nxt: cfg.initial_seq,
            reorder: VecDeque::new(),
            assembling: false,
            assembly: Vec::new(),
            ready: VecDeque::new(),
            failed: None,
            closed_at: None,
            pool: Vec::new(),
            stats: CoreStats::default(),
            cfg,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &ReliableConfig {
        &self.cfg
    }

    /// The connection ids the core's packets carry.
    pub fn ids(&self) -> ConnIds {
        self.ids
    }

    /// The link MTU packets are sized for.
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// Largest frame accepted by [`tx_reserve`](Self::tx_reserve).
    pub fn max_frame_len(&self) -> usize {
        self.cfg.max_frame_len
    }

    /// Fragment payload bytes per packet.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// Counters.
    pub fn stats(&self) -> &CoreStats {
        &self.stats
    }

    /// Oldest unacknowledged sequence number.
    pub fn snd_una(&self) -> u32 {
        self.snd_una
    }

    /// Next sequence number to be assigned.
    pub fn snd_nxt(&self) -> u32 {
        self.snd_nxt
    }

    /// Next sequence number expected from the peer.
    pub fn rcv_nxt(&self) -> u32 {
        self.rcv_nxt
    }

    /// Packets in the send buffer (unacknowledged, sent or not).
    pub fn in_flight(&self) -> u32 {
        self.snd_nxt.wrapping_sub(self.snd_una)
    }

    /// Frames reassembled and waiting for [`deliver`](Self::deliver).
    pub fn ready_frames(&self) -> usize {
        self.ready.len()
    }

    /// The current retransmission timeout, backoff included.
    pub fn current_rto(&self) -> Duration {
        let factor = 1u32 << self.backoff.min(20);
        self.rto.saturating_mul(factor).min(self.cfg.rto_max)
    }

    /// `Err` once the connection has failed (peer unreachable or protocol
    /// violation); every later call fails the same way.
    pub fn check(&self) -> Result<(), TransportError> {
        match &self.failed {
            None => Ok(()),
            Some(why) => Err(TransportError::Link(why.clone())),
        }
    }

    /// True until every committed frame has been acknowledged.
    pub fn tx_pending(&self) -> bool {
        self.snd_una != self.snd_nxt
    }

    /// The application let the connection go at `now`: it commits and
    /// reads nothing more, but the peer's last packets (its `Goodbye`, or
    /// what it sent as we closed) are done only once acknowledged, and a
    /// lost acknowledgement brings a retransmission. So the core lingers:
    /// it goes on acknowledging what arrives (dropping the frames) and
    /// retransmitting what it sent unacknowledged, until
    /// [`is_wound_down`](Self::is_wound_down). A failure while lingering
    /// (the peer gone first) is no news, and is logged at debug level.
    pub fn handle_close(&mut self, now: Instant) {
        if self.closed_at.is_none() {
            self.closed_at = Some(now);
            self.last_now = Some(now);
            while let Some(f) = self.ready.pop_front() {
                self.recycle(f);
            }
        }
    }

    /// Whether a core the application let go still has a part to play:
    /// it has frames unacknowledged, or has received data (whose
    /// acknowledgement the peer may still need). A core that has neither
    /// can go at once.
    pub fn needs_linger(&self) -> bool {
        self.failed.is_none() && (self.tx_pending() || self.rcv_nxt != self.cfg.initial_seq)
    }

    /// True while the peer is owed something: an acknowledgement, or our
    /// frames until it acknowledges them (and the core has not failed).
    pub fn owes_peer(&self) -> bool {
        self.failed.is_none() && (self.tx_pending() || self.ack_deadline.is_some())
    }

    /// How long a closed core lingers: two of the longest retransmission
    /// timeouts, so that the peer's retransmission of a packet whose
    /// acknowledgement was lost arrives within it.
    pub fn linger(&self) -> Duration {
        self.cfg.rto_max.saturating_mul(2)
    }

    /// True once a closed core may go: it failed, or its
    /// [`linger`](Self::linger) has passed with everything it sent
    /// acknowledged. False while the connection is open.
    pub fn is_wound_down(&self, now: Instant) -> bool {
        let Some(closed) = self.closed_at else {
            return false;
        };
        self.failed.is_some()
            || (!self.tx_pending() && now.saturating_duration_since(closed) >= self.linger())
    }

    fn buf(&mut self) -> Vec<u8> {
        let mut v = self.pool.pop().unwrap_or_default();
        v.clear();
        v
    }

    fn recycle(&mut self, v: Vec<u8>) {
        if self.pool.len() < POOL_MAX {
            self.pool.push(v);
        }
    }

    fn fail(&mut self, why: String) {
        if self.failed.is_none() {
            if self.closed_at.is_some() {
                // Lingering after the close: the peer may well have gone.
                tracing::debug!(
                    conn = self.ids.local,
                    "closed datagram connection ends: {why}"
                );
            } else {
                tracing::warn!(conn = self.ids.local, "datagram connection failed: {why}");
            }
            self.failed = Some(why);
            self.rto_deadline = None;
            self.ack_deadline = None;
        }
    }

    // ---------------------------------------------------------------- tx

    /// Lend `len` bytes of staging space for one frame.
    ///
    /// `Ok(None)` when the send window cannot take the frame's fragments
    /// now (back-pressure; retry after acknowledgements arrive).
    /// A frame longer than [`max_frame_len`](Self::max_frame_len) fails with
    /// [`TransportError::FrameTooLarge`].
    pub fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.check()?;
        if len > self.cfg.max_frame_len {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.cfg.max_frame_len,
            });
        }
        let need = fragments(len, self.max_payload) as u64;
        if u64::from(self.in_flight()) + need > u64::from(self.cfg.window) {
            self.stats.window_full += 1;
            self.reserved = None;
            return Ok(None);
        }
        self.stage.clear();
        self.stage.resize(len, 0);
        self.reserved = Some(len);
        Ok(Some(&mut self.stage[..]))
    }

    /// Commit the first `len` bytes of the last reservation as one frame:
    /// it is fragmented into packets that enter the send buffer.
    ///
    /// # Panics
    /// If `len` exceeds the reservation. A commit without a reservation is
    /// ignored (and asserts in debug builds).
    pub fn tx_commit(&mut self, len: usize) {
        let Some(reserved) = self.reserved.take() else {
            debug_assert!(false, "tx_commit without tx_reserve");
            return;
        };
        assert!(
            len <= reserved,
            "tx_commit({len}) beyond the reservation of {reserved}"
        );
        let n = fragments(len, self.max_payload);
        if n == 1 {
            // Zero-copy: the staging buffer becomes the packet's payload.
            let fresh = self.buf();
            let mut data = std::mem::replace(&mut self.stage, fresh);
            data.truncate(len);
            self.push_fragment(PacketFlags::FIRST.with(PacketFlags::LAST), data);
        } else {
            for i in 0..n {
                let start = i * self.max_payload;
                let end = (start + self.max_payload).min(len);
                let mut data = self.buf();
                data.extend_from_slice(&self.stage[start..end]);
                let mut flags = PacketFlags::NONE;
                if i == 0 {
                    flags = flags.with(PacketFlags::FIRST);
                }
                if i == n - 1 {
                    flags = flags.with(PacketFlags::LAST);
                }
                self.push_fragment(flags, data);
            }
        }
        self.stats.frames_sent += 1;
    }

    fn push_fragment(&mut self, flags: PacketFlags, data: Vec<u8>) {
        self.snd_buf.push_back(TxPacket {
            flags,
            data,
            sent_at: None,
            serial: 0,
            tx_count: 0,
            sacked: false,
            in_retx: false,
        });
        self.snd_nxt = self.snd_nxt.wrapping_add(1);
    }

    fn ack_due(&self, now: Instant) -> bool {
        self.ack_deadline.is_some_and(|d| d <= now)
    }

    /// True if [`poll_transmit`](Self::poll_transmit) may produce a packet
    /// at `now`.
    pub fn wants_transmit(&self, now: Instant) -> bool {
        self.failed.is_none()
            && (!self.retx.is_empty() || self.next_new != self.snd_nxt || self.ack_due(now))
    }

    /// Write the next packet to send into `buf` (at least
    /// [`mtu`](Self::mtu) bytes) and return its length: a retransmission,
    /// else new data, else a due standalone acknowledgement. `None` when
    /// nothing needs sending.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.last_now = Some(now);
        if self.failed.is_some() {
            return None;
        }
        while let Some(seq) = self.retx.pop_front() {
            if seq_lt(seq, self.snd_una) || !seq_lt(seq, self.next_new) {
                continue;
            }
            let idx = seq.wrapping_sub(self.snd_una) as usize;
            let p = &mut self.snd_buf[idx];
            if !p.in_retx {
                continue;
            }
            p.in_retx = false;
            if p.sacked {
                continue;
            }
            self.stats.retransmits += 1;
            return Some(self.emit_data(now, seq, buf));
        }
        if self.next_new != self.snd_nxt {
            let seq = self.next_new;
            self.next_new = seq.wrapping_add(1);
            self.stats.data_packets_sent += 1;
            return Some(self.emit_data(now, seq, buf));
        }
        if self.ack_due(now) {
            let hdr = PacketHeader {
                flags: PacketFlags::NONE,
                dst_conn: self.ids.peer,
                src_conn: self.ids.local,
                seq: 0,
                ack: self.rcv_nxt,
                sack: self.sack_bits(),
                payload_len: 0,
            };
            self.acked();
            self.stats.acks_sent += 1;
            return Some(hdr.encode(&[], buf));
        }
        None
    }

    fn emit_data(&mut self, now: Instant, seq: u32, buf: &mut [u8]) -> usize {
        let ack = self.rcv_nxt;
        let sack = self.sack_bits();
        let idx = seq.wrapping_sub(self.snd_una) as usize;
        self.tx_serial += 1;
        let p = &mut self.snd_buf[idx];
        p.sent_at = Some(now);
        p.serial = self.tx_serial;
        p.tx_count += 1;
        let hdr = PacketHeader {
            flags: PacketFlags::DATA.with(p.flags),
            dst_conn: self.ids.peer,
            src_conn: self.ids.local,
            seq,
            ack,
            sack,
            payload_len: 0,
        };
        let n = hdr.encode(&p.data, buf);
        if self.rto_deadline.is_none() {
            self.rto_deadline = Some(now + self.current_rto());
        }
        self.acked();
        n
    }

    /// An acknowledgement went out (standalone or piggybacked).
    fn acked(&mut self) {
        self.ack_deadline = None;
        self.rx_unacked = 0;
    }

    fn sack_bits(&self) -> u64 {
        let mut bits = 0u64;
        for (i, slot) in self
            .reorder
            .iter()
            .skip(1)
            .take(SACK_BITS as usize)
            .enumerate()
        {
            if slot.is_some() {
                bits |= 1 << i;
            }
        }
        bits
    }

    // ------------------------------------------------------------ timers

    /// The earliest instant the core needs [`handle_timeout`](Self::handle_timeout)
    /// or a transmit pass: the retransmission deadline, the delayed-ack
    /// deadline, or the last `now` seen if packets are waiting to be sent.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.failed.is_some() {
            return None;
        }
        let immediate = if !self.retx.is_empty() || self.next_new != self.snd_nxt {
            self.last_now
        } else {
            None
        };
        [self.rto_deadline, self.ack_deadline, immediate]
            .into_iter()
            .flatten()
            .min()
    }

    /// Run the timers at `now`: on a retransmission timeout the
    /// unacknowledged packets the peer can report on (the oldest
    /// unacknowledged one and the selective-ack range after it) are queued
    /// again and the timeout backs off; after
    /// [`dead_after_timeouts`](ReliableConfig::dead_after_timeouts)
    /// consecutive timeouts without progress the connection fails.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = Some(now);
        if self.failed.is_some() {
            return;
        }
        let Some(deadline) = self.rto_deadline else {
            return;
        };
        if deadline > now {
            return;
        }
        if self.snd_una == self.next_new {
            self.rto_deadline = None;
            return;
        }
        self.timeouts += 1;
        self.stats.timeouts += 1;
        if self.timeouts >= self.cfg.dead_after_timeouts {
            let why = format!(
                "peer unreachable: {} consecutive retransmission timeouts without an \
                 acknowledgement (last RTO {:?}, {} packets unacknowledged)",
                self.timeouts,
                self.current_rto(),
                self.in_flight()
            );
            self.fail(why);
            return;
        }
        self.backoff += 1;
        tracing::debug!(
            conn = self.ids.local,
            snd_una = self.snd_una,
            rto = ?self.current_rto(),
            timeouts = self.timeouts,
            "retransmission timeout"
        );
        let sent = self.next_new.wrapping_sub(self.snd_una) as usize;
        let visible = sent.min(1 + SACK_BITS as usize);
        for (i, p) in self.snd_buf.iter_mut().take(visible).enumerate() {
            if !p.sacked && !p.in_retx {
                p.in_retx = true;
                self.retx.push_back(self.snd_una.wrapping_add(i as u32));
            }
        }
        self.rto_deadline = Some(now + self.current_rto());
    }

    fn rtt_sample(&mut self, rtt: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(srtt) => {
                let dev = if srtt > rtt { srtt - rtt } else { rtt - srtt };
                self.rttvar = (self.rttvar * 3 + dev) / 4;
                self.srtt = Some((srtt * 7 + rtt) / 8);
            }
        }
        let srtt = self.srtt.unwrap_or(rtt);
        self.rto = (srtt + (self.rttvar * 4).max(self.cfg.ack_delay))
            .clamp(self.cfg.rto_min, self.cfg.rto_max);
    }

    // ---------------------------------------------------------------- rx

    fn on_ack(&mut self, now: Instant, ack: u32, sack: u64) {
        if seq_lt(self.next_new, ack) {
            // Acknowledges data never sent: a confused or foreign peer.
            self.stats.bad_acks += 1;
            return;
        }
        let mut progress = false;
        let mut sample: Option<Instant> = None;
        let mut delivered = self.delivered_serial;
        if seq_lt(self.snd_una, ack) {
            let n = ack.wrapping_sub(self.snd_una);
            for _ in 0..n {
                let Some(p) = self.snd_buf.pop_front() else {
                    break;
                };
                if !p.sacked {
                    delivered = delivered.max(p.serial);
                    if p.tx_count == 1 {
                        sample = p.sent_at;
                    }
                }
                self.recycle(p.data);
            }
            self.snd_una = ack;
            progress = true;
        }
        if sack != 0 {
            for i in 0..SACK_BITS {
                if sack & (1 << i) == 0 {
                    continue;
                }
                let s = ack.wrapping_add(1 + i);
                if !seq_lt(s, self.next_new) {
                    break;
                }
                if seq_lt(s, self.snd_una) {
                    continue;
                }
                let p = &mut self.snd_buf[s.wrapping_sub(self.snd_una) as usize];
                if !p.sacked {
                    p.sacked = true;
                    progress = true;
                    delivered = delivered.max(p.serial);
                    if p.tx_count == 1 {
                        sample = sample.max(p.sent_at);
                    }
                }
            }
        }
        if progress {
            self.timeouts = 0;
            self.backoff = 0;
            if let Some(sent) = sample {
                self.rtt_sample(now.saturating_duration_since(sent));
            }
            self.rto_deadline = if self.snd_una == self.next_new {
                None
            } else {
                Some(now + self.current_rto())
            };
        }
        if delivered > self.delivered_serial {
            self.delivered_serial = delivered;
            // A packet that this acknowledgement reports missing although
            // one sent well after it arrived is lost (or its retransmission
            // is): retransmit it now rather than at the timeout. Packets
            // beyond the reported range are unknown, not missing.
            let sent = self.next_new.wrapping_sub(self.snd_una);
            let end = ack.wrapping_add(1 + SACK_BITS);
            let reported = if seq_lt(self.snd_una, end) {
                end.wrapping_sub(self.snd_una).min(sent)
            } else {
                0
            };
            for (i, p) in self.snd_buf.iter_mut().take(reported as usize).enumerate() {
                if !p.sacked && !p.in_retx && p.serial + FAST_RETRANSMIT_THRESHOLD <= delivered {
                    p.in_retx = true;
                    self.retx.push_back(self.snd_una.wrapping_add(i as u32));
                    self.stats.fast_retransmits += 1;
                }
            }
        }
    }

    /// Process one received datagram at `now`: verify it, then
    /// [`handle_parsed`](Self::handle_parsed). Corrupted and malformed
    /// packets are dropped and counted.
    pub fn handle_packet(
        &mut self,
        now: Instant,
        pkt: &[u8],
        sink: &mut dyn FnMut(&[u8]),
        budget: &mut usize,
    ) {
        let (hdr, payload) = match PacketHeader::decode(pkt) {
            Ok(x) => x,
            Err(e) => {
                self.last_now = Some(now);
                if self.failed.is_none() {
                    self.stats.packets_received += 1;
                    if e == PacketError::BadChecksum {
                        self.stats.dropped_corrupt += 1;
                    } else {
                        self.stats.dropped_malformed += 1;
                    }
                    tracing::trace!("dropped a packet: {e}");
                }
                return;
            }
        };
        self.handle_parsed(now, &hdr, payload, sink, budget);
    }

    /// Process one verified datagram (`hdr` and `payload` as
    /// [`PacketHeader::decode`] returned them) at `now`.
    ///
    /// Foreign, duplicate and out-of-window packets are dropped (and
    /// counted). Acknowledgements update the send side. Data is buffered
    /// and reassembled; a frame completed in order while no earlier frame
    /// waits is lent to `sink` directly from the datagram if `*budget`
    /// allows (which it then decrements), otherwise it waits for
    /// [`deliver`](Self::deliver). Pass a zero budget to always buffer.
    pub fn handle_parsed(
        &mut self,
        now: Instant,
        hdr: &PacketHeader,
        payload: &[u8],
        sink: &mut dyn FnMut(&[u8]),
        budget: &mut usize,
    ) {
        self.last_now = Some(now);
        if self.failed.is_some() {
            return;
        }
        self.stats.packets_received += 1;
        if hdr.dst_conn != self.ids.local || hdr.src_conn != self.ids.peer {
            self.stats.dropped_foreign += 1;
            return;
        }
        self.on_ack(now, hdr.ack, hdr.sack);
        if !hdr.flags.contains(PacketFlags::DATA) {
            return;
        }
        let off = seq_diff(hdr.seq, self.rcv_nxt);
        if off < 0 {
            // Already delivered: our acknowledgement was probably lost.
            self.stats.duplicates += 1;
            self.ack_deadline = Some(now);
            return;
        }
        let off = off as u32;
        if off >= self.cfg.window {
            self.stats.out_of_window += 1;
            self.ack_deadline = Some(now);
            return;
        }
        let frag = hdr.flags;
        if off > 0 {
            let off = off as usize;
            if self.reorder.len() <= off {
                self.reorder.resize_with(off + 1, || None);
            }
            if self.reorder[off].is_some() {
                self.stats.duplicates += 1;
            } else {
                let mut data = self.buf();
                data.extend_from_slice(payload);
                self.reorder[off] = Some(RxPacket { flags: frag, data });
                self.stats.out_of_order += 1;
            }
            // A gap: tell the sender at once (duplicate ack with SACK).
            self.ack_deadline = Some(now);
            return;
        }
        // In order.
        self.reorder.pop_front();
        self.rcv_nxt = self.rcv_nxt.wrapping_add(1);
        self.accept(frag, payload, sink, budget);
        let mut filled_gap = false;
        while matches!(self.reorder.front(), Some(Some(_))) {
            let Some(Some(p)) = self.reorder.pop_front() else {
                unreachable!()
            };
            self.rcv_nxt = self.rcv_nxt.wrapping_add(1);
            self.accept(p.flags, &p.data, sink, budget);
            self.recycle(p.data);
            filled_gap = true;
        }
        self.rx_unacked += 1;
        if filled_gap || self.rx_unacked >= self.cfg.ack_every {
            self.ack_deadline = Some(now);
        } else if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now + self.cfg.ack_delay);
        }
    }

    /// An in-order fragment.
    fn accept(
        &mut self,
        flags: PacketFlags,
        data: &[u8],
        sink: &mut dyn FnMut(&[u8]),
        budget: &mut usize,
    ) {
        if self.failed.is_some() {
            return;
        }
        let first = flags.contains(PacketFlags::FIRST);
        let last = flags.contains(PacketFlags::LAST);
        if first && self.assembling {
            return self.fail("protocol violation: a fragment opens a frame inside another".into());
        }
        if !first && !self.assembling {
            return self.fail("protocol violation: a continuation fragment outside a frame".into());
        }
        let so_far = if first { 0 } else { self.assembly.len() };
        if so_far + data.len() > self.cfg.max_frame_len {
            return self.fail(format!(
                "protocol violation: a frame longer than the maximum of {} bytes",
                self.cfg.max_frame_len
            ));
        }
        if first && last {
            if self.closed_at.is_some() {
                return;
            }
            if self.ready.is_empty() && *budget > 0 {
                *budget -= 1;
                self.stats.frames_delivered += 1;
                sink(data);
            } else {
                let mut frame = self.buf();
                frame.extend_from_slice(data);
                self.ready.push_back(frame);
            }
            return;
        }
        if first {
            self.assembling = true;
            self.assembly.clear();
        }
        self.assembly.extend_from_slice(data);
        if last {
            self.assembling = false;
            let fresh = self.buf();
            let frame = std::mem::replace(&mut self.assembly, fresh);
            if self.closed_at.is_some() {
                self.recycle(frame);
            } else if self.ready.is_empty() && *budget > 0 {
                *budget -= 1;
                self.stats.frames_delivered += 1;
                sink(&frame);
                self.recycle(frame);
            } else {
                self.ready.push_back(frame);
            }
        }
    }

    /// Lend up to `max` reassembled frames to `sink`, in order. Returns how
    /// many were delivered.
    pub fn deliver(&mut self, max: usize, sink: &mut dyn FnMut(&[u8])) -> usize {
        let mut n = 0;
        while n < max {
            let Some(frame) = self.ready.pop_front() else {
                break;
            };
            sink(&frame);
            self.recycle(frame);
            n += 1;
        }
        self.stats.frames_delivered += n as u64;
        n
    }
}

/// Packets a frame of `len` bytes is cut into (an empty frame still takes
/// one).
fn fragments(len: usize, max_payload: usize) -> usize {
    len.div_ceil(max_payload).max(1)
}

#[cfg(test)]
mod tests;

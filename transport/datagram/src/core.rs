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

use crate::packet::{PacketFlags, PACKET_HEADER_LEN};

mod cc;
mod rx;
mod timers;
mod tx;

/// A packet is deemed lost, and retransmitted without waiting for the
/// timer, once a packet transmitted this many transmissions after it has been
/// acknowledged (cumulatively or selectively). Tolerates that much reordering.
pub const FAST_RETRANSMIT_THRESHOLD: u64 = 3;
/// Most acknowledgements owed at once for duplicate data packets (one
/// each, see `handle_parsed`).
const ACKS_OWED_MAX: u32 = 64;
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
    /// Smallest congestion window, in packets, that a loss leaves (the
    /// window starts at, and never exceeds, `window`; see
    /// `docs/backends/datagram.md`). Equal to `window`, congestion control
    /// is off.
    pub min_cwnd: u32,
}

/// The frames waiting for the application may hold this many frames'
/// maximum length (`max_frame_len`) of bytes; see
/// [`ReliableCore::ready_frames`].
pub const BACKLOG_FRAMES_LEN: usize = 4;

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
            min_cwnd: 4,
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
    /// In-order data packets dropped unacknowledged because the frames
    /// waiting for [`ReliableCore::deliver`] were at their bound (see
    /// [`ReliableCore::ready_frames`]): the peer sends them again.
    pub dropped_backlog: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// `tx_reserve` calls refused for a full window.
    pub window_full: u64,
    /// Loss episodes that reduced the congestion window.
    pub cwnd_reductions: u64,
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
            dropped_backlog,
            timeouts,
            window_full,
            cwnd_reductions,
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
        self.dropped_backlog += dropped_backlog;
        self.timeouts += timeouts;
        self.window_full += window_full;
        self.cwnd_reductions += cwnd_reductions;
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
    /// The frame the fragment belongs to: its number among the frames
    /// committed on the connection (see `ReliableCore::tx_frames`).
    frame: u64,
    /// The fragment's bytes: `start..start + len` of its frame's buffer.
    start: usize,
    len: usize,
    sent_at: Option<Instant>,
    /// Transmission serial of the latest transmission (0: never sent).
    serial: u64,
    tx_count: u32,
    sacked: bool,
    /// Queued in `retx`.
    in_retx: bool,
    /// Queued again by a retransmission timeout (and by nothing since): an
    /// acknowledgement of it may be one of the earlier transmission, which
    /// the timeout wrongly took for lost (see `ReliableCore::on_ack`).
    by_timeout: bool,
}

#[derive(Debug)]
struct RxPacket {
    flags: PacketFlags,
    data: Vec<u8>,
}

const POOL_MAX: usize = 512;
/// Bytes of frame buffers kept for reuse at least (see
/// `ReliableCore::recycle_frame`); twice `max_frame_len` if that is more.
const FRAME_POOL_BYTES: usize = 4 << 20;

/// The sans-IO reliability protocol: fragmentation, sequencing, cumulative
/// and selective acknowledgements, retransmission, windows and in-order
/// exactly-once reassembly. See the [module documentation](self).
pub struct ReliableCore {
    cfg: ReliableConfig,
    ids: ConnIds,
    mtu: usize,
    max_payload: usize,

    // Transmit side.
    /// The buffer `tx_reserve` lends; it becomes the frame's buffer at
    /// `tx_commit`. Its length is what it ever held (initialised bytes),
    /// not the frame's.
    stage: Vec<u8>,
    reserved: Option<usize>,
    /// Oldest unacknowledged sequence number; `snd_buf[0]`.
    snd_una: u32,
    /// Next sequence number to assign.
    snd_nxt: u32,
    /// Next never-transmitted sequence number.
    next_new: u32,
    snd_buf: VecDeque<TxPacket>,
    /// The buffers of the frames whose packets are in `snd_buf`, oldest
    /// first: each fragment is a range of its frame's buffer, which goes
    /// when the frame's last packet is acknowledged.
    tx_frames: VecDeque<Vec<u8>>,
    /// The number of `tx_frames[0]` (frames freed so far).
    tx_frames_base: u64,
    retx: VecDeque<u32>,
    /// Serial of the latest data transmission.
    tx_serial: u64,
    /// Highest serial known to have reached the peer.
    delivered_serial: u64,
    /// How many packets may be in flight (see [`cc`]).
    cc: cc::CongestionWindow,
    /// Packets of `snd_buf` selectively acknowledged.
    sacked: u32,

    // Timers.
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    /// Timeouts since the last RTT sample: `rto` doubles with each
    /// ([`current_rto`](Self::current_rto)). Only a sample resets it, not
    /// an acknowledgement of retransmitted packets (Karn's algorithm).
    backoff: u32,
    rto_deadline: Option<Instant>,
    timeouts: u32,
    ack_deadline: Option<Instant>,
    rx_unacked: u32,
    /// Acknowledgements owed for duplicate data packets, one each.
    acks_owed: u32,
    last_now: Option<Instant>,

    // Receive side.
    rcv_nxt: u32,
    /// Slot `i` holds sequence number `rcv_nxt + i`; slot 0 is always empty.
    reorder: VecDeque<Option<RxPacket>>,
    assembling: bool,
    assembly: Vec<u8>,
    ready: VecDeque<Vec<u8>>,
    /// Bytes of the frames in `ready`.
    ready_bytes: usize,

    failed: Option<String>,
    /// When the application let the connection go
    /// ([`ReliableCore::handle_close`]), moved to the last packet of the
    /// peer's received since: the linger runs from it.
    closed_at: Option<Instant>,
    /// Buffers for out-of-order fragments.
    pool: Vec<Vec<u8>>,
    /// Buffers for whole frames (staging, reassembly, ready frames), and
    /// the capacity they hold.
    frame_pool: Vec<Vec<u8>>,
    frame_pool_bytes: usize,
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
        if cfg.dead_after_timeouts == 0
            || cfg.ack_every == 0
            || cfg.rx_batch == 0
            || cfg.min_cwnd == 0
        {
            return Err(ConfigError(
                "dead_after_timeouts, ack_every, rx_batch and min_cwnd must be positive".into(),
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
            tx_frames: VecDeque::new(),
            tx_frames_base: 0,
            retx: VecDeque::new(),
            tx_serial: 0,
            delivered_serial: 0,
            cc: cc::CongestionWindow::new(cfg.window, cfg.min_cwnd),
            sacked: 0,
            srtt: None,
            rttvar: Duration::ZERO,
            rto,
            backoff: 0,
            rto_deadline: None,
            timeouts: 0,
            ack_deadline: None,
            rx_unacked: 0,
            acks_owed: 0,
            last_now: None,
            rcv_nxt: cfg.initial_seq,
            reorder: VecDeque::new(),
            assembling: false,
            assembly: Vec::new(),
            ready: VecDeque::new(),
            ready_bytes: 0,
            failed: None,
            closed_at: None,
            pool: Vec::new(),
            frame_pool: Vec::new(),
            frame_pool_bytes: 0,
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

    /// The congestion window: how many packets may be in the network
    /// (sent, neither cumulatively nor selectively acknowledged) before
    /// no new packet goes.
    pub fn cwnd(&self) -> u32 {
        self.cc.window()
    }

    /// Packets sent and not yet cumulatively acknowledged.
    fn sent_in_flight(&self) -> u32 {
        self.next_new.wrapping_sub(self.snd_una)
    }

    /// Whether a never-sent packet waits and the congestion window lets
    /// it go: the packets still in the network (sent, neither
    /// cumulatively nor selectively acknowledged: RFC 6675's pipe, lost
    /// ones included until they are resent) must be fewer than the window.
    /// Packets the peer reports go out of the pipe, so new packets keep
    /// flowing past a loss, and their acknowledgements find a lost
    /// retransmission again.
    fn new_data_ready(&self) -> bool {
        self.next_new != self.snd_nxt
            && self.sent_in_flight().saturating_sub(self.sacked) < self.cc.window()
    }

    /// A loss was detected: the congestion window answers the episode.
    fn congestion(&mut self) {
        if self.cc.on_loss(self.sent_in_flight(), self.next_new) {
            self.stats.cwnd_reductions += 1;
        }
    }

    /// Frames reassembled and waiting for [`deliver`](Self::deliver).
    ///
    /// They are bounded: once `window` frames or [`BACKLOG_FRAMES_LEN`]
    /// frame lengths wait, in-order data packets are dropped without
    /// acknowledgement (counted in [`CoreStats::dropped_backlog`]) until
    /// the application takes some, and the peer sends them again, as a
    /// receiver with a full buffer drops. The peer's window keeps
    /// flowing otherwise (acknowledgements say what arrived, not what was
    /// taken), so a peer faster than its reader, or one that means harm,
    /// would grow this queue without end. The packets the reorder buffer
    /// holds can still complete frames past the bound: at most `window`
    /// more.
    pub fn ready_frames(&self) -> usize {
        self.ready.len()
    }

    /// Whether the frames waiting for the application are at their bound
    /// (see [`Self::ready_frames`]).
    fn backlog_full(&self) -> bool {
        self.ready.len() >= self.cfg.window as usize
            || self.ready_bytes >= BACKLOG_FRAMES_LEN * self.cfg.max_frame_len
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
                self.recycle_frame(f);
            }
            self.ready_bytes = 0;
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

    /// How long a closed core lingers after the close, or after the
    /// peer's last packet since: two of the longest retransmission
    /// timeouts, so that the peer's next retransmission of a packet whose
    /// acknowledgement was lost arrives within it, however far its
    /// timeouts have backed off.
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

    /// A buffer for a whole frame, as a recycled one was left: its length
    /// is what it held (callers that append clear it first), so a staging
    /// buffer as long as the frame needs no zeroing.
    fn frame_buf(&mut self) -> Vec<u8> {
        let v = self.frame_pool.pop().unwrap_or_default();
        self.frame_pool_bytes -= v.capacity();
        v
    }

    /// Keep a frame's buffer for the next frame, while the pool holds
    /// fewer than [`POOL_MAX`] buffers and [`FRAME_POOL_BYTES`] (or two
    /// of the largest frames).
    fn recycle_frame(&mut self, v: Vec<u8>) {
        let cap = v.capacity();
        let limit = FRAME_POOL_BYTES.max(2 * self.cfg.max_frame_len);
        if cap > 0 && self.frame_pool.len() < POOL_MAX && self.frame_pool_bytes + cap <= limit {
            self.frame_pool_bytes += cap;
            self.frame_pool.push(v);
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
}

/// Packets a frame of `len` bytes is cut into (an empty frame still takes
/// one).
fn fragments(len: usize, max_payload: usize) -> usize {
    len.div_ceil(max_payload).max(1)
}

#[cfg(test)]
mod tests;

//! [`Datagram`]: the reliable-datagram protocol of the DPDK backend
//! (`starwire_datagram`: [`PacketHeader::decode`] and
//! [`ReliableCore::handle_packet`]) as a driver target (`fuzz-datagram`),
//! with [`Datagrams`], mutations aimed at the packet header's fields.
//!
//! An input is one datagram. It goes first to [`PacketHeader::decode`],
//! checked against a reference written from the format in
//! `starwire_datagram::packet` (same verdict, same error kind), and an
//! accepted packet must encode back to exactly its bytes (the format has one
//! encoding: every field is checked or taken verbatim, padding aside).
//!
//! Then it goes to one end of a connection in a realistic state. Two
//! cores, `A` and `B`, run a fixed script against each other ([`SCENARIOS`]:
//! frames of one to five fragments both ways, packets lost, holes
//! selectively acknowledged, a retransmission timeout, `B` closed and
//! lingering, sequence numbers about to wrap), then the input is handed to
//! the end its `dst_conn` names (`B` unless it names `A`), with the
//! run's delivery budget, and the two cores exchange packets without loss
//! until nothing is left to send and no timer is set. Time advances
//! deterministically from one instant taken when the target is made.
//!
//! The input is classed against what the sending end really sent: refused
//! by the decoder, foreign (other connection ids), a replay of a packet the
//! peer sent, a data packet whose sequence number, flags and payload are the
//! peer's (its acknowledgement fields may be anything), a forged data
//! packet, or a forged acknowledgement (a mutated packet whose checksum the
//! mutator wrote again). Oracles, besides "no panic":
//!
//! * the packet's step: it counts as one packet received; a refused or
//!   foreign packet counts as dropped (corrupt only for a bad checksum) and
//!   changes nothing else the core shows; an accepted one commits nothing,
//!   never grows the packets in flight, moves `snd_una` only to its `ack`,
//!   moves `rcv_nxt` only if it is the next data packet (and by at most the
//!   window), counts at most one of duplicate / out of window / out of
//!   order, and delivers at most its budget, each frame counted;
//! * every packet either core sends decodes, carries the connection's ids,
//!   fits the MTU, and, if it carries data, is exactly the fragment the
//!   core's committed frames give that sequence number; it acknowledges
//!   nothing its peer has not committed (unless the core was fed forged
//!   data);
//! * no frame longer than the maximum is delivered, and each end delivers a
//!   prefix of the frames the other committed, in order, exactly once (the
//!   end fed forged data aside); a closed end delivers nothing more;
//! * the counters agree with what was seen: frames committed and
//!   delivered, packets sent, packets received and dropped, and, once all
//!   is acknowledged, one first transmission per sequence number;
//! * the exchange settles within a bound of steps;
//! * after a benign input (refused, foreign or a replay) the connection
//!   completes: every frame delivered both ways (to a closed end, only
//!   acknowledged), nothing pending, no bad acknowledgement, no drop but
//!   the input's, and a closed end winds down after its linger.

use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::Rng;
use starwire_datagram::packet::{
    peek_dst_conn, peek_src_conn, PacketError, PacketFlags, PacketHeader, PACKET_HEADER_LEN,
    PACKET_MAGIC, PACKET_VERSION,
};
use starwire_datagram::{ConnIds, CoreStats, ReliableConfig, ReliableCore};

use crate::driver::{Spec, Target};
use crate::mutate::{delete, flip_bit, insert_random, splice, truncate};
use crate::{Mutation, Mutator};

/// Fragment payload bytes per packet.
const PAYLOAD: usize = 64;
/// The link MTU of both cores.
const MTU: usize = PACKET_HEADER_LEN + PAYLOAD;
/// Largest frame, send window and receive reorder buffer.
const MAX_FRAME: usize = 512;
const WINDOW: u32 = 32;
/// Packets from `A` carry `dst_conn` 2 and `src_conn` 1.
const A: ConnIds = ConnIds { local: 1, peer: 2 };
const B: ConnIds = ConnIds { local: 2, peer: 1 };
/// One-way delay of a packet, and the step of the scripts.
const HOP: Duration = Duration::from_micros(20);
/// Steps of the exchange after the input (packets both ways, or a jump to
/// the next timer) before it must have settled.
const MAX_STEPS: usize = 1000;
/// Delivery budgets of a `handle_packet` call: always buffer, one frame,
/// unbounded.
const BUDGETS: [usize; 3] = [0, 1, usize::MAX];

fn config(initial_seq: u32) -> ReliableConfig {
    ReliableConfig {
        initial_seq,
        max_frame_len: MAX_FRAME,
        window: WINDOW,
        ack_every: 4,
        min_cwnd: 2,
        ..ReliableConfig::default()
    }
}

/// The `i`-th frame `side` commits: `len` bytes that differ from every
/// other frame's.
fn frame(side: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (side * 101 + i * 31 + j * 7 + 1) as u8)
        .collect()
}

/// Frame lengths of the script: `A`'s and `B`'s first and second flights.
const A1: [usize; 4] = [10, 150, 0, 64];
const B1: [usize; 1] = [30];
const A2: [usize; 2] = [300, 65];
const B2: [usize; 2] = [150, 1];

/// How the script leaves the connection. Masks say which packets of a
/// burst arrive (bit `i`: the `i`-th packet); the others never do, unless
/// the input is one of them.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// A name for reports.
    pub name: &'static str,
    /// Sequence number of the first packet each way.
    pub initial_seq: u32,
    /// `A`'s first flight (6 packets) at `B`.
    pub a1: u64,
    /// `B`'s first flight (1 packet) at `A`.
    pub b1: u64,
    /// The acknowledgements that follow the first flights, both ways.
    pub acks: u64,
    /// `A`'s second flight (7 packets and any retransmission) at `B`.
    pub a2: u64,
    /// `B`'s second flight (4 packets) at `A`.
    pub b2: u64,
    /// Then a retransmission timeout on both ends, whose packets never
    /// arrive (unless the input is one).
    pub timeout: bool,
    /// Then `B` is closed by its application (it lingers).
    pub close_b: bool,
}

/// The states a fuzzed packet meets.
pub const SCENARIOS: [Scenario; 4] = [
    // B holds the first two fragments of A's 300-byte frame; the rest of
    // A's second flight is in flight.
    Scenario {
        name: "in-flight",
        initial_seq: 0,
        a1: u64::MAX,
        b1: u64::MAX,
        acks: u64::MAX,
        a2: 0b11,
        b2: u64::MAX,
        timeout: false,
        close_b: false,
    },
    // A's second packet lost: B buffers what follows and acknowledges it
    // selectively, A resends it fast. B's first frame lost: A buffers B's
    // second flight. Sequence numbers wrap.
    Scenario {
        name: "holes",
        initial_seq: u32::MAX - 3,
        a1: !0b10,
        b1: 0,
        acks: u64::MAX,
        a2: 0b1_0101,
        b2: u64::MAX,
        timeout: false,
        close_b: false,
    },
    // Acknowledgements and second flights lost; both ends time out and
    // resend.
    Scenario {
        name: "timeout",
        initial_seq: 1 << 31,
        a1: u64::MAX,
        b1: u64::MAX,
        acks: 0,
        a2: 0,
        b2: 0,
        timeout: true,
        close_b: false,
    },
    // B has three fragments of A's 300-byte frame, and its application
    // lets the connection go.
    Scenario {
        name: "closed",
        initial_seq: 7,
        a1: u64::MAX,
        b1: u64::MAX,
        acks: u64::MAX,
        a2: 0b111,
        b2: 0b101,
        timeout: false,
        close_b: true,
    },
];

/// The fragment the frames `frames`, committed from `init` on, give
/// sequence number `seq`: its flags (DATA included) and payload.
fn fragment(frames: &[Vec<u8>], init: u32, seq: u32) -> Option<(PacketFlags, &[u8])> {
    let mut idx = seq.wrapping_sub(init) as usize;
    for f in frames {
        let n = f.len().div_ceil(PAYLOAD).max(1);
        if idx < n {
            let mut flags = PacketFlags::DATA;
            if idx == 0 {
                flags = flags.with(PacketFlags::FIRST);
            }
            if idx == n - 1 {
                flags = flags.with(PacketFlags::LAST);
            }
            let start = idx * PAYLOAD;
            let end = (start + PAYLOAD).min(f.len());
            return Some((flags, &f[start..end]));
        }
        idx -= n;
    }
    None
}

/// `a - b` in sequence space.
fn seq_diff(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

/// A short name for a decoder error's kind.
fn error_kind(e: &PacketError) -> &'static str {
    match e {
        PacketError::Truncated { .. } => "Truncated",
        PacketError::BadMagic(_) => "BadMagic",
        PacketError::BadVersion(_) => "BadVersion",
        PacketError::BadChecksum => "BadChecksum",
        PacketError::Malformed(_) => "Malformed",
        _ => "other",
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn crc(p: &[u8], end: usize) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&p[..32]), &p[PACKET_HEADER_LEN..end])
}

/// The decoder's verdict on `p` as the format says, written apart from it:
/// `Err` holds the kind of the first check that fails (and, for a short
/// packet, the bytes needed).
fn reference(p: &[u8]) -> Result<(), (&'static str, usize)> {
    if p.len() < PACKET_HEADER_LEN {
        return Err(("Truncated", PACKET_HEADER_LEN));
    }
    if p[..2] != PACKET_MAGIC {
        return Err(("BadMagic", 0));
    }
    if p[2] != PACKET_VERSION {
        return Err(("BadVersion", 0));
    }
    let end = PACKET_HEADER_LEN + usize::from(u16_at(p, 28));
    if p.len() < end {
        return Err(("Truncated", end));
    }
    if crc(p, end) != u32_at(p, 32) {
        return Err(("BadChecksum", 0));
    }
    let flags = p[3];
    if flags & !0b111 != 0 || u16_at(p, 30) != 0 {
        return Err(("Malformed", 0));
    }
    if flags & 1 == 0 && (flags != 0 || end != PACKET_HEADER_LEN || u32_at(p, 12) != 0) {
        return Err(("Malformed", 0));
    }
    Ok(())
}

/// Decode `input`, checked against [`reference`]; an accepted packet
/// must encode back to its bytes and agree with the `peek_*` readers.
pub fn check_decode(input: &[u8]) -> Result<Result<(PacketHeader, &[u8]), PacketError>, String> {
    let got = PacketHeader::decode(input);
    let want = reference(input);
    match (&got, want) {
        (Ok(_), Ok(())) => {}
        (Err(PacketError::Truncated { needed, have }), Err(("Truncated", n))) => {
            if (*needed, *have) != (n, input.len()) {
                return Err(format!(
                    "decode says {got:?}, the format needs {n} bytes of {}",
                    input.len()
                ));
            }
        }
        (Err(e), Err((k, _))) if error_kind(e) == k => {}
        _ => return Err(format!("decode says {got:?}, the format says {want:?}")),
    }
    let peeks = (peek_dst_conn(input), peek_src_conn(input));
    let want_peeks = (
        (input.len() >= 8).then(|| u32_at(input, 4)),
        (input.len() >= 12).then(|| u32_at(input, 8)),
    );
    if peeks != want_peeks {
        return Err(format!("peek_dst_conn/peek_src_conn read {peeks:?}"));
    }
    if let Ok((hdr, payload)) = &got {
        let end = PACKET_HEADER_LEN + payload.len();
        if usize::from(hdr.payload_len) != payload.len()
            || input[PACKET_HEADER_LEN..end] != **payload
        {
            return Err(format!(
                "{hdr:?} lends {} payload bytes that are not the packet's",
                payload.len()
            ));
        }
        let mut again = vec![0; end];
        if hdr.encode(payload, &mut again) != end || again[..] != input[..end] {
            return Err(format!("accepted {hdr:?} encodes to other bytes"));
        }
    }
    Ok(got)
}

/// Mutations of one datagram: bit flips, header fields set to interesting
/// values or moved by a little (sequence numbers and acknowledgements to
/// the window's edges), fields taken from another packet, SACK bits, the
/// payload length, truncation, padding, payload bytes inserted and
/// deleted, payloads grown past a frame, splicing. [`Datagram::prepare`]
/// then writes the checksum again seven times in eight, so the mutated
/// fields reach the core.
#[derive(Debug)]
pub struct Datagrams;

/// Offsets of the 32-bit fields: `dst_conn`, `src_conn`, `seq`, `ack`.
const U32_FIELDS: [usize; 4] = [4, 8, 12, 16];
const U32_VALUES: [u32; 8] = [0, 1, 2, u32::MAX, 1 << 31, (1 << 31) - 1, 1 << 30, WINDOW];
const FLAGS: [u8; 11] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 0x80, 0xff];

fn u32_field(rng: &mut SmallRng) -> usize {
    // seq and ack twice as often as the ids.
    [4, 8, 12, 12, 16, 16][rng.gen_range(0..6)]
}

fn put_u32(data: &mut [u8], at: usize, v: u32) {
    if data.len() >= at + 4 {
        data[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
}

impl Mutation for Datagrams {
    fn apply(rng: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        let len = data.len();
        match rng.gen_range(0..14) {
            0 if len > 0 => flip_bit(rng, data),
            1 if len > 3 => data[3] = FLAGS[rng.gen_range(0..FLAGS.len())],
            2 | 3 => {
                let at = u32_field(rng);
                if len >= at + 4 {
                    let d: i32 = rng.gen_range(-40..=40);
                    let v = u32_at(data, at).wrapping_add_signed(d);
                    put_u32(data, at, v);
                }
            }
            4 => {
                let at = U32_FIELDS[rng.gen_range(0..U32_FIELDS.len())];
                put_u32(data, at, U32_VALUES[rng.gen_range(0..U32_VALUES.len())]);
            }
            5 if !corpus.is_empty() => {
                // A field of another packet: its seq, ack, ids or SACK.
                let other = &corpus[rng.gen_range(0..corpus.len())];
                let (at, w) = [(4, 8), (12, 4), (16, 4), (20, 8), (16, 12)][rng.gen_range(0..5)];
                if other.len() >= at + w && len >= at + w {
                    data[at..at + w].copy_from_slice(&other[at..at + w]);
                }
            }
            6 if len >= 28 => {
                let mut s = u64::from_le_bytes(data[20..28].try_into().unwrap_or_default());
                s = match rng.gen_range(0..5) {
                    0 => s ^ (1 << rng.gen_range(0..64)),
                    1 => 0,
                    2 => u64::MAX,
                    3 => s << rng.gen_range(1..8),
                    _ => s >> rng.gen_range(1..8),
                };
                data[20..28].copy_from_slice(&s.to_le_bytes());
            }
            7 if len >= 30 => {
                let v = match rng.gen_range(0..4) {
                    0 | 1 => len.saturating_sub(PACKET_HEADER_LEN).min(0xffff) as u16,
                    2 => rng.gen_range(0..=PAYLOAD as u16 + 2),
                    _ => [0xffff, 0x8000, 0x100][rng.gen_range(0..3)],
                };
                data[28..30].copy_from_slice(&v.to_le_bytes());
            }
            8 if len >= PACKET_HEADER_LEN => {
                // Magic, version or the reserved bytes.
                let at = [0, 1, 2, 30, 31][rng.gen_range(0..5)];
                data[at] = [0, 1, 2, 3, 0xff, b'S', b'D'][rng.gen_range(0..7)];
            }
            9 if len > 0 => truncate(rng, data),
            10 => {
                let k = rng.gen_range(1..=16);
                data.extend((0..k).map(|_| rng.gen::<u8>()));
            }
            11 if len > PACKET_HEADER_LEN => {
                if rng.gen_bool(0.5) {
                    delete(rng, data, PACKET_HEADER_LEN, 16);
                } else {
                    insert_random(rng, data, 16);
                }
            }
            12 if len >= PACKET_HEADER_LEN => {
                // A payload past a fragment's, up to past a frame's, with
                // the length to match.
                let k = rng.gen_range(1..=2 * MAX_FRAME);
                let b: u8 = rng.gen();
                data.extend((0..k).map(|i| b ^ i as u8));
                data.truncate(max_len);
                let plen = (data.len() - PACKET_HEADER_LEN).min(0xffff) as u16;
                data[28..30].copy_from_slice(&plen.to_le_bytes());
            }
            _ if !corpus.is_empty() => splice(rng, data, corpus),
            _ => {}
        }
        data.truncate(max_len);
    }
}

/// Write the checksum of `data` again where its payload length fits;
/// where it does not, half the time make it the bytes after the header.
fn fix_checksum(rng: &mut SmallRng, data: &mut [u8]) {
    if data.len() < PACKET_HEADER_LEN {
        return;
    }
    let mut end = PACKET_HEADER_LEN + usize::from(u16_at(data, 28));
    if end > data.len() {
        if rng.gen_bool(0.5) {
            return;
        }
        let plen = (data.len() - PACKET_HEADER_LEN).min(0xffff);
        data[28..30].copy_from_slice(&(plen as u16).to_le_bytes());
        end = PACKET_HEADER_LEN + plen;
    }
    let c = crc(data, end);
    data[32..36].copy_from_slice(&c.to_le_bytes());
}

/// What the input is, to the end it reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// Refused by the decoder (the error's kind).
    Refused(&'static str),
    /// Other connection ids.
    Foreign,
    /// A packet the peer sent, again.
    Replay,
    /// The peer's data packet (sequence number, flags and payload) with
    /// other acknowledgement fields.
    PeerData,
    /// A data packet the peer never sent.
    ForgedData,
    /// An acknowledgement the peer never sent.
    ForgedAck,
}

impl Class {
    /// Refused, foreign or a replay: the connection must complete.
    fn benign(self) -> bool {
        matches!(self, Self::Refused(_) | Self::Foreign | Self::Replay)
    }
}

/// One end of the connection and what it did.
struct End {
    core: ReliableCore,
    init: u32,
    /// Frames committed, in order.
    sent: Vec<Vec<u8>>,
    /// Frames delivered (lent to a sink), in order.
    got: Vec<Vec<u8>>,
    /// `handle_packet` calls.
    handled: u64,
    /// Packets `poll_transmit` returned.
    transmitted: u64,
    /// The packets it sent while `record` is set.
    emitted: Vec<Vec<u8>>,
    record: bool,
    /// It was fed a data packet its peer never sent.
    forged_rx: bool,
    /// When it was closed, and the frames it had delivered then.
    closed: Option<(Instant, usize)>,
    buf: Vec<u8>,
}

impl End {
    fn new(initial_seq: u32, ids: ConnIds) -> Result<Self, String> {
        let core = ReliableCore::new(config(initial_seq), MTU, ids).map_err(|e| e.to_string())?;
        Ok(Self {
            core,
            init: initial_seq,
            sent: Vec::new(),
            got: Vec::new(),
            handled: 0,
            transmitted: 0,
            emitted: Vec::new(),
            record: true,
            forged_rx: false,
            closed: None,
            buf: vec![0; MTU],
        })
    }

    fn commit(&mut self, f: Vec<u8>) -> Result<(), String> {
        let len = f.len();
        match self.core.tx_reserve(len) {
            Ok(Some(b)) => b.copy_from_slice(&f),
            other => return Err(format!("script: tx_reserve({len}) gives {other:?}")),
        }
        self.core.tx_commit(len);
        self.sent.push(f);
        Ok(())
    }

    /// Everything `poll_transmit` gives at `now`, each packet checked;
    /// `peer_snd_nxt` bounds its acknowledgement.
    fn transmit(&mut self, now: Instant, peer_snd_nxt: u32) -> Result<Vec<Vec<u8>>, String> {
        let mut out = Vec::new();
        for _ in 0..4096 {
            // A packet longer than the MTU panics here.
            let Some(n) = self.core.poll_transmit(now, &mut self.buf) else {
                return Ok(out);
            };
            self.transmitted += 1;
            let pkt = self.buf[..n].to_vec();
            self.check_sent(&pkt, peer_snd_nxt)?;
            if self.record {
                self.emitted.push(pkt.clone());
            }
            out.push(pkt);
        }
        Err("poll_transmit never runs dry".into())
    }

    fn check_sent(&self, pkt: &[u8], peer_snd_nxt: u32) -> Result<(), String> {
        let ids = self.core.ids();
        let (h, payload) = PacketHeader::decode(pkt)
            .map_err(|e| format!("conn {} sent a packet that {e}", ids.local))?;
        if (h.src_conn, h.dst_conn) != (ids.local, ids.peer) {
            return Err(format!("conn {} sent {h:?}", ids.local));
        }
        if h.flags.contains(PacketFlags::DATA) {
            let want = fragment(&self.sent, self.init, h.seq);
            if want != Some((h.flags, payload)) {
                return Err(format!(
                    "conn {} sent {h:?} with {} payload bytes; its frames give {want:?}",
                    ids.local,
                    payload.len()
                ));
            }
        }
        if !self.forged_rx && (seq_diff(h.ack, self.init) < 0 || seq_diff(h.ack, peer_snd_nxt) > 0)
        {
            return Err(format!(
                "conn {} acknowledges up to {} but its peer committed up to {peer_snd_nxt}",
                ids.local, h.ack
            ));
        }
        Ok(())
    }

    fn receive(&mut self, now: Instant, pkt: &[u8], budget: &mut usize) {
        self.handled += 1;
        let got = &mut self.got;
        self.core
            .handle_packet(now, pkt, &mut |f| got.push(f.to_vec()), budget);
    }

    fn deliver(&mut self) {
        let got = &mut self.got;
        self.core.deliver(usize::MAX, &mut |f| got.push(f.to_vec()));
    }
}

/// Both ends, `A` first, and the script's clock.
struct World {
    ends: [End; 2],
    now: Instant,
}

impl World {
    /// `ends[i]` and `ends[1 - i]`.
    fn pair(&mut self, i: usize) -> (&mut End, &mut End) {
        let [a, b] = &mut self.ends;
        if i == 0 {
            (a, b)
        } else {
            (b, a)
        }
    }

    fn transmit(&mut self, i: usize) -> Result<Vec<Vec<u8>>, String> {
        let now = self.now;
        let (me, peer) = self.pair(i);
        me.transmit(now, peer.core.snd_nxt())
    }

    /// Hand `ends[i]` the packets of `pkts` that `mask` lets through.
    fn arrive(&mut self, i: usize, pkts: &[Vec<u8>], mask: u64, budget: usize) {
        let now = self.now;
        let e = &mut self.ends[i];
        for (k, p) in pkts.iter().enumerate() {
            if k >= 64 || mask & (1 << k) != 0 {
                let mut b = budget;
                e.receive(now, p, &mut b);
            }
        }
        e.deliver();
    }

    /// Run the script of `s` from `base`.
    fn new(s: &Scenario, base: Instant) -> Result<Self, String> {
        let mut w = World {
            ends: [End::new(s.initial_seq, A)?, End::new(s.initial_seq, B)?],
            now: base,
        };
        let all = usize::MAX;
        for (i, &len) in A1.iter().enumerate() {
            w.ends[0].commit(frame(0, i, len))?;
        }
        for (i, &len) in B1.iter().enumerate() {
            w.ends[1].commit(frame(1, i, len))?;
        }
        let (pa, pb) = (w.transmit(0)?, w.transmit(1)?);
        w.now += HOP;
        w.arrive(1, &pa, s.a1, all);
        w.arrive(0, &pb, s.b1, all);
        // Acknowledgements: B's at once (four packets, or a hole), A's
        // once its delay has passed.
        let mut acks = (w.transmit(0)?, w.transmit(1)?);
        w.now += Duration::from_micros(150);
        acks.0.extend(w.transmit(0)?);
        acks.1.extend(w.transmit(1)?);
        w.now += HOP;
        w.arrive(1, &acks.0, s.acks, all);
        w.arrive(0, &acks.1, s.acks, all);
        let n = A1.len();
        for (i, &len) in A2.iter().enumerate() {
            w.ends[0].commit(frame(0, n + i, len))?;
        }
        let n = B1.len();
        for (i, &len) in B2.iter().enumerate() {
            w.ends[1].commit(frame(1, n + i, len))?;
        }
        let (pa, pb) = (w.transmit(0)?, w.transmit(1)?);
        w.now += HOP;
        w.arrive(1, &pa, s.a2, 1);
        w.arrive(0, &pb, s.b2, 1);
        if s.timeout {
            w.now += Duration::from_millis(30);
            let now = w.now;
            for e in &mut w.ends {
                e.core.handle_timeout(now);
            }
            w.transmit(0)?;
            w.transmit(1)?;
        }
        // Acknowledgements due now, in flight with everything else.
        w.transmit(0)?;
        w.transmit(1)?;
        if s.close_b {
            let b = &mut w.ends[1];
            b.core.handle_close(w.now);
            b.closed = Some((w.now, b.got.len()));
        }
        for e in &w.ends {
            e.core
                .check()
                .map_err(|e| format!("script of {}: {e}", s.name))?;
        }
        Ok(w)
    }

    /// Exchange packets without loss until neither end has one to send
    /// nor a timer set: the steps it took, `None` if more than
    /// [`MAX_STEPS`].
    fn settle(&mut self, budget: usize) -> Result<Option<usize>, String> {
        for step in 0..MAX_STEPS {
            let now = self.now;
            for e in &mut self.ends {
                e.core.handle_timeout(now);
            }
            let (pa, pb) = (self.transmit(0)?, self.transmit(1)?);
            if pa.is_empty() && pb.is_empty() {
                let next = self.ends.iter().filter_map(|e| e.core.poll_timeout()).min();
                match next {
                    None => return Ok(Some(step)),
                    Some(t) => self.now = t.max(now + Duration::from_micros(1)),
                }
                continue;
            }
            self.now += HOP;
            self.arrive(1, &pa, u64::MAX, budget);
            self.arrive(0, &pb, u64::MAX, budget);
        }
        Ok(None)
    }
}

/// What a core shows, for comparing it before and after a packet.
#[derive(Debug, Clone, PartialEq)]
struct Shown {
    stats: CoreStats,
    snd_una: u32,
    snd_nxt: u32,
    rcv_nxt: u32,
    in_flight: u32,
    cwnd: u32,
    rto: Duration,
    ready: usize,
    tx_pending: bool,
    owes_peer: bool,
    needs_linger: bool,
    wants_transmit: bool,
    ok: bool,
}

fn shown(c: &ReliableCore, now: Instant) -> Shown {
    Shown {
        stats: *c.stats(),
        snd_una: c.snd_una(),
        snd_nxt: c.snd_nxt(),
        rcv_nxt: c.rcv_nxt(),
        in_flight: c.in_flight(),
        cwnd: c.cwnd(),
        rto: c.current_rto(),
        ready: c.ready_frames(),
        tx_pending: c.tx_pending(),
        owes_peer: c.owes_peer(),
        needs_linger: c.needs_linger(),
        wants_transmit: c.wants_transmit(now),
        ok: c.check().is_ok(),
    }
}

/// The counters in a fixed order.
fn counters(s: &CoreStats) -> [u64; COUNTERS.len()] {
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
    } = *s;
    [
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
    ]
}

/// Bit `i`: counter `i` of [`counters`] changed.
fn changed(a: &CoreStats, b: &CoreStats) -> u32 {
    counters(a)
        .iter()
        .zip(counters(b))
        .enumerate()
        .filter(|(_, (x, y))| **x != *y)
        .fold(0, |m, (i, _)| m | 1 << i)
}

/// The one packet's effect on the core it reached.
struct Step<'a> {
    class: Class,
    hdr: Option<&'a PacketHeader>,
    before: &'a Shown,
    after: &'a Shown,
    /// Frames lent to the sink.
    lent: usize,
    budget: usize,
    budget_left: usize,
    closed: bool,
}

fn check_step(s: &Step<'_>) -> Result<(), String> {
    let (b, a) = (s.before, s.after);
    let d = |f: fn(&CoreStats) -> u64| f(&a.stats).wrapping_sub(f(&b.stats));
    if d(|s| s.packets_received) != 1 {
        return Err(format!(
            "a packet counted as {} received",
            d(|s| s.packets_received)
        ));
    }
    let mut expect = b.clone();
    expect.stats.packets_received += 1;
    match (s.class, s.hdr) {
        (Class::Refused(k), _) => {
            if k == "BadChecksum" {
                expect.stats.dropped_corrupt += 1;
            } else {
                expect.stats.dropped_malformed += 1;
            }
        }
        (Class::Foreign, _) => expect.stats.dropped_foreign += 1,
        (_, Some(h)) => return check_accepted(s, h),
        (_, None) => return Err("an accepted packet without a header".into()),
    }
    if *a != expect || s.lent != 0 {
        return Err(format!(
            "a dropped packet ({:?}) changed the core: {b:?} -> {a:?}, {} frames lent",
            s.class, s.lent
        ));
    }
    Ok(())
}

fn check_accepted(s: &Step<'_>, h: &PacketHeader) -> Result<(), String> {
    let (b, a) = (s.before, s.after);
    let d = |f: fn(&CoreStats) -> u64| f(&a.stats).wrapping_sub(f(&b.stats));
    let unchanged = d(|s| s.dropped_corrupt)
        + d(|s| s.dropped_malformed)
        + d(|s| s.dropped_foreign)
        + d(|s| s.frames_sent)
        + d(|s| s.data_packets_sent)
        + d(|s| s.retransmits)
        + d(|s| s.acks_sent)
        + d(|s| s.timeouts)
        + d(|s| s.window_full);
    if unchanged != 0 {
        return Err(format!(
            "receiving {h:?} moved counters it does not own: {:?} -> {:?}",
            b.stats, a.stats
        ));
    }
    let data = h.flags.contains(PacketFlags::DATA);
    let kinds = d(|s| s.duplicates)
        + d(|s| s.out_of_window)
        + d(|s| s.out_of_order)
        + d(|s| s.dropped_backlog);
    if kinds > u64::from(data) || d(|s| s.bad_acks) > 1 {
        return Err(format!(
            "one packet {h:?} counted as {:?} -> {:?}",
            b.stats, a.stats
        ));
    }
    if a.snd_nxt != b.snd_nxt || a.in_flight > b.in_flight {
        return Err(format!(
            "receiving {h:?} took snd_nxt {} -> {}, in flight {} -> {}",
            b.snd_nxt, a.snd_nxt, b.in_flight, a.in_flight
        ));
    }
    if a.snd_una != b.snd_una && a.snd_una != h.ack {
        return Err(format!(
            "{h:?} moved snd_una {} -> {}",
            b.snd_una, a.snd_una
        ));
    }
    let moved = seq_diff(a.rcv_nxt, b.rcv_nxt);
    if moved != 0 && (!data || h.seq != b.rcv_nxt || moved < 0 || moved as u32 > WINDOW) {
        return Err(format!(
            "{h:?} moved rcv_nxt {} -> {}",
            b.rcv_nxt, a.rcv_nxt
        ));
    }
    let lent = s.lent as u64;
    if s.lent > s.budget || s.budget - s.budget_left != s.lent || d(|s| s.frames_delivered) != lent
    {
        return Err(format!(
            "{} frames lent with a budget of {} left at {}, frames_delivered {:?} -> {:?}",
            s.lent, s.budget, s.budget_left, b.stats.frames_delivered, a.stats.frames_delivered
        ));
    }
    if (!data && (moved != 0 || a.ready != b.ready || s.lent != 0)) || a.ready < b.ready {
        return Err(format!(
            "{h:?} took the ready frames {} -> {}, {} lent",
            b.ready, a.ready, s.lent
        ));
    }
    // The backlog's bound, plus the frames a drained reorder buffer can
    // complete past it.
    if a.ready > 2 * WINDOW as usize {
        return Err(format!(
            "{h:?} left {} frames waiting, past twice the window",
            a.ready
        ));
    }
    if s.closed && (s.lent != 0 || a.ready != 0) {
        return Err(format!(
            "a closed core lent {} frames, holds {}",
            s.lent, a.ready
        ));
    }
    Ok(())
}

/// The checks on both ends once the exchange is over.
fn check_end(e: &End, peer: &End, name: &str) -> Result<(), String> {
    let st = e.core.stats();
    let ok = e.core.check().is_ok();
    if st.frames_sent != e.sent.len() as u64
        || st.frames_delivered != e.got.len() as u64
        || st.data_packets_sent + st.retransmits + st.acks_sent != e.transmitted
        || st.packets_received > e.handled
        || (ok && st.packets_received != e.handled)
    {
        return Err(format!(
            "{name}'s counters {st:?} disagree: {} frames committed, {} delivered, {} \
             packets sent, {} handed to it (failed: {})",
            e.sent.len(),
            e.got.len(),
            e.transmitted,
            e.handled,
            !ok
        ));
    }
    let drops = st.dropped_corrupt
        + st.dropped_malformed
        + st.dropped_foreign
        + st.duplicates
        + st.out_of_window
        + st.out_of_order
        + st.dropped_backlog;
    if drops > st.packets_received {
        return Err(format!(
            "{name} dropped more packets than it received: {st:?}"
        ));
    }
    if e.core.in_flight() > WINDOW {
        return Err(format!(
            "{name} has {} packets in flight",
            e.core.in_flight()
        ));
    }
    if let Some(f) = e.got.iter().find(|f| f.len() > MAX_FRAME) {
        return Err(format!("{name} delivered a frame of {} bytes", f.len()));
    }
    if !e.forged_rx {
        let prefix =
            e.got.len() <= peer.sent.len() && e.got.iter().zip(&peer.sent).all(|(g, s)| g == s);
        if !prefix {
            return Err(format!(
                "{name} delivered {} frames that are not the first of the {} its peer committed",
                e.got.len(),
                peer.sent.len()
            ));
        }
    }
    if let Some((_, n)) = e.closed {
        if e.got.len() != n {
            return Err(format!(
                "{name} delivered {} frames after its close",
                e.got.len() - n
            ));
        }
    }
    if ok && !e.core.tx_pending() {
        let first = st.data_packets_sent;
        let seqs = u64::from(e.core.snd_nxt().wrapping_sub(e.init));
        if first != seqs {
            return Err(format!(
                "{name} sent {first} packets for the first time for {seqs} sequence numbers"
            ));
        }
    }
    Ok(())
}

/// After a benign packet: the connection completed.
fn check_complete(w: &World, victim: usize, class: Class) -> Result<(), String> {
    for (i, e) in w.ends.iter().enumerate() {
        let name = ["A", "B"][i];
        let peer = &w.ends[1 - i];
        let st = e.core.stats();
        if let Err(why) = e.core.check() {
            return Err(format!("{name} failed: {why}"));
        }
        if e.core.tx_pending() {
            return Err(format!(
                "{name} still has {} packets unacknowledged",
                e.core.in_flight()
            ));
        }
        if e.closed.is_none() && e.got != peer.sent {
            return Err(format!(
                "{name} delivered {} of the {} frames its peer committed",
                e.got.len(),
                peer.sent.len()
            ));
        }
        let dropped = st.dropped_corrupt + st.dropped_malformed + st.dropped_foreign;
        let input = u64::from(i == victim && matches!(class, Class::Refused(_) | Class::Foreign));
        if st.bad_acks != 0 || dropped != input {
            return Err(format!("{name}'s counters after a benign packet: {st:?}"));
        }
        if let Some((at, _)) = e.closed {
            // The linger runs from the close or the peer's last packet
            // since, both at or before `now`.
            let later = w.now.max(at) + e.core.linger();
            if !e.core.is_wound_down(later) {
                return Err(format!("{name}, closed, never winds down"));
            }
        }
    }
    Ok(())
}

/// See the module documentation.
#[derive(Debug)]
pub struct Datagram {
    base: Instant,
    runs: u64,
    classes: BTreeMap<Class, u64>,
    /// Runs where the input made the core it reached fail.
    failed: u64,
    /// Forged frames delivered.
    forged_frames: u64,
    /// Benign runs whose connection completed.
    completed: u64,
    /// Most steps an exchange took to settle.
    most_steps: usize,
    /// Runs whose input moved each counter of [`counters`].
    moved: [u64; COUNTERS.len()],
    /// Why cores failed, either end.
    failures: BTreeMap<String, u64>,
    /// The class of the last run's input.
    last: Option<Class>,
}

/// Names of [`counters`], for the summary.
const COUNTERS: [&str; 18] = [
    "frames_sent",
    "frames_delivered",
    "data_packets_sent",
    "retransmits",
    "fast_retransmits",
    "acks_sent",
    "packets_received",
    "dropped_corrupt",
    "dropped_malformed",
    "dropped_foreign",
    "bad_acks",
    "duplicates",
    "out_of_window",
    "out_of_order",
    "dropped_backlog",
    "timeouts",
    "window_full",
    "cwnd_reductions",
];

impl Default for Datagram {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            runs: 0,
            classes: BTreeMap::new(),
            failed: 0,
            forged_frames: 0,
            completed: 0,
            most_steps: 0,
            moved: [0; COUNTERS.len()],
            failures: BTreeMap::new(),
            last: None,
        }
    }
}

/// The choices of a run its input does not hold.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// Index into [`SCENARIOS`].
    pub scenario: usize,
    /// Index into the delivery budgets: 0, 1, unbounded.
    pub budget: usize,
}

impl Case {
    fn all() -> impl Iterator<Item = Case> {
        (0..SCENARIOS.len())
            .flat_map(|scenario| (0..BUDGETS.len()).map(move |budget| Case { scenario, budget }))
    }
}

impl Datagram {
    /// Every packet both ends send in every scenario's script, then in
    /// the exchange that completes it: data of every kind of fragment,
    /// retransmissions, acknowledgements with and without SACK bits.
    pub fn seeds(&self) -> Vec<Vec<u8>> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for s in &SCENARIOS {
            let Ok(mut w) = World::new(s, self.base) else {
                continue;
            };
            let _ = w.settle(usize::MAX);
            for e in &w.ends {
                for p in &e.emitted {
                    if seen.insert(p.clone()) {
                        out.push(p.clone());
                    }
                }
            }
        }
        out
    }

    /// What the accepted packet `input` (`h`, `payload`) is to `e`.
    fn classify(input: &[u8], h: &PacketHeader, payload: &[u8], e: &End, peer: &End) -> Class {
        let ids = e.core.ids();
        if (h.dst_conn, h.src_conn) != (ids.local, ids.peer) {
            return Class::Foreign;
        }
        let end = PACKET_HEADER_LEN + payload.len();
        if peer.emitted.iter().any(|p| p[..] == input[..end]) {
            return Class::Replay;
        }
        if !h.flags.contains(PacketFlags::DATA) {
            return Class::ForgedAck;
        }
        if fragment(&peer.sent, peer.init, h.seq) == Some((h.flags, payload)) {
            Class::PeerData
        } else {
            Class::ForgedData
        }
    }
}

impl Target for Datagram {
    const SPEC: Spec = Spec {
        name: "fuzz-datagram",
        seed: 0x5357_4447,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/datagram"),
        max_len: 2048,
        max_len_flag: false,
        corpus_flags: false,
        max_corpus: 4096,
        failure_prefix: "datagram",
    };
    type Mutation = Datagrams;
    type Case = Case;
    type Key = u64;

    fn seeds(&self) -> Vec<Vec<u8>> {
        Datagram::seeds(self)
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<Datagrams>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> Case {
        // One in sixteen unmutated: replays of the peer's packets.
        if !m.rng().gen_ratio(1, 16) {
            m.mutate(input, corpus);
            if !m.rng().gen_ratio(1, 8) {
                fix_checksum(m.rng(), input);
            }
        }
        Case {
            scenario: m.rng().gen_range(0..SCENARIOS.len()),
            budget: m.rng().gen_range(0..BUDGETS.len()),
        }
    }

    fn run(&mut self, case: &Case, input: &[u8]) -> Result<u64, String> {
        self.runs += 1;
        let decoded = check_decode(input)?;
        let s = &SCENARIOS[case.scenario];
        let mut w = World::new(s, self.base)?;
        let v = usize::from(peek_dst_conn(input) != Some(A.local));
        let budget = BUDGETS[case.budget];
        w.now += HOP;
        let now = w.now;
        let (e, peer) = w.pair(v);
        let class = match &decoded {
            Ok((h, p)) => Self::classify(input, h, p, e, peer),
            Err(err) => Class::Refused(error_kind(err)),
        };
        *self.classes.entry(class).or_default() += 1;
        self.last = Some(class);
        e.record = false;
        peer.record = false;
        let before = shown(&e.core, now);
        let lent_before = e.got.len();
        let mut left = budget;
        e.receive(now, input, &mut left);
        let after = shown(&e.core, now);
        check_step(&Step {
            class,
            hdr: decoded.as_ref().ok().map(|(h, _)| h),
            before: &before,
            after: &after,
            lent: e.got.len() - lent_before,
            budget,
            budget_left: left,
            closed: e.closed.is_some(),
        })?;
        e.forged_rx = class == Class::ForgedData;
        e.deliver();
        let victim_failed = !after.ok;
        if victim_failed {
            self.failed += 1;
        }
        let Some(steps) = w.settle(budget)? else {
            return Err(format!("the exchange did not settle in {MAX_STEPS} steps"));
        };
        self.most_steps = self.most_steps.max(steps);
        let [a, b] = &w.ends;
        check_end(a, b, "A")?;
        check_end(b, a, "B")?;
        if class.benign() {
            check_complete(&w, v, class)?;
            self.completed += 1;
        }
        let e = &w.ends[v];
        if e.forged_rx {
            let peer = &w.ends[1 - v];
            let forged = e
                .got
                .iter()
                .enumerate()
                .filter(|(i, f)| peer.sent.get(*i) != Some(*f))
                .count();
            self.forged_frames += forged as u64;
        }
        let moved = changed(&before.stats, &after.stats);
        for (i, n) in self.moved.iter_mut().enumerate() {
            *n += u64::from(moved >> i & 1);
        }
        for e in &w.ends {
            if let Err(why) = e.core.check() {
                let why = why.to_string();
                // The reason without its numbers.
                let why = why.split(" (").next().unwrap_or_default();
                let why = why.trim_end_matches(|c: char| !c.is_alphabetic());
                let why = why.split(": 1").next().unwrap_or_default();
                match self.failures.get_mut(why) {
                    Some(n) => *n += 1,
                    None => {
                        self.failures.insert(why.to_string(), 1);
                    }
                }
            }
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (
            case.scenario,
            case.budget,
            v,
            class,
            moved,
            before.snd_una != after.snd_una,
            before.rcv_nxt != after.rcv_nxt,
            victim_failed,
            w.ends
                .iter()
                .map(|e| e.core.check().is_ok())
                .collect::<Vec<_>>(),
        )
            .hash(&mut h);
        Ok(h.finish())
    }

    fn describe(&self, case: &Case) -> String {
        format!(
            " in scenario {} with a delivery budget of {}",
            SCENARIOS[case.scenario].name,
            ["0", "1", "unbounded"][case.budget]
        )
    }

    fn progress(&self) -> String {
        format!(
            "runs {}  completed {}  core failed {}  forged frames {}",
            self.runs, self.completed, self.failed, self.forged_frames
        )
    }

    fn summary(&self) -> Vec<String> {
        vec![
            format!(
                "runs {} | benign runs completed {} | cores failed by the input {} | forged \
                 frames delivered {}",
                self.runs, self.completed, self.failed, self.forged_frames
            ),
            format!("inputs by class: {:?}", self.classes),
            format!(
                "counters the input moved (runs): {:?}",
                COUNTERS
                    .iter()
                    .zip(self.moved)
                    .filter(|(_, n)| *n > 0)
                    .collect::<Vec<_>>()
            ),
            format!("core failures (either end): {:?}", self.failures),
            format!("most steps an exchange took to settle: {}", self.most_steps),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        for case in Case::all() {
            self.run(&case, input)
                .map_err(|e| format!("{e}{}", self.describe(&case)))?;
        }
        Ok(())
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        println!("{:?}", PacketHeader::decode(input));
        let mut ok = true;
        for case in Case::all() {
            let r = self.run(&case, input).map(drop);
            let class = self.last;
            println!(
                "{}: {class:?} -> {:?}",
                self.describe(&case).trim_start(),
                r
            );
            ok &= r.is_ok();
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_runs_and_every_seed_passes() {
        let mut t = Datagram::default();
        let seeds = t.seeds();
        assert!(seeds.len() > 30, "{} seeds", seeds.len());
        for s in &seeds {
            t.check(s).unwrap_or_else(|e| panic!("{e}: {s:?}"));
        }
        // Each scenario's own packets are replays, and complete.
        assert!(t.classes.get(&Class::Replay).is_some_and(|&n| n > 0));
        assert!(t.completed > 0);
    }

    #[test]
    fn a_short_run_keeps_the_oracles_and_reaches_every_class() {
        let mut t = Datagram::default();
        let seeds = t.seeds();
        let mut m = Mutator::<Datagrams>::new(5, Datagram::SPEC.max_len);
        for i in 0..10_000 {
            let mut d = seeds[i % seeds.len()].clone();
            let case = t.prepare(&mut m, &mut d, &seeds);
            t.run(&case, &d).unwrap_or_else(|e| panic!("{e}: {d:?}"));
        }
        for k in [
            Class::Refused("Truncated"),
            Class::Refused("BadChecksum"),
            Class::Refused("Malformed"),
            Class::Foreign,
            Class::Replay,
            Class::PeerData,
            Class::ForgedData,
            Class::ForgedAck,
        ] {
            assert!(
                t.classes.contains_key(&k),
                "{k:?} never reached: {:?}",
                t.classes
            );
        }
        assert!(t.failed > 0, "no input made a core fail");
    }

    #[test]
    fn the_scenarios_leave_the_states_they_name() {
        let base = Instant::now();
        let worlds: Vec<World> = SCENARIOS
            .iter()
            .map(|s| World::new(s, base).unwrap())
            .collect();
        let st = |w: usize, e: usize| *worlds[w].ends[e].core.stats();
        let rcv = |w: usize, e: usize| {
            let c = &worlds[w].ends[e].core;
            c.rcv_nxt().wrapping_sub(c.config().initial_seq)
        };
        // in-flight: B has A's first flight and two fragments of the
        // 300-byte frame; A has packets unacknowledged.
        assert_eq!(rcv(0, 1), 6 + 2);
        assert!(worlds[0].ends[0].core.tx_pending());
        // holes: both ends buffer out of order, A resent fast, sequence
        // numbers wrapped.
        assert!(st(1, 0).out_of_order > 0 && st(1, 1).out_of_order > 0);
        assert!(st(1, 0).fast_retransmits > 0);
        assert!(worlds[1].ends[1].core.rcv_nxt() < SCENARIOS[1].initial_seq);
        // timeout: both ends timed out.
        assert!(st(2, 0).timeouts > 0 && st(2, 1).timeouts > 0);
        // closed: B has three fragments of the 300-byte frame, and is
        // closed with something to linger for.
        assert_eq!(rcv(3, 1), 6 + 3);
        assert!(worlds[3].ends[1].closed.is_some());
        assert!(worlds[3].ends[1].core.needs_linger());
    }

    #[test]
    fn the_reference_agrees_on_hand_made_packets() {
        let hdr = PacketHeader {
            flags: PacketFlags::NONE,
            dst_conn: 2,
            src_conn: 1,
            seq: 0,
            ack: 5,
            sack: 3,
            payload_len: 0,
        };
        let mut p = vec![0; PACKET_HEADER_LEN];
        hdr.encode(&[], &mut p);
        assert!(check_decode(&p).unwrap().is_ok());
        // An acknowledgement with a sequence number, checksum written again.
        p[12] = 1;
        let mut rng = <SmallRng as rand::SeedableRng>::seed_from_u64(1);
        fix_checksum(&mut rng, &mut p);
        assert_eq!(reference(&p), Err(("Malformed", 0)));
        assert!(matches!(
            check_decode(&p),
            Ok(Err(PacketError::Malformed(_)))
        ));
        assert_eq!(reference(&p[..20]), Err(("Truncated", PACKET_HEADER_LEN)));
    }
}

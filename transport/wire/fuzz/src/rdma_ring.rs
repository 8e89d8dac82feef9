//! [`RdmaRing`]: the receive path of the RDMA backend's ring protocol
//! (`starwire_rdma::RingConn`, driven through its `RdmaDriver` over the
//! crate's simulated NICs) as a driver target (`fuzz-rdma-ring`), with
//! [`RingOps`], mutations of its op scripts.
//!
//! An input is a script. Its first byte says after how many ops the
//! victim connects (bits 0-2; the peer may write before it does: the
//! driver holds those completions and replays them on `connect`) and
//! whether the peer first announces a hostile ring address, one whose
//! ring runs past the end of the address space (bit 3; bits 4-7 pick it),
//! which the victim must refuse with `RingError::Remote`, staying
//! prepared; every op after it is an opcode byte and its arguments:
//!
//! * the *peer*, a hand-driven [`SimNic`] on the victim's fabric, writes an
//!   honest frame into the victim's ring (placed at its tail, wrapping as
//!   the protocol says, only within the credits it was given), a frame whose
//!   immediate lies (wrap bit flipped, length off from the bytes written),
//!   a fully forged write (any immediate, any offset and length, in the
//!   ring's bounds or not), an honest credit message for the victim's frames
//!   it consumed, or a forged credit immediate;
//! * the *victim*, an [`RdmaDriver`] with one connection, runs a receive
//!   pass with a delivery budget, queues a frame for the peer and flushes,
//!   or only flushes (which returns its credits).
//!
//! The peer polls its completion queue after each of its ops, so the
//! target knows exactly which writes its NIC executed and in which order
//! they land at the victim (on the victim's next poll). A model of the
//! receiver, written from `docs/backends/rdma.md`, follows them: the
//! landed bytes (a shadow of the victim's ring), the frames polled and not
//! yet lent, the receiver's head, both credits, the counters, and the
//! first protocol violation. Oracles, besides "no panic":
//!
//! * every frame lent is the model's next frame: a slice of the victim's
//!   ring region at exactly the offset the protocol gives it (after a wrap,
//!   0), of the immediate's length, holding exactly the bytes that landed
//!   there; a receive pass lends at most its budget;
//! * a violation (a credit overflowing the peer's ring or receive depth, a
//!   wrap marker at offset 0, a length that is not the bytes written, a
//!   frame that does not fit the ring) ends the connection with a
//!   [`RingFault::Protocol`] of that kind, after the frames before it, and
//!   no such fault comes without one; a completion error
//!   ([`RingFault::Completion`]) comes only after the peer broke its queue
//!   pair or forged credits; the fault is reported once, kept, and nothing
//!   is delivered after it;
//! * the counters agree with the model: frames received (and the frames
//!   the sink saw), credit messages received, the ring and receive-WR
//!   credits after a receive pass, and one receive WR spent per write a
//!   flush posts;
//! * a script of honest ops never fails the connection, and at its end
//!   every honest frame has been lent.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::Rng;
use starwire_rdma::imm::{slot_len, MAX_CREDIT_BYTES, MAX_CREDIT_RECVS};
use starwire_rdma::{
    Access, Completion, Imm, LocalSlice, MemoryRegion, RdmaDriver, RemoteRing, RemoteSlice,
    RingConfig, RingConn, RingError, RingFault, SimConfig, SimNic, Verbs, WcOpcode,
};
use starwire_transport::{ConnId, Driver};

use crate::driver::{Spec, Target};
use crate::mutate::{delete, duplicate, flip_bit, insert_random, splice, truncate};
use crate::{Mutation, Mutator};

/// Ring sizes of one run: the victim's own, and the ring and receive
/// depth its peer announces.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// A name for reports.
    pub name: &'static str,
    /// The victim's ring, staging and receive depth.
    pub victim: RingConfig,
    /// The peer's ring length.
    pub peer_ring: usize,
    /// The peer's receive depth.
    pub peer_depth: u32,
}

/// The shapes a script runs against.
pub const SHAPES: [Shape; 2] = [
    Shape {
        name: "1k/4",
        victim: RingConfig {
            ring_len: 1024,
            staging_len: 1024,
            recv_depth: 4,
            max_frame_len: None,
        },
        peer_ring: 1024,
        peer_depth: 4,
    },
    Shape {
        name: "2k/8",
        victim: RingConfig {
            ring_len: 2048,
            staging_len: 1024,
            recv_depth: 8,
            max_frame_len: None,
        },
        peer_ring: 4096,
        peer_depth: 16,
    },
];

/// Delivery budgets of a receive pass.
const BUDGETS: [usize; 5] = [0, 1, 2, 3, usize::MAX];

/// Opcodes of a script (the byte modulo [`N_OPS`]).
const OP_FRAME: u8 = 0;
const OP_FORGE: u8 = 1;
const OP_CREDIT: u8 = 2;
const OP_FORGE_CREDIT: u8 = 3;
const OP_LIE: u8 = 4;
const OP_RX: u8 = 5;
const OP_SEND: u8 = 6;
const OP_FLUSH: u8 = 7;
const N_OPS: u8 = 8;

/// Argument bytes of each opcode.
const ARGS: [usize; N_OPS as usize] = [2, 8, 0, 4, 3, 1, 2, 0];

/// One parsed op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Frame(u16),
    Forge { imm: u32, off: u16, len: u16 },
    Credit,
    ForgeCredit(u32),
    Lie { len: u16, how: u8 },
    Rx(u8),
    Send(u16),
    Flush,
}

/// The script of `input`: when the victim connects, and the ops (a
/// truncated last op is dropped).
fn parse(input: &[u8]) -> (usize, Vec<Op>) {
    let Some((&first, mut rest)) = input.split_first() else {
        return (0, Vec::new());
    };
    let mut ops = Vec::new();
    while let Some((&code, tail)) = rest.split_first() {
        let code = code % N_OPS;
        let n = ARGS[usize::from(code)];
        if tail.len() < n {
            break;
        }
        let a = &tail[..n];
        let u16_at = |i: usize| u16::from_le_bytes([a[i], a[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
        ops.push(match code {
            OP_FRAME => Op::Frame(u16_at(0)),
            OP_FORGE => Op::Forge {
                imm: u32_at(0),
                off: u16_at(4),
                len: u16_at(6),
            },
            OP_CREDIT => Op::Credit,
            OP_FORGE_CREDIT => Op::ForgeCredit(u32_at(0)),
            OP_LIE => Op::Lie {
                len: u16_at(0),
                how: a[2],
            },
            OP_RX => Op::Rx(a[0]),
            OP_SEND => Op::Send(u16_at(0)),
            _ => Op::Flush,
        });
        rest = &tail[n..];
    }
    (usize::from(first & 7), ops)
}

/// The hostile ring address bits 3-7 of the first byte of `input` ask
/// for: at most 1023 bytes below the top of the address space, so every
/// shape's peer ring (at least 1024 bytes) runs past it.
fn hostile_addr(input: &[u8]) -> Option<u64> {
    let first = *input.first()?;
    (first & 8 != 0).then(|| u64::MAX - 63 - 64 * u64::from(first >> 4))
}

/// The bytes of `op` in a script.
fn encode(op: Op, out: &mut Vec<u8>) {
    match op {
        Op::Frame(len) => {
            out.push(OP_FRAME);
            out.extend_from_slice(&len.to_le_bytes());
        }
        Op::Forge { imm, off, len } => {
            out.push(OP_FORGE);
            out.extend_from_slice(&imm.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        Op::Credit => out.push(OP_CREDIT),
        Op::ForgeCredit(v) => {
            out.push(OP_FORGE_CREDIT);
            out.extend_from_slice(&v.to_le_bytes());
        }
        Op::Lie { len, how } => {
            out.push(OP_LIE);
            out.extend_from_slice(&len.to_le_bytes());
            out.push(how);
        }
        Op::Rx(b) => out.extend_from_slice(&[OP_RX, b]),
        Op::Send(len) => {
            out.push(OP_SEND);
            out.extend_from_slice(&len.to_le_bytes());
        }
        Op::Flush => out.push(OP_FLUSH),
    }
}

/// A script's bytes.
fn script(connect_after: u8, ops: &[Op]) -> Vec<u8> {
    let mut out = vec![connect_after];
    for &op in ops {
        encode(op, &mut out);
    }
    out
}

/// The kinds of protocol violation the receiver must detect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Violation {
    /// A credit that overflows the peer's ring or receive depth.
    Credit,
    /// A wrap marker while the head is at offset 0.
    WrapAtZero,
    /// A length that is not the bytes written, or a frame past the ring.
    Misfit,
}

/// The violation a fault's text names, if it is a protocol fault.
fn violation_of(f: &RingFault) -> Option<Result<Violation, String>> {
    let RingFault::Protocol(m) = f else {
        return None;
    };
    Some(if m.starts_with("credit of") {
        Ok(Violation::Credit)
    } else if m.starts_with("wrap marker") {
        Ok(Violation::WrapAtZero)
    } else if m.contains("does not fit") {
        Ok(Violation::Misfit)
    } else {
        Err(m.clone())
    })
}

/// A short name of a fault, for statistics and outcome keys.
fn fault_name(f: &RingFault) -> String {
    match f {
        RingFault::Protocol(_) => match violation_of(f) {
            Some(Ok(v)) => format!("protocol {v:?}"),
            _ => "protocol (other)".into(),
        },
        RingFault::Completion { wr, status, .. } => format!("{wr:?} {}", status.verbs_name()),
        RingFault::Verbs(_) => "verbs".into(),
        _ => "other".into(),
    }
}

/// A write the peer's NIC executed: it lands at the victim on the
/// victim's next poll.
#[derive(Debug, Clone, Copy)]
struct Write {
    /// Ring offset of its first byte.
    off: usize,
    /// Offset of its bytes in the peer's staging.
    src: usize,
    len: usize,
    imm: u32,
}

/// A received frame the model holds until it is lent.
#[derive(Debug, Clone, Copy)]
struct Pending {
    wrap: bool,
    len: usize,
    byte_len: usize,
}

/// The receiver as the protocol describes it.
#[derive(Debug)]
struct Model {
    ring_len: usize,
    peer_ring: usize,
    peer_depth: u32,
    /// The bytes of the victim's ring.
    shadow: Vec<u8>,
    /// Executed by the peer's NIC, not yet applied at the victim.
    landed: VecDeque<Write>,
    /// Polled before the victim connected.
    held: Vec<(u32, usize)>,
    connected: bool,
    pending: VecDeque<Pending>,
    head: usize,
    ring_credit: usize,
    recv_credit: u32,
    frames: u64,
    credits: u64,
    violation: Option<Violation>,
}

impl Model {
    /// Apply the landed writes (the victim is polling): their bytes, then
    /// their completions, in order, or held until connected.
    fn land(&mut self, staging: &[u8]) {
        while let Some(w) = self.landed.pop_front() {
            self.shadow[w.off..w.off + w.len].copy_from_slice(&staging[w.src..w.src + w.len]);
            if self.connected {
                self.complete(w.imm, w.len);
            } else {
                self.held.push((w.imm, w.len));
            }
        }
    }

    /// One receive completion of the connection.
    fn complete(&mut self, imm: u32, byte_len: usize) {
        if self.violation.is_some() {
            return;
        }
        match Imm::decode(imm) {
            Imm::Data { wrap, len } => self.pending.push_back(Pending {
                wrap,
                len,
                byte_len,
            }),
            Imm::Credit { bytes, recvs } => {
                if self.ring_credit + bytes > self.peer_ring
                    || self.recv_credit + recvs > self.peer_depth
                {
                    self.violation = Some(Violation::Credit);
                } else {
                    self.ring_credit += bytes;
                    self.recv_credit += recvs;
                    self.credits += 1;
                }
            }
        }
    }

    /// Lend up to `max` frames: their ring offsets and lengths.
    fn deliver(&mut self, max: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        if self.violation.is_some() {
            return out;
        }
        while out.len() < max {
            let Some(&f) = self.pending.front() else {
                break;
            };
            let mut at = self.head;
            if f.wrap {
                if at == 0 {
                    self.violation = Some(Violation::WrapAtZero);
                    break;
                }
                at = 0;
            }
            let end = at + slot_len(f.len);
            if f.len != f.byte_len || end > self.ring_len {
                self.violation = Some(Violation::Misfit);
                break;
            }
            self.pending.pop_front();
            out.push((at, f.len));
            self.head = if end == self.ring_len { 0 } else { end };
            self.frames += 1;
        }
        out
    }
}

/// The hand-driven peer: a sender into the victim's ring and a receiver
/// of the victim's frames, honest unless an op says otherwise.
#[derive(Debug)]
struct Peer {
    nic: SimNic,
    qpn: u32,
    staging: MemoryRegion,
    /// What `staging` holds (fixed: a write's bytes are known whenever it
    /// executes).
    bytes: Vec<u8>,
    ring_len: usize,
    victim: RemoteRing,
    /// Writes posted, awaiting their send completions.
    posted: VecDeque<(u64, Write)>,
    next_wr: u64,
    /// Sender state towards the victim.
    tail: usize,
    credit: usize,
    recvs: u32,
    /// Receiver state of the victim's frames.
    head: usize,
    owed_bytes: usize,
    owed_recvs: u32,
    /// A write of ours failed: our queue pair is in error.
    broken: bool,
    /// Frames the victim sent us.
    got: u64,
}

impl Peer {
    /// Post one write and ring the doorbell; false if the verbs refused.
    fn write(&mut self, w: Write, model: &mut Model) -> bool {
        let wr_id = self.next_wr;
        let posted = self.nic.post_write_with_imm(
            self.qpn,
            wr_id,
            LocalSlice {
                lkey: self.staging.lkey,
                offset: w.src,
                len: w.len,
            },
            RemoteSlice {
                rkey: self.victim.rkey,
                addr: self.victim.addr + w.off as u64,
            },
            w.imm,
        );
        if posted.is_err() {
            return false;
        }
        self.next_wr += 1;
        self.posted.push_back((wr_id, w));
        let _ = self.nic.ring_doorbell();
        self.pump(model);
        true
    }

    /// Poll our completion queue dry: our executed writes go to the model
    /// (they land at the victim on its next poll); the victim's frames and
    /// credits are taken in, and each receive WR re-posted.
    fn pump(&mut self, model: &mut Model) {
        let mut wcs = [Completion::default(); 16];
        loop {
            let Ok(n) = self.nic.poll_cq(&mut wcs) else {
                self.broken = true;
                return;
            };
            for wc in &wcs[..n] {
                match wc.opcode {
                    WcOpcode::RdmaWrite => {
                        let Some((id, w)) = self.posted.pop_front() else {
                            continue;
                        };
                        debug_assert_eq!(id, wc.wr_id);
                        if wc.status.is_success() {
                            model.landed.push_back(w);
                        } else {
                            self.broken = true;
                        }
                    }
                    _ => {
                        if !wc.status.is_success() {
                            continue;
                        }
                        match wc.imm.map(Imm::decode) {
                            Some(Imm::Data { wrap, len }) => {
                                let mut at = self.head;
                                if wrap {
                                    self.owed_bytes += self.ring_len - at;
                                    at = 0;
                                }
                                let end = (at + slot_len(len)).min(self.ring_len);
                                self.owed_bytes += end - at;
                                self.head = if end == self.ring_len { 0 } else { end };
                                self.got += 1;
                            }
                            Some(Imm::Credit { bytes, recvs }) => {
                                self.credit += bytes;
                                self.recvs += recvs;
                            }
                            None => {}
                        }
                        if self.nic.post_recv(self.qpn, 1 << 40 | self.next_wr).is_ok() {
                            self.owed_recvs += 1;
                        }
                    }
                }
            }
            if n < wcs.len() {
                return;
            }
        }
    }

    /// A frame of `len` bytes placed at our tail as the protocol says;
    /// `None` when the credits do not allow it.
    fn place(&self, len: usize, seq: u64) -> Option<(Write, bool, usize)> {
        let slot = slot_len(len);
        let wrap = self.tail + slot > self.victim.len;
        let need = if wrap {
            self.victim.len - self.tail + slot
        } else {
            slot
        };
        if self.recvs < 1 || need > self.credit || slot > self.victim.len {
            return None;
        }
        let w = Write {
            off: if wrap { 0 } else { self.tail },
            src: (seq as usize * 64) % self.victim.len,
            len,
            imm: Imm::Data { wrap, len }.encode(),
        };
        Some((w, wrap, need))
    }

    /// Account a placed frame in our sender state.
    fn advance(&mut self, w: &Write, need: usize) {
        self.credit -= need;
        self.recvs -= 1;
        let end = w.off + slot_len(w.len);
        self.tail = if end == self.victim.len { 0 } else { end };
    }
}

/// What a run did, for the key and the statistics.
#[derive(Debug, Default, Clone, Hash)]
struct Outcome {
    fault: Option<String>,
    frames: u64,
    credits: u64,
    wrapped: u64,
    forged: bool,
    held: bool,
}

/// One run: the victim's driver, the peer, the model.
#[derive(Debug)]
struct Run {
    d: RdmaDriver<SimNic>,
    c: ConnId,
    remote: RemoteRing,
    connected: bool,
    peer: Peer,
    m: Model,
    now: Instant,
    /// A ring address past the end of the address space the peer
    /// announces first, to be refused.
    hostile: Option<u64>,
    /// Offset of the victim ring's first byte in memory.
    base: usize,
    /// The peer broke its queue pair or forged credits: a completion
    /// error at the victim may follow.
    misbehaved: bool,
    /// Any op other than the honest ones ran.
    forged: bool,
    /// Failures the driver reported.
    reported: u32,
    /// Honest frames the peer wrote.
    honest: u64,
    wrapped: u64,
    seq: u64,
}

fn err<T>(s: String) -> Result<T, String> {
    Err(s)
}

impl Run {
    fn new(shape: &Shape) -> Result<Self, String> {
        let (mut nv, mut np) = SimNic::pair(SimConfig::default());
        let (qv, qp) = nv
            .connect_qp(&mut np)
            .map_err(|e| format!("connect_qp: {e}"))?;
        let mut d = RdmaDriver::new(nv, shape.victim).map_err(|e| format!("driver: {e}"))?;
        let (c, local) = d.prepare(qv).map_err(|e| format!("prepare: {e}"))?;
        let ring = np
            .reg_mr(shape.peer_ring, Access::RemoteWrite)
            .map_err(|e| format!("peer ring: {e}"))?;
        let staging_len = 2 * local.len + 128;
        let staging = np
            .reg_mr(staging_len, Access::Local)
            .map_err(|e| format!("peer staging: {e}"))?;
        let bytes: Vec<u8> = (0..staging_len)
            .map(|i| (i as u8).wrapping_mul(29) ^ (i >> 7) as u8 ^ 0x5a)
            .collect();
        np.mr_mem(staging.lkey)
            .ok_or("peer staging not registered")?
            .write(0, &bytes)
            .map_err(|e| format!("peer staging: {e}"))?;
        for i in 0..shape.peer_depth {
            np.post_recv(qp, 1 << 40 | u64::from(i))
                .map_err(|e| format!("peer post_recv: {e}"))?;
        }
        let remote = RemoteRing {
            rkey: ring.rkey,
            addr: ring.addr,
            len: shape.peer_ring,
            recv_depth: shape.peer_depth,
        };
        let m = Model {
            ring_len: local.len,
            peer_ring: shape.peer_ring,
            peer_depth: shape.peer_depth,
            shadow: vec![0; local.len],
            landed: VecDeque::new(),
            held: Vec::new(),
            connected: false,
            pending: VecDeque::new(),
            head: 0,
            ring_credit: 0,
            recv_credit: 0,
            frames: 0,
            credits: 0,
            violation: None,
        };
        let peer = Peer {
            nic: np,
            qpn: qp,
            staging,
            bytes,
            ring_len: shape.peer_ring,
            victim: local,
            posted: VecDeque::new(),
            next_wr: 0,
            tail: 0,
            credit: local.len,
            recvs: local.recv_depth,
            head: 0,
            owed_bytes: 0,
            owed_recvs: 0,
            broken: false,
            got: 0,
        };
        Ok(Self {
            d,
            c,
            remote,
            connected: false,
            peer,
            m,
            now: Instant::now(),
            hostile: None,
            base: 0,
            misbehaved: false,
            forged: false,
            reported: 0,
            honest: 0,
            wrapped: 0,
            seq: 0,
        })
    }

    fn ring(&self) -> Option<&RingConn> {
        self.d.ring(self.c)
    }

    fn fault(&self) -> Option<RingFault> {
        self.ring().and_then(|r| r.fault().cloned())
    }

    /// Connect the victim: the completions it held are replayed.
    fn connect(&mut self) -> Result<(), String> {
        if let Some(addr) = self.hostile.take() {
            let lie = RemoteRing {
                addr,
                ..self.remote
            };
            match self.d.connect(self.c, lie) {
                Err(RingError::Remote(_)) => {}
                Err(e) => return err(format!("ring at {addr:#x} refused with {e}")),
                Ok(()) => return err(format!("a ring at {addr:#x} was accepted")),
            }
            if self.d.ring(self.c).is_some() {
                return err("connected after a refused connect".into());
            }
        }
        self.d
            .connect(self.c, self.remote)
            .map_err(|e| format!("connect refused: {e}"))?;
        self.connected = true;
        let ring = self.d.ring(self.c).ok_or("not connected after connect")?;
        let (region, credit, recvs) = (
            ring.ring_region(),
            ring.ring_credit(),
            ring.peer_recv_credit(),
        );
        let mem = self
            .d
            .verbs()
            .mr_mem(region.lkey)
            .ok_or("victim ring not registered")?;
        self.base = mem.as_ptr() as usize;
        self.m.connected = true;
        self.m.ring_credit = credit;
        self.m.recv_credit = recvs;
        if (self.m.ring_credit, self.m.recv_credit) != (self.remote.len, self.remote.recv_depth) {
            return err(format!(
                "connected with credits {} / {}, the peer announced {} / {}",
                self.m.ring_credit, self.m.recv_credit, self.remote.len, self.remote.recv_depth
            ));
        }
        let held = std::mem::take(&mut self.m.held);
        for (imm, len) in held {
            self.m.complete(imm, len);
        }
        let before = Snapshot::default();
        self.judge(&before, None, &[], &[])
    }

    /// The victim's state before a call of it.
    fn snapshot(&mut self) -> Snapshot {
        let Some(r) = self.d.ring(self.c) else {
            return Snapshot::default();
        };
        // Nothing else moves the credits between calls of the victim.
        self.m.ring_credit = r.ring_credit();
        self.m.recv_credit = r.peer_recv_credit();
        Snapshot {
            fault: r.fault().cloned(),
            stats: Some(r.stats()),
        }
    }

    /// A receive pass with budget `max`.
    fn rx(&mut self, max: usize) -> Result<(), String> {
        let before = self.snapshot();
        self.m.land(&self.peer.bytes);
        let want = if self.connected && before.fault.is_none() {
            self.m.deliver(max)
        } else {
            Vec::new()
        };
        let mut got: Vec<(usize, Vec<u8>)> = Vec::new();
        let me = self.c;
        let mut stranger = false;
        let n = self.d.rx_burst(self.now, max, &mut |c, f| {
            stranger |= c != me;
            got.push((f.as_ptr() as usize, f.to_vec()));
        });
        if stranger {
            return err("a frame was lent for another connection".into());
        }
        if n != got.len() || n > max {
            return err(format!(
                "rx_burst returned {n}, lent {} frames, budget {max}",
                got.len()
            ));
        }
        self.judge(&before, Some(max), &want, &got)?;
        if self.fault().is_none() {
            if let Some(r) = self.ring() {
                let have = (r.ring_credit(), r.peer_recv_credit());
                let model = (self.m.ring_credit, self.m.recv_credit);
                if have != model {
                    return err(format!(
                        "after a receive pass the credits are {have:?}, the credit messages give \
                         {model:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// A flush (after queueing a frame of `len` bytes, if any).
    fn flush(&mut self, send: Option<usize>) -> Result<(), String> {
        if let Some(len) = send {
            let healthy = self.fault().is_none();
            match self.d.tx_reserve(self.c, len) {
                Ok(Some(buf)) => {
                    buf.fill(len as u8);
                    self.d.tx_commit(self.c, len);
                }
                Ok(None) => {}
                Err(e) if healthy && self.connected => {
                    return err(format!("tx_reserve of {len} bytes on a healthy ring: {e}"));
                }
                Err(_) => {}
            }
        }
        let before = self.snapshot();
        self.m.land(&self.peer.bytes);
        let recv_after_reap = self.m.recv_credit;
        self.d.flush(self.now);
        self.judge(&before, None, &[], &[])?;
        if self.fault().is_none() {
            if let (Some(r), Some(b)) = (self.ring(), before.stats) {
                let s = r.stats();
                let writes = (s.data_writes - b.data_writes) + (s.credit_writes - b.credit_writes);
                let spent = u64::from(recv_after_reap) - u64::from(r.peer_recv_credit());
                if u64::from(recv_after_reap) < u64::from(r.peer_recv_credit()) || spent != writes {
                    return err(format!(
                        "a flush posted {writes} writes and moved the receive credit from \
                         {recv_after_reap} to {}",
                        r.peer_recv_credit()
                    ));
                }
                if r.ring_credit() > self.m.ring_credit || r.ring_credit() > self.remote.len {
                    return err(format!(
                        "a flush raised the ring credit to {} (model {})",
                        r.ring_credit(),
                        self.m.ring_credit
                    ));
                }
            }
        }
        self.peer.pump(&mut self.m);
        Ok(())
    }

    /// Check a call of the victim: the frames it lent (`got`: address and
    /// bytes) against the model's (`want`: offset and length), its fault
    /// and failure reports, its counters.
    fn judge(
        &mut self,
        before: &Snapshot,
        budget: Option<usize>,
        want: &[(usize, usize)],
        got: &[(usize, Vec<u8>)],
    ) -> Result<(), String> {
        while let Some((c, e)) = self.d.poll_failure() {
            if c != self.c {
                return err(format!("a failure of another connection: {e}"));
            }
            self.reported += 1;
        }
        let after = self.fault();
        if before.fault.is_some() {
            if after != before.fault {
                return err(format!(
                    "the fault changed from {:?} to {after:?}",
                    before.fault
                ));
            }
            if !got.is_empty() {
                return err(format!("{} frames lent after the fault", got.len()));
            }
            return self.check_reports(true);
        }
        let completion_fault = match &after {
            None => {
                if let Some(v) = self.m.violation {
                    return err(format!("the peer's {v:?} violation went undetected"));
                }
                false
            }
            Some(f) => match violation_of(f) {
                Some(Ok(v)) => {
                    if self.m.violation != Some(v) {
                        return err(format!(
                            "fault {f} where the model sees {:?}",
                            self.m.violation
                        ));
                    }
                    false
                }
                Some(Err(m)) => return err(format!("a protocol fault of no kind: {m}")),
                None => {
                    if !self.misbehaved {
                        return err(format!("fault {f} with a well-behaved peer"));
                    }
                    true
                }
            },
        };
        if completion_fault {
            // The error completion stopped the pass somewhere in its
            // completions: none of the frames may be lent.
            if !got.is_empty() {
                return err(format!("{} frames lent by a failed pass", got.len()));
            }
            self.m.violation = None;
        } else {
            if got.len() != want.len() {
                return err(format!(
                    "lent {} frames, the protocol allows {} (budget {budget:?})",
                    got.len(),
                    want.len()
                ));
            }
            for (i, ((addr, bytes), &(off, len))) in got.iter().zip(want).enumerate() {
                let at = addr.wrapping_sub(self.base);
                if at != off || bytes.len() != len {
                    return err(format!(
                        "frame {i} of the pass lent at ring offset {at} ({} bytes), the protocol \
                         says {off} ({len} bytes)",
                        bytes.len()
                    ));
                }
                if bytes[..] != self.m.shadow[off..off + len] {
                    return err(format!(
                        "frame {i} at ring offset {off} is not the bytes that landed there"
                    ));
                }
            }
        }
        if let (Some(r), Some(b)) = (self.ring(), before.stats) {
            let s = r.stats();
            if s.frames_received != b.frames_received + got.len() as u64 {
                return err(format!(
                    "frames_received went from {} to {} with {} frames lent",
                    b.frames_received,
                    s.frames_received,
                    got.len()
                ));
            }
            if completion_fault {
                if s.credits_received < b.credits_received || s.credits_received > self.m.credits {
                    return err(format!(
                        "credits_received {} outside {}..={}",
                        s.credits_received, b.credits_received, self.m.credits
                    ));
                }
                self.m.credits = s.credits_received;
                self.m.frames = s.frames_received;
            } else if (s.frames_received, s.credits_received) != (self.m.frames, self.m.credits) {
                return err(format!(
                    "counters: {} frames / {} credits received, the model {} / {}",
                    s.frames_received, s.credits_received, self.m.frames, self.m.credits
                ));
            }
        }
        self.check_reports(after.is_some())
    }

    fn check_reports(&self, failed: bool) -> Result<(), String> {
        if self.reported != u32::from(failed) {
            return err(format!(
                "{} failures reported for a connection that {}",
                self.reported,
                if failed { "failed" } else { "did not fail" }
            ));
        }
        Ok(())
    }

    /// Run one op.
    fn op(&mut self, op: Op) -> Result<(), String> {
        match op {
            Op::Frame(len) => {
                let len = usize::from(len) % (self.peer.victim.len / 2 + 1);
                if let Some((w, wrap, need)) = self.peer.place(len, self.seq) {
                    self.seq += 1;
                    if self.peer.write(w, &mut self.m) {
                        self.peer.advance(&w, need);
                        self.honest += 1;
                        self.wrapped += u64::from(wrap);
                    }
                }
            }
            Op::Lie { len, how } => {
                let len = usize::from(len) % (self.peer.victim.len / 2 + 1);
                if let Some((mut w, wrap, need)) = self.peer.place(len, self.seq) {
                    self.seq += 1;
                    self.forged = true;
                    let lied = match how % 4 {
                        0 => Imm::Data { wrap: !wrap, len },
                        1 => Imm::Data { wrap, len: len + 1 },
                        2 => Imm::Data {
                            wrap,
                            len: len.saturating_sub(1),
                        },
                        _ => {
                            w.len = (len + 64).min(self.peer.victim.len - w.off);
                            Imm::Data { wrap, len }
                        }
                    };
                    w.imm = lied.encode();
                    if self.peer.write(w, &mut self.m) {
                        self.peer.advance(&Write { len, ..w }, need);
                    }
                }
            }
            Op::Forge { imm, off, len } => {
                self.forged = true;
                let ring = self.peer.victim.len;
                let w = Write {
                    off: usize::from(off) % (ring + 64),
                    src: 0,
                    len: usize::from(len) % (ring + 65),
                    imm,
                };
                if w.off + w.len > ring {
                    // Refused by the NIC: our queue pair breaks.
                    self.misbehaved = true;
                }
                if imm & 1 << 31 != 0 {
                    self.misbehaved = true;
                }
                if self.peer.write(w, &mut self.m) {
                    self.peer.recvs = self.peer.recvs.saturating_sub(1);
                }
            }
            Op::Credit => {
                let p = &mut self.peer;
                if p.recvs >= 1 && (p.owed_bytes > 0 || p.owed_recvs > 0) {
                    let bytes = p.owed_bytes.min(MAX_CREDIT_BYTES);
                    let recvs = p.owed_recvs.min(MAX_CREDIT_RECVS);
                    let w = Write {
                        off: 0,
                        src: 0,
                        len: 0,
                        imm: Imm::Credit { bytes, recvs }.encode(),
                    };
                    if p.write(w, &mut self.m) {
                        let p = &mut self.peer;
                        p.owed_bytes -= bytes;
                        p.owed_recvs -= recvs;
                        p.recvs -= 1;
                    }
                }
            }
            Op::ForgeCredit(v) => {
                self.forged = true;
                self.misbehaved = true;
                let w = Write {
                    off: 0,
                    src: 0,
                    len: 0,
                    imm: 1 << 31 | v,
                };
                if self.peer.write(w, &mut self.m) {
                    self.peer.recvs = self.peer.recvs.saturating_sub(1);
                }
            }
            Op::Rx(b) => self.rx(BUDGETS[usize::from(b) % BUDGETS.len()])?,
            Op::Send(len) => {
                let len = usize::from(len) % (self.d.max_frame_len() + 1);
                self.flush(Some(len))?;
            }
            Op::Flush => self.flush(None)?,
        }
        if self.peer.broken {
            self.misbehaved = true;
        }
        Ok(())
    }

    /// Run a script, then drain: every honest frame must arrive unless
    /// the connection failed.
    fn script(&mut self, connect_after: usize, ops: &[Op]) -> Result<(), String> {
        for (i, &op) in ops.iter().enumerate() {
            if i == connect_after && !self.connected {
                self.connect()?;
            }
            self.op(op)?;
        }
        if !self.connected {
            self.connect()?;
        }
        for _ in 0..3 {
            self.rx(usize::MAX)?;
            self.flush(None)?;
        }
        if self.fault().is_none() {
            if self.m.violation.is_some() {
                return err("a violation the model sees outlived the drain".into());
            }
            if !self.forged && self.m.frames != self.honest {
                return err(format!(
                    "{} honest frames written, {} lent",
                    self.honest, self.m.frames
                ));
            }
        } else if !self.forged {
            return err(format!("honest script failed with {:?}", self.fault()));
        }
        Ok(())
    }

    fn outcome(&self) -> Outcome {
        Outcome {
            fault: self.fault().as_ref().map(fault_name),
            frames: self.m.frames,
            credits: self.m.credits,
            wrapped: self.wrapped,
            forged: self.forged,
            held: !self.m.held.is_empty(),
        }
    }
}

/// The victim's state before one of its calls.
#[derive(Debug, Default)]
struct Snapshot {
    fault: Option<RingFault>,
    stats: Option<starwire_rdma::RingStats>,
}

/// Mutations of a script: bit flips, op bytes set, whole ops inserted
/// (honest ones and forgeries near the ring's edges), ops deleted and
/// duplicated, splicing, truncation, the connect point moved.
#[derive(Debug)]
pub struct RingOps;

/// A random op, its lengths near the interesting boundaries.
fn random_op(rng: &mut SmallRng) -> Op {
    let len = |rng: &mut SmallRng| -> u16 {
        match rng.gen_range(0..5) {
            0 => rng.gen_range(0..=8),
            1 => [63, 64, 65, 127, 128, 129, 511, 512, 1023, 1024][rng.gen_range(0..10)],
            _ => rng.gen(),
        }
    };
    match rng.gen_range(0..10) {
        0 | 1 => Op::Frame(len(rng)),
        2 => Op::Forge {
            imm: match rng.gen_range(0..4) {
                0 => rng.gen(),
                1 => u32::from(len(rng)) | 1 << 30,
                2 => u32::from(len(rng)),
                _ => 1 << 31 | rng.gen_range(0..4) << 21 | rng.gen_range(0..40),
            },
            off: [0, 64, 960, 1024, 2048][rng.gen_range(0..5)],
            len: len(rng),
        },
        3 => Op::Credit,
        4 => Op::ForgeCredit(rng.gen_range(0..3) << 21 | rng.gen_range(0..20)),
        5 => Op::Lie {
            len: len(rng),
            how: rng.gen(),
        },
        6 | 7 => Op::Rx(rng.gen()),
        8 => Op::Send(len(rng)),
        _ => Op::Flush,
    }
}

impl Mutation for RingOps {
    fn apply(rng: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        if data.is_empty() {
            data.push(0);
        }
        let len = data.len();
        match rng.gen_range(0..9) {
            0 => flip_bit(rng, data),
            1 => {
                let i = rng.gen_range(0..len);
                data[i] = rng.gen();
            }
            2 | 3 => {
                let mut op = Vec::new();
                encode(random_op(rng), &mut op);
                if len + op.len() <= max_len {
                    let (_, ops) = parse(data);
                    // Insert at an op boundary.
                    let k = rng.gen_range(0..=ops.len());
                    let mut out = vec![data[0]];
                    for (i, &o) in ops.iter().enumerate() {
                        if i == k {
                            out.extend_from_slice(&op);
                        }
                        encode(o, &mut out);
                    }
                    if k == ops.len() {
                        out.extend_from_slice(&op);
                    }
                    *data = out;
                }
            }
            4 if len > 1 => delete(rng, data, 1, 12),
            5 if len > 1 => duplicate(rng, data, 1, 24, max_len),
            6 if !corpus.is_empty() => splice(rng, data, corpus),
            7 if len > 1 => {
                if rng.gen_bool(0.5) {
                    truncate(rng, data);
                } else {
                    insert_random(rng, data, 4);
                }
            }
            _ => data[0] = rng.gen_range(0..8),
        }
        if data.is_empty() {
            data.push(0);
        }
        let i = rng.gen_range(0..data.len());
        if rng.gen_ratio(1, 4) {
            flip_bit(rng, &mut data[i..=i]);
        }
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct RdmaRing {
    runs: u64,
    faults: BTreeMap<String, u64>,
    frames: u64,
    wrapped: u64,
    credits: u64,
    honest_runs: u64,
    held: u64,
}

/// Seed scripts: honest traffic both ways with wraps and credits, a
/// late connect, and each kind of violation from a busy ring.
pub fn seeds() -> Vec<Vec<u8>> {
    use Op::*;
    let honest = [
        Frame(100),
        Frame(300),
        Rx(1),
        Frame(0),
        Frame(64),
        Send(200),
        Rx(4),
        Flush,
        Credit,
        Frame(500),
        Frame(129),
        Rx(4),
        Flush,
        Send(1),
        Frame(400),
        Frame(256),
        Rx(2),
        Flush,
        Credit,
        Frame(511),
        Rx(4),
        Flush,
        Frame(1000),
        Rx(4),
    ];
    let mut out = vec![script(0, &honest), script(3, &honest)];
    let busy = [Frame(200), Frame(300), Rx(4), Flush, Frame(400), Frame(100)];
    let violations: [&[Op]; 7] = [
        &[ForgeCredit(1)],
        &[Send(100), Send(100), ForgeCredit(2)],
        &[Lie { len: 40, how: 0 }, Rx(4)],
        &[Lie { len: 100, how: 1 }, Rx(4)],
        &[Lie { len: 100, how: 3 }, Rx(4)],
        &[
            Forge {
                imm: 64 | 1 << 30,
                off: 0,
                len: 64,
            },
            Rx(4),
        ],
        &[
            Forge {
                imm: 1000,
                off: 960,
                len: 128,
            },
            Send(50),
            Rx(4),
            Flush,
        ],
    ];
    for v in violations {
        let mut ops = busy.to_vec();
        ops.extend_from_slice(v);
        out.push(script(0, &ops));
    }
    // A wrap marker on the first frame, written before the connect.
    let first = [Lie { len: 10, how: 0 }, Frame(10), Rx(4)];
    out.push(script(1, &first));
    // The peer first announces rings running past the end of the address
    // space (bit 3 of the first byte; bits 4-7 pick the address).
    out.push(script(0x08, &honest));
    out.push(script(0xf8 | 3, &honest));
    out
}

/// The choices of a run its input does not hold: the index into
/// [`SHAPES`].
pub type Case = usize;

impl RdmaRing {
    fn run_case(&mut self, shape: usize, input: &[u8]) -> Result<Outcome, String> {
        let (connect_after, ops) = parse(input);
        let mut run = Run::new(&SHAPES[shape])?;
        run.hostile = hostile_addr(input);
        let held_before = connect_after > 0 && !ops.is_empty();
        run.script(connect_after, &ops)?;
        let mut o = run.outcome();
        o.held = held_before;
        Ok(o)
    }
}

impl Target for RdmaRing {
    const SPEC: Spec = Spec {
        name: "fuzz-rdma-ring",
        seed: 0x5357_5252,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/rdma-ring"),
        max_len: 512,
        max_len_flag: false,
        corpus_flags: false,
        max_corpus: 4096,
        failure_prefix: "rdma-ring",
    };
    type Mutation = RingOps;
    type Case = Case;
    type Key = u64;

    fn seeds(&self) -> Vec<Vec<u8>> {
        seeds()
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<RingOps>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> Case {
        m.mutate(input, corpus);
        m.rng().gen_range(0..SHAPES.len())
    }

    fn run(&mut self, case: &Case, input: &[u8]) -> Result<u64, String> {
        self.runs += 1;
        let o = self.run_case(*case, input)?;
        if let Some(f) = &o.fault {
            *self.faults.entry(f.clone()).or_default() += 1;
        }
        self.frames += o.frames;
        self.wrapped += o.wrapped;
        self.credits += o.credits;
        self.honest_runs += u64::from(!o.forged);
        self.held += u64::from(o.held);
        let mut h = DefaultHasher::new();
        (
            *case,
            &o.fault,
            o.frames.min(24),
            o.credits.min(8),
            o.wrapped.min(4),
            o.forged,
            o.held,
        )
            .hash(&mut h);
        Ok(h.finish())
    }

    fn describe(&self, case: &Case) -> String {
        format!(" with ring shape {}", SHAPES[*case].name)
    }

    fn progress(&self) -> String {
        format!(
            "runs {}  frames lent {}  faults {}",
            self.runs,
            self.frames,
            self.faults.values().sum::<u64>()
        )
    }

    fn summary(&self) -> Vec<String> {
        vec![
            format!(
                "runs {} (honest scripts {}, peer wrote before connect {}) | frames lent {} | \
                 honest wraps {} | credit messages {}",
                self.runs, self.honest_runs, self.held, self.frames, self.wrapped, self.credits
            ),
            format!("connections failed, by fault: {:?}", self.faults),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        for case in 0..SHAPES.len() {
            self.run(&case, input)
                .map_err(|e| format!("{e}{}", self.describe(&case)))?;
        }
        Ok(())
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        let (connect_after, ops) = parse(input);
        println!("connect after {connect_after} ops: {ops:?}");
        let mut ok = true;
        for case in 0..SHAPES.len() {
            let r = self.run_case(case, input);
            println!("{}: {r:?}", self.describe(&case).trim_start());
            ok &= r.is_ok();
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_parse_back() {
        for s in seeds() {
            let (k, ops) = parse(&s);
            let hostile = s[0] & !7;
            assert_eq!(script(hostile | k as u8, &ops), s);
        }
    }

    #[test]
    fn every_seed_passes_and_reaches_its_fault() {
        let mut t = RdmaRing::default();
        for s in seeds() {
            t.check(&s)
                .unwrap_or_else(|e| panic!("{e}: {:?}", parse(&s)));
        }
        assert!(
            t.honest_runs >= 4 && t.wrapped > 0 && t.credits > 0,
            "{t:?}"
        );
        for k in ["Credit", "WrapAtZero", "Misfit"] {
            let k = format!("protocol {k}");
            assert!(
                t.faults.contains_key(&k),
                "{k} never reached: {:?}",
                t.faults
            );
        }
    }

    #[test]
    fn a_ring_past_the_end_of_the_address_space_is_refused() {
        assert_eq!(hostile_addr(&[0x07]), None);
        assert_eq!(hostile_addr(&[0x08]), Some(u64::MAX - 63));
        assert_eq!(hostile_addr(&[0xfb]), Some(u64::MAX - 1023));
        let mut t = RdmaRing::default();
        let hostile: Vec<_> = seeds().into_iter().filter(|s| s[0] & 8 != 0).collect();
        assert_eq!(hostile.len(), 2);
        for s in hostile {
            for case in 0..SHAPES.len() {
                let o = t
                    .run_case(case, &s)
                    .unwrap_or_else(|e| panic!("{e}: {:?}", parse(&s)));
                assert!(o.fault.is_none(), "{:?}", o.fault);
            }
        }
    }

    #[test]
    fn a_short_run_keeps_the_oracles() {
        let mut t = RdmaRing::default();
        let seeds = seeds();
        let mut m = Mutator::<RingOps>::new(3, RdmaRing::SPEC.max_len);
        for i in 0..3000 {
            let mut d = seeds[i % seeds.len()].clone();
            let case = t.prepare(&mut m, &mut d, &seeds);
            t.run(&case, &d)
                .unwrap_or_else(|e| panic!("{e}: {:?}", parse(&d)));
        }
        assert!(t.faults.len() >= 4, "{:?}", t.faults);
    }
}

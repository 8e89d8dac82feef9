//! The ring protocol: [`PreparedRing`] → [`RingTransport`], a sans-IO
//! [`Transport`] over any [`QueuePair`].
//!
//! The protocol is described in full in `docs/backends/rdma.md`; in short:
//!
//! * each side registers a *staging* region (frames are encoded there in
//!   place) and a *receive ring* (the peer writes frames into it);
//! * `flush` posts one RDMA write-with-immediate per frame from staging into
//!   the peer's ring at the tail the sender tracks, and rings the doorbell
//!   once; the immediate carries the frame length and a wrap bit
//!   ([`Imm`](crate::Imm));
//! * `rx_burst` polls the completion queue and lends each frame in place
//!   from the local ring; the bytes are freed when the sink returns and sent
//!   back as *credits* (an immediate-only write) on the next `flush`;
//! * two credits gate every write: free bytes in the peer's ring and
//!   receive WRs posted at the peer.

use std::collections::VecDeque;
use std::fmt;
use std::time::Instant;

use starwire_transport::{Link, Transport, TransportError};
use thiserror::Error;

use crate::imm::{slot_len, Imm, MAX_CREDIT_BYTES, MAX_CREDIT_RECVS, MAX_DATA_LEN, SLOT};
use crate::verbs::{
    Completion, LocalSlice, MemoryRegion, QpCaps, QueuePair, RemoteSlice, VerbsError, WcStatus,
};

/// `wr_id` bit marking a receive WR.
const WR_RECV: u64 = 1 << 63;
/// `wr_id` bit marking a credit write (otherwise a data write).
const WR_CREDIT: u64 = 1 << 62;
/// Smallest receive-WR depth: data writes keep one peer receive WR in
/// reserve for credit messages, and the credit-return threshold must stay
/// below the depth.
pub const MIN_RECV_DEPTH: u32 = 4;
/// Completions polled per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// Sizes of one side of a ring connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Bytes of the local receive ring the peer writes into. A multiple of
    /// 128 (two slots), at most 128 MiB − 64 (what a credit immediate can
    /// return at once).
    pub ring_len: usize,
    /// Bytes of the local staging region frames are encoded into. A
    /// multiple of 64.
    pub staging_len: usize,
    /// Receive WRs kept posted: at most this many peer writes (frames and
    /// credit messages) may be in flight towards us. Between
    /// [`MIN_RECV_DEPTH`] and 1023, and within the QP's `max_recv_wr`.
    pub recv_depth: u32,
    /// Largest frame we send. `None` picks the largest allowed:
    /// min(peer ring / 2, `staging_len`, the QP's maximum message).
    pub max_frame_len: Option<usize>,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            ring_len: 1 << 20,
            staging_len: 1 << 20,
            recv_depth: 128,
            max_frame_len: None,
        }
    }
}

/// What one side tells the other out of band before connecting: where to
/// write and how many writes it may have in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRing {
    /// rkey of the receive ring.
    pub rkey: u32,
    /// Address of the ring's first byte (`remote_addr` of offset 0).
    pub addr: u64,
    /// Length of the receive ring in bytes.
    pub len: usize,
    /// Receive WRs posted for incoming writes.
    pub recv_depth: u32,
}

impl RemoteRing {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 24;

    /// Little-endian encoding for the out-of-band exchange:
    /// rkey (u32), recv_depth (u32), addr (u64), len (u64).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0; Self::ENCODED_LEN];
        out[0..4].copy_from_slice(&self.rkey.to_le_bytes());
        out[4..8].copy_from_slice(&self.recv_depth.to_le_bytes());
        out[8..16].copy_from_slice(&self.addr.to_le_bytes());
        out[16..24].copy_from_slice(&(self.len as u64).to_le_bytes());
        out
    }

    /// Inverse of [`to_bytes`](Self::to_bytes). Values are checked by
    /// [`PreparedRing::connect`].
    pub fn from_bytes(b: &[u8; Self::ENCODED_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut v = [0; 8];
            v.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(v)
        };
        Self {
            rkey: u32_at(0),
            recv_depth: u32_at(4),
            addr: u64_at(8),
            len: usize::try_from(u64_at(16)).unwrap_or(usize::MAX),
        }
    }
}

/// Setting up a ring failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RingError {
    /// The local [`RingConfig`] is unusable with this queue pair.
    #[error("invalid ring configuration: {0}")]
    Config(String),
    /// The peer's [`RemoteRing`] is unusable.
    #[error("invalid remote ring: {0}")]
    Remote(String),
    /// A verb failed while registering memory or posting receive WRs.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

/// Which kind of work request an error completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkRequest {
    /// A data frame written with `IBV_WR_RDMA_WRITE_WITH_IMM`.
    DataWrite,
    /// A credit return written with `IBV_WR_RDMA_WRITE_WITH_IMM`.
    CreditWrite,
    /// A receive WR posted with `ibv_post_recv`.
    Recv,
}

impl fmt::Display for WorkRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DataWrite => "ibv_post_send IBV_WR_RDMA_WRITE_WITH_IMM (data)",
            Self::CreditWrite => "ibv_post_send IBV_WR_RDMA_WRITE_WITH_IMM (credit)",
            Self::Recv => "ibv_post_recv receive WR",
        })
    }
}

/// Why a [`RingTransport`] stopped. The first fault is kept
/// ([`RingTransport::fault`]); every later call fails with
/// [`TransportError::Link`] carrying its text.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RingFault {
    /// A verb failed synchronously.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// A work request completed with an error status.
    #[error("{wr} (wr_id {wr_id:#x}) completed with {status}")]
    Completion {
        /// The kind of work request.
        wr: WorkRequest,
        /// Its `wr_id`.
        wr_id: u64,
        /// The error status.
        status: WcStatus,
    },
    /// The peer broke the ring protocol (impossible immediate, credit
    /// overflow, frame outside the ring).
    #[error("ring protocol violation: {0}")]
    Protocol(String),
}

/// Counters, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// `flush` calls.
    pub flushes: u64,
    /// Doorbells rung (at most one per flush).
    pub doorbells: u64,
    /// Data writes posted.
    pub data_writes: u64,
    /// Credit writes posted.
    pub credit_writes: u64,
    /// Frames delivered to a sink.
    pub frames_received: u64,
    /// Credit messages received.
    pub credits_received: u64,
    /// Data writes that skipped the end of the peer's ring.
    pub wraps: u64,
    /// Flushes that left frames queued for lack of ring credit.
    pub ring_stalls: u64,
    /// Flushes that left frames queued for lack of peer receive WRs.
    pub recv_stalls: u64,
}

/// A ring whose memory is registered and receive WRs posted, waiting for
/// the peer's [`RemoteRing`].
#[derive(Debug)]
pub struct PreparedRing<Q> {
    qp: Q,
    cfg: RingConfig,
    caps: QpCaps,
    staging: MemoryRegion,
    ring: MemoryRegion,
    next_recv: u64,
}

fn check_ring_shape(len: usize, recv_depth: u32) -> Result<(), String> {
    if len < 2 * SLOT || len % (2 * SLOT) != 0 {
        return Err(format!(
            "ring length {len} is not a non-zero multiple of {}",
            2 * SLOT
        ));
    }
    if len > MAX_CREDIT_BYTES {
        return Err(format!(
            "ring length {len} exceeds the {MAX_CREDIT_BYTES} bytes a credit can return"
        ));
    }
    if !(MIN_RECV_DEPTH..=MAX_CREDIT_RECVS).contains(&recv_depth) {
        return Err(format!(
            "receive depth {recv_depth} outside {MIN_RECV_DEPTH}..={MAX_CREDIT_RECVS}"
        ));
    }
    Ok(())
}

impl<Q: QueuePair> PreparedRing<Q> {
    /// Register the staging region and the receive ring on `qp` and post
    /// `cfg.recv_depth` receive WRs (before the peer can write, so no write
    /// ever meets an empty receive queue).
    pub fn new(mut qp: Q, cfg: RingConfig) -> Result<Self, RingError> {
        let caps = qp.caps();
        check_ring_shape(cfg.ring_len, cfg.recv_depth).map_err(RingError::Config)?;
        if cfg.staging_len < SLOT || cfg.staging_len % SLOT != 0 {
            return Err(RingError::Config(format!(
                "staging length {} is not a non-zero multiple of {SLOT}",
                cfg.staging_len
            )));
        }
        if cfg.recv_depth > caps.max_recv_wr {
            return Err(RingError::Config(format!(
                "receive depth {} exceeds the QP's max_recv_wr {}",
                cfg.recv_depth, caps.max_recv_wr
            )));
        }
        if u64::from(caps.cq_depth) < u64::from(caps.max_send_wr) + u64::from(cfg.recv_depth) {
            return Err(RingError::Config(format!(
                "CQ depth {} cannot hold {} send + {} receive completions",
                caps.cq_depth, caps.max_send_wr, cfg.recv_depth
            )));
        }
        if caps.max_send_wr == 0 {
            return Err(RingError::Config("QP has max_send_wr 0".into()));
        }
        let staging = qp.reg_mr(cfg.staging_len)?;
        let ring = qp.reg_mr(cfg.ring_len)?;
        for i in 0..u64::from(cfg.recv_depth) {
            qp.post_recv(WR_RECV | i)?;
        }
        Ok(Self {
            qp,
            cfg,
            caps,
            staging,
            ring,
            next_recv: u64::from(cfg.recv_depth),
        })
    }

    /// What to send to the peer.
    pub fn local_ring(&self) -> RemoteRing {
        RemoteRing {
            rkey: self.ring.rkey,
            addr: self.ring.addr,
            len: self.ring.len,
            recv_depth: self.cfg.recv_depth,
        }
    }

    /// The queue pair.
    pub fn qp(&self) -> &Q {
        &self.qp
    }

    /// Start the protocol against the peer's ring.
    pub fn connect(self, remote: RemoteRing) -> Result<RingTransport<Q>, RingError> {
        check_ring_shape(remote.len, remote.recv_depth).map_err(RingError::Remote)?;
        let limit = (remote.len / 2)
            .min(self.cfg.staging_len)
            .min(self.caps.max_msg_size)
            .min(MAX_DATA_LEN);
        let max_frame = match self.cfg.max_frame_len {
            None => limit,
            Some(m) if m <= limit => m,
            Some(m) => {
                return Err(RingError::Config(format!(
                    "max_frame_len {m} exceeds {limit} (peer ring / 2, staging, QP maximum)"
                )))
            }
        };
        Ok(RingTransport {
            qp: self.qp,
            caps: self.caps,
            staging: self.staging,
            ring: self.ring,
            remote,
            max_frame,
            credit_recv_threshold: (self.cfg.recv_depth / 4).max(2),
            st_head: 0,
            st_tail: 0,
            st_used: 0,
            reservation: None,
            queued: VecDeque::new(),
            inflight: VecDeque::new(),
            next_data_wr: 0,
            next_credit_wr: 0,
            next_recv: self.next_recv,
            sq_outstanding: 0,
            r_tail: 0,
            r_credit: remote.len,
            peer_recvs: remote.recv_depth,
            l_head: 0,
            owed_bytes: 0,
            owed_recvs: 0,
            pending_rx: VecDeque::new(),
            fault: None,
            stats: RingStats::default(),
        })
    }
}

/// Space lent by `tx_reserve`, not yet committed.
#[derive(Debug, Clone, Copy)]
struct Reservation {
    off: usize,
    len: usize,
    /// Staging bytes skipped at the end of the region to place it at 0.
    skip: usize,
}

/// A committed frame in staging.
#[derive(Debug, Clone, Copy)]
struct TxFrame {
    off: usize,
    len: usize,
    /// Staging bytes freed by its send completion (skip + slot).
    release: usize,
    /// Staging offset just past it (the new head once released).
    end: usize,
}

/// A received frame whose completion was polled, not yet lent to a sink.
#[derive(Debug, Clone, Copy)]
struct RxFrame {
    wrap: bool,
    len: usize,
    byte_len: u32,
}

/// A connected ring: the RDMA backend's [`Transport`]. See the module
/// documentation and `docs/backends/rdma.md`.
#[derive(Debug)]
pub struct RingTransport<Q> {
    qp: Q,
    caps: QpCaps,
    staging: MemoryRegion,
    ring: MemoryRegion,
    remote: RemoteRing,
    max_frame: usize,
    credit_recv_threshold: u32,

    // Staging (a byte ring of committed frames; freed in send-completion
    // order).
    st_head: usize,
    st_tail: usize,
    st_used: usize,
    reservation: Option<Reservation>,
    /// Committed, not yet posted.
    queued: VecDeque<TxFrame>,
    /// Posted data writes awaiting their send completion, in order.
    inflight: VecDeque<(u64, TxFrame)>,
    next_data_wr: u64,
    next_credit_wr: u64,
    next_recv: u64,
    sq_outstanding: u32,

    // The peer's ring as the sender sees it.
    r_tail: usize,
    /// Free bytes starting at `r_tail` (wrapping).
    r_credit: usize,
    /// Receive WRs posted at the peer that our writes have not consumed.
    peer_recvs: u32,

    // The local ring.
    l_head: usize,
    /// Ring bytes freed and not yet returned.
    owed_bytes: usize,
    /// Receive WRs re-posted and not yet reported.
    owed_recvs: u32,
    pending_rx: VecDeque<RxFrame>,

    fault: Option<RingFault>,
    stats: RingStats,
}

impl<Q: QueuePair> RingTransport<Q> {
    /// The queue pair.
    pub fn qp(&self) -> &Q {
        &self.qp
    }

    /// The local receive ring the peer writes into.
    pub fn ring_region(&self) -> MemoryRegion {
        self.ring
    }

    /// The local staging region frames are encoded into.
    pub fn staging_region(&self) -> MemoryRegion {
        self.staging
    }

    /// The peer's ring.
    pub fn remote(&self) -> RemoteRing {
        self.remote
    }

    /// Counters.
    pub fn stats(&self) -> RingStats {
        self.stats
    }

    /// The fault that stopped the transport, if any.
    pub fn fault(&self) -> Option<&RingFault> {
        self.fault.as_ref()
    }

    /// Free bytes in the peer's ring, from the sender's point of view.
    pub fn ring_credit(&self) -> usize {
        self.r_credit
    }

    /// Receive WRs the peer has posted for us, from the sender's point of
    /// view.
    pub fn peer_recv_credit(&self) -> u32 {
        self.peer_recvs
    }

    fn check(&self) -> Result<(), TransportError> {
        match &self.fault {
            Some(f) => Err(TransportError::Link(f.to_string())),
            None => Ok(()),
        }
    }

    fn fail(&mut self, fault: RingFault) -> TransportError {
        tracing::warn!(%fault, "rdma ring failed");
        let fault = self.fault.get_or_insert(fault);
        TransportError::Link(fault.to_string())
    }

    fn credit_due(&self) -> bool {
        self.owed_bytes > 0 || self.owed_recvs >= self.credit_recv_threshold
    }

    /// Poll the CQ until it is empty (bounded by its depth): release
    /// staging on send completions, absorb credits, re-post receive WRs,
    /// and queue received frames for `rx_burst`.
    fn reap(&mut self) -> Result<(), RingFault> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        let rounds = self.caps.cq_depth as usize / POLL_BATCH + 2;
        for _ in 0..rounds {
            let n = self.qp.poll_cq(&mut wcs)?;
            for wc in &wcs[..n] {
                self.on_completion(wc)?;
            }
            if n < POLL_BATCH {
                break;
            }
        }
        Ok(())
    }

    fn on_completion(&mut self, wc: &Completion) -> Result<(), RingFault> {
        let wr = if wc.wr_id & WR_RECV != 0 {
            WorkRequest::Recv
        } else if wc.wr_id & WR_CREDIT != 0 {
            WorkRequest::CreditWrite
        } else {
            WorkRequest::DataWrite
        };
        if !wc.status.is_success() {
            return Err(RingFault::Completion {
                wr,
                wr_id: wc.wr_id,
                status: wc.status,
            });
        }
        match wr {
            WorkRequest::CreditWrite => self.sq_outstanding = self.sq_outstanding.saturating_sub(1),
            WorkRequest::DataWrite => {
                self.sq_outstanding = self.sq_outstanding.saturating_sub(1);
                let (wr_id, frame) = self.inflight.pop_front().ok_or_else(|| {
                    RingFault::Protocol(format!(
                        "send completion {:#x} with nothing in flight",
                        wc.wr_id
                    ))
                })?;
                if wr_id != wc.wr_id {
                    return Err(RingFault::Protocol(format!(
                        "send completion {:#x} out of order (expected {wr_id:#x})",
                        wc.wr_id
                    )));
                }
                self.st_used -= frame.release;
                self.st_head = frame.end;
            }
            WorkRequest::Recv => {
                self.qp.post_recv(WR_RECV | self.next_recv)?;
                self.next_recv = (self.next_recv + 1) & !(WR_RECV | WR_CREDIT);
                self.owed_recvs += 1;
                let imm = wc.imm.ok_or_else(|| {
                    RingFault::Protocol("receive completion without immediate".into())
                })?;
                match Imm::decode(imm) {
                    Imm::Data { wrap, len } => self.pending_rx.push_back(RxFrame {
                        wrap,
                        len,
                        byte_len: wc.byte_len,
                    }),
                    Imm::Credit { bytes, recvs } => {
                        if self.r_credit + bytes > self.remote.len
                            || self.peer_recvs + recvs > self.remote.recv_depth
                        {
                            return Err(RingFault::Protocol(format!(
                                "credit of {bytes} bytes / {recvs} receive WRs overflows the peer's ring"
                            )));
                        }
                        self.r_credit += bytes;
                        self.peer_recvs += recvs;
                        self.stats.credits_received += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Post the owed credits as one immediate-only write.
    fn post_credit(&mut self) -> Result<(), RingFault> {
        let bytes = self.owed_bytes.min(MAX_CREDIT_BYTES);
        let recvs = self.owed_recvs.min(MAX_CREDIT_RECVS);
        let wr_id = WR_CREDIT | self.next_credit_wr;
        self.qp.post_write_with_imm(
            wr_id,
            LocalSlice {
                lkey: self.staging.lkey,
                offset: 0,
                len: 0,
            },
            RemoteSlice {
                rkey: self.remote.rkey,
                addr: self.remote.addr,
            },
            Imm::Credit { bytes, recvs }.encode(),
        )?;
        self.next_credit_wr = (self.next_credit_wr + 1) & !(WR_RECV | WR_CREDIT);
        self.owed_bytes -= bytes;
        self.owed_recvs -= recvs;
        self.peer_recvs -= 1;
        self.sq_outstanding += 1;
        self.stats.credit_writes += 1;
        Ok(())
    }

    /// Post as many queued frames as credits allow; returns how many.
    fn post_frames(&mut self) -> Result<u64, RingFault> {
        let mut posted = 0;
        while let Some(&frame) = self.queued.front() {
            if self.sq_outstanding >= self.caps.max_send_wr {
                break;
            }
            // One peer receive WR stays in reserve for credit returns.
            if self.peer_recvs < 2 {
                self.stats.recv_stalls += 1;
                break;
            }
            let slot = slot_len(frame.len);
            let wrap = self.r_tail + slot > self.remote.len;
            let need = if wrap {
                self.remote.len - self.r_tail + slot
            } else {
                slot
            };
            if need > self.r_credit {
                self.stats.ring_stalls += 1;
                break;
            }
            let dst = if wrap { 0 } else { self.r_tail };
            let wr_id = self.next_data_wr;
            self.qp.post_write_with_imm(
                wr_id,
                LocalSlice {
                    lkey: self.staging.lkey,
                    offset: frame.off,
                    len: frame.len,
                },
                RemoteSlice {
                    rkey: self.remote.rkey,
                    addr: self.remote.addr + dst as u64,
                },
                Imm::Data {
                    wrap,
                    len: frame.len,
                }
                .encode(),
            )?;
            self.queued.pop_front();
            self.inflight.push_back((wr_id, frame));
            self.next_data_wr = (self.next_data_wr + 1) & !(WR_RECV | WR_CREDIT);
            self.sq_outstanding += 1;
            self.peer_recvs -= 1;
            self.r_credit -= need;
            self.r_tail = dst + slot;
            if self.r_tail == self.remote.len {
                self.r_tail = 0;
            }
            self.stats.data_writes += 1;
            self.stats.wraps += u64::from(wrap);
            posted += 1;
        }
        Ok(posted)
    }

    fn flush_inner(&mut self) -> Result<(), RingFault> {
        self.reap()?;
        let mut posted = 0;
        if self.credit_due() && self.peer_recvs >= 1 && self.sq_outstanding < self.caps.max_send_wr
        {
            self.post_credit()?;
            posted += 1;
        }
        posted += self.post_frames()?;
        if posted > 0 {
            self.qp.ring_doorbell()?;
            self.stats.doorbells += 1;
        }
        Ok(())
    }

    /// Where a frame of `slot` bytes fits in staging: (offset, skipped).
    fn place_in_staging(&mut self, slot: usize) -> Option<(usize, usize)> {
        let cap = self.staging.len;
        let empty = self.st_used == 0;
        // Restart at offset 0 only when no frame (not even a zero-length
        // one, whose release moves the head) is outstanding.
        if empty && self.queued.is_empty() && self.inflight.is_empty() {
            self.st_head = 0;
            self.st_tail = 0;
        }
        if self.st_tail > self.st_head || empty {
            // Free: [tail, cap) and [0, head).
            if slot <= cap - self.st_tail {
                Some((self.st_tail, 0))
            } else if slot <= self.st_head {
                Some((0, cap - self.st_tail))
            } else {
                None
            }
        } else {
            // Wrapped (or full when tail == head).
            (slot <= self.st_head - self.st_tail).then_some((self.st_tail, 0))
        }
    }
}

/// A driver of rings busy-polls: a [`QueuePair`] offers no descriptor to
/// park on.
impl<Q: QueuePair> Link for RingTransport<Q> {}

impl<Q: QueuePair> Transport for RingTransport<Q> {
    /// min(peer ring / 2, staging length, the QP's maximum message), or the
    /// configured smaller value. Half the peer's ring guarantees a frame
    /// always fits once every credit has come back, even after skipping
    /// the ring's end.
    fn max_frame_len(&self) -> usize {
        self.max_frame
    }

    #[allow(unsafe_code)]
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.check()?;
        if len > self.max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.max_frame,
            });
        }
        self.reservation = None;
        let Some((off, skip)) = self.place_in_staging(slot_len(len)) else {
            return Ok(None);
        };
        self.reservation = Some(Reservation { off, len, skip });
        let lkey = self.staging.lkey;
        let unusable = match self.qp.mr_mem(lkey) {
            None => Some(format!("staging region (lkey {lkey:#x}) is not registered")),
            Some(mem) => mem
                .range(off, len)
                .err()
                .map(|e| format!("staging region (lkey {lkey:#x}): {e}")),
        };
        if let Some(why) = unusable {
            return Err(self.fail(RingFault::Protocol(why)));
        }
        // SAFETY: `off .. off + len` is free staging: `place_in_staging`
        // hands out only bytes no queued or in-flight frame covers (a
        // frame's bytes are released when its send completion is polled),
        // so no posted write reads them; the staging rkey is never given to
        // the peer (trusted, as any holder of an rkey must be, not to forge
        // one), so no remote write targets them; and the slice borrows
        // `self` mutably, so this transport touches staging nowhere else
        // while it lives.
        Ok(self
            .qp
            .mr_mem(lkey)
            .and_then(|mem| unsafe { mem.slice_mut(off, len) }.ok()))
    }

    fn tx_commit(&mut self, len: usize) {
        let Some(r) = self.reservation.take() else {
            debug_assert!(false, "tx_commit without tx_reserve");
            return;
        };
        debug_assert!(len <= r.len, "committed {len} > reserved {}", r.len);
        let len = len.min(r.len);
        let slot = slot_len(len);
        let mut end = r.off + slot;
        if end == self.staging.len {
            end = 0;
        }
        let release = r.skip + slot;
        self.st_used += release;
        self.st_tail = end;
        self.queued.push_back(TxFrame {
            off: r.off,
            len,
            release,
            end,
        });
    }

    /// Poll completions, return owed credits, post every frame the credits
    /// allow, and ring the doorbell once if anything was posted.
    fn flush(&mut self, _now: Instant) -> Result<(), TransportError> {
        self.check()?;
        self.stats.flushes += 1;
        self.flush_inner().map_err(|f| self.fail(f))
    }

    #[allow(unsafe_code)]
    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        self.check()?;
        if let Err(f) = self.reap() {
            return Err(self.fail(f));
        }
        let ring_len = self.ring.len;
        let Some(ring) = self.qp.mr_mem(self.ring.lkey) else {
            let lkey = self.ring.lkey;
            return Err(self.fail(RingFault::Protocol(format!(
                "receive ring (lkey {lkey:#x}) is not registered"
            ))));
        };
        let mut delivered = 0;
        let mut violation = None;
        while delivered < max {
            let Some(&frame) = self.pending_rx.front() else {
                break;
            };
            let mut head = self.l_head;
            let mut freed = 0;
            if frame.wrap {
                if head == 0 {
                    violation = Some("wrap marker at ring offset 0".to_string());
                    break;
                }
                freed += ring_len - head;
                head = 0;
            }
            let slot = slot_len(frame.len);
            if u32::try_from(frame.len) != Ok(frame.byte_len) || head + slot > ring_len {
                violation = Some(format!(
                    "frame of {} bytes ({} written) at offset {head} does not fit a {ring_len}-byte ring",
                    frame.len, frame.byte_len
                ));
                break;
            }
            // SAFETY: the peer wrote these bytes with the write whose
            // receive completion `reap` polled (verbs makes the data visible
            // before the completion), and it has no credit for them until
            // `owed_bytes` goes back in a credit message, which takes a
            // later `flush`: a peer that keeps to the credits it was given
            // (the trust an rkey grants) does not write them while the sink
            // holds them. Locally the ring is only ever read.
            let bytes = match unsafe { ring.slice(head, frame.len) } {
                Ok(bytes) => bytes,
                Err(e) => {
                    violation = Some(format!("receive ring: {e}"));
                    break;
                }
            };
            self.pending_rx.pop_front();
            sink(bytes);
            head += slot;
            if head == ring_len {
                head = 0;
            }
            self.l_head = head;
            self.owed_bytes += freed + slot;
            delivered += 1;
        }
        self.stats.frames_received += delivered as u64;
        match violation {
            Some(v) => Err(self.fail(RingFault::Protocol(v))),
            None => Ok(delivered),
        }
    }

    /// Frames committed and not yet posted, or credits due to the peer.
    fn tx_pending(&self) -> bool {
        !self.queued.is_empty() || (self.fault.is_none() && self.credit_due())
    }
}

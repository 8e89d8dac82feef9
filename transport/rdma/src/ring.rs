//! The ring protocol of one connection: [`RingConn`], the per-connection
//! state an [`RdmaDriver`](crate::RdmaDriver) holds, sans-IO over the
//! driver's [`Verbs`].
//!
//! The protocol is described in full in `docs/backends/rdma.md`; in short:
//!
//! * each connection registers a *staging* region (frames are encoded there
//!   in place) and a *receive ring* (the peer writes frames into it);
//! * a flush posts one RDMA write-with-immediate per frame from staging into
//!   the peer's ring at the tail the sender tracks (the driver rings one
//!   doorbell for all its connections); the immediate carries the frame
//!   length and a wrap bit ([`Imm`](crate::Imm));
//! * the driver polls its completion queue and hands each completion to its
//!   connection; a receive pass lends each frame in place from the local
//!   ring; the bytes are freed when the sink returns and sent back as
//!   *credits* (an immediate-only write) on the next flush;
//! * two credits gate every write: free bytes in the peer's ring and
//!   receive WRs posted at the peer.

use std::collections::VecDeque;
use std::fmt;

use starwire_transport::TransportError;
use thiserror::Error;

use crate::imm::{slot_len, Imm, MAX_CREDIT_BYTES, MAX_CREDIT_RECVS};
use crate::verbs::{
    Completion, LocalSlice, MemoryRegion, QpCaps, RemoteSlice, Verbs, VerbsError, WcStatus,
};

mod setup;

pub(crate) use setup::{check_config, check_remote, PreparedRing};
pub use setup::{RemoteRing, RingConfig};

/// `wr_id` bit marking a receive WR.
const WR_RECV: u64 = 1 << 63;
/// `wr_id` bit marking a credit write (otherwise a data write).
const WR_CREDIT: u64 = 1 << 62;
/// `wr_id` bits 32..62 name the connection's slot in its driver, so a
/// completion finds its connection without a lookup.
const WR_SLOT_SHIFT: u32 = 32;
const WR_SLOT_MASK: u64 = (1 << 30) - 1;
/// Connections one driver can hold: the slots `wr_id` can name.
pub(crate) const MAX_SLOTS: usize = 1 << 30;
/// Smallest receive-WR depth: data writes keep one peer receive WR in
/// reserve for credit messages, and the credit-return threshold must stay
/// below the depth.
pub const MIN_RECV_DEPTH: u32 = 4;

/// The `wr_id` of a WR of `kind` (0, [`WR_RECV`] or [`WR_CREDIT`]) on the
/// connection in `slot`, with sequence number `seq`.
fn wr_id(kind: u64, slot: u32, seq: u32) -> u64 {
    kind | (u64::from(slot) << WR_SLOT_SHIFT) | u64::from(seq)
}

/// The connection slot a completion's `wr_id` names.
pub(crate) fn wr_slot(wr_id: u64) -> usize {
    ((wr_id >> WR_SLOT_SHIFT) & WR_SLOT_MASK) as usize
}

/// Setting up a driver or one of its connections failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RingError {
    /// The local [`RingConfig`] is unusable with this queue pair or
    /// completion queue.
    #[error("invalid ring configuration: {0}")]
    Config(String),
    /// The peer's [`RemoteRing`] is unusable.
    #[error("invalid remote ring: {0}")]
    Remote(String),
    /// No queue pair with this number exists on the driver's verbs.
    #[error("no queue pair {0:#x}")]
    UnknownQp(u32),
    /// The connection is not one prepared and not yet connected.
    #[error("{0} is not a prepared connection of this driver")]
    NotPrepared(starwire_transport::ConnId),
    /// The connection is not one reserved and not yet prepared
    /// ([`RdmaDriver::reserve`](crate::RdmaDriver::reserve)).
    #[error("{0} is not a reserved connection of this driver")]
    NotReserved(starwire_transport::ConnId),
    /// The driver holds as many connections as `wr_id`s can name.
    #[error("the driver already holds the most connections it can name")]
    TooManyConnections,
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

/// Why a connection stopped. The first fault is kept
/// ([`RingConn::fault`]); every later call on the connection fails with
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

/// Counters of one connection, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
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
    /// Posting passes that left frames queued for lack of ring credit.
    pub ring_stalls: u64,
    /// Posting passes that left frames queued for lack of peer receive WRs.
    pub recv_stalls: u64,
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

/// One connected ring: the state an [`RdmaDriver`](crate::RdmaDriver)
/// keeps per connection (its queue pair, its two regions, both credits).
/// Read-only from outside the crate; see the module documentation and
/// `docs/backends/rdma.md`.
#[derive(Debug)]
pub struct RingConn {
    qpn: u32,
    slot: u32,
    caps: QpCaps,
    staging: MemoryRegion,
    ring: MemoryRegion,
    remote: RemoteRing,
    max_frame: usize,
    /// Receive WRs kept posted on the queue pair.
    recv_depth: u32,
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
    next_data_wr: u32,
    next_credit_wr: u32,
    next_recv: u32,
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

impl RingConn {
    /// The connection's queue pair.
    pub fn qpn(&self) -> u32 {
        self.qpn
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

    /// The fault that stopped the connection, if any.
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

    /// Send and receive WRs this connection may have outstanding: its
    /// share of the completion queue.
    pub(crate) fn cq_share(&self) -> u64 {
        u64::from(self.caps.max_send_wr) + u64::from(self.recv_depth)
    }

    /// Deregister the connection's regions (the driver destroys its queue
    /// pair).
    pub(crate) fn release<V: Verbs>(&self, verbs: &mut V) {
        for lkey in [self.staging.lkey, self.ring.lkey] {
            if let Err(e) = verbs.dereg_mr(lkey) {
                tracing::warn!(%e, "rdma: deregistering a ring region failed");
            }
        }
    }

    /// `Err` once the connection has failed.
    pub(crate) fn check(&self) -> Result<(), TransportError> {
        match &self.fault {
            Some(f) => Err(TransportError::Link(f.to_string())),
            None => Ok(()),
        }
    }

    /// Record `fault`; returns the error to report the first time only.
    pub(crate) fn fail(&mut self, fault: RingFault) -> Option<TransportError> {
        if self.fault.is_some() {
            return None;
        }
        tracing::warn!(%fault, qpn = self.qpn, "rdma connection failed");
        let e = TransportError::Link(fault.to_string());
        self.fault = Some(fault);
        Some(e)
    }

    fn credit_due(&self) -> bool {
        self.owed_bytes > 0 || self.owed_recvs >= self.credit_recv_threshold
    }

    /// Received frames polled and not yet lent to a sink.
    pub(crate) fn rx_pending(&self) -> bool {
        self.fault.is_none() && !self.pending_rx.is_empty()
    }

    /// Frames committed and not yet posted, or credits due to the peer.
    pub(crate) fn tx_pending(&self) -> bool {
        self.fault.is_none() && (!self.queued.is_empty() || self.credit_due())
    }

    /// One completion of this connection's queue pair: release staging on
    /// send completions, absorb credits, re-post receive WRs, and queue
    /// received frames for [`deliver`](Self::deliver).
    pub(crate) fn on_completion<V: Verbs>(
        &mut self,
        verbs: &mut V,
        wc: &Completion,
    ) -> Result<(), RingFault> {
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
                verbs.post_recv(self.qpn, wr_id(WR_RECV, self.slot, self.next_recv))?;
                self.next_recv = self.next_recv.wrapping_add(1);
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
    fn post_credit<V: Verbs>(&mut self, verbs: &mut V) -> Result<(), RingFault> {
        let bytes = self.owed_bytes.min(MAX_CREDIT_BYTES);
        let recvs = self.owed_recvs.min(MAX_CREDIT_RECVS);
        verbs.post_write_with_imm(
            self.qpn,
            wr_id(WR_CREDIT, self.slot, self.next_credit_wr),
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
        self.next_credit_wr = self.next_credit_wr.wrapping_add(1);
        self.owed_bytes -= bytes;
        self.owed_recvs -= recvs;
        self.peer_recvs -= 1;
        self.sq_outstanding += 1;
        self.stats.credit_writes += 1;
        Ok(())
    }

    /// Post as many queued frames as credits allow; returns how many.
    fn post_frames<V: Verbs>(&mut self, verbs: &mut V) -> Result<u64, RingFault> {
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
            // `check_remote` refused rings past the end of the address
            // space; a second guard, so a peer's address never overflows.
            let addr = u64::try_from(dst)
                .ok()
                .and_then(|d| self.remote.addr.checked_add(d))
                .ok_or_else(|| {
                    RingFault::Protocol(format!(
                        "peer ring at {:#x} + offset {dst} overflows the address space",
                        self.remote.addr
                    ))
                })?;
            let wr_id = wr_id(0, self.slot, self.next_data_wr);
            verbs.post_write_with_imm(
                self.qpn,
                wr_id,
                LocalSlice {
                    lkey: self.staging.lkey,
                    offset: frame.off,
                    len: frame.len,
                },
                RemoteSlice {
                    rkey: self.remote.rkey,
                    addr,
                },
                Imm::Data {
                    wrap,
                    len: frame.len,
                }
                .encode(),
            )?;
            self.queued.pop_front();
            self.inflight.push_back((wr_id, frame));
            self.next_data_wr = self.next_data_wr.wrapping_add(1);
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

    /// Stage the credit message if one is due and every queued frame the
    /// credits allow; the driver rings the doorbell. Returns how many
    /// writes were staged.
    pub(crate) fn post<V: Verbs>(&mut self, verbs: &mut V) -> Result<u64, RingFault> {
        let mut posted = 0;
        if self.credit_due() && self.peer_recvs >= 1 && self.sq_outstanding < self.caps.max_send_wr
        {
            self.post_credit(verbs)?;
            posted += 1;
        }
        posted += self.post_frames(verbs)?;
        Ok(posted)
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

    /// Reserve `len` bytes of staging for one frame; `Ok(false)` when
    /// staging is full. [`reserved`](Self::reserved) lends them.
    pub(crate) fn reserve<V: Verbs>(
        &mut self,
        verbs: &V,
        len: usize,
    ) -> Result<bool, TransportError> {
        self.check()?;
        if len > self.max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.max_frame,
            });
        }
        self.reservation = None;
        let Some((off, skip)) = self.place_in_staging(slot_len(len)) else {
            return Ok(false);
        };
        let lkey = self.staging.lkey;
        let unusable = match verbs.mr_mem(lkey) {
            None => Some(format!("staging region (lkey {lkey:#x}) is not registered")),
            Some(mem) => mem
                .range(off, len)
                .err()
                .map(|e| format!("staging region (lkey {lkey:#x}): {e}")),
        };
        if let Some(why) = unusable {
            self.fail(RingFault::Protocol(why));
            return self.check().map(|()| false);
        }
        self.reservation = Some(Reservation { off, len, skip });
        Ok(true)
    }

    /// The staging bytes of the reservation just made, to encode the frame
    /// in place. The slice keeps this connection borrowed mutably and the
    /// verbs shared, so while it lives nothing reserves staging again,
    /// posts a write or deregisters the region.
    #[allow(unsafe_code)]
    pub(crate) fn reserved<'a, V: Verbs>(&'a mut self, verbs: &'a V) -> Option<&'a mut [u8]> {
        let r = self.reservation?;
        let mem = verbs.mr_mem(self.staging.lkey)?;
        // SAFETY: by the `Verbs` contract (its `# Safety` items 1-4), which
        // `V` promised with its `unsafe impl`: `mem` is exactly the staging
        // region's bytes, overlapping no other region (1). `r.off .. r.off
        // + r.len` is free staging: `reserve` took it from
        // `place_in_staging`, which hands out only bytes no queued or
        // in-flight frame covers (a frame's bytes are released when its
        // send completion is polled, after which the device reads them no
        // more (4)), so no posted write reads them; staging is registered
        // `Access::Local`, so no peer's write lands in it, whatever key it
        // forges (2), and nothing else writes it (3); and the borrows above
        // rule out any other access through the ring or the verbs while
        // the slice lives.
        unsafe { mem.slice_mut(r.off, r.len) }.ok()
    }

    /// Commit the frame written into the last reservation.
    pub(crate) fn tx_commit(&mut self, len: usize) {
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

    /// Lend up to `max` received frames to `sink`, in place from the local
    /// ring, in order. Returns how many were lent and, if the peer broke
    /// the protocol, the fault (after the frames before it).
    #[allow(unsafe_code)]
    pub(crate) fn deliver<V: Verbs>(
        &mut self,
        verbs: &V,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> (usize, Option<RingFault>) {
        if self.fault.is_some() || self.pending_rx.is_empty() {
            return (0, None);
        }
        let ring_len = self.ring.len;
        let Some(ring) = verbs.mr_mem(self.ring.lkey) else {
            let lkey = self.ring.lkey;
            return (
                0,
                Some(RingFault::Protocol(format!(
                    "receive ring (lkey {lkey:#x}) is not registered"
                ))),
            );
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
            // SAFETY: by the `Verbs` contract (its `# Safety` items 1, 3
            // and 5), which `V` promised with its `unsafe impl`: `ring` is
            // exactly the receive ring's bytes, overlapping no other region
            // (1), and only the peer's writes change them (3). The peer
            // wrote these bytes with the write whose receive completion the
            // driver polled, so they are in place and that write is done
            // with them (5); and it has no credit for them until
            // `owed_bytes` goes back in a credit message, which takes a
            // later flush: a peer that keeps to the credits it was given
            // (the trust an rkey grants) does not write them while the sink
            // holds them. Locally the ring is only ever read, and the verbs
            // stay borrowed (no deregistration) until this returns.
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
        (delivered, violation.map(RingFault::Protocol))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SimConfig, SimNic};

    /// `check_remote` refuses such a ring; should one get through, posting
    /// fails the connection with a protocol fault instead of overflowing.
    #[test]
    fn a_remote_address_that_overflows_is_a_protocol_fault() {
        let (mut na, mut nb) = SimNic::pair(SimConfig::default());
        let (qa, _qb) = na.connect_qp(&mut nb).unwrap();
        let cfg = RingConfig {
            ring_len: 4096,
            staging_len: 2048,
            recv_depth: 8,
            max_frame_len: None,
        };
        let max_frame = check_config(&cfg).unwrap();
        let prepared = PreparedRing::new(&mut na, qa, 0, &cfg, max_frame).unwrap();
        let mut remote = prepared.local_ring();
        remote.addr = u64::MAX - 63;
        assert!(matches!(
            check_remote(&remote, max_frame),
            Err(RingError::Remote(_))
        ));
        let (mut conn, failed) = prepared.connect(&mut na, remote, max_frame);
        assert!(failed.is_none());
        for _ in 0..2 {
            assert!(conn.reserve(&na, 64).unwrap());
            conn.tx_commit(64);
        }
        let fault = conn.post(&mut na).unwrap_err();
        assert!(
            matches!(&fault, RingFault::Protocol(m) if m.contains("overflows")),
            "{fault}"
        );
    }
}

//! [`SimRcQp`]: an in-memory, connected pair of RC queue pairs.
//!
//! The simulator models what the ring protocol can observe of a real RC
//! connection:
//!
//! * **Staged posting.** Send WRs wait in a staging list until
//!   [`ring_doorbell`](QueuePair::ring_doorbell); [`SimRcQp::doorbells`]
//!   counts the doorbells.
//! * **Reliable, in-order delivery.** Doorbelled writes are executed in
//!   posting order. A write checks the local slice (`IBV_WC_LOC_PROT_ERR`,
//!   `IBV_WC_LOC_LEN_ERR`), the peer's QP state (`IBV_WC_RETRY_EXC_ERR` when
//!   the peer is in error), the rkey and bounds (`IBV_WC_REM_ACCESS_ERR`) and
//!   a posted receive WR on the peer. Then the bytes are copied, one peer
//!   receive WR is consumed, and a successful send completion is queued.
//! * **Receiver not ready.** With no receive WR posted at the peer the write
//!   stays at the head of the send queue (blocking later writes, as RC does)
//!   and is retried on every later doorbell or `poll_cq`; after
//!   [`SimConfig::rnr_retry`] failed retries it completes with
//!   `IBV_WC_RNR_RETRY_EXC_ERR`. (Real hardware retries after an RNR timer;
//!   `rnr_retry = 7`, "infinite", is not modelled so tests cannot hang.)
//! * **Error state.** Any error completion moves the QP to
//!   [`QpState::Error`]: staged and queued send WRs and posted receive WRs
//!   are flushed with `IBV_WC_WR_FLUSH_ERR`, and so is everything posted
//!   later. The peer's QP stays connected; its next write fails with
//!   `IBV_WC_RETRY_EXC_ERR` because nobody answers.
//! * **Landing.** The peer's bytes and receive completion are applied to
//!   local memory when the local side next calls `poll_cq` — the only way
//!   software can learn of them — so the receive completion is never visible
//!   before its data.
//! * **Queue limits.** A WR holds its queue slot until its completion is
//!   polled; posting beyond [`SimConfig::max_send_wr`] /
//!   [`SimConfig::max_recv_wr`] fails with `ENOMEM`. More completions than
//!   [`SimConfig::cq_depth`] overrun the CQ: `poll_cq` fails with
//!   `EOVERFLOW` and the QP enters the error state.
//!
//! State shared by the two ends lives behind an `Arc<Mutex<..>>`; this is a
//! test vehicle, not a fast path.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::mem::{OwnedMem, RegisteredMem};
use crate::verbs::{
    Completion, Errno, LocalSlice, MemoryRegion, QpCaps, QpState, QueuePair, RemoteSlice,
    VerbsError, WcOpcode, WcStatus,
};

/// Capacities and behaviour of a simulated queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Outstanding send WRs per QP.
    pub max_send_wr: u32,
    /// Outstanding receive WRs per QP.
    pub max_recv_wr: u32,
    /// Completion-queue entries per QP.
    pub cq_depth: u32,
    /// Largest message.
    pub max_msg_size: usize,
    /// RNR retries before a write completes with
    /// [`WcStatus::RnrRetryExceeded`] (a retry happens on each later
    /// doorbell or `poll_cq` of the writer).
    pub rnr_retry: u8,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            max_send_wr: 128,
            max_recv_wr: 256,
            cq_depth: 384,
            max_msg_size: 1 << 30,
            rnr_retry: 3,
        }
    }
}

/// A write executed by the peer's NIC, waiting to be applied to local
/// memory together with its receive completion.
#[derive(Debug)]
struct Landing {
    rkey: u32,
    offset: usize,
    data: Vec<u8>,
    wc: Completion,
}

/// The part of one end that the other end's "NIC" touches.
#[derive(Debug)]
struct Port {
    state: QpState,
    /// rkey → (base address, length), for remote-access checks.
    rkeys: HashMap<u32, (u64, usize)>,
    /// Posted receive WRs not yet consumed.
    recvs: VecDeque<u64>,
    /// Executed incoming writes not yet applied.
    inbound: VecDeque<Landing>,
}

impl Port {
    fn new() -> Self {
        Self {
            state: QpState::ReadyToSend,
            rkeys: HashMap::new(),
            recvs: VecDeque::new(),
            inbound: VecDeque::new(),
        }
    }
}

#[derive(Debug)]
struct Fabric {
    ports: [Port; 2],
    next_key: u32,
}

#[derive(Debug)]
struct SimRegion {
    mr: MemoryRegion,
    buf: OwnedMem,
}

#[derive(Debug, Clone, Copy)]
struct SendWr {
    wr_id: u64,
    local: LocalSlice,
    remote: RemoteSlice,
    imm: u32,
    rnr_retries: u8,
}

/// One end of a simulated, connected RC queue pair. See the module
/// documentation for the semantics.
#[derive(Debug)]
pub struct SimRcQp {
    side: usize,
    fabric: Arc<Mutex<Fabric>>,
    cfg: SimConfig,
    regions: Vec<SimRegion>,
    staged: Vec<SendWr>,
    send_queue: VecDeque<SendWr>,
    cq: VecDeque<Completion>,
    cq_overrun: bool,
    sq_outstanding: u32,
    rq_outstanding: u32,
    doorbells: u64,
}

/// `addr` as an offset into a region starting at `base`.
fn remote_offset(addr: u64, base: u64) -> Option<usize> {
    addr.checked_sub(base).and_then(|o| usize::try_from(o).ok())
}

fn lock(fabric: &Mutex<Fabric>) -> MutexGuard<'_, Fabric> {
    fabric
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl SimRcQp {
    /// Two queue pairs connected to each other, both in the
    /// ready-to-send state.
    pub fn pair(cfg: SimConfig) -> (Self, Self) {
        let fabric = Arc::new(Mutex::new(Fabric {
            ports: [Port::new(), Port::new()],
            next_key: 0x100,
        }));
        let end = |side| Self {
            side,
            fabric: Arc::clone(&fabric),
            cfg,
            regions: Vec::new(),
            staged: Vec::new(),
            send_queue: VecDeque::new(),
            cq: VecDeque::new(),
            cq_overrun: false,
            sq_outstanding: 0,
            rq_outstanding: 0,
            doorbells: 0,
        };
        (end(0), end(1))
    }

    /// Doorbells rung so far.
    pub fn doorbells(&self) -> u64 {
        self.doorbells
    }

    /// Receive WRs currently posted and not yet consumed by the peer.
    pub fn posted_recvs(&self) -> usize {
        lock(&self.fabric).ports[self.side].recvs.len()
    }

    fn peer(&self) -> usize {
        1 - self.side
    }

    fn region(&self, lkey: u32) -> Option<&SimRegion> {
        self.regions.iter().find(|r| r.mr.lkey == lkey)
    }

    fn push_cqe(&mut self, wc: Completion) {
        if self.cq.len() >= self.cfg.cq_depth as usize {
            self.cq_overrun = true;
        } else {
            self.cq.push_back(wc);
        }
    }

    fn send_wc(wr: &SendWr, status: WcStatus) -> Completion {
        Completion {
            wr_id: wr.wr_id,
            status,
            opcode: WcOpcode::RdmaWrite,
            imm: None,
            byte_len: u32::try_from(wr.local.len).unwrap_or(u32::MAX),
        }
    }

    /// Move to the error state: report `first`, flush every send and
    /// receive WR.
    fn enter_error(&mut self, fabric: &mut Fabric, first: Option<Completion>) {
        fabric.ports[self.side].state = QpState::Error;
        if let Some(wc) = first {
            self.push_cqe(wc);
        }
        self.flush_sends();
        let recvs: Vec<u64> = fabric.ports[self.side].recvs.drain(..).collect();
        for wr_id in recvs {
            self.push_cqe(Completion {
                wr_id,
                status: WcStatus::WrFlush,
                opcode: WcOpcode::RecvRdmaWithImm,
                imm: None,
                byte_len: 0,
            });
        }
    }

    fn flush_sends(&mut self) {
        let queued: Vec<SendWr> = self
            .send_queue
            .drain(..)
            .chain(self.staged.drain(..))
            .collect();
        for wr in &queued {
            self.push_cqe(Self::send_wc(wr, WcStatus::WrFlush));
        }
    }

    /// Execute doorbelled writes in order until the queue is empty or the
    /// head is blocked by RNR.
    fn progress(&mut self, fabric: &mut Fabric) {
        let (me, peer) = (self.side, self.peer());
        if fabric.ports[me].state == QpState::Error {
            self.flush_sends();
            return;
        }
        while let Some(wr) = self.send_queue.front().copied() {
            let local = self
                .regions
                .iter_mut()
                .find(|r| r.mr.lkey == wr.local.lkey)
                .and_then(|r| {
                    let end = wr.local.offset.checked_add(wr.local.len)?;
                    r.buf.bytes_mut().get(wr.local.offset..end)
                });
            let Some(src) = local else {
                self.send_queue.pop_front();
                let wc = Self::send_wc(&wr, WcStatus::LocalProtection);
                self.enter_error(fabric, Some(wc));
                return;
            };
            let failure =
                if wr.local.len > self.cfg.max_msg_size {
                    Some(WcStatus::LocalLength)
                } else if fabric.ports[peer].state == QpState::Error {
                    Some(WcStatus::RetryExceeded)
                } else {
                    let fits = fabric.ports[peer].rkeys.get(&wr.remote.rkey).is_some_and(
                        |&(base, len)| {
                            remote_offset(wr.remote.addr, base)
                                .and_then(|off| off.checked_add(wr.local.len))
                                .is_some_and(|end| end <= len)
                        },
                    );
                    (!fits).then_some(WcStatus::RemoteAccess)
                };
            if let Some(status) = failure {
                self.send_queue.pop_front();
                self.enter_error(fabric, Some(Self::send_wc(&wr, status)));
                return;
            }
            let Some(recv_wr) = fabric.ports[peer].recvs.pop_front() else {
                let head = self.send_queue.front_mut().expect("head exists");
                if head.rnr_retries >= self.cfg.rnr_retry {
                    self.send_queue.pop_front();
                    let wc = Self::send_wc(&wr, WcStatus::RnrRetryExceeded);
                    self.enter_error(fabric, Some(wc));
                } else {
                    head.rnr_retries += 1;
                }
                return;
            };
            let data = src.to_vec();
            let byte_len = u32::try_from(data.len()).unwrap_or(u32::MAX);
            let base = fabric.ports[peer].rkeys[&wr.remote.rkey].0;
            fabric.ports[peer].inbound.push_back(Landing {
                rkey: wr.remote.rkey,
                offset: remote_offset(wr.remote.addr, base).unwrap_or(0),
                data,
                wc: Completion {
                    wr_id: recv_wr,
                    status: WcStatus::Success,
                    opcode: WcOpcode::RecvRdmaWithImm,
                    imm: Some(wr.imm),
                    byte_len,
                },
            });
            self.send_queue.pop_front();
            self.push_cqe(Self::send_wc(&wr, WcStatus::Success));
        }
    }

    /// Apply writes the peer executed: land the bytes, then queue the
    /// receive completions.
    fn apply_inbound(&mut self, fabric: &mut Fabric) {
        while let Some(landing) = fabric.ports[self.side].inbound.pop_front() {
            let target = self
                .regions
                .iter_mut()
                .find(|r| r.mr.rkey == landing.rkey)
                .and_then(|r| {
                    r.buf
                        .bytes_mut()
                        .get_mut(landing.offset..landing.offset + landing.data.len())
                });
            // The writer checked rkey and bounds against our table; regions
            // are never deregistered, so the target exists.
            if let Some(dst) = target {
                dst.copy_from_slice(&landing.data);
            }
            self.push_cqe(landing.wc);
        }
    }
}

impl QueuePair for SimRcQp {
    fn caps(&self) -> QpCaps {
        QpCaps {
            max_send_wr: self.cfg.max_send_wr,
            max_recv_wr: self.cfg.max_recv_wr,
            cq_depth: self.cfg.cq_depth,
            max_msg_size: self.cfg.max_msg_size,
        }
    }

    fn state(&self) -> QpState {
        lock(&self.fabric).ports[self.side].state
    }

    fn reg_mr(&mut self, len: usize) -> Result<MemoryRegion, VerbsError> {
        if len == 0 {
            return Err(VerbsError::RegMr {
                len,
                errno: Errno::EINVAL,
            });
        }
        let mut fabric = lock(&self.fabric);
        let key = fabric.next_key;
        fabric.next_key += 2;
        let mr = MemoryRegion {
            id: u32::try_from(self.regions.len()).unwrap_or(u32::MAX),
            // Synthetic, distinct and far apart, like virtual addresses.
            addr: u64::from(key) << 32,
            len,
            lkey: key,
            rkey: key + 1,
        };
        fabric.ports[self.side]
            .rkeys
            .insert(mr.rkey, (mr.addr, len));
        drop(fabric);
        self.regions.push(SimRegion {
            mr,
            buf: OwnedMem::zeroed(len),
        });
        Ok(mr)
    }

    fn mr_mem(&self, lkey: u32) -> Option<RegisteredMem<'_>> {
        self.region(lkey).map(|r| r.buf.mem())
    }

    fn post_write_with_imm(
        &mut self,
        wr_id: u64,
        local: LocalSlice,
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<(), VerbsError> {
        if self.sq_outstanding >= self.cfg.max_send_wr {
            return Err(VerbsError::PostSend {
                wr_id,
                errno: Errno::ENOMEM,
            });
        }
        self.sq_outstanding += 1;
        self.staged.push(SendWr {
            wr_id,
            local,
            remote,
            imm,
            rnr_retries: 0,
        });
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<(), VerbsError> {
        if self.rq_outstanding >= self.cfg.max_recv_wr {
            return Err(VerbsError::PostRecv {
                wr_id,
                errno: Errno::ENOMEM,
            });
        }
        self.rq_outstanding += 1;
        let fabric = Arc::clone(&self.fabric);
        let mut fabric = lock(&fabric);
        fabric.ports[self.side].recvs.push_back(wr_id);
        if fabric.ports[self.side].state == QpState::Error {
            self.enter_error(&mut fabric, None);
        }
        Ok(())
    }

    fn ring_doorbell(&mut self) -> Result<(), VerbsError> {
        self.doorbells += 1;
        self.send_queue.extend(self.staged.drain(..));
        let fabric = Arc::clone(&self.fabric);
        self.progress(&mut lock(&fabric));
        Ok(())
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let fabric = Arc::clone(&self.fabric);
        let mut fabric = lock(&fabric);
        self.apply_inbound(&mut fabric);
        self.progress(&mut fabric);
        if self.cq_overrun {
            fabric.ports[self.side].state = QpState::Error;
            return Err(VerbsError::PollCq {
                errno: Errno::EOVERFLOW,
            });
        }
        drop(fabric);
        let n = out.len().min(self.cq.len());
        for (slot, wc) in out.iter_mut().zip(self.cq.drain(..n)) {
            match wc.opcode {
                WcOpcode::RdmaWrite => self.sq_outstanding -= 1,
                WcOpcode::RecvRdmaWithImm => self.rq_outstanding -= 1,
            }
            *slot = wc;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll_all(qp: &mut SimRcQp) -> Vec<Completion> {
        let mut buf = [Completion::default(); 16];
        let mut all = Vec::new();
        for _ in 0..100 {
            let n = qp.poll_cq(&mut buf).expect("poll_cq");
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        all
    }

    fn local(mr: &MemoryRegion, offset: usize, len: usize) -> LocalSlice {
        LocalSlice {
            lkey: mr.lkey,
            offset,
            len,
        }
    }

    fn remote(mr: &MemoryRegion, offset: u64) -> RemoteSlice {
        RemoteSlice {
            rkey: mr.rkey,
            addr: mr.addr + offset,
        }
    }

    #[test]
    fn an_end_can_move_to_another_thread() {
        fn send<T: Send>(t: T) -> T {
            t
        }
        let (a, b) = SimRcQp::pair(SimConfig::default());
        let mut a = std::thread::spawn(move || send(a)).join().unwrap();
        let mr = a.reg_mr(8).unwrap();
        let a = std::thread::spawn(move || send(a)).join().unwrap();
        a.mr_mem(mr.lkey).unwrap().write(0, b"moved").unwrap();
        let mut back = [0; 5];
        a.mr_mem(mr.lkey).unwrap().read(0, &mut back).unwrap();
        assert_eq!(&back, b"moved");
        drop(b);
    }

    #[test]
    fn write_with_imm_lands_and_completes_both_sides() {
        let (mut a, mut b) = SimRcQp::pair(SimConfig::default());
        let src = a.reg_mr(64).unwrap();
        let dst = b.reg_mr(64).unwrap();
        a.mr_mem(src.lkey).unwrap().write(0, b"ping").unwrap();
        b.post_recv(77).unwrap();
        a.post_write_with_imm(5, local(&src, 0, 4), remote(&dst, 10), 0xabc)
            .unwrap();
        // Staged until the doorbell.
        assert!(poll_all(&mut b).is_empty());
        assert_eq!(b.posted_recvs(), 1);
        a.ring_doorbell().unwrap();
        assert_eq!(a.doorbells(), 1);
        let send = poll_all(&mut a);
        assert_eq!(send.len(), 1);
        assert_eq!(send[0].wr_id, 5);
        assert_eq!(send[0].status, WcStatus::Success);
        assert_eq!(send[0].opcode, WcOpcode::RdmaWrite);
        let recv = poll_all(&mut b);
        assert_eq!(recv.len(), 1);
        assert_eq!(recv[0].wr_id, 77);
        assert_eq!(recv[0].opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(recv[0].imm, Some(0xabc));
        assert_eq!(recv[0].byte_len, 4);
        let mut landed = [0; 4];
        b.mr_mem(dst.lkey).unwrap().read(10, &mut landed).unwrap();
        assert_eq!(&landed, b"ping");
    }

    #[test]
    fn zero_length_write_delivers_only_the_immediate() {
        let (mut a, mut b) = SimRcQp::pair(SimConfig::default());
        let src = a.reg_mr(8).unwrap();
        let dst = b.reg_mr(8).unwrap();
        b.post_recv(1).unwrap();
        a.post_write_with_imm(1, local(&src, 0, 0), remote(&dst, 8), 42)
            .unwrap();
        a.ring_doorbell().unwrap();
        let recv = poll_all(&mut b);
        assert_eq!((recv[0].imm, recv[0].byte_len), (Some(42), 0));
    }

    #[test]
    fn remote_access_out_of_bounds_errors_and_flushes() {
        let (mut a, mut b) = SimRcQp::pair(SimConfig::default());
        let src = a.reg_mr(64).unwrap();
        let dst = b.reg_mr(64).unwrap();
        a.post_recv(900).unwrap();
        for i in 0..3 {
            b.post_recv(i).unwrap();
        }
        a.post_write_with_imm(1, local(&src, 0, 16), remote(&dst, 56), 0)
            .unwrap();
        a.post_write_with_imm(2, local(&src, 0, 8), remote(&dst, 0), 0)
            .unwrap();
        a.ring_doorbell().unwrap();
        assert_eq!(a.state(), QpState::Error);
        let wcs = poll_all(&mut a);
        let statuses: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            statuses,
            vec![
                (1, WcStatus::RemoteAccess),
                (2, WcStatus::WrFlush),
                (900, WcStatus::WrFlush)
            ]
        );
        // Later posts flush too.
        a.post_write_with_imm(3, local(&src, 0, 8), remote(&dst, 0), 0)
            .unwrap();
        a.ring_doorbell().unwrap();
        a.post_recv(901).unwrap();
        let later: Vec<_> = poll_all(&mut a)
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect();
        assert_eq!(
            later,
            vec![(3, WcStatus::WrFlush), (901, WcStatus::WrFlush)]
        );
        // Nothing landed at the peer, no recv consumed.
        assert!(poll_all(&mut b).is_empty());
        assert_eq!(b.posted_recvs(), 3);
        // The peer's next write finds nobody answering.
        let bsrc = b.reg_mr(8).unwrap();
        b.post_write_with_imm(9, local(&bsrc, 0, 8), remote(&src, 0), 0)
            .unwrap();
        b.ring_doorbell().unwrap();
        assert_eq!(poll_all(&mut b)[0].status, WcStatus::RetryExceeded);
    }

    #[test]
    fn wrong_key_is_a_remote_access_error() {
        let (mut a, mut b) = SimRcQp::pair(SimConfig::default());
        let src = a.reg_mr(64).unwrap();
        let dst = b.reg_mr(64).unwrap();
        b.post_recv(0).unwrap();
        let lkey_as_rkey = RemoteSlice {
            rkey: dst.lkey,
            addr: dst.addr,
        };
        a.post_write_with_imm(1, local(&src, 0, 8), lkey_as_rkey, 0)
            .unwrap();
        a.ring_doorbell().unwrap();
        assert_eq!(poll_all(&mut a)[0].status, WcStatus::RemoteAccess);
    }

    #[test]
    fn local_slice_outside_region_is_a_protection_error() {
        let (mut a, mut b) = SimRcQp::pair(SimConfig::default());
        let src = a.reg_mr(16).unwrap();
        let dst = b.reg_mr(64).unwrap();
        b.post_recv(0).unwrap();
        a.post_write_with_imm(1, local(&src, 8, 16), remote(&dst, 0), 0)
            .unwrap();
        a.ring_doorbell().unwrap();
        assert_eq!(poll_all(&mut a)[0].status, WcStatus::LocalProtection);
        assert_eq!(a.state(), QpState::Error);
    }

    #[test]
    fn rnr_blocks_then_recovers_when_a_recv_is_posted() {
        let (mut a, mut b) = SimRcQp::pair(SimConfig::default());
        let src = a.reg_mr(8).unwrap();
        let dst = b.reg_mr(8).unwrap();
        a.post_write_with_imm(1, local(&src, 0, 8), remote(&dst, 0), 1)
            .unwrap();
        a.ring_doorbell().unwrap();
        assert!(poll_all(&mut a).is_empty());
        b.post_recv(0).unwrap();
        assert_eq!(poll_all(&mut a)[0].status, WcStatus::Success);
        assert_eq!(poll_all(&mut b)[0].imm, Some(1));
    }

    #[test]
    fn rnr_retry_exhaustion_is_an_error_completion() {
        let cfg = SimConfig {
            rnr_retry: 2,
            ..SimConfig::default()
        };
        let (mut a, mut b) = SimRcQp::pair(cfg);
        let src = a.reg_mr(8).unwrap();
        let dst = b.reg_mr(8).unwrap();
        a.post_write_with_imm(1, local(&src, 0, 8), remote(&dst, 0), 1)
            .unwrap();
        a.post_write_with_imm(2, local(&src, 0, 8), remote(&dst, 0), 2)
            .unwrap();
        a.ring_doorbell().unwrap();
        let mut seen = Vec::new();
        for _ in 0..10 {
            seen.extend(poll_all(&mut a));
            if !seen.is_empty() {
                break;
            }
        }
        let statuses: Vec<_> = seen.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            statuses,
            vec![(1, WcStatus::RnrRetryExceeded), (2, WcStatus::WrFlush)]
        );
        assert_eq!(a.state(), QpState::Error);
        assert!(poll_all(&mut b).is_empty());
    }

    #[test]
    fn posting_beyond_queue_capacity_fails_until_completions_are_polled() {
        let cfg = SimConfig {
            max_send_wr: 2,
            max_recv_wr: 1,
            ..SimConfig::default()
        };
        let (mut a, mut b) = SimRcQp::pair(cfg);
        let src = a.reg_mr(8).unwrap();
        let dst = b.reg_mr(8).unwrap();
        b.post_recv(0).unwrap();
        assert_eq!(
            b.post_recv(1),
            Err(VerbsError::PostRecv {
                wr_id: 1,
                errno: Errno::ENOMEM
            })
        );
        a.post_write_with_imm(1, local(&src, 0, 0), remote(&dst, 0), 0)
            .unwrap();
        a.post_write_with_imm(2, local(&src, 0, 0), remote(&dst, 0), 0)
            .unwrap();
        assert_eq!(
            a.post_write_with_imm(3, local(&src, 0, 0), remote(&dst, 0), 0),
            Err(VerbsError::PostSend {
                wr_id: 3,
                errno: Errno::ENOMEM
            })
        );
        a.ring_doorbell().unwrap();
        // WR 1 completed; WR 2 waits for a receive WR (RNR).
        let mut one = [Completion::default(); 1];
        assert_eq!(a.poll_cq(&mut one), Ok(1));
        assert_eq!((one[0].wr_id, one[0].status), (1, WcStatus::Success));
        a.post_write_with_imm(3, local(&src, 0, 0), remote(&dst, 0), 0)
            .unwrap();
        // The receive slot frees once b polls the completion.
        assert_eq!(b.poll_cq(&mut one), Ok(1));
        b.post_recv(1).unwrap();
    }

    #[test]
    fn cq_overrun_fails_poll_and_errors_the_qp() {
        let (mut c, mut d) = SimRcQp::pair(SimConfig {
            cq_depth: 2,
            ..SimConfig::default()
        });
        let cs = c.reg_mr(8).unwrap();
        let dr = d.reg_mr(8).unwrap();
        for i in 0..3 {
            d.post_recv(i).unwrap();
            c.post_write_with_imm(i, local(&cs, 0, 0), remote(&dr, 0), 0)
                .unwrap();
        }
        c.ring_doorbell().unwrap();
        let mut one = [Completion::default(); 1];
        assert_eq!(
            c.poll_cq(&mut one),
            Err(VerbsError::PollCq {
                errno: Errno::EOVERFLOW
            })
        );
        assert_eq!(c.state(), QpState::Error);
    }
}

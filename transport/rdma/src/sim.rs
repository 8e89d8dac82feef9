//! [`SimNic`]: an in-memory RDMA NIC, one per driver, on a [`SimFabric`]
//! that connects the queue pairs of several NICs.
//!
//! A NIC is what one driver owns: a protection domain (every memory region
//! of the NIC), one completion queue that all its queue pairs report into
//! (each completion carries its `qp_num`), and RC queue pairs created in
//! connected pairs across two NICs ([`SimNic::connect_qp`]). The simulator
//! models what the ring protocol can observe of real hardware:
//!
//! * **Staged posting.** Send WRs wait on their queue pair until
//!   [`ring_doorbell`](Verbs::ring_doorbell), which hands the WRs of every
//!   queue pair to the NIC at once; [`SimNic::doorbells`] counts the calls.
//! * **Reliable, in-order delivery per queue pair.** Doorbelled writes are
//!   executed in posting order. A write checks the local slice
//!   (`IBV_WC_LOC_PROT_ERR`, `IBV_WC_LOC_LEN_ERR`), the peer queue pair
//!   (`IBV_WC_RETRY_EXC_ERR` when it is in error or destroyed), the rkey
//!   against the peer NIC's protection domain and the bounds
//!   (`IBV_WC_REM_ACCESS_ERR`) and a posted receive WR on the peer queue
//!   pair. Then the bytes are copied, one peer receive WR is consumed, and a
//!   successful send completion is queued.
//! * **Receiver not ready.** With no receive WR posted at the peer the write
//!   stays at the head of its send queue (blocking later writes of that
//!   queue pair, as RC does) and is retried on every later doorbell or
//!   `poll_cq`; after [`SimConfig::rnr_retry`] failed retries it completes
//!   with `IBV_WC_RNR_RETRY_EXC_ERR`. (Real hardware retries after an RNR
//!   timer; `rnr_retry = 7`, "infinite", is not modelled so tests cannot
//!   hang.)
//! * **Error state, per queue pair.** Any error completion moves its queue
//!   pair to [`QpState::Error`]: its staged and queued send WRs and posted
//!   receive WRs are flushed with `IBV_WC_WR_FLUSH_ERR`, and so is everything
//!   posted on it later. Other queue pairs of the NIC carry on. The peer
//!   queue pair stays connected; its next write fails with
//!   `IBV_WC_RETRY_EXC_ERR` because nobody answers.
//! * **Landing.** The peer's bytes and receive completion are applied to
//!   local memory when the local NIC next calls `poll_cq` (the only way
//!   software can learn of them), so the receive completion is never visible
//!   before its data.
//! * **Queue limits.** A WR holds its queue slot until its completion is
//!   polled; posting beyond [`SimConfig::max_send_wr`] /
//!   [`SimConfig::max_recv_wr`] fails with `ENOMEM`. More completions than
//!   [`SimConfig::cq_depth`] overrun the shared CQ: `poll_cq` fails with
//!   `EOVERFLOW` from then on and every queue pair of the NIC enters the
//!   error state.
//! * **Teardown.** [`destroy_qp`](Verbs::destroy_qp) removes the queue
//!   pair's completions from the CQ (as mlx5 cleans its CQ);
//!   [`dereg_mr`](Verbs::dereg_mr) frees a region, and later writes naming
//!   its rkey fail with `IBV_WC_REM_ACCESS_ERR`.
//!
//! State the NICs share lives behind an `Arc<Mutex<..>>`; this is a test
//! vehicle, not a fast path.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::mem::{OwnedMem, RegisteredMem};
use crate::verbs::{
    Access, Completion, DoorbellError, Errno, LocalSlice, MemoryRegion, QpCaps, QpState,
    RemoteSlice, Verbs, VerbsError, WcOpcode, WcStatus,
};

/// Capacities and behaviour of the simulated NICs of one fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Outstanding send WRs per queue pair.
    pub max_send_wr: u32,
    /// Outstanding receive WRs per queue pair.
    pub max_recv_wr: u32,
    /// Entries of each NIC's completion queue, shared by its queue pairs.
    pub cq_depth: u32,
    /// Largest message.
    pub max_msg_size: usize,
    /// RNR retries before a write completes with
    /// [`WcStatus::RnrRetryExceeded`] (a retry happens on each later
    /// doorbell or `poll_cq` of the writer's NIC).
    pub rnr_retry: u8,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            max_send_wr: 128,
            max_recv_wr: 256,
            cq_depth: 1 << 16,
            max_msg_size: 1 << 30,
            rnr_retry: 3,
        }
    }
}

/// A write executed by the peer's NIC, waiting to be applied to local
/// memory together with its receive completion.
#[derive(Debug)]
struct Landing {
    lkey: u32,
    offset: usize,
    data: Vec<u8>,
    wc: Completion,
}

/// A registered region as the peers' NICs see it.
#[derive(Debug, Clone, Copy)]
struct RemoteKey {
    base: u64,
    len: usize,
    lkey: u32,
}

/// The part of a NIC that the other NICs touch.
#[derive(Debug, Default)]
struct NicPort {
    /// The protection domain's regions by rkey.
    rkeys: HashMap<u32, RemoteKey>,
    /// Executed incoming writes not yet applied.
    inbound: VecDeque<Landing>,
}

/// The part of a queue pair that its peer's NIC touches.
#[derive(Debug)]
struct QpPort {
    nic: usize,
    peer: u32,
    state: QpState,
    /// Posted receive WRs not yet consumed.
    recvs: VecDeque<u64>,
}

#[derive(Debug)]
struct Fabric {
    nics: Vec<NicPort>,
    /// Live queue pairs by number; destroyed ones are gone.
    qps: HashMap<u32, QpPort>,
    next_key: u32,
    next_qpn: u32,
}

/// The network the simulated NICs are attached to. Cloning it gives
/// another handle on the same network.
#[derive(Debug, Clone)]
pub struct SimFabric {
    shared: Arc<Mutex<Fabric>>,
    cfg: SimConfig,
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

/// The local side of one queue pair.
#[derive(Debug, Default)]
struct SimQp {
    staged: Vec<SendWr>,
    send_queue: VecDeque<SendWr>,
    sq_outstanding: u32,
    rq_outstanding: u32,
}

/// One simulated NIC: a protection domain, one completion queue and the
/// queue pairs created on it. See the module documentation for the
/// semantics.
#[derive(Debug)]
pub struct SimNic {
    nic: usize,
    fabric: Arc<Mutex<Fabric>>,
    cfg: SimConfig,
    regions: HashMap<u32, SimRegion>,
    /// Regions registered so far: the next region's id.
    registered: u32,
    /// Ordered, so that progress visits queue pairs deterministically.
    qps: BTreeMap<u32, SimQp>,
    cq: VecDeque<Completion>,
    cq_overrun: bool,
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

impl SimFabric {
    /// An empty network whose NICs have the capacities of `cfg`.
    pub fn new(cfg: SimConfig) -> Self {
        Self {
            shared: Arc::new(Mutex::new(Fabric {
                nics: Vec::new(),
                qps: HashMap::new(),
                next_key: 0x100,
                next_qpn: 0x11,
            })),
            cfg,
        }
    }

    /// A new NIC attached to this network, with no region and no queue
    /// pair yet.
    pub fn nic(&self) -> SimNic {
        let mut fabric = lock(&self.shared);
        fabric.nics.push(NicPort::default());
        SimNic {
            nic: fabric.nics.len() - 1,
            fabric: Arc::clone(&self.shared),
            cfg: self.cfg,
            regions: HashMap::new(),
            registered: 0,
            qps: BTreeMap::new(),
            cq: VecDeque::new(),
            cq_overrun: false,
            doorbells: 0,
        }
    }
}

impl SimNic {
    /// Two NICs on a new fabric.
    pub fn pair(cfg: SimConfig) -> (Self, Self) {
        let fabric = SimFabric::new(cfg);
        (fabric.nic(), fabric.nic())
    }

    /// Create a queue pair here and one on `peer`, connected to each other
    /// and ready to send. Returns their numbers (local, peer).
    pub fn connect_qp(&mut self, peer: &mut SimNic) -> Result<(u32, u32), VerbsError> {
        if !Arc::ptr_eq(&self.fabric, &peer.fabric) {
            return Err(VerbsError::CreateQp {
                errno: Errno::EINVAL,
            });
        }
        let mut fabric = lock(&self.fabric);
        let (a, b) = (fabric.next_qpn, fabric.next_qpn + 1);
        fabric.next_qpn += 2;
        let port = |nic, peer| QpPort {
            nic,
            peer,
            state: QpState::ReadyToSend,
            recvs: VecDeque::new(),
        };
        fabric.qps.insert(a, port(self.nic, b));
        fabric.qps.insert(b, port(peer.nic, a));
        drop(fabric);
        self.qps.insert(a, SimQp::default());
        peer.qps.insert(b, SimQp::default());
        Ok((a, b))
    }

    /// Doorbells rung so far.
    pub fn doorbells(&self) -> u64 {
        self.doorbells
    }

    /// Receive WRs currently posted on `qpn` and not yet consumed by the
    /// peer (0 for an unknown queue pair).
    pub fn posted_recvs(&self, qpn: u32) -> usize {
        lock(&self.fabric)
            .qps
            .get(&qpn)
            .map_or(0, |qp| qp.recvs.len())
    }

    /// Queue pairs of this NIC.
    pub fn qp_count(&self) -> usize {
        self.qps.len()
    }

    /// Regions registered on this NIC.
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    fn push_cqe(&mut self, wc: Completion) {
        if self.cq.len() >= self.cfg.cq_depth as usize {
            self.cq_overrun = true;
        } else {
            self.cq.push_back(wc);
        }
    }

    fn send_wc(qpn: u32, wr: &SendWr, status: WcStatus) -> Completion {
        Completion {
            wr_id: wr.wr_id,
            qp_num: qpn,
            status,
            opcode: WcOpcode::RdmaWrite,
            imm: None,
            byte_len: u32::try_from(wr.local.len).unwrap_or(u32::MAX),
        }
    }

    /// Move `qpn` to the error state: report `first`, flush its send and
    /// receive WRs.
    fn enter_error(&mut self, fabric: &mut Fabric, qpn: u32, first: Option<Completion>) {
        let recvs: Vec<u64> = match fabric.qps.get_mut(&qpn) {
            Some(port) => {
                port.state = QpState::Error;
                port.recvs.drain(..).collect()
            }
            None => Vec::new(),
        };
        if let Some(wc) = first {
            self.push_cqe(wc);
        }
        self.flush_sends(qpn);
        for wr_id in recvs {
            self.push_cqe(Completion {
                wr_id,
                qp_num: qpn,
                status: WcStatus::WrFlush,
                opcode: WcOpcode::RecvRdmaWithImm,
                imm: None,
                byte_len: 0,
            });
        }
    }

    fn flush_sends(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        let queued: Vec<SendWr> = qp.send_queue.drain(..).chain(qp.staged.drain(..)).collect();
        for wr in &queued {
            self.push_cqe(Self::send_wc(qpn, wr, WcStatus::WrFlush));
        }
    }

    /// Why `wr` cannot execute now, if it fails outright.
    fn check_write(&self, fabric: &Fabric, peer: u32, wr: &SendWr) -> Option<WcStatus> {
        let local_ok = self.regions.get(&wr.local.lkey).is_some_and(|r| {
            wr.local
                .offset
                .checked_add(wr.local.len)
                .is_some_and(|end| end <= r.mr.len)
        });
        if !local_ok {
            return Some(WcStatus::LocalProtection);
        }
        if wr.local.len > self.cfg.max_msg_size {
            return Some(WcStatus::LocalLength);
        }
        let Some(peer_port) = fabric.qps.get(&peer) else {
            return Some(WcStatus::RetryExceeded);
        };
        if peer_port.state == QpState::Error {
            return Some(WcStatus::RetryExceeded);
        }
        let fits = fabric.nics[peer_port.nic]
            .rkeys
            .get(&wr.remote.rkey)
            .is_some_and(|k| {
                remote_offset(wr.remote.addr, k.base)
                    .and_then(|off| off.checked_add(wr.local.len))
                    .is_some_and(|end| end <= k.len)
            });
        (!fits).then_some(WcStatus::RemoteAccess)
    }

    /// Execute the doorbelled writes of `qpn` in order until its queue is
    /// empty or the head is blocked by RNR.
    fn progress(&mut self, fabric: &mut Fabric, qpn: u32) {
        let Some(port) = fabric.qps.get(&qpn) else {
            return;
        };
        if port.state == QpState::Error {
            self.flush_sends(qpn);
            return;
        }
        let peer = port.peer;
        loop {
            let Some(wr) = self
                .qps
                .get(&qpn)
                .and_then(|q| q.send_queue.front().copied())
            else {
                return;
            };
            if let Some(status) = self.check_write(fabric, peer, &wr) {
                if let Some(qp) = self.qps.get_mut(&qpn) {
                    qp.send_queue.pop_front();
                }
                self.enter_error(fabric, qpn, Some(Self::send_wc(qpn, &wr, status)));
                return;
            }
            let peer_port = fabric.qps.get_mut(&peer).expect("checked by check_write");
            let Some(recv_wr) = peer_port.recvs.pop_front() else {
                let retry = self.cfg.rnr_retry;
                let Some(head) = self
                    .qps
                    .get_mut(&qpn)
                    .and_then(|q| q.send_queue.front_mut())
                else {
                    return;
                };
                if head.rnr_retries >= retry {
                    if let Some(qp) = self.qps.get_mut(&qpn) {
                        qp.send_queue.pop_front();
                    }
                    let wc = Self::send_wc(qpn, &wr, WcStatus::RnrRetryExceeded);
                    self.enter_error(fabric, qpn, Some(wc));
                } else {
                    head.rnr_retries += 1;
                }
                return;
            };
            let peer_nic = peer_port.nic;
            let key = fabric.nics[peer_nic].rkeys[&wr.remote.rkey];
            let range = wr.local.offset..wr.local.offset + wr.local.len;
            let data = self
                .regions
                .get_mut(&wr.local.lkey)
                .map(|r| r.buf.bytes_mut()[range].to_vec())
                .expect("checked by check_write");
            let byte_len = u32::try_from(data.len()).unwrap_or(u32::MAX);
            fabric.nics[peer_nic].inbound.push_back(Landing {
                lkey: key.lkey,
                offset: remote_offset(wr.remote.addr, key.base).unwrap_or(0),
                data,
                wc: Completion {
                    wr_id: recv_wr,
                    qp_num: peer,
                    status: WcStatus::Success,
                    opcode: WcOpcode::RecvRdmaWithImm,
                    imm: Some(wr.imm),
                    byte_len,
                },
            });
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.send_queue.pop_front();
            }
            self.push_cqe(Self::send_wc(qpn, &wr, WcStatus::Success));
        }
    }

    fn progress_all(&mut self, fabric: &mut Fabric) {
        let qpns: Vec<u32> = self.qps.keys().copied().collect();
        for qpn in qpns {
            self.progress(fabric, qpn);
        }
    }

    /// Apply writes the peers executed: land the bytes, then queue the
    /// receive completions.
    fn apply_inbound(&mut self, fabric: &mut Fabric) {
        while let Some(landing) = fabric.nics[self.nic].inbound.pop_front() {
            let target = self.regions.get_mut(&landing.lkey).and_then(|r| {
                r.buf
                    .bytes_mut()
                    .get_mut(landing.offset..landing.offset + landing.data.len())
            });
            // The writer checked rkey and bounds against our protection
            // domain; a region deregistered since takes nothing.
            if let Some(dst) = target {
                dst.copy_from_slice(&landing.data);
            }
            if self.qps.contains_key(&landing.wc.qp_num) {
                self.push_cqe(landing.wc);
            }
        }
    }
}

// SAFETY: the `Verbs` contract holds. (1) `mr_mem` looks `lkey` up in
// `regions`, which holds only regions `reg_mr` registered and `dereg_mr`
// has not removed, and returns a view of exactly that region's `OwnedMem`:
// an allocation of its own of `mr.len` bytes, so no two regions overlap;
// it is freed only when its region leaves `regions` (`dereg_mr`, `&mut
// self`) or the NIC drops. (2) Only `Access::RemoteWrite` regions get an
// entry in the fabric's `rkeys`, and a peer's write is landed
// (`apply_inbound`) only into the region its rkey names (keys are never
// reused), within the bounds `check_write` checked against that entry. (3) Receive WRs carry no
// buffer; a send copies its local slice out (`progress`) and writes
// nothing local; region bytes are written only by `apply_inbound`, landing
// peer writes. (4) A send's local bytes are copied once, when it executes
// in `progress`, before its completion is queued; `destroy_qp` drops
// unexecuted WRs. (5) `apply_inbound` copies a landing's bytes in before it
// queues its receive completion, and a landing is applied once.
#[allow(unsafe_code)]
unsafe impl Verbs for SimNic {
    fn cq_depth(&self) -> u32 {
        self.cfg.cq_depth
    }

    fn qp_caps(&self, qpn: u32) -> Option<QpCaps> {
        self.qps.contains_key(&qpn).then_some(QpCaps {
            max_send_wr: self.cfg.max_send_wr,
            max_recv_wr: self.cfg.max_recv_wr,
            max_msg_size: self.cfg.max_msg_size,
        })
    }

    fn qp_state(&self, qpn: u32) -> Option<QpState> {
        if !self.qps.contains_key(&qpn) {
            return None;
        }
        lock(&self.fabric).qps.get(&qpn).map(|q| q.state)
    }

    fn reg_mr(&mut self, len: usize, access: Access) -> Result<MemoryRegion, VerbsError> {
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
            id: self.registered,
            // Synthetic, distinct and far apart, like virtual addresses.
            addr: u64::from(key) << 32,
            len,
            lkey: key,
            rkey: key + 1,
        };
        // Without remote write no key admits a peer's write.
        if access == Access::RemoteWrite {
            fabric.nics[self.nic].rkeys.insert(
                mr.rkey,
                RemoteKey {
                    base: mr.addr,
                    len,
                    lkey: mr.lkey,
                },
            );
        }
        drop(fabric);
        self.registered += 1;
        self.regions.insert(
            mr.lkey,
            SimRegion {
                mr,
                buf: OwnedMem::zeroed(len),
            },
        );
        Ok(mr)
    }

    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError> {
        let Some(region) = self.regions.remove(&lkey) else {
            return Err(VerbsError::DeregMr {
                lkey,
                errno: Errno::EINVAL,
            });
        };
        lock(&self.fabric).nics[self.nic]
            .rkeys
            .remove(&region.mr.rkey);
        Ok(())
    }

    fn mr_mem(&self, lkey: u32) -> Option<RegisteredMem<'_>> {
        self.regions.get(&lkey).map(|r| r.buf.mem())
    }

    fn post_write_with_imm(
        &mut self,
        qpn: u32,
        wr_id: u64,
        local: LocalSlice,
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<(), VerbsError> {
        let max = self.cfg.max_send_wr;
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Err(VerbsError::PostSend {
                wr_id,
                errno: Errno::EINVAL,
            });
        };
        if qp.sq_outstanding >= max {
            return Err(VerbsError::PostSend {
                wr_id,
                errno: Errno::ENOMEM,
            });
        }
        qp.sq_outstanding += 1;
        qp.staged.push(SendWr {
            wr_id,
            local,
            remote,
            imm,
            rnr_retries: 0,
        });
        Ok(())
    }

    fn post_recv(&mut self, qpn: u32, wr_id: u64) -> Result<(), VerbsError> {
        let max = self.cfg.max_recv_wr;
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Err(VerbsError::PostRecv {
                wr_id,
                errno: Errno::EINVAL,
            });
        };
        if qp.rq_outstanding >= max {
            return Err(VerbsError::PostRecv {
                wr_id,
                errno: Errno::ENOMEM,
            });
        }
        qp.rq_outstanding += 1;
        let fabric = Arc::clone(&self.fabric);
        let mut fabric = lock(&fabric);
        let Some(port) = fabric.qps.get_mut(&qpn) else {
            return Err(VerbsError::PostRecv {
                wr_id,
                errno: Errno::EINVAL,
            });
        };
        port.recvs.push_back(wr_id);
        if port.state == QpState::Error {
            self.enter_error(&mut fabric, qpn, None);
        }
        Ok(())
    }

    fn ring_doorbell(&mut self) -> Result<(), DoorbellError> {
        self.doorbells += 1;
        for qp in self.qps.values_mut() {
            let staged = std::mem::take(&mut qp.staged);
            qp.send_queue.extend(staged);
        }
        let fabric = Arc::clone(&self.fabric);
        self.progress_all(&mut lock(&fabric));
        Ok(())
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let fabric = Arc::clone(&self.fabric);
        let mut fabric = lock(&fabric);
        if !self.cq_overrun {
            self.apply_inbound(&mut fabric);
            self.progress_all(&mut fabric);
        }
        if self.cq_overrun {
            for qpn in self.qps.keys() {
                if let Some(port) = fabric.qps.get_mut(qpn) {
                    port.state = QpState::Error;
                }
            }
            return Err(VerbsError::PollCq {
                errno: Errno::EOVERFLOW,
            });
        }
        drop(fabric);
        let n = out.len().min(self.cq.len());
        for (slot, wc) in out.iter_mut().zip(self.cq.drain(..n)) {
            if let Some(qp) = self.qps.get_mut(&wc.qp_num) {
                match wc.opcode {
                    WcOpcode::RdmaWrite => qp.sq_outstanding -= 1,
                    WcOpcode::RecvRdmaWithImm => qp.rq_outstanding -= 1,
                }
            }
            *slot = wc;
        }
        Ok(n)
    }

    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError> {
        if self.qps.remove(&qpn).is_none() {
            return Err(VerbsError::DestroyQp {
                qpn,
                errno: Errno::EINVAL,
            });
        }
        let mut fabric = lock(&self.fabric);
        fabric.qps.remove(&qpn);
        fabric.nics[self.nic].inbound.retain(|l| l.wc.qp_num != qpn);
        drop(fabric);
        self.cq.retain(|wc| wc.qp_num != qpn);
        Ok(())
    }
}

#[cfg(test)]
mod tests;

//! [`VerbsNic`]: the verbs of one reactor on real hardware, implementing
//! `starwire_rdma::Verbs` so that `RdmaDriver<VerbsNic>` runs the ring
//! protocol on RC queue pairs.

use std::collections::{HashMap, VecDeque};
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use starwire_rdma::{
    Access, Completion, DoorbellError, Errno, LocalSlice, MemoryRegion, QpCaps, QpEndpoint,
    QpState, RegisteredMem, RemoteRing, RemoteSlice, Verbs, VerbsError, WcOpcode, WcStatus,
    MAX_QPN,
};

use crate::device::{LinkLayer, VerbsDevice};
use crate::error::DeviceError;
use crate::sys::{
    CompChannel, Cq, Mr, PostScratch, Qp, QpCreate, RtrAttr, RtsAttr, SendWr, Wc, POLL_MAX,
};

/// Settings of one reactor's verbs. Queue sizes are capped at what the
/// device allows (`max_qp_wr`, `max_cqe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NicConfig {
    /// Completion-queue entries, shared by every queue pair of the
    /// reactor: it must hold `max_send_wr + recv_depth` per connection
    /// (`RdmaDriver::prepare` refuses a connection beyond that).
    pub cq_depth: u32,
    /// Send WRs per queue pair.
    pub max_send_wr: u32,
    /// Receive WRs per queue pair (at least the ring's `recv_depth`).
    pub max_recv_wr: u32,
    /// Frames up to this many bytes are sent inline (`IBV_SEND_INLINE`:
    /// copied into the work request, no DMA read of staging), within the
    /// queue pair's `max_inline_data`.
    pub max_inline: u32,
    /// One send WR in this many asks for a completion (and the last of each
    /// doorbell always does); the others complete with it.
    pub signal_every: u32,
    /// Local ACK timeout, `4.096 µs * 2^timeout` (14: about 67 ms).
    pub timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR` (7, the most).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (7: retry forever). The ring's credits
    /// keep a receive WR posted for every write, so RNR only happens while
    /// the peer re-posts; a peer that never does is found by the session
    /// layer's deadlines, not by the transport.
    pub rnr_retry: u8,
    /// RNR NAK timer we ask of the peer (12: 0.64 ms).
    pub min_rnr_timer: u8,
}

impl Default for NicConfig {
    fn default() -> Self {
        Self {
            cq_depth: 16384,
            max_send_wr: 128,
            max_recv_wr: 256,
            max_inline: 256,
            signal_every: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// Counters of one reactor's verbs, for the guest run and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicStats {
    /// `ibv_post_send` calls: one doorbell per queue pair with work in a
    /// flush.
    pub post_sends: u64,
    /// Send work requests posted.
    pub send_wrs: u64,
    /// Of those, sent inline.
    pub inline_wrs: u64,
    /// Of those, signalled (the others complete with the next signalled
    /// one).
    pub signaled_wrs: u64,
    /// `ibv_post_recv` calls (one receive WR each).
    pub recv_wrs: u64,
    /// Completions read from the CQ.
    pub cqes: u64,
    /// Send completions given to the driver for unsignalled WRs.
    pub implied_completions: u64,
    /// Completion events read from the channel.
    pub cq_events: u64,
    /// Asynchronous events read (and logged).
    pub async_events: u64,
}

/// One queue pair of the reactor and its send bookkeeping.
#[derive(Debug)]
struct QpEntry {
    qp: Qp,
    state: QpState,
    /// Send WRs waiting for the doorbell.
    staged: Vec<SendWr>,
    /// Posted send WRs whose completion the driver has not been given, in
    /// posting order.
    posted: VecDeque<u64>,
    /// Posted WRs since the last signalled one.
    since_signal: u32,
    psn: u32,
}

/// The verbs of one reactor: one completion channel and completion queue
/// that every queue pair of the reactor reports into, the queue pairs, and
/// the regions, all in the device's protection domain.
///
/// Queue pairs are created in the Init state ([`create_qp`]
/// (Self::create_qp)), so the driver posts their receives
/// (`RdmaDriver::prepare`) before the peer learns the ring's rkey; then
/// [`connect_qp`](Self::connect_qp) takes them to RTS against the peer's
/// [`QpEndpoint`].
///
/// Every send WR the driver stages produces exactly one completion, as the
/// `Verbs` contract says, but not every one is signalled: one in
/// [`NicConfig::signal_every`] and the last of each doorbell are, and a
/// signalled completion stands for the unsignalled WRs posted before it on
/// its queue pair (RC completes in order), whose completions are given to
/// the driver with it.
pub struct VerbsNic {
    // Field order is drop order: queue pairs, then regions, then the CQ.
    qps: HashMap<u32, QpEntry>,
    regions: HashMap<u32, Mr>,
    cq: Arc<Cq>,
    channel: Arc<CompChannel>,
    device: VerbsDevice,
    cfg: NicConfig,
    max_msg_size: usize,
    /// Queue pairs with staged WRs.
    dirty: Vec<u32>,
    /// Completions ready for the driver, beyond what its last poll took.
    ready: VecDeque<Completion>,
    polled: Vec<Wc>,
    scratch: PostScratch,
    registered: u32,
    stats: NicStats,
}

impl std::fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsNic")
            .field("device", &self.device)
            .field("qps", &self.qps.len())
            .field("regions", &self.regions.len())
            .field("cq_depth", &self.cq.depth())
            .finish()
    }
}

fn errno(e: i32) -> Errno {
    Errno(e)
}

impl VerbsNic {
    /// The verbs of one reactor on `device`: a completion channel and a
    /// completion queue of `cfg.cq_depth` entries (at most the device's
    /// `max_cqe`).
    pub fn new(device: &VerbsDevice, mut cfg: NicConfig) -> Result<Self, DeviceError> {
        let name = device.name().to_owned();
        cfg.max_send_wr = cfg.max_send_wr.clamp(1, device.max_qp_wr().max(1));
        cfg.max_recv_wr = cfg.max_recv_wr.clamp(1, device.max_qp_wr().max(1));
        cfg.cq_depth = cfg.cq_depth.clamp(1, device.max_cqe().max(1));
        cfg.signal_every = cfg.signal_every.clamp(1, cfg.max_send_wr);
        let ctx = device.pd().context();
        let channel = CompChannel::create(ctx).map_err(|errno| DeviceError::CreateChannel {
            device: name.clone(),
            errno,
        })?;
        let channel = Arc::new(channel);
        let cq =
            Cq::create(ctx, &channel, cfg.cq_depth).map_err(|errno| DeviceError::CreateCq {
                device: name,
                cqe: cfg.cq_depth,
                errno,
            })?;
        Ok(Self {
            qps: HashMap::new(),
            regions: HashMap::new(),
            cq: Arc::new(cq),
            channel,
            device: device.clone(),
            max_msg_size: device.max_msg_size() as usize,
            cfg,
            dirty: Vec::new(),
            ready: VecDeque::new(),
            polled: Vec::with_capacity(POLL_MAX),
            scratch: PostScratch::default(),
            registered: 0,
            stats: NicStats::default(),
        })
    }

    /// The device.
    pub fn device(&self) -> &VerbsDevice {
        &self.device
    }

    /// The settings in force (capped to the device).
    pub fn config(&self) -> &NicConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> NicStats {
        self.stats
    }

    /// Create a queue pair in the Init state: receive WRs may be posted on
    /// it, nothing sent. Returns its number.
    pub fn create_qp(&mut self) -> Result<u32, DeviceError> {
        let want = QpCreate {
            max_send_wr: self.cfg.max_send_wr,
            max_recv_wr: self.cfg.max_recv_wr,
            max_inline_data: self.cfg.max_inline,
        };
        let qp =
            Qp::create(self.device.pd(), &self.cq, want).map_err(|e| DeviceError::ModifyQp {
                qpn: 0,
                state: "RESET (ibv_create_qp)",
                errno: e,
            })?;
        let qpn = qp.qp_num();
        qp.to_init(self.device.port())
            .map_err(|errno| DeviceError::ModifyQp {
                qpn,
                state: "INIT",
                errno,
            })?;
        // A 24-bit starting PSN that differs between queue pairs; a stale
        // packet of an earlier queue pair with the same number is then
        // out of sequence.
        let psn = qpn.wrapping_mul(0x9e37_79b1) >> 8 & MAX_QPN;
        self.qps.insert(
            qpn,
            QpEntry {
                qp,
                state: QpState::Init,
                staged: Vec::new(),
                posted: VecDeque::new(),
                since_signal: 0,
                psn,
            },
        );
        Ok(qpn)
    }

    /// What the peer needs to connect to queue pair `qpn` and write into
    /// `ring`; `None` for an unknown queue pair.
    pub fn local_endpoint(&self, qpn: u32, ring: RemoteRing) -> Option<QpEndpoint> {
        let e = self.qps.get(&qpn)?;
        Some(QpEndpoint {
            qpn,
            psn: e.psn,
            lid: self.device.lid(),
            gid: self.device.gid().0,
            gid_index: self.device.gid_index(),
            mtu: self.device.active_mtu(),
            port: self.device.port(),
            ring,
        })
    }

    /// Take queue pair `qpn` from Init to RTR and RTS against `peer`
    /// (the path MTU is the smaller port MTU of the two).
    pub fn connect_qp(&mut self, qpn: u32, peer: &QpEndpoint) -> Result<(), DeviceError> {
        let Some(e) = self.qps.get_mut(&qpn).filter(|e| e.state == QpState::Init) else {
            return Err(DeviceError::NotInit(qpn));
        };
        let global = self.device.link_layer() == LinkLayer::Ethernet || peer.gid != [0; 16];
        let rtr = RtrAttr {
            port: self.device.port(),
            dest_qpn: peer.qpn,
            rq_psn: peer.psn,
            mtu: peer.mtu.min(self.device.active_mtu()),
            dlid: peer.lid,
            global,
            dgid: peer.gid,
            sgid_index: self.device.sgid_index(),
            min_rnr_timer: self.cfg.min_rnr_timer,
        };
        let fail = |state, errno| DeviceError::ModifyQp { qpn, state, errno };
        e.qp.to_rtr(&rtr).map_err(|errno| fail("RTR", errno))?;
        let rts = RtsAttr {
            sq_psn: e.psn,
            timeout: self.cfg.timeout,
            retry_cnt: self.cfg.retry_cnt,
            rnr_retry: self.cfg.rnr_retry,
        };
        e.qp.to_rts(&rts).map_err(|errno| fail("RTS", errno))?;
        e.state = QpState::ReadyToSend;
        Ok(())
    }

    /// Give the driver a completion now or on its next poll.
    fn emit(
        ready: &mut VecDeque<Completion>,
        out: &mut [Completion],
        n: &mut usize,
        wc: Completion,
    ) {
        if *n < out.len() && ready.is_empty() {
            out[*n] = wc;
            *n += 1;
        } else {
            ready.push_back(wc);
        }
    }

    /// Turn one CQE into the driver's completions: a send completion (or
    /// any error completion of a posted send) also completes the
    /// unsignalled WRs posted before it on its queue pair.
    fn absorb(&mut self, wc: Wc, out: &mut [Completion], n: &mut usize) {
        let mut completion = Completion {
            wr_id: wc.wr_id,
            qp_num: wc.qp_num,
            status: wc.status,
            opcode: wc.opcode.unwrap_or(WcOpcode::RecvRdmaWithImm),
            imm: wc.imm,
            byte_len: wc.byte_len,
        };
        let Some(e) = self.qps.get_mut(&wc.qp_num) else {
            // A queue pair destroyed since: nobody to tell.
            return;
        };
        if !wc.status.is_success() {
            e.state = QpState::Error;
        }
        let send = match wc.opcode {
            Some(WcOpcode::RdmaWrite) => true,
            Some(WcOpcode::RecvRdmaWithImm) => false,
            // An error completion: a send if it names a posted send WR.
            _ => e.posted.contains(&wc.wr_id),
        };
        if send {
            completion.opcode = WcOpcode::RdmaWrite;
            while let Some(id) = e.posted.pop_front() {
                if id == wc.wr_id {
                    break;
                }
                self.stats.implied_completions += 1;
                let implied = Completion {
                    wr_id: id,
                    qp_num: wc.qp_num,
                    status: WcStatus::Success,
                    opcode: WcOpcode::RdmaWrite,
                    imm: None,
                    byte_len: 0,
                };
                Self::emit(&mut self.ready, out, n, implied);
            }
        }
        Self::emit(&mut self.ready, out, n, completion);
    }

    /// Read and log the asynchronous events waiting.
    fn read_async_events(&mut self) {
        while let Some(ev) = self.device.pd().context().next_async_event() {
            self.stats.async_events += 1;
            tracing::warn!(
                device = self.device.name(),
                event = %ev.what,
                qp_num = ev.qp_num,
                port = ev.port,
                "rdma async event"
            );
            if let Some(e) = ev.qp_num.and_then(|q| self.qps.get_mut(&q)) {
                if ev.what.contains("fatal") || ev.what.contains("error") {
                    e.state = QpState::Error;
                }
            }
        }
    }
}

// SAFETY: the `Verbs` contract holds. (1) `mr_mem` returns `Mr::mem` of
// a region in `regions`, which holds only regions `reg_mr` registered and
// `dereg_mr` has not removed: exactly that region's own mapping, of the
// `len` `reg_mr` reported, so no two regions overlap; it is unmapped only
// when its `Mr` drops (`dereg_mr`, `&mut self`, or the NIC's drop).
// (2) `Mr::register` asks `IBV_ACCESS_REMOTE_WRITE` only for
// `Access::RemoteWrite`, and the HCA checks every incoming write's rkey,
// access and bounds against the region it names, failing it with a remote
// access error otherwise. (3) Receive WRs carry no scatter entry
// (`Qp::post_recv`), sends are RDMA writes that only read their local
// slice, and nothing here writes region bytes. (4) The NIC reads a send's
// slice until the WR completes (an inline WR is copied inside
// `ibv_post_send`); a completion is given for an unsignalled WR only once
// a later CQE of its queue pair has been polled, and RC completes a queue
// pair's WRs in order, so that one is done too; after `ibv_destroy_qp`
// none of its WRs is processed. (5) `ibv_poll_cq` returns a receive
// completion only once the write's data is in memory (the provider orders
// the CQE read before later reads of the data).
#[allow(unsafe_code)]
unsafe impl Verbs for VerbsNic {
    fn cq_depth(&self) -> u32 {
        self.cq.depth()
    }

    fn qp_caps(&self, qpn: u32) -> Option<QpCaps> {
        let caps = self.qps.get(&qpn)?.qp.caps();
        Some(QpCaps {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_msg_size: self.max_msg_size,
        })
    }

    fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.qps.get(&qpn).map(|e| e.state)
    }

    fn reg_mr(&mut self, len: usize, access: Access) -> Result<MemoryRegion, VerbsError> {
        if len == 0 {
            return Err(VerbsError::RegMr {
                len,
                errno: Errno::EINVAL,
            });
        }
        let remote_write = access == Access::RemoteWrite;
        let mr =
            Mr::register(self.device.pd(), len, remote_write).map_err(|e| VerbsError::RegMr {
                len,
                errno: errno(e),
            })?;
        let region = MemoryRegion {
            id: self.registered,
            addr: mr.addr(),
            len: mr.len(),
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        self.registered = self.registered.wrapping_add(1);
        self.regions.insert(region.lkey, mr);
        Ok(region)
    }

    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError> {
        match self.regions.remove(&lkey) {
            Some(_) => Ok(()),
            None => Err(VerbsError::DeregMr {
                lkey,
                errno: Errno::EINVAL,
            }),
        }
    }

    fn mr_mem(&self, lkey: u32) -> Option<RegisteredMem<'_>> {
        self.regions.get(&lkey).map(Mr::mem)
    }

    fn post_write_with_imm(
        &mut self,
        qpn: u32,
        wr_id: u64,
        local: LocalSlice,
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<(), VerbsError> {
        let refused = |errno| VerbsError::PostSend { wr_id, errno };
        let e = self.qps.get_mut(&qpn).ok_or(refused(Errno::EINVAL))?;
        let Some(mr) = self.regions.get(&local.lkey) else {
            return Err(refused(Errno::EINVAL));
        };
        let (Some(len), true) = (
            u32::try_from(local.len).ok(),
            local
                .offset
                .checked_add(local.len)
                .is_some_and(|end| end <= mr.len()),
        ) else {
            return Err(refused(Errno::EINVAL));
        };
        let outstanding = e.staged.len() + e.posted.len();
        if outstanding >= e.qp.caps().max_send_wr as usize {
            return Err(refused(Errno::ENOMEM));
        }
        let inline = len > 0 && len <= self.cfg.max_inline.min(e.qp.caps().max_inline_data);
        if e.staged.is_empty() {
            self.dirty.push(qpn);
        }
        e.staged.push(SendWr {
            wr_id,
            lkey: local.lkey,
            offset: local.offset,
            len,
            remote_addr: remote.addr,
            rkey: remote.rkey,
            imm,
            signaled: false,
            inline,
        });
        Ok(())
    }

    fn post_recv(&mut self, qpn: u32, wr_id: u64) -> Result<(), VerbsError> {
        let e = self.qps.get(&qpn).ok_or(VerbsError::PostRecv {
            wr_id,
            errno: Errno::EINVAL,
        })?;
        e.qp.post_recv(wr_id).map_err(|e| VerbsError::PostRecv {
            wr_id,
            errno: errno(e),
        })?;
        self.stats.recv_wrs += 1;
        Ok(())
    }

    fn ring_doorbell(&mut self) -> Result<(), DoorbellError> {
        // One error per queue pair whose chain was refused: the WRs from
        // the refused one on never complete, so each such connection must
        // fail, not only the first.
        let mut refused: Option<DoorbellError> = None;
        let every = self.cfg.signal_every;
        for qpn in std::mem::take(&mut self.dirty) {
            let Some(e) = self.qps.get_mut(&qpn) else {
                continue;
            };
            let last = e.staged.len().saturating_sub(1);
            for (i, w) in e.staged.iter_mut().enumerate() {
                e.since_signal += 1;
                w.signaled = i == last || e.since_signal >= every;
                if w.signaled {
                    e.since_signal = 0;
                }
            }
            // The ring keeps a frame's staging bytes until its completion.
            let r = e.qp.post_send(&e.staged, &self.regions, &mut self.scratch);
            let posted = match r {
                Ok(()) => e.staged.len(),
                Err((at, err)) => {
                    let refusal = VerbsError::PostSend {
                        wr_id: e.staged[at].wr_id,
                        errno: errno(err),
                    };
                    match &mut refused {
                        Some(r) => r.push(refusal),
                        None => refused = Some(DoorbellError::new(refusal)),
                    }
                    at
                }
            };
            self.stats.post_sends += 1;
            for w in &e.staged[..posted] {
                self.stats.send_wrs += 1;
                self.stats.inline_wrs += u64::from(w.inline);
                self.stats.signaled_wrs += u64::from(w.signaled);
                e.posted.push_back(w.wr_id);
            }
            e.staged.clear();
        }
        refused.map_or(Ok(()), Err)
    }

    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let mut n = 0;
        while n < out.len() {
            let Some(wc) = self.ready.pop_front() else {
                break;
            };
            out[n] = wc;
            n += 1;
        }
        while n < out.len() && self.ready.is_empty() {
            let mut polled = std::mem::take(&mut self.polled);
            polled.clear();
            let got = self
                .cq
                .poll(&mut polled)
                .map_err(|e| VerbsError::PollCq { errno: errno(e) });
            let got = match got {
                Ok(got) => got,
                Err(e) => {
                    self.polled = polled;
                    return Err(e);
                }
            };
            self.stats.cqes += got as u64;
            for &wc in &polled {
                self.absorb(wc, out, &mut n);
            }
            self.polled = polled;
            if got < POLL_MAX {
                break;
            }
        }
        Ok(n)
    }

    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError> {
        let Some(e) = self.qps.remove(&qpn) else {
            return Err(VerbsError::DestroyQp {
                qpn,
                errno: Errno::EINVAL,
            });
        };
        drop(e);
        self.dirty.retain(|&q| q != qpn);
        // Completions of the queue pair still in the CQ go with it: move
        // everything queued to `ready` (whose completions of other queue
        // pairs keep their order) and drop this one's.
        loop {
            let mut polled = std::mem::take(&mut self.polled);
            polled.clear();
            let got = self.cq.poll(&mut polled).unwrap_or(0);
            self.stats.cqes += got as u64;
            for &wc in &polled {
                self.absorb(wc, &mut [], &mut 0);
            }
            self.polled = polled;
            if got < POLL_MAX {
                break;
            }
        }
        self.ready.retain(|wc| wc.qp_num != qpn);
        Ok(())
    }

    fn can_sleep(&self) -> bool {
        true
    }

    fn event_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        out.push(self.channel.fd());
        out.push(self.device.pd().context().async_fd());
    }

    fn arm_cq(&mut self) -> Result<(), VerbsError> {
        self.cq
            .req_notify()
            .map_err(|e| VerbsError::ReqNotifyCq { errno: errno(e) })
    }

    fn take_events(&mut self) {
        self.stats.cq_events += u64::from(self.cq.take_events());
        self.read_async_events();
    }
}

//! A reliable-connected queue pair: creation in the Init state, the
//! RTR/RTS transitions, posting.

use std::collections::HashMap;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as ffi;

use super::{last_errno, rc_errno, Cq, Mr, Pd};

/// What to ask of `ibv_create_qp`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpCreate {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_inline_data: u32,
}

/// The peer, as the RTR transition needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RtrAttr {
    pub(crate) port: u8,
    pub(crate) dest_qpn: u32,
    pub(crate) rq_psn: u32,
    /// `enum ibv_mtu`.
    pub(crate) mtu: u8,
    pub(crate) dlid: u16,
    /// Route by GID (`is_global`): always on Ethernet (RoCE).
    pub(crate) global: bool,
    pub(crate) dgid: [u8; 16],
    pub(crate) sgid_index: u8,
    pub(crate) min_rnr_timer: u8,
}

/// The RTS transition's timers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RtsAttr {
    pub(crate) sq_psn: u32,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
}

/// One `IBV_WR_RDMA_WRITE_WITH_IMM`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendWr {
    pub(crate) wr_id: u64,
    /// Local source: `len` bytes at `offset` of the region `lkey` (no
    /// gather entry when `len` is 0).
    pub(crate) lkey: u32,
    pub(crate) offset: usize,
    pub(crate) len: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    /// Host order.
    pub(crate) imm: u32,
    pub(crate) signaled: bool,
    /// `IBV_SEND_INLINE`: the CPU copies the bytes into the work request
    /// inside `ibv_post_send`.
    pub(crate) inline: bool,
}

/// Work-request arrays reused by every post, so posting allocates nothing.
#[derive(Default)]
pub(crate) struct PostScratch {
    wrs: Vec<ffi::ibv_send_wr>,
    sges: Vec<ffi::ibv_sge>,
}

// SAFETY: the scratch arrays hold pointers only while a post runs (they
// are rebuilt by each post); between posts they are plain memory.
unsafe impl Send for PostScratch {}

/// An RC queue pair (`ibv_create_qp`) whose send and receive completions
/// go to one CQ, with selective signalling (`sq_sig_all = 0`).
pub(crate) struct Qp {
    qp: NonNull<ffi::ibv_qp>,
    caps: QpCreate,
    _cq: Arc<Cq>,
    _pd: Arc<Pd>,
}

// SAFETY: libibverbs queue pairs may be used from any thread; the pointer
// is owned by this value.
unsafe impl Send for Qp {}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

impl Qp {
    /// `ibv_create_qp` (RC, one gather entry, receives without scatter
    /// entries). A device that refuses the inline size asked for is asked
    /// again without inline data.
    pub(crate) fn create(pd: &Arc<Pd>, cq: &Arc<Cq>, want: QpCreate) -> Result<Self, i32> {
        let attempt = |inline: u32| {
            // SAFETY: all-zero is a valid `ibv_qp_init_attr` (null
            // pointers, integers).
            let mut a: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            a.send_cq = cq.as_ptr();
            a.recv_cq = cq.as_ptr();
            a.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            a.sq_sig_all = 0;
            a.cap = ffi::ibv_qp_cap {
                max_send_wr: want.max_send_wr,
                max_recv_wr: want.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: inline,
            };
            // SAFETY: a live protection domain and CQ of one context, and
            // a valid attribute block the call updates with the caps
            // granted.
            let qp = unsafe { ffi::ibv_create_qp(pd.as_ptr(), &mut a) };
            NonNull::new(qp)
                .map(|qp| (qp, a.cap))
                .ok_or_else(last_errno)
        };
        let (qp, cap) = match attempt(want.max_inline_data) {
            Ok(r) => r,
            Err(_) if want.max_inline_data > 0 => attempt(0)?,
            Err(e) => return Err(e),
        };
        Ok(Self {
            qp,
            caps: QpCreate {
                max_send_wr: cap.max_send_wr,
                max_recv_wr: cap.max_recv_wr,
                max_inline_data: cap.max_inline_data,
            },
            _cq: Arc::clone(cq),
            _pd: Arc::clone(pd),
        })
    }

    /// The queue pair number.
    pub(crate) fn qp_num(&self) -> u32 {
        // SAFETY: the QP is live; a plain field read.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    /// The capacities granted.
    pub(crate) fn caps(&self) -> QpCreate {
        self.caps
    }

    fn modify(&self, a: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<(), i32> {
        // SAFETY: a live QP and a valid attribute block whose fields named
        // by `mask` are set.
        match unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), a, mask.0 as i32) } {
            0 => Ok(()),
            rc => Err(rc_errno(rc)),
        }
    }

    fn attr() -> ffi::ibv_qp_attr {
        // SAFETY: all-zero is a valid `ibv_qp_attr` (integers, a GID
        // union of bytes).
        unsafe { std::mem::zeroed() }
    }

    /// Reset → Init on `port`, with remote write access (the peer writes
    /// our receive ring).
    pub(crate) fn to_init(&self, port: u8) -> Result<(), i32> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = Self::attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// Init → RTR towards the peer.
    pub(crate) fn to_rtr(&self, r: &RtrAttr) -> Result<(), i32> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = Self::attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = u32::from(r.mtu);
        a.dest_qp_num = r.dest_qpn;
        a.rq_psn = r.rq_psn;
        // The ring uses no RDMA reads or atomics.
        a.max_dest_rd_atomic = 0;
        a.min_rnr_timer = r.min_rnr_timer;
        a.ah_attr.port_num = r.port;
        a.ah_attr.dlid = r.dlid;
        if r.global {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = r.dgid;
            a.ah_attr.grh.sgid_index = r.sgid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )
    }

    /// RTR → RTS.
    pub(crate) fn to_rts(&self, r: &RtsAttr) -> Result<(), i32> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = Self::attr();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = r.sq_psn;
        a.timeout = r.timeout;
        a.retry_cnt = r.retry_cnt;
        a.rnr_retry = r.rnr_retry;
        a.max_rd_atomic = 0;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// `ibv_post_recv` of one receive WR with no scatter entry (a
    /// write-with-immediate consumes it only for its immediate). No memory
    /// is lent.
    pub(crate) fn post_recv(&self, wr_id: u64) -> Result<(), i32> {
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: a live QP, one valid WR naming no memory, a valid
        // out-pointer.
        match unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(rc_errno(rc)),
        }
    }

    /// Post `wrs` as one chain: one `ibv_post_send`, one doorbell. Each
    /// WR's source must lie inside its region in `regions` (the regions
    /// this queue pair's owner registered), or nothing is posted from it
    /// on. On failure, the index of the first WR not posted and the errno
    /// (the WRs before it were posted).
    ///
    /// The bytes of a WR are read by the CPU inside this call (inline) or
    /// by the NIC until it completes; the caller keeps them unchanged
    /// until then, or the peer receives torn bytes.
    pub(crate) fn post_send(
        &self,
        wrs: &[SendWr],
        regions: &HashMap<u32, Mr>,
        scratch: &mut PostScratch,
    ) -> Result<(), (usize, i32)> {
        if wrs.is_empty() {
            return Ok(());
        }
        scratch.wrs.clear();
        scratch.sges.clear();
        for (i, w) in wrs.iter().enumerate() {
            let inside = regions.get(&w.lkey).filter(|mr| {
                w.offset
                    .checked_add(w.len as usize)
                    .is_some_and(|end| end <= mr.len())
            });
            let Some(mr) = inside else {
                if i == 0 {
                    return Err((0, libc::EINVAL));
                }
                // Post what was valid; report the first invalid one after.
                return match self.post_send(&wrs[..i], regions, scratch) {
                    Ok(()) => Err((i, libc::EINVAL)),
                    Err(e) => Err(e),
                };
            };
            scratch.sges.push(ffi::ibv_sge {
                addr: mr.addr() + w.offset as u64,
                length: w.len,
                lkey: w.lkey,
            });
        }
        for w in wrs {
            // SAFETY: all-zero is a valid `ibv_send_wr` (null pointers,
            // integers, unions of those).
            let mut s: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
            s.wr_id = w.wr_id;
            s.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            let mut flags = 0;
            if w.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if w.inline {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            s.send_flags = flags;
            s.imm_data_invalidated_rkey_union.imm_data = w.imm.to_be();
            s.wr.rdma = ffi::rdma_t {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            scratch.wrs.push(s);
        }
        // Link the chain only now: the vectors no longer move.
        let base = scratch.wrs.as_mut_ptr();
        let sges = scratch.sges.as_mut_ptr();
        for (i, w) in wrs.iter().enumerate() {
            let s = &mut scratch.wrs[i];
            if w.len > 0 {
                // SAFETY: `i < sges.len()`, so the pointer is inside it.
                s.sg_list = unsafe { sges.add(i) };
                s.num_sge = 1;
            }
            if i + 1 < wrs.len() {
                // SAFETY: `i + 1 < wrs.len()`, inside the vector.
                s.next = unsafe { base.add(i + 1) };
            }
        }
        let mut bad = ptr::null_mut();
        // SAFETY: a live QP and a chain of valid WRs whose gather entries
        // live in `scratch` for the call; every entry lies inside a region
        // of `regions` (checked above), whose mapping is borrowed for the
        // call, so the inline copies read mapped memory, and the NIC checks
        // the others against their keys.
        let rc = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let at = if bad.is_null() {
            0
        } else {
            (bad as usize - base as usize) / std::mem::size_of::<ffi::ibv_send_wr>()
        };
        Err((at.min(wrs.len() - 1), rc_errno(rc)))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, here, before its CQ and
        // protection domain (held by `self`).
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_destroy_qp failed");
        }
    }
}

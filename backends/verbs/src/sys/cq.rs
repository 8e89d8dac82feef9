//! The completion channel and the completion queue of one reactor.

use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as ffi;
use starwire_rdma::{WcOpcode, WcStatus};

use super::{last_errno, rc_errno, set_nonblocking, Context};

/// A completion channel (`ibv_create_comp_channel`): a descriptor that
/// turns readable when an armed completion queue gets a completion.
pub(crate) struct CompChannel {
    ch: NonNull<ffi::ibv_comp_channel>,
    _ctx: Arc<Context>,
}

// SAFETY: the channel is a descriptor plus a pointer owned by this value;
// libibverbs allows its use from any thread.
unsafe impl Send for CompChannel {}
// SAFETY: as above; reading events from two threads would only race for
// them, which is not memory-unsafe.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// `ibv_create_comp_channel`, its descriptor made non-blocking.
    pub(crate) fn create(ctx: &Arc<Context>) -> Result<Self, i32> {
        // SAFETY: a live context.
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(last_errno)?;
        let ch = Self {
            ch,
            _ctx: Arc::clone(ctx),
        };
        set_nonblocking(ch.raw_fd())?;
        Ok(ch)
    }

    fn raw_fd(&self) -> RawFd {
        // SAFETY: the channel is live; `fd` is a plain field.
        unsafe { (*self.ch.as_ptr()).fd }
    }

    /// The descriptor to wait on.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to the channel, closed only by
        // `ibv_destroy_comp_channel` in `Drop`, after this borrow.
        unsafe { BorrowedFd::borrow_raw(self.raw_fd()) }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: completion queues on the channel hold an `Arc` of it, so
        // none is left; destroyed once, here.
        let rc = unsafe { ffi::ibv_destroy_comp_channel(self.ch.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_destroy_comp_channel failed");
        }
    }
}

/// One work completion, converted from `struct ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wc {
    pub(crate) wr_id: u64,
    pub(crate) qp_num: u32,
    pub(crate) status: WcStatus,
    /// `None` for an opcode the ring never posts (and on error
    /// completions, where verbs leaves it undefined).
    pub(crate) opcode: Option<WcOpcode>,
    pub(crate) byte_len: u32,
    /// The immediate, host order.
    pub(crate) imm: Option<u32>,
}

fn status(s: ffi::ibv_wc_status::Type) -> WcStatus {
    use ffi::ibv_wc_status as S;
    match s {
        S::IBV_WC_SUCCESS => WcStatus::Success,
        S::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        S::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
        S::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        S::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        S::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        S::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlush,
        other => WcStatus::Other(other),
    }
}

/// A completion queue (`ibv_create_cq`) on a completion channel.
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    depth: u32,
    channel: Arc<CompChannel>,
}

// SAFETY: libibverbs completion queues may be polled and armed from any
// thread (providers lock the queue); the pointer is owned by this value.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

/// Completions polled per `ibv_poll_cq` call at most.
pub(crate) const POLL_MAX: usize = 64;

impl Cq {
    /// `ibv_create_cq` with at least `cqe` entries, reporting to `channel`.
    pub(crate) fn create(
        ctx: &Arc<Context>,
        channel: &Arc<CompChannel>,
        cqe: u32,
    ) -> Result<Self, i32> {
        let want = i32::try_from(cqe).map_err(|_| libc::EINVAL)?;
        // SAFETY: a live context and channel of that context; no CQ context
        // pointer; completion vector 0.
        let cq = unsafe {
            ffi::ibv_create_cq(ctx.as_ptr(), want, ptr::null_mut(), channel.ch.as_ptr(), 0)
        };
        let cq = NonNull::new(cq).ok_or_else(last_errno)?;
        // SAFETY: the CQ is live; `cqe` is a plain field (the size granted).
        let depth = u32::try_from(unsafe { (*cq.as_ptr()).cqe }).unwrap_or(cqe);
        Ok(Self {
            cq,
            depth,
            channel: Arc::clone(channel),
        })
    }

    /// Entries granted (at least those asked for).
    pub(crate) fn depth(&self) -> u32 {
        self.depth
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    /// `ibv_poll_cq`: up to [`POLL_MAX`] completions appended to `out`;
    /// returns how many.
    pub(crate) fn poll(&self, out: &mut Vec<Wc>) -> Result<usize, i32> {
        // SAFETY: all-zero is a valid `ibv_wc` (integers and a union of
        // integers).
        let mut wcs: [ffi::ibv_wc; POLL_MAX] = unsafe { std::mem::zeroed() };
        // SAFETY: a live CQ and room for `POLL_MAX` entries.
        let n = unsafe { ffi::ibv_poll_cq(self.as_ptr(), POLL_MAX as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(rc_errno(n));
        }
        let n = n as usize;
        for wc in &wcs[..n] {
            let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            let imm = if with_imm {
                // SAFETY: with IBV_WC_WITH_IMM the union holds the
                // immediate, in network order.
                Some(u32::from_be(unsafe {
                    wc.imm_data_invalidated_rkey_union.imm_data
                }))
            } else {
                None
            };
            let status = status(wc.status);
            let opcode = match wc.opcode {
                _ if !status.is_success() => None,
                ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => Some(WcOpcode::RdmaWrite),
                ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => Some(WcOpcode::RecvRdmaWithImm),
                _ => None,
            };
            out.push(Wc {
                wr_id: wc.wr_id,
                qp_num: wc.qp_num,
                status,
                opcode,
                byte_len: wc.byte_len,
                imm,
            });
        }
        Ok(n)
    }

    /// `ibv_req_notify_cq` for any next completion.
    pub(crate) fn req_notify(&self) -> Result<(), i32> {
        // SAFETY: a live CQ on a completion channel.
        match unsafe { ffi::ibv_req_notify_cq(self.as_ptr(), 0) } {
            0 => Ok(()),
            rc => Err(rc_errno(rc)),
        }
    }

    /// Read every completion event waiting on the channel
    /// (`ibv_get_cq_event`, non-blocking) and acknowledge them
    /// (`ibv_ack_cq_events`); returns how many.
    pub(crate) fn take_events(&self) -> u32 {
        let mut n = 0u32;
        loop {
            let mut cq = ptr::null_mut();
            let mut cq_ctx = ptr::null_mut();
            // SAFETY: a live channel and valid out-pointers; the
            // descriptor is non-blocking, so with no event waiting the call
            // returns -1 (EAGAIN) at once.
            let rc =
                unsafe { ffi::ibv_get_cq_event(self.channel.ch.as_ptr(), &mut cq, &mut cq_ctx) };
            if rc != 0 {
                break;
            }
            // Only this CQ reports to its channel.
            debug_assert_eq!(cq, self.as_ptr());
            n += 1;
        }
        if n > 0 {
            // SAFETY: `n` events of this CQ were read and not yet
            // acknowledged.
            unsafe { ffi::ibv_ack_cq_events(self.as_ptr(), n) };
        }
        n
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: queue pairs on the CQ hold an `Arc` of it, so none is
        // left; every event read was acknowledged in `take_events`;
        // destroyed once, here, before the channel (`self.channel`).
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_destroy_cq failed");
        }
    }
}

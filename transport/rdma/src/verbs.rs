//! The verbs model: the handful of ibverbs operations the ring protocol
//! needs, as plain data plus the [`Verbs`] trait.
//!
//! Names follow rdma-core (`ibv_reg_mr`, `ibv_post_send` with
//! `IBV_WR_RDMA_WRITE_WITH_IMM`, `ibv_post_recv`, `ibv_poll_cq`,
//! `struct ibv_wc`) and rust-ibverbs (`MemoryRegion`, local/remote memory
//! slices). The model is deliberately narrow and per core, like the
//! hardware: one protection domain that owns every memory region, one
//! completion queue that every queue pair reports into (send and receive),
//! and reliable-connected (RC) queue pairs, one per connection. Every send
//! work request is signaled; receive work requests have no scatter entries
//! (a write-with-immediate consumes a receive WR only to deliver its
//! immediate; the bytes land where the writer said).
//!
//! Two implementations exist: [`SimNic`](crate::SimNic), an in-memory NIC
//! on a simulated fabric used by the tests, and `VerbsNic` in
//! `starwire-verbs`, over libibverbs (see `docs/backends/rdma.md`). The
//! trait is `unsafe` to implement: the ring lends registered memory as
//! slices on the strength of its contract (see [`Verbs`]'s `# Safety`).

use std::fmt;
use std::os::fd::BorrowedFd;

use thiserror::Error;

use crate::mem::RegisteredMem;

/// What a region's rkey admits: the NIC refuses a peer's RDMA write to a
/// region registered without remote write (`IBV_WC_REM_ACCESS_ERR` at the
/// writer), whatever key it guesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Local reads and writes only (a staging buffer, whose rkey is never
    /// given to the peer).
    Local,
    /// Remote writes too (`IBV_ACCESS_REMOTE_WRITE`: a receive ring).
    RemoteWrite,
}

/// A registered memory region: what `ibv_reg_mr` returns.
///
/// `lkey` names the region in local work requests; `rkey` and `addr` are
/// what the peer puts in its RDMA writes (`wr.rdma.rkey`,
/// `wr.rdma.remote_addr`) to target this region, if it was registered
/// with [`Access::RemoteWrite`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryRegion {
    /// Identifier local to the verbs that registered it (registration
    /// order).
    pub id: u32,
    /// Address of the first byte as the peer names it in `remote_addr`
    /// (the buffer's virtual address for the verbs driver; synthetic in the
    /// simulator).
    pub addr: u64,
    /// Length in bytes; offsets in work requests are relative to its start.
    pub len: usize,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// A local gather entry (`struct ibv_sge`, addressed by offset instead of
/// virtual address): `len` bytes at `offset` inside the region `lkey`.
/// `len == 0` is allowed (an immediate-only write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSlice {
    /// Local key of the source region.
    pub lkey: u32,
    /// Offset inside the region.
    pub offset: usize,
    /// Number of bytes.
    pub len: usize,
}

/// The remote target of an RDMA write (`wr.rdma.rkey` and
/// `wr.rdma.remote_addr`): the write covers `addr .. addr + len` of the
/// peer's region `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Remote key of the peer's region.
    pub rkey: u32,
    /// Remote address (the region's [`MemoryRegion::addr`] plus an offset).
    pub addr: u64,
}

/// Completion status (`enum ibv_wc_status`, the subset an RC write/recv can
/// produce).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    #[default]
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: the message exceeds the port's maximum.
    LocalLength,
    /// `IBV_WC_LOC_PROT_ERR`: the local slice is not inside a region
    /// registered with this lkey.
    LocalProtection,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer rejected the rkey/offset/length.
    RemoteAccess,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive WR posted and the
    /// receiver-not-ready retries ran out.
    RnrRetryExceeded,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer stopped answering (its QP is in the
    /// error state or gone).
    RetryExceeded,
    /// `IBV_WC_WR_FLUSH_ERR`: the WR was flushed because the QP is in the
    /// error state.
    WrFlush,
    /// Any other `enum ibv_wc_status` value a device reports.
    Other(u32),
}

impl WcStatus {
    /// True for [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == Self::Success
    }

    /// The rdma-core name of the status.
    pub fn verbs_name(self) -> &'static str {
        match self {
            Self::Success => "IBV_WC_SUCCESS",
            Self::LocalLength => "IBV_WC_LOC_LEN_ERR",
            Self::LocalProtection => "IBV_WC_LOC_PROT_ERR",
            Self::RemoteAccess => "IBV_WC_REM_ACCESS_ERR",
            Self::RnrRetryExceeded => "IBV_WC_RNR_RETRY_EXC_ERR",
            Self::RetryExceeded => "IBV_WC_RETRY_EXC_ERR",
            Self::WrFlush => "IBV_WC_WR_FLUSH_ERR",
            Self::Other(_) => "IBV_WC_*",
        }
    }

    fn meaning(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::LocalLength => "local length error",
            Self::LocalProtection => "local protection error",
            Self::RemoteAccess => "remote access error",
            Self::RnrRetryExceeded => "receiver not ready, RNR retries exhausted",
            Self::RetryExceeded => "transport retries exhausted",
            Self::WrFlush => "flushed, QP in error state",
            Self::Other(_) => "see enum ibv_wc_status",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Other(n) => write!(f, "ibv_wc_status {n}"),
            _ => write!(f, "{} ({})", self.verbs_name(), self.meaning()),
        }
    }
}

/// Completion opcode (`enum ibv_wc_opcode`, the two the ring uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum WcOpcode {
    /// `IBV_WC_RDMA_WRITE`: send-side completion of a write(-with-imm).
    #[default]
    RdmaWrite,
    /// `IBV_WC_RECV_RDMA_WITH_IMM`: a peer's write-with-imm consumed one of
    /// our receive WRs.
    RecvRdmaWithImm,
}

/// One work completion (`struct ibv_wc`).
///
/// As in verbs, only `wr_id`, `status` and `qp_num` are meaningful on an
/// error completion; callers classify completions by their own `wr_id`
/// encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Completion {
    /// The `wr_id` given when the WR was posted.
    pub wr_id: u64,
    /// The queue pair the WR was posted on (`ibv_wc.qp_num`): one
    /// completion queue serves every queue pair of a driver.
    pub qp_num: u32,
    /// Outcome.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// The immediate (receive side of a write-with-imm), host order.
    pub imm: Option<u32>,
    /// Bytes written by the peer (receive side); the write's length on the
    /// send side.
    pub byte_len: u32,
}

/// Queue-pair state, reduced to what the ring observes (the RTR step of
/// the Reset → Init → RTR → RTS walk happens inside connecting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Created, not yet connected (`IBV_QPS_INIT`): receive WRs may be
    /// posted, so a connection posts its receives before the peer learns
    /// its rkey; nothing can be sent yet.
    Init,
    /// Ready to send: connected and usable.
    ReadyToSend,
    /// Error: every outstanding and future WR completes with
    /// [`WcStatus::WrFlush`].
    Error,
}

/// Queue capacities fixed when the QP was created (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send WRs that may be outstanding (posted, completion not yet polled).
    pub max_send_wr: u32,
    /// Receive WRs that may be outstanding.
    pub max_recv_wr: u32,
    /// Largest message (`max_msg_sz` of the port).
    pub max_msg_size: usize,
}

/// An errno returned by a verb (verbs report failures as positive errno
/// values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl Errno {
    /// `ENOMEM`: a queue is full (or memory is exhausted).
    pub const ENOMEM: Self = Self(12);
    /// `EINVAL`: an invalid argument (unknown key, zero-length region).
    pub const EINVAL: Self = Self(22);
    /// `ENOSYS`: no RDMA support on this host.
    pub const ENOSYS: Self = Self(38);
    /// `EOVERFLOW`: the completion queue overran.
    pub const EOVERFLOW: Self = Self(75);
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            Self::ENOMEM => "ENOMEM",
            Self::EINVAL => "EINVAL",
            Self::ENOSYS => "ENOSYS",
            Self::EOVERFLOW => "EOVERFLOW",
            _ => return write!(f, "errno {}", self.0),
        };
        write!(f, "{name}")
    }
}

/// A verb that failed synchronously: one variant per verb.
///
/// Failures of the *operation* (remote access, receiver not ready, ...)
/// are not errors of the verb: they arrive as error [`Completion`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// `ibv_get_device_list` failed or found no device (e.g. `ENOSYS` on a
    /// host without RDMA support).
    #[error("ibv_get_device_list failed: {errno}")]
    GetDeviceList {
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_reg_mr` failed.
    #[error("ibv_reg_mr of {len} bytes failed: {errno}{}", reg_mr_hint(*errno))]
    RegMr {
        /// Requested length.
        len: usize,
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_dereg_mr` failed (`EINVAL`: no region with this lkey).
    #[error("ibv_dereg_mr (lkey {lkey:#x}) failed: {errno}")]
    DeregMr {
        /// The region's local key.
        lkey: u32,
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_destroy_qp` failed (`EINVAL`: no queue pair with this number).
    #[error("ibv_destroy_qp (qp {qpn:#x}) failed: {errno}")]
    DestroyQp {
        /// The queue pair number.
        qpn: u32,
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_create_qp` or connecting the new queue pair failed (`EINVAL`:
    /// the two ends are not on one fabric).
    #[error("ibv_create_qp failed: {errno}")]
    CreateQp {
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_post_send` rejected a work request (for example the send queue
    /// is full: `ENOMEM`).
    #[error("ibv_post_send (wr_id {wr_id:#x}) failed: {errno}")]
    PostSend {
        /// The rejected WR.
        wr_id: u64,
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_post_recv` rejected a work request.
    #[error("ibv_post_recv (wr_id {wr_id:#x}) failed: {errno}")]
    PostRecv {
        /// The rejected WR.
        wr_id: u64,
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_poll_cq` failed (a negative return; `EOVERFLOW` models a CQ
    /// overrun).
    #[error("ibv_poll_cq failed: {errno}")]
    PollCq {
        /// Reported error.
        errno: Errno,
    },
    /// `ibv_req_notify_cq` failed: the completion queue cannot wake a
    /// parked reactor.
    #[error("ibv_req_notify_cq failed: {errno}")]
    ReqNotifyCq {
        /// Reported error.
        errno: Errno,
    },
}

/// [`Verbs::ring_doorbell`] could not hand some queue pairs' chains of
/// work requests to the NIC: one error per refused queue pair (never
/// none), each naming the first WR of its chain not handed over
/// ([`VerbsError::PostSend`]). That WR and those after it on its queue
/// pair are dropped and never complete; the other queue pairs' WRs were
/// handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoorbellError(Vec<VerbsError>);

impl fmt::Display for DoorbellError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut errors = self.0.iter();
        if let Some(first) = errors.next() {
            write!(f, "{first}")?;
        }
        for e in errors {
            write!(f, "; {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for DoorbellError {}

impl DoorbellError {
    /// The doorbell failed with `first`.
    pub fn new(first: VerbsError) -> Self {
        Self(vec![first])
    }

    /// Another queue pair's chain was refused.
    pub fn push(&mut self, e: VerbsError) {
        self.0.push(e);
    }

    /// The errors, one per refused queue pair, in the order met.
    pub fn errors(&self) -> &[VerbsError] {
        &self.0
    }
}

impl From<VerbsError> for DoorbellError {
    fn from(e: VerbsError) -> Self {
        Self::new(e)
    }
}

/// What to tell a user whose registration failed with `errno`: `ENOMEM`
/// is almost always the locked-memory limit, since registered memory is
/// pinned.
fn reg_mr_hint(errno: Errno) -> &'static str {
    if errno == Errno::ENOMEM {
        "; registered memory is pinned and counted against RLIMIT_MEMLOCK \
         (unless the process has CAP_IPC_LOCK): raise it with `ulimit -l unlimited` \
         in the shell, LimitMEMLOCK=infinity in a systemd unit, \
         `--ulimit memlock=-1` for docker or a memlock line in \
         /etc/security/limits.conf, or use smaller rings"
    } else {
        ""
    }
}

/// The verbs of one driver, as the hardware arranges them per core: a
/// protection domain that owns every memory region, one completion queue
/// that every queue pair reports into, and the connected RC queue pairs,
/// named by their number (`qp_num`). Creating and connecting a queue pair
/// (the QPN/GID exchange and the Reset → Init → RTR → RTS walk) belongs to
/// the implementation; the ring protocol starts on a connected one.
///
/// Posting is staged: [`post_write_with_imm`](Self::post_write_with_imm)
/// only queues a WR on its queue pair; [`ring_doorbell`](Self::ring_doorbell)
/// hands every WR queued on any queue pair to the NIC at once. Receive WRs
/// are visible as soon as they are posted.
///
/// Every send WR is signaled: each produces exactly one completion, in
/// posting order per queue pair (RC). A WR occupies its queue slot until its
/// completion has been returned by [`poll_cq`](Self::poll_cq).
///
/// # Safety
///
/// The ring lends registered bytes as Rust slices
/// ([`RegisteredMem::slice`], [`RegisteredMem::slice_mut`]): staging to
/// encode a frame in place, the receive ring to hand a frame to its sink.
/// That is sound only if the implementation, with the device behind it,
/// guarantees:
///
/// 1. **A view is its region.** [`mr_mem`](Self::mr_mem)`(lkey)` returns
///    `Some` only for a region registered by this value's
///    [`reg_mr`](Self::reg_mr) and not yet deregistered, and the view is
///    exactly that region's bytes: `len` bytes as `reg_mr` reported them,
///    overlapping no other region's. They stay valid, at the same
///    address, while `self` is borrowed: only [`dereg_mr`](Self::dereg_mr)
///    and dropping `self` free them.
/// 2. **A peer writes only regions registered for it.** No peer's RDMA
///    write lands in a region registered with [`Access::Local`], whatever
///    rkey and address it names. A write lands only in the
///    [`Access::RemoteWrite`] region whose rkey it names, inside that
///    region's [`MemoryRegion::addr`]` .. addr + len`.
/// 3. **Nothing else writes registered bytes.** After `reg_mr` returns,
///    a region's bytes change only through the caller's
///    [`RegisteredMem`] accesses and the peer writes of (2): receive WRs
///    have no scatter entries, a send WR only reads its local slice, and
///    the implementation writes no region itself except to land a peer's
///    write.
/// 4. **A send stops reading at its completion.** The device reads the
///    `local` slice of a WR staged by
///    [`post_write_with_imm`](Self::post_write_with_imm) only until
///    [`poll_cq`](Self::poll_cq) has returned that WR's completion, or
///    [`destroy_qp`](Self::destroy_qp) of its queue pair has returned.
/// 5. **Data before its completion.** When `poll_cq` returns the receive
///    completion of a write-with-immediate, all of that write's bytes are
///    in the region and visible to the CPU: that write changes them no
///    more.
///
/// A peer that writes its own receive ring's credited bytes out of turn is
/// outside this contract: the ring trusts the peer it gave an rkey to
/// (see `RingConn::deliver`).
///
/// An implementation must say `unsafe impl` to promise this:
///
/// ```compile_fail,E0200
/// # use starwire_rdma::{
/// #     Access, Completion, DoorbellError, Errno, LocalSlice, MemoryRegion, QpCaps, QpState,
/// #     RegisteredMem, RemoteSlice, Verbs, VerbsError,
/// # };
/// struct Nic;
/// impl Verbs for Nic {
/// #     fn cq_depth(&self) -> u32 { 0 }
/// #     fn qp_caps(&self, _: u32) -> Option<QpCaps> { None }
/// #     fn qp_state(&self, _: u32) -> Option<QpState> { None }
/// #     fn reg_mr(&mut self, len: usize, _: Access) -> Result<MemoryRegion, VerbsError> {
/// #         Err(VerbsError::RegMr { len, errno: Errno(12) })
/// #     }
/// #     fn dereg_mr(&mut self, _: u32) -> Result<(), VerbsError> { Ok(()) }
/// #     fn mr_mem(&self, _: u32) -> Option<RegisteredMem<'_>> { None }
/// #     fn post_write_with_imm(
/// #         &mut self, _: u32, _: u64, _: LocalSlice, _: RemoteSlice, _: u32,
/// #     ) -> Result<(), VerbsError> { Ok(()) }
/// #     fn post_recv(&mut self, _: u32, _: u64) -> Result<(), VerbsError> { Ok(()) }
/// #     fn ring_doorbell(&mut self) -> Result<(), DoorbellError> { Ok(()) }
/// #     fn poll_cq(&mut self, _: &mut [Completion]) -> Result<usize, VerbsError> { Ok(0) }
/// #     fn destroy_qp(&mut self, _: u32) -> Result<(), VerbsError> { Ok(()) }
///     // ...
/// }
/// ```
#[allow(unsafe_code)]
pub unsafe trait Verbs {
    /// Entries of the completion queue. It must hold every WR that may be
    /// outstanding on all queue pairs at once, or it overruns.
    fn cq_depth(&self) -> u32;

    /// Capacities of queue pair `qpn`; `None` if there is no such QP.
    fn qp_caps(&self, qpn: u32) -> Option<QpCaps>;

    /// Current state of queue pair `qpn`; `None` if there is no such QP.
    fn qp_state(&self, qpn: u32) -> Option<QpState>;

    /// Register `len` zeroed bytes in the protection domain for local
    /// write access, and remote write access with
    /// [`Access::RemoteWrite`] (`ibv_reg_mr` over a buffer the
    /// implementation owns).
    fn reg_mr(&mut self, len: usize, access: Access) -> Result<MemoryRegion, VerbsError>;

    /// Deregister the region `lkey` and free its bytes (`ibv_dereg_mr`).
    /// Work requests still posted against it complete with an error.
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError>;

    /// The memory of a region registered here, or `None` for an unknown
    /// lkey. The NIC may access it at any time, so it is a
    /// [`RegisteredMem`] view, not a slice: copies in and out are safe,
    /// lending a range as a slice is `unsafe`.
    fn mr_mem(&self, lkey: u32) -> Option<RegisteredMem<'_>>;

    /// Stage one `IBV_WR_RDMA_WRITE_WITH_IMM` on queue pair `qpn`: write
    /// `local` into the peer's region at `remote`, then consume one of the
    /// peer's receive WRs to deliver `imm` (with the write's length).
    /// Visible to the NIC only after [`ring_doorbell`](Self::ring_doorbell).
    fn post_write_with_imm(
        &mut self,
        qpn: u32,
        wr_id: u64,
        local: LocalSlice,
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<(), VerbsError>;

    /// Post one receive WR (no scatter entries) on queue pair `qpn` for an
    /// incoming write-with-imm.
    fn post_recv(&mut self, qpn: u32, wr_id: u64) -> Result<(), VerbsError>;

    /// Hand every send WR staged on any queue pair to the NIC: one
    /// submission per pass. The WRs of a queue pair whose chain is refused
    /// from some WR on are dropped (they never complete); the error names,
    /// for every such queue pair, the first WR not handed over
    /// ([`VerbsError::PostSend`]), so the driver fails each of those
    /// connections. The WRs of other queue pairs are handed over
    /// regardless.
    fn ring_doorbell(&mut self) -> Result<(), DoorbellError>;

    /// Move up to `out.len()` completions (send and receive, of every queue
    /// pair) into `out`; returns how many.
    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError>;

    /// Destroy queue pair `qpn` (`ibv_destroy_qp`): its WRs are dropped and
    /// its completions still in the CQ are removed, so none arrives after
    /// this returns. The peer's later writes fail with
    /// [`WcStatus::RetryExceeded`].
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError>;

    /// Whether the verbs can wake a parked reactor
    /// ([`event_fds`](Self::event_fds)). False (the default, the
    /// simulator): the driver's reactor polls.
    fn can_sleep(&self) -> bool {
        false
    }

    /// Descriptors whose readability ends a park: the completion channel
    /// (readable once the armed completion queue got a completion) and the
    /// asynchronous-event descriptor.
    fn event_fds<'a>(&'a self, _out: &mut Vec<BorrowedFd<'a>>) {}

    /// Ask for one completion event on the next completion
    /// (`ibv_req_notify_cq`), before the last check for completions ahead
    /// of a park, so none can slip in between unseen.
    fn arm_cq(&mut self) -> Result<(), VerbsError> {
        Ok(())
    }

    /// After a park: consume the completion events that ended it
    /// (`ibv_get_cq_event`, `ibv_ack_cq_events`) and read and log the
    /// asynchronous events.
    fn take_events(&mut self) {}
}

//! The unsafe fence: every place the kernel is handed a pointer.
//!
//! Pushing an SQE that references memory is `unsafe` in the io-uring crate
//! because the kernel reads or writes that memory until the completion
//! arrives, outside Rust's view. Building an entry here is safe; every
//! function that hands the kernel memory (a push of an entry that names
//! it, a registration, a provided buffer) or trusts a pointer it is given
//! is an `unsafe fn` whose `# Safety` section says what its caller keeps.
//! The callers in the `ring` module keep it through these invariants:
//!
//! * **Send buffers.** A send SQE points at an [`SendMsg`] that is boxed
//!   and stored in the connection's `inflight` slot, together with the pool
//!   slots and `Bytes` its iovecs point into. `inflight` is cleared only
//!   when the send's completion (and, for zero-copy, its notification) has
//!   been reaped; the ring waits (bounded) for outstanding completions
//!   before it unmaps anything, and leaks what the kernel may still hold
//!   (`Ring`'s `Drop`).
//! * **Provided buffers.** The receive pool and the buffer ring outlive the
//!   `IoUring` (field order of `Ring`), are leaked rather than freed when
//!   the ring goes with requests the kernel did not complete (`Ring`'s
//!   `Drop`: the ring's file may outlive the value), and a buffer is given
//!   back to the kernel only after its bytes were consumed.
//! * **Lent transmit slots.** A slot taken from the pool for a connection's
//!   stage (`TxStage::set_fill`) is written by that stage alone, and only
//!   past the bytes it handed over, until the stage lets go of it; the
//!   stage belongs to a connection of the ring, which drops its
//!   connections before the pool (field order).
//! * **Direct receives.** A receive straight into a frame buffer writes
//!   into the spare capacity of the connection's reassembly `Vec`
//!   (`partial`). While it is in flight (`direct_inflight`) the `Vec` is
//!   neither grown, shrunk nor dropped: the receive path touches it only
//!   when received chunks wait, and none arrive while no other receive is
//!   armed; a connection's state is freed only once no receive is armed.
//! * **Own receive buffers.** A receive into a connection's own buffer
//!   (`own`, an `OwnBuf`: a raw allocation that is never resized, so no
//!   reference to its whole covers bytes the kernel writes) writes past
//!   the chunks received before it; the receive path makes references
//!   only to those chunks while it is in flight (`recv_armed`, not a
//!   direct receive), and the buffer is dropped only once no receive is
//!   armed (or leaked, when the ring goes with one outstanding).
//! * **Eventfd drains.** A read of the park eventfd writes into the ring's
//!   boxed `eventfd_buf`, which is neither read nor replaced while the read
//!   is in flight (`eventfd_read_inflight`) and is leaked if the ring goes
//!   with it outstanding; the eventfd is closed only after the ring.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{opcode, squeue, types, IoUring};
use memmap2::MmapMut;

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel
/// had to copy.
pub(crate) const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in the notification's result.
pub(crate) const NOTIF_USAGE_ZC_COPIED: i32 = i32::MIN;

/// `IOU_PBUF_RING_INC`: incremental consumption of provided buffers.
const IOU_PBUF_RING_INC: u16 = 2;

/// A `msghdr` and its iovecs, boxed so their addresses are stable while the
/// kernel reads them.
pub(crate) struct SendMsg {
    pub(crate) hdr: libc::msghdr,
    pub(crate) iov: Vec<libc::iovec>,
}

// SAFETY: the raw pointers inside point at the boxed `iov` and at pool
// slots / `Bytes` owned by the same in-flight record; moving the record to
// another thread (with the whole ring, inside its driver) keeps them valid.
unsafe impl Send for SendMsg {}

impl SendMsg {
    /// Room for `iovecs` pieces before the vector grows.
    pub(crate) fn with_capacity(iovecs: usize) -> Box<Self> {
        // SAFETY: msghdr is a plain C struct for which all-zero is valid
        // (null name, no control data).
        let hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        Box::new(Self {
            hdr,
            iov: Vec::with_capacity(iovecs),
        })
    }

    /// Point the header at `iov`; call after the last change to `iov`.
    pub(crate) fn seal(&mut self) {
        self.hdr.msg_iov = self.iov.as_mut_ptr();
        self.hdr.msg_iovlen = self.iov.len() as _;
    }
}

/// An iovec over `len` bytes at `ptr`.
///
/// Safe: it only records the address; the kernel dereferences it once the
/// iovec is pushed ([`push_send`]) or registered ([`register_buffer`]),
/// and those functions' callers answer for the memory.
pub(crate) fn iovec(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: len,
    }
}

/// A connection's socket as SQEs name it: a plain descriptor, or its slot
/// in the ring's registered file table (no descriptor lookup and no
/// reference count per request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sock {
    Fd(RawFd),
    Fixed(u32),
}

/// Build an SQE with `$t` bound to the socket as the crate wants it (its
/// target types are sealed, so the two cases are spelled out).
macro_rules! on_sock {
    ($sock:expr, |$t:ident| $e:expr) => {
        match $sock {
            Sock::Fd(fd) => {
                let $t = types::Fd(fd);
                $e
            }
            Sock::Fixed(i) => {
                let $t = types::Fixed(i);
                $e
            }
        }
    };
}

/// The io-uring crate's ring, with the count of its requests in flight.
///
/// Every SQE is queued by [`push`], which counts it as it is queued: the
/// crate makes each pushed SQE visible to the kernel when `push` returns,
/// and under SQPOLL the kernel thread takes it from then on, without an
/// enter of ours, so counting what an enter submitted missed the SQEs the
/// thread had already taken. A request leaves the count with its last
/// completion ([`completed`](Self::completed)), so the count is exact
/// whatever the kernel thread does. SQEs queued and not yet submitted are
/// counted too: for a ring without SQPOLL, those still in the SQ
/// (`SubmissionQueue::len`) are the ones the kernel does not hold.
///
/// It dereferences to the `IoUring` for entering, registering and reaping;
/// nothing outside [`push`] pushes to its submission queue.
pub(crate) struct Uring {
    ring: IoUring,
    in_flight: u64,
}

impl Uring {
    pub(crate) fn new(ring: IoUring) -> Self {
        Self { ring, in_flight: 0 }
    }

    /// Requests queued whose last completion has not been reaped.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// A request's last completion (one without `IORING_CQE_F_MORE`) was
    /// reaped.
    pub(crate) fn completed(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }
}

impl std::ops::Deref for Uring {
    type Target = IoUring;
    fn deref(&self) -> &IoUring {
        &self.ring
    }
}

impl std::ops::DerefMut for Uring {
    fn deref_mut(&mut self) -> &mut IoUring {
        &mut self.ring
    }
}

/// Queue an SQE and count it in flight. Returns false when the submission
/// queue is full.
///
/// # Safety
/// Every buffer `e` names stays valid for the access the kernel makes
/// (reads for a send, writes for a receive) until the entry's last
/// completion is reaped, and nothing else writes memory the kernel reads
/// or touches memory the kernel writes meanwhile; where the ring may go
/// first, the memory is leaked rather than freed (`Ring`'s `Drop`).
unsafe fn push(ring: &mut Uring, e: &squeue::Entry) -> bool {
    // SAFETY: the caller keeps what `e` names alive and unshared until its
    // completion (this function's contract, which is the io-uring crate's).
    let queued = unsafe { ring.ring.submission().push(e).is_ok() };
    // Counted now: the submission queue dropped above published the SQE,
    // and a kernel thread (SQPOLL) may already have taken it.
    ring.in_flight += u64::from(queued);
    queued
}

/// Arm a multishot receive with buffer selection from group `bgid`.
///
/// Safe: the receive writes only into provided buffers, which were lent to
/// the kernel by [`BufRing::add`] under that function's contract.
pub(crate) fn push_recv_multishot(ring: &mut Uring, sock: Sock, bgid: u16, user_data: u64) -> bool {
    let e = on_sock!(sock, |t| opcode::RecvMulti::new(t, bgid).build());
    // SAFETY: the entry names no memory of the caller's: the kernel picks
    // a buffer of group `bgid`, each of which `BufRing::add`'s caller
    // keeps for the kernel until a completion hands it back.
    unsafe { push(ring, &e.user_data(user_data)) }
}

/// When a receive into caller memory completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvWait {
    /// At once (`MSG_DONTWAIT`), with what the socket holds or `-EAGAIN`.
    Now,
    /// Once some data came (no flag: the kernel arms a poll when the
    /// socket is empty).
    Some,
    /// Once all `len` bytes came (`MSG_WAITALL`), at the end of the stream,
    /// or on an error.
    All,
}

/// Queue a single-shot receive of at most `len` bytes into `ptr` (a direct
/// receive into a frame buffer, or one into a connection's own buffer),
/// completing as `wait` says.
///
/// # Safety
/// `ptr..ptr + len` is valid for writes and stays allocated, unmoved and
/// neither read nor written by anyone else until the receive's completion
/// is reaped; if the ring may go with the receive outstanding, the memory
/// is leaked (module documentation, "Direct receives" and "Own receive
/// buffers").
pub(crate) unsafe fn push_recv_into(
    ring: &mut Uring,
    sock: Sock,
    ptr: *mut u8,
    len: u32,
    wait: RecvWait,
    user_data: u64,
) -> bool {
    let flags = match wait {
        RecvWait::Now => libc::MSG_DONTWAIT,
        RecvWait::Some => 0,
        RecvWait::All => libc::MSG_WAITALL,
    };
    let e = on_sock!(sock, |t| opcode::Recv::new(t, ptr, len)
        .flags(flags)
        .build());
    // SAFETY: the entry names `ptr..ptr + len` only, which the caller keeps
    // for the kernel until the completion (this function's contract).
    unsafe { push(ring, &e.user_data(user_data)) }
}

/// Take `n` more bytes of `v`'s spare capacity as written, after a direct
/// receive into it reported `n`. Returns false (and leaves `v` alone) when
/// `n` exceeds the spare capacity, which a kernel that keeps to the
/// requested length never reports.
///
/// # Safety
/// The first `n` bytes of `v`'s spare capacity (from `v.len()` on) were
/// written: a receive given exactly that memory, with `v` neither grown,
/// shrunk nor moved since, completed with `n`.
pub(crate) unsafe fn commit_received(v: &mut Vec<u8>, n: usize) -> bool {
    if n > v.capacity() - v.len() {
        return false;
    }
    // SAFETY: `n` fits the spare capacity (checked above) and the caller
    // says the kernel wrote those `n` bytes, so they are initialised.
    unsafe { v.set_len(v.len() + n) };
    true
}

/// Queue a read of 8 bytes from `fd` (an eventfd's count) into `buf`.
///
/// # Safety
/// `buf` is valid for an 8-byte write and stays allocated and unread
/// until the read's completion is reaped, or is leaked if the ring may go
/// with the read outstanding (module documentation, "Eventfd drains").
pub(crate) unsafe fn push_read_u64(
    ring: &mut Uring,
    fd: RawFd,
    buf: *mut u64,
    user_data: u64,
) -> bool {
    // RWF_NOWAIT: nothing to read completes with -EAGAIN. Without it the
    // kernel (6.18 here) arms a poll for a pollable file, O_NONBLOCK or
    // not, and the read would wait for the eventfd's next signal.
    let e = opcode::Read::new(types::Fd(fd), buf.cast::<u8>(), 8)
        .rw_flags(libc::RWF_NOWAIT)
        .build()
        .user_data(user_data);
    // SAFETY: the entry names the 8 bytes at `buf` only, which the caller
    // keeps for the kernel until the completion (this function's contract).
    unsafe { push(ring, &e) }
}

/// Queue a one-shot poll for readability (or hang-up) of `fd`.
pub(crate) fn push_poll_in(ring: &mut Uring, sock: Sock, user_data: u64) -> bool {
    let mask = (libc::POLLIN | libc::POLLRDHUP) as u32;
    let e = on_sock!(sock, |t| opcode::PollAdd::new(t, mask).build());
    // SAFETY: a poll names no memory.
    unsafe { push(ring, &e.user_data(user_data)) }
}

/// How a send goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendKind {
    /// `IORING_OP_SEND` (one buffer) or `IORING_OP_SENDMSG`.
    Plain,
    /// `IORING_OP_SENDMSG_ZC` with usage reporting.
    ZeroCopyMsg,
    /// `IORING_OP_SEND_ZC` of the single iovec, from registered buffer
    /// `buf_index`, with usage reporting.
    ZeroCopyFixed(u16),
}

/// Queue a send of `msg`.
///
/// # Safety
/// `msg` was [sealed](SendMsg::seal) after its last change, and it (its
/// header and iovecs) and every byte its iovecs name stay valid for reads,
/// unmoved and unwritten until the send's result completion is reaped; for
/// a zero-copy send, the bytes its iovecs name stay so until its
/// notification too. With [`SendKind::ZeroCopyFixed`], `msg` has one
/// iovec, inside registered buffer `idx`. If the ring may go with the send
/// outstanding, all of it is leaked (module documentation, "Send
/// buffers").
pub(crate) unsafe fn push_send(
    ring: &mut Uring,
    sock: Sock,
    msg: &SendMsg,
    kind: SendKind,
    user_data: u64,
) -> bool {
    // Plain sends may return short (the socket was full) and the ring
    // resumes them; zero-copy sends wait for all of it (`MSG_WAITALL`), as
    // their notification covers the whole request.
    let flags = (libc::MSG_NOSIGNAL | libc::MSG_WAITALL) as u32;
    let plain = libc::MSG_NOSIGNAL as u32;
    let e = match kind {
        SendKind::Plain if msg.iov.len() == 1 => {
            // One buffer: SEND skips the msghdr import of SENDMSG.
            let v = msg.iov[0];
            on_sock!(sock, |t| opcode::Send::new(
                t,
                v.iov_base as *const u8,
                v.iov_len as u32
            )
            .flags(plain as i32)
            .build())
        }
        SendKind::Plain => on_sock!(sock, |t| opcode::SendMsg::new(t, &msg.hdr)
            .flags(plain)
            .build()),
        SendKind::ZeroCopyMsg => on_sock!(sock, |t| opcode::SendMsgZc::new(t, &msg.hdr)
            .ioprio(SEND_ZC_REPORT_USAGE)
            .flags(flags)
            .build()),
        SendKind::ZeroCopyFixed(idx) => {
            let v = msg.iov[0];
            on_sock!(sock, |t| opcode::SendZc::new(
                t,
                v.iov_base as *const u8,
                v.iov_len as u32
            )
            .buf_index(Some(idx))
            .zc_flags(SEND_ZC_REPORT_USAGE)
            .flags(flags as i32)
            .build())
        }
    };
    // SAFETY: the entry names `msg` and the bytes of its iovecs, which the
    // caller keeps for the kernel until the completion (and notification)
    // this function's contract names.
    unsafe { push(ring, &e.user_data(user_data)) }
}

/// Register a sparse file table of `slots` entries.
pub(crate) fn register_file_table(ring: &IoUring, slots: u32) -> std::io::Result<()> {
    ring.submitter().register_files_sparse(slots)
}

/// Put `fd` (or nothing, with -1) into slot `slot` of the file table.
pub(crate) fn set_file_slot(ring: &IoUring, slot: u32, fd: RawFd) -> std::io::Result<()> {
    ring.submitter()
        .register_files_update(slot, &[fd])
        .map(drop)
}

/// Queue a cancellation of every request with `target` user data.
pub(crate) fn push_cancel(ring: &mut Uring, target: u64, user_data: u64) -> bool {
    let e = opcode::AsyncCancel::new(target)
        .build()
        .user_data(user_data);
    // SAFETY: a cancellation names no memory.
    unsafe { push(ring, &e) }
}

/// Queue a cancellation of every request on the ring.
pub(crate) fn push_cancel_all(ring: &mut Uring, user_data: u64) -> bool {
    let e = opcode::AsyncCancel2::new(types::CancelBuilder::any())
        .build()
        .user_data(user_data);
    // SAFETY: a cancellation names no memory.
    unsafe { push(ring, &e) }
}

/// `IORING_REGISTER_RING_FDS` / `IORING_UNREGISTER_RING_FDS`.
const REGISTER_RING_FDS: libc::c_uint = 20;
const UNREGISTER_RING_FDS: libc::c_uint = 21;
/// `IORING_ENTER_REGISTERED_RING`.
const ENTER_REGISTERED_RING: libc::c_uint = 1 << 4;
/// `IORING_ENTER_GETEVENTS`.
pub(crate) const ENTER_GETEVENTS: u32 = 1;

/// `struct io_uring_rsrc_update`.
#[repr(C)]
struct RsrcUpdate {
    offset: u32,
    resv: u32,
    data: u64,
}

/// Register the ring's own descriptor in the calling thread's io_uring
/// context; returns its index there. Enters with that index skip the
/// descriptor lookup (and its reference count) of every call. The
/// registration belongs to the calling thread only.
///
/// The io-uring crate keeps the index in a `Submitter`, which
/// `IoUring::submitter()` makes anew on every call, so the index is kept
/// here instead.
pub(crate) fn register_ring_fd(ring: &IoUring) -> std::io::Result<u32> {
    ring_fds(ring, REGISTER_RING_FDS, u32::MAX, ring.as_raw_fd() as u64)
}

/// Undo [`register_ring_fd`]; call on the thread that registered.
pub(crate) fn unregister_ring_fd(ring: &IoUring, index: u32) -> std::io::Result<()> {
    ring_fds(ring, UNREGISTER_RING_FDS, index, 0).map(drop)
}

/// One `io_uring_rsrc_update` through `IORING_(UN)REGISTER_RING_FDS`;
/// returns the offset the kernel wrote back.
fn ring_fds(ring: &IoUring, op: libc::c_uint, offset: u32, data: u64) -> std::io::Result<u32> {
    let mut up = RsrcUpdate {
        offset,
        resv: 0,
        data,
    };
    // SAFETY: `up` is a valid io_uring_rsrc_update for the duration of the
    // call; the kernel reads it and, on registration, writes the chosen
    // index into `offset`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring.as_raw_fd(),
            op,
            std::ptr::addr_of_mut!(up),
            1u32,
        )
    };
    if r != 1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(up.offset)
}

/// How an enter names the ring: its index among the calling thread's
/// registered rings, or its plain descriptor.
#[derive(Debug, Clone, Copy)]
pub(crate) enum EnterFd {
    Registered(u32),
    Plain(RawFd),
}

impl EnterFd {
    /// `ring` through its index `registered` in the calling thread, if
    /// any, else its plain descriptor.
    pub(crate) fn new(ring: &IoUring, registered: Option<u32>) -> Self {
        match registered {
            Some(i) => Self::Registered(i),
            None => Self::Plain(ring.as_raw_fd()),
        }
    }

    fn fd_and_flags(self) -> (libc::c_int, libc::c_uint) {
        match self {
            Self::Registered(i) => (i as libc::c_int, ENTER_REGISTERED_RING),
            Self::Plain(fd) => (fd, 0),
        }
    }
}

/// `io_uring_enter` submitting `to_submit` SQEs, with `flags`
/// (`ENTER_GETEVENTS` or 0; `min_complete = 0`: never waits), through the
/// ring's [`EnterFd`], which the caller took from a ring it holds: the
/// ring stays alive, and only its issuer thread, the caller, enters it.
pub(crate) fn enter_raw(fd: EnterFd, to_submit: u32, flags: u32) -> std::io::Result<usize> {
    let (fd, extra) = fd.fd_and_flags();
    // SAFETY: a plain io_uring_enter on our own ring (or its registered
    // index, valid in this thread): no argument pointer, and the SQEs it
    // submits were pushed under this module's invariants.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_enter,
            fd,
            to_submit,
            0u32,
            flags | extra,
            std::ptr::null::<libc::c_void>(),
            0usize,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// [`enter_raw`] through the ring descriptor registered at `registered`
/// in the calling thread, or the plain descriptor.
pub(crate) fn enter(
    ring: &IoUring,
    registered: Option<u32>,
    to_submit: u32,
    flags: u32,
) -> std::io::Result<usize> {
    enter_raw(EnterFd::new(ring, registered), to_submit, flags)
}

/// `IORING_ENTER_EXT_ARG` (5.11): the argument is an
/// `io_uring_getevents_arg`.
const ENTER_EXT_ARG: libc::c_uint = 1 << 3;

/// `struct io_uring_getevents_arg`.
#[repr(C)]
struct GeteventsArg {
    sigmask: u64,
    sigmask_sz: u32,
    min_wait_usec: u32,
    ts: u64,
}

/// `struct __kernel_timespec`.
#[repr(C)]
struct KernelTimespec {
    tv_sec: i64,
    tv_nsec: i64,
}

/// `io_uring_enter` submitting `to_submit` SQEs, then waiting until at
/// least one completion is posted (running the ring's deferred work as it
/// comes) or `timeout` passes: a reactor's park. Returns the SQEs
/// submitted; a wait that timed out with nothing submitted is `ETIME`.
/// Called like [`enter_raw`].
///
/// The io-uring crate's `submit_with_args` takes the same argument but
/// not a registered ring index, which every other enter here uses.
pub(crate) fn enter_wait(
    fd: EnterFd,
    to_submit: u32,
    timeout: std::time::Duration,
) -> std::io::Result<usize> {
    let (fd, extra) = fd.fd_and_flags();
    let ts = KernelTimespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let arg = GeteventsArg {
        sigmask: 0,
        sigmask_sz: 0,
        min_wait_usec: 0,
        ts: std::ptr::addr_of!(ts) as u64,
    };
    // SAFETY: io_uring_enter on our own ring (or its registered index,
    // valid in this thread) with an extended argument that points at `arg`
    // and, through it, at `ts`: both live on this stack frame for the
    // whole call, and the kernel only reads them. The SQEs it submits were
    // pushed under this module's invariants.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_enter,
            fd,
            to_submit,
            1u32,
            ENTER_GETEVENTS | ENTER_EXT_ARG | extra,
            std::ptr::addr_of!(arg),
            std::mem::size_of::<GeteventsArg>(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as usize)
}

/// Register `len` bytes at `base` as fixed buffer 0.
///
/// # Safety
/// `base..base + len` is one mapping that stays mapped for as long as
/// `ring` exists: the kernel pins its pages and a fixed-buffer send reads
/// them by index, without naming the pointer again.
pub(crate) unsafe fn register_buffer(
    ring: &IoUring,
    base: *const u8,
    len: usize,
) -> std::io::Result<()> {
    // SAFETY: the caller keeps `base..base + len` mapped while the ring
    // exists (this function's contract).
    unsafe { ring.submitter().register_buffers(&[iovec(base, len)]) }
}

/// The provided-buffer ring: `entries` 16-byte `io_uring_buf` records in
/// a page-aligned anonymous mapping shared with the kernel.
pub(crate) struct BufRing {
    map: MmapMut,
    entries: u16,
    tail: u16,
}

impl std::fmt::Debug for BufRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufRing")
            .field("entries", &self.entries)
            .field("tail", &self.tail)
            .finish()
    }
}

const BUF_ENTRY_LEN: usize = 16;
/// Offset of the shared tail: the `resv` field of entry 0.
const TAIL_OFFSET: usize = 14;

impl BufRing {
    /// A ring of `entries` (a power of two, at most 32768) records; any
    /// other count is refused (`InvalidInput`): [`Self::publish`] and
    /// [`Self::add`] rely on it to stay inside the mapping.
    pub(crate) fn new(entries: u16) -> std::io::Result<Self> {
        if !entries.is_power_of_two() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("a buffer ring of {entries} entries (not a power of two)"),
            ));
        }
        let map = MmapMut::map_anon(usize::from(entries) * BUF_ENTRY_LEN)?;
        Ok(Self {
            map,
            entries,
            tail: 0,
        })
    }

    /// Register with `ring` as buffer group `bgid`; `incremental` asks for
    /// `IOU_PBUF_RING_INC` (6.12): receives take only the bytes they need
    /// from the head buffer, so consecutive messages pack into one buffer.
    ///
    /// # Safety
    /// `self` stays alive for as long as the group is registered with
    /// `ring` (until it is unregistered, or `ring` is dropped): the kernel
    /// reads the records and the tail through the mapping.
    pub(crate) unsafe fn register(
        &self,
        ring: &IoUring,
        bgid: u16,
        incremental: bool,
    ) -> std::io::Result<()> {
        // SAFETY: the mapping is page aligned and holds `entries` records;
        // the caller keeps it alive while the group is registered (this
        // function's contract).
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                self.map.as_ptr() as u64,
                self.entries,
                bgid,
                if incremental { IOU_PBUF_RING_INC } else { 0 },
            )
        }
    }

    /// Write one record at the local tail; visible to the kernel after
    /// [`publish`](Self::publish).
    ///
    /// # Safety
    /// `addr..addr + len` is valid for writes and is the kernel's from the
    /// publish on: it stays allocated and nobody reads or writes it until
    /// a completion hands buffer `bid` back (and then only the bytes that
    /// completion reports, until it is added again), and it outlives the
    /// ring this buffer ring is registered with.
    pub(crate) unsafe fn add(&mut self, addr: *const u8, len: u32, bid: u16) {
        let slot = usize::from(self.tail & (self.entries - 1)) * BUF_ENTRY_LEN;
        // Raw writes, no slice of the mapping: the kernel writes the other
        // records (with incremental consumption, the head's address and
        // length) while this one is filled.
        let rec = self.map.as_mut_ptr().wrapping_add(slot);
        // SAFETY: `slot + 14 <= entries * 16`, the mapping's length, and
        // the record at the local tail is ours until `publish`: the kernel
        // consumed it before (or never had it). Unaligned writes, so no
        // alignment is assumed.
        unsafe {
            rec.cast::<u64>().write_unaligned(addr as u64);
            rec.wrapping_add(8).cast::<u32>().write_unaligned(len);
            rec.wrapping_add(12).cast::<u16>().write_unaligned(bid);
        }
        // Bytes 14..16 of record 0 are the shared tail: never written here.
        self.tail = self.tail.wrapping_add(1);
    }

    /// Make the records added so far visible to the kernel.
    pub(crate) fn publish(&mut self) {
        let p = self
            .map
            .as_mut_ptr()
            .wrapping_add(TAIL_OFFSET)
            .cast::<u16>();
        // SAFETY: `p` is inside the mapping and 2-byte aligned (page base +
        // 14); the kernel reads it with acquire ordering, so a release
        // store makes the records written before it visible.
        let tail = unsafe { AtomicU16::from_ptr(p) };
        tail.store(self.tail, Ordering::Release);
    }
}

/// Where a transmit slot starts, kept by the connection that fills it
/// (in its stage).
///
/// Only an address: making one, moving it and offsetting it are safe;
/// writing through it is [`lend_slot`], whose caller answers for the
/// memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotPtr(*const u8);

// SAFETY: a `SlotPtr` is an address and nothing dereferences it except
// through `lend_slot`, whose caller vouches for the memory on whatever
// thread it runs; sending or sharing the address alone touches nothing.
unsafe impl Send for SlotPtr {}
// SAFETY: as above.
unsafe impl Sync for SlotPtr {}

impl SlotPtr {
    pub(crate) fn new(ptr: *const u8) -> Self {
        Self(ptr)
    }

    /// The address `off` bytes into the slot (not dereferenced: any
    /// offset is allowed here, and `lend_slot`'s caller checks the range).
    pub(crate) fn at(self, off: usize) -> *const u8 {
        self.0.wrapping_add(off)
    }
}

/// A mutable view of `len` bytes at `ptr` for the duration of `'a`.
///
/// Used to lend part of a transmit slot to the connection filling it
/// (through its stage, which ties `'a` to a borrow of itself).
///
/// # Safety
/// `ptr..ptr + len` is valid for reads and writes, and for all of `'a` it
/// stays allocated and nothing else reads or writes it: for a transmit
/// slot, the slot is held by the caller's connection, the range lies past
/// every byte of it that was queued or is in flight, and the pool's
/// mapping lives at least as long as `'a`.
pub(crate) unsafe fn lend_slot<'a>(ptr: *const u8, len: usize) -> &'a mut [u8] {
    // SAFETY: the caller vouches for the range and its exclusive use for
    // `'a` (this function's contract).
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A count that is not a power of two (0 included) is refused before
    /// anything is mapped: `publish` would write past an empty mapping and
    /// `add` would index with `entries - 1` wrapped.
    #[test]
    fn a_buffer_ring_needs_a_power_of_two_entries() {
        for bad in [0u16, 3, 100, 32767] {
            let e = BufRing::new(bad).expect_err("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad}");
        }
        for good in [1u16, 8, 32768] {
            assert_eq!(BufRing::new(good).unwrap().entries, good);
        }
    }
}

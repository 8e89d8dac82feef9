//! The unsafe fence: every place the kernel is handed a pointer.
//!
//! Pushing an SQE that references memory is `unsafe` in the io-uring crate
//! because the kernel reads or writes that memory until the completion
//! arrives, outside Rust's view. The invariants this module relies on are
//! kept by `ring.rs`:
//!
//! * **Send buffers.** A send SQE points at an [`SendMsg`] that is boxed
//!   and stored in the connection's `inflight` slot, together with the pool
//!   slots and `Bytes` its iovecs point into. `inflight` is cleared only
//!   when the send's completion (and, for zero-copy, its notification) has
//!   been reaped, and the ring waits for outstanding completions before it
//!   unmaps anything (`RingInner`'s `Drop`).
//! * **Provided buffers.** The receive pool and the buffer ring outlive the
//!   `IoUring` (field order of `RingInner`), and a buffer is given back to
//!   the kernel only after its bytes were consumed.
//! * **Lent transmit slots.** A slot handed out by `tx_slice` belongs to one
//!   connection (taken from the pool, not in flight) until it is queued.
#![allow(unsafe_code)]

use std::os::fd::RawFd;
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
// another thread (with the whole ring, under its mutex) keeps them valid.
unsafe impl Send for SendMsg {}

impl SendMsg {
    pub(crate) fn new() -> Box<Self> {
        // SAFETY: msghdr is a plain C struct for which all-zero is valid
        // (null name, no control data).
        let hdr: libc::msghdr = unsafe { std::mem::zeroed() };
        Box::new(Self {
            hdr,
            iov: Vec::new(),
        })
    }

    /// Point the header at `iov`; call after the last change to `iov`.
    pub(crate) fn seal(&mut self) {
        self.hdr.msg_iov = self.iov.as_mut_ptr();
        self.hdr.msg_iovlen = self.iov.len() as _;
    }
}

/// An iovec over `len` bytes at `ptr`.
pub(crate) fn iovec(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: len,
    }
}

/// Queue an SQE. Returns false when the submission queue is full.
fn push(ring: &mut IoUring, e: &squeue::Entry) -> bool {
    // SAFETY: every entry built in this module references only memory the
    // module invariants keep alive until its completion (see the module
    // documentation).
    unsafe { ring.submission().push(e).is_ok() }
}

/// Arm a (multishot when `multishot`) receive with buffer selection from
/// group `bgid`.
pub(crate) fn push_recv(
    ring: &mut IoUring,
    fd: RawFd,
    bgid: u16,
    multishot: bool,
    user_data: u64,
) -> bool {
    let e = if multishot {
        opcode::RecvMulti::new(types::Fd(fd), bgid).build()
    } else {
        opcode::Recv::new(types::Fd(fd), std::ptr::null_mut(), 0)
            .buf_group(bgid)
            .build()
            .flags(squeue::Flags::BUFFER_SELECT)
    };
    push(ring, &e.user_data(user_data))
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

/// Queue a send of `msg` (kept alive by the caller until completion).
pub(crate) fn push_send(
    ring: &mut IoUring,
    fd: RawFd,
    msg: &SendMsg,
    kind: SendKind,
    user_data: u64,
) -> bool {
    let flags = (libc::MSG_NOSIGNAL | libc::MSG_WAITALL) as u32;
    let e = match kind {
        SendKind::Plain if msg.iov.len() == 1 => {
            // One buffer: SEND skips the msghdr import of SENDMSG.
            let v = msg.iov[0];
            return push(
                ring,
                &opcode::Send::new(types::Fd(fd), v.iov_base as *const u8, v.iov_len as u32)
                    .flags(flags as i32)
                    .build()
                    .user_data(user_data),
            );
        }
        SendKind::Plain => opcode::SendMsg::new(types::Fd(fd), &msg.hdr).flags(flags),
        SendKind::ZeroCopyMsg => {
            return push(
                ring,
                &opcode::SendMsgZc::new(types::Fd(fd), &msg.hdr)
                    .ioprio(SEND_ZC_REPORT_USAGE)
                    .flags(flags)
                    .build()
                    .user_data(user_data),
            )
        }
        SendKind::ZeroCopyFixed(idx) => {
            let v = msg.iov[0];
            return push(
                ring,
                &opcode::SendZc::new(types::Fd(fd), v.iov_base as *const u8, v.iov_len as u32)
                    .buf_index(Some(idx))
                    .zc_flags(SEND_ZC_REPORT_USAGE)
                    .flags(flags as i32)
                    .build()
                    .user_data(user_data),
            );
        }
    };
    push(ring, &e.build().user_data(user_data))
}

/// Queue a cancellation of every request with `target` user data.
pub(crate) fn push_cancel(ring: &mut IoUring, target: u64, user_data: u64) -> bool {
    let e = opcode::AsyncCancel::new(target)
        .build()
        .user_data(user_data);
    push(ring, &e)
}

/// Queue a cancellation of every request on the ring.
pub(crate) fn push_cancel_all(ring: &mut IoUring, user_data: u64) -> bool {
    let e = opcode::AsyncCancel2::new(types::CancelBuilder::any())
        .build()
        .user_data(user_data);
    push(ring, &e)
}

/// Submit every queued SQE and run pending completion work
/// (`IORING_ENTER_GETEVENTS` with `min_complete = 0`: never waits).
pub(crate) fn enter_getevents(ring: &IoUring, to_submit: u32) -> std::io::Result<usize> {
    let n = to_submit;
    // SAFETY: a plain io_uring_enter on our own ring: no argument pointer,
    // and the SQEs it submits were pushed under this module's invariants.
    unsafe {
        ring.submitter()
            .enter::<libc::sigset_t>(n, 0, io_uring::EnterFlags::GETEVENTS.bits(), None)
    }
}

/// Register `len` bytes at `base` as fixed buffer 0.
pub(crate) fn register_buffer(ring: &IoUring, base: *const u8, len: usize) -> std::io::Result<()> {
    // SAFETY: `base..base + len` is the transmit pool's mapping, which
    // outlives the ring (field order of `RingInner`).
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
    /// A ring of `entries` (a power of two, at most 32768) records.
    pub(crate) fn new(entries: u16) -> std::io::Result<Self> {
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
    pub(crate) fn register(
        &self,
        ring: &IoUring,
        bgid: u16,
        incremental: bool,
    ) -> std::io::Result<()> {
        // SAFETY: the mapping is page aligned, holds `entries` records and
        // outlives the ring (field order of `RingInner`).
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
    pub(crate) fn add(&mut self, addr: *const u8, len: u32, bid: u16) {
        let slot = usize::from(self.tail & (self.entries - 1)) * BUF_ENTRY_LEN;
        let rec = &mut self.map[slot..slot + BUF_ENTRY_LEN];
        rec[0..8].copy_from_slice(&(addr as u64).to_ne_bytes());
        rec[8..12].copy_from_slice(&len.to_ne_bytes());
        rec[12..14].copy_from_slice(&bid.to_ne_bytes());
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

/// A mutable view of `len` bytes at `ptr` for the duration of `'a`.
///
/// Used to lend a transmit slot: the slot was taken from the pool by the
/// connection that calls this and is neither queued nor in flight, so no
/// one else reads or writes it while the caller holds `&'a mut` of that
/// connection; the pool mapping lives as long as the ring the connection
/// holds an `Arc` of.
pub(crate) fn lend_slot<'a>(ptr: *const u8, len: usize) -> &'a mut [u8] {
    // SAFETY: see the function documentation.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
}

//! The receive side: spin, single and multishot receives, direct
//! receives into a frame buffer, their completions, and `rx_burst`, which
//! lends the frames in place.
// Lends the kernel receive buffers (`sys::push_recv_into`, provided
// buffers) and takes what it wrote (`sys::commit_received`).
#![allow(unsafe_code)]

use io_uring::cqueue;
use starwire_transport::TransportError;
use starwire_wire::{Deframer, FrameError, Limits, NextFrame, HEADER_LEN};

use super::op::{armed_recv_op, user_data, BGID, OP_CANCEL, OP_RECV, OP_RECV_DIRECT, OP_RECV_OWN};
use super::{slot_id, Conn, OwnBuf, Ring, RxEnd};
use crate::sys::{self, RecvWait};

/// The "buffer id" of chunks in a connection's own receive buffer (never a
/// provided buffer's: those are below 32768).
pub(super) const OWN_BID: u16 = u16::MAX;

/// Receives into a connection's own buffer start on this boundary: a
/// receive that starts on an odd half cache line makes the kernel's
/// `copy_to_user` several times slower per byte (`docs/backends/uring.md`,
/// "Where receives land", has the measurement).
const OWN_ALIGN: usize = 64;

/// A connection's receive waits while its own buffer has less room than
/// this and still holds unconsumed bytes: the application is behind, and
/// the buffer starts over once it caught up.
const OWN_MIN_ROOM: usize = 4096;

/// Spin mode skips a connection's receive while this many received chunks
/// wait to be consumed: the application is behind.
const SPIN_MAX_CHUNKS: usize = 16;

/// Short frames after a long one before the connection gives back the
/// frame buffer the long one left (up to `max_frame_len`): enough that a
/// stream alternating long and short frames keeps it, few enough that a
/// connection which sent one long frame does not hold it for good.
const RELEASE_AFTER_SHORT: u32 = 64;

/// A frame buffer at least this long (or at least `rx_direct_min`, when
/// that is smaller) is a long frame's, given back after a run of short
/// frames. Without the cap, turning direct receives off (`rx_direct_min`
/// above `max_frame_len`) kept every buffer a long frame had been
/// reassembled in, up to 1 MiB per connection, for good.
const LONG_BUFFER_MIN: usize = 128 * 1024;

/// Bookkeeping after `c` delivered a frame of `len` bytes, with `partial`
/// empty: whether the next header is received directly, and whether the
/// frame buffer of a past long frame is given back (returned true).
fn after_frame(c: &mut Conn, len: usize, direct_min: usize) -> bool {
    debug_assert!(c.partial.is_empty() && !c.direct_inflight);
    c.large_run = len >= direct_min;
    let long = direct_min.min(LONG_BUFFER_MIN);
    if len >= long || c.partial.capacity() < long {
        c.short_since_long = 0;
        return false;
    }
    c.short_since_long += 1;
    if c.short_since_long < RELEASE_AFTER_SHORT {
        return false;
    }
    c.short_since_long = 0;
    c.partial = Vec::new();
    true
}

/// What [`queue_own_recv`] did.
enum OwnRecv {
    Queued,
    /// The buffer is short of room and still holds unconsumed bytes: the
    /// receive waits until the application consumed them.
    NoRoom,
    SqFull,
}

/// Queue a receive of at most `max` bytes into `c`'s own buffer (allocated
/// here the first time, `own_len` long): from the start once every chunk
/// before was consumed, else after the last, on an `OWN_ALIGN` boundary.
///
/// # Safety
/// `c` is a connection of the ring that owns `ring`, kept by it as the
/// `sys` module's "Own receive buffers" says: while the receive is armed
/// (`recv_armed`, set here) `c.own` is neither freed, resized nor read
/// past the chunks received before it, and it is leaked if the ring goes
/// with the receive outstanding.
unsafe fn queue_own_recv(
    ring: &mut sys::Uring,
    c: &mut Conn,
    idx: usize,
    own_len: usize,
    max: usize,
    wait: RecvWait,
) -> OwnRecv {
    debug_assert!(!c.recv_armed);
    if c.own.is_empty() {
        c.own = OwnBuf::zeroed(own_len);
    }
    if c.own_refs == 0 {
        c.own_end = 0;
    }
    let at = (c.own_end as usize).next_multiple_of(OWN_ALIGN);
    let room = c.own.len().saturating_sub(at);
    if room < OWN_MIN_ROOM && c.own_refs > 0 {
        return OwnRecv::NoRoom;
    }
    // `own` is at most 1 GiB (validated), so `at` and the length fit.
    let len = room.min(max) as u32;
    let ptr = c.own.recv_ptr(at);
    // SAFETY: `ptr..ptr + len` is inside `own` (`len` is at most the room
    // past `at`), past every unconsumed chunk, and the caller keeps it for
    // the kernel until the completion (this function's contract).
    if !unsafe { sys::push_recv_into(ring, c.sock, ptr, len, wait, user_data(idx, OP_RECV_OWN)) } {
        return OwnRecv::SqFull;
    }
    c.own_end = at as u32;
    c.recv_armed = true;
    OwnRecv::Queued
}

impl Ring {
    /// Single and spin receives go into each connection's own buffer; only
    /// multishot ones (`single_len` `None` outside spin mode) draw from the
    /// provided buffers.
    pub(super) fn own_receives(&self) -> bool {
        self.spin || self.single_len.is_some()
    }

    /// Connection indices from `conn_cursor` on, wrapping around.
    pub(super) fn pass_order(
        &self,
    ) -> std::iter::Chain<std::ops::Range<usize>, std::ops::Range<usize>> {
        let n = self.conns.len();
        let start = self.conn_cursor.min(n);
        (start..n).chain(0..start)
    }

    /// `RecvMode::Spin`: queue a non-blocking receive into its own buffer
    /// for every connection that has none in flight and is keeping up with
    /// what it received. It takes what the socket holds, up to the room
    /// left, and completes inside the same enter (or with `-EAGAIN`).
    pub(super) fn queue_spin_receives(&mut self) -> usize {
        let mut queued = 0;
        let own_len = self.cfg.rx_conn_buf_len;
        for idx in self.pass_order() {
            let Some(c) = self.conns[idx].as_mut() else {
                continue;
            };
            if c.closing
                || c.recv_armed
                || c.rx_end.is_some()
                || c.direct_want.is_some()
                || c.chunks.len() >= SPIN_MAX_CHUNKS
            {
                continue;
            }
            // SAFETY: `c` is this ring's connection, whose `own` the ring
            // keeps while its receive is armed (`sys`, "Own receive
            // buffers").
            match unsafe {
                queue_own_recv(&mut self.ring, c, idx, own_len, usize::MAX, RecvWait::Now)
            } {
                OwnRecv::Queued => queued += 1,
                OwnRecv::NoRoom => {}
                OwnRecv::SqFull => {
                    self.stats.sq_full += 1;
                    // The rest first next time.
                    self.conn_cursor = idx;
                    break;
                }
            }
        }
        queued
    }

    /// Queue a direct receive for each connection waiting for one: the
    /// rest of its frame, straight into the frame buffer. A multishot
    /// receive still armed is cancelled first (the bytes it already took
    /// arrive as chunks, in order, before its last completion), and chunks
    /// still waiting are consumed by `rx_burst` first; either way the
    /// connection stays on the list until its receive is queued.
    ///
    /// Returns how many non-blocking (spin mode) receives it queued: like
    /// spin receives, they are no work by themselves, so a reactor whose
    /// peer went quiet in the middle of a long frame (or after one) may
    /// still park.
    pub(super) fn queue_direct_receives(&mut self) -> usize {
        if self.direct.is_empty() {
            return 0;
        }
        let mut queued = 0;
        let mut keep = Vec::new();
        let own = self.own_receives();
        for idx in std::mem::take(&mut self.direct) {
            let Some(Some(c)) = self.conns.get_mut(idx) else {
                continue;
            };
            let Some(frame_len) = c.direct_want else {
                continue;
            };
            if c.closing || c.rx_end.is_some() || c.direct_inflight {
                continue;
            }
            if !c.chunks.is_empty() {
                keep.push(idx);
                continue;
            }
            if c.recv_armed {
                if !self.spin && !c.cancel_sent {
                    let target = user_data(idx, armed_recv_op(c, own));
                    if sys::push_cancel(&mut self.ring, target, user_data(idx, OP_CANCEL)) {
                        c.cancel_sent = true;
                        self.stats.direct_cancels += 1;
                    }
                }
                keep.push(idx);
                continue;
            }
            let have = c.partial.len();
            let want = frame_len.saturating_sub(have);
            let Ok(len) = u32::try_from(want) else {
                // Frames are bounded by max_frame_len (at most 1 GiB).
                continue;
            };
            if len == 0 {
                continue;
            }
            c.partial.reserve_exact(want);
            let ptr = c.partial.spare_capacity_mut().as_mut_ptr().cast::<u8>();
            let wait = if self.spin {
                RecvWait::Now
            } else {
                RecvWait::All
            };
            // SAFETY: `len` bytes of `partial`'s spare capacity (reserved
            // above), which the ring leaves alone while the receive is in
            // flight (`direct_inflight`, set below) and leaks if it goes
            // with it outstanding (`sys`, "Direct receives").
            if !unsafe {
                sys::push_recv_into(
                    &mut self.ring,
                    c.sock,
                    ptr,
                    len,
                    wait,
                    user_data(idx, OP_RECV_DIRECT),
                )
            } {
                self.stats.sq_full += 1;
                keep.push(idx);
                continue;
            }
            c.recv_armed = true;
            c.direct_inflight = true;
            self.stats.direct_recvs += 1;
            queued += usize::from(self.spin);
        }
        self.direct = keep;
        queued
    }

    /// A direct receive completed: take its bytes into the frame buffer.
    pub(super) fn complete_direct(&mut self, idx: usize, res: i32) {
        let spin = self.spin;
        let deframer = self.deframer();
        let direct_min = self.cfg.rx_direct_min;
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        c.recv_armed = false;
        c.direct_inflight = false;
        match res {
            n if n > 0 => {
                let n = n as usize;
                // SAFETY: the direct receive that completed was given
                // `partial`'s spare capacity from its length on, and the
                // `Vec` was left alone while it was in flight (`sys`,
                // "Direct receives"); the kernel wrote the `n` bytes.
                if !unsafe { sys::commit_received(&mut c.partial, n) } {
                    c.rx_end = Some(RxEnd::Errno(libc::EINVAL));
                    return;
                }
                self.stats.recv_cqes += 1;
                self.stats.direct_bytes += n as u64;
                c.stats.recv_cqes += 1;
                c.stats.bytes_received += n as u64;
                if c.closing {
                    return;
                }
                let have = c.partial.len();
                if have < HEADER_LEN {
                    // Short (non-blocking, or interrupted): ask again.
                    self.direct.push(idx);
                    return;
                }
                match deframer.needed(&c.partial) {
                    Ok(len) if have >= len => {
                        // Complete: `rx_burst` delivers it and decides how
                        // the next frame is received.
                        c.direct_want = None;
                        c.direct_ready = true;
                    }
                    Ok(len) if len >= direct_min => {
                        // The rest of a long frame (or its body, after a
                        // direct receive of its header): again.
                        c.direct_want = Some(len);
                        self.direct.push(idx);
                    }
                    Ok(_) => {
                        // A header that opens a short frame: its body comes
                        // the usual way.
                        c.direct_want = None;
                        if !spin {
                            self.rearm.push(idx);
                        }
                    }
                    Err(_) => {
                        // `rx_burst` reports it.
                        c.direct_want = None;
                        c.direct_ready = true;
                    }
                }
            }
            0 => c.rx_end = Some(RxEnd::Eof),
            e if e == -libc::EAGAIN => {
                self.stats.rx_empty += 1;
                if !c.closing {
                    self.direct.push(idx);
                }
            }
            e if e == -libc::ECONNRESET || e == -libc::EPIPE => {
                c.rx_end = Some(RxEnd::Reset);
            }
            e if e == -libc::ECANCELED => {}
            e => c.rx_end = Some(RxEnd::Errno(-e)),
        }
    }

    /// A multishot receive's completion (the only receives that draw
    /// from the provided buffers).
    pub(super) fn complete_recv(&mut self, idx: usize, res: i32, flags: u32) {
        let more = cqueue::more(flags);
        let bid = cqueue::buffer_select(flags);
        // Account the bytes in the buffer first: with incremental
        // consumption they start where the last receive into it ended.
        let chunk = match bid {
            Some(b) if usize::from(b) < self.rx_fill.len() => {
                let b_ = usize::from(b);
                let start = self.rx_fill[b_];
                let n = res.max(0) as u32;
                self.rx_fill[b_] = start + n;
                self.rx_refs[b_] += 1;
                if !cqueue::buffer_more(flags) {
                    self.rx_kernel_done[b_] = true;
                }
                Some((b, start, start + n))
            }
            _ => None,
        };
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            if let Some((b, ..)) = chunk {
                self.release_rx(b);
            }
            return;
        };
        if !more {
            c.recv_armed = false;
            c.cancel_sent = false;
        }
        match res {
            n if n > 0 => {
                self.stats.recv_cqes += 1;
                c.stats.recv_cqes += 1;
                c.stats.bytes_received += n as u64;
                match chunk {
                    Some(ch) if !c.closing => c.chunks.push_back(ch),
                    Some((b, ..)) => self.release_rx(b),
                    None => c.rx_end = Some(RxEnd::Errno(libc::EINVAL)),
                }
                if !more && !self.conns[idx].as_ref().is_some_and(|c| c.closing) {
                    self.rearm.push(idx);
                }
            }
            0 => {
                c.rx_end = Some(RxEnd::Eof);
                if let Some((b, ..)) = chunk {
                    self.release_rx(b);
                }
            }
            e if e == -libc::ENOBUFS => {
                self.stats.rx_enobufs += 1;
                if !c.closing {
                    self.rearm.push(idx);
                }
            }
            e if e == -libc::ECONNRESET || e == -libc::EPIPE => {
                c.rx_end = Some(RxEnd::Reset);
            }
            e if e == -libc::ECANCELED => {
                // Stopped for a direct receive (re-armed once that is
                // done; `rearm_receives` skips it until then) or closing.
                if !c.closing {
                    self.rearm.push(idx);
                }
            }
            e => c.rx_end = Some(RxEnd::Errno(-e)),
        }
    }

    /// A receive into the connection's own buffer completed.
    pub(super) fn complete_own(&mut self, idx: usize, res: i32) {
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        c.recv_armed = false;
        c.cancel_sent = false;
        match res {
            n if n > 0 => {
                let start = c.own_end as usize;
                let end = start + n as usize;
                if end > c.own.len() {
                    // More than the room it was given: not a kernel that
                    // keeps to the requested length.
                    c.rx_end = Some(RxEnd::Errno(libc::EINVAL));
                    return;
                }
                self.stats.recv_cqes += 1;
                c.stats.recv_cqes += 1;
                c.stats.bytes_received += n as u64;
                if c.closing {
                    return;
                }
                // `end` is within `own`, at most 1 GiB.
                c.chunks.push_back((OWN_BID, start as u32, end as u32));
                c.own_end = end as u32;
                c.own_refs += 1;
                if !self.spin {
                    // A single receive: the next goes at the next enter.
                    self.rearm.push(idx);
                }
            }
            0 => c.rx_end = Some(RxEnd::Eof),
            e if e == -libc::EAGAIN && self.spin => self.stats.rx_empty += 1,
            e if e == -libc::ECONNRESET || e == -libc::EPIPE => {
                c.rx_end = Some(RxEnd::Reset);
            }
            e if e == -libc::EAGAIN || e == -libc::ECANCELED => {
                // Stopped for a direct receive (re-armed once that is
                // done; `rearm_receives` skips it until then), or closing.
                if !c.closing && !self.spin {
                    self.rearm.push(idx);
                }
            }
            e => c.rx_end = Some(RxEnd::Errno(-e)),
        }
    }

    /// One chunk of buffer `bid` was consumed; give the buffer back to the
    /// kernel once the kernel is done with it and no chunk is left.
    fn release_rx(&mut self, bid: u16) {
        if self.release_rx_quiet(bid) {
            self.buf_ring.publish();
        }
    }

    pub(super) fn release_rx_quiet(&mut self, bid: u16) -> bool {
        let b = usize::from(bid);
        self.rx_refs[b] -= 1;
        if self.rx_refs[b] > 0 || !self.rx_kernel_done[b] {
            return false;
        }
        self.rx_fill[b] = 0;
        self.rx_kernel_done[b] = false;
        let id = slot_id(b);
        // SAFETY: buffer `b` of the receive pool, whose chunks were all
        // consumed and which the kernel is done with (no `BUF_MORE`): it
        // goes back to the kernel as at setup (`Ring::new`).
        unsafe {
            self.buf_ring
                .add(self.rx_pool.slot_ptr(id), self.cfg.rx_buf_len as u32, bid)
        };
        true
    }

    pub(super) fn rearm_receives(&mut self) {
        if self.rearm.is_empty() {
            return;
        }
        let mut keep = Vec::new();
        for idx in std::mem::take(&mut self.rearm) {
            let Some(Some(c)) = self.conns.get_mut(idx) else {
                continue;
            };
            if c.closing || c.recv_armed || c.rx_end.is_some() || c.direct_want.is_some() {
                continue;
            }
            let queued = match self.single_len {
                // Single receives go into the connection's own buffer.
                // SAFETY: `c` is this ring's connection, whose `own` the
                // ring keeps while its receive is armed (`sys`, "Own
                // receive buffers").
                Some(max) => match unsafe {
                    queue_own_recv(
                        &mut self.ring,
                        c,
                        idx,
                        self.cfg.rx_conn_buf_len,
                        max as usize,
                        RecvWait::Some,
                    )
                } {
                    OwnRecv::Queued => true,
                    // `rx_burst` asks again once it consumed the chunks.
                    OwnRecv::NoRoom => continue,
                    OwnRecv::SqFull => false,
                },
                None => {
                    sys::push_recv_multishot(&mut self.ring, c.sock, BGID, user_data(idx, OP_RECV))
                }
            };
            if queued {
                c.recv_armed = true;
                self.stats.recv_arms += 1;
            } else {
                keep.push(idx);
            }
        }
        self.rearm = keep;
    }

    /// Finds received frames, checking every header against the largest
    /// body and message it may announce.
    fn deframer(&self) -> Deframer {
        let max_body = u32::try_from(self.cfg.max_frame_len - HEADER_LEN).unwrap_or(u32::MAX);
        let max_message = u32::try_from(self.cfg.max_message_len).unwrap_or(u32::MAX);
        Deframer::new(Limits::new(max_body, max_message))
    }

    /// Deliver up to `max` complete frames in place (reassembling frames
    /// that straddle buffers), then the end of the stream if it came.
    pub(crate) fn rx_burst(
        &mut self,
        idx: usize,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let deframer = self.deframer();
        let buf_len = self.cfg.rx_buf_len;
        let direct_min = self.cfg.rx_direct_min;
        let c = self.conns[idx].as_mut().expect("live connection");
        if let Some(e) = &c.frame_error {
            return Err(TransportError::Frame(e.clone()));
        }
        let mut n = 0;
        let mut released = 0;
        let mut freed = std::mem::take(&mut self.rx_freed);
        let mut err = None;
        if c.direct_ready {
            // A direct receive completed the frame in `partial`.
            c.direct_ready = false;
            match deframer.needed(&c.partial) {
                Ok(len) if len == c.partial.len() => {
                    sink(&c.partial);
                    c.partial.clear();
                    c.stats.frames_received += 1;
                    released += usize::from(after_frame(c, len, direct_min));
                    n += 1;
                }
                Ok(_) => err = Some(FrameError::BadLength("direct receive overran its frame")),
                Err(e) => err = Some(e),
            }
        }
        while n < max && err.is_none() {
            let Some(&(bid, off, end)) = c.chunks.front() else {
                break;
            };
            debug_assert!(!c.direct_inflight, "chunks while a direct receive runs");
            let data = if bid == OWN_BID {
                // SAFETY: `off..end` holds bytes of a receive whose
                // completion was reaped (`complete_own` made the chunk); a
                // receive armed meanwhile writes only past every unconsumed
                // chunk, and `own` is neither dropped nor replaced while
                // `data` lives (this loop changes other fields of `c`).
                match unsafe { c.own.bytes(off as usize, end as usize) } {
                    Some(chunk) => chunk,
                    None => {
                        err = Some(FrameError::BadLength("receive chunk outside its buffer"));
                        break;
                    }
                }
            } else {
                let id = slot_id(usize::from(bid));
                let (from, to) = (off as usize, buf_len.min(end as usize));
                // SAFETY: `from..to` holds bytes of a receive whose
                // completion was reaped (`complete_recv` made the chunk);
                // the kernel writes this buffer again only past them
                // (incremental consumption) or once `release_rx_quiet` has
                // put it back in the buffer ring, which waits for every
                // chunk of it to be read.
                let chunk = unsafe { self.rx_pool.slot(id, from, to.saturating_sub(from)) };
                match chunk {
                    Ok(chunk) => chunk,
                    Err(_) => {
                        err = Some(FrameError::BadLength("receive chunk outside its buffer"));
                        break;
                    }
                }
            };
            let used;
            if !c.partial.is_empty() {
                let want = match deframer.needed(&c.partial) {
                    Ok(want) => want,
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                };
                let take = (want - c.partial.len()).min(data.len());
                c.partial.extend_from_slice(&data[..take]);
                used = take;
                let scan = deframer.scan(&c.partial, 1, &mut *sink);
                if let NextFrame::Invalid(e) = scan.next {
                    err = Some(e);
                    break;
                }
                if scan.frames == 1 {
                    c.partial.clear();
                    c.stats.frames_received += 1;
                    released += usize::from(after_frame(c, scan.consumed, direct_min));
                    n += 1;
                }
            } else {
                // Every complete frame of this chunk in one pass: the chunk
                // bookkeeping above and below runs once per chunk, not once
                // per frame (a burst of answers is 16 or more frames in one
                // receive).
                let scan = deframer.scan(data, max - n, |frame: &[u8]| {
                    sink(frame);
                    c.stats.frames_received += 1;
                    released += usize::from(after_frame(c, frame.len(), direct_min));
                });
                n += scan.frames;
                used = match scan.next {
                    NextFrame::NotRead => scan.consumed,
                    NextFrame::Incomplete { .. } => {
                        c.partial.extend_from_slice(&data[scan.consumed..]);
                        data.len()
                    }
                    NextFrame::Invalid(e) => {
                        // The connection is unusable from here; where its
                        // chunk stood no longer matters.
                        err = Some(e);
                        break;
                    }
                };
            }
            let off = off + used as u32;
            if off >= end {
                c.chunks.pop_front();
                if bid == OWN_BID {
                    c.own_refs -= 1;
                } else {
                    freed.push(bid);
                }
            } else if let Some(f) = c.chunks.front_mut() {
                f.1 = off;
            }
        }
        self.stats.frames_received += n as u64;
        self.stats.rx_buffers_released += released as u64;
        let c = self.conns[idx].as_mut().expect("live connection");
        if let Some(e) = err {
            tracing::debug!(error = %e, "uring: bad frame");
            c.frame_error = Some(e.clone());
            for b in freed.drain(..) {
                self.release_rx(b);
            }
            self.rx_freed = freed;
            if n > 0 {
                return Ok(n);
            }
            return Err(TransportError::Frame(e));
        }
        if c.chunks.is_empty() && !c.direct_inflight && !c.direct_ready {
            // Receive the rest of a long frame straight into `partial`
            // (`queue_direct_receives`); after a long frame, receive the
            // next header that way too, so that its body does not land in
            // the provided buffers first.
            let have = c.partial.len();
            let want = if have >= HEADER_LEN {
                deframer
                    .needed(&c.partial)
                    .ok()
                    .filter(|&len| len >= direct_min && len > have)
            } else if c.large_run {
                Some(HEADER_LEN)
            } else {
                None
            };
            if want.is_some() && c.direct_want.is_none() {
                self.direct.push(idx);
            }
            c.direct_want = want;
            if want.is_none()
                && !self.spin
                && !c.recv_armed
                && !c.closing
                && c.rx_end.is_none()
                && !self.rearm.contains(&idx)
            {
                // Back to the (multishot or single) receive.
                self.rearm.push(idx);
            }
        }
        let end = if c.chunks.is_empty() { c.rx_end } else { None };
        let truncated = match end {
            Some(RxEnd::Eof) => deframer.end_of_stream(&c.partial).err(),
            _ => None,
        };
        for b in freed.drain(..) {
            self.release_rx(b);
        }
        self.rx_freed = freed;
        if n > 0 {
            return Ok(n);
        }
        if let Some(e) = truncated {
            self.conns[idx].as_mut().expect("live").frame_error = Some(e.clone());
            return Err(TransportError::Frame(e));
        }
        match end {
            None => Ok(0),
            Some(RxEnd::Eof) | Some(RxEnd::Reset) => Err(TransportError::Closed),
            Some(RxEnd::Errno(e)) => Err(TransportError::Io(std::io::Error::from_raw_os_error(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{loopback_pair, rpc_frame};
    use super::super::Ring;
    use super::*;
    use crate::{RecvMode, UringConfig, UringDriver};

    /// Spin receives into the connection's own buffer start at its front
    /// when everything before was consumed, else after the unconsumed
    /// chunk on an `OWN_ALIGN` boundary; frames of any length come out
    /// whole.
    #[test]
    fn own_buffer_receives_start_aligned_and_from_the_front() {
        use std::io::Write;
        let cfg = UringConfig {
            recv: RecvMode::Spin,
            ..UringConfig::default()
        };
        let mut d = UringDriver::new(&cfg).unwrap();
        let r = d.ring_mut();
        let (a, mut b) = loopback_pair();
        let idx = r.add_conn(a).unwrap();
        // 32-byte header + 100 bytes: 132, not a multiple of 64.
        let frame = |id: u64| rpc_frame(id, 100);
        let wait_chunks = |r: &mut Ring, n: usize| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while r.conn(idx).chunks.len() < n {
                assert!(std::time::Instant::now() < deadline, "no data");
                r.end_turn().unwrap();
            }
            r.conn(idx).chunks.iter().copied().collect::<Vec<_>>()
        };
        b.write_all(&frame(1)).unwrap();
        assert_eq!(wait_chunks(r, 1), vec![(OWN_BID, 0, 132)]);
        // Not consumed yet: the next receive goes after it, aligned.
        b.write_all(&frame(2)).unwrap();
        assert_eq!(
            wait_chunks(r, 2),
            vec![(OWN_BID, 0, 132), (OWN_BID, 192, 324)]
        );
        let mut got = Vec::new();
        let n = r
            .rx_burst(idx, 8, &mut |f: &[u8]| got.push(f.to_vec()))
            .unwrap();
        assert_eq!((n, got), (2, vec![frame(1), frame(2)]));
        assert_eq!(r.conn(idx).own_refs, 0);
        // All consumed: the next receive starts at the front again.
        b.write_all(&frame(3)).unwrap();
        assert_eq!(wait_chunks(r, 1), vec![(OWN_BID, 0, 132)]);
    }
}

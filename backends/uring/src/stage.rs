//! The transmit side of one connection between flushes.
//!
//! Frames are written into a transmit slot the connection holds (taken
//! from the ring's registered pool once per slot) and recorded as pieces
//! in stream order; the driver's `flush` hands the pieces to the ring's
//! send queue in one call. So `tx_reserve`, `tx_commit` and `tx_gather`
//! touch only the stage: the ring's queue, pool and counters are reached
//! once per batch of frames, plus once per slot filled.
//!
//! Slot references: a slot this connection fills holds one reference in
//! the ring (taken with the slot); pieces of it staged here hold none
//! until they are handed over, so the fill's reference is dropped only
//! after its pieces were handed over (or discarded, when the connection
//! goes away).
// Writes frames into transmit slots through `sys::lend_slot`.
#![allow(unsafe_code)]

use bytes::Bytes;
use starwire_bufpool::SlotId;
use starwire_transport::TransportError;

use crate::ring::TxSeg;
use crate::sys::{self, SlotPtr};

/// The slot being written: bytes `from..used` are written and not yet
/// recorded as a piece.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fill {
    pub(crate) id: SlotId,
    ptr: SlotPtr,
    from: usize,
    used: usize,
}

/// What the ring last said about the connection's sending side (taken at
/// each hand-over and each receive pass: the stage's view between them).
///
/// Between calls the ring's queue only shrinks at a flush (which refreshes
/// the view); it grows when a short send's unsent rest goes back to it. So
/// the view's `queued` is never above the ring's: back-pressure is never
/// reported on stale numbers, and the queue limit can be passed by at most
/// the rest of one send until the next `rx_burst` or `flush`.
#[derive(Debug, Clone, Default)]
pub(crate) struct RingView {
    /// Bytes queued in the ring and not yet in a send.
    pub(crate) queued: usize,
    /// A send is in flight or bytes wait in the ring's queue.
    pub(crate) pending: bool,
    /// The send side failed with this errno.
    pub(crate) send_error: Option<i32>,
}

/// Limits the stage applies without the ring (copies of the ring's
/// configuration).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StageLimits {
    pub(crate) max_frame_len: usize,
    pub(crate) slot_len: usize,
    pub(crate) queue_limit: usize,
    pub(crate) gather_copy_threshold: usize,
}

/// The staged transmit state of one connection.
#[derive(Debug)]
pub(crate) struct TxStage {
    limits: StageLimits,
    fill: Option<Fill>,
    /// Pieces in stream order, not yet handed to the ring.
    segs: Vec<TxSeg>,
    /// Bytes in `segs` and in the fill's unrecorded `from..used`.
    staged: usize,
    /// Length of the outstanding reservation (in the fill, or in
    /// `heap_reserve`).
    reserved: Option<usize>,
    /// A reservation longer than a slot.
    heap_reserve: Option<Vec<u8>>,
    /// Frames staged since the last hand-over, and of those written to
    /// heap memory (for the ring's counters).
    frames: u64,
    heap_frames: u64,
    /// A frame was staged since the last [`take_idle_fill`](Self::take_idle_fill).
    touched: bool,
    pub(crate) view: RingView,
}

/// What `flush` hands to the ring.
#[derive(Debug, Default)]
pub(crate) struct Handover {
    pub(crate) segs: Vec<TxSeg>,
    pub(crate) frames: u64,
    pub(crate) heap_frames: u64,
    /// The fill's slot, when the connection lets go of it after the pieces
    /// are queued.
    pub(crate) release: Option<SlotId>,
}

/// What `tx_reserve` needs from the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reserve {
    /// The bytes are reserved: [`TxStage::lent`] lends them.
    Lent,
    /// Back-pressure: nothing lent.
    Full,
    /// The fill has no room: hand the stage over and take a new slot
    /// (`TxStage::take_handover`, then `TxStage::set_fill`), and ask again.
    NeedSlot,
}

impl TxStage {
    pub(crate) fn new(limits: StageLimits) -> Self {
        Self {
            limits,
            fill: None,
            segs: Vec::new(),
            staged: 0,
            reserved: None,
            heap_reserve: None,
            frames: 0,
            heap_frames: 0,
            touched: false,
            view: RingView::default(),
        }
    }

    fn check_error(&self) -> Result<(), TransportError> {
        match self.view.send_error {
            None => Ok(()),
            Some(e) if e == libc::EPIPE || e == libc::ECONNRESET => Err(TransportError::Closed),
            Some(e) => Err(TransportError::Io(std::io::Error::from_raw_os_error(e))),
        }
    }

    /// Bytes waiting to be sent: in the ring's queue and here.
    fn waiting(&self) -> usize {
        self.view.queued + self.staged
    }

    /// Frames or pieces wait here or in the ring (as of the ring's last
    /// word).
    pub(crate) fn pending(&self) -> bool {
        self.staged > 0 || self.view.pending
    }

    /// Frames were staged since the last hand-over.
    pub(crate) fn has_staged(&self) -> bool {
        self.staged > 0 || !self.segs.is_empty()
    }

    /// Bytes left in the slot being filled.
    pub(crate) fn fill_room(&self) -> usize {
        self.fill.map_or(0, |f| self.limits.slot_len - f.used)
    }

    /// Drop everything staged and the outstanding reservation (the
    /// connection goes away); returns the slot being filled, for the
    /// caller to give back.
    pub(crate) fn discard(&mut self) -> Option<SlotId> {
        self.segs.clear();
        self.staged = 0;
        self.reserved = None;
        self.heap_reserve = None;
        self.frames = 0;
        self.heap_frames = 0;
        self.fill.take().map(|f| f.id)
    }

    /// The fill a hand-over kept, once nothing was staged since the last
    /// call: the caller gives the slot back. Called once a turn, so a
    /// connection that went quiet holds its slot for at most two turns.
    pub(crate) fn take_idle_fill(&mut self) -> Option<SlotId> {
        let touched = std::mem::replace(&mut self.touched, false);
        if touched || self.has_staged() || self.reserved.is_some() {
            return None;
        }
        self.fill.take().map(|f| f.id)
    }

    /// A new slot to write into (taken from the pool by the ring, after
    /// [`take_handover`](Self::take_handover) let go of the old one).
    ///
    /// # Safety
    /// `ptr` is the start of slot `id` of a ring's transmit pool, at least
    /// `slot_len` (of this stage's limits) bytes valid for reads and
    /// writes, taken from the pool for this stage, whose pieces go to that
    /// ring only. For as long as the stage holds the slot (until a
    /// hand-over releases it, [`take_idle_fill`](Self::take_idle_fill) or
    /// [`discard`](Self::discard) returns it, or the stage is last used)
    /// the mapping stays mapped and
    /// nothing else writes the slot, or reads the bytes of it the stage has
    /// not handed over.
    pub(crate) unsafe fn set_fill(&mut self, id: SlotId, ptr: SlotPtr) {
        debug_assert!(self.fill.is_none());
        self.fill = Some(Fill {
            id,
            ptr,
            from: 0,
            used: 0,
        });
    }

    /// Record the fill's written bytes as a piece.
    fn record_fill(&mut self) {
        if let Some(f) = self.fill.as_mut() {
            if f.used > f.from {
                self.segs.push(TxSeg::Slot {
                    id: f.id,
                    off: f.from,
                    len: f.used - f.from,
                });
                f.from = f.used;
            }
        }
    }

    /// Record `b` by reference, after the fill's written bytes.
    fn push_shared(&mut self, b: Bytes) {
        self.record_fill();
        self.staged += b.len();
        self.segs.push(TxSeg::Shared(b));
    }

    /// Everything staged, for the ring to queue. The fill is let go of
    /// unless `keep_fill` (the caller decides by its room and the pool) or
    /// a reservation in it is outstanding.
    pub(crate) fn take_handover(&mut self, keep_fill: bool) -> Handover {
        self.record_fill();
        let keep = keep_fill || self.reserved.is_some();
        let release = if keep {
            None
        } else {
            self.fill.take().map(|f| f.id)
        };
        self.staged = 0;
        Handover {
            segs: std::mem::take(&mut self.segs),
            frames: std::mem::take(&mut self.frames),
            heap_frames: std::mem::take(&mut self.heap_frames),
            release,
        }
    }

    /// Give back the vector a hand-over took (emptied by the ring), so the
    /// next batch does not allocate one.
    pub(crate) fn return_segs(&mut self, mut v: Vec<TxSeg>) {
        if self.segs.is_empty() && v.capacity() > self.segs.capacity() {
            v.clear();
            self.segs = v;
        }
    }

    /// Reserve `len` bytes for one frame; [`lent`](Self::lent) lends them.
    pub(crate) fn reserve(&mut self, len: usize) -> Result<Reserve, TransportError> {
        let max = self.limits.max_frame_len;
        if len > max {
            return Err(TransportError::FrameTooLarge { len, max });
        }
        self.check_error()?;
        self.reserved = None;
        self.heap_reserve = None;
        if len > self.limits.slot_len {
            // Longer than a slot: heap memory, recorded by reference at the
            // commit.
            if self.waiting() > 0 && self.waiting() + len > self.limits.queue_limit {
                return Ok(Reserve::Full);
            }
            self.reserved = Some(len);
            self.heap_reserve = Some(vec![0; len]);
            return Ok(Reserve::Lent);
        }
        match self.fill {
            Some(f) if self.limits.slot_len - f.used >= len => {
                self.reserved = Some(len);
                self.touched = true;
                Ok(Reserve::Lent)
            }
            _ => Ok(Reserve::NeedSlot),
        }
    }

    /// The bytes of the outstanding reservation, for the frame to be
    /// written into; `None` without one. The view borrows the stage, so
    /// it ends before the reservation can be committed or handed over.
    pub(crate) fn lent(&mut self) -> Option<&mut [u8]> {
        let len = self.reserved?;
        if let Some(buf) = self.heap_reserve.as_mut() {
            return Some(&mut buf[..len]);
        }
        let f = self.fill?;
        // SAFETY: `set_fill`'s contract keeps the fill's slot mapped and
        // this stage's alone past the bytes it handed over; the
        // reservation is `f.used..f.used + len`, inside the slot (`reserve`
        // checked the room) and past every recorded piece, and the borrow
        // of `self` keeps the stage from recording, handing over or lending
        // those bytes again while the view lives.
        Some(unsafe { sys::lend_slot(f.ptr.at(f.used), len) })
    }

    /// # Panics
    /// Without an outstanding reservation, or when `len` exceeds it.
    pub(crate) fn commit(&mut self, len: usize) {
        let r = self
            .reserved
            .take()
            .expect("tx_commit without a reservation");
        assert!(
            len <= r,
            "tx_commit of {len} bytes exceeds the reservation of {r}"
        );
        if let Some(mut buf) = self.heap_reserve.take() {
            buf.truncate(len);
            self.push_shared(Bytes::from(buf));
            self.heap_frames += 1;
        } else if let Some(f) = self.fill.as_mut() {
            f.used += len;
            self.staged += len;
        }
        self.frames += 1;
        self.touched = true;
    }

    /// Stage `head` (copied into the fill) and `segs` (kept by reference
    /// when at least `gather_copy_threshold` long; shorter ones are copied
    /// next to the head). `Ok(None)`: the fill has no room for the copied
    /// part (see [`Reserve::NeedSlot`]).
    pub(crate) fn gather(
        &mut self,
        head: &[u8],
        segs: &[Bytes],
    ) -> Result<Option<bool>, TransportError> {
        let total = head.len() + segs.iter().map(Bytes::len).sum::<usize>();
        let max = self.limits.max_frame_len;
        if total > max {
            return Err(TransportError::FrameTooLarge { len: total, max });
        }
        let threshold = self.limits.gather_copy_threshold.max(1);
        let copied = head.len()
            + segs
                .iter()
                .filter(|s| s.len() < threshold)
                .map(Bytes::len)
                .sum::<usize>();
        if copied > self.limits.slot_len {
            return self.gather_heap(head, segs, total).map(Some);
        }
        let shared_bytes = total - copied;
        if shared_bytes > 0 && self.waiting() + shared_bytes > self.limits.queue_limit {
            self.check_error()?;
            return Ok(Some(false));
        }
        match self.reserve(copied)? {
            Reserve::Lent => {}
            Reserve::Full => return Ok(Some(false)),
            Reserve::NeedSlot => return Ok(None),
        }
        self.reserved = None;
        let f = self.fill.expect("reserved in the fill");
        let start = f.used;
        // SAFETY: `set_fill`'s contract keeps the fill's slot mapped and
        // this stage's alone past the bytes it handed over; `start..start +
        // copied` is inside the slot (`reserve` checked the room) and past
        // every recorded piece. `dst` does not leave this call, which
        // records pieces only of bytes it already wrote and hands nothing
        // over.
        let dst = unsafe { sys::lend_slot(f.ptr.at(start), copied) };
        self.staged += copied;
        let mut at = head.len();
        dst[..at].copy_from_slice(head);
        for s in segs {
            if s.len() < threshold {
                dst[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            } else {
                // The bytes written so far become a piece, then the shared
                // segment follows; `dst` goes on where they ended.
                if let Some(f) = self.fill.as_mut() {
                    f.used = start + at;
                }
                self.push_shared(s.clone());
            }
        }
        if let Some(f) = self.fill.as_mut() {
            f.used = start + at;
        }
        self.frames += 1;
        self.touched = true;
        Ok(Some(true))
    }

    /// `gather` of a frame whose copied part exceeds a slot: runs of copied
    /// bytes go to heap buffers, long segments stay by reference.
    fn gather_heap(
        &mut self,
        head: &[u8],
        segs: &[Bytes],
        total: usize,
    ) -> Result<bool, TransportError> {
        self.check_error()?;
        // The reservation is abandoned, as by a new reserve.
        self.reserved = None;
        self.heap_reserve = None;
        if self.waiting() > 0 && self.waiting() + total > self.limits.queue_limit {
            return Ok(false);
        }
        let threshold = self.limits.gather_copy_threshold.max(1);
        let mut run = head.to_vec();
        for s in segs {
            if s.len() < threshold {
                run.extend_from_slice(s);
                continue;
            }
            if !run.is_empty() {
                self.push_shared(std::mem::take(&mut run).into());
            }
            self.push_shared(s.clone());
        }
        if !run.is_empty() {
            self.push_shared(run.into());
        }
        self.frames += 1;
        self.heap_frames += 1;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> StageLimits {
        StageLimits {
            max_frame_len: 1024,
            slot_len: 256,
            queue_limit: 4096,
            gather_copy_threshold: 64,
        }
    }

    fn slot(i: usize) -> SlotId {
        SlotId::from_index(i)
    }

    /// The stage's reservation, which `r` says was made.
    fn lent(st: &mut TxStage, r: Reserve) -> &mut [u8] {
        assert_eq!(r, Reserve::Lent);
        st.lent().expect("a reservation")
    }

    /// `st` fills `mem`, as slot `id`.
    fn set_fill(st: &mut TxStage, id: SlotId, mem: &mut [u8]) {
        assert!(mem.len() >= limits().slot_len);
        // SAFETY: `mem` is `slot_len` bytes, outlives the stage in every
        // test (declared before it), and is not touched while the stage
        // holds it.
        unsafe { st.set_fill(id, SlotPtr::new(mem.as_mut_ptr().cast_const())) };
    }

    fn shape(segs: &[TxSeg]) -> Vec<(char, usize, usize)> {
        segs.iter()
            .map(|s| match s {
                TxSeg::Slot { id, off, len } => ('s', id.index() * 1000 + off, *len),
                TxSeg::Shared(b) => ('r', 0, b.len()),
            })
            .collect()
    }

    /// Pieces come out in stream order: slot bytes written before a
    /// segment kept by reference, the segment, then what follows; the
    /// slot's bytes are where the frames wrote them.
    #[test]
    fn a_handover_keeps_the_stream_order() {
        let mut mem = vec![0u8; 256];
        let mut st = TxStage::new(limits());
        assert!(matches!(st.reserve(10).unwrap(), Reserve::NeedSlot));
        set_fill(&mut st, slot(3), &mut mem);
        let r = st.reserve(10).unwrap();
        let buf = lent(&mut st, r);
        assert_eq!(buf.len(), 10);
        buf[..8].copy_from_slice(b"frame-1.");
        st.commit(8);
        let big = Bytes::from(vec![7u8; 100]);
        let done = st
            .gather(
                b"hd",
                &[
                    Bytes::from_static(b"ab"),
                    big.clone(),
                    Bytes::from_static(b"xyz"),
                ],
            )
            .unwrap();
        assert_eq!(done, Some(true));
        assert!(st.pending());
        let h = st.take_handover(false);
        assert_eq!(
            shape(&h.segs),
            vec![('s', 3000, 12), ('r', 0, 100), ('s', 3012, 3)]
        );
        assert_eq!(h.frames, 2);
        assert_eq!(h.release, Some(slot(3)), "no reservation: the fill goes");
        assert!(!st.pending());
        assert_eq!(&mem[..15], b"frame-1.hdabxyz");
    }

    /// An outstanding reservation keeps the fill across a hand-over; a
    /// frame longer than a slot is heap memory, handed over by reference.
    #[test]
    fn reservations_keep_the_fill_and_long_frames_go_to_the_heap() {
        let mut mem = vec![0u8; 256];
        let mut st = TxStage::new(limits());
        set_fill(&mut st, slot(0), &mut mem);
        let r = st.reserve(16).unwrap();
        lent(&mut st, r);
        let h = st.take_handover(false);
        assert!(h.segs.is_empty());
        assert_eq!(h.release, None, "a reservation is outstanding");
        st.commit(16);
        assert_eq!(st.lent().map(|b| b.len()), None, "committed");
        let r = st.reserve(300).unwrap();
        let buf = lent(&mut st, r);
        assert_eq!(buf.len(), 300);
        buf.fill(9);
        st.commit(250);
        let h = st.take_handover(false);
        assert_eq!(shape(&h.segs), vec![('s', 0, 16), ('r', 0, 250)]);
        assert_eq!((h.frames, h.heap_frames), (2, 1));
        assert_eq!(h.release, Some(slot(0)));
        // No fill now: the next frame needs a slot.
        assert!(matches!(st.reserve(1).unwrap(), Reserve::NeedSlot));
    }

    /// The queue limit counts what the ring holds and what is staged; a
    /// send error the ring reported fails the next frame.
    #[test]
    fn back_pressure_and_errors_use_the_rings_view() {
        let mut mem = vec![0u8; 256];
        let mut st = TxStage::new(limits());
        set_fill(&mut st, slot(1), &mut mem);
        let big = Bytes::from(vec![1u8; 100]);
        st.view.queued = 4000;
        assert_eq!(
            st.gather(b"h", std::slice::from_ref(&big)).unwrap(),
            Some(false)
        );
        assert!(matches!(st.reserve(500).unwrap(), Reserve::Full));
        st.view.queued = 0;
        assert_eq!(
            st.gather(b"h", std::slice::from_ref(&big)).unwrap(),
            Some(true)
        );
        // A frame whose copied part fits a slot but not the fill's room.
        assert_eq!(st.gather(&[0u8; 256], &[]).unwrap(), None);
        assert!(matches!(
            st.gather(&[0u8; 2000], &[]),
            Err(TransportError::FrameTooLarge {
                len: 2000,
                max: 1024
            })
        ));
        st.view.send_error = Some(libc::EPIPE);
        assert!(matches!(st.reserve(4), Err(TransportError::Closed)));
        st.view.send_error = Some(libc::EIO);
        assert!(matches!(st.reserve(4), Err(TransportError::Io(_))));
    }

    /// A fill kept across a hand-over goes back only after a call with no
    /// frame staged since the one before, and never while a reservation
    /// in it is outstanding.
    #[test]
    fn a_kept_fill_goes_back_after_a_quiet_turn() {
        let mut mem = vec![0u8; 256];
        let mut st = TxStage::new(limits());
        set_fill(&mut st, slot(2), &mut mem);
        assert_eq!(st.gather(b"frame", &[]).unwrap(), Some(true));
        assert!(st.has_staged());
        let h = st.take_handover(true);
        assert_eq!((h.segs.len(), h.release), (1, None));
        assert!(!st.has_staged());
        assert_eq!(st.fill_room(), 256 - 5);
        assert_eq!(st.take_idle_fill(), None, "a frame was staged this turn");
        let r = st.reserve(4).unwrap();
        lent(&mut st, r);
        assert_eq!(st.take_idle_fill(), None, "reserved this turn");
        assert_eq!(st.take_idle_fill(), None, "the reservation is outstanding");
        st.commit(4);
        let h = st.take_handover(true);
        assert_eq!(shape(&h.segs), vec![('s', 2005, 4)]);
        assert_eq!(st.take_idle_fill(), None, "a frame was staged this turn");
        assert_eq!(st.take_idle_fill(), Some(slot(2)));
        assert_eq!((st.fill.map(|f| f.id), st.fill_room()), (None, 0));
    }
}

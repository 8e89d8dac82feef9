//! The send queue: an owned staging buffer plus borrowed `Bytes`, written
//! with vectored writes.
//!
//! The queue is a list of chunks, each either a range of the staging buffer
//! (frames encoded in place by `tx_reserve`/`tx_commit`, heads and small
//! segments copied by `tx_gather`) or a `Bytes` segment kept by reference.
//! Chunks go out in exactly the order they were queued; adjacent staging
//! ranges are merged so a burst of reserved frames is a single `iovec`.

use std::collections::VecDeque;
use std::io::{self, IoSlice};

use bytes::{Buf, Bytes};
use starwire_transport::TransportError;

/// The most `iovec`s handed to one vectored write (Linux `IOV_MAX`).
pub const MAX_IOVECS: usize = 1024;
/// Smaller iovec array used when few chunks are queued, to avoid
/// initialising a 16 KiB array for a handful of slices.
const SMALL_IOVECS: usize = 16;
/// First allocation of the staging buffer.
const INITIAL_STAGE: usize = 16 << 10;

#[derive(Debug)]
enum Chunk {
    /// `stage[start..end]`.
    Staged { start: usize, end: usize },
    /// A segment kept by reference.
    Shared(Bytes),
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Self::Staged { start, end } => end - start,
            Self::Shared(b) => b.len(),
        }
    }
}

/// The bounded, ordered send queue. Independent of the socket so it can be
/// tested against a scripted writer.
pub(crate) struct TxQueue {
    /// Staging memory. `stage.len()` is the initialised high-water mark (never
    /// above `limit`); the live region is `stage_dead..stage_end`.
    stage: Vec<u8>,
    /// End of committed staged bytes; new frames are staged here.
    stage_end: usize,
    /// Staged bytes before this offset have been written.
    stage_dead: usize,
    /// The outstanding reservation `(start, len)`, at `stage_end`.
    reserved: Option<(usize, usize)>,
    chunks: VecDeque<Chunk>,
    /// Bytes queued and not yet written (staged and shared).
    queued: usize,
    limit: usize,
    max_frame: usize,
    copy_threshold: usize,
}

impl std::fmt::Debug for TxQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxQueue")
            .field("queued", &self.queued)
            .field("chunks", &self.chunks.len())
            .field("stage_capacity", &self.stage.capacity())
            .field("reserved", &self.reserved)
            .field("limit", &self.limit)
            .finish()
    }
}

impl TxQueue {
    pub(crate) fn new(limit: usize, max_frame: usize, copy_threshold: usize) -> Self {
        debug_assert!(limit >= max_frame);
        Self {
            stage: Vec::new(),
            stage_end: 0,
            stage_dead: 0,
            reserved: None,
            chunks: VecDeque::new(),
            queued: 0,
            limit,
            max_frame,
            copy_threshold,
        }
    }

    /// Bytes queued and not yet written.
    pub(crate) fn queued(&self) -> usize {
        self.queued
    }

    /// Chunks (future iovecs) queued.
    pub(crate) fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Allocated staging memory.
    pub(crate) fn stage_capacity(&self) -> usize {
        self.stage.capacity()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    pub(crate) fn reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.reserved = None;
        if len > self.max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.max_frame,
            });
        }
        if self.queued + len > self.limit {
            return Ok(None);
        }
        let start = self.make_room(len);
        self.reserved = Some((start, len));
        Ok(Some(&mut self.stage[start..start + len]))
    }

    pub(crate) fn commit(&mut self, len: usize) {
        let (start, reserved) = self
            .reserved
            .take()
            .expect("tx_commit called without an outstanding tx_reserve");
        assert!(
            len <= reserved,
            "tx_commit of {len} bytes exceeds the reservation of {reserved}"
        );
        self.push_staged(start, len);
    }

    pub(crate) fn gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        self.reserved = None;
        let len = head.len() + segs.iter().map(Bytes::len).sum::<usize>();
        if len > self.max_frame {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.max_frame,
            });
        }
        if self.queued + len > self.limit {
            return Ok(false);
        }
        let copied = head.len()
            + segs
                .iter()
                .map(Bytes::len)
                .filter(|&l| l <= self.copy_threshold)
                .sum::<usize>();
        let mut at = self.make_room(copied);
        self.stage[at..at + head.len()].copy_from_slice(head);
        self.push_staged(at, head.len());
        at += head.len();
        for seg in segs {
            if seg.is_empty() {
                continue;
            }
            if seg.len() <= self.copy_threshold {
                self.stage[at..at + seg.len()].copy_from_slice(seg);
                self.push_staged(at, seg.len());
                at += seg.len();
            } else {
                self.queued += seg.len();
                self.chunks.push_back(Chunk::Shared(seg.clone()));
            }
        }
        Ok(true)
    }

    /// Make `len` bytes of staging room at `stage_end` and return its start.
    /// The caller has checked `queued + len <= limit` and holds no
    /// reservation.
    fn make_room(&mut self, len: usize) -> usize {
        debug_assert!(self.reserved.is_none());
        if self.chunks.is_empty() {
            self.stage_end = 0;
            self.stage_dead = 0;
        }
        let need = self.stage_end + len;
        if need > self.stage.len() {
            let live = self.stage_end - self.stage_dead;
            // Compact when it is required to stay within the limit, or when
            // it is cheaper than growing (less live data than dead prefix).
            if need > self.limit || (self.stage_dead > 0 && live <= self.stage_dead) {
                self.compact();
            }
        }
        let need = self.stage_end + len;
        debug_assert!(need <= self.limit);
        if need > self.stage.len() {
            let new_len = need
                .max(self.stage.len() * 2)
                .max(INITIAL_STAGE)
                .min(self.limit);
            self.stage.reserve_exact(new_len - self.stage.len());
            self.stage.resize(new_len, 0);
        }
        self.stage_end
    }

    /// Move the live staged bytes to offset 0.
    fn compact(&mut self) {
        let dead = self.stage_dead;
        if dead == 0 {
            return;
        }
        self.stage.copy_within(dead..self.stage_end, 0);
        for c in &mut self.chunks {
            if let Chunk::Staged { start, end } = c {
                *start -= dead;
                *end -= dead;
            }
        }
        self.stage_end -= dead;
        self.stage_dead = 0;
    }

    fn push_staged(&mut self, start: usize, len: usize) {
        debug_assert_eq!(start, self.stage_end);
        if len == 0 {
            return;
        }
        let end = start + len;
        self.stage_end = end;
        self.queued += len;
        if let Some(Chunk::Staged { end: last_end, .. }) = self.chunks.back_mut() {
            if *last_end == start {
                *last_end = end;
                return;
            }
        }
        self.chunks.push_back(Chunk::Staged { start, end });
    }

    /// Write queued bytes with `write` (one vectored write per call).
    ///
    /// Calls `write` once, and again only while it accepted everything it
    /// was offered and more is queued (more than [`MAX_IOVECS`] chunks).
    /// Stops at `WouldBlock` or a short write; retries `Interrupted`.
    /// Returns the number of bytes written.
    pub(crate) fn flush_with<W>(&mut self, mut write: W) -> io::Result<usize>
    where
        W: FnMut(&[IoSlice<'_>]) -> io::Result<usize>,
    {
        let mut written = 0;
        while !self.chunks.is_empty() {
            let step = if self.chunks.len() <= SMALL_IOVECS {
                self.write_once::<SMALL_IOVECS, W>(&mut write)
            } else {
                self.write_once::<MAX_IOVECS, W>(&mut write)
            };
            match step {
                Ok((n, everything)) => {
                    written += n;
                    if !everything {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(written)
    }

    /// One vectored write of up to `N` chunks. Returns the bytes written and
    /// whether everything offered was accepted.
    fn write_once<const N: usize, W>(&mut self, write: &mut W) -> io::Result<(usize, bool)>
    where
        W: FnMut(&[IoSlice<'_>]) -> io::Result<usize>,
    {
        let mut iov = [IoSlice::new(&[]); N];
        let mut n = 0;
        let mut offered = 0;
        for (slot, chunk) in iov.iter_mut().zip(&self.chunks) {
            let s: &[u8] = match chunk {
                Chunk::Staged { start, end } => &self.stage[*start..*end],
                Chunk::Shared(b) => b,
            };
            *slot = IoSlice::new(s);
            offered += s.len();
            n += 1;
        }
        let w = write(&iov[..n])?;
        if w == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        debug_assert!(w <= offered);
        self.consume(w);
        Ok((w, w == offered))
    }

    /// Drop `n` written bytes from the front of the queue.
    fn consume(&mut self, n: usize) {
        self.queued -= n;
        let mut left = n;
        while left > 0 {
            let front = self
                .chunks
                .front_mut()
                .expect("writer reported more bytes than were queued");
            let len = front.len();
            if left >= len {
                left -= len;
                if let Some(Chunk::Staged { end, .. }) = self.chunks.pop_front() {
                    self.stage_dead = end;
                }
            } else {
                match front {
                    Chunk::Staged { start, .. } => {
                        *start += left;
                        self.stage_dead = *start;
                    }
                    Chunk::Shared(b) => b.advance(left),
                }
                left = 0;
            }
        }
        if self.chunks.is_empty() && self.reserved.is_none() {
            self.stage_end = 0;
            self.stage_dead = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted writer: accepts at most `budget[i]` bytes on call `i`
    /// (or would block when the budget is 0) and records what it got.
    struct Sink {
        out: Vec<u8>,
        calls: usize,
        iovecs: Vec<usize>,
        budget: Vec<usize>,
    }

    impl Sink {
        fn new(budget: Vec<usize>) -> Self {
            Self {
                out: Vec::new(),
                calls: 0,
                iovecs: Vec::new(),
                budget,
            }
        }
        fn write(&mut self, iov: &[IoSlice<'_>]) -> io::Result<usize> {
            let budget = self.budget.get(self.calls).copied().unwrap_or(usize::MAX);
            self.calls += 1;
            self.iovecs.push(iov.len());
            if budget == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let mut left = budget;
            let mut n = 0;
            for s in iov {
                let take = s.len().min(left);
                self.out.extend_from_slice(&s[..take]);
                n += take;
                left -= take;
                if left == 0 {
                    break;
                }
            }
            Ok(n)
        }
    }

    fn pattern(tag: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| tag.wrapping_add(i as u8)).collect()
    }

    #[test]
    fn reserved_frames_merge_into_one_iovec() {
        let mut q = TxQueue::new(1 << 20, 1 << 16, 0);
        let mut want = Vec::new();
        for tag in 0..50u8 {
            let p = pattern(tag, 10 + tag as usize);
            q.reserve(p.len() + 5).unwrap().unwrap()[..p.len()].copy_from_slice(&p);
            q.commit(p.len());
            want.extend_from_slice(&p);
        }
        assert_eq!(q.chunks(), 1);
        let mut s = Sink::new(vec![]);
        let n = q.flush_with(|iov| s.write(iov)).unwrap();
        assert_eq!(n, want.len());
        assert_eq!(s.calls, 1);
        assert_eq!(s.out, want);
        assert!(q.is_empty());
        assert_eq!(q.queued(), 0);
    }

    #[test]
    fn mixed_order_and_partial_writes() {
        let mut q = TxQueue::new(1 << 20, 1 << 16, 4);
        let mut want = Vec::new();
        for tag in 0..40u8 {
            if tag % 3 == 0 {
                let p = pattern(tag, 7);
                q.reserve(7).unwrap().unwrap().copy_from_slice(&p);
                q.commit(7);
                want.extend_from_slice(&p);
            } else {
                let head = pattern(tag, 3);
                let big = Bytes::from(pattern(tag.wrapping_mul(7), 100));
                let small = Bytes::from(pattern(tag.wrapping_mul(11), 2));
                assert!(q
                    .gather(
                        &head,
                        &[big.clone(), Bytes::new(), small.clone(), big.clone()]
                    )
                    .unwrap());
                want.extend_from_slice(&head);
                want.extend_from_slice(&big);
                want.extend_from_slice(&small);
                want.extend_from_slice(&big);
            }
        }
        // Short writes of odd sizes, with would-blocks in between.
        let budget: Vec<usize> = (0..10_000).map(|i| [13, 0, 1, 250, 0, 97][i % 6]).collect();
        let mut s = Sink::new(budget);
        let mut flushes = 0;
        while !q.is_empty() {
            let before = s.calls;
            q.flush_with(|iov| s.write(iov)).unwrap();
            // A short write or a would-block ends the flush after one call.
            assert_eq!(s.calls - before, 1);
            flushes += 1;
            assert!(flushes < 10_000);
        }
        assert_eq!(s.out, want);
    }

    #[test]
    fn more_than_iov_max_chunks_loop_only_while_fully_accepted() {
        let mut q = TxQueue::new(1 << 20, 1 << 16, 0);
        let mut want = Vec::new();
        for tag in 0..1500u32 {
            let seg = Bytes::from(pattern(tag as u8, 20));
            assert!(q.gather(&[], std::slice::from_ref(&seg)).unwrap());
            want.extend_from_slice(&seg);
        }
        assert_eq!(q.chunks(), 1500);
        let mut s = Sink::new(vec![]);
        q.flush_with(|iov| s.write(iov)).unwrap();
        assert_eq!(s.iovecs, vec![MAX_IOVECS, 1500 - MAX_IOVECS]);
        assert_eq!(s.out, want);

        // Same again, but the first write is short: stop after it.
        for tag in 0..1500u32 {
            let seg = Bytes::from(pattern(tag as u8, 20));
            assert!(q.gather(&[], &[seg]).unwrap());
        }
        let mut s = Sink::new(vec![100]);
        q.flush_with(|iov| s.write(iov)).unwrap();
        assert_eq!(s.calls, 1);
        assert_eq!(q.queued(), 1500 * 20 - 100);
    }

    #[test]
    fn back_pressure_and_bounded_staging() {
        let limit = 4096;
        let mut q = TxQueue::new(limit, 1024, 64);
        let mut n = 0;
        while let Some(b) = q.reserve(1000).unwrap() {
            b.fill(n as u8);
            q.commit(1000);
            n += 1;
        }
        assert_eq!(n, 4);
        assert!(!q.gather(&[0; 100], &[]).unwrap());
        assert!(matches!(
            q.reserve(1025),
            Err(TransportError::FrameTooLarge {
                len: 1025,
                max: 1024
            })
        ));
        // Drain part, then keep the queue partly full for many rounds: the
        // staging buffer must never outgrow the limit and no byte is lost.
        let mut committed = 4000;
        let mut s = Sink::new((0..1000).map(|r| 700 + r % 300).collect());
        for round in 0..1000usize {
            let before = s.calls;
            q.flush_with(|iov| s.write(iov)).unwrap();
            assert_eq!(s.calls - before, 1);
            while let Some(b) = q.reserve(333).unwrap() {
                b.fill(round as u8);
                q.commit(333);
                committed += 333;
            }
            assert!(q.queued() <= limit);
            assert!(q.stage_capacity() <= limit);
            assert_eq!(s.out.len() + q.queued(), committed);
        }
    }

    #[test]
    fn abandoned_reservation_is_not_sent() {
        let mut q = TxQueue::new(1 << 16, 1 << 12, 0);
        q.reserve(10).unwrap().unwrap().fill(1);
        q.reserve(5).unwrap().unwrap().fill(2);
        q.commit(3);
        q.reserve(10).unwrap().unwrap().fill(3);
        assert!(q.gather(&[4, 4], &[]).unwrap());
        let mut s = Sink::new(vec![]);
        q.flush_with(|iov| s.write(iov)).unwrap();
        assert_eq!(s.out, vec![2, 2, 2, 4, 4]);
    }

    #[test]
    #[should_panic(expected = "exceeds the reservation")]
    fn commit_longer_than_reservation_panics() {
        let mut q = TxQueue::new(1 << 16, 1 << 12, 0);
        q.reserve(10).unwrap().unwrap();
        q.commit(11);
    }
}

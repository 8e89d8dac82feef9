//! Lending slot bytes: the pool's only `unsafe` code.
//!
//! A backend registers the pool with the kernel or a device, which then
//! writes slots (receives into provided buffers) and reads them (fixed-buffer
//! and zero-copy sends) without any Rust borrow. A reference over memory
//! that changes under it is undefined behaviour, so these methods reach the
//! bytes through the mapping's raw pointer, lend only the range asked for
//! (never the whole mapping or slot on the way), and are `unsafe`: the
//! caller's protocol says which bytes the device has finished with.

use std::ops::Range;

use crate::{BufPool, SlotId, SlotRangeError};

impl BufPool {
    /// Offsets in the mapping of `off .. off + len` of slot `id`, if the
    /// slot exists and the range lies inside it.
    fn slot_range(
        &self,
        id: SlotId,
        off: usize,
        len: usize,
    ) -> Result<Range<usize>, SlotRangeError> {
        let slot = id.index();
        let inside =
            slot < self.slots && off.checked_add(len).is_some_and(|end| end <= self.slot_len);
        if !inside {
            return Err(SlotRangeError {
                slot,
                off,
                len,
                slots: self.slots,
                slot_len: self.slot_len,
            });
        }
        // `slot * slot_len + off + len <= slots * slot_len`, which `new`
        // checked does not overflow.
        let at = slot * self.slot_len + off;
        Ok(at..at + len)
    }

    /// Lend `len` bytes at `off` of slot `id`.
    ///
    /// # Safety
    ///
    /// For as long as the returned slice lives, nothing may write those
    /// bytes: the kernel or device must not be able to write them (they are
    /// not part of a buffer handed to it for receiving, such as an entry of
    /// an io_uring provided-buffer ring or a posted receive, unless it has
    /// completed the bytes and writes that buffer only past them), and no
    /// other code may write them through the pool's addresses.
    pub unsafe fn slot(&self, id: SlotId, off: usize, len: usize) -> Result<&[u8], SlotRangeError> {
        let range = self.slot_range(id, off, len)?;
        // SAFETY: `range` lies inside the mapping, which lives as long as
        // `self`; `MmapRaw::as_ptr` creates no reference over the rest of
        // it; the caller guarantees no writer for the slice's life.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(range.start), len) })
    }

    /// Lend `len` bytes at `off` of slot `id`, mutably.
    ///
    /// # Safety
    ///
    /// For as long as the returned slice lives, nothing else may read or
    /// write those bytes: they are not part of a buffer the kernel or device
    /// may write (a provided buffer, a posted receive) or may still read (a
    /// fixed-buffer or zero-copy send whose completion, or notification, has
    /// not arrived), and no other code reaches them through the pool's
    /// addresses.
    pub unsafe fn slot_mut(
        &mut self,
        id: SlotId,
        off: usize,
        len: usize,
    ) -> Result<&mut [u8], SlotRangeError> {
        let range = self.slot_range(id, off, len)?;
        // SAFETY: `range` lies inside the mapping, which lives as long as
        // `self`; `MmapRaw::as_mut_ptr` creates no reference over the rest
        // of it;
        // `&mut self` excludes other slices lent by the pool, and the caller
        // guarantees no other access for the slice's life.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(range.start), len) })
    }
}

#[cfg(test)]
mod tests {
    use crate::{BufPool, HugePolicy, SlotId, SlotRangeError};

    #[test]
    fn lent_slots_hold_their_own_bytes() {
        let mut p = BufPool::new(4096, 4, HugePolicy::Never).unwrap();
        let ids: Vec<SlotId> = std::iter::from_fn(|| p.take()).collect();
        for (k, &id) in ids.iter().enumerate() {
            // SAFETY: the pool is registered with nothing.
            unsafe { p.slot_mut(id, 0, 4096) }.unwrap().fill(k as u8);
        }
        for (k, &id) in ids.iter().enumerate() {
            // SAFETY: as above.
            let bytes = unsafe { p.slot(id, 0, 4096) }.unwrap();
            assert!(bytes.iter().all(|&b| b == k as u8));
            assert_eq!(bytes.as_ptr(), p.slot_ptr(id));
        }
    }

    #[test]
    fn lending_outside_a_slot_is_a_typed_error() {
        let mut p = BufPool::new(64, 2, HugePolicy::Never).unwrap();
        let outside = |slot, off, len| SlotRangeError {
            slot,
            off,
            len,
            slots: 2,
            slot_len: 64,
        };
        let (a, b) = (SlotId::from_index(0), SlotId::from_index(1));
        // SAFETY: the pool is registered with nothing.
        unsafe {
            p.slot_mut(b, 60, 4).unwrap().copy_from_slice(b"tail");
            assert_eq!(p.slot(b, 60, 4).unwrap(), b"tail");
            assert_eq!(p.slot(b, 64, 0).unwrap(), b"");
            assert_eq!(p.slot(a, 60, 5), Err(outside(0, 60, 5)));
            assert_eq!(p.slot(a, 65, 0), Err(outside(0, 65, 0)));
            assert_eq!(p.slot(a, usize::MAX, 2), Err(outside(0, usize::MAX, 2)));
            assert_eq!(p.slot(SlotId::from_index(2), 0, 1), Err(outside(2, 0, 1)));
            assert_eq!(
                p.slot_mut(SlotId::from_index(7), 0, 0),
                Err(outside(7, 0, 0))
            );
            assert_eq!(p.slot_mut(a, 1, 64), Err(outside(0, 1, 64)));
            // The rejected calls wrote nothing.
            assert_eq!(p.slot(a, 0, 64).unwrap(), &[0; 64][..]);
        }
    }
}

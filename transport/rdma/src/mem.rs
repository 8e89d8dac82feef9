//! [`RegisteredMem`]: the bytes of a registered memory region, reached
//! through a raw pointer because the NIC may read or write any part of them
//! at any time.
//!
//! A region registered with remote write access is shared with the device:
//! the peer's RDMA writes land in it and our posted writes are read out of
//! it, without any Rust borrow being involved. A `&[u8]` over the whole
//! region would therefore be a shared reference to memory that changes under
//! it, which is undefined behaviour. So, much like rust-vmm's
//! `VolatileSlice`:
//!
//! * building a view is safe only from memory the crate allocated (the
//!   simulator's buffers); from a raw pointer it is `unsafe`
//!   ([`RegisteredMem::from_raw_parts`]);
//! * copying bytes in or out ([`read`](RegisteredMem::read),
//!   [`write`](RegisteredMem::write)) is safe: the copies are volatile and
//!   never create a reference, so a concurrent device access can at worst
//!   tear the bytes;
//! * lending a range as a slice ([`slice`](RegisteredMem::slice),
//!   [`slice_mut`](RegisteredMem::slice_mut)) is `unsafe`: the caller proves,
//!   from its protocol, that no posted work request touches the range while
//!   the borrow lives.
//!
//! Every range is checked; a range outside the region is a [`RangeError`].
//!
//! Posting work requests stays safe: the verbs own their regions until they
//! are deregistered or dropped, and the NIC checks every key, offset and
//! length, so a work request never reaches freed memory. The obligation sits with whoever
//! turns device-shared bytes into a Rust slice.

use std::cell::UnsafeCell;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::{self, NonNull};

use thiserror::Error;

/// A byte range outside a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("range of {len} bytes at offset {off} is outside a {region_len}-byte region")]
pub struct RangeError {
    /// Requested offset.
    pub off: usize,
    /// Requested length.
    pub len: usize,
    /// Length of the region.
    pub region_len: usize,
}

/// The bytes of one registered memory region, for as long as `'a` (a
/// borrow of the verbs that registered it) lives.
///
/// Copyable and cheap: a pointer and a length. It grants no exclusive
/// access; see the module documentation for what each method requires.
#[derive(Clone, Copy)]
pub struct RegisteredMem<'a> {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes that others (the device, other views) may change.
    _mem: PhantomData<&'a [UnsafeCell<u8>]>,
}

impl fmt::Debug for RegisteredMem<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredMem")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<'a> RegisteredMem<'a> {
    /// A view of `len` bytes starting at `ptr`.
    ///
    /// # Safety
    ///
    /// For all of `'a`, `ptr .. ptr + len` must be one live allocation (or
    /// part of one) that is valid for reads and writes, not moved or freed,
    /// and not reachable through any Rust reference except those lent by
    /// this view's unsafe methods. `len` must be at most `isize::MAX`.
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize) -> Self {
        Self {
            ptr,
            len,
            _mem: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte. Dereferencing it is subject to the same rules as the
    /// unsafe methods here.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// `off .. off + len` if it lies inside the region.
    pub fn range(&self, off: usize, len: usize) -> Result<Range<usize>, RangeError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(off..end),
            _ => Err(RangeError {
                off,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Pointer to `off`, which [`range`](Self::range) has checked.
    fn at(&self, range: &Range<usize>) -> *mut u8 {
        // SAFETY: `range.start <= self.len` (checked by `range`), so the
        // result is inside the allocation or one past its end, which
        // `from_raw_parts` guarantees is one allocation of at most
        // `isize::MAX` bytes.
        unsafe { self.ptr.as_ptr().add(range.start) }
    }

    /// Copy `dst.len()` bytes starting at `off` into `dst`.
    ///
    /// The copy is volatile: if the device writes the range meanwhile,
    /// `dst` may hold a mix of old and new bytes, but nothing is undefined.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<(), RangeError> {
        let range = self.range(off, dst.len())?;
        let src = self.at(&range);
        for (i, byte) in dst.iter_mut().enumerate() {
            // SAFETY: `off + i` is inside the checked range, and the memory
            // is valid for reads for `'a` (`from_raw_parts`); a volatile
            // read creates no reference the device could invalidate.
            *byte = unsafe { ptr::read_volatile(src.add(i)) };
        }
        Ok(())
    }

    /// Copy `src` into the region starting at `off`.
    ///
    /// The copy is volatile; a device reading the range meanwhile may see a
    /// mix of old and new bytes. A caller that holds a slice lent by
    /// [`slice`](Self::slice) over these bytes has promised that nobody
    /// writes them, this method included.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<(), RangeError> {
        let range = self.range(off, src.len())?;
        let dst = self.at(&range);
        for (i, &byte) in src.iter().enumerate() {
            // SAFETY: `off + i` is inside the checked range, and the memory
            // is valid for writes for `'a` (`from_raw_parts`); a volatile
            // write creates no reference.
            unsafe { ptr::write_volatile(dst.add(i), byte) };
        }
        Ok(())
    }

    /// Lend `off .. off + len` as a shared slice.
    ///
    /// # Safety
    ///
    /// For as long as the returned slice lives, nothing may write the range:
    /// it must not be the target of a posted receive or of an RDMA write the
    /// peer may issue (the caller's protocol must withhold that range from
    /// the peer), and no [`write`](Self::write) or
    /// [`slice_mut`](Self::slice_mut) of this region may cover it.
    pub unsafe fn slice(&self, off: usize, len: usize) -> Result<&'a [u8], RangeError> {
        let range = self.range(off, len)?;
        // SAFETY: the range is inside the allocation (checked) and valid
        // for reads for `'a` (`from_raw_parts`); the caller guarantees no
        // writer for the slice's life.
        Ok(unsafe { std::slice::from_raw_parts(self.at(&range), len) })
    }

    /// Lend `off .. off + len` as an exclusive slice.
    ///
    /// # Safety
    ///
    /// For as long as the returned slice lives, nothing else may read or
    /// write the range: it must not be the local source of a posted send
    /// work request, the target of a posted receive or of an RDMA write the
    /// peer may issue, nor covered by any other access through a view of
    /// this region ([`read`](Self::read), [`write`](Self::write), another
    /// lent slice).
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> Result<&'a mut [u8], RangeError> {
        let range = self.range(off, len)?;
        // SAFETY: the range is inside the allocation (checked) and valid
        // for reads and writes for `'a` (`from_raw_parts`); the caller
        // guarantees exclusive access for the slice's life.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.at(&range), len) })
    }
}

/// A zeroed heap buffer owned as a raw pointer, so that views of it may be
/// written through while it is shared (a `Box<[u8]>` would assert unique
/// access whenever it is moved).
pub(crate) struct OwnedMem {
    ptr: NonNull<u8>,
    len: usize,
}

impl OwnedMem {
    /// `len` zeroed bytes.
    pub(crate) fn zeroed(len: usize) -> Self {
        let buf: &'static mut [u8] = Box::leak(vec![0; len].into_boxed_slice());
        Self {
            ptr: NonNull::from(buf).cast(),
            len,
        }
    }

    /// The whole buffer, for whoever plays the device. Exclusive access
    /// makes this safe: every view borrows `self`, so none is alive.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is the start of a leaked boxed slice of `len` bytes
        // that only `Drop` frees; `&mut self` rules out any live view or
        // slice lent from one.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A view of the whole buffer, for as long as it is borrowed.
    pub(crate) fn mem(&self) -> RegisteredMem<'_> {
        // SAFETY: `ptr` is the start of a leaked boxed slice of `len` bytes
        // that only `Drop` frees, which cannot run while `self` is
        // borrowed; no reference to it is kept anywhere.
        unsafe { RegisteredMem::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for OwnedMem {
    fn drop(&mut self) {
        let slice = ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `slice` is exactly the boxed slice leaked in `zeroed`,
        // freed only here, and every view borrowed `self` so none is left.
        drop(unsafe { Box::from_raw(slice) });
    }
}

// SAFETY: `OwnedMem` owns its allocation as `Box<[u8]>` would, with no
// thread-local state; moving it to another thread moves that ownership.
// It is not `Sync`: views from two threads could race.
unsafe impl Send for OwnedMem {}

impl fmt::Debug for OwnedMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedMem")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_bounds_ranges_are_typed_errors() {
        let owned = OwnedMem::zeroed(64);
        let mem = owned.mem();
        let err = |off, len| RangeError {
            off,
            len,
            region_len: 64,
        };
        assert_eq!(mem.range(0, 64), Ok(0..64));
        assert_eq!(mem.range(64, 0), Ok(64..64));
        assert_eq!(mem.range(60, 8), Err(err(60, 8)));
        assert_eq!(mem.range(65, 0), Err(err(65, 0)));
        assert_eq!(mem.range(usize::MAX, 2), Err(err(usize::MAX, 2)));
        assert_eq!(mem.read(57, &mut [0; 8]), Err(err(57, 8)));
        assert_eq!(mem.write(usize::MAX, &[1]), Err(err(usize::MAX, 1)));
        // SAFETY: nothing else accesses `owned` in this test, and the
        // rejected calls lend nothing.
        unsafe {
            assert_eq!(mem.slice(1, 64), Err(err(1, 64)));
            assert_eq!(
                mem.slice_mut(usize::MAX, usize::MAX),
                Err(err(usize::MAX, usize::MAX))
            );
        }
        // Nothing was written by the rejected calls.
        let mut all = [1; 64];
        mem.read(0, &mut all).unwrap();
        assert_eq!(all, [0; 64]);
    }

    #[test]
    fn copies_and_lent_slices_see_the_same_bytes() {
        let owned = OwnedMem::zeroed(128);
        let mem = owned.mem();
        mem.write(10, b"ping").unwrap();
        // SAFETY: nothing else accesses bytes 10..14 while `lent` lives.
        let lent = unsafe { mem.slice(10, 4) }.unwrap();
        assert_eq!(lent, b"ping");
        // SAFETY: bytes 64..128 are disjoint from `lent`, and nothing else
        // accesses them until `out`'s last use.
        let out = unsafe { mem.slice_mut(64, 64) }.unwrap();
        assert_eq!(mem.as_ptr().wrapping_add(64), out.as_mut_ptr());
        out[..4].copy_from_slice(b"pong");
        let mut back = [0; 4];
        mem.read(64, &mut back).unwrap();
        assert_eq!(&back, b"pong");
        assert_eq!(lent, b"ping");
    }
}

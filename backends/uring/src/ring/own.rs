//! A connection's own receive buffer: heap memory the kernel writes into
//! while a receive is armed.
//!
//! It is held by a raw pointer rather than a `Box<[u8]>`: a box asserts
//! that it alone reaches its memory, so moving it or borrowing the whole
//! slice while the kernel writes into its tail claims what is not true.
//! Here Rust code makes references only to the byte ranges a completion
//! handed over ([`OwnBuf::bytes`]), and gives the kernel a pointer that
//! no reference was taken from ([`OwnBuf::recv_ptr`]).
#![allow(unsafe_code)]

use std::ptr::NonNull;

/// See the module docs. Empty until the first receive needs it.
pub(crate) struct OwnBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an `OwnBuf` owns its allocation as a `Box<[u8]>` would and shares
// it with no other value of this process; sending it to another thread
// sends that ownership.
unsafe impl Send for OwnBuf {}

impl std::fmt::Debug for OwnBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnBuf").field("len", &self.len).finish()
    }
}

impl Default for OwnBuf {
    fn default() -> Self {
        Self {
            ptr: NonNull::dangling(),
            len: 0,
        }
    }
}

impl OwnBuf {
    /// `len` zeroed bytes (zeroed: the kernel never sees memory this
    /// process did not initialise).
    pub(crate) fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self::default();
        }
        let raw = Box::into_raw(vec![0u8; len].into_boxed_slice());
        Self {
            ptr: NonNull::new(raw.cast::<u8>()).expect("a box's pointer is not null"),
            len,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A pointer to byte `at` for a receive (no reference to the buffer is
    /// made). Panics past the end.
    pub(crate) fn recv_ptr(&mut self, at: usize) -> *mut u8 {
        assert!(at <= self.len, "receive offset {at} past {}", self.len);
        self.ptr.as_ptr().wrapping_add(at)
    }

    /// Bytes `from..to`, or `None` when they are not inside the buffer.
    ///
    /// # Safety
    /// While the returned slice lives, nothing writes to those bytes (no
    /// receive armed over them) and the buffer is neither dropped, leaked
    /// nor replaced. The lifetime is the caller's to choose, so that the
    /// connection holding the buffer can be changed meanwhile.
    pub(crate) unsafe fn bytes<'a>(&self, from: usize, to: usize) -> Option<&'a [u8]> {
        if from > to || to > self.len {
            return None;
        }
        // SAFETY: `from..to` is inside the allocation of `len` initialised
        // bytes (checked above); the caller keeps it unwritten and alive
        // for `'a`.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(from), to - from) })
    }

    /// Never free the memory (the kernel may still write into it): the
    /// buffer is empty afterwards.
    pub(crate) fn leak(&mut self) {
        std::mem::forget(std::mem::take(self));
    }
}

impl Drop for OwnBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
            // SAFETY: `ptr` and `len` came from `Box::into_raw` of a boxed
            // slice of `len` bytes (`zeroed`) and are dropped once: `leak`
            // forgets the value instead.
            drop(unsafe { Box::from_raw(raw) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_only_inside_and_leaks_without_freeing() {
        let mut b = OwnBuf::zeroed(64);
        assert_eq!(b.len(), 64);
        let p = b.recv_ptr(8);
        // SAFETY: byte 8 is inside the buffer, and no reference to it lives.
        unsafe { p.write(7) };
        // SAFETY: nothing writes the buffer while `s` lives.
        let s = unsafe { b.bytes(8, 10) }.unwrap();
        assert_eq!(s, &[7, 0]);
        // SAFETY: refused before any slice is made.
        assert!(unsafe { b.bytes(60, 65) }.is_none());
        // SAFETY: as above.
        assert!(unsafe { b.bytes(10, 8) }.is_none());
        b.leak();
        assert!(b.is_empty());
        assert!(OwnBuf::default().is_empty());
        assert!(OwnBuf::zeroed(0).is_empty());
    }
}

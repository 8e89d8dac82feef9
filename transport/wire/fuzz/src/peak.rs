//! The largest single allocation a thread asked for since [`reset`]: the
//! measure behind the checkpoint target's oracle that a reader does not
//! allocate from a count it has not checked against its input.
//!
//! Counting needs the [`Counting`] allocator installed as the binary's
//! `#[global_allocator]` (the `fuzz-checkpoint` driver and the corpus test
//! do); without it [`largest`] stays 0.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    // A const-initialised `Cell` has no destructor and never allocates, so
    // the allocator can touch it.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with` fails only while the thread is being torn down.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

/// Forget what this thread allocated so far.
pub fn reset() {
    LARGEST.with(|l| l.set(0));
}

/// The largest allocation (or reallocation's new size) this thread asked
/// for since [`reset`], in bytes.
pub fn largest() -> usize {
    LARGEST.with(Cell::get)
}

/// The system allocator, noting the size of each request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counting;

// SAFETY: every method forwards its arguments unchanged to `System`, which
// upholds `GlobalAlloc`'s contract; noting a size touches only a
// thread-local `Cell` and neither allocates nor unwinds.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's obligations on `layout` are `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's obligations on `layout` are `System.alloc_zeroed`'s.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (every allocation goes
        // through it) with `layout`, as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` was allocated by `System` with `layout`, and
        // `new_size` meets `realloc`'s conditions, as the caller guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

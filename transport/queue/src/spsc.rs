//! Bounded single-producer / single-consumer ring.
//!
//! Indices are free-running `usize` counters (`slot = index & mask`); the ring
//! is full when `tail - head == capacity` and empty when `tail == head`
//! (wrapping arithmetic). Each handle keeps a private copy of its own index and
//! a cached copy of the peer's index, so the shared cache line of the peer is
//! only read when the cached value says "full" (producer) or "empty"
//! (consumer).

use core::cell::Cell;
use core::fmt;
use core::marker::PhantomData;
use core::mem::{self, MaybeUninit};

use crossbeam_utils::CachePadded;

use crate::sync::{Arc, AtomicUsize, Ordering, UnsafeCell};

type Slot<T> = UnsafeCell<MaybeUninit<T>>;

/// Shared state of one ring.
pub(crate) struct Ring<T> {
    /// Index of the next slot the consumer reads. Written only by the consumer.
    head: CachePadded<AtomicUsize>,
    /// Index of the next slot the producer writes. Written only by the producer.
    tail: CachePadded<AtomicUsize>,
    /// `mask + 1` slots; read-only pointer, lives on its own cache line.
    buf: Box<[Slot<T>]>,
    mask: usize,
}

// SAFETY: the ring owns `T` values and moves them from the producer thread to
// the consumer thread, so `T: Send` is required and sufficient. Slot access is
// coordinated by the head/tail protocol: a slot is written only by the
// producer while it is outside `[head, tail)`, and read only by the consumer
// while it is inside it, with Release/Acquire on the indices ordering the two.
unsafe impl<T: Send> Send for Ring<T> {}
// SAFETY: see the `Send` impl; shared access goes only through the two
// handles, each of which is unique (not `Clone`) and takes `&mut self`.
unsafe impl<T: Send> Sync for Ring<T> {}

impl<T> Ring<T> {
    fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "ring capacity must be non-zero");
        let cap = capacity
            .checked_next_power_of_two()
            .expect("ring capacity overflows usize");
        let buf = (0..cap)
            .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Self {
            head: CachePadded::new(AtomicUsize::new(0)),
            tail: CachePadded::new(AtomicUsize::new(0)),
            buf,
            mask: cap - 1,
        }
    }

    /// Writes `value` into the slot of `index`.
    ///
    /// # Safety
    /// Only the producer may call this, and the slot must be free, i.e.
    /// `index` is outside the consumer-visible range `[head, tail)` and
    /// `index - head < capacity` for the latest `head` read with Acquire.
    #[inline(always)]
    unsafe fn write(&self, index: usize, value: T) {
        // SAFETY: `index & mask < mask + 1 == buf.len()`.
        let slot = unsafe { self.buf.get_unchecked(index & self.mask) };
        // SAFETY: by the caller's contract the consumer has finished with this
        // slot (its Release store of `head` was observed with Acquire) and will
        // not touch it until we publish `tail` past it, so we have exclusive
        // access; writing a `MaybeUninit` never drops the old contents.
        slot.with_mut(|p| unsafe { p.write(MaybeUninit::new(value)) });
    }

    /// Moves the value out of the slot of `index`.
    ///
    /// # Safety
    /// Only the consumer may call this, the slot must be initialised (`index`
    /// is in `[head, tail)` for a `tail` read with Acquire), and the caller must
    /// advance `head` past `index` before reading it again.
    #[inline(always)]
    unsafe fn read(&self, index: usize) -> T {
        // SAFETY: `index & mask < mask + 1 == buf.len()`.
        let slot = unsafe { self.buf.get_unchecked(index & self.mask) };
        // SAFETY: the producer initialised the slot before its Release store
        // of `tail`, which we observed with Acquire; the producer will not
        // write it again until we publish a `head` past it; we take ownership
        // of the value exactly once because the caller advances `head`.
        slot.with(|p| unsafe { p.read().assume_init() })
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        if !mem::needs_drop::<T>() {
            return;
        }
        // Both handles are gone (we hold the last `Arc`), so these are the
        // final values and `[head, tail)` holds exactly the undelivered items.
        let head = self.head.load(Ordering::Acquire);
        let tail = self.tail.load(Ordering::Acquire);
        let mut i = head;
        while i != tail {
            // SAFETY: slots in `[head, tail)` are initialised and nobody else
            // can access the ring any more; each index is read once.
            drop(unsafe { self.read(i) });
            i = i.wrapping_add(1);
        }
    }
}

/// Creates a bounded SPSC ring and returns its two ends.
///
/// `capacity` is rounded up to the next power of two.
///
/// # Panics
/// If `capacity` is zero or its next power of two overflows `usize`.
///
/// ```
/// let (mut tx, mut rx) = starwire_queue::spsc::<u32>(2);
/// assert_eq!(tx.push(1), Ok(()));
/// assert_eq!(tx.push(2), Ok(()));
/// assert_eq!(tx.push(3), Err(3)); // full: the item is handed back
/// assert_eq!(rx.pop(), Some(1));
/// ```
pub fn spsc<T>(capacity: usize) -> (SpscProducer<T>, SpscConsumer<T>) {
    let ring = Arc::new(Ring::new(capacity));
    let mask = ring.mask;
    (
        SpscProducer {
            ring: ring.clone(),
            tail: 0,
            cached_head: 0,
            mask,
            _not_sync: PhantomData,
        },
        SpscConsumer {
            ring,
            head: 0,
            cached_tail: 0,
            _not_sync: PhantomData,
        },
    )
}

/// Producing end of an SPSC ring. `Send`, not `Clone`, not `Sync`.
pub struct SpscProducer<T> {
    ring: Arc<Ring<T>>,
    /// Private copy of `ring.tail` (we are its only writer).
    tail: usize,
    /// Last `ring.head` we observed; the true head is never behind it.
    cached_head: usize,
    mask: usize,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T> SpscProducer<T> {
    /// Number of slots in the ring (a power of two).
    #[inline]
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Number of items currently in the ring (a snapshot).
    pub fn len(&self) -> usize {
        self.tail
            .wrapping_sub(self.ring.head.load(Ordering::Acquire))
    }

    /// Whether the ring is currently empty (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline(always)]
    fn cached_full(&self, tail: usize) -> bool {
        tail.wrapping_sub(self.cached_head) > self.mask
    }

    /// Returns at least `wanted` if that many slots are free, refreshing the
    /// cached head only when the cache says fewer are free.
    #[inline]
    fn free_slots(&mut self, wanted: usize) -> usize {
        let cap = self.mask + 1;
        let mut free = cap - self.tail.wrapping_sub(self.cached_head);
        if free < wanted {
            self.cached_head = self.ring.head.load(Ordering::Acquire);
            free = cap - self.tail.wrapping_sub(self.cached_head);
        }
        free
    }

    /// Whether `wanted` items would fit now (a snapshot: the consumer only
    /// makes more room, so a `true` holds until this producer pushes).
    #[inline]
    pub fn has_room(&mut self, wanted: usize) -> bool {
        self.free_slots(wanted) >= wanted
    }

    /// Pushes one item; if the ring is full the item is handed back in `Err`.
    #[inline]
    pub fn push(&mut self, item: T) -> Result<(), T> {
        let tail = self.tail;
        if self.cached_full(tail) {
            self.cached_head = self.ring.head.load(Ordering::Acquire);
            if self.cached_full(tail) {
                return Err(item);
            }
        }
        // SAFETY: we are the producer and `tail - head < capacity` for a head
        // loaded with Acquire, so the slot is free.
        unsafe { self.ring.write(tail, item) };
        self.tail = tail.wrapping_add(1);
        self.ring.tail.store(self.tail, Ordering::Release);
        Ok(())
    }

    /// Pushes items pulled from `items` until it is exhausted or the ring is
    /// full, then publishes them all with a single Release store. Returns the
    /// number pushed. An item is only pulled from the iterator once there is a
    /// free slot for it, so nothing is dropped: what did not fit stays in
    /// `items`.
    ///
    /// If `items.next()` panics, the items already written are still
    /// published.
    #[inline]
    pub fn push_batch<I: Iterator<Item = T>>(&mut self, items: &mut I) -> usize {
        let start = self.tail;
        let mut guard = PublishTail {
            tail: start,
            producer: self,
        };
        loop {
            let tail = guard.tail;
            if guard.producer.cached_full(tail) {
                guard.producer.cached_head = guard.producer.ring.head.load(Ordering::Acquire);
                if guard.producer.cached_full(tail) {
                    break;
                }
            }
            let Some(item) = items.next() else { break };
            // SAFETY: we are the producer and `tail - head < capacity` for a
            // head loaded with Acquire, so the slot is free.
            unsafe { guard.producer.ring.write(tail, item) };
            guard.tail = tail.wrapping_add(1);
        }
        guard.tail.wrapping_sub(start)
        // `guard` publishes the new tail here.
    }

    /// Moves as many items as fit from the front of `items` into the ring,
    /// preserving order; the rest stay in `items`. Returns the number pushed.
    #[inline]
    pub fn push_vec(&mut self, items: &mut Vec<T>) -> usize {
        let n = self.free_slots(items.len()).min(items.len());
        if n == 0 {
            return 0;
        }
        self.push_batch(&mut items.drain(..n))
    }
}

/// Publishes the producer's new tail when dropped (also on unwind).
struct PublishTail<'a, T> {
    producer: &'a mut SpscProducer<T>,
    tail: usize,
}

impl<T> Drop for PublishTail<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.tail != self.producer.tail {
            self.producer.tail = self.tail;
            self.producer.ring.tail.store(self.tail, Ordering::Release);
        }
    }
}

impl<T> fmt::Debug for SpscProducer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpscProducer")
            .field("capacity", &self.capacity())
            .field("tail", &self.tail)
            .finish_non_exhaustive()
    }
}

/// Consuming end of an SPSC ring. `Send`, not `Clone`, not `Sync`.
pub struct SpscConsumer<T> {
    ring: Arc<Ring<T>>,
    /// Private copy of `ring.head` (we are its only writer).
    head: usize,
    /// Last `ring.tail` we observed; the true tail is never behind it.
    cached_tail: usize,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T> SpscConsumer<T> {
    /// Number of slots in the ring (a power of two).
    #[inline]
    pub fn capacity(&self) -> usize {
        self.ring.mask + 1
    }

    /// Number of items currently in the ring (a snapshot).
    pub fn len(&self) -> usize {
        self.ring
            .tail
            .load(Ordering::Acquire)
            .wrapping_sub(self.head)
    }

    /// Whether the ring is currently empty (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Items ready to pop, up to `wanted`; reloads the shared tail only when
    /// the cached one shows fewer than `wanted`.
    #[inline]
    fn available(&mut self, wanted: usize) -> usize {
        let mut avail = self.cached_tail.wrapping_sub(self.head);
        if avail < wanted {
            self.cached_tail = self.ring.tail.load(Ordering::Acquire);
            avail = self.cached_tail.wrapping_sub(self.head);
        }
        avail.min(wanted)
    }

    /// Pops the oldest item, or `None` if the ring is empty.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        let head = self.head;
        if head == self.cached_tail {
            self.cached_tail = self.ring.tail.load(Ordering::Acquire);
            if head == self.cached_tail {
                return None;
            }
        }
        // SAFETY: we are the consumer and `head < tail` for a tail loaded with
        // Acquire; `head` is advanced right below.
        let item = unsafe { self.ring.read(head) };
        self.head = head.wrapping_add(1);
        self.ring.head.store(self.head, Ordering::Release);
        Some(item)
    }

    /// Pops up to `max` items, passing each to `f` in order, and frees their
    /// slots with a single Release store. Returns the number popped.
    ///
    /// If `f` panics, the items already handed out are still released and
    /// the rest stay in the ring.
    #[inline]
    pub fn drain<F: FnMut(T)>(&mut self, max: usize, mut f: F) -> usize {
        let n = self.available(max);
        if n == 0 {
            return 0;
        }
        let start = self.head;
        let mut guard = PublishHead {
            head: start,
            consumer: self,
        };
        let end = start.wrapping_add(n);
        while guard.head != end {
            let head = guard.head;
            // SAFETY: we are the consumer and `head` is in `[start, start + n)`
            // which is below a tail loaded with Acquire; `guard.head` is
            // advanced before the item is handed out, so even if `f` panics
            // this slot is never read again.
            let item = unsafe { guard.consumer.ring.read(head) };
            guard.head = head.wrapping_add(1);
            f(item);
        }
        n
        // `guard` publishes the new head here.
    }

    /// Pops up to `max` items, appending them to `out`. Returns the number
    /// popped.
    #[inline]
    pub fn pop_batch(&mut self, out: &mut Vec<T>, max: usize) -> usize {
        let n = self.available(max);
        out.reserve(n);
        self.drain(n, |item| out.push(item))
    }

    /// Whether the producer has published anything not yet popped. Used by
    /// the parking protocol after a SeqCst fence.
    #[inline]
    pub(crate) fn has_pending(&self) -> bool {
        self.ring.tail.load(Ordering::Acquire) != self.head
    }
}

/// Publishes the consumer's new head when dropped (also on unwind).
struct PublishHead<'a, T> {
    consumer: &'a mut SpscConsumer<T>,
    head: usize,
}

impl<T> Drop for PublishHead<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.head != self.consumer.head {
            self.consumer.head = self.head;
            self.consumer.ring.head.store(self.head, Ordering::Release);
        }
    }
}

impl<T> fmt::Debug for SpscConsumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpscConsumer")
            .field("capacity", &self.capacity())
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

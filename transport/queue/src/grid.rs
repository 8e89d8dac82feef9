//! The M x N grid of SPSC rings and the eventcount used to park consumers.

use core::cell::Cell;
use core::fmt;
use core::marker::PhantomData;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::spsc::{spsc, SpscConsumer, SpscProducer};
use crate::sync::{self, fence, Arc, AtomicBool, Condvar, Mutex, Ordering};

/// Builds an M x N grid: one SPSC ring of `capacity` slots (rounded up to a
/// power of two) for every (producer, consumer) pair.
///
/// Returns `producers` [`Producer`] handles (index `p` at position `p`) and
/// `consumers` [`Consumer`] handles (index `c` at position `c`). Move each
/// handle to the thread that will use it.
///
/// # Panics
/// If `producers`, `consumers` or `capacity` is zero.
///
/// ```
/// let (mut producers, mut consumers) = starwire_queue::grid::<&str>(2, 1, 4);
/// producers[0].push_to(0, "a").unwrap();
/// producers[1].push_to(0, "b").unwrap();
/// let mut got = Vec::new();
/// consumers[0].pop_batch(&mut got, 8);
/// got.sort();
/// assert_eq!(got, ["a", "b"]);
/// ```
pub fn grid<T>(
    producers: usize,
    consumers: usize,
    capacity: usize,
) -> (Vec<Producer<T>>, Vec<Consumer<T>>) {
    build(producers, consumers, capacity, Wake::Park)
}

/// Builds a grid whose consumers never park: busy-polling reactors
/// (DeepRec's `*_ENABLE_POLLING=true`). Producers then skip the wake check
/// and its SeqCst fence entirely, so a push costs what a push into the bare
/// SPSC ring costs. [`Consumer::park`] on such a grid returns at once.
///
/// # Panics
/// If `producers`, `consumers` or `capacity` is zero.
pub fn grid_polling<T>(
    producers: usize,
    consumers: usize,
    capacity: usize,
) -> (Vec<Producer<T>>, Vec<Consumer<T>>) {
    build(producers, consumers, capacity, Wake::Never)
}

/// Whether consumers may park, fixed when the grid is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// Consumers may park; producers run the eventcount check.
    Park,
    /// Consumers only poll; producers never check.
    Never,
}

fn build<T>(
    producers: usize,
    consumers: usize,
    capacity: usize,
    wake: Wake,
) -> (Vec<Producer<T>>, Vec<Consumer<T>>) {
    assert!(producers > 0, "grid needs at least one producer");
    assert!(consumers > 0, "grid needs at least one consumer");
    let waiters: Vec<Arc<CachePadded<Waiter>>> = (0..consumers)
        .map(|_| Arc::new(CachePadded::new(Waiter::new(wake))))
        .collect();
    // rx[c][p] is the consuming end of the ring p -> c.
    let mut rx: Vec<Vec<SpscConsumer<T>>> = (0..consumers)
        .map(|_| Vec::with_capacity(producers))
        .collect();
    let mut out_producers = Vec::with_capacity(producers);
    for p in 0..producers {
        let mut lanes = Vec::with_capacity(consumers);
        for rx_c in rx.iter_mut() {
            let (tx, r) = spsc(capacity);
            lanes.push(tx);
            rx_c.push(r);
        }
        out_producers.push(Producer {
            index: p,
            lanes: lanes.into_boxed_slice(),
            waiters: waiters.clone().into_boxed_slice(),
            _not_sync: PhantomData,
        });
    }
    let out_consumers = rx
        .into_iter()
        .zip(waiters)
        .enumerate()
        .map(|(c, (lanes, waiter))| Consumer {
            index: c,
            lanes: lanes.into_boxed_slice(),
            next: 0,
            waiter,
            _not_sync: PhantomData,
        })
        .collect();
    (out_producers, out_consumers)
}

/// Per-consumer eventcount.
///
/// Consumer: `sleeping = true; fence(SeqCst); re-check rings; wait for
/// notified`. Producer: `publish tail; fence(SeqCst); if sleeping { notify }`.
/// The two SeqCst fences are totally ordered: if the producer's comes first
/// the consumer's re-check sees the item, otherwise the producer sees
/// `sleeping` and notifies through the mutex-protected flag, which the
/// consumer checks under the same mutex before blocking. So no wakeup is lost.
struct Waiter {
    /// Immutable after construction: whether the consumer may park.
    wake: Wake,
    sleeping: AtomicBool,
    notified: Mutex<bool>,
    cv: Condvar,
}

impl Waiter {
    fn new(wake: Wake) -> Self {
        Self {
            wake,
            sleeping: AtomicBool::new(false),
            notified: Mutex::new(false),
            cv: Condvar::new(),
        }
    }

    /// Producer side, after publishing: one fence and one load when the
    /// consumer is not parked.
    #[inline]
    fn wake(&self) {
        if self.wake == Wake::Never {
            return;
        }
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            self.notify();
        }
    }

    #[cold]
    #[inline(never)]
    fn notify(&self) {
        *sync::lock(&self.notified) = true;
        self.cv.notify_one();
    }

    /// Consumer side: blocks until notified or `deadline` passes, then
    /// consumes the notification.
    fn wait(&self, deadline: Option<Instant>) {
        let mut notified = sync::lock(&self.notified);
        while !*notified {
            match deadline {
                None => notified = self.cv.wait(notified).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    notified = self
                        .cv
                        .wait_timeout(notified, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        *notified = false;
    }
}

/// Wakes the consumer when dropped, so a batch push notifies even if the
/// caller's iterator panics half-way.
struct WakeOnDrop<'a>(&'a Waiter);

impl Drop for WakeOnDrop<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.wake();
    }
}

/// A producer thread's handle: one ring to each consumer.
///
/// `Send`, but neither `Clone` nor `Sync`: exactly one thread produces into
/// each ring.
///
/// ```compile_fail
/// fn sync<S: Sync>() {}
/// sync::<starwire_queue::Producer<u8>>();
/// ```
pub struct Producer<T> {
    index: usize,
    /// `lanes[c]` is the ring to consumer `c`.
    lanes: Box<[SpscProducer<T>]>,
    waiters: Box<[Arc<CachePadded<Waiter>>]>,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T> Producer<T> {
    /// This producer's index in the grid.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Number of consumers (valid targets are `0..consumers()`).
    pub fn consumers(&self) -> usize {
        self.lanes.len()
    }

    /// Capacity of each of this producer's rings.
    pub fn capacity(&self) -> usize {
        self.lanes[0].capacity()
    }

    /// Whether `wanted` items would fit in the ring to `consumer` now (a
    /// snapshot: the consumer only makes more room, so a `true` holds until
    /// this producer pushes there).
    ///
    /// # Panics
    /// If `consumer >= self.consumers()`.
    #[inline]
    pub fn has_room(&mut self, consumer: usize, wanted: usize) -> bool {
        self.lanes[consumer].has_room(wanted)
    }

    /// Pushes `item` to consumer `consumer`, waking it if it is parked. If the
    /// ring is full the item is handed back in `Err`.
    ///
    /// The wake check costs a SeqCst fence (which waits for the tail store to
    /// become visible) plus one load; in tight loops prefer
    /// [`Self::push_batch_to`], which pays it once per batch.
    ///
    /// # Panics
    /// If `consumer >= self.consumers()`.
    #[inline]
    pub fn push_to(&mut self, consumer: usize, item: T) -> Result<(), T> {
        self.lanes[consumer].push(item)?;
        self.waiters[consumer].wake();
        Ok(())
    }

    /// Pushes items from `items` to consumer `consumer` until the iterator is
    /// exhausted or the ring is full (what did not fit stays in `items`);
    /// one index publication and one wake check for the whole batch. Returns
    /// the number pushed.
    ///
    /// # Panics
    /// If `consumer >= self.consumers()`.
    #[inline]
    pub fn push_batch_to<I: Iterator<Item = T>>(
        &mut self,
        consumer: usize,
        items: &mut I,
    ) -> usize {
        let _wake = WakeOnDrop(&self.waiters[consumer]);
        self.lanes[consumer].push_batch(items)
    }

    /// Moves as many items as fit from the front of `items` to consumer
    /// `consumer`, preserving order; the rest stay in `items`. Returns the
    /// number pushed.
    ///
    /// # Panics
    /// If `consumer >= self.consumers()`.
    #[inline]
    pub fn push_vec_to(&mut self, consumer: usize, items: &mut Vec<T>) -> usize {
        let n = self.lanes[consumer].push_vec(items);
        if n > 0 {
            self.waiters[consumer].wake();
        }
        n
    }
}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("index", &self.index)
            .field("consumers", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

/// A consumer (reactor) thread's handle: drains the rings from all producers,
/// round-robin.
///
/// `Send`, but neither `Clone` nor `Sync`.
///
/// ```compile_fail
/// fn sync<S: Sync>() {}
/// sync::<starwire_queue::Consumer<u8>>();
/// ```
pub struct Consumer<T> {
    index: usize,
    /// `lanes[p]` is the ring from producer `p`.
    lanes: Box<[SpscConsumer<T>]>,
    /// Ring to look at first on the next pop.
    next: usize,
    waiter: Arc<CachePadded<Waiter>>,
    _not_sync: PhantomData<Cell<()>>,
}

impl<T> Consumer<T> {
    /// This consumer's index in the grid.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Number of producers feeding this consumer.
    pub fn producers(&self) -> usize {
        self.lanes.len()
    }

    #[inline(always)]
    fn step(&self, i: usize) -> usize {
        if i + 1 == self.lanes.len() {
            0
        } else {
            i + 1
        }
    }

    /// Pops one item. Rings are visited round-robin: after taking an item
    /// from producer `p`'s ring, the next pop starts at producer `p + 1`.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        let mut i = self.next;
        for _ in 0..self.lanes.len() {
            if let Some(item) = self.lanes[i].pop() {
                self.next = self.step(i);
                return Some(item);
            }
            i = self.step(i);
        }
        None
    }

    /// Pops up to `max` items, passing each to `f`. Visits the rings once,
    /// starting one ring further than the previous call (round-robin across
    /// calls), taking as much as is left of `max` from each; each ring's slots
    /// are released with one store. Per-producer order is preserved.
    #[inline]
    pub fn drain<F: FnMut(T)>(&mut self, max: usize, mut f: F) -> usize {
        let start = self.next;
        self.next = self.step(start);
        let mut total = 0;
        let mut i = start;
        loop {
            if total == max {
                break;
            }
            total += self.lanes[i].drain(max - total, &mut f);
            i = self.step(i);
            if i == start {
                break;
            }
        }
        total
    }

    /// Pops up to `max` items, appending them to `out`; see [`Self::drain`].
    #[inline]
    pub fn pop_batch(&mut self, out: &mut Vec<T>, max: usize) -> usize {
        self.drain(max, |item| out.push(item))
    }

    /// Whether all rings are empty (a snapshot).
    pub fn is_empty(&self) -> bool {
        !self.lanes.iter().any(SpscConsumer::has_pending)
    }

    /// Parks the calling thread until some producer pushes to this consumer.
    /// Returns at once if an item is already pending. May return spuriously;
    /// callers poll again after it returns.
    pub fn park(&mut self) {
        self.park_until(None);
    }

    /// Like [`Self::park`] but gives up after `timeout`.
    ///
    /// (Under `--cfg loom` the timeout is not modelled and this behaves like
    /// `park`.)
    pub fn park_timeout(&mut self, timeout: Duration) {
        self.park_until(Instant::now().checked_add(timeout));
    }

    fn park_until(&mut self, deadline: Option<Instant>) {
        let w = &**self.waiter;
        if w.wake == Wake::Never {
            // A polling grid: producers never wake anyone, so never sleep.
            return;
        }
        // Announce the intention to sleep, then re-check: pairs with the
        // producer's `publish; fence(SeqCst); load(sleeping)`.
        w.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if !self.is_empty() {
            w.sleeping.store(false, Ordering::Relaxed);
            return;
        }
        w.wait(deadline);
        w.sleeping.store(false, Ordering::Relaxed);
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("index", &self.index)
            .field("producers", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

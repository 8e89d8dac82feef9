//! [`MemoryBudget`]: one bound on the bytes every connection of a task
//! holds for its peers: chunked messages being reassembled and messages
//! queued to send.
//!
//! Each [`Connection`](crate::Connection) given the budget charges a
//! message's bytes when it queues or starts to reassemble it and releases
//! them once the message has left (or was delivered, or the connection
//! ended). A charge that would pass the limit is refused: the message is
//! handed back ([`SendError::OverBudget`](crate::SendError::OverBudget))
//! or the connection that would need it ends. One atomic compare-and-swap per
//! message, whatever the message's size; connections of every reactor share it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A byte budget shared by connections (cheap to clone: one `Arc`).
#[derive(Debug, Clone)]
pub struct MemoryBudget(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    limit: usize,
    used: AtomicUsize,
}

impl MemoryBudget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: usize) -> Self {
        Self(Arc::new(Inner {
            limit,
            used: AtomicUsize::new(0),
        }))
    }

    /// The limit, in bytes.
    pub fn limit(&self) -> usize {
        self.0.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.0.used.load(Ordering::Relaxed)
    }

    /// Charge `n` bytes if they fit under the limit; false (nothing
    /// charged) if not.
    ///
    /// A compare-and-swap, not an add undone on refusal: a refused charge
    /// must never be seen by another connection's charge, which would be
    /// refused too although it fits (and a refused receive ends its
    /// connection).
    pub fn try_charge(&self, n: usize) -> bool {
        let limit = self.0.limit;
        self.0
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(n).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    /// Charge `n` bytes even past the limit: for the small error replies
    /// that say a request did not fit, which must still be counted.
    pub fn charge(&self, n: usize) {
        self.0.used.fetch_add(n, Ordering::Relaxed);
    }

    /// Give back `n` bytes charged before.
    pub fn release(&self, n: usize) {
        let before = self.0.used.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(before >= n, "released {n} of {before} charged bytes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_fit_under_the_limit_and_a_refused_one_charges_nothing() {
        let b = MemoryBudget::new(100);
        let c = b.clone();
        assert!(b.try_charge(60));
        assert!(!c.try_charge(41), "shared: 60 + 41 > 100");
        assert_eq!(b.used(), 60);
        assert!(c.try_charge(40));
        assert!(!b.try_charge(1));
        b.release(60);
        assert_eq!(c.used(), 40);
        // Past the limit only on purpose.
        c.charge(100);
        assert_eq!(b.used(), 140);
        assert!(!b.try_charge(0), "nothing fits while over the limit");
        c.release(140);
        assert_eq!(b.used(), 0);
        assert!(b.try_charge(100));
    }

    /// Connections on other threads trying charges that can never fit
    /// never make a charge that fits fail (an add undone on refusal let
    /// them, for as long as their bytes were counted).
    #[test]
    fn refused_charges_on_other_threads_never_refuse_one_that_fits() {
        const SMALL: usize = 500;
        const ROUNDS: usize = 200_000;
        let b = MemoryBudget::new(2 * SMALL);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let big = {
            let (b, stop, started) = (b.clone(), Arc::clone(&stop), Arc::clone(&started));
            std::thread::spawn(move || {
                let mut tries = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    assert!(!b.try_charge(2 * SMALL + 1));
                    assert!(!b.try_charge(usize::MAX), "no overflow either");
                    tries += 1;
                    started.store(true, Ordering::Relaxed);
                }
                tries
            })
        };
        let small: Vec<_> = (0..2)
            .map(|_| {
                let (b, started) = (b.clone(), Arc::clone(&started));
                std::thread::spawn(move || {
                    // The refused charges run alongside from the first.
                    while !started.load(Ordering::Relaxed) {
                        std::thread::yield_now();
                    }
                    (0..ROUNDS)
                        .filter(|_| {
                            let fit = b.try_charge(SMALL);
                            if fit {
                                b.release(SMALL);
                            }
                            !fit
                        })
                        .count()
                })
            })
            .collect();
        let refused: Vec<usize> = small.into_iter().map(|t| t.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        assert!(big.join().unwrap() > 0);
        assert_eq!(refused, [0, 0], "charges that fit were refused");
        assert_eq!(b.used(), 0);
    }
}

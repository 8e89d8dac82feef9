//! The park/wake stress that reactor tests share: producers on their own
//! threads push items one at a time into a reactor's queue and wake it.

use std::time::Duration;

use starwire_queue::Producer;

use crate::reactor::ReactorWaker;

/// Push `per` items from each of `txs` (item `p << 32 | i` from producer
/// `p`), waking `waker` after every push and while the queue is full, with
/// a short sleep every `pause_every` items so the reactor parks often.
/// Returns once every item is queued.
pub fn push_and_wake(txs: Vec<Producer<u64>>, waker: &ReactorWaker, per: u64, pause_every: u64) {
    let threads: Vec<_> = txs
        .into_iter()
        .enumerate()
        .map(|(p, mut tx)| {
            let waker = waker.clone();
            std::thread::spawn(move || {
                for i in 0..per {
                    let mut item = (p as u64) << 32 | i;
                    while let Err(back) = tx.push_to(0, item) {
                        item = back;
                        waker.wake();
                        std::thread::yield_now();
                    }
                    waker.wake();
                    if i % pause_every.max(1) == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("producer");
    }
}

/// Panics unless `got` holds every item [`push_and_wake`] sent from
/// `producers` producers of `per` items, each producer's in order.
pub fn assert_all_in_producer_order(got: &[u64], producers: usize, per: u64) {
    assert_eq!(got.len(), producers * per as usize, "items lost or doubled");
    let mut next = vec![0u64; producers];
    for x in got {
        let p = (x >> 32) as usize;
        assert_eq!(x & 0xffff_ffff, next[p], "producer {p} out of order");
        next[p] += 1;
    }
}

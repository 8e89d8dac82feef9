//! Loom model checks. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p starwire-queue --release --test loom`.
#![cfg(loom)]

use loom::model::Builder;
use loom::thread;

use starwire_queue::{grid, spsc};

fn model(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(f);
}

/// Pushes `items` in order, yielding while the ring is full.
fn push_all(tx: &mut starwire_queue::SpscProducer<u32>, items: impl IntoIterator<Item = u32>) {
    for mut item in items {
        loop {
            match tx.push(item) {
                Ok(()) => break,
                Err(back) => {
                    item = back;
                    thread::yield_now();
                }
            }
        }
    }
}

/// Pops exactly `n` items, yielding while the ring is empty.
fn pop_n(rx: &mut starwire_queue::SpscConsumer<u32>, n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    while out.len() < n {
        match rx.pop() {
            Some(v) => out.push(v),
            None => thread::yield_now(),
        }
    }
    out
}

#[test]
fn spsc_order_and_no_loss() {
    model(5, || {
        let (mut tx, mut rx) = spsc::<u32>(4);
        let t = thread::spawn(move || push_all(&mut tx, 0..3));
        assert_eq!(pop_n(&mut rx, 3), [0, 1, 2]);
        t.join().unwrap();
        assert!(rx.pop().is_none());
    });
}

#[test]
fn spsc_wrap_around_tiny_ring() {
    // Capacity 2, four items: indices wrap past the end twice.
    model(5, || {
        let (mut tx, mut rx) = spsc::<u32>(2);
        let t = thread::spawn(move || push_all(&mut tx, 0..4));
        assert_eq!(pop_n(&mut rx, 4), [0, 1, 2, 3]);
        t.join().unwrap();
    });
}

#[test]
fn spsc_full_ring_hands_item_back() {
    model(5, || {
        let (mut tx, mut rx) = spsc::<u32>(1);
        let t = thread::spawn(move || {
            tx.push(1).unwrap();
            // Either the consumer already freed the slot, or we get 2 back.
            match tx.push(2) {
                Ok(()) => vec![],
                Err(back) => vec![back],
            }
        });
        let first = pop_n(&mut rx, 1);
        let returned = t.join().unwrap();
        let mut all = first;
        all.extend(rx.pop());
        all.extend(returned);
        all.sort_unstable();
        assert_eq!(
            all,
            [1, 2],
            "every item is delivered or handed back exactly once"
        );
        assert!(rx.pop().is_none());
    });
}

#[test]
fn spsc_batch_push_and_pop() {
    model(5, || {
        let (mut tx, mut rx) = spsc::<u32>(2);
        let t = thread::spawn(move || {
            let mut items = 0..3u32;
            while !items.is_empty() {
                if tx.push_batch(&mut items) == 0 {
                    thread::yield_now();
                }
            }
        });
        let mut out = Vec::new();
        while out.len() < 3 {
            if rx.pop_batch(&mut out, 2) == 0 {
                thread::yield_now();
            }
        }
        assert_eq!(out, [0, 1, 2]);
        t.join().unwrap();
    });
}

#[test]
fn spsc_drop_with_items_in_flight() {
    // Dropping the handles concurrently must drop undelivered items exactly
    // once (loom's Arc checks for leaks, its cells for racy access).
    model(5, || {
        let (mut tx, mut rx) = spsc::<loom::sync::Arc<u32>>(2);
        let item = loom::sync::Arc::new(7);
        let t = thread::spawn({
            let item = item.clone();
            move || {
                let _ = tx.push(item);
            }
        });
        drop(rx.pop());
        drop(rx);
        t.join().unwrap();
        assert_eq!(loom::sync::Arc::strong_count(&item), 1);
    });
}

#[test]
fn park_is_woken_by_concurrent_push() {
    // If a wakeup could be lost, the consumer would block forever on the
    // condvar and loom would report a deadlock.
    model(5, || {
        let (mut ps, mut cs) = grid::<u32>(1, 1, 2);
        let mut p = ps.pop().unwrap();
        let mut c = cs.pop().unwrap();
        let t = thread::spawn(move || {
            p.push_to(0, 42).unwrap();
        });
        let got = loop {
            if let Some(v) = c.pop() {
                break v;
            }
            c.park();
        };
        assert_eq!(got, 42);
        t.join().unwrap();
    });
}

#[test]
fn park_woken_by_batch_push_from_either_producer() {
    model(3, || {
        let (ps, mut cs) = grid::<u32>(2, 1, 2);
        let mut c = cs.pop().unwrap();
        let handles: Vec<_> = ps
            .into_iter()
            .map(|mut p| {
                thread::spawn(move || {
                    let v = p.index() as u32;
                    assert_eq!(p.push_batch_to(0, &mut core::iter::once(v)), 1);
                })
            })
            .collect();
        let mut got = Vec::new();
        while got.len() < 2 {
            if c.drain(2, |v| got.push(v)) == 0 {
                c.park();
            }
        }
        got.sort_unstable();
        assert_eq!(got, [0, 1]);
        for h in handles {
            h.join().unwrap();
        }
    });
}

#[test]
fn repeated_park_wake_cycles() {
    // Two items pushed one at a time: the consumer may park twice; a stale
    // notification from the first push must not swallow the second.
    model(5, || {
        let (mut ps, mut cs) = grid::<u32>(1, 1, 2);
        let mut p = ps.pop().unwrap();
        let mut c = cs.pop().unwrap();
        let t = thread::spawn(move || {
            p.push_to(0, 1).unwrap();
            p.push_to(0, 2).unwrap();
        });
        let mut got = Vec::new();
        while got.len() < 2 {
            match c.pop() {
                Some(v) => got.push(v),
                None => c.park(),
            }
        }
        assert_eq!(got, [1, 2]);
        t.join().unwrap();
    });
}

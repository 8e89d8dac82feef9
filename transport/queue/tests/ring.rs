//! Single-threaded behaviour of the SPSC ring and the grid.
#![cfg(not(loom))]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use starwire_queue::{grid, spsc};

/// Counts how many instances were dropped.
#[derive(Debug)]
struct Tracked(Arc<AtomicUsize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn capacity_rounds_up_to_power_of_two() {
    assert_eq!(spsc::<u8>(1).0.capacity(), 1);
    assert_eq!(spsc::<u8>(3).0.capacity(), 4);
    assert_eq!(spsc::<u8>(8).1.capacity(), 8);
    assert_eq!(grid::<u8>(1, 1, 5).0[0].capacity(), 8);
}

#[test]
#[should_panic(expected = "non-zero")]
fn zero_capacity_panics() {
    let _ = spsc::<u8>(0);
}

#[test]
fn fifo_and_full_hands_back() {
    let (mut tx, mut rx) = spsc::<String>(2);
    assert!(rx.pop().is_none());
    tx.push("a".into()).unwrap();
    tx.push("b".into()).unwrap();
    assert_eq!(tx.push("c".into()), Err("c".to_string()));
    assert_eq!(tx.len(), 2);
    assert_eq!(rx.pop().as_deref(), Some("a"));
    tx.push("c".into()).unwrap();
    assert_eq!(rx.pop().as_deref(), Some("b"));
    assert_eq!(rx.pop().as_deref(), Some("c"));
    assert!(rx.pop().is_none());
    assert!(rx.is_empty());
}

#[test]
fn wrap_around_many_laps() {
    let (mut tx, mut rx) = spsc::<u32>(4);
    let mut next_pop = 0;
    for i in 0..1000u32 {
        tx.push(i).unwrap();
        if i % 3 == 2 {
            // Keep 0..=3 items in flight so indices cross the mask boundary
            // at every phase.
            while tx.len() > 1 {
                assert_eq!(rx.pop(), Some(next_pop));
                next_pop += 1;
            }
        }
    }
    while let Some(v) = rx.pop() {
        assert_eq!(v, next_pop);
        next_pop += 1;
    }
    assert_eq!(next_pop, 1000);
}

#[test]
fn push_batch_stops_when_full_without_losing_items() {
    let (mut tx, mut rx) = spsc::<u32>(4);
    tx.push(100).unwrap();
    let mut it = 0..10u32;
    assert_eq!(tx.push_batch(&mut it), 3);
    // The iterator was not advanced past what fit.
    assert_eq!(it.next(), Some(3));
    let mut out = Vec::new();
    assert_eq!(rx.pop_batch(&mut out, 2), 2);
    assert_eq!(out, [100, 0]);
    // Wraps around the end of the buffer.
    assert_eq!(tx.push_batch(&mut (3..10u32)), 2);
    let mut seen = Vec::new();
    assert_eq!(rx.drain(usize::MAX, |v| seen.push(v)), 4);
    assert_eq!(seen, [1, 2, 3, 4]);
    assert_eq!(rx.drain(8, |_| unreachable!()), 0);
}

#[test]
fn push_vec_moves_prefix_keeps_rest() {
    let (mut tx, mut rx) = spsc::<u32>(4);
    let mut v: Vec<u32> = (0..6).collect();
    assert_eq!(tx.push_vec(&mut v), 4);
    assert_eq!(v, [4, 5]);
    assert_eq!(tx.push_vec(&mut v), 0);
    assert_eq!(rx.pop(), Some(0));
    assert_eq!(tx.push_vec(&mut v), 1);
    assert_eq!(v, [5]);
    let mut out = Vec::new();
    rx.pop_batch(&mut out, 10);
    assert_eq!(out, [1, 2, 3, 4]);
}

#[test]
fn drop_releases_undelivered_items() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (mut tx, mut rx) = spsc::<Tracked>(8);
    for _ in 0..5 {
        tx.push(Tracked(drops.clone())).unwrap();
    }
    drop(rx.pop());
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    drop(tx);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    drop(rx);
    assert_eq!(drops.load(Ordering::SeqCst), 5);

    let drops = Arc::new(AtomicUsize::new(0));
    let (mut producers, consumers) = grid::<Tracked>(2, 2, 4);
    for p in producers.iter_mut() {
        for c in 0..2 {
            p.push_to(c, Tracked(drops.clone())).unwrap();
        }
    }
    drop(consumers);
    drop(producers);
    assert_eq!(drops.load(Ordering::SeqCst), 4);
}

#[test]
fn panicking_drain_closure_neither_loses_nor_duplicates() {
    let drops = Arc::new(AtomicUsize::new(0));
    let (mut tx, mut rx) = spsc::<Tracked>(8);
    for _ in 0..4 {
        tx.push(Tracked(drops.clone())).unwrap();
    }
    let mut calls = 0;
    let r = catch_unwind(AssertUnwindSafe(|| {
        rx.drain(4, |item| {
            calls += 1;
            drop(item);
            if calls == 2 {
                panic!("boom");
            }
        })
    }));
    assert!(r.is_err());
    assert_eq!(drops.load(Ordering::SeqCst), 2);
    assert_eq!(rx.len(), 2);
    drop((tx, rx));
    assert_eq!(drops.load(Ordering::SeqCst), 4);
}

#[test]
fn panicking_batch_iterator_publishes_what_was_written() {
    let (mut tx, mut rx) = spsc::<u32>(8);
    let r = catch_unwind(AssertUnwindSafe(|| {
        tx.push_batch(&mut (0..5u32).map(|i| if i == 3 { panic!("boom") } else { i }))
    }));
    assert!(r.is_err());
    let mut out = Vec::new();
    rx.pop_batch(&mut out, 8);
    assert_eq!(out, [0, 1, 2]);
}

#[test]
fn grid_routes_and_round_robins() {
    let (mut producers, mut consumers) = grid::<(usize, u32)>(3, 2, 8);
    for p in producers.iter_mut() {
        assert_eq!(p.consumers(), 2);
        for i in 0..4 {
            p.push_to(1, (p.index(), i)).unwrap();
        }
    }
    assert!(consumers[0].pop().is_none());
    assert!(consumers[0].is_empty());
    let c = &mut consumers[1];
    assert_eq!(c.producers(), 3);
    // One item from each producer in turn.
    let firsts: Vec<_> = (0..6).map(|_| c.pop().unwrap()).collect();
    assert_eq!(firsts, [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]);
    // Batches rotate their starting ring.
    let mut out = Vec::new();
    assert_eq!(c.pop_batch(&mut out, 1), 1);
    assert_eq!(c.pop_batch(&mut out, 1), 1);
    assert_eq!(c.pop_batch(&mut out, 1), 1);
    let mut producers_seen: Vec<_> = out.iter().map(|&(p, _)| p).collect();
    producers_seen.sort_unstable();
    assert_eq!(producers_seen, [0, 1, 2]);
    out.clear();
    assert_eq!(c.pop_batch(&mut out, 100), 3);
    assert!(c.is_empty());
}

#[test]
fn grid_batch_push_and_hand_back() {
    let (mut producers, mut consumers) = grid::<u32>(1, 1, 4);
    let p = &mut producers[0];
    assert_eq!(p.push_batch_to(0, &mut (0..3u32)), 3);
    let mut v = vec![3, 4, 5];
    assert_eq!(p.push_vec_to(0, &mut v), 1);
    assert_eq!(v, [4, 5]);
    assert_eq!(p.push_to(0, 9), Err(9));
    let mut seen = Vec::new();
    consumers[0].drain(10, |x| seen.push(x));
    assert_eq!(seen, [0, 1, 2, 3]);
}

#[test]
fn park_returns_immediately_when_items_pending() {
    let (mut producers, mut consumers) = grid::<u32>(2, 1, 4);
    producers[1].push_to(0, 7).unwrap();
    // Would block forever if the pending item were ignored.
    consumers[0].park();
    assert_eq!(consumers[0].pop(), Some(7));
    // Times out when nothing arrives.
    consumers[0].park_timeout(std::time::Duration::from_millis(1));
    assert!(consumers[0].pop().is_none());
}

#[test]
fn handles_are_send() {
    fn send<S: Send>() {}
    send::<starwire_queue::Producer<String>>();
    send::<starwire_queue::Consumer<String>>();
    send::<starwire_queue::SpscProducer<String>>();
    send::<starwire_queue::SpscConsumer<String>>();
}

#[test]
fn has_room_tracks_pushes_and_pops() {
    let (mut p, mut c) = spsc::<u32>(4);
    assert!(p.has_room(4) && !p.has_room(5));
    for i in 0..3 {
        p.push(i).unwrap();
    }
    assert!(p.has_room(1) && !p.has_room(2));
    assert_eq!(c.pop(), Some(0));
    // The pop is seen through the head, not the producer's cached copy.
    assert!(p.has_room(2) && !p.has_room(3));

    let (mut producers, mut consumers) = grid::<u32>(1, 2, 2);
    producers[0].push_to(1, 7).unwrap();
    producers[0].push_to(1, 8).unwrap();
    assert!(!producers[0].has_room(1, 1));
    assert!(producers[0].has_room(0, 2));
    assert_eq!(consumers[1].pop(), Some(7));
    assert!(producers[0].has_room(1, 1) && !producers[0].has_room(1, 2));
}

//! SPSC throughput: starwire's ring vs `crossbeam_queue::ArrayQueue`, one
//! producer pinned on core 0 and one consumer pinned on core 1, moving `u64`s.
//!
//! `queue/batch1/*`: push/pop one item at a time.
//! `queue/batch32/*`: starwire `push_batch`/`drain` of 32; ArrayQueue (no
//! batch API) a loop of 32 `push` / up to 32 `pop`.
//! `queue/*/spsc-ring`: one bare SPSC ring (a cell of the grid).
//! `queue/*/mn-polling`: the 1x1 M:N grid for busy-polling consumers
//! (`grid_polling`: no wake check).
//! `queue/*/mn-parking`: the 1x1 M:N grid whose consumer may park (`grid`:
//! a SeqCst fence and a load per push, once per batch for batch pushes).
#![deny(unsafe_code)]

use std::hint::{black_box, spin_loop};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use starwire_bench::pin_current_thread;

const PRODUCER_CORE: usize = 0;
const CONSUMER_CORE: usize = 1;
const CAPACITY: usize = 1024;
const ITEMS_PER_ITER: u64 = 10_000;
const BATCH: usize = 32;

fn pin(core: usize) {
    if let Err(e) = pin_current_thread(core) {
        eprintln!("warning: cannot pin to core {core}: {e}");
    }
}

/// Runs `produce` on a thread pinned to the producer core and `consume` on the
/// current thread pinned to the consumer core; times the consumer from the
/// common start until it has received `total` items.
fn timed<P, C>(total: u64, produce: P, consume: C) -> Duration
where
    P: FnOnce(u64) + Send + 'static,
    C: FnOnce(u64) -> u64,
{
    let barrier = Arc::new(Barrier::new(2));
    let b = barrier.clone();
    let producer = thread::spawn(move || {
        pin(PRODUCER_CORE);
        b.wait();
        produce(total);
    });
    pin(CONSUMER_CORE);
    barrier.wait();
    let start = Instant::now();
    let sum = consume(total);
    let elapsed = start.elapsed();
    producer.join().unwrap();
    assert_eq!(sum, total * (total - 1) / 2, "items lost or duplicated");
    elapsed
}

fn starwire_batch1(total: u64) -> Duration {
    let (mut tx, mut rx) = starwire_queue::spsc::<u64>(CAPACITY);
    timed(
        total,
        move |total| {
            for i in 0..total {
                let mut item = i;
                while let Err(back) = tx.push(item) {
                    item = back;
                    spin_loop();
                }
            }
        },
        move |total| {
            let (mut n, mut sum) = (0, 0u64);
            while n < total {
                match rx.pop() {
                    Some(v) => {
                        sum = sum.wrapping_add(black_box(v));
                        n += 1;
                    }
                    None => spin_loop(),
                }
            }
            sum
        },
    )
}

fn starwire_batch32(total: u64) -> Duration {
    let (mut tx, mut rx) = starwire_queue::spsc::<u64>(CAPACITY);
    timed(
        total,
        move |total| {
            let mut items = 0..total;
            while !items.is_empty() {
                if tx.push_batch(&mut (&mut items).take(BATCH)) == 0 {
                    spin_loop();
                }
            }
        },
        move |total| {
            let (mut n, mut sum) = (0, 0u64);
            while n < total {
                let got = rx.drain(BATCH, |v| sum = sum.wrapping_add(black_box(v)));
                if got == 0 {
                    spin_loop();
                }
                n += got as u64;
            }
            sum
        },
    )
}

type Grid = fn(
    usize,
    usize,
    usize,
) -> (
    Vec<starwire_queue::Producer<u64>>,
    Vec<starwire_queue::Consumer<u64>>,
);

fn grid_park_batch1(total: u64) -> Duration {
    grid_batch1(starwire_queue::grid, total)
}
fn grid_poll_batch1(total: u64) -> Duration {
    grid_batch1(starwire_queue::grid_polling, total)
}
fn grid_park_batch32(total: u64) -> Duration {
    grid_batch32(starwire_queue::grid, total)
}
fn grid_poll_batch32(total: u64) -> Duration {
    grid_batch32(starwire_queue::grid_polling, total)
}

fn grid_batch1(make: Grid, total: u64) -> Duration {
    let (mut ps, mut cs) = make(1, 1, CAPACITY);
    let (mut tx, mut rx) = (ps.pop().unwrap(), cs.pop().unwrap());
    timed(
        total,
        move |total| {
            for i in 0..total {
                let mut item = i;
                while let Err(back) = tx.push_to(0, item) {
                    item = back;
                    spin_loop();
                }
            }
        },
        move |total| {
            let (mut n, mut sum) = (0, 0u64);
            while n < total {
                match rx.pop() {
                    Some(v) => {
                        sum = sum.wrapping_add(black_box(v));
                        n += 1;
                    }
                    None => spin_loop(),
                }
            }
            sum
        },
    )
}

fn grid_batch32(make: Grid, total: u64) -> Duration {
    let (mut ps, mut cs) = make(1, 1, CAPACITY);
    let (mut tx, mut rx) = (ps.pop().unwrap(), cs.pop().unwrap());
    timed(
        total,
        move |total| {
            let mut items = 0..total;
            while !items.is_empty() {
                if tx.push_batch_to(0, &mut (&mut items).take(BATCH)) == 0 {
                    spin_loop();
                }
            }
        },
        move |total| {
            let (mut n, mut sum) = (0, 0u64);
            while n < total {
                let got = rx.drain(BATCH, |v| sum = sum.wrapping_add(black_box(v)));
                if got == 0 {
                    spin_loop();
                }
                n += got as u64;
            }
            sum
        },
    )
}

fn arrayqueue_batch1(total: u64) -> Duration {
    let q = Arc::new(ArrayQueue::<u64>::new(CAPACITY));
    let tx = q.clone();
    timed(
        total,
        move |total| {
            for i in 0..total {
                let mut item = i;
                while let Err(back) = tx.push(item) {
                    item = back;
                    spin_loop();
                }
            }
        },
        move |total| {
            let (mut n, mut sum) = (0, 0u64);
            while n < total {
                match q.pop() {
                    Some(v) => {
                        sum = sum.wrapping_add(black_box(v));
                        n += 1;
                    }
                    None => spin_loop(),
                }
            }
            sum
        },
    )
}

fn arrayqueue_batch32(total: u64) -> Duration {
    let q = Arc::new(ArrayQueue::<u64>::new(CAPACITY));
    let tx = q.clone();
    timed(
        total,
        move |total| {
            let mut i = 0;
            while i < total {
                let end = (i + BATCH as u64).min(total);
                while i < end {
                    let mut item = i;
                    while let Err(back) = tx.push(item) {
                        item = back;
                        spin_loop();
                    }
                    i += 1;
                }
            }
        },
        move |total| {
            let (mut n, mut sum) = (0, 0u64);
            while n < total {
                let mut got = 0;
                while got < BATCH {
                    match q.pop() {
                        Some(v) => {
                            sum = sum.wrapping_add(black_box(v));
                            got += 1;
                        }
                        None => break,
                    }
                }
                if got == 0 {
                    spin_loop();
                }
                n += got as u64;
            }
            sum
        },
    )
}

type Run = fn(u64) -> Duration;

fn bench_queue(c: &mut Criterion) {
    let groups: [(&str, [(&str, Run); 4]); 2] = [
        (
            "queue/batch1",
            [
                ("arrayqueue", arrayqueue_batch1),
                ("spsc-ring", starwire_batch1),
                ("mn-polling", grid_poll_batch1),
                ("mn-parking", grid_park_batch1),
            ],
        ),
        (
            "queue/batch32",
            [
                ("arrayqueue", arrayqueue_batch32),
                ("spsc-ring", starwire_batch32),
                ("mn-polling", grid_poll_batch32),
                ("mn-parking", grid_park_batch32),
            ],
        ),
    ];
    for (group_name, runs) in groups {
        let mut group = c.benchmark_group(group_name);
        group.throughput(Throughput::Elements(ITEMS_PER_ITER));
        for (name, run) in runs {
            group.bench_function(name, |b| b.iter_custom(|iters| run(iters * ITEMS_PER_ITER)));
        }
        group.finish();
    }
}

criterion_group!(benches, bench_queue);
criterion_main!(benches);

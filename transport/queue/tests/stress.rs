//! Multi-threaded stress tests: exactly-once delivery, per-(producer,
//! consumer) FIFO order, and park/wake under load.
#![cfg(not(loom))]

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use starwire_queue::{grid, Consumer, Producer};

const SEQ_BITS: u32 = 40;

fn encode(producer: usize, seq: u64) -> u64 {
    ((producer as u64) << SEQ_BITS) | seq
}

fn decode(item: u64) -> (usize, u64) {
    ((item >> SEQ_BITS) as usize, item & ((1 << SEQ_BITS) - 1))
}

/// Checks that every item from each producer arrives exactly once and in
/// order; returns true once all `per_producer` items of every producer arrived.
struct Checker {
    consumer: usize,
    next: Vec<u64>,
    per_producer: u64,
    received: u64,
}

impl Checker {
    fn new(consumer: usize, producers: usize, per_producer: u64) -> Self {
        Self {
            consumer,
            next: vec![0; producers],
            per_producer,
            received: 0,
        }
    }

    fn check(&mut self, item: u64) {
        let (p, seq) = decode(item);
        assert_eq!(
            seq, self.next[p],
            "consumer {} got seq {seq} from producer {p}, expected {}",
            self.consumer, self.next[p]
        );
        self.next[p] += 1;
        self.received += 1;
    }

    fn done(&self) -> bool {
        self.received == self.per_producer * self.next.len() as u64
    }

    fn finish(&self) {
        assert!(self.next.iter().all(|&n| n == self.per_producer));
    }
}

/// Sends `per_consumer` sequenced items to every consumer, interleaving
/// targets; odd producers use batch pushes. `pause` yields the CPU every so
/// often so that consumers go idle and park.
fn produce(mut p: Producer<u64>, per_consumer: u64, pause: Option<Duration>) {
    let n = p.consumers();
    let me = p.index();
    let mut next = vec![0u64; n];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ me as u64;
    let mut sent_since_pause = 0u64;
    while next.iter().any(|&s| s < per_consumer) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let c = (rng as usize) % n;
        if next[c] == per_consumer {
            continue;
        }
        let burst = 1 + (rng >> 32) % 48;
        let end = (next[c] + burst).min(per_consumer);
        if me % 2 == 1 {
            let mut items = (next[c]..end).map(|s| encode(me, s));
            let pushed = p.push_batch_to(c, &mut items);
            next[c] += pushed as u64;
            sent_since_pause += pushed as u64;
            if pushed == 0 {
                thread::yield_now();
            }
        } else {
            while next[c] < end {
                match p.push_to(c, encode(me, next[c])) {
                    Ok(()) => {
                        next[c] += 1;
                        sent_since_pause += 1;
                    }
                    Err(item) => {
                        assert_eq!(
                            item,
                            encode(me, next[c]),
                            "full ring must hand back the item"
                        );
                        thread::yield_now();
                        break;
                    }
                }
            }
        }
        if let Some(d) = pause {
            if sent_since_pause >= 256 {
                sent_since_pause = 0;
                thread::sleep(d);
            }
        }
    }
}

fn run(producers: usize, consumers: usize, capacity: usize, per_pair: u64, park: bool) {
    let (ps, cs) = grid::<u64>(producers, consumers, capacity);
    let (done_tx, done_rx) = mpsc::channel();
    let mut handles = Vec::new();
    for c in cs {
        let done_tx = done_tx.clone();
        handles.push(thread::spawn(move || {
            let parks = consume(c, producers, per_pair, park);
            done_tx.send(parks).unwrap();
        }));
    }
    let pause = park.then(|| Duration::from_micros(50));
    for p in ps {
        handles.push(thread::spawn(move || produce(p, per_pair, pause)));
    }
    drop(done_tx);
    let mut parks = 0;
    for _ in 0..consumers {
        // Not a speed assertion: a generous bound that turns a lost wakeup
        // (a consumer parked forever) into a failure instead of a hang.
        match done_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(n) => parks += n,
            Err(e) => panic!("consumer did not finish (lost wakeup or panic): {e}"),
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    if park {
        eprintln!("consumers parked {parks} times");
    }
}

/// Drains until all items arrived; returns how many times it parked.
fn consume(mut c: Consumer<u64>, producers: usize, per_pair: u64, park: bool) -> u64 {
    let mut checker = Checker::new(c.index(), producers, per_pair);
    let mut buf = Vec::with_capacity(64);
    let mut parks = 0;
    let mut round = 0u64;
    while !checker.done() {
        round += 1;
        let got = match round % 3 {
            0 => c.pop().map(|x| checker.check(x)).is_some() as usize,
            1 => c.drain(37, |x| checker.check(x)),
            _ => {
                buf.clear();
                let n = c.pop_batch(&mut buf, 64);
                buf.iter().for_each(|&x| checker.check(x));
                n
            }
        };
        if got == 0 {
            if park {
                parks += 1;
                if round % 2 == 0 {
                    c.park();
                } else {
                    c.park_timeout(Duration::from_secs(3600));
                }
            } else {
                thread::yield_now();
            }
        }
    }
    checker.finish();
    assert!(c.pop().is_none());
    parks
}

#[test]
fn stress_exactly_once_in_order() {
    // 4 x 3 pairs x 200k = 2.4M items.
    run(4, 3, 256, 200_000, false);
}

#[test]
fn stress_tiny_rings() {
    // Constant full/empty transitions and wrap-around.
    run(3, 2, 2, 20_000, false);
}

#[test]
fn stress_park_wake_under_load() {
    run(3, 2, 64, 30_000, true);
}

#[test]
fn spsc_threads_exactly_once_in_order() {
    let (mut tx, mut rx) = starwire_queue::spsc::<u64>(64);
    const N: u64 = 500_000;
    let t = thread::spawn(move || {
        let mut next = 0;
        while next < N {
            let end = (next + 1 + next % 40).min(N);
            let pushed = tx.push_batch(&mut (next..end)) as u64;
            next += pushed;
            if pushed == 0 {
                thread::yield_now();
            }
        }
    });
    let mut expect = 0;
    while expect < N {
        let n = rx.drain(29, |v| {
            assert_eq!(v, expect);
            expect += 1;
        });
        if n == 0 {
            thread::yield_now();
        }
    }
    t.join().unwrap();
    assert!(rx.pop().is_none());
}

/// A polling grid delivers everything exactly once and in per-producer
/// order, with no wake-up machinery at all.
#[test]
fn polling_grid_delivers_exactly_once_in_order() {
    let producers = 3;
    let consumers = 2;
    let per = 50_000u64;
    let (txs, rxs) = starwire_queue::grid_polling::<u64>(producers, consumers, 16);
    let handles: Vec<_> = txs
        .into_iter()
        .map(|mut tx| {
            std::thread::spawn(move || {
                let p = tx.index() as u64;
                for i in 0..per {
                    for c in 0..consumers {
                        let mut item = p << 32 | i;
                        while let Err(back) = tx.push_to(c, item) {
                            item = back;
                            std::thread::yield_now();
                        }
                    }
                }
            })
        })
        .collect();
    let consumers_h: Vec<_> = rxs
        .into_iter()
        .map(|mut rx| {
            std::thread::spawn(move || {
                let mut next = vec![0u64; producers];
                let mut got = 0u64;
                while got < per * producers as u64 {
                    rx.park(); // returns at once on a polling grid
                    let n = rx.drain(64, |x| {
                        let p = (x >> 32) as usize;
                        assert_eq!(x & 0xffff_ffff, next[p], "order broken");
                        next[p] += 1;
                    });
                    if n == 0 {
                        std::thread::yield_now();
                    }
                    got += n as u64;
                }
                next
            })
        })
        .collect();
    for h in handles {
        h.join().expect("producer");
    }
    for h in consumers_h {
        assert_eq!(h.join().expect("consumer"), vec![per; producers]);
    }
}

//! Reactors parked in their io_uring driver (`Driver::park`): the
//! eventcount handshake loses no wake-up, and network input ends a park,
//! with the ring's one enter in place of `poll(2)`.
#![cfg(target_os = "linux")]

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use starwire_queue::{grid, Consumer};
use starwire_transport::reactor::{
    park_driver, IdlePolicy, ParkWaker, Parked, Reactor, ReactorSpec, ReactorState,
};
use starwire_transport::testing::{assert_all_in_producer_order, push_and_wake};
use starwire_transport::{Driver, Sleep};
use starwire_uring::{UringConfig, UringDriver};

use common::{frame, raw_pair, solo};

/// Park the reactor in `driver`, which must park in itself.
fn park_in(driver: &mut UringDriver, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
    assert_eq!(driver.sleep(), Sleep::Own);
    park_driver(driver, waker, timeout)
}

/// A queue consumer whose reactor parks in a driver with one quiet
/// connection: only the producers' wake-ups end its parks.
struct QueueState {
    rx: Consumer<u64>,
    got: Vec<u64>,
    want: usize,
    driver: UringDriver,
}

impl ReactorState for QueueState {
    fn turn(&mut self, now: Instant) -> bool {
        let before = self.got.len();
        let got = &mut self.got;
        self.rx.drain(64, |x| got.push(x));
        let d = &mut self.driver;
        d.rx_burst(now, 32, &mut |_, _: &[u8]| panic!("a quiet peer"));
        d.flush(now) | (self.got.len() > before)
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        park_in(&mut self.driver, waker, timeout)
    }
    fn finished(&self) -> bool {
        self.got.len() >= self.want
    }
}

/// Producers push one item at a time and wake the reactor, which parks in
/// its ring. A lost wake-up would leave it asleep until its (long) park
/// timeout, which the stats record: none may happen.
#[test]
fn a_reactor_parked_in_its_ring_loses_no_wakeup() {
    for policy in [
        IdlePolicy::Park,
        IdlePolicy::PollThenPark(Duration::from_micros(20)),
    ] {
        let producers = 3;
        let per = 10_000u64;
        let (txs, mut rxs) = grid::<u64>(producers, 1, 64);
        let rx = rxs.pop().expect("one consumer");
        let mut spec = ReactorSpec::new(0);
        spec.idle = policy;
        spec.max_park = Duration::from_secs(30);
        let want = producers * per as usize;
        // The peer stays open and silent for the whole run.
        let (_peer, s) = raw_pair();
        let reactor = Reactor::spawn(spec, move |_| QueueState {
            rx,
            got: Vec::new(),
            want,
            driver: solo(s, &UringConfig::default()).0,
        })
        .expect("spawn");
        push_and_wake(txs, &reactor.waker(), per, 500);
        let (state, stats) = reactor.join().expect("reactor");
        assert_all_in_producer_order(&state.got, producers, per);
        assert_eq!(stats.park_timeouts, 0, "a wake-up was lost: {stats:?}");
        assert!(stats.parks > 0, "{stats:?}");
        assert_eq!(stats.driver_parks, stats.parks, "{stats:?}");
        let ring = state.driver.stats();
        assert!(ring.ring_parks > 0, "{ring:?}");
    }
}

/// Frames from a peer, read by a reactor that parks in its driver;
/// `seen` tells the peer how many arrived.
struct FrameState {
    driver: UringDriver,
    got: Vec<Vec<u8>>,
    want: usize,
    seen: Arc<AtomicUsize>,
}

impl ReactorState for FrameState {
    fn turn(&mut self, now: Instant) -> bool {
        let got = &mut self.got;
        let d = &mut self.driver;
        let n = d.rx_burst(now, 32, &mut |_, f: &[u8]| got.push(f.to_vec()));
        if let Some((c, e)) = d.poll_failure() {
            panic!("{c}: {e}");
        }
        self.seen.store(self.got.len(), Ordering::Release);
        d.flush(now) | (n > 0)
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        park_in(&mut self.driver, waker, timeout)
    }
    fn finished(&self) -> bool {
        self.got.len() >= self.want
    }
}

/// Network input ends parks in the driver, in every receive mode, with no
/// park running into its timeout and no `poll(2)`.
#[test]
fn input_wakes_a_reactor_parked_in_its_ring() {
    use starwire_uring::RecvMode;
    for recv in [RecvMode::Single, RecvMode::Multishot, RecvMode::Spin] {
        let (mut peer, s) = raw_pair();
        let mut spec = ReactorSpec::new(0);
        spec.idle = IdlePolicy::Park;
        spec.max_park = Duration::from_secs(30);
        let want = 60;
        let seen = Arc::new(AtomicUsize::new(0));
        let seen_in = Arc::clone(&seen);
        let reactor = Reactor::spawn(spec, move |_| {
            let cfg = UringConfig {
                recv,
                ..UringConfig::default()
            };
            FrameState {
                driver: solo(s, &cfg).0,
                got: Vec::new(),
                want,
                seen: seen_in,
            }
        })
        .expect("spawn");
        let sent: Vec<Vec<u8>> = (0..want as u64)
            .map(|i| frame(i, 64 + 50 * i as usize))
            .collect();
        // Lockstep: each frame goes once the one before was read and the
        // reactor had time to park, so a loaded machine that starts the
        // reactor late cannot hand it the whole stream in one turn.
        for (i, f) in sent.iter().enumerate() {
            while seen.load(Ordering::Acquire) < i {
                std::thread::sleep(Duration::from_micros(100));
            }
            std::thread::sleep(Duration::from_micros(500));
            peer.write_all(f).unwrap();
        }
        let (state, stats) = reactor.join().expect("reactor");
        assert_eq!(state.got, sent, "{recv:?}");
        assert_eq!(stats.park_timeouts, 0, "{recv:?}: {stats:?}");
        assert!(stats.driver_parks > 10, "{recv:?}: {stats:?}");
        assert_eq!(stats.driver_parks, stats.parks, "{recv:?}: {stats:?}");
    }
}

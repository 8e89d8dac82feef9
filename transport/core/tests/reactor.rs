//! Reactors: the park/wake path under stress, socket wake-ups, pinning.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use starwire_queue::{grid, Consumer};
use starwire_transport::reactor::{
    park_fds, IdlePolicy, ParkWaker, Parked, Reactor, ReactorSpec, ReactorState,
};
use starwire_transport::testing::{assert_all_in_producer_order, push_and_wake};

struct Sink {
    rx: Consumer<u64>,
    got: Vec<u64>,
    want: usize,
}

impl ReactorState for Sink {
    fn turn(&mut self, _now: Instant) -> bool {
        let before = self.got.len();
        let got = &mut self.got;
        self.rx.drain(64, |x| got.push(x));
        self.got.len() > before
    }
    fn finished(&self) -> bool {
        self.got.len() >= self.want
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        Parked::Poll(park_fds(waker, &[], &[], timeout))
    }
}

/// Producers push one item at a time and wake the reactor; a lost wake-up
/// would leave the reactor asleep until its (long) park timeout, which the
/// stats record. None may happen.
#[test]
fn no_lost_wakeups_under_stress() {
    for policy in [
        IdlePolicy::Park,
        IdlePolicy::PollThenPark(Duration::from_micros(20)),
    ] {
        let producers = 3;
        let per = 20_000u64;
        let (txs, mut rxs) = grid::<u64>(producers, 1, 64);
        let rx = rxs.pop().expect("one consumer");
        let mut spec = ReactorSpec::new(0);
        spec.idle = policy;
        spec.max_park = Duration::from_secs(30);
        let want = producers * per as usize;
        let reactor = Reactor::spawn(spec, move |_| Sink {
            rx,
            got: Vec::new(),
            want,
        })
        .expect("spawn");
        push_and_wake(txs, &reactor.waker(), per, 1000);
        let (sink, stats) = reactor.join().expect("reactor");
        assert_all_in_producer_order(&sink.got, producers, per);
        assert_eq!(stats.park_timeouts, 0, "a wake-up was lost: {stats:?}");
        // Parks the producers' wake-ups ended are told apart as such.
        assert!(stats.waker_reads > 0, "{stats:?}");
    }
}

struct SocketReader {
    sock: std::net::UdpSocket,
    got: Arc<AtomicU64>,
}

impl ReactorState for SocketReader {
    fn turn(&mut self, _now: Instant) -> bool {
        let mut buf = [0u8; 64];
        let mut any = false;
        while self.sock.recv(&mut buf).is_ok() {
            self.got.fetch_add(1, Ordering::SeqCst);
            any = true;
        }
        any
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        Parked::Poll(park_fds(waker, &[self.sock.as_fd()], &[], timeout))
    }
    fn finished(&self) -> bool {
        self.got.load(Ordering::SeqCst) >= 100
    }
}

/// Network input wakes a parked reactor without any waker call.
#[test]
fn socket_input_wakes_a_parked_reactor() {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    sock.set_nonblocking(true).expect("nonblocking");
    let addr = sock.local_addr().expect("addr");
    let got = Arc::new(AtomicU64::new(0));
    let mut spec = ReactorSpec::new(0);
    spec.idle = IdlePolicy::Park;
    spec.max_park = Duration::from_secs(30);
    let g = got.clone();
    let reactor = Reactor::spawn(spec, move |_| SocketReader { sock, got: g }).expect("spawn");
    let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    // Each datagram goes once the reactor has read the one before and had
    // a moment to park again, so on a loaded machine the datagrams do not
    // pile up while the reactor waits for a cpu (which reads them in one
    // turn with fewer parks).
    for i in 0..100 {
        tx.send_to(b"x", addr).expect("send");
        let t0 = std::time::Instant::now();
        while got.load(Ordering::SeqCst) <= i && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_micros(100));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let (_, stats) = reactor.join().expect("join");
    assert_eq!(got.load(Ordering::SeqCst), 100);
    assert_eq!(stats.park_timeouts, 0, "{stats:?}");
    // Parks that input ended are told apart from wake-ups (poll's revents
    // for the eventfd), so none of them reads the eventfd (at most one
    // wake, the join's, could end a park).
    assert!(stats.parks >= 50, "{stats:?}");
    assert!(stats.waker_reads <= 1, "{stats:?}");
    assert_eq!(stats.driver_parks, 0, "{stats:?}");
    let _ = std::io::stdout().flush();
}

struct SocketWriter {
    sock: std::os::unix::net::UnixStream,
    left: usize,
}

impl ReactorState for SocketWriter {
    fn turn(&mut self, _now: Instant) -> bool {
        let chunk = [7u8; 64 << 10];
        let mut any = false;
        while self.left > 0 {
            match self.sock.write(&chunk[..self.left.min(chunk.len())]) {
                Ok(n) => {
                    self.left -= n;
                    any = true;
                }
                Err(_) => break,
            }
        }
        if self.left == 0 {
            let _ = self.sock.shutdown(std::net::Shutdown::Write);
        }
        any
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        let write: &[BorrowedFd<'_>] = if self.left > 0 {
            &[self.sock.as_fd()]
        } else {
            &[]
        };
        Parked::Poll(park_fds(waker, &[], write, timeout))
    }
    fn finished(&self) -> bool {
        self.left == 0
    }
}

/// A reactor whose socket refused queued bytes parks until the socket takes
/// more (its park's write descriptors), not until `max_park`: a reply half written must
/// not wait for the next request.
#[test]
fn socket_writability_wakes_a_parked_reactor() {
    use std::io::Read;
    let (a, mut b) = std::os::unix::net::UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("nonblocking");
    let total = 8 << 20;
    let mut spec = ReactorSpec::new(0);
    spec.idle = IdlePolicy::Park;
    spec.max_park = Duration::from_secs(30);
    let reactor = Reactor::spawn(spec, move |_| SocketWriter {
        sock: a,
        left: total,
    })
    .expect("spawn");
    // Read late, so the socket fills and the reactor parks with bytes left.
    std::thread::sleep(Duration::from_millis(100));
    let mut all = Vec::new();
    b.read_to_end(&mut all).expect("read");
    let (_, stats) = reactor.join().expect("join");
    assert_eq!(all.len(), total);
    assert!(stats.parks > 0, "the socket never filled: {stats:?}");
    assert_eq!(
        stats.park_timeouts, 0,
        "a writability wake-up was lost: {stats:?}"
    );
}

struct WhereAmI {
    cpu: Option<usize>,
}

impl ReactorState for WhereAmI {
    fn turn(&mut self, _now: Instant) -> bool {
        self.cpu = starwire_placement::current_cpu().ok();
        true
    }
    fn finished(&self) -> bool {
        self.cpu.is_some()
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        Parked::Poll(park_fds(waker, &[], &[], timeout))
    }
}

#[test]
fn reactor_runs_on_its_pinned_core() {
    let cpus = starwire_placement::CpuSet::process_affinity().expect("affinity");
    let cpu = cpus.last().expect("a cpu");
    let mut spec = ReactorSpec::new(0);
    spec.cpu = Some(cpu);
    spec.idle = IdlePolicy::BusyPoll;
    let r = Reactor::spawn(spec, |_| WhereAmI { cpu: None }).expect("spawn");
    let (state, _) = r.join().expect("join");
    assert_eq!(state.cpu, Some(cpu));
}

/// Busy for its first `busy` turns (2 ms each), then idle (1 ms each,
/// sleeping too, so idle time is long enough to tell apart) until `turns`.
struct Alternating {
    turn: u32,
    busy: u32,
    turns: u32,
}

impl ReactorState for Alternating {
    fn turn(&mut self, _now: Instant) -> bool {
        self.turn += 1;
        let busy = self.turn <= self.busy;
        std::thread::sleep(Duration::from_millis(if busy { 2 } else { 1 }));
        busy
    }
    fn finished(&self) -> bool {
        self.turn >= self.turns
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        Parked::Poll(park_fds(waker, &[], &[], timeout))
    }
}

/// `busy_ns` counts the time of busy turns only, and `run_ns` all of it:
/// the bench reads their ratio as the reactor's load.
#[test]
fn busy_time_counts_busy_turns_only() {
    let mut spec = ReactorSpec::new(0);
    spec.idle = IdlePolicy::BusyPoll;
    let r = Reactor::spawn(spec, |_| Alternating {
        turn: 0,
        busy: 10,
        turns: 40,
    })
    .expect("spawn");
    let (_, stats) = r.join().expect("join");
    assert_eq!(stats.busy_turns, 10, "{stats:?}");
    let ms = |ns: u64| ns as f64 / 1e6;
    // 10 busy turns of at least 2 ms; the idle turns (30 of at least 1 ms)
    // are in the run time but not in the busy time.
    assert!(ms(stats.busy_ns) >= 20.0, "{stats:?}");
    assert!(ms(stats.run_ns) >= ms(stats.busy_ns) + 25.0, "{stats:?}");
}

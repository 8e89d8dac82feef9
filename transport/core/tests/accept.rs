//! The acceptor over loopback TCP: routing by preamble to parked reactors,
//! and the sockets it closes (silent, garbage, unknown shard, over the
//! pending cap) while good connections go through.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use starwire_queue::Consumer;
use starwire_transport::accept::{
    dial, inboxes, resolve, AcceptConfig, Acceptor, DialError, Routed,
};
use starwire_transport::preamble::Preamble;
use starwire_transport::reactor::{
    park_fds, IdlePolicy, ParkWaker, Parked, Reactor, ReactorSpec, ReactorState,
};

/// A reactor that takes the streams routed to it and reads what each
/// peer wrote after its preamble.
struct Sink {
    index: u32,
    rx: Consumer<Routed>,
    /// (the routed shard, the bytes after the preamble)
    got: Vec<(u32, Vec<u8>)>,
    want: usize,
}

impl ReactorState for Sink {
    fn turn(&mut self, _now: Instant) -> bool {
        let mut any = false;
        while let Some(mut r) = self.rx.pop() {
            any = true;
            let mut tag = [0u8; 4];
            r.stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            r.stream
                .read_exact(&mut tag)
                .expect("the bytes after the preamble");
            assert_eq!(r.shard, self.index, "routed to the wrong reactor");
            self.got.push((r.shard, tag.to_vec()));
        }
        any
    }
    fn finished(&self) -> bool {
        self.got.len() >= self.want
    }
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        Parked::Poll(park_fds(waker, &[], &[], timeout))
    }
}

/// Two parked sink reactors behind an acceptor with `cfg`, each finishing
/// after `want[i]` streams.
fn start(want: [usize; 2], cfg: AcceptConfig) -> (Acceptor, Vec<Reactor<Sink>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let (tx, rxs) = inboxes(2).expect("queue");
    let mut reactors = Vec::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        let mut spec = ReactorSpec::new(i);
        spec.idle = IdlePolicy::Park;
        // Long: a lost wake-up would show as a stall.
        spec.max_park = Duration::from_secs(30);
        let want = want[i];
        let r = Reactor::spawn(spec, move |_| Sink {
            index: i as u32,
            rx,
            got: Vec::new(),
            want,
        })
        .expect("reactor");
        reactors.push(r);
    }
    let wakers = reactors.iter().map(Reactor::waker).collect();
    let acceptor = Acceptor::spawn(listener, tx, wakers, cfg).expect("acceptor");
    (acceptor, reactors)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// Wait (at most 5 s) until `cond`.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = soon();
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether the acceptor closed `s`: end of stream or a reset.
fn closed_by_peer(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// Whether `s` is still open a little later (nothing to read, no end).
fn still_open(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let mut b = [0u8; 16];
    matches!(s.read(&mut b), Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
}

#[test]
fn sixty_four_connections_reach_the_reactor_of_their_shard() {
    let (acceptor, reactors) = start([32, 32], AcceptConfig::default());
    let addr = acceptor.local_addr().to_string();
    let clients: Vec<_> = (0..64u32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut s = dial(&addr, i % 2, soon()).expect("dial");
                // What follows the preamble stays for the reactor.
                s.write_all(&i.to_le_bytes()).expect("write");
                s
            })
        })
        .collect();
    let _streams: Vec<TcpStream> = clients
        .into_iter()
        .map(|c| c.join().expect("client"))
        .collect();
    let mut seen = Vec::new();
    for (k, r) in reactors.into_iter().enumerate() {
        let (sink, stats) = r.join().expect("reactor");
        assert_eq!(sink.got.len(), 32);
        for (shard, tag) in sink.got {
            let i = u32::from_le_bytes(tag.try_into().expect("4 bytes"));
            assert_eq!(i % 2, shard, "connection {i} on reactor {k}");
            seen.push(i);
        }
        assert_eq!(stats.park_timeouts, 0, "a wake-up was lost: {stats:?}");
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..64).collect::<Vec<_>>());
    // The count follows the hand-over the reactors already saw.
    wait_for("the count", || acceptor.stats().routed == 64);
    assert_eq!(acceptor.stats().accepted, 64);
}

#[test]
fn a_silent_socket_times_out_while_others_go_through() {
    let timeout = Duration::from_secs(1);
    let cfg = AcceptConfig {
        preamble_timeout: timeout,
        ..AcceptConfig::default()
    };
    let (acceptor, reactors) = start([1, 0], cfg);
    let addr = acceptor.local_addr();
    let t0 = Instant::now();
    let mut silent = TcpStream::connect(addr).expect("connect");
    wait_for("the accept", || acceptor.stats().accepted >= 1);
    // A good connection behind the silent one is not held up by it.
    let mut good = dial(&addr.to_string(), 0, soon()).expect("dial");
    good.write_all(b"good").expect("write");
    let mut it = reactors.into_iter();
    let (sink, _) = it.next().expect("reactor 0").join().expect("reactor 0");
    assert_eq!(sink.got, [(0, b"good".to_vec())]);
    assert_eq!(acceptor.stats().timed_out, 0, "waited for the silent one");
    // The silent one is closed once its time is up, not before.
    assert!(closed_by_peer(&mut silent));
    assert!(t0.elapsed() >= timeout);
    assert_eq!(acceptor.stats().timed_out, 1);
}

#[test]
fn garbage_and_unknown_shards_are_closed() {
    let (acceptor, reactors) = start([1, 0], AcceptConfig::default());
    let addr = acceptor.local_addr();
    let mut http = TcpStream::connect(addr).expect("connect");
    http.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("write");
    assert!(closed_by_peer(&mut http));
    // A magic that goes wrong half-way is rejected without waiting for
    // the rest of the preamble.
    let mut half = TcpStream::connect(addr).expect("connect");
    half.write_all(b"SWX").expect("write");
    assert!(closed_by_peer(&mut half));
    let mut unknown = TcpStream::connect(addr).expect("connect");
    unknown
        .write_all(&Preamble { shard: 2 }.emit())
        .expect("write");
    assert!(closed_by_peer(&mut unknown));
    let st = acceptor.stats();
    assert_eq!(
        (st.bad_preamble, st.unknown_shard, st.routed),
        (2, 1, 0),
        "{st:?}"
    );
    // The acceptor serves on.
    let mut good = dial(&addr.to_string(), 0, soon()).expect("dial");
    good.write_all(b"next").expect("write");
    let mut it = reactors.into_iter();
    let (sink, _) = it.next().expect("reactor 0").join().expect("reactor 0");
    assert_eq!(sink.got, [(0, b"next".to_vec())]);
}

#[test]
fn the_pending_cap_closes_the_oldest_silent_socket() {
    let cfg = AcceptConfig {
        preamble_timeout: Duration::from_secs(30),
        max_pending: 4,
        ..AcceptConfig::default()
    };
    let (acceptor, reactors) = start([1, 0], cfg);
    let addr = acceptor.local_addr();
    let mut silent = Vec::new();
    for k in 1..=6u64 {
        silent.push(TcpStream::connect(addr).expect("connect"));
        wait_for("the accept", || acceptor.stats().accepted >= k);
    }
    // Six accepted, four kept: the two oldest were closed.
    wait_for("the evictions", || acceptor.stats().evicted >= 2);
    assert_eq!(acceptor.stats().evicted, 2);
    assert!(closed_by_peer(&mut silent[0]));
    assert!(closed_by_peer(&mut silent[1]));
    for s in &mut silent[2..] {
        assert!(still_open(s));
    }
    // A good connection still goes through, at the cost of the oldest.
    let mut good = dial(&addr.to_string(), 0, soon()).expect("dial");
    good.write_all(b"late").expect("write");
    let mut it = reactors.into_iter();
    let (sink, _) = it.next().expect("reactor 0").join().expect("reactor 0");
    assert_eq!(sink.got, [(0, b"late".to_vec())]);
    assert!(closed_by_peer(&mut silent[2]));
    wait_for("the count", || acceptor.stats().routed == 1);
    let st = acceptor.stats();
    assert_eq!((st.accepted, st.evicted), (7, 3), "{st:?}");
}

#[test]
fn a_name_that_does_not_resolve_is_retried_until_the_deadline() {
    // `.invalid` never resolves (RFC 6761).
    let addr = "starwire-ps-0.invalid:2222";
    let t0 = Instant::now();
    let e = dial(addr, 0, t0 + Duration::from_millis(300)).expect_err("no such name");
    assert!(t0.elapsed() >= Duration::from_millis(300));
    match &e {
        DialError::Resolve {
            addr: a, attempts, ..
        } => {
            assert_eq!(a, addr);
            // 0, 50, 150 ms, then at the deadline.
            assert!(*attempts >= 4, "{e}");
        }
        other => panic!("expected a resolve error, got {other}"),
    }
    assert!(
        e.to_string()
            .starts_with("resolving starwire-ps-0.invalid:2222: "),
        "{e}"
    );
    let e = resolve(addr, Instant::now()).expect_err("no such name");
    assert!(matches!(e, DialError::Resolve { attempts: 1, .. }), "{e}");
    let found = resolve("127.0.0.1:7", Instant::now()).expect("an IP resolves");
    assert_eq!(found, ["127.0.0.1:7".parse().unwrap()]);
}

#[test]
fn dial_retries_until_someone_listens_and_gives_up_at_the_deadline() {
    // Nobody listens on a port just released.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let e = dial(&addr, 0, t0 + Duration::from_millis(200)).expect_err("nobody listens");
    assert!(t0.elapsed() >= Duration::from_millis(200));
    assert!(e.to_string().contains(&addr), "{e}");
    // A listener that comes up late is reached before the deadline.
    let a = addr.clone();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        let l = TcpListener::bind(&a).expect("rebind");
        let (mut s, _) = l.accept().expect("accept");
        let mut pre = [0u8; Preamble::LEN];
        s.read_exact(&mut pre).expect("preamble");
        Preamble::parse(&pre).expect("valid")
    });
    let _s = dial(&addr, 3, soon()).expect("dial");
    assert_eq!(late.join().expect("listener"), Preamble { shard: 3 });
}

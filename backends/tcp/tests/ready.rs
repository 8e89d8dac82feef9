//! The TCP driver's ready list: with many connections a receive pass
//! reads only the sockets with input, frames left in a connection's buffer
//! are still delivered, a failed connection does not keep a park awake,
//! and with few connections every socket is read and polled as before.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use starwire_tcp::{TcpAcceptor, TcpConfig, TcpDriver, READY_LIST_FROM};
use starwire_transport::{ConnId, Driver, TransportError};
use starwire_wire::{Header, Opcode, HEADER_LEN};

/// Passes tried before a test gives up waiting for loopback input.
const PASSES: usize = 20_000;

/// A driver over `n` accepted connections and their raw peers.
fn driver(n: usize) -> (TcpDriver, Vec<(ConnId, TcpStream)>) {
    let (mut d, acceptor) = empty_driver();
    let conns = (0..n).map(|_| connect(&mut d, &acceptor)).collect();
    (d, conns)
}

/// A driver without connections, and an acceptor to give it some.
fn empty_driver() -> (TcpDriver, TcpAcceptor) {
    let cfg = TcpConfig::default();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let acceptor = TcpAcceptor::bind(addr, cfg).unwrap();
    (TcpDriver::new(cfg).unwrap(), acceptor)
}

/// One more connection of `d`, and its raw peer.
fn connect(d: &mut TcpDriver, acceptor: &TcpAcceptor) -> (ConnId, TcpStream) {
    let raw = TcpStream::connect(acceptor.local_addr().unwrap()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let t = loop {
        if let Some(t) = acceptor.poll_accept().unwrap() {
            break t;
        }
        assert!(Instant::now() < deadline, "connection never accepted");
        std::thread::yield_now();
    };
    (d.attach(t), raw)
}

fn frame(id: u64, body_len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + body_len);
    f.extend_from_slice(&Header::new(Opcode::Rpc, id, body_len as u32).to_bytes());
    f.resize(HEADER_LEN + body_len, id as u8);
    f
}

fn read_calls(d: &TcpDriver) -> Vec<u64> {
    d.transports().map(|(_, t)| t.stats().read_calls).collect()
}

/// Passes of at most `max` frames until `want` frames arrived; the
/// connections they came on, in order.
fn receive(d: &mut TcpDriver, max: usize, want: usize) -> Vec<ConnId> {
    let mut got = Vec::new();
    for _ in 0..PASSES {
        d.rx_burst(Instant::now(), max, &mut |c, _| got.push(c));
        if got.len() >= want {
            return got;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    panic!("{} of {want} frames arrived", got.len());
}

/// Whether a park on the driver's descriptors would end within `ms`.
fn wakes_within(d: &TcpDriver, ms: u16) -> bool {
    let mut fds = Vec::new();
    d.wake_fds(&mut fds);
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
        .collect();
    nix::poll::poll(&mut pfds, PollTimeout::from(ms)).unwrap() > 0
}

#[test]
fn many_connections_read_only_the_sockets_with_input() {
    let n = READY_LIST_FROM + 3;
    let (mut d, mut conns) = driver(n);
    // The first pass reads every socket once (input may predate the set).
    assert_eq!(d.rx_burst(Instant::now(), 64, &mut |_, _| {}), 0);
    assert!(
        read_calls(&d).iter().all(|&r| r == 1),
        "{:?}",
        read_calls(&d)
    );
    let before = read_calls(&d);
    let (busy, raw) = &mut conns[3];
    let busy = *busy;
    for id in 1..=3 {
        raw.write_all(&frame(id, 100)).unwrap();
    }
    let got = receive(&mut d, 64, 3);
    assert!(got.iter().all(|c| *c == busy), "{got:?}");
    let after = read_calls(&d);
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        if i == busy.index() {
            assert!(a > b, "the busy socket was read");
        } else {
            assert_eq!(a, b, "idle socket {i} was read");
        }
    }
    // Nothing left: a park sleeps, and its descriptor is the set's one.
    let mut fds = Vec::new();
    d.wake_fds(&mut fds);
    assert_eq!(fds.len(), 1);
    assert!(!wakes_within(&d, 20));
}

#[test]
fn frames_past_a_pass_limit_come_in_the_next_passes_without_input() {
    let (mut d, mut conns) = driver(READY_LIST_FROM);
    d.rx_burst(Instant::now(), 64, &mut |_, _| {});
    let (conn, raw) = &mut conns[1];
    let conn = *conn;
    let mut all = Vec::new();
    for id in 1..=4 {
        all.extend(frame(id, 10));
    }
    raw.write_all(&all).unwrap();
    // The first frame may take a few passes to arrive; the read that
    // brings it takes in all four (one write of a few hundred bytes).
    assert_eq!(receive(&mut d, 1, 1), [conn]);
    let mut ids = Vec::new();
    for _ in 0..3 {
        d.rx_burst(Instant::now(), 1, &mut |_, f| {
            ids.push(f[HEADER_LEN]);
        });
    }
    assert_eq!(ids, [2, 3, 4]);
}

#[test]
fn a_failed_connection_is_reported_once_and_does_not_end_parks() {
    failed_connection_is_reported_once_and_does_not_end_parks(READY_LIST_FROM + 1);
}

/// Below the ready list's threshold the sockets are polled one by one: a
/// failed one (readable for ever at EOF) is left out of them too.
#[test]
fn with_few_connections_a_failed_one_does_not_end_parks() {
    failed_connection_is_reported_once_and_does_not_end_parks(READY_LIST_FROM - 1);
}

fn failed_connection_is_reported_once_and_does_not_end_parks(n: usize) {
    let (mut d, mut conns) = driver(n);
    d.rx_burst(Instant::now(), 64, &mut |_, _| {});
    let (gone, raw) = conns.remove(2);
    drop(raw);
    let mut failed = None;
    for _ in 0..PASSES {
        d.rx_burst(Instant::now(), 64, &mut |_, _| {});
        if let Some(f) = d.poll_failure() {
            failed = Some(f);
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let (conn, e) = failed.expect("the closed peer is reported");
    assert_eq!(conn, gone);
    assert!(matches!(e, TransportError::Closed), "{e:?}");
    d.rx_burst(Instant::now(), 64, &mut |_, _| {});
    assert!(d.poll_failure().is_none());
    assert!(!wakes_within(&d, 20), "the closed socket ends every park");
    // The others still carry frames.
    let (conn, raw) = &mut conns[0];
    raw.write_all(&frame(9, 8)).unwrap();
    assert_eq!(receive(&mut d, 64, 1), [*conn]);
    d.detach(gone);
    assert_eq!(d.len(), n - 1);
}

#[test]
fn few_connections_are_each_read_and_polled() {
    let (mut d, mut conns) = driver(READY_LIST_FROM - 1);
    let mut fds = Vec::new();
    d.wake_fds(&mut fds);
    let mut got: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut want: Vec<_> = d
        .transports()
        .map(|(_, t)| t.stream().as_raw_fd())
        .collect();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want);
    for _ in 0..3 {
        d.rx_burst(Instant::now(), 64, &mut |_, _| {});
    }
    assert!(
        read_calls(&d).iter().all(|&r| r == 3),
        "{:?}",
        read_calls(&d)
    );
    let (conn, raw) = &mut conns[0];
    raw.write_all(&frame(1, 8)).unwrap();
    assert_eq!(receive(&mut d, 64, 1), [*conn]);
}

#[test]
fn input_from_before_the_set_takes_over_is_delivered_and_then_only_ready_sockets_are_read() {
    let (mut d, acceptor) = empty_driver();
    let mut conns: Vec<_> = (0..READY_LIST_FROM - 1)
        .map(|_| connect(&mut d, &acceptor))
        .collect();
    d.rx_burst(Instant::now(), 64, &mut |_, _| {});
    // Bytes wait in the kernel while the driver still reads every socket,
    // then the connection that puts the sockets in the set comes.
    let (early, raw) = &mut conns[0];
    let early = *early;
    raw.write_all(&frame(1, 8)).unwrap();
    conns.push(connect(&mut d, &acceptor));
    assert_eq!(receive(&mut d, 64, 1), [early]);
    let mut fds = Vec::new();
    d.wake_fds(&mut fds);
    assert_eq!(fds.len(), 1, "a park polls the set");
    let before = read_calls(&d);
    let (late, raw) = &mut conns[READY_LIST_FROM - 1];
    let late = *late;
    raw.write_all(&frame(2, 8)).unwrap();
    assert_eq!(receive(&mut d, 64, 1), [late]);
    let after = read_calls(&d);
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        if i != late.index() {
            assert_eq!(a, b, "idle socket {i} was read");
        }
    }
}

//! What a gRPC server bounds: the connections it holds (from accept,
//! authenticated or not), the calls open at once on one connection, how
//! long a connection may stay idle, and how long the token's handshake of
//! an accepted socket may take in all, however its peer trickles it.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestHandler, RPC};
use starwire_grpc::{
    ConnectionId, ConnectionServer, GrpcClient, GrpcConfig, GrpcError, GrpcServer, Handler,
    HandlerError,
};
use starwire_transport::ClusterToken;

const TOKEN: &str = "grpc-bounds-token-0123456789";

fn token() -> Option<ClusterToken> {
    Some(ClusterToken::new(TOKEN.as_bytes()).unwrap())
}

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

fn start(cfg: &GrpcConfig) -> GrpcServer {
    GrpcServer::start_with(loopback(), Arc::new(TestHandler::default()), cfg).unwrap()
}

fn echoes(c: &GrpcClient) -> bool {
    let p = Bytes::from_static(b"hello");
    c.call(RPC, p.clone()).map(|r| r == p).unwrap_or(false)
}

/// Whether the server closes `s` within `within` (what it sends first,
/// such as its HTTP/2 settings, is read past).
fn closed_within(mut s: &TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return false;
        };
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match s.read(&mut [0u8; 256]) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// A good client, retried until `deadline`: the slot of a connection
/// closed by its peer comes back once the server has seen it close.
fn served_by(addr: SocketAddr, cfg: &GrpcConfig, deadline: Instant) -> bool {
    loop {
        if let Ok(c) = GrpcClient::connect_with(addr, cfg) {
            if echoes(&c) {
                return true;
            }
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Without a token: two open sockets (no HTTP/2 yet) hold both slots, a
/// third is closed at accept; once one of the two closes, a client is
/// served again.
#[test]
fn connections_past_max_connections_are_closed_at_accept() {
    let cfg = GrpcConfig {
        max_connections: 2,
        ..GrpcConfig::default()
    };
    let s = start(&cfg);
    let addr = s.local_addr();
    let a = TcpStream::connect(addr).unwrap();
    let b = TcpStream::connect(addr).unwrap();
    let extra = TcpStream::connect(addr).unwrap();
    assert!(
        closed_within(&extra, Duration::from_secs(5)),
        "a third connection was kept"
    );
    assert!(
        !closed_within(&a, Duration::from_millis(200)),
        "a held one closed"
    );
    drop(a);
    assert!(
        served_by(addr, &cfg, Instant::now() + Duration::from_secs(10)),
        "no client served after a slot came back"
    );
    drop(b);
    s.shutdown();
}

/// With a token, sockets still in the handshake count: two silent ones
/// hold both slots, a third is closed at once (not at the handshake
/// timeout); after the timeout closes the silent ones, a client with the
/// token is served.
#[test]
fn unauthenticated_sockets_count_toward_max_connections() {
    let cfg = GrpcConfig {
        token: token(),
        handshake_timeout: Duration::from_secs(3),
        max_connections: 2,
        ..GrpcConfig::default()
    };
    let s = start(&cfg);
    let addr = s.local_addr();
    let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let extra = TcpStream::connect(addr).unwrap();
    let t = Instant::now();
    assert!(
        closed_within(&extra, Duration::from_secs(2)),
        "a socket past max_connections was kept"
    );
    assert!(t.elapsed() < Duration::from_secs(2));
    for q in &silent {
        assert!(
            closed_within(q, Duration::from_secs(10)),
            "a silent peer kept"
        );
    }
    assert!(served_by(
        addr,
        &cfg,
        Instant::now() + Duration::from_secs(10)
    ));
    s.shutdown();
}

/// Counts the calls inside the handler at once.
#[derive(Debug, Default)]
struct Overlap {
    now: AtomicUsize,
    most: AtomicUsize,
}

impl Handler for Overlap {
    fn handle(&self, _opcode: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        self.now.fetch_sub(1, Ordering::SeqCst);
        Ok(payload.to_vec())
    }
}

/// With one stream allowed per connection, calls made at once run one at
/// a time (the server's two runtime threads would run two), and all are
/// answered: the client queues what the server does not take yet.
#[test]
fn max_concurrent_streams_bounds_the_calls_of_a_connection() {
    for (streams, want) in [(1, 1), (8, 2)] {
        let h = Arc::new(Overlap::default());
        let cfg = GrpcConfig {
            max_concurrent_streams: streams,
            ..GrpcConfig::default()
        };
        let s = GrpcServer::start_with(loopback(), h.clone(), &cfg).unwrap();
        let c = GrpcClient::connect_with(s.local_addr(), &cfg).unwrap();
        let calls = (0..6)
            .map(|i| (RPC, Bytes::from(vec![i as u8; 8])))
            .collect();
        for (i, r) in c.call_many(calls).into_iter().enumerate() {
            assert_eq!(r.unwrap(), Bytes::from(vec![i as u8; 8]));
        }
        assert_eq!(
            h.most.load(Ordering::SeqCst),
            want,
            "{streams} streams allowed"
        );
        s.shutdown();
    }
}

/// Without a token, a socket that sends nothing is closed at the handshake
/// timeout (its HTTP/2 preface never came), not at the idle timeout.
#[test]
fn a_silent_socket_is_closed_at_the_handshake_timeout() {
    let cfg = GrpcConfig {
        handshake_timeout: Duration::from_millis(500),
        idle_timeout: Some(Duration::from_secs(600)),
        ..GrpcConfig::default()
    };
    let s = start(&cfg);
    let addr = s.local_addr();
    let silent = TcpStream::connect(addr).unwrap();
    let t = Instant::now();
    assert!(
        closed_within(&silent, Duration::from_secs(10)),
        "a silent socket was kept"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    // A client's connection outlives the handshake timeout.
    let c = GrpcClient::connect_with(addr, &cfg).unwrap();
    assert!(echoes(&c));
    std::thread::sleep(Duration::from_millis(800));
    assert!(echoes(&c));
    s.shutdown();
}

/// Answers each call with the id of the connection it came on.
#[derive(Debug, Default)]
struct Ids;

impl Handler for Ids {
    fn handle(&self, _: u8, _: &[u8]) -> Result<Vec<u8>, HandlerError> {
        Err(HandlerError::Internal("handle_on is called".into()))
    }
    fn handle_on(&self, c: ConnectionId, _: u8, _: &[u8]) -> Result<Vec<u8>, HandlerError> {
        Ok(c.0.to_le_bytes().to_vec())
    }
}

/// A socket that sends nothing is closed at the idle timeout; a client
/// that keeps calling is not: all its calls, from before the idle socket
/// connects to three timeouts later, come on one connection.
#[test]
fn an_idle_connection_is_closed_at_the_idle_timeout() {
    let timeout = Duration::from_millis(1000);
    let cfg = GrpcConfig {
        idle_timeout: Some(timeout),
        ..GrpcConfig::default()
    };
    let s = GrpcServer::start_with(loopback(), Arc::new(Ids), &cfg).unwrap();
    let addr = s.local_addr();
    let busy = GrpcClient::connect_with(addr, &cfg).unwrap();
    let first = busy.call(RPC, Bytes::new()).unwrap();
    let t = Instant::now();
    // Calls 100 ms apart from now on, until three idle timeouts passed.
    let calls = std::thread::spawn(move || {
        let mut ids = Vec::new();
        while t.elapsed() < 3 * timeout {
            ids.push(busy.call(RPC, Bytes::new()));
            std::thread::sleep(Duration::from_millis(100));
        }
        ids
    });
    let idle = TcpStream::connect(addr).unwrap();
    assert!(
        closed_within(&idle, Duration::from_secs(10)),
        "an idle socket was kept"
    );
    assert!(t.elapsed() >= timeout * 8 / 10);
    let ids = calls.join().unwrap();
    assert!(ids.len() >= 10, "{} calls", ids.len());
    for id in ids {
        assert_eq!(
            id.expect("a busy client's call failed"),
            first,
            "a busy client lost its connection"
        );
    }
    s.shutdown();
}

/// Calls carry the id of their connection: two clients get two, the calls
/// of one client the same one.
#[test]
fn calls_carry_their_connection() {
    let s = GrpcServer::start(loopback(), Arc::new(Ids)).unwrap();
    let id = |c: &GrpcClient| c.call(RPC, Bytes::new()).unwrap();
    let (a, b) = (
        GrpcClient::connect(s.local_addr()).unwrap(),
        GrpcClient::connect(s.local_addr()).unwrap(),
    );
    assert_eq!(id(&a), id(&a));
    assert_ne!(id(&a), id(&b));
    s.shutdown();
}

/// A server started on a listener its caller bound serves there.
#[test]
fn a_server_serves_on_the_listener_it_is_given() {
    let l = TcpListener::bind(loopback()).unwrap();
    let addr = l.local_addr().unwrap();
    let s =
        GrpcServer::start_on(l, Arc::new(TestHandler::default()), &GrpcConfig::default()).unwrap();
    assert_eq!(s.local_addr(), addr);
    assert!(echoes(&GrpcClient::connect(addr).unwrap()));
    s.shutdown();
}

/// The handshake of an accepted socket (the bench's data connection) has
/// its timeout in all: a peer sending a byte every 200 ms (each read well
/// within the timeout, the hello alone taking seconds) is refused at the
/// timeout.
#[test]
fn a_trickled_handshake_fails_at_the_total_timeout() {
    let l = TcpListener::bind(loopback()).unwrap();
    let addr = l.local_addr().unwrap();
    let trickler = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        for _ in 0..100 {
            if s.write_all(b"S").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let (sock, _) = l.accept().unwrap();
    let cfg = GrpcConfig {
        token: token(),
        handshake_timeout: Duration::from_secs(1),
        ..GrpcConfig::default()
    };
    let t = Instant::now();
    match ConnectionServer::start(sock, Arc::new(TestHandler::default()), &cfg) {
        Err(GrpcError::Auth(e)) => assert!(e.to_string().contains("within 1 s"), "{e}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a trickling peer was served"),
    }
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the handshake took {took:?}, its timeout is 1 s"
    );
    trickler.join().unwrap();
}

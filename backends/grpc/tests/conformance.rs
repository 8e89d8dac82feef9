//! Message-layer conformance of the gRPC baseline: request/response
//! matching, many calls in flight, large payloads, ordering of sequential
//! calls, the typed pull/push messages, and a peer shutdown.

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestHandler, DENSE_PUSH, DIM, RPC};
use starwire_grpc::{ConnectionServer, GrpcClient, GrpcConfig, GrpcServer, NextCall};

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

fn pair() -> (GrpcServer, GrpcClient) {
    let s = GrpcServer::start(loopback(), Arc::new(TestHandler::default())).unwrap();
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    (s, c)
}

fn payload(i: usize, len: usize) -> Bytes {
    (0..len)
        .map(|j| (i.wrapping_mul(31) ^ j) as u8)
        .collect::<Vec<u8>>()
        .into()
}

#[test]
fn echo_matches_request() {
    let (s, c) = pair();
    for (i, len) in [0usize, 1, 64, 4096, 65_537].into_iter().enumerate() {
        let p = payload(i, len);
        assert_eq!(c.call(RPC, p.clone()).unwrap(), p);
    }
    s.shutdown();
}

#[test]
fn concurrent_calls_each_get_their_own_reply() {
    let (s, c) = pair();
    let reqs: Vec<(u8, Bytes)> = (0..256).map(|i| (RPC, payload(i, 100 + i))).collect();
    let want: Vec<Bytes> = reqs.iter().map(|(_, p)| p.clone()).collect();
    let got = c.call_many(reqs);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.into_iter().zip(want) {
        assert_eq!(g.unwrap(), w);
    }
    s.shutdown();
}

#[test]
fn pipelined_window_completes_every_call() {
    let (s, c) = pair();
    let total = 2_000usize;
    let mut issued = 0usize;
    let mut seen = vec![false; total];
    c.call_pipelined(
        64,
        || {
            if issued == total {
                return NextCall::End;
            }
            issued += 1;
            let i = issued as u32 - 1;
            NextCall::Call(RPC, Bytes::from(i.to_le_bytes().to_vec()), i)
        },
        |r, tag| {
            let b = r.unwrap();
            let i = u32::from_le_bytes(b[..].try_into().unwrap());
            assert_eq!(i, tag, "each call's tag comes back with its reply");
            assert!(!seen[i as usize], "reply {i} twice");
            seen[i as usize] = true;
        },
    );
    assert!(seen.iter().all(|&s| s), "every call answered");
    s.shutdown();
}

/// A source that is not ready: the window waits for the instant it
/// names, near (spinning) and far (a timer), then asks again; no call
/// leaves before its instant.
#[test]
fn pipelined_window_waits_for_the_instant_the_source_names() {
    let (s, c) = pair();
    let t0 = Instant::now();
    // Due 0.5 ms apart (spun), then 5 ms apart (timed).
    let due: Vec<Instant> = (0..6u64)
        .map(|i| t0 + Duration::from_micros(if i < 3 { 500 * i } else { 5_000 * i }))
        .collect();
    let mut issued = 0usize;
    let mut asked_early = 0;
    let mut left = Vec::new();
    c.call_pipelined(
        4,
        || {
            let Some(&at) = due.get(issued) else {
                return NextCall::End;
            };
            let now = Instant::now();
            if now < at {
                asked_early += 1;
                return NextCall::NotBefore(at);
            }
            left.push(now);
            issued += 1;
            NextCall::Call(RPC, Bytes::from_static(b"x"), issued - 1)
        },
        |r, _| assert_eq!(&r.unwrap()[..], b"x"),
    );
    assert_eq!(left.len(), due.len());
    for (l, d) in left.iter().zip(&due) {
        assert!(l >= d, "a call left before its instant");
    }
    assert!(asked_early > 0, "the source was asked again after waiting");
    s.shutdown();
}

#[test]
fn four_mib_payload_round_trips() {
    let (s, c) = pair();
    let p = payload(7, 4 << 20);
    assert_eq!(c.call(RPC, p.clone()).unwrap(), p);
    s.shutdown();
}

#[test]
fn sequential_calls_arrive_in_order() {
    let (s, c) = pair();
    for want in 0u64..200 {
        let b = c.call(DENSE_PUSH, Bytes::new()).unwrap();
        assert_eq!(u64::from_le_bytes(b[..].try_into().unwrap()), want);
    }
    s.shutdown();
}

#[test]
fn typed_pull_push_round_trip() {
    let (s, c) = pair();
    let keys = vec![3u64, 1 << 40, 7];
    let grads: Vec<f32> = (0..keys.len() * DIM).map(|i| i as f32).collect();
    c.sparse_push(1, keys.clone(), DIM, grads.clone()).unwrap();
    let rows = c.sparse_pull(1, keys).unwrap();
    assert_eq!(rows.dim, DIM);
    let want: Vec<f32> = grads.iter().map(|g| -g).collect();
    assert_eq!(rows.values, want);
    // A key never pushed reads as zeros.
    assert_eq!(c.sparse_pull(1, vec![5]).unwrap().values, vec![0.0; DIM]);
    assert_eq!(c.sparse_pull(1, vec![]).unwrap().values, Vec::<f32>::new());

    c.dense_push(0, vec![1.5, -2.0]).unwrap();
    assert_eq!(c.dense_pull(0).unwrap(), vec![1.5, -2.0]);
    s.shutdown();
}

#[test]
fn peer_shutdown_is_a_typed_error() {
    let (s, c) = pair();
    assert!(c.call(RPC, Bytes::from_static(b"x")).is_ok());
    s.shutdown();
    let e = c.call(RPC, Bytes::from_static(b"x")).unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::Unavailable), "{e}");
}

#[test]
fn connection_server_serves_one_socket_until_closed() {
    let l = TcpListener::bind(loopback()).unwrap();
    let addr = l.local_addr().unwrap();
    let client_sock = std::net::TcpStream::connect(addr).unwrap();
    let (server_sock, _) = l.accept().unwrap();
    let cfg = GrpcConfig::default();
    let srv = ConnectionServer::start(server_sock, Arc::new(TestHandler::default()), &cfg).unwrap();
    let c = GrpcClient::from_stream(client_sock, &cfg).unwrap();
    let p = payload(1, 1000);
    assert_eq!(c.call(RPC, p.clone()).unwrap(), p);
    drop(c);
    // Returns once the client has closed the connection.
    srv.wait();
}

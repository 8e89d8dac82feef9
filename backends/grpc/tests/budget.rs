//! A server's memory budget (`GrpcConfig::memory_budget`): requests and
//! replies past it are answered `Overloaded` and the server keeps serving;
//! the bytes of finished calls come back; a peer that reads none of its
//! replies holds their bytes until its connection closes.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use common::RPC;
use prost::Message;
use starwire_grpc::proto::CallRequest;
use starwire_grpc::{GrpcClient, GrpcConfig, GrpcServer, Handler, HandlerError, CALL_PATH};
use starwire_wire::Status as Wire;

const MIB: usize = 1 << 20;

/// Answers an `Rpc` whose payload is a little-endian `u32` n with n bytes,
/// and any other payload with itself.
#[derive(Debug)]
struct Sized;

impl Handler for Sized {
    fn handle(&self, _: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
        Ok(match <[u8; 4]>::try_from(payload) {
            Ok(n) => vec![7u8; u32::from_le_bytes(n) as usize],
            Err(_) => payload.to_vec(),
        })
    }
}

fn start(budget: usize) -> GrpcServer {
    let cfg = GrpcConfig {
        memory_budget: Some(budget),
        ..GrpcConfig::default()
    };
    GrpcServer::start_with(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        Arc::new(Sized),
        &cfg,
    )
    .unwrap()
}

fn reply_of(n: usize) -> Bytes {
    Bytes::copy_from_slice(&(n as u32).to_le_bytes())
}

fn overloaded(r: Result<Bytes, starwire_grpc::GrpcError>) {
    let e = match r {
        // Not the reply itself: megabytes of it would bury the failure.
        Ok(b) => panic!("past the budget, answered with {} bytes", b.len()),
        Err(e) => e,
    };
    assert_eq!(e.wire_status(), Some(Wire::Overloaded), "{e}");
    assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
}

#[test]
fn requests_and_replies_past_the_budget_are_overloaded() {
    let s = start(MIB);
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    overloaded(c.call(RPC, Bytes::from(vec![1u8; 2 * MIB])));
    overloaded(c.call(RPC, reply_of(2 * MIB)));
    // The same connection keeps serving, and what finished calls held
    // came back: many calls of most of the budget pass, one at a time.
    for _ in 0..20 {
        let p = Bytes::from(vec![3u8; 300 << 10]);
        assert_eq!(c.call(RPC, p.clone()).unwrap(), p);
        assert_eq!(c.call(RPC, reply_of(600 << 10)).unwrap().len(), 600 << 10);
    }
    s.shutdown();
}

/// A call sent over a bare HTTP/2 connection whose stream windows are 0:
/// the server can send none of its reply. Its stream stays open as long as
/// the response (future) is kept: h2 resets a stream whose handles are all
/// dropped before it ends (`RST_STREAM CANCEL`), and the server rightly
/// drops the reply of a call its peer cancelled.
fn unread_call(send: &mut h2::client::SendRequest<Bytes>, n: usize) -> h2::client::ResponseFuture {
    let msg = CallRequest {
        opcode: u32::from(RPC),
        payload: reply_of(n),
    }
    .encode_to_vec();
    let mut body = BytesMut::new();
    body.put_u8(0);
    body.put_u32(msg.len() as u32);
    body.put_slice(&msg);
    let req = http::Request::post(format!("http://localhost{CALL_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (rsp, mut stream) = send.send_request(req, false).unwrap();
    stream.send_data(body.freeze(), true).unwrap();
    rsp
}

#[test]
fn a_peer_that_reads_nothing_holds_its_replies_until_it_closes() {
    let s = start(4 * MIB);
    let addr = s.local_addr();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut send, conn) = rt.block_on(async {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(io)
            .await
            .unwrap()
    });
    let conn = rt.spawn(async move {
        let _ = conn.await;
    });
    // Three replies of 1 MiB wait for a window that never opens. The
    // peer keeps their streams open (a dropped response would cancel its
    // call once the connection task next runs) and reads nothing.
    let waiting: Vec<_> = (0..3).map(|_| unread_call(&mut send, MIB)).collect();
    let served = rt.block_on(async {
        let mut served = Vec::new();
        for r in waiting {
            let rsp = r.await.unwrap();
            assert_eq!(rsp.status(), 200);
            // A served call, not a trailers-only error.
            assert_eq!(rsp.headers().get("grpc-status"), None, "{rsp:?}");
            served.push(rsp);
        }
        served
    });
    // They hold 3 MiB of the 4: a reply of 2 MiB does not fit. A reply is
    // charged as hyper takes its data frame from the body, just after its
    // headers are queued, so the peer may see the headers an instant
    // before: retry while one fits, for a while (a budget that does not
    // hold unread replies lets every try through, and fails).
    let c = GrpcClient::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        match c.call(RPC, reply_of(2 * MIB)) {
            Ok(r) if Instant::now() < deadline => assert_eq!(r.len(), 2 * MIB),
            r => break r,
        }
    };
    overloaded(refused);
    assert_eq!(c.call(RPC, reply_of(1000)).unwrap().len(), 1000);
    // Closed, the peer's replies are dropped and their bytes come back.
    drop(served);
    drop(send);
    conn.abort();
    drop(rt);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.call(RPC, reply_of(2 * MIB)) {
            Ok(r) => {
                assert_eq!(r.len(), 2 * MIB);
                break;
            }
            Err(e) if e.wire_status() == Some(Wire::Overloaded) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("the closed peer's replies still hold the budget: {e}"),
        }
    }
    s.shutdown();
}

/// A peer that keeps its flow-control window shut, so that its reply waits
/// in the server with no write on the socket, and pings to look alive, is
/// still closed at the idle timeout: replies none of which left are a
/// stall.
#[test]
fn a_peer_that_never_opens_its_window_is_closed_at_the_idle_timeout() {
    let cfg = GrpcConfig {
        idle_timeout: Some(Duration::from_millis(800)),
        ..GrpcConfig::default()
    };
    let s = GrpcServer::start_with(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        Arc::new(Sized),
        &cfg,
    )
    .unwrap();
    let addr = s.local_addr();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = Instant::now();
    let closed = rt.block_on(async {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, mut conn) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(io)
            .await
            .unwrap();
        let mut pings = conn.ping_pong().unwrap();
        let conn = tokio::spawn(conn);
        let rsp = unread_call(&mut send, MIB);
        let _head = rsp.await.unwrap();
        // A ping every 100 ms keeps bytes moving both ways.
        while t.elapsed() < Duration::from_secs(10) && !conn.is_finished() {
            let _ =
                tokio::time::timeout(Duration::from_millis(100), pings.ping(h2::Ping::opaque()))
                    .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        conn.is_finished()
    });
    assert!(
        closed,
        "a peer holding its reply behind a shut window was kept"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
    // Others are served.
    let c = GrpcClient::connect_with(addr, &cfg).unwrap();
    assert_eq!(c.call(RPC, reply_of(10)).unwrap().len(), 10);
    s.shutdown();
}

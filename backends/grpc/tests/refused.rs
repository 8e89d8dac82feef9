//! A stream the server refuses (`REFUSED_STREAM`, which HTTP/2 promises
//! was not processed) is sent again by the client, a bounded number of
//! times. The server here is a bare HTTP/2 one that refuses the first
//! streams it is given and answers the rest as a gRPC server would.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use prost::Message;
use starwire_grpc::proto::CallReply;
use starwire_grpc::{GrpcClient, GrpcError};

/// Serve HTTP/2 on a loopback port: the first `refuse` streams are reset
/// with `REFUSED_STREAM`, the rest answered with `reply`. Returns the port
/// and the count of streams seen.
fn refusing_server(refuse: usize, reply: &'static [u8]) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            let (s, _) = l.accept().await.unwrap();
            let mut conn = h2::server::handshake(s).await.unwrap();
            while let Some(Ok((req, mut respond))) = conn.accept().await {
                if count.fetch_add(1, Ordering::SeqCst) < refuse {
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                    continue;
                }
                // The body is read on a task of its own: the connection is
                // driven by `accept`.
                tokio::spawn(async move {
                    let mut body = req.into_body();
                    while let Some(Ok(d)) = body.data().await {
                        let _ = body.flow_control().release_capacity(d.len());
                    }
                    let head = http::Response::builder()
                        .status(200)
                        .header("content-type", "application/grpc")
                        .body(())
                        .unwrap();
                    let mut send = respond.send_response(head, false).unwrap();
                    let msg = CallReply {
                        payload: Bytes::from_static(reply),
                    }
                    .encode_to_vec();
                    let mut frame = vec![0u8];
                    frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
                    frame.extend_from_slice(&msg);
                    send.send_data(Bytes::from(frame), false).unwrap();
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                    send.send_trailers(trailers).unwrap();
                });
            }
        });
    });
    (addr, seen)
}

#[test]
fn a_refused_stream_is_sent_again() {
    let (addr, seen) = refusing_server(2, b"answer");
    let c = GrpcClient::connect(addr).unwrap();
    assert_eq!(c.call(1, Bytes::from_static(b"q")).unwrap(), &b"answer"[..]);
    assert_eq!(seen.load(Ordering::SeqCst), 3, "two refusals, one answer");
}

#[test]
fn a_server_that_refuses_every_stream_fails_the_call() {
    let (addr, seen) = refusing_server(usize::MAX, b"");
    let c = GrpcClient::connect(addr).unwrap();
    match c.call(1, Bytes::from_static(b"q")) {
        Err(GrpcError::Status { code, .. }) => assert_eq!(code, tonic::Code::Unavailable),
        r => panic!("{r:?}"),
    }
    let n = seen.load(Ordering::SeqCst);
    assert!((2..=16).contains(&n), "sent {n} times");
}

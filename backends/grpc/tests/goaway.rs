//! A call whose stream a server's GOAWAY leaves out (its id above the
//! frame's last-stream-id, as at a PS's shutdown) was not processed
//! (RFC 9113 section 6.8): the client sends it again on a new connection,
//! as gRPC's transparent retry does, and when it cannot, the call fails
//! `Unavailable` (the connection gone), never `Internal`.
//!
//! The server that sends the GOAWAY speaks HTTP/2 by hand: it reads the
//! client's frames until the call's HEADERS, then sends GOAWAY with
//! last-stream-id 0 and `NO_ERROR`. No timing is involved: the stream is
//! open at the client before the frame leaves. (h2's own server cannot be
//! told which last-stream-id to send: it always names the last stream it
//! read.) Later connections are served by the real server.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use common::{TestHandler, RPC};
use starwire_grpc::{ConnectionServer, GrpcClient, GrpcConfig, GrpcError};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;

fn frame_head(len: usize, kind: u8, flags: u8, stream: u32) -> [u8; 9] {
    let l = u32::try_from(len).unwrap().to_be_bytes();
    let s = stream.to_be_bytes();
    [l[1], l[2], l[3], kind, flags, s[0], s[1], s[2], s[3]]
}

/// On a fresh connection: the server preface, then the client's frames
/// (its SETTINGS acknowledged) up to the first HEADERS, then GOAWAY with
/// last-stream-id 0 and `NO_ERROR`. Returns the connection, for
/// [`drain`].
fn go_away_on_first_call(mut s: TcpStream) -> TcpStream {
    s.write_all(&frame_head(0, SETTINGS, 0, 0)).unwrap();
    let mut preface = [0u8; PREFACE.len()];
    s.read_exact(&mut preface).unwrap();
    assert_eq!(preface, PREFACE);
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).unwrap();
        match (head[3], head[4] & ACK) {
            (SETTINGS, 0) => s.write_all(&frame_head(0, SETTINGS, ACK, 0)).unwrap(),
            (HEADERS, _) => break,
            _ => {}
        }
    }
    let mut goaway = frame_head(8, GOAWAY, 0, 0).to_vec();
    goaway.extend_from_slice(&0u32.to_be_bytes()); // last-stream-id
    goaway.extend_from_slice(&0u32.to_be_bytes()); // NO_ERROR
    s.write_all(&goaway).unwrap();
    s
}

/// Read and drop what the client still sends (the call's body) until it
/// closes the connection, as it does once it has no stream open on it.
fn drain(mut s: TcpStream) {
    let _ = std::io::copy(&mut s, &mut std::io::sink());
}

/// Listen on a loopback port: the first `goaways` connections get a
/// GOAWAY that leaves their first call out, the rest are served by a
/// [`ConnectionServer`] with the tests' handler (which echoes `Rpc`).
/// Returns the address and the count of GOAWAYs sent.
fn going_away_server(goaways: usize) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
    let addr = l.local_addr().unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    let count = sent.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            if count.load(Ordering::SeqCst) < goaways {
                let s = go_away_on_first_call(s);
                count.fetch_add(1, Ordering::SeqCst);
                drain(s);
            } else {
                let cfg = GrpcConfig::default();
                let h = Arc::new(TestHandler::default());
                std::thread::spawn(move || {
                    if let Ok(srv) = ConnectionServer::start(s, h, &cfg) {
                        srv.wait();
                    }
                });
            }
        }
    });
    (addr, sent)
}

#[test]
fn a_call_left_out_by_goaway_is_sent_again_on_a_new_connection() {
    let (addr, sent) = going_away_server(1);
    let c = GrpcClient::connect(addr).unwrap();
    assert_eq!(c.call(RPC, Bytes::from_static(b"q")).unwrap(), &b"q"[..]);
    assert_eq!(sent.load(Ordering::SeqCst), 1);
}

#[test]
fn a_call_left_out_by_every_connection_fails_unavailable() {
    let (addr, sent) = going_away_server(usize::MAX);
    let c = GrpcClient::connect(addr).unwrap();
    match c.call(RPC, Bytes::from_static(b"q")) {
        Err(GrpcError::Status { code, .. }) => assert_eq!(code, tonic::Code::Unavailable),
        r => panic!("{r:?}"),
    }
    let n = sent.load(Ordering::SeqCst);
    assert!((2..=16).contains(&n), "sent {n} times");
}

/// A client on one given socket cannot reconnect: the call left out is the
/// connection gone.
#[test]
fn a_call_left_out_on_the_one_connection_is_unavailable() {
    let l = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || drain(go_away_on_first_call(l.accept().unwrap().0)));
    let c =
        GrpcClient::from_stream(TcpStream::connect(addr).unwrap(), &GrpcConfig::default()).unwrap();
    match c.call(RPC, Bytes::from_static(b"q")) {
        Err(GrpcError::Status { code, .. }) => assert_eq!(code, tonic::Code::Unavailable),
        r => panic!("{r:?}"),
    }
    drop(c);
    server.join().unwrap();
}

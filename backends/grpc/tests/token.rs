//! The cluster token on the gRPC baseline: a server with a token serves
//! only clients that prove it, before any call; a client checks the
//! server's proof in turn. Both the listening server and the bench's
//! one-connection server.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{TestHandler, RPC};
use starwire_grpc::{ConnectionServer, GrpcClient, GrpcConfig, GrpcError, GrpcServer};
use starwire_transport::ClusterToken;

fn cfg(token: Option<&str>) -> GrpcConfig {
    GrpcConfig {
        token: token.map(|t| ClusterToken::new(t.as_bytes()).unwrap()),
        handshake_timeout: Duration::from_secs(2),
        ..GrpcConfig::default()
    }
}

const TOKEN: &str = "grpc-test-token-0123456789";

fn start(c: &GrpcConfig) -> GrpcServer {
    GrpcServer::start_with(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        Arc::new(TestHandler::default()),
        c,
    )
    .unwrap()
}

/// Whether the server closed `s` (rather than the read timing out).
fn closed(mut s: &TcpStream) -> bool {
    match s.read(&mut [0u8; 64]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

fn echoes(c: &GrpcClient) -> bool {
    let p = Bytes::from_static(b"hello");
    c.call(RPC, p.clone()).map(|r| r == p).unwrap_or(false)
}

#[test]
fn a_server_with_a_token_serves_only_clients_that_prove_it() {
    let s = start(&cfg(Some(TOKEN)));
    let addr = s.local_addr();
    // No token, or another one: no call is served.
    for c in [None, Some("grpc-test-token-another-one")] {
        match GrpcClient::connect_with(addr, &cfg(c)) {
            Err(GrpcError::Connect { .. }) => {}
            Ok(client) => assert!(!echoes(&client), "served a client with token {c:?}"),
            Err(e) => panic!("{e}"),
        }
    }
    // Bytes that are no handshake are closed at once, and a silent peer
    // at the handshake timeout.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    raw.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    assert!(closed(&raw), "a peer without the handshake kept");
    let silent = TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(closed(&silent), "a silent peer kept");
    // The real client is served, also after those.
    let good = GrpcClient::connect_with(addr, &cfg(Some(TOKEN))).unwrap();
    assert!(echoes(&good));
    s.shutdown();
}

#[test]
fn a_client_with_a_token_refuses_a_server_without_it() {
    let s = start(&cfg(None));
    match GrpcClient::connect_with(s.local_addr(), &cfg(Some(TOKEN))) {
        Err(GrpcError::Connect { .. }) => {}
        Ok(client) => assert!(!echoes(&client), "a server without the token was used"),
        Err(e) => panic!("{e}"),
    }
    s.shutdown();
}

/// One accepted connection (the bench's data connection), the server with
/// `server` and the client with `client` as tokens.
fn one_connection(server: Option<&str>, client: Option<&str>) -> bool {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    let server_cfg = cfg(server);
    let srv = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        match ConnectionServer::start(s, Arc::new(TestHandler::default()), &server_cfg) {
            Ok(srv) => {
                srv.wait();
                true
            }
            Err(GrpcError::Auth(_)) => false,
            Err(e) => panic!("{e}"),
        }
    });
    let served = match GrpcClient::from_stream(TcpStream::connect(addr).unwrap(), &cfg(client)) {
        Ok(c) => echoes(&c),
        Err(GrpcError::Auth(_) | GrpcError::Connect { .. }) => false,
        Err(e) => panic!("{e}"),
    };
    let accepted = srv.join().unwrap();
    served && accepted
}

#[test]
fn a_connection_server_with_a_token_serves_only_a_client_that_proves_it() {
    assert!(one_connection(Some(TOKEN), Some(TOKEN)));
    assert!(one_connection(None, None));
    assert!(!one_connection(Some(TOKEN), None));
    assert!(!one_connection(
        Some(TOKEN),
        Some("grpc-test-token-another-one")
    ));
    assert!(!one_connection(None, Some(TOKEN)));
}

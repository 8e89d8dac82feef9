//! The transport conformance suite over real loopback TCP sockets.

use std::net::{SocketAddr, TcpListener, TcpStream};

use starwire_tcp::{TcpConfig, TcpTransport};
use starwire_transport::conformance;

fn pair(cfg: &TcpConfig) -> (TcpTransport, TcpTransport) {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
    let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (s, _) = l.accept().expect("accept");
    (
        TcpTransport::new(c, *cfg).expect("client"),
        TcpTransport::new(s, *cfg).expect("server"),
    )
}

#[test]
fn tcp_default_config() {
    let cfg = TcpConfig::default();
    conformance::run_all("tcp", || pair(&cfg));
}

#[test]
fn tcp_small_frames_and_queues() {
    let cfg = TcpConfig {
        max_frame_len: 4096,
        tx_queue_limit_bytes: 16 * 1024,
        rx_buffer_len: 8192,
        ..TcpConfig::default()
    };
    conformance::run_all("tcp-small", || pair(&cfg));
}

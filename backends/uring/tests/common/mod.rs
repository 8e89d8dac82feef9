//! Helpers the integration tests share.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use starwire_transport::wire::{Header, Opcode};
use starwire_transport::Transport;
use starwire_uring::{Ring, UringTransport};

/// A connected loopback pair: (client, accepted).
pub fn raw_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

/// A valid RPC frame: header `id` and `body` bytes derived from it.
pub fn frame(id: u64, body: usize) -> Vec<u8> {
    let mut f = Header::new(Opcode::Rpc, id, body as u32)
        .to_bytes()
        .to_vec();
    f.extend((0..body).map(|i| (i as u64 ^ id) as u8));
    f
}

/// `poll(2)` for readability of the ring's park descriptor (`fd()`, which
/// arms it) for at most `ms`: 1 when readable, 0 on timeout.
pub fn poll_park_fd(r: &Ring, ms: i32) -> i32 {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: r.fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) }
}

/// Enter `r` and receive on `t` until at least one frame came (5 s at
/// most); `what` names the case in the panic.
pub fn next_frames(r: &Ring, t: &mut UringTransport, what: &str) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.is_empty() {
        assert!(Instant::now() < deadline, "{what}: no frame");
        r.enter().unwrap();
        t.rx_burst(Instant::now(), 8, &mut |x: &[u8]| got.push(x.to_vec()))
            .unwrap();
    }
    got
}

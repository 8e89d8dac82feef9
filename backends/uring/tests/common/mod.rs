//! Helpers the integration tests share.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use starwire_transport::wire::{Header, Opcode};
use starwire_transport::{ConnId, Driver, StreamDriver, TransportError};
use starwire_uring::{UringConfig, UringDriver};

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

/// A driver with `stream` as its one connection.
pub fn solo(stream: TcpStream, cfg: &UringConfig) -> (UringDriver, ConnId) {
    let mut d = UringDriver::new(cfg).unwrap();
    let id = d.attach_stream(stream).unwrap();
    (d, id)
}

/// One turn of `d` with nothing new to send: the flush (its enter queues
/// receives again and reaps), then a receive pass lending up to `max`
/// frames of each connection to `sink`. Returns the frames delivered, or
/// the first failure the turn reported.
pub fn turn(
    d: &mut UringDriver,
    max: usize,
    sink: &mut dyn FnMut(ConnId, &[u8]),
) -> Result<usize, (ConnId, TransportError)> {
    let now = Instant::now();
    d.flush(now);
    let n = d.rx_burst(now, max, sink);
    if let Some(f) = d.poll_failure() {
        return Err(f);
    }
    Ok(n)
}

/// Turns of `d` until an error or `limit` frames (5 s at most); returns
/// the frames and the error.
pub fn drain(d: &mut UringDriver, limit: usize) -> (Vec<Vec<u8>>, Option<TransportError>) {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && got.len() < limit {
        match turn(d, 32, &mut |_, f: &[u8]| got.push(f.to_vec())) {
            Ok(_) => std::thread::yield_now(),
            Err((_, e)) => return (got, Some(e)),
        }
    }
    (got, None)
}

/// `poll(2)` for readability of the driver's park descriptor
/// (`wake_fds`, which arms it) for at most `ms`: 1 when readable, 0 on
/// timeout.
pub fn poll_park_fd(d: &UringDriver, ms: i32) -> i32 {
    use std::os::fd::AsRawFd;
    let mut fds = Vec::new();
    d.wake_fds(&mut fds);
    assert_eq!(fds.len(), 1, "one park descriptor");
    let mut p = libc::pollfd {
        fd: fds[0].as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) }
}

/// Turns of `d` until at least one frame came (5 s at most); `what`
/// names the case in the panic.
pub fn next_frames(d: &mut UringDriver, what: &str) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.is_empty() {
        assert!(Instant::now() < deadline, "{what}: no frame");
        turn(d, 8, &mut |_, x: &[u8]| got.push(x.to_vec())).unwrap();
    }
    got
}

/// `n` loopback connections between two fresh drivers: `a_ids[i]` on the
/// first is connected to `b_ids[i]` on the second. Each end is attached
/// with `attach_stream`, as a reactor attaches what its listener accepted.
pub fn driver_pair(
    cfg: &UringConfig,
    n: usize,
) -> (UringDriver, Vec<ConnId>, UringDriver, Vec<ConnId>) {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
    let addr = l.local_addr().expect("addr");
    let mut a = UringDriver::new(cfg).expect("driver a");
    let mut b = UringDriver::new(cfg).expect("driver b");
    let (mut a_ids, mut b_ids) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let c = TcpStream::connect(addr).expect("connect");
        let (s, _) = l.accept().expect("accept");
        a_ids.push(a.attach_stream(c).expect("attach a"));
        b_ids.push(b.attach_stream(s).expect("attach b"));
    }
    (a, a_ids, b, b_ids)
}

/// Frames both ways over every connection of a [`driver_pair`]: each end
/// sends `per_conn` frames of mixed lengths (up to `max_body`) on each of
/// its connections, through `tx_reserve` and `tx_gather` alternately, and
/// each frame must arrive once, in order, intact, on the connection's
/// other end. Back-pressure is waited out; `what` names the case in a
/// panic.
pub fn exchange(
    (a, a_ids, b, b_ids): &mut (UringDriver, Vec<ConnId>, UringDriver, Vec<ConnId>),
    per_conn: u64,
    max_body: usize,
    what: &str,
) {
    let n = a_ids.len();
    let body = |conn: usize, k: u64| ((conn * 7919) as u64 + k * 131) as usize % (max_body + 1);
    // Frame ids carry the connection and the sequence number.
    let id = |conn: usize, k: u64| ((conn as u64) << 32) | k;
    let mut sent = [vec![0u64; n], vec![0u64; n]];
    let mut got = [vec![0u64; n], vec![0u64; n]];
    let deadline = Instant::now() + Duration::from_secs(60);
    let total = n as u64 * per_conn;
    while got.iter().flatten().sum::<u64>() < 2 * total {
        assert!(Instant::now() < deadline, "{what}: stalled: got {got:?}");
        let now = Instant::now();
        for (side, (d, ids)) in [(&mut *a, &*a_ids), (&mut *b, &*b_ids)]
            .into_iter()
            .enumerate()
        {
            for (i, &c) in ids.iter().enumerate() {
                while sent[side][i] < per_conn {
                    let k = sent[side][i];
                    let f = frame(id(i, k), body(i, k));
                    let queued = if k % 2 == 0 {
                        match d.tx_reserve(c, f.len()).expect("tx_reserve") {
                            Some(buf) => {
                                buf.copy_from_slice(&f);
                                d.tx_commit(c, f.len());
                                true
                            }
                            None => false,
                        }
                    } else {
                        let (h, rest) = f.split_at(starwire_transport::wire::HEADER_LEN);
                        d.tx_gather(c, h, &[bytes::Bytes::copy_from_slice(rest)])
                            .expect("tx_gather")
                    };
                    if !queued {
                        break;
                    }
                    sent[side][i] += 1;
                }
            }
            d.flush(now);
        }
        for (side, (d, ids)) in [(&mut *b, &*b_ids), (&mut *a, &*a_ids)]
            .into_iter()
            .enumerate()
        {
            // `side` 0 receives what `a` sent (on `b`), 1 what `b` sent.
            let got = &mut got[side];
            d.rx_burst(now, 64, &mut |c: ConnId, f: &[u8]| {
                let i = ids
                    .iter()
                    .position(|&x| x == c)
                    .expect("a known connection");
                assert!(got[i] < per_conn, "{what}: conn {i}: more frames than sent");
                let k = got[i];
                assert!(
                    f == frame(id(i, k), body(i, k)),
                    "{what}: conn {i} frame {k}"
                );
                got[i] += 1;
            });
            if let Some((c, e)) = d.poll_failure() {
                panic!("{what}: {c} failed: {e}");
            }
        }
    }
}

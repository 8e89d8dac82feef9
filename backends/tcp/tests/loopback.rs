//! Real sockets on 127.0.0.1. Both ends are driven from one thread by
//! alternating `flush` and `rx_burst`; every loop has an iteration bound so
//! a bug fails instead of hanging.

use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Instant;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use starwire_tcp::{TcpAcceptor, TcpConfig, TcpTransport, MAX_IOVECS};
use starwire_transport::{Transport, TransportError};
use starwire_wire::{FrameError, Header, Opcode, HEADER_LEN};

/// Upper bound on driver iterations; each makes at least one system call.
const ITERATIONS: usize = 2_000_000;

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A connected pair: (client with `a`, accepted server with `b`).
fn pair(a: TcpConfig, b: TcpConfig) -> (TcpTransport, TcpTransport) {
    let acceptor = TcpAcceptor::bind(localhost(), b).unwrap();
    let client = TcpTransport::connect(acceptor.local_addr().unwrap(), a).unwrap();
    for _ in 0..ITERATIONS {
        if let Some(server) = acceptor.poll_accept().unwrap() {
            assert_eq!(server.peer_addr().unwrap(), client.local_addr().unwrap());
            return (client, server);
        }
        std::thread::yield_now();
    }
    panic!("connection never accepted");
}

/// A raw peer (plain blocking `TcpStream`) and the accepted transport.
fn raw_pair(cfg: TcpConfig) -> (TcpStream, TcpTransport) {
    let acceptor = TcpAcceptor::bind(localhost(), cfg).unwrap();
    let raw = TcpStream::connect(acceptor.local_addr().unwrap()).unwrap();
    for _ in 0..ITERATIONS {
        if let Some(server) = acceptor.poll_accept().unwrap() {
            return (raw, server);
        }
        std::thread::yield_now();
    }
    panic!("connection never accepted");
}

fn small_cfg(max_frame_len: usize) -> TcpConfig {
    TcpConfig {
        max_frame_len,
        tx_queue_limit_bytes: 4 * max_frame_len,
        rx_buffer_len: 2 * max_frame_len,
        ..TcpConfig::default()
    }
}

/// A whole frame: Rpc header with `id`, body derived from `id`.
fn frame(id: u64, body_len: usize) -> Bytes {
    let mut f = Vec::with_capacity(HEADER_LEN + body_len);
    f.extend_from_slice(&Header::new(Opcode::Rpc, id, body_len as u32).to_bytes());
    f.extend((0..body_len).map(|i| (id.wrapping_mul(131) ^ (i as u64).wrapping_mul(7)) as u8));
    Bytes::from(f)
}

/// How a frame is queued.
#[derive(Debug, Clone)]
enum How {
    /// `tx_reserve` + `tx_commit` (with some slack in the reservation).
    Reserve,
    /// `tx_gather` with the header plus `head_extra` body bytes as head and
    /// the rest of the body split at the given offsets (relative to the
    /// end of the head).
    Gather { head_extra: usize, cuts: Vec<usize> },
}

struct Plan {
    frames: Vec<(How, Bytes)>,
}

impl Plan {
    fn new() -> Self {
        Self { frames: Vec::new() }
    }
    fn push(&mut self, how: How, body_len: usize) {
        let id = self.frames.len() as u64 + 1;
        self.frames.push((how, frame(id, body_len)));
    }
    fn random_gather(rng: &mut StdRng, body_len: usize) -> How {
        let head_extra = rng.gen_range(0..=body_len.min(16));
        let rest = body_len - head_extra;
        let mut cuts: Vec<usize> = (0..rng.gen_range(0..6))
            .map(|_| rng.gen_range(0..=rest))
            .collect();
        cuts.sort_unstable();
        How::Gather { head_extra, cuts }
    }
}

/// Queue one frame; false under back-pressure.
fn queue(t: &mut TcpTransport, how: &How, f: &Bytes) -> bool {
    match how {
        How::Reserve => {
            let slack = (f.len() < t.max_frame_len()) as usize;
            let Some(buf) = t.tx_reserve(f.len() + slack).unwrap() else {
                return false;
            };
            buf[..f.len()].copy_from_slice(f);
            t.tx_commit(f.len());
            true
        }
        How::Gather { head_extra, cuts } => {
            let head_len = HEADER_LEN + head_extra;
            let mut segs = Vec::new();
            let mut at = head_len;
            for &c in cuts {
                segs.push(f.slice(at..head_len + c));
                at = head_len + c;
            }
            segs.push(f.slice(at..));
            t.tx_gather(&f[..head_len], &segs).unwrap()
        }
    }
}

#[derive(Debug, Default)]
struct Outcome {
    /// Flushes that left bytes queued after writing some (partial writes).
    partial_flushes: usize,
    /// Times queueing hit back-pressure.
    back_pressure: usize,
    /// Most chunks (iovecs) queued before a flush.
    max_chunks: usize,
}

/// Send `plan` from `tx` to `rx`, checking every frame arrives once, in
/// order, byte-exact, and the per-call system-call bounds.
fn transfer(tx: &mut TcpTransport, rx: &mut TcpTransport, plan: &Plan, burst: usize) -> Outcome {
    let now = Instant::now();
    let frames = &plan.frames;
    let mut out = Outcome::default();
    let (mut sent, mut received) = (0, 0);
    let rx_capacity = rx.rx_buffer_capacity();
    for _ in 0..ITERATIONS {
        while sent < frames.len() {
            let (how, f) = &frames[sent];
            if !queue(tx, how, f) {
                out.back_pressure += 1;
                break;
            }
            sent += 1;
        }
        assert!(tx.tx_queued_bytes() <= tx.config().tx_queue_limit_bytes);
        assert!(tx.tx_buffer_capacity() <= tx.config().tx_queue_limit_bytes);

        let chunks = tx.tx_queued_chunks();
        out.max_chunks = out.max_chunks.max(chunks);
        let before = tx.stats();
        tx.flush(now).unwrap();
        let after = tx.stats();
        let writes = after.write_calls - before.write_calls;
        assert!(
            writes as usize <= chunks.div_ceil(MAX_IOVECS).max(1),
            "{writes} writes for {chunks} chunks"
        );
        if after.bytes_written > before.bytes_written && tx.tx_pending() {
            out.partial_flushes += 1;
        }

        let reads = rx.stats().read_calls;
        let n = rx
            .rx_burst(now, burst, &mut |got: &[u8]| {
                assert!(received < frames.len(), "more frames than were sent");
                assert_eq!(got, &frames[received].1[..], "frame {received}");
                received += 1;
            })
            .unwrap();
        assert!(n <= burst);
        assert!(
            rx.stats().read_calls - reads <= 1,
            "more than one read per burst"
        );
        assert_eq!(rx.rx_buffer_capacity(), rx_capacity);

        if received == frames.len() && !tx.tx_pending() {
            assert_eq!(sent, frames.len());
            assert_eq!(rx.rx_buffered_bytes(), 0);
            assert_eq!(tx.stats().bytes_written, rx.stats().bytes_read);
            return out;
        }
    }
    panic!(
        "no progress: sent {sent}, received {received} of {}",
        frames.len()
    );
}

#[test]
fn many_small_frames_in_order_exactly_once() {
    let (mut a, mut b) = pair(TcpConfig::default(), TcpConfig::default());
    let mut plan = Plan::new();
    for i in 0..20_000 {
        plan.push(How::Reserve, i % 65);
    }
    transfer(&mut a, &mut b, &plan, 64);
    // And the other direction, with a burst size of one.
    let mut back = Plan::new();
    for i in 0..2_000 {
        back.push(How::Reserve, i % 7);
    }
    transfer(&mut b, &mut a, &back, 1);
}

#[test]
fn a_burst_of_reserved_frames_is_one_write() {
    let (mut a, mut b) = pair(TcpConfig::default(), TcpConfig::default());
    let mut plan = Plan::new();
    for i in 0..100 {
        plan.push(How::Reserve, i);
    }
    for (how, f) in &plan.frames {
        assert!(queue(&mut a, how, f));
    }
    // Contiguous staged frames are one iovec, written by one call (a few
    // KiB always fit an empty loopback socket buffer).
    assert_eq!(a.tx_queued_chunks(), 1);
    a.flush(Instant::now()).unwrap();
    assert_eq!(a.stats().write_calls, 1);
    assert!(!a.tx_pending());
    let mut got = 0;
    for _ in 0..ITERATIONS {
        got += b.rx_burst(Instant::now(), 1000, &mut |_| {}).unwrap();
        if got == 100 {
            break;
        }
    }
    assert_eq!(got, 100);
    // Nothing queued: flush makes no system call.
    a.flush(Instant::now()).unwrap();
    assert_eq!(a.stats().write_calls, 1);
}

#[test]
fn mixed_reserve_and_gather_keep_queue_order() {
    for threshold in [0, 8, 256] {
        let cfg = TcpConfig {
            gather_copy_threshold: threshold,
            ..small_cfg(64 << 10)
        };
        let (mut a, mut b) = pair(cfg, cfg);
        let mut rng = StdRng::seed_from_u64(7 + threshold as u64);
        let mut plan = Plan::new();
        for _ in 0..5_000 {
            let body = if rng.gen_ratio(1, 10) {
                rng.gen_range(0..=(64 << 10) - HEADER_LEN)
            } else {
                rng.gen_range(0..300)
            };
            let how = if rng.gen_bool(0.5) {
                How::Reserve
            } else {
                Plan::random_gather(&mut rng, body)
            };
            plan.push(how, body);
        }
        let out = transfer(&mut a, &mut b, &plan, 16);
        assert!(out.back_pressure > 0, "{out:?}");
    }
}

#[test]
fn more_gathered_segments_than_iov_max() {
    let cfg = TcpConfig {
        gather_copy_threshold: 0,
        ..TcpConfig::default()
    };
    let (mut a, mut b) = pair(cfg, cfg);
    let mut plan = Plan::new();
    for i in 0..3_000 {
        // Header copied, body one shared segment: two iovecs per frame
        // unless merged with the previous staged head (never, a segment sits
        // between).
        plan.push(
            How::Gather {
                head_extra: 0,
                cuts: vec![],
            },
            1 + i % 50,
        );
    }
    let out = transfer(&mut a, &mut b, &plan, 256);
    assert!(out.max_chunks > 2 * MAX_IOVECS, "{out:?}");
}

#[test]
fn frames_of_max_size() {
    let max = 256 << 10;
    let cfg = small_cfg(max);
    let (mut a, mut b) = pair(cfg, cfg);
    let body = max - HEADER_LEN;
    let mut plan = Plan::new();
    for i in 0..40 {
        let how = if i % 2 == 0 {
            How::Reserve
        } else {
            How::Gather {
                head_extra: 5,
                cuts: vec![1000, 100_000],
            }
        };
        plan.push(how, body);
    }
    transfer(&mut a, &mut b, &plan, 4);

    assert!(matches!(
        a.tx_reserve(max + 1),
        Err(TransportError::FrameTooLarge { len, max: m }) if len == max + 1 && m == max
    ));
    let big = Bytes::from(vec![0u8; max]);
    assert!(matches!(
        a.tx_gather(&[0; HEADER_LEN], &[big]),
        Err(TransportError::FrameTooLarge { .. })
    ));
    assert_eq!(a.max_frame_len(), max);
}

#[test]
fn ten_megabytes_of_random_sizes() {
    let cfg = TcpConfig::default();
    let (mut a, mut b) = pair(cfg, cfg);
    let mut rng = StdRng::seed_from_u64(42);
    let max_body = cfg.max_frame_len - HEADER_LEN;
    let mut plan = Plan::new();
    let mut total = 0;
    while total < 10 << 20 {
        let body = match rng.gen_range(0..100) {
            0..=4 => rng.gen_range(0..=max_body),
            5..=29 => rng.gen_range(0..64 << 10),
            _ => rng.gen_range(0..2048),
        };
        let how = if rng.gen_bool(0.5) {
            How::Reserve
        } else {
            Plan::random_gather(&mut rng, body)
        };
        plan.push(how, body);
        total += HEADER_LEN + body;
    }
    let burst = rng.gen_range(1..64);
    transfer(&mut a, &mut b, &plan, burst);
}

#[test]
fn partial_writes_with_a_tiny_send_buffer() {
    let max = 64 << 10;
    let tx_cfg = TcpConfig {
        socket_send_buffer: Some(4096),
        ..small_cfg(max)
    };
    let rx_cfg = TcpConfig {
        socket_recv_buffer: Some(4096),
        ..small_cfg(max)
    };
    let (mut a, mut b) = pair(tx_cfg, rx_cfg);
    let sndbuf = socket2::SockRef::from(a.stream())
        .send_buffer_size()
        .unwrap();
    assert!(sndbuf < 64 << 10, "SO_SNDBUF not applied: {sndbuf}");
    let mut rng = StdRng::seed_from_u64(3);
    let mut plan = Plan::new();
    for _ in 0..300 {
        let body = rng.gen_range(0..=max - HEADER_LEN);
        let how = if rng.gen_bool(0.3) {
            How::Reserve
        } else {
            Plan::random_gather(&mut rng, body)
        };
        plan.push(how, body);
    }
    let out = transfer(&mut a, &mut b, &plan, 8);
    assert!(out.partial_flushes > 0, "{out:?}");
}

#[test]
fn back_pressure_then_progress_after_flush_and_read() {
    let max = 16 << 10;
    let cfg = TcpConfig {
        socket_send_buffer: Some(4096),
        socket_recv_buffer: Some(4096),
        ..small_cfg(max)
    };
    let limit = cfg.tx_queue_limit_bytes;
    let (mut a, mut b) = pair(cfg, cfg);
    let now = Instant::now();

    // Without flushing: the queue fills to the limit, then refuses.
    let f = frame(1, max - HEADER_LEN);
    let mut queued = 0;
    while let Some(buf) = a.tx_reserve(f.len()).unwrap() {
        buf.copy_from_slice(&f);
        a.tx_commit(f.len());
        queued += 1;
        assert!(queued <= limit / f.len());
    }
    assert_eq!(queued, limit / f.len());
    assert_eq!(a.tx_queued_bytes(), limit);
    assert!(!a
        .tx_gather(&f[..HEADER_LEN], &[f.slice(HEADER_LEN..)])
        .unwrap());
    // A frame that fits the remaining room is still accepted.
    assert!(a.tx_reserve(0).unwrap().is_some());

    // With flushing but no reader: the kernel buffers fill, then the queue
    // stays full.
    let mut refused_after_flush = false;
    for _ in 0..ITERATIONS {
        a.flush(now).unwrap();
        match a.tx_reserve(f.len()).unwrap() {
            Some(buf) => {
                buf.copy_from_slice(&f);
                a.tx_commit(f.len());
                queued += 1;
            }
            None => {
                refused_after_flush = true;
                break;
            }
        }
    }
    assert!(refused_after_flush);
    assert!(a.tx_pending());

    // Reading on the other side frees room; everything queued arrives.
    let mut received = 0;
    for _ in 0..ITERATIONS {
        a.flush(now).unwrap();
        received += b
            .rx_burst(now, 8, &mut |got: &[u8]| assert_eq!(got, &f[..]))
            .unwrap();
        if received == queued && !a.tx_pending() {
            break;
        }
    }
    assert_eq!(received, queued);
    assert!(a.tx_reserve(f.len()).unwrap().is_some());
}

/// Drive `t` until `rx_burst` fails; returns the frames delivered before
/// and the error.
fn until_error(t: &mut TcpTransport) -> (usize, TransportError) {
    let mut frames = 0;
    for _ in 0..ITERATIONS {
        match t.rx_burst(Instant::now(), 16, &mut |_| frames += 1) {
            Ok(_) => {}
            Err(e) => return (frames, e),
        }
    }
    panic!("no error reported");
}

/// Check that a good connection still works.
fn still_works(a: &mut TcpTransport, b: &mut TcpTransport) {
    let mut plan = Plan::new();
    for i in 0..200 {
        plan.push(How::Reserve, i * 3);
    }
    transfer(a, b, &plan, 32);
}

fn raw_header(magic: &[u8; 4], body_len: u32, message_len: u32) -> [u8; HEADER_LEN] {
    let mut h = Header::new(Opcode::Rpc, 9, 0).to_bytes();
    h[..4].copy_from_slice(magic);
    h[20..24].copy_from_slice(&body_len.to_le_bytes());
    h[24..28].copy_from_slice(&message_len.to_le_bytes());
    h
}

#[test]
fn garbage_bad_magic_oversized_and_truncated_fail_only_their_connection() {
    let max = 64 << 10;
    let cfg = small_cfg(max);
    let (mut good_a, mut good_b) = pair(cfg, cfg);
    still_works(&mut good_a, &mut good_b);

    // Garbage bytes.
    let (mut raw, mut bad) = raw_pair(cfg);
    raw.write_all(b"GET / HTTP/1.1\r\nHost: example.invalid\r\n\r\n")
        .unwrap();
    let (n, e) = until_error(&mut bad);
    assert_eq!(n, 0);
    assert!(
        matches!(e, TransportError::Frame(FrameError::BadMagic(m)) if &m == b"GET "),
        "{e:?}"
    );
    // The error is final.
    assert!(matches!(
        bad.rx_burst(Instant::now(), 16, &mut |_| {}),
        Err(TransportError::Frame(_))
    ));
    still_works(&mut good_a, &mut good_b);

    // A good frame, then a header with bad magic.
    let (mut raw, mut bad) = raw_pair(cfg);
    raw.write_all(&frame(1, 10)).unwrap();
    raw.write_all(&raw_header(b"SWR2", 0, 0)).unwrap();
    let (n, e) = until_error(&mut bad);
    assert_eq!(n, 1);
    assert!(
        matches!(e, TransportError::Frame(FrameError::BadMagic(_))),
        "{e:?}"
    );
    still_works(&mut good_a, &mut good_b);

    // A body one byte over the frame limit.
    let (mut raw, mut bad) = raw_pair(cfg);
    let over = (max - HEADER_LEN + 1) as u32;
    raw.write_all(&raw_header(b"SWR1", over, over)).unwrap();
    let (_, e) = until_error(&mut bad);
    assert!(
        matches!(e, TransportError::Frame(FrameError::Oversized { len, .. }) if len == u64::from(over)),
        "{e:?}"
    );
    still_works(&mut good_a, &mut good_b);

    // A good frame, then half a frame, then EOF.
    let (mut raw, mut bad) = raw_pair(cfg);
    raw.write_all(&frame(1, 100)).unwrap();
    let f = frame(2, 1000);
    raw.write_all(&f[..500]).unwrap();
    raw.shutdown(Shutdown::Write).unwrap();
    let (n, e) = until_error(&mut bad);
    assert_eq!(n, 1);
    assert!(
        matches!(
            e,
            TransportError::Frame(FrameError::Truncated {
                needed: 1032,
                have: 500
            })
        ),
        "{e:?}"
    );
    // EOF inside a header.
    let (mut raw, mut bad) = raw_pair(cfg);
    raw.write_all(&f[..HEADER_LEN - 1]).unwrap();
    raw.shutdown(Shutdown::Write).unwrap();
    let (n, e) = until_error(&mut bad);
    assert_eq!(n, 0);
    assert!(
        matches!(e, TransportError::Frame(FrameError::Truncated { .. })),
        "{e:?}"
    );
    still_works(&mut good_a, &mut good_b);
}

#[test]
fn four_gib_announcement_keeps_memory_bounded() {
    let cfg = small_cfg(64 << 10);
    let (mut good_a, mut good_b) = pair(cfg, cfg);
    let (mut raw, mut bad) = raw_pair(cfg);
    let capacity = bad.rx_buffer_capacity();
    assert_eq!(capacity, cfg.rx_buffer_len);
    raw.write_all(&raw_header(b"SWR1", u32::MAX, u32::MAX))
        .unwrap();
    // The peer keeps streaming "body" bytes; nothing is buffered for it.
    let junk = vec![0xabu8; 256 << 10];
    raw.set_nonblocking(true).unwrap();
    match raw.write(&junk) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        Err(e) => panic!("{e}"),
    }
    let (n, e) = until_error(&mut bad);
    assert_eq!(n, 0);
    assert!(
        matches!(e, TransportError::Frame(FrameError::Oversized { .. })),
        "{e:?}"
    );
    assert_eq!(bad.rx_buffer_capacity(), capacity);
    assert!(bad.rx_buffered_bytes() <= capacity);
    still_works(&mut good_a, &mut good_b);

    // A legal frame announced at the limit, streamed slowly: buffered bytes
    // stay within the fixed buffer until it completes.
    let (mut raw, mut bad) = raw_pair(cfg);
    let f = frame(5, cfg.max_frame_len - HEADER_LEN);
    let mut delivered = 0;
    for piece in f.chunks(4000) {
        raw.write_all(piece).unwrap();
        for _ in 0..4 {
            delivered += bad
                .rx_burst(Instant::now(), 4, &mut |got: &[u8]| assert_eq!(got, &f[..]))
                .unwrap();
        }
        assert_eq!(bad.rx_buffer_capacity(), capacity);
    }
    for _ in 0..ITERATIONS {
        if delivered == 1 {
            break;
        }
        delivered += bad.rx_burst(Instant::now(), 4, &mut |_| {}).unwrap();
    }
    assert_eq!(delivered, 1);
}

#[test]
fn eof_is_closed_after_buffered_frames() {
    let cfg = TcpConfig::default();
    let (mut a, mut b) = pair(cfg, cfg);
    let now = Instant::now();
    for i in 0..3 {
        let f = frame(i + 1, 10);
        assert!(a.tx_gather(&f, &[]).unwrap());
    }
    for _ in 0..ITERATIONS {
        a.flush(now).unwrap();
        if !a.tx_pending() {
            break;
        }
    }
    assert!(!a.tx_pending());
    drop(a);
    // A burst of one at a time: the frames come first, then Closed.
    let mut ids = Vec::new();
    let mut closed = false;
    for _ in 0..ITERATIONS {
        match b.rx_burst(now, 1, &mut |got: &[u8]| {
            ids.push(Header::parse(got, 1 << 20, 1 << 20).unwrap().request_id)
        }) {
            Ok(_) => {}
            Err(TransportError::Closed) => {
                closed = true;
                break;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(closed);
    assert_eq!(ids, vec![1, 2, 3]);
    assert!(matches!(
        b.rx_burst(now, 1, &mut |_| panic!("frame after close")),
        Err(TransportError::Closed)
    ));
}

#[test]
fn writing_to_a_closed_peer_is_closed() {
    let cfg = TcpConfig::default();
    let (mut a, b) = pair(cfg, cfg);
    drop(b);
    let f = frame(1, 1000);
    let mut result = Ok(());
    for _ in 0..ITERATIONS {
        if a.tx_queued_bytes() < 1 << 20 {
            assert!(a.tx_gather(&f, &[]).unwrap());
        }
        result = a.flush(Instant::now());
        if result.is_err() {
            break;
        }
    }
    assert!(matches!(result, Err(TransportError::Closed)), "{result:?}");
}

#[test]
fn acceptor_without_pending_connection_returns_none() {
    let acceptor = TcpAcceptor::bind(localhost(), TcpConfig::default()).unwrap();
    assert!(acceptor.poll_accept().unwrap().is_none());
}

#[test]
fn inconsistent_config_is_rejected() {
    let bad = TcpConfig {
        rx_buffer_len: TcpConfig::default().max_frame_len,
        ..TcpConfig::default()
    };
    let e = TcpAcceptor::bind(localhost(), bad).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let acceptor = TcpAcceptor::bind(localhost(), TcpConfig::default()).unwrap();
    let e = TcpTransport::connect(acceptor.local_addr().unwrap(), bad).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
}

#[cfg(target_os = "linux")]
#[test]
fn loopback_connections_cap_their_send_buffer_unless_configured() {
    use starwire_tcp::DEFAULT_LOOPBACK_SEND_BUFFER;
    let sndbuf = |t: &TcpTransport| {
        socket2::SockRef::from(t.stream())
            .send_buffer_size()
            .unwrap()
    };
    // What the kernel makes of a request of the default cap (it doubles the
    // request and clamps it to net.core.wmem_max): the same whichever
    // field asked for it.
    let explicit = TcpConfig {
        socket_send_buffer: Some(DEFAULT_LOOPBACK_SEND_BUFFER),
        ..TcpConfig::default()
    };
    let (c, s) = pair(explicit, explicit);
    let capped = sndbuf(&c);
    assert_eq!(sndbuf(&s), capped);
    // The default caps both ends of a loopback connection.
    let (c, s) = pair(TcpConfig::default(), TcpConfig::default());
    assert_eq!((sndbuf(&c), sndbuf(&s)), (capped, capped));
    // An explicit SO_SNDBUF wins over the loopback cap.
    let own = TcpConfig {
        socket_send_buffer: Some(64 << 10),
        ..TcpConfig::default()
    };
    let (c, s) = pair(own, own);
    assert_eq!(sndbuf(&c), 128 << 10);
    assert_eq!(sndbuf(&s), 128 << 10);
    // Without the cap the kernel's autotuning keeps the buffer.
    let auto = TcpConfig {
        loopback_send_buffer: None,
        ..TcpConfig::default()
    };
    let (c, s) = pair(auto, auto);
    assert_ne!(sndbuf(&c), capped);
    assert_ne!(sndbuf(&s), capped);
}

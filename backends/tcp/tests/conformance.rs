//! The conformance suite over real loopback TCP: the tcp driver with 64
//! connections, and drivers of fault-injecting links over TCP sockets (what
//! the soak's `--faults` runs).

use std::collections::HashSet;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use starwire_tcp::{TcpConfig, TcpDriver, TcpTransport};
use starwire_transport::conformance::{self, link_pairs, DriverPair, Pair, MIN_CONNECTIONS};
use starwire_transport::testing::{FaultSpec, Faulty};
use starwire_transport::wire::Opcode;
use starwire_transport::{Connection, Driver, Incoming, Links, Payload, Sleep, StreamDriver};

/// `n` loopback connections between two tcp drivers, attached from their
/// streams.
fn drivers(cfg: &TcpConfig, n: usize) -> DriverPair<TcpDriver, TcpDriver> {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
    let addr = l.local_addr().expect("addr");
    let mut a = TcpDriver::new(*cfg).expect("client driver");
    let mut b = TcpDriver::new(*cfg).expect("server driver");
    let mut a_ids = Vec::with_capacity(n);
    let mut b_ids = Vec::with_capacity(n);
    for _ in 0..n {
        let c = TcpStream::connect(addr).expect("connect");
        let (s, _) = l.accept().expect("accept");
        a_ids.push(a.attach_stream(c).expect("attach client"));
        b_ids.push(b.attach_stream(s).expect("attach server"));
    }
    DriverPair { a, a_ids, b, b_ids }
}

fn small() -> TcpConfig {
    TcpConfig {
        max_frame_len: 4096,
        tx_queue_limit_bytes: 16 * 1024,
        rx_buffer_len: 8192,
        ..TcpConfig::default()
    }
}

#[test]
fn tcp_default_config() {
    let cfg = TcpConfig::default();
    conformance::run_all_drivers("tcp", MIN_CONNECTIONS, |n| drivers(&cfg, n));
}

#[test]
fn tcp_small_frames_and_queues() {
    let cfg = small();
    conformance::run_all_drivers("tcp-small", MIN_CONNECTIONS, |n| drivers(&cfg, n));
}

type FaultyTcp = Links<Faulty<TcpTransport>>;

/// `n` loopback connections between two drivers of faulty links: the
/// client's inject nothing, the server's end of connection `i` injects
/// `server(i)`.
fn faulty_drivers(
    cfg: &TcpConfig,
    n: usize,
    server: impl Fn(usize) -> FaultSpec,
) -> DriverPair<FaultyTcp, FaultyTcp> {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
    let addr = l.local_addr().expect("addr");
    let mut i = 0;
    link_pairs(n, || {
        let c = TcpStream::connect(addr).expect("connect");
        let (s, _) = l.accept().expect("accept");
        let spec = server(i);
        i += 1;
        (
            Faulty::new(
                TcpTransport::new(c, *cfg).expect("client"),
                FaultSpec::default(),
            ),
            Faulty::new(TcpTransport::new(s, *cfg).expect("server"), spec),
        )
    })
}

#[test]
fn faulty_tcp_links_with_no_faults_are_transparent() {
    let cfg = small();
    conformance::run_all_drivers("tcp-faulty-0", MIN_CONNECTIONS, |n| {
        faulty_drivers(&cfg, n, |_| FaultSpec::default())
    });
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Message `seq`: its number, a checksum, and a body of varying length.
fn message(seq: u64) -> Vec<u8> {
    let len = 16 + (seq as usize * 37) % 300;
    let mut m = vec![0u8; len];
    m[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in m[16..].iter_mut().enumerate() {
        *b = (seq as usize + i) as u8;
    }
    let sum = fnv1a(&m[16..]) ^ seq;
    m[8..16].copy_from_slice(&sum.to_le_bytes());
    m
}

/// What the server made of one connection's messages.
#[derive(Debug, Default, Clone)]
struct Verdict {
    accepted: u64,
    next: u64,
    anomalies: u64,
}

impl Verdict {
    fn take(&mut self, body: &[u8]) {
        let seq = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
        let sum = u64::from_le_bytes(body[8..16].try_into().expect("8 bytes"));
        assert_eq!(fnv1a(&body[16..]) ^ seq, sum, "no fault corrupts here");
        if seq != self.next {
            self.anomalies += 1;
        }
        self.accepted += 1;
        self.next = self.next.max(seq + 1);
    }
}

/// The soak's `--faults` over a driver of faulty TCP links: on 64
/// connections at once, the odd ones dropping and reordering what they
/// receive, every connection that got a fault shows it (a gap, a message
/// out of order or missing, or a failed connection) and every other one
/// gets everything in order. The driver parks on the links' sockets.
#[test]
fn faulty_tcp_links_show_every_fault_on_its_own_connection() {
    const SENT: u64 = 200;
    let n = MIN_CONNECTIONS;
    let cfg = small();
    let spec = |i: usize| match i % 2 {
        0 => FaultSpec::default(),
        _ => format!("drop=0.02,reorder=0.02,seed={i}")
            .parse()
            .expect("spec"),
    };
    let mut p = Pair::new(faulty_drivers(&cfg, n, spec));
    let mut verdicts = vec![Verdict::default(); n];
    let mut failed = vec![false; n];
    let mut sent = vec![0u64; n];
    let mut settle = 0;
    let mut on_b = |j: usize, _: &mut Connection, m: Incoming<'_>| {
        if let Incoming::Request { body, .. } = m {
            verdicts[j].take(body);
        }
    };
    p.drive_with(
        &mut |_, _, _| {},
        &mut on_b,
        &mut |f| {
            assert_eq!(f.index % 2, 1, "a faultless connection failed: {}", f.error);
            failed[f.index] = true;
        },
        &mut |p| {
            let mut all_out = true;
            for (i, sent) in sent.iter_mut().enumerate() {
                let id = p.a_ids[i];
                let Some(c) = p.a.conn(id) else { continue };
                while *sent < SENT && !c.is_closed() {
                    let body = Payload::from(message(*sent));
                    if c.send_oneway(Opcode::Tensors, 0, body).is_err() {
                        break;
                    }
                    *sent += 1;
                }
                let (closed, out) = (c.is_closed(), *sent == SENT && c.queued() == 0);
                all_out &= closed || (out && !p.a.driver().tx_pending(id));
            }
            // Then a while longer for the last frames to arrive.
            settle += usize::from(all_out);
            settle > 2000
        },
    );

    let d = p.b.driver();
    // Connections that failed (a dropped or reordered handshake) showed
    // their fault; their links are gone with their counters.
    let mut faulted = failed.iter().filter(|f| **f).count();
    for (i, v) in verdicts.iter().enumerate() {
        if failed[i] {
            continue;
        }
        let stats = d.link(p.b_ids[i]).expect("attached").stats();
        let injected = stats.dropped + stats.reordered + stats.corrupted + stats.delayed;
        faulted += usize::from(injected > 0);
        if i % 2 == 0 {
            assert_eq!(injected, 0, "connection {i}");
        }
        if injected == 0 {
            assert_eq!((v.accepted, v.anomalies), (SENT, 0), "connection {i}");
        } else {
            assert!(
                v.anomalies > 0 || v.accepted < SENT,
                "connection {i}: {injected} faults went unnoticed: {v:?}"
            );
        }
    }
    assert!(faulted >= n / 4, "only {faulted} connections got faults");

    // An idle reactor over this driver parks in poll(2) on the sockets.
    assert_eq!(d.sleep(), Sleep::Fds);
    let mut fds = Vec::new();
    d.wake_fds(&mut fds);
    let got: HashSet<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let want: HashSet<_> = d
        .iter()
        .map(|(_, l)| l.inner().stream().as_raw_fd())
        .collect();
    assert_eq!(got.len(), fds.len(), "a socket listed twice");
    assert_eq!(got, want);
    let mut writable = Vec::new();
    d.write_fds(&mut writable);
    assert!(writable.is_empty(), "nothing is queued");
}

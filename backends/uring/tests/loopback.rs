//! The io_uring backend against real sockets: bad input from a raw peer,
//! many connections on one shared ring, zero-copy fallback, and the memlock
//! error in a child process without CAP_IPC_LOCK.
#![cfg(target_os = "linux")]

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_transport::wire::{FrameError, Header, Opcode, HEADER_LEN};
use starwire_transport::{Transport, TransportError};
use starwire_uring::{MemlockError, UringConfig, UringError, UringReactor, UringTransport};

fn raw_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

/// Receive on `t` until an error or `limit` frames; returns frames and the
/// error.
fn drain(t: &mut UringTransport, limit: usize) -> (Vec<Vec<u8>>, Option<TransportError>) {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && got.len() < limit {
        match t.rx_burst(Instant::now(), 32, &mut |f: &[u8]| got.push(f.to_vec())) {
            Ok(_) => std::thread::yield_now(),
            Err(e) => return (got, Some(e)),
        }
    }
    (got, None)
}

fn frame(id: u64, body: usize) -> Vec<u8> {
    let mut f = Header::new(Opcode::Rpc, id, body as u32)
        .to_bytes()
        .to_vec();
    f.extend((0..body).map(|i| (i as u64 ^ id) as u8));
    f
}

#[test]
fn garbage_after_good_frames_is_a_frame_error() {
    let (mut raw, s) = raw_pair();
    let mut t = UringTransport::standalone(s, &UringConfig::default()).unwrap();
    let mut bytes = frame(1, 10);
    bytes.extend(frame(2, 0));
    bytes.extend(b"this is not a starwire header, not at all");
    raw.write_all(&bytes).unwrap();
    let (got, err) = drain(&mut t, usize::MAX);
    assert_eq!(got, vec![frame(1, 10), frame(2, 0)]);
    assert!(
        matches!(err, Some(TransportError::Frame(FrameError::BadMagic(_)))),
        "{err:?}"
    );
    // Final: reported again.
    let r = t.rx_burst(Instant::now(), 8, &mut |_: &[u8]| panic!("no frame"));
    assert!(matches!(r, Err(TransportError::Frame(_))));
}

#[test]
fn oversized_length_is_rejected_before_any_allocation() {
    let (mut raw, s) = raw_pair();
    let cfg = UringConfig::default();
    let mut t = UringTransport::standalone(s, &cfg).unwrap();
    // A header announcing a body far over max_frame_len.
    let h = Header::new(Opcode::Rpc, 9, (cfg.max_frame_len * 16) as u32);
    raw.write_all(&h.to_bytes()).unwrap();
    let (got, err) = drain(&mut t, usize::MAX);
    assert!(got.is_empty());
    assert!(matches!(err, Some(TransportError::Frame(_))), "{err:?}");
}

#[test]
fn truncated_frame_then_eof() {
    let (mut raw, s) = raw_pair();
    let mut t = UringTransport::standalone(s, &UringConfig::default()).unwrap();
    let f = frame(1, 100);
    raw.write_all(&f[..60]).unwrap();
    raw.shutdown(Shutdown::Write).unwrap();
    let (got, err) = drain(&mut t, usize::MAX);
    assert!(got.is_empty());
    assert!(
        matches!(
            err,
            Some(TransportError::Frame(FrameError::Truncated {
                needed: 132,
                have: 60
            }))
        ),
        "{err:?}"
    );
}

#[test]
fn peer_close_is_closed_after_frames() {
    let (mut raw, s) = raw_pair();
    let mut t = UringTransport::standalone(s, &UringConfig::default()).unwrap();
    raw.write_all(&frame(5, 3)).unwrap();
    drop(raw);
    let (got, err) = drain(&mut t, usize::MAX);
    assert_eq!(got, vec![frame(5, 3)]);
    assert!(matches!(err, Some(TransportError::Closed)), "{err:?}");
}

#[test]
fn many_connections_share_one_ring_with_one_enter_per_turn() {
    let cfg = UringConfig {
        zero_copy_threshold: 16 << 10,
        ..UringConfig::default()
    };
    let a = UringReactor::new(&cfg).unwrap();
    let b = UringReactor::new(&cfg).unwrap();
    let n = 8;
    let mut ca = Vec::new();
    let mut cb = Vec::new();
    for _ in 0..n {
        let (x, y) = raw_pair();
        ca.push(UringTransport::new(&a, x).unwrap());
        cb.push(UringTransport::new(&b, y).unwrap());
    }
    let big = Bytes::from(vec![0xab_u8; 40 << 10]);
    let per_conn = 20u64;
    let mut sent = vec![0u64; n];
    let mut got: Vec<Vec<Vec<u8>>> = vec![Vec::new(); n];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut turns = 0u64;
    while got.iter().map(Vec::len).sum::<usize>() < n * per_conn as usize {
        assert!(Instant::now() < deadline, "stalled");
        turns += 1;
        let now = Instant::now();
        for (i, t) in ca.iter_mut().enumerate() {
            if sent[i] < per_conn {
                let h = Header::new(Opcode::Rpc, sent[i], big.len() as u32).to_bytes();
                if t.tx_gather(&h, std::slice::from_ref(&big)).unwrap() {
                    sent[i] += 1;
                }
            }
            t.flush(now).unwrap();
        }
        a.enter().unwrap();
        for (i, t) in cb.iter_mut().enumerate() {
            t.rx_burst(now, 32, &mut |f: &[u8]| got[i].push(f.to_vec()))
                .unwrap();
        }
        b.enter().unwrap();
    }
    for g in &got {
        for (k, f) in g.iter().enumerate() {
            let h = Header::parse(f, u32::MAX, u32::MAX).unwrap();
            assert_eq!(h.request_id, k as u64, "order");
            assert!(f[HEADER_LEN..].iter().all(|&x| x == 0xab));
        }
    }
    let (sa, sb) = (a.stats(), b.stats());
    assert!(sa.enters <= turns && sb.enters <= turns, "{sa:?} {sb:?}");
    // Loopback always copies: every connection that tried zero-copy fell
    // back after its first report.
    assert!(sa.zc_sends > 0, "{sa:?}");
    assert_eq!(sa.zc_fallbacks, sa.zc_copied.min(n as u64), "{sa:?}");
    assert!(sa.sends > sa.zc_sends);
    // Multishot: one arm per connection serves many completions.
    assert!(sb.recv_cqes > 4 * sb.recv_arms, "{sb:?}");
}

const CHILD_ENV: &str = "STARWIRE_URING_MEMLOCK_CHILD";

/// In the child: drop CAP_IPC_LOCK, lower RLIMIT_MEMLOCK to 1 MiB, and
/// ask for a ring registering 2 MiB. Prints the outcome for the parent.
fn memlock_child() {
    use caps::{CapSet, Capability};
    use nix::sys::resource::{setrlimit, Resource};
    for set in [CapSet::Effective, CapSet::Permitted] {
        caps::drop(None, set, Capability::CAP_IPC_LOCK).expect("drop CAP_IPC_LOCK");
    }
    setrlimit(Resource::RLIMIT_MEMLOCK, 1 << 20, 1 << 20).expect("setrlimit");
    match UringReactor::new(&UringConfig::default()) {
        Err(UringError::Memlock(e @ MemlockError::TooLow { .. })) => {
            println!("MEMLOCK-ERROR: {e}");
        }
        Err(e) => println!("OTHER-ERROR: {e}"),
        Ok(_) => println!("NO-ERROR"),
    }
}

#[test]
fn memlock_limit_too_low_is_a_clear_error() {
    if std::env::var_os(CHILD_ENV).is_some() {
        memlock_child();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "memlock_limit_too_low_is_a_clear_error",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}");
    let line = stdout
        .lines()
        .find_map(|l| {
            ["MEMLOCK-ERROR", "OTHER-ERROR", "NO-ERROR"]
                .iter()
                .find_map(|k| l.find(k).map(|i| &l[i..]))
        })
        .unwrap_or_else(|| panic!("no outcome in {stdout}"));
    assert!(line.starts_with("MEMLOCK-ERROR"), "{line}");
    for want in [
        "RLIMIT_MEMLOCK is 1048576",
        "2097152",
        "ulimit -l",
        "LimitMEMLOCK=",
    ] {
        assert!(line.contains(want), "{want} missing: {line}");
    }
}

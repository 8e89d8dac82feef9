//! A live PS task (tcp, the real `start_ps` wiring, a cluster token and
//! small bounds) against hostile clients: random bytes, oversized
//! lengths, truncated frames, slowloris, many idle sockets, an unfinished
//! chunked message, a client that never reads, an oversized pull, a NaN
//! push, and unauthenticated push, checkpoint and hello-then-close.
//!
//! After each attack a good client (the real worker connection, with the
//! token) must be served; the model's weights change only through its
//! authenticated pushes; the process's peak RSS stays within the memory
//! budget plus 64 MiB. Everything runs in one test so that the RSS is
//! this suite's alone.
//!
//! The idle-socket attack opens 1000 sockets. Both ends live in this one
//! process, past the usual soft limit of 1024 open files: the test raises
//! its soft limit towards the hard one first.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_ps::{VarDef, VarKind};
use starwire_tcp::TcpDriver;
use starwire_train::backend::Tcp;
use starwire_train::cluster::{
    connect, plan, start_ps, Guard, ProcessReactors, ReactorLayout, RunningPs,
};
use starwire_train::net::{Exchange, Reply, Request, SessionNet};
use starwire_train::TrainConfig;
use starwire_transport::accept::dial;
use starwire_transport::wire::{Flags, Header, Opcode, Status, HEADER_LEN};
use starwire_transport::{
    ClusterToken, ConnConfig, Connection, FrameTx, Incoming, Payload, PeerInfo, TaskRole,
    TransportError,
};
use starwire_wire::ps::{Control, PullRequestWriter, PushRequestWriter};

const TOKEN: &str = "hostile-suite-token-0123456789";
const BUDGET_MB: usize = 32;
const HANDSHAKE: Duration = Duration::from_secs(1);
const IDLE: Duration = Duration::from_secs(3);
const MAX_CONNECTIONS: usize = 256;
const IDLE_SOCKETS: usize = 1000;

/// Raise this process's soft limit of open files to `need`: the idle
/// sockets' client ends and the PS's accepted ends (at most
/// `MAX_CONNECTIONS`) are all in this process.
fn raise_open_files(need: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if soft >= need {
        return;
    }
    assert!(
        hard >= need,
        "the hostile suite needs {need} open files and the hard limit is {hard} (ulimit -Hn)"
    );
    setrlimit(Resource::RLIMIT_NOFILE, need, hard).expect("setrlimit");
}

fn config() -> TrainConfig {
    TrainConfig {
        ps: 1,
        workers: 1,
        embedding_dim: 8,
        guard: Guard {
            token: Some(ClusterToken::new(TOKEN.as_bytes()).expect("token")),
            max_connections: MAX_CONNECTIONS,
            handshake_timeout: HANDSHAKE,
            idle_timeout: Some(IDLE),
            memory_budget_mb: BUDGET_MB,
            max_reply_bytes: 1 << 20,
            max_rows: 20_000,
            max_wait_steps: 1000,
            ..Guard::default()
        },
        ..TrainConfig::default()
    }
}

/// The worker's real connection to shard 0.
fn good(cfg: &TrainConfig, addr: &str) -> SessionNet<TcpDriver> {
    connect::<Tcp>(cfg, &[addr.to_string()], 0, 1).expect("a good client connects")
}

fn one(net: &mut SessionNet<TcpDriver>, opcode: Opcode, body: Vec<u8>) -> Reply {
    let mut replies = Vec::new();
    net.exchange(
        vec![Request {
            shard: 0,
            opcode,
            body: Payload::from_bytes(Bytes::from(body)),
        }],
        &mut replies,
    )
    .expect("exchange");
    replies.pop().expect("a reply")
}

/// The dense variable's values and step, as the PS answers a pull.
fn weights(cfg: &TrainConfig, addr: &str, dense: u32) -> Vec<u8> {
    let mut net = good(cfg, addr);
    let mut b = Vec::new();
    PullRequestWriter::new(&mut b).dense(dense);
    let r = one(&mut net, Opcode::SparsePull, b);
    assert_eq!(r.status, Some(Status::Ok));
    net.close();
    r.body
}

/// Frames a [`Connection`] writes, collected for a raw socket.
#[derive(Default)]
struct Collect(Vec<u8>);

impl FrameTx for Collect {
    fn max_frame_len(&self) -> usize {
        1 << 20
    }
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        let at = self.0.len();
        self.0.resize(at + len, 0);
        Ok(Some(&mut self.0[at..]))
    }
    fn tx_commit(&mut self, _len: usize) {}
    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        self.0.extend_from_slice(head);
        for s in segs {
            self.0.extend_from_slice(s);
        }
        Ok(true)
    }
}

/// A hand-driven peer: the message layer over a blocking socket, so an
/// attack can speak the protocol as far as it likes and then misbehave.
struct RawPeer {
    s: TcpStream,
    conn: Connection,
    rx: Vec<u8>,
    closed: bool,
}

fn raw_config(token: Option<&str>) -> ConnConfig {
    let mut c = ConnConfig::new(PeerInfo {
        role: TaskRole::Worker,
        job: "worker".into(),
        task_index: 0,
        incarnation: 1,
        shards: 1,
    });
    c.token = token.map(|t| ClusterToken::new(t.as_bytes()).expect("token"));
    c.flags = starwire_train::cluster::training_flags(&config()).into();
    c
}

impl RawPeer {
    fn new(addr: &str, cfg: ConnConfig) -> Self {
        let s = dial(addr, 0, Instant::now() + Duration::from_secs(5)).expect("dial");
        Self {
            s,
            conn: Connection::new(cfg, 1 << 20),
            rx: Vec::new(),
            closed: false,
        }
    }

    /// Write what the connection queued.
    fn send(&mut self) {
        let mut out = Collect::default();
        self.conn.poll_transmit(&mut out).expect("transmit");
        let _ = self.s.write_all(&out.0);
    }

    /// Read for `d` (or until the PS closes), handing frames to the
    /// connection; the statuses of the responses that came.
    fn recv(&mut self, d: Duration) -> Vec<Status> {
        let mut got = Vec::new();
        let end = Instant::now() + d;
        let mut buf = vec![0u8; 1 << 16];
        while !self.closed && Instant::now() < end {
            let left = end
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            self.s.set_read_timeout(Some(left)).expect("timeout");
            match self.s.read(&mut buf) {
                Ok(0) => self.closed = true,
                Ok(n) => self.rx.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
                Err(_) => self.closed = true,
            }
            while let Some(len) = self
                .rx
                .get(20..24)
                .map(|b| HEADER_LEN + u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            {
                if self.rx.len() < len {
                    break;
                }
                let frame: Vec<u8> = self.rx.drain(..len).collect();
                let mut scratch = Vec::new();
                match self.conn.handle_frame(&frame, &mut scratch) {
                    Ok(Some(Incoming::Response { status, .. })) => got.push(status),
                    Ok(_) => {}
                    Err(_) => self.closed = true,
                }
            }
            self.send();
        }
        got
    }

    /// Run the handshake; true once established.
    fn handshake(&mut self) -> bool {
        let end = Instant::now() + Duration::from_secs(5);
        while !self.conn.is_established() && !self.closed && Instant::now() < end {
            self.send();
            self.recv(Duration::from_millis(50));
        }
        self.conn.is_established()
    }

    /// Whether the PS closes the socket within `d`.
    fn closed_within(&mut self, d: Duration) -> bool {
        let end = Instant::now() + d;
        while !self.closed && Instant::now() < end {
            self.recv(Duration::from_millis(100));
        }
        self.closed
    }
}

/// Whether the PS closes a raw socket within `d` (its bytes are drained).
fn closes(mut s: &TcpStream, d: Duration) -> bool {
    let end = Instant::now() + d;
    let mut buf = [0u8; 4096];
    loop {
        s.set_read_timeout(Some(d.min(Duration::from_millis(50))))
            .expect("timeout");
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
        if Instant::now() >= end {
            return false;
        }
    }
}

fn frame(h: Header, body: &[u8]) -> Vec<u8> {
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// Peak resident set of this process, in bytes.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn a_live_ps_survives_hostile_clients_and_serves_a_good_one() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    // Room for the PS's own files (listener, rings, eventfds) besides.
    raise_open_files((IDLE_SOCKETS + MAX_CONNECTIONS + 512) as u64);
    let cfg = config();
    let plan = plan(&cfg).expect("plan");
    let vars: &[VarDef] = &plan.shard_vars[0];
    let dense = vars
        .iter()
        .find(|v| matches!(v.kind, VarKind::Dense { .. }))
        .expect("a dense variable");
    let (dense_id, dense_len) = (dense.id, dense.width());
    let table = vars
        .iter()
        .find_map(|v| match v.kind {
            VarKind::Embedding { .. } => Some(v.id),
            VarKind::Dense { .. } => None,
        })
        .expect("a table");
    let layout = ReactorLayout::detect(&cfg, &ProcessReactors::ps_task(&cfg, 0)).expect("layout");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    // Every good client that hangs up counts as a worker that is done:
    // this PS waits for more than will come, and is stopped at the end.
    let ps = start_ps::<Tcp>(&cfg, &plan, 0, listener, 1 << 20, None, &layout).expect("PS");
    let addr = ps.addr().to_string();
    let w0 = weights(&cfg, &addr, dense_id);

    // Random bytes, before and after the preamble.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng as u8
            })
            .collect()
    };
    let mut s = TcpStream::connect(&addr).expect("connect");
    s.write_all(&noise(4096)).expect("write");
    assert!(closes(&s, Duration::from_secs(3)), "random bytes kept");
    let mut s = dial(&addr, 0, Instant::now() + Duration::from_secs(5)).expect("dial");
    let _ = s.write_all(&noise(1 << 16));
    assert!(closes(&s, Duration::from_secs(3)), "random frames kept");

    // An oversized length, and a truncated frame then silence.
    let mut s = dial(&addr, 0, Instant::now() + Duration::from_secs(5)).expect("dial");
    let mut h = Header::new(Opcode::Hello, 0, 0);
    h.body_len = u32::MAX;
    h.message_len = u32::MAX;
    let _ = s.write_all(&frame(h, &[0; 64]));
    assert!(closes(&s, Duration::from_secs(3)), "oversized length kept");
    let mut s = dial(&addr, 0, Instant::now() + Duration::from_secs(5)).expect("dial");
    let f = frame(Header::new(Opcode::Hello, 0, 100), &[0; 100]);
    s.write_all(&f[..50]).expect("write");
    assert!(closes(&s, HANDSHAKE * 3), "truncated frame kept");

    // Slowloris: a byte of the hello every 200 ms never finishes it.
    let mut peer = RawPeer::new(&addr, raw_config(Some(TOKEN)));
    let mut out = Collect::default();
    peer.conn.poll_transmit(&mut out).expect("transmit");
    let t0 = Instant::now();
    let mut closed = false;
    for b in out.0.iter().take(40) {
        if peer.s.write_all(&[*b]).is_err() || closes(&peer.s, Duration::from_millis(200)) {
            closed = true;
            break;
        }
    }
    assert!(closed, "slowloris kept");
    assert!(
        t0.elapsed() < HANDSHAKE * 4,
        "closed after {:?}",
        t0.elapsed()
    );

    // Many idle sockets: past --max-connections they are refused at once,
    // all are closed at the handshake timeout, and then a good client is
    // served.
    let t_idle = Instant::now();
    let idle: Vec<TcpStream> = (0..IDLE_SOCKETS)
        .filter_map(|i| {
            let s = TcpStream::connect(&addr).ok()?;
            // Half send their preamble and stop.
            if i % 2 == 0 {
                let _ = (&s).write_all(&starwire_transport::preamble::Preamble { shard: 0 }.emit());
            }
            Some(s)
        })
        .collect();
    assert_eq!(
        idle.len(),
        IDLE_SOCKETS,
        "idle sockets that could not connect"
    );
    // Let the acceptor take them all in.
    std::thread::sleep(Duration::from_millis(300));
    let refused = idle
        .iter()
        .filter(|s| closes(s, Duration::from_millis(1)))
        .count();
    assert!(
        refused >= IDLE_SOCKETS - MAX_CONNECTIONS,
        "{refused} refused at once"
    );
    std::thread::sleep(HANDSHAKE * 3);
    let kept = idle
        .iter()
        .filter(|s| !closes(s, Duration::from_millis(20)))
        .count();
    assert_eq!(kept, 0, "idle sockets kept past the handshake timeout");
    drop(idle);
    eprintln!(
        "hostile suite: {IDLE_SOCKETS} idle sockets, {refused} closed within 300 ms, all within {:?}",
        t_idle.elapsed()
    );
    assert_eq!(weights(&cfg, &addr, dense_id), w0);

    // Unauthenticated: a wrong token's push and checkpoint are never
    // served; a peer with no token is refused; hello-then-close many
    // times does not count as workers that are done.
    for token in [Some("not-the-cluster-token-at-all!!"), None] {
        let mut peer = RawPeer::new(&addr, raw_config(token));
        peer.send();
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, true).dense(dense_id, &vec![100.0; dense_len]);
        // Written raw: the message layer holds data until authenticated.
        let mut h = Header::new(Opcode::SparsePush, 1, b.len() as u32);
        h.flags = Flags::NONE;
        let _ = peer.s.write_all(&frame(h, &b));
        let ck = Control::Checkpoint("/tmp/starwire-hostile").encode();
        let _ = peer
            .s
            .write_all(&frame(Header::new(Opcode::Rpc, 2, ck.len() as u32), &ck));
        let got = peer.recv(Duration::from_secs(2));
        assert!(got.is_empty(), "answered {got:?}");
        assert!(
            peer.closed_within(HANDSHAKE * 2),
            "unauthenticated peer kept"
        );
    }
    assert!(!std::path::Path::new("/tmp/starwire-hostile").exists());
    assert_eq!(
        weights(&cfg, &addr, dense_id),
        w0,
        "changed without a token"
    );

    // An authenticated client that breaks the rules. An unfinished chunked
    // message: charged, then closed at the idle timeout.
    let mut peer = RawPeer::new(&addr, raw_config(Some(TOKEN)));
    assert!(peer.handshake(), "authenticated peer refused");
    let mut h = Header::new(Opcode::SparsePush, 9, 0);
    h.flags = Flags::MORE;
    h.message_len = 200 << 20;
    h.body_len = 512 << 10;
    let _ = peer.s.write_all(&frame(h, &vec![0; 512 << 10]));
    assert!(
        peer.closed_within(IDLE * 3),
        "unfinished chunked message kept"
    );

    // A client that never reads: its replies fill the budget (the rest
    // are answered Overloaded) and it is closed at the idle timeout.
    let mut peer = RawPeer::new(&addr, raw_config(Some(TOKEN)));
    assert!(peer.handshake());
    let keys: Vec<u64> = (0..10_000).collect();
    let mut pull = Vec::new();
    PullRequestWriter::new(&mut pull).rows(table, &keys);
    for _ in 0..400 {
        let _ = peer
            .conn
            .request(Opcode::SparsePull, 0, Payload::from(pull.clone()), None);
        peer.send();
    }
    let t0 = Instant::now();
    let mut closed = false;
    while t0.elapsed() < IDLE * 4 {
        std::thread::sleep(Duration::from_millis(200));
        if peer.s.write_all(&[]).is_err() || closes(&peer.s, Duration::from_millis(1)) {
            closed = true;
            break;
        }
    }
    assert!(closed, "a client that never reads was kept");
    drop(peer);

    // An oversized pull and a NaN push from the good client: statuses.
    let mut net = good(&cfg, &addr);
    let mut b = Vec::new();
    let mut w = PullRequestWriter::new(&mut b);
    for _ in 0..((1 << 20) / (4 * dense_len) + 2) {
        w.dense(dense_id);
    }
    w.rows(table, &keys);
    let r = one(&mut net, Opcode::SparsePull, b);
    assert_eq!(r.status, Some(Status::LimitExceeded));
    let mut b = Vec::new();
    let mut g = vec![0.5f32; dense_len];
    g[0] = f32::NAN;
    PushRequestWriter::new(&mut b, true).dense(dense_id, &g);
    let r = one(&mut net, Opcode::SparsePush, b);
    assert_eq!(r.status, Some(Status::NonFinite));
    let too_far = Control::WaitStep(1 << 40).encode();
    assert_eq!(
        one(&mut net, Opcode::Rpc, too_far).status,
        Some(Status::LimitExceeded)
    );
    let many: Vec<u64> = (100_000..130_000).collect();
    let mut b = Vec::new();
    PullRequestWriter::new(&mut b).rows(table, &many);
    assert_eq!(
        one(&mut net, Opcode::SparsePull, b).status,
        Some(Status::LimitExceeded),
        "past --max-rows"
    );
    net.close();
    assert_eq!(
        weights(&cfg, &addr, dense_id),
        w0,
        "changed by refused requests"
    );

    // An authenticated push is what changes the weights.
    let mut net = good(&cfg, &addr);
    let mut b = Vec::new();
    PushRequestWriter::new(&mut b, true).dense(dense_id, &vec![0.5f32; dense_len]);
    assert_eq!(
        one(&mut net, Opcode::SparsePush, b).status,
        Some(Status::Ok)
    );
    let mut b = Vec::new();
    PullRequestWriter::new(&mut b).dense(dense_id);
    let after = one(&mut net, Opcode::SparsePull, b);
    assert_ne!(after.body, w0, "an authenticated push changed nothing");

    net.close();
    Box::new(ps).stop();

    // Hello-then-close, many times, against a PS that waits for one
    // worker: none of them counts as that worker, so it serves on until
    // the real one is done.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let ps = start_ps::<Tcp>(&cfg, &plan, 0, listener, 1, None, &layout).expect("PS");
    let addr = ps.addr().to_string();
    for token in [None, Some("not-the-cluster-token-at-all!!")] {
        for _ in 0..5 {
            let mut peer = RawPeer::new(&addr, raw_config(token));
            peer.send();
            peer.recv(Duration::from_millis(50));
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut net = good(&cfg, &addr);
    let mut b = Vec::new();
    PullRequestWriter::new(&mut b).dense(dense_id);
    assert_eq!(
        one(&mut net, Opcode::SparsePull, b).status,
        Some(Status::Ok)
    );
    assert_eq!(
        one(&mut net, Opcode::Rpc, Control::Done.encode()).status,
        Some(Status::Ok)
    );
    net.close();
    ps.join().expect("the PS finishes when its worker is done");

    let peak = peak_rss();
    let bound = ((BUDGET_MB + 64) << 20) as u64;
    eprintln!(
        "hostile suite: peak RSS {} MiB (bound {} MiB)",
        peak >> 20,
        bound >> 20
    );
    assert!(peak <= bound, "peak RSS {peak} over {bound}");
}

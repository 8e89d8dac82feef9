//! The handshake's authentication and config agreement, and the bounds a
//! connection keeps: the handshake and idle timeouts, and the memory
//! budget of queued and reassembled messages. Two `Sessions` over an
//! in-memory pair, on a virtual clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use starwire_transport::testing::MemTransport;
use starwire_transport::wire::{Header, Opcode, Status, HEADER_LEN};
use starwire_transport::{
    ClusterToken, ConnConfig, ConnError, ConnId, Event, Incoming, Links, MemoryBudget, Payload,
    PeerInfo, SendError, Sessions, Side, TaskRole, Transport,
};

type Mem = Sessions<Links<MemTransport>>;

const MAX_FRAME: usize = 4096;

fn cfg(role: TaskRole, side: Side, token: Option<&str>, flags: &str) -> ConnConfig {
    let mut c = ConnConfig::new(PeerInfo {
        role,
        job: "t".into(),
        task_index: 0,
        incarnation: 1,
        shards: 1,
    });
    c.side = side;
    c.token = token.map(|t| ClusterToken::new(t.as_bytes()).expect("token"));
    c.flags = Arc::from(flags);
    c
}

fn worker(token: Option<&str>) -> ConnConfig {
    cfg(TaskRole::Worker, Side::Dialer, token, "")
}

fn ps(token: Option<&str>) -> ConnConfig {
    cfg(TaskRole::Ps, Side::Acceptor, token, "")
}

/// A worker (`a`) and a PS (`b`) end joined by one link.
fn pair(a_cfg: ConnConfig, b_cfg: ConnConfig) -> (Mem, Mem, ConnId, ConnId) {
    let (la, lb) = MemTransport::pair(MAX_FRAME, 256);
    let (mut a, mut b) = (
        Mem::new(Links::new(MAX_FRAME)),
        Mem::new(Links::new(MAX_FRAME)),
    );
    let ia = a.driver_mut().attach(la);
    let ib = b.driver_mut().attach(lb);
    a.insert(ia, a_cfg);
    b.insert(ib, b_cfg);
    (a, b, ia, ib)
}

/// Turn both ends `rounds` times at `now`; `b` answers every request with
/// its body. Returns the requests `b` was handed.
fn turns(a: &mut Mem, b: &mut Mem, rounds: usize, now: Instant) -> usize {
    let mut served = 0;
    for _ in 0..rounds {
        a.turn(now, &mut |_, _, _| {});
        b.turn(now, &mut |_, c, m| {
            if let Incoming::Request {
                id, opcode, body, ..
            } = m
            {
                served += 1;
                let _ = c.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()));
            }
        });
    }
    served
}

fn failure(s: &mut Mem) -> Option<ConnError> {
    s.poll_failed().map(|(_, _, e)| e)
}

const TOKEN: &str = "a-cluster-token-of-32-characters";

#[test]
fn peers_with_the_same_token_connect_and_exchange() {
    let (mut a, mut b, ia, ib) = pair(worker(Some(TOKEN)), ps(Some(TOKEN)));
    let now = Instant::now();
    let id = a
        .conn(ia)
        .expect("held")
        .request(Opcode::Rpc, 0, Payload::from(vec![1, 2, 3]), None)
        .expect("queued");
    let mut answered = false;
    let mut served = 0;
    for _ in 0..5 {
        a.turn(now, &mut |_, _, m| {
            answered |= matches!(m, Incoming::Response { id: got, .. } if got == id);
        });
        served += turns(&mut Mem::new(Links::new(MAX_FRAME)), &mut b, 1, now);
    }
    assert_eq!(served, 1);
    assert!(answered);
    assert!(a.conn_ref(ia).expect("held").is_established());
    assert!(b.conn_ref(ib).expect("held").is_established());
}

#[test]
fn a_wrong_token_or_none_is_refused_before_any_request_is_served() {
    for (w, p) in [
        (Some("another-token-of-32-characters!!"), Some(TOKEN)),
        (None, Some(TOKEN)),
    ] {
        let (mut a, mut b, ia, _) = pair(worker(w), ps(p));
        a.conn(ia)
            .expect("held")
            .request(Opcode::SparsePush, 0, Payload::from(vec![9; 64]), None)
            .expect("queued");
        let served = turns(&mut a, &mut b, 6, Instant::now());
        assert_eq!(served, 0, "a request of an unauthenticated peer was served");
        let e = failure(&mut b).expect("the PS end closed");
        assert!(matches!(e, ConnError::Unauthenticated(_)), "{e}");
        a.turn(Instant::now(), &mut |_, _, _| {});
        assert!(failure(&mut a).is_some(), "the worker end saw no failure");
    }
    // A PS without a token is refused by a worker that has one, and the
    // other way round.
    let (mut a, mut b, _, _) = pair(worker(Some(TOKEN)), ps(None));
    turns(&mut a, &mut b, 4, Instant::now());
    assert!(matches!(failure(&mut b), Some(ConnError::Handshake(_))));
    a.turn(Instant::now(), &mut |_, _, _| {});
    assert!(failure(&mut a).is_some());
    let (mut a, mut b, _, _) = pair(worker(None), ps(Some(TOKEN)));
    turns(&mut a, &mut b, 4, Instant::now());
    assert!(matches!(
        failure(&mut b),
        Some(ConnError::Unauthenticated(_))
    ));
}

#[test]
fn an_acceptor_sends_no_proof_and_no_flags_to_a_peer_that_proved_nothing() {
    // The PS end with a token, facing a raw peer that sends a Hello with
    // the token flag and then nothing: the PS must send its Hello only.
    let (mut raw, lb) = MemTransport::pair(MAX_FRAME, 64);
    let mut b = Mem::new(Links::new(MAX_FRAME));
    let ib = b.driver_mut().attach(lb);
    b.insert(
        ib,
        cfg(TaskRole::Ps, Side::Acceptor, Some(TOKEN), "model=wdl\n"),
    );
    let hello = starwire_transport::wire::message::Hello {
        protocol_version: starwire_transport::PROTOCOL_VERSION,
        flags: starwire_transport::wire::message::HELLO_FLAG_AUTH,
        role: starwire_transport::wire::message::Role::Worker,
        job_name: "w",
        task_index: 0,
        incarnation: 1,
        initial_credits: 8,
        max_frame_len: MAX_FRAME as u32,
        shard_count: 1,
        nonce: [1; 16],
    };
    let mut f = vec![0u8; HEADER_LEN + hello.encoded_len()];
    Header::new(Opcode::Hello, 0, hello.encoded_len() as u32).emit(&mut f);
    hello.emit(&mut f[HEADER_LEN..]);
    let buf = raw.tx_reserve(f.len()).expect("reserve").expect("room");
    buf.copy_from_slice(&f);
    raw.tx_commit(f.len());
    raw.flush(Instant::now()).expect("flush");
    for _ in 0..4 {
        b.turn(Instant::now(), &mut |_, _, _| panic!("nothing to deliver"));
    }
    let mut opcodes = Vec::new();
    raw.rx_burst(Instant::now(), 16, &mut |frame: &[u8]| {
        opcodes.push(frame[5]);
    })
    .expect("receive");
    assert_eq!(
        opcodes,
        [Opcode::Hello as u8],
        "the PS said more than hello"
    );
}

#[test]
fn flags_that_differ_fail_the_connection_naming_them() {
    let a_cfg = cfg(
        TaskRole::Worker,
        Side::Dialer,
        Some(TOKEN),
        "model=wdl\nembedding-dim=8\n",
    );
    let b_cfg = cfg(
        TaskRole::Ps,
        Side::Acceptor,
        Some(TOKEN),
        "model=wdl\nembedding-dim=64\n",
    );
    let (mut a, mut b, _, _) = pair(a_cfg, b_cfg);
    turns(&mut a, &mut b, 4, Instant::now());
    let e = failure(&mut b).expect("the PS end failed");
    assert_eq!(
        e.to_string(),
        "training flags differ from the peer's: --embedding-dim (64 here, 8 at the peer)"
    );
    // The PS, sure of the worker, sent its proof and flags before it
    // closed: the worker names them too.
    a.turn(Instant::now(), &mut |_, _, _| {});
    let e = failure(&mut a).expect("the worker end failed");
    assert_eq!(
        e.to_string(),
        "training flags differ from the peer's: --embedding-dim (8 here, 64 at the peer)"
    );
    // Equal flags (in another order) connect; an end with none compares
    // nothing.
    for flags in ["embedding-dim=8\nmodel=wdl\n", ""] {
        let a_cfg = cfg(
            TaskRole::Worker,
            Side::Dialer,
            None,
            "model=wdl\nembedding-dim=8\n",
        );
        let (mut a, mut b, ia, _) = pair(a_cfg, cfg(TaskRole::Ps, Side::Acceptor, None, flags));
        turns(&mut a, &mut b, 4, Instant::now());
        assert!(a.conn_ref(ia).expect("held").is_established(), "{flags:?}");
    }
}

#[test]
fn a_peer_silent_after_connecting_is_closed_at_the_handshake_timeout() {
    let (_raw, lb) = MemTransport::pair(MAX_FRAME, 64);
    let mut b = Mem::new(Links::new(MAX_FRAME));
    let ib = b.driver_mut().attach(lb);
    b.insert(ib, ps(Some(TOKEN)));
    let t0 = Instant::now();
    b.conn(ib)
        .expect("held")
        .set_handshake_deadline(t0 + Duration::from_secs(5));
    assert_eq!(b.poll_timeout(), Some(t0 + Duration::from_secs(5)));
    b.turn(t0 + Duration::from_secs(4), &mut |_, _, _| {});
    assert!(failure(&mut b).is_none());
    b.turn(t0 + Duration::from_secs(5), &mut |_, _, _| {});
    let e = failure(&mut b).expect("closed");
    assert!(matches!(e, ConnError::TimedOut(_)), "{e}");
}

#[test]
fn idle_connections_and_peers_that_stop_reading_are_closed_at_the_idle_timeout() {
    let idle = Duration::from_secs(30);
    let mut b_cfg = ps(None);
    b_cfg.idle_timeout = Some(idle);
    b_cfg.recv_window = 4;
    let (mut a, mut b, ia, _) = pair(worker(None), b_cfg.clone());
    let t0 = Instant::now();
    turns(&mut a, &mut b, 4, t0);
    // Traffic keeps it open.
    let t1 = t0 + idle - Duration::from_secs(1);
    a.conn(ia)
        .expect("held")
        .request(Opcode::Rpc, 0, Payload::from(vec![1]), None)
        .expect("queued");
    turns(&mut a, &mut b, 2, t1);
    b.turn(t0 + idle, &mut |_, _, _| {});
    assert!(failure(&mut b).is_none(), "closed while busy");
    // Then silence.
    b.turn(t1 + idle, &mut |_, _, _| {});
    let e = failure(&mut b).expect("idle connection closed");
    assert_eq!(
        e.to_string(),
        "nothing received or sent within the idle timeout"
    );

    // A peer that sends requests but never reads: its replies pile up.
    let (la, lb) = MemTransport::pair(MAX_FRAME, 256);
    let (mut a, mut b) = (
        Mem::new(Links::new(MAX_FRAME)),
        Mem::new(Links::new(MAX_FRAME)),
    );
    let ia = a.driver_mut().attach(la);
    let ib = b.driver_mut().attach(lb);
    let mut a_cfg = worker(None);
    a_cfg.recv_window = 2;
    a_cfg.auto_credit = false;
    a.insert(ia, a_cfg);
    b.insert(ib, b_cfg);
    let t0 = Instant::now();
    turns(&mut a, &mut b, 4, t0);
    let mut t = t0;
    for _ in 0..40 {
        t += Duration::from_secs(1);
        for _ in 0..2 {
            let _ = a.conn(ia).expect("held").request(
                Opcode::Rpc,
                0,
                Payload::from(vec![7; 100]),
                None,
            );
        }
        // The worker sends but takes nothing in.
        a.flush(t);
        b.turn(t, &mut |_, c, m| {
            if let Incoming::Request { id, opcode, .. } = m {
                let _ = c.respond(id, opcode, Status::Ok, Payload::from(vec![0; 100]));
            }
        });
        if let Some(e) = failure(&mut b) {
            assert_eq!(
                e.to_string(),
                "the peer read none of its replies within the idle timeout"
            );
            assert!(t >= t0 + idle, "closed too early");
            return;
        }
    }
    panic!("a peer that never reads was kept");
}

#[test]
fn queued_replies_and_reassembly_are_bounded_by_the_budget_and_released() {
    let budget = MemoryBudget::new(10_000);
    let mut b_cfg = ps(None);
    b_cfg.budget = Some(budget.clone());
    let (mut a, mut b, _, ib) = pair(worker(None), b_cfg.clone());
    let now = Instant::now();
    turns(&mut a, &mut b, 4, now);
    let c = b.conn(ib).expect("held");
    c.respond(1, Opcode::Rpc, Status::Ok, Payload::from(vec![0; 6000]))
        .expect("fits");
    assert_eq!(budget.used(), 6000);
    let e = c
        .respond(2, Opcode::Rpc, Status::Ok, Payload::from(vec![0; 6000]))
        .expect_err("over the budget");
    assert!(
        matches!(e, SendError::OverBudget(ref p) if p.len() == 6000),
        "{e}"
    );
    // The short error reply is queued anyway, and counted.
    c.respond_error(2, Opcode::Rpc, Status::Overloaded, "no room")
        .expect("queued");
    assert_eq!(budget.used(), 6007);
    // Sent: released.
    turns(&mut a, &mut b, 6, now);
    assert_eq!(budget.used(), 0);

    // A chunked message is charged while it is reassembled; one too large
    // for the budget ends its connection alone.
    let (mut a, mut b, ia, ib) = pair(worker(None), b_cfg.clone());
    turns(&mut a, &mut b, 4, now);
    a.conn(ia)
        .expect("held")
        .request(Opcode::Rpc, 0, Payload::from(vec![3; 9000]), None)
        .expect("queued");
    assert_eq!(
        turns(&mut a, &mut b, 8, now),
        1,
        "a message within the budget"
    );
    assert_eq!(budget.used(), 0, "reassembly not released");
    a.conn(ia)
        .expect("held")
        .request(Opcode::Rpc, 0, Payload::from(vec![3; 200_000]), None)
        .expect("queued");
    turns(&mut a, &mut b, 8, now);
    let e = failure(&mut b).expect("closed");
    assert!(matches!(e, ConnError::OverBudget(_)), "{e}");
    assert!(b.conn_ref(ib).is_none());
    assert_eq!(budget.used(), 0, "a closed connection kept its charge");
    // Events of the closed one do not matter; a new connection is served.
    let (mut a, mut b, ia, _) = pair(worker(None), b_cfg);
    turns(&mut a, &mut b, 4, now);
    a.conn(ia)
        .expect("held")
        .request(Opcode::Rpc, 0, Payload::from(vec![1; 10]), None)
        .expect("queued");
    assert_eq!(turns(&mut a, &mut b, 4, now), 1);
    let mut events = Vec::new();
    a.poll_events(&mut |_, _, e| events.push(e));
    assert!(events.iter().any(|e| matches!(e, Event::Connected(_))));
}

/// A PS that knows the cluster's worker count refuses, at the handshake,
/// a peer claiming a worker task index past it, and serves one below it.
#[test]
fn a_worker_index_past_the_cluster_is_refused_at_the_handshake() {
    for (index, refused) in [(2u32, true), (1, false)] {
        let mut w = worker(Some(TOKEN));
        w.local.task_index = index;
        let mut p = ps(Some(TOKEN));
        p.workers = Some(2);
        let (mut a, mut b, ia, ib) = pair(w, p);
        a.conn(ia)
            .expect("held")
            .request(Opcode::SparsePull, 0, Payload::from(vec![9; 64]), None)
            .expect("queued");
        let served = turns(&mut a, &mut b, 6, Instant::now());
        if refused {
            assert_eq!(served, 0, "a request of worker {index} was served");
            let e = failure(&mut b).expect("the PS end closed");
            assert!(
                matches!(&e, ConnError::Handshake(m) if m.contains("worker 2") && m.contains("2 workers")),
                "{e}"
            );
        } else {
            assert_eq!(served, 1);
            assert!(b.conn_ref(ib).expect("held").is_established());
        }
    }
}

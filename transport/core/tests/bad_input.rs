//! Bad input: every framing error closes only its own connection with a
//! typed error; semantic errors fail one request and the connection lives.

use std::time::Instant;

use starwire_transport::conformance::{link_pairs, Pair, Side};
use starwire_transport::testing::MemTransport;
use starwire_transport::wire::message::{AuthMsg, Hello, Role};
use starwire_transport::wire::{Flags, FrameError, Header, Opcode, Status, HEADER_LEN};
use starwire_transport::{
    ConnConfig, ConnError, ConnId, Connection, Driver, Incoming, Links, Payload, PeerInfo,
    Sessions, TaskRole, Transport,
};

const MAX_FRAME: usize = 4096;

fn local(role: TaskRole) -> ConnConfig {
    ConnConfig::new(PeerInfo {
        role,
        job: "ps".into(),
        task_index: 0,
        incarnation: 1,
        shards: 1,
    })
}

fn hello_frame(credits: u32) -> Vec<u8> {
    hello_frame_of(credits, MAX_FRAME as u32)
}

fn hello_frame_of(credits: u32, max_frame_len: u32) -> Vec<u8> {
    let h = Hello {
        protocol_version: starwire_transport::PROTOCOL_VERSION,
        flags: 0,
        role: Role::Worker,
        job_name: "worker",
        task_index: 0,
        incarnation: 9,
        initial_credits: credits,
        max_frame_len,
        shard_count: 1,
        nonce: [7; 16],
    };
    let mut f = vec![0u8; HEADER_LEN + h.encoded_len()];
    Header::new(Opcode::Hello, 0, h.encoded_len() as u32).emit(&mut f);
    h.emit(&mut f[HEADER_LEN..]);
    f
}

/// The handshake's second frame of a peer without a token or flags.
fn auth_frame() -> Vec<u8> {
    let body = AuthMsg {
        proof: [0; 32],
        config: "",
    }
    .to_vec()
    .expect("auth");
    frame(Header::new(Opcode::Auth, 0, body.len() as u32), &body)
}

fn send_raw(t: &mut MemTransport, frame: &[u8]) {
    let buf = t.tx_reserve(frame.len()).expect("reserve").expect("room");
    buf.copy_from_slice(frame);
    t.tx_commit(frame.len());
    t.flush(Instant::now()).expect("flush");
}

/// The PS end of an in-memory pair, as the only connection of a driver;
/// the other end is left raw for the test to write frames into.
fn ps_end(cfg: ConnConfig) -> (MemTransport, Sessions<Links<MemTransport>>, ConnId) {
    let (raw, b) = MemTransport::pair(MAX_FRAME, 64);
    let mut links = Links::new(MAX_FRAME);
    let id = links.attach(b);
    let mut ps = Sessions::new(links);
    ps.insert(id, cfg);
    (raw, ps, id)
}

/// A PS connection fed raw frames by a hand-driven peer. Returns the error
/// the connection ended with.
fn feed(frames: &[Vec<u8>]) -> ConnError {
    let (mut raw, mut ps, id) = ps_end(local(TaskRole::Ps));
    for f in frames {
        send_raw(&mut raw, f);
    }
    let now = Instant::now();
    for _ in 0..10 {
        ps.turn(now, &mut |_, _, _| {});
        if let Some((failed, conn, e)) = ps.poll_failed() {
            assert_eq!(failed, id);
            assert!(conn.is_closed(), "connection left open after {e}");
            return e;
        }
    }
    panic!("bad input was accepted");
}

fn frame(h: Header, body: &[u8]) -> Vec<u8> {
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

#[test]
fn bad_magic_closes() {
    let mut f = frame(Header::new(Opcode::Rpc, 1, 4), &[1, 2, 3, 4]);
    f[0] = b'X';
    let e = feed(&[hello_frame(8), auth_frame(), f]);
    assert!(
        matches!(e, ConnError::Frame(FrameError::BadMagic(_))),
        "{e}"
    );
}

#[test]
fn truncated_frame_closes() {
    let mut f = frame(Header::new(Opcode::Rpc, 1, 100), &[0; 100]);
    f.truncate(HEADER_LEN + 10);
    let e = feed(&[hello_frame(8), auth_frame(), f]);
    assert!(
        matches!(e, ConnError::Frame(FrameError::Truncated { .. })),
        "{e}"
    );
}

#[test]
fn oversized_length_closes_without_allocating() {
    // Announces a 4 GiB - 1 body in a short frame.
    let mut h = Header::new(Opcode::Rpc, 1, 0);
    h.body_len = u32::MAX;
    h.message_len = u32::MAX;
    let e = feed(&[hello_frame(8), auth_frame(), frame(h, &[0; 16])]);
    assert!(
        matches!(e, ConnError::Frame(FrameError::Oversized { .. })),
        "{e}"
    );
}

#[test]
fn length_overflow_closes() {
    // A chunked message whose chunks add up to more than it announced.
    let mut first = Header::new(Opcode::Rpc, 1, 64);
    first.flags = Flags::MORE;
    first.message_len = 100;
    let mut second = Header::new(Opcode::Rpc, 1, 64);
    second.flags = Flags::CONTINUATION;
    second.message_len = 100;
    let e = feed(&[
        hello_frame(8),
        auth_frame(),
        frame(first, &[1; 64]),
        frame(second, &[2; 64]),
    ]);
    assert!(matches!(e, ConnError::Protocol(_)), "{e}");
}

#[test]
fn body_longer_than_message_closes() {
    let mut h = Header::new(Opcode::Rpc, 1, 64);
    h.message_len = 10;
    let e = feed(&[hello_frame(8), auth_frame(), frame(h, &[0; 64])]);
    assert!(
        matches!(e, ConnError::Frame(FrameError::BadLength(_))),
        "{e}"
    );
}

#[test]
fn unknown_opcode_closes() {
    let mut f = frame(Header::new(Opcode::Rpc, 1, 0), &[]);
    f[5] = 0x7e;
    let e = feed(&[hello_frame(8), auth_frame(), f]);
    assert!(
        matches!(e, ConnError::Frame(FrameError::UnknownOpcode(0x7e))),
        "{e}"
    );
}

#[test]
fn data_before_handshake_closes() {
    let e = feed(&[frame(Header::new(Opcode::Rpc, 1, 0), &[])]);
    assert!(matches!(e, ConnError::Protocol(_)), "{e}");
}

#[test]
fn frames_beyond_credit_close() {
    let mut cfg = local(TaskRole::Ps);
    cfg.recv_window = 2;
    cfg.auto_credit = false;
    let (mut raw, mut ps, _) = ps_end(cfg);
    send_raw(&mut raw, &hello_frame(8));
    send_raw(&mut raw, &auth_frame());
    for i in 0..3 {
        let mut h = Header::new(Opcode::Rpc, i + 1, 0);
        h.flags = Flags::ONEWAY;
        h.request_id = 0;
        send_raw(&mut raw, &frame(h, &[]));
    }
    ps.turn(Instant::now(), &mut |_, _, _| {});
    let r = ps.poll_failed().map(|(_, _, e)| e);
    assert!(matches!(r, Some(ConnError::Protocol(_))), "{r:?}");
}

#[test]
fn bad_handshake_closes() {
    let mut hello = hello_frame(8);
    hello[HEADER_LEN] = 99; // protocol version 99
    let e = feed(&[hello]);
    assert!(matches!(e, ConnError::Handshake(_)), "{e}");
    let mut short = frame(Header::new(Opcode::Hello, 0, 4), &[1, 0, 0, 0]);
    short.truncate(HEADER_LEN + 4);
    let e = feed(&[short]);
    assert!(matches!(e, ConnError::Handshake(_)), "{e}");
}

#[test]
fn one_bad_connection_does_not_disturb_another() {
    // Two connections of one driver; the first gets garbage.
    let mut pair = Pair::new(link_pairs(2, || MemTransport::pair(MAX_FRAME, 64)));
    pair.establish();
    let mut f = frame(Header::new(Opcode::Rpc, 1, 4), &[1, 2, 3, 4]);
    f[4] = 42; // version
    let bad = pair.a_ids[0];
    let buf = pair.a.driver_mut().tx_reserve(bad, f.len());
    buf.expect("reserve").expect("room").copy_from_slice(&f);
    pair.a.driver_mut().tx_commit(bad, f.len());
    let id = pair
        .a(1)
        .request(Opcode::Rpc, 0, Payload::from(vec![5u8; 10]), None)
        .expect("queue");
    let mut ok = false;
    let mut rejected = false;
    pair.drive_with(
        &mut |i, _, m| {
            if let Incoming::Response { id: got, .. } = m {
                assert_eq!((i, got), (1, id));
                ok = true;
            }
        },
        &mut |_, c: &mut Connection, m| {
            if let Incoming::Request { id, opcode, .. } = m {
                c.respond(id, opcode, Status::Ok, Payload::empty())
                    .expect("respond");
            }
        },
        &mut |f| {
            assert_eq!(f.index, 0, "the good connection failed: {}", f.error);
            if f.side == Side::B {
                assert!(
                    matches!(f.error, ConnError::Frame(FrameError::BadVersion(42))),
                    "{}",
                    f.error
                );
                rejected = true;
            }
        },
        &mut |p| p.a(1).pending_requests() == 0,
    );
    assert!(ok);
    assert!(rejected);
    assert!(pair.a(1).is_established() && pair.b(1).is_established());
}

#[test]
fn semantic_error_fails_one_request_only() {
    let mut pair = Pair::new(link_pairs(1, || MemTransport::pair(MAX_FRAME, 64)));
    // Variable 99 is unknown at the server; 1 is known.
    let bad = pair
        .a(0)
        .request(
            Opcode::DensePull,
            0,
            Payload::from(99u32.to_le_bytes().to_vec()),
            None,
        )
        .expect("queue");
    let good = pair
        .a(0)
        .request(
            Opcode::DensePull,
            0,
            Payload::from(1u32.to_le_bytes().to_vec()),
            None,
        )
        .expect("queue");
    let mut statuses = Vec::new();
    pair.drive(
        &mut |_, _, m| {
            if let Incoming::Response { id, status, .. } = m {
                statuses.push((id, status));
            }
        },
        &mut |_, c: &mut Connection, m| {
            if let Incoming::Request {
                id, opcode, body, ..
            } = m
            {
                let var = u32::from_le_bytes(body[..4].try_into().expect("4 bytes"));
                let status = if var == 1 {
                    Status::Ok
                } else {
                    Status::UnknownVariable
                };
                c.respond(id, opcode, status, Payload::empty())
                    .expect("respond");
            }
        },
        &mut |p| p.a(0).pending_requests() == 0,
    );
    assert_eq!(
        statuses,
        vec![(bad, Status::UnknownVariable), (good, Status::Ok)]
    );
    assert!(pair.a(0).is_established());
    assert!(pair.b(0).is_established());
}

/// A chunked reply to no pending request is dropped whole when its last
/// chunk lands: nothing is delivered and no buffer is handed to the
/// caller (who would hold it uncharged), and the budget is back to 0.
/// `scratch` starts empty: had the connection handed it the reassembled
/// message, it would hold the message's 3000 bytes.
#[test]
fn a_chunked_reply_no_request_waits_for_is_dropped_with_its_buffer() {
    let budget = starwire_transport::MemoryBudget::new(1 << 20);
    let mut conn = budgeted(&budget);
    let mut scratch = Vec::new();
    let mut first = Header::new(Opcode::Rpc, 0xdead, 1000);
    first.flags = Flags::RESPONSE.with(Flags::MORE);
    first.message_len = 3000;
    let mut last = first;
    last.flags = Flags::RESPONSE.with(Flags::CONTINUATION);
    let mut mid = last;
    mid.flags = last.flags.with(Flags::MORE);
    for (h, byte) in [(first, 1u8), (mid, 2), (last, 3)] {
        let f = frame(h, &[byte; 1000]);
        let got = conn
            .handle_frame(&f, &mut scratch)
            .expect("the connection lives");
        assert!(got.is_none(), "a reply nobody asked for was delivered");
    }
    assert_eq!(scratch.capacity(), 0, "the caller was handed the buffer");
    assert_eq!(budget.used(), 0);
}

/// A budgeted acceptor past its handshake.
fn budgeted(budget: &starwire_transport::MemoryBudget) -> Connection {
    let mut cfg = local(TaskRole::Ps);
    cfg.side = starwire_transport::Side::Acceptor;
    cfg.budget = Some(budget.clone());
    let mut conn = Connection::new(cfg, MAX_FRAME);
    let mut scratch = Vec::new();
    for f in [hello_frame(64), auth_frame()] {
        conn.handle_frame(&f, &mut scratch).expect("handshake");
    }
    conn
}

/// Chunks that break WIRE.md's rules close the connection: an empty
/// chunk, a first chunk holding the whole message, a continuation whose
/// status, shard or one-way flag differs from its first chunk's.
#[test]
fn chunks_that_break_the_rules_close() {
    let budget = starwire_transport::MemoryBudget::new(1 << 20);
    let mut first = Header::new(Opcode::Rpc, 5, 100);
    first.flags = Flags::MORE;
    first.message_len = 200;
    let mut next = first;
    next.flags = Flags::CONTINUATION;
    let mut whole = first;
    whole.message_len = 100;
    let mut empty = next;
    empty.body_len = 0;
    let mut other_status = next;
    other_status.status = Status::Internal;
    let mut other_shard = next;
    other_shard.shard_id = 3;
    let mut oneway = next;
    oneway.flags = next.flags.with(Flags::ONEWAY);
    let cases: [(&str, Vec<Vec<u8>>); 5] = [
        ("empty", vec![frame(first, &[1; 100]), frame(empty, &[])]),
        ("whole", vec![frame(whole, &[1; 100])]),
        (
            "status",
            vec![frame(first, &[1; 100]), frame(other_status, &[2; 100])],
        ),
        (
            "shard",
            vec![frame(first, &[1; 100]), frame(other_shard, &[2; 100])],
        ),
        (
            "oneway",
            vec![frame(first, &[1; 100]), frame(oneway, &[2; 100])],
        ),
    ];
    for (what, frames) in cases {
        let mut conn = budgeted(&budget);
        let mut scratch = Vec::new();
        let mut err = None;
        for f in &frames {
            if let Err(e) = conn.handle_frame(f, &mut scratch) {
                err = Some(e);
                break;
            }
        }
        assert!(
            matches!(err, Some(ConnError::Protocol(_))),
            "{what}: {err:?}"
        );
        assert_eq!(budget.used(), 0, "{what}");
    }
}

/// A message half reassembled gives its bytes back when the connection is
/// closed, locally or by the peer's Goodbye, not only when it is dropped.
#[test]
fn a_half_reassembled_message_is_released_at_close() {
    let budget = starwire_transport::MemoryBudget::new(1 << 20);
    let mut first = Header::new(Opcode::Rpc, 5, 100);
    first.flags = Flags::MORE;
    first.message_len = 200;
    for by_peer in [false, true] {
        let mut conn = budgeted(&budget);
        let mut scratch = Vec::new();
        conn.handle_frame(&frame(first, &[1; 100]), &mut scratch)
            .expect("first chunk");
        assert!(budget.used() > 0);
        if by_peer {
            let bye = frame(Header::new(Opcode::Goodbye, 0, 0), &[]);
            conn.handle_frame(&bye, &mut scratch).expect("goodbye");
        } else {
            conn.close();
        }
        assert_eq!(budget.used(), 0, "by peer: {by_peer}");
        drop(conn);
    }
}

/// A peer whose largest frame cannot carry this end's handshake proof and
/// flags (control frames are never chunked) fails the handshake naming
/// the sizes, instead of being sent a chunked control frame.
#[test]
fn a_peer_frame_too_small_for_the_handshake_fails_it() {
    let mut cfg = local(TaskRole::Ps);
    cfg.side = starwire_transport::Side::Acceptor;
    cfg.flags = format!("model=wdl\nembedding-dim=8\nnote={}\n", "x".repeat(300)).into();
    let mut conn = Connection::new(cfg, MAX_FRAME);
    let mut scratch = Vec::new();
    let small = (HEADER_LEN + 128) as u32;
    let e = conn
        .handle_frame(&hello_frame_of(8, small), &mut scratch)
        .expect_err("refused");
    assert!(
        matches!(&e, ConnError::Handshake(m) if m.contains("cannot carry")),
        "{e}"
    );
}

/// A request that expires while still queued (here: before the handshake
/// let anything leave) is taken out of the queue, its bytes given back,
/// rather than sent later to a peer that would work for nobody.
#[test]
fn a_request_that_expires_queued_is_not_sent() {
    let budget = starwire_transport::MemoryBudget::new(1 << 20);
    let mut cfg = local(TaskRole::Worker);
    cfg.budget = Some(budget.clone());
    let mut conn = Connection::new(cfg, MAX_FRAME);
    let t0 = Instant::now();
    let deadline = t0 + std::time::Duration::from_millis(100);
    let id = conn
        .request(
            Opcode::Rpc,
            0,
            Payload::from(vec![1u8; 1000]),
            Some(deadline),
        )
        .expect("queued");
    let queued = budget.used();
    assert!(queued >= 1000, "{queued}");
    conn.handle_timeout(deadline + std::time::Duration::from_millis(1));
    let mut failed = false;
    while let Some(ev) = conn.poll_event() {
        failed |= matches!(
            ev,
            starwire_transport::Event::RequestFailed { id: i, .. } if i == id
        );
    }
    assert!(failed, "the request did not fail at its deadline");
    assert_eq!(budget.used(), 0, "the expired request is still queued");
}

//! The message layer over two drivers, on every connection at once.
//!
//! Every body starts with a tag naming its connection (and whether the
//! echo handler answers it); receivers check the tag against the
//! connection the message arrived on.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_wire::{Opcode, Status, HEADER_LEN};

use super::pair::{peer, Pair};
use super::DriverPair;
use crate::connection::{
    ConnConfig, Connection, Event, Incoming, Payload, RequestError, SendError, TaskRole,
};
use crate::driver::Driver;

/// Bytes of the tag every body starts with: one saying whether the echo
/// handler answers, four naming the connection.
pub(super) const TAG_LEN: usize = 5;
const ANSWER: u8 = 0;
const SILENT: u8 = 0xff;

/// The tag of a body sent on connection `i`.
pub(super) fn tag(i: usize, answer: bool) -> [u8; TAG_LEN] {
    let mut t = [if answer { ANSWER } else { SILENT }; TAG_LEN];
    let i = u32::try_from(i).expect("fewer than 2^32 connections");
    t[1..].copy_from_slice(&i.to_le_bytes());
    t
}

/// A body of `len` (at least [`TAG_LEN`]) bytes for connection `i`: the
/// tag, then random bytes.
pub(super) fn tagged(i: usize, answer: bool, len: usize, rng: &mut SmallRng) -> Vec<u8> {
    let mut v = vec![0u8; len.max(TAG_LEN)];
    v[..TAG_LEN].copy_from_slice(&tag(i, answer));
    rng.fill(&mut v[TAG_LEN..]);
    v
}

/// The connection `body` was sent on.
pub(super) fn tag_of(body: &[u8]) -> usize {
    let t = body
        .get(1..TAG_LEN)
        .unwrap_or_else(|| panic!("a body of {} bytes has no tag", body.len()));
    u32::from_le_bytes(t.try_into().expect("4 bytes")) as usize
}

/// Panics unless `body` was sent on connection `j`.
pub(super) fn check_tag(body: &[u8], j: usize, what: &str) {
    let i = tag_of(body);
    assert_eq!(i, j, "a {what} of connection {i} arrived on connection {j}");
}

/// The server's handler: answer each request on connection `j` with its
/// own body, unless it asks for no answer.
pub(super) fn echo(j: usize, conn: &mut Connection, m: Incoming<'_>) {
    if let Incoming::Request {
        id,
        opcode,
        oneway: false,
        body,
        ..
    } = m
    {
        check_tag(body, j, "request");
        if body[0] == SILENT {
            return;
        }
        conn.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()))
            .expect("respond");
    }
}

/// Queue `k` requests of random sizes (below `max_len`) on each of the
/// connections `conns` and drive until each came back, matched to its id.
pub(super) fn echo_round<A: Driver, B: Driver>(
    p: &mut Pair<A, B>,
    conns: &[usize],
    k: usize,
    max_len: usize,
    seed: u64,
) {
    let mut expect: HashMap<usize, HashMap<u64, Vec<u8>>> = HashMap::new();
    for &i in conns {
        let mut rng = SmallRng::seed_from_u64(seed ^ ((i as u64) << 20));
        let want = expect.entry(i).or_default();
        for _ in 0..k {
            let len = rng.gen_range(TAG_LEN..max_len.max(TAG_LEN + 1));
            let body = tagged(i, true, len, &mut rng);
            let id = p
                .a(i)
                .request(Opcode::Rpc, 0, Payload::from(body.clone()), None)
                .expect("queue request");
            want.insert(id, body);
        }
    }
    let left = Cell::new(conns.len() * k);
    let mut on_a = |i: usize, _: &mut Connection, m: Incoming<'_>| match m {
        Incoming::Response {
            id, status, body, ..
        } => {
            assert_eq!(status, Status::Ok);
            let want = expect
                .get_mut(&i)
                .and_then(|w| w.remove(&id))
                .unwrap_or_else(|| panic!("connection {i}: response {id} to no request"));
            assert!(want == body, "connection {i}: response {id} differs");
            left.set(left.get() - 1);
        }
        Incoming::Request { .. } => panic!("connection {i}: the client got a request"),
    };
    p.drive(&mut on_a, &mut echo, &mut |_| left.get() == 0);
}

/// Both ends of every connection learn who the other is.
pub fn handshake<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let mut p = Pair::new(drivers);
    p.establish();
    for i in 0..p.connections() {
        let pa = p.a(i).peer().cloned();
        assert_eq!(pa, Some(peer(TaskRole::Ps, i, 22)), "connection {i} at a");
        let pb = p.b(i).peer().cloned();
        assert_eq!(
            pb,
            Some(peer(TaskRole::Worker, i, 11)),
            "connection {i} at b"
        );
        assert!(matches!(p.a(i).poll_event(), Some(Event::Connected(_))));
        assert!(matches!(p.b(i).poll_event(), Some(Event::Connected(_))));
    }
}

/// Requests of many sizes come back matched to their ids, on every
/// connection.
pub fn rpc_echo<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let mut p = Pair::new(drivers);
    let all: Vec<usize> = (0..p.connections()).collect();
    echo_round(&mut p, &all, 64, 2048, 2);
}

/// One-way messages arrive in the order sent, on every connection.
pub fn oneway_order<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    const PER_CONN: u32 = 100;
    let mut p = Pair::new(drivers);
    let n = p.connections();
    let mut next = vec![0u32; n];
    let seen: Vec<Cell<u32>> = (0..n).map(|_| Cell::new(0)).collect();
    let mut on_b = |j: usize, _: &mut Connection, m: Incoming<'_>| {
        if let Incoming::Request {
            oneway: true, body, ..
        } = m
        {
            check_tag(body, j, "one-way message");
            let seq = &body[TAG_LEN..TAG_LEN + 4];
            let seq = u32::from_le_bytes(seq.try_into().expect("4 bytes"));
            assert_eq!(seq, seen[j].get(), "connection {j}: one-way out of order");
            seen[j].set(seq + 1);
        }
    };
    p.drive(&mut |_, _, _| {}, &mut on_b, &mut |p| {
        for (i, next) in next.iter_mut().enumerate() {
            while *next < PER_CONN {
                let mut body = tag(i, true).to_vec();
                body.extend(next.to_le_bytes().repeat(1 + *next as usize % 64));
                match p.a(i).send_oneway(Opcode::Tensors, 0, Payload::from(body)) {
                    Ok(()) => *next += 1,
                    Err(SendError::QueueFull(_)) => break,
                    Err(e) => panic!("connection {i}: send_oneway: {e}"),
                }
            }
        }
        seen.iter().all(|s| s.get() == PER_CONN)
    });
}

/// Messages longer than the largest frame are chunked and reassembled,
/// with small messages before and after them intact. Every connection
/// sends one message of two or more chunks (one byte over a frame, two
/// frames, three frames and a bit); a third of them also one that just
/// fills a frame.
pub fn chunked_messages<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let mut p = Pair::new(drivers);
    let n = p.connections();
    let max =
        p.a.driver()
            .max_frame_len()
            .min(p.b.driver().max_frame_len());
    // (request id, seed and length of its body), in sending order.
    let mut expect: Vec<VecDeque<(u64, u64, usize)>> = vec![VecDeque::new(); n];
    for (i, want) in expect.iter_mut().enumerate() {
        let long = match i % 3 {
            0 => 3 * max + 17,
            1 => 2 * max,
            _ => max - HEADER_LEN + 1,
        };
        let mut sizes = vec![10, long, 5];
        if i % 3 == 2 {
            sizes.extend([max - HEADER_LEN, 5]);
        }
        for (k, len) in sizes.into_iter().enumerate() {
            let seed = ((i as u64) << 8) | k as u64;
            let body = tagged(i, true, len, &mut SmallRng::seed_from_u64(seed));
            let id = p
                .a(i)
                .request(Opcode::Rpc, 0, Payload::from(body), None)
                .expect("queue request");
            want.push_back((id, seed, len));
        }
    }
    let left = Cell::new(expect.iter().map(VecDeque::len).sum::<usize>());
    let mut on_a = |i: usize, _: &mut Connection, m: Incoming<'_>| {
        if let Incoming::Response { id, body, .. } = m {
            let (want_id, seed, len) = expect[i].pop_front().expect("expected a response");
            assert_eq!(id, want_id, "connection {i}: responses out of order");
            let want = tagged(i, true, len, &mut SmallRng::seed_from_u64(seed));
            assert!(want == body, "connection {i}: chunked body {id} differs");
            left.set(left.get() - 1);
        }
    };
    p.drive(&mut on_a, &mut echo, &mut |_| left.get() == 0);
}

/// A full send queue hands the message back; nothing is lost.
pub fn send_queue_backpressure<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    const LIMIT: usize = 16;
    let mut p = Pair::with(
        drivers,
        |i| {
            let mut c = ConnConfig::new(peer(TaskRole::Worker, i, 11));
            c.send_queue_limit = LIMIT;
            c
        },
        |i| ConnConfig::new(peer(TaskRole::Ps, i, 22)),
    );
    let n = p.connections();
    for i in 0..n {
        for k in 0..LIMIT {
            let mut body = tag(i, true).to_vec();
            body.push(k as u8);
            p.a(i)
                .request(Opcode::Rpc, 0, Payload::from(body), None)
                .expect("room for the limit");
        }
        let extra = Payload::from(tag(i, true).to_vec());
        match p.a(i).request(Opcode::Rpc, 0, extra.clone(), None) {
            Err(SendError::QueueFull(body)) => assert_eq!(body, extra),
            other => panic!("connection {i}: expected QueueFull, got {other:?}"),
        }
    }
    let responses: Vec<Cell<usize>> = (0..n).map(|_| Cell::new(0)).collect();
    p.drive(
        &mut |i, _, m| {
            if let Incoming::Response { body, .. } = m {
                check_tag(body, i, "response");
                responses[i].set(responses[i].get() + 1);
            }
        },
        &mut echo,
        &mut |_| responses.iter().all(|r| r.get() == LIMIT),
    );
    for i in 0..n {
        assert_eq!(p.a(i).pending_requests(), 0, "connection {i}");
    }
}

/// A receiver that holds its credits receives exactly its window, and the
/// rest once it grants more, on every connection.
pub fn credit_window<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    const WINDOW: usize = 8;
    const SENT: usize = 20;
    let mut p = Pair::with(
        drivers,
        |i| ConnConfig::new(peer(TaskRole::Worker, i, 11)),
        |i| {
            let mut c = ConnConfig::new(peer(TaskRole::Ps, i, 22));
            c.recv_window = WINDOW as u32;
            c.auto_credit = false;
            c
        },
    );
    let n = p.connections();
    for i in 0..n {
        for k in 0..SENT {
            let mut body = tag(i, true).to_vec();
            body.push(k as u8);
            p.a(i)
                .send_oneway(Opcode::Tensors, 0, Payload::from(body))
                .expect("queue");
        }
    }
    let seen: Vec<Cell<usize>> = (0..n).map(|_| Cell::new(0)).collect();
    let count = |j: usize, c: &mut Connection, m: Incoming<'_>, grant: bool| {
        if let Incoming::Request { body, .. } = m {
            check_tag(body, j, "one-way message");
            seen[j].set(seen[j].get() + 1);
            if grant {
                c.grant(1);
            }
        }
    };
    p.drive(
        &mut |_, _, _| {},
        &mut |j, c, m| count(j, c, m, false),
        &mut |_| seen.iter().all(|s| s.get() >= WINDOW),
    );
    // Let the senders try for a while longer: nothing beyond the window
    // may arrive.
    let mut rounds = 0;
    p.drive(
        &mut |_, _, _| {},
        &mut |j, c, m| count(j, c, m, false),
        &mut |_| {
            rounds += 1;
            rounds > 2000
        },
    );
    for (i, seen) in seen.iter().enumerate() {
        assert_eq!(seen.get(), WINDOW, "connection {i}: other than its window");
        assert_eq!(p.a(i).queued(), SENT - WINDOW, "connection {i}");
        p.b(i).grant(WINDOW as u32);
    }
    p.drive(
        &mut |_, _, _| {},
        &mut |j, c, m| count(j, c, m, true),
        &mut |_| seen.iter().all(|s| s.get() == SENT),
    );
    for i in 0..n {
        assert_eq!(p.a(i).queued(), 0, "connection {i}");
    }
}

/// Deadlines fail requests; cancelled requests are told to the peer and
/// their late responses are discarded, on every connection.
pub fn deadline_and_cancel<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let mut p = Pair::new(drivers);
    let n = p.connections();
    p.establish();
    let deadline = p.now + Duration::from_millis(5);
    let body = |i: usize, answer: bool, rest: &[u8]| {
        let mut b = tag(i, answer).to_vec();
        b.extend_from_slice(rest);
        Payload::from(b)
    };
    let mut silent = Vec::with_capacity(n);
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let s = p
            .a(i)
            .request(Opcode::Rpc, 0, body(i, false, &[1]), Some(deadline));
        silent.push(s.expect("queue"));
        let h = p.a(i).request(Opcode::Rpc, 0, body(i, true, &[7, 7]), None);
        held.push(h.expect("queue"));
    }
    // The server holds each `held` until told otherwise.
    let held_at_b: Vec<Cell<Option<u64>>> = (0..n).map(|_| Cell::new(None)).collect();
    let late = Cell::new(0);
    p.drive(
        &mut |_, _, m| {
            if let Incoming::Response { .. } = m {
                late.set(late.get() + 1);
            }
        },
        &mut |j, _, m| {
            if let Incoming::Request { id, body, .. } = m {
                check_tag(body, j, "request");
                if body[TAG_LEN..] == [7, 7] {
                    held_at_b[j].set(Some(id));
                }
            }
        },
        &mut |p| held_at_b.iter().all(|h| h.get().is_some()) && p.now > deadline,
    );
    for i in 0..n {
        let mut failed = Vec::new();
        while let Some(e) = p.a(i).poll_event() {
            if let Event::RequestFailed { id, error } = e {
                failed.push((id, error));
            }
        }
        let want = vec![(silent[i], RequestError::DeadlineExceeded)];
        assert_eq!(failed, want, "connection {i}");
        assert!(p.a(i).cancel(held[i]), "connection {i}: cancel");
        assert!(!p.a(i).cancel(held[i]), "connection {i}: cancel twice");
    }
    let mut cancelled = vec![false; n];
    p.drive(&mut |_, _, _| {}, &mut |_, _, _| {}, &mut |p| {
        for (i, cancelled) in cancelled.iter_mut().enumerate() {
            let peer_id = held_at_b[i].get().expect("server saw the request");
            while let Some(e) = p.b(i).poll_event() {
                if e == (Event::PeerCancelled { id: peer_id }) {
                    *cancelled = true;
                }
            }
        }
        cancelled.iter().all(|c| *c)
    });
    // The server answers anyway; the client must discard the late
    // responses.
    let mut probe = Vec::with_capacity(n);
    for (i, held) in held_at_b.iter().enumerate() {
        let peer_id = held.get().expect("server saw the request");
        p.b(i)
            .respond(peer_id, Opcode::Rpc, Status::Ok, body(i, true, &[1]))
            .expect("respond");
        let id = p.a(i).request(Opcode::Rpc, 0, body(i, true, &[3]), None);
        probe.push(id.expect("queue"));
    }
    let back: Vec<Cell<bool>> = (0..n).map(|_| Cell::new(false)).collect();
    p.drive(
        &mut |i, _, m| {
            if let Incoming::Response { id, body, .. } = m {
                check_tag(body, i, "response");
                assert_eq!(
                    id, probe[i],
                    "connection {i}: a late response was delivered"
                );
                back[i].set(true);
            }
        },
        &mut echo,
        &mut |_| back.iter().all(Cell::get),
    );
    assert_eq!(late.get(), 0);
}

/// An orderly close by the peer fails every pending request with a typed
/// error, on every connection.
pub fn close_fails_pending<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    const PENDING: usize = 5;
    let mut p = Pair::new(drivers);
    let n = p.connections();
    p.establish();
    let ids: Vec<Vec<u64>> = (0..n)
        .map(|i| {
            (0..PENDING)
                .map(|_| {
                    let body = Payload::from(tag(i, false).to_vec());
                    p.a(i).request(Opcode::Rpc, 0, body, None).expect("queue")
                })
                .collect()
        })
        .collect();
    let seen: Vec<Cell<usize>> = (0..n).map(|_| Cell::new(0)).collect();
    p.drive(
        &mut |_, _, _| {},
        &mut |j, c, m| {
            echo(j, c, m);
            seen[j].set(seen[j].get() + 1);
        },
        &mut |_| seen.iter().all(|s| s.get() == PENDING),
    );
    for i in 0..n {
        p.b(i).close();
    }
    p.drive(&mut |_, _, _| {}, &mut |_, _, _| {}, &mut |p| {
        (0..p.connections()).all(|i| p.a(i).is_closed())
    });
    for (i, ids) in ids.iter().enumerate() {
        let mut failed = Vec::new();
        let mut closed = false;
        while let Some(e) = p.a(i).poll_event() {
            match e {
                Event::RequestFailed {
                    id,
                    error: RequestError::ConnectionLost(_),
                } => failed.push(id),
                Event::PeerClosed => closed = true,
                _ => {}
            }
        }
        assert!(closed, "connection {i}: no PeerClosed");
        assert_eq!(&failed, ids, "connection {i}");
        match p.a(i).request(Opcode::Rpc, 0, Payload::empty(), None) {
            Err(SendError::Closed(_)) => {}
            other => panic!("connection {i}: expected Closed, got {other:?}"),
        }
    }
}

/// A reconnect to a restarted peer (new incarnation) is detected; one to
/// the same incarnation is not. Even connections remember incarnation 21,
/// odd ones the peer's 22.
pub fn restart_detection<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let mut p = Pair::with(
        drivers,
        |i| {
            let mut c = ConnConfig::new(peer(TaskRole::Worker, i, 11));
            c.known_peer_incarnation = Some(if i % 2 == 0 { 21 } else { 22 });
            c
        },
        |i| ConnConfig::new(peer(TaskRole::Ps, i, 22)),
    );
    p.establish();
    for i in 0..p.connections() {
        let mut restarted = false;
        while let Some(e) = p.a(i).poll_event() {
            if let Event::PeerRestarted { previous, peer } = e {
                assert_eq!(previous, 21, "connection {i}");
                assert_eq!(peer.incarnation, 22, "connection {i}");
                assert_eq!(peer.task_index as usize, i, "connection {i}");
                restarted = true;
            }
        }
        assert_eq!(restarted, i % 2 == 0, "connection {i}: restart detection");
    }
}

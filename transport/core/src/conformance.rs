//! The conformance suite every backend passes.
//!
//! Each backend's tests call [`run_all`] with a function that makes a fresh
//! connected pair. The suite checks the backend layer (frames in order,
//! exactly once, at every size up to the maximum, under back-pressure) and
//! the message layer over it (handshake, request/response, one-way order,
//! chunking, credits, deadlines, cancellation, orderly close, restart
//! detection). Both ends are driven from one thread on a virtual clock that
//! jumps to the next timer when nothing moves, so lossy backends retransmit
//! deterministically. The functions panic on a violation: they are test
//! assertions.

use std::cell::Cell;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_wire::{Header, Opcode, Status, HEADER_LEN};

use crate::connection::{
    Body, ConnConfig, Connection, Event, Incoming, PeerInfo, RequestError, SendError, TaskRole,
};
use crate::session::Session;
use crate::transport::Transport;

/// Turns without progress before a test gives up (and fails).
const IDLE_LIMIT: usize = 200_000;
/// Virtual time that passes per round.
const STEP: Duration = Duration::from_micros(20);

/// One conformance case.
type Case<A, B> = fn(&mut dyn FnMut() -> (A, B));

/// Run the whole suite against pairs made by `make`; `name` labels the
/// backend in the logs.
pub fn run_all<A, B>(name: &str, mut make: impl FnMut() -> (A, B))
where
    A: Transport,
    B: Transport,
{
    let cases: [(&str, Case<A, B>); 9] = [
        ("frames_in_order", frames_in_order),
        ("handshake", handshake),
        ("rpc_echo", rpc_echo),
        ("oneway_order", oneway_order),
        ("chunked_messages", chunked_messages),
        ("send_queue_backpressure", send_queue_backpressure),
        ("credit_window", credit_window),
        ("deadline_and_cancel", deadline_and_cancel),
        ("close_fails_pending", close_fails_pending),
    ];
    for (case, f) in cases {
        tracing::info!(backend = name, case, "conformance");
        f(&mut make);
    }
    restart_detection(&mut make);
}

fn peer(role: TaskRole, index: u32, incarnation: u64) -> PeerInfo {
    PeerInfo {
        role,
        job: match role {
            TaskRole::Ps => "ps".into(),
            TaskRole::Worker => "worker".into(),
        },
        task_index: index,
        incarnation,
        shards: 1,
    }
}

/// A worker-side and a PS-side session over a fresh pair, with a virtual
/// clock.
#[derive(Debug)]
pub struct Pair<A, B> {
    /// The client (worker) end.
    pub a: Session<A>,
    /// The server (PS) end.
    pub b: Session<B>,
    /// The virtual clock.
    pub now: Instant,
}

impl<A: Transport, B: Transport> Pair<A, B> {
    /// Sessions with default settings over `(a, b)`.
    pub fn new((a, b): (A, B)) -> Self {
        Self::with(
            (a, b),
            ConnConfig::new(peer(TaskRole::Worker, 0, 11)),
            ConnConfig::new(peer(TaskRole::Ps, 0, 22)),
        )
    }

    /// Sessions with the given settings.
    pub fn with((a, b): (A, B), ca: ConnConfig, cb: ConnConfig) -> Self {
        Self {
            a: Session::new(ca, a),
            b: Session::new(cb, b),
            now: Instant::now(),
        }
    }

    /// Drive both ends until `done` holds, handing messages to the two
    /// handlers. Panics after too many rounds without progress.
    pub fn drive(
        &mut self,
        on_a: &mut dyn FnMut(&mut Connection, Incoming<'_>),
        on_b: &mut dyn FnMut(&mut Connection, Incoming<'_>),
        done: &mut dyn FnMut(&mut Self) -> bool,
    ) {
        let mut idle = 0;
        while !done(self) {
            let sa = self.a.turn(self.now, on_a).expect("client turn failed");
            let sb = self.b.turn(self.now, on_b).expect("server turn failed");
            if sa.busy() || sb.busy() {
                idle = 0;
                self.now += STEP;
                continue;
            }
            idle += 1;
            assert!(
                idle < IDLE_LIMIT,
                "no progress after {IDLE_LIMIT} idle rounds"
            );
            // Nothing moved: let time pass to the next timer.
            let next = [self.a.poll_timeout(), self.b.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            self.now = match next {
                Some(t) if t > self.now => t,
                _ => self.now + STEP,
            };
        }
    }

    /// Drive until both handshakes completed.
    pub fn establish(&mut self) {
        self.drive(&mut |_, _| {}, &mut |_, _| {}, &mut |p| {
            p.a.conn_ref().is_established() && p.b.conn_ref().is_established()
        });
    }
}

fn echo(conn: &mut Connection, m: Incoming<'_>) {
    if let Incoming::Request {
        id,
        opcode,
        oneway: false,
        body,
        ..
    } = m
    {
        // A request whose body starts with 0xFF asks for no answer.
        if body.first() == Some(&0xff) {
            return;
        }
        conn.respond(id, opcode, Status::Ok, Body::from(body.to_vec()))
            .expect("respond");
    }
}

fn pattern(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    if let Some(b) = v.first_mut() {
        // Keep clear of the "no answer" marker.
        *b &= 0x7f;
    }
    v
}

/// Frames straight over the backend layer: every size up to the maximum,
/// in order, exactly once, through both `tx_reserve` and `tx_gather`.
pub fn frames_in_order<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let (mut a, mut b) = make();
    let max = a.max_frame_len().min(b.max_frame_len());
    let mut rng = SmallRng::seed_from_u64(1);
    let total = 3000usize;
    let mut sizes: Vec<usize> = (0..total)
        .map(|i| match i % 10 {
            0 => max,
            1 => HEADER_LEN,
            _ => HEADER_LEN + rng.gen_range(0..(max - HEADER_LEN).min(4096) + 1),
        })
        .collect();
    sizes[total - 1] = max;
    let frame = |i: usize, len: usize| {
        let mut f = vec![0u8; len];
        let h = Header::new(Opcode::Rpc, i as u64, (len - HEADER_LEN) as u32);
        h.emit(&mut f);
        for (k, x) in f[HEADER_LEN..].iter_mut().enumerate() {
            *x = (i * 31 + k) as u8;
        }
        f
    };
    let mut sent = 0;
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut now = Instant::now();
    let mut idle = 0;
    while got.len() < total {
        let before = (sent, got.len());
        while sent < total {
            let f = frame(sent, sizes[sent]);
            let ok = if sent % 2 == 0 {
                match a.tx_reserve(f.len()).expect("tx_reserve") {
                    Some(buf) => {
                        buf[..f.len()].copy_from_slice(&f);
                        a.tx_commit(f.len());
                        true
                    }
                    None => false,
                }
            } else {
                let (h, rest) = f.split_at(HEADER_LEN);
                let mid = rest.len() / 2;
                a.tx_gather(
                    h,
                    &[
                        bytes::Bytes::copy_from_slice(&rest[..mid]),
                        bytes::Bytes::copy_from_slice(&rest[mid..]),
                    ],
                )
                .expect("tx_gather")
            };
            if !ok {
                break;
            }
            sent += 1;
        }
        a.flush(now).expect("flush a");
        b.rx_burst(now, 64, &mut |f| got.push(f.to_vec()))
            .expect("rx b");
        b.flush(now).expect("flush b");
        a.rx_burst(now, 64, &mut |_| panic!("unexpected frame at a"))
            .expect("rx a");
        if (sent, got.len()) == before {
            idle += 1;
            assert!(
                idle < IDLE_LIMIT,
                "frames stalled at {} of {total}",
                got.len()
            );
            let next = [a.poll_timeout(), b.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            now = match next {
                Some(t) if t > now => t,
                _ => now + STEP,
            };
        } else {
            idle = 0;
            now += STEP;
        }
    }
    for (i, f) in got.iter().enumerate() {
        assert_eq!(f.len(), sizes[i], "frame {i} has the wrong length");
        assert!(*f == frame(i, sizes[i]), "frame {i} differs");
    }
}

/// Both ends learn who the other is.
pub fn handshake<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut p = Pair::new(make());
    p.establish();
    let pa = p.a.conn_ref().peer().cloned().expect("a knows b");
    let pb = p.b.conn_ref().peer().cloned().expect("b knows a");
    assert_eq!(pa, peer(TaskRole::Ps, 0, 22));
    assert_eq!(pb, peer(TaskRole::Worker, 0, 11));
    assert!(matches!(p.a.poll_event(), Some(Event::Connected(_))));
    assert!(matches!(p.b.poll_event(), Some(Event::Connected(_))));
}

/// Requests of many sizes come back matched to their ids.
pub fn rpc_echo<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut p = Pair::new(make());
    let mut rng = SmallRng::seed_from_u64(2);
    let mut expect = std::collections::HashMap::new();
    for _ in 0..1000 {
        let len = rng.gen_range(0..2048);
        let body = pattern(&mut rng, len);
        let id =
            p.a.conn()
                .request(Opcode::Rpc, 0, Body::from(body.clone()), None)
                .expect("queue request");
        expect.insert(id, body);
    }
    let mut got = 0usize;
    let mut on_a = |_: &mut Connection, m: Incoming<'_>| match m {
        Incoming::Response {
            id, status, body, ..
        } => {
            assert_eq!(status, Status::Ok);
            let want = expect.remove(&id).expect("response to a known request");
            assert!(want == body, "response {id} differs");
            got += 1;
        }
        Incoming::Request { .. } => panic!("client got a request"),
    };
    p.drive(&mut on_a, &mut echo, &mut |p| {
        p.a.conn_ref().pending_requests() == 0
    });
    assert_eq!(got, 1000);
}

/// One-way messages arrive in the order sent.
pub fn oneway_order<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut p = Pair::new(make());
    let n = 2000u32;
    let mut next = 0u32;
    let seen = Cell::new(0u32);
    let mut on_b = |_: &mut Connection, m: Incoming<'_>| {
        if let Incoming::Request {
            oneway: true, body, ..
        } = m
        {
            let seq = u32::from_le_bytes(body[..4].try_into().expect("4 bytes"));
            assert_eq!(seq, seen.get(), "one-way message out of order");
            seen.set(seq + 1);
        }
    };
    p.drive(&mut |_, _| {}, &mut on_b, &mut |p| {
        while next < n {
            let body = Body::from(next.to_le_bytes().repeat(1 + next as usize % 64));
            match p.a.conn().send_oneway(Opcode::Tensors, 0, body) {
                Ok(()) => next += 1,
                Err(SendError::QueueFull(_)) => break,
                Err(e) => panic!("send_oneway: {e}"),
            }
        }
        seen.get() == n
    });
}

/// Messages longer than the largest frame are chunked and reassembled,
/// with small messages before and after them intact.
pub fn chunked_messages<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut p = Pair::new(make());
    let max = p.a.transport().max_frame_len();
    let mut rng = SmallRng::seed_from_u64(3);
    let sizes = [
        10,
        max * 3 + 17,
        5,
        max - HEADER_LEN,
        max - HEADER_LEN + 1,
        2 * max,
        1,
    ];
    let mut expect = VecDeque::new();
    for &len in &sizes {
        let body = pattern(&mut rng, len);
        let id =
            p.a.conn()
                .request(Opcode::Rpc, 0, Body::from(body.clone()), None)
                .expect("queue request");
        expect.push_back((id, body));
    }
    let mut on_a = |_: &mut Connection, m: Incoming<'_>| {
        if let Incoming::Response { id, body, .. } = m {
            let (want_id, want) = expect.pop_front().expect("expected response");
            assert_eq!(id, want_id, "responses out of order");
            assert!(want == body, "chunked body {id} differs");
        }
    };
    p.drive(&mut on_a, &mut echo, &mut |p| {
        p.a.conn_ref().pending_requests() == 0
    });
}

/// A full send queue hands the message back; nothing is lost.
pub fn send_queue_backpressure<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut ca = ConnConfig::new(peer(TaskRole::Worker, 0, 11));
    ca.send_queue_limit = 16;
    let cb = ConnConfig::new(peer(TaskRole::Ps, 0, 22));
    let mut p = Pair::with(make(), ca, cb);
    for i in 0..16u8 {
        p.a.conn()
            .request(Opcode::Rpc, 0, Body::from(vec![i; 8]), None)
            .expect("room for 16");
    }
    match p
        .a
        .conn()
        .request(Opcode::Rpc, 0, Body::from(vec![99u8; 8]), None)
    {
        Err(SendError::QueueFull(body)) => assert_eq!(body, Body::from(vec![99u8; 8])),
        other => panic!("expected QueueFull, got {other:?}"),
    }
    let mut responses = 0;
    p.drive(
        &mut |_, m| {
            if matches!(m, Incoming::Response { .. }) {
                responses += 1;
            }
        },
        &mut echo,
        &mut |p| p.a.conn_ref().pending_requests() == 0,
    );
    assert_eq!(responses, 16);
}

/// A receiver that holds its credits receives exactly its window, and the
/// rest once it grants more.
pub fn credit_window<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let ca = ConnConfig::new(peer(TaskRole::Worker, 0, 11));
    let mut cb = ConnConfig::new(peer(TaskRole::Ps, 0, 22));
    cb.recv_window = 8;
    cb.auto_credit = false;
    let mut p = Pair::with(make(), ca, cb);
    for i in 0..20u8 {
        p.a.conn()
            .send_oneway(Opcode::Tensors, 0, Body::from(vec![i; 4]))
            .expect("queue");
    }
    let seen = Cell::new(0usize);
    let mut rounds = 0;
    p.drive(
        &mut |_, _| {},
        &mut |_, _| seen.set(seen.get() + 1),
        &mut |_| {
            rounds += 1;
            rounds > 2000
        },
    );
    assert_eq!(seen.get(), 8, "receiver got other than its window");
    assert_eq!(p.a.conn_ref().queued(), 12);
    p.b.conn().grant(8);
    p.drive(
        &mut |_, _| {},
        &mut |c, _| {
            seen.set(seen.get() + 1);
            c.grant(1);
        },
        &mut |_| seen.get() == 20,
    );
    assert_eq!(p.a.conn_ref().queued(), 0);
}

/// Deadlines fail requests; cancelled requests are told to the peer and
/// their late responses are discarded.
pub fn deadline_and_cancel<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut p = Pair::new(make());
    p.establish();
    let deadline = p.now + Duration::from_millis(5);
    let silent =
        p.a.conn()
            .request(Opcode::Rpc, 0, Body::from(vec![0xff, 1]), Some(deadline))
            .expect("queue");
    let held =
        p.a.conn()
            .request(Opcode::Rpc, 0, Body::from(vec![7, 7]), None)
            .expect("queue");
    // The server holds `held` until told otherwise.
    let held_at_b: Cell<Option<u64>> = Cell::new(None);
    let mut cancelled_at_b = false;
    let mut late = 0;
    p.drive(
        &mut |_, m| {
            if let Incoming::Response { .. } = m {
                late += 1;
            }
        },
        &mut |_, m| {
            if let Incoming::Request { id, body, .. } = m {
                if body == [7, 7] {
                    held_at_b.set(Some(id));
                }
            }
        },
        &mut |p| held_at_b.get().is_some() && p.now > deadline,
    );
    let mut failed = Vec::new();
    while let Some(e) = p.a.poll_event() {
        if let Event::RequestFailed { id, error } = e {
            failed.push((id, error));
        }
    }
    assert_eq!(failed, vec![(silent, RequestError::DeadlineExceeded)]);
    assert!(p.a.conn().cancel(held));
    assert!(!p.a.conn().cancel(held), "cancel twice");
    let peer_id = held_at_b.get().expect("server saw the request");
    p.drive(&mut |_, _| {}, &mut |_, _| {}, &mut |p| {
        while let Some(e) = p.b.poll_event() {
            if e == (Event::PeerCancelled { id: peer_id }) {
                cancelled_at_b = true;
            }
        }
        cancelled_at_b
    });
    // The server answers anyway; the client must discard the late response.
    p.b.conn()
        .respond(peer_id, Opcode::Rpc, Status::Ok, Body::from(vec![1]))
        .expect("respond");
    let probe =
        p.a.conn()
            .request(Opcode::Rpc, 0, Body::from(vec![3]), None)
            .expect("queue");
    let probe_back = Cell::new(false);
    p.drive(
        &mut |_, m| {
            if let Incoming::Response { id, .. } = m {
                assert_eq!(id, probe, "a late response was delivered");
                probe_back.set(true);
            }
        },
        &mut echo,
        &mut |_| probe_back.get(),
    );
    assert_eq!(late, 0);
}

/// An orderly close by the peer fails every pending request with a typed
/// error.
pub fn close_fails_pending<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut p = Pair::new(make());
    p.establish();
    let ids: Vec<u64> = (0..5)
        .map(|_| {
            p.a.conn()
                .request(Opcode::Rpc, 0, Body::from(vec![0xff]), None)
                .expect("queue")
        })
        .collect();
    let seen = Cell::new(0);
    p.drive(
        &mut |_, _| {},
        &mut |_, _| seen.set(seen.get() + 1),
        &mut |_| seen.get() == 5,
    );
    p.b.conn().close();
    p.drive(&mut |_, _| {}, &mut |_, _| {}, &mut |p| {
        p.a.conn_ref().is_closed()
    });
    let mut failed = Vec::new();
    let mut closed = false;
    while let Some(e) = p.a.poll_event() {
        match e {
            Event::RequestFailed {
                id,
                error: RequestError::ConnectionLost(_),
            } => failed.push(id),
            Event::PeerClosed => closed = true,
            _ => {}
        }
    }
    assert!(closed);
    assert_eq!(failed, ids);
    match p.a.conn().request(Opcode::Rpc, 0, Body::empty(), None) {
        Err(SendError::Closed(_)) => {}
        other => panic!("expected Closed, got {other:?}"),
    }
}

/// A reconnect to a restarted peer (new incarnation) is detected.
pub fn restart_detection<A: Transport, B: Transport>(make: &mut dyn FnMut() -> (A, B)) {
    let mut ca = ConnConfig::new(peer(TaskRole::Worker, 0, 11));
    ca.known_peer_incarnation = Some(21);
    let cb = ConnConfig::new(peer(TaskRole::Ps, 0, 22));
    let mut p = Pair::with(make(), ca, cb);
    p.establish();
    let mut restarted = false;
    while let Some(e) = p.a.poll_event() {
        if let Event::PeerRestarted { previous, peer } = e {
            assert_eq!(previous, 21);
            assert_eq!(peer.incarnation, 22);
            restarted = true;
        }
    }
    assert!(restarted, "restart not detected");
}

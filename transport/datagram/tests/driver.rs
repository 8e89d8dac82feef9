//! One `DatagramDriver` per side serving many connections over one lossy
//! link: the message layer (`Sessions`) on 64 connections under seeded
//! loss, one burst per flush, routing by connection id, timers and
//! failures per connection. Deterministic: seeded loss, a virtual clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_datagram::{
    DatagramDriver, DatagramError, DatagramLink, LossConfig, LossyLink, PacketFlags, PacketHeader,
    ReliableConfig, PACKET_HEADER_LEN,
};
use starwire_transport::conformance::{DriverPair, Pair};
use starwire_transport::{ConnId, Connection, Driver, Incoming, Payload, TaskRole, TransportError};
use starwire_wire::{Opcode, Status};

type Dgram = DatagramDriver<LossyLink>;

/// Two drivers over one link pair with `n` connections between them:
/// `a_ids[i]` on `a` is connected to `b_ids[i]` on `b`. The shape of the
/// conformance suite's `DriverPair`.
fn pair(n: usize, loss: LossConfig, seed: u64) -> (Dgram, Vec<ConnId>, Dgram, Vec<ConnId>) {
    pair_with(n, loss, seed, ReliableConfig::default())
}

fn pair_with(
    n: usize,
    loss: LossConfig,
    seed: u64,
    cfg: ReliableConfig,
) -> (Dgram, Vec<ConnId>, Dgram, Vec<ConnId>) {
    let (la, lb) = LossyLink::pair(loss, seed);
    let mut a = DatagramDriver::new(la, cfg.clone()).expect("driver a");
    let mut b = DatagramDriver::new(lb, cfg).expect("driver b");
    let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (ca, ia) = a.prepare().expect("prepare a");
        let (cb, ib) = b.prepare().expect("prepare b");
        a.connect(ca, ib).expect("connect a");
        b.connect(cb, ia).expect("connect b");
        a_ids.push(ca);
        b_ids.push(cb);
    }
    (a, a_ids, b, b_ids)
}

/// 5 % loss with duplication and reordering, room for many connections.
fn lossy() -> LossConfig {
    LossConfig {
        loss: 0.05,
        duplicate: 0.02,
        reorder: 0.05,
        queue_capacity: 1 << 16,
        tx_ring: 256,
        ..LossConfig::lossless(1500)
    }
}

/// The shared conformance suite on 64 connections of one driver per side.
#[test]
fn conformance_over_sixty_four_connections() {
    for (name, loss) in [
        ("datagram-0%", LossConfig::lossless(1500)),
        ("datagram-5%", lossy()),
    ] {
        let mut seed = 0;
        starwire_transport::conformance::run_all_drivers(name, 64, |n| {
            seed += 1;
            let (a, a_ids, b, b_ids) = pair(n, loss.clone(), seed);
            DriverPair { a, a_ids, b, b_ids }
        });
    }
}

/// Both sides' message layers over one driver each, on a virtual clock:
/// the conformance suite's [`Pair`]. Connection `i` is worker `i` on `a`
/// and PS `i` on `b`.
type Net = Pair<Dgram, Dgram>;

fn net(n: usize, loss: LossConfig, seed: u64) -> Net {
    let (a, a_ids, b, b_ids) = pair(n, loss, seed);
    Pair::new(DriverPair { a, a_ids, b, b_ids })
}

fn echo(_: usize, conn: &mut Connection, m: Incoming<'_>) {
    if let Incoming::Request {
        id, opcode, body, ..
    } = m
    {
        conn.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()))
            .expect("respond");
    }
}

#[test]
fn sixty_four_sessions_handshake_and_echo_through_loss() {
    let n = 64;
    let mut net = net(n, lossy(), 0x64);
    net.establish();
    // Each handshake reached its own peer: packets were routed to the
    // connection their id names.
    for (i, (&ca, &cb)) in net.a_ids.iter().zip(&net.b_ids).enumerate() {
        let pa = net.a.conn_ref(ca).and_then(Connection::peer).unwrap();
        let pb = net.b.conn_ref(cb).and_then(Connection::peer).unwrap();
        assert_eq!((pa.role, pa.task_index), (TaskRole::Ps, i as u32));
        assert_eq!((pb.role, pb.task_index), (TaskRole::Worker, i as u32));
    }

    let mut rng = SmallRng::seed_from_u64(6);
    let mut expect: HashMap<(usize, u64), Vec<u8>> = HashMap::new();
    for (i, &c) in net.a_ids.iter().enumerate() {
        for _ in 0..10 {
            // Many bodies span several packets; some exceed a frame.
            let len = rng.gen_range(0..80_000);
            let mut body = vec![0u8; len];
            rng.fill(&mut body[..]);
            let id = net
                .a
                .conn(c)
                .unwrap()
                .request(Opcode::Rpc, 0, Payload::from(body.clone()), None)
                .expect("request");
            expect.insert((i, id), body);
        }
    }
    let mut answered = 0;
    let mut on_a = |i: usize, _: &mut Connection, m: Incoming<'_>| {
        let Incoming::Response {
            id, status, body, ..
        } = m
        else {
            panic!("the worker got a request");
        };
        assert_eq!(status, Status::Ok);
        let want = expect
            .remove(&(i, id))
            .expect("a response to a request of this connection");
        assert!(want == body);
        answered += 1;
    };
    net.drive(&mut on_a, &mut echo, &mut |net| {
        net.a_ids
            .iter()
            .all(|&c| net.a.conn_ref(c).unwrap().pending_requests() == 0)
    });
    assert_eq!(answered, 10 * n);
    // Loss happened and was repaired; every burst served many connections.
    let link = net.a.driver().link().tx_stats();
    assert!(link.lost > 100, "{link:?}");
    let retransmits: u64 = net
        .a_ids
        .iter()
        .map(|&c| net.a.driver().core(c).unwrap().stats().retransmits)
        .sum();
    assert!(retransmits > 0);
    // The metrics read the same counts through the driver contract.
    let c = Driver::counters(net.a.driver());
    assert_eq!(c.retransmits, Some(retransmits));
    assert_eq!(c.packets_sent, Some(net.a.driver().stats().packets_sent));
    let st = net.a.driver().stats();
    assert!(st.tx_bursts <= st.flushes, "{st:?}");
    assert_eq!(st.dropped_unknown_conn, 0);
}

#[test]
fn one_flush_over_sixty_four_connections_is_one_burst() {
    let n = 64;
    let loss = LossConfig {
        tx_ring: 1024,
        ..LossConfig::lossless(1500)
    };
    // A receive pass takes up to `rx_batch` packets: room for all 256.
    let cfg = ReliableConfig {
        rx_batch: 256,
        ..ReliableConfig::default()
    };
    let (mut a, a_ids, mut b, b_ids) = pair_with(n, loss, 1, cfg);
    let now = Instant::now();
    for (i, &c) in a_ids.iter().enumerate() {
        // Two frames per connection, the second in three packets.
        for len in [100, 3000] {
            let buf = a.tx_reserve(c, len).unwrap().expect("window");
            buf.fill(i as u8);
            a.tx_commit(c, len);
        }
    }
    assert!(a.flush(now));
    assert_eq!(a.stats().tx_bursts, 1);
    assert_eq!(a.link().tx_stats().bursts, 1);
    assert_eq!(a.link().tx_stats().sent, 4 * n as u64);
    // One receive pass takes one link burst and routes it: `max` frames
    // per connection, in order, the rest kept for the next pass.
    let index: HashMap<ConnId, usize> = b_ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    let mut seen = vec![Vec::new(); n];
    let got = b.rx_burst(now, 1, &mut |c, f| {
        let i = index[&c];
        assert!(f.iter().all(|&x| x == i as u8));
        seen[i].push(f.len());
    });
    assert_eq!(got, n);
    assert_eq!(b.stats().rx_bursts, 1);
    assert!(seen.iter().all(|s| s == &[100]), "{seen:?}");
    b.rx_burst(now, 1, &mut |c, f| seen[index[&c]].push(f.len()));
    assert!(seen.iter().all(|s| s == &[100, 3000]));
    // The acknowledgements of every connection leave in one burst too.
    assert!(b.flush(now + Duration::from_millis(1)));
    assert_eq!(b.link().tx_stats().bursts, 1);
    a.rx_burst(now, 1, &mut |_, _| panic!("no data"));
    assert!(a_ids.iter().all(|&c| !a.tx_pending(c)));
}

#[test]
fn a_full_transmit_ring_carries_the_rest_to_the_next_flush() {
    let n = 8;
    // Eight packets per burst, four per connection waiting.
    let (mut a, a_ids, mut b, b_ids) = pair(
        n,
        LossConfig {
            tx_ring: 8,
            ..LossConfig::lossless(1500)
        },
        2,
    );
    let now = Instant::now();
    for &c in &a_ids {
        for _ in 0..4 {
            a.tx_reserve(c, 64).unwrap().expect("window");
            a.tx_commit(c, 64);
        }
    }
    let mut rounds = 0;
    let mut got = vec![0; n];
    let index: HashMap<ConnId, usize> = b_ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    while got.iter().sum::<usize>() < 4 * n {
        rounds += 1;
        assert!(rounds <= 4, "each flush fills the ring");
        a.flush(now);
        // Packets still waiting make the timer due at once.
        if rounds < 4 {
            assert_eq!(a.poll_timeout(), Some(now));
        }
        b.rx_burst(now, 64, &mut |c, _| got[index[&c]] += 1);
    }
    assert_eq!(a.stats().tx_bursts, 4);
    assert!(got.iter().all(|&g| g == 4));
}

/// Queue on `a`'s link a packet of sequence 0 from connection `src` to
/// `dst`, whatever the connections' state.
fn inject(a: &mut Dgram, flags: PacketFlags, dst: u32, src: u32, payload: &[u8]) {
    let hdr = PacketHeader {
        flags,
        dst_conn: dst,
        src_conn: src,
        seq: 0,
        ack: 0,
        sack: 0,
        payload_len: 0,
    };
    let buf = a
        .link_mut()
        .tx_alloc(PACKET_HEADER_LEN + payload.len())
        .unwrap();
    let len = hdr.encode(payload, buf);
    a.link_mut().tx_commit(len).unwrap();
}

#[test]
fn unknown_and_foreign_packets_are_counted_and_dropped() {
    let (mut a, _, mut b, b_ids) = pair(2, LossConfig::lossless(1500), 3);
    let now = Instant::now();
    let whole = PacketFlags::DATA
        .with(PacketFlags::FIRST)
        .with(PacketFlags::LAST);
    let mut send = |dst: u32, src: u32| inject(&mut a, whole, dst, src, b"evil");
    let b0 = b.local_id(b_ids[0]).unwrap();
    // An id no slot has, the right slot with another generation, and the
    // right id from the wrong peer connection.
    send(77, 0);
    send(b0 + (1 << 20), 0);
    let wrong_src = b.core(b_ids[1]).unwrap().ids().peer;
    send(b0, wrong_src);
    a.link_mut().tx_burst_flush(now).unwrap();
    // Garbage: no header at all.
    a.link_mut().tx_alloc(3).unwrap().copy_from_slice(b"bad");
    a.link_mut().tx_commit(3).unwrap();
    a.link_mut().tx_burst_flush(now).unwrap();
    assert_eq!(b.rx_burst(now, 8, &mut |_, _| panic!("nothing valid")), 0);
    let st = b.stats();
    assert_eq!(st.dropped_unknown_conn, 2);
    assert_eq!(st.dropped_malformed, 1);
    assert_eq!(b.core(b_ids[0]).unwrap().stats().dropped_foreign, 1);
    assert!(b.poll_failure().is_none());
}

#[test]
fn a_protocol_violation_is_reported_when_the_receive_pass_returns() {
    let (mut a, _, mut b, b_ids) = pair(3, LossConfig::lossless(1500), 4);
    let now = Instant::now();
    // A continuation fragment outside a frame, on connection 1.
    let dst = b.local_id(b_ids[1]).unwrap();
    let src = b.core(b_ids[1]).unwrap().ids().peer;
    inject(&mut a, PacketFlags::DATA, dst, src, b"half");
    a.link_mut().tx_burst_flush(now).unwrap();
    assert_eq!(b.rx_burst(now, 8, &mut |_, _| panic!("no frame")), 0);
    // No flush in between: the receive pass itself reported it.
    let (c, e) = b.poll_failure().expect("connection 1 failed");
    assert_eq!(c, b_ids[1]);
    assert!(e.to_string().contains("protocol violation"), "{e}");
    assert!(b.poll_failure().is_none(), "alone");
    // Reported once: neither the next pass nor a flush reports it again.
    b.rx_burst(now, 8, &mut |_, _| {});
    b.flush(now);
    assert!(b.poll_failure().is_none(), "once");
    assert!(b.tx_reserve(b_ids[1], 1).is_err());
    assert!(b.tx_reserve(b_ids[0], 1).is_ok());
}

#[test]
fn a_reused_slot_ignores_packets_of_its_previous_connection() {
    let (mut a, a_ids, mut b, b_ids) = pair(1, LossConfig::lossless(1500), 4);
    let now = Instant::now();
    let old = b.local_id(b_ids[0]).unwrap();
    a.tx_reserve(a_ids[0], 10).unwrap().unwrap();
    a.tx_commit(a_ids[0], 10);
    a.flush(now);
    // b closes the connection before the packet arrives, and a new one
    // takes the slot.
    b.detach(b_ids[0]);
    assert!(matches!(
        b.tx_reserve(b_ids[0], 1),
        Err(TransportError::Closed)
    ));
    let (c, new) = b.prepare().unwrap();
    assert_eq!(c, b_ids[0], "the slot is reused");
    assert_ne!(new, old, "under another id");
    let (ca, ia) = a.prepare().unwrap();
    b.connect(c, ia).unwrap();
    a.connect(ca, new).unwrap();
    assert_eq!(b.rx_burst(now, 8, &mut |_, _| panic!("stale frame")), 0);
    assert_eq!(b.stats().dropped_unknown_conn, 1);
    assert!(matches!(
        b.connect(c, ia),
        Err(DatagramError::NotPrepared(x)) if x == c
    ));
}

/// Generations are 12 bits: the 4096th reuse of a slot would give it the
/// id of its first connection again. A slot whose generation wraps waits
/// out the reuse quarantine, so a late packet of that first connection
/// (from a peer whose slot cycled alike) is not taken by a new one.
#[test]
fn a_slot_is_not_reused_under_an_old_id_within_the_quarantine() {
    let (mut a, _, mut b, b_ids) = pair(1, LossConfig::lossless(1500), 5);
    let whole = PacketFlags::DATA
        .with(PacketFlags::FIRST)
        .with(PacketFlags::LAST);
    let t0 = Instant::now();
    let old = b.local_id(b_ids[0]).unwrap();
    let peer = b.core(b_ids[0]).unwrap().ids().peer;
    b.detach(b_ids[0]);
    let mut now = t0;
    // 4095 more connections come and go through the slot, the peer's id
    // the same each time, the last one's end not yet seen by a flush.
    for k in 1..4096 {
        let (c, id) = b.prepare().unwrap();
        assert_eq!(c, b_ids[0], "the slot is reused");
        assert_eq!(id, old + (k << 20));
        b.connect(c, peer).unwrap();
        now += Duration::from_micros(10);
        b.flush(now);
        b.detach(c);
    }
    let q = b.reuse_quarantine();
    assert!(q >= Duration::from_secs(5), "{q:?}");
    // A new connection toward the same peer id, and a packet of the first
    // connection, late: it is not taken for the new one's.
    let (c, id) = b.prepare().unwrap();
    b.connect(c, peer).unwrap();
    now += Duration::from_millis(1);
    inject(&mut a, whole, old, peer, b"stale");
    a.link_mut().tx_burst_flush(now).unwrap();
    assert_eq!(b.rx_burst(now, 8, &mut |_, _| panic!("stale frame")), 0);
    assert_eq!(b.stats().dropped_unknown_conn, 1);
    // The slot's ids are used up: another slot serves, under another id.
    assert_ne!(c, b_ids[0], "the wrapped slot is parked");
    assert_ne!(id, old);
    // Not before the quarantine is over, counted from the first `now`
    // seen after the slot was freed (this receive pass).
    b.flush(now + q - Duration::from_micros(1));
    let (c2, _) = b.prepare().unwrap();
    assert_ne!(c2, b_ids[0], "still parked");
    b.flush(now + q);
    let (c3, id3) = b.prepare().unwrap();
    assert_eq!(
        c3, b_ids[0],
        "the slot serves again once the quarantine is over"
    );
    assert_eq!(id3, old, "with its first id");
}

#[test]
fn poll_timeout_is_the_earliest_timer_over_connections() {
    let (mut a, a_ids, _b, _) = pair(3, LossConfig::lossless(1500), 5);
    let t0 = Instant::now();
    assert_eq!(a.poll_timeout(), None, "idle connections have no timer");
    a.tx_reserve(a_ids[1], 10).unwrap().unwrap();
    a.tx_commit(a_ids[1], 10);
    a.flush(t0);
    let rto = a.poll_timeout().expect("a retransmission timer");
    assert_eq!(rto, a.core(a_ids[1]).unwrap().poll_timeout().unwrap());
    assert!(rto > t0);
    let t1 = t0 + Duration::from_micros(500);
    a.tx_reserve(a_ids[2], 10).unwrap().unwrap();
    a.tx_commit(a_ids[2], 10);
    a.flush(t1);
    assert_eq!(a.poll_timeout(), Some(rto), "the earlier of the two");
    // At the deadline the first connection retransmits, the second waits.
    a.flush(rto);
    assert_eq!(a.core(a_ids[1]).unwrap().stats().retransmits, 1);
    assert_eq!(a.core(a_ids[2]).unwrap().stats().retransmits, 0);
}

#[test]
fn a_dead_peer_connection_fails_alone() {
    let n = 4;
    let (mut a, a_ids, mut b, b_ids) = pair(n, LossConfig::lossless(1500), 6);
    let mut now = Instant::now();
    // b forgets connection 2; a keeps sending on every connection.
    b.detach(b_ids[2]);
    let mut failure = None;
    for round in 0..10_000 {
        for &c in &a_ids {
            if let Ok(Some(buf)) = a.tx_reserve(c, 16) {
                buf.fill(round as u8);
                a.tx_commit(c, 16);
            }
        }
        a.flush(now);
        b.rx_burst(now, 64, &mut |_, _| {});
        b.flush(now);
        a.rx_burst(now, 64, &mut |_, _| {});
        if let Some(f) = a.poll_failure() {
            failure = Some(f);
            break;
        }
        now = a.poll_timeout().map_or(now, |t| t.max(now)) + Duration::from_micros(10);
    }
    let (c, e) = failure.expect("connection 2 fails");
    assert_eq!(c, a_ids[2]);
    assert!(e.to_string().contains("peer unreachable"), "{e}");
    assert!(a.poll_failure().is_none(), "alone");
    assert!(b.stats().dropped_unknown_conn > 0);
    for (i, &c) in a_ids.iter().enumerate() {
        assert_eq!(a.tx_reserve(c, 1).is_ok(), i != 2);
    }
    a.detach(a_ids[2]);
    assert_eq!(a.len(), n - 1);
}

/// An out-of-band exchange that connects its connection to `peer` on its
/// `after`-th step, or fails then when `peer` is `None`.
#[derive(Debug)]
struct Scripted {
    peer: Option<u32>,
    after: usize,
    steps: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl starwire_datagram::Exchange<LossyLink> for Scripted {
    fn step(&mut self, d: &mut Dgram, conn: ConnId, _now: Instant) -> Result<bool, TransportError> {
        let n = self
            .steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if n < self.after {
            return Ok(false);
        }
        match self.peer {
            Some(peer) => {
                d.connect(conn, peer)
                    .map_err(|e| TransportError::Link(e.to_string()))?;
                Ok(true)
            }
            None => Err(TransportError::Link("scripted failure".into())),
        }
    }
}

/// Exchanges run on the flushes, one step each, without holding up the
/// driver's other connections: one connects its connection (frames queued
/// before it then leave), one fails its connection alone, and one whose
/// connection is detached first is dropped unfinished.
#[test]
fn out_of_band_exchanges_connect_or_fail_their_connection_alone() {
    let (mut a, a_ids, mut b, b_ids) = pair(1, LossConfig::lossless(1500), 9);
    let steps = || std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (ca, ia) = a.prepare().unwrap();
    let (cb, ib) = b.prepare().unwrap();
    b.connect(cb, ia).unwrap();
    let ok_steps = steps();
    a.begin_exchange(
        ca,
        Box::new(Scripted {
            peer: Some(ib),
            after: 3,
            steps: ok_steps.clone(),
        }),
    );
    let (cf, _) = a.prepare().unwrap();
    a.begin_exchange(
        cf,
        Box::new(Scripted {
            peer: None,
            after: 2,
            steps: steps(),
        }),
    );
    let (cd, _) = a.prepare().unwrap();
    let dropped = steps();
    a.begin_exchange(
        cd,
        Box::new(Scripted {
            peer: Some(ib),
            after: 1_000,
            steps: dropped.clone(),
        }),
    );
    assert_eq!(a.exchanging(), 3);
    assert!(matches!(a.tx_reserve(ca, 4), Ok(None)), "not connected yet");
    // The established connection is served while the others exchange.
    a.tx_reserve(a_ids[0], 4)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"live");
    a.tx_commit(a_ids[0], 4);
    let now = Instant::now();
    a.flush(now);
    let mut got = Vec::new();
    b.rx_burst(now, 8, &mut |c, f| got.push((c, f.to_vec())));
    assert_eq!(got, vec![(b_ids[0], b"live".to_vec())]);
    a.detach(cd);
    assert_eq!(a.exchanging(), 2);
    a.flush(now);
    let (failed, e) = a.poll_failure().expect("the scripted failure");
    assert_eq!(failed, cf);
    assert!(e.to_string().contains("scripted failure"), "{e}");
    assert!(a.poll_failure().is_none());
    assert_eq!(a.exchanging(), 1);
    a.flush(now);
    assert_eq!(a.exchanging(), 0);
    assert_eq!(ok_steps.load(std::sync::atomic::Ordering::Relaxed), 3);
    assert_eq!(
        dropped.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the first flush's step, none after the detach"
    );
    a.tx_reserve(ca, 5)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"later");
    a.tx_commit(ca, 5);
    a.flush(now);
    got.clear();
    b.rx_burst(now, 8, &mut |c, f| got.push((c, f.to_vec())));
    assert_eq!(got, vec![(cb, b"later".to_vec())]);
}

#[test]
fn frames_queued_before_connect_wait_for_it() {
    let (la, lb) = LossyLink::pair(LossConfig::lossless(1500), 7);
    let mut a = DatagramDriver::new(la, ReliableConfig::default()).unwrap();
    let mut b = DatagramDriver::new(lb, ReliableConfig::default()).unwrap();
    let (ca, ia) = a.prepare().unwrap();
    let (cb, ib) = b.prepare().unwrap();
    assert!(matches!(a.tx_reserve(ca, 8), Ok(None)));
    a.connect(ca, ib).unwrap();
    let now = Instant::now();
    a.tx_reserve(ca, 8)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"12345678");
    a.tx_commit(ca, 8);
    a.flush(now);
    // b is not connected yet: the packet is dropped, and retransmitted
    // once b is.
    assert_eq!(b.rx_burst(now, 8, &mut |_, _| panic!("not connected")), 0);
    assert_eq!(b.stats().dropped_unknown_conn, 1);
    b.connect(cb, ia).unwrap();
    let later = a.poll_timeout().unwrap();
    a.flush(later);
    let mut got = Vec::new();
    b.rx_burst(later, 8, &mut |c, f| {
        assert_eq!(c, cb);
        got.push(f.to_vec());
    });
    assert_eq!(got, vec![b"12345678".to_vec()]);
}

#[test]
fn core_totals_keep_the_counters_of_detached_connections() {
    let (mut a, a_ids, mut b, b_ids) = pair(2, LossConfig::lossless(1500), 9);
    let now = Instant::now();
    for &c in &a_ids {
        a.tx_reserve(c, 10).unwrap().unwrap();
        a.tx_commit(c, 10);
    }
    a.flush(now);
    b.rx_burst(now, 8, &mut |_, _| {});
    let before = a.core_totals();
    assert_eq!(before.frames_sent, 2);
    assert_eq!(b.core_totals().frames_delivered, 2);
    a.detach(a_ids[0]);
    b.detach(b_ids[1]);
    assert_eq!(
        a.core_totals(),
        before,
        "a detached connection still counts"
    );
    assert_eq!(b.core_totals().frames_delivered, 2);
}

/// The end of a connection: `a` sends its last frame (a `Goodbye`, say)
/// and `b`'s session layer lets the connection go as soon as it has read
/// it, before `b` ever flushes. `b`'s core lingers, closed: its owed
/// acknowledgement still goes out, a retransmission after that
/// acknowledgement is lost is acknowledged again, and `a` completes
/// without a timeout failure. Neither side reports a failure; `b`'s slot
/// is free once the linger has passed.
#[test]
fn a_detached_connection_acknowledges_the_peers_last_frames() {
    let (mut a, a_ids, mut b, b_ids) = pair(1, LossConfig::lossless(1500), 11);
    let (ca, cb) = (a_ids[0], b_ids[0]);
    let t0 = Instant::now();
    let mut now = t0;
    a.tx_reserve(ca, 8)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"goodbye!");
    a.tx_commit(ca, 8);
    a.flush(now);
    let mut got = Vec::new();
    b.rx_burst(now, 8, &mut |_, f| got.push(f.to_vec()));
    assert_eq!(got, vec![b"goodbye!".to_vec()]);
    let old = b.local_id(cb).unwrap();
    b.detach(cb);
    assert_eq!((b.len(), b.lingering()), (0, 1), "b lingers, detached");
    assert!(b.winding_down(), "b owes an acknowledgement");

    // b's acknowledgement goes out, and is lost.
    now += Duration::from_millis(1);
    b.flush(now);
    assert!(
        !b.winding_down(),
        "a stopping reactor need not wait for retransmissions"
    );
    let lost = a
        .link_mut()
        .rx_burst(now, 64, &mut |_| {})
        .expect("a's link");
    assert_eq!(lost, 1, "b acknowledged the frame");
    assert!(a.tx_pending(ca));

    // a retransmits at its timeout; b, closed, acknowledges again.
    for _ in 0..1000 {
        now = a.poll_timeout().map_or(now, |t| t.max(now)) + Duration::from_micros(10);
        a.flush(now);
        b.rx_burst(now, 64, &mut |_, _| {
            panic!("a closed connection delivers no frame")
        });
        b.flush(now);
        a.rx_burst(now, 64, &mut |_, _| {});
        if !a.tx_pending(ca) {
            break;
        }
    }
    assert!(!a.tx_pending(ca), "a's last frame is acknowledged");
    let core = a.core(ca).unwrap().stats();
    assert_eq!((core.retransmits, core.timeouts), (1, 1));

    // Long after: nobody failed, and b's slot is free under a new id.
    while now < t0 + Duration::from_secs(30) {
        now += Duration::from_millis(50);
        a.flush(now);
        b.rx_burst(now, 64, &mut |_, _| {});
        b.flush(now);
        a.rx_burst(now, 64, &mut |_, _| {});
    }
    assert!(a.poll_failure().is_none() && b.poll_failure().is_none());
    assert_eq!(b.lingering(), 0, "the linger ended");
    let (c, id) = b.prepare().unwrap();
    assert_eq!(c, cb, "the slot is free again");
    assert_ne!(id, old);
}

/// A closed core whose own frame is never acknowledged (the peer went
/// first) retransmits within its retry budget and then goes quietly: the
/// driver reports no failure for a connection it no longer holds.
#[test]
fn a_lingering_core_whose_peer_is_gone_goes_quietly() {
    let (mut a, a_ids, mut b, b_ids) = pair(1, LossConfig::lossless(1500), 12);
    let mut now = Instant::now();
    a.tx_reserve(a_ids[0], 4).unwrap().unwrap().fill(1);
    a.tx_commit(a_ids[0], 4);
    a.detach(a_ids[0]);
    b.detach(b_ids[0]);
    assert_eq!(a.lingering(), 1, "a has a frame unacknowledged");
    assert!(a.winding_down());
    assert_eq!(b.lingering(), 0, "b received nothing: freed at once");
    for _ in 0..10_000 {
        a.flush(now);
        b.rx_burst(now, 64, &mut |_, _| panic!("no connection"));
        if a.lingering() == 0 {
            break;
        }
        now = a.poll_timeout().map_or(now, |t| t.max(now)) + Duration::from_micros(10);
    }
    assert_eq!(a.lingering(), 0, "the retry budget bounds the linger");
    assert!(!a.winding_down());
    assert!(a.poll_failure().is_none());
    assert!(b.stats().dropped_unknown_conn > 0);
    assert_eq!(a.core_totals().timeouts, 10);
}

/// A datagram queue has no receive interrupt: a parked driver naps for at
/// most `IDLE_NAP` (a short timeout is kept), and says the park timed out
/// when its waker stayed quiet.
#[test]
fn park_is_a_bounded_nap() {
    use starwire_datagram::IDLE_NAP;
    use starwire_transport::reactor::{ParkEnd, ParkWaker};
    use starwire_transport::Sleep;
    use std::os::fd::AsFd;

    let (mut a, _, _b, _) = pair(1, LossConfig::lossless(1500), 1);
    assert_eq!(a.sleep(), Sleep::Own);
    let fd = std::net::TcpListener::bind("127.0.0.1:0").expect("a descriptor");
    let waker = || ParkWaker {
        fd: fd.as_fd(),
        id: 1,
    };
    let t0 = Instant::now();
    assert_eq!(
        a.park(waker(), Duration::from_secs(30)),
        Some(ParkEnd::Timeout)
    );
    assert_eq!(a.park(waker(), Duration::ZERO), Some(ParkEnd::Timeout));
    // Far above the nap, far below the timeout asked for: holds on a
    // loaded machine.
    let took = t0.elapsed();
    assert!(IDLE_NAP < Duration::from_millis(1));
    assert!(took < Duration::from_secs(5), "two naps took {took:?}");
}

/// A nap watches the reactor's waker: a wake-up written before or during
/// the nap ends it as `Waker`, so the reactor drains it and turns.
#[test]
fn a_wake_up_ends_the_nap() {
    use starwire_transport::reactor::{ParkEnd, ParkWaker};
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    let (mut a, _, _b, _) = pair(1, LossConfig::lossless(1500), 1);
    let (mut tx, rx) = UnixStream::pair().expect("a socket pair");
    let waker = || ParkWaker {
        fd: rx.as_fd(),
        id: 1,
    };
    assert_eq!(
        a.park(waker(), Duration::from_secs(30)),
        Some(ParkEnd::Timeout)
    );
    tx.write_all(&[1]).expect("a wake-up");
    assert_eq!(
        a.park(waker(), Duration::from_secs(30)),
        Some(ParkEnd::Waker)
    );
}

/// The linger runs from the peer's last packet, not only from the close:
/// `a`'s acknowledgements are lost until well past one linger after `b`
/// closed, so `a`'s backed-off retransmissions reach `b` later than that;
/// `b`, still lingering, acknowledges each, and once one acknowledgement
/// gets through `a` completes without failing.
#[test]
fn a_lingering_core_outlives_the_peers_late_retransmissions() {
    let (mut a, a_ids, mut b, b_ids) = pair(1, LossConfig::lossless(1500), 12);
    let (ca, cb) = (a_ids[0], b_ids[0]);
    let t0 = Instant::now();
    let mut now = t0;
    a.tx_reserve(ca, 8)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"goodbye!");
    a.tx_commit(ca, 8);
    a.flush(now);
    b.rx_burst(now, 8, &mut |_, _| {});
    b.detach(cb);
    let linger = ReliableConfig::default().rto_max * 2;
    let mut late = 0;
    for _ in 0..10_000 {
        now = a.poll_timeout().map_or(now, |t| t.max(now)) + Duration::from_micros(10);
        a.flush(now);
        b.rx_burst(now, 64, &mut |_, _| {});
        b.flush(now);
        if now < t0 + linger + Duration::from_millis(200) {
            // Lost: what b sent never reaches a.
            a.link_mut()
                .rx_burst(now, 64, &mut |_| {})
                .expect("a's link");
        } else {
            late += 1;
            a.rx_burst(now, 64, &mut |_, _| {});
        }
        if !a.tx_pending(ca) || a.poll_failure().is_some() {
            break;
        }
    }
    assert!(late > 0, "no retransmission came after the first linger");
    assert!(a.poll_failure().is_none(), "a failed: b's slot was gone");
    assert!(!a.tx_pending(ca), "a's last frame is acknowledged");
}

/// A link that records the connections the driver told it to forget.
struct Forgetful {
    inner: LossyLink,
    forgotten: Vec<u32>,
}

impl DatagramLink for Forgetful {
    fn mtu(&self) -> usize {
        self.inner.mtu()
    }
    fn tx_alloc(&mut self, len: usize) -> Option<&mut [u8]> {
        self.inner.tx_alloc(len)
    }
    fn tx_commit(&mut self, len: usize) -> Result<(), starwire_datagram::LinkError> {
        self.inner.tx_commit(len)
    }
    fn tx_burst_flush(&mut self, now: Instant) -> Result<usize, starwire_datagram::LinkError> {
        self.inner.tx_burst_flush(now)
    }
    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, starwire_datagram::LinkError> {
        self.inner.rx_burst(now, max, sink)
    }
    fn forget(&mut self, local_conn: u32) {
        self.forgotten.push(local_conn);
    }
}

/// A freed slot's id is forgotten by the link (a DPDK link drops the
/// connection's peer address): at once for a connection with nothing to
/// linger for, after the linger for one that has.
#[test]
fn a_freed_connection_is_forgotten_by_the_link() {
    let (la, _lb) = LossyLink::pair(LossConfig::lossless(1500), 13);
    let link = Forgetful {
        inner: la,
        forgotten: Vec::new(),
    };
    let mut a = DatagramDriver::new(link, ReliableConfig::default()).expect("driver");
    let (c, id) = a.prepare().unwrap();
    a.connect(c, 7).unwrap();
    a.detach(c);
    assert_eq!(a.link_mut().forgotten, vec![id], "freed at once");
    let (c2, id2) = a.prepare().unwrap();
    assert_ne!(id2, id);
    a.connect(c2, 8).unwrap();
    a.tx_reserve(c2, 4)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"last");
    a.tx_commit(c2, 4);
    let t0 = Instant::now();
    a.flush(t0);
    a.detach(c2);
    assert_eq!(a.link_mut().forgotten, vec![id], "lingering, not yet");
    let mut now = t0;
    while now < t0 + Duration::from_secs(60) && a.link_mut().forgotten.len() < 2 {
        now += Duration::from_millis(50);
        a.flush(now);
        a.rx_burst(now, 64, &mut |_, _| {});
    }
    assert_eq!(a.link_mut().forgotten, vec![id, id2], "after the linger");
}

/// A peer that sends small frames as fast as its window allows, against a
/// reader that takes the `max` of 32 frames a connection per receive
/// burst (`Sessions`' own) while a burst brings up to `rx_batch` (64)
/// packets: the frames waiting for the reader stay within their bound
/// (they grew by the difference every turn before it), the packets past
/// it come again, and every frame arrives, in order.
#[test]
fn a_reader_slower_than_its_peer_holds_a_bounded_backlog_and_loses_nothing() {
    let cfg = ReliableConfig::default();
    let window = cfg.window as usize;
    let (mut a, a_ids, mut b, b_ids) = pair_with(1, LossConfig::lossless(1500), 1, cfg);
    let (ca, cb) = (a_ids[0], b_ids[0]);
    let total = 20_000u32;
    let mut now = Instant::now();
    let (mut sent, mut got) = (0u32, Vec::new());
    let mut most_waiting = 0;
    for _ in 0..100_000 {
        while sent < total {
            match a.tx_reserve(ca, 4).expect("reserve") {
                Some(buf) => {
                    buf.copy_from_slice(&sent.to_le_bytes());
                    a.tx_commit(ca, 4);
                    sent += 1;
                }
                None => break,
            }
        }
        a.flush(now);
        // The reader is slower still for the first half: one burst a turn
        // with room for only 8 frames.
        let max = if got.len() < total as usize / 2 {
            8
        } else {
            32
        };
        b.rx_burst(now, max, &mut |c, f| {
            assert_eq!(c, cb);
            got.push(u32::from_le_bytes(f.try_into().expect("4 bytes")));
        });
        most_waiting = most_waiting.max(b.core(cb).expect("core").ready_frames());
        b.flush(now);
        a.rx_burst(now, 32, &mut |_, _| {});
        now += Duration::from_micros(200);
        if got.len() == total as usize && !a.tx_pending(ca) {
            break;
        }
    }
    assert_eq!(
        got,
        (0..total).collect::<Vec<_>>(),
        "every frame, once, in order"
    );
    assert!(most_waiting <= 2 * window, "{most_waiting} frames waited");
    let stats = *b.core(cb).expect("core").stats();
    assert!(
        stats.dropped_backlog > 0,
        "the bound was reached: {stats:?}"
    );
    assert_eq!(b.counters().backlog_drops, Some(stats.dropped_backlog));
}

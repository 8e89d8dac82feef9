use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::*;
use crate::packet::{PacketFlags, PacketHeader};

const MTU: usize = PACKET_HEADER_LEN + 96; // 96 bytes of payload per packet

/// The ids of the two ends of `pair`: packets from a to b carry
/// `dst_conn` 2 and `src_conn` 1.
const A: ConnIds = ConnIds { local: 1, peer: 2 };
const B: ConnIds = ConnIds { local: 2, peer: 1 };

fn cfg() -> ReliableConfig {
    ReliableConfig {
        max_frame_len: 1024,
        window: 32,
        min_cwnd: 4,
        ..ReliableConfig::default()
    }
}

fn pair(cfg: ReliableConfig) -> (ReliableCore, ReliableCore) {
    (
        ReliableCore::new(cfg.clone(), MTU, A).unwrap(),
        ReliableCore::new(cfg, MTU, B).unwrap(),
    )
}

fn frame(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

fn send_frame(c: &mut ReliableCore, bytes: &[u8]) {
    let b = c.tx_reserve(bytes.len()).unwrap().expect("window has room");
    b.copy_from_slice(bytes);
    c.tx_commit(bytes.len());
}

fn drain_tx(c: &mut ReliableCore, now: Instant) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0; MTU];
    for _ in 0..10_000 {
        match c.poll_transmit(now, &mut buf) {
            Some(n) => out.push(buf[..n].to_vec()),
            None => return out,
        }
    }
    panic!("poll_transmit never ran dry");
}

fn feed(c: &mut ReliableCore, now: Instant, pkts: &[Vec<u8>], out: &mut Vec<Vec<u8>>) {
    for p in pkts {
        let mut budget = usize::MAX;
        c.handle_packet(now, p, &mut |f| out.push(f.to_vec()), &mut budget);
    }
    c.deliver(usize::MAX, &mut |f| out.push(f.to_vec()));
}

/// A data packet from `src` to `dst`.
fn data_pkt_between(src: u32, dst: u32, seq: u32, flags: PacketFlags, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0; PACKET_HEADER_LEN + payload.len()];
    let hdr = PacketHeader {
        flags: PacketFlags::DATA.with(flags),
        dst_conn: dst,
        src_conn: src,
        seq,
        ack: cfg().initial_seq,
        sack: 0,
        payload_len: 0,
    };
    hdr.encode(payload, &mut buf);
    buf
}

/// A data packet from a to `dst`.
fn data_pkt(dst: u32, seq: u32, flags: PacketFlags, payload: &[u8]) -> Vec<u8> {
    data_pkt_between(A.local, dst, seq, flags, payload)
}

fn whole() -> PacketFlags {
    PacketFlags::FIRST.with(PacketFlags::LAST)
}

#[test]
fn duplicate_packets_are_delivered_once_and_acked_at_once() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    let frames: Vec<_> = (0..3).map(|i| frame(i, 50)).collect();
    for f in &frames {
        send_frame(&mut a, f);
    }
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 3);
    let mut got = Vec::new();
    feed(&mut b, now, &pkts[..2], &mut got);
    // A duplicate of an already delivered packet.
    feed(&mut b, now, &pkts[..1], &mut got);
    assert_eq!(
        b.poll_timeout(),
        Some(now),
        "a duplicate is acknowledged at once"
    );
    feed(&mut b, now, &pkts, &mut got);
    assert_eq!(got, frames);
    assert_eq!(b.stats().duplicates, 3);
    assert_eq!(b.stats().frames_delivered, 3);
    // One acknowledgement for each duplicate: each may be what the
    // sender's lost acknowledgement made it resend.
    let acks = drain_tx(&mut b, now);
    assert_eq!(acks.len(), 3);
    feed(&mut a, now, &acks, &mut Vec::new());
    assert!(!a.tx_pending());
    assert_eq!(a.poll_timeout(), None, "nothing outstanding, no timer");
}

#[test]
fn buffered_duplicates_are_discarded_too() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    for i in 0..4 {
        send_frame(&mut a, &frame(i, 10));
    }
    let pkts = drain_tx(&mut a, now);
    let mut got = Vec::new();
    // 3 arrives twice before 0..2.
    feed(&mut b, now, &[pkts[3].clone(), pkts[3].clone()], &mut got);
    assert!(got.is_empty());
    assert_eq!(b.stats().duplicates, 1);
    feed(&mut b, now, &pkts[..3], &mut got);
    assert_eq!(got, (0..4).map(|i| frame(i, 10)).collect::<Vec<_>>());
}

#[test]
fn out_of_window_and_old_sequence_numbers_are_dropped() {
    let (_, mut b) = pair(cfg());
    let now = Instant::now();
    let w = cfg().window;
    let mut got = Vec::new();
    feed(
        &mut b,
        now,
        &[data_pkt(B.local, w, whole(), b"far")],
        &mut got,
    );
    assert_eq!(b.stats().out_of_window, 1);
    feed(
        &mut b,
        now,
        &[data_pkt(B.local, u32::MAX, whole(), b"old")],
        &mut got,
    );
    assert_eq!(
        b.stats().duplicates,
        1,
        "behind rcv_nxt counts as a duplicate"
    );
    // The last slot of the window is accepted and buffered.
    feed(
        &mut b,
        now,
        &[data_pkt(B.local, w - 1, whole(), b"edge")],
        &mut got,
    );
    assert_eq!(b.stats().out_of_order, 1);
    assert!(got.is_empty());
    assert_eq!(b.rcv_nxt(), 0);
    // Filling the gap 0..w-1 delivers everything in order.
    let fill: Vec<_> = (0..w - 1)
        .map(|s| data_pkt(B.local, s, whole(), &s.to_le_bytes()))
        .collect();
    feed(&mut b, now, &fill, &mut got);
    assert_eq!(got.len() as u32, w);
    assert_eq!(got.last().unwrap(), b"edge");
    assert_eq!(b.rcv_nxt(), w);
}

#[test]
fn sequence_numbers_wrap_around() {
    let c = ReliableConfig {
        initial_seq: u32::MAX - 10,
        ..cfg()
    };
    let (mut a, mut b) = pair(c);
    let now = Instant::now();
    let mut rng = SmallRng::seed_from_u64(7);
    let frames: Vec<_> = (0..40)
        .map(|i| frame(i, [10, 96, 97, 300][i % 4]))
        .collect();
    let mut got = Vec::new();
    let mut next = 0;
    for _round in 0..100 {
        while next < frames.len() {
            let Some(buf) = a.tx_reserve(frames[next].len()).unwrap() else {
                break;
            };
            buf.copy_from_slice(&frames[next]);
            a.tx_commit(frames[next].len());
            next += 1;
        }
        let mut pkts = drain_tx(&mut a, now);
        // Reorder and duplicate.
        let dups: Vec<_> = pkts.iter().step_by(3).cloned().collect();
        pkts.extend(dups);
        pkts.shuffle(&mut rng);
        feed(&mut b, now, &pkts, &mut got);
        let acks = drain_tx(&mut b, now);
        feed(&mut a, now, &acks, &mut Vec::new());
        if next == frames.len() && !a.tx_pending() {
            break;
        }
    }
    assert_eq!(got, frames);
    let packets: u32 = frames.iter().map(|f| f.len().div_ceil(96) as u32).sum();
    assert!(packets > 11, "the run must cross the wrap");
    assert_eq!(b.rcv_nxt(), (u32::MAX - 10).wrapping_add(packets));
    assert_eq!(a.snd_una(), b.rcv_nxt());
    assert!(a.snd_una() < 1000, "wrapped past zero");
    assert!(b.stats().duplicates > 0 && b.stats().out_of_order > 0);
}

#[test]
fn frames_are_fragmented_with_first_and_last_flags() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    let big = frame(1, 1024);
    send_frame(&mut a, &big);
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 11); // ceil(1024 / 96)
    for (i, p) in pkts.iter().enumerate() {
        assert!(p.len() <= MTU);
        let (h, payload) = PacketHeader::decode(p).unwrap();
        assert_eq!(h.seq, i as u32);
        assert_eq!(h.flags.contains(PacketFlags::FIRST), i == 0);
        assert_eq!(h.flags.contains(PacketFlags::LAST), i == 10);
        assert_eq!(payload.len(), if i == 10 { 1024 - 960 } else { 96 });
    }
    let mut got = Vec::new();
    feed(&mut b, now, &pkts, &mut got);
    assert_eq!(got, vec![big]);
    // Empty frames travel too.
    send_frame(&mut a, &[]);
    let pkts = drain_tx(&mut a, now);
    let mut got = Vec::new();
    feed(&mut b, now, &pkts, &mut got);
    assert_eq!(got, vec![Vec::<u8>::new()]);
}

#[test]
fn retransmission_timer_backs_off_until_an_rtt_sample() {
    let (mut a, mut b) = pair(cfg());
    let t0 = Instant::now();
    send_frame(&mut a, b"hello");
    let first = drain_tx(&mut a, t0);
    assert_eq!(first.len(), 1);
    let rto0 = a.current_rto();
    assert_eq!(a.poll_timeout(), Some(t0 + rto0));
    // Lost. Nothing happens before the deadline.
    a.handle_timeout(t0 + rto0 - Duration::from_micros(1));
    assert!(drain_tx(&mut a, t0).is_empty());
    let t1 = t0 + rto0;
    a.handle_timeout(t1);
    assert_eq!(a.stats().timeouts, 1);
    assert_eq!(a.current_rto(), (rto0 * 2).min(cfg().rto_max));
    let again = drain_tx(&mut a, t1);
    assert_eq!(again, first, "the same packet again");
    assert_eq!(a.stats().retransmits, 1);
    assert_eq!(a.poll_timeout(), Some(t1 + a.current_rto()));
    let mut got = Vec::new();
    feed(&mut b, t1, &again, &mut got);
    assert_eq!(got, vec![b"hello".to_vec()]);
    // Delayed ack: due after ack_delay, not now.
    assert!(drain_tx(&mut b, t1).is_empty());
    let t2 = t1 + cfg().ack_delay;
    assert_eq!(b.poll_timeout(), Some(t2));
    let acks = drain_tx(&mut b, t2);
    assert_eq!(acks.len(), 1);
    feed(&mut a, t2, &acks, &mut Vec::new());
    assert!(!a.tx_pending());
    // The acknowledgement of a retransmission is progress but no RTT
    // sample (Karn): the backed-off timeout stays.
    assert_eq!(a.current_rto(), rto0 * 2, "backoff kept");
    // A frame sent once and acknowledged is a sample: the backoff goes.
    send_frame(&mut a, b"again");
    let pkts = drain_tx(&mut a, t2);
    assert_eq!(a.poll_timeout(), Some(t2 + rto0 * 2), "armed backed off");
    let t3 = t2 + Duration::from_micros(50);
    feed(&mut b, t3, &pkts, &mut Vec::new());
    let t4 = t3 + cfg().ack_delay;
    let acks = drain_tx(&mut b, t4);
    feed(&mut a, t4, &acks, &mut Vec::new());
    assert!(!a.tx_pending());
    assert!(a.current_rto() < rto0 * 2, "backoff reset by the sample");
}

/// Frames sent one at a time (the next once the last is acknowledged)
/// from `a` to `b` over a path that delays every packet by `one_way`,
/// where `lose(n)` drops a's `n`-th data transmission. A virtual clock
/// steps from event to event. Returns `a`'s RTO after each frame's
/// acknowledgement.
fn stop_and_wait(
    a: &mut ReliableCore,
    b: &mut ReliableCore,
    frames: usize,
    one_way: Duration,
    lose: impl Fn(usize) -> bool,
) -> Vec<Duration> {
    let mut now = Instant::now();
    // (arrival, to b, packet), in arrival order: the delay is constant.
    let mut wire: VecDeque<(Instant, bool, Vec<u8>)> = VecDeque::new();
    let mut data_sent = 0;
    let mut rtos = Vec::new();
    let mut next = 0;
    for _ in 0..100_000 {
        if !a.tx_pending() {
            if next > 0 {
                rtos.push(a.current_rto());
            }
            if next == frames {
                return rtos;
            }
            send_frame(a, &frame(next, 40));
            next += 1;
        }
        a.handle_timeout(now);
        b.handle_timeout(now);
        for p in drain_tx(a, now) {
            data_sent += 1;
            if !lose(data_sent) {
                wire.push_back((now + one_way, true, p));
            }
        }
        for p in drain_tx(b, now) {
            wire.push_back((now + one_way, false, p));
        }
        while wire.front().is_some_and(|w| w.0 <= now) {
            let (_, to_b, p) = wire.pop_front().unwrap();
            let to = if to_b { &mut *b } else { &mut *a };
            feed(to, now, &[p], &mut Vec::new());
        }
        if !a.tx_pending() {
            // Acknowledged: the next frame goes at once.
            continue;
        }
        let t = [
            a.poll_timeout(),
            b.poll_timeout(),
            wire.front().map(|w| w.0),
        ]
        .into_iter()
        .flatten()
        .min()
        .expect("a frame unacknowledged has a timer running");
        now = now.max(t);
    }
    panic!("the frames were never all acknowledged");
}

/// Karn's algorithm: a round trip longer than the RTO before any sample
/// (8 ms against 5 ms), and the first transmission lost. Each frame then
/// times out and is acknowledged only once resent, an acknowledgement that
/// gives no RTT sample. Were the backoff dropped on that acknowledgement
/// (as it was), the RTO would fall back to 5 ms and every frame would be
/// resent, the estimate never learning the round trip; kept, the next
/// frame's timeout is long enough for it to be acknowledged first, its RTT
/// is measured, and no frame is resent after.
#[test]
fn an_acknowledged_retransmission_keeps_the_backoff() {
    let (mut a, mut b) = pair(cfg());
    let rto0 = cfg().rto_initial;
    let rtos = stop_and_wait(&mut a, &mut b, 20, Duration::from_millis(4), |n| n == 1);
    assert_eq!(
        rtos[0],
        rto0 * 2,
        "the backoff outlives the acknowledgement"
    );
    assert!(
        rtos[1..].iter().all(|&r| r > Duration::from_millis(8)),
        "the RTO learnt the round trip: {rtos:?}"
    );
    assert_eq!(a.stats().retransmits, 1, "only the lost packet was resent");
}

#[test]
fn ack_every_n_packets_is_immediate() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    let n = cfg().ack_every as usize;
    for i in 0..n {
        send_frame(&mut a, &frame(i, 5));
    }
    let pkts = drain_tx(&mut a, now);
    feed(&mut b, now, &pkts[..n - 1], &mut Vec::new());
    assert_eq!(b.poll_timeout(), Some(now + cfg().ack_delay));
    feed(&mut b, now, &pkts[n - 1..], &mut Vec::new());
    assert_eq!(b.poll_timeout(), Some(now));
    let acks = drain_tx(&mut b, now);
    assert_eq!(acks.len(), 1);
    let (h, _) = PacketHeader::decode(&acks[0]).unwrap();
    assert_eq!(h.ack, n as u32);
    assert_eq!(h.sack, 0);
}

#[test]
fn dead_peer_after_the_timeout_budget() {
    let c = ReliableConfig {
        dead_after_timeouts: 4,
        ..cfg()
    };
    let (mut a, _) = pair(c);
    let mut now = Instant::now();
    send_frame(&mut a, b"anyone?");
    let mut sent = drain_tx(&mut a, now).len();
    for _ in 0..100 {
        let Some(t) = a.poll_timeout() else { break };
        now = now.max(t);
        a.handle_timeout(now);
        sent += drain_tx(&mut a, now).len();
    }
    let err = a.check().unwrap_err();
    assert!(
        matches!(&err, TransportError::Link(m) if m.starts_with("peer unreachable")),
        "{err}"
    );
    assert_eq!(a.stats().timeouts, 4);
    assert_eq!(sent, 4, "one transmission and three retransmissions");
    assert!(a.tx_reserve(1).is_err());
    assert_eq!(a.poll_timeout(), None);
}

#[test]
fn sack_triggers_fast_retransmit() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    for i in 0..6 {
        send_frame(&mut a, &frame(i, 20));
    }
    let pkts = drain_tx(&mut a, now);
    let mut got = Vec::new();
    feed(&mut b, now, &pkts[1..], &mut got);
    assert!(got.is_empty());
    let acks = drain_tx(&mut b, now);
    assert_eq!(acks.len(), 1, "out-of-order data is acknowledged at once");
    let (h, _) = PacketHeader::decode(&acks[0]).unwrap();
    assert_eq!((h.ack, h.sack), (0, 0b11111));
    feed(&mut a, now, &acks, &mut Vec::new());
    assert_eq!(a.stats().fast_retransmits, 1);
    let rtx = drain_tx(&mut a, now);
    assert_eq!(
        rtx,
        vec![pkts[0].clone()],
        "only the hole, before any timeout"
    );
    feed(&mut b, now, &rtx, &mut got);
    assert_eq!(got, (0..6).map(|i| frame(i, 20)).collect::<Vec<_>>());
    // On a timeout, sacked packets are not sent again.
    let (mut a, _) = pair(cfg());
    for i in 0..6 {
        send_frame(&mut a, &frame(i, 20));
    }
    drain_tx(&mut a, now);
    feed(&mut a, now, &acks, &mut Vec::new());
    let fast = drain_tx(&mut a, now);
    assert_eq!(fast.len(), 1);
    let t = a.poll_timeout().unwrap();
    a.handle_timeout(t);
    assert_eq!(drain_tx(&mut a, t), fast);
}

#[test]
fn corrupted_foreign_and_malformed_packets_are_dropped() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    send_frame(&mut a, b"payload");
    let mut pkt = drain_tx(&mut a, now).remove(0);
    let mut got = Vec::new();
    let mut bad = pkt.clone();
    *bad.last_mut().unwrap() ^= 0x10;
    feed(&mut b, now, &[bad], &mut got);
    assert_eq!(b.stats().dropped_corrupt, 1);
    feed(
        &mut b,
        now,
        &[data_pkt(99, 0, whole(), b"payload")],
        &mut got,
    );
    assert_eq!(b.stats().dropped_foreign, 1);
    // The right destination from the wrong peer connection is foreign too.
    feed(
        &mut b,
        now,
        &[data_pkt_between(77, B.local, 0, whole(), b"payload")],
        &mut got,
    );
    assert_eq!(b.stats().dropped_foreign, 2);
    feed(
        &mut b,
        now,
        &[pkt[..20].to_vec(), b"garbage".to_vec()],
        &mut got,
    );
    assert_eq!(b.stats().dropped_malformed, 2);
    assert!(got.is_empty());
    assert_eq!(b.rcv_nxt(), 0);
    assert!(b.check().is_ok());
    // Ethernet padding after the packet is fine.
    pkt.extend_from_slice(&[0; 20]);
    feed(&mut b, now, &[pkt], &mut got);
    assert_eq!(got, vec![b"payload".to_vec()]);
}

#[test]
fn window_back_pressure() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    // 4 fragments per frame, window of 32 packets: 8 frames fit.
    let f = frame(0, 96 * 4);
    for _ in 0..8 {
        send_frame(&mut a, &f);
    }
    assert!(a.tx_reserve(f.len()).unwrap().is_none());
    assert!(
        a.tx_reserve(1).unwrap().is_none(),
        "full to the last packet"
    );
    assert_eq!(a.stats().window_full, 2);
    assert_eq!(a.in_flight(), 32);
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 32);
    assert!(a.tx_reserve(1).unwrap().is_none(), "still unacknowledged");
    let mut got = Vec::new();
    feed(&mut b, now, &pkts[..4], &mut got);
    let acks = drain_tx(&mut b, now + cfg().ack_delay);
    feed(&mut a, now, &acks, &mut Vec::new());
    assert_eq!(a.in_flight(), 28);
    assert!(a.tx_reserve(f.len()).unwrap().is_some(), "room after acks");
    assert!(
        a.tx_reserve(f.len() + 1).unwrap().is_none(),
        "5 fragments do not fit"
    );
}

#[test]
fn protocol_violations_fail_the_connection() {
    let (_, mut b) = pair(cfg());
    let now = Instant::now();
    feed(
        &mut b,
        now,
        &[data_pkt(B.local, 0, PacketFlags::LAST, b"x")],
        &mut Vec::new(),
    );
    let err = b.check().unwrap_err();
    assert!(err.to_string().contains("protocol violation"), "{err}");

    let (_, mut b) = pair(cfg());
    let big = vec![0u8; 96];
    let pkts: Vec<_> = (0..11)
        .map(|s| {
            data_pkt(
                B.local,
                s,
                if s == 0 {
                    PacketFlags::FIRST
                } else {
                    PacketFlags::NONE
                },
                &big,
            )
        })
        .collect();
    feed(&mut b, now, &pkts, &mut Vec::new());
    assert!(b.check().is_err(), "a frame beyond max_frame_len");
}

#[test]
fn direct_delivery_respects_the_budget_and_order() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    for i in 0..5 {
        send_frame(&mut a, &frame(i, 30));
    }
    let pkts = drain_tx(&mut a, now);
    let mut got = Vec::new();
    let mut budget = 2;
    for p in &pkts {
        b.handle_packet(now, p, &mut |f| got.push(f.to_vec()), &mut budget);
    }
    assert_eq!(budget, 0);
    assert_eq!(got.len(), 2);
    assert_eq!(b.ready_frames(), 3);
    assert_eq!(b.deliver(2, &mut |f| got.push(f.to_vec())), 2);
    assert_eq!(b.deliver(9, &mut |f| got.push(f.to_vec())), 1);
    assert_eq!(got, (0..5).map(|i| frame(i, 30)).collect::<Vec<_>>());
    assert_eq!(b.stats().frames_delivered, 5);

    // A frame completed while older ones wait is queued behind them, even
    // with budget to spare.
    for i in 5..8 {
        send_frame(&mut a, &frame(i, 30));
    }
    let pkts = drain_tx(&mut a, now);
    let mut zero = 0;
    b.handle_packet(now, &pkts[0], &mut |_| panic!("no budget"), &mut zero);
    let mut budget = 10;
    for p in &pkts[1..] {
        b.handle_packet(now, p, &mut |f| got.push(f.to_vec()), &mut budget);
    }
    assert_eq!(budget, 10, "nothing may overtake the queued frame");
    assert_eq!(b.deliver(10, &mut |f| got.push(f.to_vec())), 3);
    assert_eq!(got, (0..8).map(|i| frame(i, 30)).collect::<Vec<_>>());
}

#[test]
fn config_validation() {
    assert!(ReliableCore::new(cfg(), MIN_MTU - 1, A).is_err());
    let small = ReliableConfig {
        window: 10,
        ..cfg()
    };
    assert!(
        ReliableCore::new(small, MTU, A).is_err(),
        "11 fragments > window 10"
    );
    let huge = ReliableConfig {
        window: MAX_WINDOW + 1,
        ..cfg()
    };
    assert!(ReliableCore::new(huge, MTU, A).is_err());
    let mut c = ReliableCore::new(cfg(), MTU, A).unwrap();
    assert!(matches!(
        c.tx_reserve(1025),
        Err(TransportError::FrameTooLarge {
            len: 1025,
            max: 1024
        })
    ));
}

#[test]
fn frame_buffers_go_with_their_last_acknowledged_fragment_and_are_reused() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    // A large frame, a one-packet frame and an empty one in flight at once.
    let frames = [frame(1, 1000), frame(2, 40), Vec::new()];
    for f in &frames {
        send_frame(&mut a, f);
    }
    assert_eq!(a.tx_frames.len(), 3);
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 11 + 1 + 1);
    // Acknowledging the first 10 fragments frees nothing: the large
    // frame's last fragment is still out.
    let mut got = Vec::new();
    feed(&mut b, now, &pkts[..10], &mut got);
    feed(&mut a, now, &drain_ack(&mut b, now), &mut Vec::new());
    assert_eq!((a.tx_frames.len(), a.tx_frames_base), (3, 0));
    feed(&mut b, now, &pkts[10..], &mut got);
    assert_eq!(got, frames.to_vec());
    feed(&mut a, now, &drain_ack(&mut b, now), &mut Vec::new());
    assert_eq!((a.tx_frames.len(), a.tx_frames_base), (0, 3));
    assert!(!a.tx_pending());
    // The buffers are back in the pool; the next frames take them, and
    // whatever an earlier frame left in a buffer is overwritten.
    assert!(!a.frame_pool.is_empty());
    let again = [frame(3, 500), frame(4, 7)];
    for f in &again {
        send_frame(&mut a, f);
    }
    let mut got = Vec::new();
    feed(&mut b, now, &drain_tx(&mut a, now), &mut got);
    assert_eq!(got, again.to_vec());
}

#[test]
fn a_lost_frame_goes_again_from_its_own_buffer_while_later_frames_reuse_earlier_ones() {
    let (mut a, mut b) = pair(cfg());
    let t0 = Instant::now();
    // Frames 0 and 1 arrive; frame 2's three packets are lost.
    let first = [frame(0, 500), frame(1, 40), frame(2, 250)];
    for f in &first {
        send_frame(&mut a, f);
    }
    let pkts = drain_tx(&mut a, t0);
    assert_eq!(pkts.len(), 6 + 1 + 3);
    let mut got = Vec::new();
    feed(&mut b, t0, &pkts[..7], &mut got);
    feed(&mut a, t0, &drain_ack(&mut b, t0), &mut Vec::new());
    assert_eq!((a.tx_frames.len(), a.tx_frames_base), (1, 2));
    assert_eq!(
        a.frame_pool.len(),
        2,
        "frames 0 and 1 gave their buffers back"
    );
    // The next frames take those buffers, unzeroed, each shorter than
    // what its buffer held before, while frame 2 is still unacknowledged.
    let later = [frame(3, 300), frame(4, 20), frame(5, 450)];
    for f in &later {
        send_frame(&mut a, f);
    }
    assert!(a.frame_pool.is_empty(), "both buffers were taken again");
    // Frame 2 times out: its first packet goes again from its own
    // buffer. The timeout is a loss episode: the congestion window falls
    // to its minimum of 4 (half of 3 in flight), so one new packet goes
    // with it.
    let t1 = t0 + a.current_rto();
    a.handle_timeout(t1);
    assert_eq!((a.cwnd(), a.stats().cwnd_reductions), (4, 1));
    let pkts = drain_tx(&mut a, t1);
    assert_eq!(pkts.len(), 1 + 1);
    assert_eq!(a.stats().retransmits, 1);
    feed(&mut b, t1, &pkts, &mut got);
    // The acknowledgement reports frame 2's other two packets missing:
    // they go again from the same buffer, in the same episode (no second
    // reduction), and the rest follows as acknowledgements come back.
    exchange(&mut a, &mut b, t1, &mut got);
    assert_eq!(a.stats().retransmits, 3);
    assert_eq!(a.stats().cwnd_reductions, 1);
    let want: Vec<Vec<u8>> = first.iter().chain(&later).cloned().collect();
    assert_eq!(got, want);
    assert!(!a.tx_pending());
    assert!(a.tx_frames.is_empty());
}

/// Acknowledgements from `b` to `a` and `a`'s packets to `b`, in turn,
/// until neither has a packet to send.
fn exchange(a: &mut ReliableCore, b: &mut ReliableCore, now: Instant, got: &mut Vec<Vec<u8>>) {
    loop {
        feed(a, now, &drain_ack(b, now), &mut Vec::new());
        let pkts = drain_tx(a, now);
        if pkts.is_empty() {
            break;
        }
        feed(b, now, &pkts, got);
    }
}

#[test]
fn a_receiver_starved_for_most_of_the_timeout_budget_gets_every_frame_once() {
    let c = cfg();
    let (mut a, mut b) = pair(c.clone());
    let t0 = Instant::now();
    // A full window of frames of 0 to 5 packets.
    let mut sent = Vec::new();
    loop {
        let f = frame(sent.len(), sent.len() * 137 % 480);
        let Some(buf) = a.tx_reserve(f.len()).unwrap() else {
            break;
        };
        buf.copy_from_slice(&f);
        a.tx_commit(f.len());
        sent.push(f);
    }
    let in_flight = a.in_flight() as usize;
    assert!(in_flight + 5 > c.window as usize, "{in_flight}");
    let mut wire = drain_tx(&mut a, t0);
    // The receiver does not run: each timeout but the last sends the
    // oldest packets again (the n-th in a row 2^(n-1) of them, at most
    // all), and every copy waits unread.
    let mut now = t0;
    for _ in 1..c.dead_after_timeouts {
        now = a.poll_timeout().expect("a retransmission deadline");
        a.handle_timeout(now);
        wire.extend(drain_tx(&mut a, now));
    }
    assert!(a.check().is_ok());
    let resent: usize = (0..c.dead_after_timeouts - 1)
        .map(|k| (1usize << k).min(in_flight))
        .sum();
    assert_eq!(wire.len(), in_flight + resent);
    // It runs at last and reads them all: each frame once, intact, and
    // its acknowledgement is progress (the timeouts start again from 0).
    let mut got = Vec::new();
    feed(&mut b, now, &wire, &mut got);
    assert_eq!(got, sent);
    feed(&mut a, now, &drain_ack(&mut b, now), &mut Vec::new());
    assert!(!a.tx_pending());
    assert!(a.tx_frames.is_empty());
    assert_eq!(a.poll_timeout(), None);
    // The timeouts were one loss episode: the congestion window halved
    // once, to half the packets then in flight.
    assert_eq!(a.stats().cwnd_reductions, 1);
    assert_eq!(a.cwnd(), in_flight as u32 / 2);
    // The next frames reuse the freed buffers, within that window.
    let again: Vec<Vec<u8>> = (0..6).map(|i| frame(100 + i, 400 - 70 * i)).collect();
    for f in &again {
        send_frame(&mut a, f);
    }
    let mut got = Vec::new();
    exchange(&mut a, &mut b, now, &mut got);
    assert_eq!(got, again);
}

#[test]
fn frames_waiting_to_be_read_keep_their_bytes_while_the_assembly_buffer_is_reused() {
    let (mut a, mut b) = pair(cfg());
    let now = Instant::now();
    let frames = [
        frame(0, 700),
        frame(1, 200),
        frame(2, 30),
        frame(3, 650),
        frame(4, 100),
    ];
    for f in &frames {
        send_frame(&mut a, f);
    }
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 8 + 3 + 1 + 7 + 2);
    // No budget for the first three: each is reassembled, then waits.
    let mut got = Vec::new();
    for p in &pkts[..12] {
        let mut budget = 0;
        b.handle_packet(now, p, &mut |f| got.push(f.to_vec()), &mut budget);
    }
    assert!(got.is_empty());
    assert_eq!(b.ready_frames(), 3);
    assert_eq!(b.deliver(usize::MAX, &mut |f| got.push(f.to_vec())), 3);
    // The rest are lent straight from the assembly buffer, the shorter
    // after the longer.
    feed(&mut b, now, &pkts[12..], &mut got);
    assert_eq!(got, frames.to_vec());
    assert_eq!(b.stats().frames_delivered, 5);
}

/// The standalone acknowledgement `c` owes, due at once.
fn drain_ack(c: &mut ReliableCore, now: Instant) -> Vec<Vec<u8>> {
    c.ack_deadline = Some(now);
    drain_tx(c, now)
}

/// Twenty one-packet frames sent by `a` at `now`.
fn twenty_sent(a: &mut ReliableCore, now: Instant) -> Vec<Vec<u8>> {
    for i in 0..20 {
        send_frame(a, &frame(i, 20));
    }
    let pkts = drain_tx(a, now);
    assert_eq!(pkts.len(), 20);
    pkts
}

#[test]
fn a_timeout_retransmits_the_oldest_packet_and_timeouts_in_a_row_double_it() {
    let (mut a, _) = pair(cfg());
    let t0 = Instant::now();
    let pkts = twenty_sent(&mut a, t0);
    let t = a.poll_timeout().unwrap();
    a.handle_timeout(t);
    assert_eq!(drain_tx(&mut a, t), vec![pkts[0].clone()]);
    let t = a.poll_timeout().unwrap();
    a.handle_timeout(t);
    assert_eq!(drain_tx(&mut a, t), pkts[..2].to_vec(), "backed off, two");
    let t = a.poll_timeout().unwrap();
    a.handle_timeout(t);
    assert_eq!(drain_tx(&mut a, t), pkts[..4].to_vec(), "then four");
    assert_eq!((a.stats().timeouts, a.stats().retransmits), (3, 7));
}

#[test]
fn a_spurious_timeout_costs_one_packet() {
    // The peer did not run until after the timeout: the original packets
    // were waiting in its receive ring, and arrive before the copy.
    let (mut a, mut b) = pair(cfg());
    let t0 = Instant::now();
    let pkts = twenty_sent(&mut a, t0);
    let t1 = a.poll_timeout().unwrap();
    a.handle_timeout(t1);
    let copy = drain_tx(&mut a, t1);
    assert_eq!(copy, vec![pkts[0].clone()]);
    let mut got = Vec::new();
    feed(&mut b, t1, &pkts[..10], &mut got);
    let ack = drain_ack(&mut b, t1);
    feed(&mut a, t1, &ack, &mut Vec::new());
    assert_eq!(a.stats().fast_retransmits, 0, "packets 10.. are in flight");
    assert!(drain_tx(&mut a, t1).is_empty());
    feed(&mut b, t1, &pkts[10..], &mut got);
    feed(&mut b, t1, &copy, &mut got);
    assert_eq!(got, (0..20).map(|i| frame(i, 20)).collect::<Vec<_>>());
    assert_eq!(b.stats().duplicates, 1);
    feed(&mut a, t1, &drain_ack(&mut b, t1), &mut Vec::new());
    assert_eq!(a.stats().retransmits, 1);
    assert_eq!(a.poll_timeout(), None, "all acknowledged");
}

#[test]
fn a_lost_tail_is_recovered_after_one_timeout() {
    // All twenty lost: the timeout sends the first again, and its
    // acknowledgement, alone, reports the others missing.
    let (mut a, mut b) = pair(cfg());
    let t0 = Instant::now();
    twenty_sent(&mut a, t0);
    let mut now = a.poll_timeout().unwrap();
    a.handle_timeout(now);
    let mut got = Vec::new();
    let mut to_b = drain_tx(&mut a, now);
    assert_eq!(to_b.len(), 1);
    for _ in 0..10 {
        if to_b.is_empty() {
            break;
        }
        now += Duration::from_micros(10);
        feed(&mut b, now, &to_b, &mut got);
        feed(&mut a, now, &drain_ack(&mut b, now), &mut Vec::new());
        to_b = drain_tx(&mut a, now);
    }
    assert_eq!(got, (0..20).map(|i| frame(i, 20)).collect::<Vec<_>>());
    assert_eq!(a.stats().timeouts, 1);
    assert_eq!(a.stats().retransmits, 20, "each lost packet once");
    assert_eq!(a.poll_timeout(), None);
}

/// The congestion window starts at the send window (a run without loss
/// never meets it), halves the packets in flight on a loss, lets out new
/// packets only while fewer than it are in the network (the peer's
/// selective acknowledgements take packets out), and grows back by one
/// packet per window acknowledged.
#[test]
fn a_loss_halves_the_congestion_window_and_acknowledgements_grow_it_back() {
    let c = cfg();
    let (mut a, mut b) = pair(c.clone());
    let now = Instant::now();
    assert_eq!(a.cwnd(), c.window);
    // 20 one-packet frames; the 5th is lost.
    for i in 0..20 {
        send_frame(&mut a, &frame(i, 40));
    }
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 20);
    let mut got = Vec::new();
    let arrived: Vec<Vec<u8>> = pkts
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != 4)
        .map(|(_, p)| p.clone())
        .collect();
    feed(&mut b, now, &arrived, &mut got);
    // 12 frames more wait while the acknowledgement reports the loss.
    for i in 20..32 {
        send_frame(&mut a, &frame(i, 40));
    }
    feed(&mut a, now, &drain_ack(&mut b, now), &mut Vec::new());
    assert_eq!(a.stats().fast_retransmits, 1);
    assert_eq!(a.stats().cwnd_reductions, 1);
    // Frames 0 to 3 are acknowledged: 16 in flight, halved.
    assert_eq!(a.cwnd(), 8, "half of the 16 in flight");
    // The retransmission goes, and new packets while fewer than 8 are in
    // the network: of the 16 sent, 15 were acknowledged selectively, and
    // the lost one still counts.
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 1 + 7);
    assert_eq!(a.stats().retransmits, 1);
    feed(&mut b, now, &pkts, &mut got);
    assert_eq!(got.len(), 27);
    exchange(&mut a, &mut b, now, &mut got);
    assert_eq!(a.cwnd(), 8, "the episode's end leaves the window");
    // Acknowledgements grow it: 16 frames leave 8 at a time; once 8 are
    // acknowledged, 9.
    for i in 32..48 {
        send_frame(&mut a, &frame(i, 40));
    }
    let pkts = drain_tx(&mut a, now);
    assert_eq!(pkts.len(), 8);
    feed(&mut b, now, &pkts, &mut got);
    feed(&mut a, now, &drain_ack(&mut b, now), &mut Vec::new());
    assert_eq!(a.cwnd(), 9, "8 acknowledged: one more packet");
    exchange(&mut a, &mut b, now, &mut got);
    let want: Vec<Vec<u8>> = (0..48).map(|i| frame(i, 40)).collect();
    assert_eq!(got, want);
    assert_eq!(a.stats().cwnd_reductions, 1);
}

/// `min_cwnd` equal to the window turns congestion control off.
#[test]
fn a_minimum_window_of_the_send_window_keeps_it() {
    let c = ReliableConfig {
        min_cwnd: 32,
        ..cfg()
    };
    let (mut a, _b) = pair(c);
    let now = Instant::now();
    for i in 0..8 {
        send_frame(&mut a, &frame(i, 40));
    }
    drain_tx(&mut a, now);
    a.handle_timeout(now + a.current_rto());
    assert_eq!((a.cwnd(), a.stats().cwnd_reductions), (32, 1));
}

/// A reader that takes nothing while its peer goes on sending: the
/// frames waiting for it stop at their bound (the window, here), the
/// in-order packets past it are dropped unacknowledged, and once the
/// reader takes its frames the peer's resends bring every one, in order.
#[test]
fn the_frames_waiting_for_a_slow_reader_are_bounded_and_none_is_lost() {
    let cfg = cfg();
    let window = cfg.window as usize;
    let (mut a, mut b) = pair(cfg);
    let frames: Vec<_> = (0..10 * window).map(|i| frame(i, 50)).collect();
    let mut now = Instant::now();
    let mut next = 0;
    let mut got = Vec::new();
    let mut most_waiting = 0;
    for round in 0..2_000 {
        // The reader takes nothing for the first 200 rounds.
        let reading = round >= 200;
        while next < frames.len() {
            match a.tx_reserve(frames[next].len()).unwrap() {
                Some(buf) => {
                    buf.copy_from_slice(&frames[next]);
                    a.tx_commit(frames[next].len());
                    next += 1;
                }
                None => break,
            }
        }
        for p in drain_tx(&mut a, now) {
            let mut budget = if reading { usize::MAX } else { 0 };
            b.handle_packet(now, &p, &mut |f| got.push(f.to_vec()), &mut budget);
        }
        most_waiting = most_waiting.max(b.ready_frames());
        if reading {
            b.deliver(usize::MAX, &mut |f| got.push(f.to_vec()));
        }
        for p in drain_tx(&mut b, now) {
            a.handle_packet(now, &p, &mut |_| {}, &mut 0);
        }
        now += Duration::from_millis(1);
        a.handle_timeout(now);
        b.handle_timeout(now);
        if got.len() == frames.len() && !a.tx_pending() {
            break;
        }
    }
    assert_eq!(most_waiting, window, "the backlog filled to its bound");
    assert!(b.stats().dropped_backlog > 0, "{:?}", b.stats());
    assert_eq!(got, frames, "every frame, once, in order");
    assert!(a.check().is_ok() && b.check().is_ok());
}

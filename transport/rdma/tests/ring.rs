//! The ring protocol over the simulated RC queue pair.

use std::collections::VecDeque;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_rdma::{
    PreparedRing, QpState, QueuePair, RangeError, RegisteredMem, RemoteRing, RingConfig, RingError,
    RingFault, RingTransport, SimConfig, SimRcQp, WcStatus, WorkRequest,
};
use starwire_transport::{Transport, TransportError};

type Ring = RingTransport<SimRcQp>;

fn small_cfg() -> RingConfig {
    RingConfig {
        ring_len: 4096,
        staging_len: 2048,
        recv_depth: 8,
        max_frame_len: None,
    }
}

fn connect(a: RingConfig, b: RingConfig, sim: SimConfig) -> (Ring, Ring) {
    let (qa, qb) = SimRcQp::pair(sim);
    let pa = PreparedRing::new(qa, a).expect("prepare a");
    let pb = PreparedRing::new(qb, b).expect("prepare b");
    let (ra, rb) = (pa.local_ring(), pb.local_ring());
    (
        pa.connect(rb).expect("connect a"),
        pb.connect(ra).expect("connect b"),
    )
}

/// Deterministic frame contents: a function of the sequence number.
fn fill(seq: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (seq as u8).wrapping_mul(31).wrapping_add(i as u8) ^ (seq >> 8) as u8;
    }
}

fn matches(seq: u64, frame: &[u8]) -> bool {
    frame
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (seq as u8).wrapping_mul(31).wrapping_add(i as u8) ^ (seq >> 8) as u8)
}

/// Try to queue one frame; true if it was taken.
fn send(t: &mut Ring, seq: u64, len: usize) -> bool {
    match t.tx_reserve(len).expect("tx_reserve") {
        Some(buf) => {
            assert_eq!(buf.len(), len);
            fill(seq, buf);
            t.tx_commit(len);
            true
        }
        None => false,
    }
}

/// One directional stream: frames queued by one side, checked by the other.
struct Stream {
    next_seq: u64,
    total: u64,
    sent_lens: VecDeque<(u64, usize)>,
    received: u64,
    pending_len: Option<usize>,
}

impl Stream {
    fn new(total: u64) -> Self {
        Self {
            next_seq: 0,
            total,
            sent_lens: VecDeque::new(),
            received: 0,
            pending_len: None,
        }
    }

    fn done(&self) -> bool {
        self.received == self.total
    }

    fn offer(&mut self, t: &mut Ring, rng: &mut SmallRng, burst: usize) {
        let max = t.max_frame_len();
        for _ in 0..burst {
            if self.next_seq == self.total {
                return;
            }
            let len = *self.pending_len.get_or_insert_with(|| {
                // Bias towards both tiny and maximal frames.
                match rng.gen_range(0..10) {
                    0 => max,
                    1 => rng.gen_range(0..=8),
                    _ => rng.gen_range(1..=max),
                }
            });
            if !send(t, self.next_seq, len) {
                return;
            }
            self.sent_lens.push_back((self.next_seq, len));
            self.pending_len = None;
            self.next_seq += 1;
        }
    }

    fn drain(&mut self, t: &mut Ring, now: Instant, max: usize) {
        let expected = &mut self.sent_lens;
        let received = &mut self.received;
        let n = t
            .rx_burst(now, max, &mut |frame| {
                let (seq, len) = expected.pop_front().expect("frame that was never sent");
                assert_eq!(frame.len(), len, "frame {seq} length");
                assert!(matches(seq, frame), "frame {seq} contents");
                *received += 1;
            })
            .expect("rx_burst");
        assert!(n <= max);
    }
}

#[test]
fn thousands_of_random_frames_arrive_in_order_exactly_once() {
    for seed in [0x5eed, 1, 2] {
        random_one_way(seed);
    }
}

fn random_one_way(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (mut a, mut b) = connect(small_cfg(), small_cfg(), SimConfig::default());
    assert_eq!(a.max_frame_len(), 2048);
    let now = Instant::now();
    let mut ab = Stream::new(5000);
    for _ in 0..200_000 {
        if ab.done() {
            break;
        }
        let burst = rng.gen_range(1..6);
        ab.offer(&mut a, &mut rng, burst);
        if rng.gen_bool(0.8) {
            a.flush(now).unwrap();
        }
        let max = rng.gen_range(0..6);
        ab.drain(&mut b, now, max);
        if rng.gen_bool(0.7) {
            b.flush(now).unwrap();
        }
        a.rx_burst(now, 16, &mut |_| panic!("no traffic b -> a"))
            .unwrap();
    }
    assert!(ab.done(), "delivered {} of {}", ab.received, ab.total);
    assert!(ab.sent_lens.is_empty());
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.data_writes, 5000);
    assert_eq!(sb.frames_received, 5000);
    assert!(sa.wraps > 100, "wraps: {}", sa.wraps);
    assert!(sa.ring_stalls > 0 && sa.recv_stalls > 0, "{sa:?}");
    assert!(sb.credit_writes > 0 && sa.credits_received == sb.credit_writes);
    // Idle: all credit eventually returns.
    for _ in 0..4 {
        b.flush(now).unwrap();
        a.flush(now).unwrap();
    }
    assert_eq!(a.ring_credit(), 4096);
    assert!(!a.tx_pending() && !b.tx_pending());
}

#[test]
fn both_directions_at_once_with_minimal_receive_depth() {
    for seed in [7, 8, 9] {
        random_both_ways(seed);
    }
}

fn random_both_ways(seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let cfg = RingConfig {
        ring_len: 1024,
        staging_len: 1024,
        recv_depth: 4,
        max_frame_len: None,
    };
    let (mut a, mut b) = connect(cfg, cfg, SimConfig::default());
    let now = Instant::now();
    let (mut ab, mut ba) = (Stream::new(3000), Stream::new(3000));
    for _ in 0..300_000 {
        if ab.done() && ba.done() {
            break;
        }
        let (x, y) = (rng.gen_range(0..4), rng.gen_range(0..4));
        ab.offer(&mut a, &mut rng, x);
        ba.offer(&mut b, &mut rng, y);
        if rng.gen_bool(0.6) {
            a.flush(now).unwrap();
        }
        if rng.gen_bool(0.6) {
            b.flush(now).unwrap();
        }
        let (m, n) = (rng.gen_range(0..4), rng.gen_range(0..4));
        ab.drain(&mut b, now, m);
        ba.drain(&mut a, now, n);
    }
    assert!(
        ab.done() && ba.done(),
        "a->b {} b->a {}",
        ab.received,
        ba.received
    );
    // Credit chatter dies out when idle.
    for _ in 0..10 {
        a.flush(now).unwrap();
        b.flush(now).unwrap();
        a.rx_burst(now, 8, &mut |_| panic!("no data")).unwrap();
        b.rx_burst(now, 8, &mut |_| panic!("no data")).unwrap();
    }
    let quiet = (a.stats().credit_writes, b.stats().credit_writes);
    for _ in 0..10 {
        a.flush(now).unwrap();
        b.flush(now).unwrap();
        a.rx_burst(now, 8, &mut |_| panic!("no data")).unwrap();
        b.rx_burst(now, 8, &mut |_| panic!("no data")).unwrap();
    }
    assert_eq!(quiet, (a.stats().credit_writes, b.stats().credit_writes));
    assert!(!a.tx_pending() && !b.tx_pending());
}

#[test]
fn one_doorbell_per_flush_with_work_and_none_when_idle() {
    let mut rng = SmallRng::seed_from_u64(11);
    let (mut a, mut b) = connect(small_cfg(), small_cfg(), SimConfig::default());
    let now = Instant::now();
    let mut ab = Stream::new(2000);
    let mut flushes_with_work = 0;
    for _ in 0..100_000 {
        if ab.done() {
            break;
        }
        let burst = rng.gen_range(0..8);
        ab.offer(&mut a, &mut rng, burst);
        let before = a.stats();
        a.flush(now).unwrap();
        let after = a.stats();
        let posted =
            (after.data_writes - before.data_writes) + (after.credit_writes - before.credit_writes);
        if posted > 0 {
            flushes_with_work += 1;
        }
        // Exactly one doorbell per flush that posted something.
        assert_eq!(a.qp().doorbells(), flushes_with_work);
        ab.drain(&mut b, now, 4);
        b.flush(now).unwrap();
    }
    assert!(ab.done());
    assert_eq!(a.qp().doorbells(), flushes_with_work);
    assert_eq!(a.stats().doorbells, flushes_with_work);
    assert!(a.stats().flushes > flushes_with_work);
    let writes = a.stats().data_writes + a.stats().credit_writes;
    assert!(
        writes > flushes_with_work,
        "writes were batched behind doorbells"
    );

    // A batch of frames goes out behind a single doorbell (after the
    // last send completions and credits have been reaped).
    for _ in 0..3 {
        a.flush(now).unwrap();
        b.flush(now).unwrap();
    }
    assert!(!a.tx_pending());
    let bells = a.qp().doorbells();
    for seq in 0..6 {
        assert!(send(&mut a, seq, 100));
    }
    assert!(a.tx_pending());
    a.flush(now).unwrap();
    assert_eq!(a.qp().doorbells(), bells + 1);
    assert!(!a.tx_pending());
    // Idle flushes ring nothing.
    a.flush(now).unwrap();
    a.flush(now).unwrap();
    assert_eq!(a.qp().doorbells(), bells + 1);
}

#[test]
fn bursts_respect_max_and_keep_order() {
    let cfg = RingConfig {
        ring_len: 8192,
        staging_len: 8192,
        recv_depth: 64,
        max_frame_len: None,
    };
    let (mut a, mut b) = connect(cfg, cfg, SimConfig::default());
    let now = Instant::now();
    for seq in 0..50 {
        assert!(send(&mut a, seq, 40 + seq as usize));
    }
    a.flush(now).unwrap();
    assert_eq!(a.qp().doorbells(), 1);
    assert_eq!(a.stats().data_writes, 50);
    let mut got = Vec::new();
    assert_eq!(b.rx_burst(now, 0, &mut |_| panic!("max 0")).unwrap(), 0);
    let mut sizes = Vec::new();
    for _ in 0..10 {
        let n = b
            .rx_burst(now, 16, &mut |f| {
                let seq = f.len() as u64 - 40;
                assert!(matches(seq, f));
                got.push(seq);
            })
            .unwrap();
        if n == 0 {
            break;
        }
        sizes.push(n);
    }
    assert_eq!(sizes, vec![16, 16, 16, 2]);
    assert_eq!(got, (0..50).collect::<Vec<_>>());
    // The receiver owes credit and says so.
    assert!(b.tx_pending());
    b.flush(now).unwrap();
    assert!(!b.tx_pending());
    a.flush(now).unwrap();
    assert_eq!(a.ring_credit(), 8192);
}

#[test]
fn receiver_that_never_polls_stalls_the_sender_without_loss() {
    let (mut a, mut b) = connect(small_cfg(), small_cfg(), SimConfig::default());
    let now = Instant::now();
    let mut queued = 0;
    for seq in 0..100 {
        if !send(&mut a, seq, 64) {
            break;
        }
        queued += 1;
        a.flush(now).unwrap();
    }
    // recv_depth 8, one kept in reserve for credits.
    assert_eq!(a.stats().data_writes, 7);
    assert_eq!(a.peer_recv_credit(), 1);
    assert!(a.stats().recv_stalls > 0);
    assert!(a.tx_pending());
    assert_eq!(a.qp().state(), QpState::ReadyToSend);
    // The receiver wakes up: everything arrives.
    let mut seq = 0;
    for _ in 0..100 {
        b.rx_burst(now, 64, &mut |f| {
            assert!(matches(seq, f));
            seq += 1;
        })
        .unwrap();
        b.flush(now).unwrap();
        a.flush(now).unwrap();
        if seq == queued {
            break;
        }
    }
    assert_eq!(seq, queued);
}

#[test]
fn rnr_when_the_receiver_never_reposts_is_a_typed_error() {
    let (qa, mut qb) = SimRcQp::pair(SimConfig {
        rnr_retry: 3,
        ..SimConfig::default()
    });
    let pa = PreparedRing::new(qa, small_cfg()).unwrap();
    // A hand-driven peer that registers a ring and posts only two receive
    // WRs while promising sixteen.
    let ring = qb.reg_mr(4096).unwrap();
    qb.post_recv(1).unwrap();
    qb.post_recv(2).unwrap();
    let mut a = pa
        .connect(RemoteRing {
            rkey: ring.rkey,
            addr: ring.addr,
            len: 4096,
            recv_depth: 16,
        })
        .unwrap();
    let now = Instant::now();
    for seq in 0..5 {
        assert!(send(&mut a, seq, 128));
    }
    let mut err = None;
    for _ in 0..50 {
        let r = a
            .flush(now)
            .and_then(|()| a.rx_burst(now, 8, &mut |_| {}).map(drop));
        if let Err(e) = r {
            err = Some(e);
            break;
        }
    }
    let err = err.expect("RNR must surface as an error, not a hang");
    assert!(matches!(err, TransportError::Link(ref m) if m.contains("IBV_WC_RNR_RETRY_EXC_ERR")));
    assert_eq!(
        a.fault(),
        Some(&RingFault::Completion {
            wr: WorkRequest::DataWrite,
            wr_id: 2,
            status: WcStatus::RnrRetryExceeded,
        })
    );
    assert_eq!(a.qp().state(), QpState::Error);
    // Sticky: every later call fails the same way.
    assert!(matches!(a.tx_reserve(8), Err(TransportError::Link(_))));
    assert!(matches!(a.flush(now), Err(TransportError::Link(_))));
    assert!(matches!(
        a.rx_burst(now, 1, &mut |_| {}),
        Err(TransportError::Link(_))
    ));
    // The two writes that found a receive WR landed.
    let mut wcs = [starwire_rdma::Completion::default(); 4];
    assert_eq!(qb.poll_cq(&mut wcs).unwrap(), 2);
    let mut landed = [0u8; 4];
    qb.mr_mem(ring.lkey)
        .unwrap()
        .read(128, &mut landed)
        .unwrap();
    assert_eq!(landed, {
        let mut f = [0u8; 4];
        fill(1, &mut f);
        f
    });
}

#[test]
fn remote_access_outside_the_ring_puts_the_qp_in_error() {
    let (qa, qb) = SimRcQp::pair(SimConfig::default());
    let pa = PreparedRing::new(qa, small_cfg()).unwrap();
    let pb = PreparedRing::new(qb, small_cfg()).unwrap();
    let ra = pa.local_ring();
    // b's ring is 4096 bytes; a is told it is twice that.
    let lie = RemoteRing {
        len: 8192,
        ..pb.local_ring()
    };
    let mut a = pa.connect(lie).unwrap();
    let mut b = pb.connect(ra).unwrap();
    let now = Instant::now();
    let mut result = Ok(());
    for seq in 0..6 {
        assert!(send(&mut a, seq, 1024));
        result = a.flush(now);
        if result.is_err() {
            break;
        }
    }
    // The flush that tripped may succeed; the next poll reports it.
    if result.is_ok() {
        result = a.flush(now);
    }
    let err = result.expect_err("write past the ring must fail");
    assert!(matches!(err, TransportError::Link(ref m) if m.contains("IBV_WC_REM_ACCESS_ERR")));
    assert!(matches!(
        a.fault(),
        Some(RingFault::Completion {
            wr: WorkRequest::DataWrite,
            status: WcStatus::RemoteAccess,
            ..
        })
    ));
    assert_eq!(a.qp().state(), QpState::Error);
    // The four writes inside the ring were delivered intact.
    let mut seq = 0;
    b.rx_burst(now, 16, &mut |f| {
        assert!(matches(seq, f));
        seq += 1;
    })
    .unwrap();
    assert_eq!(seq, 4);
    // The peer learns when its credit return finds nobody answering.
    let err = b.flush(now).and_then(|()| b.flush(now)).unwrap_err();
    assert!(matches!(err, TransportError::Link(ref m) if m.contains("IBV_WC_RETRY_EXC_ERR")));
    assert!(matches!(
        b.fault(),
        Some(RingFault::Completion {
            wr: WorkRequest::CreditWrite,
            ..
        })
    ));
}

#[test]
fn frames_are_encoded_and_read_in_place() {
    let (mut a, mut b) = connect(small_cfg(), small_cfg(), SimConfig::default());
    let now = Instant::now();
    let addresses = |mem: RegisteredMem<'_>| {
        let start = mem.as_ptr() as usize;
        start..start + mem.len()
    };
    let staging = addresses(a.qp().mr_mem(a.staging_region().lkey).unwrap());
    let ring = addresses(b.qp().mr_mem(b.ring_region().lkey).unwrap());
    let mut delivered = 0;
    for round in 0..20u64 {
        for i in 0..3 {
            let seq = round * 3 + i;
            let buf = a.tx_reserve(700).unwrap().expect("room");
            let p = buf.as_ptr_range();
            assert!(staging.contains(&(p.start as usize)) && p.end as usize <= staging.end);
            fill(seq, buf);
            a.tx_commit(700);
            a.flush(now).unwrap();
        }
        b.rx_burst(now, 8, &mut |f| {
            let p = f.as_ptr_range();
            assert!(ring.contains(&(p.start as usize)) && p.end as usize <= ring.end);
            assert!(matches(delivered, f));
            delivered += 1;
        })
        .unwrap();
        b.flush(now).unwrap();
    }
    assert_eq!(delivered, 60);
}

#[test]
fn max_size_frames_and_oversize_rejection() {
    let cfg = RingConfig {
        ring_len: 4096,
        staging_len: 4096,
        recv_depth: 8,
        max_frame_len: None,
    };
    let (mut a, mut b) = connect(cfg, cfg, SimConfig::default());
    let now = Instant::now();
    let max = a.max_frame_len();
    assert_eq!(max, 2048);
    assert!(matches!(
        a.tx_reserve(max + 1),
        Err(TransportError::FrameTooLarge {
            len: 2049,
            max: 2048
        })
    ));
    // A small frame after each maximal one: every later maximal frame
    // straddles the end of the ring and must wrap.
    let lens: Vec<usize> = (0..400)
        .map(|i| if i % 2 == 0 { max } else { 100 })
        .collect();
    let mut next = 0;
    let mut seen = 0;
    for _ in 0..10_000 {
        if seen == lens.len() {
            break;
        }
        while next < lens.len() && send(&mut a, next as u64, lens[next]) {
            next += 1;
        }
        a.flush(now).unwrap();
        b.rx_burst(now, 4, &mut |f| {
            assert_eq!(f.len(), lens[seen]);
            assert!(matches(seen as u64, f));
            seen += 1;
        })
        .unwrap();
        b.flush(now).unwrap();
    }
    assert_eq!(seen, lens.len());
    assert!(a.stats().wraps >= 100, "{:?}", a.stats());
}

#[test]
fn explicit_max_frame_len_is_honoured_and_checked() {
    let cfg = RingConfig {
        max_frame_len: Some(1000),
        ..small_cfg()
    };
    let (a, _b) = connect(cfg, small_cfg(), SimConfig::default());
    assert_eq!(a.max_frame_len(), 1000);
    let (qa, qb) = SimRcQp::pair(SimConfig::default());
    let too_big = RingConfig {
        max_frame_len: Some(2049),
        ..small_cfg()
    };
    let pa = PreparedRing::new(qa, too_big).unwrap();
    let pb = PreparedRing::new(qb, small_cfg()).unwrap();
    assert!(matches!(
        pa.connect(pb.local_ring()),
        Err(RingError::Config(_))
    ));
}

#[test]
fn setup_rejects_unusable_shapes() {
    let bad = [
        RingConfig {
            ring_len: 1000,
            ..small_cfg()
        },
        RingConfig {
            ring_len: 0,
            ..small_cfg()
        },
        RingConfig {
            recv_depth: 3,
            ..small_cfg()
        },
        RingConfig {
            recv_depth: 1024,
            ..small_cfg()
        },
        RingConfig {
            staging_len: 100,
            ..small_cfg()
        },
    ];
    for cfg in bad {
        let (qa, _qb) = SimRcQp::pair(SimConfig {
            max_recv_wr: 2048,
            cq_depth: 4096,
            ..SimConfig::default()
        });
        assert!(
            matches!(PreparedRing::new(qa, cfg), Err(RingError::Config(_))),
            "{cfg:?}"
        );
    }
    // recv_depth beyond the QP's receive queue.
    let (qa, _qb) = SimRcQp::pair(SimConfig {
        max_recv_wr: 4,
        ..SimConfig::default()
    });
    assert!(matches!(
        PreparedRing::new(qa, small_cfg()),
        Err(RingError::Config(_))
    ));
    // A CQ too small for both queues.
    let (qa, _qb) = SimRcQp::pair(SimConfig {
        cq_depth: 16,
        ..SimConfig::default()
    });
    assert!(matches!(
        PreparedRing::new(qa, small_cfg()),
        Err(RingError::Config(_))
    ));
    // A bad remote description.
    let (qa, _qb) = SimRcQp::pair(SimConfig::default());
    let pa = PreparedRing::new(qa, small_cfg()).unwrap();
    let remote = RemoteRing {
        rkey: 1,
        addr: 0,
        len: 4096,
        recv_depth: 2,
    };
    assert!(matches!(pa.connect(remote), Err(RingError::Remote(_))));
}

#[test]
fn remote_ring_round_trips_through_bytes() {
    let r = RemoteRing {
        rkey: 0xdead_beef,
        addr: 0x7f00_1234_5000,
        len: 1 << 20,
        recv_depth: 128,
    };
    assert_eq!(RemoteRing::from_bytes(&r.to_bytes()), r);
}

#[test]
fn preparing_posts_the_receive_depth() {
    let (qa, _qb) = SimRcQp::pair(SimConfig::default());
    let pa = PreparedRing::new(qa, small_cfg()).unwrap();
    assert_eq!(pa.qp().posted_recvs(), 8);
    assert_eq!(pa.local_ring().recv_depth, 8);
    assert_eq!(pa.local_ring().len, 4096);
}

#[test]
fn region_ranges_outside_the_region_are_typed_errors() {
    let (a, _b) = connect(small_cfg(), small_cfg(), SimConfig::default());
    let staging = a.qp().mr_mem(a.staging_region().lkey).unwrap();
    assert_eq!(staging.len(), 2048);
    let outside = |off, len| RangeError {
        off,
        len,
        region_len: 2048,
    };
    assert_eq!(staging.range(2040, 8), Ok(2040..2048));
    assert_eq!(staging.range(2041, 8), Err(outside(2041, 8)));
    assert_eq!(staging.range(usize::MAX, 1), Err(outside(usize::MAX, 1)));
    assert_eq!(staging.read(2048, &mut [0; 1]), Err(outside(2048, 1)));
    assert_eq!(staging.write(4096, &[]), Err(outside(4096, 0)));
    // SAFETY: nothing is in flight on this idle transport and the rejected
    // calls lend nothing.
    unsafe {
        assert_eq!(staging.slice(1, 2048), Err(outside(1, 2048)));
        assert_eq!(
            staging.slice_mut(2047, usize::MAX),
            Err(outside(2047, usize::MAX))
        );
    }
    assert!(a.qp().mr_mem(0xdead).is_none());
}

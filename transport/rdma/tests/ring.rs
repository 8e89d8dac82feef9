//! The ring protocol of one connection, through an `RdmaDriver` on each
//! side over simulated NICs.

use std::collections::VecDeque;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_rdma::{
    Access, QpState, RangeError, RdmaDriver, RegisteredMem, RemoteRing, RingConfig, RingConn,
    RingError, RingFault, SimConfig, SimNic, Verbs, WcStatus, WorkRequest,
};
use starwire_transport::{ConnId, Driver, TransportError};

/// One side: a driver with a single connection.
struct End {
    d: RdmaDriver<SimNic>,
    c: ConnId,
}

impl End {
    fn ring(&self) -> &RingConn {
        self.d.ring(self.c).expect("connected")
    }

    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.d.tx_reserve(self.c, len)
    }

    fn tx_commit(&mut self, len: usize) {
        self.d.tx_commit(self.c, len);
    }

    fn take_failure(&mut self) -> Result<(), TransportError> {
        match self.d.poll_failure() {
            Some((c, e)) => {
                assert_eq!(c, self.c);
                Err(e)
            }
            None => Ok(()),
        }
    }

    fn flush(&mut self, now: Instant) -> Result<(), TransportError> {
        self.d.flush(now);
        self.take_failure()
    }

    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let me = self.c;
        let n = self.d.rx_burst(now, max, &mut |c, f| {
            assert_eq!(c, me);
            sink(f);
        });
        self.take_failure().map(|()| n)
    }

    fn tx_pending(&self) -> bool {
        self.d.tx_pending(self.c)
    }

    fn max_frame_len(&self) -> usize {
        self.d.max_frame_len()
    }

    fn qp_state(&self) -> Option<QpState> {
        self.d.verbs().qp_state(self.ring().qpn())
    }
}

fn small_cfg() -> RingConfig {
    RingConfig {
        ring_len: 4096,
        staging_len: 2048,
        recv_depth: 8,
        max_frame_len: None,
    }
}

fn connect(a: RingConfig, b: RingConfig, sim: SimConfig) -> (End, End) {
    let (mut na, mut nb) = SimNic::pair(sim);
    let (qa, qb) = na.connect_qp(&mut nb).expect("queue pair");
    let mut da = RdmaDriver::new(na, a).expect("driver a");
    let mut db = RdmaDriver::new(nb, b).expect("driver b");
    let (ca, ra) = da.prepare(qa).expect("prepare a");
    let (cb, rb) = db.prepare(qb).expect("prepare b");
    da.connect(ca, rb).expect("connect a");
    db.connect(cb, ra).expect("connect b");
    (End { d: da, c: ca }, End { d: db, c: cb })
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
fn send(t: &mut End, seq: u64, len: usize) -> bool {
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

    fn offer(&mut self, t: &mut End, rng: &mut SmallRng, burst: usize) {
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

    fn drain(&mut self, t: &mut End, now: Instant, max: usize) {
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
    let (sa, sb) = (a.ring().stats(), b.ring().stats());
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
    assert_eq!(a.ring().ring_credit(), 4096);
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
    let idle_round = |a: &mut End, b: &mut End| {
        a.flush(now).unwrap();
        b.flush(now).unwrap();
        a.rx_burst(now, 8, &mut |_| panic!("no data")).unwrap();
        b.rx_burst(now, 8, &mut |_| panic!("no data")).unwrap();
    };
    for _ in 0..10 {
        idle_round(&mut a, &mut b);
    }
    let quiet = (
        a.ring().stats().credit_writes,
        b.ring().stats().credit_writes,
    );
    for _ in 0..10 {
        idle_round(&mut a, &mut b);
    }
    assert_eq!(
        quiet,
        (
            a.ring().stats().credit_writes,
            b.ring().stats().credit_writes
        )
    );
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
        let before = a.ring().stats();
        a.flush(now).unwrap();
        let after = a.ring().stats();
        let posted =
            (after.data_writes - before.data_writes) + (after.credit_writes - before.credit_writes);
        if posted > 0 {
            flushes_with_work += 1;
        }
        // Exactly one doorbell per flush that posted something.
        assert_eq!(a.d.verbs().doorbells(), flushes_with_work);
        ab.drain(&mut b, now, 4);
        b.flush(now).unwrap();
    }
    assert!(ab.done());
    assert_eq!(a.d.verbs().doorbells(), flushes_with_work);
    assert_eq!(a.d.stats().doorbells, flushes_with_work);
    assert!(a.d.stats().flushes > flushes_with_work);
    let writes = a.ring().stats().data_writes + a.ring().stats().credit_writes;
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
    let bells = a.d.verbs().doorbells();
    for seq in 0..6 {
        assert!(send(&mut a, seq, 100));
    }
    assert!(a.tx_pending());
    a.flush(now).unwrap();
    assert_eq!(a.d.verbs().doorbells(), bells + 1);
    assert!(!a.tx_pending());
    // Idle flushes ring nothing.
    a.flush(now).unwrap();
    a.flush(now).unwrap();
    assert_eq!(a.d.verbs().doorbells(), bells + 1);
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
    assert_eq!(a.d.verbs().doorbells(), 1);
    assert_eq!(a.ring().stats().data_writes, 50);
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
    assert_eq!(a.ring().ring_credit(), 8192);
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
    assert_eq!(a.ring().stats().data_writes, 7);
    assert_eq!(a.ring().peer_recv_credit(), 1);
    assert!(a.ring().stats().recv_stalls > 0);
    assert!(a.tx_pending());
    assert_eq!(a.qp_state(), Some(QpState::ReadyToSend));
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
    let (na, mut nb) = SimNic::pair(SimConfig {
        rnr_retry: 3,
        ..SimConfig::default()
    });
    let mut na = na;
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    let (ca, _) = da.prepare(qa).unwrap();
    // A hand-driven peer that registers a ring and posts only two receive
    // WRs while promising sixteen.
    let ring = nb.reg_mr(4096, Access::RemoteWrite).unwrap();
    nb.post_recv(qb, 1).unwrap();
    nb.post_recv(qb, 2).unwrap();
    da.connect(
        ca,
        RemoteRing {
            rkey: ring.rkey,
            addr: ring.addr,
            len: 4096,
            recv_depth: 16,
        },
    )
    .unwrap();
    let mut a = End { d: da, c: ca };
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
        a.ring().fault(),
        Some(&RingFault::Completion {
            wr: WorkRequest::DataWrite,
            wr_id: 2,
            status: WcStatus::RnrRetryExceeded,
        })
    );
    assert_eq!(a.qp_state(), Some(QpState::Error));
    // Sticky, and reported once: later calls fail, nothing more is polled.
    assert!(matches!(a.tx_reserve(8), Err(TransportError::Link(_))));
    assert!(a.flush(now).is_ok());
    assert!(a.rx_burst(now, 1, &mut |_| panic!("no frame")).is_ok());
    assert!(!a.tx_pending());
    // The two writes that found a receive WR landed.
    let mut wcs = [starwire_rdma::Completion::default(); 4];
    assert_eq!(nb.poll_cq(&mut wcs).unwrap(), 2);
    let mut landed = [0u8; 4];
    nb.mr_mem(ring.lkey)
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
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    let mut db = RdmaDriver::new(nb, small_cfg()).unwrap();
    let (ca, ra) = da.prepare(qa).unwrap();
    let (cb, rb) = db.prepare(qb).unwrap();
    // b's ring is 4096 bytes; a is told it is twice that.
    da.connect(ca, RemoteRing { len: 8192, ..rb }).unwrap();
    db.connect(cb, ra).unwrap();
    let (mut a, mut b) = (End { d: da, c: ca }, End { d: db, c: cb });
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
        a.ring().fault(),
        Some(RingFault::Completion {
            wr: WorkRequest::DataWrite,
            status: WcStatus::RemoteAccess,
            ..
        })
    ));
    assert_eq!(a.qp_state(), Some(QpState::Error));
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
        b.ring().fault(),
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
    let staging = addresses(a.d.verbs().mr_mem(a.ring().staging_region().lkey).unwrap());
    let ring = addresses(b.d.verbs().mr_mem(b.ring().ring_region().lkey).unwrap());
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
    // Refusing an oversized frame is not a failure of the connection.
    assert!(a.d.poll_failure().is_none());
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
    assert!(a.ring().stats().wraps >= 100, "{:?}", a.ring().stats());
}

#[test]
fn explicit_max_frame_len_is_honoured_and_checked() {
    let cfg = RingConfig {
        max_frame_len: Some(1000),
        ..small_cfg()
    };
    let (a, _b) = connect(cfg, small_cfg(), SimConfig::default());
    assert_eq!(a.max_frame_len(), 1000);
    let too_big = RingConfig {
        max_frame_len: Some(2049),
        ..small_cfg()
    };
    let (na, _nb) = SimNic::pair(SimConfig::default());
    assert!(matches!(
        RdmaDriver::new(na, too_big),
        Err(RingError::Config(_))
    ));
    // A peer whose ring cannot hold two of our largest frames is refused,
    // and the connection stays prepared for a better answer.
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    let half = RingConfig {
        ring_len: 2048,
        ..small_cfg()
    };
    let mut db = RdmaDriver::new(nb, half).unwrap();
    let (ca, _) = da.prepare(qa).unwrap();
    let (_, rb) = db.prepare(qb).unwrap();
    assert!(matches!(da.connect(ca, rb), Err(RingError::Remote(_))));
    assert!(da.ring(ca).is_none());
    let fine = RemoteRing { len: 4096, ..rb };
    da.connect(ca, fine).unwrap();
    assert!(da.ring(ca).is_some());
    assert!(matches!(
        da.connect(ca, fine),
        Err(RingError::NotPrepared(c)) if c == ca
    ));
    assert!(matches!(
        db.connect(ConnId::new(7), fine),
        Err(RingError::NotPrepared(_))
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
        let (na, _nb) = SimNic::pair(SimConfig::default());
        assert!(
            matches!(RdmaDriver::new(na, cfg), Err(RingError::Config(_))),
            "{cfg:?}"
        );
    }
    // recv_depth beyond the QP's receive queue.
    let (mut na, mut nb) = SimNic::pair(SimConfig {
        max_recv_wr: 4,
        ..SimConfig::default()
    });
    let (qa, _) = na.connect_qp(&mut nb).unwrap();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    assert!(matches!(da.prepare(qa), Err(RingError::Config(_))));
    assert_eq!(da.verbs().region_count(), 0, "nothing stays registered");
    assert!(matches!(
        da.prepare(0xdead),
        Err(RingError::UnknownQp(0xdead))
    ));
    assert!(da.is_empty());
}

#[test]
fn a_remote_ring_past_the_end_of_the_address_space_is_refused() {
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    let mut db = RdmaDriver::new(nb, small_cfg()).unwrap();
    let (ca, ra) = da.prepare(qa).unwrap();
    let (cb, rb) = db.prepare(qb).unwrap();
    for addr in [u64::MAX - 63, u64::MAX - 4095, u64::MAX] {
        let hostile = RemoteRing { addr, ..rb };
        let err = da.connect(ca, hostile).unwrap_err();
        assert!(
            matches!(&err, RingError::Remote(m) if m.contains("address space")),
            "{err}"
        );
        assert!(a_ring_is_absent(&da, ca), "the connection stays prepared");
    }
    // The connection is still usable with the real ring.
    da.connect(ca, rb).unwrap();
    db.connect(cb, ra).unwrap();
    let (mut a, mut b) = (End { d: da, c: ca }, End { d: db, c: cb });
    let now = Instant::now();
    assert!(send(&mut a, 0, 64));
    assert!(send(&mut a, 1, 64));
    a.flush(now).unwrap();
    let mut seq = 0;
    b.rx_burst(now, 16, &mut |f| {
        assert!(matches(seq, f));
        seq += 1;
    })
    .unwrap();
    assert_eq!(seq, 2);
    assert!(a.d.poll_failure().is_none());
}

fn a_ring_is_absent(d: &RdmaDriver<SimNic>, c: ConnId) -> bool {
    d.ring(c).is_none() && d.len() == 1
}

#[test]
fn the_shared_cq_bounds_the_connections_of_a_driver() {
    // Each connection may have 128 send + 8 receive WRs outstanding: a
    // 300-entry CQ holds two of them, not three.
    let (mut na, mut nb) = SimNic::pair(SimConfig {
        cq_depth: 300,
        ..SimConfig::default()
    });
    let qps: Vec<(u32, u32)> = (0..3).map(|_| na.connect_qp(&mut nb).unwrap()).collect();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    let (c0, _) = da.prepare(qps[0].0).unwrap();
    da.prepare(qps[1].0).unwrap();
    let err = da.prepare(qps[2].0).unwrap_err();
    assert!(
        matches!(&err, RingError::Config(m) if m.contains("CQ depth 300")),
        "{err}"
    );
    assert_eq!(da.len(), 2);
    // Detaching frees the connection's share, its slot, its queue pair
    // and its regions.
    da.detach(c0);
    assert_eq!(da.len(), 1);
    assert_eq!(da.verbs().qp_count(), 2);
    assert_eq!(da.verbs().region_count(), 2);
    let (c2, _) = da.prepare(qps[2].0).unwrap();
    assert_eq!(c2, c0, "the slot is reused");
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
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let (qa, _) = na.connect_qp(&mut nb).unwrap();
    let mut da = RdmaDriver::new(na, small_cfg()).unwrap();
    let (_, local) = da.prepare(qa).unwrap();
    assert_eq!(da.verbs().posted_recvs(qa), 8);
    assert_eq!(local.recv_depth, 8);
    assert_eq!(local.len, 4096);
}

#[test]
fn region_ranges_outside_the_region_are_typed_errors() {
    let (a, _b) = connect(small_cfg(), small_cfg(), SimConfig::default());
    let staging = a.d.verbs().mr_mem(a.ring().staging_region().lkey).unwrap();
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
    // SAFETY: nothing is in flight on this idle connection and the rejected
    // calls lend nothing.
    unsafe {
        assert_eq!(staging.slice(1, 2048), Err(outside(1, 2048)));
        assert_eq!(
            staging.slice_mut(2047, usize::MAX),
            Err(outside(2047, usize::MAX))
        );
    }
    assert!(a.d.verbs().mr_mem(0xdead).is_none());
}

//! End-to-end: two `DatagramDriver<LossyLink>` ends driven from one thread
//! with a virtual clock, exchanging starwire frames over an impaired link,
//! on one connection or many sharing the link.

use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_datagram::{
    CoreStats, DatagramDriver, DatagramLink, DatagramStats, LinkStats, LossConfig, LossyLink,
    ReliableConfig,
};
use starwire_transport::{ConnId, Driver, FrameTx, TransportError};
use starwire_wire::{Header, Opcode, HEADER_LEN};

type End = DatagramDriver<LossyLink>;

/// Deterministic 64-bit mix (splitmix64 finalizer).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The length of frame `i` of stream `stream`: mostly small, some that
/// fragment, a few up to `max`, every 997th exactly `max`.
fn frame_len(stream: u64, i: u64, max: usize) -> usize {
    let r = mix(stream ^ (i << 20));
    let span = |lo: usize, hi: usize| lo + (r >> 8) as usize % (hi - lo + 1);
    let len = match r % 100 {
        _ if i % 997 == 0 => max,
        0..=59 => span(HEADER_LEN, 256),
        60..=89 => span(257, 4000),
        90..=97 => span(4001, 16_000),
        _ => span(16_001, max),
    };
    len.min(max)
}

/// Frame `i` of stream `stream`: a starwire header naming `i`, then a body
/// derived from `(stream, i)`.
fn frame(stream: u64, i: u64, max: usize) -> Vec<u8> {
    let len = frame_len(stream, i, max);
    let mut f = vec![0u8; len];
    Header::new(Opcode::Rpc, i, (len - HEADER_LEN) as u32).emit(&mut f);
    let mut x = mix(stream.wrapping_mul(31) ^ i);
    for chunk in f[HEADER_LEN..].chunks_mut(8) {
        x = mix(x);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    f
}

struct Stream {
    id: u64,
    total: u64,
    sent: u64,
    received: u64,
}

impl Stream {
    fn new(id: u64, total: u64) -> Self {
        Self {
            id,
            total,
            sent: 0,
            received: 0,
        }
    }

    /// Queue frames until back-pressure. Returns how many were queued.
    fn push(&mut self, t: &mut impl FrameTx) -> Result<u64, TransportError> {
        let max = t.max_frame_len();
        let before = self.sent;
        while self.sent < self.total {
            let f = frame(self.id, self.sent, max);
            let Some(buf) = t.tx_reserve(f.len())? else {
                break;
            };
            buf.copy_from_slice(&f);
            t.tx_commit(f.len());
            self.sent += 1;
        }
        Ok(self.sent - before)
    }

    /// Check a delivered frame: it must be exactly the next one.
    fn check(&mut self, got: &[u8], max: usize) {
        assert!(
            self.received < self.total,
            "stream {}: extra frame delivered after all {}",
            self.id,
            self.total
        );
        let want = frame(self.id, self.received, max);
        if got != want.as_slice() {
            let rid = Header::parse(got, u32::MAX, u32::MAX).map(|h| h.request_id);
            panic!(
                "stream {}: frame {} wrong: got {} bytes (header: {rid:?}), want {} bytes",
                self.id,
                self.received,
                got.len(),
                want.len()
            );
        }
        self.received += 1;
    }

    fn done(&self) -> bool {
        self.received == self.total
    }
}

/// Two drivers with `n` connections between them over one link pair.
struct Sim {
    a: End,
    b: End,
    /// `a_ids[i]` on `a` is connected to `b_ids[i]` on `b`.
    a_ids: Vec<ConnId>,
    b_ids: Vec<ConnId>,
    now: Instant,
    steps: u64,
}

#[derive(Debug, PartialEq)]
struct Report {
    /// Sums over the connections of each side.
    a: CoreStats,
    b: CoreStats,
    a_drv: DatagramStats,
    b_drv: DatagramStats,
    a_link: LinkStats,
    b_link: LinkStats,
    virtual_time: Duration,
}

const MAX_STEPS: u64 = 3_000_000;
const TICK: Duration = Duration::from_micros(2);

fn sum(stats: impl Iterator<Item = CoreStats>) -> CoreStats {
    stats.fold(CoreStats::default(), |mut t, s| {
        t.frames_delivered += s.frames_delivered;
        t.data_packets_sent += s.data_packets_sent;
        t.retransmits += s.retransmits;
        t.fast_retransmits += s.fast_retransmits;
        t.acks_sent += s.acks_sent;
        t.duplicates += s.duplicates;
        t.out_of_order += s.out_of_order;
        t.timeouts += s.timeouts;
        t.dropped_foreign += s.dropped_foreign;
        t
    })
}

impl Sim {
    fn new(loss: LossConfig, cfg: ReliableConfig, seed: u64, n: usize) -> Self {
        let (la, lb) = LossyLink::pair(loss, seed);
        let mut a = DatagramDriver::new(la, cfg.clone()).unwrap();
        let mut b = DatagramDriver::new(lb, cfg).unwrap();
        let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let (ca, ia) = a.prepare().unwrap();
            let (cb, ib) = b.prepare().unwrap();
            a.connect(ca, ib).unwrap();
            b.connect(cb, ia).unwrap();
            a_ids.push(ca);
            b_ids.push(cb);
        }
        Self {
            a,
            b,
            a_ids,
            b_ids,
            now: Instant::now(),
            steps: 0,
        }
    }

    fn failure(&mut self) -> Result<(), TransportError> {
        match self.a.poll_failure().or_else(|| self.b.poll_failure()) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// One round: push, flush, receive on both ends; then advance the clock
    /// a tick, or to the earliest deadline when nothing is moving.
    /// `sa[i]` flows over connection i from a to b, `sb[i]` back.
    fn step(&mut self, sa: &mut [Stream], sb: &mut [Stream]) -> Result<(), TransportError> {
        self.steps += 1;
        assert!(
            self.steps < MAX_STEPS,
            "no completion after {MAX_STEPS} steps"
        );
        let now = self.now;
        let max = self.a.max_frame_len();
        let mut moved = 0;
        for (i, (s, t)) in sa.iter_mut().zip(sb.iter_mut()).enumerate() {
            moved += s.push(&mut self.a.tx(self.a_ids[i]))?;
            moved += t.push(&mut self.b.tx(self.b_ids[i]))?;
        }
        self.a.flush(now);
        self.b.flush(now);
        let (a_ids, b_ids) = (&self.a_ids, &self.b_ids);
        moved += self.b.rx_burst(now, 64, &mut |c, f| {
            let i = b_ids
                .iter()
                .position(|&x| x == c)
                .expect("a connection of b");
            sa[i].check(f, max);
        }) as u64;
        moved += self.a.rx_burst(now, 64, &mut |c, f| {
            let i = a_ids
                .iter()
                .position(|&x| x == c)
                .expect("a connection of a");
            sb[i].check(f, max);
        }) as u64;
        self.failure()?;
        let busy = self.a.link().rx_queued() + self.b.link().rx_queued();
        if moved == 0 && busy == 0 {
            let next = [
                self.a.poll_timeout(),
                self.b.poll_timeout(),
                self.a.link().rx_next_release(),
                self.b.link().rx_next_release(),
            ]
            .into_iter()
            .flatten()
            .min();
            if let Some(t) = next {
                self.now = self.now.max(t);
            }
        }
        self.now += TICK;
        Ok(())
    }

    fn pending(&self) -> bool {
        self.a_ids.iter().any(|&c| self.a.tx_pending(c))
            || self.b_ids.iter().any(|&c| self.b.tx_pending(c))
    }

    fn report(&self, t0: Instant) -> Report {
        let core = |d: &End, ids: &[ConnId]| sum(ids.iter().map(|&c| *d.core(c).unwrap().stats()));
        Report {
            a: core(&self.a, &self.a_ids),
            b: core(&self.b, &self.b_ids),
            a_drv: self.a.stats(),
            b_drv: self.b.stats(),
            a_link: self.a.link().tx_stats(),
            b_link: self.b.link().tx_stats(),
            virtual_time: self.now - t0,
        }
    }
}

/// `n_ab` frames from a to b and `n_ba` from b to a on each of `conns`
/// connections, concurrently; returns once every stream is delivered and
/// acknowledged.
fn transfer(
    loss: LossConfig,
    cfg: ReliableConfig,
    seed: u64,
    conns: usize,
    n_ab: u64,
    n_ba: u64,
) -> Report {
    let mut sim = Sim::new(loss, cfg, seed, conns);
    let t0 = sim.now;
    let id = |i: usize, dir: u64| seed * 1000 + i as u64 * 2 + dir;
    let mut sa: Vec<Stream> = (0..conns).map(|i| Stream::new(id(i, 1), n_ab)).collect();
    let mut sb: Vec<Stream> = (0..conns).map(|i| Stream::new(id(i, 2), n_ba)).collect();
    loop {
        sim.step(&mut sa, &mut sb).unwrap_or_else(|e| {
            let got: u64 = sa.iter().chain(&sb).map(|s| s.received).sum();
            panic!("seed {seed}: transport failed after {got} frames: {e}")
        });
        let done = sa.iter().chain(&sb).all(Stream::done);
        if done && !sim.pending() {
            break;
        }
    }
    assert!(sa.iter().all(|s| s.sent == n_ab) && sb.iter().all(|s| s.sent == n_ba));
    // Let everything still in flight (duplicates, held packets, last acks)
    // arrive: nothing more may be delivered.
    let late = sim.now + Duration::from_secs(1);
    let max = sim.a.max_frame_len();
    for _ in 0..1000 {
        let (a_ids, b_ids) = (&sim.a_ids, &sim.b_ids);
        sim.b.rx_burst(late, 64, &mut |c, f| {
            let i = b_ids.iter().position(|&x| x == c).unwrap();
            sa[i].check(f, max);
        });
        sim.a.rx_burst(late, 64, &mut |c, f| {
            let i = a_ids.iter().position(|&x| x == c).unwrap();
            sb[i].check(f, max);
        });
        if sim.a.link().rx_in_flight() + sim.b.link().rx_in_flight() == 0 {
            break;
        }
    }
    assert_eq!(sim.a.link().rx_in_flight() + sim.b.link().rx_in_flight(), 0);
    sim.failure().expect("no connection failed");
    let r = sim.report(t0);
    assert_eq!(r.b.frames_delivered, n_ab * conns as u64);
    assert_eq!(r.a.frames_delivered, n_ba * conns as u64);
    // One link burst per flush at most, and none without packets.
    assert!(r.a_link.bursts <= r.a_drv.flushes, "{r:?}");
    assert_eq!(r.a_link.bursts, r.a_drv.tx_bursts);
    assert_eq!(r.a_link.sent, r.a_drv.packets_sent);
    // Every packet reached its connection: none was misrouted.
    assert_eq!(
        r.a_drv.dropped_unknown_conn + r.b_drv.dropped_unknown_conn,
        0
    );
    assert_eq!(r.a.dropped_foreign + r.b.dropped_foreign, 0);
    r
}

fn impaired(loss: f64) -> LossConfig {
    LossConfig {
        loss,
        duplicate: 0.02,
        reorder: 0.05,
        reorder_depth: 8,
        ..LossConfig::lossless(1500)
    }
}

#[test]
fn five_percent_loss_with_duplication_and_reordering() {
    for seed in [1, 2, 3] {
        let r = transfer(
            impaired(0.05),
            ReliableConfig::default(),
            seed,
            1,
            20_000,
            2_000,
        );
        // The impairments really happened, and the protocol repaired them.
        assert!(r.a_link.lost > 1000, "seed {seed}: {r:?}");
        assert!(
            r.a_link.duplicated > 100 && r.a_link.reordered > 100,
            "{r:?}"
        );
        assert!(r.a.retransmits > 0 && r.a.fast_retransmits > 0, "{r:?}");
        assert!(r.b.duplicates > 0 && r.b.out_of_order > 0, "{r:?}");
        // Repairs are targeted: selective acks keep retransmissions close to
        // the number of packets actually lost.
        assert!(r.a.retransmits < 2 * r.a_link.lost, "{r:?}");
        assert!(
            r.b.duplicates < r.a_link.duplicated + r.a.retransmits,
            "{r:?}"
        );
    }
}

#[test]
fn sixty_four_connections_share_one_lossy_link() {
    let loss = LossConfig {
        queue_capacity: 1 << 16,
        tx_ring: 512,
        ..impaired(0.05)
    };
    let r = transfer(loss, ReliableConfig::default(), 64, 64, 300, 100);
    assert!(r.a_link.lost > 1000, "{r:?}");
    assert!(r.a.retransmits > 0 && r.b.out_of_order > 0, "{r:?}");
    // The bursts were shared: many packets, of many connections, per burst.
    assert!(r.a_link.sent > 8 * r.a_link.bursts, "{r:?}");
}

#[test]
fn runs_are_deterministic_per_seed() {
    let run = |seed| transfer(impaired(0.05), ReliableConfig::default(), seed, 4, 300, 100);
    let first = run(9);
    assert_eq!(run(9), first);
    assert_ne!(run(10), first);
}

#[test]
fn lossless_sanity() {
    let r = transfer(
        LossConfig::lossless(1500),
        ReliableConfig::default(),
        5,
        1,
        5_000,
        5_000,
    );
    assert_eq!(r.a.retransmits + r.b.retransmits, 0, "{r:?}");
    assert_eq!(r.a.timeouts + r.b.timeouts, 0);
    assert_eq!(r.a.duplicates + r.b.duplicates + r.a.out_of_order, 0);
    assert!(r.a.acks_sent + r.b.acks_sent > 0);
    // Acknowledgements ride on data: fewer standalone acks than data packets.
    assert!(r.a.acks_sent < r.b.data_packets_sent, "{r:?}");
}

#[test]
fn thirty_percent_loss_still_completes() {
    // Seed 20 failed (ten timeouts in a row) when a timeout resent one
    // packet and a burst of duplicates got one acknowledgement.
    for seed in 11..21 {
        let r = transfer(
            impaired(0.30),
            ReliableConfig::default(),
            seed,
            1,
            2_000,
            500,
        );
        assert!(r.a_link.lost > 1000, "{r:?}");
        assert!(r.a.retransmits > r.a_link.lost / 2, "{r:?}");
    }
}

#[test]
fn corrupted_packets_are_never_delivered() {
    let loss = LossConfig {
        corrupt: 0.10,
        ..impaired(0.01)
    };
    let r = transfer(loss, ReliableConfig::default(), 21, 2, 1_500, 500);
    assert!(r.a_link.corrupted > 100, "{r:?}");
    // Every corrupted copy reached the peer and was dropped by its driver
    // before routing (and every delivered frame was checked byte for byte
    // by the streams).
    assert_eq!(
        r.b_drv.dropped_corrupt + r.b_drv.dropped_malformed,
        r.a_link.corrupted
    );
    assert_eq!(
        r.a_drv.dropped_corrupt + r.a_drv.dropped_malformed,
        r.b_link.corrupted
    );
}

#[test]
fn dead_peer_fails_after_the_retry_budget() {
    let cfg = ReliableConfig {
        dead_after_timeouts: 6,
        ..ReliableConfig::default()
    };
    let loss = LossConfig {
        loss: 1.0,
        ..LossConfig::lossless(1500)
    };
    let mut sim = Sim::new(loss, cfg.clone(), 3, 1);
    let mut sa = [Stream::new(1, 10)];
    let mut sb = [Stream::new(2, 0)];
    let err = loop {
        if let Err(e) = sim.step(&mut sa, &mut sb) {
            break e;
        }
    };
    assert!(
        matches!(&err, TransportError::Link(m) if m.starts_with("peer unreachable")),
        "{err}"
    );
    let ca = sim.a_ids[0];
    let st = *sim.a.core(ca).unwrap().stats();
    assert_eq!(st.timeouts, u64::from(cfg.dead_after_timeouts));
    assert!(st.retransmits > 0);
    assert_eq!(sa[0].sent, 10);
    assert_eq!(sa[0].received, 0);
    // The failure sticks, and is reported once.
    sim.a.flush(sim.now);
    assert!(sim.a.poll_failure().is_none());
    assert!(matches!(
        sim.a.tx_reserve(ca, 40),
        Err(TransportError::Link(m)) if m.starts_with("peer unreachable")
    ));
    assert!(!sim.a.tx_pending(ca));
    assert_eq!(
        sim.a.poll_timeout(),
        None,
        "no timer for a failed connection"
    );
}

#[test]
fn peer_that_stops_mid_stream_is_declared_dead() {
    let mut sim = Sim::new(LossConfig::lossless(1500), ReliableConfig::default(), 4, 1);
    let mut sa = [Stream::new(1, 100_000)];
    let mut sb = [Stream::new(2, 0)];
    while sa[0].received < 500 {
        sim.step(&mut sa, &mut sb).unwrap();
    }
    // b's process is gone: only a is driven from now on.
    let mut now = sim.now;
    let mut failure = None;
    for _ in 0..10_000 {
        sim.a.flush(now);
        sim.a.rx_burst(now, 64, &mut |_, _| {});
        failure = sim.a.poll_failure();
        if failure.is_some() {
            break;
        }
        now = sim
            .a
            .poll_timeout()
            .expect("a timer while data is unacknowledged")
            .max(now);
    }
    let (_, err) = failure.expect("a fails");
    assert!(err.to_string().contains("peer unreachable"), "{err}");
    assert_eq!(
        sim.a.core(sim.a_ids[0]).unwrap().stats().timeouts,
        u64::from(ReliableConfig::default().dead_after_timeouts)
    );
}

#[test]
fn window_back_pressure_through_the_driver() {
    let cfg = ReliableConfig {
        window: 16,
        max_frame_len: 2048,
        ..ReliableConfig::default()
    };
    let mtu = 256;
    let loss = LossConfig::lossless(mtu);
    let mut sim = Sim::new(loss, cfg, 1, 1);
    let (ca, cb) = (sim.a_ids[0], sim.b_ids[0]);
    let (a, b) = (&mut sim.a, &mut sim.b);
    let t0 = Instant::now();
    let payload = mtu - starwire_datagram::PACKET_HEADER_LEN;
    let mut queued = 0u8;
    while let Some(buf) = a.tx_reserve(ca, payload).unwrap() {
        buf.fill(queued);
        a.tx_commit(ca, payload);
        queued += 1;
        assert!(queued <= 16, "the window must push back");
    }
    assert_eq!(queued, 16);
    assert!(a.tx_reserve(ca, 2048).unwrap().is_none());
    a.flush(t0);
    assert!(
        a.tx_reserve(ca, 1).unwrap().is_none(),
        "sent is not acknowledged"
    );
    assert!(a.tx_pending(ca));
    let mut got = Vec::new();
    b.rx_burst(t0, 100, &mut |_, f| got.push(f[0]));
    assert_eq!(got, (0..16).collect::<Vec<u8>>());
    // b acknowledges (every ack_every packets) in its flush.
    b.flush(t0);
    a.rx_burst(t0, 100, &mut |_, _| panic!("nothing to deliver"));
    assert!(!a.tx_pending(ca), "{:?}", a.core(ca));
    assert!(a.tx_reserve(ca, 2048).unwrap().is_some());
    // The default gather path goes through the same reservation.
    let head = Header::new(Opcode::Rpc, 7, 3).to_bytes();
    assert!(a
        .tx_gather(ca, &head, &[Bytes::from_static(b"abc")])
        .unwrap());
    a.flush(t0);
    let mut got = Vec::new();
    b.rx_burst(t0, 100, &mut |c, f| {
        assert_eq!(c, cb);
        got.push(f.to_vec());
    });
    assert_eq!(got, vec![[&head[..], b"abc"].concat()]);
}

#[test]
fn oversized_frames_are_refused_not_fragmented_into_oblivion() {
    let sim = Sim::new(LossConfig::lossless(1500), ReliableConfig::default(), 1, 1);
    let (mut a, ca) = (sim.a, sim.a_ids[0]);
    let max = a.max_frame_len();
    assert!(matches!(
        a.tx_reserve(ca, max + 1),
        Err(TransportError::FrameTooLarge { .. })
    ));
    assert!(a.poll_failure().is_none(), "refusing a frame fails nothing");
    assert!(a.tx_reserve(ca, max).unwrap().is_some());
    assert_eq!(a.link().mtu(), 1500);
}

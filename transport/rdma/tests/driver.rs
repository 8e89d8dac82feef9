//! One `RdmaDriver` per side serving many connections over one simulated
//! completion queue: raw frames per connection, the message layer
//! (`Sessions`) on 64 connections, and failures confined to their
//! connection. Everything is deterministic: seeded sizes, a virtual clock.

use std::collections::HashMap;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_rdma::{
    Access, Completion, DoorbellError, Errno, LocalSlice, MemoryRegion, QpCaps, QpState,
    RdmaDriver, RegisteredMem, RemoteSlice, RingConfig, RingError, SimConfig, SimNic, Verbs,
    VerbsError, WcStatus, MIN_RECV_DEPTH,
};
use starwire_transport::conformance::{DriverPair, Pair};
use starwire_transport::{ConnId, Connection, Driver, Incoming, Payload, TaskRole, TransportError};
use starwire_wire::{Opcode, Status};

type Rdma = RdmaDriver<SimNic>;

/// Rings small enough for many connections per test.
fn cfg() -> RingConfig {
    RingConfig {
        ring_len: 16 * 1024,
        staging_len: 8 * 1024,
        recv_depth: 16,
        max_frame_len: None,
    }
}

/// Two drivers with `n` connections between them: `a_ids[i]` on `a` is
/// connected to `b_ids[i]` on `b`. The shape of the conformance suite's
/// `DriverPair`.
fn pair(n: usize, ring: RingConfig) -> (Rdma, Vec<ConnId>, Rdma, Vec<ConnId>) {
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let qps: Vec<(u32, u32)> = (0..n)
        .map(|_| na.connect_qp(&mut nb).expect("queue pair"))
        .collect();
    let mut a = RdmaDriver::new(na, ring).expect("driver a");
    let mut b = RdmaDriver::new(nb, ring).expect("driver b");
    let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
    for (qa, qb) in qps {
        let (ca, ra) = a.prepare(qa).expect("prepare a");
        let (cb, rb) = b.prepare(qb).expect("prepare b");
        a.connect(ca, rb).expect("connect a");
        b.connect(cb, ra).expect("connect b");
        a_ids.push(ca);
        b_ids.push(cb);
    }
    (a, a_ids, b, b_ids)
}

/// The shared conformance suite on 64 connections of one driver per side.
#[test]
fn conformance_over_sixty_four_connections() {
    starwire_transport::conformance::run_all_drivers("rdma-sim", 64, |n| {
        let (a, a_ids, b, b_ids) = pair(n, cfg());
        DriverPair { a, a_ids, b, b_ids }
    });
}

/// Frame `seq` of connection `conn`: its first 12 bytes name both.
fn frame(conn: usize, seq: u32, len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len.max(12)];
    f[..8].copy_from_slice(&(conn as u64).to_le_bytes());
    f[8..12].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in f[12..].iter_mut().enumerate() {
        *b = (conn as u8) ^ (seq as u8).wrapping_mul(7) ^ i as u8;
    }
    f
}

#[test]
fn one_flush_over_many_connections_rings_one_doorbell() {
    let n = 64;
    let (mut a, a_ids, mut b, b_ids) = pair(n, cfg());
    let now = Instant::now();
    for (i, &c) in a_ids.iter().enumerate() {
        for seq in 0..3 {
            let f = frame(i, seq, 100 + i);
            let buf = a.tx_reserve(c, f.len()).unwrap().expect("room");
            buf.copy_from_slice(&f);
            a.tx_commit(c, f.len());
        }
    }
    assert!(a_ids.iter().all(|&c| a.tx_pending(c)));
    let before = a.stats();
    assert!(a.flush(now));
    let after = a.stats();
    assert_eq!(after.doorbells - before.doorbells, 1);
    assert_eq!(a.verbs().doorbells(), 1);
    // The metrics read the same count through the driver contract.
    assert_eq!(Driver::counters(&a).doorbells, Some(after.doorbells));
    let writes: u64 = a_ids
        .iter()
        .map(|&c| a.ring(c).unwrap().stats().data_writes)
        .sum();
    assert_eq!(writes, 3 * n as u64);
    assert!(a_ids.iter().all(|&c| !a.tx_pending(c)));

    // One receive pass polls the shared CQ in batches (not once per
    // connection) and lends every connection's frames, tagged and in
    // order, at most `max` per connection.
    let index: HashMap<ConnId, usize> = b_ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    let mut next = vec![0u32; n];
    let polls = b.stats().cq_polls;
    let got = b.rx_burst(now, 2, &mut |c, f| {
        let i = index[&c];
        assert_eq!(f, frame(i, next[i], 100 + i).as_slice());
        next[i] += 1;
    });
    assert_eq!(got, 2 * n);
    assert!(next.iter().all(|&k| k == 2));
    let per_pass = b.stats().cq_polls - polls;
    assert!(per_pass <= (3 * n as u64) / 32 + 1, "{per_pass} polls");
    assert_eq!(b.stats().completions, 3 * n as u64);
    let got = b.rx_burst(now, 2, &mut |c, f| {
        let i = index[&c];
        assert_eq!(f, frame(i, next[i], 100 + i).as_slice());
        next[i] += 1;
    });
    assert_eq!(got, n);
    // The credits go back behind one doorbell too.
    let bells = b.verbs().doorbells();
    assert!(b.flush(now));
    assert_eq!(b.verbs().doorbells(), bells + 1);
    assert!(b.poll_failure().is_none() && a.poll_failure().is_none());

    // The totals add every ring up, and keep what detached ones counted.
    let totals = b.ring_totals();
    assert_eq!(totals.frames_received, 3 * n as u64);
    assert_eq!(totals.credit_writes, n as u64);
    for &c in &b_ids[..n / 2] {
        b.detach(c);
    }
    assert_eq!(b.ring_totals(), totals);
    assert_eq!(a.ring_totals().data_writes, 3 * n as u64);
}

#[test]
fn frames_stay_in_order_per_connection_under_random_traffic() {
    let n = 64;
    let mut ring = cfg();
    ring.recv_depth = MIN_RECV_DEPTH;
    let (mut a, a_ids, mut b, b_ids) = pair(n, ring);
    let mut rng = SmallRng::seed_from_u64(0x64);
    let max = a.max_frame_len();
    let total = 150u32;
    let lens: Vec<Vec<usize>> = (0..n)
        .map(|_| (0..total).map(|_| rng.gen_range(12..=max)).collect())
        .collect();
    let index: HashMap<ConnId, usize> = b_ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
    let mut sent = vec![0u32; n];
    let mut got = vec![0u32; n];
    let now = Instant::now();
    for _ in 0..100_000 {
        if got.iter().all(|&g| g == total) {
            break;
        }
        for (i, &c) in a_ids.iter().enumerate() {
            for _ in 0..rng.gen_range(0..3) {
                if sent[i] == total {
                    break;
                }
                let f = frame(i, sent[i], lens[i][sent[i] as usize]);
                let Some(buf) = a.tx_reserve(c, f.len()).unwrap() else {
                    break;
                };
                buf.copy_from_slice(&f);
                a.tx_commit(c, f.len());
                sent[i] += 1;
            }
        }
        let bells = a.stats().doorbells;
        a.flush(now);
        assert!(a.stats().doorbells <= bells + 1);
        b.rx_burst(now, rng.gen_range(1..4), &mut |c, f| {
            let i = index[&c];
            let want = frame(i, got[i], lens[i][got[i] as usize]);
            assert!(f == want.as_slice(), "conn {i} frame {}", got[i]);
            got[i] += 1;
        });
        b.flush(now);
        a.rx_burst(now, 4, &mut |_, _| panic!("no traffic b -> a"));
    }
    assert!(got.iter().all(|&g| g == total), "{got:?}");
    assert!(a.poll_failure().is_none() && b.poll_failure().is_none());
    let stalls: u64 = a_ids
        .iter()
        .map(|&c| a.ring(c).unwrap().stats().recv_stalls)
        .sum();
    assert!(stalls > 0, "credits limited the senders");
    let c = Driver::counters(&a);
    assert_eq!(c.receive_stalls, Some(stalls));
    assert_eq!(c.credit_stalls, Some(a.ring_totals().ring_stalls));
    assert_eq!(c.syscalls, None);
    let writes: u64 = a_ids
        .iter()
        .map(|&c| a.ring(c).unwrap().stats().data_writes)
        .sum();
    assert_eq!(writes, u64::from(total) * n as u64);
    let bells = a.stats().doorbells;
    assert!(
        writes > 16 * bells,
        "{writes} writes behind {bells} doorbells"
    );
}

/// Both sides' message layers over one driver each, on a virtual clock:
/// the conformance suite's [`Pair`]. Connection `i` is worker `i` on `a`
/// and PS `i` on `b`.
type Net = Pair<Rdma, Rdma>;

fn net(n: usize) -> Net {
    let (a, a_ids, b, b_ids) = pair(n, cfg());
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
fn sixty_four_sessions_handshake_and_echo_over_one_driver_each() {
    let n = 64;
    let mut net = net(n);
    net.establish();
    // Each handshake reached its own peer: frames were routed to the
    // connection their queue pair belongs to.
    for (i, (&ca, &cb)) in net.a_ids.iter().zip(&net.b_ids).enumerate() {
        let pa = net.a.conn_ref(ca).and_then(Connection::peer).unwrap();
        let pb = net.b.conn_ref(cb).and_then(Connection::peer).unwrap();
        assert_eq!((pa.role, pa.task_index), (TaskRole::Ps, i as u32));
        assert_eq!((pb.role, pb.task_index), (TaskRole::Worker, i as u32));
    }

    let mut rng = SmallRng::seed_from_u64(5);
    let mut expect: HashMap<(usize, u64), Vec<u8>> = HashMap::new();
    for (i, &c) in net.a_ids.iter().enumerate() {
        for _ in 0..20 {
            // Some bodies exceed the largest frame and are chunked.
            let len = rng.gen_range(0..12_000);
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
    assert_eq!(answered, 20 * n);
    let st = net.a.driver().stats();
    assert!(st.doorbells <= st.flushes, "{st:?}");
}

#[test]
fn a_failed_connection_is_reported_alone_and_the_others_carry_on() {
    let n = 8;
    let (mut a, a_ids, mut b, b_ids) = pair(n, cfg());
    let now = Instant::now();
    // b drops connection 3: its queue pair is destroyed.
    b.detach(b_ids[3]);
    assert!(b.ring(b_ids[3]).is_none());
    for (i, &c) in a_ids.iter().enumerate() {
        let f = frame(i, 0, 64);
        a.tx_reserve(c, f.len())
            .unwrap()
            .unwrap()
            .copy_from_slice(&f);
        a.tx_commit(c, f.len());
    }
    a.flush(now);
    a.flush(now);
    let (c, e) = a.poll_failure().expect("connection 3 fails");
    assert_eq!(c, a_ids[3]);
    assert!(
        matches!(&e, TransportError::Link(m) if m.contains(WcStatus::RetryExceeded.verbs_name())),
        "{e}"
    );
    assert!(a.poll_failure().is_none(), "reported once, alone");
    assert!(matches!(
        a.tx_reserve(a_ids[3], 8),
        Err(TransportError::Link(_))
    ));
    let mut seen = Vec::new();
    b.rx_burst(now, 8, &mut |c, _| seen.push(c));
    seen.sort_unstable();
    let mut want: Vec<ConnId> = b_ids.clone();
    want.remove(3);
    assert_eq!(seen, want);
    // Detaching the failed connection releases its queue pair and regions.
    let (qps, regions) = (a.verbs().qp_count(), a.verbs().region_count());
    a.detach(a_ids[3]);
    assert_eq!(a.verbs().qp_count(), qps - 1);
    assert_eq!(a.verbs().region_count(), regions - 2);
    assert!(matches!(
        a.tx_reserve(a_ids[3], 8),
        Err(TransportError::Closed)
    ));
}

#[test]
fn frames_that_arrive_before_connect_wait_for_it() {
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let mut a = RdmaDriver::new(na, cfg()).unwrap();
    let mut b = RdmaDriver::new(nb, cfg()).unwrap();
    let (ca, ra) = a.prepare(qa).unwrap();
    let (cb, rb) = b.prepare(qb).unwrap();
    a.connect(ca, rb).unwrap();
    let now = Instant::now();
    for seq in 0..5 {
        let f = frame(0, seq, 200);
        a.tx_reserve(ca, f.len())
            .unwrap()
            .unwrap()
            .copy_from_slice(&f);
        a.tx_commit(ca, f.len());
    }
    a.flush(now);
    // b is prepared, not connected: it holds the completions and lends
    // nothing; its own frames wait too.
    assert_eq!(b.rx_burst(now, 16, &mut |_, _| panic!("not connected")), 0);
    assert!(matches!(b.tx_reserve(cb, 8), Ok(None)));
    b.connect(cb, ra).unwrap();
    let mut seq = 0;
    b.rx_burst(now, 16, &mut |c, f| {
        assert_eq!(c, cb);
        assert_eq!(f, frame(0, seq, 200).as_slice());
        seq += 1;
    });
    assert_eq!(seq, 5);
    assert!(b.poll_failure().is_none());
}

#[test]
fn completions_of_a_queue_pair_the_driver_does_not_own_are_ignored() {
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let (stray_a, stray_b) = na.connect_qp(&mut nb).unwrap();
    let mut a = RdmaDriver::new(na, cfg()).unwrap();
    let mut b = RdmaDriver::new(nb, cfg()).unwrap();
    let (ca, ra) = a.prepare(qa).unwrap();
    let (cb, rb) = b.prepare(qb).unwrap();
    a.connect(ca, rb).unwrap();
    b.connect(cb, ra).unwrap();
    // A receive WR on a queue pair of a's NIC that no connection owns,
    // with a wr_id that names connection slot 0; b's NIC writes to it.
    a.verbs_mut().post_recv(stray_a, 1 << 63).unwrap();
    let src = b.verbs_mut().reg_mr(8, Access::RemoteWrite).unwrap();
    let dst = a.ring(ca).unwrap().ring_region();
    b.verbs_mut()
        .post_write_with_imm(
            stray_b,
            0,
            LocalSlice {
                lkey: src.lkey,
                offset: 0,
                len: 0,
            },
            RemoteSlice {
                rkey: dst.rkey,
                addr: dst.addr,
            },
            0,
        )
        .unwrap();
    b.verbs_mut().ring_doorbell().unwrap();
    let now = Instant::now();
    assert_eq!(a.rx_burst(now, 8, &mut |_, _| panic!("no frame")), 0);
    assert_eq!(a.stats().stray_completions, 1);
    assert!(a.poll_failure().is_none(), "connection 0 is unaffected");
    assert_eq!(a.ring(ca).unwrap().stats().frames_received, 0);
}

#[test]
fn an_overrun_completion_queue_fails_every_connection_once() {
    // Two connections take 2 * (16 + 16) entries of a 64-entry queue;
    // queue pairs outside the driver flood it with 96 completions.
    let (mut na, mut nb) = SimNic::pair(SimConfig {
        max_send_wr: 16,
        max_recv_wr: 64,
        cq_depth: 64,
        ..SimConfig::default()
    });
    let qps: Vec<(u32, u32)> = (0..2).map(|_| na.connect_qp(&mut nb).unwrap()).collect();
    let floods: Vec<(u32, u32)> = (0..3).map(|_| na.connect_qp(&mut nb).unwrap()).collect();
    let (src_a, dst_a) = (
        na.reg_mr(8, Access::RemoteWrite).unwrap(),
        na.reg_mr(8, Access::RemoteWrite).unwrap(),
    );
    let (src_b, dst_b) = (
        nb.reg_mr(8, Access::RemoteWrite).unwrap(),
        nb.reg_mr(8, Access::RemoteWrite).unwrap(),
    );
    let write = |nic: &mut SimNic, qpn, wr_id, src: &MemoryRegion, dst: &MemoryRegion| {
        let local = LocalSlice {
            lkey: src.lkey,
            offset: 0,
            len: 0,
        };
        let remote = RemoteSlice {
            rkey: dst.rkey,
            addr: dst.addr,
        };
        nic.post_write_with_imm(qpn, wr_id, local, remote, 0)
            .unwrap();
    };
    for &(fa, fb) in &floods {
        for i in 0..16 {
            na.post_recv(fa, i).unwrap();
            nb.post_recv(fb, i).unwrap();
            write(&mut na, fa, i, &src_a, &dst_b);
            write(&mut nb, fb, i, &src_b, &dst_a);
        }
    }
    na.ring_doorbell().unwrap();
    nb.ring_doorbell().unwrap();
    let mut a = RdmaDriver::new(na, cfg()).unwrap();
    let ids: Vec<ConnId> = qps.iter().map(|q| a.prepare(q.0).unwrap().0).collect();
    let now = Instant::now();
    a.rx_burst(now, 8, &mut |_, _| {});
    let mut failed: Vec<ConnId> = std::iter::from_fn(|| a.poll_failure().map(|(c, _)| c)).collect();
    failed.sort_unstable();
    assert_eq!(failed, ids, "both prepared connections fail");
    a.flush(now);
    a.rx_burst(now, 8, &mut |_, _| {});
    assert!(a.poll_failure().is_none(), "once each");
    assert!(
        matches!(a.tx_reserve(ids[0], 8), Err(TransportError::Link(m)) if m.contains("EOVERFLOW"))
    );
}

#[test]
fn a_reserved_connection_holds_a_slot_and_nothing_else() {
    // Room in the completion queue for one connection (16 send + 16
    // receive entries) and no more.
    let (mut na, mut nb) = SimNic::pair(SimConfig {
        max_send_wr: 16,
        max_recv_wr: 64,
        cq_depth: 32,
        ..SimConfig::default()
    });
    let (qa, qb) = na.connect_qp(&mut nb).unwrap();
    let mut a = RdmaDriver::new(na, cfg()).unwrap();
    let mut b = RdmaDriver::new(nb, cfg()).unwrap();
    let regions = a.verbs().region_count();
    // Many reservations take no registered memory and no CQ room.
    let reserved: Vec<ConnId> = (0..100).map(|_| a.reserve().expect("reserve")).collect();
    assert_eq!(a.len(), 100);
    assert_eq!(a.verbs().region_count(), regions, "nothing registered");
    assert_eq!(a.verbs().qp_count(), 1, "no queue pair made");
    let now = Instant::now();
    let (cb, rb) = b.prepare(qb).unwrap();
    // Like a prepared connection that is not connected: frames wait, the
    // ring is not there, it cannot be connected yet, no failure.
    assert!(matches!(a.tx_reserve(reserved[0], 8), Ok(None)));
    assert!(!a.tx_pending(reserved[0]));
    assert!(a.ring(reserved[0]).is_none());
    assert!(matches!(
        a.connect(reserved[0], rb),
        Err(RingError::NotPrepared(_))
    ));
    a.flush(now);
    assert_eq!(a.rx_burst(now, 16, &mut |_, _| panic!("nothing")), 0);
    assert!(a.poll_failure().is_none());
    assert_eq!(a.counters().doorbells, Some(0));
    // Detaching frees them; a reservation is no prepared connection.
    for &c in &reserved[1..] {
        a.detach(c);
    }
    assert_eq!(a.len(), 1);
    assert!(matches!(
        a.prepare_reserved(reserved[1], qa),
        Err(RingError::NotReserved(_))
    ));
    // The one left is prepared on a queue pair, in its own slot, and
    // takes the completion queue's room: a second prepare finds none.
    let ra = a
        .prepare_reserved(reserved[0], qa)
        .expect("prepare reserved");
    assert_eq!(a.len(), 1);
    assert!(a.verbs().region_count() > regions);
    assert!(matches!(
        a.prepare_reserved(reserved[0], qa),
        Err(RingError::NotReserved(_))
    ));
    a.connect(reserved[0], rb).unwrap();
    b.connect(cb, ra).unwrap();
    let f = frame(0, 0, 100);
    a.tx_reserve(reserved[0], f.len())
        .unwrap()
        .unwrap()
        .copy_from_slice(&f);
    a.tx_commit(reserved[0], f.len());
    a.flush(now);
    let mut got = 0;
    b.rx_burst(now, 16, &mut |c, g| {
        assert_eq!((c, g), (cb, f.as_slice()));
        got += 1;
    });
    assert_eq!(got, 1);
    // Detached, it gives everything back.
    a.detach(reserved[0]);
    assert!(a.is_empty());
    assert_eq!(a.verbs().region_count(), regions);
    assert_eq!(a.verbs().qp_count(), 0);
}

#[test]
fn a_reservation_that_cannot_be_prepared_stays_reserved() {
    let (mut na, mut nb) = SimNic::pair(SimConfig {
        max_send_wr: 16,
        max_recv_wr: 64,
        cq_depth: 32,
        ..SimConfig::default()
    });
    let (q1, _) = na.connect_qp(&mut nb).unwrap();
    let (q2, _) = na.connect_qp(&mut nb).unwrap();
    let mut a = RdmaDriver::new(na, cfg()).unwrap();
    let regions = a.verbs().region_count();
    let first = a.reserve().unwrap();
    let second = a.reserve().unwrap();
    assert_ne!(first, second);
    a.prepare_reserved(first, q1).unwrap();
    // The completion queue holds one connection only.
    let err = a.prepare_reserved(second, q2).unwrap_err();
    assert!(
        matches!(&err, RingError::Config(m) if m.contains("CQ depth 32")),
        "{err}"
    );
    assert!(
        matches!(a.tx_reserve(second, 8), Ok(None)),
        "still reserved"
    );
    assert!(matches!(
        a.prepare_reserved(second, 0x7777),
        Err(RingError::UnknownQp(0x7777))
    ));
    // Freeing the prepared one makes room for it.
    a.detach(first);
    assert_eq!(a.verbs().region_count(), regions);
    a.prepare_reserved(second, q2).expect("room again");
    a.detach(second);
    assert!(a.is_empty());
    assert_eq!(a.verbs().region_count(), regions);
}

/// `SimNic`, except that the doorbell refuses the chains of the queue
/// pairs in `refuse`, as `ibv_post_send` does (`ENOMEM`): their WRs are
/// dropped, never to complete, and each refused chain is reported.
struct Refusing {
    nic: SimNic,
    refuse: Vec<u32>,
    /// The first WR staged on each refused queue pair since the last
    /// doorbell.
    dropped: Vec<(u32, u64)>,
}

// SAFETY: every method delegates to `SimNic`, whose `unsafe impl Verbs`
// keeps the contract; WRs of refused queue pairs are never handed to it,
// so no device reads their local slices (item 4 holds trivially), and
// nothing else touches registered memory.
#[allow(unsafe_code)]
unsafe impl Verbs for Refusing {
    fn cq_depth(&self) -> u32 {
        self.nic.cq_depth()
    }
    fn qp_caps(&self, qpn: u32) -> Option<QpCaps> {
        self.nic.qp_caps(qpn)
    }
    fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.nic.qp_state(qpn)
    }
    fn reg_mr(&mut self, len: usize, access: Access) -> Result<MemoryRegion, VerbsError> {
        self.nic.reg_mr(len, access)
    }
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError> {
        self.nic.dereg_mr(lkey)
    }
    fn mr_mem(&self, lkey: u32) -> Option<RegisteredMem<'_>> {
        self.nic.mr_mem(lkey)
    }
    fn post_write_with_imm(
        &mut self,
        qpn: u32,
        wr_id: u64,
        local: LocalSlice,
        remote: RemoteSlice,
        imm: u32,
    ) -> Result<(), VerbsError> {
        if !self.refuse.contains(&qpn) {
            return self.nic.post_write_with_imm(qpn, wr_id, local, remote, imm);
        }
        if !self.dropped.iter().any(|&(q, _)| q == qpn) {
            self.dropped.push((qpn, wr_id));
        }
        Ok(())
    }
    fn post_recv(&mut self, qpn: u32, wr_id: u64) -> Result<(), VerbsError> {
        self.nic.post_recv(qpn, wr_id)
    }
    fn ring_doorbell(&mut self) -> Result<(), DoorbellError> {
        self.nic.ring_doorbell()?;
        let mut refused = self
            .dropped
            .drain(..)
            .map(|(_, wr_id)| VerbsError::PostSend {
                wr_id,
                errno: Errno::ENOMEM,
            });
        match refused.next() {
            None => Ok(()),
            Some(first) => {
                let mut e = DoorbellError::new(first);
                refused.for_each(|r| e.push(r));
                Err(e)
            }
        }
    }
    fn poll_cq(&mut self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        self.nic.poll_cq(out)
    }
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError> {
        self.nic.destroy_qp(qpn)
    }
}

/// A doorbell that refuses the chains of two queue pairs fails both
/// connections (their WRs will never complete), each once, and leaves
/// the third running.
#[test]
fn a_doorbell_refusing_several_chains_fails_each_of_their_connections() {
    let (mut na, mut nb) = SimNic::pair(SimConfig::default());
    let qps: Vec<(u32, u32)> = (0..3).map(|_| na.connect_qp(&mut nb).unwrap()).collect();
    let wrapped = Refusing {
        nic: na,
        refuse: Vec::new(),
        dropped: Vec::new(),
    };
    let mut a = RdmaDriver::new(wrapped, cfg()).unwrap();
    let mut b = RdmaDriver::new(nb, cfg()).unwrap();
    let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
    for &(qa, qb) in &qps {
        let (ca, ra) = a.prepare(qa).unwrap();
        let (cb, rb) = b.prepare(qb).unwrap();
        a.connect(ca, rb).unwrap();
        b.connect(cb, ra).unwrap();
        a_ids.push(ca);
        b_ids.push(cb);
    }
    a.verbs_mut().refuse = vec![qps[0].0, qps[2].0];
    let now = Instant::now();
    for (i, &c) in a_ids.iter().enumerate() {
        let f = frame(i, 0, 64);
        let buf = a.tx_reserve(c, f.len()).unwrap().expect("staging");
        buf.copy_from_slice(&f);
        a.tx_commit(c, f.len());
    }
    a.flush(now);
    let mut failed: Vec<(ConnId, TransportError)> =
        std::iter::from_fn(|| a.poll_failure()).collect();
    failed.sort_unstable_by_key(|(c, _)| *c);
    let ids: Vec<ConnId> = failed.iter().map(|(c, _)| *c).collect();
    assert_eq!(ids, vec![a_ids[0], a_ids[2]], "{failed:?}");
    for (_, e) in &failed {
        assert!(
            matches!(e, TransportError::Link(m) if m.contains("ibv_post_send") && m.contains("ENOMEM")),
            "{e}"
        );
    }
    for c in [a_ids[0], a_ids[2]] {
        assert!(matches!(a.tx_reserve(c, 8), Err(TransportError::Link(_))));
    }
    // The third connection's frame arrives; nothing is reported twice.
    let mut got = Vec::new();
    for _ in 0..4 {
        b.rx_burst(now, 8, &mut |c, f| got.push((c, f.to_vec())));
        a.rx_burst(now, 8, &mut |_, _| {});
        a.flush(now);
        b.flush(now);
    }
    assert_eq!(got, vec![(b_ids[1], frame(1, 0, 64))]);
    assert!(a.poll_failure().is_none(), "once each");
    assert!(a.ring(a_ids[1]).unwrap().fault().is_none());
}

//! The DPDK backend on a real DPDK port in one process: `net_ring0`, a
//! ring-backed port whose transmit queue loops back to its own receive
//! queue, without hugepages or PCI devices. The EAL initialises once per
//! process, so every test that needs it is a step of the one test below.
//! A second ring port, `net_ring1`, is opened with four queue pairs for
//! the links of a queue set, a third, `net_ring2`, with one pair for a
//! set of one (a process that makes one link at a time).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use starwire_datagram::udp::UdpEndpoint;
use starwire_datagram::{
    DatagramDriver, DatagramLink, Impaired, LinkError, LossConfig, ReliableConfig,
};
use starwire_dpdk::{
    probe_steering, DeviceInfo, DpdkError, DpdkLink, Eal, LinkConfig, Port, PortConfig, QueueSet,
    SharedQueue, Steering, HANDOVER_HOLD,
};
use starwire_transport::conformance::{self, DriverPair};

const EAL_ARGS: &str =
    "--no-huge --no-pci --no-shconf -m 512 --vdev=net_ring0 --vdev=net_ring1 --vdev=net_ring2";

fn endpoints(port: &Port, a_port: u16, b_port: u16) -> (UdpEndpoint, UdpEndpoint) {
    let mac = port.info().mac;
    let a = UdpEndpoint {
        mac,
        ip: Ipv4Addr::new(198, 18, 0, 1),
        port: a_port,
    };
    let b = UdpEndpoint {
        mac,
        ip: Ipv4Addr::new(198, 18, 0, 2),
        port: b_port,
    };
    (a, b)
}

fn link_pair(q: &SharedQueue, port: &Port, a_port: u16, b_port: u16) -> (DpdkLink, DpdkLink) {
    let (ea, eb) = endpoints(port, a_port, b_port);
    let mtu = port.info().mtu;
    let a = DpdkLink::shared(q, mtu, LinkConfig::new(ea, eb)).expect("link a");
    let b = DpdkLink::shared(q, mtu, LinkConfig::new(eb, ea)).expect("link b");
    (a, b)
}

fn send(l: &mut DpdkLink, bytes: &[u8]) {
    l.tx_alloc(bytes.len()).expect("tx_alloc")[..bytes.len()].copy_from_slice(bytes);
    l.tx_commit(bytes.len()).expect("tx_commit");
}

fn recv_all(l: &mut DpdkLink) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for _ in 0..100 {
        let n = l
            .rx_burst(Instant::now(), 64, &mut |p| out.push(p.to_vec()))
            .expect("rx_burst");
        if n == 0 && !out.is_empty() {
            break;
        }
    }
    out
}

#[test]
fn net_ring_port() {
    let eal = Eal::init(EAL_ARGS).expect("EAL");
    assert!(std::ptr::eq(
        eal,
        Eal::init(&format!("  {EAL_ARGS} ")).unwrap()
    ));
    assert!(matches!(
        Eal::init("--no-huge"),
        Err(DpdkError::EalAlreadyInitialised { .. })
    ));
    eal.register_thread().expect("the main lcore is registered");
    std::thread::spawn(move || {
        let id = eal.register_thread().expect("register");
        assert_eq!(eal.register_thread().unwrap(), id, "idempotent");
    })
    .join()
    .unwrap();

    assert_eq!(eal.ports(), 3);
    let info = DeviceInfo::probe(eal, 0).expect("port 0");
    assert_eq!(info.driver, "net_ring");
    assert_eq!(info.name, "net_ring0");
    assert!(info.mtu >= 1500, "{info:?}");
    assert!(matches!(
        DeviceInfo::probe(eal, 3),
        Err(DpdkError::NoPort {
            port: 3,
            available: 3
        })
    ));
    let few = PortConfig {
        mbufs: Some(100),
        ..PortConfig::default()
    };
    match Port::open(eal, &few) {
        Err(DpdkError::TooFewMbufs { asked, need, .. }) => {
            assert_eq!(asked, 100);
            assert!(need >= 2048);
        }
        other => panic!("{other:?}"),
    }

    let mut port = Port::open(eal, &PortConfig::default()).expect("open");
    assert!(port.info().link.up);
    assert_eq!(port.queues(), 1);
    assert!(port.mbufs() >= 3072);
    let q = SharedQueue::new(port.take_queue().expect("queue 0"));

    raw_datagrams(&port, &q);
    let (a, b) = link_pair(&q, &port, 7500, 7501);
    full_inbox_holds_the_queue(a, b, 800);
    conformance_over_net_ring(&port, &q);
    conformance_under_injected_loss(&port, &q);
    hello_exchanges_over_streams(&port, &q);

    queue_set(eal);
    set_of_one(eal);
}

/// The queue set's hand-over under concurrency: four links, each on its
/// own thread as reactors run them, send to each other at once. Per
/// sender, each link gets the datagrams in order, none twice and none
/// damaged; what a full inbox dropped is counted (`rx_inbox_full`), and
/// every datagram sent was received or counted so.
fn links_on_their_own_threads(
    eal: &'static Eal,
    set: &QueueSet,
    mtu: u16,
    ep: &dyn Fn(u16) -> UdpEndpoint,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    const EACH: u32 = 2_000;
    let links: Vec<DpdkLink> = (0..4u16)
        .map(|i| DpdkLink::steered(set, mtu, LinkConfig::new(ep(7600 + i), ep(7600))))
        .collect::<Result<_, _>>()
        .expect("four links");
    let senders_done = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = links
        .into_iter()
        .enumerate()
        .map(|(i, mut l)| {
            let done = Arc::clone(&senders_done);
            let peers: Vec<u16> = (0..4u16).filter(|&j| usize::from(j) != i).collect();
            let to = move |j: u16| ep(7600 + j);
            let peer_eps: Vec<UdpEndpoint> = peers.iter().map(|&j| to(j)).collect();
            std::thread::spawn(move || {
                eal.register_thread().expect("register");
                for (&j, &e) in peers.iter().zip(&peer_eps) {
                    l.add_peer(u32::from(j), e);
                }
                let mut got: Vec<(u8, u32)> = Vec::new();
                // The next sequence number to each peer.
                let mut next = [0u32; 3];
                let mut quiet_since: Option<Instant> = None;
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    assert!(Instant::now() < deadline, "link {i} never went quiet");
                    let was_sending = next.iter().any(|&n| n < EACH);
                    for (k, &j) in peers.iter().enumerate() {
                        if next[k] == EACH {
                            continue;
                        }
                        // A full transmit queue holds back: send later.
                        let Some(buf) = l.tx_alloc(16) else {
                            break;
                        };
                        buf[..16].fill(0);
                        buf[0] = i as u8;
                        // dst_conn: the receiver's connection with this
                        // link as peer; src_conn: ours with it as peer.
                        buf[4..8].copy_from_slice(&(i as u32).to_le_bytes());
                        buf[8..12].copy_from_slice(&u32::from(j).to_le_bytes());
                        buf[12..16].copy_from_slice(&next[k].to_le_bytes());
                        l.tx_commit(16).expect("tx_commit");
                        next[k] += 1;
                    }
                    if was_sending && next.iter().all(|&n| n == EACH) {
                        done.fetch_add(1, Ordering::Release);
                    }
                    l.tx_burst_flush(Instant::now()).expect("flush");
                    let n = l
                        .rx_burst(Instant::now(), 32, &mut |p| {
                            let s = u32::from_le_bytes(p[12..16].try_into().unwrap());
                            got.push((p[0], s));
                        })
                        .expect("rx");
                    if done.load(Ordering::Acquire) < 4 || n > 0 {
                        quiet_since = None;
                    } else if quiet_since.get_or_insert_with(Instant::now).elapsed()
                        > Duration::from_millis(100)
                    {
                        return (l, got);
                    }
                }
            })
        })
        .collect();
    let mut ends: Vec<(DpdkLink, Vec<(u8, u32)>)> = threads
        .into_iter()
        .map(|t| t.join().expect("link thread"))
        .collect();
    // What a descheduled link left in the others' inboxes.
    for _ in 0..100 {
        for (l, got) in &mut ends {
            l.rx_burst(Instant::now(), 32, &mut |p| {
                let s = u32::from_le_bytes(p[12..16].try_into().unwrap());
                got.push((p[0], s));
            })
            .expect("rx");
        }
    }
    let mut received = 0u64;
    for (i, (_, got)) in ends.iter().enumerate() {
        for from in (0..4u8).filter(|&f| usize::from(f) != i) {
            let seqs: Vec<u32> = got.iter().filter(|p| p.0 == from).map(|p| p.1).collect();
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]) && seqs.iter().all(|&s| s < EACH),
                "link {i} from {from}: out of order, twice or damaged"
            );
            received += seqs.len() as u64;
        }
        assert_eq!(got.iter().filter(|p| usize::from(p.0) == i).count(), 0);
    }
    let dropped: u64 = ends.iter().map(|(l, _)| l.stats().rx_inbox_full).sum();
    assert_eq!(
        received + dropped,
        4 * 3 * u64::from(EACH),
        "dropped {dropped}"
    );
    assert!(received > 0);
    drop(ends);
    assert_eq!(set.free(), 4);
}

/// One queue pair leased to one link at a time, used without a lock: the
/// link gets every packet of its queue (its own, which net_ring loops
/// back, and one for a UDP port no link holds, which its filter drops),
/// nothing is handed over, and a second link at once is refused.
fn set_of_one(eal: &'static Eal) {
    let cfg = PortConfig {
        port: 2,
        ..PortConfig::default()
    };
    let mut port = Port::open(eal, &cfg).expect("open net_ring2");
    assert_eq!(port.queues(), 1);
    let set = QueueSet::new(&mut port, Steering::Single).expect("a set of one");
    assert_eq!(
        (set.queues(), set.free(), set.steering()),
        (1, 1, Steering::Single)
    );
    let mtu = port.info().mtu;
    let (me, nobody) = endpoints(&port, 7400, 7401);
    let mut link = DpdkLink::steered(&set, mtu, LinkConfig::new(me, me)).expect("link");
    assert_eq!(link.queue(), Some(0));
    assert!(matches!(
        DpdkLink::steered(&set, mtu, LinkConfig::new(nobody, me)),
        Err(DpdkError::QueuesTaken { queues: 1, .. })
    ));
    for i in 0..10u8 {
        send(&mut link, &[i; 20]);
    }
    assert_eq!(link.tx_burst_flush(Instant::now()).unwrap(), 10);
    let got = recv_all(&mut link);
    assert_eq!(got, (0..10u8).map(|i| vec![i; 20]).collect::<Vec<_>>());
    link.set_peer(nobody);
    send(&mut link, b"for nobody");
    assert_eq!(link.tx_burst_flush(Instant::now()).unwrap(), 1);
    assert!(recv_all(&mut link).is_empty());
    let st = link.stats();
    assert_eq!(
        (st.rx_filtered, st.rx_handed_over, st.rx_handed_in),
        (1, 0, 0)
    );
    drop(link);
    assert_eq!(set.free(), 1, "the pair goes back");
    let mut again = DpdkLink::steered(&set, mtu, LinkConfig::new(me, me)).expect("again");
    send(&mut again, b"again");
    again.tx_burst_flush(Instant::now()).unwrap();
    assert_eq!(recv_all(&mut again), vec![b"again".to_vec()]);
}

/// A port with a queue pair per link and no `rte_flow` (net_ring has no
/// flow rules): each link sends on its own queue, whose packets come back
/// on the same queue's receive side, so every packet for another link is
/// handed over through the grid. Raw datagrams first, then the
/// conformance suite between two links of the set.
fn queue_set(eal: &'static Eal) {
    let cfg = PortConfig {
        port: 1,
        queues: 4,
        ..PortConfig::default()
    };
    let mut port = Port::open(eal, &cfg).expect("open net_ring1");
    assert_eq!(port.queues(), 4);
    let (steering, why) = probe_steering(1, port.queues());
    assert_eq!(steering, Steering::Software, "{why}");
    assert_eq!(probe_steering(1, 1).0, Steering::Single);
    let set = QueueSet::new(&mut port, steering).expect("queue set");
    assert_eq!((set.queues(), set.free()), (4, 4));
    let mtu = port.info().mtu;
    let ep = |udp: u16| endpoints(&port, udp, udp).0;
    let mut links: Vec<DpdkLink> = (0..4)
        .map(|i| DpdkLink::steered(&set, mtu, LinkConfig::new(ep(7100 + i), ep(7100))))
        .collect::<Result<_, _>>()
        .expect("four links");
    let mut queues: Vec<u16> = links.iter().filter_map(DpdkLink::queue).collect();
    queues.sort_unstable();
    assert_eq!(queues, [0, 1, 2, 3], "a queue pair each");
    assert!(matches!(
        DpdkLink::steered(&set, mtu, LinkConfig::new(ep(7200), ep(7200))),
        Err(DpdkError::QueuesTaken { queues: 4, .. })
    ));
    drop(links.pop());
    assert_eq!(set.free(), 1, "a dropped link gives its pair back");
    assert!(matches!(
        DpdkLink::steered(&set, mtu, LinkConfig::new(ep(7100), ep(7100))),
        Err(DpdkError::UdpPortInUse { udp_port: 7100, .. })
    ));
    links.push(DpdkLink::steered(&set, mtu, LinkConfig::new(ep(7103), ep(7100))).expect("again"));

    // Every link sends 20 datagrams to each other link: byte 0 says the
    // sender, bytes 4..8 (dst_conn) the receiver's connection whose peer
    // it is (the sender's index), bytes 8..12 (src_conn) the sender's
    // connection whose peer is the receiver, byte 12 the sequence. Links
    // poll in turn until all arrived.
    for (i, l) in links.iter_mut().enumerate() {
        for j in 0..4u32 {
            l.add_peer(j, ep(7100 + j as u16));
        }
        for seq in 0..20u8 {
            for j in (0..4u32).filter(|&j| j as usize != i) {
                let mut p = [0u8; 13];
                p[0] = i as u8;
                p[4..8].copy_from_slice(&(i as u32).to_le_bytes());
                p[8..12].copy_from_slice(&j.to_le_bytes());
                p[12] = seq;
                send(l, &p);
            }
        }
        assert_eq!(l.tx_burst_flush(Instant::now()).unwrap(), 60);
    }
    let mut got: Vec<Vec<(u8, u8)>> = vec![Vec::new(); 4];
    for _ in 0..1000 {
        for (i, l) in links.iter_mut().enumerate() {
            l.rx_burst(Instant::now(), 32, &mut |p| got[i].push((p[0], p[12])))
                .unwrap();
        }
        if got.iter().all(|g| g.len() == 60) {
            break;
        }
    }
    for (i, g) in got.iter().enumerate() {
        for from in (0..4u8).filter(|&f| usize::from(f) != i) {
            let seqs: Vec<u8> = g.iter().filter(|p| p.0 == from).map(|p| p.1).collect();
            assert_eq!(seqs, (0..20).collect::<Vec<_>>(), "link {i} from {from}");
        }
    }
    let over: u64 = links.iter().map(|l| l.stats().rx_handed_over).sum();
    let in_: u64 = links.iter().map(|l| l.stats().rx_handed_in).sum();
    assert_eq!((over, in_), (240, 240), "each packet handed over once");
    drop(links);
    assert_eq!(set.free(), 4);

    links_on_their_own_threads(eal, &set, mtu, &ep);

    let (ea, eb) = endpoints(&port, 7400, 7401);
    full_inbox_holds_the_queue(
        DpdkLink::steered(&set, mtu, LinkConfig::new(ea, eb)).expect("link a"),
        DpdkLink::steered(&set, mtu, LinkConfig::new(eb, ea)).expect("link b"),
        600,
    );

    let mut udp = 7300u16;
    conformance::run_all_drivers("dpdk-queue-set", conformance::MIN_CONNECTIONS, |n| {
        udp += 2;
        let a_end = ep(udp);
        let b_end = ep(udp + 1);
        let la = DpdkLink::steered(&set, mtu, LinkConfig::new(a_end, b_end)).expect("link a");
        let lb = DpdkLink::steered(&set, mtu, LinkConfig::new(b_end, a_end)).expect("link b");
        let cfg = ReliableConfig::default();
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
        DriverPair { a, a_ids, b, b_ids }
    });
    assert_eq!(set.free(), 4, "every case's links gave their pairs back");
}

/// Datagrams both ways over one shared queue, the headers right, the
/// device's ring full keeping packets pending, ports demultiplexed.
fn raw_datagrams(port: &Port, q: &SharedQueue) {
    let (mut a, mut b) = link_pair(q, port, 7000, 7001);
    assert!(matches!(
        DpdkLink::shared(q, port.info().mtu, *a.config()),
        Err(DpdkError::UdpPortInUse { udp_port: 7000, .. })
    ));
    assert_eq!(a.mtu(), usize::from(port.info().mtu) - 28);
    let before = port.stats().expect("stats");
    for i in 0..10u8 {
        send(&mut a, &[i; 100]);
        send(&mut b, &[100 + i; 3]);
    }
    assert_eq!(a.tx_burst_flush(Instant::now()).unwrap(), 10);
    assert_eq!(b.tx_burst_flush(Instant::now()).unwrap(), 10);
    let at_b = recv_all(&mut b);
    let at_a = recv_all(&mut a);
    assert_eq!(at_b, (0..10u8).map(|i| vec![i; 100]).collect::<Vec<_>>());
    assert_eq!(
        at_a,
        (0..10u8).map(|i| vec![100 + i; 3]).collect::<Vec<_>>()
    );
    let after = port.stats().expect("stats");
    assert_eq!(after.opackets - before.opackets, 20);
    assert_eq!(after.ipackets - before.ipackets, 20);

    // The largest datagram; a longer commit is refused and not sent.
    let mtu = a.mtu();
    send(&mut a, &vec![7; mtu]);
    assert!(a.tx_alloc(mtu + 1).is_some());
    assert!(matches!(
        a.tx_commit(mtu + 1),
        Err(LinkError::Oversized { .. })
    ));
    a.tx_burst_flush(Instant::now()).unwrap();
    assert_eq!(recv_all(&mut b), vec![vec![7; mtu]]);

    // A packet to a UDP port nobody holds is dropped, not lent.
    let (mut c, d) = link_pair(q, port, 7002, 7003);
    drop(d);
    send(&mut c, b"hello");
    c.tx_burst_flush(Instant::now()).unwrap();
    assert!(recv_all(&mut c).is_empty());
    assert_eq!(c.stats().rx_filtered, 1, "{:?}", c.stats());

    // Each of our connection ids can have a peer of its own: the link
    // reads src_conn (bytes 8..12) of each datagram.
    let (mut e, mut f) = link_pair(q, port, 7004, 7005);
    let (_, g_end) = endpoints(port, 0, 7006);
    let mut g =
        DpdkLink::shared(q, port.info().mtu, LinkConfig::new(g_end, e.config().local)).expect("g");
    e.add_peer(77, g.config().local);
    let to = |conn: u32| {
        let mut p = vec![0u8; 13];
        p[8..12].copy_from_slice(&conn.to_le_bytes());
        p[12] = conn as u8;
        p
    };
    send(&mut e, &to(77));
    send(&mut e, &to(5));
    e.tx_burst_flush(Instant::now()).unwrap();
    assert_eq!(recv_all(&mut g), vec![to(77)]);
    assert_eq!(
        recv_all(&mut f),
        vec![to(5)],
        "others go to the link's peer"
    );
    // Only a connection's peer reaches it: f's datagram names g's
    // connection 0, whose peer is e, so g drops it unlent.
    f.add_peer(9, g.config().local);
    send(&mut f, &to(9));
    f.tx_burst_flush(Instant::now()).unwrap();
    let foreign = g.stats().rx_foreign;
    assert!(
        recv_all(&mut g).is_empty(),
        "a stranger's datagram was lent"
    );
    assert_eq!(g.stats().rx_foreign, foreign + 1, "{:?}", g.stats());
    drop((e, f, g));

    // More packets than the ring takes stay pending, in order, and leave
    // with later bursts.
    let total = 3000usize;
    let mut sent = 0usize;
    let mut got: Vec<u32> = Vec::new();
    let mut full_seen = false;
    while got.len() < total {
        while sent < total {
            let Some(buf) = a.tx_alloc(4) else { break };
            buf.copy_from_slice(&(sent as u32).to_le_bytes());
            a.tx_commit(4).unwrap();
            sent += 1;
        }
        a.tx_burst_flush(Instant::now()).unwrap();
        full_seen |= a.pending() > 0;
        b.rx_burst(Instant::now(), 64, &mut |p| {
            got.push(u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
        })
        .unwrap();
    }
    assert_eq!(got, (0..total as u32).collect::<Vec<_>>());
    assert!(
        full_seen && a.stats().tx_pending_full > 0,
        "{:?}",
        a.stats()
    );
}

/// A connected pair of loopback TCP streams.
fn streams() -> (std::net::TcpStream, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).expect("connect");
    (a, l.accept().expect("accept").0)
}

/// `attach_stream`'s bootstrap never blocks its reactor: two drivers
/// attach the two ends of a stream and their flushes exchange the hellos
/// and connect them (a frame then crosses); a silent peer leaves its
/// connection waiting and the flush returns, a garbled hello or one past
/// the deadline fails its connection alone, and a detached one is dropped.
fn hello_exchanges_over_streams(port: &Port, q: &SharedQueue) {
    use starwire_dpdk::bootstrap::{attach_one, BOOTSTRAP_TIMEOUT};
    use starwire_transport::Driver;
    use std::io::Write;
    let (la, lb) = link_pair(q, port, 9500, 9501);
    let cfg = ReliableConfig::default();
    let mut a = DatagramDriver::new(la, cfg.clone()).expect("driver a");
    let mut b = DatagramDriver::new(lb, cfg).expect("driver b");
    let (sa, sb) = streams();
    let ca = attach_one(&mut a, sa).expect("attach a");
    let cb = attach_one(&mut b, sb).expect("attach b");
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.exchanging() + b.exchanging() > 0 {
        assert!(Instant::now() < deadline, "the hellos never crossed");
        a.flush(Instant::now());
        b.flush(Instant::now());
    }
    assert!(a.core(ca).is_some() && b.core(cb).is_some());
    a.tx_reserve(ca, 5)
        .unwrap()
        .unwrap()
        .copy_from_slice(b"hello");
    a.tx_commit(ca, 5);
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(Instant::now() < deadline, "the frame never crossed");
        a.flush(Instant::now());
        b.rx_burst(Instant::now(), 8, &mut |c, f| got.push((c, f.to_vec())));
    }
    assert_eq!(got, vec![(cb, b"hello".to_vec())]);

    // A peer that says nothing: the flush returns, the connection waits.
    let (silent, _quiet) = streams();
    let cs = attach_one(&mut a, silent).expect("attach silent");
    let t = Instant::now();
    a.flush(Instant::now());
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(a.exchanging(), 1);
    assert!(a.core(cs).is_none() && a.poll_failure().is_none());
    // Past the deadline it fails, alone.
    a.flush(Instant::now() + BOOTSTRAP_TIMEOUT);
    let (failed, e) = a.poll_failure().expect("timed out");
    assert_eq!(failed, cs);
    assert!(e.to_string().contains("no hello line"), "{e}");
    a.detach(cs);
    // A garbled hello fails its connection.
    let (garbled, mut peer) = streams();
    peer.write_all(b"starwire-dpdk-hello 1 nonsense\n").unwrap();
    let cg = attach_one(&mut a, garbled).expect("attach garbled");
    let mut failure = None;
    while failure.is_none() {
        assert!(
            Instant::now() < deadline,
            "the garbled hello was never read"
        );
        a.flush(Instant::now());
        failure = a.poll_failure();
    }
    let (failed, e) = failure.unwrap();
    assert_eq!(failed, cg);
    assert!(e.to_string().contains("bad DPDK bootstrap line"), "{e}");
    a.detach(cg);
    // Detached while waiting: the exchange goes with it.
    let (silent, _quiet) = streams();
    let cd = attach_one(&mut a, silent).expect("attach");
    a.detach(cd);
    assert_eq!(a.exchanging(), 0);
    assert!(a.core(ca).is_some(), "the first connection is untouched");
}

/// The shared conformance suite: 64 connections between two
/// `DatagramDriver<DpdkLink>`s on one net_ring queue.
fn conformance_over_net_ring(port: &Port, q: &SharedQueue) {
    let before = port.stats().expect("stats");
    let mut udp = 8000u16;
    conformance::run_all_drivers("dpdk-net_ring", conformance::MIN_CONNECTIONS, |n| {
        udp += 2;
        let (la, lb) = link_pair(q, port, udp, udp + 1);
        let cfg = ReliableConfig::default();
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
        DriverPair { a, a_ids, b, b_ids }
    });
    assert_eq!(udp, 8000 + 2 * 11, "a fresh driver pair per case");
    let after = port.stats().expect("stats");
    assert!(
        after.opackets - before.opackets > 10_000,
        "the suite's packets went through the port: {before:?} {after:?}"
    );
    // The last acknowledgements may still sit in the ring.
    assert!(after.ipackets - before.ipackets <= after.opackets - before.opackets);
}

/// The suite again with 5 % loss, 2 % duplication and 5 % reordering
/// injected under both real links: the reliability core repairs it all.
fn conformance_under_injected_loss(port: &Port, q: &SharedQueue) {
    let loss = LossConfig {
        loss: 0.05,
        duplicate: 0.02,
        reorder: 0.05,
        ..LossConfig::lossless(1500)
    };
    let mut udp = 9000u16;
    conformance::run_all_drivers("dpdk-net_ring-5%", conformance::MIN_CONNECTIONS, |n| {
        udp += 2;
        let (la, lb) = link_pair(q, port, udp, udp + 1);
        let la = Impaired::new(la, loss.clone(), u64::from(udp));
        let lb = Impaired::new(lb, loss.clone(), u64::from(udp) + 1);
        let cfg = ReliableConfig::default();
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
        DriverPair { a, a_ids, b, b_ids }
    });
    assert_eq!(udp, 9000 + 2 * 11, "a fresh driver pair per case");
}

/// `a` sends datagrams to `b`'s UDP port; they come back on the queue
/// `a` polls, and `a` files them for `b` (its ring in a queue set, its
/// inbox on a shared queue). While that has no room for a burst, `a`
/// leaves the queue unpolled (the packets wait in the device), so
/// nothing is dropped however long `b` takes to poll, up to
/// [`HANDOVER_HOLD`]; past it `a` polls again and drops what does not
/// fit. `n`, a multiple of 200, is more than `b` can hold.
fn full_inbox_holds_the_queue(mut a: DpdkLink, mut b: DpdkLink, n: u32) {
    assert_eq!(n % 200, 0);
    let send_to_b = |a: &mut DpdkLink| {
        for round in 0..n / 200 {
            for i in 0..200u32 {
                send(a, &(round * 200 + i).to_le_bytes());
            }
            assert_eq!(a.tx_burst_flush(Instant::now()).unwrap(), 200);
        }
    };
    send_to_b(&mut a);
    let t0 = Instant::now();
    for _ in 0..40 {
        assert_eq!(a.rx_burst(t0, 64, &mut |_| ()).unwrap(), 0, "none for a");
    }
    let s = a.stats();
    assert_eq!(s.rx_inbox_full, 0, "held back, not dropped: {s:?}");
    assert!(s.rx_held_back > 0, "{s:?}");
    // `b` drains what it holds, `a` polls again: all arrive, in order.
    let mut got = Vec::new();
    for _ in 0..1000 {
        a.rx_burst(t0, 64, &mut |_| ()).unwrap();
        b.rx_burst(t0, 64, &mut |p| {
            got.push(u32::from_le_bytes(p[..4].try_into().unwrap()))
        })
        .unwrap();
        if got.len() == n as usize {
            break;
        }
    }
    assert_eq!(got, (0..n).collect::<Vec<u32>>());
    assert_eq!(a.stats().rx_inbox_full, 0);

    // `b` stops polling: past the hold, `a` polls anyway and drops.
    send_to_b(&mut a);
    let t1 = Instant::now();
    for _ in 0..40 {
        a.rx_burst(t1, 64, &mut |_| ()).unwrap();
    }
    assert_eq!(a.stats().rx_inbox_full, 0, "within the hold");
    let later = t1 + HANDOVER_HOLD + Duration::from_millis(1);
    for _ in 0..40 {
        a.rx_burst(later, 64, &mut |_| ()).unwrap();
    }
    assert!(a.stats().rx_inbox_full > 0, "{:?}", a.stats());
}

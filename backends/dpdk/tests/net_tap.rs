//! A port with two queue pairs on `net_tap`, whose kernel side sends to
//! two links from many UDP sockets: the kernel, not our sender, picks the
//! receive queue of each packet (tun's per-flow hash), and the links must
//! each get exactly their own datagrams.
//!
//! `net_tap` implements `rte_flow` with TC flower rules. Where the kernel
//! has them the set is steered by `rte_flow` and no packet may be handed
//! over between links; where it has not (`rte_flow_validate` passes, the
//! rule's creation fails), the set must say `software` and the links hand
//! over what lands on the other's queue.
//!
//! Needs root, `/dev/net/tun` and the `ip` tool, and changes the network
//! namespace it runs in (an address and a neighbour entry on the tap), so
//! it is ignored by default; `ci/dpdk-netns.sh` runs it inside a namespace
//! of its own with:
//!
//! * `STARWIRE_DPDK_TEST_TAP_EAL`: EAL arguments with a `net_tap` device
//!   (`--vdev=net_tap0,iface=NAME`);
//! * `STARWIRE_DPDK_TEST_TAP_IFACE`: that NAME;
//! * `STARWIRE_DPDK_TEST_TAP_STEERING` (optional): the steering the set
//!   must get, `rte_flow` or `software`. `ci/verbs-vm.sh` runs the test in
//!   a guest whose kernel has TC flower and asks for `rte_flow`, so that
//!   path cannot pass by falling back.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use starwire_datagram::udp::UdpEndpoint;
use starwire_datagram::DatagramLink;
use starwire_dpdk::{
    probe_steering, DpdkLink, Eal, LinkConfig, Port, PortConfig, QueueSet, Steering,
};

const KERNEL_IP: Ipv4Addr = Ipv4Addr::new(10, 241, 0, 1);
const DPDK_IP: Ipv4Addr = Ipv4Addr::new(10, 241, 0, 2);
const LINK_PORTS: [u16; 2] = [41_000, 41_001];
/// Kernel sockets, each its own flow (source port): enough that the
/// tun hash puts some on each queue.
const SOCKETS: usize = 32;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set; see the module docs"))
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?}: {st}");
}

#[test]
#[ignore = "needs root, /dev/net/tun and a network namespace to change: ci/dpdk-netns.sh"]
fn kernel_flows_reach_their_links_on_net_tap_queues() {
    let iface = env("STARWIRE_DPDK_TEST_TAP_IFACE");
    let eal = Eal::init(&env("STARWIRE_DPDK_TEST_TAP_EAL")).expect("EAL");
    let cfg = PortConfig {
        queues: 2,
        ..PortConfig::default()
    };
    let mut port = Port::open(eal, &cfg).expect("open net_tap");
    assert_eq!(port.info().driver, "net_tap");
    assert_eq!(port.queues(), 2);
    let (probed, mut why) = probe_steering(cfg.port, port.queues());
    let set = QueueSet::new(&mut port, probed).expect("queue set");
    let steering = set.steering();
    assert_ne!(steering, Steering::Single, "{why}");
    if let Some(refused) = set.rte_flow_refused() {
        assert_eq!((probed, steering), (Steering::RteFlow, Steering::Software));
        why = format!("{why}, but rte_flow_create refused it: {refused}");
    }
    if let Ok(want) = std::env::var("STARWIRE_DPDK_TEST_TAP_STEERING") {
        assert_eq!(steering.to_string(), want, "steering: {why}");
    }

    // The kernel end: an address on the tap, and our MAC for DPDK_IP.
    let mac = port.info().mac;
    ip(&["addr", "replace", &format!("{KERNEL_IP}/24"), "dev", &iface]);
    ip(&["link", "set", &iface, "up"]);
    #[rustfmt::skip]
    ip(&["neigh", "replace", &DPDK_IP.to_string(), "lladdr", &mac.to_string(), "dev", &iface]);

    let ep = |ip, port| UdpEndpoint { mac, ip, port };
    let mut links: Vec<DpdkLink> = LINK_PORTS
        .iter()
        .map(|&p| {
            DpdkLink::steered(
                &set,
                port.info().mtu,
                LinkConfig::new(ep(DPDK_IP, p), ep(KERNEL_IP, 9)),
            )
        })
        .collect::<Result<_, _>>()
        .expect("two links");

    // Every socket sends one datagram to each link: byte 0 names the link,
    // byte 1 the socket.
    let socks: Vec<UdpSocket> = (0..SOCKETS)
        .map(|_| UdpSocket::bind(SocketAddr::from((KERNEL_IP, 0))))
        .collect::<Result<_, _>>()
        .expect("kernel sockets");
    for (s, sock) in socks.iter().enumerate() {
        for (l, &p) in LINK_PORTS.iter().enumerate() {
            sock.send_to(&[l as u8, s as u8, 0xa5], (DPDK_IP, p))
                .expect("send");
        }
    }

    let mut got: Vec<Vec<(u8, u8)>> = vec![Vec::new(); 2];
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.iter().any(|g| g.len() < SOCKETS) && Instant::now() < deadline {
        for (i, l) in links.iter_mut().enumerate() {
            l.rx_burst(Instant::now(), 32, &mut |p| {
                assert_eq!(p.len(), 3, "datagram length");
                got[i].push((p[0], p[1]));
            })
            .expect("rx_burst");
        }
    }
    for (i, g) in got.iter_mut().enumerate() {
        assert!(
            g.iter().all(|&(l, _)| usize::from(l) == i),
            "link {i} got another's: {g:?}"
        );
        g.sort_unstable();
        let want: Vec<(u8, u8)> = (0..SOCKETS).map(|s| (i as u8, s as u8)).collect();
        assert_eq!(*g, want, "link {i}: one datagram from every socket");
    }
    let stats: Vec<_> = links.iter().map(DpdkLink::stats).collect();
    let over: u64 = stats.iter().map(|s| s.rx_handed_over).sum();
    let in_: u64 = stats.iter().map(|s| s.rx_handed_in).sum();
    assert_eq!(over, in_, "every packet handed over arrived");
    match steering {
        // A rule per link: each datagram on its link's own queue.
        Steering::RteFlow => assert_eq!(over, 0, "steered by rte_flow, yet handed over"),
        // The kernel spread 2 x 32 flows over two queues; the chance that
        // every one landed on its link's queue is 2^-64.
        _ => assert!(over > 0, "no packet landed on the other link's queue"),
    }
    let own: Vec<u64> = (0..2)
        .map(|i| SOCKETS as u64 - stats[i].rx_handed_in)
        .collect();
    println!(
        "{{\"check\":\"net-tap-queues\",\"steering\":\"{steering}\",\"why\":{why:?},\"datagrams\":{},\"on_own_queue\":[{},{}],\"handed_over\":{over},\"port_ipackets\":{}}}",
        2 * SOCKETS,
        own[0],
        own[1],
        port.stats().expect("stats").ipackets
    );
}

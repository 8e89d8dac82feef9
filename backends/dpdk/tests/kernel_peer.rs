//! A peer that is not ours: a Linux UDP socket in another network
//! namespace exchanges datagrams with a `DpdkLink`, so the kernel checks
//! our Ethernet, IPv4 and UDP headers and checksums, and we parse its.
//! The kernel has no neighbour entry for us: it finds our MAC by ARP, and
//! the link answers.
//!
//! Needs a veth pair between two namespaces and root, so it is ignored by
//! default; `ci/dpdk-netns.sh` sets it up and runs it inside the DPDK
//! side's namespace with:
//!
//! * `STARWIRE_DPDK_TEST_EAL`: EAL arguments naming the DPDK port (an
//!   `net_af_packet` or `net_af_xdp` device on our end of the veth pair);
//! * `STARWIRE_DPDK_TEST_NETNS`: the peer namespace (`/var/run/netns/NAME`);
//! * `STARWIRE_DPDK_TEST_LOCAL`: our IPv4 address (the peer resolves it
//!   by ARP);
//! * `STARWIRE_DPDK_TEST_PEER` and `STARWIRE_DPDK_TEST_PEER_MAC`: the
//!   kernel end's IPv4 address and MAC.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use starwire_datagram::udp::{MacAddr, UdpEndpoint};
use starwire_datagram::DatagramLink;
use starwire_dpdk::{DpdkLink, Eal, LinkConfig, Port, PortConfig};

const COUNT: usize = 200;
const OUR_PORT: u16 = 40_000;
const PEER_PORT: u16 = 9_999;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set; see the module docs"))
}

fn payload(dir: u8, i: usize) -> Vec<u8> {
    // Odd lengths too: the checksum pads the last byte.
    (0..(i % 300) + 1)
        .map(|k| (k as u8).wrapping_mul(31) ^ i as u8 ^ dir)
        .collect()
}

/// The kernel end, on a thread that moved into the peer namespace: receive
/// our datagrams, then send as many back.
fn kernel_peer(netns: String, peer: Ipv4Addr, ours: Ipv4Addr) -> std::io::Result<usize> {
    let ns = std::fs::File::open(&netns)?;
    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
    let sock = UdpSocket::bind(SocketAddr::from((peer, PEER_PORT)))?;
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut buf = [0u8; 2048];
    let mut got = 0;
    // Tell the DPDK side we are listening.
    sock.send_to(b"ready", (ours, OUR_PORT))?;
    while got < COUNT {
        let (n, from) = sock.recv_from(&mut buf)?;
        assert_eq!(from, SocketAddr::from((ours, OUR_PORT)), "source address");
        assert_eq!(&buf[..n], &payload(0, got)[..], "datagram {got} from DPDK");
        got += 1;
    }
    for i in 0..COUNT {
        sock.send_to(&payload(1, i), (ours, OUR_PORT))?;
        if i % 16 == 15 {
            // No flow control on this path: stay below the ring's size.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(got)
}

#[test]
#[ignore = "needs root, two network namespaces and a veth pair: ci/dpdk-netns.sh"]
fn kernel_udp_socket_exchanges_datagrams_with_dpdk() {
    let ours: Ipv4Addr = env("STARWIRE_DPDK_TEST_LOCAL").parse().expect("local IPv4");
    let peer: Ipv4Addr = env("STARWIRE_DPDK_TEST_PEER").parse().expect("peer IPv4");
    let peer_mac: MacAddr = env("STARWIRE_DPDK_TEST_PEER_MAC")
        .parse()
        .expect("peer MAC");
    let netns = env("STARWIRE_DPDK_TEST_NETNS");
    let eal = Eal::init(&env("STARWIRE_DPDK_TEST_EAL")).expect("EAL");
    let mut port = Port::open(eal, &PortConfig::default()).expect("port");
    let local = UdpEndpoint {
        mac: port.info().mac,
        ip: ours,
        port: OUR_PORT,
    };
    let remote = UdpEndpoint {
        mac: peer_mac,
        ip: peer,
        port: PEER_PORT,
    };
    let queue = port.take_queue().expect("queue");
    let mut link = DpdkLink::new(queue, port.info().mtu, LinkConfig::new(local, remote));

    let kernel = std::thread::spawn(move || kernel_peer(netns, peer, ours));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut received: Vec<Vec<u8>> = Vec::new();
    let rx = |link: &mut DpdkLink, received: &mut Vec<Vec<u8>>| {
        link.rx_burst(Instant::now(), 32, &mut |p| received.push(p.to_vec()))
            .expect("rx_burst");
    };
    while received.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the kernel peer's ready never came"
        );
        rx(&mut link, &mut received);
        // The ARP reply the kernel waits for before its first datagram
        // leaves with a burst, as the driver's flush would send it.
        link.tx_burst_flush(Instant::now()).expect("flush");
    }
    assert_eq!(received.remove(0), b"ready");
    assert!(
        link.stats().arp_replies >= 1,
        "the kernel found our MAC by ARP: {:?}",
        link.stats()
    );
    let mut sent = 0;
    while sent < COUNT {
        assert!(Instant::now() < deadline, "sending timed out");
        let p = payload(0, sent);
        if let Some(buf) = link.tx_alloc(p.len()) {
            buf[..p.len()].copy_from_slice(&p);
            link.tx_commit(p.len()).expect("commit");
            sent += 1;
        }
        link.tx_burst_flush(Instant::now()).expect("flush");
        if sent % 16 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    while link.pending() > 0 {
        assert!(Instant::now() < deadline, "packets stuck pending");
        link.tx_burst_flush(Instant::now()).expect("flush");
    }
    while received.len() < COUNT && Instant::now() < deadline {
        rx(&mut link, &mut received);
    }
    let got = kernel
        .join()
        .expect("kernel thread")
        .expect("kernel socket");
    assert_eq!(got, COUNT, "the kernel accepted every datagram we sent");
    assert_eq!(
        received.len(),
        COUNT,
        "every datagram of the kernel arrived"
    );
    for (i, r) in received.iter().enumerate() {
        assert_eq!(r, &payload(1, i), "datagram {i} from the kernel");
    }
    let s = port.stats().expect("stats");
    println!(
        "{{\"check\":\"kernel-udp\",\"sent\":{COUNT},\"received\":{},\"arp_replies\":{},\"port_opackets\":{},\"port_ipackets\":{}}}",
        received.len(),
        link.stats().arp_replies,
        s.opackets,
        s.ipackets
    );
}

//! [`DpdkLink`]: the [`DatagramLink`] of one reactor over one DPDK queue
//! pair, each datagram in an Ethernet/IPv4/UDP packet of its own mbuf.
//!
//! Transmit: [`tx_alloc`](DatagramLink::tx_alloc) takes an mbuf from the
//! port's pool and lends its data room after the headers;
//! [`tx_commit`](DatagramLink::tx_commit) writes the headers (checksums
//! included) and queues the mbuf; [`tx_burst_flush`](DatagramLink::tx_burst_flush)
//! is one `rte_eth_tx_burst` of the queue. Packets the device's ring has
//! no room for stay queued, in order, for the next burst; `tx_alloc`
//! refuses once [`LinkConfig::max_pending`] wait.
//!
//! Receive: [`rx_burst`](DatagramLink::rx_burst) is one `rte_eth_rx_burst`;
//! each packet that passes the filter (EtherType IPv4, protocol UDP, not
//! a fragment, our destination port, well-formed headers) is lent to the
//! sink in place, its UDP payload straight from the mbuf, which goes back
//! to the pool afterwards. An ARP request for our IPv4 address is
//! answered: the reply joins the packets queued for the next burst, so a
//! kernel peer needs no static neighbour entry for us.
//!
//! A queue pair owned by one link is used without a lock: one the link
//! was given ([`DpdkLink::new`]) or one it leased from a [`QueueSet`]
//! ([`DpdkLink::steered`]), whose links hand each other the packets that
//! arrived on the wrong queue through lock-free rings (see
//! [`steer`](crate::steer)). Links that share a queue pair (a port with
//! fewer queues than reactors) go through a [`SharedQueue`]: whichever
//! link receives takes a burst and files each packet under the link bound
//! to its UDP destination port, under the queue's lock.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use starwire_datagram::arp::{ArpRepr, ETHERTYPE_ARP};
use starwire_datagram::packet::{peek_dst_conn, peek_src_conn};
use starwire_datagram::udp::{self, UdpEndpoint, UdpRepr, HEADERS_LEN, IP_UDP_OVERHEAD};
use starwire_datagram::{DatagramLink, LinkError};

use crate::error::DpdkError;
use crate::ffi::{self, Mbuf, Mempool};
use crate::port::PortQueue;
use crate::steer::{Lease, QueueSet, HANDOVER_HOLD};

/// Packets a link's inbox in a [`SharedQueue`] holds. A link polls the
/// queue only while every other link's inbox has room for the burst, for
/// at most [`HANDOVER_HOLD`]; past it what does not fit is dropped (the
/// reliability layer retransmits).
const INBOX_CAPACITY: usize = 512;

/// How a link sends and receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkConfig {
    /// This end: the port's MAC, an IPv4 address and a UDP port.
    pub local: UdpEndpoint,
    /// Where every datagram goes.
    pub peer: UdpEndpoint,
    /// Packets per `rte_eth_rx_burst` at most.
    pub rx_burst: u16,
    /// Packets queued for transmission at most; `tx_alloc` refuses beyond.
    pub max_pending: usize,
    /// Take this end's IPv4 address from the local address of the first
    /// bootstrap connection (no address was configured).
    pub ip_from_bootstrap: bool,
}

impl LinkConfig {
    /// Defaults for the two ends: bursts of 32, up to 256 packets queued.
    pub fn new(local: UdpEndpoint, peer: UdpEndpoint) -> Self {
        Self {
            local,
            peer,
            rx_burst: 32,
            max_pending: 256,
            ip_from_bootstrap: false,
        }
    }
}

/// Counters of one link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DpdkLinkStats {
    /// Packets the device took for transmission.
    pub tx_packets: u64,
    /// `rte_eth_tx_burst` calls.
    pub tx_bursts: u64,
    /// Bursts after which packets stayed queued (the device's ring was
    /// full).
    pub tx_ring_full: u64,
    /// `tx_alloc` refusals for an empty pool.
    pub tx_no_mbuf: u64,
    /// `tx_alloc` refusals for [`LinkConfig::max_pending`] packets queued.
    pub tx_pending_full: u64,
    /// Packets lent to the sink.
    pub rx_packets: u64,
    /// `rte_eth_rx_burst` calls.
    pub rx_bursts: u64,
    /// Packets that were not IPv4/UDP to a port of ours.
    pub rx_filtered: u64,
    /// Packets to our port with bad headers (lengths, IPv4 checksum,
    /// several segments).
    pub rx_malformed: u64,
    /// Packets to our port from an address and port that is not the peer
    /// of the connection they name (`dst_conn`): dropped before the
    /// reliability layer sees them.
    pub rx_foreign: u64,
    /// ARP requests for our IPv4 address answered.
    pub arp_replies: u64,
    /// Packets dropped because the inbox of the link they were for was
    /// full (shared queues, queue sets).
    pub rx_inbox_full: u64,
    /// Receive passes that left the queue unpolled because another link's
    /// inbox had no room for the burst (shared queues, queue sets).
    pub rx_held_back: u64,
    /// Packets this link received on its queue and handed to the link of
    /// their UDP port (queue sets).
    pub rx_handed_over: u64,
    /// Packets other links handed to this one (queue sets).
    pub rx_handed_in: u64,
}

/// A queue pair several links use, each bound to its own UDP port.
#[derive(Debug, Clone)]
pub struct SharedQueue {
    inner: Arc<Mutex<Demux>>,
}

#[derive(Debug)]
struct Demux {
    /// Packets received for each bound UDP port, not yet taken.
    inboxes: Vec<(u16, VecDeque<Mbuf>)>,
    scratch: Vec<Mbuf>,
    /// Its device holds the pool of the mbufs above: `Drop` gives them
    /// back first.
    queue: ffi::Queue,
}

impl Drop for Demux {
    fn drop(&mut self) {
        // The mbufs go back to their pool while `queue` (whose device holds
        // the pool) is still alive: Drop runs before any field is dropped,
        // whatever the fields' order.
        self.inboxes.clear();
        self.scratch.clear();
    }
}

impl SharedQueue {
    /// Share `queue` among links.
    pub fn new(queue: PortQueue) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Demux {
                inboxes: Vec::new(),
                scratch: Vec::new(),
                queue: queue.0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Demux> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bind(&self, udp_port: u16) -> Result<(), DpdkError> {
        let mut d = self.lock();
        if d.inboxes.iter().any(|(p, _)| *p == udp_port) {
            return Err(DpdkError::UdpPortInUse {
                queue: d.queue.index(),
                udp_port,
            });
        }
        d.inboxes.push((udp_port, VecDeque::new()));
        Ok(())
    }

    fn unbind(&self, udp_port: u16) {
        self.lock().inboxes.retain(|(p, _)| *p != udp_port);
    }
}

#[derive(Debug)]
enum Access {
    Own(ffi::Queue),
    Steered(Lease),
    Shared(SharedQueue),
}

/// One reactor's [`DatagramLink`] over a DPDK queue pair; see the
/// module docs.
#[derive(Debug)]
pub struct DpdkLink {
    // Mbuf holders: `Drop` empties them while `pool` is alive, so every
    // mbuf is back in the pool before the link's handle to it goes.
    /// Committed packets the device has not taken yet, in order.
    pending: Vec<Mbuf>,
    /// The mbuf lent by the last `tx_alloc`, with the length lent.
    cur: Option<(Mbuf, usize)>,
    rx: Vec<Mbuf>,
    cfg: LinkConfig,
    /// Where the packets of each peer connection id go, when the link's
    /// connections have different peers; others go to `cfg.peer`.
    peers: HashMap<u32, UdpEndpoint>,
    mtu: usize,
    stats: DpdkLinkStats,
    /// The pool of every mbuf above: allocation, and the handle that
    /// keeps it alive until they are back.
    pool: Arc<Mempool>,
    access: Access,
    /// When a shared queue was first left unpolled for a full inbox,
    /// while it still is.
    held_since: Option<Instant>,
}

impl DpdkLink {
    /// A link owning `queue`; the datagram MTU follows from the port's MTU
    /// `port_mtu`.
    pub fn new(queue: PortQueue, port_mtu: u16, cfg: LinkConfig) -> Self {
        let pool = Arc::clone(queue.0.device().pool());
        Self::with(Access::Own(queue.0), pool, port_mtu, cfg)
    }

    /// A link on a queue shared with other links, bound to the UDP port
    /// `cfg.local.port`, which no other link of the queue may hold.
    pub fn shared(queue: &SharedQueue, port_mtu: u16, cfg: LinkConfig) -> Result<Self, DpdkError> {
        queue.bind(cfg.local.port)?;
        let pool = Arc::clone(queue.lock().queue.device().pool());
        Ok(Self::with(
            Access::Shared(queue.clone()),
            pool,
            port_mtu,
            cfg,
        ))
    }

    /// A link on a queue pair of its own leased from `set`, bound to the
    /// UDP port `cfg.local.port`, which no other link of the set may hold.
    /// The queue pair goes back to the set when the link drops.
    pub fn steered(set: &QueueSet, port_mtu: u16, cfg: LinkConfig) -> Result<Self, DpdkError> {
        let lease = set.lease(cfg.local.port)?;
        let pool = Arc::clone(set.pool());
        Ok(Self::with(Access::Steered(lease), pool, port_mtu, cfg))
    }

    fn with(access: Access, pool: Arc<Mempool>, port_mtu: u16, cfg: LinkConfig) -> Self {
        let mtu = (usize::from(port_mtu).saturating_sub(IP_UDP_OVERHEAD))
            .min(ffi::MBUF_DATA_ROOM - HEADERS_LEN);
        Self {
            pending: Vec::with_capacity(cfg.max_pending),
            cur: None,
            rx: Vec::with_capacity(usize::from(cfg.rx_burst)),
            cfg,
            peers: HashMap::new(),
            mtu,
            stats: DpdkLinkStats::default(),
            pool,
            access,
            held_since: None,
        }
    }

    /// The link's settings.
    pub fn config(&self) -> &LinkConfig {
        &self.cfg
    }

    /// Send every later datagram from `ip`, this end's address from now
    /// on (`ip_from_bootstrap` is done).
    pub fn set_local_ip(&mut self, ip: std::net::Ipv4Addr) {
        self.cfg.local.ip = ip;
        self.cfg.ip_from_bootstrap = false;
    }

    /// Send every later datagram to `peer`, unless its connection has a
    /// peer of its own ([`add_peer`](Self::add_peer)).
    pub fn set_peer(&mut self, peer: UdpEndpoint) {
        self.cfg.peer = peer;
    }

    /// Send the datagrams of our connection `local_conn` (their
    /// `src_conn`) to `peer`: the connections of one link may each have
    /// another peer. Keyed by our id, which is unique among the
    /// connections of the link's driver; the peers' ids are not (two
    /// workers' drivers both number their first connection alike). Peers
    /// are learnt in an out-of-band exchange that needs the link's
    /// connection ids first.
    pub fn add_peer(&mut self, local_conn: u32, peer: UdpEndpoint) {
        self.peers.insert(local_conn, peer);
    }

    /// Forget the peer of our connection `local_conn` (it ended).
    pub fn remove_peer(&mut self, local_conn: u32) {
        self.peers.remove(&local_conn);
    }

    /// Counters.
    pub fn stats(&self) -> DpdkLinkStats {
        self.stats
    }

    /// The index of the queue pair the link uses (`None` once a leased
    /// pair is back in its set).
    pub fn queue(&self) -> Option<u16> {
        match &self.access {
            Access::Own(q) => Some(q.index()),
            Access::Steered(l) => l.queue(),
            Access::Shared(s) => Some(s.lock().queue.index()),
        }
    }

    /// Packets committed and not yet taken by the device.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Queue the reply to `frame` if it is an ARP request for our address
    /// (and an mbuf and room in the queue are there; else the asker asks
    /// again). True when answered.
    fn answer_arp(&mut self, frame: &[u8]) -> bool {
        let local = self.cfg.local;
        let Some(reply) = ArpRepr::parse(frame)
            .ok()
            .and_then(|r| r.answer(local.mac, local.ip))
        else {
            return false;
        };
        if self.pending.len() >= self.cfg.max_pending {
            return false;
        }
        let Some(mut m) = self.pool.alloc() else {
            return false;
        };
        let len = reply.buffer_len();
        let Some(room) = m.room_mut().get_mut(..len) else {
            return false;
        };
        reply.emit(room);
        // A 60-byte frame.
        m.set_len(len as u16);
        self.pending.push(m);
        self.stats.arp_replies += 1;
        true
    }

    /// Whether a datagram to our port came from the peer of the
    /// connection it names (its `dst_conn`, our id; the link's one peer if
    /// that connection has none of its own). Only the bootstrap's peer may
    /// reach a connection: anyone else who can send to the port would
    /// otherwise only have to guess a connection id and a sequence number
    /// to inject a frame into a session whose handshake proved the token.
    /// The Ethernet address is not compared: across a router it is the
    /// router's.
    /// A payload too short to name a connection is let through: it
    /// cannot reach one, and the driver's decoder drops it.
    fn sent_by_peer(&self, repr: &UdpRepr, payload: &[u8]) -> bool {
        let Some(conn) = peek_dst_conn(payload) else {
            return true;
        };
        let peer = self.peers.get(&conn).unwrap_or(&self.cfg.peer);
        repr.src.ip == peer.ip && repr.src.port == peer.port
    }

    /// Lend each received packet in `self.rx` to `sink` if it passes the
    /// filter, answer ARP requests for our address, and free them all.
    fn lend(&mut self, sink: &mut dyn FnMut(&[u8])) -> usize {
        let mut lent = 0;
        // Taken for the pass (an ARP reply needs the link), given back
        // empty with its capacity.
        let mut rx = std::mem::take(&mut self.rx);
        for m in rx.drain(..) {
            let data = m.data();
            if m.segments() != 1 {
                self.stats.rx_malformed += 1;
                continue;
            }
            if udp::classify(data) != Some(self.cfg.local.port) {
                let arp = data.get(12..14) == Some(&ETHERTYPE_ARP.to_be_bytes()[..]);
                if !(arp && self.answer_arp(data)) {
                    self.stats.rx_filtered += 1;
                }
                continue;
            }
            match UdpRepr::parse(data) {
                Ok((repr, payload)) if self.sent_by_peer(&repr, payload) => {
                    sink(payload);
                    lent += 1;
                }
                Ok(_) => self.stats.rx_foreign += 1,
                Err(_) => self.stats.rx_malformed += 1,
            }
        }
        self.rx = rx;
        self.stats.rx_packets += lent as u64;
        lent
    }
}

impl Drop for DpdkLink {
    fn drop(&mut self) {
        // Give the link's mbufs back while `pool` (and `access`, which
        // holds the pool too) is alive: Drop runs before any field is
        // dropped, so this does not depend on the fields' order. Packets
        // committed and not sent are dropped with the link.
        self.pending.clear();
        self.cur = None;
        self.rx.clear();
        tracing::debug!(udp_port = self.cfg.local.port, stats = ?self.stats, "DPDK link closed");
        if let Access::Shared(q) = &self.access {
            q.unbind(self.cfg.local.port);
        }
    }
}

impl DatagramLink for DpdkLink {
    fn mtu(&self) -> usize {
        self.mtu
    }

    /// The connection's peer ([`add_peer`](Self::add_peer)) goes with it.
    fn forget(&mut self, local_conn: u32) {
        self.remove_peer(local_conn);
    }

    /// Lends at most the mbuf's room after the headers (at least the MTU).
    fn tx_alloc(&mut self, len: usize) -> Option<&mut [u8]> {
        if self.pending.len() >= self.cfg.max_pending {
            self.stats.tx_pending_full += 1;
            return None;
        }
        let mut m = match self.cur.take() {
            Some((m, _)) => m,
            None => match self.pool.alloc() {
                Some(m) => m,
                None => {
                    self.stats.tx_no_mbuf += 1;
                    return None;
                }
            },
        };
        let len = len.min(m.room_mut().len().saturating_sub(HEADERS_LEN));
        self.cur = Some((m, len));
        let (m, _) = self.cur.as_mut()?;
        Some(&mut m.room_mut()[HEADERS_LEN..HEADERS_LEN + len])
    }

    fn tx_commit(&mut self, len: usize) -> Result<(), LinkError> {
        let Some((mut m, allocated)) = self.cur.take() else {
            return Err(LinkError::BadCommit {
                len,
                allocated: None,
            });
        };
        if len > allocated {
            return Err(LinkError::BadCommit {
                len,
                allocated: Some(allocated),
            });
        }
        if len > self.mtu {
            return Err(LinkError::Oversized { len, mtu: self.mtu });
        }
        let room = m.room_mut();
        let dst = if self.peers.is_empty() {
            self.cfg.peer
        } else {
            peek_src_conn(&room[HEADERS_LEN..HEADERS_LEN + len])
                .and_then(|c| self.peers.get(&c).copied())
                .unwrap_or(self.cfg.peer)
        };
        let repr = UdpRepr {
            src: self.cfg.local,
            dst,
            payload_len: len,
        };
        repr.emit(room);
        // The MTU bounds len far below u16::MAX.
        m.set_len((HEADERS_LEN + len) as u16);
        self.pending.push(m);
        Ok(())
    }

    fn tx_burst_flush(&mut self, _now: Instant) -> Result<usize, LinkError> {
        if self.pending.is_empty() {
            return Ok(0);
        }
        let sent = match &mut self.access {
            Access::Own(q) => q.tx_burst(&mut self.pending),
            Access::Steered(l) => l.tx_burst(&mut self.pending),
            Access::Shared(s) => s.lock().queue.tx_burst(&mut self.pending),
        };
        self.stats.tx_bursts += 1;
        self.stats.tx_packets += sent as u64;
        if !self.pending.is_empty() {
            self.stats.tx_ring_full += 1;
        }
        Ok(sent)
    }

    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, LinkError> {
        let max = max.min(usize::from(self.cfg.rx_burst));
        if max == 0 {
            return Ok(0);
        }
        match &mut self.access {
            Access::Own(q) => {
                q.rx_burst(&mut self.rx, max as u16);
                self.stats.rx_bursts += 1;
            }
            Access::Steered(l) => l.rx(now, &mut self.rx, max, &mut self.stats),
            Access::Shared(s) => {
                let mut d = s.lock();
                let Demux {
                    inboxes,
                    scratch,
                    queue,
                } = &mut *d;
                let me = self.cfg.local.port;
                let Some(mine) = inboxes.iter().position(|(p, _)| *p == me) else {
                    return Err(LinkError::Device(format!("UDP port {me} is not bound")));
                };
                let waiting = &mut inboxes[mine].1;
                let n = max.min(waiting.len());
                self.rx.extend(waiting.drain(..n));
                let want = max.saturating_sub(self.rx.len());
                let full = inboxes
                    .iter()
                    .enumerate()
                    .any(|(i, (_, q))| i != mine && q.len() + want > INBOX_CAPACITY);
                let poll = if want == 0 {
                    false
                } else if !full {
                    self.held_since = None;
                    true
                } else if now.saturating_duration_since(*self.held_since.get_or_insert(now))
                    < HANDOVER_HOLD
                {
                    self.stats.rx_held_back += 1;
                    false
                } else {
                    true
                };
                if poll {
                    queue.rx_burst(scratch, (max - self.rx.len()) as u16);
                    self.stats.rx_bursts += 1;
                    for m in scratch.drain(..) {
                        let to = udp::classify(m.data())
                            .and_then(|p| inboxes.iter().position(|(q, _)| *q == p));
                        match to {
                            Some(i) if i == mine => self.rx.push(m),
                            Some(i) if inboxes[i].1.len() < INBOX_CAPACITY => {
                                inboxes[i].1.push_back(m);
                            }
                            Some(_) => self.stats.rx_inbox_full += 1,
                            // Not for any link: filtered below, counted once.
                            None => self.rx.push(m),
                        }
                    }
                }
            }
        }
        Ok(self.lend(sink))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::freed;
    use crate::port::{Port, PortConfig};
    use std::net::Ipv4Addr;

    fn open(port: u16) -> Port {
        let cfg = PortConfig {
            port,
            rx_desc: 128,
            tx_desc: 128,
            ..PortConfig::default()
        };
        Port::open(crate::testing::eal(), &cfg).expect("open a net_ring port")
    }

    /// A link that is the last holder of its pool gives back the packets
    /// it committed but did not send, and the one it lent, before the
    /// pool is freed: a pool freed first shows them missing.
    #[test]
    fn a_link_gives_its_mbufs_back_before_its_pool_goes() {
        let mut port = open(1);
        let size = port.mbufs();
        let ep = UdpEndpoint {
            mac: port.info().mac,
            ip: Ipv4Addr::new(198, 18, 0, 1),
            port: 7000,
        };
        let mtu = port.info().mtu;
        let queue = port.take_queue().expect("a queue pair");
        let mut link = DpdkLink::new(queue, mtu, LinkConfig::new(ep, ep));
        for i in 0..16u8 {
            link.tx_alloc(64).expect("tx_alloc")[..4].copy_from_slice(&[i; 4]);
            link.tx_commit(4).expect("tx_commit");
        }
        link.tx_alloc(64).expect("one more lent");
        assert_eq!(link.pending(), 16);
        assert_eq!(port.mbufs_available(), size - 17);
        drop(port);
        assert_eq!(freed::take("starwire_p1"), None, "the link holds the pool");
        drop(link);
        assert_eq!(
            freed::take("starwire_p1"),
            Some((size, size)),
            "every mbuf back before the pool was freed"
        );
    }

    /// A shared queue's demultiplexer that is the last holder of its
    /// queue (whose device holds the pool) gives back the packets in its
    /// inboxes and scratch before the pool is freed.
    #[test]
    fn a_demultiplexer_gives_its_mbufs_back_before_its_pool_goes() {
        let mut port = open(2);
        let size = port.mbufs();
        let queue = port.take_queue().expect("a queue pair").0;
        let pool = Arc::clone(queue.device().pool());
        let take = |n| {
            (0..n)
                .map(|_| pool.alloc().expect("an mbuf"))
                .collect::<Vec<_>>()
        };
        let demux = Demux {
            inboxes: vec![(7000, take(8).into()), (7001, take(4).into())],
            scratch: take(3),
            queue,
        };
        drop(pool);
        assert_eq!(port.mbufs_available(), size - 15);
        drop(port);
        assert_eq!(freed::take("starwire_p2"), None, "the queue holds the pool");
        drop(demux);
        assert_eq!(
            freed::take("starwire_p2"),
            Some((size, size)),
            "every mbuf back before the pool was freed"
        );
    }
}

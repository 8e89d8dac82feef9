//! A queue pair per link: how the packets of each reactor reach its
//! queue, and the software demultiplexer that hands over those that
//! arrive on another's.
//!
//! A port with a queue pair per link ([`QueueSet`]) gives each link one
//! pair, used without a lock: the link transmits on its own queue and
//! polls its own receive queue. Where the port takes `rte_flow` rules,
//! each link's UDP port is steered to its receive queue
//! ([`Steering::RteFlow`]). Where it does not ([`Steering::Software`]:
//! `net_ring`, `net_af_packet`, `net_af_xdp`, cloud vNICs), packets land
//! on whichever queue the device picks (queue 0 without RSS, the queue
//! of the sending queue on `net_ring`, a hash on `net_af_packet`'s
//! fanout); the link that polls that queue hands each packet for another
//! link's UDP port over an M:N grid of single-producer rings
//! (`starwire_queue::grid_polling`), one ring per (link, link) pair, as
//! Machnet does on vNICs without flow steering. A port with fewer queues
//! than links is [`Steering::Single`]: its links share queue 0 through
//! [`SharedQueue`](crate::SharedQueue), under a lock; or, in a process
//! that makes one link at a time, its one link leases the pair from a set
//! of one and uses it without a lock.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use starwire_datagram::udp;
use starwire_queue::{grid_polling, Consumer, Producer};

use crate::error::DpdkError;
use crate::ffi::{self, FlowRule, Mbuf, Mempool};
use crate::link::DpdkLinkStats;
use crate::port::Port;

/// Packets each ring of the grid holds. A link polls its queue only
/// while every ring it hands over to has room for the whole burst, so a
/// packet is not dropped for a peer that is slow to drain its ring
/// ([`HANDOVER_HOLD`]).
pub const HANDOVER_RING: usize = 256;

/// How long a link leaves its receive queue unpolled because another
/// bound link's ring has no room for a burst. The packets wait in the
/// device's ring instead of being dropped (a peer's reactor that the
/// scheduler has not run for a while would otherwise lose every packet
/// handed to it, acknowledgements and retransmissions included, and
/// its connections time out one after another). Past it the link polls
/// again and drops what does not fit, so a peer that never drains
/// cannot stop the links it shares a port with.
pub const HANDOVER_HOLD: Duration = Duration::from_millis(20);

/// How the packets of a port's links reach them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steering {
    /// A queue pair per link; `rte_flow` rules steer each link's UDP port
    /// to its receive queue.
    RteFlow,
    /// A queue pair per link; the link that receives a packet for another
    /// hands it over through a lock-free M:N grid of rings.
    Software,
    /// One queue pair shared by every link under a lock.
    Single,
}

impl Steering {
    /// The name in logs, `starwire info` and bench rows.
    pub fn as_str(self) -> &'static str {
        match self {
            Steering::RteFlow => "rte_flow",
            Steering::Software => "software",
            Steering::Single => "single",
        }
    }
}

impl std::fmt::Display for Steering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which steering a port with `queues` queue pairs supports, and why:
/// `rte_flow` when the driver validates a rule to its second queue.
/// Validation alone can pass where creation fails (`net_tap` checks the
/// rule in user space, then the kernel lacks the TC classifier), so
/// [`QueueSet::new`] also installs one on the started port before it
/// trusts it.
pub fn probe_steering(port: u16, queues: u16) -> (Steering, String) {
    if queues < 2 {
        return (
            Steering::Single,
            format!("{queues} queue pair: every link shares it"),
        );
    }
    match ffi::flow_validate(port, PROBE_UDP_PORT, 1) {
        Ok(()) => (
            Steering::RteFlow,
            "rte_flow_validate accepts a UDP destination port rule".to_owned(),
        ),
        Err((errno, reason)) => (
            Steering::Software,
            format!("rte_flow_validate refused a UDP rule: {reason} (errno {errno})"),
        ),
    }
}

/// The UDP port of the rule [`probe_steering`] validates and
/// [`QueueSet::new`] installs once.
const PROBE_UDP_PORT: u16 = 20_000;

/// The UDP port bound to each slot: `port + 1`, 0 when free. Read without
/// a lock by every receiving link, written under the set's lock.
#[derive(Debug)]
struct Routes(Box<[AtomicU32]>);

impl Routes {
    /// `slots` slots, none bound.
    fn new(slots: usize) -> Self {
        Self((0..slots).map(|_| AtomicU32::new(0)).collect())
    }

    /// Bind `slot` to `udp_port` (under the set's lock; the slot's inbox
    /// is empty first, so a reader that finds it hands over to the new
    /// link only what arrives from now on).
    fn bind(&self, slot: usize, udp_port: u16) {
        self.0[slot].store(u32::from(udp_port) + 1, Ordering::Release);
    }

    /// Free `slot` (under the set's lock).
    fn unbind(&self, slot: usize) {
        self.0[slot].store(0, Ordering::Release);
    }

    /// Whether a link holds `slot`.
    fn is_bound(&self, slot: usize) -> bool {
        self.0[slot].load(Ordering::Acquire) != 0
    }

    /// The slot bound to `udp_port` when its entry was read, if any. An
    /// entry is one atomic word, so a reader never sees half a binding;
    /// it may act on the slot after its link has gone and another has
    /// taken it: a packet handed over then reaches the link of another UDP
    /// port, whose filter drops it (`rx_filtered`).
    fn find(&self, udp_port: u16) -> Option<usize> {
        let want = u32::from(udp_port) + 1;
        self.0
            .iter()
            .position(|r| r.load(Ordering::Acquire) == want)
    }
}

/// One queue pair with its ends of the grid: the rings it hands packets
/// to the other slots through, and the rings it takes theirs from.
#[derive(Debug)]
struct Slot {
    /// Its place in the grid and in the routes.
    index: usize,
    handover: Producer<Mbuf>,
    inbox: Consumer<Mbuf>,
    /// Its device holds the pool of the mbufs in the rings: `Drop`
    /// empties the inbox first.
    queue: ffi::Queue,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Packets handed to this slot go back to the pool while `queue`
        // (whose device holds the pool) is alive: Drop runs before any
        // field is dropped, whatever the fields' order. A ring's packets
        // are reachable only from its consumer, and slots drop only with
        // their set (a lease gives its slot back), when no link pushes any
        // more; so once every slot has drained its inbox, no ring of the
        // grid holds an mbuf.
        self.inbox.drain(usize::MAX, drop);
    }
}

#[derive(Debug)]
struct Shared {
    free: Mutex<Vec<Slot>>,
    routes: Routes,
    steering: Steering,
    /// Why `rte_flow_create` refused the rule the driver had validated.
    rte_flow_refused: Option<String>,
    /// Slots of the set, leased or not.
    slots: usize,
    /// The port index.
    port: u16,
    /// The pool of the port's mbufs, alive as long as the set: a lease's
    /// mbufs go back to it before the lease lets go of the set.
    pool: Arc<Mempool>,
}

impl Shared {
    /// Empty a slot about to be leased of what its last holder left: the
    /// packets handed to it (for a link that is gone), and those waiting
    /// on its receive queue, which go to their links if bound, else back
    /// to the pool. A new link then starts on fresh packets.
    fn clear(&self, slot: &mut Slot) {
        let stale = slot.inbox.drain(usize::MAX, drop);
        let dropped = self.hand_over_queue(slot);
        if stale + dropped > 0 {
            tracing::debug!(
                queue = slot.queue.index(),
                stale,
                dropped,
                "packets left for a link that is gone"
            );
        }
    }

    /// Empty the receive queue of `slot`, whose link has gone or not
    /// come yet: each packet goes to the link bound to its UDP port, if
    /// any and its ring has room. Returns how many were dropped.
    fn hand_over_queue(&self, slot: &mut Slot) -> usize {
        let mut burst = Vec::new();
        let mut dropped = 0;
        while slot.queue.rx_burst(&mut burst, 32) > 0 {
            for m in burst.drain(..) {
                let to = udp::classify(m.data()).and_then(|p| self.routes.find(p));
                if let Some(i) = to {
                    if slot.handover.push_to(i, m).is_ok() {
                        continue;
                    }
                }
                dropped += 1;
            }
        }
        dropped
    }
}

/// Every queue pair of a port, each to be leased by one link; see the
/// module docs.
#[derive(Debug, Clone)]
pub struct QueueSet {
    shared: Arc<Shared>,
}

impl QueueSet {
    /// Take every queue pair left on `port` (at least two, or one with
    /// `steering` [`Steering::Single`]: a set for a process that makes one
    /// link at a time), with `steering` (from [`probe_steering`]).
    /// `rte_flow` is kept only if a rule can be created (and is destroyed
    /// at once) on the started port; else the set hands packets over in
    /// software, and [`steering`](Self::steering) says so.
    pub fn new(port: &mut Port, steering: Steering) -> Result<Self, DpdkError> {
        let mut queues = Vec::new();
        while let Some(q) = port.take_queue() {
            queues.push(q.0);
        }
        let n = queues.len();
        let port = port.info().port;
        // One pair only for a process that makes one link at a time
        // (`Single`): it leases the pair and uses it without a lock.
        if n == 0 || (n < 2 && steering != Steering::Single) {
            return Err(DpdkError::NoQueue { port });
        }
        let mut steering = steering;
        let mut rte_flow_refused = None;
        if steering == Steering::RteFlow {
            if let Err((errno, reason)) = FlowRule::create(queues[1].device(), PROBE_UDP_PORT, 1) {
                tracing::warn!(port, errno, %reason,
                    "rte_flow_validate accepted a UDP rule but rte_flow_create refused it; \
                     packets are handed over in software");
                steering = Steering::Software;
                rte_flow_refused = Some(format!("{reason} (errno {errno})"));
            }
        }
        let pool = Arc::clone(queues[0].device().pool());
        let (producers, consumers) = grid_polling(n, n, HANDOVER_RING);
        let free: Vec<Slot> = producers
            .into_iter()
            .zip(consumers)
            .zip(queues)
            .enumerate()
            .map(|(index, ((handover, inbox), queue))| Slot {
                index,
                handover,
                inbox,
                queue,
            })
            .rev()
            .collect();
        Ok(Self {
            shared: Arc::new(Shared {
                free: Mutex::new(free),
                routes: Routes::new(n),
                steering,
                rte_flow_refused,
                slots: n,
                port,
                pool,
            }),
        })
    }

    /// How packets reach the links of the set.
    pub fn steering(&self) -> Steering {
        self.shared.steering
    }

    /// Why the set is `software` although the driver validated a rule:
    /// `rte_flow_create`'s error on the started port.
    pub fn rte_flow_refused(&self) -> Option<&str> {
        self.shared.rte_flow_refused.as_deref()
    }

    /// Queue pairs in the set.
    pub fn queues(&self) -> usize {
        self.shared.slots
    }

    pub(crate) fn pool(&self) -> &Arc<Mempool> {
        &self.shared.pool
    }

    /// Queue pairs no link holds.
    pub fn free(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.shared.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lease a queue pair to the link bound to `udp_port`.
    pub(crate) fn lease(&self, udp_port: u16) -> Result<Lease, DpdkError> {
        let mut free = self.lock();
        if let Some(i) = self.shared.routes.find(udp_port) {
            return Err(DpdkError::UdpPortInUse {
                queue: i as u16,
                udp_port,
            });
        }
        let Some(mut slot) = free.pop() else {
            return Err(DpdkError::QueuesTaken {
                port: self.shared.port,
                queues: self.shared.slots,
            });
        };
        self.shared.clear(&mut slot);
        let queue = slot.queue.index();
        let flow = match self.shared.steering {
            Steering::RteFlow => match FlowRule::create(slot.queue.device(), udp_port, queue) {
                Ok(f) => Some(f),
                // The software hand-over still delivers what lands elsewhere.
                Err((errno, reason)) => {
                    tracing::warn!(udp_port, queue, errno, %reason,
                        "rte_flow_create failed; this link's packets are handed over in software");
                    None
                }
            },
            _ => None,
        };
        self.shared.routes.bind(slot.index, udp_port);
        Ok(Lease {
            slot: Some(slot),
            flow,
            set: Arc::clone(&self.shared),
            udp_port,
            scratch: Vec::new(),
            held_since: None,
        })
    }
}

/// A queue pair held by one link; it goes back to its set on drop.
#[derive(Debug)]
pub(crate) struct Lease {
    scratch: Vec<Mbuf>,
    /// Destroyed before the slot goes back.
    flow: Option<FlowRule>,
    slot: Option<Slot>,
    set: Arc<Shared>,
    udp_port: u16,
    /// When the queue was first left unpolled for a full ring, while it
    /// still is.
    held_since: Option<Instant>,
}

impl Lease {
    /// The queue pair's index on the port.
    pub(crate) fn queue(&self) -> Option<u16> {
        self.slot.as_ref().map(|s| s.queue.index())
    }

    /// One `rte_eth_tx_burst` on the leased queue (the lease holds its
    /// slot from creation until it drops).
    pub(crate) fn tx_burst(&mut self, pkts: &mut Vec<Mbuf>) -> usize {
        self.slot.as_mut().map_or(0, |s| s.queue.tx_burst(pkts))
    }

    /// Up to `max` packets for this link into `out`: some of those other
    /// links handed over, one `rte_eth_rx_burst` of the leased queue, whose
    /// packets for other links' UDP ports go to their rings, then more of
    /// the handed-over ones if room is left. The handed-over packets take
    /// at most half a burst before the queue is polled, so neither source
    /// starves the other (a link whose inbox stays full still polls the
    /// queue its peers' packets arrive on). The queue is left unpolled
    /// while a bound link's ring lacks room for the burst, for at most
    /// [`HANDOVER_HOLD`] at `now`. Packets for no link stay in `out`, for
    /// the link's filter to count.
    pub(crate) fn rx(
        &mut self,
        now: Instant,
        out: &mut Vec<Mbuf>,
        max: usize,
        stats: &mut DpdkLinkStats,
    ) {
        let me = self.udp_port;
        let Self {
            scratch,
            slot,
            set,
            held_since,
            ..
        } = self;
        let Some(slot) = slot.as_mut() else { return };
        if set.slots == 1 {
            // The only pair of the set: nothing to hand over or in.
            slot.queue.rx_burst(out, max as u16);
            stats.rx_bursts += 1;
            return;
        }
        let start = out.len();
        let handed_in = slot.inbox.pop_batch(out, max.div_ceil(2));
        let mut room = max.saturating_sub(handed_in);
        if room > 0 {
            let full = (0..set.slots).any(|i| {
                i != slot.index && set.routes.is_bound(i) && !slot.handover.has_room(i, room)
            });
            if !full {
                *held_since = None;
            } else if now.saturating_duration_since(*held_since.get_or_insert(now)) < HANDOVER_HOLD
            {
                stats.rx_held_back += 1;
                room = 0;
            }
        }
        if room > 0 {
            slot.queue.rx_burst(scratch, room as u16);
            stats.rx_bursts += 1;
        }
        for m in scratch.drain(..) {
            let to = match udp::classify(m.data()) {
                Some(p) if p != me => set.routes.find(p),
                _ => None,
            };
            match to {
                Some(i) => match slot.handover.push_to(i, m) {
                    Ok(()) => stats.rx_handed_over += 1,
                    Err(m) => {
                        drop(m);
                        stats.rx_inbox_full += 1;
                    }
                },
                None => out.push(m),
            }
        }
        let more = max.saturating_sub(out.len() - start);
        let handed_in = handed_in + slot.inbox.pop_batch(out, more.min(max - handed_in));
        stats.rx_handed_in += handed_in as u64;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Back to the pool while `set` (which holds it) is alive, whatever
        // the fields' order.
        self.scratch.clear();
        drop(self.flow.take());
        if let Some(mut slot) = self.slot.take() {
            let mut free = self.set.free.lock().unwrap_or_else(|e| e.into_inner());
            self.set.routes.unbind(slot.index);
            // What waits on the queue goes to the links still bound, now
            // that nobody polls it: on `net_ring` a link's last packets
            // (the acknowledgement of its peer's `Goodbye`) land on its
            // own queue, and the peer would retransmit into the void.
            let dropped = self.set.hand_over_queue(&mut slot);
            if dropped > 0 {
                tracing::debug!(
                    queue = slot.queue.index(),
                    dropped,
                    "packets on the queue of a departing link for no link"
                );
            }
            free.push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::freed;
    use crate::link::{DpdkLink, LinkConfig};
    use crate::port::PortConfig;
    use starwire_datagram::udp::UdpEndpoint;
    use starwire_datagram::DatagramLink;
    use std::collections::VecDeque;
    use std::net::Ipv4Addr;
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::thread;

    /// Slots of the routes stress test: the first and the last stay
    /// bound, the others are bound and freed over and over.
    const SLOTS: usize = 8;
    /// Ports bound for good, at slot 0 and at the last slot.
    const STABLE: [(u16, usize); 2] = [(1000, 0), (2000, SLOTS - 1)];
    /// Ports never bound.
    const NEVER: [u16; 2] = [500, 65_534];

    /// The only slot a churning port is ever bound to (1..=6); port 0
    /// among them, whose entry (1) must never read as a free slot (0).
    fn home(udp_port: u16) -> usize {
        usize::from(udp_port % 6) + 1
    }

    fn churning() -> Vec<u16> {
        (0..12).chain([65_535]).collect()
    }

    /// One thread binds and frees slots, as leases and their drops do,
    /// while others look ports up, as receiving links do: a stable port
    /// is always found at its slot, a port never bound never is, and a
    /// churning port is found nowhere but at the one slot it is bound to.
    #[test]
    fn routes_stay_whole_while_slots_are_bound_and_freed() {
        let routes = Routes::new(SLOTS);
        for (p, slot) in STABLE {
            routes.bind(slot, p);
        }
        let done = AtomicBool::new(false);
        thread::scope(|s| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let (mut found, mut missed) = (0u64, 0u64);
                        while !done.load(Ordering::Relaxed) {
                            for (p, slot) in STABLE {
                                assert_eq!(routes.find(p), Some(slot), "stable port {p}");
                            }
                            for p in NEVER {
                                assert_eq!(routes.find(p), None, "port {p} was never bound");
                            }
                            for p in churning() {
                                match routes.find(p) {
                                    Some(i) => {
                                        assert_eq!(i, home(p), "port {p} found at slot {i}");
                                        found += 1;
                                    }
                                    None => missed += 1,
                                }
                            }
                        }
                        (found, missed)
                    })
                })
                .collect();
            // A fixed xorshift sequence picks the slot and port of each step.
            let mut x = 0x9e37_79b9_u32;
            let mut bound: [Option<u16>; SLOTS] = [None; SLOTS];
            for _ in 0..300_000 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let slot = 1 + (x as usize % (SLOTS - 2));
                if bound[slot].take().is_some() {
                    routes.unbind(slot);
                } else {
                    let ports: Vec<u16> = churning()
                        .into_iter()
                        .filter(|&p| home(p) == slot)
                        .collect();
                    let p = ports[(x >> 8) as usize % ports.len()];
                    routes.bind(slot, p);
                    bound[slot] = Some(p);
                }
            }
            done.store(true, Ordering::Relaxed);
            for r in readers {
                let (found, missed) = r.join().expect("a reader panicked");
                assert!(found > 0 && missed > 0, "found {found}, missed {missed}");
            }
        });
    }

    fn open(port: u16, queues: u16) -> Port {
        let cfg = PortConfig {
            port,
            queues,
            rx_desc: 128,
            tx_desc: 128,
            ..PortConfig::default()
        };
        let port = Port::open(crate::testing::eal(), &cfg).expect("open a net_ring port");
        assert_eq!(port.queues(), queues);
        port
    }

    fn endpoint(port: &Port, udp: u16) -> UdpEndpoint {
        UdpEndpoint {
            mac: port.info().mac,
            ip: Ipv4Addr::new(198, 18, 0, 1),
            port: udp,
        }
    }

    /// Packets handed over to a link that is gone stay in its slot's
    /// ring until the set drops; they go back to the pool before the pool
    /// is freed.
    #[test]
    fn a_set_gives_handed_over_mbufs_back_before_its_pool_goes() {
        let mut port = open(3, 2);
        let size = port.mbufs();
        let set = QueueSet::new(&mut port, Steering::Software).expect("queue set");
        let mtu = port.info().mtu;
        let (ea, eb) = (endpoint(&port, 7500), endpoint(&port, 7501));
        let mut a = DpdkLink::steered(&set, mtu, LinkConfig::new(ea, eb)).expect("link a");
        let b = DpdkLink::steered(&set, mtu, LinkConfig::new(eb, ea)).expect("link b");
        let now = Instant::now();
        for i in 0..8u8 {
            a.tx_alloc(16).expect("tx_alloc")[..16].copy_from_slice(&[i; 16]);
            a.tx_commit(16).expect("tx_commit");
        }
        assert_eq!(a.tx_burst_flush(now).expect("flush"), 8);
        // net_ring brings them back on a's queue: a hands them to b.
        let mut lent = 0;
        for _ in 0..10 {
            a.rx_burst(now, 32, &mut |_| lent += 1).expect("rx_burst");
        }
        assert_eq!((lent, a.stats().rx_handed_over), (0, 8));
        drop(b);
        drop(a);
        assert_eq!(port.mbufs_available(), size - 8, "8 in b's ring");
        drop(port);
        assert_eq!(freed::take("starwire_p3"), None, "the set holds the pool");
        drop(set);
        assert_eq!(
            freed::take("starwire_p3"),
            Some((size, size)),
            "every mbuf back before the pool was freed"
        );
    }

    /// A link that goes leaves no packet for a link still bound on its
    /// queue: net_ring brings a's packets for b back on a's queue, and a
    /// drops before it polls it (a reactor that stops right after the
    /// burst with its last acknowledgement); b receives them all.
    #[test]
    fn a_departing_link_hands_over_what_waits_on_its_queue() {
        let mut port = open(5, 2);
        let set = QueueSet::new(&mut port, Steering::Software).expect("queue set");
        let mtu = port.info().mtu;
        let (ea, eb) = (endpoint(&port, 7600), endpoint(&port, 7601));
        let mut a = DpdkLink::steered(&set, mtu, LinkConfig::new(ea, eb)).expect("link a");
        let mut b = DpdkLink::steered(&set, mtu, LinkConfig::new(eb, ea)).expect("link b");
        let now = Instant::now();
        for seq in 0..8 {
            let p = payload(seq, 0, 7601);
            a.tx_alloc(p.len()).expect("tx_alloc")[..p.len()].copy_from_slice(&p);
            a.tx_commit(p.len()).expect("tx_commit");
        }
        assert_eq!(a.tx_burst_flush(now).expect("flush"), 8);
        drop(a);
        let mut got = Vec::new();
        b.rx_burst(now, 32, &mut |p| {
            got.push(u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
        })
        .expect("rx_burst");
        assert_eq!(got, (0..8).collect::<Vec<_>>());
        assert_eq!(b.stats().rx_handed_in, 8);
    }

    /// The payload of the churn test: a sequence number, a `dst_conn` the
    /// receiver has no peer of its own for, the `src_conn` the sender
    /// picks the destination by, and the destination's UDP port.
    fn payload(seq: u32, to_conn: u32, to_port: u16) -> [u8; 14] {
        let mut p = [0; 14];
        p[..4].copy_from_slice(&seq.to_le_bytes());
        p[8..12].copy_from_slice(&to_conn.to_le_bytes());
        p[12..].copy_from_slice(&to_port.to_le_bytes());
        p
    }

    /// Links lease and give back queue pairs of a set (binding and
    /// freeing routes) on one thread while another link receives on its
    /// own thread what a third hands over to it by those routes: the
    /// receiver gets its packets in order, none twice, none another's,
    /// and none lost but those the hand-over counted as dropped.
    #[test]
    fn links_come_and_go_while_another_receives() {
        const R: u16 = 7300;
        const S: u16 = 7301;
        const CHURN: u16 = 7400;
        const ROUNDS: u32 = 1500;
        const PER_ROUND: u32 = 16;
        let mut port = open(4, 4);
        let set = QueueSet::new(&mut port, Steering::Software).expect("queue set");
        let mtu = port.info().mtu;
        let ep = |udp| endpoint(&port, udp);
        let mut r = DpdkLink::steered(&set, mtu, LinkConfig::new(ep(R), ep(S))).expect("r");
        let mut s = DpdkLink::steered(&set, mtu, LinkConfig::new(ep(S), ep(R))).expect("s");
        // Conn 0 is r; conn 1 + k is the churning link of UDP port CHURN + k.
        for k in 0..8 {
            s.add_peer(1 + u32::from(k), ep(CHURN + k));
        }
        let sending = &AtomicBool::new(true);
        let churned = &AtomicUsize::new(0);
        let eal = crate::testing::eal();
        let (received, r) = thread::scope(|sc| {
            let receiver = sc.spawn(move || {
                eal.register_thread().expect("lcore");
                let mut next = 0u32;
                let mut idle = 0;
                // Idle polls are counted from the first that follows the
                // end of sending: those before it may precede s's last
                // hand-over.
                let mut ended = false;
                loop {
                    if !ended && !sending.load(Ordering::Acquire) {
                        ended = true;
                        idle = 0;
                    } else if ended && idle >= 1000 {
                        break;
                    }
                    let n = r
                        .rx_burst(Instant::now(), 32, &mut |p| {
                            assert_eq!(p.len(), 14);
                            assert_eq!(u16::from_le_bytes([p[12], p[13]]), R, "another's");
                            let seq = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
                            assert!(seq >= next, "{seq} after {next}: twice or reordered");
                            next = seq + 1;
                        })
                        .expect("rx_burst");
                    idle = if n == 0 { idle + 1 } else { 0 };
                }
                (r.stats().rx_packets, r)
            });
            sc.spawn(|| {
                eal.register_thread().expect("lcore");
                let mut held: VecDeque<DpdkLink> = VecDeque::new();
                let mut i = 0u16;
                while sending.load(Ordering::Relaxed) {
                    let udp = CHURN + i % 8;
                    i = i.wrapping_add(1);
                    let cfg = LinkConfig::new(ep(udp), ep(S));
                    match DpdkLink::steered(&set, mtu, cfg) {
                        Ok(mut l) => {
                            l.rx_burst(Instant::now(), 32, &mut |p| {
                                assert_eq!(u16::from_le_bytes([p[12], p[13]]), udp);
                            })
                            .expect("rx_burst");
                            held.push_back(l);
                            churned.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(DpdkError::QueuesTaken { .. }) => {}
                        Err(e) => panic!("lease of {udp}: {e}"),
                    }
                    if held.len() == 2 {
                        drop(held.pop_front());
                    }
                }
            });
            let mut seq = 0;
            let mut other = 0u32;
            for _ in 0..ROUNDS {
                for _ in 0..PER_ROUND {
                    let p = payload(seq, 0, R);
                    seq += 1;
                    s.tx_alloc(p.len()).expect("tx_alloc")[..p.len()].copy_from_slice(&p);
                    s.tx_commit(p.len()).expect("tx_commit");
                }
                for _ in 0..4 {
                    let k = other % 8;
                    other += 1;
                    let p = payload(other, 1 + k, CHURN + k as u16);
                    s.tx_alloc(p.len()).expect("tx_alloc")[..p.len()].copy_from_slice(&p);
                    s.tx_commit(p.len()).expect("tx_commit");
                }
                while s.pending() > 0 {
                    s.tx_burst_flush(Instant::now()).expect("flush");
                    s.rx_burst(Instant::now(), 32, &mut |_| panic!("nothing is for s"))
                        .expect("rx_burst");
                }
                for _ in 0..2 {
                    s.rx_burst(Instant::now(), 32, &mut |_| panic!("nothing is for s"))
                        .expect("rx_burst");
                }
            }
            // What is left in s's queue: s holds its queue back while r's
            // ring is full (up to HANDOVER_HOLD at a time, counted in
            // rx_held_back), and r's thread may not run for a while on a
            // loaded host, so a number of polls could all fall in holds.
            // net_ring delivers at once: the queue is empty when a poll
            // that was not held back takes nothing from it.
            let polled = |st: &DpdkLinkStats| {
                st.rx_handed_over + st.rx_filtered + st.rx_inbox_full + st.rx_held_back
            };
            loop {
                let before = polled(&s.stats());
                s.rx_burst(Instant::now(), 32, &mut |_| panic!("nothing is for s"))
                    .expect("rx_burst");
                if polled(&s.stats()) == before {
                    break;
                }
            }
            sending.store(false, Ordering::Release);
            receiver.join().expect("the receiver panicked")
        });
        let sent = u64::from(ROUNDS * PER_ROUND);
        let st = r.stats();
        assert_eq!((st.rx_filtered, st.rx_foreign, st.rx_malformed), (0, 0, 0));
        let dropped = s.stats().rx_inbox_full;
        assert!(
            received <= sent && received + dropped >= sent,
            "sent {sent}, received {received}, dropped in hand-over {dropped}"
        );
        assert!(churned.load(Ordering::Relaxed) > 10, "links came and went");
    }
}

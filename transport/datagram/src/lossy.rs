//! [`LossyLink`]: an in-memory datagram link that loses, duplicates,
//! reorders and corrupts packets, deterministically per seed.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::faults::{check_rates, Faults, TxBuf};
use crate::link::{DatagramLink, LinkError};

/// How a [`LossyLink`] pair mistreats packets. Rates are probabilities in
/// `[0, 1]`, applied independently per packet and direction.
#[derive(Debug, Clone, PartialEq)]
pub struct LossConfig {
    /// Largest packet; committing a longer one fails with
    /// [`LinkError::Oversized`].
    pub mtu: usize,
    /// Probability that a packet is lost.
    pub loss: f64,
    /// Probability that a (not lost) packet is delivered twice.
    pub duplicate: f64,
    /// Probability that a packet copy is held back and released after
    /// `1..=reorder_depth` later packets (or `reorder_hold` of time).
    pub reorder: f64,
    /// Most later packets a held packet is released after.
    pub reorder_depth: u32,
    /// Time after which a held packet is released even if no later packet
    /// came (so a reordered tail is not held forever).
    pub reorder_hold: Duration,
    /// Probability that a packet copy has 1 to 3 random bits flipped.
    pub corrupt: f64,
    /// Packets in flight per direction (queued plus held); beyond it the link
    /// drops, like a full NIC ring.
    pub queue_capacity: usize,
    /// Packets committed per burst; beyond it `tx_alloc` returns `None`
    /// until [`DatagramLink::tx_burst_flush`].
    pub tx_ring: usize,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self::lossless(1500)
    }
}

impl LossConfig {
    /// A perfect link with the given MTU.
    pub fn lossless(mtu: usize) -> Self {
        Self {
            mtu,
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_depth: 8,
            reorder_hold: Duration::from_micros(200),
            corrupt: 0.0,
            queue_capacity: 4096,
            tx_ring: 64,
        }
    }
}

/// Per-direction counters of a [`LossyLink`] pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// `tx_burst_flush` calls that handed packets to the wire.
    pub bursts: u64,
    /// Packets handed to the wire by `tx_burst_flush`.
    pub sent: u64,
    /// Commits refused for exceeding the MTU.
    pub oversized: u64,
    /// Packets lost.
    pub lost: u64,
    /// Packet copies dropped because the in-flight queue was full.
    pub dropped_full: u64,
    /// Packets duplicated.
    pub duplicated: u64,
    /// Packet copies held back and released out of order.
    pub reordered: u64,
    /// Packet copies corrupted.
    pub corrupted: u64,
    /// Packet copies lent to the receiver.
    pub delivered: u64,
}

#[derive(Debug)]
struct Direction {
    queue: VecDeque<Vec<u8>>,
    faults: Faults,
    stats: LinkStats,
}

impl Direction {
    fn new(seed: u64) -> Self {
        Self {
            queue: VecDeque::new(),
            faults: Faults::new(seed),
            stats: LinkStats::default(),
        }
    }

    fn transmit(&mut self, cfg: &LossConfig, pkt: Vec<u8>, now: Instant) {
        self.stats.sent += 1;
        let release_at = Some(now + cfg.reorder_hold);
        self.faults
            .transmit(cfg, pkt, release_at, cfg.queue_capacity, &mut self.queue);
    }

    /// The counters, with what the fault draw did.
    fn stats(&self) -> LinkStats {
        let f = self.faults.faulted;
        LinkStats {
            lost: f.lost,
            dropped_full: f.dropped_full,
            duplicated: f.duplicated,
            reordered: f.reordered,
            corrupted: f.corrupted,
            ..self.stats
        }
    }
}

#[derive(Debug)]
struct Wire {
    cfg: LossConfig,
    dirs: [Direction; 2],
}

/// One end of an in-memory lossy datagram link; see [`LossyLink::pair`].
///
/// Both ends share the wire behind a mutex, so the ends may live on
/// different threads, but the simulation is deterministic (for a seed)
/// only when the two ends are driven in a deterministic order, as the
/// tests do from one thread.
pub struct LossyLink {
    side: usize,
    wire: Arc<Mutex<Wire>>,
    mtu: usize,
    tx_ring: usize,
    tx: TxBuf,
    staged: Vec<Vec<u8>>,
    oversized: u64,
    rx_tmp: Vec<Vec<u8>>,
}

impl fmt::Debug for LossyLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LossyLink")
            .field("side", &self.side)
            .field("mtu", &self.mtu)
            .field("staged", &self.staged.len())
            .finish_non_exhaustive()
    }
}

fn lock(wire: &Mutex<Wire>) -> MutexGuard<'_, Wire> {
    wire.lock().unwrap_or_else(|e| e.into_inner())
}

impl LossyLink {
    /// A connected pair of ends. Everything random is drawn from `seed`.
    ///
    /// # Panics
    /// If a rate is outside `[0, 1]`, or `mtu`, `queue_capacity` or
    /// `tx_ring` is zero.
    pub fn pair(cfg: LossConfig, seed: u64) -> (Self, Self) {
        check_rates(&cfg);
        assert!(cfg.mtu > 0 && cfg.queue_capacity > 0 && cfg.tx_ring > 0);
        let (mtu, tx_ring) = (cfg.mtu, cfg.tx_ring);
        let wire = Arc::new(Mutex::new(Wire {
            cfg,
            dirs: [
                Direction::new(seed ^ 0x5eed_0000_a2b0_0001),
                Direction::new(seed.rotate_left(17) ^ 0x5eed_0000_b2a0_0002),
            ],
        }));
        let end = |side| Self {
            side,
            wire: Arc::clone(&wire),
            mtu,
            tx_ring,
            tx: TxBuf::default(),
            staged: Vec::new(),
            oversized: 0,
            rx_tmp: Vec::new(),
        };
        (end(0), end(1))
    }

    fn lock(&self) -> MutexGuard<'_, Wire> {
        lock(&self.wire)
    }

    /// Counters of the direction from this end to its peer.
    pub fn tx_stats(&self) -> LinkStats {
        let mut s = self.lock().dirs[self.side].stats();
        s.oversized = self.oversized;
        s
    }

    /// Packets waiting to be received at this end right now (not counting
    /// held-back ones).
    pub fn rx_queued(&self) -> usize {
        self.lock().dirs[1 - self.side].queue.len()
    }

    /// Packets in flight toward this end, held-back ones included.
    pub fn rx_in_flight(&self) -> usize {
        let w = self.lock();
        let d = &w.dirs[1 - self.side];
        d.queue.len() + d.faults.held()
    }

    /// When the earliest held-back packet toward this end is released by
    /// time, if any is held.
    pub fn rx_next_release(&self) -> Option<Instant> {
        self.lock().dirs[1 - self.side].faults.next_release()
    }

    /// Change the loss rate of both directions (e.g. to cut the link).
    ///
    /// # Panics
    /// If `loss` is outside `[0, 1]`.
    pub fn set_loss(&self, loss: f64) {
        assert!((0.0..=1.0).contains(&loss));
        self.lock().cfg.loss = loss;
    }
}

impl DatagramLink for LossyLink {
    fn mtu(&self) -> usize {
        self.mtu
    }

    fn tx_alloc(&mut self, len: usize) -> Option<&mut [u8]> {
        if self.staged.len() >= self.tx_ring {
            return None;
        }
        Some(self.tx.lend(len))
    }

    fn tx_commit(&mut self, len: usize) -> Result<(), LinkError> {
        let pkt = self.tx.commit(len, self.mtu).inspect_err(|e| {
            if matches!(e, LinkError::Oversized { .. }) {
                self.oversized += 1;
            }
        })?;
        self.staged.push(pkt);
        Ok(())
    }

    fn tx_burst_flush(&mut self, now: Instant) -> Result<usize, LinkError> {
        let n = self.staged.len();
        if n == 0 {
            return Ok(0);
        }
        let mut guard = lock(&self.wire);
        let w = &mut *guard;
        w.dirs[self.side].stats.bursts += 1;
        for pkt in self.staged.drain(..) {
            w.dirs[self.side].transmit(&w.cfg, pkt, now);
        }
        Ok(n)
    }

    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, LinkError> {
        {
            let mut w = lock(&self.wire);
            let hold = w.cfg.reorder_hold;
            let d = &mut w.dirs[1 - self.side];
            d.faults.release_due(now, hold, &mut d.queue);
            let n = max.min(d.queue.len());
            self.rx_tmp.extend(d.queue.drain(..n));
            d.stats.delivered += n as u64;
        }
        let n = self.rx_tmp.len();
        for pkt in self.rx_tmp.drain(..) {
            sink(&pkt);
            self.tx.recycle(pkt);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(l: &mut LossyLink, bytes: &[u8]) {
        l.tx_alloc(bytes.len()).unwrap().copy_from_slice(bytes);
        l.tx_commit(bytes.len()).unwrap();
    }

    fn recv_all(l: &mut LossyLink, now: Instant) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        l.rx_burst(now, usize::MAX, &mut |p| out.push(p.to_vec()))
            .unwrap();
        out
    }

    #[test]
    fn lossless_delivers_in_order_both_ways() {
        let (mut a, mut b) = LossyLink::pair(LossConfig::lossless(100), 1);
        let now = Instant::now();
        for i in 0..10u8 {
            send(&mut a, &[i; 10]);
            send(&mut b, &[100 + i; 3]);
        }
        assert_eq!(b.rx_queued(), 0, "nothing moves before the burst");
        assert_eq!(a.tx_burst_flush(now).unwrap(), 10);
        assert_eq!(b.tx_burst_flush(now).unwrap(), 10);
        assert_eq!(a.tx_burst_flush(now).unwrap(), 0);
        assert_eq!(a.tx_stats().bursts, 1, "an empty flush is no burst");
        let at_b = recv_all(&mut b, now);
        let at_a = recv_all(&mut a, now);
        assert_eq!(at_b, (0..10u8).map(|i| vec![i; 10]).collect::<Vec<_>>());
        assert_eq!(
            at_a,
            (0..10u8).map(|i| vec![100 + i; 3]).collect::<Vec<_>>()
        );
    }

    #[test]
    fn oversized_packet_is_an_error_and_not_sent() {
        let (mut a, mut b) = LossyLink::pair(LossConfig::lossless(64), 1);
        assert!(a.tx_alloc(65).is_some());
        assert!(matches!(
            a.tx_commit(65),
            Err(LinkError::Oversized { len: 65, mtu: 64 })
        ));
        assert!(matches!(a.tx_commit(1), Err(LinkError::BadCommit { .. })));
        send(&mut a, &[1; 64]);
        a.tx_burst_flush(Instant::now()).unwrap();
        assert_eq!(recv_all(&mut b, Instant::now()), vec![vec![1; 64]]);
        assert_eq!(a.tx_stats().oversized, 1);
    }

    #[test]
    fn tx_ring_and_queue_capacity_bound() {
        let cfg = LossConfig {
            tx_ring: 4,
            queue_capacity: 6,
            ..LossConfig::lossless(64)
        };
        let (mut a, mut b) = LossyLink::pair(cfg, 1);
        let now = Instant::now();
        for round in 0..2u8 {
            for i in 0..4u8 {
                send(&mut a, &[round * 10 + i]);
            }
            assert!(a.tx_alloc(1).is_none(), "tx ring full");
            a.tx_burst_flush(now).unwrap();
        }
        let got = recv_all(&mut b, now);
        assert_eq!(
            got,
            vec![vec![0], vec![1], vec![2], vec![3], vec![10], vec![11]]
        );
        assert_eq!(a.tx_stats().dropped_full, 2);
    }

    fn run(cfg: &LossConfig, seed: u64) -> (Vec<Vec<u8>>, LinkStats) {
        let (mut a, mut b) = LossyLink::pair(cfg.clone(), seed);
        let t0 = Instant::now();
        let mut got = Vec::new();
        for i in 0..2000u32 {
            send(&mut a, &i.to_le_bytes());
            a.tx_burst_flush(t0).unwrap();
            if i % 7 == 0 {
                got.extend(recv_all(&mut b, t0));
            }
        }
        got.extend(recv_all(&mut b, t0 + Duration::from_secs(1)));
        (got, a.tx_stats())
    }

    #[test]
    fn impairments_happen_and_are_deterministic_per_seed() {
        let cfg = LossConfig {
            loss: 0.1,
            duplicate: 0.1,
            reorder: 0.1,
            corrupt: 0.05,
            ..LossConfig::lossless(64)
        };
        let (got, st) = run(&cfg, 42);
        assert_eq!(run(&cfg, 42), (got.clone(), st), "same seed, same run");
        assert_ne!(run(&cfg, 43).0, got, "another seed, another run");
        assert!(st.lost > 100 && st.lost < 300, "{st:?}");
        assert!(
            st.duplicated > 100 && st.reordered > 100 && st.corrupted > 50,
            "{st:?}"
        );
        assert_eq!(st.delivered as usize, got.len());
        assert_eq!(
            st.sent - st.lost + st.duplicated,
            st.delivered,
            "every copy not lost arrives once the holds are released"
        );
        // Reordering is visible: some intact packet arrives after a later one.
        let seqs: Vec<u32> = got
            .iter()
            .filter(|p| p.len() == 4)
            .map(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]))
            .filter(|&s| s < 2000)
            .collect();
        assert!(seqs.windows(2).any(|w| w[1] < w[0]));
        // Corruption is visible: some packet is not one that was sent.
        let sent: std::collections::HashSet<_> = (0..2000u32).map(|i| i.to_le_bytes()).collect();
        assert!(got
            .iter()
            .any(|p| !sent.contains(&[p[0], p[1], p[2], p[3]])));
    }
}

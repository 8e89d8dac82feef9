//! [`Impaired`]: a fault injector under any [`DatagramLink`], for tests of
//! the reliability core over a real device (the host kernel has no netem).
//!
//! Like smoltcp's `phy::FaultInjector`: it sits between the driver and the
//! link and mistreats what the driver sends, deterministically per seed,
//! with the rates of a [`LossConfig`] (loss, duplication, reordering,
//! corruption). Receive passes through untouched; wrap both ends to
//! impair both directions.
//!
//! The driver writes each packet into a buffer of the injector, which
//! copies it into the link's own buffer when the packet leaves (twice if
//! duplicated, later if held back): a copy per packet the fast path would
//! not make, the price of being able to hold and repeat packets.

use std::collections::VecDeque;
use std::time::Instant;

use crate::faults::{check_rates, Faults, TxBuf};
use crate::link::{DatagramLink, LinkError};
use crate::lossy::LossConfig;

/// Packets committed and not yet handed to the inner link, at most; then
/// `tx_alloc` refuses until a flush.
const MAX_QUEUED: usize = 256;

/// What an [`Impaired`] link did to the packets committed to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImpairStats {
    /// Packets committed.
    pub committed: u64,
    /// Packets dropped.
    pub lost: u64,
    /// Packets sent twice.
    pub duplicated: u64,
    /// Packet copies held back and sent after later ones.
    pub reordered: u64,
    /// Packet copies with 1 to 3 bits flipped.
    pub corrupted: u64,
}

/// A [`DatagramLink`] that loses, duplicates, reorders and corrupts the
/// packets sent through it before `inner` sends them; see the module docs.
/// A held packet is released after `reorder_depth` later ones at most, or
/// `reorder_hold` after the first flush that held it.
#[derive(Debug)]
pub struct Impaired<L> {
    inner: L,
    cfg: LossConfig,
    faults: Faults,
    tx: TxBuf,
    /// Packets to hand to the inner link, in order.
    queued: VecDeque<Vec<u8>>,
    stats: ImpairStats,
}

impl<L: DatagramLink> Impaired<L> {
    /// Impair what is sent over `inner` with the rates of `cfg` (its
    /// `mtu`, `queue_capacity` and `tx_ring` are not used: the inner link
    /// has its own), drawing from `seed`.
    ///
    /// # Panics
    /// If a rate is outside `[0, 1]`.
    pub fn new(inner: L, cfg: LossConfig, seed: u64) -> Self {
        check_rates(&cfg);
        Self {
            inner,
            cfg,
            faults: Faults::new(seed ^ 0x1a9a_17ed_0000_0001),
            tx: TxBuf::default(),
            queued: VecDeque::new(),
            stats: ImpairStats::default(),
        }
    }

    /// The link underneath.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// The link underneath, mutably.
    pub fn inner_mut(&mut self) -> &mut L {
        &mut self.inner
    }

    /// What was done so far.
    pub fn stats(&self) -> ImpairStats {
        let f = self.faults.faulted;
        ImpairStats {
            lost: f.lost,
            duplicated: f.duplicated,
            reordered: f.reordered,
            corrupted: f.corrupted,
            ..self.stats
        }
    }

    /// Hand queued packets to the inner link until it has no buffer.
    fn drain(&mut self) -> Result<(), LinkError> {
        while let Some(pkt) = self.queued.front() {
            let Some(buf) = self.inner.tx_alloc(pkt.len()) else {
                return Ok(());
            };
            let n = pkt.len().min(buf.len());
            buf[..n].copy_from_slice(&pkt[..n]);
            self.inner.tx_commit(n)?;
            if let Some(done) = self.queued.pop_front() {
                self.tx.recycle(done);
            }
        }
        Ok(())
    }
}

impl<L: DatagramLink> DatagramLink for Impaired<L> {
    fn mtu(&self) -> usize {
        self.inner.mtu()
    }

    fn tx_alloc(&mut self, len: usize) -> Option<&mut [u8]> {
        if self.queued.len() >= MAX_QUEUED {
            return None;
        }
        Some(self.tx.lend(len))
    }

    fn tx_commit(&mut self, len: usize) -> Result<(), LinkError> {
        let pkt = self.tx.commit(len, self.inner.mtu())?;
        self.stats.committed += 1;
        // The clock is an argument of flushes: a held packet's hold starts
        // at the first flush that sees it.
        if let Some(lost) = self
            .faults
            .transmit(&self.cfg, pkt, None, usize::MAX, &mut self.queued)
        {
            self.tx.recycle(lost);
        }
        Ok(())
    }

    fn tx_burst_flush(&mut self, now: Instant) -> Result<usize, LinkError> {
        self.faults
            .release_due(now, self.cfg.reorder_hold, &mut self.queued);
        self.drain()?;
        let sent = self.inner.tx_burst_flush(now)?;
        // Room the burst made in the inner ring.
        self.drain()?;
        Ok(sent)
    }

    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, LinkError> {
        self.inner.rx_burst(now, max, sink)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::lossy::LossyLink;

    fn send(l: &mut Impaired<LossyLink>, i: u32) {
        l.tx_alloc(4).unwrap().copy_from_slice(&i.to_le_bytes());
        l.tx_commit(4).unwrap();
    }

    fn run(cfg: &LossConfig, seed: u64) -> (Vec<u32>, ImpairStats) {
        let (a, mut b) = LossyLink::pair(LossConfig::lossless(64), 1);
        let mut a = Impaired::new(a, cfg.clone(), seed);
        let t0 = Instant::now();
        let mut got = Vec::new();
        for i in 0..3000u32 {
            send(&mut a, i);
            a.tx_burst_flush(t0).unwrap();
            b.rx_burst(t0, usize::MAX, &mut |p| {
                got.push(u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
            })
            .unwrap();
        }
        // The first flush after the last commit starts the hold; a later
        // one releases what is still held.
        let late = t0 + Duration::from_secs(1);
        a.tx_burst_flush(t0).unwrap();
        a.tx_burst_flush(late).unwrap();
        a.tx_burst_flush(late).unwrap();
        b.rx_burst(late, usize::MAX, &mut |p| {
            got.push(u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
        })
        .unwrap();
        (got, a.stats())
    }

    #[test]
    fn impairs_deterministically_and_delivers_every_copy_not_lost() {
        let cfg = LossConfig {
            loss: 0.05,
            duplicate: 0.05,
            reorder: 0.05,
            ..LossConfig::lossless(64)
        };
        let (got, st) = run(&cfg, 9);
        assert_eq!(run(&cfg, 9), (got.clone(), st), "same seed, same run");
        assert_ne!(run(&cfg, 10).0, got, "another seed, another run");
        assert_eq!(st.committed, 3000);
        assert!(st.lost > 75 && st.lost < 225, "{st:?}");
        assert!(st.duplicated > 75 && st.reordered > 75, "{st:?}");
        assert_eq!(got.len() as u64, st.committed - st.lost + st.duplicated);
        assert!(got.windows(2).any(|w| w[1] < w[0]), "reordered");
        let mut seen = std::collections::HashMap::new();
        for g in &got {
            *seen.entry(*g).or_insert(0) += 1;
        }
        assert!(seen.values().any(|&n| n == 2), "duplicated");
        assert_eq!(seen.len() as u64, st.committed - st.lost);
    }

    #[test]
    fn lossless_passes_everything_in_order_and_keeps_the_link_rules() {
        let (a, mut b) = LossyLink::pair(LossConfig::lossless(64), 1);
        let mut a = Impaired::new(a, LossConfig::lossless(64), 3);
        assert_eq!(a.mtu(), 64);
        assert!(matches!(a.tx_commit(1), Err(LinkError::BadCommit { .. })));
        assert!(a.tx_alloc(65).is_some());
        assert!(matches!(a.tx_commit(65), Err(LinkError::Oversized { .. })));
        for i in 0..100 {
            send(&mut a, i);
        }
        a.tx_burst_flush(Instant::now()).unwrap();
        // The inner ring takes 64 per burst; the rest leave with the next.
        a.tx_burst_flush(Instant::now()).unwrap();
        let mut got = Vec::new();
        b.rx_burst(Instant::now(), usize::MAX, &mut |p| {
            got.push(u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
        })
        .unwrap();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }
}

//! The fault draw that [`LossyLink`](crate::lossy::LossyLink) (a
//! simulated wire) and [`Impaired`](crate::impair::Impaired) (under a real
//! link) share: loss, duplication, corruption and reordering of each
//! packet, drawn from one seeded generator in one order, so a seed means
//! the same faults wherever it is used.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::link::LinkError;
use crate::lossy::LossConfig;

/// What the draw did to the packets given to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Faulted {
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    /// Copies dropped because the queue and the held packets were at
    /// capacity.
    pub dropped_full: u64,
}

#[derive(Debug)]
struct Held {
    pkt: Vec<u8>,
    /// Later packets still to be queued before this one.
    countdown: u32,
    /// When it is released by time; `None` until the first
    /// [`Faults::release_due`] that sees it (for a link whose clock is an
    /// argument of flushes, not of commits).
    release_at: Option<Instant>,
}

/// The seeded fault draw over one direction, with the packets it holds
/// back.
#[derive(Debug)]
pub(crate) struct Faults {
    rng: SmallRng,
    held: Vec<Held>,
    pub faulted: Faulted,
}

/// # Panics
/// If a rate of `cfg` is outside `[0, 1]`.
pub(crate) fn check_rates(cfg: &LossConfig) {
    for (name, p) in [
        ("loss", cfg.loss),
        ("duplicate", cfg.duplicate),
        ("reorder", cfg.reorder),
        ("corrupt", cfg.corrupt),
    ] {
        assert!((0.0..=1.0).contains(&p), "{name} rate {p} outside [0, 1]");
    }
}

impl Faults {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
            held: Vec::new(),
            faulted: Faulted::default(),
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.gen::<f64>() < p
    }

    /// Packets held back.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The earliest time a held packet is due, among those stamped.
    pub fn next_release(&self) -> Option<Instant> {
        self.held.iter().filter_map(|h| h.release_at).min()
    }

    /// One packet sent: lost, or queued on `queue` once or twice, each
    /// copy perhaps corrupted or held back (released after later packets
    /// or at `release_at`). Copies beyond `capacity` packets (queued plus
    /// held) are dropped. A lost packet is given back for reuse.
    pub fn transmit(
        &mut self,
        cfg: &LossConfig,
        pkt: Vec<u8>,
        release_at: Option<Instant>,
        capacity: usize,
        queue: &mut VecDeque<Vec<u8>>,
    ) -> Option<Vec<u8>> {
        if self.chance(cfg.loss) {
            self.faulted.lost += 1;
            return Some(pkt);
        }
        if self.chance(cfg.duplicate) {
            self.faulted.duplicated += 1;
            self.place(cfg, pkt.clone(), release_at, capacity, queue);
        }
        self.place(cfg, pkt, release_at, capacity, queue);
        None
    }

    fn place(
        &mut self,
        cfg: &LossConfig,
        mut pkt: Vec<u8>,
        release_at: Option<Instant>,
        capacity: usize,
        queue: &mut VecDeque<Vec<u8>>,
    ) {
        if queue.len() + self.held.len() >= capacity {
            self.faulted.dropped_full += 1;
            return;
        }
        if !pkt.is_empty() && self.chance(cfg.corrupt) {
            self.faulted.corrupted += 1;
            for _ in 0..self.rng.gen_range(1..=3) {
                let bit = self.rng.gen_range(0..pkt.len() * 8);
                pkt[bit / 8] ^= 1 << (bit % 8);
            }
        }
        if cfg.reorder_depth > 0 && self.chance(cfg.reorder) {
            self.faulted.reordered += 1;
            let countdown = self.rng.gen_range(1..=cfg.reorder_depth);
            self.held.push(Held {
                pkt,
                countdown,
                release_at,
            });
            return;
        }
        queue.push_back(pkt);
        // Held packets fall behind the one just queued.
        let mut i = 0;
        while i < self.held.len() {
            self.held[i].countdown -= 1;
            if self.held[i].countdown == 0 {
                queue.push_back(self.held.remove(i).pkt);
            } else {
                i += 1;
            }
        }
    }

    /// Queue the held packets due by `now`; one not stamped yet is due
    /// `hold` from now.
    pub fn release_due(&mut self, now: Instant, hold: Duration, queue: &mut VecDeque<Vec<u8>>) {
        let mut i = 0;
        while i < self.held.len() {
            let due = *self.held[i].release_at.get_or_insert(now + hold);
            if due <= now {
                queue.push_back(self.held.remove(i).pkt);
            } else {
                i += 1;
            }
        }
    }
}

/// Free packet buffers kept for reuse, at most.
const FREE_LIST_MAX: usize = 256;

/// The packet buffer an in-memory link lends from `tx_alloc` to
/// `tx_commit`, and the free list it is drawn from.
#[derive(Debug, Default)]
pub(crate) struct TxBuf {
    cur: Vec<u8>,
    /// The length lent by the last `tx_alloc`, until its commit.
    lent: Option<usize>,
    free: Vec<Vec<u8>>,
}

impl TxBuf {
    /// A zeroed buffer of `len` bytes; a second call before the commit
    /// lends the same buffer again.
    pub fn lend(&mut self, len: usize) -> &mut [u8] {
        if self.lent.is_none() {
            self.cur = self.free.pop().unwrap_or_default();
        }
        self.cur.clear();
        self.cur.resize(len, 0);
        self.lent = Some(len);
        &mut self.cur[..]
    }

    /// The first `len` bytes of the buffer lent, as a packet of at most
    /// `mtu` bytes.
    pub fn commit(&mut self, len: usize, mtu: usize) -> Result<Vec<u8>, LinkError> {
        let allocated = self.lent.take();
        match allocated {
            Some(a) if len <= a => {}
            _ => return Err(LinkError::BadCommit { len, allocated }),
        }
        if len > mtu {
            return Err(LinkError::Oversized { len, mtu });
        }
        let mut pkt = std::mem::take(&mut self.cur);
        pkt.truncate(len);
        Ok(pkt)
    }

    /// Keep `pkt`'s allocation for a later packet.
    pub fn recycle(&mut self, pkt: Vec<u8>) {
        if self.free.len() < FREE_LIST_MAX {
            self.free.push(pkt);
        }
    }
}

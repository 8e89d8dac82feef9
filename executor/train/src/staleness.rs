//! How stale each push is: the global steps a shard applied between the
//! pull whose values a gradient was computed on and that gradient's push.
//!
//! Both replies carry the shard's global step (a pull reply the step its
//! values are at, a push reply the step after the push was applied, which
//! counts the push itself when it completes the worker's step). So for the
//! pushes of step `k` to shard `s`, pulled at global step `b` and
//! acknowledged at `g`, the staleness is `g - 1 - b`: 0 when no other
//! worker's step landed in between. The worker measures it from the replies
//! it already reads; the wire carries nothing more.

use serde::Serialize;

/// Staleness values counted one by one; larger ones share the last bucket
/// (the maximum is kept exactly).
const BUCKETS: usize = 1 << 14;

/// Counts of staleness values, mergeable across workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StalenessHistogram {
    /// By value, up to the largest bucket counted: every worker of a
    /// process keeps one (and its outcome a copy), so it is as long as
    /// the values seen, not [`BUCKETS`] long.
    counts: Vec<u64>,
    sum: u64,
    max: u64,
}

/// The summary in the JSON report (`"staleness"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Staleness {
    /// Mean over every measured push.
    pub mean: f64,
    /// 99th percentile (nearest rank).
    pub p99: u64,
    /// Largest.
    pub max: u64,
    /// Pushes measured (one per shard per step).
    pub pushes: u64,
}

impl StalenessHistogram {
    /// Count one push of staleness `v`.
    pub fn record(&mut self, v: u64) {
        let i = usize::try_from(v).map_or(BUCKETS - 1, |i| i.min(BUCKETS - 1));
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
        self.sum += v;
        self.max = self.max.max(v);
    }

    /// Add `other`'s counts.
    pub fn merge(&mut self, other: &StalenessHistogram) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum += other.sum;
        self.max = self.max.max(other.max);
    }

    /// Pushes counted.
    pub fn len(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// True when nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Mean, 99th percentile and maximum (all 0 when empty).
    pub fn summary(&self) -> Staleness {
        let n = self.len();
        if n == 0 {
            return Staleness::default();
        }
        let rank = (n * 99).div_ceil(100);
        let mut seen = 0;
        let mut p99 = self.max;
        for (v, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                p99 = (v as u64).min(self.max);
                break;
            }
        }
        Staleness {
            mean: self.sum as f64 / n as f64,
            p99,
            max: self.max,
            pushes: n,
        }
    }
}

/// A worker's view: the global step of each shard's last pull, matched
/// with the acknowledgement of the push computed on it.
#[derive(Debug, Clone, Default)]
pub struct StalenessTracker {
    /// Per shard: the step of the values the pending push was computed on.
    base: Vec<Option<u64>>,
    /// Per shard: the highest push acknowledgement of this exchange.
    acked: Vec<Option<u64>>,
    hist: StalenessHistogram,
}

/// The global step in a pull or push reply body (both put it at bytes
/// 8..16; see `starwire_wire::ps`). None for a body too short, which the
/// reply's own parser rejects.
fn reply_step(body: &[u8]) -> Option<u64> {
    let b: [u8; 8] = body.get(8..16)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

impl StalenessTracker {
    fn grow(&mut self, shard: usize) {
        if self.base.len() <= shard {
            self.base.resize(shard + 1, None);
            self.acked.resize(shard + 1, None);
        }
    }

    /// One exchange: the push replies (each with its shard) of the previous
    /// step's gradients, then the pull replies of this step.
    pub fn handle_exchange<'a>(
        &mut self,
        pushes: impl IntoIterator<Item = (usize, &'a [u8])>,
        pulls: impl IntoIterator<Item = (usize, &'a [u8])>,
    ) {
        for (s, body) in pushes {
            self.grow(s);
            if let Some(g) = reply_step(body) {
                self.acked[s] = Some(self.acked[s].map_or(g, |a| a.max(g)));
            }
        }
        for s in 0..self.acked.len() {
            if let (Some(g), Some(b)) = (self.acked[s].take(), self.base[s].take()) {
                self.hist.record(g.saturating_sub(1).saturating_sub(b));
            }
        }
        for (s, body) in pulls {
            self.grow(s);
            if let Some(b) = reply_step(body) {
                // Several pulls to one shard (no fusion): the oldest values.
                self.base[s] = Some(self.base[s].map_or(b, |x| x.min(b)));
            }
        }
    }

    /// Forget the pulls that no push will follow (evaluation).
    pub fn forget_pulls(&mut self) {
        self.base.iter_mut().for_each(|b| *b = None);
    }

    /// What was measured.
    pub fn histogram(&self) -> &StalenessHistogram {
        &self.hist
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(step: u64) -> Vec<u8> {
        let mut b = vec![1, 2, 0, 0, 0, 0, 0, 0];
        b.extend_from_slice(&step.to_le_bytes());
        b
    }

    #[test]
    fn push_after_others_steps_is_stale_by_them() {
        let mut t = StalenessTracker::default();
        let (p0, p5) = (body(0), body(5));
        // Step 1: pulls from shards 0 and 1 at step 0.
        t.handle_exchange([], [(0, &p0[..]), (1, &p0[..])]);
        // Step 2: the pushes land at 1 on shard 0 (nobody in between) and
        // at 4 on shard 1 (three other steps first).
        let (a1, a4) = (body(1), body(4));
        t.handle_exchange([(0, &a1[..]), (1, &a4[..])], [(0, &p5[..])]);
        let s = t.histogram().summary();
        assert_eq!((s.pushes, s.max), (2, 3));
        assert_eq!(s.mean, 1.5);
        // A push with no pull before it (shard 1) is not counted.
        let a9 = body(9);
        t.handle_exchange([(0, &a9[..]), (1, &a9[..])], []);
        let s = t.histogram().summary();
        assert_eq!((s.pushes, s.max), (3, 3), "{s:?}");
        t.forget_pulls();
    }

    #[test]
    fn p99_and_merge() {
        let mut h = StalenessHistogram::default();
        for v in 0..100 {
            h.record(v);
        }
        let mut g = StalenessHistogram::default();
        g.record(1 << 20);
        h.merge(&g);
        let s = h.summary();
        assert_eq!(s.pushes, 101);
        assert_eq!(s.p99, 99);
        assert_eq!(s.max, 1 << 20);
        assert_eq!(
            h.counts.len(),
            BUCKETS,
            "a huge value shares the last bucket"
        );
        assert_eq!(
            StalenessHistogram::default().summary(),
            Staleness::default()
        );
    }

    #[test]
    fn histograms_grow_to_their_largest_value_and_merge_either_way() {
        let (mut a, mut b) = (StalenessHistogram::default(), StalenessHistogram::default());
        assert!(a.counts.is_empty());
        a.record(2);
        b.record(7);
        b.record(2);
        assert_eq!((a.counts.len(), b.counts.len()), (3, 8));
        let mut ab = a.clone();
        ab.merge(&b);
        let mut ba = b.clone();
        ba.merge(&a);
        assert_eq!(ab, ba);
        assert_eq!(ab.counts[2], 2);
        let s = ab.summary();
        assert_eq!((s.pushes, s.max, s.p99), (3, 7, 7));
        assert!((s.mean - 11.0 / 3.0).abs() < 1e-12);
    }
}

//! A fixed-bucket histogram of durations, updated lock-free.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bucket upper bounds for request and step durations, in seconds: 10 µs
/// (a loopback round trip) to 10 s (a stalled step).
pub const DURATION_BOUNDS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Durations counted into buckets: one relaxed add for the bucket and
/// one for the sum per observation.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// The bounds in nanoseconds, compared against without floating point.
    bounds_ns: Box<[u64]>,
    /// One per bound, then the overflow (`+Inf`) bucket.
    buckets: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl Histogram {
    /// A histogram with upper bounds `bounds` (seconds, increasing).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            bounds_ns: bounds.iter().map(|b| (b * 1e9) as u64).collect(),
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    /// Count one duration.
    #[inline]
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = self.bounds_ns.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The counts as they are now.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            bounds: self.bounds,
            counts: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// A histogram as read at a scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), the last one above every bound.
    counts: Vec<u64>,
    sum_seconds: f64,
}

impl HistogramSnapshot {
    /// `(upper bound, count in this bucket)` for each bound, then
    /// `(+Inf, count above the last bound)`.
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
    }

    /// Observations: the sum of the buckets, so it agrees with them even
    /// when read while another thread observes.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The sum of the observations, in seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_seconds
    }

    /// Add `other`'s counts (same bounds; with other bounds only the sum
    /// and the overflow bucket can be kept, so every count goes there).
    pub fn merge(&mut self, other: &Self) {
        self.sum_seconds += other.sum_seconds;
        if self.bounds == other.bounds {
            for (a, b) in self.counts.iter_mut().zip(&other.counts) {
                *a += b;
            }
        } else if let Some(last) = self.counts.last_mut() {
            *last += other.count();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(1));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let s = h.snapshot();
        let b: Vec<_> = s.buckets().collect();
        assert_eq!(b, vec![(0.001, 2), (0.01, 1), (f64::INFINITY, 1)]);
        assert_eq!(s.count(), 4);
        assert!((s.sum_seconds() - 1.0065).abs() < 1e-9);
    }

    #[test]
    fn snapshots_merge_bucket_by_bucket() {
        let (a, b) = (
            Histogram::new(DURATION_BOUNDS),
            Histogram::new(DURATION_BOUNDS),
        );
        a.observe(Duration::from_micros(20));
        b.observe(Duration::from_micros(20));
        b.observe(Duration::from_secs(20));
        let mut s = a.snapshot();
        s.merge(&b.snapshot());
        assert_eq!(s.count(), 3);
        let b: Vec<_> = s.buckets().filter(|(_, n)| *n > 0).collect();
        assert_eq!(b, vec![(2.5e-5, 2), (f64::INFINITY, 1)]);
    }
}

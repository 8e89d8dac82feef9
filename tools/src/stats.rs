//! Latency percentiles and the median over repetitions.

/// Summary of a set of round-trip times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencySummary {
    /// Fastest, µs.
    pub min_us: f64,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Slowest, µs.
    pub max_us: f64,
}

/// Nearest-rank percentile of sorted samples (`q` in `[0, 1]`).
fn rank(sorted: &[u64], q: f64) -> u64 {
    let n = sorted.len();
    let idx = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
    sorted[idx]
}

/// Summarise round-trip times in nanoseconds; `None` when there are none.
/// Sorts `ns` in place.
pub fn summarize(ns: &mut [u64]) -> Option<LatencySummary> {
    if ns.is_empty() {
        return None;
    }
    ns.sort_unstable();
    let us = |v: u64| v as f64 / 1000.0;
    Some(LatencySummary {
        min_us: us(ns[0]),
        p50_us: us(rank(ns, 0.50)),
        p99_us: us(rank(ns, 0.99)),
        p999_us: us(rank(ns, 0.999)),
        max_us: us(ns[ns.len() - 1]),
    })
}

/// Median of the present values (mean of the two middle ones for an even
/// count); `None` when no value is present.
pub fn median(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().flatten().collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_ordered_and_nearest_rank() {
        let mut ns: Vec<u64> = (1..=1000).rev().map(|i| i * 1000).collect();
        let s = summarize(&mut ns).expect("non-empty");
        assert_eq!(s.min_us, 1.0);
        assert_eq!(s.p50_us, 500.0);
        assert_eq!(s.p99_us, 990.0);
        assert_eq!(s.p999_us, 999.0);
        assert_eq!(s.max_us, 1000.0);
        assert!(summarize(&mut []).is_none());
    }

    #[test]
    fn median_skips_missing_values() {
        assert_eq!(median([Some(3.0), None, Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median([Some(4.0), Some(1.0)]), Some(2.5));
        assert_eq!(median([None]), None);
    }
}

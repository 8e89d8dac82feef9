//! The soak's memory check: VmRSS sampled once a quarter of the run has
//! passed (connections set up, buffers warm) and again when the whole run
//! has (before the drain and teardown free anything); growth between the
//! two of more than max(5 %, 16 MiB) fails the soak, as a leak would.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Growth allowed on top of the quarter-run sample, in per mille.
const GROWTH_PER_MILLE: u64 = 50;
/// Growth always allowed, in kB (allocator and page-cache noise).
const GROWTH_FLOOR_KB: u64 = 16 << 10;

/// The shortest run whose growth is checked: in a shorter one a quarter
/// is not enough to set up and warm every buffer (a DPDK mempool's
/// mbufs are first touched as traffic cycles through them), so growth
/// there says nothing about leaks.
pub const MIN_CHECKED_SECS: f64 = 10.0;

/// VmRSS of this process in kB.
pub fn rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The most RSS may grow past `quarter_kb` by the end of the run.
pub fn growth_limit_kb(quarter_kb: u64) -> u64 {
    (quarter_kb * GROWTH_PER_MILLE / 1000).max(GROWTH_FLOOR_KB)
}

/// Whether RSS at the end stayed within the limit of the quarter-run
/// sample; without both samples (no `/proc`) there is nothing to check.
pub fn within_limit(quarter_kb: Option<u64>, end_kb: Option<u64>) -> bool {
    match (quarter_kb, end_kb) {
        (Some(q), Some(e)) => e.saturating_sub(q) <= growth_limit_kb(q),
        _ => true,
    }
}

/// A VmRSS sample taken by a thread after a delay.
#[derive(Debug)]
pub struct RssAt {
    kb: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl RssAt {
    /// Sample VmRSS once `after` has passed.
    pub fn spawn(after: Duration) -> Self {
        let kb = Arc::new(AtomicU64::new(0));
        let out = Arc::clone(&kb);
        let thread = std::thread::Builder::new()
            .name("starwire-soak-rss".into())
            .spawn(move || {
                std::thread::sleep(after);
                out.store(rss_kb().unwrap_or(0), Ordering::Relaxed);
            })
            .ok();
        Self { kb, thread }
    }

    /// The sample, once taken (the run may end before it is).
    pub fn take(mut self) -> Option<u64> {
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
        Some(self.kb.load(Ordering::Relaxed)).filter(|&kb| kb > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_over_max_5_percent_16_mib_fails() {
        // Small processes: 16 MiB of slack.
        assert_eq!(growth_limit_kb(100_000), 16_384);
        assert!(within_limit(Some(100_000), Some(116_384)));
        assert!(!within_limit(Some(100_000), Some(116_385)));
        // Large ones: 5 %.
        assert_eq!(growth_limit_kb(1_000_000), 50_000);
        assert!(within_limit(Some(1_000_000), Some(1_050_000)));
        assert!(!within_limit(Some(1_000_000), Some(1_050_001)));
        // Shrinking is fine; a missing sample checks nothing.
        assert!(within_limit(Some(1_000_000), Some(10)));
        assert!(within_limit(None, Some(10)));
    }

    #[test]
    fn the_sample_is_taken_after_the_delay() {
        let early = RssAt::spawn(Duration::from_secs(3600));
        assert_eq!(early.take(), None, "not taken yet");
        let s = RssAt::spawn(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(200));
        assert!(s.take().unwrap_or(0) > 0);
    }
}

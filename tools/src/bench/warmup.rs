//! A run's warm-up: a count of completions (`--warmup 1000`), or a time
//! since the run's first send (`--warmup 2s`, perftest's `--margin`), and
//! the gate every client passes its completions through to learn which
//! are measured.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What a run does before it measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Warmup {
    /// This many completed iterations (steps in fuse mode).
    Iters(u64),
    /// Until this long has passed since the run's first send: the first
    /// completion after it is the last one not measured.
    Time(Duration),
}

/// `--warmup`: a count of iterations (`1000`), or a time with its unit
/// (`2s`, `1.5s`, `500ms`, `250us`).
pub fn parse_warmup(s: &str) -> Result<Warmup, String> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map(Warmup::Iters)
            .map_err(|e| format!("{s:?}: {e}"));
    }
    let expected = || {
        format!(
            "{s:?}: expected a count of iterations (1000) or a time with a unit (2s, 500ms, 250us)"
        )
    };
    let (number, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix("us").or_else(|| s.strip_suffix("µs")) {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(expected());
    };
    let v: f64 = number.trim().parse().map_err(|_| expected())?;
    Duration::try_from_secs_f64(v * scale)
        .map(Warmup::Time)
        .map_err(|_| format!("{s:?}: expected a time of zero or more"))
}

/// Where a completion falls in its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completion {
    /// Within the warm-up: not measured.
    Warmup,
    /// The warm-up's last: the measurement starts at it.
    Last,
    /// Measured.
    Measured,
}

/// Which completions of a run are measured. A client tells it of its
/// first send and of every completion, numbered from 1; the count form
/// knows its length from the start, the time form once its time has
/// passed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WarmupGate {
    /// Completions in the warm-up, once known.
    len: Option<u64>,
    /// The time form's length.
    time: Option<Duration>,
    /// When the run's first request was sent.
    first_send: Option<Instant>,
}

impl WarmupGate {
    pub(crate) fn new(warmup: Warmup) -> Self {
        let (len, time) = match warmup {
            Warmup::Iters(n) => (Some(n), None),
            Warmup::Time(t) => (None, Some(t)),
        };
        Self {
            len,
            time,
            first_send: None,
        }
    }

    /// No warm-up (`--warmup 0`): the measurement starts with the first
    /// send.
    pub(crate) fn is_none(&self) -> bool {
        self.len == Some(0)
    }

    /// A request was sent at `now`; only the run's first one counts.
    pub(crate) fn on_send(&mut self, now: Instant) {
        self.first_send.get_or_insert(now);
    }

    /// The `completed`th completion came at `now`.
    pub(crate) fn on_complete(&mut self, completed: u64, now: Instant) -> Completion {
        if let (None, Some(time), Some(t0)) = (self.len, self.time, self.first_send) {
            if now.saturating_duration_since(t0) >= time {
                self.len = Some(completed);
            }
        }
        match self.len {
            Some(w) if completed > w => Completion::Measured,
            Some(w) if completed == w => Completion::Last,
            _ => Completion::Warmup,
        }
    }

    /// The measured ones of `completed` completions.
    pub(crate) fn measured(&self, completed: u64) -> u64 {
        self.len.map_or(0, |w| completed.saturating_sub(w))
    }

    /// Completions a run of `iters` measured iterations issues: the
    /// warm-up's and those. Unbounded while a time warm-up lasts.
    pub(crate) fn budget(&self, iters: u64) -> u64 {
        self.len.map_or(u64::MAX, |w| w.saturating_add(iters))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_or_a_time_with_its_unit() {
        assert_eq!(parse_warmup("0"), Ok(Warmup::Iters(0)));
        assert_eq!(parse_warmup("1000"), Ok(Warmup::Iters(1000)));
        assert_eq!(
            parse_warmup("18446744073709551615"),
            Ok(Warmup::Iters(u64::MAX)),
            "bounded by the plan's check, naming the flag"
        );
        let time = |s| match parse_warmup(s) {
            Ok(Warmup::Time(d)) => d,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(time("2s"), Duration::from_secs(2));
        assert_eq!(time("1.5s"), Duration::from_millis(1500));
        assert_eq!(time("500ms"), Duration::from_millis(500));
        assert_eq!(time("250us"), Duration::from_micros(250));
        assert_eq!(time("250µs"), Duration::from_micros(250));
        assert_eq!(time("0s"), Duration::ZERO, "refused by the plan's check");
        for bad in [
            "", "1.5", "2m", "s", "ms", "-1s", "NaN s", "infs", "1e400s", "2 h", "x",
        ] {
            let e = parse_warmup(bad).unwrap_err();
            assert!(e.contains(&format!("{:?}", bad.trim())), "{bad}: {e}");
        }
        assert!(parse_warmup("18446744073709551616").is_err());
    }

    #[test]
    fn a_count_measures_what_comes_after_it() {
        let t = Instant::now();
        let mut g = WarmupGate::new(Warmup::Iters(2));
        assert!(!g.is_none());
        assert_eq!(g.budget(10), 12);
        let seen: Vec<Completion> = (1..=3).map(|n| g.on_complete(n, t)).collect();
        assert_eq!(
            seen,
            [Completion::Warmup, Completion::Last, Completion::Measured]
        );
        assert_eq!(g.measured(5), 3);
        let none = WarmupGate::new(Warmup::Iters(0));
        assert!(none.is_none());
        assert_eq!(none.measured(5), 5);
    }

    #[test]
    fn a_time_ends_at_the_first_completion_past_it() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut g = WarmupGate::new(Warmup::Time(Duration::from_millis(100)));
        assert!(!g.is_none());
        assert_eq!(g.budget(10), u64::MAX, "unbounded while it lasts");
        g.on_send(t0);
        g.on_send(ms(50));
        assert_eq!(g.on_complete(1, ms(40)), Completion::Warmup);
        assert_eq!(g.on_complete(2, ms(99)), Completion::Warmup);
        assert_eq!(g.measured(2), 0);
        // 100 ms after the first send, not the latest.
        assert_eq!(g.on_complete(3, ms(100)), Completion::Last);
        assert_eq!(g.on_complete(4, ms(101)), Completion::Measured);
        assert_eq!((g.budget(10), g.measured(4)), (13, 1));
    }
}

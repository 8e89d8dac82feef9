//! The soak's throughput: answered requests, and the payload bytes of
//! each request and its answer, per second of the time a side's traffic
//! took ([`Span`]), so that a soak that answered everything slowly shows
//! it and two soaks can be compared.

use std::time::Instant;

use serde::Serialize;

/// When a side's traffic began and ended, as its reactors saw it (each
/// passes its turn's `now`): a client's first request sent and the later
/// of its last answer received and the end of `--duration`; a server's
/// first request received and its last answer sent.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Span {
    first: Option<Instant>,
    last: Option<Instant>,
}

impl Span {
    /// Traffic at `now`, where it may begin.
    pub(super) fn begin(&mut self, now: Instant) {
        self.first = Some(self.first.map_or(now, |f| f.min(now)));
    }

    /// Traffic until `now` at least.
    pub(super) fn extend_to(&mut self, now: Instant) {
        self.last = Some(self.last.map_or(now, |l| l.max(now)));
    }

    /// Both spans, across reactors: the earliest start, the latest end.
    pub(super) fn merge(&mut self, o: Span) {
        if let Some(f) = o.first {
            self.begin(f);
        }
        if let Some(l) = o.last {
            self.extend_to(l);
        }
    }

    /// Seconds from the start to the end; 0 without both.
    pub(super) fn secs(&self) -> f64 {
        match (self.first, self.last) {
            (Some(f), Some(l)) => l.saturating_duration_since(f).as_secs_f64(),
            _ => 0.0,
        }
    }
}

/// The report's throughput fields (field names are a contract, see
/// docs/CLI.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(super) struct Throughput {
    /// The seconds the rates are over: the side's [`Span`].
    pub(super) measured_s: f64,
    /// Answered requests per second.
    pub(super) msgs_per_s: f64,
    /// Payload bits of the answered requests and their answers per
    /// second, in 10^9 (frame headers not counted).
    pub(super) gbps: f64,
}

impl Throughput {
    /// `answered` requests, their and their answers' payloads
    /// `payload_bytes`, over `secs`; every rate 0 over no time.
    pub(super) fn new(answered: u64, payload_bytes: u64, secs: f64) -> Self {
        if !(secs > 0.0 && secs.is_finite()) {
            return Self {
                measured_s: 0.0,
                msgs_per_s: 0.0,
                gbps: 0.0,
            };
        }
        Self {
            measured_s: secs,
            msgs_per_s: answered as f64 / secs,
            gbps: payload_bytes as f64 * 8.0 / secs / 1e9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rates_are_answers_and_payload_bits_over_the_span() {
        let t0 = Instant::now();
        let mut span = Span::default();
        span.begin(t0);
        span.extend_to(t0 + Duration::from_millis(500));
        let t = Throughput::new(1000, 125_000_000, span.secs());
        assert_eq!(
            t,
            Throughput {
                measured_s: 0.5,
                msgs_per_s: 2000.0,
                gbps: 2.0,
            }
        );
    }

    /// Reactors' spans add up to the earliest start and the latest end,
    /// whatever order they come in; an empty one changes nothing.
    #[test]
    fn spans_merge_to_the_earliest_start_and_the_latest_end() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let (mut a, mut b) = (Span::default(), Span::default());
        a.begin(at(100));
        a.extend_to(at(900));
        b.begin(at(50));
        b.extend_to(at(400));
        let mut all = Span::default();
        for s in [a, Span::default(), b] {
            all.merge(s);
        }
        assert_eq!(all.secs(), 0.85);
        // Within one reactor too: `begin` keeps the earliest, `extend_to`
        // the latest.
        all.begin(at(75));
        all.extend_to(at(600));
        assert_eq!(all.secs(), 0.85);
    }

    /// Nothing answered, or no time: every rate 0, never NaN or infinite
    /// (which JSON cannot hold).
    #[test]
    fn no_time_gives_zero_rates() {
        let zero = Throughput {
            measured_s: 0.0,
            msgs_per_s: 0.0,
            gbps: 0.0,
        };
        assert_eq!(Span::default().secs(), 0.0);
        let mut begun = Span::default();
        begun.begin(Instant::now());
        assert_eq!(begun.secs(), 0.0);
        for secs in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(Throughput::new(5, 500, secs), zero, "{secs}");
        }
        assert_eq!(Throughput::new(0, 0, 2.0).msgs_per_s, 0.0);
    }
}

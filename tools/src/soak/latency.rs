//! The soak's round trips: each answered request's time from the client
//! reactor's turn that sent it to the turn that received its answer, in
//! the bench's HdrHistogram ([`Rtts`]); their percentiles in the report
//! and at `/metrics`, and the `--max-latency-ms` bar on the p99.
//!
//! The round trips are those of the `answered` requests that
//! `msgs_per_s` counts: a client sends only inside its measured window
//! (from its first request to the end of `--duration`), and an answer
//! drained after that still counts, as it does in the throughput.
//!
//! Each client reactor records into a histogram of its own and merges it
//! into the soak's ([`RoundTripFeed::flush`]) a few times a second, so the
//! lock is taken per publication, not per message.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use starwire_telemetry::{Counter, Gauge, Telemetry};

use crate::bench::hist::Rtts;

/// Round trips of one client reactor, or of all of them merged.
#[derive(Debug, Clone, Default)]
pub(super) struct RoundTrips {
    rtts: Rtts,
}

impl RoundTrips {
    /// Record the round trip of one answered request.
    #[inline]
    pub(super) fn record(&mut self, rtt: Duration) {
        self.rtts
            .record(u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Add another reactor's round trips.
    pub(super) fn merge(&mut self, other: &RoundTrips) {
        self.rtts.merge(&other.rtts);
    }

    /// Forget every round trip (the memory stays).
    fn reset(&mut self) {
        self.rtts.reset();
    }

    /// The report's `latency_us`: all 0 when nothing was answered, as the
    /// rates are over no time (JSON holds no NaN).
    pub(super) fn latency(&self) -> LatencyUs {
        match self.rtts.summary() {
            Some(s) => LatencyUs {
                p50: s.p50_us,
                p99: s.p99_us,
                p999: s.p999_us,
                max: s.max_us,
                count: self.rtts.len(),
            },
            None => LatencyUs::default(),
        }
    }
}

/// The round trips of every client reactor of the soak, merged as each
/// flushes its own.
pub(super) type MergedRoundTrips = Arc<Mutex<RoundTrips>>;

/// A copy of what `merged` holds (the lock held for the copy only).
pub(super) fn snapshot(merged: &MergedRoundTrips) -> RoundTrips {
    // A reactor that panicked mid-merge fails the soak anyway; what it
    // left is still a histogram.
    merged
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// A client reactor's round trips not yet merged into the soak's.
#[derive(Debug)]
pub(super) struct RoundTripFeed {
    fresh: RoundTrips,
    merged: MergedRoundTrips,
}

impl RoundTripFeed {
    /// A feed into `merged`.
    pub(super) fn new(merged: MergedRoundTrips) -> Self {
        Self {
            fresh: RoundTrips::default(),
            merged,
        }
    }

    /// Record the round trip of one answered request.
    #[inline]
    pub(super) fn record(&mut self, rtt: Duration) {
        self.fresh.record(rtt);
    }

    /// Merge what was recorded since the last flush into the soak's.
    pub(super) fn flush(&mut self) {
        if self.fresh.rtts.is_empty() {
            return;
        }
        self.merged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .merge(&self.fresh);
        self.fresh.reset();
    }
}

/// The report's `latency_us` (field names are a contract, see
/// docs/CLI.md): percentiles of the round trips in µs, within the
/// histogram's 0.1 %, and how many there were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(super) struct LatencyUs {
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) p999: f64,
    pub(super) max: f64,
    pub(super) count: u64,
}

/// `--max-latency-ms`, for clap's `value_parser`: milliseconds above 0.
pub(super) fn parse_max_latency_ms(s: &str) -> Result<f64, String> {
    let ms: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("expected a number of milliseconds: {e}"))?;
    if !(ms.is_finite() && ms > 0.0) {
        return Err("expected a positive number of milliseconds".into());
    }
    Ok(ms)
}

/// Whether `lat` meets the bar `max_ms` (`--max-latency-ms`) on its p99:
/// `Err` says why not. No bar, no failure; with a bar and no round trip
/// measured the bar is not met (the soak fails then anyway: all was
/// lost).
pub(super) fn check_bar(lat: &LatencyUs, max_ms: Option<f64>) -> Result<(), String> {
    let Some(ms) = max_ms else { return Ok(()) };
    let bar_us = ms * 1000.0;
    if lat.count == 0 {
        return Err(format!("--max-latency-ms {ms}: no round trip was measured"));
    }
    if lat.p99 > bar_us {
        return Err(format!(
            "--max-latency-ms {ms}: p99 latency {:.1} us is over the bar of {bar_us:.1} us",
            lat.p99
        ));
    }
    Ok(())
}

/// The quantiles published at `/metrics`: 1 is the largest round trip.
const QUANTILES: [&str; 4] = ["0.5", "0.99", "0.999", "1"];

impl LatencyUs {
    /// The figures at [`QUANTILES`], in their order.
    fn at_quantiles(&self) -> [f64; QUANTILES.len()] {
        [self.p50, self.p99, self.p999, self.max]
    }
}

/// `starwire_soak_latency_us{quantile}` and
/// `starwire_soak_latency_round_trips_total`: one set for the soak, not
/// one per reactor (percentiles do not add up as the registry adds
/// cells), set from the merged round trips.
#[derive(Debug)]
pub(super) struct LatencyCells {
    quantiles: [Arc<Gauge>; QUANTILES.len()],
    count: Arc<Counter>,
}

impl LatencyCells {
    /// Cells in `t` (0 until the first publication).
    pub(super) fn new(t: &Telemetry) -> Self {
        let quantiles = QUANTILES.map(|q| {
            t.gauge(
                "starwire_soak_latency_us",
                "Soak round trips (request sent to its answer received) in microseconds at this quantile, 1 being the largest, as the report's latency_us; the client side's, updated every second",
                &[("quantile", q)],
            )
        });
        let count = t.counter(
            "starwire_soak_latency_round_trips",
            "Soak round trips the starwire_soak_latency_us quantiles are over, as the report's latency_us.count",
            &[],
        );
        Self { quantiles, count }
    }

    /// Publish `lat`.
    pub(super) fn publish(&self, lat: &LatencyUs) {
        for (cell, v) in self.quantiles.iter().zip(lat.at_quantiles()) {
            cell.set(v);
        }
        self.count.set(lat.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the histogram's 0.1 %.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 1e-3
    }

    /// 1 to 1000 µs, one of each, over two reactors' feeds flushed at
    /// different times: the merged percentiles are those of the whole,
    /// and the count is every round trip, each once.
    #[test]
    fn percentiles_are_of_every_reactors_round_trips_in_microseconds() {
        let merged = MergedRoundTrips::default();
        let mut a = RoundTripFeed::new(Arc::clone(&merged));
        let mut b = RoundTripFeed::new(Arc::clone(&merged));
        for us in 1..=1000u64 {
            let r = if us % 2 == 0 { &mut a } else { &mut b };
            r.record(Duration::from_micros(us));
            if us == 500 {
                a.flush();
                assert_eq!(snapshot(&merged).latency().count, 250);
            }
        }
        assert_eq!(snapshot(&merged).latency().count, 250, "not flushed yet");
        a.flush();
        b.flush();
        // A flush with nothing new adds nothing.
        a.flush();
        let l = snapshot(&merged).latency();
        assert_eq!(l.count, 1000);
        assert!(close(l.p50, 500.0), "{l:?}");
        assert!(close(l.p99, 990.0), "{l:?}");
        assert!(close(l.p999, 999.0), "{l:?}");
        assert!(close(l.max, 1000.0), "{l:?}");
        assert!(l.p50 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max);
    }

    /// Nothing answered: every figure 0, never NaN (which JSON cannot
    /// hold); a round trip longer than the histogram's hour is kept as
    /// its largest, and counted.
    #[test]
    fn no_round_trips_give_zeros_and_a_huge_one_is_kept() {
        let none = RoundTrips::default().latency();
        assert_eq!(none, LatencyUs::default());
        let json = serde_json::to_value(none).expect("latency JSON");
        assert_eq!(
            json,
            serde_json::json!({"p50": 0.0, "p99": 0.0, "p999": 0.0, "max": 0.0, "count": 0})
        );
        let mut r = RoundTrips::default();
        r.record(Duration::MAX);
        let l = r.latency();
        assert_eq!(l.count, 1);
        assert!(close(l.max, 3_600_000_000.0), "{l:?}");
    }

    fn lat(p99: f64, count: u64) -> LatencyUs {
        LatencyUs {
            p50: p99 / 2.0,
            p99,
            p999: p99,
            max: p99,
            count,
        }
    }

    #[test]
    fn the_bar_fails_a_p99_over_it_and_names_the_flag_and_both_figures() {
        assert_eq!(check_bar(&lat(5000.0, 10), None), Ok(()));
        assert_eq!(check_bar(&lat(999.9, 10), Some(1.0)), Ok(()));
        // At the bar is within it.
        assert_eq!(check_bar(&lat(1000.0, 10), Some(1.0)), Ok(()));
        let e = check_bar(&lat(1000.5, 10), Some(1.0)).unwrap_err();
        assert!(e.contains("--max-latency-ms 1"), "{e}");
        assert!(e.contains("1000.5 us"), "{e}");
        assert!(e.contains("1000.0 us"), "{e}");
        // Fractional bars are in milliseconds too.
        let e = check_bar(&lat(300.0, 10), Some(0.25)).unwrap_err();
        assert!(e.contains("300.0 us") && e.contains("250.0 us"), "{e}");
        // Only the p99 counts: a max over the bar passes.
        let mut slow_max = lat(100.0, 10);
        slow_max.max = 1e6;
        assert_eq!(check_bar(&slow_max, Some(1.0)), Ok(()));
        // A bar and nothing measured: not met.
        let e = check_bar(&LatencyUs::default(), Some(1.0)).unwrap_err();
        assert!(
            e.contains("--max-latency-ms") && e.contains("no round trip"),
            "{e}"
        );
    }

    #[test]
    fn the_bar_must_be_a_positive_finite_number_of_milliseconds() {
        assert_eq!(parse_max_latency_ms("2.5"), Ok(2.5));
        assert_eq!(parse_max_latency_ms(" 10 "), Ok(10.0));
        assert_eq!(parse_max_latency_ms("1e-3"), Ok(0.001));
        for bad in [
            "0", "-0", "-1", "nan", "NaN", "inf", "-inf", "1e999", "", "ms", "5ms",
        ] {
            assert!(parse_max_latency_ms(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// The series as `/metrics` renders them: one gauge per quantile and
    /// the count, each the report's figure.
    #[test]
    fn the_series_are_the_reports_latency() {
        let t = Telemetry::new();
        let l = LatencyUs {
            p50: 12.5,
            p99: 40.25,
            p999: 81.0,
            max: 120.0,
            count: 777,
        };
        let cells = LatencyCells::new(&t);
        let before = crate::metrics::render(&t).expect("a scrape");
        assert!(
            before.contains("starwire_soak_latency_us{quantile=\"0.99\"} 0"),
            "{before}"
        );
        cells.publish(&l);
        let scrape = crate::metrics::render(&t).expect("a scrape");
        let value = |series: &str| -> f64 {
            scrape
                .lines()
                .find_map(|line| line.strip_prefix(series))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {series} in\n{scrape}"))
        };
        for (q, want) in [
            ("0.5", 12.5),
            ("0.99", 40.25),
            ("0.999", 81.0),
            ("1", 120.0),
        ] {
            let series = format!("starwire_soak_latency_us{{quantile=\"{q}\"}} ");
            assert_eq!(value(&series), want, "{scrape}");
        }
        assert_eq!(
            value("starwire_soak_latency_round_trips_total "),
            777.0,
            "{scrape}"
        );
        assert!(
            scrape.contains("# TYPE starwire_soak_latency_us gauge"),
            "{scrape}"
        );
    }
}

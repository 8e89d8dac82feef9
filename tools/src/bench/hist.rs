//! Round-trip times of a bench run, in an HdrHistogram: recording is O(1)
//! and allocation-free, memory is fixed whatever the run's length, and the
//! histograms of a run's connections and repetitions merge exactly. Also
//! the `--histogram` log (HdrHistogram's interval log format, one
//! histogram per result) and the `--interval` reports.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use hdrhistogram::serialization::interval_log::{IntervalLogWriterBuilder, Tag};
use hdrhistogram::serialization::V2DeflateSerializer;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::Mode;
use crate::backend::Backend;

/// Largest round trip recorded as itself, in ns (one hour); longer ones
/// are recorded as this.
const HIGHEST_NS: u64 = 3_600_000_000_000;
/// Significant decimal digits: every value is kept within 0.1%.
const SIGFIG: u8 = 3;

/// Round-trip times in nanoseconds.
#[derive(Debug, Clone)]
pub struct Rtts {
    h: Histogram<u64>,
}

impl Default for Rtts {
    fn default() -> Self {
        Self::new()
    }
}

impl Rtts {
    /// An empty histogram of 1 ns to one hour at 3 significant digits
    /// (its whole memory, about 270 KB, is allocated here).
    pub fn new() -> Self {
        let h = Histogram::new_with_bounds(1, HIGHEST_NS, SIGFIG)
            .expect("1 ns to 1 h at 3 significant digits is a valid histogram");
        Self { h }
    }

    /// Record one round trip.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        self.h.saturating_record(ns);
    }

    /// Add every value of `other` (a connection's or a repetition's).
    pub fn merge(&mut self, other: &Rtts) {
        // Both have the same bounds, so every value of `other` fits and
        // `add` cannot fail; a count past u64::MAX saturates.
        let _ = self.h.add(&other.h);
    }

    /// The values recorded.
    pub fn len(&self) -> u64 {
        self.h.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.h.is_empty()
    }

    /// Forget every value (the memory stays).
    pub fn reset(&mut self) {
        self.h.reset();
    }

    /// Percentiles, mean and spread; `None` when nothing was recorded.
    pub fn summary(&self) -> Option<LatencySummary> {
        if self.h.is_empty() {
            return None;
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        let q = |q: f64| us(self.h.value_at_quantile(q));
        Some(LatencySummary {
            min_us: us(self.h.min()),
            p50_us: q(0.50),
            p99_us: q(0.99),
            p999_us: q(0.999),
            p9999_us: q(0.9999),
            max_us: us(self.h.max()),
            avg_us: self.h.mean() / 1000.0,
            stdev_us: self.h.stdev() / 1000.0,
        })
    }
}

/// Summary of a set of round-trip times, in µs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencySummary {
    /// Fastest.
    pub min_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// 99.99th percentile.
    pub p9999_us: f64,
    /// Slowest.
    pub max_us: f64,
    /// Mean.
    pub avg_us: f64,
    /// Standard deviation.
    pub stdev_us: f64,
}

/// One histogram of the `--histogram` log.
#[derive(Debug)]
pub struct LogEntry<'a> {
    /// `BACKEND-MODE-SIZE`, e.g. `tcp-lat-64`.
    pub tag: String,
    /// When its first measurement started, from the start of the bench.
    pub start: Duration,
    /// Measured time, over every repetition.
    pub duration: Duration,
    /// The round trips.
    pub rtts: &'a Rtts,
}

/// Write `entries` to `path` in HdrHistogram's interval log format
/// (compressed V2 histograms, as Java's `HistogramLogReader` and
/// `HistogramLogProcessor` read them); values are nanoseconds, the max
/// column microseconds. `started` is the bench's start (the log's
/// StartTime and BaseTime).
pub fn write_log(path: &Path, started: SystemTime, entries: &[LogEntry<'_>]) -> Result<(), String> {
    let ctx = |e: &dyn std::fmt::Display| format!("writing --histogram {}: {e}", path.display());
    let mut buf = Vec::new();
    let mut ser = V2DeflateSerializer::new();
    {
        let mut w = IntervalLogWriterBuilder::new()
            .add_comment("starwire bench round-trip times in ns, one histogram per result")
            .add_comment("tag: BACKEND-MODE-SIZE; the max column is in us")
            .with_start_time(started)
            .with_base_time(started)
            .with_max_value_divisor(1000.0)
            .begin_log_with(&mut buf, &mut ser)
            .map_err(|e| ctx(&e))?;
        for e in entries {
            let tag = Tag::new(&e.tag).ok_or_else(|| ctx(&format!("bad tag {:?}", e.tag)))?;
            w.write_histogram(&e.rtts.h, e.start, e.duration, Some(tag))
                .map_err(|e| ctx(&e))?;
        }
    }
    let mut f = std::fs::File::create(path).map_err(|e| ctx(&e))?;
    f.write_all(&buf).map_err(|e| ctx(&e))
}

/// Where a run's `--interval` reports go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IntervalOutput {
    /// A line of text on stderr (stdout holds the table).
    #[default]
    Text,
    /// A JSON line on stdout, among the result lines (`--json`).
    Json,
}

/// `--interval` reports of one run: every `every`, the rate and round
/// trips of the messages completed in that interval. Costs a clock
/// comparison per message; the report is formatted once per interval.
#[derive(Debug)]
pub struct IntervalReport {
    every: Duration,
    /// Backend, mode and size of the run.
    run: (Backend, Mode, usize),
    /// Payload bits a completed message carries (both ways when echoed).
    bits_per_msg: f64,
    output: IntervalOutput,
    /// When the measurement started (the reports' zero).
    t0: Option<Instant>,
    /// Start of the current interval.
    from: Option<Instant>,
    msgs: u64,
    rtts: Rtts,
}

impl IntervalReport {
    /// Reports every `every` for `run` (backend, mode, size), to `output`.
    pub fn new(
        every: Duration,
        run: (Backend, Mode, usize),
        bits_per_msg: f64,
        output: IntervalOutput,
    ) -> Self {
        Self {
            every,
            run,
            bits_per_msg,
            output,
            t0: None,
            from: None,
            msgs: 0,
            rtts: Rtts::new(),
        }
    }

    /// The measurement starts at `now` (after the warm-up).
    pub fn start(&mut self, now: Instant) {
        self.t0 = Some(now);
        self.from = Some(now);
    }

    /// A measured message completed at `now`, with its round trip when
    /// the mode records them.
    #[inline]
    pub fn on_complete(&mut self, now: Instant, rtt_ns: Option<u64>) {
        let Some(from) = self.from else { return };
        self.msgs += 1;
        if let Some(ns) = rtt_ns {
            self.rtts.record(ns);
        }
        if now.saturating_duration_since(from) >= self.every {
            self.emit(now);
        }
    }

    /// The run ended at `now`: report the last, partial interval.
    pub fn finish(&mut self, now: Instant) {
        if self.msgs > 0 {
            self.emit(now);
        }
        self.from = None;
    }

    fn emit(&mut self, now: Instant) {
        let Some(interval) = self.interval(now) else {
            return;
        };
        match self.output {
            IntervalOutput::Text => {
                crate::progress::suspend(|| eprintln!("{}", interval.text()));
            }
            // A stdout that cannot be written fails the next result line,
            // which ends the bench with the error.
            IntervalOutput::Json => {
                let _ = super::write_stdout(&format!("{}\n", interval.json()));
            }
        }
        self.msgs = 0;
        self.rtts.reset();
        self.from = Some(now);
    }

    /// The current interval, ending at `now`.
    fn interval(&self, now: Instant) -> Option<Interval> {
        let (t0, from) = (self.t0?, self.from?);
        let secs = now.saturating_duration_since(from).as_secs_f64();
        let rate = if secs > 0.0 {
            self.msgs as f64 / secs
        } else {
            0.0
        };
        let lat = self.rtts.summary();
        let (backend, mode, size) = self.run;
        Some(Interval {
            backend,
            mode,
            size,
            from_s: from.saturating_duration_since(t0).as_secs_f64(),
            to_s: now.saturating_duration_since(t0).as_secs_f64(),
            msgs_per_s: rate,
            gbps: rate * self.bits_per_msg / 1e9,
            p50_us: lat.map(|l| l.p50_us),
            p99_us: lat.map(|l| l.p99_us),
            max_us: lat.map(|l| l.max_us),
        })
    }
}

/// One `--interval` report; the field names are the result lines' (see
/// docs/CLI.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub backend: Backend,
    pub mode: Mode,
    pub size: usize,
    /// The interval, in seconds from the start of the measurement.
    pub from_s: f64,
    pub to_s: f64,
    pub msgs_per_s: f64,
    pub gbps: f64,
    /// Round trips in the interval (lat and rate; `None` otherwise).
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub max_us: Option<f64>,
}

impl Interval {
    /// `[tcp lat 64 B]   1.00-2.00 s  msgs/s 40213  Gb/s 0.021  rtt p50 21.33 p99 40.10 max 52.00 us`
    fn text(&self) -> String {
        let mut s = format!(
            "[{} {} {} B] {:>15} s  msgs/s {:>10.0}  Gb/s {:>8.3}",
            self.backend,
            self.mode.name(),
            self.size,
            format!("{:.2}-{:.2}", self.from_s, self.to_s),
            self.msgs_per_s,
            self.gbps
        );
        if let (Some(p50), Some(p99), Some(max)) = (self.p50_us, self.p99_us, self.max_us) {
            s.push_str(&format!("  rtt p50 {p50:.2} p99 {p99:.2} max {max:.2} us"));
        }
        s
    }

    /// `{"interval":{...}}`: a consumer of `--json` tells it from a result
    /// line by its one key.
    fn json(&self) -> String {
        #[derive(Serialize)]
        struct Tagged<'a> {
            interval: &'a Interval,
        }
        serde_json::to_string(&Tagged { interval: self })
            .expect("an interval of plain numbers and names serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the histogram's 0.1% resolution.
    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 1e-3 + 1e-9
    }

    #[test]
    fn percentiles_mean_and_spread() {
        let mut r = Rtts::new();
        assert!(r.summary().is_none());
        // 1..=10000 µs, in a scrambled order.
        for i in 0..10_000u64 {
            r.record(((i * 7_919) % 10_000 + 1) * 1000);
        }
        let s = r.summary().expect("non-empty");
        assert_eq!(r.h.len(), 10_000);
        assert!(close(s.min_us, 1.0), "{s:?}");
        assert!(close(s.p50_us, 5000.0), "{s:?}");
        assert!(close(s.p99_us, 9900.0), "{s:?}");
        assert!(close(s.p999_us, 9990.0), "{s:?}");
        assert!(close(s.p9999_us, 9999.0), "{s:?}");
        assert!(close(s.max_us, 10_000.0), "{s:?}");
        assert!(close(s.avg_us, 5000.5), "{s:?}");
        // The uniform distribution's spread: n / sqrt(12).
        assert!((s.stdev_us - 2886.75).abs() < 5.0, "{s:?}");
    }

    #[test]
    fn merge_is_the_union_and_reset_empties() {
        let (mut a, mut b) = (Rtts::new(), Rtts::new());
        for _ in 0..99 {
            a.record(10_000);
        }
        b.record(5_000_000);
        a.merge(&b);
        let s = a.summary().unwrap();
        assert_eq!(a.h.len(), 100);
        assert!(close(s.p50_us, 10.0) && close(s.max_us, 5000.0), "{s:?}");
        assert!(close(s.p999_us, 5000.0), "{s:?}");
        a.reset();
        assert!(a.h.is_empty() && a.summary().is_none());
    }

    #[test]
    fn a_round_trip_past_the_range_is_kept_as_the_largest() {
        let mut r = Rtts::new();
        r.record(u64::MAX);
        r.record(0);
        let s = r.summary().unwrap();
        assert!(close(s.max_us, HIGHEST_NS as f64 / 1000.0), "{s:?}");
        assert_eq!(r.h.len(), 2);
    }

    #[test]
    fn the_log_reads_back_with_its_tags_and_counts() {
        use hdrhistogram::serialization::interval_log::{IntervalLogIterator, LogEntry as Entry};
        use hdrhistogram::serialization::Deserializer;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.hlog");
        let (mut a, mut b) = (Rtts::new(), Rtts::new());
        for i in 1..=1000 {
            a.record(i * 100);
        }
        b.record(42_000);
        let entries = [
            LogEntry {
                tag: "tcp-lat-64".into(),
                start: Duration::from_millis(10),
                duration: Duration::from_secs(2),
                rtts: &a,
            },
            LogEntry {
                tag: "raw-rate-4096".into(),
                start: Duration::from_millis(2500),
                duration: Duration::from_secs(1),
                rtts: &b,
            },
        ];
        write_log(&path, SystemTime::now(), &entries).unwrap();
        let text = std::fs::read(&path).unwrap();
        let mut seen = Vec::new();
        for e in IntervalLogIterator::new(&text) {
            if let Entry::Interval(h) = e.expect("a well-formed log") {
                let raw = base64_decode(h.encoded_histogram());
                let hist: Histogram<u64> = Deserializer::new()
                    .deserialize(&mut raw.as_slice())
                    .expect("a V2 compressed histogram");
                seen.push((
                    h.tag().map(|t| t.as_str().to_owned()),
                    hist.len(),
                    h.duration(),
                ));
            }
        }
        assert_eq!(
            seen,
            vec![
                (Some("tcp-lat-64".into()), 1000, Duration::from_secs(2)),
                (Some("raw-rate-4096".into()), 1, Duration::from_secs(1)),
            ]
        );
        let s = String::from_utf8(text).unwrap();
        assert!(s.contains("#[MaxValueDivisor: 1000.000]"), "{s}");
        assert!(s.contains("Tag=tcp-lat-64,"), "{s}");
    }

    /// Standard base64 (the log's encoding), enough for the test.
    fn base64_decode(s: &str) -> Vec<u8> {
        let val = |c: u8| match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        };
        let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').map(val).collect();
        let mut out = Vec::new();
        for chunk in bytes.chunks(4) {
            let mut n = 0u32;
            for (i, &v) in chunk.iter().enumerate() {
                n |= u32::from(v) << (18 - 6 * i);
            }
            out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
        }
        out
    }

    #[test]
    fn a_tag_with_a_comma_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = Rtts::new();
        let e = [LogEntry {
            tag: "a,b".into(),
            start: Duration::ZERO,
            duration: Duration::ZERO,
            rtts: &r,
        }];
        let err = write_log(&dir.path().join("x"), SystemTime::now(), &e).unwrap_err();
        assert!(err.contains("bad tag"), "{err}");
    }

    fn interval(mode: Mode, lat: Option<&LatencySummary>) -> Interval {
        Interval {
            backend: Backend::Tcp,
            mode,
            size: 64,
            from_s: 1.0,
            to_s: 2.0,
            msgs_per_s: 1000.0,
            gbps: 0.001,
            p50_us: lat.map(|l| l.p50_us),
            p99_us: lat.map(|l| l.p99_us),
            max_us: lat.map(|l| l.max_us),
        }
    }

    #[test]
    fn interval_lines_name_the_run_and_the_window() {
        let mut r = Rtts::new();
        r.record(21_000);
        let s = interval(Mode::Lat, r.summary().as_ref()).text();
        assert!(s.starts_with("[tcp lat 64 B]"), "{s}");
        assert!(s.contains("1.00-2.00"), "{s}");
        assert!(s.contains("msgs/s       1000"), "{s}");
        assert!(s.contains("Gb/s    0.001"), "{s}");
        assert!(s.contains("rtt p50 21.0"), "{s}");
        let bw = interval(Mode::Bw, None).text();
        assert!(
            bw.starts_with("[tcp bw 64 B]") && !bw.contains("rtt"),
            "{bw}"
        );
    }

    #[test]
    fn an_interval_in_json_is_one_object_under_its_key() {
        let mut r = Rtts::new();
        r.record(21_000);
        let line = interval(Mode::Rate, r.summary().as_ref()).json();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let top: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(top, ["interval"], "{line}");
        let i = v["interval"].as_object().unwrap();
        let mut keys: Vec<&str> = i.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "backend",
                "from_s",
                "gbps",
                "max_us",
                "mode",
                "msgs_per_s",
                "p50_us",
                "p99_us",
                "size",
                "to_s"
            ],
            "{line}"
        );
        assert_eq!(
            (&i["backend"], &i["mode"], &i["size"]),
            (&"tcp".into(), &"rate".into(), &64.into())
        );
        assert_eq!(
            (i["from_s"].as_f64(), i["to_s"].as_f64()),
            (Some(1.0), Some(2.0))
        );
        assert_eq!(i["msgs_per_s"].as_f64(), Some(1000.0));
        assert!((i["p50_us"].as_f64().unwrap() - 21.0).abs() < 0.1, "{line}");
        // Without round trips (bw) the percentiles are null, as in the
        // result lines.
        let bw: serde_json::Value = serde_json::from_str(&interval(Mode::Bw, None).json()).unwrap();
        assert!(bw["interval"]["p50_us"].is_null(), "{bw}");
        assert_eq!(bw["interval"]["mode"], "bw");
    }

    #[test]
    fn an_interval_reports_its_window_rate_and_round_trips() {
        let t = Instant::now();
        let mut rep = IntervalReport::new(
            Duration::from_secs(1),
            (Backend::Tcp, Mode::Lat, 64),
            512.0,
            IntervalOutput::Json,
        );
        rep.start(t);
        for _ in 0..10 {
            rep.on_complete(t, Some(20_000));
        }
        let i = rep.interval(t + Duration::from_millis(500)).unwrap();
        assert_eq!((i.from_s, i.to_s, i.msgs_per_s), (0.0, 0.5, 20.0));
        assert!((i.gbps - 20.0 * 512.0 / 1e9).abs() < 1e-15, "{i:?}");
        assert!((i.p99_us.unwrap() - 20.0).abs() < 0.1, "{i:?}");
    }

    #[test]
    fn interval_report_counts_only_after_start() {
        let mut rep = IntervalReport::new(
            Duration::from_secs(3600),
            (Backend::Tcp, Mode::Lat, 1),
            8.0,
            IntervalOutput::Text,
        );
        let t = Instant::now();
        rep.on_complete(t, Some(1000));
        assert_eq!(rep.msgs, 0, "before start nothing is counted");
        rep.start(t);
        rep.on_complete(t, Some(1000));
        rep.on_complete(t, None);
        assert_eq!((rep.msgs, rep.rtts.h.len()), (2, 1));
        rep.finish(t + Duration::from_millis(5));
        assert_eq!(rep.msgs, 0);
        rep.on_complete(t, Some(1000));
        assert_eq!(rep.msgs, 0, "after finish nothing is counted");
    }
}

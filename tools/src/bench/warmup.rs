//! A run's warm-up: a count of completions (`--warmup 1000`), or a time
//! since the run's first send (`--warmup 2s`, perftest's `--margin`); the
//! gate that says at which completion it ends, and the budget every lat,
//! rate and bw client passes its requests through to learn which may be
//! sent and which are measured.

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

/// The requests of a lat, rate or bw run, over its connections: when each
/// may send one more, and which are measured.
///
/// A request is measured if it was sent after the warm-up ended (at its
/// [`Completion::Last`]), whenever it completes: one still in flight then
/// was sent in the warm-up, and warm-up messages stay out of the
/// statistics, as sockperf keeps only the messages sent after its warm-up
/// and perftest runs its warm-up before its measured iterations. `--iters`
/// is then a count of requests sent after the warm-up, split evenly over
/// the connections (as perftest gives each QP its `-n`), so a connection
/// that answered faster in the warm-up does not take the others' share.
///
/// The warm-up's requests still in flight when it ends are answered after
/// it, among the measured ones: the measured time is that of the run's
/// last completions, as many as were measured, so that rates are the
/// rates of the completions in it.
///
/// With a target rate (`--rate`, [`Self::with_rate`]) the measured
/// requests are sent on a schedule (open loop, as wrk2's `-R`): the
/// measurement's request `i` is due `i / rate` seconds after it starts,
/// dealt round-robin over the connections (request `i` to rank `i mod n`,
/// so `--iters` shares stay those of the closed loop). A request may not
/// leave before it is due, and its latency counts from when it was due
/// ([`Self::on_send`]), so a window that is full when it is due shows in
/// the percentiles. With `--duration` the requests due within it are
/// sent, however late. The warm-up stays closed-loop.
#[derive(Debug)]
pub(crate) struct RequestBudget {
    gate: WarmupGate,
    /// `--iters`; ignored with a duration.
    iters: u64,
    duration: Option<Duration>,
    /// `--rate`: measured requests per second over all connections.
    rate: Option<f64>,
    /// By connection rank: measured requests sent on it.
    sent_on: Vec<u64>,
    /// Requests sent in the warm-up.
    warmup_sent: u64,
    completed: u64,
    measured: u64,
    start: Option<Instant>,
    /// Completions still to come before the measured time starts: the
    /// warm-up's requests in flight when it ended.
    skip: u64,
    /// When the measured time starts: the last of those completions.
    window_start: Option<Instant>,
    /// The last measured completion.
    end: Option<Instant>,
}

impl RequestBudget {
    /// A run of `iters` measured requests (or of `duration`, measured)
    /// after `warmup`, with no connection yet.
    pub(crate) fn new(warmup: Warmup, iters: u64, duration: Option<Duration>) -> Self {
        Self {
            gate: WarmupGate::new(warmup),
            iters,
            duration,
            rate: None,
            sent_on: Vec::new(),
            warmup_sent: 0,
            completed: 0,
            measured: 0,
            start: None,
            skip: 0,
            window_start: None,
            end: None,
        }
    }

    /// The measured requests follow the schedule of `rate` requests per
    /// second over all connections (`None`: closed loop).
    pub(crate) fn with_rate(mut self, rate: Option<f64>) -> Self {
        self.rate = rate;
        self
    }

    /// One more connection; its rank, the index the other calls take.
    pub(crate) fn add_connection(&mut self) -> usize {
        self.sent_on.push(0);
        self.sent_on.len() - 1
    }

    /// The connections are ready to send at `now`. Without a warm-up
    /// (`--warmup 0`) the measurement starts here: true then.
    pub(crate) fn begin(&mut self, now: Instant) -> bool {
        if self.gate.is_none() && self.start.is_none() {
            self.start_at(now);
            return true;
        }
        false
    }

    fn start_at(&mut self, now: Instant) {
        self.start = Some(now);
        self.end = Some(now);
        self.skip = self.warmup_sent - self.completed;
        if self.skip == 0 {
            self.window_start = Some(now);
        }
    }

    /// When the measurement started (the warm-up ended), if it did.
    #[cfg(test)]
    pub(crate) fn start(&self) -> Option<Instant> {
        self.start
    }

    /// The last measured completion, or the measurement's start.
    pub(crate) fn end(&self) -> Option<Instant> {
        self.end
    }

    /// The measured time: that of the run's last completions, as many as
    /// were measured (from the completion of the warm-up's last request
    /// that was in flight when it ended, or from its end).
    pub(crate) fn elapsed(&self) -> Duration {
        match (self.window_start.or(self.start), self.end) {
            (Some(t0), Some(t1)) => t1.saturating_duration_since(t0),
            _ => Duration::ZERO,
        }
    }

    /// The measured requests completed so far.
    pub(crate) fn measured(&self) -> u64 {
        self.measured
    }

    /// Whether connection `rank` may send one more request at `now`:
    /// always in the warm-up, then until its share of `iters` is sent or
    /// the duration has passed; with a rate, only once its next request is
    /// due ([`Self::next_due`]).
    pub(crate) fn may_start(&self, rank: usize, now: Instant) -> bool {
        let Some(t0) = self.start else {
            return true;
        };
        if self.rate.is_some() {
            return !self.past_duration(now) && self.next_due(rank).is_some_and(|due| due <= now);
        }
        if let Some(d) = self.duration {
            return now.saturating_duration_since(t0) < d;
        }
        self.sent_on
            .get(rank)
            .is_some_and(|&sent| sent < self.share(rank))
    }

    /// Connection `rank`'s share of `iters`.
    fn share(&self, rank: usize) -> u64 {
        let n = self.sent_on.len().max(1) as u64;
        self.iters / n + u64::from((rank as u64) < self.iters % n)
    }

    /// With a rate, once the schedule started: when connection `rank`'s
    /// next measured request is due, if it has one left (within its share
    /// of `iters`, or due within the duration). `None` in the closed loop.
    ///
    /// The schedule starts once the warm-up's requests still in flight as
    /// it ended are answered (`window_start`): the closed-loop warm-up
    /// leaves every window full, and the first scheduled requests would
    /// otherwise wait behind that backlog, their latencies counted from
    /// their due times.
    pub(crate) fn next_due(&self, rank: usize) -> Option<Instant> {
        let (rate, t0) = (self.rate?, self.window_start?);
        let sent = *self.sent_on.get(rank)?;
        let n = self.sent_on.len() as u64;
        // The index of this request in the measurement's schedule.
        let i = sent.checked_mul(n)?.checked_add(rank as u64)?;
        let offset = i as f64 / rate;
        let scheduled = match self.duration {
            Some(d) => offset < d.as_secs_f64(),
            None => sent < self.share(rank),
        };
        if !scheduled {
            return None;
        }
        t0.checked_add(Duration::try_from_secs_f64(offset).ok()?)
    }

    /// With a rate: whether the schedule has started (the warm-up's
    /// requests in flight as it ended are answered).
    #[cfg(feature = "grpc")]
    pub(crate) fn schedule_started(&self) -> bool {
        self.window_start.is_some()
    }

    /// Whether the run sends on a schedule (`--rate`).
    pub(crate) fn open_loop(&self) -> bool {
        self.rate.is_some()
    }

    /// With a rate: whether some connection has a scheduled request left
    /// to send at `now`. False in the closed loop, before the schedule
    /// starts, and past the duration.
    pub(crate) fn scheduled_left(&self, now: Instant) -> bool {
        !self.past_duration(now) && (0..self.sent_on.len()).any(|r| self.next_due(r).is_some())
    }

    /// With a rate and a duration: whether the duration has passed since
    /// the schedule started. Nothing is sent after it, as wrk2 stops at
    /// its `-d`: requests due but not sent by then (the window was full)
    /// are not sent, and `msgs_per_s` falls short of the rate by them.
    fn past_duration(&self, now: Instant) -> bool {
        match (self.duration, self.window_start) {
            (Some(d), Some(t0)) => now.saturating_duration_since(t0) >= d,
            _ => false,
        }
    }

    /// Connection `rank` sent a request at `now`. A measured one gives
    /// the instant its latency counts from: when it was due with a rate
    /// (it may leave late), else `now`. `None` for a warm-up request.
    pub(crate) fn on_send(&mut self, rank: usize, now: Instant) -> Option<Instant> {
        self.gate.on_send(now);
        if self.start.is_none() {
            self.warmup_sent += 1;
            return None;
        }
        let origin = self.next_due(rank).unwrap_or(now);
        if let Some(sent) = self.sent_on.get_mut(rank) {
            *sent += 1;
        }
        Some(origin)
    }

    /// A request completed at `now`; `measured`: [`Self::on_send`] gave
    /// it an instant. At the warm-up's last completion the measurement
    /// starts.
    pub(crate) fn on_complete(&mut self, measured: bool, now: Instant) -> Completion {
        self.completed += 1;
        if self.start.is_some() && self.skip > 0 {
            self.skip -= 1;
            if self.skip == 0 {
                self.window_start = Some(now);
            }
        }
        if measured {
            self.measured += 1;
            self.end = Some(now);
            return Completion::Measured;
        }
        if self.start.is_some() {
            // A warm-up request answered after a measured one (on another
            // connection): the measured time still ends at the run's last
            // completion, so that it holds as many as were measured.
            self.end = Some(now);
            return Completion::Warmup;
        }
        match self.gate.on_complete(self.completed, now) {
            Completion::Warmup => Completion::Warmup,
            // The warm-up's last request: not measured either.
            Completion::Last | Completion::Measured => {
                self.start_at(now);
                Completion::Last
            }
        }
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

    /// Sends `budget` lets connection `rank` make at `now`, up to `max`.
    fn send_all(b: &mut RequestBudget, rank: usize, now: Instant, max: usize) -> Vec<bool> {
        let mut sent = Vec::new();
        while sent.len() < max && b.may_start(rank, now) {
            sent.push(b.on_send(rank, now).is_some());
        }
        sent
    }

    #[test]
    fn only_requests_sent_after_the_warm_up_are_measured() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // One connection with 16 outstanding and 4 iterations: the 15
        // still in flight when the warm-up ends are not among them.
        let mut b = RequestBudget::new(Warmup::Time(Duration::from_millis(10)), 4, None);
        let c = b.add_connection();
        assert!(!b.begin(t0), "a warm-up to wait out");
        assert_eq!(send_all(&mut b, c, t0, 16), [false; 16]);
        assert_eq!(b.on_complete(false, ms(5)), Completion::Warmup);
        assert_eq!(send_all(&mut b, c, ms(5), 1), [false]);
        assert_eq!(b.on_complete(false, ms(10)), Completion::Last);
        assert_eq!(b.start(), Some(ms(10)));
        assert_eq!(send_all(&mut b, c, ms(10), 16), [true; 4]);
        for _ in 0..15 {
            assert_eq!(b.on_complete(false, ms(11)), Completion::Warmup);
        }
        for k in 0..4 {
            assert_eq!(b.on_complete(true, ms(12 + k)), Completion::Measured);
        }
        assert_eq!(b.measured(), 4);
        // The last 4 completions: after the 15th at 11 ms.
        assert_eq!(b.elapsed(), Duration::from_millis(4));
        assert_eq!(b.end(), Some(ms(15)));
    }

    #[test]
    fn iters_are_shared_evenly_from_the_end_of_the_warm_up() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // Whatever each connection sent in the warm-up, 10 over 4 is 3,
        // 3, 2 and 2, in attach order.
        let mut b = RequestBudget::new(Warmup::Iters(3), 10, None);
        let ranks: Vec<usize> = (0..4).map(|_| b.add_connection()).collect();
        assert_eq!(ranks, [0, 1, 2, 3]);
        assert_eq!(send_all(&mut b, 0, t0, 50), [false; 50]);
        for k in 1..=3 {
            let want = if k == 3 {
                Completion::Last
            } else {
                Completion::Warmup
            };
            assert_eq!(b.on_complete(false, ms(k)), want);
        }
        let shares: Vec<usize> = (0..4)
            .map(|r| send_all(&mut b, r, ms(3), 50).len())
            .collect();
        assert_eq!(shares, [3, 3, 2, 2]);
        // No warm-up: measured from the first send.
        let mut none = RequestBudget::new(Warmup::Iters(0), 2, None);
        let c = none.add_connection();
        assert!(none.begin(t0));
        assert_eq!(send_all(&mut none, c, t0, 5), [true, true]);
        assert_eq!(none.on_complete(true, ms(1)), Completion::Measured);
    }

    #[test]
    fn a_duration_counts_from_the_end_of_the_warm_up() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let d = Some(Duration::from_millis(20));
        let mut b = RequestBudget::new(Warmup::Time(Duration::from_millis(10)), 1, d);
        let c = b.add_connection();
        assert_eq!(send_all(&mut b, c, t0, 3), [false; 3]);
        assert_eq!(b.on_complete(false, ms(10)), Completion::Last);
        assert_eq!(send_all(&mut b, c, ms(29), 3), [true; 3]);
        assert!(!b.may_start(c, ms(30)));
        assert_eq!(b.on_complete(false, ms(31)), Completion::Warmup);
        assert_eq!(b.on_complete(true, ms(32)), Completion::Measured);
        assert_eq!(b.on_complete(false, ms(33)), Completion::Warmup);
        for k in 34..36 {
            assert_eq!(b.on_complete(true, ms(k)), Completion::Measured);
        }
        // 3 measured, 2 of the warm-up in flight at its end: the last 3
        // completions, after the second since its end (at 32 ms).
        assert_eq!((b.measured(), b.elapsed()), (3, Duration::from_millis(3)));
        assert_eq!(b.end(), Some(ms(35)));
    }

    /// A connection with no share of `--iters` whose warm-up request is
    /// answered last: the measured time is the run's last completion's,
    /// not 0 (which gave no rate at all).
    #[test]
    fn the_measured_time_ends_at_the_run_s_last_completion() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut b = RequestBudget::new(Warmup::Iters(1), 1, None);
        let (r0, r1) = (b.add_connection(), b.add_connection());
        assert!(!b.begin(t0));
        assert_eq!(send_all(&mut b, r0, t0, 1), [false]);
        assert_eq!(send_all(&mut b, r1, t0, 1), [false]);
        assert_eq!(b.on_complete(false, ms(1)), Completion::Last);
        assert_eq!(send_all(&mut b, r0, ms(1), 1), [true]);
        assert_eq!(send_all(&mut b, r1, ms(1), 1), [] as [bool; 0]);
        assert_eq!(b.on_complete(true, ms(2)), Completion::Measured);
        assert_eq!(b.on_complete(false, ms(5)), Completion::Warmup);
        assert_eq!(b.measured(), 1);
        assert_eq!(b.elapsed(), Duration::from_millis(3));
        assert_eq!(b.end(), Some(ms(5)));
    }

    #[test]
    fn a_rate_deals_due_times_round_robin_from_the_end_of_the_warm_up() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        // 1000/s over 2 connections: request i of the measurement is due
        // at i ms, on rank i mod 2; 5 iterations are 3 and 2.
        let mut b = RequestBudget::new(Warmup::Iters(1), 5, None).with_rate(Some(1000.0));
        let ranks: Vec<usize> = (0..2).map(|_| b.add_connection()).collect();
        assert!(b.open_loop());
        // The warm-up is closed-loop: no schedule yet.
        assert!(!b.begin(t0));
        assert_eq!((b.next_due(0), b.scheduled_left(t0)), (None, false));
        assert_eq!(send_all(&mut b, 0, t0, 3), [false; 3]);
        assert_eq!(b.on_complete(false, ms(8)), Completion::Last);
        // The schedule waits for the warm-up's requests still in flight,
        // so that the first scheduled ones do not queue behind them.
        assert_eq!((b.next_due(0), b.may_start(0, ms(9))), (None, false));
        assert_eq!(b.on_complete(false, ms(9)), Completion::Warmup);
        assert_eq!(b.next_due(0), None);
        assert_eq!(b.on_complete(false, ms(10)), Completion::Warmup);
        assert_eq!((b.next_due(0), b.next_due(1)), (Some(ms(10)), Some(ms(11))));
        assert!(b.may_start(0, ms(10)) && !b.may_start(1, ms(10)));
        let mut sent = Vec::new();
        for now in (10..20).map(ms) {
            for &r in &ranks {
                while b.may_start(r, now) {
                    sent.push((r, b.on_send(r, now).expect("measured")));
                }
            }
        }
        assert_eq!(
            sent,
            [
                (0, ms(10)),
                (1, ms(11)),
                (0, ms(12)),
                (1, ms(13)),
                (0, ms(14))
            ]
        );
        assert_eq!((b.next_due(0), b.next_due(1)), (None, None));
        assert!(!b.scheduled_left(ms(20)));
    }

    #[test]
    fn a_late_request_counts_from_when_it_was_due() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut b = RequestBudget::new(Warmup::Iters(0), 10, None).with_rate(Some(1000.0));
        let c = b.add_connection();
        assert!(b.begin(t0));
        assert_eq!(b.on_send(c, t0), Some(t0));
        // Sent 4 ms after it was due (its window was full, say): the
        // latency counts from 1 ms, and the next ones are due already.
        assert!(b.may_start(c, ms(5)));
        assert_eq!(b.on_send(c, ms(5)), Some(ms(1)));
        assert_eq!(b.on_send(c, ms(5)), Some(ms(2)));
        assert_eq!(b.next_due(c), Some(ms(3)));
        // Not before it is due.
        assert!(!b.may_start(c, ms(3) - Duration::from_nanos(1)));
        // The closed loop counts from the send.
        let mut closed = RequestBudget::new(Warmup::Iters(0), 10, None);
        let c = closed.add_connection();
        assert!(closed.begin(t0));
        assert_eq!(closed.next_due(c), None);
        assert_eq!(closed.on_send(c, ms(5)), Some(ms(5)));
    }

    #[test]
    fn a_rate_with_a_duration_sends_what_is_due_until_it_ends() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let d = Some(Duration::from_micros(3500));
        let mut b = RequestBudget::new(Warmup::Iters(0), 1, d).with_rate(Some(1000.0));
        let c = b.add_connection();
        assert!(b.begin(t0));
        // Due at 0, 1, 2 and 3 ms: those due by 2 ms leave then, late
        // ones included; the one due at 3 ms is not sent past the
        // duration (wrk2 stops at its -d too).
        assert_eq!(send_all(&mut b, c, ms(2), 10), [true; 3]);
        assert!(b.scheduled_left(ms(3)));
        assert!(!b.may_start(c, ms(4)));
        assert!(!b.scheduled_left(ms(4)));
        for k in 0..3 {
            assert_eq!(b.on_complete(true, ms(5 + k)), Completion::Measured);
        }
        assert_eq!(b.measured(), 3);
        // Without the duration, a backlog is sent late and measured.
        let mut b = RequestBudget::new(Warmup::Iters(0), 4, None).with_rate(Some(1000.0));
        let c = b.add_connection();
        assert!(b.begin(t0));
        assert_eq!(send_all(&mut b, c, ms(50), 10), [true; 4]);
    }
}

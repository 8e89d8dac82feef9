//! Unit tests of the session-layer load generator: warm-up, budgets and
//! the `--rate` schedule, driven with explicit times.

use super::super::{Plan, Warmup};
use super::*;
use crate::backend::Backend;

/// One run's load generator over `conns` unconnected connections:
/// requests are queued on them and never sent, and the test answers
/// them at the times it chooses.
struct Rig {
    st: GenState,
    conns: Vec<Connection>,
}

fn run_of(mode: Mode, inflight: usize, iters: u64, warmup: Warmup, conns: usize) -> Run {
    let p = Plan {
        backends: vec![Backend::Tcp],
        modes: vec![mode],
        sizes: vec![8],
        inflight: Some(inflight),
        iters: Some(iters),
        duration_s: None,
        warmup: Some(0),
        warmup_s: None,
        tensors: 1,
        repeat: 1,
        polling: true,
        client_core: None,
        server_core: None,
        connections: conns,
        interval_s: None,
        bidirectional: false,
        cpu_util: false,
    };
    let mut run = p.runs().remove(0);
    run.warmup = warmup;
    run
}

impl Rig {
    /// Attach `run.connections` connections and issue every
    /// connection's first window at `now`, as the first turn does.
    fn kick(run: &Run, now: Instant) -> Self {
        let mut st = GenState::new(run);
        let cfg = conn_config(TaskRole::Worker, window_for(run));
        let conns = (0..run.connections)
            .map(|c| {
                st.attach(c);
                Connection::new(cfg.clone(), 1 << 20)
            })
            .collect::<Vec<_>>();
        let mut rig = Self { st, conns };
        rig.st.begin(now);
        for c in 0..rig.conns.len() {
            rig.st.issue(c, &mut rig.conns[c], now);
        }
        rig
    }

    /// Answer the oldest outstanding request of connection `c` at
    /// `now`; false if it has none.
    fn answer(&mut self, c: usize, now: Instant) -> bool {
        let Some(&(id, _, _)) = self.st.starts[c].front() else {
            return false;
        };
        let m = Incoming::Response {
            id,
            opcode: self.st.op,
            status: Status::Ok,
            body: &[],
        };
        self.st.on_incoming(c, &mut self.conns[c], m, now, || now);
        assert_eq!(self.st.error, None);
        true
    }

    /// Answer every connection in turn, one request each, a
    /// microsecond apart from `from`, until the run is complete.
    fn finish(&mut self, from: Instant) {
        let mut now = from;
        for _ in 0..10_000 {
            if self.st.complete {
                return;
            }
            for c in 0..self.conns.len() {
                now += Duration::from_micros(1);
                self.answer(c, now);
            }
        }
        panic!("the run never completed");
    }

    /// The slowest round trip recorded, if any.
    fn max_rtt(&self) -> Option<Duration> {
        let s = self.st.rtts.summary()?;
        Some(Duration::from_nanos((s.max_us * 1000.0) as u64))
    }
}

/// Windows of 4 on 4 connections, answered round-robin a millisecond
/// apart through the warm-up, then a microsecond apart: the requests
/// in flight when the warm-up ends were sent in it, and the
/// measurement takes exactly `--iters` sent after it.
#[test]
fn requests_in_flight_when_the_warm_up_ends_are_not_measured() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    for warmup in [Warmup::Time(Duration::from_millis(10)), Warmup::Iters(10)] {
        let run = run_of(Mode::Rate, 4, 6, warmup, 4);
        let mut rig = Rig::kick(&run, t0);
        for k in 1..=10 {
            assert!(rig.answer((k as usize - 1) % 4, ms(k)));
        }
        assert_eq!(rig.st.budget.start(), Some(ms(10)), "{warmup:?}");
        rig.finish(ms(10));
        assert_eq!(rig.st.budget.measured(), 6, "{warmup:?}");
        // Every measured request was sent at or after 10 ms and
        // answered within microseconds; every warm-up one waited 1 ms
        // or more.
        let max = rig.max_rtt().expect("round trips recorded");
        assert!(max < Duration::from_millis(1), "{warmup:?}: {max:?}");
    }
}

/// One connection answers through the whole warm-up while three wait:
/// the fast one must not have used up the others' shares, nor the
/// others measure their warm-up requests.
#[test]
fn a_time_warm_up_over_uneven_connections_measures_exactly_iters() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let run = run_of(Mode::Lat, 1, 8, Warmup::Time(Duration::from_millis(10)), 4);
    let mut rig = Rig::kick(&run, t0);
    for k in 1..=10 {
        assert!(rig.answer(0, ms(k)));
    }
    assert_eq!(rig.st.budget.start(), Some(ms(10)));
    rig.finish(ms(10));
    assert_eq!(rig.st.budget.measured(), 8);
    let max = rig.max_rtt().expect("round trips recorded");
    assert!(max < Duration::from_millis(1), "{max:?}");
}

impl Rig {
    /// What a turn's `poll` does with `--rate`: issue the requests
    /// due on every connection at `now`; how many were sent.
    fn pump(&mut self, now: Instant) -> usize {
        (0..self.conns.len())
            .map(|c| self.st.issue(c, &mut self.conns[c], now))
            .sum()
    }

    fn outstanding(&self, c: usize) -> usize {
        self.st.starts[c].len()
    }
}

fn open_loop(mode: Mode, inflight: usize, iters: u64, warmup: Warmup, conns: usize) -> Run {
    let mut run = run_of(mode, inflight, iters, warmup, conns);
    run.rate = Some(1000.0);
    run
}

/// 1000/s with a window of 2: requests leave when due, not sooner;
/// those due while the window is full wait for a response, and the
/// reactor is not woken for them until then.
#[test]
fn a_rate_sends_when_due_and_waits_while_the_window_is_full() {
    let t0 = Instant::now();
    let us = |n: u64| t0 + Duration::from_micros(n);
    let run = open_loop(Mode::Rate, 2, 6, Warmup::Iters(0), 1);
    let mut rig = Rig::kick(&run, t0);
    assert_eq!(rig.outstanding(0), 1, "only the first is due at the start");
    assert_eq!(rig.st.next_due(), Some(us(1000)));
    assert_eq!(rig.pump(us(999)), 0);
    assert_eq!(rig.pump(us(1000)), 1);
    // Window full: nothing to wake for, whatever is due.
    assert_eq!(rig.st.next_due(), None);
    assert_eq!(rig.pump(us(5000)), 0);
    // A response frees a slot: the request due at 2 ms leaves at once
    // (late), and the one due at 3 ms waits for the next.
    assert!(rig.answer(0, us(5000)));
    assert_eq!(rig.outstanding(0), 2);
    let (_, origin, measured) = rig.st.starts[0][1];
    assert_eq!((origin, measured), (us(2000), true));
    assert!(!rig.st.complete);
}

/// Lat (one outstanding) at 1000/s, the first answer 3 ms late: each
/// round trip counts from its due time, so the backlog shows (3, 2
/// and 1 ms) where the send times would say a microsecond each.
#[test]
fn a_rate_measures_latency_from_the_due_time() {
    let t0 = Instant::now();
    let us = |n: u64| t0 + Duration::from_micros(n);
    let run = open_loop(Mode::Lat, 1, 4, Warmup::Iters(0), 1);
    let mut rig = Rig::kick(&run, t0);
    assert!(rig.answer(0, us(3000)));
    for k in 1..=3 {
        assert!(rig.answer(0, us(3000 + k)));
    }
    assert!(rig.st.complete);
    assert_eq!(rig.st.budget.measured(), 4);
    let s = rig.st.rtts.summary().expect("round trips recorded");
    // 3000, 2001, 1002 and 3 µs, within the histogram's 0.1%.
    assert!((s.max_us - 3000.0).abs() <= 3.0, "{s:?}");
    assert!((s.min_us - 3.0).abs() <= 0.01, "{s:?}");
    assert!((s.avg_us - 1501.5).abs() <= 1.5, "{s:?}");
}

/// A warm-up over 3 connections, then a schedule of exactly `--iters`
/// requests dealt over them; the run completes only when the last
/// scheduled one is answered, not when the window first drains.
#[test]
fn a_rate_measures_exactly_iters_over_connections() {
    let t0 = Instant::now();
    let us = |n: u64| t0 + Duration::from_micros(n);
    let run = open_loop(Mode::Rate, 4, 10, Warmup::Iters(12), 3);
    let mut rig = Rig::kick(&run, t0);
    let mut now = t0;
    let mut k = 0u64;
    while !rig.st.complete {
        k += 1;
        assert!(k < 100_000, "the run never completed");
        now = us(10 * k);
        rig.pump(now);
        for c in 0..3 {
            rig.answer(c, now);
        }
        // Between two due times every request may be answered: the
        // run is not over while the schedule has more.
        if rig.st.budget.start().is_some() && rig.st.issued == rig.st.completed {
            assert_eq!(rig.st.complete, !rig.st.budget.scheduled_left(now));
        }
    }
    assert_eq!(rig.st.budget.measured(), 10);
    // 10 ms of schedule at 1000/s from the warm-up's end.
    let start = rig.st.budget.start().expect("measured");
    assert!(now >= start + Duration::from_millis(9), "{:?}", now - start);
}

/// The reactor is asked to wake a little before the next due time.
#[test]
fn a_rate_wakes_the_reactor_before_the_next_due_time() {
    let t0 = Instant::now();
    let run = open_loop(Mode::Rate, 4, 10, Warmup::Iters(0), 1);
    let rig = Rig::kick(&run, t0);
    let gen = LoadGen {
        ids: Vec::new(),
        st: rig.st,
    };
    let due = t0 + Duration::from_millis(1);
    assert_eq!(gen.st.next_due(), Some(due));
    assert_eq!(
        <LoadGen as Service<TcpDriver>>::next_deadline(&gen),
        Some(due - WAKE_EARLY)
    );
    // Closed loop: no timer.
    let closed = Rig::kick(&run_of(Mode::Rate, 4, 10, Warmup::Iters(0), 1), t0);
    assert_eq!(closed.st.next_due(), None);
}

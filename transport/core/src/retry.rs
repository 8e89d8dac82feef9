//! When to try a connection setup step again: the backoff schedule of
//! [`dial`](crate::accept::dial) and [`resolve`](crate::accept::resolve).
//!
//! Under a launcher, tasks start in any order, and the DNS name of a
//! headless service's pod exists only once that pod does. So a name that
//! does not resolve yet, or a port nobody listens on yet, is retried with
//! growing pauses until a deadline (`--connect-timeout`).
//!
//! The schedule is plain data and the clock an argument: [`Backoff`] says
//! how the pauses grow, [`Retry`] counts the failed attempts and, given
//! `now`, says how long to wait before the next one or that the deadline
//! has passed. Only the callers read the clock and sleep, so the tests
//! step through the schedule without either.

use std::time::{Duration, Instant};

/// How the pause after each failed attempt grows: `first` after the first
/// failure, doubling after each further one, never more than `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The pause after the first failed attempt.
    pub first: Duration,
    /// The longest pause.
    pub max: Duration,
}

impl Backoff {
    /// The schedule of connection setup: quick at first, as a peer that
    /// starts at the same moment is up within milliseconds, then at most
    /// one attempt (and one warning) every 5 s.
    pub const CONNECT: Backoff = Backoff {
        first: Duration::from_millis(50),
        max: Duration::from_secs(5),
    };

    /// The pause after failed attempt number `attempt` (1 is the first).
    pub fn delay(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.first
            .checked_mul(1u32 << doublings)
            .map_or(self.max, |d| d.min(self.max))
    }
}

/// The failed attempts of one step, and its deadline.
#[derive(Debug, Clone)]
pub struct Retry {
    backoff: Backoff,
    deadline: Instant,
    failures: u32,
}

impl Retry {
    /// A step that may be attempted until `deadline`.
    pub fn new(backoff: Backoff, deadline: Instant) -> Self {
        Retry {
            backoff,
            deadline,
            failures: 0,
        }
    }

    /// Failed attempts so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// An attempt failed at `now`: the pause before the next one, or `None`
    /// once the deadline has passed. The last pause ends at the deadline,
    /// so the last attempt is made then.
    pub fn handle_failure(&mut self, now: Instant) -> Option<Duration> {
        self.failures = self.failures.saturating_add(1);
        let left = self.deadline.checked_duration_since(now)?;
        if left.is_zero() {
            return None;
        }
        Some(self.backoff.delay(self.failures).min(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn pauses_double_up_to_the_cap() {
        let b = Backoff::CONNECT;
        let got: Vec<u128> = (1..=10).map(|a| b.delay(a).as_millis()).collect();
        assert_eq!(got, [50, 100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        // No overflow however many attempts failed.
        assert_eq!(b.delay(u32::MAX), b.max);
        let huge = Backoff {
            first: Duration::from_secs(u64::MAX / 4),
            max: Duration::MAX,
        };
        assert_eq!(huge.delay(40), Duration::MAX);
    }

    /// Step a retry through a clock that advances by exactly each pause
    /// (attempts take no time): the attempts it makes, as offsets from the
    /// start.
    fn schedule(backoff: Backoff, timeout: Duration) -> Vec<Duration> {
        let t0 = Instant::now();
        let mut r = Retry::new(backoff, t0 + timeout);
        let mut now = t0;
        let mut attempts = vec![Duration::ZERO];
        while let Some(wait) = r.handle_failure(now) {
            now += wait;
            attempts.push(now - t0);
        }
        assert_eq!(r.failures() as usize, attempts.len());
        attempts
    }

    #[test]
    fn retries_until_the_deadline_and_makes_the_last_attempt_at_it() {
        let got = schedule(Backoff::CONNECT, 2 * Duration::from_secs(1));
        let want: Vec<Duration> = [0, 50, 150, 350, 750, 1550, 2000]
            .iter()
            .map(|&m| m * MS)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_default_timeout_makes_a_bounded_number_of_attempts() {
        // 8 attempts in the first 6.35 s, 58 more 5 s apart, the last at 300 s.
        let got = schedule(Backoff::CONNECT, Duration::from_secs(300));
        assert_eq!(got.len(), 8 + 58 + 1);
        assert_eq!(got.last(), Some(&Duration::from_secs(300)));
        assert!(got.windows(2).all(|w| w[1] - w[0] <= Backoff::CONNECT.max));
    }

    #[test]
    fn a_deadline_already_passed_gives_up_at_once() {
        let t0 = Instant::now();
        let mut r = Retry::new(Backoff::CONNECT, t0);
        assert_eq!(r.handle_failure(t0), None);
        assert_eq!(r.handle_failure(t0 + MS), None);
        assert_eq!(r.failures(), 2);
        assert_eq!(schedule(Backoff::CONNECT, Duration::ZERO), [Duration::ZERO]);
    }
}

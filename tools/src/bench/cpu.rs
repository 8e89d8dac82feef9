//! `--cpu-util`: the CPU time of this process over a run, as a share of
//! one core (perftest's `--cpu_util`, `top`'s `%CPU`: two busy cores are
//! 200%).

use std::time::{Duration, Instant};

use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::time::TimeValLike;

/// User plus system CPU time of every thread of this process so far.
fn process_cpu() -> Result<Duration, String> {
    let u = getrusage(UsageWho::RUSAGE_SELF).map_err(|e| format!("getrusage: {e}"))?;
    let us = u.user_time().num_microseconds() + u.system_time().num_microseconds();
    Ok(Duration::from_micros(us.max(0) as u64))
}

/// A started CPU measurement.
#[derive(Debug, Clone, Copy)]
pub struct CpuMeter {
    cpu: Duration,
    wall: Instant,
}

impl CpuMeter {
    /// Start measuring now.
    pub fn start() -> Result<Self, String> {
        Ok(Self {
            cpu: process_cpu()?,
            wall: Instant::now(),
        })
    }

    /// CPU time of the process since [`CpuMeter::start`].
    pub fn cpu_time(&self) -> Result<Duration, String> {
        Ok(process_cpu()?.saturating_sub(self.cpu))
    }

    /// CPU % of one core since [`CpuMeter::start`].
    pub fn percent(&self) -> Result<f64, String> {
        Ok(percent(self.cpu_time()?, self.wall.elapsed()))
    }
}

fn percent(cpu: Duration, wall: Duration) -> f64 {
    if wall.is_zero() {
        return 0.0;
    }
    100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_of_one_core() {
        assert_eq!(
            percent(Duration::from_secs(1), Duration::from_secs(2)),
            50.0
        );
        assert_eq!(
            percent(Duration::from_secs(4), Duration::from_secs(2)),
            200.0
        );
        assert_eq!(percent(Duration::from_secs(1), Duration::ZERO), 0.0);
    }

    #[test]
    fn a_busy_thread_shows_up() {
        let m = CpuMeter::start().unwrap();
        let until = Instant::now() + Duration::from_millis(200);
        let mut x = 0u64;
        while Instant::now() < until {
            x = x.wrapping_mul(31).wrapping_add(1);
            std::hint::black_box(x);
        }
        let p = m.percent().unwrap();
        // The meter counts the whole process, and the test harness runs
        // other tests on other threads meanwhile: the spinning thread lifts
        // it well above idle, and no process can use more than every core
        // (with room for the clocks' granularity).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ceiling = 100.0 * cores as f64 + 25.0;
        assert!(p > 5.0 && p < ceiling, "{p} not in (5, {ceiling})");
    }
}

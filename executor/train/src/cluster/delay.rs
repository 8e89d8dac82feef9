//! `--bounded-delay N`: asynchronous steps taken in turn, at most `N + 1`
//! in flight.
//!
//! After the bounded delay of Li et al.'s parameter server ("Scaling
//! Distributed Machine Learning with the Parameter Server", OSDI 2014,
//! section 4.2: a task waits until every task started more than `τ` before
//! it has finished), counted in applied steps, since that is what a shard
//! knows (its global step), not which steps they were. The tasks are the
//! workers' steps in round-robin order: with one step a turn, step `s` of
//! worker `w` of `W` is the `s W + w`-th, and its pull waits until the
//! shards have applied `s W + w - N` steps. So at most `N + 1` steps are
//! between their pull and their push at any time, and a gradient is
//! computed on values about `N` steps old instead of about `W`: the drift
//! of the dense weights and of the other rows of an example, which
//! DC-ASGD's per-coordinate term does not see, stays small.
//!
//! A worker may take its turns `K` at a time (`--turn-steps K`): the order
//! is then round-robin over blocks of `K` consecutive steps of a worker,
//! the same bound applying to each step. Where the workers of one host
//! outnumber its CPUs, a worker's state (its batch, its plan of the pulls,
//! its reply buffers) is evicted from the caches by every other worker's
//! step between two of its own; with `K` steps in a row the next step
//! finds it warm, and about `(N + 1) / K` workers are in flight, the CPUs'
//! count when `K` is [`default_turn_steps`]. An asynchronous checkpoint
//! during the run stops every worker after the same step, which blocks
//! would not reach together: `periodic::check` refuses `K > 1` with one.
//!
//! A worker with a larger share (a block more of the data an epoch) has
//! steps in rounds where others have none: the order skips the workers
//! with no steps left.
//!
//! It cannot deadlock: the first step of the order that has not been pushed
//! has every earlier one pushed, so the shards' global step has reached its
//! turn. That needs every earlier step to exist, so the bound applies only
//! where every worker's steps are known up front: not to Criteo files,
//! whose shares are known only by reading them.

use super::shares;
use super::TrainConfig;

/// `--bounded-delay` when the flag is not given, for asynchronous training
/// with [`BOUNDED_FROM_WORKERS`] workers or more.
pub const DEFAULT_BOUNDED_DELAY: u64 = 4;

/// Asynchronous workers from which a delay bound is on by default: where
/// the workers outnumber the cores of a host many times over, and Adagrad
/// diverges at about `W` steps of staleness.
pub const BOUNDED_FROM_WORKERS: usize = 32;

/// `--bounded-delay` when the flag is not given: [`DEFAULT_BOUNDED_DELAY`]
/// for asynchronous training with at least [`BOUNDED_FROM_WORKERS`]
/// workers, else none.
pub fn default_bounded_delay(workers: usize, sync: bool) -> Option<u64> {
    (!sync && workers >= BOUNDED_FROM_WORKERS).then_some(DEFAULT_BOUNDED_DELAY)
}

/// The bound a run applies: `cfg.bounded_delay` when its turns are known
/// (asynchronous, shares known up front).
pub fn applied_bounded_delay(cfg: &TrainConfig) -> Option<u64> {
    Turns::new(cfg, 0).map(|t| t.delay)
}

/// The steps in a row a run's workers take in the bounded order, when a
/// bound applies.
pub fn applied_turn_steps(cfg: &TrainConfig) -> Option<u64> {
    Turns::new(cfg, 0).map(|t| t.block)
}

/// `--turn-steps` when it is not given, for `local_workers` workers on
/// this host under a bound of `delay`: 1 when the host has a CPU for each
/// worker, else enough steps in a row that the `delay + 1` steps in flight
/// are about one worker per CPU, `ceil((delay + 1) / CPUs)`. Measured in
/// docs/TRAIN.md ("Many workers").
pub fn default_turn_steps(local_workers: usize, delay: u64) -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    turn_steps_for(local_workers, cpus, delay)
}

fn turn_steps_for(local_workers: usize, cpus: usize, delay: u64) -> u64 {
    if local_workers <= cpus {
        1
    } else {
        (delay + 1).div_ceil(cpus.max(1) as u64)
    }
}

/// The turns of one worker: the global step each of its steps waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turns {
    delay: u64,
    worker: usize,
    /// Every worker's steps, by worker.
    steps: Vec<u64>,
    /// Steps a worker takes in a row (`--turn-steps`).
    block: u64,
}

impl Turns {
    /// Worker `w`'s turns under `cfg`'s bound (none: no bound, or the
    /// steps of the workers are not known up front).
    pub fn new(cfg: &TrainConfig, w: usize) -> Option<Self> {
        let delay = cfg.bounded_delay.filter(|_| !cfg.sync)?;
        Some(Self {
            delay,
            worker: w,
            steps: shares::known_steps(cfg)?,
            block: cfg.turn_steps.unwrap_or(1).max(1),
        })
    }

    /// The global step the shards must reach before this worker pulls for
    /// its step `step` (counted from 0 over every epoch); none for a step
    /// past the worker's planned ones.
    pub fn turn(&self, step: u64) -> Option<u64> {
        let planned = self.steps.get(self.worker).copied().unwrap_or(0);
        (step < planned).then(|| self.place(step).saturating_sub(self.delay))
    }

    /// The place of this worker's step `step` in the order: round `r`
    /// holds every worker's steps `r K..(r + 1) K` that it has, worker
    /// after worker, after the rounds before it.
    fn place(&self, step: u64) -> u64 {
        let k = self.block;
        let (start, end) = ((step / k) * k, (step / k + 1) * k);
        let before: u64 = self.steps.iter().map(|&s| s.min(start)).sum();
        let this_round: u64 = self.steps[..self.worker]
            .iter()
            .map(|&s| s.min(end) - s.min(start))
            .sum();
        before + this_round + (step - start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::DataSource;

    fn cfg(workers: usize, sync: bool, delay: Option<u64>) -> TrainConfig {
        TrainConfig {
            workers,
            sync,
            bounded_delay: delay,
            train_examples: 10_400,
            batch_size: 100,
            epochs: 2,
            ..TrainConfig::default()
        }
    }

    #[test]
    fn default_only_for_many_asynchronous_workers() {
        assert_eq!(default_bounded_delay(2, false), None);
        assert_eq!(default_bounded_delay(31, false), None);
        assert_eq!(default_bounded_delay(64, true), None);
        assert_eq!(
            default_bounded_delay(32, false),
            Some(DEFAULT_BOUNDED_DELAY)
        );
    }

    #[test]
    fn turns_follow_round_robin_order_minus_the_delay() {
        // 10 400 examples over 8 workers: 1300 each, 13 steps an epoch.
        let t = Turns::new(&cfg(8, false, Some(3)), 5).unwrap();
        assert_eq!(t.turn(0), Some(2));
        assert_eq!(t.turn(1), Some(10));
        assert_eq!(t.turn(25), Some(25 * 8 + 2));
        assert_eq!(t.turn(26), None);
        let first = Turns::new(&cfg(8, false, Some(3)), 0).unwrap();
        assert_eq!(first.turn(0), Some(0));
    }

    #[test]
    fn steps_in_a_row_keep_the_order_a_permutation() {
        // 10 400 examples over 8 workers, 2 epochs: 26 steps each. Every K,
        // a divisor of 26 or not, places the 208 steps at 0..208 once
        // each, each worker's in its own order; so the first step not
        // pushed has every earlier place pushed and cannot wait forever.
        for k in [1, 2, 3, 5, 13, 26, 40] {
            let mut c = cfg(8, false, Some(3));
            c.turn_steps = Some(k);
            let mut seen = vec![false; 208];
            for w in 0..8 {
                let t = Turns::new(&c, w).unwrap();
                let places: Vec<u64> = (0..26).map(|s| t.place(s)).collect();
                assert!(places.windows(2).all(|p| p[0] < p[1]), "K {k}: {places:?}");
                for p in places {
                    assert!(
                        !std::mem::replace(&mut seen[p as usize], true),
                        "K {k}: {p} twice"
                    );
                }
                assert_eq!(t.turn(26), None);
            }
            assert!(seen.iter().all(|&s| s), "K {k}");
        }
        // K 3: worker 5's steps 0-2 are places 15-17, its step 3 is 24 + 15.
        let mut c = cfg(8, false, Some(3));
        c.turn_steps = Some(3);
        let t = Turns::new(&c, 5).unwrap();
        assert_eq!(
            (t.turn(0), t.turn(2), t.turn(3)),
            (Some(12), Some(14), Some(36))
        );
        // The last block, of 26 - 24 = 2 steps: worker 5's are places
        // 192 + 10 and 192 + 11.
        assert_eq!((t.turn(24), t.turn(25)), (Some(199), Some(200)));
        assert_eq!(applied_turn_steps(&c), Some(3));
        assert_eq!(applied_turn_steps(&cfg(8, false, None)), None);
    }

    #[test]
    fn steps_in_a_row_by_default_only_where_workers_outnumber_cpus() {
        assert_eq!(turn_steps_for(2, 2, 4), 1);
        assert_eq!(turn_steps_for(1, 1, 4), 1);
        assert_eq!(turn_steps_for(64, 2, 4), 3);
        assert_eq!(turn_steps_for(64, 5, 4), 1);
        assert_eq!(turn_steps_for(64, 4, 4), 2);
        assert_eq!(turn_steps_for(64, 1, 0), 1);
        assert_eq!(turn_steps_for(64, 0, 4), 5);
    }

    #[test]
    fn no_turns_without_a_bound_under_sync_or_on_unknown_shares() {
        assert_eq!(Turns::new(&cfg(64, false, None), 0), None);
        assert_eq!(Turns::new(&cfg(64, true, Some(8)), 0), None);
        let files = TrainConfig {
            train: DataSource::Criteo("/nonexistent/train.txt".into()),
            ..cfg(64, false, Some(8))
        };
        assert_eq!(Turns::new(&files, 0), None);
    }

    #[test]
    fn uneven_shares_are_all_in_the_order() {
        // 1001 examples over 2 workers, dealt 100 at a time: blocks 0-9
        // alternate, worker 0 also takes the last example. Worker 0 has 6
        // steps an epoch (the last of one example), worker 1 has 5; over
        // two epochs, 12 and 10, so worker 0's steps 5 and 11 (its
        // epochs' last) are the rounds worker 1 has no step in.
        let c = TrainConfig {
            train_examples: 1001,
            ..cfg(2, false, Some(0))
        };
        let t0 = Turns::new(&c, 0).unwrap();
        let t1 = Turns::new(&c, 1).unwrap();
        assert_eq!(t0.steps, vec![12, 10]);
        let order: Vec<(usize, u64)> = {
            let mut v: Vec<(u64, usize, u64)> = (0..12)
                .map(|s| (t0.turn(s).unwrap(), 0, s))
                .chain((0..10).map(|s| (t1.turn(s).unwrap(), 1, s)))
                .collect();
            v.sort();
            assert!(v.iter().enumerate().all(|(i, &(p, ..))| p == i as u64));
            v.into_iter().map(|(_, w, s)| (w, s)).collect()
        };
        assert_eq!(
            &order[8..14],
            &[(0, 4), (1, 4), (0, 5), (1, 5), (0, 6), (1, 6)]
        );
        assert_eq!(order[20..], [(0, 10), (0, 11)]);
        assert_eq!((t0.turn(12), t1.turn(10)), (None, None));
        // In blocks of K the 22 steps are still a permutation, each
        // worker's in its own order.
        for k in [2, 3, 5, 11, 30] {
            let c = TrainConfig {
                turn_steps: Some(k),
                ..c.clone()
            };
            let mut seen = [false; 22];
            for (w, n) in [(0, 12), (1, 10)] {
                let t = Turns::new(&c, w).unwrap();
                let places: Vec<u64> = (0..n).map(|s| t.place(s)).collect();
                assert!(places.windows(2).all(|p| p[0] < p[1]), "K {k}: {places:?}");
                for p in places {
                    assert!(!std::mem::replace(&mut seen[p as usize], true), "K {k}");
                }
            }
            assert!(seen.iter().all(|&s| s), "K {k}");
        }
    }
}

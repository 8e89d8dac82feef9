//! Which of each worker's steps a shard has applied, so that a worker
//! restarted after `kill -9` trains every example exactly once.
//!
//! A worker's pushes to one shard arrive in order on one connection, and
//! its last push of each step is flagged `completes_step`; so the shard
//! can number them without the worker saying more: push `p` of the
//! worker's step `s` (a step may send several pushes to a shard). The
//! shard keeps, per worker, how far it has applied ([`Position`]) and the
//! position of the next push to arrive (the *cursor*). They move together
//! while the worker trains. A restarted worker reads the applied steps of
//! every shard, resumes at the lowest and says so
//! ([`AppliedSteps::handle_resume`], which moves the cursor back); a push
//! whose position the shard has already applied is then acknowledged and
//! not applied again (the worker may have been killed mid-push, having
//! reached some shards and not others).
//!
//! With `--sync` a shard keeps each worker's pushes of a step until every
//! worker has pushed it, then applies their sum once; it numbers a push as
//! it keeps it ([`PsShard::handle_numbered`](crate::PsShard::handle_numbered)),
//! so a kept push counts as applied here: the worker is not asked for it
//! again.
//!
//! The applied positions are part of the shard's checkpoint, so a PS
//! restored from one knows where each worker's pushes stand in it.

/// A position in a worker's pushes to one shard: its step, and the pushes
/// of that step already counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    /// Steps of the worker completed on this shard.
    pub steps: u64,
    /// Pushes of the next step counted (those before its completing one).
    pub parts: u32,
}

impl Position {
    /// The position after a push (`completes`: it was the step's last).
    /// It never goes back, so a push past the position applied is always
    /// fresh: a peer's `RESUME_AT` or a checkpoint may set the steps as
    /// high as `u64::MAX`, and a step past that one counts as a part.
    fn after(self, completes: bool) -> Self {
        match self.steps.checked_add(1).filter(|_| completes) {
            Some(steps) => Self { steps, parts: 0 },
            None => Self {
                steps: self.steps,
                parts: self.parts.saturating_add(1),
            },
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Worker {
    applied: Position,
    cursor: Position,
}

/// Per worker (by task index): the position of its pushes a shard has
/// applied, and the position of its next push. See the module
/// documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppliedSteps {
    workers: Vec<Option<Worker>>,
}

/// A `RESUME_AT` the shard cannot honour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "worker {worker} resumes at its step {at}, but this shard has applied only {applied} of its \
     steps (the pushes between were never applied)"
)]
pub struct ResumeAhead {
    /// The worker.
    pub worker: u32,
    /// The step it resumes at.
    pub at: u64,
    /// Its steps this shard applied.
    pub applied: u64,
}

impl AppliedSteps {
    fn slot(&mut self, worker: u32) -> &mut Worker {
        let i = worker as usize;
        if self.workers.len() <= i {
            self.workers.resize(i + 1, None);
        }
        self.workers[i].get_or_insert_with(Worker::default)
    }

    /// A push of `worker` arrives (`completes`: its step's last): true
    /// when the shard applies it, false when it applied that push before
    /// (acknowledge it only). Call [`handle_applied`](Self::handle_applied)
    /// once an applied push succeeded.
    pub fn handle_push(&mut self, worker: u32, completes: bool) -> bool {
        let w = self.slot(worker);
        let fresh = w.cursor >= w.applied;
        w.cursor = w.cursor.after(completes);
        fresh
    }

    /// The push [`handle_push`](Self::handle_push) let through was applied.
    pub fn handle_applied(&mut self, worker: u32) {
        let w = self.slot(worker);
        w.applied = w.applied.max(w.cursor);
    }

    /// `worker`'s next push is the first of its step `at`. A step after
    /// those applied is refused: the steps between would be missing. A
    /// worker the shard never heard from (a shard restored from a
    /// checkpoint that did not record it) starts at `at`.
    pub fn handle_resume(&mut self, worker: u32, at: u64) -> Result<(), ResumeAhead> {
        let i = worker as usize;
        if self.workers.get(i).copied().flatten().is_none() {
            let p = Position {
                steps: at,
                parts: 0,
            };
            *self.slot(worker) = Worker {
                applied: p,
                cursor: p,
            };
            return Ok(());
        }
        let w = self.slot(worker);
        if at > w.applied.steps {
            return Err(ResumeAhead {
                worker,
                at,
                applied: w.applied.steps,
            });
        }
        w.cursor = Position {
            steps: at,
            parts: 0,
        };
        Ok(())
    }

    /// The position of `worker`'s pushes applied, if heard from.
    pub fn position(&self, worker: u32) -> Option<Position> {
        self.workers
            .get(worker as usize)
            .copied()
            .flatten()
            .map(|w| w.applied)
    }

    /// Take `worker`'s position back to `to` (never forward): pushes
    /// counted as applied after it were not (with `--sync`, pushes kept
    /// for a step that was never applied), so a checkpoint taken now must
    /// not count them, and the worker pushes them again.
    pub fn rewind(&mut self, worker: u32, to: Position) {
        if let Some(Some(w)) = self.workers.get_mut(worker as usize) {
            w.applied = w.applied.min(to);
            w.cursor = w.applied;
        }
    }

    /// Each worker heard from, with the position of its pushes applied,
    /// by increasing task index.
    pub fn applied(&self) -> impl Iterator<Item = (u32, Position)> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| w.map(|w| (i as u32, w.applied)))
    }

    /// The state a checkpoint restores: these positions applied, every
    /// cursor at them.
    pub(crate) fn restored(positions: &[(u32, Position)]) -> Self {
        let mut s = Self::default();
        for &(worker, p) in positions {
            *s.slot(worker) = Worker {
                applied: p,
                cursor: p,
            };
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push(a: &mut AppliedSteps, w: u32, completes: bool) -> bool {
        let fresh = a.handle_push(w, completes);
        if fresh {
            a.handle_applied(w);
        }
        fresh
    }

    /// Killed after two pushes of its step 1 (of three), the worker resumes
    /// at step 1 again: the two are acknowledged, the third applied.
    #[test]
    fn a_replayed_step_applies_only_the_pushes_not_applied() {
        let mut a = AppliedSteps::default();
        assert!(push(&mut a, 3, true));
        assert!(push(&mut a, 3, false));
        assert!(push(&mut a, 3, false));
        assert_eq!(
            a.applied().collect::<Vec<_>>(),
            vec![(3, Position { steps: 1, parts: 2 })]
        );
        a.handle_resume(3, 1).unwrap();
        assert!(!push(&mut a, 3, false));
        assert!(!push(&mut a, 3, false));
        assert!(push(&mut a, 3, true));
        assert!(push(&mut a, 3, true));
        assert_eq!(
            a.applied().collect::<Vec<_>>(),
            vec![(3, Position { steps: 3, parts: 0 })]
        );
    }

    /// A worker new to the shard that resumes at the last step there is
    /// does not wrap the count (a debug build panicked, a release one
    /// acknowledged every later push without applying it): each push is
    /// applied.
    #[test]
    fn a_resume_at_the_last_step_never_wraps() {
        let mut a = AppliedSteps::default();
        a.handle_resume(1, u64::MAX).unwrap();
        for completes in [true, false, true] {
            assert!(push(&mut a, 1, completes));
        }
        assert_eq!(
            a.applied().collect::<Vec<_>>(),
            vec![(
                1,
                Position {
                    steps: u64::MAX,
                    parts: 3
                }
            )]
        );
    }

    /// A shard that applied more of the worker's steps than the one it
    /// resumes at acknowledges them; one ahead of them is refused.
    #[test]
    fn resume_skips_the_steps_applied_and_refuses_a_gap() {
        let mut a = AppliedSteps::restored(&[(0, Position { steps: 5, parts: 0 })]);
        assert_eq!(
            a.handle_resume(0, 6),
            Err(ResumeAhead {
                worker: 0,
                at: 6,
                applied: 5
            })
        );
        a.handle_resume(0, 3).unwrap();
        assert!(!push(&mut a, 0, true));
        assert!(!push(&mut a, 0, true));
        assert!(push(&mut a, 0, true));
        assert_eq!(
            a.applied().next(),
            Some((0, Position { steps: 6, parts: 0 }))
        );
        // Another worker is untouched, and starts at 0.
        assert!(push(&mut a, 1, true));
        assert_eq!(a.applied().count(), 2);
        // One never heard from starts where it says.
        a.handle_resume(4, 9).unwrap();
        assert!(push(&mut a, 4, true));
        assert_eq!(
            a.applied().last(),
            Some((
                4,
                Position {
                    steps: 10,
                    parts: 0
                }
            ))
        );
    }

    /// A push that failed leaves the applied position behind the cursor;
    /// the next ones are still applied.
    #[test]
    fn after_a_failed_push_the_next_ones_still_apply() {
        let mut a = AppliedSteps::default();
        assert!(a.handle_push(0, true));
        assert!(push(&mut a, 0, true));
        assert_eq!(
            a.applied().next(),
            Some((0, Position { steps: 2, parts: 0 }))
        );
    }
}

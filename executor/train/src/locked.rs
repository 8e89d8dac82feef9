//! A PS task's shards behind one lock each, for the backends that serve
//! a shard from whichever thread a request arrives on: the gRPC baseline
//! (tonic's runtime threads) and `inproc` (the workers' own threads). The
//! session backends need none of this: each shard is its reactor's alone.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::cluster::{shard_handler, write_shard, Plan, PsEnd, TrainConfig};
use crate::handler::ShardHandler;
use crate::psserver::{PsHandler, Service};
use crate::TrainError;
use starwire_transport::MemoryBudget;

/// Lock `m`; a thread that panicked while holding it left the shard as
/// every request leaves it (each is served whole or not at all), so the
/// poison is ignored.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One shard and what serving it keeps between requests.
pub(crate) type ShardService = Service<ShardHandler>;

/// The shards of one PS task, and the senders of the `DONE`s each has
/// received.
#[derive(Debug)]
pub(crate) struct LockedShards {
    shards: Vec<Mutex<ShardService>>,
    /// Per shard, who said `DONE` (a worker index, a connection): a
    /// sender counts once however often it says it.
    done: Mutex<Vec<HashSet<u64>>>,
    all_done: Condvar,
    /// The task was stopped ([`Self::stop`]): for the workers that call
    /// the shards directly (`inproc`), what a closed connection is to a
    /// network worker.
    stopped: AtomicBool,
}

impl LockedShards {
    /// PS task `p`'s shards of the plan, restored from `restore` if given.
    pub(crate) fn start(
        cfg: &TrainConfig,
        plan: &Plan,
        p: usize,
        restore: Option<&Path>,
    ) -> Result<Self, TrainError> {
        let r = cfg.ps_reactors.max(1);
        let handlers = (0..r)
            .map(|local| shard_handler(cfg, plan, p * r + local, restore))
            .collect::<Result<Vec<_>, _>>()?;
        let sync = cfg.sync.then(|| (cfg.workers, cfg.guard.budget()));
        Ok(Self::new(handlers, sync))
    }

    /// These handlers as shards 0, 1, … of a task, gathering each step's
    /// pushes of `sync` workers when given (`--sync`), charged to its
    /// budget.
    pub(crate) fn new(handlers: Vec<ShardHandler>, sync: Option<(usize, MemoryBudget)>) -> Self {
        let n = handlers.len();
        Self {
            shards: handlers
                .into_iter()
                .map(|handler| {
                    let s = Service::new(handler);
                    Mutex::new(match &sync {
                        Some((w, budget)) => s.with_sync(*w, budget.clone()),
                        None => s,
                    })
                })
                .collect(),
            done: Mutex::new(vec![HashSet::new(); n]),
            all_done: Condvar::new(),
            stopped: AtomicBool::new(false),
        }
    }

    /// Stop serving: every later request, and every `WAIT_STEP` being
    /// waited for, fails ([`Self::check_serving`]).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// An error for shard `shard` once the task is stopped.
    pub(crate) fn check_serving(&self, shard: usize) -> Result<(), TrainError> {
        if self.stopped.load(Ordering::Acquire) {
            return Err(TrainError::Link(shard, "the PS task stopped".into()));
        }
        Ok(())
    }

    /// Local shard `i`, if the task has it.
    pub(crate) fn get(&self, i: usize) -> Option<&Mutex<ShardService>> {
        self.shards.get(i)
    }

    /// Local shard `i` received a `DONE` from `sender`; again from the same
    /// sender, it changes nothing.
    pub(crate) fn done(&self, i: usize, sender: u64) {
        if lock(&self.done)[i].insert(sender) {
            self.all_done.notify_all();
        }
    }

    /// Distinct senders of `DONE` so far, per local shard.
    #[cfg(test)]
    pub(crate) fn dones(&self) -> Vec<usize> {
        lock(&self.done).iter().map(HashSet::len).collect()
    }

    /// The shards as they are (each between two requests): counters and
    /// steps, and each shard's checkpoint file written when `checkpoint`
    /// is set and the task has a `--checkpoint-dir`.
    pub(crate) fn shutdown(&self, checkpoint: bool) -> Result<PsEnd, TrainError> {
        let mut end = PsEnd::default();
        for s in &self.shards {
            let mut g = lock(s);
            if checkpoint {
                g.rewind_kept();
            }
            let h = g.handler();
            end.stats.push(h.stats());
            end.steps.push((h.index, h.shard.global_step()));
            if let (true, Some(dir)) = (checkpoint, &h.checkpoint_dir) {
                end.written.push(write_shard(h, dir)?);
            }
        }
        Ok(end)
    }

    /// Wait until every shard has received `DONE` from `expected`
    /// senders; then the shards' counters.
    pub(crate) fn join(&self, expected: usize) -> Vec<serde_json::Value> {
        let mut d = lock(&self.done);
        while d.iter().any(|s| s.len() < expected) {
            d = self.all_done.wait(d).unwrap_or_else(|e| e.into_inner());
        }
        drop(d);
        self.shards
            .iter()
            .map(|s| {
                let g = lock(s);
                tracing::debug!(
                    shard = g.handler().index,
                    served = ?g.served(),
                    failed = g.failed(),
                    "shard done"
                );
                g.handler().stats()
            })
            .collect()
    }
}

//! The executor: dependency counting, a lock-free ready queue and optional
//! compute threads for large ops.
//!
//! A run is a DAG of tasks ([`TaskSet`]). Every task has an atomic count of
//! unfinished predecessors; finishing a task decrements the counts of its
//! successors, and whoever brings a count to zero dispatches that task:
//!
//! * a task whose cost (in FLOPs, computed from its actual inputs) is below
//!   the executor's threshold, or any task when the executor has no compute
//!   threads, goes to the run's own lock-free queue and is run by the calling
//!   thread (the reactor), run-to-completion;
//! * a larger task goes to the pool's lock-free queue and a compute thread
//!   runs it; its ready successors come back the same way.
//!
//! The calling thread drains its queue and parks when it is empty and tasks
//! are still in flight; the thread that finishes the last task, or queues an
//! inline task, unparks it. There is no global lock: queues are
//! `crossbeam_queue::SegQueue`s, counts are atomics.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle, Thread};

use crossbeam_queue::SegQueue;

use crate::error::GraphError;

/// Tasks at or above this many FLOPs are handed to compute threads by
/// [`Executor::new`]: a few hundred microseconds of single-threaded work,
/// far more than the few microseconds a handoff costs.
pub const DEFAULT_HANDOFF_FLOPS: u64 = 1 << 20;

/// One run's tasks, as the executor sees them.
pub(crate) trait TaskSet: Send + Sync + 'static {
    /// The number of tasks, numbered `0..len`.
    fn len(&self) -> usize;
    /// The tasks that wait for `task` (no duplicates).
    fn successors(&self, task: usize) -> &[u32];
    /// How many distinct predecessors `task` has.
    fn predecessors(&self, task: usize) -> u32;
    /// The cost of `task` in FLOPs; called once its predecessors are done.
    fn cost(&self, task: usize) -> u64;
    /// Runs `task`; errors are recorded by the task set itself.
    fn run(&self, task: usize);
    /// Records that `task` panicked.
    fn panicked(&self, task: usize);
}

type Job = Box<dyn FnOnce() + Send>;

#[derive(Debug)]
struct Pool {
    jobs: SegQueue<Job>,
    stop: AtomicBool,
    workers: OnceLock<Vec<Thread>>,
}

impl Pool {
    fn submit(&self, job: Job) {
        self.jobs.push(job);
        // Unparking an idle worker is cheap and parking is token-based, so a
        // wake-up between a worker's empty pop and its park is never lost.
        if let Some(ws) = self.workers.get() {
            ws.iter().for_each(Thread::unpark);
        }
    }

    fn work(&self) {
        loop {
            match self.jobs.pop() {
                // Jobs catch their tasks' panics themselves; this only
                // keeps the thread alive should one slip through.
                Some(job) => {
                    let _ = catch_unwind(AssertUnwindSafe(job));
                }
                None if self.stop.load(Ordering::Acquire) => return,
                None => thread::park(),
            }
        }
    }
}

/// Runs graphs: inline on the calling thread, with large ops optionally handed
/// to compute threads. See the module docs for the scheduling.
///
/// One executor may serve many concurrent runs from many threads.
#[derive(Debug)]
pub struct Executor {
    pool: Option<Arc<Pool>>,
    handles: Vec<JoinHandle<()>>,
    threshold: u64,
    handoffs: Arc<AtomicU64>,
}

impl Executor {
    /// An executor with `threads` compute threads and the default handoff
    /// threshold [`DEFAULT_HANDOFF_FLOPS`]. `threads == 0` runs everything
    /// inline on the calling thread.
    ///
    /// # Errors
    ///
    /// [`GraphError::ThreadSpawn`] if the operating system refuses to start
    /// a thread (the threads already started are stopped).
    pub fn new(threads: usize) -> Result<Self, GraphError> {
        Self::with_threshold(threads, DEFAULT_HANDOFF_FLOPS)
    }

    /// Like [`Executor::new`] with an explicit handoff threshold in FLOPs
    /// (`0` hands every op to the compute threads).
    ///
    /// # Errors
    ///
    /// As [`Executor::new`].
    pub fn with_threshold(threads: usize, handoff_flops: u64) -> Result<Self, GraphError> {
        Self::spawning(threads, handoff_flops, |name, work| {
            thread::Builder::new().name(name).spawn(work)
        })
    }

    /// [`Executor::with_threshold`], each compute thread started by `spawn`
    /// (given its name and its work).
    fn spawning(
        threads: usize,
        handoff_flops: u64,
        mut spawn: impl FnMut(String, Job) -> std::io::Result<JoinHandle<()>>,
    ) -> Result<Self, GraphError> {
        if threads == 0 {
            return Ok(Self {
                pool: None,
                handles: Vec::new(),
                threshold: handoff_flops,
                handoffs: Arc::default(),
            });
        }
        let pool = Arc::new(Pool {
            jobs: SegQueue::new(),
            stop: AtomicBool::new(false),
            workers: OnceLock::new(),
        });
        // Built first: if a spawn fails, dropping it stops and joins the
        // threads already started.
        let mut exec = Self {
            pool: Some(Arc::clone(&pool)),
            handles: Vec::new(),
            threshold: handoff_flops,
            handoffs: Arc::default(),
        };
        for index in 0..threads {
            let p = Arc::clone(&pool);
            let h = spawn(
                format!("starwire-compute-{index}"),
                Box::new(move || p.work()),
            )
            .map_err(|e| GraphError::ThreadSpawn {
                index,
                threads,
                reason: e.to_string(),
            })?;
            exec.handles.push(h);
        }
        let _ = pool
            .workers
            .set(exec.handles.iter().map(|h| h.thread().clone()).collect());
        Ok(exec)
    }

    /// The number of compute threads.
    pub fn threads(&self) -> usize {
        self.handles.len()
    }

    /// The handoff threshold in FLOPs.
    pub fn handoff_flops(&self) -> u64 {
        self.threshold
    }

    /// How many tasks have been handed to compute threads so far.
    pub fn handoffs(&self) -> u64 {
        self.handoffs.load(Ordering::Relaxed)
    }

    /// Runs every task of `tasks` and returns when all are done.
    pub(crate) fn run<T: TaskSet>(&self, tasks: Arc<T>) {
        let n = tasks.len();
        if n == 0 {
            return;
        }
        let run = Arc::new(Run {
            pending: (0..n)
                .map(|t| AtomicU32::new(tasks.predecessors(t)))
                .collect(),
            done: Arc::new(Done {
                remaining: AtomicUsize::new(n),
                aborted: AtomicBool::new(false),
                caller: thread::current(),
            }),
            inline: SegQueue::new(),
            pool: self.pool.clone(),
            threshold: self.threshold,
            handoffs: Arc::clone(&self.handoffs),
            tasks,
        });
        for t in 0..n {
            if run.tasks.predecessors(t) == 0 {
                Run::dispatch(&run, t);
            }
        }
        loop {
            while let Some(t) = run.inline.pop() {
                Run::execute(&run, t);
            }
            if run.done.finished() {
                return;
            }
            thread::park();
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.stop.store(true, Ordering::Release);
            for h in &self.handles {
                h.thread().unpark();
            }
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

struct Run<T> {
    tasks: Arc<T>,
    pending: Vec<AtomicU32>,
    done: Arc<Done>,
    inline: SegQueue<usize>,
    pool: Option<Arc<Pool>>,
    threshold: u64,
    handoffs: Arc<AtomicU64>,
}

/// What the calling thread waits on. Kept apart from the [`Run`] so that a
/// compute thread lets go of the run (and so of the task set) before it
/// reports its task done: once the caller wakes up, it holds the only
/// reference, and the task set's owner can take its values back.
struct Done {
    /// Tasks not finished yet.
    remaining: AtomicUsize,
    /// The bookkeeping of a task panicked: some tasks will never be
    /// dispatched, so the caller stops waiting for them.
    aborted: AtomicBool,
    caller: Thread,
}

impl Done {
    fn finished(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0 || self.aborted.load(Ordering::Acquire)
    }

    /// One task is done; `aborted` if its bookkeeping panicked.
    fn task_done(&self, aborted: bool) {
        if aborted {
            self.aborted.store(true, Ordering::Release);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 || aborted {
            self.caller.unpark();
        }
    }
}

impl<T: TaskSet> Run<T> {
    fn dispatch(this: &Arc<Self>, t: usize) {
        let handoff = this.pool.as_ref().filter(|_| {
            // A task whose cost panics is recorded as panicked and queued
            // inline: the task set skips the work of a failed run, and the
            // run still completes.
            match catch_unwind(AssertUnwindSafe(|| this.tasks.cost(t))) {
                Ok(cost) => cost >= this.threshold,
                Err(_) => {
                    this.panicked(t);
                    false
                }
            }
        });
        match handoff {
            Some(pool) => {
                this.handoffs.fetch_add(1, Ordering::Relaxed);
                let run = Arc::clone(this);
                pool.submit(Box::new(move || Run::execute_owned(run, t)));
            }
            None => {
                this.inline.push(t);
                if thread::current().id() != this.done.caller.id() {
                    this.done.caller.unpark();
                }
            }
        }
    }

    /// Records that `t` panicked (a panic in doing so is swallowed: the
    /// run must still complete).
    fn panicked(&self, t: usize) {
        let _ = catch_unwind(AssertUnwindSafe(|| self.tasks.panicked(t)));
    }

    /// Runs task `t` and dispatches its ready successors. False if the
    /// bookkeeping panicked, leaving successors undispatched.
    fn step(this: &Arc<Self>, t: usize) -> bool {
        if catch_unwind(AssertUnwindSafe(|| this.tasks.run(t))).is_err() {
            this.panicked(t);
        }
        let dispatched = catch_unwind(AssertUnwindSafe(|| {
            for &s in this.tasks.successors(t) {
                let s = s as usize;
                if this.pending[s].fetch_sub(1, Ordering::AcqRel) == 1 {
                    Run::dispatch(this, s);
                }
            }
        }));
        if dispatched.is_err() {
            this.panicked(t);
            return false;
        }
        true
    }

    /// Runs task `t` on the calling thread.
    fn execute(this: &Arc<Self>, t: usize) {
        let ok = Run::step(this, t);
        this.done.task_done(!ok);
    }

    /// Runs task `t` on a compute thread, letting go of the run before
    /// reporting it done (see [`Done`]).
    fn execute_owned(this: Arc<Self>, t: usize) {
        let ok = Run::step(&this, t);
        let done = Arc::clone(&this.done);
        drop(this);
        done.task_done(!ok);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A chain `0 -> 1 -> 2` whose bookkeeping can be made to panic.
    struct Chain {
        succ: Vec<Vec<u32>>,
        /// `cost(t)` panics for this task.
        cost_panics: Option<usize>,
        /// `successors(t)` panics for this task.
        successors_panics: Option<usize>,
        ran: AtomicUsize,
        panicked: OnceLock<usize>,
    }

    impl Chain {
        fn new(cost_panics: Option<usize>, successors_panics: Option<usize>) -> Self {
            Self {
                succ: vec![vec![1], vec![2], vec![]],
                cost_panics,
                successors_panics,
                ran: AtomicUsize::new(0),
                panicked: OnceLock::new(),
            }
        }
    }

    impl TaskSet for Chain {
        fn len(&self) -> usize {
            self.succ.len()
        }
        fn successors(&self, task: usize) -> &[u32] {
            assert!(self.successors_panics != Some(task), "successors({task})");
            &self.succ[task]
        }
        fn predecessors(&self, task: usize) -> u32 {
            u32::from(task > 0)
        }
        fn cost(&self, task: usize) -> u64 {
            assert!(self.cost_panics != Some(task), "cost({task})");
            1000
        }
        fn run(&self, _task: usize) {
            self.ran.fetch_add(1, Ordering::SeqCst);
        }
        fn panicked(&self, task: usize) {
            let _ = self.panicked.set(task);
        }
    }

    /// Runs `tasks` on a spawned thread; the task that was recorded as
    /// panicked, or an error if none was or the run did not finish.
    fn run_chain(exec: &Arc<Executor>, tasks: Chain) -> Result<usize, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let exec = Arc::clone(exec);
        thread::spawn(move || {
            let tasks = Arc::new(tasks);
            exec.run(Arc::clone(&tasks));
            let _ = tx.send(tasks.panicked.get().copied());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err("no panic recorded".into()),
            Err(e) => Err(format!("the run did not finish: {e}")),
        }
    }

    #[test]
    fn a_panic_in_the_bookkeeping_of_a_compute_thread_fails_the_run() {
        // Threshold 0: every task goes to the compute thread, so `cost(1)`
        // and `successors(1)` are called there.
        let exec = Arc::new(Executor::with_threshold(1, 0).unwrap());
        assert_eq!(run_chain(&exec, Chain::new(Some(1), None)), Ok(1));
        assert_eq!(run_chain(&exec, Chain::new(Some(2), None)), Ok(2));
        assert_eq!(run_chain(&exec, Chain::new(None, Some(1))), Ok(1));
        assert_eq!(run_chain(&exec, Chain::new(None, Some(2))), Ok(2));
        // The compute thread survived and still runs tasks.
        let tasks = Arc::new(Chain::new(None, None));
        let before = exec.handoffs();
        exec.run(Arc::clone(&tasks));
        assert_eq!(tasks.ran.load(Ordering::SeqCst), 3);
        assert!(tasks.panicked.get().is_none());
        assert_eq!(exec.handoffs(), before + 3);
        // Inline too (where costs are never asked for).
        let inline = Arc::new(Executor::new(0).unwrap());
        assert_eq!(run_chain(&inline, Chain::new(None, Some(0))), Ok(0));
        assert_eq!(run_chain(&inline, Chain::new(None, Some(2))), Ok(2));
    }

    #[test]
    fn a_thread_that_cannot_start_is_an_error_and_stops_the_others() {
        let ended = Arc::new(AtomicUsize::new(0));
        let mut started = 0;
        let e = Executor::spawning(5, 0, |name, work| {
            if started == 2 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    "Resource temporarily unavailable",
                ));
            }
            started += 1;
            let ended = Arc::clone(&ended);
            thread::Builder::new().name(name).spawn(move || {
                work();
                ended.fetch_add(1, Ordering::SeqCst);
            })
        })
        .unwrap_err();
        assert_eq!(
            e,
            GraphError::ThreadSpawn {
                index: 2,
                threads: 5,
                reason: "Resource temporarily unavailable".into()
            }
        );
        assert!(e.to_string().contains("compute thread 3 of 5"), "{e}");
        // The two threads started were stopped and joined.
        assert_eq!(ended.load(Ordering::SeqCst), 2);
    }
}

//! The cluster of a training run: the local loopback cluster of `starwire
//! train` and the single roles of `starwire ps` and `starwire worker`.
//!
//! Its parts: the configuration (`config.rs`), the plan of which PS holds
//! each variable (`plan.rs`), where the reactors run (`reactors.rs`), the
//! pieces of the PS and worker roles (`roles.rs`), how much of the data
//! each worker trains (`shares.rs`), the turns of `--bounded-delay`
//! (`delay.rs`), the local cluster's shape on its host (`host.rs`) and the
//! report (`report.rs`).

mod config;
mod delay;
mod failover;
mod guard;
mod host;
mod listen;
pub(crate) mod periodic;
mod plan;
mod reactors;
mod report;
mod roles;
mod shares;

pub use config::{
    default_prefetch, model_name, protocol_name, BackendKind, LrScaling, TrainConfig,
    DEFAULT_CONNECT_TIMEOUT,
};
pub use delay::{
    default_bounded_delay, default_turn_steps, BOUNDED_FROM_WORKERS, DEFAULT_BOUNDED_DELAY,
};
pub use failover::Failover;
pub use guard::{
    check_listen, training_flags, Guard, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MEMORY_BUDGET_MB,
};
pub use host::fit_local_host;
pub use plan::{plan, shard_threshold, Plan, ASSIGNMENT_SAMPLE};
pub use reactors::{
    summary, PinnedThread, ProcessReactors, ReactorLayout, ReactorReport, OVERSUBSCRIBED_IDLE_POLL,
};
pub use report::{Interval, PsTaskReport, TrainReport};
pub use roles::{
    connect, connect_handoff, evaluate, load_eval, make_shard, start_ps, worker_loop,
    ClusterBackend, PsEnd, PsTask, ResumeFrom, RunningPs, Sessions, WorkerNet, WorkerOutcome,
};
pub(crate) use roles::{shard_handler, write_shard};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_utils::sync::WaitGroup;
use starwire_data::{auc, Batch};
use starwire_graph::{partition, Executor};
use starwire_transport::retry::{Backoff, Retry};

use config::{across_processes, check_optimizer};
use roles::{cluster_backend, read_manifest, write_checkpoint, write_manifest};

use crate::net::Traffic;
use crate::source::DataSource;
use crate::staleness::StalenessHistogram;
use crate::worker::{control_all, WorkerBuffers, WorkerCore};
use crate::TrainError;
use starwire_wire::ps::Control;

/// `starwire train` without cluster flags: PS tasks and workers as threads
/// of this process over loopback, then an evaluation.
pub fn run_local(cfg: &TrainConfig) -> Result<TrainReport, TrainError> {
    // The local cluster's tasks authenticate each other with a token of
    // their own unless one was given: nothing else on the host can join.
    let mut cfg = cfg.clone();
    // Its workers are threads of this process: the PS shards fault their
    // reserved rows in while the cluster starts, and the workers read
    // ahead when the host has a CPU for each.
    cfg.reserve_at_start = true;
    cfg.prefetch = Some(
        cfg.prefetch
            .unwrap_or_else(|| default_prefetch(cfg.backend, cfg.workers)),
    );
    // Steps in a row where the workers outnumber the CPUs, unless
    // checkpoints during the run need one step a turn.
    if let (None, Some(d), false) = (
        cfg.turn_steps,
        cfg.bounded_delay,
        cfg.checkpoints_during_run(),
    ) {
        cfg.turn_steps = Some(default_turn_steps(cfg.workers, d));
    }
    cfg.guard
        .token
        .get_or_insert_with(starwire_transport::ClusterToken::random);
    run_local_on(&*cluster_backend(cfg.backend), &cfg)
}

/// A checkpoint restores only into a cluster of as many shards: rows hash
/// to shards by their count, so a restore into fewer would lose the rows of
/// the shards not restored, and into more would misplace them.
fn check_shard_count(m: &starwire_ps::Manifest, plan: &Plan) -> Result<(), TrainError> {
    if m.shard_count != plan.shards {
        return Err(TrainError::Config(format!(
            "the checkpoint has {} shards, this cluster {}; use as many PS (train --ps, or \
             the hosts of --ps-hosts or TF_CONFIG) and the same NETWORK_PS_CORE_NUMBER",
            m.shard_count, plan.shards
        )));
    }
    Ok(())
}

fn run_local_on(k: &dyn ClusterBackend, cfg: &TrainConfig) -> Result<TrainReport, TrainError> {
    cfg.check_handoff()?;
    periodic::check(cfg)?;
    check_optimizer(cfg)?;
    let plan = plan(cfg)?;
    let manifest = match &cfg.checkpoint_dir {
        Some(d) => read_manifest(d)?,
        None => None,
    };
    if let Some(m) = &manifest {
        check_shard_count(m, &plan)?;
    }
    let restore = manifest.as_ref().and(cfg.checkpoint_dir.as_deref());
    // PS tasks and workers are planned together: pinned, they take
    // different CPUs while there are CPUs to spare.
    let layout = ReactorLayout::detect(cfg, &ProcessReactors::local(cfg))?;
    warn(&layout);
    // Workers plus the evaluator say DONE to every shard.
    let expected = cfg.workers + 1;
    let mut tasks = Vec::with_capacity(cfg.ps);
    for p in 0..cfg.ps {
        let l = listen::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        tasks.push(k.start_ps(cfg, &plan, p, l, expected, restore, &layout)?);
    }
    let addrs: Vec<String> = tasks.iter().map(|t| t.addr().to_string()).collect();

    let eval_all = load_eval(cfg, &plan.truth, cfg.eval_examples)?;
    let eval_interval: Vec<Batch> = {
        let mut v = Vec::new();
        let mut n = 0;
        for b in &eval_all {
            if n >= 20_000 {
                break;
            }
            n += b.len;
            v.push(b.clone());
        }
        v
    };
    // The start: every worker and the driver wait for one another there. A
    // worker that fails or panics before it, or whose thread could not be
    // spawned, drops its handle, which counts as its arrival.
    let start = WaitGroup::new();
    let pool = WorkerBuffers::default();
    // Each worker says when it ends and whether it failed, so that the
    // first failure stops the PS tasks at once: the other workers may be
    // waiting for it (its turns under `--bounded-delay`, a checkpoint
    // step's barrier), and the closed connections end their waits.
    let (ended_tx, ended_rx) = std::sync::mpsc::channel::<Ended>();
    let mut failed_first = None;
    let (t_start, outcomes): (Instant, Vec<Result<WorkerOutcome, TrainError>>) =
        std::thread::scope(|sc| {
            let mut hs = Vec::new();
            for w in 0..cfg.workers {
                let ended = EndedGuard {
                    tx: ended_tx.clone(),
                    worker: w,
                    sent: false,
                };
                let start = start.clone();
                let (plan, pool, addrs, ev, layout) =
                    (&plan, &pool, &addrs, &eval_interval, &layout);
                let cpu = layout.worker_cpu(w);
                let resume = manifest
                    .as_ref()
                    .and_then(|m| m.workers.iter().find(|p| p.worker as usize == w).cloned());
                hs.push(
                    std::thread::Builder::new()
                        .name(format!("starwire-worker-{w}"))
                        .spawn_scoped(sc, move || {
                            let mut ended = ended;
                            let net = k.connect(cfg, addrs, w as u32, plan.shards, Some(layout));
                            let mut net = net?;
                            let r = worker_loop(
                                cfg,
                                plan,
                                Some(pool),
                                w,
                                &mut *net,
                                Some(start),
                                ResumeFrom {
                                    position: resume.as_ref(),
                                    held_steps: 0,
                                },
                                Some(ev),
                                cpu,
                            );
                            // A failure is told before the DONEs, which
                            // may queue behind a WAIT_STEP of the failed
                            // exchange.
                            ended.send(r.is_err());
                            let _ = control_all(&mut *net, plan.shards, &Control::Done);
                            net.close();
                            r
                        }),
                );
            }
            drop(ended_tx);
            start.wait();
            let t0 = Instant::now();
            // Until every worker has ended (a worker that panicked says so
            // through its guard's drop).
            while let Ok(e) = ended_rx.recv() {
                if e.failed && failed_first.is_none() {
                    failed_first = Some(e.worker);
                    for t in tasks.drain(..) {
                        t.stop();
                    }
                }
            }
            let outs = hs
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(TrainError::Internal("worker panicked".into()))),
                    Err(e) => Err(TrainError::Io(e)),
                })
                .collect();
            (t0, outs)
        });
    let mut outs = Vec::new();
    let mut first_err = None;
    for (w, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(o) => outs.push(o),
            // The error of the worker that failed first, not those of the
            // workers that lost their PS connections because of it.
            Err(e) if failed_first == Some(w) => first_err = Some(e),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        // A worker failed: the PS tasks were stopped when it did (every
        // failure is told through its guard), rather than waiting for a
        // DONE that will not come.
        debug_assert!(tasks.is_empty());
        return Err(e);
    }
    // The evaluator: its own connections, after every worker has pushed.
    let mut net = k.connect(cfg, &addrs, cfg.workers as u32, plan.shards, None)?;
    let mut core = WorkerCore::new(
        partition(&plan.model, cfg.protocol),
        plan.layout.clone(),
        cfg.tensor_fuse,
        executor(cfg)?,
    );
    let eval_result = evaluate(&mut core, &mut *net, &eval_all);
    let ckpt = match (&cfg.checkpoint_dir, &eval_result) {
        (Some(d), Ok(_)) => {
            let progress = outs.iter().filter_map(|o| o.progress.clone()).collect();
            write_checkpoint(&mut core, &mut *net, cfg, &plan, d, progress)
                .map(|()| Some(d.clone()))
        }
        _ => Ok(None),
    };
    // Closing the evaluator's connections counts as its DONE.
    let _ = control_all(&mut *net, plan.shards, &Control::Done);
    net.close();
    drop(net);
    let mut shard_stats = Vec::new();
    for t in tasks {
        shard_stats.extend(t.join()?);
    }
    let (auc_v, logloss_v) = eval_result?;
    let ckpt = ckpt?;
    let steps: u64 = outs.iter().map(|o| o.steps).sum();
    let samples: u64 = outs.iter().map(|o| o.samples).sum();
    let train_seconds = outs
        .iter()
        .filter_map(|o| o.end)
        .max()
        .map_or(0.0, |e| e.saturating_duration_since(t_start).as_secs_f64());
    let traffic = outs.iter().fold(Traffic::default(), |a, o| Traffic {
        sent: a.sent + o.traffic.sent,
        received: a.received + o.traffic.received,
        requests: a.requests + o.traffic.requests,
    });
    let oracle_auc = (cfg.eval == DataSource::Synthetic).then(|| {
        let mut labels = Vec::new();
        let mut probs = Vec::new();
        for b in &eval_all {
            for i in 0..b.len {
                labels.push(b.labels[i]);
                probs.push(plan.truth.oracle_prob(b, i));
            }
        }
        auc(&labels, &probs)
    });
    let w0 = outs.first();
    Ok(TrainReport {
        backend: k.name().into(),
        protocol: protocol_name(cfg.protocol).into(),
        model: model_name(cfg.model).into(),
        ps: cfg.ps,
        shards: plan.shards,
        workers: cfg.workers,
        tensor_fuse: cfg.tensor_fuse,
        sync: cfg.sync,
        batch_size: cfg.batch_size,
        bounded_delay: delay::applied_bounded_delay(cfg),
        turn_steps: delay::applied_turn_steps(cfg),
        worker_handoff: cfg.handoff(),
        prefetch: cfg.prefetch.unwrap_or(0),
        steps,
        samples,
        examples_trained: outs.iter().map(|o| o.examples_trained).sum(),
        examples_planned: outs.iter().map(|o| o.examples_planned).sum(),
        train_seconds,
        samples_per_s: samples as f64 / train_seconds.max(1e-9),
        auc: auc_v,
        logloss: logloss_v,
        oracle_auc,
        eval_examples: eval_all.iter().map(|b| b.len as u64).sum(),
        bytes_per_step: (traffic.sent + traffic.received) as f64 / steps.max(1) as f64,
        requests_per_step: traffic.requests as f64 / steps.max(1) as f64,
        final_train_loss: w0.map_or(0.0, |o| o.last_loss),
        intervals: w0.map(|o| o.intervals.clone()).unwrap_or_default(),
        assignment: plan.assignment.clone(),
        skipped_lines: outs.iter().map(|o| o.skipped).sum(),
        checkpoint: ckpt,
        staleness: outs
            .iter()
            .fold(StalenessHistogram::default(), |mut h, o| {
                h.merge(&o.staleness);
                h
            })
            .summary(),
        resumed_from_step: manifest.map(|m| m.global_step),
        shard_stats,
        reactors: layout.report(),
        failovers: Vec::new(),
    })
}

/// The layout's warnings, logged.
/// The graph executor of a worker (or of the evaluator), with
/// `cfg.compute_threads` compute threads: one the operating system
/// refuses to start is an error, not an abort.
pub(super) fn executor(cfg: &TrainConfig) -> Result<Executor, TrainError> {
    Executor::new(cfg.compute_threads).map_err(|e| TrainError::Io(std::io::Error::other(e)))
}

fn warn(layout: &ReactorLayout) {
    for w in &layout.warnings {
        tracing::warn!("{w}");
    }
}

/// How long `starwire ps` serves.
#[derive(Debug, Clone, Copy)]
pub struct PsLifetime<'a> {
    /// End once every one of the cluster's workers is done
    /// (`--exit-when-done`, batch jobs); else serve until stopped, as
    /// TensorFlow's `server.join()`.
    pub exit_when_done: bool,
    /// Set (by SIGTERM or SIGINT) to stop the task: it checkpoints (with
    /// a `--checkpoint-dir`) and ends.
    pub stop: &'a AtomicBool,
}

/// How often a PS task looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// `starwire ps`: serve PS task `index` on `bind` for `lifetime`; returns
/// the shards' counters and the task's reactors. Restores from
/// `--checkpoint-dir` when it holds a checkpoint. A worker that died
/// unfinished (its connection ended before it said `DONE`, and it did not
/// rejoin and finish) makes it an error naming the worker, however the
/// task ended: a PS never ends well while a worker's data is untrained.
pub fn run_ps_task(
    cfg: &TrainConfig,
    index: usize,
    bind: SocketAddr,
    lifetime: PsLifetime<'_>,
) -> Result<PsTaskReport, TrainError> {
    across_processes(cfg.backend)?;
    periodic::check(cfg)?;
    check_optimizer(cfg)?;
    let k = cluster_backend(cfg.backend);
    let plan = plan(cfg)?;
    let restore = match &cfg.checkpoint_dir {
        Some(d) => match read_manifest(d)? {
            Some(m) => {
                check_shard_count(&m, &plan)?;
                Some(d.as_path())
            }
            None => None,
        },
        None => None,
    };
    let layout = ReactorLayout::detect(cfg, &ProcessReactors::ps_task(cfg, index))?;
    warn(&layout);
    let reactors = layout.report();
    cfg.guard.check_listen(bind)?;
    let l = listen::bind(bind).map_err(|source| TrainError::Listen { addr: bind, source })?;
    let expected = if lifetime.exit_when_done {
        cfg.workers
    } else {
        0
    };
    let task = k.start_ps(cfg, &plan, index, l, expected, restore, &layout)?;
    tracing::info!(
        target: "status",
        "starwire ps {index}: serving {} shard(s) on {}; {}; {}",
        cfg.ps_reactors.max(1),
        task.addr(),
        summary(&reactors),
        if lifetime.exit_when_done {
            "exits when every worker is done, or on SIGTERM or SIGINT"
        } else {
            "serves until SIGTERM or SIGINT"
        }
    );
    let stopped = || lifetime.stop.load(Ordering::Relaxed);
    while !stopped() && !task.finished() {
        std::thread::sleep(STOP_POLL);
    }
    if !stopped() {
        // Every expected worker is done (or a reactor failed: join says).
        return Ok(PsTaskReport {
            shards: task.join()?,
            reactors,
        });
    }
    let end = task.shutdown(true)?;
    if let Some(dir) = &cfg.checkpoint_dir {
        ps_manifest(cfg, &plan, dir, &end)?;
    }
    if !end.lost.is_empty() {
        return Err(TrainError::WorkersLost(end.lost));
    }
    Ok(PsTaskReport {
        shards: end.stats,
        reactors,
    })
}

/// After a stopped PS task wrote its shard files into `dir`: the manifest,
/// when this task holds every shard of the cluster (one PS task) and no
/// checkpoints are taken during the run. With several PS tasks each writes
/// only its own shards, and the manifest stays the last one written by the
/// chief.
fn ps_manifest(
    cfg: &TrainConfig,
    plan: &Plan,
    dir: &std::path::Path,
    end: &PsEnd,
) -> Result<(), TrainError> {
    if cfg.checkpoints_during_run() {
        // The manifest names the latest checkpoint taken during the run,
        // whose worker positions match its files; this one has none.
        tracing::info!(
            target: "status",
            "checkpoint: {} shard file(s) written into {}; the manifest stays that of the \
             latest checkpoint taken during the run",
            end.written.len(),
            dir.display()
        );
        return Ok(());
    }
    if end.steps.len() != plan.shards {
        tracing::warn!(
            target: "status",
            "checkpoint: wrote {} of the cluster's {} shard files into {}; the manifest is \
             the chief's",
            end.written.len(),
            plan.shards,
            dir.display()
        );
        return Ok(());
    }
    let mut steps = vec![0u64; plan.shards];
    for &(s, step) in &end.steps {
        if let Some(slot) = steps.get_mut(s) {
            *slot = step;
        }
    }
    // The workers' positions are theirs to report; a checkpoint taken on
    // SIGTERM keeps those of the one it was restored from.
    let workers = read_manifest(dir)?.map(|m| m.workers).unwrap_or_default();
    let files = (0..plan.shards).map(crate::handler::shard_file).collect();
    write_manifest(cfg, plan, dir, files, steps, workers)?;
    tracing::info!(
        target: "status",
        "checkpoint: {} shard file(s) and the manifest written into {}",
        end.written.len(),
        dir.display()
    );
    Ok(())
}

/// `starwire worker`: run worker `index` against the PS tasks at
/// `ps_addrs`. Worker 0 then evaluates (on the model as it stands when it
/// finishes; in asynchronous training other workers may still be pushing)
/// and writes the checkpoint if asked.
pub fn run_worker_task(
    cfg: &TrainConfig,
    ps_addrs: &[String],
    index: usize,
) -> Result<TrainReport, TrainError> {
    across_processes(cfg.backend)?;
    cfg.check_handoff()?;
    periodic::check(cfg)?;
    // The one worker of this process.
    let mut cfg = cfg.clone();
    cfg.prefetch = Some(
        cfg.prefetch
            .unwrap_or_else(|| default_prefetch(cfg.backend, 1)),
    );
    let cfg = &cfg;
    let k = cluster_backend(cfg.backend);
    let plan = plan(cfg)?;
    let manifest = match &cfg.checkpoint_dir {
        Some(d) => read_manifest(d)?,
        None => None,
    };
    let resume = manifest.as_ref().and_then(|m| {
        m.workers
            .iter()
            .find(|p| p.worker as usize == index)
            .cloned()
    });
    let layout = ReactorLayout::detect(cfg, &ProcessReactors::worker(index))?;
    warn(&layout);
    let mut net = k.connect(cfg, ps_addrs, index as u32, plan.shards, Some(&layout))?;
    let eval_all = if index == 0 {
        load_eval(cfg, &plan.truth, cfg.eval_examples)?
    } else {
        Vec::new()
    };
    let t0 = Instant::now();
    let mut resume = resume;
    let mut known = match cfg.checkpoint_dir {
        Some(_) => failover::incarnations(&mut *net, plan.shards)?,
        None => Vec::new(),
    };
    let mut failovers = Vec::new();
    let out = loop {
        let forward_to = failover::resume_at(
            &mut *net,
            plan.shards,
            index,
            resume.as_ref().map_or(0, |p| p.steps),
            cfg.sync,
        )?;
        let e = match worker_loop(
            cfg,
            &plan,
            None,
            index,
            &mut *net,
            None,
            ResumeFrom {
                position: resume.as_ref(),
                held_steps: forward_to,
            },
            None,
            layout.worker_cpu(index),
        ) {
            Ok(out) => break out,
            Err(e) => e,
        };
        if known.is_empty()
            || !failover::is_link_failure(&e)
            || failovers.len() as u32 >= failover::MAX_RESTARTS
        {
            return Err(e);
        }
        let lost = Instant::now();
        tracing::warn!(
            worker = index,
            "{e}: reconnecting to the PS tasks (for up to --connect-timeout {:?})",
            cfg.connect_timeout
        );
        net.close();
        drop(net);
        // The dial retries a PS that does not accept yet; a handshake cut
        // (a dying task's listener still accepting) is retried here.
        let mut retry = Retry::new(Backoff::CONNECT, lost + cfg.connect_timeout);
        let (new_net, now) = loop {
            let attempt = k
                .connect(cfg, ps_addrs, index as u32, plan.shards, Some(&layout))
                .and_then(|mut n| Ok((failover::incarnations(&mut *n, plan.shards)?, n)));
            match attempt {
                Ok((now, n)) => break (n, now),
                Err(e) if failover::is_link_failure(&e) => {
                    let pause = retry.handle_failure(Instant::now()).ok_or(e)?;
                    std::thread::sleep(pause);
                }
                Err(e) => return Err(e),
            }
        };
        net = new_net;
        let Some(restart) = failover::restarted(&known, &now) else {
            return Err(e);
        };
        known = now;
        let restored = failover::restored_step(&mut *net, plan.shards)?;
        let (step, progress) = failover::rollback(cfg, index, restored)?;
        let reconnect_seconds = failover::since(lost);
        tracing::warn!(
            worker = index,
            "{restart}: rolling back to its checkpoint (global step {}), {reconnect_seconds:.3} s \
             after the failure",
            step.unwrap_or(0)
        );
        failovers.push(failover::Failover {
            rolled_back_to: step,
            reconnect_seconds,
        });
        resume = progress;
    };
    let train_seconds = out
        .end
        .map_or(0.0, |e| e.saturating_duration_since(t0).as_secs_f64());
    let mut core = WorkerCore::new(
        partition(&plan.model, cfg.protocol),
        plan.layout.clone(),
        cfg.tensor_fuse,
        executor(cfg)?,
    );
    let (auc_v, logloss_v) = if index == 0 {
        evaluate(&mut core, &mut *net, &eval_all)?
    } else {
        (f64::NAN, f64::NAN)
    };
    let mut ckpt = None;
    if let (0, Some(d)) = (index, &cfg.checkpoint_dir) {
        let progress = out.progress.clone().into_iter().collect();
        write_checkpoint(&mut core, &mut *net, cfg, &plan, d, progress)?;
        ckpt = Some(d.clone());
    }
    let shard_stats = control_all(&mut *net, plan.shards, &Control::Stats)?
        .into_iter()
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect();
    control_all(&mut *net, plan.shards, &Control::Done)?;
    net.close();
    let t = out.traffic;
    Ok(TrainReport {
        backend: k.name().into(),
        protocol: protocol_name(cfg.protocol).into(),
        model: model_name(cfg.model).into(),
        ps: cfg.ps,
        shards: plan.shards,
        workers: cfg.workers,
        tensor_fuse: cfg.tensor_fuse,
        sync: cfg.sync,
        batch_size: cfg.batch_size,
        bounded_delay: delay::applied_bounded_delay(cfg),
        turn_steps: delay::applied_turn_steps(cfg),
        worker_handoff: cfg.handoff(),
        prefetch: cfg.prefetch.unwrap_or(0),
        steps: out.steps,
        samples: out.samples,
        examples_trained: out.examples_trained,
        examples_planned: out.examples_planned,
        train_seconds,
        samples_per_s: out.samples as f64 / train_seconds.max(1e-9),
        auc: auc_v,
        logloss: logloss_v,
        oracle_auc: None,
        eval_examples: eval_all.iter().map(|b| b.len as u64).sum(),
        bytes_per_step: (t.sent + t.received) as f64 / out.steps.max(1) as f64,
        requests_per_step: t.requests as f64 / out.steps.max(1) as f64,
        final_train_loss: out.last_loss,
        intervals: out.intervals,
        assignment: plan.assignment,
        skipped_lines: out.skipped,
        checkpoint: ckpt,
        staleness: out.staleness.summary(),
        resumed_from_step: manifest.map(|m| m.global_step),
        shard_stats,
        reactors: layout.report(),
        failovers,
    })
}

/// A local worker's end, as its thread reports it to `starwire train`'s
/// driver.
struct Ended {
    worker: usize,
    failed: bool,
}

/// Sends a worker's [`Ended`] once: by [`EndedGuard::send`] when its
/// training ends, else as a failure when its thread ends (an early
/// return, or a panic unwinding through the drop).
struct EndedGuard {
    tx: std::sync::mpsc::Sender<Ended>,
    worker: usize,
    sent: bool,
}

impl EndedGuard {
    fn send(&mut self, failed: bool) {
        if !std::mem::replace(&mut self.sent, true) {
            let _ = self.tx.send(Ended {
                worker: self.worker,
                failed,
            });
        }
    }
}

impl Drop for EndedGuard {
    fn drop(&mut self) {
        self.send(true);
    }
}

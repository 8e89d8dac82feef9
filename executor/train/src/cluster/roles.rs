//! The pieces of the PS and worker roles: starting a PS task's reactors,
//! connecting a worker to every shard, a worker's training loop, the
//! evaluation and the checkpoint.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::sync::WaitGroup;
use starwire_data::{auc, logloss, Batch, TrueModel};
use starwire_graph::partition;
use starwire_ps::{Manifest, PsShard, WorkerProgress};
use starwire_transport::accept::{dial, inboxes, Acceptor};
use starwire_transport::reactor::Reactor;
use starwire_transport::{ConnConfig, Driver, Endpoint, PeerInfo, TaskRole};

use super::config::shard_config;
use super::periodic;
use super::reactors::{PinnedThread, ReactorLayout};
use super::shares::{self, examples_planned, last_common_step, step_cap, sync_epoch_steps};
use super::{model_name, protocol_name, BackendKind, Interval, Plan, TrainConfig};
use crate::backend::{Backend, Tcp};
use crate::deltas::DeltaExport;
use crate::handler::{shard_file, ShardHandler};
use crate::handoff::{HandoffConfig, HandoffNet};
use crate::net::{Exchange, SessionNet, Traffic, WorkerService};
use crate::server::ShardService;
use crate::source::{Batches, Prefetch, Reader};
use crate::telemetry::{Published, ShardTelemetry, StepProgress, WorkerTelemetry};
use crate::worker::{WorkerBuffers, WorkerCore};
use crate::TrainError;
use starwire_wire::ps::Control;

fn peer(role: TaskRole, index: u32, shards: u16) -> PeerInfo {
    let incarnation = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    PeerInfo {
        role,
        job: match role {
            TaskRole::Ps => "ps".into(),
            TaskRole::Worker => "worker".into(),
        },
        task_index: index,
        incarnation,
        shards,
    }
}

/// One shard's reactor state: its endpoint, or none when the backend
/// failed to start on the reactor's thread (the reactor then finishes at
/// once), publishing its driver's counters.
type ShardState<K> = Published<<K as Backend>::Driver, ShardService<ShardHandler>>;

/// A running PS task: its acceptor and one reactor per shard.
#[derive(Debug)]
pub struct PsTask<K: Backend> {
    acceptor: Acceptor,
    reactors: Vec<Reactor<ShardState<K>>>,
}

impl<K: Backend> PsTask<K> {
    /// Where workers connect.
    pub fn addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }

    /// Wait for every shard to finish (every expected worker said `DONE`
    /// or was lost) and return the shards' counters; a worker that died
    /// unfinished is an error naming it.
    pub fn join(self) -> Result<Vec<serde_json::Value>, TrainError> {
        let PsTask { acceptor, reactors } = self;
        let ended: Vec<Joined<K>> = reactors.into_iter().map(Reactor::join).collect();
        let end = collect::<K>(ended.into_iter(), false)?;
        drop(acceptor);
        if !end.lost.is_empty() {
            return Err(TrainError::WorkersLost(end.lost));
        }
        Ok(end.stats)
    }

    /// Whether a shard's reactor has ended: its expected workers are done,
    /// or it failed.
    pub fn any_finished(&self) -> bool {
        self.reactors.iter().any(Reactor::is_finished)
    }

    /// Stop serving: no new connection is accepted, every shard's reactor
    /// is told to stop at once and stops between two requests (no push is
    /// half applied), and then each shard writes its checkpoint file when
    /// `checkpoint` is set and the task has a `--checkpoint-dir`.
    pub fn shutdown(self, checkpoint: bool) -> Result<PsEnd, TrainError> {
        let PsTask { acceptor, reactors } = self;
        drop(acceptor);
        for r in &reactors {
            r.waker().stop();
        }
        // Every reactor is joined before any file is written, so none is
        // left running by a write that fails.
        let ended: Vec<Joined<K>> = reactors.into_iter().map(Reactor::join).collect();
        collect::<K>(ended.into_iter(), checkpoint)
    }
}

/// What a PS task's shards ended with.
#[derive(Debug, Clone, Default)]
pub struct PsEnd {
    /// Each shard's counters.
    pub stats: Vec<serde_json::Value>,
    /// Each shard's index and global step, as it stopped.
    pub steps: Vec<(usize, u64)>,
    /// Workers lost on any shard (connection ended before `DONE`, no
    /// rejoin), by task index.
    pub lost: Vec<u32>,
    /// The shard files written, when asked to checkpoint.
    pub written: Vec<std::path::PathBuf>,
}

type Joined<K> = Result<
    (ShardState<K>, starwire_transport::reactor::ReactorStats),
    starwire_transport::reactor::ReactorError,
>;

/// The shards of ended reactors: counters, steps, lost workers, and their
/// checkpoint files written when `checkpoint` is set.
fn collect<K: Backend>(
    ended: impl Iterator<Item = Joined<K>>,
    checkpoint: bool,
) -> Result<PsEnd, TrainError> {
    let mut end = PsEnd::default();
    for r in ended {
        let (shard, _) = r.map_err(|e| TrainError::Internal(format!("PS reactor: {e}")))?;
        let mut endpoint = shard
            .into_inner()
            .ok_or_else(|| TrainError::Internal("PS reactor had no driver".into()))?;
        if checkpoint {
            endpoint.service_mut().rewind_kept();
        }
        let service = endpoint.service();
        let h = service.handler();
        end.stats.push(crate::psserver::PsHandler::stats(h));
        end.steps.push((h.index, h.shard.global_step()));
        end.lost.extend(service.server().lost());
        if let (true, Some(dir)) = (checkpoint, &h.checkpoint_dir) {
            end.written.push(write_shard(h, dir)?);
        }
    }
    end.lost.sort_unstable();
    end.lost.dedup();
    Ok(end)
}

/// Write shard `h`'s checkpoint file into `dir`.
pub(crate) fn write_shard(h: &ShardHandler, dir: &Path) -> Result<std::path::PathBuf, TrainError> {
    let path = dir.join(shard_file(h.index));
    let ck = |reason: String| TrainError::Checkpoint {
        path: path.clone(),
        reason,
    };
    starwire_ps::create_dir_durable(dir).map_err(|e| ck(e.to_string()))?;
    starwire_ps::write_atomic(&path, |w| h.shard.save(w)).map_err(|e| ck(e.to_string()))?;
    Ok(path)
}

/// Shard `s` of the plan as a reactor (or a lock) serves it, restored
/// from the checkpoint in `restore` if given.
pub(crate) fn shard_handler(
    cfg: &TrainConfig,
    plan: &Plan,
    s: usize,
    restore: Option<&Path>,
) -> Result<ShardHandler, TrainError> {
    let shard = make_shard(cfg, plan, s, restore)?;
    let telemetry = ShardTelemetry::new(&cfg.telemetry, cfg.backend.name(), &shard, cfg.log_every);
    let deltas = cfg
        .delta_every_steps
        .map(|n| DeltaExport::new(n, shard.global_step(), &shard));
    Ok(ShardHandler {
        checkpoint_dir: cfg.checkpoint_dir.clone(),
        checkpoint_every: cfg.checkpoint_every_steps.unwrap_or(0),
        deltas,
        telemetry: Some(telemetry),
        ..ShardHandler::new(shard, s)
    })
}

/// Shard `s` of the plan, restored from the checkpoint in `restore` if
/// given. An optimizer hyper-parameter out of range
/// ([`starwire_ps::OptimizerConfig::validate`]) is a
/// [`TrainError::Config`].
pub fn make_shard(
    cfg: &TrainConfig,
    plan: &Plan,
    s: usize,
    restore: Option<&Path>,
) -> Result<PsShard, TrainError> {
    let mut shard = PsShard::try_new(s, &plan.shard_vars[s], shard_config(cfg))
        .map_err(|e| TrainError::Config(e.to_string()))?;
    // With --sync the workers' pushes are merged into one push of no
    // worker (applied as Adagrad, `dc_asgd` or `--staleness-lr` alike):
    // no push ever uses a worker's pull record, which would only grow.
    // Asynchronously, the evaluator (task index `workers`) never pushes.
    shard.set_recorded_workers(if cfg.sync { 0 } else { cfg.workers as u32 });
    // Tables start with room for the rows they are expected to reach (a
    // sharded table's share of them), so their maps do not grow, and a
    // thread faults those rows' pages in, so the pulls that make the rows
    // pay no page faults: from the first row, or in the local cluster
    // from now, while the rest of the cluster starts. A restore replaces
    // the tables whole, reservation and all, so it starts nothing early:
    // those pages would be faulted in for tables that are dropped.
    let rows = plan.shard_vars[s].iter().map(|def| {
        let id = def.id as usize;
        let seen = plan.expected_keys.get(id).copied().unwrap_or(0);
        let ways = match plan.layout.home_shard.get(id) {
            Some(Some(_)) => 1,
            _ => plan.shards.max(1) as u64,
        };
        (def.id, usize::try_from(seen / ways).unwrap_or(0))
    });
    shard.reserve_rows(rows, cfg.reserve_at_start && restore.is_none());
    if let Some(dir) = restore {
        let manifest = read_manifest(dir)?.ok_or_else(|| TrainError::Checkpoint {
            path: dir.join("manifest.json"),
            reason: "no manifest: the checkpoint is incomplete".into(),
        })?;
        let path = dir.join(manifest_file(&manifest, s, dir)?);
        let ck = |reason: String| TrainError::Checkpoint {
            path: path.clone(),
            reason,
        };
        let mut f = std::fs::File::open(&path).map_err(|e| ck(e.to_string()))?;
        shard.restore(&mut f).map_err(|e| ck(e.to_string()))?;
        check_shard(&manifest, s, shard.global_step(), &path)?;
    }
    Ok(shard)
}

/// Shard `s`'s file as the manifest names it: a path inside the
/// checkpoint directory (no `..`, not absolute).
fn manifest_file<'m>(m: &'m Manifest, s: usize, dir: &Path) -> Result<&'m Path, TrainError> {
    let bad = |reason: String| TrainError::Checkpoint {
        path: dir.join("manifest.json"),
        reason,
    };
    let f = Path::new(
        m.shard_files
            .get(s)
            .ok_or_else(|| bad(format!("no file for shard {s}")))?,
    );
    let inside = f
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !inside {
        return Err(bad(format!(
            "shard {s}'s file {} is not inside the checkpoint directory",
            f.display()
        )));
    }
    Ok(f)
}

/// Shard `s`'s file, at global step `file`, against the manifest: a
/// file of another step than the manifest names is from another
/// checkpoint (or was written while the shard still trained).
pub(super) fn check_shard(
    m: &Manifest,
    s: usize,
    file: u64,
    path: &Path,
) -> Result<(), TrainError> {
    match m.shard_steps.get(s) {
        Some(&manifest) if manifest != file => Err(TrainError::CheckpointMismatch {
            path: path.to_owned(),
            shard: s,
            manifest,
            file,
        }),
        _ => Ok(()),
    }
}

/// A PS task as the local cluster drives it, whatever its backend.
pub trait RunningPs {
    /// Where workers connect.
    fn addr(&self) -> SocketAddr;
    /// Wait until every expected worker is done; the shards' counters.
    fn join(self: Box<Self>) -> Result<Vec<serde_json::Value>, TrainError>;
    /// Stop at once (a run that failed).
    fn stop(self: Box<Self>);
    /// Whether the task ended by itself: its expected workers are done,
    /// or a reactor failed. A task serving until stopped never does.
    fn finished(&self) -> bool {
        false
    }
    /// Stop serving; each shard writes its checkpoint file when
    /// `checkpoint` is set and the task has a `--checkpoint-dir`.
    fn shutdown(self: Box<Self>, checkpoint: bool) -> Result<PsEnd, TrainError>;
}

impl<K: Backend> RunningPs for PsTask<K> {
    fn addr(&self) -> SocketAddr {
        PsTask::addr(self)
    }
    fn join(self: Box<Self>) -> Result<Vec<serde_json::Value>, TrainError> {
        PsTask::join(*self)
    }
    fn stop(self: Box<Self>) {
        for r in self.reactors {
            let _ = r.stop();
        }
    }
    fn finished(&self) -> bool {
        self.any_finished()
    }
    fn shutdown(self: Box<Self>, checkpoint: bool) -> Result<PsEnd, TrainError> {
        PsTask::shutdown(*self, checkpoint)
    }
}

/// A worker's connections to every shard, whatever the backend.
pub trait WorkerNet: Exchange {
    /// Close every connection politely.
    fn close(&mut self);
}

impl<D: Driver> WorkerNet for SessionNet<D> {
    fn close(&mut self) {
        SessionNet::close(self);
    }
}

impl<D: Driver + Send + 'static> WorkerNet for HandoffNet<D> {
    fn close(&mut self) {
        HandoffNet::close(self);
    }
}

/// How the local cluster starts a PS task and connects a worker on one
/// backend.
pub trait ClusterBackend: Sync {
    /// The name in reports.
    fn name(&self) -> &'static str;
    /// Start PS task `p` on `listener`, its reactors placed by `layout`
    /// (see [`start_ps`]).
    #[allow(clippy::too_many_arguments)]
    fn start_ps(
        &self,
        cfg: &TrainConfig,
        plan: &Plan,
        p: usize,
        listener: TcpListener,
        expected: usize,
        restore: Option<&Path>,
        layout: &ReactorLayout,
    ) -> Result<Box<dyn RunningPs>, TrainError>;
    /// Connect worker (or evaluator) `index` to every shard. With
    /// `layout`, a worker that hands its requests to network reactors
    /// ([`TrainConfig::handoff`]) starts them where `layout` puts them;
    /// without it (the evaluator), the calling thread drives the
    /// connections.
    fn connect(
        &self,
        cfg: &TrainConfig,
        ps_addrs: &[String],
        index: u32,
        shards: usize,
        layout: Option<&ReactorLayout>,
    ) -> Result<Box<dyn WorkerNet>, TrainError>;
}

/// A session backend ([`Backend`]) as a [`ClusterBackend`].
#[derive(Debug, Default)]
pub struct Sessions<K>(std::marker::PhantomData<K>);

impl<K: Backend> ClusterBackend for Sessions<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }
    fn start_ps(
        &self,
        cfg: &TrainConfig,
        plan: &Plan,
        p: usize,
        listener: TcpListener,
        expected: usize,
        restore: Option<&Path>,
        layout: &ReactorLayout,
    ) -> Result<Box<dyn RunningPs>, TrainError> {
        Ok(Box::new(start_ps::<K>(
            cfg, plan, p, listener, expected, restore, layout,
        )?))
    }
    fn connect(
        &self,
        cfg: &TrainConfig,
        ps_addrs: &[String],
        index: u32,
        shards: usize,
        layout: Option<&ReactorLayout>,
    ) -> Result<Box<dyn WorkerNet>, TrainError> {
        Ok(match layout.filter(|l| l.handoff()) {
            Some(layout) => Box::new(connect_handoff::<K>(cfg, ps_addrs, index, shards, layout)?),
            None => Box::new(connect::<K>(cfg, ps_addrs, index, shards)?),
        })
    }
}

pub(super) fn cluster_backend(b: BackendKind) -> Box<dyn ClusterBackend> {
    match b {
        BackendKind::Tcp => Box::new(Sessions::<Tcp>::default()),
        BackendKind::Inproc => Box::new(crate::inproc::Inproc),
        #[cfg(all(feature = "uring", target_os = "linux"))]
        BackendKind::Uring => Box::new(Sessions::<crate::backend::Uring>::default()),
        #[cfg(feature = "grpc")]
        BackendKind::Grpc => Box::new(crate::grpc::Grpc),
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        BackendKind::Verbs => Box::new(Sessions::<crate::backend::Verbs>::default()),
        #[cfg(feature = "dpdk")]
        BackendKind::Dpdk => Box::new(Sessions::<crate::backend::Dpdk>::default()),
    }
}

/// Start PS task `ps_index` of the plan on `listener`; its shards finish
/// after `expected` workers have said `DONE`. Restores the shards from
/// `restore` if given. Each shard's reactor runs where `layout` puts it.
pub fn start_ps<K: Backend>(
    cfg: &TrainConfig,
    plan: &Plan,
    ps_index: usize,
    listener: TcpListener,
    expected: usize,
    restore: Option<&Path>,
    layout: &ReactorLayout,
) -> Result<PsTask<K>, TrainError> {
    let r = cfg.ps_reactors.max(1);
    let (tx, rxs) = inboxes(r)?;
    let mut reactors = Vec::with_capacity(r);
    let budget = cfg.guard.budget();
    let max_wait_steps = cfg.guard.max_wait_steps;
    for (local, rx) in rxs.into_iter().enumerate() {
        let s = ps_index * r + local;
        let mut handler = shard_handler(cfg, plan, s, restore)?;
        let me = peer(TaskRole::Ps, ps_index as u32, r as u16);
        handler.incarnation = me.incarnation;
        let mut conn_cfg = cfg.guard.apply(cfg, ConnConfig::new(me), Some(&budget));
        // The worker task indices this PS serves: the cluster's, and in the
        // local cluster its evaluator's (one past them, counted in
        // `expected`).
        conn_cfg.workers = u32::try_from(cfg.workers.max(expected)).ok();
        let spec = layout.ps_spec(s)?;
        // The driver (an io_uring ring) is made on the reactor's own
        // thread, which reports a failure to make it.
        let (btx, brx) = mpsc::sync_channel(1);
        let polling = cfg.ps_polling;
        // Half the idle timeout: the barriers fail naming the dead worker
        // before the idle timeout closes the connections waiting on them.
        let dead_wait = cfg.guard.idle_timeout.map_or(Duration::MAX, |t| t / 2);
        let sync_workers = cfg.sync.then_some(cfg.workers);
        let sync_budget = budget.clone();
        let held_budget = budget.clone();
        let telemetry = cfg.telemetry.clone();
        let reactor = Reactor::spawn(spec, move |_| {
            let driver = K::driver(polling);
            let ok = driver.as_ref().map(|_| ()).map_err(|e| e.to_string());
            let _ = btx.send(ok);
            let mut service = ShardService::new(s, handler, expected)
                .with_max_wait_steps(max_wait_steps)
                .with_budget(held_budget);
            if let Some(w) = sync_workers {
                service = service.with_sync(w, dead_wait, sync_budget);
            }
            let endpoint = driver
                .ok()
                .map(|d| Endpoint::new(d, service, conn_cfg).with_inbox(rx));
            Published::new(endpoint, &telemetry, K::NAME)
        })
        .map_err(|e| TrainError::Internal(format!("starting PS reactor: {e}")))?;
        brx.recv()
            .map_err(|_| TrainError::Internal("PS reactor died while starting".into()))?
            .map_err(|e| TrainError::Backend(K::NAME, e))?;
        reactors.push(reactor);
    }
    let wakers = reactors.iter().map(Reactor::waker).collect();
    let acceptor = Acceptor::spawn(listener, tx, wakers, cfg.guard.accept_config())?;
    Ok(PsTask { acceptor, reactors })
}

/// How long a worker's handshakes, and each of its requests, may take.
const WORKER_TIMEOUT: Duration = Duration::from_secs(120);

/// Dial every shard of the cluster: shard `s`'s stream at position `s`.
fn dial_shards(
    cfg: &TrainConfig,
    ps_addrs: &[String],
    shards: usize,
) -> Result<Vec<std::net::TcpStream>, TrainError> {
    let r = cfg.ps_reactors.max(1);
    let deadline = Instant::now() + cfg.connect_timeout;
    let mut streams = Vec::with_capacity(shards);
    for s in 0..shards {
        let (p, local) = (s / r, s % r);
        let addr = ps_addrs
            .get(p)
            .ok_or_else(|| TrainError::Config(format!("no address for PS {p}")))?;
        streams.push(dial(addr, local as u32, deadline)?);
    }
    Ok(streams)
}

/// Connect a worker (or the evaluator) to every shard of the cluster; the
/// calling thread drives the connections.
pub fn connect<K: Backend>(
    cfg: &TrainConfig,
    ps_addrs: &[String],
    index: u32,
    shards: usize,
) -> Result<SessionNet<K::Driver>, TrainError> {
    let streams = dial_shards(cfg, ps_addrs, shards)?;
    let backend = |e: &dyn std::fmt::Display| TrainError::Backend(K::NAME, e.to_string());
    let driver = K::driver(cfg.worker_polling).map_err(|e| backend(&e))?;
    let now = Instant::now();
    let service = WorkerService::new(shards, WORKER_TIMEOUT, now);
    let cc = cfg
        .guard
        .apply(cfg, ConnConfig::new(peer(TaskRole::Worker, index, 1)), None);
    let mut endpoint = Endpoint::new(driver, service, cc);
    for (s, stream) in streams.into_iter().enumerate() {
        // A stream the PS reset after accepting it (a dying task's
        // listener) fails here: a lost connection, which the failover
        // retries, not a broken backend.
        endpoint
            .attach_stream(stream, s as u32, now)
            .map_err(|e| match e {
                starwire_transport::TransportError::Io(e) => TrainError::Io(e),
                e => backend(&e),
            })?;
    }
    SessionNet::new(endpoint, cfg.worker_polling)
}

/// Connect worker `index` to every shard of the cluster through its
/// network reactors, placed by `layout`; the calling thread hands them its
/// requests.
pub fn connect_handoff<K: Backend>(
    cfg: &TrainConfig,
    ps_addrs: &[String],
    index: u32,
    shards: usize,
    layout: &ReactorLayout,
) -> Result<HandoffNet<K::Driver>, TrainError> {
    let streams = dial_shards(cfg, ps_addrs, shards)?;
    let hc = HandoffConfig {
        reactors: layout.worker_specs(index as usize)?,
        producers: 1,
        wait: layout.worker_wait(),
        polling: cfg.worker_polling,
        conn: cfg
            .guard
            .apply(cfg, ConnConfig::new(peer(TaskRole::Worker, index, 1)), None),
        timeout: WORKER_TIMEOUT,
        telemetry: cfg.telemetry.clone(),
    };
    HandoffNet::connect::<K>(streams, &hc)
}

/// What one worker did.
#[derive(Debug, Clone, Default)]
pub struct WorkerOutcome {
    /// Steps run in this session.
    pub steps: u64,
    /// Examples trained on in this session.
    pub samples: u64,
    /// Examples of this worker the model holds at the end: those of the
    /// position it resumed from plus those trained since (a roll-back's
    /// retrained examples count once).
    pub examples_trained: u64,
    /// Examples an uninterrupted run plans for this worker (none: not
    /// known without reading the data, as for Criteo files).
    pub examples_planned: Option<u64>,
    /// Traffic.
    pub traffic: Traffic,
    /// Progress for a checkpoint.
    pub progress: Option<WorkerProgress>,
    /// Intervals (worker 0 only).
    pub intervals: Vec<Interval>,
    /// Loss of the last interval.
    pub last_loss: f64,
    /// Bad lines skipped, over every epoch of this session.
    pub skipped: u64,
    /// When training ended.
    pub end: Option<Instant>,
    /// How stale this worker's pushes were.
    pub staleness: crate::staleness::StalenessHistogram,
}

/// Read at most `cap` examples of an evaluation source into batches of
/// `batch`.
pub fn load_eval(
    cfg: &TrainConfig,
    truth: &Arc<TrueModel>,
    cap: u64,
) -> Result<Vec<Batch>, TrainError> {
    let mut r = Reader::eval(&cfg.eval, truth, cap, cfg.skip_bad_lines)?;
    let mut out = Vec::new();
    let mut total = 0u64;
    while total < cap {
        let mut b = Batch::with_capacity(cfg.batch_size);
        let want = (cap - total).min(cfg.batch_size as u64) as usize;
        let n = r.next_batch(want, &mut b)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        out.push(b);
    }
    Ok(out)
}

/// AUC and logloss of the current model on `batches`.
pub fn evaluate(
    core: &mut WorkerCore,
    net: &mut dyn Exchange,
    batches: &[Batch],
) -> Result<(f64, f64), TrainError> {
    let mut labels = Vec::new();
    let mut probs = Vec::new();
    for b in batches {
        let p = core.predict(net, b)?;
        labels.extend_from_slice(&b.labels);
        probs.extend_from_slice(&p);
    }
    Ok((auc(&labels, &probs), logloss(&labels, &probs)))
}

/// Where a worker starts.
#[derive(Debug, Clone, Copy, Default)]
pub struct ResumeFrom<'a> {
    /// Its position in a checkpoint (none: the start of its data).
    pub position: Option<&'a WorkerProgress>,
    /// Its steps the PS holds already (a worker restarted after the PS
    /// applied its pushes past that position): read up to there, not
    /// trained again.
    pub held_steps: u64,
}

/// Run worker `w` of the cluster until its data (or step cap) is done,
/// pinned to `cpu` if given (after its compute threads have started, so
/// they keep the process's CPUs), its graph run and its requests written
/// in buffers from `pool` when given (the workers of one process share
/// them). With `start` (the local cluster's), it waits there before its
/// first step until every worker has reached it or dropped its handle.
#[allow(clippy::too_many_arguments)]
pub fn worker_loop(
    cfg: &TrainConfig,
    plan: &Plan,
    pool: Option<&WorkerBuffers>,
    w: usize,
    net: &mut dyn Exchange,
    start: Option<WaitGroup>,
    from: ResumeFrom<'_>,
    eval_batches: Option<&[Batch]>,
    cpu: Option<usize>,
) -> Result<WorkerOutcome, TrainError> {
    // The other workers wait at the start for this one, failed or not: an
    // error before the start drops `start`, which counts as its arrival.
    let part = partition(&plan.model, cfg.protocol);
    let mut core = WorkerCore::new(
        part,
        plan.layout.clone(),
        cfg.tensor_fuse,
        super::executor(cfg)?,
    );
    if let Some(pool) = pool {
        core.share_buffers(pool.clone());
    }
    let deal = shares::deal(cfg, w)?;
    let mut reader = Reader::train(
        &cfg.train,
        &plan.truth,
        cfg.train_examples,
        deal,
        cfg.skip_bad_lines,
    )?;
    let cap = step_cap(cfg, w);
    let epoch_cap = sync_epoch_steps(cfg, &plan.shares)?;
    // Asynchronously a checkpoint step stops every worker at a barrier, so
    // only the steps every worker reaches are checkpoint steps.
    let during_run = cfg.checkpoints_during_run();
    let async_cut = match (cfg.sync, during_run) {
        (true, _) => u64::MAX,
        (false, true) => last_common_step(cfg, &plan.shares)?.unwrap_or(0),
        (false, false) => 0,
    };
    let mut batch = Batch::with_capacity(cfg.batch_size);
    let mut out = WorkerOutcome::default();
    let (mut epoch, mut offset, mut steps_done) = (0u64, 0u64, 0u64);
    let mut resumed_in_epoch = 0u64;
    out.examples_planned = examples_planned(cfg, &plan.shares, w)?;
    let resume = from.position;
    // Examples in the model before this session's training: those of the
    // resumed position, then those of the steps the PS holds already.
    let mut resumed_examples = resume.map_or(0, |p| p.examples);
    if let Some(p) = resume {
        // A position counts into the share it was taken in: one of as many
        // as there were workers (when recorded), dealt in blocks.
        if let Some(n) = p.workers.filter(|&n| n != cfg.workers as u64) {
            return Err(TrainError::Config(format!(
                "worker {w}'s checkpointed position counts into one of {n} worker(s)' shares of \
                 the data, and this run deals it to {} worker(s): resume with the checkpoint's \
                 {n} worker(s) (train --workers, or the hosts of --worker-hosts or TF_CONFIG), \
                 or start from an empty directory",
                cfg.workers
            )));
        }
        if p.deal_block != deal.block() as u64 {
            return Err(TrainError::Config(format!(
                "worker {w}'s checkpointed position counts into a share dealt {} example(s) at \
                 a time, and this run deals {} (a batch, or an even share if smaller): resume \
                 with the checkpoint's --batch-size and data, or start from an empty directory",
                p.deal_block,
                deal.block()
            )));
        }
        epoch = p.epoch;
        steps_done = p.steps;
        // Skip what this worker had consumed of the resumed epoch. The
        // position is at the end of one of its batches, so reads of a
        // batch at most are those batches, one read each (a batch does
        // not span files, so not all are full): they count its steps of
        // the epoch.
        let mut skipped = 0u64;
        while skipped < p.offset {
            let want = (p.offset - skipped).min(cfg.batch_size as u64) as usize;
            let n = reader.next_batch(want, &mut batch)?;
            if n == 0 {
                break;
            }
            skipped += n as u64;
            resumed_in_epoch += 1;
        }
        offset = skipped;
    }
    // Past the resumed position, the batches are read ahead (on the
    // worker's core when pinned) unless `--prefetch 0`.
    let batches = match cfg.prefetch.unwrap_or(0) {
        0 => Ok(Batches::Inline(reader, cfg.batch_size)),
        depth => {
            let name = format!("starwire-input-{w}");
            Prefetch::start(reader, cfg.batch_size, depth, name, cpu).map(Batches::Ahead)
        }
    };
    if let Some(start) = start {
        start.wait();
    }
    let mut reader = batches.map_err(TrainError::Io)?;
    let _pinned = PinnedThread::pin(cpu)?;
    let cells = WorkerTelemetry::new(
        &cfg.telemetry,
        cfg.backend.name(),
        w,
        cfg.log_every,
        net.traffic(),
    );
    let mut timed = cells.timed(net);
    let net: &mut dyn Exchange = &mut timed;
    let mut loss_sum = 0.0f64;
    let mut loss_n = 0u64;
    let w_count = cfg.workers as u64;
    let mut last_checkpoint = Instant::now();
    let turns = super::delay::Turns::new(cfg, w);
    // With --sync (and no checkpoints to take between steps): the step the
    // next step's pulls wait for.
    let mut sync_turn: Option<u64> = None;
    // Bad lines skipped in the epochs rewound (a rewind starts the count
    // again), and whether the step cap stopped an epoch before its rewind.
    let (mut skipped_lines, mut capped) = (0u64, false);
    'epochs: while epoch < cfg.epochs {
        let mut in_epoch = std::mem::take(&mut resumed_in_epoch);
        loop {
            if cap.is_some_and(|c| steps_done >= c) {
                capped = true;
                break 'epochs;
            }
            if epoch_cap.is_some_and(|c| in_epoch >= c) {
                break;
            }
            in_epoch += 1;
            let n = reader.next_batch(&mut batch)?;
            if n == 0 {
                break;
            }
            if steps_done < from.held_steps {
                offset += n as u64;
                steps_done += 1;
                resumed_examples += n as u64;
                // With --sync the next step is computed on the values after
                // every worker's pushes of the steps passed over.
                if cfg.sync && steps_done == from.held_steps {
                    core.barrier(net, steps_done * w_count)?;
                }
                continue;
            }
            // A checkpoint step's barrier may release the other workers as
            // soon as this step's push lands: this worker's progress after
            // the step is written before the push.
            let c = (steps_done + 1) * w_count;
            let every = cfg.checkpoint_every_steps.unwrap_or(0);
            let at_step = periodic::is_checkpoint_step(c, every);
            // Asynchronously, the checkpoints of --checkpoint-every-secs
            // are at the steps shard 0 decides for every worker alike.
            let voted = !cfg.sync
                && !at_step
                && steps_done < async_cut
                && periodic::is_vote_step(steps_done + 1)
                && cfg.checkpoint_dir.is_some()
                && match cfg.checkpoint_every_secs {
                    // Every worker's own clock: the first vote decides, so a
                    // want of worker 0's alone is lost whenever another
                    // worker runs a whole vote ahead of it.
                    Some(s) => periodic::vote(net, c, last_checkpoint.elapsed() >= s)?,
                    None => false,
                };
            if voted && w == 0 {
                core.control(net, &Control::CheckpointAt(c))?;
            }
            let ckpt_dir = cfg
                .checkpoint_dir
                .as_deref()
                .filter(|_| steps_done < async_cut && (at_step || voted));
            if let Some(dir) = ckpt_dir {
                let progress = WorkerProgress {
                    worker: w as u32,
                    epoch,
                    offset: offset + n as u64,
                    steps: steps_done + 1,
                    examples: resumed_examples + out.samples + n as u64,
                    deal_block: deal.block() as u64,
                    workers: Some(w_count),
                };
                periodic::write_progress(dir, c, &progress)?;
            }
            // Worker 0 times the checkpoints of --checkpoint-every-secs: the
            // shards hear of step c before this worker's push of it.
            let timed_dir = cfg
                .checkpoint_dir
                .as_deref()
                .filter(|_| w == 0 && cfg.sync && ckpt_dir.is_none())
                .filter(|_| {
                    cfg.checkpoint_every_secs
                        .is_some_and(|s| last_checkpoint.elapsed() >= s)
                });
            if timed_dir.is_some() {
                core.control(net, &Control::CheckpointAt(c))?;
            }
            let t_step = Instant::now();
            // The global step last seen may be behind the shards': waiting
            // only when it is short of the turn spares the shards a
            // barrier when the turn has come.
            let turn = sync_turn.take().or_else(|| {
                turns
                    .as_ref()
                    .and_then(|t| t.turn(steps_done))
                    .filter(|&t| core.global_step() < t)
            });
            let info = core.step_in_turn(net, &batch, turn)?;
            offset += n as u64;
            steps_done += 1;
            out.steps += 1;
            out.samples += n as u64;
            loss_sum += f64::from(info.loss);
            loss_n += 1;
            if cfg.sync && cfg.checkpoint_dir.is_none() {
                // The next step's pulls wait for this step behind its
                // push, in its one exchange.
                sync_turn = Some(c);
            } else if cfg.sync {
                core.flush_and_wait(net, c)?;
                if let (0, Some(dir)) = (w, ckpt_dir) {
                    periodic::complete(cfg, plan, dir, c)?;
                    last_checkpoint = Instant::now();
                }
                if let Some(dir) = timed_dir {
                    let shares = plan.shares.get(cfg)?;
                    let progress = periodic::sync_progress(cfg, steps_done, epoch_cap, &shares);
                    periodic::publish(cfg, plan, dir, c, progress)?;
                    last_checkpoint = Instant::now();
                }
            } else if let Some(dir) = ckpt_dir {
                // Every worker stops after its step `c / workers`: the
                // barrier lets none push the next step before every shard
                // has applied exactly these (and written its file).
                core.flush_and_wait(net, c)?;
                if w == 0 {
                    periodic::complete(cfg, plan, dir, c)?;
                }
                last_checkpoint = Instant::now();
            }
            cells.stepped(StepProgress {
                steps: out.steps,
                steps_done,
                samples: out.samples,
                epoch,
                loss: f64::from(info.loss),
                global_step: core.global_step(),
                took: t_step.elapsed(),
            });
        }
        if let Some(c) = sync_turn.take() {
            core.flush_and_wait(net, c)?;
        }
        epoch += 1;
        offset = 0;
        out.last_loss = loss_sum / loss_n.max(1) as f64;
        if w == 0 && epoch < cfg.epochs {
            if let Some(eb) = eval_batches {
                core.flush(net)?;
                let (a, l) = evaluate(&mut core, net, eb)?;
                if cfg.log_every > 0 {
                    tracing::info!(
                        target: "progress",
                        worker = w,
                        epoch,
                        train_loss = format_args!("{:.4}", out.last_loss),
                        eval_auc = format_args!("{a:.4}"),
                        eval_logloss = format_args!("{l:.4}"),
                        "epoch done"
                    );
                }
                out.intervals.push(Interval {
                    epoch,
                    steps: steps_done,
                    train_loss: out.last_loss,
                    auc: a,
                    logloss: l,
                });
            }
            loss_sum = 0.0;
            loss_n = 0;
        }
        skipped_lines += reader.skipped();
        reader.rewind()?;
    }
    match sync_turn {
        Some(c) => core.flush_and_wait(net, c)?,
        None => core.flush(net)?,
    }
    out.end = Some(Instant::now());
    if loss_n > 0 {
        out.last_loss = loss_sum / loss_n as f64;
    }
    out.traffic = net.traffic();
    out.skipped = skipped_lines + if capped { reader.skipped() } else { 0 };
    out.staleness = core.staleness().clone();
    out.examples_trained = resumed_examples + out.samples;
    out.progress = Some(WorkerProgress {
        worker: w as u32,
        epoch,
        offset,
        steps: steps_done,
        examples: out.examples_trained,
        deal_block: deal.block() as u64,
        workers: Some(w_count),
    });
    Ok(out)
}

pub(crate) fn read_manifest(dir: &Path) -> Result<Option<Manifest>, TrainError> {
    let p = dir.join("manifest.json");
    match std::fs::read_to_string(&p) {
        Ok(s) => Manifest::from_json(&s)
            .map(Some)
            .map_err(|e| TrainError::Checkpoint {
                path: p,
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TrainError::Checkpoint {
            path: p,
            reason: e.to_string(),
        }),
    }
}

fn model_json(cfg: &TrainConfig) -> serde_json::Value {
    serde_json::json!({
        "model": model_name(cfg.model),
        "embedding_dim": cfg.embedding_dim,
        "protocol": protocol_name(cfg.protocol),
        "ps": cfg.ps,
        "ps_reactors": cfg.ps_reactors,
        "optimizer": format!("{:?}", cfg.optimizer),
    })
}

/// Write the checkpoint: every shard's file, then the manifest.
pub(super) fn write_checkpoint(
    core: &mut WorkerCore,
    net: &mut dyn Exchange,
    cfg: &TrainConfig,
    plan: &Plan,
    dir: &Path,
    workers: Vec<WorkerProgress>,
) -> Result<(), TrainError> {
    starwire_ps::create_dir_durable(dir)?;
    let d = dir.to_str().ok_or_else(|| TrainError::Checkpoint {
        path: dir.to_owned(),
        reason: "path is not UTF-8".into(),
    })?;
    // Each shard answers with the global step its file holds.
    let shard_steps = core
        .control(net, &Control::Checkpoint(d))?
        .iter()
        .map(|b| b.as_slice().try_into().map(u64::from_le_bytes))
        .collect::<Result<Vec<u64>, _>>()
        .map_err(|_| TrainError::Checkpoint {
            path: dir.to_owned(),
            reason: "a shard's checkpoint reply does not carry its global step".into(),
        })?;
    let files = (0..plan.shards).map(shard_file).collect();
    write_manifest(cfg, plan, dir, files, shard_steps, workers)
}

/// Write `dir`'s manifest for shard files at `shard_steps` (the last
/// file of a checkpoint: a directory without it is incomplete).
pub(super) fn write_manifest(
    cfg: &TrainConfig,
    plan: &Plan,
    dir: &Path,
    shard_files: Vec<String>,
    shard_steps: Vec<u64>,
    workers: Vec<WorkerProgress>,
) -> Result<(), TrainError> {
    let global_step = shard_steps.iter().copied().max().unwrap_or(0);
    let m = Manifest {
        format_version: starwire_ps::checkpoint::FORMAT_VERSION,
        global_step,
        shard_count: plan.shards,
        seed: cfg.seed,
        model: model_json(cfg),
        shard_files,
        workers,
        shard_steps,
    };
    let json = m.to_json().map_err(|e| TrainError::Checkpoint {
        path: dir.to_owned(),
        reason: e.to_string(),
    })?;
    let path = dir.join("manifest.json");
    starwire_ps::write_atomic(&path, |w| {
        w.write_all(json.as_bytes())
            .map_err(starwire_ps::CheckpointError::from)
    })
    .map_err(|e| TrainError::Checkpoint {
        path,
        reason: e.to_string(),
    })
}

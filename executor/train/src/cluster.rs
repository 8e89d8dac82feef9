//! Placement, the local loopback cluster of `starwire train`, and the
//! single roles of `starwire ps` and `starwire worker`.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde::Serialize;
use starwire_data::{auc, logloss, Batch, SyntheticSpec, TrueModel};
use starwire_graph::{
    partition, Executor, Model, ModelKind, ModelSpec, Protocol, VarKind as GVarKind, VarSpec,
};
use starwire_ps::placement::{estimate, place_with, Location, PlaceOptions, PlacementReport};
use starwire_ps::{
    Manifest, OptimizerConfig, OptimizerKind, PsShard, ShardConfig, Strategy, VarDef, VarStats,
    WorkerProgress,
};
use starwire_transport::reactor::{IdlePolicy, Reactor, ReactorSpec};
use starwire_transport::{ConnConfig, PeerInfo, TaskRole};
use starwire_wire::ps::Control;

use crate::handler::{shard_file, ShardHandler};
use crate::link::{connect_shard, Acceptor, Backend, Binder, ShardInbox, Tcp};
use crate::net::{Exchange, SessionNet, Traffic};
use crate::server::PsReactor;
use crate::source::{DataSource, Reader};
use crate::worker::{control_all, Layout, WorkerCore};
use crate::TrainError;

/// Everything `starwire train` (and `ps` / `worker`) is configured with.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The transport backend.
    pub backend: BackendKind,
    /// PS tasks.
    pub ps: usize,
    /// Worker tasks.
    pub workers: usize,
    /// `star_server` or `star_server_lite`.
    pub protocol: Protocol,
    /// `lr` or `wdl`.
    pub model: ModelKind,
    /// Training data.
    pub train: DataSource,
    /// Evaluation data.
    pub eval: DataSource,
    /// Passes over the training data.
    pub epochs: u64,
    /// Cap on the total number of steps (all workers together).
    pub steps: Option<u64>,
    /// Examples per step per worker.
    pub batch_size: usize,
    /// Embedding width.
    pub embedding_dim: usize,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Learning rate.
    pub lr: f32,
    /// Placement strategy of whole variables.
    pub placement: Strategy,
    /// One fused pull and push per shard per step (`--tensor-fuse on`).
    pub tensor_fuse: bool,
    /// A barrier per step.
    pub sync: bool,
    /// Seed of the data, the initial values and annealing.
    pub seed: u64,
    /// Write a checkpoint here at the end; restore from it at start if one
    /// is there.
    pub checkpoint_dir: Option<PathBuf>,
    /// DeepRec `filter_freq` (0: off).
    pub filter_freq: u32,
    /// DeepRec `steps_to_live` (0: off).
    pub steps_to_live: u64,
    /// DeepRec `default_value_dim`: rows of each table's default value
    /// matrix (0: every key initialised by itself).
    pub default_value_dim: usize,
    /// Synthetic training examples per epoch.
    pub train_examples: u64,
    /// Evaluation examples (synthetic), or a cap on those read (Criteo).
    pub eval_examples: u64,
    /// Skip malformed Criteo lines instead of failing.
    pub skip_bad_lines: bool,
    /// Busy-poll on the workers (`WORKER_ENABLE_POLLING`).
    pub worker_polling: bool,
    /// Busy-poll on the PS reactors (`PS_ENABLE_POLLING`).
    pub ps_polling: bool,
    /// Reactors (shards) per PS task (`NETWORK_PS_CORE_NUMBER`).
    pub ps_reactors: usize,
    /// Pin PS reactors to cores (not `PS_DISABLE_PIN_CORES`).
    pub pin_ps: bool,
    /// Compute threads of each worker's graph executor (0: inline).
    pub compute_threads: usize,
    /// Print progress every this many steps of worker 0 (0: never).
    pub log_every: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            backend: BackendKind::Tcp,
            ps: 1,
            workers: 2,
            protocol: Protocol::StarServer,
            model: ModelKind::Lr,
            train: DataSource::Synthetic,
            eval: DataSource::Synthetic,
            epochs: 1,
            steps: None,
            batch_size: 512,
            embedding_dim: 8,
            optimizer: OptimizerKind::Adagrad,
            lr: 0.05,
            placement: Strategy::Greedy,
            tensor_fuse: true,
            sync: false,
            seed: 1,
            checkpoint_dir: None,
            filter_freq: 0,
            steps_to_live: 0,
            default_value_dim: starwire_ps::DEFAULT_VALUE_DIM,
            train_examples: SyntheticSpec::default().examples_per_epoch,
            eval_examples: 50_000,
            skip_bad_lines: false,
            worker_polling: false,
            ps_polling: false,
            ps_reactors: 1,
            pin_ps: false,
            compute_threads: 0,
            log_every: 0,
        }
    }
}

/// The transport a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// Non-blocking TCP sockets (always built).
    Tcp,
    /// No network: workers call the local cluster's shards directly (the
    /// compute bound; `starwire train` only).
    Inproc,
    /// io_uring (feature `uring`).
    #[cfg(all(feature = "uring", target_os = "linux"))]
    Uring,
    /// The gRPC baseline (feature `grpc`).
    #[cfg(feature = "grpc")]
    Grpc,
}

impl BackendKind {
    /// Every backend compiled in, by name.
    pub const ALL: &'static [(&'static str, BackendKind)] = &[
        ("tcp", BackendKind::Tcp),
        ("inproc", BackendKind::Inproc),
        #[cfg(all(feature = "uring", target_os = "linux"))]
        ("uring", BackendKind::Uring),
        #[cfg(feature = "grpc")]
        ("grpc", BackendKind::Grpc),
    ];

    /// The backend called `name`, if compiled in.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
    }
}

/// The DeepRec protocol name.
pub fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::StarServer => "star_server",
        Protocol::StarServerLite => "star_server_lite",
    }
}

/// The model name on the command line.
pub fn model_name(m: ModelKind) -> &'static str {
    match m {
        ModelKind::Lr => "lr",
        ModelKind::Wdl => "wdl",
    }
}

/// One progress interval (an epoch of worker 0).
#[derive(Debug, Clone, Serialize)]
pub struct Interval {
    /// Epoch that just ended.
    pub epoch: u64,
    /// Worker 0's steps so far.
    pub steps: u64,
    /// Worker 0's mean training loss over the interval.
    pub train_loss: f64,
    /// Eval AUC (on up to 20k eval examples).
    pub auc: f64,
    /// Eval logloss.
    pub logloss: f64,
}

/// The outcome of a training run (`--json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    /// Backend name.
    pub backend: String,
    /// DeepRec protocol name.
    pub protocol: String,
    /// Model name.
    pub model: String,
    /// PS tasks.
    pub ps: usize,
    /// Shards (PS tasks × reactors).
    pub shards: usize,
    /// Workers.
    pub workers: usize,
    /// Fusion on.
    pub tensor_fuse: bool,
    /// Synchronous training.
    pub sync: bool,
    /// Steps run, all workers together.
    pub steps: u64,
    /// Examples trained on.
    pub samples: u64,
    /// Training wall time in seconds (from the first step to the last push).
    pub train_seconds: f64,
    /// Aggregate training throughput.
    pub samples_per_s: f64,
    /// Eval AUC at the end.
    pub auc: f64,
    /// Eval logloss at the end.
    pub logloss: f64,
    /// AUC of the true model on the eval set (synthetic eval only).
    pub oracle_auc: Option<f64>,
    /// Eval examples.
    pub eval_examples: u64,
    /// Request and reply body bytes per step, averaged over workers' steps.
    pub bytes_per_step: f64,
    /// Requests per step, averaged.
    pub requests_per_step: f64,
    /// Mean training loss over the last interval of worker 0.
    pub final_train_loss: f64,
    /// Per-interval metrics.
    pub intervals: Vec<Interval>,
    /// The placement of the variables on PS tasks.
    pub placement: PlacementReport,
    /// Lines skipped as bad (Criteo with `--skip-bad-lines`).
    pub skipped_lines: u64,
    /// The checkpoint written, if any.
    pub checkpoint: Option<PathBuf>,
    /// The step the run resumed from (a restored checkpoint), if any.
    pub resumed_from_step: Option<u64>,
    /// Per-shard counters.
    pub shard_stats: Vec<serde_json::Value>,
}

/// What every task of a cluster computes identically from the
/// configuration: the model, where each variable lives, and the
/// variables each shard holds.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The model.
    pub model: Model,
    /// The true model of the synthetic data (shared by train and eval).
    pub truth: Arc<TrueModel>,
    /// Shards of the cluster.
    pub shards: usize,
    /// Variables of each shard.
    pub shard_vars: Vec<Vec<VarDef>>,
    /// The worker's view.
    pub layout: Layout,
    /// The PS-level placement report.
    pub report: PlacementReport,
    /// The estimates placement worked from.
    pub stats: Vec<VarStats>,
}

fn to_def(v: &VarSpec) -> VarDef {
    use starwire_graph::Init as G;
    use starwire_ps::{Init as P, VarKind as K};
    VarDef {
        id: v.id.0,
        name: v.name.clone(),
        kind: match &v.kind {
            GVarKind::Dense { shape } => K::Dense {
                shape: shape.clone(),
            },
            GVarKind::Embedding { dim } => K::Embedding { dim: *dim },
        },
        init: match v.init {
            G::Zeros => P::Zeros,
            G::Uniform { scale } => P::Uniform { scale },
            G::Normal { std } => P::Normal { std },
            G::GlorotUniform => P::GlorotUniform,
        },
    }
}

fn slots(k: OptimizerKind) -> usize {
    match k {
        OptimizerKind::Sgd => 0,
        OptimizerKind::Adagrad => 1,
        OptimizerKind::Adam => 2,
    }
}

/// Examples read to estimate table sizes and traffic for placement.
pub const PLACEMENT_SAMPLE: usize = 20_000;

fn synthetic_spec(cfg: &TrainConfig) -> SyntheticSpec {
    SyntheticSpec {
        seed: cfg.seed,
        examples_per_epoch: cfg.train_examples,
        ..SyntheticSpec::default()
    }
}

/// Size and expected-traffic estimates of every variable, from the key
/// counts of a sample of `n` examples.
fn var_stats(
    cfg: &TrainConfig,
    model: &Model,
    counts: &HashMap<u32, HashMap<u64, u64>>,
    n: usize,
) -> Vec<VarStats> {
    let s = slots(cfg.optimizer);
    model
        .variables()
        .iter()
        .map(|v| match &v.kind {
            GVarKind::Embedding { dim } => {
                // Sorted: a float sum in hash-map order would differ between
                // processes, and every task must compute the same placement.
                let mut c: Vec<u64> = counts
                    .get(&v.id.0)
                    .map(|m| m.values().copied().collect())
                    .unwrap_or_default();
                c.sort_unstable();
                VarStats {
                    id: v.id.0,
                    name: v.name.clone(),
                    embedding: true,
                    bytes: estimate::table_bytes(c.len() as u64, *dim, s),
                    expected_requests: estimate::table_requests(
                        &c,
                        n as u64,
                        cfg.batch_size as u64,
                    ),
                }
            }
            GVarKind::Dense { shape } => VarStats {
                id: v.id.0,
                name: v.name.clone(),
                embedding: false,
                bytes: estimate::dense_bytes(shape.iter().product(), s),
                expected_requests: 1.0,
            },
        })
        .collect()
}

/// How large a table must be to be sharded over every PS: more than half
/// a PS's fair share of the bytes (every table with one PS).
pub fn shard_threshold(stats: &[VarStats], ps: usize) -> u64 {
    let total: u64 = stats.iter().map(|v| v.bytes).sum();
    if ps <= 1 {
        0
    } else {
        total / (2 * ps as u64)
    }
}

/// Build the model and place its variables.
pub fn plan(cfg: &TrainConfig) -> Result<Plan, TrainError> {
    if cfg.ps == 0 || cfg.workers == 0 || cfg.batch_size == 0 || cfg.embedding_dim == 0 {
        return Err(TrainError::Config(
            "--ps, --workers, --batch-size and --embedding-dim must be at least 1".into(),
        ));
    }
    let spec = match cfg.model {
        ModelKind::Lr => ModelSpec::lr(cfg.embedding_dim),
        ModelKind::Wdl => ModelSpec::wdl(cfg.embedding_dim),
    };
    let model = Model::build(spec).map_err(|e| TrainError::Internal(e.to_string()))?;
    let truth = Arc::new(TrueModel::new(synthetic_spec(cfg))?);

    // Key counts per variable from a sample of the training data.
    let mut reader = Reader::train(&cfg.train, &truth, cfg.train_examples, 0, 1, true)?;
    let mut batch = Batch::with_capacity(PLACEMENT_SAMPLE);
    let n = reader.next_batch(PLACEMENT_SAMPLE, &mut batch)?;
    let nf = model.spec().num_fields;
    let mut counts: HashMap<u32, HashMap<u64, u64>> = HashMap::new();
    for l in model.lookups() {
        let c = counts.entry(l.var.0).or_default();
        for b in 0..n {
            for &f in &l.fields {
                let k = batch.keys[b * nf + f];
                if k != starwire_data::MISSING_KEY {
                    *c.entry(k).or_default() += 1;
                }
            }
        }
    }
    let stats = var_stats(cfg, &model, &counts, n);
    // "Large" tables are sharded over every PS by key: those that would by
    // themselves hold more than half a PS's fair share of the bytes.
    let threshold = shard_threshold(&stats, cfg.ps);
    let placement = place_with(
        &stats,
        cfg.ps,
        cfg.placement,
        &PlaceOptions {
            shard_threshold_bytes: threshold,
        },
    );
    let report = placement.report();

    let r = cfg.ps_reactors.max(1);
    let shards = cfg.ps * r;
    let mut shard_vars: Vec<Vec<VarDef>> = vec![Vec::new(); shards];
    let mut home_shard = vec![None; model.variables().len()];
    let mut next_on_ps = vec![0usize; cfg.ps];
    for v in model.variables() {
        let def = to_def(v);
        match placement.location(v.id.0) {
            Some(Location::Ps(p)) => {
                let s = p * r + next_on_ps[p] % r;
                next_on_ps[p] += 1;
                // A dense variable, or a table small enough to live whole on
                // one shard: the worker routes all its keys there.
                home_shard[v.id.0 as usize] = Some(s);
                shard_vars[s].push(def);
            }
            Some(Location::Sharded) | None => {
                for sv in &mut shard_vars {
                    sv.push(def.clone());
                }
            }
        }
    }
    let layout = Layout {
        shards,
        home_shard,
        num_dense: model.spec().num_dense,
        num_fields: nf,
    };
    Ok(Plan {
        model,
        truth,
        shards,
        shard_vars,
        layout,
        report,
        stats,
    })
}

fn shard_config(cfg: &TrainConfig) -> ShardConfig {
    ShardConfig {
        seed: cfg.seed,
        optimizer: OptimizerConfig::with_kind(cfg.optimizer, cfg.lr),
        filter_freq: cfg.filter_freq,
        steps_to_live: cfg.steps_to_live,
        default_value_dim: cfg.default_value_dim,
        ..ShardConfig::default()
    }
}

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

/// A running PS task: its acceptor and one reactor per shard.
#[derive(Debug)]
pub struct PsTask<K: Backend> {
    acceptor: Acceptor,
    reactors: Vec<Reactor<PsReactor<ShardHandler, K::B>>>,
}

impl<K: Backend> PsTask<K> {
    /// Where workers connect.
    pub fn addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }

    /// Wait for every shard to finish (every expected worker said `DONE`)
    /// and return the shards' counters.
    pub fn join(self) -> Result<Vec<serde_json::Value>, TrainError> {
        let PsTask { acceptor, reactors } = self;
        let mut out = Vec::new();
        for r in reactors {
            let (shard, _) = r
                .join()
                .map_err(|e| TrainError::Internal(format!("PS reactor: {e}")))?;
            out.push(crate::psserver::PsHandler::stats(shard.handler()));
        }
        drop(acceptor);
        Ok(out)
    }
}

/// Shard `s` of the plan as a reactor (or a lock) serves it, restored
/// from the checkpoint in `restore` if given.
pub(crate) fn shard_handler(
    cfg: &TrainConfig,
    plan: &Plan,
    s: usize,
    restore: Option<&Path>,
) -> Result<ShardHandler, TrainError> {
    Ok(ShardHandler {
        shard: make_shard(cfg, plan, s, restore)?,
        index: s,
        checkpoint_dir: cfg.checkpoint_dir.clone(),
    })
}

/// Shard `s` of the plan, restored from the checkpoint in `restore` if
/// given.
pub fn make_shard(
    cfg: &TrainConfig,
    plan: &Plan,
    s: usize,
    restore: Option<&Path>,
) -> Result<PsShard, TrainError> {
    let mut shard = PsShard::new(s, &plan.shard_vars[s], shard_config(cfg));
    if let Some(dir) = restore {
        let path = dir.join(shard_file(s));
        let ck = |reason: String| TrainError::Checkpoint {
            path: path.clone(),
            reason,
        };
        let mut f = std::fs::File::open(&path).map_err(|e| ck(e.to_string()))?;
        shard.restore(&mut f).map_err(|e| ck(e.to_string()))?;
    }
    Ok(shard)
}

/// A PS task as the local cluster drives it, whatever its backend.
pub trait RunningPs {
    /// Where workers connect.
    fn addr(&self) -> SocketAddr;
    /// Wait until every expected worker is done; the shards' counters.
    fn join(self: Box<Self>) -> Result<Vec<serde_json::Value>, TrainError>;
    /// Stop at once (a run that failed).
    fn stop(self: Box<Self>);
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
}

/// A worker's connections to every shard, whatever the backend.
pub trait WorkerNet: Exchange {
    /// Close every connection politely.
    fn close(&mut self);
}

impl<T: crate::link::LinkTransport> WorkerNet for SessionNet<T> {
    fn close(&mut self) {
        SessionNet::close(self);
    }
}

/// How the local cluster starts a PS task and connects a worker on one
/// backend.
pub trait ClusterBackend: Sync {
    /// The name in reports.
    fn name(&self) -> &'static str;
    /// Start PS task `p` on `listener` (see [`start_ps`]).
    fn start_ps(
        &self,
        cfg: &TrainConfig,
        plan: &Plan,
        p: usize,
        listener: TcpListener,
        expected: usize,
        restore: Option<&Path>,
    ) -> Result<Box<dyn RunningPs>, TrainError>;
    /// Connect worker (or evaluator) `index` to every shard.
    fn connect(
        &self,
        cfg: &TrainConfig,
        ps_addrs: &[String],
        index: u32,
        shards: usize,
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
    ) -> Result<Box<dyn RunningPs>, TrainError> {
        Ok(Box::new(start_ps::<K>(
            cfg, plan, p, listener, expected, restore,
        )?))
    }
    fn connect(
        &self,
        cfg: &TrainConfig,
        ps_addrs: &[String],
        index: u32,
        shards: usize,
    ) -> Result<Box<dyn WorkerNet>, TrainError> {
        Ok(Box::new(connect::<K>(cfg, ps_addrs, index, shards)?))
    }
}

fn cluster_backend(b: BackendKind) -> Box<dyn ClusterBackend> {
    match b {
        BackendKind::Tcp => Box::new(Sessions::<Tcp>::default()),
        BackendKind::Inproc => Box::new(crate::inproc::Inproc),
        #[cfg(all(feature = "uring", target_os = "linux"))]
        BackendKind::Uring => Box::new(Sessions::<crate::link::Uring>::default()),
        #[cfg(feature = "grpc")]
        BackendKind::Grpc => Box::new(crate::grpc::Grpc),
    }
}

/// Start PS task `ps_index` of the plan on `listener`; its shards finish
/// after `expected` workers have said `DONE`. Restores the shards from
/// `restore` if given.
pub fn start_ps<K: Backend>(
    cfg: &TrainConfig,
    plan: &Plan,
    ps_index: usize,
    listener: TcpListener,
    expected: usize,
    restore: Option<&Path>,
) -> Result<PsTask<K>, TrainError> {
    let r = cfg.ps_reactors.max(1);
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut reactors = Vec::with_capacity(r);
    let mut inboxes = Vec::with_capacity(r);
    for local in 0..r {
        let s = ps_index * r + local;
        let handler = shard_handler(cfg, plan, s, restore)?;
        let (tx, rx) = mpsc::channel();
        let conn_cfg = ConnConfig::new(peer(TaskRole::Ps, ps_index as u32, r as u16));
        let spec = ReactorSpec {
            index: s,
            cpu: cfg.pin_ps.then_some(local % ncpu),
            idle: if cfg.ps_polling {
                IdlePolicy::PollThenPark(Duration::from_millis(5))
            } else {
                IdlePolicy::Park
            },
            max_park: Duration::from_millis(100),
        };
        // The binder (an io_uring ring) is made on the reactor's own thread;
        // the first connection reports a failure to make it.
        let (btx, brx) = mpsc::sync_channel(1);
        let polling = cfg.ps_polling;
        let reactor = Reactor::spawn(spec, move |_| {
            let binder = K::binder(polling);
            let ok = binder.as_ref().map(|_| ()).map_err(|e| e.to_string());
            let _ = btx.send(ok);
            PsReactor::new(s, handler, conn_cfg, binder.ok(), rx, expected)
        })
        .map_err(|e| TrainError::Internal(format!("starting PS reactor: {e}")))?;
        brx.recv()
            .map_err(|_| TrainError::Internal("PS reactor died while starting".into()))?
            .map_err(|e| TrainError::Backend(K::NAME, e))?;
        inboxes.push(ShardInbox {
            tx,
            waker: reactor.waker(),
        });
        reactors.push(reactor);
    }
    let acceptor = Acceptor::spawn(listener, inboxes)?;
    Ok(PsTask { acceptor, reactors })
}

/// Connect a worker (or the evaluator) to every shard of the cluster.
pub fn connect<K: Backend>(
    cfg: &TrainConfig,
    ps_addrs: &[String],
    index: u32,
    shards: usize,
) -> Result<SessionNet<<K::B as Binder>::Link>, TrainError> {
    let r = cfg.ps_reactors.max(1);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ts = Vec::with_capacity(shards);
    for s in 0..shards {
        let (p, local) = (s / r, s % r);
        let addr = ps_addrs
            .get(p)
            .ok_or_else(|| TrainError::Config(format!("no address for PS {p}")))?;
        ts.push(connect_shard(addr, local as u32, deadline)?);
    }
    let mut binder =
        K::binder(cfg.worker_polling).map_err(|e| TrainError::Backend(K::NAME, e.to_string()))?;
    let ts = ts
        .into_iter()
        .map(|s| binder.bind(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TrainError::Backend(K::NAME, e.to_string()))?;
    let cc = ConnConfig::new(peer(TaskRole::Worker, index, 1));
    SessionNet::new(&cc, ts, cfg.worker_polling, Duration::from_secs(120))
}

/// What one worker did.
#[derive(Debug, Clone, Default)]
pub struct WorkerOutcome {
    /// Steps run in this session.
    pub steps: u64,
    /// Examples trained on.
    pub samples: u64,
    /// Traffic.
    pub traffic: Traffic,
    /// Progress for a checkpoint.
    pub progress: Option<WorkerProgress>,
    /// Intervals (worker 0 only).
    pub intervals: Vec<Interval>,
    /// Loss of the last interval.
    pub last_loss: f64,
    /// Bad lines skipped.
    pub skipped: u64,
    /// When training ended.
    pub end: Option<Instant>,
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

/// Worker `w`'s total step cap from `--steps N`: N split as evenly as
/// possible, so the workers together run exactly N.
fn step_cap(cfg: &TrainConfig, w: usize) -> Option<u64> {
    let n = cfg.workers as u64;
    cfg.steps.map(|s| s / n + u64::from((w as u64) < s % n))
}

/// Examples in one epoch of the training data: known for the generator,
/// counted (one line per example) for a file.
fn epoch_examples(cfg: &TrainConfig) -> Result<u64, TrainError> {
    match &cfg.train {
        DataSource::Synthetic => Ok(cfg.train_examples),
        DataSource::Criteo(p) => {
            use std::io::Read;
            let mut f = std::fs::File::open(p).map_err(|e| {
                TrainError::Data(starwire_data::DataError::Open {
                    path: p.clone(),
                    source: e,
                })
            })?;
            let mut buf = vec![0u8; 1 << 20];
            let (mut lines, mut last) = (0u64, b'\n');
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
                last = buf[n - 1];
            }
            Ok(lines + u64::from(last != b'\n'))
        }
    }
}

/// With `--sync`, every worker runs the same number of steps per epoch (a
/// barrier waits for all of them): the batches of the smallest share.
fn sync_epoch_steps(cfg: &TrainConfig) -> Result<Option<u64>, TrainError> {
    if !cfg.sync {
        return Ok(None);
    }
    let min_share = epoch_examples(cfg)? / cfg.workers as u64;
    if min_share == 0 {
        return Err(TrainError::Config(format!(
            "--sync with {} workers needs at least one example per worker",
            cfg.workers
        )));
    }
    Ok(Some(min_share.div_ceil(cfg.batch_size as u64)))
}

/// Run worker `w` of the cluster until its data (or step cap) is done.
#[allow(clippy::too_many_arguments)]
pub fn worker_loop(
    cfg: &TrainConfig,
    plan: &Plan,
    w: usize,
    net: &mut dyn Exchange,
    start: Option<&Barrier>,
    resume: Option<&WorkerProgress>,
    eval_batches: Option<&[Batch]>,
) -> Result<WorkerOutcome, TrainError> {
    let part = partition(&plan.model, cfg.protocol);
    let mut core = WorkerCore::new(
        part,
        plan.layout.clone(),
        cfg.tensor_fuse,
        Executor::new(cfg.compute_threads),
    );
    let mut reader = Reader::train(
        &cfg.train,
        &plan.truth,
        cfg.train_examples,
        w,
        cfg.workers,
        cfg.skip_bad_lines,
    )?;
    let cap = step_cap(cfg, w);
    let epoch_cap = sync_epoch_steps(cfg)?;
    let mut batch = Batch::with_capacity(cfg.batch_size);
    let mut out = WorkerOutcome::default();
    let (mut epoch, mut offset, mut steps_done) = (0u64, 0u64, 0u64);
    let mut resumed_in_epoch = 0u64;
    if let Some(p) = resume {
        epoch = p.epoch;
        steps_done = p.steps;
        // Skip what this worker had consumed of the resumed epoch.
        let mut skipped = 0u64;
        while skipped < p.offset {
            let want = (p.offset - skipped).min(cfg.batch_size as u64) as usize;
            let n = reader.next_batch(want, &mut batch)?;
            if n == 0 {
                break;
            }
            skipped += n as u64;
        }
        offset = skipped;
        resumed_in_epoch = skipped.div_ceil(cfg.batch_size as u64);
    }
    if let Some(b) = start {
        b.wait();
    }
    let t0 = Instant::now();
    let mut loss_sum = 0.0f64;
    let mut loss_n = 0u64;
    let w_count = cfg.workers as u64;
    'epochs: while epoch < cfg.epochs {
        let mut in_epoch = std::mem::take(&mut resumed_in_epoch);
        loop {
            if cap.is_some_and(|c| steps_done >= c) {
                break 'epochs;
            }
            if epoch_cap.is_some_and(|c| in_epoch >= c) {
                break;
            }
            in_epoch += 1;
            let n = reader.next_batch(cfg.batch_size, &mut batch)?;
            if n == 0 {
                break;
            }
            let info = core.step(net, &batch)?;
            offset += n as u64;
            steps_done += 1;
            out.steps += 1;
            out.samples += n as u64;
            loss_sum += f64::from(info.loss);
            loss_n += 1;
            if cfg.sync {
                core.flush(net)?;
                core.barrier(net, steps_done * w_count)?;
            }
            if w == 0 && cfg.log_every > 0 && steps_done % cfg.log_every == 0 {
                let secs = t0.elapsed().as_secs_f64();
                eprintln!(
                    "worker 0: step {steps_done:>7}  epoch {epoch}  loss {:.4}  global step {}  {:.0} samples/s (this worker)",
                    loss_sum / loss_n.max(1) as f64,
                    core.global_step(),
                    out.samples as f64 / secs.max(1e-9),
                );
            }
        }
        epoch += 1;
        offset = 0;
        out.last_loss = loss_sum / loss_n.max(1) as f64;
        if w == 0 && epoch < cfg.epochs {
            if let Some(eb) = eval_batches {
                core.flush(net)?;
                let (a, l) = evaluate(&mut core, net, eb)?;
                if cfg.log_every > 0 {
                    eprintln!(
                        "worker 0: epoch {epoch} done: train loss {:.4}  eval auc {a:.4}  logloss {l:.4}",
                        out.last_loss
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
        reader.rewind()?;
    }
    core.flush(net)?;
    out.end = Some(Instant::now());
    if loss_n > 0 {
        out.last_loss = loss_sum / loss_n as f64;
    }
    out.traffic = net.traffic();
    out.skipped = reader.skipped();
    out.progress = Some(WorkerProgress {
        worker: w as u32,
        epoch,
        offset,
        steps: steps_done,
    });
    Ok(out)
}

fn read_manifest(dir: &Path) -> Result<Option<Manifest>, TrainError> {
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
fn write_checkpoint(
    core: &mut WorkerCore,
    net: &mut dyn Exchange,
    cfg: &TrainConfig,
    plan: &Plan,
    dir: &Path,
    workers: Vec<WorkerProgress>,
) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir)?;
    let d = dir.to_str().ok_or_else(|| TrainError::Checkpoint {
        path: dir.to_owned(),
        reason: "path is not UTF-8".into(),
    })?;
    core.control(net, &Control::Checkpoint(d))?;
    // Every shard's global step (WAIT_STEP(0) answers at once).
    let global_step = core
        .control(net, &Control::WaitStep(0))?
        .iter()
        .filter_map(|b| b.as_slice().try_into().ok().map(u64::from_le_bytes))
        .max()
        .unwrap_or(0);
    let m = Manifest {
        format_version: starwire_ps::checkpoint::FORMAT_VERSION,
        global_step,
        shard_count: plan.shards,
        seed: cfg.seed,
        model: model_json(cfg),
        shard_files: (0..plan.shards).map(shard_file).collect(),
        workers,
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

/// `starwire train` without cluster flags: PS tasks and workers as threads
/// of this process over loopback, then an evaluation.
pub fn run_local(cfg: &TrainConfig) -> Result<TrainReport, TrainError> {
    run_local_on(&*cluster_backend(cfg.backend), cfg)
}

fn run_local_on(k: &dyn ClusterBackend, cfg: &TrainConfig) -> Result<TrainReport, TrainError> {
    let plan = plan(cfg)?;
    let manifest = match &cfg.checkpoint_dir {
        Some(d) => read_manifest(d)?,
        None => None,
    };
    if let Some(m) = &manifest {
        if m.shard_count != plan.shards {
            return Err(TrainError::Config(format!(
                "the checkpoint has {} shards, this cluster {}; use the same --ps and NETWORK_PS_CORE_NUMBER",
                m.shard_count, plan.shards
            )));
        }
    }
    let restore = manifest.as_ref().and(cfg.checkpoint_dir.as_deref());
    // Workers plus the evaluator say DONE to every shard.
    let expected = cfg.workers + 1;
    let mut tasks = Vec::with_capacity(cfg.ps);
    for p in 0..cfg.ps {
        let l = TcpListener::bind("127.0.0.1:0")?;
        tasks.push(k.start_ps(cfg, &plan, p, l, expected, restore)?);
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
    let start = Barrier::new(cfg.workers + 1);
    let (t_start, outcomes): (Instant, Vec<Result<WorkerOutcome, TrainError>>) =
        std::thread::scope(|sc| {
            let mut hs = Vec::new();
            for w in 0..cfg.workers {
                let (plan, addrs, start, ev) = (&plan, &addrs, &start, &eval_interval);
                let resume = manifest
                    .as_ref()
                    .and_then(|m| m.workers.iter().find(|p| p.worker as usize == w).cloned());
                hs.push(
                    std::thread::Builder::new()
                        .name(format!("starwire-worker-{w}"))
                        .spawn_scoped(sc, move || {
                            let mut net = match k.connect(cfg, addrs, w as u32, plan.shards) {
                                Ok(n) => n,
                                Err(e) => {
                                    start.wait();
                                    return Err(e);
                                }
                            };
                            let r = worker_loop(
                                cfg,
                                plan,
                                w,
                                &mut *net,
                                Some(start),
                                resume.as_ref(),
                                Some(ev),
                            );
                            let _ = control_all(&mut *net, plan.shards, &Control::Done);
                            net.close();
                            r
                        }),
                );
            }
            start.wait();
            let t0 = Instant::now();
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
    for o in outcomes {
        match o {
            Ok(o) => outs.push(o),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        // A worker failed: stop the PS tasks instead of waiting for a DONE
        // that will not come.
        for t in tasks {
            t.stop();
        }
        return Err(e);
    }
    // The evaluator: its own connections, after every worker has pushed.
    let mut net = k.connect(cfg, &addrs, cfg.workers as u32, plan.shards)?;
    let mut core = WorkerCore::new(
        partition(&plan.model, cfg.protocol),
        plan.layout.clone(),
        cfg.tensor_fuse,
        Executor::new(cfg.compute_threads),
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
        steps,
        samples,
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
        placement: plan.report.clone(),
        skipped_lines: outs.iter().map(|o| o.skipped).sum(),
        checkpoint: ckpt,
        resumed_from_step: manifest.map(|m| m.global_step),
        shard_stats,
    })
}

/// A task of a cluster across processes needs a network backend.
fn across_processes(b: BackendKind) -> Result<(), TrainError> {
    if b == BackendKind::Inproc {
        return Err(TrainError::Config(
            "--backend inproc has no network: it runs only in `starwire train` (the local \
             cluster); `starwire ps` and `starwire worker` need tcp, uring or grpc"
                .into(),
        ));
    }
    Ok(())
}

/// `starwire ps`: serve PS task `index` on `bind` until every one of the
/// `cfg.workers` workers has said `DONE`; returns the shards' counters.
/// Restores from `--checkpoint-dir` when it holds a checkpoint.
pub fn run_ps_task(
    cfg: &TrainConfig,
    index: usize,
    bind: SocketAddr,
) -> Result<Vec<serde_json::Value>, TrainError> {
    across_processes(cfg.backend)?;
    let k = cluster_backend(cfg.backend);
    let plan = plan(cfg)?;
    let restore = match &cfg.checkpoint_dir {
        Some(d) => read_manifest(d)?.map(|_| d.as_path()),
        None => None,
    };
    let l = TcpListener::bind(bind)?;
    let task = k.start_ps(cfg, &plan, index, l, cfg.workers, restore)?;
    eprintln!(
        "starwire ps {index}: serving {} shard(s) on {}",
        cfg.ps_reactors.max(1),
        task.addr()
    );
    task.join()
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
    let mut net = k.connect(cfg, ps_addrs, index as u32, plan.shards)?;
    let eval_all = if index == 0 {
        load_eval(cfg, &plan.truth, cfg.eval_examples)?
    } else {
        Vec::new()
    };
    let t0 = Instant::now();
    let out = worker_loop(cfg, &plan, index, &mut *net, None, resume.as_ref(), None)?;
    let train_seconds = out
        .end
        .map_or(0.0, |e| e.saturating_duration_since(t0).as_secs_f64());
    let mut core = WorkerCore::new(
        partition(&plan.model, cfg.protocol),
        plan.layout.clone(),
        cfg.tensor_fuse,
        Executor::new(cfg.compute_threads),
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
        steps: out.steps,
        samples: out.samples,
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
        placement: plan.report,
        skipped_lines: out.skipped,
        checkpoint: ckpt,
        resumed_from_step: manifest.map(|m| m.global_step),
        shard_stats,
    })
}

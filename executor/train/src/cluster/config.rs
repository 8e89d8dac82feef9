//! What a run is configured with: [`TrainConfig`], the backend, and the
//! checks and conversions every role applies to it.

use std::path::PathBuf;
use std::time::Duration;

use starwire_data::SyntheticSpec;
use starwire_graph::{ModelKind, Protocol};
use starwire_ps::{OptimizerConfig, OptimizerKind, ShardConfig, Strategy};
use starwire_telemetry::Telemetry;

use crate::source::DataSource;
use crate::TrainError;

/// The default of [`TrainConfig::connect_timeout`]: long enough for a
/// launcher to schedule and start every pod of a cluster.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(300);

/// `--prefetch` when it is not given, for `local_workers` workers on this
/// host: one batch ahead where a worker waits on a network for its PS and
/// the host has a CPU for each worker, so the reading fills the worker's
/// waits; none with `inproc` (the PS runs on the worker's thread: it
/// never waits) or with more workers than CPUs (no core is idle to read
/// in; a thread more per worker only adds switches). Measured in
/// docs/TRAIN.md ("Reading ahead").
pub fn default_prefetch(backend: BackendKind, local_workers: usize) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    usize::from(backend != BackendKind::Inproc && local_workers <= cpus)
}

/// How the learning rate of each push scales with the number of workers
/// `W` (`--lr-scaling`). Asynchronous pushes are applied one by one, each
/// on values up to `W - 1` other workers' steps old, so many workers need a
/// smaller rate per push.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LrScaling {
    /// `--lr` as given.
    None,
    /// `--lr / sqrt(W)`.
    Sqrt,
    /// `--lr / W`.
    Linear,
}

impl LrScaling {
    /// Every rule with its command-line name.
    pub const ALL: [(&'static str, LrScaling); 3] = [
        ("none", LrScaling::None),
        ("sqrt", LrScaling::Sqrt),
        ("linear", LrScaling::Linear),
    ];

    /// The factor applied to `--lr` with `workers` workers.
    pub fn factor(self, workers: usize) -> f32 {
        let w = workers.max(1) as f32;
        match self {
            LrScaling::None => 1.0,
            LrScaling::Sqrt => 1.0 / w.sqrt(),
            LrScaling::Linear => 1.0 / w,
        }
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            LrScaling::None => "none",
            LrScaling::Sqrt => "sqrt",
            LrScaling::Linear => "linear",
        }
    }
}

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
    /// How the rate of each push is scaled with the number of workers.
    pub lr_scaling: LrScaling,
    /// Global steps of linear learning-rate warm-up (0: none).
    pub lr_warmup_steps: u64,
    /// The optimizer's other hyper-parameters (FTRL's `beta`, `l1`, `l2`;
    /// AdagradDecay's decay step and rate); its `kind` and `lr` are taken
    /// from `optimizer` and `lr`.
    pub optimizer_params: OptimizerConfig,
    /// How whole variables are assigned to PS tasks (`--placement`).
    pub assignment: Strategy,
    /// One fused pull and push per shard per step (`--tensor-fuse on`).
    pub tensor_fuse: bool,
    /// A barrier per step.
    pub sync: bool,
    /// Asynchronous steps taken in turn, at most this many plus one in
    /// flight (`--bounded-delay`; none: no bound; see `delay.rs`).
    pub bounded_delay: Option<u64>,
    /// Steps each worker takes in a row in the bounded order
    /// (`--turn-steps`; `None`: 1, which the local cluster replaces with
    /// [`default_turn_steps`](super::default_turn_steps)). Every task of a
    /// cluster must have the same (the handshake compares it when given).
    pub turn_steps: Option<u64>,
    /// Seed of the data, the initial values and annealing.
    pub seed: u64,
    /// Write a checkpoint here at the end; restore from it at start if one
    /// is there.
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint during the run, at every global step that is a
    /// multiple of this (`--checkpoint-every-steps`).
    pub checkpoint_every_steps: Option<u64>,
    /// Also checkpoint during the run when this long has passed since the
    /// last one (`--checkpoint-every-secs`): with `sync` at the next
    /// global step worker 0 reaches, without at the next one shard 0
    /// decides at the workers' votes.
    pub checkpoint_every_secs: Option<std::time::Duration>,
    /// Each shard also writes an incremental checkpoint (the rows touched
    /// since its last full one) at every global step that is a multiple of
    /// this (`--delta-every-steps`; needs `checkpoint_dir`).
    pub delta_every_steps: Option<u64>,
    /// DeepRec `filter_freq` (0: off).
    pub filter_freq: u32,
    /// Keys each shard's frequency filter counts per table at once
    /// (`--filter-capacity`).
    pub filter_capacity: usize,
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
    /// `ps_reactors` is the variable's default, which the local cluster
    /// cuts down to the host's CPUs ([`fit_local_host`](super::fit_local_host)).
    pub ps_reactors_fit_host: bool,
    /// Workers hand their requests to network reactors through the M:N
    /// queue (`--worker-handoff on`) instead of turning their connections
    /// on the worker thread.
    pub worker_handoff: bool,
    /// Network reactors per worker with the hand-off
    /// (`NETWORK_WORKER_CORE_NUMBER`; at most one per shard).
    pub worker_reactors: usize,
    /// Pin PS reactors to cores (not `PS_DISABLE_PIN_CORES`).
    pub pin_ps: bool,
    /// Pin each worker's network threads to cores (not
    /// `WORKER_DISABLE_PIN_CORES`).
    pub pin_workers: bool,
    /// How long a polling PS reactor polls when idle before it parks, in
    /// µs; 0 polls forever (`STARWIRE_IDLE_POLL_US`).
    pub idle_poll_us: u64,
    /// Pinned reactors take the cores near this NIC first (`--device`).
    pub device: Option<String>,
    /// Compute threads of each worker's graph executor (0: inline).
    pub compute_threads: usize,
    /// Batches each worker reads ahead on a thread of its own while it
    /// waits for the PS (`--prefetch`; 0: read between steps; `None`:
    /// [`default_prefetch`] for the workers of this process).
    pub prefetch: Option<usize>,
    /// How long a worker keeps trying to reach each PS (name lookup and
    /// connect, with backoff) before it gives up (`--connect-timeout`).
    pub connect_timeout: Duration,
    /// Log progress every this many steps of each worker and global steps
    /// of each shard (0: never).
    pub log_every: u64,
    /// Where the PS shards and workers publish their live counters.
    pub telemetry: Telemetry,
    /// The cluster token and a PS task's bounds.
    pub guard: super::guard::Guard,
    /// Each PS shard faults its tables' reserved rows in from its start
    /// rather than from their first rows ([`starwire_ps::PsShard::reserve_rows`]):
    /// set by the local cluster of `starwire train`, whose workers are
    /// sure to come. A PS task of its own (`starwire ps`) leaves it off,
    /// so a PS no worker trains holds no memory for rows.
    pub reserve_at_start: bool,
}

impl TrainConfig {
    /// Checkpoints are taken during the run (`--checkpoint-every-steps` or
    /// `--checkpoint-every-secs`), not only at its end.
    pub fn checkpoints_during_run(&self) -> bool {
        self.checkpoint_every_steps.is_some() || self.checkpoint_every_secs.is_some()
    }
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
            lr_scaling: LrScaling::None,
            lr_warmup_steps: 0,
            optimizer_params: OptimizerConfig::adagrad(0.05),
            assignment: Strategy::Greedy,
            tensor_fuse: true,
            sync: false,
            bounded_delay: None,
            turn_steps: None,
            seed: 1,
            checkpoint_dir: None,
            checkpoint_every_steps: None,
            checkpoint_every_secs: None,
            delta_every_steps: None,
            filter_freq: 0,
            filter_capacity: starwire_ps::TablePolicy::default().filter_capacity,
            steps_to_live: 0,
            default_value_dim: starwire_ps::DEFAULT_VALUE_DIM,
            train_examples: SyntheticSpec::default().examples_per_epoch,
            eval_examples: 50_000,
            skip_bad_lines: false,
            worker_polling: false,
            ps_polling: false,
            ps_reactors: 1,
            ps_reactors_fit_host: false,
            worker_handoff: false,
            worker_reactors: 1,
            pin_ps: false,
            pin_workers: false,
            idle_poll_us: 0,
            device: None,
            compute_threads: 0,
            prefetch: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            log_every: 0,
            telemetry: Telemetry::default(),
            guard: super::guard::Guard::default(),
            reserve_at_start: false,
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
    /// RDMA verbs (feature `verbs`; the device set with
    /// [`set_verbs_device`](crate::backend::set_verbs_device)).
    #[cfg(all(feature = "verbs", target_os = "linux"))]
    Verbs,
    /// DPDK (feature `dpdk`): reliable datagrams over the process's DPDK
    /// port, each connection bootstrapped over its TCP stream.
    #[cfg(feature = "dpdk")]
    Dpdk,
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
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        ("verbs", BackendKind::Verbs),
        #[cfg(feature = "dpdk")]
        ("dpdk", BackendKind::Dpdk),
    ];

    /// The backend's name on the command line.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, b)| *b == self)
            .map_or("unknown", |(n, _)| n)
    }

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

pub(super) fn shard_config(cfg: &TrainConfig) -> ShardConfig {
    ShardConfig {
        seed: cfg.seed,
        optimizer: OptimizerConfig {
            kind: cfg.optimizer,
            lr: cfg.lr * cfg.lr_scaling.factor(cfg.workers),
            warmup_steps: cfg.lr_warmup_steps,
            ..cfg.optimizer_params
        },
        filter_freq: cfg.filter_freq,
        filter_capacity: cfg.filter_capacity,
        steps_to_live: cfg.steps_to_live,
        default_value_dim: cfg.default_value_dim,
        max_reply_bytes: cfg.guard.max_reply_bytes,
        max_rows: cfg.guard.max_rows,
        ..ShardConfig::default()
    }
}

/// The optimizer the shards are built with ([`shard_config`]) is in
/// range. `starwire train`, `ps` and `worker` have checked their flags
/// already, each error naming its flag; this catches a configuration
/// built through the library before a PS binds or a thread starts.
pub(super) fn check_optimizer(cfg: &TrainConfig) -> Result<(), TrainError> {
    shard_config(cfg)
        .optimizer
        .validate()
        .map_err(|e| TrainError::Config(e.to_string()))
}

/// A task of a cluster across processes needs a network backend.
pub(super) fn across_processes(b: BackendKind) -> Result<(), TrainError> {
    if b == BackendKind::Inproc {
        return Err(TrainError::Config(
            "--backend inproc has no network: it runs only in `starwire train` (the local \
             cluster); `starwire ps` and `starwire worker` need tcp, uring, grpc or dpdk"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_read_ahead_over_a_network_with_a_cpu_each() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(default_prefetch(BackendKind::Tcp, 1), 1);
        assert_eq!(default_prefetch(BackendKind::Tcp, cpus), 1);
        assert_eq!(default_prefetch(BackendKind::Tcp, cpus + 1), 0);
        assert_eq!(default_prefetch(BackendKind::Inproc, 1), 0);
    }

    /// A `--sync` run's shards keep no pull records (its merged pushes
    /// use none), an asynchronous run's do.
    #[test]
    fn only_an_asynchronous_run_s_shards_record_pulls() {
        for sync in [false, true] {
            let cfg = TrainConfig {
                sync,
                optimizer: OptimizerKind::DcAsgd,
                ..TrainConfig::default()
            };
            let plan = crate::cluster::plan(&cfg).unwrap();
            let shard = crate::cluster::make_shard(&cfg, &plan, 0, None).unwrap();
            assert!(shard.config().optimizer.tracks_pulls());
            let trained = if sync { 0 } else { cfg.workers as u32 };
            assert_eq!(shard.recorded_workers(), trained);
        }
    }

    #[test]
    fn scaling_and_warmup_reach_the_shards() {
        let cfg = TrainConfig {
            workers: 16,
            lr: 0.4,
            lr_scaling: LrScaling::Sqrt,
            lr_warmup_steps: 100,
            ..TrainConfig::default()
        };
        let o = shard_config(&cfg).optimizer;
        assert_eq!((o.lr, o.warmup_steps), (0.1, 100));
        let cfg = TrainConfig {
            filter_freq: 3,
            filter_capacity: 4096,
            ..TrainConfig::default()
        };
        let s = shard_config(&cfg);
        assert_eq!((s.filter_freq, s.filter_capacity), (3, 4096));
        assert_eq!(
            shard_config(&TrainConfig::default()).filter_capacity,
            starwire_ps::TablePolicy::default().filter_capacity
        );
        assert_eq!(LrScaling::Linear.factor(16), 1.0 / 16.0);
        assert_eq!(LrScaling::None.factor(64), 1.0);
        for (name, s) in LrScaling::ALL {
            assert_eq!(s.name(), name);
        }
    }
}

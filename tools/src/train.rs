//! `starwire train` (the local loopback cluster), `starwire ps` and
//! `starwire worker` (one role each, across hosts). See docs/TRAIN.md.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::builder::RangedU64ValueParser;
use clap::Args;
use starwire_config::{ClusterConfig, ClusterFlags, EndpointMap, Overrides, Role, Settings};
use starwire_data::SyntheticSpec;
use starwire_graph::{ModelKind, Protocol};
use starwire_ps::{OptimizerKind, Strategy};
use starwire_train::cluster::LrScaling;
use starwire_train::cluster::PsLifetime;
use starwire_train::source::DataSource;
use starwire_train::{BackendKind, TrainConfig, TrainReport};

use crate::failure::{at_least_one, local_tasks, positive_f32, positive_f64, Failure};

/// `starwire train`: the local cluster's size, and the training flags.
#[derive(Debug, Clone, Args)]
pub struct LocalArgs {
    /// PS tasks (1 to 1024).
    #[arg(long, default_value_t = 1, value_parser = local_tasks)]
    pub ps: usize,
    /// Worker tasks (1 to 1024).
    #[arg(long, default_value_t = 2, value_parser = local_tasks)]
    pub workers: usize,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Training flags shared by `train`, `ps` and `worker` (every task of a
/// cluster must be given the same ones). `ps` and `worker` take the
/// cluster's size from its spec (`--ps_hosts`, `--worker_hosts` or
/// TF_CONFIG), `train` from [`LocalArgs`].
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Transport backend: tcp, uring, grpc, dpdk, verbs (when built in),
    /// or inproc (no network: workers call the shards directly; the compute
    /// bound, local cluster only).
    #[arg(long, default_value = "tcp", value_parser = parse_backend)]
    pub backend: String,
    /// star_server (robust) or star_server_lite (pooling on the PS).
    #[arg(long, default_value = "star_server", value_parser = parse_protocol)]
    pub protocol: Protocol,
    /// lr or wdl.
    #[arg(long, default_value = "lr", value_parser = parse_model)]
    pub model: ModelKind,
    /// synthetic or criteo:PATH (a file, directory or glob pattern; .gz
    /// files decompressed; each worker reads its share of the files).
    #[arg(long, default_value = "synthetic")]
    pub train: DataSource,
    /// synthetic or criteo:PATH.
    #[arg(long, default_value = "synthetic")]
    pub eval: DataSource,
    /// Passes over the training data.
    #[arg(long, default_value_t = 2)]
    pub epochs: u64,
    /// Stop after this many steps in total (split evenly over workers).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Examples per step per worker [default: 512; with --sync and more
    /// than 32 workers, 512 x 32 / workers].
    #[arg(long, value_parser = at_least_one)]
    pub batch_size: Option<usize>,
    /// Embedding width (1 to 65536).
    #[arg(
        long,
        default_value_t = 8,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=starwire_graph::MAX_WIDTH as u64)
    )]
    pub embedding_dim: usize,
    /// sgd, adagrad, adam, ftrl, adagrad_decay or dc_asgd [default:
    /// adagrad; dc_asgd for asynchronous training with 32 workers or more].
    #[arg(long, value_parser = parse_optimizer)]
    pub optimizer: Option<OptimizerKind>,
    /// Learning rate (FTRL's alpha).
    #[arg(long, default_value_t = 0.6)]
    pub lr: f32,
    /// Scale the rate of each push with the workers W: none, sqrt (--lr /
    /// sqrt(W)) or linear (--lr / W).
    #[arg(long, default_value = "none", value_parser = parse_lr_scaling)]
    pub lr_scaling: LrScaling,
    /// Grow the rate linearly over the first N global steps of each shard.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub lr_warmup_steps: u64,
    /// ftrl: beta (TensorFlow's FtrlOptimizer beta).
    #[arg(long, default_value_t = 0.0)]
    pub beta: f32,
    /// ftrl: l1_regularization_strength.
    #[arg(long, default_value_t = 0.0)]
    pub l1_regularization_strength: f32,
    /// ftrl: l2_regularization_strength.
    #[arg(long, default_value_t = 0.0)]
    pub l2_regularization_strength: f32,
    /// adagrad_decay: accumulator_decay_step (global steps per decay).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub accumulator_decay_step: u64,
    /// adagrad_decay: accumulator_decay_rate.
    #[arg(long, default_value_t = 0.9)]
    pub accumulator_decay_rate: f32,
    /// dc_asgd: the delay compensation's lambda0 (Zheng et al. 2017).
    #[arg(long, default_value_t = 8.0)]
    pub dc_lambda: f32,
    /// Divide the rate of each row's update by its staleness (the updates
    /// the row received since the worker pulled it): none, sqrt or linear.
    #[arg(long, default_value = "none", value_parser = parse_staleness_lr)]
    pub staleness_lr: starwire_ps::StalenessLr,
    /// How whole variables are assigned to PS tasks: rr, greedy or anneal.
    #[arg(long, default_value = "greedy")]
    pub placement: String,
    /// One fused pull and push per PS shard per step (on), or one request
    /// per tensor (off).
    #[arg(long, default_value = "on", value_parser = crate::parse_on_off, action = clap::ArgAction::Set)]
    pub tensor_fuse: bool,
    /// Synchronous SGD: each step's pushes of every worker summed in
    /// worker-index order and applied once, then a barrier.
    #[arg(long)]
    pub sync: bool,
    /// Asynchronous steps taken in turn, each worker's pull waiting until
    /// the shards have applied every step more than N before it in the
    /// order (round-robin over the workers, --turn-steps at a time; at
    /// most N + 1 steps in flight), or off [default: 4 for asynchronous
    /// training with 32 workers or more, else off; with --backend grpc
    /// always off, and a number is refused (the gRPC baseline has no
    /// WAIT_STEP)].
    #[arg(long, value_name = "N|off", value_parser = parse_bounded_delay)]
    pub bounded_delay: Option<BoundedDelay>,
    /// Steps each worker takes in a row in the bounded-delay order (the
    /// same bound on each); give every task of a cluster the same; above
    /// 1 not with checkpoints during an asynchronous run [default: when
    /// the local cluster has more workers than CPUs and takes no such
    /// checkpoints, ceil((N + 1) / CPUs), about one worker in flight per
    /// CPU; else 1].
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub turn_steps: Option<u64>,
    /// Seed of the data, initial values and annealing.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write a checkpoint here at the end; resume from it if one is there.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint during the run, at every global step that is a
    /// multiple of N (with --checkpoint-dir; N a multiple of the workers;
    /// without --sync on Criteo files, each worker first counts every
    /// worker's share). Worker 0 writes the manifest of each.
    #[arg(long, value_name = "N")]
    pub checkpoint_every_steps: Option<u64>,
    /// Also checkpoint during the run once S seconds have passed since the
    /// last checkpoint, at the next step (with --checkpoint-dir; without
    /// --sync, at the next step shard 0 decides for every worker).
    #[arg(long, value_name = "S")]
    pub checkpoint_every_secs: Option<u64>,
    /// Each PS shard also writes an incremental checkpoint (the rows
    /// touched since its last full checkpoint) into
    /// DIR/deltas/C/ at every global step C that is a multiple of N
    /// (with --checkpoint-dir).
    #[arg(long, value_name = "N")]
    pub delta_every_steps: Option<u64>,
    /// DeepRec EmbeddingVariable filter_freq: a key gets a row after this
    /// many lookups (0: at once).
    #[arg(long, default_value_t = 0)]
    pub filter_freq: u32,
    /// With --filter-freq above 1: the keys each PS shard counts per table
    /// at once (as DeepRec CBFFilter's max_element_size sizes its
    /// filter), about 50 bytes each; past it a new key takes the oldest
    /// counter not pulled again.
    #[arg(
        long,
        value_name = "N",
        default_value_t = starwire_ps::TablePolicy::default().filter_capacity,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_FILTER_CAPACITY as u64)
    )]
    pub filter_capacity: usize,
    /// DeepRec EmbeddingVariable steps_to_live: evict rows untouched for
    /// this many global steps (0: never).
    #[arg(long, default_value_t = 0)]
    pub steps_to_live: u64,
    /// DeepRec EmbeddingVariable default_value_dim: a new row starts as row
    /// key % N of each table's default value matrix (0: each key
    /// initialised by itself; at most 65536, the largest --embedding-dim).
    #[arg(
        long,
        default_value_t = 4096,
        value_parser = RangedU64ValueParser::<usize>::new().range(..=MAX_DEFAULT_VALUE_DIM as u64)
    )]
    pub default_value_dim: usize,
    /// Synthetic training examples per epoch.
    #[arg(long, default_value_t = 200_000)]
    pub train_examples: u64,
    /// Evaluation examples (synthetic), or the most read from the file.
    #[arg(long, default_value_t = 50_000)]
    pub eval_examples: u64,
    /// Skip malformed Criteo lines (counted) instead of failing.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Workers hand their requests to NETWORK_WORKER_CORE_NUMBER network
    /// reactors through the M:N queue (on), or drive their connections on
    /// the worker thread (off). tcp, uring, dpdk and verbs only.
    #[arg(long, default_value = "off", value_parser = crate::parse_on_off, action = clap::ArgAction::Set)]
    pub worker_handoff: bool,
    /// Compute threads per worker for large ops (0: inline; at most 1024).
    #[arg(
        long,
        default_value_t = 0,
        value_parser = RangedU64ValueParser::<usize>::new().range(..=MAX_COMPUTE_THREADS as u64)
    )]
    pub compute_threads: usize,
    /// Batches each worker reads ahead on a thread of its own (on the
    /// worker's core when pinned) while it waits for the PS, as
    /// TensorFlow's Dataset.prefetch; 0 reads each batch between steps;
    /// at most 1024. Default: 1 with a network backend when the host has a
    /// CPU for each of its workers, else 0.
    #[arg(
        long,
        value_parser = RangedU64ValueParser::<usize>::new().range(..=MAX_PREFETCH as u64)
    )]
    pub prefetch: Option<usize>,
    /// A progress line every this many steps of each worker, and global
    /// steps of each PS shard, on stderr (0: none).
    #[arg(long, default_value_t = 100)]
    pub log_every: u64,
    /// Pinned reactors (PS_DISABLE_PIN_CORES / WORKER_DISABLE_PIN_CORES
    /// false) take the cores near this NIC first.
    #[arg(long)]
    pub device: Option<String>,
    /// Print one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
    /// Where DPDK runs (feature `dpdk`; backend dpdk).
    #[cfg(feature = "dpdk")]
    #[command(flatten)]
    pub dpdk: crate::dpdk::DpdkArgs,
    /// The cluster token and the PS task's bounds.
    #[command(flatten)]
    pub guard: crate::guard::GuardArgs,
    /// The verbs backend's device: every task of a process uses it.
    #[command(flatten)]
    pub rdma: crate::rdma::RdmaDeviceArgs,
}

/// Most `--default-value-dim` rows: the widest table a model takes
/// (`--embedding-dim`'s bound), so the matrix is at most 65536 x 65536
/// floats per table, not whatever a typo asks for.
const MAX_DEFAULT_VALUE_DIM: usize = starwire_graph::MAX_WIDTH;
/// Largest `--filter-capacity`: 2^28 counters are about 13 GB per table
/// per shard, far past any budget a PS is given; a typo should not ask
/// for more.
const MAX_FILTER_CAPACITY: usize = 1 << 28;

/// Most `--compute-threads` per worker: each is an OS thread per worker
/// (and the evaluator), so a larger count only fails to start.
const MAX_COMPUTE_THREADS: usize = 1024;

/// Most batches `--prefetch` reads ahead per worker (each held in memory).
const MAX_PREFETCH: usize = 1024;

fn parse_protocol(s: &str) -> Result<Protocol, String> {
    match s {
        "star_server" => Ok(Protocol::StarServer),
        "star_server_lite" => Ok(Protocol::StarServerLite),
        "grpc" | "grpc++" | "star_server_rdma" => Err(format!(
            "protocol {s:?} selects a transport in DeepRec; here use --backend, and \
             --protocol star_server or star_server_lite"
        )),
        _ => Err(format!(
            "expected star_server or star_server_lite, got {s:?}"
        )),
    }
}

fn parse_model(s: &str) -> Result<ModelKind, String> {
    match s {
        "lr" => Ok(ModelKind::Lr),
        "wdl" => Ok(ModelKind::Wdl),
        _ => Err(format!("expected lr or wdl, got {s:?}")),
    }
}

fn parse_optimizer(s: &str) -> Result<OptimizerKind, String> {
    OptimizerKind::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = OptimizerKind::ALL.iter().map(|(n, _)| *n).collect();
        format!("expected one of {}, got {s:?}", names.join(", "))
    })
}

/// Asynchronous workers from which `--optimizer` defaults to `dc_asgd`.
const DC_ASGD_FROM_WORKERS: usize = 32;

/// The optimizer when `--optimizer` is not given: Adagrad, whose steps
/// overshoot when many asynchronous workers push gradients computed on
/// values tens of steps old; there DC-ASGD compensates them (docs/TRAIN.md,
/// "Many workers"). Synchronous steps are not stale.
fn default_optimizer(workers: usize, sync: bool) -> OptimizerKind {
    if !sync && workers >= DC_ASGD_FROM_WORKERS {
        OptimizerKind::DcAsgd
    } else {
        OptimizerKind::Adagrad
    }
}

/// Examples per step per worker when `--batch-size` is not given.
const DEFAULT_BATCH_SIZE: usize = 512;

/// Synchronous workers past which the default batch shrinks.
const SYNC_FULL_BATCH_UP_TO_WORKERS: usize = 32;

/// The batch when `--batch-size` is not given: 512, except for a
/// synchronous run of more than 32 workers, where it is `512 x 32 / W`
/// (at least 1): a synchronous step trains every worker's batch at once,
/// so an epoch at 64 x 512 is 64 times fewer steps than one worker's, too
/// few to converge whatever the merge (docs/TRAIN.md, "Many workers, few
/// steps", measured). Asynchronous workers each take their own steps.
fn default_batch_size(workers: usize, sync: bool) -> usize {
    if sync && workers > SYNC_FULL_BATCH_UP_TO_WORKERS {
        (DEFAULT_BATCH_SIZE * SYNC_FULL_BATCH_UP_TO_WORKERS / workers).max(1)
    } else {
        DEFAULT_BATCH_SIZE
    }
}

/// `--bounded-delay`: a bound, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundedDelay(Option<u64>);

fn parse_bounded_delay(s: &str) -> Result<BoundedDelay, String> {
    if s == "off" {
        return Ok(BoundedDelay(None));
    }
    s.parse()
        .map(|n| BoundedDelay(Some(n)))
        .map_err(|_| format!("expected a number of steps or off, got {s:?}"))
}

/// `--bounded-delay` as given, or its default (none on the gRPC baseline,
/// which has no `WAIT_STEP`); a bound with `--sync` (whose steps wait for
/// every worker already) or on the gRPC baseline is a usage error.
fn bounded_delay(a: &TrainArgs, workers: usize) -> Result<Option<u64>, String> {
    let grpc = a.backend == "grpc";
    match a.bounded_delay {
        Some(BoundedDelay(Some(n))) if a.sync => Err(format!(
            "--bounded-delay {n} is for asynchronous training: --sync steps wait for every \
             worker already"
        )),
        Some(BoundedDelay(Some(n))) if grpc => Err(format!(
            "--bounded-delay {n}: the grpc baseline has no WAIT_STEP; use another backend"
        )),
        Some(BoundedDelay(n)) => Ok(n),
        None if grpc => Ok(None),
        None => Ok(starwire_train::cluster::default_bounded_delay(
            workers, a.sync,
        )),
    }
}

/// `--turn-steps` as given; with no delay bound it orders nothing, a
/// usage error.
fn turn_steps(a: &TrainArgs, bound: Option<u64>) -> Result<Option<u64>, String> {
    match (a.turn_steps, bound) {
        (Some(k), None) => Err(format!(
            "--turn-steps {k} orders the steps of a delay bound, and this run has none \
             (asynchronous training with --bounded-delay N)"
        )),
        (k, _) => Ok(k),
    }
}

fn parse_lr_scaling(s: &str) -> Result<LrScaling, String> {
    LrScaling::ALL
        .iter()
        .find(|(n, _)| *n == s)
        .map(|&(_, k)| k)
        .ok_or_else(|| format!("expected none, sqrt or linear, got {s:?}"))
}

fn parse_staleness_lr(s: &str) -> Result<starwire_ps::StalenessLr, String> {
    starwire_ps::StalenessLr::ALL
        .iter()
        .find(|(n, _)| *n == s)
        .map(|&(_, k)| k)
        .ok_or_else(|| format!("expected none, sqrt or linear, got {s:?}"))
}

fn parse_strategy(s: &str, seed: u64) -> Result<Strategy, String> {
    match s {
        "rr" => Ok(Strategy::RoundRobin),
        "greedy" => Ok(Strategy::Greedy),
        "anneal" => Ok(Strategy::Anneal {
            seed,
            iters: 20_000,
        }),
        _ => Err(format!(
            "--placement: expected rr, greedy or anneal, got {s:?}"
        )),
    }
}

fn check_backend(name: &str) -> Result<BackendKind, String> {
    BackendKind::from_name(name).ok_or_else(|| {
        let have: Vec<&str> = BackendKind::ALL.iter().map(|(n, _)| *n).collect();
        crate::backend::missing_backend_hint(name).unwrap_or_else(|| {
            format!(
                "unknown backend {name:?}; training runs on: {}",
                have.join(", ")
            )
        })
    })
}

/// `--backend`: a training backend compiled into this binary.
fn parse_backend(s: &str) -> Result<String, String> {
    let name = s.trim().to_ascii_lowercase();
    check_backend(&name).map(|_| name)
}

/// A failure of the trainer: an invalid configuration is a usage error.
pub(crate) fn train_failure(e: starwire_train::TrainError) -> Failure {
    match e {
        starwire_train::TrainError::Config(_) => Failure::Usage(e.to_string()),
        _ => Failure::Run(e.to_string()),
    }
}

/// [`config`] (its errors are usage errors), then the device the backend
/// needs: none found is a run-time error (exit 1), as on a host without
/// RDMA.
fn prepare(a: &TrainArgs, ps: usize, workers: usize) -> Result<TrainConfig, Failure> {
    let cfg = config(a, ps, workers).map_err(Failure::Usage)?;
    #[cfg(all(feature = "verbs", target_os = "linux"))]
    if cfg.backend == BackendKind::Verbs {
        let dev = starwire_verbs::VerbsDevice::open(&starwire_verbs::DeviceSpec {
            name: a.rdma.rdma_device.clone(),
            port: a.rdma.rdma_port,
            gid_index: a.rdma.gid_index,
        })
        .map_err(|e| Failure::Run(e.to_string()))?;
        starwire_train::backend::set_verbs_device(dev);
    }
    Ok(cfg)
}

/// The configuration from the flags and the DeepRec environment variables
/// (resolved as `starwire info` shows them: a PS's connections are the
/// workers, a worker's the PS tasks).
fn config(a: &TrainArgs, ps: usize, workers: usize) -> Result<TrainConfig, String> {
    let backend = check_backend(&a.backend)?;
    let settings = Settings::resolve(
        workers,
        ps,
        &starwire_config::process_env,
        &Overrides::default(),
    )
    .map_err(|e| e.to_string())?;
    check_optimizer_flags(a)?;
    let optimizer = a
        .optimizer
        .unwrap_or_else(|| default_optimizer(workers, a.sync));
    let bound = bounded_delay(a, workers)?;
    let mut cfg = TrainConfig {
        backend,
        ps,
        workers,
        protocol: a.protocol,
        model: a.model,
        train: a.train.clone(),
        eval: a.eval.clone(),
        epochs: a.epochs,
        steps: a.steps,
        batch_size: a
            .batch_size
            .unwrap_or_else(|| default_batch_size(workers, a.sync)),
        embedding_dim: a.embedding_dim,
        optimizer,
        lr: a.lr,
        lr_scaling: a.lr_scaling,
        lr_warmup_steps: a.lr_warmup_steps,
        optimizer_params: starwire_ps::OptimizerConfig {
            ftrl_beta: a.beta,
            l1: a.l1_regularization_strength,
            l2: a.l2_regularization_strength,
            decay_step: a.accumulator_decay_step,
            decay_rate: a.accumulator_decay_rate,
            dc_lambda: a.dc_lambda,
            staleness_lr: a.staleness_lr,
            ..starwire_ps::OptimizerConfig::with_kind(optimizer, a.lr)
        },
        assignment: parse_strategy(&a.placement, a.seed)?,
        tensor_fuse: a.tensor_fuse,
        sync: a.sync,
        bounded_delay: bound,
        turn_steps: turn_steps(a, bound)?,
        seed: a.seed,
        checkpoint_dir: a.checkpoint_dir.clone(),
        checkpoint_every_steps: a.checkpoint_every_steps,
        checkpoint_every_secs: a.checkpoint_every_secs.map(std::time::Duration::from_secs),
        delta_every_steps: a.delta_every_steps,
        filter_freq: a.filter_freq,
        filter_capacity: a.filter_capacity,
        steps_to_live: a.steps_to_live,
        default_value_dim: a.default_value_dim,
        train_examples: a.train_examples,
        eval_examples: a.eval_examples,
        skip_bad_lines: a.skip_bad_lines,
        compute_threads: a.compute_threads,
        prefetch: a.prefetch,
        worker_handoff: a.worker_handoff,
        log_every: a.log_every,
        device: a.device.clone(),
        guard: a.guard.guard()?,
        ..TrainConfig::default()
    };
    cfg.apply_settings(&settings);
    Ok(cfg)
}

/// The optimizer's hyper-parameters are in range (a usage error names the
/// flag).
fn check_optimizer_flags(a: &TrainArgs) -> Result<(), String> {
    let positive = |v: f32| v.is_finite() && v > 0.0;
    let non_negative = |v: f32| v.is_finite() && v >= 0.0;
    if !positive(a.lr) {
        return Err(format!("--lr must be a positive number, got {}", a.lr));
    }
    for (flag, v) in [
        ("--dc-lambda", a.dc_lambda),
        ("--beta", a.beta),
        ("--l1-regularization-strength", a.l1_regularization_strength),
        ("--l2-regularization-strength", a.l2_regularization_strength),
    ] {
        if !non_negative(v) {
            return Err(format!("{flag} must be 0 or more, got {v}"));
        }
    }
    if !(positive(a.accumulator_decay_rate) && a.accumulator_decay_rate <= 1.0) {
        return Err(format!(
            "--accumulator-decay-rate must be in (0, 1], got {}",
            a.accumulator_decay_rate
        ));
    }
    Ok(())
}

fn print_report(r: &TrainReport, json: bool) -> Result<(), String> {
    if json {
        println!("{}", serde_json::to_string(r).map_err(|e| e.to_string())?);
        return Ok(());
    }
    println!(
        "trained {} ({}, backend {}, fusion {}, {}, batch {}) on {} PS ({} shards) and {} workers",
        r.model,
        r.protocol,
        r.backend,
        if r.tensor_fuse { "on" } else { "off" },
        if r.sync { "sync" } else { "async" },
        r.batch_size,
        r.ps,
        r.shards,
        r.workers
    );
    if let Some(step) = r.resumed_from_step {
        println!("  resumed from the checkpoint at global step {step}; this run:");
    }
    println!(
        "  steps {}  samples {}  {:.1} s  {:.0} samples/s  {:.0} bytes/step  {:.1} requests/step",
        r.steps, r.samples, r.train_seconds, r.samples_per_s, r.bytes_per_step, r.requests_per_step
    );
    for i in &r.intervals {
        println!(
            "  epoch {}: train loss {:.4}  eval auc {:.4}  logloss {:.4}",
            i.epoch, i.train_loss, i.auc, i.logloss
        );
    }
    let oracle = r
        .oracle_auc
        .map(|o| format!("  (oracle auc {o:.4}, gap {:.4})", o - r.auc))
        .unwrap_or_default();
    println!(
        "  final: eval auc {:.4}  logloss {:.4}  on {} examples{oracle}",
        r.auc, r.logloss, r.eval_examples
    );
    for line in r.assignment.to_string().lines() {
        println!("    {line}");
    }
    if r.skipped_lines > 0 {
        println!("  skipped {} bad lines", r.skipped_lines);
    }
    if let Some(c) = &r.checkpoint {
        println!("  checkpoint written to {}", c.display());
    }
    println!("  {}", starwire_train::cluster::summary(&r.reactors));
    Ok(())
}

/// `starwire train`.
/// With `--backend dpdk`: set the process's DPDK port up from the flags
/// (it opens at the first driver); the guard closes it when the command
/// is done, after every reactor has ended.
#[cfg(feature = "dpdk")]
fn dpdk_setup(a: &TrainArgs) -> Option<crate::dpdk::CloseOnDrop> {
    (a.backend == "dpdk").then(|| {
        a.dpdk.configure();
        crate::dpdk::CloseOnDrop
    })
}

#[cfg(not(feature = "dpdk"))]
fn dpdk_setup(_a: &TrainArgs) -> Option<()> {
    None
}

/// This task's fast endpoint in the `.endpoint_map`, over dpdk: the IPv4
/// address of its DPDK side (unless `--dpdk-ip` names one) and the first
/// UDP port its links bind. Set before [`dpdk_setup`], which it takes
/// precedence over (the first configuration counts).
#[cfg(feature = "dpdk")]
fn dpdk_fast_endpoint(a: &TrainArgs, fast: &starwire_config::HostPort) -> Result<(), String> {
    let ip = match a.dpdk.dpdk_ip {
        Some(ip) => ip,
        None => fast.host().parse().map_err(|_| {
            format!(
                "endpoint map: the fast endpoint {fast} of a dpdk task must be an IPv4 \
                 address (its DPDK side), or give --dpdk-ip"
            )
        })?,
    };
    crate::dpdk::DpdkContext::configure(crate::dpdk::ContextConfig {
        ip: Some(ip),
        first_udp_port: Some(fast.port()),
        ..a.dpdk.context_config()
    });
    Ok(())
}

#[cfg(not(feature = "dpdk"))]
fn dpdk_fast_endpoint(_a: &TrainArgs, _fast: &starwire_config::HostPort) -> Result<(), String> {
    Ok(())
}

/// Connections each client of the local cluster (a worker, the evaluator)
/// opens to a PS task, and what they are: one per shard of the task, one
/// channel over grpc (it carries all of the task's shards), none over
/// inproc.
fn connections_per_client(cfg: &TrainConfig) -> (usize, &'static str) {
    match cfg.backend {
        BackendKind::Inproc => (0, "connections"),
        #[cfg(feature = "grpc")]
        BackendKind::Grpc => (1, "gRPC channel"),
        _ => (cfg.ps_reactors.max(1), "shard(s) of the task"),
    }
}

/// A `--max-connections` below what a PS task of the local cluster holds
/// would refuse one of the cluster's own connections as it starts: given
/// (`explicit`), a usage error naming the count; left at its default
/// (1024), raised to the count (`--workers 1024` needs 1025 and more).
/// Every worker's connections and the evaluator's are counted: the
/// evaluator dials as the workers close, and a PS counts a connection
/// until its reactor has seen it end.
fn check_local_connections(cfg: &mut TrainConfig, explicit: bool) -> Result<(), String> {
    let (per_client, what) = connections_per_client(cfg);
    let need = (cfg.workers + 1) * per_client;
    if cfg.guard.max_connections >= need {
        return Ok(());
    }
    if !explicit {
        cfg.guard.max_connections = need;
        return Ok(());
    }
    Err(format!(
        "--max-connections {} is below the {need} connections each PS task of this cluster \
         holds: ({} workers + the evaluator) x {per_client} {what}; give --max-connections \
         {need} or more",
        cfg.guard.max_connections, cfg.workers
    ))
}

pub fn main(l: LocalArgs) -> Result<(), Failure> {
    let a = &l.train;
    let mut cfg = prepare(a, l.ps, l.workers)?;
    starwire_train::cluster::fit_local_host(&mut cfg).map_err(train_failure)?;
    check_local_connections(&mut cfg, a.guard.max_connections.is_some()).map_err(Failure::Usage)?;
    let _dpdk = dpdk_setup(a);
    tracing::info!(
        target: "status",
        "starwire train: {} on {} PS x {} reactor(s) and {} workers over loopback {}; \
         polling ps={} worker={}; worker handoff {}",
        starwire_train::cluster::model_name(cfg.model),
        cfg.ps,
        cfg.ps_reactors,
        cfg.workers,
        a.backend,
        cfg.ps_polling,
        cfg.worker_polling,
        if cfg.handoff() { "on" } else { "off" }
    );
    let _metrics = a.metrics.serve(&cfg.telemetry)?;
    let r = starwire_train::run_local(&cfg).map_err(train_failure)?;
    Ok(print_report(&r, a.json)?)
}

/// Cluster flags of `starwire ps` / `starwire worker`. TensorFlow's and
/// DeepRec's spellings (`--ps_hosts`, ...) are aliases.
#[derive(Debug, Clone, Args)]
pub struct RoleArgs {
    /// PS hosts, `h:p,h:p` (else TF_CONFIG).
    #[arg(long, visible_alias = "ps_hosts")]
    pub ps_hosts: Option<String>,
    /// Worker hosts, `h:p,h:p` (else TF_CONFIG).
    #[arg(long, visible_alias = "worker_hosts")]
    pub worker_hosts: Option<String>,
    /// This task's job; the subcommand's: ps, or worker or chief (worker
    /// 0). Optional: the subcommand names the job.
    #[arg(long, visible_alias = "job_name")]
    pub job_name: Option<String>,
    /// This task's index (else TF_CONFIG's task).
    #[arg(long, visible_alias = "task_index")]
    pub task_index: Option<u32>,
    #[command(flatten)]
    pub connect: crate::launch::ConnectArgs,
    /// Training flags (the same on every task).
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Flags of [`TrainArgs`] only a worker task reads: a PS task's run
/// (`starwire_train::run_ps_task`) never looks at `eval`, `eval_examples`,
/// `skip_bad_lines` (they feed the workers' readers and the evaluation),
/// `compute_threads`, `prefetch` (a worker's executor and reader) or
/// `worker_handoff` (a worker's connections). `ps` and `worker` share one
/// flag struct, so that a launch script can give every task the same
/// flags; their `--help` groups these under [`WORKER_HEADING`].
const WORKER_ONLY: &[&str] = &[
    "eval",
    "eval_examples",
    "skip_bad_lines",
    "worker_handoff",
    "compute_threads",
    "prefetch",
];

/// Flags of [`TrainArgs`] only a PS task reads: a worker never listens
/// (`insecure`), and the bounds are those of a PS task's acceptor,
/// connections and shards (a worker's connections take the token and the
/// handshake timeout only).
const PS_ONLY: &[&str] = &[
    "insecure",
    "max_connections",
    "idle_timeout_secs",
    "memory_budget_mb",
    "max_reply_bytes",
    "max_rows",
    "max_wait_steps",
    "filter_capacity",
];

/// The flags of [`crate::launch::PsArgs`] besides the shared ones.
const PS_TASK_ONLY: &[&str] = &["bind", "exit_when_done"];

/// `starwire ps --help`'s and `starwire worker --help`'s heading of the
/// flags only a worker uses.
const WORKER_HEADING: &str = "Worker options";
/// The heading of the flags only a PS task uses.
const PS_HEADING: &str = "PS options";
/// `starwire ps --help`'s heading of [`WORKER_ONLY`].
const WORKER_HEADING_ON_PS: &str = "Worker options (a ps task accepts and ignores them)";
/// `starwire worker --help`'s heading of [`PS_ONLY`].
const PS_HEADING_ON_WORKER: &str = "PS options (a worker accepts and ignores them)";

/// `cli` with the flags of its `ps` and `worker` subcommands grouped in
/// `--help` by the role that uses them. `starwire train` runs both roles:
/// its help is left as it is.
pub fn role_headings(cli: clap::Command) -> clap::Command {
    let heading = |mut c: clap::Command, ids: &[&str], h: &'static str| {
        for id in ids {
            c = c.mut_arg(*id, |a| a.help_heading(h));
        }
        c
    };
    cli.mut_subcommand("ps", |c| {
        let c = heading(c, PS_TASK_ONLY, PS_HEADING);
        let c = heading(c, PS_ONLY, PS_HEADING);
        heading(c, WORKER_ONLY, WORKER_HEADING_ON_PS)
    })
    .mut_subcommand("worker", |c| {
        let c = heading(c, WORKER_ONLY, WORKER_HEADING);
        heading(c, PS_ONLY, PS_HEADING_ON_WORKER)
    })
}

/// This task's cluster configuration and the PS addresses to dial. The
/// `.endpoint_map`'s fast endpoints replace the spec's; over dpdk, the
/// spec's addresses carry the bootstrap streams instead, and this task's
/// fast endpoint names its DPDK side (see [`dpdk_setup`]).
fn resolve(r: &RoleArgs, role: Role) -> Result<(ClusterConfig, Vec<String>), String> {
    let flags = ClusterFlags {
        ps_hosts: r.ps_hosts.clone(),
        worker_hosts: r.worker_hosts.clone(),
        job_name: crate::launch::job_flags(role, r.job_name.as_deref(), r.task_index)?,
        task_index: r.task_index,
    };
    let mut c = ClusterConfig::from_process_env(&flags).map_err(|e| e.to_string())?;
    if c.task.role != role {
        return Err(format!(
            "this task is {} in the cluster configuration, not a {} task; \
             run `starwire {}` there",
            c.task,
            role.job_name(),
            c.task.role
        ));
    }
    // `.endpoint_map`: the fast address of every gRPC address it names.
    if let Some(map) = EndpointMap::from_process_env().map_err(|e| format!("endpoint map: {e}"))? {
        let mapped = map.apply(&c.spec).map_err(|e| e.to_string())?;
        if r.train.backend == "dpdk" {
            let me = mapped
                .endpoint(c.task)
                .ok_or_else(|| format!("endpoint map: no fast endpoint for {}", c.task))?;
            dpdk_fast_endpoint(&r.train, me)?;
        } else {
            c.spec = mapped;
        }
    }
    let ps = c.spec.ps().iter().map(ToString::to_string).collect();
    Ok((c, ps))
}

/// `starwire ps`.
pub fn ps_main(a: crate::launch::PsArgs) -> Result<(), Failure> {
    let r = &a.role;
    let (c, _) = resolve(r, Role::Ps).map_err(Failure::Usage)?;
    let mut cfg = prepare(&r.train, c.spec.ps().len(), c.spec.workers().len())?;
    cfg.connect_timeout = r.connect.timeout();
    let me = &c.spec.ps()[c.task.index as usize];
    let deadline = std::time::Instant::now() + cfg.connect_timeout;
    let bind = crate::launch::listen_addr(a.bind.as_ref(), me, deadline).map_err(Failure::Run)?;
    if let Err(e) = cfg.guard.check_listen(bind) {
        return Err(Failure::Usage(e.to_string()));
    }
    let _metrics = r.train.metrics.serve(&cfg.telemetry)?;
    let _dpdk = dpdk_setup(&r.train);
    let stop = stop_on_signals()?;
    let lifetime = PsLifetime {
        exit_when_done: a.exit_when_done,
        stop: &stop,
    };
    let rep = starwire_train::run_ps_task(&cfg, c.task.index as usize, bind, lifetime)
        .map_err(|e| r.connect.failure(e))?;
    tracing::info!(
        target: "status",
        "starwire ps {}: {}",
        c.task.index,
        if a.exit_when_done {
            "every worker is done"
        } else {
            "stopped"
        }
    );
    if r.train.json {
        println!(
            "{}",
            serde_json::to_string(&rep).map_err(|e| e.to_string())?
        );
    }
    Ok(())
}

/// A flag SIGTERM and SIGINT set, so the PS stops with a checkpoint
/// instead of dying; a second signal, once the flag is set, exits at once
/// (status 1), for a checkpoint that hangs.
fn stop_on_signals() -> Result<Arc<AtomicBool>, Failure> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [SIGTERM, SIGINT] {
        // The shutdown check runs first: it sees the flag as the previous
        // signal left it.
        signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&stop))
            .and_then(|_| signal_hook::flag::register(sig, Arc::clone(&stop)))
            .map_err(|e| Failure::Run(format!("handling signal {sig}: {e}")))?;
    }
    Ok(stop)
}

/// `starwire worker`.
pub fn worker_main(r: RoleArgs) -> Result<(), Failure> {
    let (c, ps_addrs) = resolve(&r, Role::Worker).map_err(Failure::Usage)?;
    let mut cfg = prepare(&r.train, c.spec.ps().len(), c.spec.workers().len())?;
    cfg.connect_timeout = r.connect.timeout();
    let _metrics = r.train.metrics.serve(&cfg.telemetry)?;
    let _dpdk = dpdk_setup(&r.train);
    let rep = starwire_train::run_worker_task(&cfg, &ps_addrs, c.task.index as usize)
        .map_err(|e| r.connect.failure(e))?;
    Ok(print_report(&rep, r.train.json)?)
}

/// `starwire place`: compare the strategies of assigning variables to PS
/// tasks on a model.
#[derive(Debug, Clone, Args)]
pub struct PlaceArgs {
    /// PS tasks to assign the variables to.
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    pub ps: usize,
    /// `zipf` (a benchmark model of `--vars` variables with Zipf-distributed
    /// sizes and independent request loads), `lr` or `wdl` (estimated from
    /// a sample of the training data, as `train` does).
    #[arg(long, default_value = "zipf")]
    pub model: String,
    /// Variables of the zipf model (1 to 1,000,000).
    #[arg(long, default_value_t = 32, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub vars: usize,
    /// Zipf exponent of the sizes (a finite number above 0).
    #[arg(long, default_value_t = 1.1, value_parser = positive_f64)]
    pub zipf: f64,
    /// Embedding width (lr, wdl).
    #[arg(long, default_value_t = 8)]
    pub embedding_dim: usize,
    /// Examples per step per worker (request estimates).
    #[arg(long, default_value_t = 512)]
    pub batch_size: usize,
    /// Seed of the zipf loads and of annealing.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per strategy.
    #[arg(long)]
    pub json: bool,
}

/// `starwire place`.
pub fn place_main(a: PlaceArgs) -> Result<(), String> {
    use starwire_ps::assign::{assign_with, zipf_model, AssignOptions};
    let stats = match a.model.as_str() {
        "zipf" => zipf_model(a.vars, a.zipf, a.seed),
        m @ ("lr" | "wdl") => {
            let cfg = TrainConfig {
                ps: a.ps,
                model: parse_model(m)?,
                embedding_dim: a.embedding_dim,
                batch_size: a.batch_size,
                seed: a.seed,
                ..TrainConfig::default()
            };
            starwire_train::cluster::plan(&cfg)
                .map_err(|e| e.to_string())?
                .stats
        }
        other => return Err(format!("--model: expected zipf, lr or wdl, got {other:?}")),
    };
    let opts = AssignOptions {
        shard_threshold_bytes: starwire_train::cluster::shard_threshold(&stats, a.ps),
    };
    if !a.json {
        println!(
            "placing {} variables ({} model) on {} PS",
            stats.len(),
            a.model,
            a.ps
        );
    }
    let mut summary = Vec::new();
    for name in ["rr", "greedy", "anneal"] {
        let strategy = parse_strategy(name, a.seed)?;
        let r = assign_with(&stats, a.ps, strategy, &opts).report();
        if a.json {
            println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
        } else {
            println!("{r}");
        }
        summary.push((
            name,
            r.bytes_max_over_mean,
            r.requests_max_over_mean,
            r.cost,
        ));
    }
    if !a.json {
        println!("strategy  max/mean bytes  max/mean requests   cost");
        for (n, b, q, c) in summary {
            println!("{n:<8}  {b:>14.3}  {q:>17.3}  {c:>5.3}");
        }
    }
    Ok(())
}

/// `starwire data`: write the synthetic data set as Criteo TSV.
#[derive(Debug, Clone, Args)]
pub struct DataArgs {
    /// Output file.
    #[arg(long)]
    pub out: PathBuf,
    /// Examples to write.
    #[arg(long, default_value_t = 200_000)]
    pub examples: u64,
    /// `train` or `eval` (held-out examples of the same true model).
    #[arg(long, default_value = "train", value_parser = ["train", "eval"])]
    pub stream: String,
    /// Seed (the same as `train --seed` gives the same data).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Ids per categorical field.
    #[arg(long, default_value_t = SyntheticSpec::default().vocab)]
    pub vocab: u32,
    /// Zipf exponent of the ids' distribution (larger: fewer ids carry
    /// more of the draws).
    #[arg(long, default_value_t = SyntheticSpec::default().zipf_exponent)]
    pub zipf_exponent: f64,
    /// Mean click probability the true model's bias is calibrated to.
    #[arg(long, default_value_t = SyntheticSpec::default().target_ctr)]
    pub ctr: f64,
    /// The most frequent ids of each field that carry a true weight.
    #[arg(long, default_value_t = SyntheticSpec::default().weighted_ids)]
    pub weighted_ids: u32,
}

/// `starwire data`. A spec the true model cannot be built from (a
/// `--vocab` of 0, a `--ctr` outside (0, 1), ...) is a usage error.
pub fn data_main(a: DataArgs) -> Result<(), Failure> {
    use starwire_data::{Stream, Synthetic, TrueModel};
    let spec = SyntheticSpec {
        seed: a.seed,
        vocab: a.vocab,
        zipf_exponent: a.zipf_exponent,
        target_ctr: a.ctr,
        weighted_ids: a.weighted_ids,
        ..SyntheticSpec::default()
    };
    let stream = match a.stream.as_str() {
        "train" => Stream::Train,
        "eval" => Stream::Eval,
        s => {
            return Err(Failure::Usage(format!(
                "--stream: expected train or eval, got {s:?}"
            )))
        }
    };
    let model = TrueModel::new(spec).map_err(|e| {
        Failure::Usage(format!(
            "{e} (from --vocab, --zipf-exponent, --ctr, --weighted-ids)"
        ))
    })?;
    let model = std::sync::Arc::new(model);
    let n = Synthetic::new(model, stream, a.examples)
        .write_criteo(&a.out)
        .map_err(|e| e.to_string())?;
    eprintln!("wrote {n} {} examples to {}", a.stream, a.out.display());
    Ok(())
}

/// `starwire reference`: the single-process logistic regression that checks
/// the distributed trainer, on the same data.
#[derive(Debug, Clone, Args)]
pub struct ReferenceArgs {
    /// synthetic or criteo:PATH.
    #[arg(long, default_value = "synthetic")]
    pub train: DataSource,
    /// synthetic or criteo:PATH.
    #[arg(long, default_value = "synthetic")]
    pub eval: DataSource,
    /// lbfgs (L2 logistic regression fitted to convergence, its strength
    /// chosen on a validation split) or adagrad (the stochastic trainer of
    /// --epochs, --batch-size and --lr).
    #[arg(long, default_value = "lbfgs", value_parser = ["lbfgs", "adagrad"])]
    pub solver: String,
    /// lbfgs: fit with this L2 strength (a finite number, 0 or more)
    /// instead of choosing one of 1e-2, 3e-3, ... 1e-6 (largest first) on
    /// every 10th example.
    #[arg(long, value_parser = non_negative_f64)]
    pub l2: Option<f64>,
    /// lbfgs: most passes over the data per fit.
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_passes: u32,
    /// lbfgs: converged when the gradient's norm is at most this (a finite
    /// number above 0).
    #[arg(long, default_value_t = 1e-5, value_parser = positive_f64)]
    pub tolerance: f64,
    /// adagrad: passes over the training data.
    #[arg(long, default_value_t = 2)]
    pub epochs: u64,
    /// adagrad: examples per step (and the reading unit of both).
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    pub batch_size: usize,
    /// adagrad: learning rate (a finite number above 0).
    #[arg(long, default_value_t = 0.5, value_parser = positive_f32)]
    pub lr: f32,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Synthetic training examples per epoch.
    #[arg(long, default_value_t = 200_000)]
    pub train_examples: u64,
    /// Evaluation examples (synthetic), or the most read from the file.
    #[arg(long, default_value_t = 50_000)]
    pub eval_examples: u64,
    /// Skip malformed Criteo lines (counted) instead of failing.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A finite number, 0 or more (`reference --l2`: no regularisation is a
/// strength the solver takes), for clap's `value_parser`.
fn non_negative_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("expected a finite number, 0 or more, got {v}")),
        Err(e) => Err(format!("expected a number: {e}")),
    }
}

/// How the reference was fitted, for the report.
enum Fitted {
    Adagrad(starwire_data::ReferenceLr),
    Lbfgs(starwire_data::ConvergedLr, starwire_data::ConvergedReport),
}

/// `starwire reference`.
pub fn reference_main(a: ReferenceArgs) -> Result<(), String> {
    use starwire_data::{
        auc, logloss, Batch, ConvergedLr, ConvergedOptions, Optimizer, ReferenceLr, TrueModel,
    };
    use starwire_train::source::Reader;
    let spec = SyntheticSpec {
        seed: a.seed,
        examples_per_epoch: a.train_examples,
        ..SyntheticSpec::default()
    };
    let truth = std::sync::Arc::new(TrueModel::new(spec).map_err(|e| e.to_string())?);
    let mut r = Reader::train(
        &a.train,
        &truth,
        a.train_examples,
        Default::default(),
        a.skip_bad_lines,
    )
    .map_err(|e| e.to_string())?;
    let mut b = Batch::with_capacity(a.batch_size);
    let t0 = std::time::Instant::now();
    let mut samples = 0u64;
    // Bad lines skipped, over every pass over the training data and the
    // evaluation.
    let mut skipped = 0u64;
    let fitted = if a.solver == "adagrad" {
        let mut lr = ReferenceLr::new(Optimizer::Adagrad {
            lr: a.lr,
            initial_accumulator: 0.1,
        });
        for _ in 0..a.epochs {
            while r
                .next_batch(a.batch_size, &mut b)
                .map_err(|e| e.to_string())?
                > 0
            {
                samples += b.len as u64;
                lr.fit_batch(&b);
            }
            skipped += r.skipped();
            r.rewind().map_err(|e| e.to_string())?;
        }
        Fitted::Adagrad(lr)
    } else {
        let mut all = Batch::default();
        while r
            .next_batch(a.batch_size, &mut b)
            .map_err(|e| e.to_string())?
            > 0
        {
            all.extend_from(&b);
        }
        skipped += r.skipped();
        let opts = ConvergedOptions {
            l2_grid: a
                .l2
                .map_or_else(|| ConvergedOptions::default().l2_grid, |l| vec![l]),
            max_passes: a.max_passes,
            tolerance: a.tolerance,
            ..ConvergedOptions::default()
        };
        let (m, rep) = ConvergedLr::fit(&all, &opts).map_err(|e| e.to_string())?;
        samples = all.len as u64;
        Fitted::Lbfgs(m, rep)
    };
    let secs = t0.elapsed().as_secs_f64();
    let mut e = Reader::eval(&a.eval, &truth, a.eval_examples, a.skip_bad_lines)
        .map_err(|e| e.to_string())?;
    let (mut labels, mut probs, mut oracle) = (Vec::new(), Vec::new(), Vec::new());
    let mut p = Vec::new();
    let synthetic_eval = a.eval == DataSource::Synthetic;
    while (labels.len() as u64) < a.eval_examples {
        let want = (a.eval_examples - labels.len() as u64).min(a.batch_size as u64) as usize;
        let n = e.next_batch(want, &mut b).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        match &fitted {
            Fitted::Adagrad(m) => m.predict_batch(&b, &mut p),
            Fitted::Lbfgs(m, _) => m.predict_batch(&b, &mut p),
        }
        labels.extend_from_slice(&b.labels);
        probs.extend_from_slice(&p);
        if synthetic_eval {
            oracle.extend((0..b.len).map(|i| truth.oracle_prob(&b, i)));
        }
    }
    skipped += e.skipped();
    let (a_auc, a_ll) = (auc(&labels, &probs), logloss(&labels, &probs));
    let o_auc = synthetic_eval.then(|| auc(&labels, &oracle));
    if a.json {
        let mut j = serde_json::json!({
            "trainer": "reference_lr", "solver": a.solver, "samples": samples,
            "seconds": secs,
            "auc": a_auc, "logloss": a_ll, "oracle_auc": o_auc, "eval_examples": labels.len(),
            "skipped_lines": skipped,
        });
        if let Fitted::Adagrad(_) = &fitted {
            j["samples_per_s"] = (samples as f64 / secs.max(1e-9)).into();
        }
        if let Fitted::Lbfgs(_, rep) = &fitted {
            j["converged"] = rep.fit.converged.into();
            j["passes"] = rep.fit.passes.into();
            j["total_passes"] = rep.total_passes.into();
            j["grad_norm"] = rep.fit.grad_norm.into();
            j["l2"] = rep.fit.l2.into();
            j["validation"] = rep
                .validation
                .iter()
                .map(|(s, auc)| serde_json::json!({"l2": s.l2, "auc": auc, "passes": s.passes, "converged": s.converged}))
                .collect();
        }
        println!("{j}");
        return Ok(());
    }
    if let Fitted::Lbfgs(_, rep) = &fitted {
        for (s, auc) in &rep.validation {
            println!(
                "  l2 {:.0e}: validation auc {auc:.4} ({} passes{})",
                s.l2,
                s.passes,
                if s.converged { "" } else { ", not converged" }
            );
        }
        println!(
            "reference lr (l-bfgs, l2 {:.0e}): {} after {} passes, gradient norm {:.2e}; {} passes in {secs:.1} s",
            rep.fit.l2,
            if rep.fit.converged { "converged" } else { "NOT converged" },
            rep.fit.passes,
            rep.fit.grad_norm,
            rep.total_passes
        );
    } else {
        println!(
            "reference lr (adagrad): {samples} samples in {secs:.1} s, {:.0} samples/s",
            samples as f64 / secs.max(1e-9)
        );
    }
    let oracle = o_auc
        .map(|o| format!(" (oracle auc {o:.4})"))
        .unwrap_or_default();
    println!(
        "  eval auc {a_auc:.4}  logloss {a_ll:.4}  on {} examples{oracle}",
        labels.len()
    );
    if skipped > 0 {
        println!("  skipped {skipped} bad lines");
    }
    Ok(())
}

/// The train section of `starwire report`: the comm-bound configuration
/// on the local cluster (1 PS, 2 workers), per backend and fusion setting.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReportTrain;

impl crate::report::TrainSuite for ReportTrain {
    fn run(&self, case: &crate::report::TrainCase) -> Result<crate::report::TrainResult, String> {
        let backend = check_backend(case.backend)?;
        let cfg = TrainConfig {
            backend,
            model: parse_model(&case.model)?,
            embedding_dim: case.embedding_dim,
            batch_size: case.batch_size,
            steps: Some(case.steps),
            tensor_fuse: case.fusion,
            eval_examples: 2_048,
            ps_reactors: 1,
            ..TrainConfig::default()
        };
        let r = starwire_train::run_local(&cfg).map_err(|e| e.to_string())?;
        Ok(crate::report::TrainResult {
            samples_per_s: r.samples_per_s,
            steps: r.steps,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    fn args(extra: &[&str]) -> TrainArgs {
        Cli::try_parse_from(std::iter::once("train").chain(extra.iter().copied()))
            .unwrap()
            .train
    }

    #[test]
    fn the_default_batch_shrinks_only_for_synchronous_runs_past_32_workers() {
        let batch = |flags: &[&str], workers| config(&args(flags), 1, workers).unwrap().batch_size;
        assert_eq!(batch(&[], 64), 512);
        assert_eq!(batch(&["--sync"], 2), 512);
        assert_eq!(batch(&["--sync"], 32), 512);
        assert_eq!(batch(&["--sync"], 33), 496);
        assert_eq!(batch(&["--sync"], 64), 256);
        assert_eq!(batch(&["--sync"], 128), 128);
        assert_eq!(batch(&["--sync"], 20_000), 1);
        assert_eq!(batch(&["--sync", "--batch-size", "512"], 64), 512);
    }

    #[test]
    fn counts_that_size_threads_and_memory_are_bounded() {
        for (flag, max) in [
            ("--compute-threads", MAX_COMPUTE_THREADS),
            ("--prefetch", MAX_PREFETCH),
            ("--default-value-dim", MAX_DEFAULT_VALUE_DIM),
            ("--embedding-dim", starwire_graph::MAX_WIDTH),
            ("--filter-capacity", MAX_FILTER_CAPACITY),
        ] {
            let at = max.to_string();
            assert!(Cli::try_parse_from(["train", flag, &at]).is_ok(), "{flag}");
            let past = (max + 1).to_string();
            let e = Cli::try_parse_from(["train", flag, &past]).err().unwrap();
            assert!(e.to_string().contains(flag), "{e}");
        }
        assert_eq!(
            args(&["--default-value-dim", "65536"]).default_value_dim,
            65536
        );
        assert_eq!(args(&["--default-value-dim", "0"]).default_value_dim, 0);
        assert_eq!(args(&["--prefetch", "0"]).prefetch, Some(0));
        assert!(Cli::try_parse_from(["train", "--filter-capacity", "0"]).is_err());
        let cfg = config(&args(&["--filter-capacity", "1000"]), 1, 2).unwrap();
        assert_eq!(cfg.filter_capacity, 1000);
    }

    #[test]
    fn an_l2_strength_is_finite_and_0_or_more() {
        assert_eq!(non_negative_f64("0"), Ok(0.0));
        assert_eq!(non_negative_f64(" 1e-4 "), Ok(1e-4));
        for bad in ["-1", "nan", "inf", "-inf", "x", ""] {
            assert!(non_negative_f64(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_local_cluster_needs_a_connection_per_worker_and_evaluator_and_shard() {
        let check = |flags: &[&str], workers, reactors| {
            let a = args(flags);
            let mut cfg = config(&a, 1, workers).unwrap();
            cfg.ps_reactors = reactors;
            check_local_connections(&mut cfg, a.guard.max_connections.is_some())
                .map(|()| cfg.guard.max_connections)
        };
        assert_eq!(check(&["--max-connections", "6"], 2, 2), Ok(6));
        let e = check(&["--max-connections", "5"], 2, 2).unwrap_err();
        assert!(e.contains("--max-connections 6 or more"), "{e}");
        assert!(check(&["--max-connections", "1"], 2, 1).is_err());
        let inproc = ["--backend", "inproc", "--max-connections", "1"];
        assert_eq!(check(&inproc, 8, 4), Ok(1));
        // Not given: the default, raised where the cluster needs more.
        assert_eq!(check(&[], 2, 2), Ok(1024));
        assert_eq!(check(&[], 1024, 1), Ok(1025));
        assert_eq!(check(&[], 128, 8), Ok(129 * 8));
    }

    #[test]
    fn turn_steps_need_a_bound() {
        assert_eq!(turn_steps(&args(&[]), Some(4)), Ok(None));
        assert_eq!(
            turn_steps(&args(&["--turn-steps", "3"]), Some(4)),
            Ok(Some(3))
        );
        let e = turn_steps(&args(&["--turn-steps", "3"]), None).unwrap_err();
        assert!(e.contains("--bounded-delay"), "{e}");
        assert!(Cli::try_parse_from(["train", "--turn-steps", "0"]).is_err());
    }

    #[test]
    fn bounded_delay_defaults_for_many_asynchronous_workers_and_refuses_sync_and_grpc() {
        let d = starwire_train::cluster::DEFAULT_BOUNDED_DELAY;
        assert_eq!(bounded_delay(&args(&[]), 64), Ok(Some(d)));
        assert_eq!(bounded_delay(&args(&[]), 2), Ok(None));
        assert_eq!(bounded_delay(&args(&["--sync"]), 64), Ok(None));
        let off = args(&["--bounded-delay", "off"]);
        assert_eq!(bounded_delay(&off, 64), Ok(None));
        assert_eq!(
            bounded_delay(&args(&["--bounded-delay", "7"]), 2),
            Ok(Some(7))
        );
        let sync = args(&["--bounded-delay", "7", "--sync"]);
        assert!(bounded_delay(&sync, 64).unwrap_err().contains("--sync"));
        let mut grpc = args(&[]);
        grpc.backend = "grpc".into();
        assert_eq!(bounded_delay(&grpc, 64), Ok(None));
        grpc.bounded_delay = Some(BoundedDelay(Some(3)));
        assert!(bounded_delay(&grpc, 64).unwrap_err().contains("grpc"));
    }
}

//! What a run reports: its metrics per interval and at the end (`--json`
//! prints a [`TrainReport`]).

use std::path::PathBuf;

use serde::Serialize;
use starwire_ps::AssignmentReport;

use super::failover::Failover;
use super::ReactorReport;

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
    /// Examples per step per worker (`--batch-size`, or its default).
    pub batch_size: usize,
    /// `--bounded-delay` of asynchronous training (none: no bound).
    pub bounded_delay: Option<u64>,
    /// Steps each worker took in a row in the bounded order
    /// (`--turn-steps` or its default; none without a bound).
    pub turn_steps: Option<u64>,
    /// Workers hand their requests to network reactors
    /// (`--worker-handoff on` on a backend with reactors).
    pub worker_handoff: bool,
    /// Batches each worker read ahead (`--prefetch` or its default).
    pub prefetch: usize,
    /// Steps run, all workers together.
    pub steps: u64,
    /// Examples trained on in this session (a roll-back's retrained
    /// examples count again).
    pub samples: u64,
    /// Examples whose gradients the model holds at the end, summed over
    /// the workers of the report: each worker's position resumed from plus
    /// what it trained since, so examples trained again after a roll-back
    /// count once.
    pub examples_trained: u64,
    /// Examples an uninterrupted run of the same flags trains (none: the
    /// data's size is not known without reading it, as for Criteo files).
    pub examples_planned: Option<u64>,
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
    /// The per-PS loads of the variable assignment; the JSON key is
    /// `placement`, after the `--placement` flag.
    #[serde(rename = "placement")]
    pub assignment: AssignmentReport,
    /// Lines skipped as bad (Criteo with `--skip-bad-lines`), over every
    /// epoch of this session and every worker.
    pub skipped_lines: u64,
    /// The checkpoint written, if any.
    pub checkpoint: Option<PathBuf>,
    /// The step the run resumed from (a restored checkpoint), if any.
    pub resumed_from_step: Option<u64>,
    /// PS restarts the worker went through (`starwire worker` with
    /// `--checkpoint-dir`): the step rolled back to and how long the
    /// reconnect took.
    pub failovers: Vec<Failover>,
    /// Per-shard counters.
    pub shard_stats: Vec<serde_json::Value>,
    /// Global steps each shard applied between a gradient's pull and its
    /// push, over every worker's pushes (`crate::staleness`).
    pub staleness: crate::staleness::Staleness,
    /// The reactors of this process: PS reactors, then each worker's
    /// network threads (its network reactors with the hand-off, else the
    /// worker thread).
    pub reactors: Vec<ReactorReport>,
}

/// The outcome of one PS task (`starwire ps --json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct PsTaskReport {
    /// Per-shard counters.
    pub shards: Vec<serde_json::Value>,
    /// The task's reactors.
    pub reactors: Vec<ReactorReport>,
}

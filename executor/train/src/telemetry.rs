//! The trainer's live counters and progress lines: what a PS shard and a
//! worker publish into the run's [`Telemetry`] (read by `starwire
//! --metrics-addr`), and the progress they log every `--log-every` steps
//! (tracing target `progress`).
//!
//! A shard publishes the totals its [`PsShard`] keeps anyway, with plain
//! relaxed stores after each request (one request carries a whole step's
//! keys for the shard); a worker publishes once per exchange and per
//! step; a PS reactor publishes its driver's system calls a few times a
//! second ([`Published`]). Nothing here locks or allocates after the cells
//! are made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use starwire_ps::{PsShard, Var};
use starwire_telemetry::{Counter, Gauge, Histogram, Telemetry, DURATION_BOUNDS};
use starwire_transport::reactor::{ParkWaker, Parked, ReactorState};
use starwire_transport::{Driver, Endpoint, Service};

use crate::net::{Exchange, Reply, Request, Traffic};
use crate::TrainError;

fn bytes_cells(t: &Telemetry, backend: &str) -> (Arc<Counter>, Arc<Counter>) {
    let help = "Message bytes (request and reply bodies) this process sent and received";
    (
        t.counter(
            "starwire_transport_bytes",
            help,
            &[("backend", backend), ("direction", "sent")],
        ),
        t.counter(
            "starwire_transport_bytes",
            help,
            &[("backend", backend), ("direction", "received")],
        ),
    )
}

/// The first multiple of `every` above `step` (never, for 0).
fn next_multiple(step: u64, every: u64) -> u64 {
    step.checked_div(every)
        .map_or(u64::MAX, |q| (q + 1).saturating_mul(every))
}

/// A shard's cells and progress.
#[derive(Debug)]
pub struct ShardTelemetry {
    shard: usize,
    pulls: Arc<Counter>,
    pushes: Arc<Counter>,
    errors: Arc<Counter>,
    received: Arc<Counter>,
    sent: Arc<Counter>,
    global_step: Arc<Gauge>,
    evicted: Arc<Counter>,
    /// One per embedding table of the shard, in the shard's order.
    rows: Vec<Arc<Gauge>>,
    log_every: u64,
    next_log: u64,
    /// When the last progress line was logged (or the shard started), at
    /// which global step and after how many requests.
    last_log: (Instant, u64, u64),
}

impl ShardTelemetry {
    /// Cells for `shard` in `t`; progress every `log_every` global steps
    /// (0: none).
    pub fn new(t: &Telemetry, backend: &str, shard: &PsShard, log_every: u64) -> Self {
        let s = shard.shard_index().to_string();
        let req = |kind| {
            t.counter(
                "starwire_ps_requests",
                "PS requests served, by shard and kind",
                &[("shard", &s), ("kind", kind)],
            )
        };
        let (sent, received) = bytes_cells(t, backend);
        let rows = shard
            .vars()
            .iter()
            .filter_map(|v| match v {
                Var::Table(tb) => Some(t.gauge(
                    "starwire_ps_rows",
                    "Embedding rows a PS shard holds, by shard and table",
                    &[("shard", &s), ("table", &tb.def().name)],
                )),
                Var::Dense(_) => None,
            })
            .collect();
        let step = shard.global_step();
        Self {
            shard: shard.shard_index(),
            pulls: req("pull"),
            pushes: req("push"),
            errors: t.counter(
                "starwire_ps_request_errors",
                "PS requests rejected with an error status, by shard",
                &[("shard", &s)],
            ),
            received,
            sent,
            global_step: t.gauge(
                "starwire_ps_global_step",
                "A PS shard's global step",
                &[("shard", &s)],
            ),
            evicted: t.counter(
                "starwire_ps_evicted_rows",
                "Embedding rows evicted (steps_to_live), by shard",
                &[("shard", &s)],
            ),
            rows,
            log_every,
            next_log: next_multiple(step, log_every),
            last_log: (
                Instant::now(),
                step,
                shard.stats().pulls + shard.stats().pushes,
            ),
        }
    }

    /// Publish `shard`'s totals, and log progress when its global step has
    /// passed the next multiple of `--log-every`.
    pub fn publish(&mut self, shard: &PsShard) {
        let s = shard.stats();
        self.pulls.set(s.pulls);
        self.pushes.set(s.pushes);
        self.errors.set(s.errors);
        self.received.set(s.request_bytes);
        self.sent.set(s.response_bytes);
        let step = shard.global_step();
        self.global_step.set(step as f64);
        let mut rows = self.rows.iter();
        let mut evicted = 0;
        for v in shard.vars() {
            if let Var::Table(t) = v {
                if let Some(g) = rows.next() {
                    g.set(t.len() as f64);
                }
                evicted += t.stats().evicted;
            }
        }
        self.evicted.set(evicted);
        if step >= self.next_log {
            self.next_log = next_multiple(step, self.log_every);
            self.log_progress(step, s.pulls + s.pushes);
        }
    }

    fn log_progress(&mut self, step: u64, requests: u64) {
        let now = Instant::now();
        let (t, s0, r0) = self.last_log;
        let secs = now.saturating_duration_since(t).as_secs_f64().max(1e-9);
        let steps_per_s = step.saturating_sub(s0) as f64 / secs;
        let requests_per_s = requests.saturating_sub(r0) as f64 / secs;
        tracing::info!(
            target: "progress",
            shard = self.shard,
            global_step = step,
            steps_per_s = format_args!("{steps_per_s:.1}"),
            requests_per_s = format_args!("{requests_per_s:.0}"),
            "ps"
        );
        self.last_log = (now, step, requests);
    }
}

/// A worker's cells and progress.
#[derive(Debug)]
pub struct WorkerTelemetry {
    worker: usize,
    samples: Arc<Counter>,
    steps: Arc<Counter>,
    loss: Arc<Gauge>,
    step_seconds: Arc<Histogram>,
    request_seconds: Arc<Histogram>,
    sent: Arc<Counter>,
    received: Arc<Counter>,
    /// Traffic of the worker's connections before this session (they may
    /// have carried a resumed worker's earlier exchanges).
    traffic_base: Traffic,
    log_every: u64,
    started: Instant,
}

impl WorkerTelemetry {
    /// Cells for worker `worker` in `t`; progress every `log_every` steps
    /// (0: none). `traffic_base` is what the worker's connections carried
    /// before (published counts start from it).
    pub fn new(
        t: &Telemetry,
        backend: &str,
        worker: usize,
        log_every: u64,
        traffic_base: Traffic,
    ) -> Self {
        let w = worker.to_string();
        let (sent, received) = bytes_cells(t, backend);
        Self {
            worker,
            samples: t.counter(
                "starwire_worker_samples",
                "Training examples a worker trained on",
                &[("worker", &w)],
            ),
            steps: t.counter(
                "starwire_worker_steps",
                "Training steps a worker ran",
                &[("worker", &w)],
            ),
            loss: t.gauge(
                "starwire_worker_loss",
                "A worker's mean training loss since its last epoch began",
                &[("worker", &w)],
            ),
            step_seconds: t.histogram(
                "starwire_step_duration_seconds",
                "Worker training steps (exchange with every shard and compute)",
                &[],
                DURATION_BOUNDS,
            ),
            request_seconds: t.histogram(
                "starwire_request_duration_seconds",
                "Worker exchanges with the PS shards: requests sent to the reply of the last",
                &[],
                DURATION_BOUNDS,
            ),
            sent,
            received,
            traffic_base,
            log_every,
            started: Instant::now(),
        }
    }

    /// The net the worker trains over, timed: every exchange is observed
    /// and its bytes published.
    pub fn timed<'a>(&'a self, net: &'a mut dyn Exchange) -> TimedExchange<'a> {
        TimedExchange { net, cells: self }
    }

    fn exchanged(&self, took: Duration, traffic: Traffic) {
        self.request_seconds.observe(took);
        self.sent
            .set(traffic.sent.saturating_sub(self.traffic_base.sent));
        self.received
            .set(traffic.received.saturating_sub(self.traffic_base.received));
    }

    /// One step done: `steps` and `samples` so far in this session, the
    /// step's duration, the mean loss of the epoch so far; logs progress
    /// every `--log-every` steps (`steps_done` counts resumed steps too).
    pub fn stepped(&self, p: StepProgress) {
        self.step_seconds.observe(p.took);
        self.samples.set(p.samples);
        self.steps.set(p.steps);
        self.loss.set(p.loss);
        if self.log_every > 0 && p.steps_done % self.log_every == 0 {
            let secs = self.started.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(
                target: "progress",
                worker = self.worker,
                step = p.steps_done,
                epoch = p.epoch,
                loss = format_args!("{:.4}", p.loss),
                global_step = p.global_step,
                samples_per_s = format_args!("{:.0}", p.samples as f64 / secs),
                "worker"
            );
        }
    }
}

/// What [`WorkerTelemetry::stepped`] publishes.
#[derive(Debug, Clone, Copy)]
pub struct StepProgress {
    /// Steps of this session.
    pub steps: u64,
    /// Steps including those before a resume.
    pub steps_done: u64,
    /// Examples of this session.
    pub samples: u64,
    /// The epoch.
    pub epoch: u64,
    /// Mean loss of the epoch so far.
    pub loss: f64,
    /// Highest global step seen.
    pub global_step: u64,
    /// How long the step took.
    pub took: Duration,
}

/// An [`Exchange`] whose round trips are observed (see
/// [`WorkerTelemetry::timed`]).
pub struct TimedExchange<'a> {
    net: &'a mut dyn Exchange,
    cells: &'a WorkerTelemetry,
}

impl std::fmt::Debug for TimedExchange<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimedExchange")
            .field("cells", &self.cells)
            .finish_non_exhaustive()
    }
}

impl Exchange for TimedExchange<'_> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let t0 = Instant::now();
        let r = self.net.exchange(reqs, replies);
        self.cells.exchanged(t0.elapsed(), self.net.traffic());
        r
    }

    fn traffic(&self) -> Traffic {
        self.net.traffic()
    }
}

/// How often a PS reactor publishes its driver's counters: they are summed
/// over the driver's connections, so not on every turn.
const DRIVER_PUBLISH_EVERY: Duration = Duration::from_millis(250);

/// A PS reactor's endpoint (none when its driver failed to start on the
/// reactor's thread) that publishes its driver's system calls
/// (`starwire_transport_syscalls_total{backend}`) every
/// [`DRIVER_PUBLISH_EVERY`] of turns, and once more when taken apart.
pub struct Published<D: Driver, S> {
    endpoint: Option<Endpoint<D, S>>,
    syscalls: fn(&D) -> Option<u64>,
    cell: Arc<Counter>,
    next: Option<Instant>,
}

impl<D: Driver, S> std::fmt::Debug for Published<D, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published")
            .field("running", &self.endpoint.is_some())
            .field("syscalls", &self.cell.get())
            .finish_non_exhaustive()
    }
}

impl<D: Driver, S: Service<D>> Published<D, S> {
    /// `endpoint`, its driver's system calls (as `syscalls` counts them)
    /// published into `t` under `backend`.
    pub fn new(
        endpoint: Option<Endpoint<D, S>>,
        t: &Telemetry,
        backend: &str,
        syscalls: fn(&D) -> Option<u64>,
    ) -> Self {
        Self {
            endpoint,
            syscalls,
            cell: t.counter(
                "starwire_transport_syscalls",
                "System calls the PS reactors' drivers made (reads, writes, io_uring enters)",
                &[("backend", backend)],
            ),
            next: None,
        }
    }

    fn publish(&self) {
        let n = self
            .endpoint
            .as_ref()
            .and_then(|e| (self.syscalls)(e.sessions().driver()));
        // A closed connection takes its counts with it: the published
        // total never goes back.
        if let Some(n) = n {
            self.cell.set(n.max(self.cell.get()));
        }
    }

    /// The endpoint, after a last publication.
    pub fn into_inner(self) -> Option<Endpoint<D, S>> {
        self.publish();
        self.endpoint
    }
}

impl<D, S> ReactorState for Published<D, S>
where
    D: Driver + Send,
    S: Service<D> + Send,
{
    fn turn(&mut self, now: Instant) -> bool {
        let busy = self.endpoint.turn(now);
        if self.next.map_or(true, |t| now >= t) {
            self.next = Some(now + DRIVER_PUBLISH_EVERY);
            self.publish();
        }
        busy
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.endpoint.next_deadline()
    }

    fn finished(&self) -> bool {
        self.endpoint.finished()
    }

    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        self.endpoint.park(waker, timeout)
    }
}

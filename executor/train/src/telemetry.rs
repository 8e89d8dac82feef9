//! The trainer's live counters and progress lines: what a PS shard and a
//! worker publish into the run's [`Telemetry`] (read by `starwire
//! --metrics-addr`), and the progress they log every `--log-every` steps
//! (tracing target `progress`).
//!
//! A shard publishes the totals its [`PsShard`] keeps anyway, with plain
//! relaxed stores after each request (one request carries a whole step's
//! keys for the shard); a worker publishes once per exchange and per
//! step; a reactor (a PS reactor, a worker's network reactor, a worker
//! thread that turns its own endpoint) publishes its driver's counters
//! ([`Driver::counters`]) a few times a second ([`DriverCells`],
//! [`Published`]). Nothing here locks or allocates after the cells are
//! made (a driver's cells are made at its first publication).

use std::sync::Arc;
use std::time::{Duration, Instant};

use starwire_ps::{PsShard, Var};
use starwire_telemetry::{Counter, Gauge, Histogram, Telemetry, DURATION_BOUNDS};
use starwire_transport::reactor::{ParkWaker, Parked, ReactorState};
use starwire_transport::{Driver, DriverCounters, Endpoint, Service};

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
    /// The counters of the driver of a worker that turns its own endpoint.
    driver: std::cell::RefCell<DriverCells>,
    /// Traffic of the worker's connections before this session (they may
    /// have carried a resumed worker's earlier exchanges).
    traffic_base: Traffic,
    log_every: u64,
    started: Instant,
    /// The losses summed, and counted, since the gauge was last set (the
    /// worker thread alone uses the cells).
    window: std::cell::Cell<(f64, u64)>,
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
                "A worker's mean training loss over its last window of steps (--log-every, else 100)",
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
            driver: std::cell::RefCell::new(DriverCells::new(t, backend)),
            traffic_base,
            log_every,
            started: Instant::now(),
            window: std::cell::Cell::new((0.0, 0)),
        }
    }

    /// The net the worker trains over, timed: every exchange is observed
    /// and its bytes published.
    pub fn timed<'a>(&'a self, net: &'a mut dyn Exchange) -> TimedExchange<'a> {
        TimedExchange { net, cells: self }
    }

    fn exchanged(&self, took: Duration, traffic: Traffic, net: &dyn Exchange, now: Instant) {
        self.request_seconds.observe(took);
        let mut driver = self.driver.borrow_mut();
        if driver.due(now) {
            if let Some(c) = net.driver_counters() {
                driver.publish(&c);
            }
        }
        self.sent
            .set(traffic.sent.saturating_sub(self.traffic_base.sent));
        self.received
            .set(traffic.received.saturating_sub(self.traffic_base.received));
    }

    /// One step done: `steps` and `samples` so far in this session, the
    /// step's duration and loss. The loss gauge and the progress line give
    /// the mean loss of a window of steps: those since the last progress
    /// line (every `--log-every` steps, counting resumed steps too), or the
    /// last [`LOSS_WINDOW`] steps without progress lines.
    pub fn stepped(&self, p: StepProgress) {
        self.step_seconds.observe(p.took);
        self.samples.set(p.samples);
        self.steps.set(p.steps);
        let (sum, n) = self.window.get();
        let (sum, n) = (sum + p.loss, n + 1);
        let mean = sum / n as f64;
        let every = if self.log_every > 0 {
            self.log_every
        } else {
            LOSS_WINDOW
        };
        if p.steps_done % every != 0 {
            self.window.set((sum, n));
            return;
        }
        self.window.set((0.0, 0));
        self.loss.set(mean);
        if self.log_every > 0 {
            let secs = self.started.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(
                target: "progress",
                worker = self.worker,
                step = p.steps_done,
                epoch = p.epoch,
                loss = format_args!("{mean:.4}"),
                global_step = p.global_step,
                samples_per_s = format_args!("{:.0}", p.samples as f64 / secs),
                "worker"
            );
        }
    }
}

/// Steps of the loss gauge's window when there are no progress lines.
pub const LOSS_WINDOW: u64 = 100;

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
    /// The step's training loss.
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
        let now = Instant::now();
        self.cells
            .exchanged(now - t0, self.net.traffic(), &*self.net, now);
        r
    }

    fn traffic(&self) -> Traffic {
        self.net.traffic()
    }

    fn driver_counters(&self) -> Option<DriverCounters> {
        self.net.driver_counters()
    }

    fn sender_known(&self) -> bool {
        self.net.sender_known()
    }
}

/// How often a reactor publishes its driver's counters: some are summed
/// over the driver's connections, so not on every turn.
pub const DRIVER_PUBLISH_EVERY: Duration = Duration::from_millis(250);

/// A family of driver counters: name, help, and the label beside
/// `backend`, if any.
type DriverFamily = (
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
);

/// The families of [`DriverCounters`], in [`counter_values`]'s order.
const DRIVER_FAMILIES: [DriverFamily; 10] = [
    (
        "starwire_transport_syscalls",
        "System calls the drivers made on the datapath (socket reads and writes, io_uring enters, completion-channel reads)",
        None,
    ),
    (
        "starwire_transport_packets",
        "Packets the datagram drivers handed to and took from their links",
        Some(("direction", "sent")),
    ),
    (
        "starwire_transport_packets",
        "Packets the datagram drivers handed to and took from their links",
        Some(("direction", "received")),
    ),
    (
        "starwire_transport_retransmits",
        "Data packets the reliable-datagram cores sent again",
        None,
    ),
    (
        "starwire_transport_retransmit_timeouts",
        "Retransmission timeouts of the reliable-datagram cores",
        None,
    ),
    (
        "starwire_transport_cwnd_reductions",
        "Loss episodes that halved a reliable-datagram core's congestion window",
        None,
    ),
    (
        "starwire_transport_backlog_drops",
        "Data packets a reliable-datagram core dropped unacknowledged, its application's received frames at their bound (resent by the peer)",
        None,
    ),
    (
        "starwire_transport_doorbells",
        "Doorbells the RDMA drivers rang (at most one per flush)",
        None,
    ),
    (
        "starwire_transport_credit_stalls",
        "RDMA posting passes that left frames queued for lack of ring credit",
        None,
    ),
    (
        "starwire_transport_receive_stalls",
        "RDMA posting passes that left frames queued for lack of the peer's receive work requests",
        None,
    ),
];

fn counter_values(c: &DriverCounters) -> [Option<u64>; 10] {
    [
        c.syscalls,
        c.packets_sent,
        c.packets_received,
        c.retransmits,
        c.retransmit_timeouts,
        c.cwnd_reductions,
        c.backlog_drops,
        c.doorbells,
        c.credit_stalls,
        c.receive_stalls,
    ]
}

/// One reactor's cells of its driver's counters
/// (`starwire_transport_*_total{backend}`), made at the first publication
/// of each counter the driver keeps: a TCP reactor has no retransmission
/// series, an RDMA one no syscall series unless it counts them.
#[derive(Debug)]
pub struct DriverCells {
    telemetry: Telemetry,
    backend: String,
    cells: [Option<Arc<Counter>>; 10],
    next: Option<Instant>,
}

impl DriverCells {
    /// Cells in `t` for a driver of `backend`.
    pub fn new(t: &Telemetry, backend: &str) -> Self {
        Self {
            telemetry: t.clone(),
            backend: backend.to_owned(),
            cells: Default::default(),
            next: None,
        }
    }

    /// Whether a publication is due at `now`: at the first call, then
    /// every [`DRIVER_PUBLISH_EVERY`].
    pub fn due(&mut self, now: Instant) -> bool {
        if self.next.is_some_and(|t| now < t) {
            return false;
        }
        self.next = Some(now + DRIVER_PUBLISH_EVERY);
        true
    }

    /// Publish `c`. A closed connection may take its counts with it (a
    /// driver that sums its attached connections): a published total
    /// never goes back.
    pub fn publish(&mut self, c: &DriverCounters) {
        for (i, v) in counter_values(c).into_iter().enumerate() {
            let Some(v) = v else { continue };
            let (name, help, extra) = DRIVER_FAMILIES[i];
            let cell = self.cells[i].get_or_insert_with(|| {
                let mut labels = vec![("backend", self.backend.as_str())];
                labels.extend(extra);
                self.telemetry.counter(name, help, &labels)
            });
            cell.set(v.max(cell.get()));
        }
    }
}

/// A reactor's endpoint (none when its driver failed to start on the
/// reactor's thread) that publishes its driver's counters
/// ([`DriverCells`]) every [`DRIVER_PUBLISH_EVERY`] of turns, and once
/// more when taken apart: the PS reactors and a worker's network reactors.
pub struct Published<D: Driver, S> {
    endpoint: Option<Endpoint<D, S>>,
    cells: DriverCells,
}

impl<D: Driver, S> std::fmt::Debug for Published<D, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published")
            .field("running", &self.endpoint.is_some())
            .field("cells", &self.cells)
            .finish_non_exhaustive()
    }
}

impl<D: Driver, S: Service<D>> Published<D, S> {
    /// `endpoint`, its driver's counters published into `t` under
    /// `backend`.
    pub fn new(endpoint: Option<Endpoint<D, S>>, t: &Telemetry, backend: &str) -> Self {
        Self {
            endpoint,
            cells: DriverCells::new(t, backend),
        }
    }

    fn publish(&mut self) {
        if let Some(e) = &self.endpoint {
            self.cells.publish(&e.sessions().driver().counters());
        }
    }

    /// The endpoint, after a last publication.
    pub fn into_inner(mut self) -> Option<Endpoint<D, S>> {
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
        if self.cells.due(now) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_ps::{Init, ShardConfig, VarDef, VarKind};
    use starwire_telemetry::{Family, Value};
    use starwire_wire::ps::PullRequestWriter;

    fn sample(f: &[Family], name: &str, labels: &[(&str, &str)]) -> Option<Value> {
        let fam = f.iter().find(|f| f.name == name)?;
        fam.samples
            .iter()
            .find(|(l, _)| {
                l.len() == labels.len()
                    && l.iter()
                        .zip(labels)
                        .all(|((k, v), (k2, v2))| k == k2 && v == v2)
            })
            .map(|(_, v)| v.clone())
    }

    #[test]
    fn a_shard_publishes_requests_rows_and_bytes() {
        let vars = [VarDef {
            id: 1,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 4 },
            init: Init::Uniform { scale: 0.1 },
        }];
        let mut shard = PsShard::new(3, &vars, ShardConfig::default());
        let t = Telemetry::new();
        let mut cells = ShardTelemetry::new(&t, "tcp", &shard, 0);
        let mut body = Vec::new();
        PullRequestWriter::new(&mut body).rows(1, &[10, 11, 12]);
        let mut out = Vec::new();
        shard.handle_pull(&body, &mut out).unwrap();
        cells.publish(&shard);
        let f = t.families();
        let labels = [("shard", "3"), ("kind", "pull")];
        assert_eq!(
            sample(&f, "starwire_ps_requests", &labels),
            Some(Value::Counter(1))
        );
        assert_eq!(
            sample(&f, "starwire_ps_rows", &[("shard", "3"), ("table", "emb")]),
            Some(Value::Gauge(3.0))
        );
        let sent = [("backend", "tcp"), ("direction", "sent")];
        assert_eq!(
            sample(&f, "starwire_transport_bytes", &sent),
            Some(Value::Counter(out.len() as u64))
        );
    }

    #[test]
    fn the_loss_gauge_is_the_mean_of_a_window() {
        let t = Telemetry::new();
        let w = WorkerTelemetry::new(&t, "tcp", 1, 2, Traffic::default());
        let step = |n: u64, loss: f64| {
            w.stepped(StepProgress {
                steps: n,
                steps_done: n,
                samples: 10 * n,
                epoch: 0,
                loss,
                global_step: n,
                took: Duration::from_millis(1),
            })
        };
        let loss = || sample(&t.families(), "starwire_worker_loss", &[("worker", "1")]);
        step(1, 1.0);
        assert_eq!(loss(), Some(Value::Gauge(0.0)));
        step(2, 3.0);
        assert_eq!(loss(), Some(Value::Gauge(2.0)));
        step(3, 5.0);
        step(4, 7.0);
        assert_eq!(loss(), Some(Value::Gauge(6.0)));
        let samples = sample(&t.families(), "starwire_worker_samples", &[("worker", "1")]);
        assert_eq!(samples, Some(Value::Counter(40)));
        let Some(Value::Histogram(h)) =
            sample(&t.families(), "starwire_step_duration_seconds", &[])
        else {
            panic!("no step histogram");
        };
        assert_eq!(h.count(), 4);
    }

    #[test]
    fn driver_cells_publish_what_the_driver_keeps_and_never_go_back() {
        let t = Telemetry::new();
        let mut cells = DriverCells::new(&t, "dpdk");
        let t0 = Instant::now();
        assert!(cells.due(t0));
        assert!(!cells.due(t0 + DRIVER_PUBLISH_EVERY / 2));
        assert!(cells.due(t0 + DRIVER_PUBLISH_EVERY));
        // Nothing kept, nothing registered.
        cells.publish(&DriverCounters::default());
        assert!(t.families().is_empty());
        let mut c = DriverCounters {
            packets_sent: Some(10),
            packets_received: Some(9),
            retransmits: Some(2),
            ..DriverCounters::default()
        };
        cells.publish(&c);
        let f = t.families();
        let names: Vec<_> = f.iter().map(|f| f.name).collect();
        assert_eq!(
            names,
            [
                "starwire_transport_packets",
                "starwire_transport_retransmits"
            ]
        );
        let b = [("backend", "dpdk")];
        assert_eq!(
            sample(&f, "starwire_transport_retransmits", &b),
            Some(Value::Counter(2))
        );
        assert_eq!(
            sample(
                &f,
                "starwire_transport_packets",
                &[("backend", "dpdk"), ("direction", "received")]
            ),
            Some(Value::Counter(9))
        );
        // A connection that closed took its counts: the total stays.
        c.retransmits = Some(1);
        cells.publish(&c);
        assert_eq!(
            sample(&t.families(), "starwire_transport_retransmits", &b),
            Some(Value::Counter(2))
        );
    }

    #[test]
    fn next_multiple_never_divides_by_zero() {
        assert_eq!(next_multiple(0, 100), 100);
        assert_eq!(next_multiple(100, 100), 200);
        assert_eq!(next_multiple(150, 100), 200);
        assert_eq!(next_multiple(5, 0), u64::MAX);
        assert_eq!(next_multiple(u64::MAX - 1, 7), u64::MAX);
    }
}

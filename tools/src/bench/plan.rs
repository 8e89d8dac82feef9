//! The plan of a `starwire bench` invocation, its runs, and the result
//! line each run (or the median of its repeats) prints.

use super::*;

/// What a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Ping-pong echo, one outstanding; round-trip percentiles.
    Lat,
    /// Requests with K outstanding, each answered with an empty ack.
    Rate,
    /// One-way stream of payload with K outstanding (acked).
    Bw,
    /// Steps of N tensors to one peer, fused vs unfused.
    Fuse,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Lat => "lat",
            Mode::Rate => "rate",
            Mode::Bw => "bw",
            Mode::Fuse => "fuse",
        }
    }
}

/// The whole benchmark, as sent from the client to the server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Plan {
    /// Backends, in the order they alternate.
    pub backends: Vec<Backend>,
    /// Modes.
    pub modes: Vec<Mode>,
    /// Payload sizes in bytes.
    pub sizes: Vec<usize>,
    /// `--inflight`, if given.
    pub inflight: Option<usize>,
    /// `--iters`, if given.
    pub iters: Option<u64>,
    /// `--duration` in seconds, if given.
    pub duration_s: Option<f64>,
    /// `--warmup` as a count, if given.
    pub warmup: Option<u64>,
    /// `--warmup` as a time, in seconds, if given (then `warmup` is
    /// `None`).
    #[serde(default)]
    pub warmup_s: Option<f64>,
    /// `--tensors` (fuse mode).
    pub tensors: usize,
    /// `--repeat`.
    pub repeat: usize,
    /// Busy polling on.
    pub polling: bool,
    /// Client core.
    pub client_core: Option<usize>,
    /// Server core.
    pub server_core: Option<usize>,
    /// `--connections`: data connections per run (1 from a client that
    /// predates the option).
    #[serde(default = "one")]
    pub connections: usize,
    /// `--interval`: seconds between the client's interval reports.
    #[serde(default)]
    pub interval_s: Option<f64>,
    /// `--bidirectional`: rate and bw requests are echoed, so the payload
    /// flows both ways.
    #[serde(default)]
    pub bidirectional: bool,
    /// `--cpu-util`: both ends measure their process's CPU time per run.
    #[serde(default)]
    pub cpu_util: bool,
}

pub(super) fn one() -> usize {
    1
}

/// One measurement: one backend, mode and size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// Backend.
    pub backend: Backend,
    /// Mode.
    pub mode: Mode,
    /// Payload bytes per message (per tensor in fuse mode).
    pub size: usize,
    /// Outstanding messages per connection (1 for lat).
    pub inflight: usize,
    /// Data connections, all driven by one client and one server reactor.
    #[serde(default = "one")]
    pub connections: usize,
    /// Measured iterations (steps in fuse mode); ignored with a duration.
    pub iters: u64,
    /// What comes before the measurement.
    pub warmup: Warmup,
    /// Measure for this long instead of `iters`.
    pub duration_s: Option<f64>,
    /// Tensors per step (fuse mode).
    pub tensors: usize,
    /// Largest payload of the plan (sizes the starwire frame limits
    /// identically on both ends).
    pub max_size: usize,
    /// Repetition index.
    pub rep: usize,
    /// Seconds between interval reports (client side).
    #[serde(default)]
    pub interval_s: Option<f64>,
    /// Rate and bw requests are echoed (see [`Plan::bidirectional`]).
    #[serde(default)]
    pub bidirectional: bool,
    /// Where the interval reports go (the client's `--json`).
    #[serde(skip)]
    pub intervals: IntervalOutput,
    /// `--rate`: the measured requests' schedule, in requests per second
    /// over all connections (`None`: closed loop). The client's alone: the
    /// server answers the same either way, so the plan on the wire does
    /// not carry it.
    #[serde(skip)]
    pub rate: Option<f64>,
}

impl Run {
    pub(super) fn duration(&self) -> Option<Duration> {
        self.duration_s.map(Duration::from_secs_f64)
    }

    /// Whether the server echoes every request's payload: lat always,
    /// rate and bw with `--bidirectional`.
    pub(crate) fn echoed(&self) -> bool {
        match self.mode {
            Mode::Lat => true,
            Mode::Rate | Mode::Bw => self.bidirectional,
            Mode::Fuse => false,
        }
    }

    /// Payload bits a completed message counts for in `gbps`: its request
    /// and, when bidirectional, its echo (lat counts one way).
    pub(super) fn bits_per_msg(&self) -> f64 {
        let ways = match self.mode {
            Mode::Rate | Mode::Bw if self.bidirectional => 2.0,
            _ => 1.0,
        };
        ways * self.size as f64 * 8.0
    }

    /// The `--interval` reports of this run (lat, rate and bw).
    pub(crate) fn interval_report(&self) -> Option<IntervalReport> {
        let every = self.interval_s?;
        if self.mode == Mode::Fuse {
            return None;
        }
        Some(IntervalReport::new(
            Duration::from_secs_f64(every),
            (self.backend, self.mode, self.size),
            self.bits_per_msg(),
            self.intervals,
        ))
    }
}

pub(super) fn default_iters(mode: Mode, size: usize, tensors: usize) -> u64 {
    let size = size.max(1) as u64;
    match mode {
        Mode::Lat => ((256u64 << 20) / size).clamp(100, 10_000),
        Mode::Rate => ((1u64 << 30) / size).clamp(1_000, 200_000),
        Mode::Bw => ((4u64 << 30) / size).clamp(200, 200_000),
        Mode::Fuse => (200_000 / tensors.max(1) as u64).clamp(20, 2_000),
    }
}

impl Plan {
    /// Every run, in execution order: for each mode and size, the backends
    /// alternate `repeat` times.
    pub fn runs(&self) -> Vec<Run> {
        let max_size = self.sizes.iter().copied().max().unwrap_or(0);
        let mut out = Vec::new();
        for &mode in &self.modes {
            for &size in &self.sizes {
                for rep in 0..self.repeat.max(1) {
                    for &backend in &self.backends {
                        let inflight = match mode {
                            Mode::Lat => 1,
                            Mode::Rate => self.inflight.unwrap_or(16),
                            Mode::Bw => self.inflight.unwrap_or(8),
                            Mode::Fuse => self.tensors,
                        }
                        .max(1);
                        let iters = self
                            .iters
                            .unwrap_or_else(|| default_iters(mode, size, self.tensors));
                        // Every connection starts with `inflight` requests
                        // at once: the warm-up covers that burst twice, so
                        // that the measurement starts in the steady state.
                        let burst = match mode {
                            Mode::Fuse => 0,
                            _ => 2 * (self.connections.max(1) * inflight) as u64,
                        };
                        let warmup = match (self.warmup_s, self.warmup) {
                            // A refused plan never runs: any length will do.
                            (Some(s), _) => Warmup::Time(
                                Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO),
                            ),
                            (None, Some(n)) => Warmup::Iters(n),
                            (None, None) => Warmup::Iters((iters / 10).clamp(1, 1_000).max(burst)),
                        };
                        out.push(Run {
                            backend,
                            mode,
                            size,
                            inflight,
                            connections: self.connections.max(1),
                            iters: iters.max(1),
                            warmup,
                            duration_s: self.duration_s,
                            tensors: self.tensors.max(1),
                            max_size,
                            rep,
                            interval_s: self.interval_s,
                            bidirectional: self.bidirectional,
                            intervals: IntervalOutput::default(),
                            rate: None,
                        });
                    }
                }
            }
        }
        out
    }

    /// The runs that measure something: the raw baseline has no fuse mode
    /// (its runs are skipped). The length of a bench's progress.
    pub fn measured_runs(&self) -> u64 {
        self.runs().iter().filter(|r| !r.skipped()).count() as u64
    }
}

/// Largest payload of a message: a frame of the starwire backends holds
/// it whole, header and padding included, within 256 MiB.
pub(super) const MAX_SIZE: usize = (256 << 20) - 4096;
/// Most data connections per run: each is a socket at both ends of a
/// loopback run, and an io_uring ring registers at most 1024 files.
pub(crate) const MAX_CONNECTIONS: usize = 512;
/// Most outstanding messages per connection (`--inflight`) and tensors per
/// fuse step (`--tensors`): either becomes a connection's credit window, a
/// `u32` of frames, and the client keeps one slot or tensor for each; 64 Ki
/// is far past perftest's deepest queues and the 100 tensors of a DeepRec
/// step.
pub(crate) const MAX_INFLIGHT: usize = 1 << 16;
/// See [`MAX_INFLIGHT`].
pub(super) const MAX_TENSORS: usize = 1 << 16;
/// Most runs in a plan (modes x sizes x repeat x backends): the server
/// lists them before the first one (a `Run` is about 150 B).
pub(super) const MAX_RUNS: usize = 100_000;
/// Most iterations (`--iters`, `--warmup`) of a run: over a day at
/// 10 M messages/s, and their sum cannot overflow a `u64`.
pub(super) const MAX_ITERS: u64 = 1 << 40;
/// Longest `--duration`, `--interval` and time `--warmup`, in seconds:
/// one day. Also the bound of `starwire soak`'s `--duration` and
/// `--drain`.
pub(crate) const MAX_SECONDS: f64 = 86_400.0;
/// CPUs a core number may name: `CPU_SETSIZE`, what `sched_setaffinity(2)`
/// takes through nix.
pub(super) const MAX_CPUS: usize = 1024;
/// Largest fuse step, `--tensors` x the largest size: the client builds it
/// whole, and the gRPC baseline's server accepts a message that large.
pub(super) const MAX_FUSE_STEP_BYTES: u64 = 4 << 30;
/// Largest sum of the receive buffers of a run's connections at one end
/// (`--connections` x two frames of the largest size, see
/// [`sessions::tcp_config`]): each connection's is mapped when it comes,
/// and the peer's traffic can fill it.
pub(super) const MAX_RX_MEMORY: u64 = 16 << 30;

impl Plan {
    /// The bounds of a plan: every field that sizes memory, threads or
    /// connections, and the flag combinations that make no run. The one
    /// check of both the command line (`validate`) and a `--listen`
    /// server, before it sizes or spawns anything from a client's plan.
    /// The error names the flag.
    pub fn check(&self) -> Result<(), String> {
        if self.backends.is_empty() || self.modes.is_empty() || self.sizes.is_empty() {
            return Err("--backends, --mode and --sizes must not be empty".into());
        }
        for (flag, secs) in [
            ("--duration", self.duration_s),
            ("--interval", self.interval_s),
        ] {
            if let Some(s) = secs {
                if !(s > 0.0 && s <= MAX_SECONDS) {
                    return Err(format!(
                        "{flag} {s}: expected a positive number of seconds, at most {MAX_SECONDS}"
                    ));
                }
            }
        }
        if self.bidirectional && self.modes.contains(&Mode::Fuse) {
            return Err(
                "--bidirectional applies to rate and bw (lat is always both ways); \
                 fuse mode sends one way"
                    .into(),
            );
        }
        if self.inflight == Some(0) || self.tensors == 0 || self.repeat == 0 {
            return Err("--inflight, --tensors and --repeat must be at least 1".into());
        }
        if let Some(k) = self.inflight.filter(|&k| k > MAX_INFLIGHT) {
            return Err(format!("--inflight {k}: at most {MAX_INFLIGHT}"));
        }
        if self.tensors > MAX_TENSORS {
            return Err(format!("--tensors {}: at most {MAX_TENSORS}", self.tensors));
        }
        if self.iters == Some(0) {
            return Err("--iters must be at least 1".into());
        }
        for (flag, n) in [("--iters", self.iters), ("--warmup", self.warmup)] {
            if let Some(n) = n.filter(|&n| n > MAX_ITERS) {
                return Err(format!("{flag} {n}: at most {MAX_ITERS}"));
            }
        }
        if let Some(s) = self.warmup_s {
            if self.warmup.is_some() {
                return Err("--warmup is a count or a time, not both".into());
            }
            if !(s > 0.0 && s <= MAX_SECONDS) {
                return Err(format!(
                    "--warmup {s}s: expected a positive time, at most {MAX_SECONDS} s \
                     (--warmup 0 for none)"
                ));
            }
        }
        if self.connections == 0 || self.connections > MAX_CONNECTIONS {
            return Err(format!(
                "--connections {}: expected 1 to {MAX_CONNECTIONS}",
                self.connections
            ));
        }
        if self.connections > 1 {
            if let Some(b) = self.backends.iter().find(|b| !b.multi_connection()) {
                return Err(format!(
                    "--connections {} applies to the {} backends; the {} baseline uses one \
                     connection (leave it out of --backends)",
                    self.connections,
                    multi_connection_names(),
                    b.name()
                ));
            }
            if self.modes.contains(&Mode::Fuse) {
                return Err("--connections applies to lat, rate and bw; fuse mode uses one".into());
            }
        }
        if let Some(&s) = self.sizes.iter().find(|&&s| s > MAX_SIZE) {
            return Err(format!("--sizes {s}: at most 256 MiB - 4 KiB per message"));
        }
        let runs = [self.backends.len(), self.sizes.len(), self.repeat]
            .iter()
            .try_fold(self.modes.len(), |n, &k| n.checked_mul(k))
            .filter(|&n| n <= MAX_RUNS);
        if runs.is_none() {
            return Err(format!(
                "{} modes x {} sizes x --repeat {} x {} backends: at most {MAX_RUNS} runs",
                self.modes.len(),
                self.sizes.len(),
                self.repeat,
                self.backends.len()
            ));
        }
        // Below MAX_SIZE: neither product overflows a u64.
        let max_size = self.sizes.iter().copied().max().unwrap_or(0);
        let step = self.tensors as u64 * max_size as u64;
        if self.modes.contains(&Mode::Fuse) && step > MAX_FUSE_STEP_BYTES {
            return Err(format!(
                "--tensors {} x {max_size} B: a fuse step of at most {} GiB",
                self.tensors,
                MAX_FUSE_STEP_BYTES >> 30
            ));
        }
        let rx = self.connections as u64 * sessions::tcp_config(max_size).rx_buffer_len as u64;
        if rx > MAX_RX_MEMORY {
            return Err(format!(
                "--connections {} with {max_size} B messages needs {} MiB of receive buffers \
                 at each end; at most {} GiB (fewer connections or smaller sizes)",
                self.connections,
                rx >> 20,
                MAX_RX_MEMORY >> 30
            ));
        }
        for (end, core) in [("client", self.client_core), ("server", self.server_core)] {
            if let Some(c) = core.filter(|&c| c >= MAX_CPUS) {
                return Err(format!(
                    "--cores: {end} core {c} is past the {MAX_CPUS} CPUs a thread can be \
                     pinned to"
                ));
            }
        }
        Ok(())
    }
}

/// `--rate` of `plan`: a positive, finite number of requests per second,
/// in lat and rate mode (every backend sends on a schedule; the raw
/// baseline with polling on: its blocking `recv` cannot wake at a due
/// time). The error names the flag.
pub(crate) fn check_rate(plan: &Plan, rate: Option<f64>) -> Result<(), String> {
    let Some(r) = rate else {
        return Ok(());
    };
    if !(r.is_finite() && r > 0.0) {
        return Err(format!(
            "--rate {r}: expected a positive number of requests per second"
        ));
    }
    if let Some(m) = plan
        .modes
        .iter()
        .find(|m| !matches!(m, Mode::Lat | Mode::Rate))
    {
        return Err(format!(
            "--rate applies to lat and rate mode, not {} (which send as fast as they can)",
            m.name()
        ));
    }
    if !plan.polling && plan.backends.contains(&Backend::Raw) {
        return Err(
            "--rate with the raw baseline needs --polling on (or leave raw out of --backends): \
             its blocking recv cannot wake when a request is due"
                .into(),
        );
    }
    // The schedule's length is the user's: the defaults of --iters are
    // sized for a closed loop (200,000 at 64 B in rate mode: 55 hours at
    // --rate 1).
    match (plan.iters, plan.duration_s) {
        (None, None) => {
            return Err(
                "--rate needs --iters N or --duration S: the schedule lasts N / rate seconds, \
                 or S"
                    .into(),
            )
        }
        (Some(n), _) if n as f64 / r > MAX_SECONDS => {
            return Err(format!(
                "--rate {r} --iters {n}: a schedule of {:.0} s, past {MAX_SECONDS} s",
                n as f64 / r
            ))
        }
        _ => {}
    }
    Ok(())
}

/// The backends of this binary that take `--connections`, for messages:
/// `tcp and uring`, say.
fn multi_connection_names() -> String {
    let names: Vec<&str> = Backend::compiled()
        .into_iter()
        .filter(|b| b.multi_connection())
        .map(Backend::name)
        .collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

impl Run {
    /// A run the client skips (fuse over the raw baseline).
    pub(super) fn skipped(&self) -> bool {
        self.backend == Backend::Raw && self.mode == Mode::Fuse
    }

    /// The warm-up as the result lines say it: a count, or seconds.
    fn warmup_fields(&self) -> (Option<u64>, Option<f64>) {
        match self.warmup {
            Warmup::Iters(n) => (Some(n), None),
            Warmup::Time(t) => (None, Some(t.as_secs_f64())),
        }
    }

    /// What the progress calls it: `tcp lat 64 B rep 1`.
    pub(super) fn progress_msg(&self) -> String {
        format!(
            "{} {} {} B rep {}",
            self.backend,
            self.mode.name(),
            self.size,
            self.rep + 1
        )
    }
}

/// What the client side of one run measured.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// Completed measured iterations (requests, or steps in fuse mode).
    pub iters: u64,
    /// Measured wall time.
    pub elapsed: Duration,
    /// Round-trip times (lat and rate), over every connection.
    pub rtts: Rtts,
    /// Fused steps per second (fuse mode).
    pub fused_steps_per_s: Option<f64>,
    /// Unfused steps per second (fuse mode).
    pub unfused_steps_per_s: Option<f64>,
    /// Client-side system calls per message sent or received (starwire
    /// backends; `None` for the raw baseline).
    pub syscalls_per_msg: Option<f64>,
    /// Client-side zero-copy sends and how many came back copied (uring).
    pub zero_copy: Option<(u64, u64)>,
    /// The client end's packet counters (datagram backends: dpdk).
    pub packets: Option<packets::ClientPackets>,
}

/// One result line; the field names are a contract (see docs/CLI.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResultLine {
    pub backend: Backend,
    pub mode: Mode,
    pub size: usize,
    pub inflight: usize,
    /// Data connections of the run (`inflight` is per connection).
    #[serde(default = "one")]
    pub connections: usize,
    pub iters: u64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
    pub min_us: Option<f64>,
    pub max_us: Option<f64>,
    /// 99.99th percentile round trip.
    #[serde(default)]
    pub p9999_us: Option<f64>,
    /// Mean round trip.
    #[serde(default)]
    pub avg_us: Option<f64>,
    /// Standard deviation of the round trips.
    #[serde(default)]
    pub stdev_us: Option<f64>,
    pub msgs_per_s: Option<f64>,
    pub gbps: Option<f64>,
    pub polling: bool,
    pub client_core: Option<usize>,
    pub server_core: Option<usize>,
    pub fused_steps_per_s: Option<f64>,
    pub unfused_steps_per_s: Option<f64>,
    pub tensors: Option<usize>,
    pub repeat: usize,
    #[serde(default)]
    pub syscalls_per_msg: Option<f64>,
    /// Client-side zero-copy sends (uring; null otherwise).
    #[serde(default)]
    pub zc_sends: Option<u64>,
    /// Of those, sends the kernel reported as copied; a connection switches
    /// to plain sends at the first one.
    #[serde(default)]
    pub zc_copied: Option<u64>,
    /// Rate and bw requests echoed (`--bidirectional`); `gbps` counts
    /// both ways.
    #[serde(default)]
    pub bidirectional: bool,
    /// `--cpu-util`: CPU time of the client process over the run, in % of
    /// one core (over loopback the process holds both ends).
    #[serde(default)]
    pub cpu_pct: Option<f64>,
    /// `--cpu-util` with `--connect`: the same of the server process.
    #[serde(default)]
    pub server_cpu_pct: Option<f64>,
    /// Packets received per second, summed over both ends, data and
    /// acknowledgements, warm-up included (dpdk; null otherwise).
    #[serde(default)]
    pub pps: Option<f64>,
    /// Packets sent per frame sent, over both ends: data, retransmissions
    /// and acknowledgements (dpdk; null otherwise).
    #[serde(default)]
    pub packets_per_frame: Option<f64>,
    /// Data packets sent again, over both ends (dpdk; null otherwise).
    #[serde(default)]
    pub retransmits: Option<u64>,
    /// CPU time of the client process per message sent or received, in
    /// µs, over the whole run: set-up, warm-up and close included
    /// (getrusage; over loopback the process holds both ends) (dpdk;
    /// null otherwise).
    #[serde(default)]
    pub cpu_us_per_msg: Option<f64>,
    /// The client port's `rte_eth_stats` over the run (dpdk; null
    /// otherwise).
    #[serde(default)]
    pub port_stats: Option<packets::PortCounters>,
    /// The client port's extended counters (`rte_eth_xstats_get`) that
    /// moved over the run, by the driver's names, e.g. `rx_good_packets`
    /// or a per-queue `rx_q0_packets` (dpdk; null otherwise).
    #[serde(default)]
    pub port_xstats: Option<packets::PortXstats>,
    /// How the client port's packets reach its reactors: `rte_flow`,
    /// `software` or `single` (dpdk; null otherwise).
    #[serde(default)]
    pub steering: Option<String>,
    /// Warm-up iterations before the measurement (null with a time
    /// warm-up).
    #[serde(default)]
    pub warmup: Option<u64>,
    /// Warm-up time before the measurement, in seconds (null with a count).
    #[serde(default)]
    pub warmup_s: Option<f64>,
    /// `--rate`: the requests per second the run offered on its schedule
    /// (open loop; `msgs_per_s` is what it achieved); null in the closed
    /// loop.
    #[serde(default)]
    pub offered_rate: Option<f64>,
}

impl ResultLine {
    /// Set the latency fields from `lat` (all `None` without one).
    pub(super) fn set_latency(&mut self, lat: Option<hist::LatencySummary>) {
        self.p50_us = lat.map(|l| l.p50_us);
        self.p99_us = lat.map(|l| l.p99_us);
        self.p999_us = lat.map(|l| l.p999_us);
        self.p9999_us = lat.map(|l| l.p9999_us);
        self.min_us = lat.map(|l| l.min_us);
        self.max_us = lat.map(|l| l.max_us);
        self.avg_us = lat.map(|l| l.avg_us);
        self.stdev_us = lat.map(|l| l.stdev_us);
    }
}

pub(super) fn result_line(plan: &Plan, run: &Run, m: &Measured) -> ResultLine {
    let secs = m.elapsed.as_secs_f64();
    let rate = (secs > 0.0).then(|| m.iters as f64 / secs);
    let (msgs_per_s, gbps) = match run.mode {
        Mode::Fuse => (None, None),
        _ => (rate, rate.map(|r| r * run.bits_per_msg() / 1e9)),
    };
    let (warmup, warmup_s) = run.warmup_fields();
    let mut line = ResultLine {
        backend: run.backend,
        mode: run.mode,
        size: run.size,
        inflight: run.inflight,
        connections: run.connections,
        iters: m.iters,
        p50_us: None,
        p99_us: None,
        p999_us: None,
        min_us: None,
        max_us: None,
        p9999_us: None,
        avg_us: None,
        stdev_us: None,
        msgs_per_s,
        gbps,
        polling: plan.polling,
        client_core: plan.client_core,
        server_core: plan.server_core,
        fused_steps_per_s: m.fused_steps_per_s,
        unfused_steps_per_s: m.unfused_steps_per_s,
        tensors: (run.mode == Mode::Fuse).then_some(run.tensors),
        repeat: 1,
        syscalls_per_msg: m.syscalls_per_msg,
        zc_sends: m.zero_copy.map(|z| z.0),
        zc_copied: m.zero_copy.map(|z| z.1),
        bidirectional: run.bidirectional && matches!(run.mode, Mode::Rate | Mode::Bw),
        cpu_pct: None,
        server_cpu_pct: None,
        pps: None,
        packets_per_frame: None,
        retransmits: None,
        cpu_us_per_msg: None,
        port_stats: None,
        port_xstats: None,
        steering: None,
        warmup,
        warmup_s,
        offered_rate: run.rate,
    };
    if matches!(run.mode, Mode::Lat | Mode::Rate) {
        line.set_latency(m.rtts.summary());
    }
    line
}

/// One configuration's result: the median of each metric over its
/// repetitions, except the round trips, which are those of every
/// repetition merged (`rtts`).
pub(super) fn median_line(lines: &[ResultLine], rtts: Option<&Rtts>) -> ResultLine {
    let mut out = lines[0].clone();
    macro_rules! med {
        ($f:ident) => {
            out.$f = median(lines.iter().map(|l| l.$f));
        };
    }
    if let Some(r) = rtts {
        out.set_latency(r.summary());
    }
    med!(msgs_per_s);
    med!(gbps);
    med!(fused_steps_per_s);
    med!(unfused_steps_per_s);
    med!(syscalls_per_msg);
    med!(cpu_pct);
    med!(server_cpu_pct);
    packets::merge_packets(&mut out, lines);
    let mut iters: Vec<u64> = lines.iter().map(|l| l.iters).collect();
    iters.sort_unstable();
    out.iters = iters[iters.len() / 2];
    out.zc_sends = lines.iter().filter_map(|l| l.zc_sends).max();
    out.zc_copied = lines.iter().filter_map(|l| l.zc_copied).max();
    out.repeat = lines.len();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arguments of `bench` with `args`.
    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        <Cli as clap::Parser>::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .map(|c| c.bench)
    }

    /// The plan of `bench` with `args` (its cores as given).
    fn cli(args: &[&str]) -> Plan {
        let a = parse(args).unwrap();
        let cores = a
            .cores
            .map_or((None, None), |c| (Some(c.client), Some(c.server)));
        plan_of(&a, cores)
    }

    /// The plan and `--rate` check of `bench` with `args`.
    fn rate_check(args: &[&str]) -> Result<(), String> {
        let a = parse(args).map_err(|e| e.to_string())?;
        check_rate(&plan_of(&a, (None, None)), a.rate)
    }

    #[test]
    fn a_rate_is_a_positive_number_in_lat_and_rate_mode() {
        for args in [
            &["--rate", "1000", "--iters", "100"][..],
            &[
                "--rate",
                "0.5",
                "--mode",
                "lat,rate",
                "--backends",
                "raw,tcp",
                "--duration",
                "2",
            ],
            &[
                "--rate=2.5e6",
                "--backends",
                "tcp",
                "--polling",
                "off",
                "--iters",
                "10",
            ],
        ] {
            assert_eq!(rate_check(args), Ok(()), "{args:?}");
        }
        assert_eq!(parse(&["--rate", "1e3"]).unwrap().rate, Some(1000.0));
        for (args, want) in [
            (&["--rate", "0"][..], "--rate"),
            (&["--rate", "-5"], "--rate"),
            (&["--rate=-5"], "--rate"),
            (&["--rate", "NaN"], "--rate"),
            (&["--rate", "inf"], "--rate"),
            (&["--rate", "fast"], "--rate"),
            (
                &["--rate", "10", "--mode", "bw"],
                "--rate applies to lat and rate",
            ),
            (&["--rate", "10", "--mode", "lat,fuse"], "not fuse"),
            (
                &["--rate", "10", "--polling", "off", "--iters", "5"],
                "raw baseline needs --polling on",
            ),
            // The closed loop's default --iters would be the schedule.
            (&["--rate", "10"], "--rate needs --iters N or --duration S"),
            (&["--rate", "1e-6", "--iters", "1"], "past 86400 s"),
        ] {
            let e = rate_check(args).unwrap_err();
            assert!(e.contains(want), "{args:?}: {e}");
        }
        // A value that bypassed the parser (the check stands alone).
        assert!(check_rate(&cli(&[]), Some(f64::NAN)).is_err());
        assert!(check_rate(&cli(&[]), Some(0.0)).is_err());
    }

    #[test]
    fn the_offered_rate_is_in_the_result_and_not_on_the_wire() {
        let p = cli(&["--mode", "rate"]);
        let mut run = p.runs().remove(0);
        let closed = serde_json::to_value(result_line(&p, &run, &Measured::default())).unwrap();
        assert_eq!(closed["offered_rate"], serde_json::Value::Null);
        run.rate = Some(1234.5);
        let open = serde_json::to_value(result_line(&p, &run, &Measured::default())).unwrap();
        assert_eq!(open["offered_rate"], 1234.5);
        // The server needs no rate: a run (and the plan) serialize as
        // before, and the server's run has none.
        let wire = serde_json::to_value(&run).unwrap();
        assert!(wire.get("rate").is_none(), "{wire}");
        let back: Run = serde_json::from_value(wire).unwrap();
        assert_eq!(back.rate, None);
    }

    #[test]
    fn plans_of_the_command_line_pass() {
        for args in [
            &[][..],
            &["--mode", "lat,rate,bw,fuse", "--all-sizes", "--repeat", "5"],
            &["--backends", "tcp", "--mode", "bw", "--connections", "512"],
            &[
                "--sizes",
                "268431360",
                "--inflight",
                "65536",
                "--cores",
                "0,1023",
            ],
            &["--mode", "fuse", "--tensors", "65536", "--sizes", "65536"],
            &[
                "--duration",
                "86400",
                "--interval",
                "0.001",
                "--warmup",
                "0",
            ],
            &["--warmup", "86400s", "--mode", "lat,rate,bw,fuse"],
            &["--warmup", "1us"],
        ] {
            let p = cli(args);
            assert_eq!(p.check(), Ok(()), "{args:?}");
            assert!(p.runs().len() <= MAX_RUNS);
        }
    }

    #[test]
    fn each_bound_is_refused_naming_its_flag() {
        for (args, want) in [
            (&["--sizes", "268431361"][..], "--sizes 268431361"),
            (&["--inflight", "65537"], "--inflight 65537"),
            (&["--inflight", "0"], "at least 1"),
            (&["--tensors", "65537"], "--tensors 65537"),
            (&["--repeat", "0"], "at least 1"),
            (&["--iters", "1099511627777"], "--iters 1099511627777"),
            (&["--warmup", "18446744073709551615"], "--warmup"),
            (&["--warmup", "0s"], "--warmup 0s"),
            (&["--warmup", "86401s"], "--warmup 86401s"),
            (&["--duration", "86401"], "--duration"),
            (&["--duration", "NaN"], "--duration"),
            (&["--duration=-1"], "--duration"),
            (&["--interval", "inf"], "--interval"),
            (&["--connections", "513"], "expected 1 to 512"),
            (&["--connections", "2"], "raw baseline"),
            (&["--cores", "0,1024"], "server core 1024"),
            (&["--bidirectional", "--mode", "fuse"], "--bidirectional"),
            // 23 sizes x 4 modes x 2 backends x 544 > 100 000 runs.
            (
                &[
                    "--all-sizes",
                    "--mode",
                    "lat,rate,bw,fuse",
                    "--repeat",
                    "544",
                ],
                "at most 100000 runs",
            ),
            (
                &["--mode", "fuse", "--tensors", "65536", "--sizes", "65537"],
                "a fuse step",
            ),
            (
                &[
                    "--backends",
                    "tcp",
                    "--connections",
                    "512",
                    "--sizes",
                    "16777216",
                ],
                "receive buffers",
            ),
        ] {
            let e = cli(args).check().unwrap_err();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }

    #[test]
    fn a_warmup_is_a_count_or_a_time_and_the_results_say_which() {
        let run = |args: &[&str]| {
            let p = cli(args);
            assert_eq!(p.check(), Ok(()), "{args:?}");
            let r = p.runs().remove(0);
            let line = result_line(&p, &r, &Measured::default());
            (r.warmup, line.warmup, line.warmup_s)
        };
        // The count form as it was: given, or by mode and size.
        assert_eq!(run(&["--warmup", "0"]), (Warmup::Iters(0), Some(0), None));
        assert_eq!(
            run(&["--warmup", "25", "--duration", "10"]),
            (Warmup::Iters(25), Some(25), None)
        );
        let rate = default_iters(Mode::Rate, 64, 100);
        assert_eq!(
            run(&["--mode", "rate"]).0,
            Warmup::Iters((rate / 10).clamp(1, 1_000)),
        );
        // The time form, whatever --duration or --iters say.
        for args in [
            &["--warmup", "2s", "--duration", "10"][..],
            &["--warmup", "2000ms", "--iters", "5"],
        ] {
            assert_eq!(
                run(args),
                (Warmup::Time(Duration::from_secs(2)), None, Some(2.0)),
                "{args:?}"
            );
        }
        // A plan from the network holds one form.
        let mut p = cli(&["--warmup", "1s"]);
        p.warmup = Some(3);
        assert!(p.check().unwrap_err().contains("not both"));
    }

    #[test]
    fn connections_are_refused_naming_exactly_the_backends_that_take_them() {
        let e = cli(&["--connections", "2"]).check().unwrap_err();
        let list = e
            .split_once("applies to the ")
            .and_then(|(_, r)| r.split_once(" backends"))
            .unwrap_or_else(|| panic!("{e}"))
            .0
            .replace(" and ", ", ");
        let named: Vec<&str> = list.split(", ").collect();
        let many: Vec<Backend> = Backend::compiled()
            .into_iter()
            .filter(|b| b.multi_connection())
            .collect();
        assert_eq!(named, many.iter().map(|b| b.name()).collect::<Vec<_>>());
        // Each of them runs a plan of several (dpdk among them, with its
        // feature: its bootstrap opens the run's every connection).
        for b in many {
            let mut p = cli(&["--connections", "2"]);
            p.backends = vec![b];
            assert_eq!(p.check(), Ok(()), "{b}");
        }
        #[cfg(feature = "dpdk")]
        assert!(named.contains(&"dpdk"), "{e}");
    }

    #[test]
    fn a_plan_from_the_network_is_refused_at_any_extreme() {
        let mut p = cli(&[]);
        p.repeat = usize::MAX;
        assert!(p.check().is_err());
        let mut p = cli(&[]);
        p.sizes = vec![usize::MAX];
        assert!(p.check().is_err());
        let mut p = cli(&["--backends", "tcp"]);
        p.connections = usize::MAX;
        assert!(p.check().is_err());
        let mut p = cli(&[]);
        p.client_core = Some(usize::MAX);
        assert!(p.check().is_err());
        let mut p = cli(&[]);
        p.sizes.clear();
        assert!(p.check().unwrap_err().contains("must not be empty"));
    }
}

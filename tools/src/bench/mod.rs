//! `starwire bench`: the raw-socket baseline against starwire backends.
//!
//! Every run goes through the same control protocol, also over loopback:
//! the client sends the [`Plan`] as one JSON line, and for every [`Run`] the
//! server opens a data listener, answers
//! `{"ready":{"port":P,"server_core":C}}` (C: the core its end is pinned
//! to), serves the run's data connections until the client closes them,
//! and answers `{"done":...}`. Data connections are made by the session layer: the
//! client dials each ([`dial`], the preamble for shard 0, the server's one
//! reactor), and an [`Acceptor`] on the data listener reads the preamble
//! and hands the stream on. Without `--listen`/`--connect` the server side
//! runs on a thread of the same process. With a cluster token the control
//! connection and the raw baseline's data connection prove it first
//! ([`auth`]).

mod auth;
mod cpu;
#[cfg(feature = "dpdk")]
mod dpdk;
#[cfg(feature = "grpc")]
mod grpc;
pub(crate) mod hist;
mod packets;
mod plan;
mod raw;
mod remote;
pub mod sessions;
mod table;
mod warmup;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use starwire_config::{FlagOverride, NetworkSettings, Overrides, Role};
use starwire_placement::{plan, CpuSet, Placement, ReactorMode, Topology};
use starwire_telemetry::Telemetry;
use starwire_transport::accept::{dial, inboxes, AcceptConfig, Acceptor};
use starwire_transport::reactor::{local_waker, IdlePolicy};

use crate::backend::Backend;
use crate::progress::{Progress, Unit};
use crate::stats::median;
use cpu::CpuMeter;
use hist::{IntervalOutput, IntervalReport, Rtts};
pub use plan::*;
use remote::*;
pub use warmup::{parse_warmup, Warmup};
use warmup::{Completion, RequestBudget, WarmupGate};

/// Options of `starwire bench` (see docs/CLI.md).
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Backends to compare, comma-separated: raw (plain sockets baseline),
    /// tcp, uring (with the `uring` feature, on by default on Linux), grpc
    /// (with the `grpc` feature), dpdk (with the `dpdk` feature and --eal),
    /// verbs (with the `verbs` feature and an RDMA device).
    #[arg(long, value_delimiter = ',', default_value = "raw,tcp")]
    pub backends: Vec<Backend>,
    /// What to measure (comma-separated list allowed).
    #[arg(long, value_delimiter = ',', default_value = "lat")]
    pub mode: Vec<Mode>,
    /// Payload bytes per message, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    pub sizes: Vec<usize>,
    /// Every size from 2 B to 8 MiB, powers of two (perftest's -a).
    #[arg(long, conflicts_with = "sizes")]
    pub all_sizes: bool,
    /// Rate and bw: the server echoes each request, so the payload flows
    /// both ways at once and Gb/s counts both (perftest's -b); lat is
    /// always an echo (its Gb/s counts the payload one way).
    #[arg(long)]
    pub bidirectional: bool,
    /// Report rate and round trips every SECS seconds of each run, on
    /// stderr; with --json as JSON lines among the results (iperf3's -i).
    #[arg(long, value_name = "SECS")]
    pub interval: Option<f64>,
    /// Report the CPU use of the process over each run, in % of one core
    /// (perftest's --cpu_util).
    #[arg(long)]
    pub cpu_util: bool,
    /// Write the round-trip histogram of every lat and rate result to FILE,
    /// in HdrHistogram's interval log format, tagged BACKEND-MODE-SIZE.
    #[arg(long, value_name = "FILE")]
    pub histogram: Option<PathBuf>,
    /// Outstanding messages for rate (default 16) and bw (default 8), per
    /// connection.
    #[arg(long)]
    pub inflight: Option<usize>,
    /// Data connections per run (like perftest's -q), all driven by the one
    /// client reactor and the one server reactor; each keeps --inflight
    /// outstanding. tcp, uring, dpdk and verbs; lat, rate and bw.
    #[arg(long, default_value_t = 1)]
    pub connections: usize,
    /// Open loop, lat and rate: send the measured requests on a schedule
    /// of MSGS_PER_S per second over all connections (wrk2's -R), each
    /// timed from when it was due, not sent; a request due while its
    /// connection has --inflight outstanding waits.
    #[arg(long, value_name = "MSGS_PER_S", allow_negative_numbers = true, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Measured iterations per run (steps in fuse mode).
    #[arg(long, conflicts_with = "duration")]
    pub iters: Option<u64>,
    /// Measure each run for this many seconds instead of --iters.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Warm-up per run: N iterations, or a time since the run's first
    /// send with its unit, e.g. 2s or 500ms (perftest's --margin)
    /// [default: iters/10 iterations, at most 1000, but at least 2 x
    /// connections x inflight in lat, rate and bw].
    #[arg(long, value_name = "N|TIME", value_parser = parse_warmup)]
    pub warmup: Option<Warmup>,
    /// Alternate the backends this many times; report the median.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Tensors per step in fuse mode.
    #[arg(long, default_value_t = 100)]
    pub tensors: usize,
    /// Busy polling (on, the bench default) or parking reactors / blocking
    /// recv (off). Overrides *_ENABLE_POLLING.
    #[arg(long, value_parser = crate::parse_on_off)]
    pub polling: Option<bool>,
    /// Client and server cores, `C,S` (default 0,1 with two or more CPUs).
    #[arg(long, value_parser = parse_cores)]
    pub cores: Option<Cores>,
    /// Prefer cores near this NIC when --cores is not given.
    #[arg(long)]
    pub device: Option<String>,
    /// One JSON object per result line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Serve benchmark clients on ADDR:PORT, one after another, until
    /// stopped (SIGINT or SIGTERM): the server host.
    #[arg(long, conflicts_with = "connect")]
    pub listen: Option<String>,
    /// With --listen: serve one client, then exit with its outcome
    /// (iperf3's --one-off). Scripts use it so the server ends, and closes
    /// its ports (a DPDK port's XDP program among them), on its own.
    #[arg(long, requires = "listen")]
    pub one_off: bool,
    /// Run the plan against a `bench --listen` server at ADDR:PORT.
    #[arg(long)]
    pub connect: Option<String>,
    /// With --listen: the server's metrics.
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
    /// The cluster token of the starwire data connections (a non-loopback
    /// --listen needs one, or --insecure).
    #[command(flatten)]
    pub token: crate::guard::TokenArgs,
    /// Where DPDK runs (feature `dpdk`; backend dpdk).
    #[cfg(feature = "dpdk")]
    #[command(flatten)]
    pub dpdk: crate::dpdk::DpdkArgs,
    /// The verbs backend's devices.
    #[command(flatten)]
    pub rdma: crate::rdma::RdmaArgs,
}

/// `--rate`: a positive, finite number of requests per second.
pub(crate) fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "{s:?}: expected a positive number of requests per second"
        )),
    }
}

/// `--cores C,S`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cores {
    /// Client core.
    pub client: usize,
    /// Server core.
    pub server: usize,
}

pub(crate) fn parse_cores(s: &str) -> Result<Cores, String> {
    let (c, srv) = s
        .split_once(',')
        .ok_or_else(|| format!("expected C,S (two core numbers), got {s:?}"))?;
    let n = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("{x:?} is not a core number"))
    };
    Ok(Cores {
        client: n(c)?,
        server: n(srv)?,
    })
}

/// Client and server cores: `--cores`, else near `--device`, else the first
/// two usable CPUs (0,1 normally). `None` when only one CPU is usable.
pub(crate) fn choose_cores(
    cores: Option<Cores>,
    device: Option<&str>,
) -> Result<(Option<usize>, Option<usize>), String> {
    if let Some(c) = cores {
        return Ok((Some(c.client), Some(c.server)));
    }
    let usable = CpuSet::process_affinity().map_err(|e| format!("reading CPU affinity: {e}"))?;
    if usable.len() < 2 {
        eprintln!("note: only one usable CPU; client and server are not pinned");
        return Ok((None, None));
    }
    if let Some(dev) = device {
        let topo = Topology::detect().map_err(|e| format!("detecting topology: {e}"))?;
        let placement = Placement::NearDevice {
            device: dev.to_owned(),
        };
        let p = plan(&placement, 2, ReactorMode::Polling, &usable, &topo)
            .map_err(|e| format!("placing near {dev}: {e}"))?;
        for w in &p.warnings {
            eprintln!("warning: {w}");
        }
        let cpus = p.cpus();
        return Ok((
            cpus.first().copied().flatten(),
            cpus.get(1).copied().flatten(),
        ));
    }
    let mut it = usable.iter();
    Ok((it.next(), it.next()))
}

/// Idle policy of the bench reactors: polling on = busy poll (or
/// poll-then-park with STARWIRE_IDLE_POLL_US), off = park.
fn idle_policy(role: Role, polling: bool) -> Result<IdlePolicy, String> {
    let mut o = Overrides::default();
    o.role_mut(role).enable_polling = Some(FlagOverride::new("--polling", polling));
    let s = NetworkSettings::from_process_env(role, 1, &o).map_err(|e| e.to_string())?;
    Ok(match s.idle_policy() {
        starwire_config::IdlePolicy::Park => IdlePolicy::Park,
        starwire_config::IdlePolicy::BusyPoll => IdlePolicy::BusyPoll,
        starwire_config::IdlePolicy::PollThenPark(d) => IdlePolicy::PollThenPark(d),
    })
}

/// Data connections of `run`: `--connections` for the starwire backends,
/// one for the baselines (`Plan::check` refuses more).
fn data_connections(run: &Run) -> usize {
    if run.backend.multi_connection() {
        run.connections.max(1)
    } else {
        1
    }
}

fn one_stream(streams: Vec<TcpStream>) -> Result<TcpStream, String> {
    let mut it = streams.into_iter();
    match (it.next(), it.next()) {
        (Some(s), None) => Ok(s),
        _ => Err("the raw and grpc baselines use one data connection".into()),
    }
}

/// The TCP driver of one end of `run` (the bench reactor's).
fn tcp_driver(run: &Run) -> Result<starwire_tcp::TcpDriver, String> {
    starwire_tcp::TcpDriver::new(sessions::tcp_config(run.max_size))
        .map_err(|e| format!("tcp driver: {e}"))
}

/// The ring of one end of `run` (the bench reactor's), made here and
/// bound to the reactor thread at its first enter.
#[cfg(all(feature = "uring", target_os = "linux"))]
fn uring_driver(idle: IdlePolicy, run: &Run) -> Result<starwire_uring::UringDriver, String> {
    starwire_uring::UringDriver::new(&sessions::uring_config(idle, run.max_size))
        .map_err(|e| format!("{e}; use --backends tcp"))
}

/// The verbs driver of one end of `run` (`client`: this process's client
/// end, else its server end), for `connections` connections.
#[cfg(all(feature = "verbs", target_os = "linux"))]
fn verbs_driver(
    client: bool,
    run: &Run,
    connections: usize,
) -> Result<starwire_verbs::VerbsDriver, String> {
    use crate::rdma::verbs;
    let dev = if client {
        verbs::open_client()
    } else {
        verbs::open_server()
    }?;
    verbs::driver(&dev, connections, verbs::ring_len(run.max_size))
}

/// One configuration's result and the round trips behind it.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The result line (medians over repetitions, merged round trips).
    pub line: ResultLine,
    /// Every repetition's round trips, merged (lat and rate; kept when
    /// asked for).
    pub rtts: Option<Rtts>,
    /// When its first repetition started, from the start of the bench.
    pub start: Duration,
    /// Measured time over its repetitions.
    pub measured: Duration,
}

/// The repetitions of one (backend, mode, size) seen so far.
struct Group {
    key: (Backend, Mode, usize),
    lines: Vec<ResultLine>,
    rtts: Option<Rtts>,
    start: Duration,
    measured: Duration,
}

impl Group {
    fn finish(self, keep_rtts: bool) -> Outcome {
        let line = median_line(&self.lines, self.rtts.as_ref());
        Outcome {
            line,
            rtts: self.rtts.filter(|_| keep_rtts),
            start: self.start,
            measured: self.measured,
        }
    }
}

/// Where [`drive`] hands what it learns, as it learns it.
pub(crate) trait Report {
    /// A run of `backend` starts, the server's end pinned to
    /// `server_core` (`None`: not pinned). An error ends the bench.
    fn ready(&mut self, _backend: Backend, _server_core: Option<usize>) -> Result<(), String> {
        Ok(())
    }

    /// A (backend, mode, size) is done: its last repetition finished. An
    /// error ends the bench.
    fn outcome(&mut self, outcome: Outcome) -> Result<(), String>;
}

/// Every outcome, for a caller that wants them all at the end.
impl Report for Vec<Outcome> {
    fn outcome(&mut self, outcome: Outcome) -> Result<(), String> {
        self.push(outcome);
        Ok(())
    }
}

/// How [`drive`] measures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DriveOpts {
    /// The server runs in this process (its CPU use is the client's).
    pub loopback: bool,
    /// Keep each result's merged histogram (for `--histogram`).
    pub keep_rtts: bool,
    /// Where the runs' `--interval` reports go.
    pub intervals: IntervalOutput,
    /// `--rate`: the schedule of every run (the client's alone).
    pub rate: Option<f64>,
}

/// The client side: send the plan to the server at `ctl_addr`, run every
/// run, and hand `report` one outcome per configuration (medians over
/// repetitions) as soon as its last repetition is done, so that a later
/// failure loses only what was still running.
/// Each run is an item of `progress`.
fn drive(
    plan: &Plan,
    ctl_addr: SocketAddr,
    opts: DriveOpts,
    progress: &mut Progress,
    report: &mut dyn Report,
) -> Result<(), String> {
    // The server refuses the same; a local error says it sooner.
    plan.check()?;
    check_rate(plan, opts.rate)?;
    let ctl = TcpStream::connect(ctl_addr)
        .map_err(|e| format!("connecting to the bench server {ctl_addr}: {e}"))?;
    auth::dial(&ctl, auth::Purpose::Control)?;
    ctl.set_nodelay(true).ok();
    let mut w = ctl.try_clone().map_err(|e| e.to_string())?;
    w.set_write_timeout(Some(PROMPT_TIMEOUT))
        .map_err(|e| format!("control connection: {e}"))?;
    let mut r = control_reader(ctl);
    send_line(&mut w, &ClientHello { plan: plan.clone() })?;
    let client_idle = idle_policy(Role::Worker, plan.polling)?;
    let mut runs = plan.runs();
    for run in &mut runs {
        run.intervals = opts.intervals;
        run.rate = opts.rate;
    }
    let started = Instant::now();
    let mut raw_fuse_noted = false;
    // The repetitions of one (mode, size) alternate between the backends:
    // a group is finished, and its histograms merged, at its last run
    // (its runs counted over the plan: `--repeat` per listing of its
    // backend, mode and size).
    let mut runs_of: std::collections::HashMap<(Backend, Mode, usize), usize> =
        std::collections::HashMap::new();
    for r in runs.iter().filter(|r| !r.skipped()) {
        *runs_of.entry((r.backend, r.mode, r.size)).or_default() += 1;
    }
    let mut pending: Vec<Group> = Vec::new();
    for run in &runs {
        if run.skipped() {
            if !raw_fuse_noted {
                crate::progress::suspend(|| {
                    eprintln!(
                        "note: fuse mode does not apply to the raw baseline (no tensors, \
                         no fusion); skipped"
                    )
                });
                raw_fuse_noted = true;
            }
            continue;
        }
        progress.begin(&run.progress_msg());
        // The server says which core its end is pinned to (a --listen
        // host's own --cores wins over the plan's); an older one does not.
        let (port, server_core) = match recv_within::<ServerMsg>(&mut r, PROMPT_TIMEOUT)
            .map_err(|e| format!("bench server: {e}"))?
        {
            ServerMsg::Ready { port, server_core } => {
                (port, server_core.unwrap_or(plan.server_core))
            }
            ServerMsg::Error(e) => return Err(format!("bench server: {e}")),
            other => return Err(format!("bench server: unexpected {other:?}")),
        };
        report.ready(run.backend, server_core)?;
        let run_start = started.elapsed();
        let cpu = if plan.cpu_util {
            Some(CpuMeter::start()?)
        } else {
            None
        };
        // Shard 0: the server's one reactor. The listener is bound
        // before `ready`, so one attempt each (no retry).
        let addr = SocketAddr::new(ctl_addr.ip(), port).to_string();
        let want = data_connections(run);
        // Over DPDK the data listener only bootstraps: no data streams.
        let streams = (0..want)
            .filter(|_| run.backend.data_over_tcp())
            .map(|_| dial(&addr, 0, Instant::now()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("data connection: {e}"))?;
        let measured = match run.backend {
            Backend::Raw => one_stream(streams)
                .and_then(|s| auth::dial(&s, auth::Purpose::Raw).map(|()| s))
                .and_then(|s| raw::client(s, run, plan.client_core, plan.polling)),
            Backend::Tcp => tcp_driver(run)
                .and_then(|d| sessions::client(d, streams, run, plan.client_core, client_idle)),
            #[cfg(all(feature = "uring", target_os = "linux"))]
            Backend::Uring => uring_driver(client_idle, run)
                .and_then(|d| sessions::client(d, streams, run, plan.client_core, client_idle)),
            #[cfg(feature = "grpc")]
            Backend::Grpc => {
                one_stream(streams).and_then(|s| grpc::client(s, run, plan.client_core))
            }
            #[cfg(feature = "dpdk")]
            Backend::Dpdk => dpdk::client(
                SocketAddr::new(ctl_addr.ip(), port),
                want,
                run,
                plan.client_core,
                client_idle,
            ),
            #[cfg(all(feature = "verbs", target_os = "linux"))]
            Backend::Verbs => verbs_driver(true, run, want)
                .and_then(|d| sessions::client(d, streams, run, plan.client_core, client_idle)),
        };
        let cpu_pct = cpu.map(|c| c.percent()).transpose()?;
        let (server_cpu_pct, server_datagram) = match recv_within::<ServerMsg>(&mut r, DONE_TIMEOUT)
            .map_err(|e| format!("bench server: {e}"))?
        {
            ServerMsg::Done {
                ok: true,
                cpu_pct,
                datagram,
                ..
            } => (cpu_pct, datagram),
            ServerMsg::Done { error, .. } => {
                return Err(format!(
                    "bench server failed in {} {} {} B: {}",
                    run.backend,
                    run.mode.name(),
                    run.size,
                    error.unwrap_or_default()
                ))
            }
            ServerMsg::Error(e) => return Err(format!("bench server: {e}")),
            other => return Err(format!("bench server: unexpected {other:?}")),
        };
        let m = measured?;
        let mut line = result_line(plan, run, &m);
        line.server_core = server_core;
        line.cpu_pct = cpu_pct;
        line.server_cpu_pct = server_cpu_pct.filter(|_| !opts.loopback);
        if let Some(p) = &m.packets {
            packets::set_packets(&mut line, p, server_datagram);
        }
        let key = (run.backend, run.mode, run.size);
        let at = match pending.iter().position(|g| g.key == key) {
            Some(at) => at,
            None => {
                pending.push(Group {
                    key,
                    lines: Vec::new(),
                    rtts: None,
                    start: run_start,
                    measured: Duration::ZERO,
                });
                pending.len() - 1
            }
        };
        let g = &mut pending[at];
        g.lines.push(line);
        g.measured += m.elapsed;
        progress.end();
        if matches!(run.mode, Mode::Lat | Mode::Rate) {
            match &mut g.rtts {
                Some(all) => all.merge(&m.rtts),
                None => g.rtts = Some(m.rtts),
            }
        }
        if runs_of.get(&key).map_or(true, |&n| g.lines.len() >= n) {
            report.outcome(pending.swap_remove(at).finish(opts.keep_rtts))?;
        }
    }
    // Every group finished at its last run; none is left, but none is
    // lost either.
    for g in pending {
        report.outcome(g.finish(opts.keep_rtts))?;
    }
    Ok(())
}

pub(crate) fn resolve_addr(s: &str) -> Result<SocketAddr, String> {
    s.to_socket_addrs()
        .map_err(|e| format!("{s}: {e}"))?
        .next()
        .ok_or_else(|| format!("{s}: no address"))
}

/// The checks across `bench`'s flags (usage errors).
pub(crate) fn validate(args: &BenchArgs) -> Result<(), String> {
    if args.metrics.metrics_addr.is_some() && args.listen.is_none() {
        return Err(
            "--metrics-addr serves the bench server's metrics: use it with --listen".into(),
        );
    }
    // The flags' bounds are the plan's, which a --listen server checks in
    // a client's plan too (`Plan::check`). Cores chosen later, without
    // --cores, are usable CPUs: only --cores is checked here.
    let cores = args
        .cores
        .map_or((None, None), |c| (Some(c.client), Some(c.server)));
    let plan = plan_of(args, cores);
    plan.check()?;
    if args.listen.is_some() && args.rate.is_some() {
        // A server answers what comes: the schedule is the client's.
        return Err("--rate is the client's (give it to bench --connect), not --listen's".into());
    }
    check_rate(&plan, args.rate)?;
    if args.connections > 1 {
        // Both ends in this process over loopback; one end with --connect
        // or --listen. Plus the control connection, listeners, rings.
        let ends = if args.connect.is_some() || args.listen.is_some() {
            1
        } else {
            2
        };
        let need = (ends * args.connections + 64) as u64;
        if let Ok((soft, _)) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        {
            if soft < need {
                return Err(format!(
                    "--connections {} needs about {need} open files and the limit is {soft}; \
                     raise it (ulimit -n {need}) or use fewer connections",
                    args.connections
                ));
            }
        }
    }
    Ok(())
}

/// The plan of `args`, with the client and server cores chosen.
fn plan_of(args: &BenchArgs, (client_core, server_core): (Option<usize>, Option<usize>)) -> Plan {
    Plan {
        backends: args.backends.clone(),
        modes: args.mode.clone(),
        sizes: if args.all_sizes {
            all_sizes()
        } else {
            args.sizes.clone()
        },
        inflight: args.inflight,
        iters: args.iters,
        duration_s: args.duration,
        warmup: match args.warmup {
            Some(Warmup::Iters(n)) => Some(n),
            _ => None,
        },
        warmup_s: match args.warmup {
            Some(Warmup::Time(t)) => Some(t.as_secs_f64()),
            _ => None,
        },
        tensors: args.tensors,
        repeat: args.repeat,
        polling: args.polling.unwrap_or(true),
        client_core,
        server_core,
        connections: args.connections,
        interval_s: args.interval,
        bidirectional: args.bidirectional,
        cpu_util: args.cpu_util,
    }
}

/// Run `plan` against a bench server on a thread of this process, over
/// loopback (what `bench` does without `--listen`/`--connect`), each run
/// an item of `progress`.
pub(crate) fn run_loopback(
    plan: &Plan,
    progress: &mut Progress,
) -> Result<Vec<ResultLine>, String> {
    let opts = DriveOpts {
        loopback: true,
        keep_rtts: false,
        intervals: IntervalOutput::Text,
        rate: None,
    };
    let mut outcomes: Vec<Outcome> = Vec::new();
    run_on_thread(plan, opts, progress, &mut outcomes)?;
    Ok(outcomes.into_iter().map(|o| o.line).collect())
}

/// [`drive`] against a bench server on a thread of this process.
fn run_on_thread(
    plan: &Plan,
    opts: DriveOpts,
    progress: &mut Progress,
    report: &mut dyn Report,
) -> Result<(), String> {
    // Refused before the server thread exists: it would wait for good.
    plan.check()?;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("binding the loopback control listener: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = std::thread::Builder::new()
        .name("bench-control".into())
        .spawn(move || serve(&listener, None, &Telemetry::new()))
        .map_err(|e| e.to_string())?;
    // A client error returns at once: the server thread may still wait
    // for data connections that will not come (it gives up after
    // ACCEPT_TIMEOUT), and ends with the process.
    drive(plan, addr, opts, progress, report)?;
    server
        .join()
        .map_err(|_| "bench server thread panicked".to_owned())?
}

/// Every size of `--all-sizes`: 2 B to 8 MiB, powers of two.
fn all_sizes() -> Vec<usize> {
    (1..=23).map(|k| 1usize << k).collect()
}

/// Run `starwire bench`.
pub fn main(args: BenchArgs) -> Result<(), String> {
    validate(&args)?;
    crate::rdma::set_process_args(&args.rdma, args.listen.is_some());
    for b in &args.backends {
        b.check_available()?;
    }
    let token = args.token.token()?;
    let has_token = token.is_some();
    // Set once per process; a second `main` (tests) keeps the first.
    let _ = sessions::BENCH_TOKEN.set(token);
    // Stops the DPDK port, if one was opened, when the command is done.
    #[cfg(feature = "dpdk")]
    let _dpdk = crate::dpdk::CloseOnDrop;
    #[cfg(feature = "dpdk")]
    {
        // A reactor a side: both in this process unless one end is remote.
        let reactors = if args.listen.is_some() || args.connect.is_some() {
            1
        } else {
            2
        };
        args.dpdk.configure_for(reactors);
        // The client opens the port before the first run, so a bad EAL
        // argument or port is the command's error; a --listen server opens
        // it at its first dpdk run.
        if args.listen.is_none() && args.backends.contains(&Backend::Dpdk) {
            crate::dpdk::DpdkContext::get().map_err(|e| e.to_string())?;
        }
    }
    if let Some(listen_at) = &args.listen {
        let addr = resolve_addr(listen_at)?;
        if let Err(e) = starwire_train::cluster::check_listen(addr, has_token, args.token.insecure)
        {
            eprintln!("starwire: error: {e}");
            std::process::exit(crate::guard::EXIT_INSECURE.into());
        }
        return listen(&args, listen_at);
    }
    let plan = plan_of(&args, choose_cores(args.cores, args.device.as_deref())?);
    // Made before the runs, so that a path that cannot be written fails
    // before minutes of measuring.
    if let Some(p) = &args.histogram {
        std::fs::File::create(p)
            .map_err(|e| format!("creating --histogram {}: {e}", p.display()))?;
    }
    let started = SystemTime::now();
    let opts = DriveOpts {
        loopback: args.connect.is_none(),
        keep_rtts: args.histogram.is_some(),
        intervals: if args.json {
            IntervalOutput::Json
        } else {
            IntervalOutput::Text
        },
        rate: args.rate,
    };
    let mut progress = Progress::new("starwire bench", Unit::Items, plan.measured_runs());
    let mut printer = Printer::new(&args, &plan);
    let ran = match &args.connect {
        Some(c) => {
            resolve_addr(c).and_then(|addr| drive(&plan, addr, opts, &mut progress, &mut printer))
        }
        None => run_on_thread(&plan, opts, &mut progress, &mut printer),
    };
    progress.finish();
    // A failure keeps what was printed, and closes the table under it.
    let closed = printer.finish(started, ran.is_ok());
    ran.and(closed)
}

/// Write `text` to stdout now, with the progress bar hidden: each result
/// as it comes, and with `--json` each interval report (from the client's
/// thread, while its run goes on).
fn write_stdout(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Ok(());
    }
    crate::progress::suspend(|| {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes()).and_then(|()| out.flush())
    })
    .map_err(|e| format!("writing the results: {e}"))
}

/// What `bench` prints on stdout, each result as it comes: a JSON line
/// or a table row. The table's end and the `--histogram` log sum up
/// every result, so they come last, also after a failure.
struct Printer {
    json: bool,
    table: table::Table,
    /// `--histogram`: the log's path, and the outcomes with round trips.
    histogram: Option<(PathBuf, Vec<Outcome>)>,
}

impl Printer {
    fn new(args: &BenchArgs, plan: &Plan) -> Self {
        Self {
            json: args.json,
            table: table::Table::new(plan, args.connect.is_some()),
            histogram: args.histogram.clone().map(|p| (p, Vec::new())),
        }
    }

    /// The end: the table's close (after a failure, only under rows it
    /// printed) and the histogram log.
    fn finish(mut self, started: SystemTime, complete: bool) -> Result<(), String> {
        if !self.json && (complete || self.table.has_rows()) {
            write_stdout(&self.table.finish())?;
        }
        if let Some((p, outcomes)) = &self.histogram {
            let entries: Vec<hist::LogEntry<'_>> = outcomes
                .iter()
                .filter_map(|o| {
                    o.rtts.as_ref().map(|rtts| hist::LogEntry {
                        tag: format!("{}-{}-{}", o.line.backend, o.line.mode.name(), o.line.size),
                        start: o.start,
                        duration: o.measured,
                        rtts,
                    })
                })
                .collect();
            hist::write_log(p, started, &entries)?;
        }
        Ok(())
    }
}

impl Report for Printer {
    fn ready(&mut self, backend: Backend, server_core: Option<usize>) -> Result<(), String> {
        if self.json {
            return Ok(());
        }
        write_stdout(&self.table.ready(backend, server_core))
    }

    fn outcome(&mut self, o: Outcome) -> Result<(), String> {
        if self.json {
            let mut s = serde_json::to_string(&o.line).map_err(|e| e.to_string())?;
            s.push('\n');
            write_stdout(&s)?;
        } else {
            write_stdout(&self.table.row(&o.line))?;
        }
        if let Some((_, kept)) = &mut self.histogram {
            if o.rtts.is_some() {
                kept.push(o);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(modes: Vec<Mode>, bidirectional: bool) -> Plan {
        Plan {
            backends: vec![Backend::Tcp],
            modes,
            sizes: vec![1024],
            inflight: None,
            iters: Some(10),
            duration_s: None,
            warmup: None,
            warmup_s: None,
            tensors: 4,
            repeat: 2,
            polling: false,
            client_core: None,
            server_core: None,
            connections: 1,
            interval_s: Some(0.5),
            bidirectional,
            cpu_util: false,
        }
    }

    #[test]
    fn runs_carry_interval_and_direction() {
        let runs = plan(vec![Mode::Lat, Mode::Rate, Mode::Bw, Mode::Fuse], true).runs();
        assert_eq!(runs.len(), 8, "4 modes x 2 repetitions");
        assert!(runs.iter().all(|r| r.interval_s == Some(0.5)));
        let by = |m: Mode| runs.iter().find(|r| r.mode == m).unwrap();
        // Lat is an echo either way and counts one direction; bidirectional
        // rate and bw are echoed and count both; fuse is one way.
        assert!(by(Mode::Lat).echoed() && by(Mode::Rate).echoed() && by(Mode::Bw).echoed());
        assert!(!by(Mode::Fuse).echoed());
        assert_eq!(by(Mode::Lat).bits_per_msg(), 8192.0);
        assert_eq!(by(Mode::Bw).bits_per_msg(), 16384.0);
        assert!(by(Mode::Fuse).interval_report().is_none());
        assert!(by(Mode::Bw).interval_report().is_some());
        let one_way = plan(vec![Mode::Rate], false).runs();
        assert!(!one_way[0].echoed());
        assert_eq!(one_way[0].bits_per_msg(), 8192.0);
    }

    #[test]
    fn repetitions_merge_their_round_trips_and_take_medians_of_the_rest() {
        let p = plan(vec![Mode::Lat], false);
        let runs = p.runs();
        let measured = |ns: u64, n: u64, secs: u64| {
            let mut rtts = Rtts::new();
            for _ in 0..n {
                rtts.record(ns);
            }
            Measured {
                iters: n,
                elapsed: Duration::from_secs(secs),
                rtts,
                ..Measured::default()
            }
        };
        // One fast repetition of 99 round trips, one slow of a single one.
        let (a, b) = (measured(10_000, 99, 1), measured(1_000_000, 1, 1));
        let lines = [result_line(&p, &runs[0], &a), result_line(&p, &runs[1], &b)];
        // Within the histogram's 0.1%.
        let near = |v: Option<f64>, want: f64| (v.unwrap() - want).abs() <= want * 1e-3;
        assert!(near(lines[1].p50_us, 1000.0), "{:?}", lines[1]);
        let mut all = Rtts::new();
        all.merge(&a.rtts);
        all.merge(&b.rtts);
        let m = median_line(&lines, Some(&all));
        // Merged: the median is the fast one's, the max the slow one's
        // (a median of the repetitions' p50s would be 505 µs).
        assert!(near(m.p50_us, 10.0), "{m:?}");
        assert!(near(m.max_us, 1000.0), "{m:?}");
        assert_eq!(m.msgs_per_s, Some(50.0), "median of 99/s and 1/s");
        assert_eq!(m.repeat, 2);
    }

    #[test]
    fn all_sizes_are_the_powers_of_two_from_2_b_to_8_mib() {
        let s = all_sizes();
        assert_eq!((s[0], s[s.len() - 1], s.len()), (2, 8 << 20, 23));
        assert!(s.windows(2).all(|w| w[1] == 2 * w[0]));
    }
}

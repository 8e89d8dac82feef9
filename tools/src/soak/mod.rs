//! `starwire soak`: many connections over loopback for a while, every
//! message sequence-numbered and checksummed, payload sizes varying; counts
//! lost, duplicated, corrupted and reordered messages, and RSS growth, and
//! measures throughput ([`throughput`]) and round trips ([`latency`]).
//!
//! Each reactor runs one [`Endpoint`] of the session layer: one driver
//! with its share of the connections, and the soak's client or server as
//! its [`Service`]. The client dials every connection ([`dial`], with the
//! preamble naming the server reactor it is for); the server's
//! [`Acceptor`] routes each to that reactor. Optionally the
//! fault-injecting [`Faulty`] wrapper sits under every TCP link on both
//! ends ([`Links`] of faulty links). TCP has no reliability at our layer,
//! so faults must show up as failures. A stalled connection (dropped
//! frames leak credits) is bounded by `--duration` plus `--drain`:
//! whatever is still unanswered then is reported lost.
//!
//! With `--listen` or `--connect` a process runs one side only, and the
//! other side runs in another process ([`remote`]).

mod drivers;
mod latency;
mod layout;
mod remote;
mod throughput;
mod traffic;

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use starwire_tcp::{TcpConfig, TcpDriver, TcpTransport};
use starwire_transport::accept::{dial, inboxes, AcceptConfig, Acceptor};
use starwire_transport::reactor::Reactor;
use starwire_transport::testing::{FaultSpec, FaultStats, Faulty};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{
    ConnError, ConnId, Connection, Driver, Endpoint, Incoming, Links, Payload, Service, Sessions,
    StreamDriver, TaskRole, TransportError,
};

use crate::bench::sessions::conn_config;
use crate::bench::{MAX_CONNECTIONS, MAX_INFLIGHT, MAX_SECONDS};
use crate::failure::{at_least_one, Failure};
use crate::metrics::{SoakCells, SoakCounts};
use crate::progress::{Progress, Unit};
use drivers::*;
use latency::{LatencyCells, LatencyUs, MergedRoundTrips, RoundTripFeed, RoundTrips};
use layout::{layout, Layout, Side};
use remote::Ends;
use starwire_telemetry::Telemetry;
use starwire_train::telemetry::DriverCells;
use throughput::{Span, Throughput};
use traffic::*;

/// Options of `starwire soak`.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// Backend under test: tcp, uring, dpdk or verbs (each when built in).
    #[arg(long, default_value = "tcp", value_parser = parse_soak_backend)]
    pub backend: String,
    /// Connections over loopback.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Seconds of traffic (above 0, at most 86400).
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Seconds to wait at most for outstanding answers after --duration
    /// (the soak ends as soon as every answer is in; at most 86400).
    #[arg(long, default_value_t = 2.0)]
    pub drain: f64,
    /// Fault injection under the backend, e.g. drop=0.01,corrupt=0.001,delay=0.01,reorder=0.01,delay_ms=5,seed=7.
    #[arg(long)]
    pub faults: Option<FaultSpec>,
    /// Requests outstanding per connection (at least 1).
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    pub inflight: usize,
    /// Largest request payload in bytes (sizes vary from 0 to this).
    #[arg(long, default_value_t = 64 << 10)]
    pub max_size: usize,
    /// Client reactors, at least 1 (default: NETWORK_WORKER_CORE_NUMBER
    /// rules).
    #[arg(long, value_parser = at_least_one)]
    pub client_reactors: Option<usize>,
    /// Server reactors, at least 1 (default: NETWORK_PS_CORE_NUMBER rules).
    #[arg(long, value_parser = at_least_one)]
    pub server_reactors: Option<usize>,
    /// Busy polling on (default) or off (reactors park).
    #[arg(long, value_parser = crate::parse_on_off)]
    pub polling: Option<bool>,
    /// The verbs backend's devices.
    #[command(flatten)]
    pub rdma: crate::rdma::RdmaArgs,
    /// Fail the soak when the p99 of the requests' round trips is over
    /// MS milliseconds (above 0); the client side measures them.
    #[arg(
        long,
        value_name = "MS",
        allow_negative_numbers = true,
        value_parser = latency::parse_max_latency_ms
    )]
    pub max_latency_ms: Option<f64>,
    /// One JSON object at the end instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub metrics: crate::metrics::MetricsArgs,
    /// Where DPDK runs (feature `dpdk`; backend dpdk).
    #[cfg(feature = "dpdk")]
    #[command(flatten)]
    pub dpdk: crate::dpdk::DpdkArgs,
    /// Run only the server side, on ADDR:PORT, for a `soak --connect`
    /// in another process; it ends once --connections connections have
    /// closed, and reports what it checked.
    #[arg(long, conflicts_with = "connect")]
    pub listen: Option<String>,
    /// Run only the client side, against a `soak --listen` server at
    /// ADDR:PORT (give both the same --connections and --server-reactors).
    #[arg(long)]
    pub connect: Option<String>,
    /// The cluster token of the connections (a non-loopback --listen needs
    /// one, or --insecure).
    #[command(flatten)]
    pub token: crate::guard::TokenArgs,
}

fn parse_soak_backend(s: &str) -> Result<String, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "tcp" => Ok("tcp".to_owned()),
        #[cfg(all(feature = "uring", target_os = "linux"))]
        "uring" | "io_uring" | "io-uring" => Ok("uring".to_owned()),
        #[cfg(feature = "dpdk")]
        "dpdk" => Ok("dpdk".to_owned()),
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        "verbs" | "rdma" | "ibverbs" => Ok("verbs".to_owned()),
        "raw" => Err("the raw baseline has no message layer to soak; use --backend tcp".into()),
        "grpc" => Err("the gRPC baseline has no message layer to soak; use --backend tcp".into()),
        other => Err(
            crate::backend::missing_backend_hint(other).unwrap_or_else(|| {
                // The starwire backends: the baselines have no message
                // layer.
                let soaked: Vec<&str> = crate::backend::Backend::compiled()
                    .into_iter()
                    .filter(|b| b.multi_connection())
                    .map(|b| b.name())
                    .collect();
                format!(
                    "unknown backend {other:?}; soak supports: {}",
                    soaked.join(", ")
                )
            }),
        ),
    }
}

/// The report; field names are a contract (see docs/CLI.md).
#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    /// `client` or `server` when the sides run in two processes
    /// (`--connect`, `--listen`); absent when both run here.
    #[serde(skip_serializing_if = "Option::is_none")]
    side: Option<&'static str>,
    connections: usize,
    duration_s: f64,
    faults: Option<String>,
    client_reactors: usize,
    server_reactors: usize,
    cpus: usize,
    oversubscribed: bool,
    idle_policy: String,
    /// Which sides' reactors are pinned, for the text report.
    #[serde(skip)]
    pinning: String,
    messages: u64,
    answered: u64,
    /// `measured_s`, `msgs_per_s` and `gbps`: `answered` and the payload
    /// bytes of those requests and answers over the side's [`Span`].
    #[serde(flatten)]
    throughput: Throughput,
    /// The round trips of the `answered` requests; absent for a
    /// `--listen` server, which sends none.
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_us: Option<LatencyUs>,
    /// `--max-latency-ms`, the bar `latency_us.p99` must not be over.
    max_latency_ms: Option<f64>,
    lost: u64,
    duplicated: u64,
    corrupted: u64,
    /// Answers with a status other than `Ok` (a garbled status, the frame
    /// header having no checksum), except, in one process, the server's
    /// refusals of requests it found corrupted (in `corrupted`).
    rejected: u64,
    /// Responses the connections dropped as matching no pending request:
    /// duplicates, or answers to ids never sent or to requests that
    /// failed (a soak neither cancels requests nor sets deadlines).
    unmatched_responses: u64,
    out_of_order: u64,
    connections_failed: u64,
    faults_injected: Option<FaultCounts>,
    rss_start_kb: Option<u64>,
    /// VmRSS once a quarter of `duration_s` had passed.
    rss_quarter_kb: Option<u64>,
    /// VmRSS once `duration_s` had passed, before the drain and teardown.
    rss_full_kb: Option<u64>,
    rss_end_kb: Option<u64>,
    /// The most `rss_full_kb` may exceed `rss_quarter_kb`: max(5 %, 16 MiB).
    rss_growth_limit_kb: Option<u64>,
    passed: bool,
    /// Per reactor, the driver's own counters (the verbs backend's:
    /// doorbells per flush, work requests and credit writes per frame);
    /// absent for drivers without them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    driver_counters: Vec<serde_json::Value>,
}

#[derive(Debug, Default, Clone, Copy, Serialize)]
struct FaultCounts {
    dropped: u64,
    corrupted: u64,
    delayed: u64,
    reordered: u64,
}

impl FaultCounts {
    fn add(&mut self, s: FaultStats) {
        self.dropped += s.dropped;
        self.corrupted += s.corrupted;
        self.delayed += s.delayed;
        self.reordered += s.reordered;
    }

    fn add_counts(&mut self, o: FaultCounts) {
        self.dropped += o.dropped;
        self.corrupted += o.corrupted;
        self.delayed += o.delayed;
        self.reordered += o.reordered;
    }
}

/// Counters of one side.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    messages: u64,
    answered: u64,
    lost: u64,
    duplicated: u64,
    corrupted: u64,
    /// The client's: answers whose status is not `Ok`, but for those in
    /// `refused`.
    rejected: u64,
    /// The client's, with the server in this process: the server's
    /// refusals of requests it found corrupted ([`is_refusal`]), which the
    /// server counts in its `corrupted`. Published apart from `rejected`;
    /// not reported (the report's `corrupted` has them).
    refused: u64,
    /// Responses that matched no pending request
    /// ([`Connection::unmatched_responses`]).
    unmatched_responses: u64,
    out_of_order: u64,
    failed: u64,
    /// The payload bytes of the `answered` requests and of their answers.
    payload_bytes: u64,
    /// When this side's traffic began and ended.
    span: Span,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.messages += o.messages;
        self.answered += o.answered;
        self.lost += o.lost;
        self.duplicated += o.duplicated;
        self.corrupted += o.corrupted;
        self.rejected += o.rejected;
        self.refused += o.refused;
        self.unmatched_responses += o.unmatched_responses;
        self.out_of_order += o.out_of_order;
        self.failed += o.failed;
        self.payload_bytes += o.payload_bytes;
        self.span.merge(o.span);
    }

    /// The throughput of these counts: `answered` and `payload_bytes`
    /// over `span`.
    fn throughput(&self) -> Throughput {
        Throughput::new(self.answered, self.payload_bytes, self.span.secs())
    }

    /// What a server in the same process as its client adds to the
    /// client's counts, in the report and at `/metrics`: all but the
    /// requests, which the client counts, and so their throughput.
    fn server_share(&self) -> Counts {
        // The server's refusals of corrupted requests are in its
        // `corrupted`; the client counted those it got in `refused`, not
        // in `rejected`.
        Counts {
            messages: 0,
            answered: 0,
            payload_bytes: 0,
            span: Span::default(),
            ..*self
        }
    }

    /// Add the server's counts of a soak in one process to the client's.
    fn add_server(&mut self, server: &Counts) {
        self.add(&server.server_share());
    }

    /// Whether nothing went wrong: something was sent, and nothing was
    /// lost, duplicated, corrupted, rejected, refused, unmatched or
    /// reordered, and no connection failed.
    fn clean(&self) -> bool {
        self.messages > 0
            && self.lost == 0
            && self.duplicated == 0
            && self.corrupted == 0
            && self.rejected == 0
            && self.refused == 0
            && self.unmatched_responses == 0
            && self.out_of_order == 0
            && self.failed == 0
    }

    /// These counts as a reactor publishes them at `/metrics`: a client
    /// reactor its own, a server reactor beside its client its
    /// [`Counts::server_share`], so that each series adds up to the
    /// report's field (`rejected` is what the report counts: the
    /// refusals of a server in this process are `refused`).
    fn published(&self) -> SoakCounts {
        SoakCounts {
            sent: self.messages,
            answered: self.answered,
            lost: self.lost,
            duplicated: self.duplicated,
            corrupted: self.corrupted,
            rejected: self.rejected,
            refused: self.refused,
            unmatched_responses: self.unmatched_responses,
            out_of_order: self.out_of_order,
            connections_failed: self.failed,
        }
    }
}

use crate::rss::rss_kb;

struct Outcome {
    counts: Counts,
    /// The client reactors' round trips; `None` without a client here.
    round_trips: Option<RoundTrips>,
    faults: FaultCounts,
    /// Each reactor's driver counters, clients first.
    driver: Vec<serde_json::Value>,
}

/// How often the soak's round-trip percentiles are published while it
/// runs (and once more at its end).
const LATENCY_PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// How long dialing one connection may keep retrying.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// What attaches connections to one reactor's driver: a stream becomes a
/// connection, the `k`-th of the reactor being link number
/// `first + k * step` of its side (made by `attacher(first, step)`).
trait Attach<D>: FnMut(&mut D, TcpStream) -> Result<ConnId, TransportError> + Send + 'static {}

impl<D, F> Attach<D> for F where
    F: FnMut(&mut D, TcpStream) -> Result<ConnId, TransportError> + Send + 'static
{
}

/// The attacher of a driver of plain streams.
fn stream_attacher<D: StreamDriver>(
    _first: u64,
    _step: u64,
) -> fn(&mut D, TcpStream) -> Result<ConnId, TransportError> {
    D::attach_stream
}

/// The attacher of TCP links with `spec`'s faults injected: link `i` of a
/// side injects with seed `spec.seed + i`.
fn faulty_attacher(
    spec: FaultSpec,
    cfg: TcpConfig,
) -> impl Fn(u64, u64) -> Box<dyn Attach<Links<Faulty<TcpTransport>>>> {
    move |first, step| {
        let mut k = 0u64;
        Box::new(move |d: &mut Links<Faulty<TcpTransport>>, s: TcpStream| {
            let t = TcpTransport::new(s, cfg)?;
            let mut f = spec;
            f.seed = spec.seed.wrapping_add(first + k * step);
            k += 1;
            Ok(d.attach(Faulty::new(t, f)))
        })
    }
}

/// First link number of the server side's links (for fault seeds).
const SERVER_LINKS: u64 = 1 << 20;

type ServerReactor<D> = Reactor<Endpoint<D, SoakServer>>;

/// Run the soak over drivers made by `make`, their connections attached by
/// `attacher`'s: server reactors behind an acceptor, then the clients,
/// which dial every connection.
fn run_soak<D: SoakDriver, A: Attach<D>>(
    args: &SoakArgs,
    lay: &Layout,
    make: impl Fn(Side) -> Result<D, String>,
    attacher: impl Fn(u64, u64) -> A,
) -> Result<Outcome, String> {
    let (nc, ns) = (lay.client_cpus.len(), lay.server_cpus.len());
    // Every driver first: what fails then fails before any thread starts.
    let server_drivers = (0..ns)
        .map(|_| make(Side::Server))
        .collect::<Result<Vec<_>, _>>()?;
    let client_drivers = (0..nc)
        .map(|_| make(Side::Client))
        .collect::<Result<Vec<_>, _>>()?;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("binding a loopback listener: {e}"))?;
    // The server reactors publish what they add to the report, into the
    // clients' series.
    let (servers, acceptor) = start_servers(args, lay, listener, server_drivers, &attacher, |s| {
        s.beside_its_client(&lay.telemetry)
    })?;
    let addr = acceptor.local_addr().to_string();
    let clients = run_clients(args, lay, client_drivers, &addr, &attacher);
    let served = stop_servers(servers);
    drop(acceptor);
    let mut out = clients?;
    let (sc, sf, sd) = served?;
    out.counts.add_server(&sc);
    out.faults.add_counts(sf);
    out.driver.extend(sd);
    Ok(out)
}

/// The server reactors (each service set up by `service`) behind an
/// acceptor on `listener`.
fn start_servers<D: SoakDriver, A: Attach<D>>(
    args: &SoakArgs,
    lay: &Layout,
    listener: TcpListener,
    server_drivers: Vec<D>,
    attacher: &impl Fn(u64, u64) -> A,
    service: impl Fn(SoakServer) -> SoakServer,
) -> Result<(Vec<ServerReactor<D>>, Acceptor), String> {
    let ns = server_drivers.len();
    let (tx, rxs) = inboxes(ns).map_err(|e| format!("acceptor: {e}"))?;
    let mut servers: Vec<ServerReactor<D>> = Vec::with_capacity(ns);
    for (k, (driver, rx)) in server_drivers.into_iter().zip(rxs).enumerate() {
        let attach = attacher(SERVER_LINKS + k as u64, ns as u64);
        let cfg = conn_config(TaskRole::Ps, 256);
        let service = service(SoakServer::new(lay, &args.backend));
        let r = Reactor::spawn(lay.spec(Side::Server, k), move |_| {
            driver.on_reactor_thread();
            Endpoint::new(driver, service, cfg).with_inbox_attach(rx, attach)
        });
        match r {
            Ok(r) => servers.push(r),
            Err(e) => {
                let _ = stop_servers(servers);
                return Err(format!("server reactor {k}: {e}"));
            }
        }
    }
    let wakers = servers.iter().map(Reactor::waker).collect();
    match Acceptor::spawn(listener, tx, wakers, AcceptConfig::default()) {
        Ok(a) => Ok((servers, a)),
        Err(e) => {
            let _ = stop_servers(servers);
            Err(format!("acceptor: {e}"))
        }
    }
}

/// Dial every connection (connection `i` to server reactor `i % ns`, on
/// client reactor `i % nc`), run the client reactors for `--duration`
/// plus at most `--drain`, add up what they counted, and publish their
/// round trips' percentiles.
fn run_clients<D: SoakDriver, A: Attach<D>>(
    args: &SoakArgs,
    lay: &Layout,
    drivers: Vec<D>,
    addr: &str,
    attacher: &impl Fn(u64, u64) -> A,
) -> Result<Outcome, String> {
    let (nc, ns) = (drivers.len(), lay.server_cpus.len());
    let deadline = Instant::now() + DIAL_TIMEOUT;
    let mut drivers = drivers;
    let mut attachers: Vec<A> = (0..nc).map(|k| attacher(k as u64, nc as u64)).collect();
    let mut groups: Vec<Vec<(ConnId, u32)>> = (0..nc).map(|_| Vec::new()).collect();
    for i in 0..args.connections {
        let shard = (i % ns) as u32;
        let k = i % nc;
        let s = dial(addr, shard, deadline).map_err(|e| e.to_string())?;
        // Attached before the next dial: a backend whose ends exchange
        // addresses over the stream (dpdk) has written its half, and its
        // driver's flushes, on the client reactor, finish the exchange.
        let id =
            attachers[k](&mut drivers[k], s).map_err(|e| format!("attaching a connection: {e}"))?;
        groups[k].push((id, shard));
    }
    let start = Instant::now();
    let stop_sending = start + Duration::from_secs_f64(args.duration);
    let give_up = stop_sending + Duration::from_secs_f64(args.drain);
    let round_trips = MergedRoundTrips::default();
    let latency_cells = LatencyCells::new(&lay.telemetry);
    let mut client_reactors = Vec::with_capacity(nc);
    for (k, (driver, group)) in drivers.into_iter().zip(groups).enumerate() {
        let client = SoakClient {
            first: k as u64,
            step: nc as u64,
            attached: 0,
            conns: Vec::new(),
            inflight: args.inflight,
            max_size: args.max_size,
            stop_sending,
            give_up,
            sending: true,
            counts: Counts::default(),
            round_trips: RoundTripFeed::new(Arc::clone(&round_trips)),
            // A `--connect` client has no server here to count refusals.
            server_here: !Ends::of(args).remote(),
            faults: FaultCounts::default(),
            done: false,
            cells: SoakCells::new(&lay.telemetry),
            driver: DriverCells::new(&lay.telemetry, &args.backend),
        };
        let mut ep = Endpoint::new(driver, client, conn_config(TaskRole::Worker, 256));
        let now = Instant::now();
        for (id, shard) in group {
            ep.open(id, shard, now);
        }
        let r = Reactor::spawn(lay.spec(Side::Client, k), move |_| {
            ep.sessions().driver().on_reactor_thread();
            ep
        })
        .map_err(|e| format!("client reactor {k}: {e}"))?;
        client_reactors.push(r);
    }
    // Wait for the clients (bounded by duration + drain), showing progress
    // (a bar on a terminal, else a line every few seconds; --json owns
    // stdout only): the sending phase, then the drain.
    let secs = |s: f64| s.ceil() as u64;
    let mut progress = Progress::new("soak: sending", Unit::Seconds, secs(args.duration));
    let mut draining = false;
    let mut latency_due = Instant::now() + LATENCY_PUBLISH_EVERY;
    while Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(100));
        // A client reactor ends once every answer is in after
        // --duration: the drain lasts only as long as answers are out.
        if client_reactors.iter().all(Reactor::is_finished) {
            break;
        }
        if Instant::now() >= latency_due {
            latency_due += LATENCY_PUBLISH_EVERY;
            latency_cells.publish(&latency::snapshot(&round_trips).latency());
        }
        let t = start.elapsed().as_secs_f64();
        if t < args.duration {
            progress.set(t as u64, "");
            continue;
        }
        if !draining {
            draining = true;
            progress.finish();
            progress = Progress::new("soak: sent; draining", Unit::Seconds, secs(args.drain));
        }
        progress.set((t - args.duration) as u64, "");
    }
    progress.finish();
    let mut counts = Counts::default();
    let mut faults = FaultCounts::default();
    let mut driver = Vec::new();
    for (k, r) in client_reactors.into_iter().enumerate() {
        let (ep, _) = r.join().map_err(|e| format!("client reactor {k}: {e}"))?;
        let (mut client, sessions) = ep.into_parts();
        client.sync_unmatched(&sessions);
        // What came after its last turn (connections closing) too.
        client.publish();
        client.round_trips.flush();
        counts.add(&client.counts);
        faults.add_counts(client.faults);
        faults.add_counts(fault_counts(&sessions));
        driver.extend(side_counters(&sessions, "client", k));
    }
    let round_trips = latency::snapshot(&round_trips);
    latency_cells.publish(&round_trips.latency());
    Ok(Outcome {
        counts,
        round_trips: Some(round_trips),
        faults,
        driver,
    })
}

/// Stop every server reactor and add up what they counted.
fn stop_servers<D: SoakDriver>(
    servers: Vec<ServerReactor<D>>,
) -> Result<(Counts, FaultCounts, Vec<serde_json::Value>), String> {
    let mut counts = Counts::default();
    let mut faults = FaultCounts::default();
    let mut driver = Vec::new();
    let mut error = None;
    for (k, r) in servers.into_iter().enumerate() {
        match r.stop() {
            Ok((ep, _)) => {
                let (mut server, sessions) = ep.into_parts();
                // The connections still here (those that ended were
                // counted as they did).
                server.sync_unmatched(&sessions);
                server.publish();
                counts.add(&server.counts);
                faults.add_counts(server.faults);
                faults.add_counts(fault_counts(&sessions));
                driver.extend(side_counters(&sessions, "server", k));
            }
            Err(e) => {
                error.get_or_insert(format!("server reactor {k}: {e}"));
            }
        }
    }
    match error {
        Some(e) => Err(e),
        None => Ok((counts, faults, driver)),
    }
}

/// The checks across `soak`'s flags (usage errors).
pub(crate) fn validate(args: &SoakArgs) -> Result<(), String> {
    // Bounded as bench's: each connection is a socket at both ends, and
    // each in-flight request a slot and a credit of its window.
    if args.connections == 0 || args.connections > MAX_CONNECTIONS {
        return Err(format!(
            "--connections {}: expected 1 to {MAX_CONNECTIONS}",
            args.connections
        ));
    }
    if args.inflight > MAX_INFLIGHT {
        return Err(format!(
            "--inflight {}: at most {MAX_INFLIGHT}",
            args.inflight
        ));
    }
    // Bounded as bench's --duration: the seconds become `Duration`s,
    // which a huge or non-finite number cannot be.
    if !(args.duration > 0.0 && args.duration <= MAX_SECONDS) {
        return Err(format!(
            "--duration {:?}: expected a positive number of seconds, at most {MAX_SECONDS}",
            args.duration
        ));
    }
    if !(args.drain >= 0.0 && args.drain <= MAX_SECONDS) {
        return Err(format!(
            "--drain {:?}: expected a number of seconds from 0 to {MAX_SECONDS}",
            args.drain
        ));
    }
    if args.max_size > (16 << 20) {
        return Err("--max-size: at most 16 MiB".into());
    }
    // tcp: faults under each socket (the soak must detect them); dpdk:
    // faults under the datagram link (the reliability core repairs them).
    if !matches!(args.backend.as_str(), "tcp" | "dpdk") && args.faults.is_some() {
        return Err("--faults is supported with --backend tcp or dpdk only".into());
    }
    // verbs opens both sides' devices in this process.
    if Ends::of(args).remote() && args.backend == "verbs" {
        return Err("--listen/--connect: the verbs soak runs both sides in one process".into());
    }
    if args.listen.is_some() && args.max_latency_ms.is_some() {
        return Err(
            "--max-latency-ms: the client side measures the round trips; give it to the \
             --connect side, not to --listen"
                .into(),
        );
    }
    Ok(())
}

/// Run `starwire soak`. Returns whether the soak passed.
pub fn main(args: SoakArgs) -> Result<bool, Failure> {
    validate(&args).map_err(Failure::Usage)?;
    let ends = Ends::of(&args);
    if ends.remote() {
        // The connections prove the token in their handshake
        // (conn_config), as the bench's do.
        let token = args.token.token()?;
        if let Ends::Listen(addr) = &ends {
            let at = crate::bench::resolve_addr(addr)?;
            if let Err(e) =
                starwire_train::cluster::check_listen(at, token.is_some(), args.token.insecure)
            {
                eprintln!("starwire: error: {e}");
                std::process::exit(crate::guard::EXIT_INSECURE.into());
            }
        }
        let _ = crate::bench::sessions::BENCH_TOKEN.set(token);
    }
    let rss_start_kb = rss_kb();
    let rss_quarter = crate::rss::RssAt::spawn(Duration::from_secs_f64(args.duration / 4.0));
    let rss_full = crate::rss::RssAt::spawn(Duration::from_secs_f64(args.duration));
    #[cfg(feature = "dpdk")]
    let args = dpdk_reactors(args);
    let lay = layout(&args)?;
    let _metrics = args.metrics.serve(&lay.telemetry)?;
    #[cfg(feature = "dpdk")]
    if args.backend == "dpdk" {
        // Stops the port when the soak is done.
        let _dpdk = crate::dpdk::CloseOnDrop;
        // A queue pair per reactor of this process.
        args.dpdk.configure_for(match ends {
            Ends::Local => lay.client_cpus.len() + lay.server_cpus.len(),
            Ends::Listen(_) => lay.server_cpus.len(),
            Ends::Connect(_) => lay.client_cpus.len(),
        });
        let ctx = crate::dpdk::DpdkContext::get().map_err(|e| e.to_string())?;
        // Both ends in this process bootstrap over loopback; across two,
        // each end's address on its port is --dpdk-ip.
        let ip = match (ctx.ip(), ends.remote()) {
            (Some(ip), _) => ip,
            (None, false) => ctx.ip_or_loopback(),
            (None, true) => {
                return Err(Failure::Usage(
                    "--listen/--connect over dpdk: give --dpdk-ip, this end's IPv4 address \
                     on the DPDK port"
                        .into(),
                ))
            }
        };
        let cfg = starwire_datagram::ReliableConfig::default();
        let out = match args.faults {
            None => {
                let make = |_| ctx.driver(ip, cfg.clone()).map_err(|e| e.to_string());
                remote::run(&args, &lay, make, dpdk_attacher)?
            }
            // Faults under every link: the reliability core repairs them,
            // so this soak must pass.
            Some(spec) => {
                let seed = std::sync::atomic::AtomicU64::new(spec.seed);
                let make = |_| {
                    let s = seed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let link = starwire_datagram::Impaired::new(
                        ctx.link(ip).map_err(|e| e.to_string())?,
                        loss_config(spec),
                        s,
                    );
                    starwire_datagram::DatagramDriver::new(link, cfg.clone())
                        .map_err(|e| format!("dpdk driver: {e}"))
                };
                remote::run(&args, &lay, make, dpdk_attacher)?
            }
        };
        return report(&args, &lay, (rss_start_kb, rss_quarter, rss_full), out);
    }
    #[cfg(all(feature = "uring", target_os = "linux"))]
    if args.backend == "uring" {
        crate::backend::Backend::Uring.check_available()?;
        // Each ring binds to its reactor thread at the first enter, and
        // receives as its reactor idles.
        let make = |side| {
            let cfg = crate::bench::sessions::uring_config(lay.idle(side), 0);
            starwire_uring::UringDriver::new(&cfg).map_err(|e| e.to_string())
        };
        let out = remote::run(&args, &lay, make, stream_attacher)?;
        return report(&args, &lay, (rss_start_kb, rss_quarter, rss_full), out);
    }
    #[cfg(all(feature = "verbs", target_os = "linux"))]
    if args.backend == "verbs" {
        if args.faults.is_some() {
            return Err(Failure::Usage(
                "--faults is supported with --backend tcp or dpdk only".into(),
            ));
        }
        let (client_dev, server_dev) = crate::rdma::verbs::open_pair(&args.rdma)?;
        // Rings hold at least two of the largest frames a request makes.
        let ring_len = (2 * (args.max_size + 4096))
            .next_power_of_two()
            .max(64 << 10);
        let make = |side| {
            let dev = match side {
                Side::Client => &client_dev,
                Side::Server => &server_dev,
            };
            crate::rdma::verbs::driver(dev, args.connections, ring_len)
        };
        let out = remote::run(&args, &lay, make, stream_attacher)?;
        return report(&args, &lay, (rss_start_kb, rss_quarter, rss_full), out);
    }
    let cfg = TcpConfig::default();
    let out = match args.faults {
        None => {
            let make = |_| TcpDriver::new(cfg).map_err(|e| format!("tcp driver: {e}"));
            remote::run(&args, &lay, make, stream_attacher)?
        }
        Some(spec) => {
            let make = |_| Ok(Links::new(cfg.max_frame_len));
            remote::run(&args, &lay, make, faulty_attacher(spec, cfg))?
        }
    };
    report(&args, &lay, (rss_start_kb, rss_quarter, rss_full), out)
}

fn report(
    args: &SoakArgs,
    lay: &Layout,
    (rss_start_kb, rss_quarter, rss_full): (Option<u64>, crate::rss::RssAt, crate::rss::RssAt),
    out: Outcome,
) -> Result<bool, Failure> {
    let rss_end_kb = rss_kb();
    let rss_quarter_kb = rss_quarter.take();
    let rss_full_kb = rss_full.take();
    let growth_checked = args.duration >= crate::rss::MIN_CHECKED_SECS;
    let c = out.counts;
    let latency_us = out.round_trips.as_ref().map(RoundTrips::latency);
    let latency_ok = match latency::check_bar(&latency_us.unwrap_or_default(), args.max_latency_ms)
    {
        Ok(()) => true,
        Err(why) => {
            // On stderr: --json owns stdout.
            eprintln!("starwire soak: {why}");
            false
        }
    };
    let passed = c.clean()
        && latency_ok
        && (!growth_checked
            || crate::rss::within_limit(rss_quarter_kb, rss_full_kb.or(rss_end_kb)));
    let side = match Ends::of(args) {
        Ends::Local => None,
        Ends::Listen(_) => Some("server"),
        Ends::Connect(_) => Some("client"),
    };
    let report = Report {
        backend: args.backend.clone(),
        side,
        connections: args.connections,
        duration_s: args.duration,
        faults: args.faults.map(|f| f.to_string()),
        client_reactors: lay.client_cpus.len(),
        server_reactors: lay.server_cpus.len(),
        cpus: lay.cpus,
        oversubscribed: lay.oversubscribed,
        idle_policy: lay.idle_name.clone(),
        pinning: lay.pinning.clone(),
        messages: c.messages,
        answered: c.answered,
        throughput: c.throughput(),
        latency_us,
        max_latency_ms: args.max_latency_ms,
        lost: c.lost,
        duplicated: c.duplicated,
        corrupted: c.corrupted,
        rejected: c.rejected,
        unmatched_responses: c.unmatched_responses,
        out_of_order: c.out_of_order,
        connections_failed: c.failed,
        faults_injected: args.faults.map(|_| out.faults),
        rss_start_kb,
        rss_quarter_kb,
        rss_full_kb,
        rss_end_kb,
        rss_growth_limit_kb: rss_quarter_kb
            .filter(|_| growth_checked)
            .map(crate::rss::growth_limit_kb),
        passed,
        driver_counters: out.driver,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        print_report(&report);
    }
    Ok(passed)
}

/// `p50 21.3 us, p99 40.1 us, p99.9 52.0 us, max 60.2 us over 1000 round
/// trips`, and the bar when there is one.
fn latency_line(l: &LatencyUs, max_ms: Option<f64>) -> String {
    let mut s = format!(
        "p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us over {} round trips",
        l.p50, l.p99, l.p999, l.max, l.count
    );
    if let Some(ms) = max_ms {
        s.push_str(&format!(
            " (--max-latency-ms {ms}: p99 at most {:.1} us)",
            ms * 1000.0
        ));
    }
    s
}

fn print_report(r: &Report) {
    let kb = |v: Option<u64>| v.map_or("?".to_owned(), |v| format!("{v} kB"));
    println!(
        "starwire soak: backend {}, {} connections, {:.1} s{}",
        r.backend,
        r.connections,
        r.duration_s,
        r.faults
            .as_ref()
            .map(|f| format!(", faults {f}"))
            .unwrap_or_default()
    );
    println!(
        "  reactors     {} client + {} server on {} cpus, {}; idle policy {}{}",
        r.client_reactors,
        r.server_reactors,
        r.cpus,
        r.pinning,
        r.idle_policy,
        if r.oversubscribed {
            " (more reactors than cores)"
        } else {
            ""
        }
    );
    println!(
        "  messages     {} sent, {} answered",
        r.messages, r.answered
    );
    println!(
        "  throughput   {:.0} msgs/s, {:.3} Gbit/s of payload over {:.2} s",
        r.throughput.msgs_per_s, r.throughput.gbps, r.throughput.measured_s
    );
    if let Some(l) = r.latency_us {
        println!("  latency      {}", latency_line(&l, r.max_latency_ms));
    }
    println!("  lost         {}", r.lost);
    println!("  duplicated   {}", r.duplicated);
    println!("  corrupted    {}", r.corrupted);
    println!("  rejected     {}", r.rejected);
    println!("  unmatched    {}", r.unmatched_responses);
    println!("  out of order {}", r.out_of_order);
    println!("  conn. failed {}", r.connections_failed);
    if let Some(f) = r.faults_injected {
        println!(
            "  injected     dropped {}, corrupted {}, delayed {}, reordered {}",
            f.dropped, f.corrupted, f.delayed, f.reordered
        );
    }
    println!(
        "  rss          {} -> {} at 25% -> {} at 100% -> {} (growth limit {})",
        kb(r.rss_start_kb),
        kb(r.rss_quarter_kb),
        kb(r.rss_full_kb),
        kb(r.rss_end_kb),
        kb(r.rss_growth_limit_kb)
    );
    for c in &r.driver_counters {
        println!(
            "  {} {:<7}  {:.2} doorbells per flush, {:.3} WRs per frame, {:.3} credit writes \
             per frame",
            c["side"].as_str().unwrap_or("?"),
            c["reactor"],
            c["doorbells_per_flush"].as_f64().unwrap_or(0.0),
            c["wrs_per_frame"].as_f64().unwrap_or(0.0),
            c["credit_writes_per_frame"].as_f64().unwrap_or(0.0)
        );
    }
    println!("  result       {}", if r.passed { "PASS" } else { "FAIL" });
}

#[cfg(test)]
mod tests;

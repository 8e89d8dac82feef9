//! `starwire soak`: many connections over loopback for a while, every
//! message sequence-numbered and checksummed, payload sizes varying; counts
//! lost, duplicated, corrupted and reordered messages, and RSS growth.
//!
//! Each reactor drives one driver with its share of the connections.
//! Optionally the fault-injecting [`Faulty`] wrapper sits under every TCP
//! link on both ends ([`Links`] of faulty links). TCP has no reliability at our layer, so faults must show
//! up as failures. A stalled connection (dropped frames leak credits) is
//! bounded by `--duration` plus `--drain`: whatever is still unanswered
//! then is reported lost.

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde::Serialize;
use starwire_config::{FlagOverride, NetworkSettings, Overrides, Role};
use starwire_placement::{plan, CpuSet, Placement, ReactorMode, Topology};
use starwire_tcp::{TcpConfig, TcpDriver, TcpTransport};
use starwire_transport::reactor::{
    park_driver, IdlePolicy, ParkWaker, Parked, Reactor, ReactorSpec, ReactorState,
};
use starwire_transport::testing::{FaultSpec, FaultStats, Faulty};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{
    Body, ConnId, Connection, Driver, Incoming, Links, Sessions, StreamDriver, TaskRole,
};

use crate::bench::sessions::conn_config;

/// Options of `starwire soak`.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// Backend under test: tcp or uring.
    #[arg(long, default_value = "tcp", value_parser = parse_soak_backend)]
    pub backend: String,
    /// Connections over loopback.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Seconds of traffic.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Seconds to wait for outstanding answers after --duration.
    #[arg(long, default_value_t = 2.0)]
    pub drain: f64,
    /// Fault injection under the backend, e.g. drop=0.01,corrupt=0.001,delay=0.01,reorder=0.01,delay_ms=5,seed=7.
    #[arg(long)]
    pub faults: Option<FaultSpec>,
    /// Requests outstanding per connection.
    #[arg(long, default_value_t = 8)]
    pub inflight: usize,
    /// Largest request payload in bytes (sizes vary from 0 to this).
    #[arg(long, default_value_t = 64 << 10)]
    pub max_size: usize,
    /// Client reactors (default: NETWORK_WORKER_CORE_NUMBER rules).
    #[arg(long)]
    pub client_reactors: Option<usize>,
    /// Server reactors (default: NETWORK_PS_CORE_NUMBER rules).
    #[arg(long)]
    pub server_reactors: Option<usize>,
    /// Busy polling on (default) or off (reactors park).
    #[arg(long, value_parser = crate::parse_on_off)]
    pub polling: Option<bool>,
    /// One JSON object at the end instead of text.
    #[arg(long)]
    pub json: bool,
}

fn parse_soak_backend(s: &str) -> Result<String, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "tcp" => Ok("tcp".to_owned()),
        #[cfg(all(feature = "uring", target_os = "linux"))]
        "uring" | "io_uring" | "io-uring" => Ok("uring".to_owned()),
        "raw" => Err("the raw baseline has no message layer to soak; use --backend tcp".into()),
        other => Err(
            crate::backend::missing_backend_hint(other).unwrap_or_else(|| {
                format!(
                    "unknown backend {other:?}; soak supports: {}",
                    crate::backend::compiled_in()
                )
            }),
        ),
    }
}

/// The report; field names are a contract (see docs/CLI.md).
#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    connections: usize,
    duration_s: f64,
    faults: Option<String>,
    client_reactors: usize,
    server_reactors: usize,
    cpus: usize,
    oversubscribed: bool,
    idle_policy: String,
    messages: u64,
    answered: u64,
    lost: u64,
    duplicated: u64,
    corrupted: u64,
    out_of_order: u64,
    connections_failed: u64,
    faults_injected: Option<FaultCounts>,
    rss_start_kb: Option<u64>,
    rss_end_kb: Option<u64>,
    passed: bool,
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
    out_of_order: u64,
    failed: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.messages += o.messages;
        self.answered += o.answered;
        self.lost += o.lost;
        self.duplicated += o.duplicated;
        self.corrupted += o.corrupted;
        self.out_of_order += o.out_of_order;
        self.failed += o.failed;
    }
}

/// VmRSS of this process in kB.
pub fn rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// A driver the soak can run over, with, maybe, fault counters.
trait SoakDriver: Driver + Send + 'static {
    /// The faults injected on `conn` so far.
    fn fault_stats(&self, _conn: ConnId) -> FaultStats {
        FaultStats::default()
    }
}

#[cfg(all(feature = "uring", target_os = "linux"))]
impl SoakDriver for starwire_uring::UringDriver {}

impl SoakDriver for TcpDriver {}

impl SoakDriver for Links<Faulty<TcpTransport>> {
    fn fault_stats(&self, conn: ConnId) -> FaultStats {
        self.link(conn).map(Faulty::stats).unwrap_or_default()
    }
}

/// The faults injected on every connection `sessions` holds.
fn fault_counts<D: SoakDriver>(sessions: &Sessions<D>) -> FaultCounts {
    let mut f = FaultCounts::default();
    for id in sessions.ids() {
        f.add(sessions.driver().fault_stats(id));
    }
    f
}

/// The connections of `sessions` that failed: removed, each with the
/// faults injected on it (counted into `faults`) and its handle.
fn take_failed<D: SoakDriver>(sessions: &mut Sessions<D>, faults: &mut FaultCounts) -> Vec<ConnId> {
    let mut out = Vec::new();
    while let Some(id) = sessions.next_failed() {
        faults.add(sessions.driver().fault_stats(id));
        if sessions.poll_failed().is_none() {
            break;
        }
        out.push(id);
    }
    out
}

const SEQ_HDR: usize = 16;

/// Order-sensitive checksum of `seq` and `data`: every 8-byte word goes
/// through a bijective mix, so any change of one word changes the result.
fn checksum(seq: u64, data: &[u8]) -> u64 {
    let mut h = 0x243f_6a88_85a3_08d3u64 ^ seq.wrapping_mul(0xff51_afd7_ed55_8ccd);
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        h = (h ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }
    let rest = words.remainder();
    let mut last = [0u8; 8];
    last[..rest.len()].copy_from_slice(rest);
    h = (h ^ u64::from_le_bytes(last)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ data.len() as u64
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Payload length for message `seq` of connection `conn`: mostly small,
/// some medium, a few up to `max`.
fn payload_len(conn: u64, seq: u64, max: usize) -> usize {
    let r = mix(conn << 40 ^ seq);
    let bucket = r % 100;
    let cap = match bucket {
        0..=69 => 256,
        70..=94 => 4096,
        _ => max,
    }
    .min(max);
    if cap == 0 {
        0
    } else {
        ((r >> 8) % (cap as u64 + 1)) as usize
    }
}

/// `[seq u64][checksum u64][payload]`.
fn make_body(seq: u64, len: usize, salt: u64) -> Body {
    let mut v = Vec::with_capacity(SEQ_HDR + len);
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&[0u8; 8]);
    let base = mix(seq ^ salt);
    v.extend((0..len).map(|i| (base as usize).wrapping_add(i.wrapping_mul(131)) as u8));
    let sum = checksum(seq, &v[SEQ_HDR..]);
    v[8..16].copy_from_slice(&sum.to_le_bytes());
    Body::from(v)
}

/// Decode and verify a body: `Some(seq)` when the checksum matches.
fn check_body(body: &[u8]) -> Option<u64> {
    if body.len() < SEQ_HDR {
        return None;
    }
    let seq = u64::from_le_bytes(body[..8].try_into().ok()?);
    let sum = u64::from_le_bytes(body[8..16].try_into().ok()?);
    (checksum(seq, &body[SEQ_HDR..]) == sum).then_some(seq)
}

/// In-order tracking of sequence numbers on one stream.
#[derive(Debug, Default)]
struct SeqTrack {
    next: u64,
    missing: HashSet<u64>,
}

impl SeqTrack {
    /// Note `seq`; counts duplicates and out-of-order arrivals.
    fn see(&mut self, seq: u64, c: &mut Counts) {
        if seq == self.next {
            self.next += 1;
        } else if seq > self.next {
            // A gap: the skipped ones may still come (reordered) or never
            // (lost, counted by the requester).
            if seq - self.next <= 1 << 16 {
                self.missing.extend(self.next..seq);
            }
            self.next = seq + 1;
        } else if self.missing.remove(&seq) {
            c.out_of_order += 1;
        } else {
            c.duplicated += 1;
        }
    }
}

/// One client connection's bookkeeping.
struct ClientConn {
    /// The connection's number in the whole soak (payload sizes and
    /// contents derive from it).
    index: u64,
    next_seq: u64,
    /// request id -> seq
    outstanding: HashMap<u64, u64>,
    track: SeqTrack,
}

struct SoakClient<D> {
    sessions: Sessions<D>,
    /// By [`ConnId::index`]; `None` once the connection failed.
    conns: Vec<Option<ClientConn>>,
    inflight: usize,
    max_size: usize,
    stop_sending: Instant,
    give_up: Instant,
    counts: Counts,
    /// Faults injected on connections that failed (and went).
    faults: FaultCounts,
    done: bool,
}

/// `slots[id.index()]`, if there.
fn slot<T>(slots: &mut [Option<T>], id: ConnId) -> Option<&mut T> {
    slots.get_mut(id.index()).and_then(Option::as_mut)
}

impl<D: SoakDriver> SoakClient<D> {
    fn finish(&mut self, now: Instant) {
        for (i, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            self.counts.lost += c.outstanding.len() as u64;
            c.outstanding.clear();
            if let Some(conn) = self.sessions.conn(ConnId::new(i as u32)) {
                conn.close();
            }
        }
        self.sessions.flush(now);
        self.done = true;
    }
}

fn on_response(
    outstanding: &mut HashMap<u64, u64>,
    track: &mut SeqTrack,
    counts: &mut Counts,
    m: Incoming<'_>,
) {
    let Incoming::Response {
        id, status, body, ..
    } = m
    else {
        return;
    };
    let Some(want) = outstanding.remove(&id) else {
        counts.duplicated += 1;
        return;
    };
    counts.answered += 1;
    if status != Status::Ok {
        // The server found the request corrupted (and counted it).
        return;
    }
    match check_body(body) {
        Some(seq) if seq == want => track.see(seq, counts),
        _ => counts.corrupted += 1,
    }
}

impl<D: SoakDriver> ReactorState for SoakClient<D> {
    fn turn(&mut self, now: Instant) -> bool {
        if self.done {
            return false;
        }
        let sending = now < self.stop_sending;
        let Self {
            sessions,
            conns,
            counts,
            ..
        } = self;
        for (i, c) in conns.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            let Some(conn) = sessions.conn(ConnId::new(i as u32)) else {
                continue;
            };
            while sending && c.outstanding.len() < self.inflight {
                let seq = c.next_seq;
                let len = payload_len(c.index, seq, self.max_size);
                match conn.request(Opcode::Rpc, 0, make_body(seq, len, c.index), None) {
                    Ok(id) => {
                        c.outstanding.insert(id, seq);
                        c.next_seq += 1;
                        counts.messages += 1;
                    }
                    Err(_) => break,
                }
            }
        }
        let mut busy = sessions
            .turn(now, &mut |id, _, m| {
                if let Some(c) = slot(conns, id) {
                    on_response(&mut c.outstanding, &mut c.track, counts, m);
                }
            })
            .busy();
        for (i, c) in conns.iter().enumerate() {
            if c.is_some() {
                if let Some(conn) = sessions.conn(ConnId::new(i as u32)) {
                    while conn.poll_event().is_some() {}
                }
            }
        }
        for id in take_failed(sessions, &mut self.faults) {
            if let Some(c) = conns.get_mut(id.index()).and_then(Option::take) {
                counts.failed += 1;
                counts.lost += c.outstanding.len() as u64;
            }
            busy = true;
        }
        let all_quiet = conns.iter().flatten().all(|c| c.outstanding.is_empty());
        if !sending && (all_quiet || now >= self.give_up) {
            self.finish(now);
            return true;
        }
        busy
    }

    fn next_deadline(&self) -> Option<Instant> {
        let phase = if Instant::now() < self.stop_sending {
            self.stop_sending
        } else {
            self.give_up
        };
        Some(self.sessions.poll_timeout().map_or(phase, |t| t.min(phase)))
    }

    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        park_driver(self.sessions.driver_mut(), waker, timeout)
    }

    fn finished(&self) -> bool {
        self.done
    }
}

struct SoakServer<D> {
    sessions: Sessions<D>,
    /// By [`ConnId::index`].
    tracks: Vec<SeqTrack>,
    counts: Counts,
    /// Faults injected on connections that failed (and went).
    faults: FaultCounts,
}

fn serve_request(
    track: &mut SeqTrack,
    counts: &mut Counts,
    conn: &mut Connection,
    m: Incoming<'_>,
) {
    let Incoming::Request {
        id, opcode, body, ..
    } = m
    else {
        return;
    };
    let (status, reply) = match check_body(body) {
        Some(seq) => {
            track.see(seq, counts);
            let len = (mix(seq) % 1024) as usize;
            (Status::Ok, make_body(seq, len, !seq))
        }
        None => {
            counts.corrupted += 1;
            (Status::BadRequest, Body::empty())
        }
    };
    let _ = conn.respond(id, opcode, status, reply);
}

impl<D: SoakDriver> ReactorState for SoakServer<D> {
    fn turn(&mut self, now: Instant) -> bool {
        let Self {
            sessions,
            tracks,
            counts,
            faults,
        } = self;
        let mut busy = sessions
            .turn(now, &mut |id, conn, m| {
                if let Some(track) = tracks.get_mut(id.index()) {
                    serve_request(track, counts, conn, m);
                }
            })
            .busy();
        for i in 0..tracks.len() {
            if let Some(conn) = sessions.conn(ConnId::new(i as u32)) {
                while conn.poll_event().is_some() {}
            }
        }
        busy |= !take_failed(sessions, faults).is_empty();
        busy
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.sessions.poll_timeout()
    }

    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        park_driver(self.sessions.driver_mut(), waker, timeout)
    }
}

struct Layout {
    client_cpus: Vec<Option<usize>>,
    server_cpus: Vec<Option<usize>>,
    idle: IdlePolicy,
    idle_name: String,
    oversubscribed: bool,
    cpus: usize,
}

fn layout(args: &SoakArgs) -> Result<Layout, String> {
    let polling = args.polling.unwrap_or(true);
    let mut o = Overrides::default();
    for role in Role::ALL {
        o.role_mut(role).enable_polling = Some(FlagOverride::new("--polling", polling));
    }
    if let Some(n) = args.client_reactors {
        o.worker.core_number = Some(FlagOverride::new("--client-reactors", n.max(1)));
    }
    if let Some(n) = args.server_reactors {
        o.ps.core_number = Some(FlagOverride::new("--server-reactors", n.max(1)));
    }
    let n = args.connections;
    let worker =
        NetworkSettings::from_process_env(Role::Worker, n, &o).map_err(|e| e.to_string())?;
    let ps = NetworkSettings::from_process_env(Role::Ps, n, &o).map_err(|e| e.to_string())?;
    let c = worker.cores.value.min(n).max(1);
    let s = ps.cores.value.min(n).max(1);
    let usable = CpuSet::process_affinity().map_err(|e| format!("reading CPU affinity: {e}"))?;
    let topo = Topology::detect().unwrap_or_default();
    let p = plan(
        &Placement::MaxPack,
        c + s,
        ReactorMode::PollThenPark,
        &usable,
        &topo,
    )
    .map_err(|e| format!("placing {} reactors: {e}", c + s))?;
    let cpus = p.cpus();
    let (idle, idle_name) = if !polling {
        (IdlePolicy::Park, "park".to_owned())
    } else if p.oversubscribed {
        let us = match worker.idle_policy() {
            starwire_config::IdlePolicy::PollThenPark(d) => d.as_micros() as u64,
            _ => 50,
        };
        (
            IdlePolicy::PollThenPark(Duration::from_micros(us)),
            format!(
                "poll-then-park ({us} us): {} reactors on {} cpus",
                c + s,
                usable.len()
            ),
        )
    } else {
        match worker.idle_policy() {
            starwire_config::IdlePolicy::PollThenPark(d) => (
                IdlePolicy::PollThenPark(d),
                format!("poll-then-park ({} us)", d.as_micros()),
            ),
            _ => (IdlePolicy::BusyPoll, "busy-poll".to_owned()),
        }
    };
    Ok(Layout {
        client_cpus: cpus[..c].to_vec(),
        server_cpus: cpus[c..].to_vec(),
        idle,
        idle_name,
        oversubscribed: p.oversubscribed,
        cpus: usable.len(),
    })
}

fn spec(index: usize, cpu: Option<usize>, idle: IdlePolicy) -> ReactorSpec {
    ReactorSpec {
        index,
        cpu,
        idle,
        max_park: Duration::from_millis(50),
    }
}

struct Outcome {
    counts: Counts,
    faults: FaultCounts,
}

/// One reactor's driver and its connections, with each connection's
/// number in the whole soak.
struct Group<D> {
    driver: D,
    conns: Vec<(ConnId, u64)>,
}

/// Stream `i` of `streams` goes to group `i % groups` (one driver per
/// reactor, made by `make`), attached by `attach` with its number `i`.
fn groups<D>(
    streams: Vec<TcpStream>,
    groups: usize,
    mut make: impl FnMut() -> Result<D, String>,
    mut attach: impl FnMut(&mut D, TcpStream, u64) -> Result<ConnId, String>,
) -> Result<Vec<Group<D>>, String> {
    let mut out = (0..groups.max(1))
        .map(|_| {
            make().map(|driver| Group {
                driver,
                conns: Vec::new(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let n = out.len();
    for (i, s) in streams.into_iter().enumerate() {
        let g = &mut out[i % n];
        let id = attach(&mut g.driver, s, i as u64)?;
        g.conns.push((id, i as u64));
    }
    Ok(out)
}

/// [`groups`] of drivers of TCP streams made by `make`.
fn stream_groups<D: StreamDriver>(
    streams: Vec<TcpStream>,
    n: usize,
    make: impl FnMut() -> Result<D, String>,
) -> Result<Vec<Group<D>>, String> {
    groups(streams, n, make, |d, s, _| {
        d.attach_stream(s)
            .map_err(|e| format!("attaching a connection: {e}"))
    })
}

fn run_soak<D: SoakDriver>(
    args: &SoakArgs,
    lay: &Layout,
    clients: Vec<Group<D>>,
    servers: Vec<Group<D>>,
) -> Result<Outcome, String> {
    let nc = clients.len();
    let start = Instant::now();
    let stop_sending = start + Duration::from_secs_f64(args.duration);
    let give_up = stop_sending + Duration::from_secs_f64(args.drain);
    let mut server_reactors = Vec::new();
    for (k, g) in servers.into_iter().enumerate() {
        let cfg = conn_config(TaskRole::Ps, 256);
        let r = Reactor::spawn(spec(nc + k, lay.server_cpus[k], lay.idle), move |_| {
            let mut sessions = Sessions::new(g.driver);
            let mut tracks = Vec::new();
            for &(id, _) in &g.conns {
                sessions.insert(id, cfg.clone());
                if tracks.len() <= id.index() {
                    tracks.resize_with(id.index() + 1, SeqTrack::default);
                }
            }
            SoakServer {
                sessions,
                tracks,
                counts: Counts::default(),
                faults: FaultCounts::default(),
            }
        })
        .map_err(|e| format!("server reactor {k}: {e}"))?;
        server_reactors.push(r);
    }
    let mut client_reactors = Vec::new();
    for (k, g) in clients.into_iter().enumerate() {
        let inflight = args.inflight.max(1);
        let max_size = args.max_size;
        let cfg = conn_config(TaskRole::Worker, 256);
        let r = Reactor::spawn(spec(k, lay.client_cpus[k], lay.idle), move |_| {
            let mut sessions = Sessions::new(g.driver);
            let mut conns = Vec::new();
            for &(id, index) in &g.conns {
                sessions.insert(id, cfg.clone());
                if conns.len() <= id.index() {
                    conns.resize_with(id.index() + 1, || None);
                }
                conns[id.index()] = Some(ClientConn {
                    index,
                    next_seq: 0,
                    outstanding: HashMap::new(),
                    track: SeqTrack::default(),
                });
            }
            SoakClient {
                sessions,
                conns,
                inflight,
                max_size,
                stop_sending,
                give_up,
                counts: Counts::default(),
                faults: FaultCounts::default(),
                done: false,
            }
        })
        .map_err(|e| format!("client reactor {k}: {e}"))?;
        client_reactors.push(r);
    }
    let mut counts = Counts::default();
    let mut faults = FaultCounts::default();
    let mut progress_at = Instant::now() + Duration::from_secs(5);
    // Wait for the clients (bounded by duration + drain), showing progress.
    while Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(100));
        if !args.json && Instant::now() >= progress_at {
            progress_at += Duration::from_secs(5);
            eprint!(
                "\r[starwire soak] {:>5.0}/{:.0} s",
                start.elapsed().as_secs_f64(),
                args.duration
            );
        }
    }
    if !args.json && start.elapsed() > Duration::from_secs(5) {
        eprintln!();
    }
    for (k, r) in client_reactors.into_iter().enumerate() {
        let (client, _) = r.join().map_err(|e| format!("client reactor {k}: {e}"))?;
        counts.add(&client.counts);
        faults.add_counts(client.faults);
        faults.add_counts(fault_counts(&client.sessions));
    }
    for (k, r) in server_reactors.into_iter().enumerate() {
        let (server, _) = r.stop().map_err(|e| format!("server reactor {k}: {e}"))?;
        let mut sc = server.counts;
        // Requests are counted by the client; the server contributes only
        // what it detected on the request path.
        sc.messages = 0;
        sc.answered = 0;
        counts.add(&sc);
        faults.add_counts(server.faults);
        faults.add_counts(fault_counts(&server.sessions));
    }
    Ok(Outcome { counts, faults })
}

fn connect_pairs(n: usize) -> Result<(Vec<TcpStream>, Vec<TcpStream>), String> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| format!("binding a loopback listener: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let mut clients = Vec::with_capacity(n);
    let mut servers = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?);
        let (s, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        servers.push(s);
    }
    Ok((clients, servers))
}

/// Run `starwire soak`. Returns whether the soak passed.
pub fn main(args: SoakArgs) -> Result<bool, String> {
    if args.connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    if !(args.duration > 0.0 && args.duration.is_finite() && args.drain >= 0.0) {
        return Err("--duration must be positive and --drain non-negative".into());
    }
    if args.max_size > (16 << 20) {
        return Err("--max-size: at most 16 MiB".into());
    }
    let rss_start_kb = rss_kb();
    let lay = layout(&args)?;
    let (cs, ss) = connect_pairs(args.connections)?;
    #[cfg(all(feature = "uring", target_os = "linux"))]
    if args.backend == "uring" {
        if args.faults.is_some() {
            return Err("--faults is supported with --backend tcp only".into());
        }
        crate::backend::Backend::Uring.check_available()?;
        // Each ring binds to its reactor thread at the first enter.
        let cfg = crate::bench::sessions::uring_config(lay.idle, 0);
        let make = || starwire_uring::UringDriver::new(&cfg).map_err(|e| e.to_string());
        let ct = stream_groups(cs, lay.client_cpus.len(), make)?;
        let st = stream_groups(ss, lay.server_cpus.len(), make)?;
        let out = run_soak(&args, &lay, ct, st)?;
        return report(&args, &lay, rss_start_kb, out);
    }
    let cfg = TcpConfig::default();
    let out = match args.faults {
        None => {
            let make = || TcpDriver::new(cfg).map_err(|e| format!("tcp driver: {e}"));
            let ct = stream_groups(cs, lay.client_cpus.len(), make)?;
            let st = stream_groups(ss, lay.server_cpus.len(), make)?;
            run_soak(&args, &lay, ct, st)?
        }
        Some(spec) => {
            // Client link `i` injects with seed `seed + i`, server link `i`
            // with `seed + 2^20 + i`.
            let faulty = |base: u64| {
                move |d: &mut Links<Faulty<TcpTransport>>, s: TcpStream, i: u64| {
                    let t = TcpTransport::new(s, cfg).map_err(|e| format!("tcp transport: {e}"))?;
                    let mut f = spec;
                    f.seed = spec.seed.wrapping_add(base + i);
                    Ok(d.attach(Faulty::new(t, f)))
                }
            };
            let make = || Ok(Links::new(cfg.max_frame_len));
            let ct = groups(cs, lay.client_cpus.len(), make, faulty(0))?;
            let st = groups(ss, lay.server_cpus.len(), make, faulty(1 << 20))?;
            run_soak(&args, &lay, ct, st)?
        }
    };
    report(&args, &lay, rss_start_kb, out)
}

fn report(
    args: &SoakArgs,
    lay: &Layout,
    rss_start_kb: Option<u64>,
    out: Outcome,
) -> Result<bool, String> {
    let rss_end_kb = rss_kb();
    let c = out.counts;
    let passed = c.messages > 0
        && c.lost == 0
        && c.duplicated == 0
        && c.corrupted == 0
        && c.out_of_order == 0
        && c.failed == 0;
    let report = Report {
        backend: args.backend.clone(),
        connections: args.connections,
        duration_s: args.duration,
        faults: args.faults.map(|f| f.to_string()),
        client_reactors: lay.client_cpus.len(),
        server_reactors: lay.server_cpus.len(),
        cpus: lay.cpus,
        oversubscribed: lay.oversubscribed,
        idle_policy: lay.idle_name.clone(),
        messages: c.messages,
        answered: c.answered,
        lost: c.lost,
        duplicated: c.duplicated,
        corrupted: c.corrupted,
        out_of_order: c.out_of_order,
        connections_failed: c.failed,
        faults_injected: args.faults.map(|_| out.faults),
        rss_start_kb,
        rss_end_kb,
        passed,
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
        "  reactors     {} client + {} server on {} cpus; idle policy {}{}",
        r.client_reactors,
        r.server_reactors,
        r.cpus,
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
    println!("  lost         {}", r.lost);
    println!("  duplicated   {}", r.duplicated);
    println!("  corrupted    {}", r.corrupted);
    println!("  out of order {}", r.out_of_order);
    println!("  conn. failed {}", r.connections_failed);
    if let Some(f) = r.faults_injected {
        println!(
            "  injected     dropped {}, corrupted {}, delayed {}, reordered {}",
            f.dropped, f.corrupted, f.delayed, f.reordered
        );
    }
    println!(
        "  rss          {} -> {}",
        kb(r.rss_start_kb),
        kb(r.rss_end_kb)
    );
    println!("  result       {}", if r.passed { "PASS" } else { "FAIL" });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_catches_every_single_bit_flip() {
        let body = make_body(42, 300, 7);
        let flat: Vec<u8> = body.segments().iter().flat_map(|s| s.to_vec()).collect();
        assert_eq!(check_body(&flat), Some(42));
        for bit in 0..flat.len() * 8 {
            let mut b = flat.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(check_body(&b), Some(42), "bit {bit} undetected");
        }
    }

    #[test]
    fn seq_tracking_counts_reorders_and_duplicates() {
        let mut t = SeqTrack::default();
        let mut c = Counts::default();
        for s in [0, 1, 3, 2, 4, 4] {
            t.see(s, &mut c);
        }
        assert_eq!(c.out_of_order, 1);
        assert_eq!(c.duplicated, 1);
    }
}

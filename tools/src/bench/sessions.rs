//! starwire sessions over any backend: the load generator and the
//! echo/ack server are [`Service`]s of the session layer, each on an
//! [`Endpoint`] that a reactor pinned to its core turns, with one driver
//! holding every connection of the run. The client attaches the streams it
//! dialed; the server's come from an [`Acceptor`] on the run's data
//! listener. No application thread sits between the reactors and the
//! sessions. The same code runs over TCP and io_uring through
//! [`BenchDriver`].

use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_tcp::{TcpConfig, TcpDriver};
use starwire_transport::accept::{inboxes, AcceptConfig, Acceptor};
use starwire_transport::fusion::{FusionBatcher, FusionConfig, OutTensor};
use starwire_transport::reactor::{IdlePolicy, Reactor, ReactorSpec};
use starwire_transport::wire::tensor::DType;
use starwire_transport::wire::tensors::TensorList;
use starwire_transport::wire::{Opcode, Status, HEADER_LEN};
use starwire_transport::{
    ConnConfig, ConnError, ConnId, Connection, Driver, Endpoint, Incoming, Payload, PeerInfo,
    Service, Sessions, StreamDriver, TaskRole, TransportError,
};

use super::hist::{IntervalReport, Rtts};
use super::packets::{ClientPackets, DatagramCounters};
use super::{Completion, Measured, Mode, RequestBudget, Run, WarmupGate, ACCEPT_TIMEOUT};

/// TCP settings both ends derive from the plan, so they agree: a frame
/// holds the largest payload whole (no chunking in the measurement).
pub fn tcp_config(max_payload: usize) -> TcpConfig {
    let frame = (max_payload + HEADER_LEN).next_power_of_two().max(1 << 20);
    TcpConfig {
        max_frame_len: frame,
        rx_buffer_len: 2 * frame,
        tx_queue_limit_bytes: (4 * frame).max(4 << 20),
        ..TcpConfig::default()
    }
}

/// A driver the bench runs over, with its counters.
pub trait BenchDriver: Driver + Send + 'static {
    /// System calls the driver made so far for every connection (reactor
    /// parks in `poll(2)` not included; parks in the driver's own wait
    /// are).
    fn syscalls(&self) -> u64;
    /// Zero-copy sends and how many of them the kernel reported as copied,
    /// for drivers that try zero copy.
    fn zero_copy(&self) -> Option<(u64, u64)> {
        None
    }
    /// The driver's counters, for `RUST_LOG=debug`.
    fn counters_text(&self) -> String;
    /// The packet counters of a datagram driver (dpdk), for the row.
    fn datagram(&self) -> Option<DatagramCounters> {
        None
    }
}

impl BenchDriver for TcpDriver {
    fn syscalls(&self) -> u64 {
        self.transports()
            .map(|(_, t)| {
                let s = t.stats();
                s.write_calls + s.read_calls
            })
            .sum()
    }
    fn counters_text(&self) -> String {
        let all: Vec<String> = self
            .transports()
            .map(|(_, t)| format!("{:?}", t.stats()))
            .collect();
        all.join("; ")
    }
}

#[cfg(all(feature = "uring", target_os = "linux"))]
impl BenchDriver for starwire_uring::UringDriver {
    fn syscalls(&self) -> u64 {
        // Parks in the ring are enters; eventfd drains are reads inside
        // an enter, except those that fell back to read(2).
        let s = self.stats();
        s.enters + s.eventfd_read_syscalls
    }
    fn zero_copy(&self) -> Option<(u64, u64)> {
        let s = self.stats();
        Some((s.zc_sends, s.zc_copied))
    }
    fn counters_text(&self) -> String {
        format!("{:?}", self.stats())
    }
}

#[cfg(all(feature = "verbs", target_os = "linux"))]
impl BenchDriver for starwire_verbs::VerbsDriver {
    /// Parks (each a `poll(2)`) and completion events read: posting and
    /// polling bypass the kernel.
    fn syscalls(&self) -> u64 {
        let c = self.counters();
        c.parks + c.cq_events
    }
    fn counters_text(&self) -> String {
        self.counters().to_string()
    }
}

/// io_uring settings both ends derive from the plan: frames as for TCP
/// ([`tcp_config`]), so a frame holds the largest payload whole. A reactor
/// that polls (busy, or before it parks) receives in spin mode, one that
/// parks at once with bounded single receives (`STARWIRE_URING_RECV`
/// overrides).
#[cfg(all(feature = "uring", target_os = "linux"))]
pub fn uring_config(idle: IdlePolicy, max_payload: usize) -> starwire_uring::UringConfig {
    let tcp = tcp_config(max_payload);
    starwire_uring::UringConfig {
        max_frame_len: tcp.max_frame_len,
        tx_queue_limit_bytes: tcp.tx_queue_limit_bytes,
        ..starwire_uring::UringConfig::for_polling(!matches!(idle, IdlePolicy::Park))
    }
}

/// Connection settings of one end.
pub fn conn_config(role: TaskRole, window: u32) -> ConnConfig {
    let incarnation = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let (job, task_index) = match role {
        TaskRole::Ps => ("ps", 0),
        TaskRole::Worker => ("worker", 0),
    };
    let mut c = ConnConfig::new(PeerInfo {
        role,
        job: job.to_owned(),
        task_index,
        incarnation,
        shards: 1,
    });
    c.recv_window = window.max(c.recv_window);
    c.send_queue_limit = c.send_queue_limit.max(window as usize * 2);
    c.token = BENCH_TOKEN.get().cloned().flatten();
    c
}

/// The cluster token of `bench --listen` / `--connect` (`--token-file` or
/// STARWIRE_CLUSTER_TOKEN), set once by `bench::main`: the data
/// connections of both ends prove it in their handshake.
pub static BENCH_TOKEN: std::sync::OnceLock<Option<starwire_transport::ClusterToken>> =
    std::sync::OnceLock::new();

fn spec(index: usize, cpu: Option<usize>, idle: IdlePolicy) -> ReactorSpec {
    ReactorSpec {
        index,
        cpu,
        idle,
        max_park: Duration::from_millis(100),
    }
}

/// The server's role: answers `Rpc` with an echo, `Tensors` (after
/// decoding the list) and everything else with an empty ack, on every
/// connection of the run; done once the run's `want` connections have
/// come and gone, or when they did not all come within [`ACCEPT_TIMEOUT`]
/// (a client that failed part-way through connecting must not leave the
/// server waiting for good).
#[derive(Debug)]
pub struct EchoServer {
    want: usize,
    attached: usize,
    /// Connections attached and not ended yet.
    live: usize,
    /// When the connections still missing stop being waited for; set at
    /// the first turn.
    accept_by: Option<Instant>,
    timed_out: bool,
    error: Option<String>,
}

impl EchoServer {
    fn new(want: usize) -> Self {
        Self {
            want,
            attached: 0,
            live: 0,
            accept_by: None,
            timed_out: false,
            error: None,
        }
    }
}

fn answer(conn: &mut Connection, m: Incoming<'_>, error: &mut Option<String>) {
    let Incoming::Request {
        id,
        opcode,
        oneway: false,
        body,
        ..
    } = m
    else {
        return;
    };
    let (status, reply) = match opcode {
        Opcode::Rpc => (
            Status::Ok,
            Payload::from_bytes(Bytes::copy_from_slice(body)),
        ),
        Opcode::Tensors => match TensorList::parse(body) {
            Ok(_) => (Status::Ok, Payload::empty()),
            Err(_) => (Status::BadRequest, Payload::empty()),
        },
        _ => (Status::Ok, Payload::empty()),
    };
    if let Err(e) = conn.respond(id, opcode, status, reply) {
        error.get_or_insert_with(|| format!("server respond: {e}"));
    }
}

impl<D: Driver> Service<D> for EchoServer {
    fn on_attach(&mut self, _id: ConnId, _shard: u32, _now: Instant) {
        self.attached += 1;
        self.live += 1;
    }

    fn on_message(
        &mut self,
        _id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        answer(conn, msg, &mut self.error);
        Ok(())
    }

    fn on_closed(
        &mut self,
        _id: ConnId,
        _conn: &mut Connection,
        error: &ConnError,
        _driver: &D,
        _now: Instant,
    ) {
        // The client closing its connection ends it; anything else is the
        // run's error. Either way the connection goes, and its socket with
        // it; the last one ends the run.
        self.live = self.live.saturating_sub(1);
        if !matches!(
            error,
            ConnError::Closed | ConnError::Transport(TransportError::Closed)
        ) {
            self.error
                .get_or_insert_with(|| format!("server connection: {error}"));
        }
    }

    fn poll(&mut self, _sessions: &mut Sessions<D>, now: Instant) -> bool {
        let by = *self.accept_by.get_or_insert(now + ACCEPT_TIMEOUT);
        if self.attached < self.want && now >= by && !self.timed_out {
            self.timed_out = true;
            self.error.get_or_insert_with(|| {
                format!(
                    "{} of {} data connections arrived within {} s",
                    self.attached,
                    self.want,
                    ACCEPT_TIMEOUT.as_secs()
                )
            });
            return true;
        }
        false
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.accept_by.filter(|_| self.attached < self.want)
    }

    fn finished(&self) -> bool {
        self.timed_out || (self.attached >= self.want && self.live == 0)
    }
}

/// Serve the run's `want` data connections, accepted on `data` (each
/// with its preamble for shard 0), with `driver` on a reactor pinned to
/// `core`; returns when the client has closed all of them.
pub fn serve<D: BenchDriver + StreamDriver>(
    driver: D,
    data: TcpListener,
    want: usize,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<(), String> {
    let cfg = conn_config(TaskRole::Ps, window_for(run));
    let (tx, rx) = inboxes(1).map_err(|e| format!("data acceptor: {e}"))?;
    let rx = rx.into_iter().next().ok_or("data acceptor: no inbox")?;
    let reactor = Reactor::spawn(spec(1, core, idle), move |_| {
        Endpoint::new(driver, EchoServer::new(want), cfg).with_inbox(rx)
    })
    .map_err(|e| format!("server reactor: {e}"))?;
    let acceptor = match Acceptor::spawn(data, tx, vec![reactor.waker()], AcceptConfig::default()) {
        Ok(a) => a,
        Err(e) => {
            let _ = reactor.stop();
            return Err(format!("data acceptor: {e}"));
        }
    };
    let joined = reactor.join();
    drop(acceptor);
    server_outcome(joined).map(|_| ())
}

/// Serve the connections `ids`, already connected on `driver` (a
/// datagram driver whose ends exchanged ids out of band), on a reactor
/// pinned to `core` that runs `on_thread` first; returns when the client
/// has closed all of them.
#[cfg(feature = "dpdk")]
pub fn serve_opened<D: BenchDriver>(
    driver: D,
    ids: Vec<ConnId>,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
    on_thread: impl FnOnce() + Send + 'static,
) -> Result<Option<DatagramCounters>, String> {
    let mut cfg = conn_config(TaskRole::Ps, window_for(run));
    // The server end of connections opened over a datagram link: no
    // acceptor marks them, and the handshake's proofs name the side.
    cfg.side = starwire_transport::Side::Acceptor;
    let reactor = Reactor::spawn(spec(1, core, idle), move |_| {
        on_thread();
        let mut ep = Endpoint::new(driver, EchoServer::new(ids.len()), cfg);
        let now = Instant::now();
        for id in ids {
            ep.open(id, 0, now);
        }
        ep
    })
    .map_err(|e| format!("server reactor: {e}"))?;
    server_outcome(reactor.join())
}

type Joined<D, S> = Result<
    (Endpoint<D, S>, starwire_transport::reactor::ReactorStats),
    starwire_transport::reactor::ReactorError,
>;

/// The server's outcome, with its driver's packet counters (dpdk).
fn server_outcome<D: BenchDriver>(
    joined: Joined<D, EchoServer>,
) -> Result<Option<DatagramCounters>, String> {
    let (server, rstats) = joined.map_err(|e| format!("server reactor: {e}"))?;
    tracing::debug!(
        reactor = ?rstats,
        backend = %server.sessions().driver().counters_text(),
        "bench server counters"
    );
    match &server.service().error {
        Some(e) => Err(e.clone()),
        None => Ok(server.sessions().driver().datagram()),
    }
}

fn window_for(run: &Run) -> u32 {
    let frames = match run.mode {
        Mode::Fuse => run.tensors,
        _ => run.inflight,
    };
    (frames as u32 + 16).max(256)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FusePhase {
    Fused,
    Unfused,
}

#[derive(Debug)]
struct FuseState {
    tensors: Vec<OutTensor>,
    fused: FusionBatcher,
    unfused: FusionBatcher,
    phase: FusePhase,
    /// Acks still missing for the current step; 0 = no step running.
    step_acks: usize,
    steps: u64,
    /// The current phase's warm-up (each phase warms up).
    gate: WarmupGate,
    phase_start: Option<Instant>,
    fused_rate: Option<f64>,
    unfused_rate: Option<f64>,
}

/// With `--rate`, how long before a due time a parked client reactor
/// asks to wake: a park lasts whole milliseconds of `poll(2)` (rounded
/// down, at least one), and the kernel may add its timer slack (50 µs by
/// default) to it.
const WAKE_EARLY: Duration = Duration::from_micros(200);
/// With `--rate`, how near a due time the client reactor spins instead of
/// parking: the shortest park (1 ms) could outlast it.
const SPIN_WITHIN: Duration = Duration::from_micros(1200);

/// The load generator: the client's role, over every connection of the
/// run (fuse mode uses one).
#[derive(Debug)]
pub struct LoadGen {
    /// The connections, in the order they were attached.
    ids: Vec<ConnId>,
    st: GenState,
}

#[derive(Debug)]
struct GenState {
    run: Run,
    op: Opcode,
    payload: Bytes,
    record: bool,
    /// By [`ConnId::index`]: the outstanding requests (id, the instant
    /// its latency counts from, measured), in order: a measured request's
    /// is when it was due with `--rate`, else when it was sent.
    starts: Vec<VecDeque<(u64, Instant, bool)>>,
    /// By [`ConnId::index`]: the connection's rank in attach order, in
    /// `budget`.
    rank: Vec<usize>,
    /// Over all connections.
    issued: u64,
    completed: u64,
    budget: RequestBudget,
    rtts: Rtts,
    interval: Option<IntervalReport>,
    fuse: Option<FuseState>,
    kicked: bool,
    complete: bool,
    closed: bool,
    error: Option<String>,
}

impl GenState {
    /// The state of `run`, before its connections are attached.
    fn new(run: &Run) -> Self {
        // The server echoes `Rpc` and acks `DensePush` empty.
        let op = if run.echoed() {
            Opcode::Rpc
        } else {
            Opcode::DensePush
        };
        let record = matches!(run.mode, Mode::Lat | Mode::Rate);
        let payload = Bytes::from((0..run.size).map(|i| i as u8).collect::<Vec<u8>>());
        let fuse = (run.mode == Mode::Fuse).then(|| {
            let tensors = (0..run.tensors as u64)
                .map(|k| {
                    OutTensor::new(k, DType::U8, vec![run.size as u64], payload.clone())
                        .expect("a u8 tensor of `size` elements is valid")
                })
                .collect();
            let on = FusionConfig {
                enabled: true,
                ..FusionConfig::default()
            };
            let off = FusionConfig {
                enabled: false,
                ..FusionConfig::default()
            };
            FuseState {
                tensors,
                fused: FusionBatcher::new(on, 1),
                unfused: FusionBatcher::new(off, 1),
                phase: FusePhase::Fused,
                step_acks: 0,
                steps: 0,
                gate: WarmupGate::new(run.warmup),
                phase_start: None,
                fused_rate: None,
                unfused_rate: None,
            }
        });
        Self {
            op,
            payload,
            record,
            starts: Vec::new(),
            rank: Vec::new(),
            issued: 0,
            completed: 0,
            budget: RequestBudget::new(run.warmup, run.iters, run.duration()).with_rate(run.rate),
            rtts: Rtts::new(),
            interval: run.interval_report(),
            fuse,
            kicked: false,
            complete: false,
            closed: false,
            error: None,
            run: run.clone(),
        }
    }

    /// Connection `c` (its [`ConnId::index`]) joined the run.
    fn attach(&mut self, c: usize) {
        if self.starts.len() <= c {
            let inflight = self.run.inflight;
            self.starts
                .resize_with(c + 1, || VecDeque::with_capacity(inflight));
            self.rank.resize(c + 1, 0);
        }
        self.rank[c] = self.budget.add_connection();
    }

    /// The run's connections are ready at `now`: with `--warmup 0` the
    /// measured window starts.
    fn begin(&mut self, now: Instant) {
        if self.budget.begin(now) {
            self.start_interval(now);
        }
    }

    fn start_interval(&mut self, now: Instant) {
        if let Some(r) = &mut self.interval {
            r.start(now);
        }
    }

    fn fail(&mut self, e: String) {
        self.error.get_or_insert(e);
        self.complete = true;
    }

    /// Top up the outstanding requests of connection `c` (its
    /// [`ConnId::index`]) at `now`: `inflight` on each, until its share
    /// of the run's budget is issued (see [`RequestBudget`]); with
    /// `--rate`, those of its measured requests that are due. Returns how
    /// many it sent.
    fn issue(&mut self, c: usize, conn: &mut Connection, now: Instant) -> usize {
        if self.fuse.is_some() {
            self.issue_step(conn);
            return 0;
        }
        let inflight = self.run.inflight;
        let rank = self.rank[c];
        let mut sent = 0;
        while self.starts[c].len() < inflight && self.budget.may_start(rank, now) {
            match conn.request(self.op, 0, Payload::from_bytes(self.payload.clone()), None) {
                Ok(id) => {
                    let origin = self.budget.on_send(rank, now);
                    self.starts[c].push_back((id, origin.unwrap_or(now), origin.is_some()));
                    self.issued += 1;
                    sent += 1;
                }
                Err(e) => {
                    self.fail(format!("request: {e}"));
                    return sent;
                }
            }
        }
        // With a rate, everything sent may be answered while requests are
        // still to come on the schedule.
        if self.issued == self.completed && !self.budget.scheduled_left(now) {
            self.complete = true;
        }
        sent
    }

    /// With `--rate`, once the measurement started: the earliest instant
    /// a connection with room in its window has a request due. A
    /// connection whose window is full sends when a response frees it.
    fn next_due(&self) -> Option<Instant> {
        if !self.budget.open_loop() || self.complete {
            return None;
        }
        self.starts
            .iter()
            .zip(&self.rank)
            .filter(|(out, _)| out.len() < self.run.inflight)
            .filter_map(|(_, &rank)| self.budget.next_due(rank))
            .min()
    }

    /// A message `m` on connection `c`, received at `now`; `clock` reads
    /// the time the refill requests leave at (after the completion is
    /// recorded, so a round trip does not hold the client's own
    /// bookkeeping, as raw's does not).
    fn on_incoming(
        &mut self,
        c: usize,
        conn: &mut Connection,
        m: Incoming<'_>,
        now: Instant,
        clock: impl Fn() -> Instant,
    ) {
        let Incoming::Response { id, status, .. } = m else {
            return;
        };
        if status != Status::Ok {
            return self.fail(format!("request {id} answered {status:?}"));
        }
        if self.fuse.is_some() {
            return self.on_step_ack(conn);
        }
        let Some((want, t0, measured)) = self.starts[c].pop_front() else {
            return self.fail(format!("response {id} without a request"));
        };
        if want != id {
            return self.fail(format!("response {id} out of order (expected {want})"));
        }
        self.completed += 1;
        match self.budget.on_complete(measured, now) {
            Completion::Measured => {
                let ns = now.duration_since(t0).as_nanos() as u64;
                if self.record {
                    self.rtts.record(ns);
                }
                if let Some(r) = &mut self.interval {
                    r.on_complete(now, self.record.then_some(ns));
                }
            }
            Completion::Last => self.start_interval(now),
            Completion::Warmup => {}
        }
        self.issue(c, conn, clock());
    }

    fn issue_step(&mut self, conn: &mut Connection) {
        let now = Instant::now();
        let run = &self.run;
        let Some(f) = self.fuse.as_mut() else { return };
        if f.step_acks > 0 {
            return;
        }
        let more = match (run.duration(), f.phase_start) {
            (Some(d), Some(t0)) => now.duration_since(t0) < d,
            (Some(_), None) => true,
            (None, _) => f.steps < f.gate.budget(run.iters),
        };
        if !more {
            let secs = f
                .phase_start
                .map_or(0.0, |t0| now.duration_since(t0).as_secs_f64());
            let measured = f.gate.measured(f.steps);
            let rate = (secs > 0.0).then(|| measured as f64 / secs);
            match f.phase {
                FusePhase::Fused => {
                    f.fused_rate = rate;
                    self.completed = measured;
                    f.phase = FusePhase::Unfused;
                    f.steps = 0;
                    f.gate = WarmupGate::new(run.warmup);
                    f.phase_start = None;
                }
                FusePhase::Unfused => {
                    f.unfused_rate = rate;
                    self.completed = self.completed.min(measured);
                    self.complete = true;
                    return;
                }
            }
        }
        if f.steps == 0 && f.gate.is_none() {
            f.phase_start = Some(now);
        }
        f.gate.on_send(now);
        let batcher = match f.phase {
            FusePhase::Fused => &mut f.fused,
            FusePhase::Unfused => &mut f.unfused,
        };
        for t in &f.tensors {
            batcher.add(0, t);
        }
        let mut sent = 0usize;
        let mut err = None;
        batcher.finish_step(
            &mut |_, body, _| match conn.request(Opcode::Tensors, 0, body, None) {
                Ok(_) => sent += 1,
                Err(e) => {
                    err.get_or_insert(e.to_string());
                }
            },
        );
        f.step_acks = sent;
        // Requests of both phases: the per-message figures divide by them.
        self.issued += sent as u64;
        if let Some(e) = err {
            self.fail(format!("fuse request: {e}"));
        }
    }

    fn on_step_ack(&mut self, conn: &mut Connection) {
        let Some(f) = self.fuse.as_mut() else { return };
        f.step_acks = f.step_acks.saturating_sub(1);
        if f.step_acks > 0 {
            return;
        }
        f.steps += 1;
        let now = Instant::now();
        if f.gate.on_complete(f.steps, now) == Completion::Last {
            f.phase_start = Some(now);
        }
        self.issue_step(conn);
    }
}

impl<D: Driver> Service<D> for LoadGen {
    fn on_attach(&mut self, id: ConnId, _shard: u32, _now: Instant) {
        self.ids.push(id);
        self.st.attach(id.index());
    }

    fn on_message(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        if !self.st.closed {
            // The clock read for this message, not the turn's `now`: a
            // turn handles many messages.
            self.st
                .on_incoming(id.index(), conn, msg, Instant::now(), Instant::now);
        }
        Ok(())
    }

    fn on_closed(
        &mut self,
        _id: ConnId,
        _conn: &mut Connection,
        error: &ConnError,
        _driver: &D,
        _now: Instant,
    ) {
        // Once the run closed its connections, their ends are no failure.
        if !self.st.closed {
            self.st.fail(format!("client connection: {error}"));
        }
    }

    /// The first turn that finds every connection (attached before the
    /// reactor started) established starts the run on all of them, and
    /// with `--warmup 0` the measured window: the handshakes are set-up,
    /// as the raw and grpc baselines connect before their clocks start.
    /// The turn after the run completed closes them.
    fn poll(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        let Self { ids, st } = self;
        if st.closed {
            return false;
        }
        if !st.kicked && !st.complete {
            // A connection that fails before its handshake completes ends
            // the run (`on_closed`), so this wait ends too.
            let established = ids
                .iter()
                .all(|&id| sessions.conn(id).is_some_and(|c| c.is_established()));
            if !established {
                return false;
            }
            st.kicked = true;
            st.begin(now);
            for &id in ids.iter() {
                if let Some(conn) = sessions.conn(id) {
                    st.issue(id.index(), conn, Instant::now());
                }
            }
            return true;
        }
        if st.complete {
            for &id in ids.iter() {
                if let Some(conn) = sessions.conn(id) {
                    conn.close();
                }
            }
            st.closed = true;
            return true;
        }
        if st.next_due().is_none() {
            return false;
        }
        // `--rate`: the requests that came due since the last turn.
        let now = Instant::now();
        let mut sent = 0;
        for &id in ids.iter() {
            if let Some(conn) = sessions.conn(id) {
                sent += st.issue(id.index(), conn, now);
            }
        }
        // Spinning when the next one is near keeps the reactor from a
        // park that could outlast it (see `SPIN_WITHIN`).
        sent > 0
            || st
                .next_due()
                .is_some_and(|due| due.saturating_duration_since(now) < SPIN_WITHIN)
    }

    /// With `--rate`: shortly before the next request is due (see
    /// `WAKE_EARLY`), so that a parked reactor sends it on time.
    fn next_deadline(&self) -> Option<Instant> {
        let due = self.st.next_due()?;
        Some(due.checked_sub(WAKE_EARLY).unwrap_or(due))
    }

    fn finished(&self) -> bool {
        self.st.closed
    }
}

/// Run the load generator of `run` over `streams` (the run's data
/// connections, dialed), attached to `driver`, on a client reactor pinned
/// to `core`.
pub fn client<D: BenchDriver + StreamDriver>(
    driver: D,
    streams: Vec<TcpStream>,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<Measured, String> {
    let cfg = conn_config(TaskRole::Worker, window_for(run));
    let gen = LoadGen {
        ids: Vec::with_capacity(streams.len()),
        st: GenState::new(run),
    };
    let mut ep = Endpoint::new(driver, gen, cfg);
    let now = Instant::now();
    for s in streams {
        ep.attach_stream(s, 0, now)
            .map_err(|e| format!("attaching a data connection: {e}"))?;
    }
    let reactor = Reactor::spawn(spec(0, core, idle), move |_| ep)
        .map_err(|e| format!("client reactor: {e}"))?;
    client_outcome(reactor.join())
}

/// Run the load generator of `run` over the connections `ids`, already
/// connected on `driver`, on a client reactor pinned to `core` that runs
/// `on_thread` first.
#[cfg(feature = "dpdk")]
pub fn client_opened<D: BenchDriver>(
    driver: D,
    ids: Vec<ConnId>,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
    on_thread: impl FnOnce() + Send + 'static,
) -> Result<Measured, String> {
    let cfg = conn_config(TaskRole::Worker, window_for(run));
    let gen = LoadGen {
        ids: Vec::with_capacity(ids.len()),
        st: GenState::new(run),
    };
    let reactor = Reactor::spawn(spec(0, core, idle), move |_| {
        on_thread();
        let mut ep = Endpoint::new(driver, gen, cfg);
        let now = Instant::now();
        for id in ids {
            ep.open(id, 0, now);
        }
        ep
    })
    .map_err(|e| format!("client reactor: {e}"))?;
    client_outcome(reactor.join())
}

fn client_outcome<D: BenchDriver>(joined: Joined<D, LoadGen>) -> Result<Measured, String> {
    let (ep, rstats) = joined.map_err(|e| format!("client reactor: {e}"))?;
    let (gen, sessions) = ep.into_parts();
    // Each park outside the driver is one poll(2), and one read(2) of the
    // reactor's eventfd when a wake-up ended it; each request is two
    // messages (request and response) on this end.
    let driver = sessions.driver();
    let syscalls = driver.syscalls() + (rstats.parks - rstats.driver_parks) + rstats.waker_reads;
    tracing::debug!(
        reactor = ?rstats,
        backend = %driver.counters_text(),
        "bench client counters"
    );
    let msgs = 2 * gen.st.issued.max(1);
    let syscalls_per_msg = Some(syscalls as f64 / msgs as f64);
    let zero_copy = driver.zero_copy();
    let packets = driver.datagram().map(|counters| ClientPackets {
        counters,
        msgs,
        ..ClientPackets::default()
    });
    let st = gen.st;
    if let Some(e) = st.error {
        return Err(e);
    }
    if let Some(f) = st.fuse {
        return Ok(Measured {
            iters: st.completed,
            elapsed: Duration::ZERO,
            rtts: Rtts::default(),
            fused_steps_per_s: f.fused_rate,
            unfused_steps_per_s: f.unfused_rate,
            syscalls_per_msg,
            zero_copy,
            packets,
        });
    }
    if let (Some(mut r), Some(end)) = (st.interval, st.budget.end()) {
        r.finish(end);
    }
    Ok(Measured {
        iters: st.budget.measured(),
        elapsed: st.budget.elapsed(),
        rtts: st.rtts,
        fused_steps_per_s: None,
        unfused_steps_per_s: None,
        syscalls_per_msg,
        zero_copy,
        packets,
    })
}

#[cfg(test)]
mod tests;

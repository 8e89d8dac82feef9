//! starwire sessions over any backend: the load generator is a [`Shard`]
//! on the client reactor (pinned to the client core), the echo/ack server a
//! [`Shard`] on the server reactor (pinned to the server core). No
//! application thread sits between them and the sessions. The same code
//! runs over TCP and io_uring through [`BenchTransport`].

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_tcp::{TcpConfig, TcpTransport};
use starwire_transport::fusion::{FusionBatcher, FusionConfig, OutTensor};
use starwire_transport::reactor::{
    park_in_shared_driver, IdlePolicy, ParkEnd, ParkWaker, Reactor, ReactorSpec, Shard,
};
use starwire_transport::wire::tensor::DType;
use starwire_transport::wire::tensors::TensorList;
use starwire_transport::wire::{Opcode, Status, HEADER_LEN};
use starwire_transport::DrivenTransport;
use starwire_transport::{
    Body, ConnConfig, ConnError, Connection, Incoming, PeerInfo, Session, TaskRole, TransportError,
};

use super::{Measured, Mode, Run};

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

/// A backend the bench drives: a [`DrivenTransport`] plus its counters.
pub trait BenchTransport: DrivenTransport + Send + 'static {
    /// The connections of one reactor share one driver (an io_uring ring),
    /// whose counters every one of them reports: count them once.
    const SHARED_DRIVER: bool = false;
    /// System calls the backend made so far (reactor parks not included,
    /// unless the backend parks in its own wait, counted here): this
    /// connection's, or its shared driver's.
    fn syscalls(&self) -> u64;
    /// Zero-copy sends and how many of them the kernel reported as copied,
    /// for backends that try zero copy.
    fn zero_copy(&self) -> Option<(u64, u64)> {
        None
    }
    /// The backend's counters, for `RUST_LOG=debug`.
    fn counters(&self) -> String {
        String::new()
    }
}

impl BenchTransport for TcpTransport {
    fn syscalls(&self) -> u64 {
        let s = self.stats();
        s.write_calls + s.read_calls
    }
    fn counters(&self) -> String {
        format!("{:?}", self.stats())
    }
}

#[cfg(all(feature = "uring", target_os = "linux"))]
impl BenchTransport for starwire_uring::UringTransport {
    const SHARED_DRIVER: bool = true;
    fn syscalls(&self) -> u64 {
        // Parks in the ring are enters; eventfd drains are reads inside
        // an enter, except those that fell back to read(2).
        let s = self.ring().stats();
        s.enters + s.eventfd_read_syscalls
    }
    fn zero_copy(&self) -> Option<(u64, u64)> {
        let s = self.ring().stats();
        Some((s.zc_sends, s.zc_copied))
    }
    fn counters(&self) -> String {
        format!("{:?}", self.ring().stats())
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
    c
}

fn spec(index: usize, cpu: Option<usize>, idle: IdlePolicy) -> ReactorSpec {
    ReactorSpec {
        index,
        cpu,
        idle,
        max_park: Duration::from_millis(100),
    }
}

/// The server shard: answers `Rpc` with an echo, `Tensors` (after decoding
/// the list) and everything else with an empty ack, on every connection of
/// the run.
#[derive(Debug)]
pub struct EchoServer<T> {
    /// `None` once the connection ended: dropped, so its socket closes and
    /// the client's requests on it fail rather than wait.
    sessions: Vec<Option<Session<T>>>,
    error: Option<String>,
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
        Opcode::Rpc => (Status::Ok, Body::from_bytes(Bytes::copy_from_slice(body))),
        Opcode::Tensors => match TensorList::parse(body) {
            Ok(_) => (Status::Ok, Body::empty()),
            Err(_) => (Status::BadRequest, Body::empty()),
        },
        _ => (Status::Ok, Body::empty()),
    };
    if let Err(e) = conn.respond(id, opcode, status, reply) {
        error.get_or_insert_with(|| format!("server respond: {e}"));
    }
}

impl<T: BenchTransport> Shard for EchoServer<T> {
    fn turn(&mut self, now: Instant) -> bool {
        let Self { sessions, error } = self;
        let mut busy = false;
        for slot in sessions.iter_mut() {
            let Some(session) = slot else { continue };
            busy |= match session.turn(now, &mut |conn, m| answer(conn, m, error)) {
                Ok(s) => s.busy(),
                Err(e) => {
                    // The client closing its connection ends it; anything
                    // else is the run's error. Either way the session goes,
                    // and its socket with it; the last one ends the run.
                    if !matches!(
                        e,
                        ConnError::Closed | ConnError::Transport(TransportError::Closed)
                    ) {
                        error.get_or_insert_with(|| format!("server connection: {e}"));
                    }
                    *slot = None;
                    true
                }
            };
        }
        end_turn(open(sessions)) | busy
    }

    fn wake_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        wake_fds(open(&self.sessions), out);
    }

    fn write_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        for s in open(&self.sessions) {
            out.extend(s.transport().write_fd());
        }
    }

    /// Parks in the connections' ring when they share one (uring).
    fn park(&self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        park_in_shared_driver(open(&self.sessions).map(Session::transport), waker, timeout)
    }

    fn finished(&self) -> bool {
        open(&self.sessions).next().is_none()
    }
}

/// The sessions of `slots` still open.
fn open<T>(slots: &[Option<Session<T>>]) -> impl Iterator<Item = &Session<T>> {
    slots.iter().flatten()
}

/// The sessions of `sessions` whose driver is theirs to call: the first
/// only when they share one (an io_uring ring), else each.
fn drivers<'a, T: BenchTransport + 'a>(
    sessions: impl Iterator<Item = &'a Session<T>>,
) -> impl Iterator<Item = &'a Session<T>> {
    sessions.take(if T::SHARED_DRIVER { 1 } else { usize::MAX })
}

/// The end of a reactor turn over `sessions`: once per driver (a no-op for
/// tcp).
fn end_turn<'a, T: BenchTransport + 'a>(sessions: impl Iterator<Item = &'a Session<T>>) -> bool {
    drivers(sessions).fold(false, |busy, s| s.transport().end_turn() | busy)
}

/// The park descriptors of `sessions`, one per driver (asking a ring for
/// its descriptor arms its park).
fn wake_fds<'a, T: BenchTransport + 'a>(
    sessions: impl Iterator<Item = &'a Session<T>>,
    out: &mut Vec<BorrowedFd<'a>>,
) {
    out.extend(drivers(sessions).map(|s| s.transport().wake_fd()));
}

/// The backend counters of `sessions` for `RUST_LOG=debug`, per driver.
fn counters<'a, T: BenchTransport + 'a>(sessions: impl Iterator<Item = &'a Session<T>>) -> String {
    let all: Vec<String> = drivers(sessions)
        .map(|s| s.transport().counters())
        .collect();
    all.join("; ")
}

/// Serve the data connections of one run on a reactor pinned to `core`;
/// returns when the client has closed all of them.
pub fn serve<T: BenchTransport>(
    transports: Vec<T>,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<(), String> {
    let window = window_for(run);
    let reactor = Reactor::spawn(spec(1, core, idle), move |_| EchoServer {
        sessions: transports
            .into_iter()
            .map(|t| Some(Session::new(conn_config(TaskRole::Ps, window), t)))
            .collect(),
        error: None,
    })
    .map_err(|e| format!("server reactor: {e}"))?;
    let (shard, rstats) = reactor.join().map_err(|e| format!("server reactor: {e}"))?;
    tracing::debug!(
        reactor = ?rstats,
        backend = %counters(open(&shard.sessions)),
        "bench server counters"
    );
    match shard.error {
        Some(e) => Err(e),
        None => Ok(()),
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
    phase_start: Option<Instant>,
    fused_rate: Option<f64>,
    unfused_rate: Option<f64>,
}

/// The load generator, run as the client reactor's shard.
#[derive(Debug)]
pub struct LoadGen<T> {
    /// One per connection of the run; fuse mode uses one.
    sessions: Vec<Session<T>>,
    st: GenState,
}

#[derive(Debug)]
struct GenState {
    run: Run,
    op: Opcode,
    payload: Bytes,
    record: bool,
    /// Per connection: the outstanding requests (id, start), in order.
    starts: Vec<VecDeque<(u64, Instant)>>,
    /// Over all connections.
    issued: u64,
    completed: u64,
    measure_start: Option<Instant>,
    measure_end: Option<Instant>,
    rtts: Vec<u64>,
    fuse: Option<FuseState>,
    kicked: bool,
    complete: bool,
    closed: bool,
    error: Option<String>,
}

impl GenState {
    fn new(run: &Run, connections: usize) -> Self {
        let (op, record) = match run.mode {
            Mode::Lat => (Opcode::Rpc, true),
            Mode::Rate => (Opcode::DensePush, true),
            Mode::Bw | Mode::Fuse => (Opcode::DensePush, false),
        };
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
                phase_start: None,
                fused_rate: None,
                unfused_rate: None,
            }
        });
        Self {
            op,
            payload,
            record,
            starts: (0..connections.max(1))
                .map(|_| VecDeque::with_capacity(run.inflight))
                .collect(),
            issued: 0,
            completed: 0,
            measure_start: None,
            measure_end: None,
            rtts: Vec::with_capacity(if record { run.iters as usize } else { 0 }),
            fuse,
            kicked: false,
            complete: false,
            closed: false,
            error: None,
            run: run.clone(),
        }
    }

    fn fail(&mut self, e: String) {
        self.error.get_or_insert(e);
        self.complete = true;
    }

    fn may_start(&self, now: Instant) -> bool {
        match (self.run.duration(), self.measure_start) {
            (Some(d), Some(t0)) => now.duration_since(t0) < d,
            (Some(_), None) => true,
            (None, _) => self.issued < self.run.warmup + self.run.iters,
        }
    }

    /// Top up the outstanding requests of connection `c`: `inflight` on
    /// each, until the run's budget (over all connections) is issued.
    fn issue(&mut self, c: usize, conn: &mut Connection) {
        if self.fuse.is_some() {
            return self.issue_step(conn);
        }
        let inflight = self.run.inflight;
        while self.starts[c].len() < inflight {
            let t = Instant::now();
            if !self.may_start(t) {
                break;
            }
            match conn.request(self.op, 0, Body::from_bytes(self.payload.clone()), None) {
                Ok(id) => {
                    self.starts[c].push_back((id, t));
                    self.issued += 1;
                }
                Err(e) => return self.fail(format!("request: {e}")),
            }
        }
        if self.issued == self.completed {
            self.complete = true;
        }
    }

    fn on_incoming(&mut self, c: usize, conn: &mut Connection, m: Incoming<'_>) {
        let Incoming::Response { id, status, .. } = m else {
            return;
        };
        if status != Status::Ok {
            return self.fail(format!("request {id} answered {status:?}"));
        }
        if self.fuse.is_some() {
            return self.on_step_ack(conn);
        }
        let now = Instant::now();
        let Some((want, t0)) = self.starts[c].pop_front() else {
            return self.fail(format!("response {id} without a request"));
        };
        if want != id {
            return self.fail(format!("response {id} out of order (expected {want})"));
        }
        self.completed += 1;
        if self.completed > self.run.warmup && self.record {
            self.rtts.push(now.duration_since(t0).as_nanos() as u64);
        }
        if self.completed == self.run.warmup {
            self.measure_start = Some(now);
        }
        self.measure_end = Some(now);
        self.issue(c, conn);
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
            (None, _) => f.steps < run.warmup + run.iters,
        };
        if !more {
            let secs = f
                .phase_start
                .map_or(0.0, |t0| now.duration_since(t0).as_secs_f64());
            let measured = f.steps.saturating_sub(run.warmup);
            let rate = (secs > 0.0).then(|| measured as f64 / secs);
            match f.phase {
                FusePhase::Fused => {
                    f.fused_rate = rate;
                    self.completed = measured;
                    f.phase = FusePhase::Unfused;
                    f.steps = 0;
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
        if f.steps == 0 && run.warmup == 0 {
            f.phase_start = Some(now);
        }
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
        if let Some(e) = err {
            self.fail(format!("fuse request: {e}"));
        }
    }

    fn on_step_ack(&mut self, conn: &mut Connection) {
        let warmup = self.run.warmup;
        let Some(f) = self.fuse.as_mut() else { return };
        f.step_acks = f.step_acks.saturating_sub(1);
        if f.step_acks > 0 {
            return;
        }
        f.steps += 1;
        if f.steps == warmup {
            f.phase_start = Some(Instant::now());
        }
        self.issue_step(conn);
    }
}

impl<T: BenchTransport> Shard for LoadGen<T> {
    fn turn(&mut self, now: Instant) -> bool {
        if self.st.closed {
            return false;
        }
        let Self { sessions, st } = self;
        if !st.kicked {
            st.kicked = true;
            if st.run.warmup == 0 {
                st.measure_start = Some(now);
            }
            for (c, session) in sessions.iter_mut().enumerate() {
                st.issue(c, session.conn());
            }
        }
        let mut busy = false;
        for (c, session) in sessions.iter_mut().enumerate() {
            busy |= match session.turn(now, &mut |conn, m| st.on_incoming(c, conn, m)) {
                Ok(s) => s.busy(),
                Err(e) => {
                    st.fail(format!("client connection: {e}"));
                    true
                }
            };
        }
        if st.complete {
            for session in sessions.iter_mut() {
                session.conn().close();
                let _ = session.flush(now);
            }
            st.closed = true;
        }
        end_turn(sessions.iter()) | busy
    }

    fn wake_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        wake_fds(self.sessions.iter(), out);
    }

    fn write_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        for s in &self.sessions {
            out.extend(s.transport().write_fd());
        }
    }

    /// Parks in the connections' ring when they share one (uring).
    fn park(&self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        park_in_shared_driver(self.sessions.iter().map(Session::transport), waker, timeout)
    }

    fn finished(&self) -> bool {
        self.st.closed
    }
}

/// Run the load generator of `run` over `transports` (the run's
/// connections) on a client reactor pinned to `core`.
pub fn client<T: BenchTransport>(
    transports: Vec<T>,
    run: &Run,
    core: Option<usize>,
    idle: IdlePolicy,
) -> Result<Measured, String> {
    let window = window_for(run);
    let st = GenState::new(run, transports.len());
    let reactor = Reactor::spawn(spec(0, core, idle), move |_| LoadGen {
        sessions: transports
            .into_iter()
            .map(|t| Session::new(conn_config(TaskRole::Worker, window), t))
            .collect(),
        st,
    })
    .map_err(|e| format!("client reactor: {e}"))?;
    let (gen, rstats) = reactor.join().map_err(|e| format!("client reactor: {e}"))?;
    // Each park outside the backend is one poll(2), and one read(2) of the
    // reactor's eventfd when a wake-up ended it; each request is two
    // messages (request and response) on this end.
    let syscalls = drivers(gen.sessions.iter())
        .map(|s| s.transport().syscalls())
        .sum::<u64>()
        + (rstats.parks - rstats.shard_parks)
        + rstats.waker_reads;
    tracing::debug!(
        reactor = ?rstats,
        backend = %counters(gen.sessions.iter()),
        "bench client counters"
    );
    let msgs = 2 * gen.st.issued.max(1);
    let syscalls_per_msg = Some(syscalls as f64 / msgs as f64);
    let zero_copy = gen.sessions.first().and_then(|s| s.transport().zero_copy());
    let st = gen.st;
    if let Some(e) = st.error {
        return Err(e);
    }
    if let Some(f) = st.fuse {
        return Ok(Measured {
            iters: st.completed,
            elapsed: Duration::ZERO,
            rtts_ns: Vec::new(),
            fused_steps_per_s: f.fused_rate,
            unfused_steps_per_s: f.unfused_rate,
            syscalls_per_msg,
            zero_copy,
        });
    }
    let t0 = st.measure_start.unwrap_or_else(Instant::now);
    let elapsed = st
        .measure_end
        .map_or(Duration::ZERO, |t| t.saturating_duration_since(t0));
    Ok(Measured {
        iters: st.completed.saturating_sub(st.run.warmup),
        elapsed,
        rtts_ns: st.rtts,
        fused_steps_per_s: None,
        unfused_steps_per_s: None,
        syscalls_per_msg,
        zero_copy,
    })
}

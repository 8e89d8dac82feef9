//! The gRPC baseline in the bench (`starwire-grpc`, feature `grpc`): every
//! message is a unary call over tonic's one HTTP/2 connection, the way stock
//! TensorFlow talks to its parameter servers.
//!
//! The calling thread is pinned to the client core; both tokio runtimes
//! (2 workers each, the fixed configuration of docs/backends/grpc.md) are
//! not pinned, as in stock gRPC. Lat sends `Rpc` (echoed), rate and bw send
//! `DensePush` (an empty reply) with K calls outstanding, fuse sends each
//! step's `Tensors` bodies concurrently: one call carrying the fused list,
//! or one call per tensor unfused.

use std::cell::RefCell;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use starwire_grpc::{ConnectionServer, GrpcClient, GrpcConfig, Handler, HandlerError, NextCall};
use starwire_transport::fusion::{FusionBatcher, FusionConfig, OutTensor};
use starwire_transport::wire::tensor::DType;
use starwire_transport::wire::tensors::TensorList;
use starwire_transport::wire::Opcode;
use starwire_transport::Payload;

use super::hist::{IntervalReport, Rtts};
use super::{Completion, Measured, Mode, RequestBudget, Run, WarmupGate};

/// Message limit both ends derive from the run: a fused step must fit.
/// The bench's cluster token, if any, authenticates the data connection.
fn config(run: &Run) -> GrpcConfig {
    let fused = run
        .max_size
        .saturating_add(64)
        .saturating_mul(run.tensors.max(1))
        .saturating_add(1 << 20);
    GrpcConfig {
        max_message_len: fused.max(GrpcConfig::default().max_message_len),
        token: super::sessions::BENCH_TOKEN.get().cloned().flatten(),
        ..GrpcConfig::default()
    }
}

/// The bench server's answers: `Rpc` echoed, `Tensors` decoded then acked,
/// every other message-layer opcode acked empty.
#[derive(Debug)]
struct EchoHandler;

impl Handler for EchoHandler {
    fn handle(&self, opcode: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
        match Opcode::from_u8(opcode) {
            Ok(Opcode::Rpc) => Ok(payload.to_vec()),
            Ok(Opcode::Tensors) => match TensorList::parse(payload) {
                Ok(_) => Ok(Vec::new()),
                Err(e) => Err(HandlerError::BadRequest(format!("tensor list: {e}"))),
            },
            Ok(_) => Ok(Vec::new()),
            Err(_) => Err(HandlerError::UnknownOpcode(opcode)),
        }
    }
}

/// Serve one data connection until the client closes it.
pub fn serve(stream: TcpStream, run: &Run) -> Result<(), String> {
    let srv = ConnectionServer::start(stream, Arc::new(EchoHandler), &config(run))
        .map_err(|e| format!("grpc server: {e}"))?;
    srv.wait();
    Ok(())
}

/// Run the load of `run` from a thread pinned to `core`.
pub fn client(stream: TcpStream, run: &Run, core: Option<usize>) -> Result<Measured, String> {
    let run = run.clone();
    std::thread::Builder::new()
        .name("grpc-client".into())
        .spawn(move || {
            if let Some(c) = core {
                starwire_placement::pin_current_thread(c)
                    .map_err(|e| format!("pinning to CPU {c}: {e}"))?;
            }
            let c = GrpcClient::from_stream(stream, &config(&run))
                .map_err(|e| format!("grpc client: {e}"))?;
            match run.mode {
                Mode::Fuse => fuse(&c, &run),
                _ => window(&c, &run),
            }
        })
        .map_err(|e| e.to_string())?
        .join()
        .map_err(|_| "grpc client thread panicked".to_owned())?
}

#[derive(Debug)]
struct WindowState {
    budget: RequestBudget,
    rtts: Rtts,
    interval: Option<IntervalReport>,
    error: Option<String>,
}

/// Lat, rate and bw: `run.inflight` calls outstanding.
fn window(c: &GrpcClient, run: &Run) -> Result<Measured, String> {
    // The server echoes `Rpc` and answers `DensePush` empty.
    let echo = run.echoed();
    let op = if echo { Opcode::Rpc } else { Opcode::DensePush };
    let record = matches!(run.mode, Mode::Lat | Mode::Rate);
    let payload = Bytes::from((0..run.size).map(|i| i as u8).collect::<Vec<u8>>());
    let mut budget = RequestBudget::new(run.warmup, run.iters, run.duration()).with_rate(run.rate);
    let conn = budget.add_connection();
    let mut interval = run.interval_report();
    let now = Instant::now();
    if budget.begin(now) {
        if let Some(r) = &mut interval {
            r.start(now);
        }
    }
    let st = RefCell::new(WindowState {
        budget,
        rtts: Rtts::new(),
        interval,
        error: None,
    });
    c.call_pipelined(
        run.inflight,
        || {
            let mut s = st.borrow_mut();
            let now = Instant::now();
            if s.error.is_some() {
                return NextCall::End;
            }
            if !s.budget.may_start(conn, now) {
                if !s.budget.open_loop() {
                    return NextCall::End;
                }
                // `--rate`: the next scheduled call, if one is left; before
                // the schedule starts (the warm-up's calls still in
                // flight), the next completion.
                return match s.budget.next_due(conn) {
                    Some(due) if s.budget.scheduled_left(now) => NextCall::NotBefore(due),
                    None if !s.budget.schedule_started() => {
                        NextCall::NotBefore(now + Duration::from_secs(1))
                    }
                    _ => NextCall::End,
                };
            }
            // Measured calls count from when they left, or with a rate
            // from when they were due.
            let origin = s.budget.on_send(conn, now);
            NextCall::Call(op as u8, payload.clone(), origin)
        },
        |r, origin: Option<Instant>| {
            let now = Instant::now();
            let mut s = st.borrow_mut();
            match r {
                Ok(b) if echo && b.len() != run.size => {
                    s.error.get_or_insert(format!(
                        "echo of {} bytes for a {}-byte request",
                        b.len(),
                        run.size
                    ));
                }
                Ok(_) => {}
                Err(e) => {
                    s.error.get_or_insert(format!("grpc call: {e}"));
                }
            }
            match s.budget.on_complete(origin.is_some(), now) {
                Completion::Measured => {
                    let ns = origin.map_or(0, |t0| now.duration_since(t0).as_nanos() as u64);
                    if record {
                        s.rtts.record(ns);
                    }
                    if let Some(r) = &mut s.interval {
                        r.on_complete(now, record.then_some(ns));
                    }
                }
                Completion::Last => {
                    if let Some(r) = &mut s.interval {
                        r.start(now);
                    }
                }
                Completion::Warmup => {}
            }
        },
    );
    let s = st.into_inner();
    if let Some(e) = s.error {
        return Err(e);
    }
    if let (Some(mut r), Some(end)) = (s.interval, s.budget.end()) {
        r.finish(end);
    }
    Ok(Measured {
        iters: s.budget.measured(),
        elapsed: s.budget.elapsed(),
        rtts: s.rtts,
        fused_steps_per_s: None,
        unfused_steps_per_s: None,
        // tokio's system calls are not counted.
        syscalls_per_msg: None,
        zero_copy: None,
        packets: None,
    })
}

fn body_bytes(b: Payload) -> Bytes {
    match b.segments() {
        [one] => one.clone(),
        segs => {
            let mut out = BytesMut::with_capacity(b.len());
            for s in segs {
                out.extend_from_slice(s);
            }
            out.freeze()
        }
    }
}

/// Fuse: steps of `run.tensors` tensors, fused (one call per fused list)
/// then unfused (one call per tensor); returns steps/s of each.
fn fuse(c: &GrpcClient, run: &Run) -> Result<Measured, String> {
    let payload = Bytes::from((0..run.size).map(|i| i as u8).collect::<Vec<u8>>());
    let tensors = (0..run.tensors as u64)
        .map(|k| {
            OutTensor::new(k, DType::U8, vec![run.size as u64], payload.clone())
                .map_err(|e| format!("tensor {k}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut rates = [None, None];
    let mut measured = u64::MAX;
    for (i, enabled) in [true, false].into_iter().enumerate() {
        let mut batcher = FusionBatcher::new(
            FusionConfig {
                enabled,
                ..FusionConfig::default()
            },
            1,
        );
        let mut steps = 0u64;
        // Each phase warms up.
        let mut gate = WarmupGate::new(run.warmup);
        let mut t0 = gate.is_none().then(Instant::now);
        loop {
            let more = match (run.duration(), t0) {
                (Some(d), Some(t0)) => t0.elapsed() < d,
                (Some(_), None) => true,
                (None, _) => steps < gate.budget(run.iters),
            };
            if !more {
                break;
            }
            if steps == 0 {
                gate.on_send(Instant::now());
            }
            for t in &tensors {
                batcher.add(0, t);
            }
            let mut reqs = Vec::new();
            batcher.finish_step(&mut |_, body, _| {
                reqs.push((Opcode::Tensors as u8, body_bytes(body)));
            });
            for r in c.call_many(reqs) {
                r.map_err(|e| format!("grpc fuse call: {e}"))?;
            }
            steps += 1;
            let now = Instant::now();
            if gate.on_complete(steps, now) == Completion::Last {
                t0 = Some(now);
            }
        }
        let secs = t0.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let n = gate.measured(steps);
        rates[i] = (secs > 0.0).then(|| n as f64 / secs);
        measured = measured.min(n);
    }
    Ok(Measured {
        iters: measured,
        elapsed: Duration::ZERO,
        rtts: Rtts::default(),
        fused_steps_per_s: rates[0],
        unfused_steps_per_s: rates[1],
        syscalls_per_msg: None,
        zero_copy: None,
        packets: None,
    })
}

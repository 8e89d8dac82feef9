//! The in-process backend (`--backend inproc`): no network at all. The
//! local cluster's PS shards sit behind one lock each, and a worker thread
//! serves its own requests by calling the shard directly, under its lock,
//! in request order. Replies move out of the shard as the buffer the shard
//! wrote them into (nothing is copied, framed or encoded).
//!
//! It is the compute bound of a training configuration on the machine: the
//! same PS and worker work as every other backend, with a transport that
//! costs nothing. A network backend's samples/s over this one's is the
//! share of the bound it reaches. It runs only inside `starwire train`,
//! where the PS tasks and the workers are threads of one process.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use starwire_transport::wire::{Opcode, Status};
use starwire_wire::ps::Control;

use crate::cluster::{
    ClusterBackend, Plan, PsEnd, ReactorLayout, RunningPs, TrainConfig, WorkerNet,
};
use crate::locked::{lock, LockedShards, ShardService};
use crate::net::{Exchange, Reply, Request, Traffic};
use crate::psserver::{self, PsHandler};
use crate::TrainError;

/// How long a `WAIT_STEP` barrier may wait, as a network worker's exchange.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(120);

/// The in-process [`ClusterBackend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Inproc;

/// The PS tasks of this process by address, for workers to find. A task
/// holds its listener, so no other task (of this or another cluster of
/// the process) can have the same address while it is registered.
static REGISTRY: Mutex<Vec<(SocketAddr, Arc<LockedShards>)>> = Mutex::new(Vec::new());

struct InprocPs {
    /// Held so that the address stays this task's while it is registered.
    _listener: TcpListener,
    addr: SocketAddr,
    state: Arc<LockedShards>,
    expected: usize,
}

impl Drop for InprocPs {
    fn drop(&mut self) {
        lock(&REGISTRY).retain(|(a, _)| *a != self.addr);
    }
}

impl RunningPs for InprocPs {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn join(self: Box<Self>) -> Result<Vec<serde_json::Value>, TrainError> {
        Ok(self.state.join(self.expected))
    }

    /// Workers waiting on a `WAIT_STEP` of this task, and their later
    /// requests, fail: as a network PS's closed connections end theirs.
    fn stop(self: Box<Self>) {
        self.state.stop();
    }

    fn shutdown(self: Box<Self>, checkpoint: bool) -> Result<PsEnd, TrainError> {
        self.state.shutdown(checkpoint)
    }
}

/// A worker's handles on every PS task.
struct InprocNet {
    ps: Vec<Arc<LockedShards>>,
    /// This worker's task index: a `--sync` shard gathers pushes by it.
    worker: u32,
    reactors: usize,
    traffic: Traffic,
    /// A multi-segment request body, made contiguous.
    scratch: Vec<u8>,
    /// The exchange's requests not served yet, with their positions
    /// (kept between exchanges for its capacity).
    todo: Vec<(usize, Request)>,
    /// Shards found held in a pass over `todo` (likewise).
    held: Vec<usize>,
}

/// The PS task holding `shard`, the shard's index in it, and the shard.
fn slot(
    ps: &[Arc<LockedShards>],
    reactors: usize,
    shard: usize,
) -> Result<(&LockedShards, usize, &Mutex<ShardService>), TrainError> {
    let (p, local) = (shard / reactors, shard % reactors);
    ps.get(p)
        .and_then(|st| Some((&**st, local, st.get(local)?)))
        .ok_or_else(|| TrainError::Link(shard, "no such shard".into()))
}

/// `WAIT_STEP`: until the shard's global step reaches `n`. The
/// other workers move it from their own threads; it fails once the task
/// (`st`) is stopped.
fn wait_step(
    st: &LockedShards,
    m: &Mutex<ShardService>,
    worker: u32,
    n: u64,
    shard: usize,
) -> Result<Option<(Status, String)>, TrainError> {
    let deadline = Instant::now() + BARRIER_TIMEOUT;
    let mut spins = 0u32;
    loop {
        {
            let g = lock(m);
            if g.handler().global_step() >= n {
                break;
            }
            // With `--sync`: the worker's push of the step was refused, or
            // dropped with a step the shard refused; the step needs it.
            if let Some((status, why)) = g.barrier_refused(Some(worker), n) {
                return Ok(Some((
                    status,
                    format!("WAIT_STEP {n} cannot be reached: {why}"),
                )));
            }
        }
        st.check_serving(shard)?;
        if Instant::now() > deadline {
            return Err(TrainError::Link(
                shard,
                format!("WAIT_STEP {n}: the global step did not get there in {BARRIER_TIMEOUT:?}"),
            ));
        }
        spins += 1;
        if spins < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    Ok(None)
}

impl Exchange for InprocNet {
    /// Requests to one shard are served in their order, so a step's push
    /// is applied before the next step's pull, as one ordered connection
    /// per shard gives. Across shards the order is free: a request to a
    /// shard another worker holds waits while the requests to free shards
    /// go first, so a worker blocks on a lock only when every shard it
    /// still needs is held. A `WAIT_STEP` blocks the thread until other
    /// workers move the step, so it goes only once every request before
    /// it has (see [`first_free`]).
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let n = reqs.len();
        replies.truncate(n);
        replies.resize_with(n, Reply::default);
        self.todo.clear();
        self.todo.extend(reqs.into_iter().enumerate());
        while !self.todo.is_empty() {
            let (i, g) = match first_free(&self.ps, self.reactors, &self.todo, &mut self.held)? {
                Some(x) => x,
                // Every shard still needed is held: wait for the first.
                None => (
                    0,
                    lock(slot(&self.ps, self.reactors, self.todo[0].1.shard)?.2),
                ),
            };
            let (at, r) = self.todo.remove(i);
            let (st, local, m) = slot(&self.ps, self.reactors, r.shard)?;
            serve_one(
                self.worker,
                &mut self.scratch,
                &mut self.traffic,
                g,
                (st, local, m),
                &r,
                &mut replies[at],
            )?;
        }
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }
}

/// The first request of `todo` whose shard is free and has no earlier
/// request waiting, with the shard's lock taken.
fn first_free<'a>(
    ps: &'a [Arc<LockedShards>],
    reactors: usize,
    todo: &[(usize, Request)],
    held: &mut Vec<usize>,
) -> Result<Option<(usize, MutexGuard<'a, ShardService>)>, TrainError> {
    held.clear();
    for (i, (_, r)) in todo.iter().enumerate() {
        if held.contains(&r.shard) {
            continue;
        }
        // A WAIT_STEP blocks this thread until other workers move the
        // step, which may need this exchange's earlier pushes (to any
        // shard) first: it is served only once nothing is before it.
        if i > 0 && is_wait_step(r) {
            held.push(r.shard);
            continue;
        }
        match slot(ps, reactors, r.shard)?.2.try_lock() {
            Ok(g) => return Ok(Some((i, g))),
            Err(TryLockError::Poisoned(e)) => return Ok(Some((i, e.into_inner()))),
            Err(TryLockError::WouldBlock) => held.push(r.shard),
        }
    }
    Ok(None)
}

fn is_wait_step(r: &Request) -> bool {
    r.opcode == Opcode::Rpc
        && matches!(
            r.body.segments().first().map(|b| Control::parse(b)),
            Some(Ok(Control::WaitStep(_)))
        )
}

/// Serve `r` on the shard `g` guards (`(task, local index, shard)`)
/// into `rep`.
fn serve_one(
    worker: u32,
    scratch: &mut Vec<u8>,
    traffic: &mut Traffic,
    mut g: MutexGuard<'_, ShardService>,
    (st, local, m): (&LockedShards, usize, &Mutex<ShardService>),
    r: &Request,
    rep: &mut Reply,
) -> Result<(), TrainError> {
    st.check_serving(r.shard)?;
    let body: &[u8] = match r.body.segments() {
        [] => &[],
        [one] => one,
        many => {
            scratch.clear();
            for s in many {
                scratch.extend_from_slice(s);
            }
            scratch
        }
    };
    traffic.sent += body.len() as u64;
    traffic.requests += 1;
    // The reply's last buffer becomes the shard's next scratch buffer:
    // buffers change hands instead of bytes being copied.
    let mut spare = Some(std::mem::take(&mut rep.body));
    let next = |cap: usize| {
        let mut v = spare.take().unwrap_or_default();
        v.clear();
        v.reserve(cap);
        v
    };
    let reply = g.serve_from(Some(worker), r.opcode, body, next);
    drop(g);
    match reply {
        psserver::Reply::Now(status, bytes) => {
            if status == Status::Ok {
                traffic.received += bytes.len() as u64;
            }
            rep.status = Some(status);
            // The only handle on the buffer (no pull reply is shared
            // here): taken back without a copy.
            rep.body = Vec::from(bytes);
        }
        psserver::Reply::Wait(step) => match wait_step(st, m, worker, step, r.shard)? {
            None => rep.status = Some(Status::Ok),
            Some((status, why)) => {
                rep.status = Some(status);
                rep.body = why.into_bytes();
            }
        },
        psserver::Reply::Done => {
            st.done(local, u64::from(worker));
            rep.status = Some(Status::Ok);
        }
    }
    Ok(())
}

impl WorkerNet for InprocNet {
    fn close(&mut self) {}
}

impl ClusterBackend for Inproc {
    fn name(&self) -> &'static str {
        "inproc"
    }

    fn start_ps(
        &self,
        cfg: &TrainConfig,
        plan: &Plan,
        p: usize,
        listener: TcpListener,
        expected: usize,
        restore: Option<&Path>,
        // No reactors: the shards sit behind locks.
        _layout: &ReactorLayout,
    ) -> Result<Box<dyn RunningPs>, TrainError> {
        let state = Arc::new(LockedShards::start(cfg, plan, p, restore)?);
        let addr = listener.local_addr()?;
        lock(&REGISTRY).push((addr, state.clone()));
        Ok(Box::new(InprocPs {
            _listener: listener,
            addr,
            state,
            expected,
        }))
    }

    fn connect(
        &self,
        cfg: &TrainConfig,
        ps_addrs: &[String],
        index: u32,
        _shards: usize,
        _layout: Option<&ReactorLayout>,
    ) -> Result<Box<dyn WorkerNet>, TrainError> {
        let reg = lock(&REGISTRY);
        let mut ps = Vec::with_capacity(ps_addrs.len());
        for a in ps_addrs {
            let found = a
                .parse::<SocketAddr>()
                .ok()
                .and_then(|addr| reg.iter().find(|(x, _)| *x == addr))
                .map(|(_, st)| st.clone())
                .ok_or_else(|| {
                    TrainError::Config(format!(
                        "{a}: no PS task of this process there; the inproc backend runs only \
                         in `starwire train` (the local cluster), not across processes"
                    ))
                })?;
            ps.push(found);
        }
        Ok(Box::new(InprocNet {
            ps,
            worker: index,
            reactors: cfg.ps_reactors.max(1),
            traffic: Traffic::default(),
            scratch: Vec::new(),
            todo: Vec::new(),
            held: Vec::new(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::ShardHandler;
    use starwire_ps::{PsShard, ShardConfig};
    use starwire_transport::wire::Opcode;
    use starwire_transport::Payload;
    use starwire_wire::ps::Control;

    fn state(shards: usize) -> Arc<LockedShards> {
        Arc::new(LockedShards::new(
            (0..shards)
                .map(|i| ShardHandler::new(PsShard::new(i, &[], ShardConfig::default()), i))
                .collect(),
            None,
        ))
    }

    fn net(st: &Arc<LockedShards>, shards: usize) -> InprocNet {
        InprocNet {
            ps: vec![st.clone()],
            worker: 0,
            reactors: shards,
            traffic: Traffic::default(),
            scratch: Vec::new(),
            todo: Vec::new(),
            held: Vec::new(),
        }
    }

    fn req(shard: usize, c: &Control<'_>) -> Request {
        Request {
            shard,
            opcode: Opcode::Rpc,
            body: Payload::from_bytes(c.encode()),
        }
    }

    /// While another worker holds shard 0, a request to shard 1 that comes
    /// after one to shard 0 is served; shard 0's requests wait, in order.
    #[test]
    fn a_free_shard_is_served_while_another_is_held() {
        let st = state(2);
        let held = lock(st.get(0).unwrap());
        let worker = {
            let st = st.clone();
            std::thread::spawn(move || {
                let mut n = net(&st, 2);
                let mut replies = Vec::new();
                let reqs = vec![
                    req(0, &Control::Stats),
                    req(1, &Control::Stats),
                    req(0, &Control::Done),
                ];
                n.exchange(reqs, &mut replies)
                    .map(|()| (replies, n.traffic()))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while lock(st.get(1).unwrap()).served().get("stats").is_none() {
            assert!(Instant::now() < deadline, "shard 1 was not served");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Shard 0's DONE waits behind its STATS, which waits for the lock.
        assert_eq!(st.dones()[0], 0);
        drop(held);
        let (replies, traffic) = worker.join().unwrap().unwrap();
        assert_eq!(replies.len(), 3);
        assert!(replies.iter().all(|r| r.status == Some(Status::Ok)));
        let stats: serde_json::Value = serde_json::from_slice(&replies[0].body).unwrap();
        assert_eq!(stats["shard"], 0);
        let stats: serde_json::Value = serde_json::from_slice(&replies[1].body).unwrap();
        assert_eq!(stats["shard"], 1);
        assert!(replies[2].body.is_empty());
        assert_eq!(st.dones(), vec![1, 0]);
        assert_eq!(traffic.requests, 3);
    }

    /// A bad request is a status in its reply, as on a network backend; a
    /// shard that does not exist ends the exchange with an error.
    #[test]
    fn bad_requests_are_statuses_and_unknown_shards_errors() {
        let st = state(1);
        let mut n = net(&st, 1);
        let mut replies = Vec::new();
        let bad = Request {
            shard: 0,
            opcode: Opcode::SparsePull,
            body: Payload::from_bytes(vec![0xff; 7]),
        };
        n.exchange(vec![bad], &mut replies).unwrap();
        assert!(matches!(replies[0].status, Some(s) if s != Status::Ok));
        assert_eq!(lock(st.get(0).unwrap()).failed(), 1);
        let e = n
            .exchange(vec![req(3, &Control::Stats)], &mut replies)
            .unwrap_err();
        assert!(matches!(e, TrainError::Link(3, _)), "{e}");
    }

    /// A `WAIT_STEP` is not taken past an earlier request of its exchange
    /// that waits for a held shard (a push another worker's step may need
    /// before the wait can end); once nothing is before it, it is.
    #[test]
    fn a_barrier_waits_for_every_request_before_it() {
        let st = state(2);
        let ps = vec![st.clone()];
        let mut todo: Vec<(usize, Request)> = vec![
            (0, req(1, &Control::Stats)),
            (1, req(0, &Control::WaitStep(5))),
        ];
        let mut held = Vec::new();
        let shard1 = lock(st.get(1).unwrap());
        assert!(first_free(&ps, 2, &todo, &mut held).unwrap().is_none());
        drop(shard1);
        let (i, g) = first_free(&ps, 2, &todo, &mut held).unwrap().unwrap();
        assert_eq!((i, g.handler().index), (0, 1));
        drop(g);
        todo.remove(0);
        let (i, g) = first_free(&ps, 2, &todo, &mut held).unwrap().unwrap();
        assert_eq!((i, g.handler().index), (0, 0));
    }

    /// `WAIT_STEP` for a step already reached answers at once.
    #[test]
    fn a_barrier_already_passed_answers_at_once() {
        let st = state(1);
        let mut replies = Vec::new();
        net(&st, 1)
            .exchange(vec![req(0, &Control::WaitStep(0))], &mut replies)
            .unwrap();
        assert_eq!(replies[0].status, Some(Status::Ok));
    }
}

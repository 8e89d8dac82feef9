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

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use starwire_transport::wire::Status;

use crate::cluster::{shard_handler, ClusterBackend, Plan, RunningPs, TrainConfig, WorkerNet};
use crate::handler::ShardHandler;
use crate::net::{Exchange, Reply, Request, Traffic};
use crate::server::{self, PsHandler};
use crate::TrainError;

/// How long a `WAIT_STEP` barrier may wait, as a network worker's exchange.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(120);

/// The in-process [`ClusterBackend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Inproc;

/// One shard and what serving it keeps between requests.
#[derive(Debug)]
struct Slot {
    handler: ShardHandler,
    /// The scratch buffer replies are written into.
    out: Vec<u8>,
    served: HashMap<&'static str, u64>,
    failed: u64,
}

/// A PS task's shards, shared with the workers of this process.
#[derive(Debug)]
struct PsState {
    shards: Vec<Mutex<Slot>>,
    /// `DONE`s received, per local shard.
    done: Mutex<Vec<usize>>,
    all_done: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The PS tasks of this process by address, for workers to find. A task
/// holds its listener, so no other task (of this or another cluster of
/// the process) can have the same address while it is registered.
static REGISTRY: Mutex<Vec<(SocketAddr, Arc<PsState>)>> = Mutex::new(Vec::new());

struct InprocPs {
    /// Held so that the address stays this task's while it is registered.
    _listener: TcpListener,
    addr: SocketAddr,
    state: Arc<PsState>,
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
        {
            let mut d = lock(&self.state.done);
            while d.iter().any(|&c| c < self.expected) {
                d = self
                    .state
                    .all_done
                    .wait(d)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
        Ok(self
            .state
            .shards
            .iter()
            .map(|s| {
                let g = lock(s);
                tracing::debug!(shard = g.handler.index, served = ?g.served, failed = g.failed, "inproc shard done");
                g.handler.stats()
            })
            .collect())
    }

    fn stop(self: Box<Self>) {}
}

/// A worker's handles on every PS task.
struct InprocNet {
    ps: Vec<Arc<PsState>>,
    reactors: usize,
    traffic: Traffic,
    /// A multi-segment request body, made contiguous.
    scratch: Vec<u8>,
}

/// The PS task holding `shard`, and the shard's index in it.
fn slot(
    ps: &[Arc<PsState>],
    reactors: usize,
    shard: usize,
) -> Result<(&PsState, usize), TrainError> {
    let (p, local) = (shard / reactors, shard % reactors);
    let st = ps
        .get(p)
        .filter(|st| local < st.shards.len())
        .ok_or_else(|| TrainError::Link(shard, "no such shard".into()))?;
    Ok((st, local))
}

/// `WAIT_STEP`: until shard `local`'s global step reaches `n`. The
/// other workers move it from their own threads.
fn wait_step(st: &PsState, local: usize, n: u64, shard: usize) -> Result<(), TrainError> {
    let deadline = Instant::now() + BARRIER_TIMEOUT;
    let mut spins = 0u32;
    while lock(&st.shards[local]).handler.global_step() < n {
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
    Ok(())
}

impl Exchange for InprocNet {
    /// Requests to one shard are served in their order, so a step's push
    /// is applied before the next step's pull, as one ordered connection
    /// per shard gives. Across shards the order is free: a request to a
    /// shard another worker holds waits while the requests to free shards
    /// go first, so a worker blocks on a lock only when every shard it
    /// still needs is held.
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let n = reqs.len();
        replies.truncate(n);
        replies.resize_with(n, Reply::default);
        let mut todo: Vec<(usize, Request)> = reqs.into_iter().enumerate().collect();
        let mut held: Vec<usize> = Vec::new();
        while !todo.is_empty() {
            let (i, g) = match first_free(&self.ps, self.reactors, &todo, &mut held)? {
                Some(x) => x,
                // Every shard still needed is held: wait for the first.
                None => {
                    let (st, local) = slot(&self.ps, self.reactors, todo[0].1.shard)?;
                    (0, lock(&st.shards[local]))
                }
            };
            let (at, r) = todo.remove(i);
            let (st, local) = slot(&self.ps, self.reactors, r.shard)?;
            serve_one(
                &mut self.scratch,
                &mut self.traffic,
                g,
                st,
                local,
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
    ps: &'a [Arc<PsState>],
    reactors: usize,
    todo: &[(usize, Request)],
    held: &mut Vec<usize>,
) -> Result<Option<(usize, MutexGuard<'a, Slot>)>, TrainError> {
    held.clear();
    for (i, (_, r)) in todo.iter().enumerate() {
        if held.contains(&r.shard) {
            continue;
        }
        let (st, local) = slot(ps, reactors, r.shard)?;
        match st.shards[local].try_lock() {
            Ok(g) => return Ok(Some((i, g))),
            Err(TryLockError::Poisoned(e)) => return Ok(Some((i, e.into_inner()))),
            Err(TryLockError::WouldBlock) => held.push(r.shard),
        }
    }
    Ok(None)
}

/// Serve `r` on the shard `g` guards (shard `local` of `st`) into `rep`.
fn serve_one(
    scratch: &mut Vec<u8>,
    traffic: &mut Traffic,
    mut g: MutexGuard<'_, Slot>,
    st: &PsState,
    local: usize,
    r: &Request,
    rep: &mut Reply,
) -> Result<(), TrainError> {
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
    let reply = {
        let Slot {
            handler,
            out,
            served,
            failed,
        } = &mut *g;
        server::serve_into(handler, out, next, r.opcode, body, served, failed)
    };
    drop(g);
    match reply {
        server::Reply::Now(status, bytes) => {
            if status == Status::Ok {
                traffic.received += bytes.len() as u64;
            }
            rep.status = Some(status);
            rep.body = bytes;
        }
        server::Reply::Wait(step) => {
            wait_step(st, local, step, r.shard)?;
            rep.status = Some(Status::Ok);
        }
        server::Reply::Done => {
            lock(&st.done)[local] += 1;
            st.all_done.notify_all();
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
    ) -> Result<Box<dyn RunningPs>, TrainError> {
        let r = cfg.ps_reactors.max(1);
        let mut shards = Vec::with_capacity(r);
        for local in 0..r {
            shards.push(Mutex::new(Slot {
                handler: shard_handler(cfg, plan, p * r + local, restore)?,
                out: Vec::new(),
                served: HashMap::new(),
                failed: 0,
            }));
        }
        let state = Arc::new(PsState {
            shards,
            done: Mutex::new(vec![0; r]),
            all_done: Condvar::new(),
        });
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
        _index: u32,
        _shards: usize,
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
            reactors: cfg.ps_reactors.max(1),
            traffic: Traffic::default(),
            scratch: Vec::new(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Control;
    use starwire_ps::{PsShard, ShardConfig};
    use starwire_transport::wire::Opcode;
    use starwire_transport::Body;

    fn state(shards: usize) -> Arc<PsState> {
        Arc::new(PsState {
            shards: (0..shards)
                .map(|i| {
                    Mutex::new(Slot {
                        handler: ShardHandler {
                            shard: PsShard::new(i, &[], ShardConfig::default()),
                            index: i,
                            checkpoint_dir: None,
                        },
                        out: Vec::new(),
                        served: HashMap::new(),
                        failed: 0,
                    })
                })
                .collect(),
            done: Mutex::new(vec![0; shards]),
            all_done: Condvar::new(),
        })
    }

    fn net(st: &Arc<PsState>) -> InprocNet {
        InprocNet {
            ps: vec![st.clone()],
            reactors: st.shards.len(),
            traffic: Traffic::default(),
            scratch: Vec::new(),
        }
    }

    fn req(shard: usize, c: &Control) -> Request {
        Request {
            shard,
            opcode: Opcode::Rpc,
            body: Body::from_bytes(c.encode()),
        }
    }

    /// While another worker holds shard 0, a request to shard 1 that comes
    /// after one to shard 0 is served; shard 0's requests wait, in order.
    #[test]
    fn a_free_shard_is_served_while_another_is_held() {
        let st = state(2);
        let held = lock(&st.shards[0]);
        let worker = {
            let st = st.clone();
            std::thread::spawn(move || {
                let mut n = net(&st);
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
        while !lock(&st.shards[1]).served.contains_key("stats") {
            assert!(Instant::now() < deadline, "shard 1 was not served");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Shard 0's DONE waits behind its STATS, which waits for the lock.
        assert_eq!(lock(&st.done)[0], 0);
        drop(held);
        let (replies, traffic) = worker.join().unwrap().unwrap();
        assert_eq!(replies.len(), 3);
        assert!(replies.iter().all(|r| r.status == Some(Status::Ok)));
        let stats: serde_json::Value = serde_json::from_slice(&replies[0].body).unwrap();
        assert_eq!(stats["shard"], 0);
        let stats: serde_json::Value = serde_json::from_slice(&replies[1].body).unwrap();
        assert_eq!(stats["shard"], 1);
        assert!(replies[2].body.is_empty());
        assert_eq!(*lock(&st.done), vec![1, 0]);
        assert_eq!(traffic.requests, 3);
    }

    /// A bad request is a status in its reply, as on a network backend; a
    /// shard that does not exist ends the exchange with an error.
    #[test]
    fn bad_requests_are_statuses_and_unknown_shards_errors() {
        let st = state(1);
        let mut n = net(&st);
        let mut replies = Vec::new();
        let bad = Request {
            shard: 0,
            opcode: Opcode::SparsePull,
            body: Body::from_bytes(vec![0xff; 7]),
        };
        n.exchange(vec![bad], &mut replies).unwrap();
        assert!(matches!(replies[0].status, Some(s) if s != Status::Ok));
        assert_eq!(lock(&st.shards[0]).failed, 1);
        let e = n
            .exchange(vec![req(3, &Control::Stats)], &mut replies)
            .unwrap_err();
        assert!(matches!(e, TrainError::Link(3, _)), "{e}");
    }

    /// `WAIT_STEP` for a step already reached answers at once.
    #[test]
    fn a_barrier_already_passed_answers_at_once() {
        let st = state(1);
        let mut replies = Vec::new();
        net(&st)
            .exchange(vec![req(0, &Control::WaitStep(0))], &mut replies)
            .unwrap();
        assert_eq!(replies[0].status, Some(Status::Ok));
    }
}

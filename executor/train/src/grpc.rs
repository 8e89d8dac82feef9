//! The gRPC baseline as a training backend: what stock TensorFlow does
//! and DeepRec calls `protocol="grpc"`. Each PS task serves its shards
//! behind tonic (one lock per shard, taken by whichever of the runtime's
//! threads the call lands on); each worker holds one channel per PS task
//! and blocks on its calls. The pull/push bodies are the same as on every
//! other backend, carried in the protobuf `Call` message with a 2-byte
//! shard index in front; with `--tensor-fuse off` every tensor is its own
//! RPC.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use starwire_grpc::{GrpcClient, GrpcConfig, GrpcError, GrpcServer, Handler, HandlerError};
use starwire_transport::wire::{Opcode, Status};

use crate::cluster::{
    ClusterBackend, Plan, PsEnd, ReactorLayout, RunningPs, TrainConfig, WorkerNet,
};
use crate::locked::{lock, LockedShards};
use crate::net::{Exchange, Reply, Request, Traffic};
use crate::psserver;
use crate::TrainError;

/// The baseline's settings: the cluster token, if any, proved on every
/// connection within the handshake timeout.
fn grpc_config(cfg: &TrainConfig) -> GrpcConfig {
    GrpcConfig {
        token: cfg.guard.token.clone(),
        handshake_timeout: cfg.guard.handshake_timeout,
        ..GrpcConfig::default()
    }
}

/// The gRPC [`ClusterBackend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Grpc;

/// A PS task's shards behind one gRPC server.
impl Handler for LockedShards {
    fn handle(&self, opcode: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
        let op = Opcode::from_u8(opcode).map_err(|_| HandlerError::UnknownOpcode(opcode))?;
        let Some((idx, body)) = payload.split_first_chunk::<2>() else {
            return Err(HandlerError::BadRequest("no shard index".into()));
        };
        let i = usize::from(u16::from_le_bytes(*idx));
        let shard = self
            .get(i)
            .ok_or_else(|| HandlerError::NotFound(format!("shard {i}")))?;
        // Each reply leaves as the Vec tonic sends: the next one starts in
        // a fresh buffer of the same capacity.
        let reply = lock(shard).serve(op, body, Vec::with_capacity);
        match reply {
            psserver::Reply::Now(Status::Ok, b) => Ok(Vec::from(b)),
            psserver::Reply::Now(status, msg) => {
                let m = String::from_utf8_lossy(&msg).into_owned();
                Err(match status {
                    Status::UnknownVariable => HandlerError::NotFound(m),
                    Status::WrongShape | Status::BadRequest => HandlerError::BadRequest(m),
                    Status::UnknownMethod => HandlerError::Unsupported("this control method"),
                    _ => HandlerError::Internal(m),
                })
            }
            psserver::Reply::Wait(_) => Err(HandlerError::Unsupported(
                "WAIT_STEP (--sync) on the grpc baseline",
            )),
            psserver::Reply::Done => {
                self.done(i);
                Ok(Vec::new())
            }
        }
    }
}

struct GrpcPs {
    server: GrpcServer,
    svc: Arc<LockedShards>,
    expected: usize,
}

impl RunningPs for GrpcPs {
    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
    fn join(self: Box<Self>) -> Result<Vec<serde_json::Value>, TrainError> {
        let GrpcPs {
            server,
            svc,
            expected,
        } = *self;
        let stats = svc.join(expected);
        server.shutdown();
        Ok(stats)
    }
    fn stop(self: Box<Self>) {
        self.server.shutdown();
    }
    fn shutdown(self: Box<Self>, checkpoint: bool) -> Result<PsEnd, TrainError> {
        self.server.shutdown();
        self.svc.shutdown(checkpoint)
    }
}

/// A worker's channels, one per PS task.
struct GrpcNet {
    clients: Vec<GrpcClient>,
    reactors: usize,
    traffic: Traffic,
}

fn status_of(e: &GrpcError) -> Option<Status> {
    use tonic::Code;
    match e.code()? {
        Code::NotFound => Some(Status::UnknownVariable),
        Code::InvalidArgument => Some(Status::BadRequest),
        Code::Unimplemented => Some(Status::UnknownMethod),
        Code::Unavailable | Code::Cancelled | Code::Unknown => None,
        _ => Some(Status::Internal),
    }
}

impl Exchange for GrpcNet {
    /// Concurrent calls on HTTP/2 streams carry no order: a step's pushes
    /// go first and are acknowledged before its pulls leave, so a pull
    /// never reads around the worker's own last write (what one ordered
    /// connection gives the other backends for free).
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let n = reqs.len();
        replies.clear();
        replies.resize_with(n, Reply::default);
        let (pushes, rest): (Vec<_>, Vec<_>) = reqs
            .into_iter()
            .enumerate()
            .partition(|(_, r)| r.opcode == Opcode::SparsePush);
        for phase in [pushes, rest] {
            if !phase.is_empty() {
                self.phase(phase, replies)?;
            }
        }
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.traffic
    }
}

impl GrpcNet {
    /// Send `reqs` (with their positions in the exchange) concurrently and
    /// wait for all of them.
    fn phase(
        &mut self,
        reqs: Vec<(usize, Request)>,
        replies: &mut [Reply],
    ) -> Result<(), TrainError> {
        let n = reqs.len();
        // Group by PS task, keeping each request's position.
        let mut per_ps: Vec<Vec<(usize, (u8, Bytes))>> = vec![Vec::new(); self.clients.len()];
        for (i, r) in reqs {
            let (ps, local) = (r.shard / self.reactors, r.shard % self.reactors);
            let mut b = BytesMut::with_capacity(2 + r.body.len());
            b.put_u16_le(local as u16);
            for seg in r.body.segments() {
                b.put_slice(seg);
            }
            self.traffic.sent += r.body.len() as u64;
            self.traffic.requests += 1;
            per_ps
                .get_mut(ps)
                .ok_or_else(|| TrainError::Link(r.shard, "no such shard".into()))?
                .push((i, (r.opcode as u8, b.freeze())));
        }
        let clients = &self.clients;
        let results: Vec<Vec<(usize, Result<Bytes, GrpcError>)>> = std::thread::scope(|sc| {
            let hs: Vec<_> = per_ps
                .into_iter()
                .zip(clients)
                .map(|(calls, c)| {
                    sc.spawn(move || {
                        let (idx, calls): (Vec<usize>, Vec<(u8, Bytes)>) =
                            calls.into_iter().unzip();
                        idx.into_iter().zip(c.call_many(calls)).collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut got = 0;
        for (i, r) in results.into_iter().flatten() {
            got += 1;
            let rep = &mut replies[i];
            match r {
                Ok(b) => {
                    self.traffic.received += b.len() as u64;
                    rep.status = Some(Status::Ok);
                    rep.body.extend_from_slice(&b);
                }
                Err(e) => match status_of(&e) {
                    Some(s) => {
                        rep.status = Some(s);
                        rep.body.extend_from_slice(e.to_string().as_bytes());
                    }
                    None => return Err(TrainError::Link(i, e.to_string())),
                },
            }
        }
        if got != n {
            return Err(TrainError::Internal("a gRPC call thread failed".into()));
        }
        Ok(())
    }
}

impl WorkerNet for GrpcNet {
    fn close(&mut self) {}
}

impl ClusterBackend for Grpc {
    fn name(&self) -> &'static str {
        "grpc"
    }

    fn start_ps(
        &self,
        cfg: &TrainConfig,
        plan: &Plan,
        p: usize,
        listener: TcpListener,
        expected: usize,
        restore: Option<&Path>,
        // No reactors: tonic serves the shards.
        _layout: &ReactorLayout,
    ) -> Result<Box<dyn RunningPs>, TrainError> {
        if cfg.sync {
            return Err(TrainError::Config(
                "--sync is not supported on the grpc baseline".into(),
            ));
        }
        let svc = Arc::new(LockedShards::start(cfg, plan, p, restore)?);
        // tonic binds its own listener: hand it the address of ours.
        let addr = listener.local_addr()?;
        drop(listener);
        let server = GrpcServer::start_with(addr, svc.clone(), &grpc_config(cfg))
            .map_err(|e| TrainError::Backend("grpc", e.to_string()))?;
        Ok(Box::new(GrpcPs {
            server,
            svc,
            expected,
        }))
    }

    fn connect(
        &self,
        cfg: &TrainConfig,
        ps_addrs: &[String],
        _index: u32,
        _shards: usize,
        _layout: Option<&ReactorLayout>,
    ) -> Result<Box<dyn WorkerNet>, TrainError> {
        let mut clients = Vec::with_capacity(ps_addrs.len());
        for a in ps_addrs {
            let addr: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(a.as_str())
                .map_err(|e| TrainError::Connect(a.clone(), e))?
                .next()
                .ok_or_else(|| TrainError::Config(format!("{a}: no address")))?;
            clients.push(
                GrpcClient::connect_with(addr, &grpc_config(cfg))
                    .map_err(|e| TrainError::Backend("grpc", e.to_string()))?,
            );
        }
        Ok(Box::new(GrpcNet {
            clients,
            reactors: cfg.ps_reactors.max(1),
            traffic: Traffic::default(),
        }))
    }
}

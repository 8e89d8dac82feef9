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
use starwire_grpc::{
    ConnectionId, GrpcClient, GrpcConfig, GrpcError, GrpcServer, Handler, HandlerError,
    DEFAULT_MAX_CONCURRENT_STREAMS,
};
use starwire_transport::wire::{Opcode, Status};

use crate::cluster::{
    ClusterBackend, Plan, PsEnd, ReactorLayout, RunningPs, TrainConfig, WorkerNet,
};
use crate::locked::{lock, LockedShards};
use crate::net::{Exchange, Reply, Request, Traffic};
use crate::psserver;
use crate::TrainError;

/// The baseline's settings: the cluster token, if any, proved on every
/// connection within the handshake timeout; and for a PS task's server
/// the task's bounds: `--max-connections` (counted from accept, before
/// the token), `--idle-timeout-secs`, `--memory-budget-mb` (the bytes of
/// requests and unsent replies of all its calls), and at most
/// [`DEFAULT_MAX_CONCURRENT_STREAMS`] calls at once per connection. The
/// message limit stays the baseline's (64 MiB): a shard's replies are
/// kept under it by [`reply_limit`].
fn grpc_config(cfg: &TrainConfig) -> GrpcConfig {
    GrpcConfig {
        token: cfg.guard.token.clone(),
        handshake_timeout: cfg.guard.handshake_timeout,
        max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
        max_connections: cfg.guard.max_connections,
        idle_timeout: cfg.guard.idle_timeout,
        memory_budget: Some(cfg.guard.memory_budget_mb.saturating_mul(1 << 20)),
        ..GrpcConfig::default()
    }
}

/// Bytes a `CallReply` adds around its payload: the field's tag and
/// length (at most 6), rounded up.
const REPLY_FRAMING: usize = 16;

/// The largest pull reply a shard may build behind gRPC: its
/// `--max-reply-bytes`, lowered so that the reply fits in the message
/// limit with its framing. A pull beyond it is refused with
/// `LimitExceeded` before anything is built, where tonic would refuse the
/// built reply (`OutOfRange`, seen by the worker as `Internal`).
fn reply_limit(max_reply_bytes: usize, g: &GrpcConfig) -> usize {
    max_reply_bytes.min(g.max_message_len.saturating_sub(REPLY_FRAMING))
}

/// The gRPC [`ClusterBackend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Grpc;

/// A PS task's shards behind one gRPC server.
impl Handler for LockedShards {
    /// Not called by the server ([`Self::handle_on`] is): the calls of an
    /// unknown connection share one id.
    fn handle(&self, opcode: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
        self.handle_on(ConnectionId(u64::MAX), opcode, payload)
    }

    /// A `DONE` counts once per connection: each worker (and the
    /// evaluator) holds one channel, one connection, to the task, so a
    /// client repeating it does not stand for the workers still training.
    fn handle_on(
        &self,
        conn: ConnectionId,
        opcode: u8,
        payload: &[u8],
    ) -> Result<Vec<u8>, HandlerError> {
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
                    Status::LimitExceeded => HandlerError::LimitExceeded(m),
                    status => HandlerError::Wire { status, message: m },
                })
            }
            psserver::Reply::Wait(_) => Err(HandlerError::Unsupported(
                "WAIT_STEP (--sync) on the grpc baseline",
            )),
            psserver::Reply::Done => {
                self.done(i, conn.0);
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

/// The message-layer status of a failed call: the handler's own when it
/// sent one, else the nearest to the gRPC code; `None` for the connection
/// gone.
fn status_of(e: &GrpcError) -> Option<Status> {
    use tonic::Code;
    if let Some(s) = e.wire_status() {
        return Some(s);
    }
    match e.code()? {
        Code::NotFound => Some(Status::UnknownVariable),
        Code::InvalidArgument => Some(Status::BadRequest),
        Code::Unimplemented => Some(Status::UnknownMethod),
        Code::ResourceExhausted => Some(Status::LimitExceeded),
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

    /// The gRPC PS serves every call with no sender: it records no pulls.
    fn sender_known(&self) -> bool {
        false
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
        let g = grpc_config(cfg);
        let mut shard_cfg = cfg.clone();
        shard_cfg.guard.max_reply_bytes = reply_limit(cfg.guard.max_reply_bytes, &g);
        let svc = Arc::new(LockedShards::start(&shard_cfg, plan, p, restore)?);
        // Served on the listener as bound (its backlog, its port held).
        let server = GrpcServer::start_on(listener, svc.clone(), &g)
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::handler::ShardHandler;
    use starwire_ps::{Init, PsShard, ShardConfig, VarDef, VarKind};
    use starwire_wire::ps::{Control, PullRequestWriter, PushRequestWriter};

    const DENSE: u32 = 7;

    /// One shard holding a dense variable of `floats` values, pulls up to
    /// `max_reply_bytes`, served on loopback with `g`.
    fn serve(
        floats: usize,
        max_reply_bytes: usize,
        g: &GrpcConfig,
    ) -> (GrpcServer, Arc<LockedShards>) {
        let vars = [VarDef {
            id: DENSE,
            name: "w".into(),
            kind: VarKind::Dense {
                shape: vec![floats],
            },
            init: Init::Zeros,
        }];
        let shard = PsShard::new(
            0,
            &vars,
            ShardConfig {
                max_reply_bytes,
                ..ShardConfig::default()
            },
        );
        let svc = Arc::new(LockedShards::new(vec![ShardHandler::new(shard, 0)], None));
        let server =
            GrpcServer::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), svc.clone(), g).unwrap();
        (server, svc)
    }

    /// `body` for local shard 0, as a worker sends it.
    fn to_shard0(body: &[u8]) -> Bytes {
        let mut b = vec![0u8, 0];
        b.extend_from_slice(body);
        Bytes::from(b)
    }

    fn say_done(c: &GrpcClient) {
        c.call(Opcode::Rpc as u8, to_shard0(&Control::Done.encode()))
            .unwrap();
    }

    /// `DONE` counts once per client (connection): one client repeating it
    /// does not end a task waiting for two; a second client does.
    #[test]
    fn a_repeated_done_counts_once() {
        let (server, svc) = serve(4, 1 << 20, &GrpcConfig::default());
        let a = GrpcClient::connect(server.local_addr()).unwrap();
        for _ in 0..3 {
            say_done(&a);
        }
        assert_eq!(svc.dones(), vec![1]);
        let (tx, rx) = mpsc::channel();
        let joined = {
            let svc = svc.clone();
            std::thread::spawn(move || {
                svc.join(2);
                let _ = tx.send(());
            })
        };
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "one client's repeated DONE ended the task"
        );
        let b = GrpcClient::connect(server.local_addr()).unwrap();
        say_done(&b);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("two clients' DONE did not end the task");
        joined.join().unwrap();
        assert_eq!(svc.dones(), vec![2]);
        server.shutdown();
    }

    fn pull_dense(c: &GrpcClient) -> Result<Bytes, GrpcError> {
        let mut req = Vec::new();
        PullRequestWriter::new(&mut req).dense(DENSE);
        c.call(Opcode::SparsePull as u8, to_shard0(&req))
    }

    /// A pull whose reply would be over the message limit is refused
    /// before it is built, as `LimitExceeded` (the `--max-reply-bytes`
    /// bound), once the shard's limit is [`reply_limit`]; without that,
    /// tonic refuses the built reply and the worker sees `Internal`. A
    /// reply just under the limit is answered.
    #[test]
    fn a_reply_over_the_message_limit_is_limit_exceeded() {
        let g = GrpcConfig {
            max_message_len: 1 << 20,
            ..GrpcConfig::default()
        };
        let limit = reply_limit(256 << 20, &g);
        assert!(limit < g.max_message_len);
        // 300,000 floats: a reply of 1.2 MB.
        let (server, _) = serve(300_000, limit, &g);
        let c = GrpcClient::connect_with(server.local_addr(), &g).unwrap();
        let e = pull_dense(&c).unwrap_err();
        assert_eq!(status_of(&e), Some(Status::LimitExceeded), "{e}");
        server.shutdown();
        // What the shard's own limit (256 MiB) let through.
        let (server, _) = serve(300_000, 256 << 20, &g);
        let c = GrpcClient::connect_with(server.local_addr(), &g).unwrap();
        let e = pull_dense(&c).unwrap_err();
        assert_eq!(status_of(&e), Some(Status::Internal), "{e}");
        server.shutdown();
        // The largest dense reply under the limit: 16 bytes of header and
        // 16 of the item's, then the floats.
        let floats = (limit - 32) / 4;
        let (server, _) = serve(floats, limit, &g);
        let c = GrpcClient::connect_with(server.local_addr(), &g).unwrap();
        let reply = pull_dense(&c).unwrap();
        assert!(reply.len() <= limit, "{} bytes", reply.len());
        assert!(reply.len() >= floats * 4);
        server.shutdown();
    }

    /// A NaN push is answered `NonFinite` over gRPC too, not `Internal`,
    /// and leaves the variable as it was.
    #[test]
    fn a_nan_push_is_non_finite() {
        let (server, _) = serve(4, 1 << 20, &GrpcConfig::default());
        let c = GrpcClient::connect(server.local_addr()).unwrap();
        let mut req = Vec::new();
        PushRequestWriter::new(&mut req, true).dense(DENSE, &[1.0, f32::NAN, 0.0, 0.0]);
        let e = c
            .call(Opcode::SparsePush as u8, to_shard0(&req))
            .unwrap_err();
        assert_eq!(status_of(&e), Some(Status::NonFinite), "{e}");
        assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
        let reply = pull_dense(&c).unwrap();
        assert!(reply.ends_with(&[0u8; 16]), "the variable moved");
        server.shutdown();
    }

    /// The PS task's bounds reach the gRPC server.
    #[test]
    fn the_ps_bounds_reach_the_grpc_config() {
        let mut cfg = TrainConfig::default();
        cfg.guard.max_connections = 17;
        cfg.guard.idle_timeout = Some(Duration::from_secs(33));
        cfg.guard.memory_budget_mb = 5;
        let g = grpc_config(&cfg);
        assert_eq!(g.memory_budget, Some(5 << 20));
        assert_eq!(g.max_connections, 17);
        assert_eq!(g.idle_timeout, Some(Duration::from_secs(33)));
        assert_eq!(g.max_concurrent_streams, DEFAULT_MAX_CONCURRENT_STREAMS);
        assert!(reply_limit(cfg.guard.max_reply_bytes, &g) + REPLY_FRAMING <= g.max_message_len);
        assert_eq!(reply_limit(1000, &g), 1000);
    }
}

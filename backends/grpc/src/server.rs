//! The server: a tonic service calling a [`Handler`] on a 2-worker runtime.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use starwire_transport::MemoryBudget;
use starwire_wire::Opcode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};

use crate::budget::{Budgeted, Unsent};
use crate::proto::message_layer_server::{MessageLayer, MessageLayerServer};
use crate::proto::{
    CallReply, CallRequest, DensePullReply, DensePullRequest, DensePushRequest, PushReply,
    SparsePullReply, SparsePullRequest, SparsePushRequest,
};
use crate::{auth, runtime, ConnectionId, GrpcConfig, GrpcError, Handler, HandlerError};

/// How long [`GrpcServer::shutdown`] waits for connections to drain before
/// dropping them.
const DRAIN: Duration = Duration::from_secs(2);

struct Service {
    h: Arc<dyn Handler>,
}

fn checked_dim(values: usize, rows: usize) -> Result<u32, Status> {
    if rows == 0 {
        return if values == 0 {
            Ok(0)
        } else {
            Err(HandlerError::Internal(format!("{values} values for no keys")).into_status())
        };
    }
    if values % rows != 0 {
        return Err(HandlerError::Internal(format!(
            "{values} values are not {rows} rows of equal width"
        ))
        .into_status());
    }
    u32::try_from(values / rows)
        .map_err(|_| HandlerError::Internal("row width over u32".into()).into_status())
}

#[tonic::async_trait]
impl MessageLayer for Service {
    async fn call(&self, req: Request<CallRequest>) -> Result<Response<CallReply>, Status> {
        // Every connection is a `Conn`, whose info tonic puts in each
        // request; without it (none is known) the calls share one id.
        let conn = req
            .extensions()
            .get::<ConnInfo>()
            .map_or(ConnectionId(u64::MAX), |c| c.id);
        let r = req.into_inner();
        let op = u8::try_from(r.opcode)
            .map_err(|_| Status::invalid_argument(format!("opcode {} is over 255", r.opcode)))?;
        match Opcode::from_u8(op) {
            Ok(o) if !o.is_control() => {}
            // Connection-core opcodes mean nothing over gRPC.
            _ => return Err(HandlerError::UnknownOpcode(op).into_status()),
        }
        let out = self
            .h
            .handle_on(conn, op, &r.payload)
            .map_err(HandlerError::into_status)?;
        Ok(Response::new(CallReply {
            payload: out.into(),
        }))
    }

    async fn sparse_pull(
        &self,
        req: Request<SparsePullRequest>,
    ) -> Result<Response<SparsePullReply>, Status> {
        let r = req.into_inner();
        let values = self
            .h
            .sparse_pull(r.var, &r.keys)
            .map_err(HandlerError::into_status)?;
        let dim = checked_dim(values.len(), r.keys.len())?;
        Ok(Response::new(SparsePullReply { dim, values }))
    }

    async fn sparse_push(
        &self,
        req: Request<SparsePushRequest>,
    ) -> Result<Response<PushReply>, Status> {
        let r = req.into_inner();
        let dim = r.dim as usize;
        if r.keys.len().checked_mul(dim) != Some(r.grads.len()) {
            return Err(HandlerError::BadRequest(format!(
                "{} gradient values for {} keys of width {dim}",
                r.grads.len(),
                r.keys.len()
            ))
            .into_status());
        }
        self.h
            .sparse_push(r.var, &r.keys, dim, &r.grads)
            .map_err(HandlerError::into_status)?;
        Ok(Response::new(PushReply {}))
    }

    async fn dense_pull(
        &self,
        req: Request<DensePullRequest>,
    ) -> Result<Response<DensePullReply>, Status> {
        let values = self
            .h
            .dense_pull(req.into_inner().var)
            .map_err(HandlerError::into_status)?;
        Ok(Response::new(DensePullReply { values }))
    }

    async fn dense_push(
        &self,
        req: Request<DensePushRequest>,
    ) -> Result<Response<PushReply>, Status> {
        let r = req.into_inner();
        self.h
            .dense_push(r.var, &r.grads)
            .map_err(HandlerError::into_status)?;
        Ok(Response::new(PushReply {}))
    }
}

fn service(h: Arc<dyn Handler>, cfg: &GrpcConfig) -> Budgeted<MessageLayerServer<Service>> {
    let svc = MessageLayerServer::new(Service { h })
        .max_decoding_message_size(cfg.max_message_len)
        .max_encoding_message_size(cfg.max_message_len);
    Budgeted::new(svc, cfg.memory_budget.map(MemoryBudget::new))
}

fn builder(cfg: &GrpcConfig) -> tonic::transport::Server {
    // Defaults otherwise: HTTP/2 windows, frame size, no keep-alive pings
    // (the idle timeout is kept by `Conn`).
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(Some(cfg.max_concurrent_streams))
}

/// A gRPC server listening on an address, serving any number of clients.
#[derive(Debug)]
pub struct GrpcServer {
    rt: Runtime,
    local: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl GrpcServer {
    /// Listen on `addr` (port 0 picks one) and serve `h` with the default
    /// [`GrpcConfig`].
    pub fn start(addr: SocketAddr, h: Arc<dyn Handler>) -> Result<Self, GrpcError> {
        Self::start_with(addr, h, &GrpcConfig::default())
    }

    /// Listen on `addr` and serve `h` with `cfg`.
    pub fn start_with(
        addr: SocketAddr,
        h: Arc<dyn Handler>,
        cfg: &GrpcConfig,
    ) -> Result<Self, GrpcError> {
        let listener =
            std::net::TcpListener::bind(addr).map_err(|source| GrpcError::Bind { addr, source })?;
        Self::start_on(listener, h, cfg)
    }

    /// Serve `h` with `cfg` on `listener`, already bound (and listening
    /// with the backlog its owner chose): the port is never let go.
    pub fn start_on(
        listener: std::net::TcpListener,
        h: Arc<dyn Handler>,
        cfg: &GrpcConfig,
    ) -> Result<Self, GrpcError> {
        let unknown = SocketAddr::from(([0, 0, 0, 0], 0));
        let local = listener.local_addr().map_err(|source| GrpcError::Bind {
            addr: unknown,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| GrpcError::Bind {
                addr: local,
                source,
            })?;
        let rt = runtime("grpc-server")?;
        let listener = {
            let _g = rt.enter();
            tokio::net::TcpListener::from_std(listener).map_err(|source| GrpcError::Bind {
                addr: local,
                source,
            })?
        };
        let (stop, stopped) = oneshot::channel::<()>();
        // A dropped sender stops the server too.
        let stopped = async {
            let _ = stopped.await;
        };
        let incoming = accepted(&rt, listener, cfg.clone());
        let task = rt.spawn(
            builder(cfg)
                .add_service(service(h, cfg))
                .serve_with_incoming_shutdown(incoming, stopped),
        );
        Ok(Self {
            rt,
            local,
            stop: Some(stop),
            task,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stop listening, let open connections finish their calls (at most
    /// 2 s), then close everything.
    pub fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let task = &mut self.task;
        let _ = self
            .rt
            .block_on(async { tokio::time::timeout(DRAIN, task).await });
        self.rt.shutdown_timeout(DRAIN);
    }
}

/// The connections of `listener`, each holding one of
/// `cfg.max_connections` slots from accept until it closes (one accepted
/// with none left is closed at once, warned about). With a token, each
/// proves it in a task of its own first, so that a slow peer holds up no
/// other, and one that does not is closed. The accept loop ends with the
/// server.
fn accepted(
    rt: &Runtime,
    listener: tokio::net::TcpListener,
    cfg: GrpcConfig,
) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(64);
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    rt.spawn(async move {
        let mut next = 0u64;
        loop {
            let (s, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors: do not spin.
                    tracing::debug!("grpc accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if tx.is_closed() {
                // The server has stopped.
                break;
            }
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::warn!(
                    %peer,
                    "closed a gRPC connection at accept: {} connections are open \
                     (--max-connections)",
                    cfg.max_connections
                );
                continue;
            };
            let id = ConnectionId(next);
            next += 1;
            let authenticate = cfg.token.is_some();
            let (tx, cfg) = (tx.clone(), cfg.clone());
            let serve = async move {
                let mut s = s;
                if s.set_nodelay(true).is_err() {
                    return;
                }
                if let Some(token) = &cfg.token {
                    if auth::accept(&mut s, peer, token, &cfg).await.is_err() {
                        return;
                    }
                }
                let conn = Conn::new(s, id, &cfg).holding(slot);
                let _ = tx.send(Ok(conn)).await;
            };
            if authenticate {
                tokio::spawn(serve);
            } else {
                serve.await;
            }
        }
    });
    ReceiverStream::new(rx)
}

/// A server for one connection that is already accepted (the bench's data
/// connection): serves it until the peer closes it.
#[derive(Debug)]
pub struct ConnectionServer {
    rt: Runtime,
    closed: oneshot::Receiver<()>,
}

impl ConnectionServer {
    /// Serve `h` on `stream`; returns at once, [`ConnectionServer::wait`]
    /// blocks until the peer has closed the connection.
    pub fn start(
        stream: std::net::TcpStream,
        h: Arc<dyn Handler>,
        cfg: &GrpcConfig,
    ) -> Result<Self, GrpcError> {
        auth::on_std(&stream, true, cfg).map_err(GrpcError::Auth)?;
        stream
            .set_nodelay(true)
            .and_then(|()| stream.set_nonblocking(true))
            .map_err(GrpcError::Socket)?;
        let rt = runtime("grpc-server")?;
        let (closed_tx, closed) = oneshot::channel();
        let io = {
            let _g = rt.enter();
            let s = tokio::net::TcpStream::from_std(stream).map_err(GrpcError::Socket)?;
            let mut c = Conn::new(s, ConnectionId(0), cfg);
            c._closed = Some(closed_tx);
            c
        };
        let svc = service(h, cfg);
        let mut server = builder(cfg);
        // The accept loop ends after the one connection; the connection's
        // task goes on until the peer closes it and drops the `Conn`.
        rt.spawn(async move {
            let one = tokio_stream::once(Ok::<_, io::Error>(io));
            if let Err(e) = server.add_service(svc).serve_with_incoming(one).await {
                tracing::debug!("grpc connection server: {e}");
            }
        });
        Ok(Self { rt, closed })
    }

    /// Block until the peer has closed the connection, then stop.
    pub fn wait(self) {
        let Self { rt, closed } = self;
        // Err means the sender is gone: the connection was dropped.
        let _ = rt.block_on(closed);
        rt.shutdown_timeout(DRAIN);
    }
}

/// What tonic puts in each request of a [`Conn`].
#[derive(Debug, Clone)]
pub(crate) struct ConnInfo {
    id: ConnectionId,
    /// The connection's unsent reply bytes, counted when it has an idle
    /// timeout.
    pub(crate) unsent: Option<Arc<Unsent>>,
}

/// An accepted connection as the server serves it: its id, the slot of
/// `max_connections` it holds until dropped, its idle timeout, and (the
/// bench's one connection) a sender whose drop tells
/// [`ConnectionServer::wait`] that it is gone.
struct Conn {
    inner: tokio::net::TcpStream,
    id: ConnectionId,
    idle: Option<Idle>,
    preface: Option<Preface>,
    _slot: Option<OwnedSemaphorePermit>,
    _closed: Option<oneshot::Sender<()>>,
}

/// Bytes of the HTTP/2 client preface (`PRI * HTTP/2.0...`, RFC 9113
/// section 3.4), which a client sends first.
const PREFACE_LEN: usize = 24;

/// The deadline for a connection's HTTP/2 preface: `cfg.handshake_timeout`
/// from when it is served (after the token's handshake, if any), so that a
/// socket that sends nothing gives its `max_connections` slot back then,
/// not at the idle timeout.
struct Preface {
    got: usize,
    timeout: Duration,
    timer: Pin<Box<Sleep>>,
}

impl Conn {
    fn new(inner: tokio::net::TcpStream, id: ConnectionId, cfg: &GrpcConfig) -> Self {
        let preface = Preface {
            got: 0,
            timeout: cfg.handshake_timeout,
            timer: Box::pin(tokio::time::sleep(cfg.handshake_timeout)),
        };
        Self {
            inner,
            id,
            idle: cfg.idle_timeout.map(Idle::new),
            preface: Some(preface),
            _slot: None,
            _closed: None,
        }
    }

    /// After a read: counts the preface's bytes while it is awaited, and
    /// once the read waits past its deadline, the error that closes the
    /// connection.
    fn preface_check(
        &mut self,
        cx: &mut Context<'_>,
        r: &Poll<io::Result<()>>,
        n: usize,
    ) -> Option<io::Error> {
        let p = self.preface.as_mut()?;
        p.got += n;
        if p.got >= PREFACE_LEN {
            self.preface = None;
            return None;
        }
        if r.is_pending() && p.timer.as_mut().poll(cx).is_ready() {
            let e = io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no HTTP/2 preface within the handshake timeout ({} s)",
                    p.timeout.as_secs_f64()
                ),
            );
            tracing::debug!(conn = self.id.0, "closed a gRPC connection: {e}");
            return Some(e);
        }
        None
    }

    fn holding(mut self, slot: OwnedSemaphorePermit) -> Self {
        self._slot = Some(slot);
        self
    }

    /// After an I/O call: its progress resets the idle clock; a call that
    /// waits is an error once the connection has been idle (or its writes
    /// stalled) too long.
    fn idle_check<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
        moved: impl FnOnce(&T) -> bool,
        write: bool,
    ) -> Poll<io::Result<T>> {
        let Some(idle) = self.idle.as_mut() else {
            return r;
        };
        match &r {
            Poll::Ready(Ok(v)) => {
                if moved(v) {
                    idle.moved(write);
                }
                r
            }
            Poll::Ready(Err(_)) => r,
            Poll::Pending => {
                if write {
                    idle.stalled.get_or_insert_with(Instant::now);
                }
                match idle.poll_expired(cx) {
                    Poll::Ready(e) => {
                        tracing::debug!(conn = self.id.0, "closed a gRPC connection: {e}");
                        Poll::Ready(Err(e))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

/// A connection's idle timeout and what it is measured from.
struct Idle {
    timeout: Duration,
    /// When a byte last moved either way.
    last: Instant,
    /// Since when a write has been waiting for the peer to read.
    stalled: Option<Instant>,
    /// The replies the connection's calls have queued and HTTP/2 has not
    /// written: a peer that keeps its flow-control window shut stalls them
    /// with no write waiting on the socket.
    unsent: Arc<Unsent>,
    timer: Pin<Box<Sleep>>,
}

impl Idle {
    fn new(timeout: Duration) -> Self {
        let now = Instant::now();
        Self {
            timeout,
            last: now,
            stalled: None,
            unsent: Arc::new(Unsent::new()),
            timer: Box::pin(tokio::time::sleep_until(now + timeout)),
        }
    }

    fn moved(&mut self, write: bool) {
        self.last = Instant::now();
        if write {
            self.stalled = None;
        }
    }

    /// The timer, armed for the earlier of the idle and the stall
    /// deadlines: the error once it has passed.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let idle = self.last + self.timeout;
        // The earlier of a waiting write and replies none of which left.
        let stalled = match (self.stalled, self.unsent.waiting_since()) {
            (Some(a), Some(b)) => Some(a.min(b.into())),
            (a, b) => a.or(b.map(Instant::from)),
        };
        let (deadline, what) = match stalled {
            Some(s) if s + self.timeout < idle => (
                s + self.timeout,
                "the peer read nothing within the idle timeout",
            ),
            _ => (idle, "nothing received or sent within the idle timeout"),
        };
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} ({} s)", self.timeout.as_secs_f64()),
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnInfo {
            id: self.id,
            unsent: self.idle.as_ref().map(|i| i.unsent.clone()),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let after = buf.filled().len();
        if let Some(e) = self.preface_check(cx, &r, after - before) {
            return Poll::Ready(Err(e));
        }
        self.idle_check(cx, r, |()| after > before, false)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.idle_check(cx, r, |&n| n > 0, true)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.idle_check(cx, r, |&n| n > 0, true)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.idle_check(cx, r, |()| false, true)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

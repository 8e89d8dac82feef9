//! The server: a tonic service calling a [`Handler`] on a 2-worker runtime.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use starwire_transport::ClusterToken;
use starwire_wire::Opcode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};
use tonic::{Request, Response, Status};

use crate::proto::message_layer_server::{MessageLayer, MessageLayerServer};
use crate::proto::{
    CallReply, CallRequest, DensePullReply, DensePullRequest, DensePushRequest, PushReply,
    SparsePullReply, SparsePullRequest, SparsePushRequest,
};
use crate::{auth, runtime, GrpcConfig, GrpcError, Handler, HandlerError};

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
            .handle(op, &r.payload)
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

fn service(h: Arc<dyn Handler>, cfg: &GrpcConfig) -> MessageLayerServer<Service> {
    MessageLayerServer::new(Service { h })
        .max_decoding_message_size(cfg.max_message_len)
        .max_encoding_message_size(cfg.max_message_len)
}

fn builder() -> tonic::transport::Server {
    // Defaults otherwise: HTTP/2 windows, concurrency, keep-alive.
    tonic::transport::Server::builder().tcp_nodelay(true)
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
        let rt = runtime("grpc-server")?;
        let (stop, stopped) = oneshot::channel::<()>();
        // A dropped sender stops the server too.
        let stopped = async {
            let _ = stopped.await;
        };
        let svc = service(h, cfg);
        let (local, task) = match &cfg.token {
            None => {
                let incoming = {
                    let _g = rt.enter();
                    TcpIncoming::bind(addr)
                        .map_err(|source| GrpcError::Bind { addr, source })?
                        .with_nodelay(Some(true))
                };
                let local = incoming
                    .local_addr()
                    .map_err(|source| GrpcError::Bind { addr, source })?;
                let task = rt.spawn(
                    builder()
                        .add_service(svc)
                        .serve_with_incoming_shutdown(incoming, stopped),
                );
                (local, task)
            }
            Some(token) => {
                let listener = std::net::TcpListener::bind(addr)
                    .and_then(|l| l.set_nonblocking(true).map(|()| l))
                    .map_err(|source| GrpcError::Bind { addr, source })?;
                let local = listener
                    .local_addr()
                    .map_err(|source| GrpcError::Bind { addr, source })?;
                let listener = {
                    let _g = rt.enter();
                    tokio::net::TcpListener::from_std(listener)
                        .map_err(|source| GrpcError::Bind { addr, source })?
                };
                let incoming = authenticated(&rt, listener, token.clone(), cfg.clone());
                let task = rt.spawn(
                    builder()
                        .add_service(svc)
                        .serve_with_incoming_shutdown(incoming, stopped),
                );
                (local, task)
            }
        };
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

/// The connections of `listener` that prove `token`, each in a task of
/// its own so that a slow peer holds up no other; the others are closed.
/// The accept loop ends with the runtime.
fn authenticated(
    rt: &Runtime,
    listener: tokio::net::TcpListener,
    token: ClusterToken,
    cfg: GrpcConfig,
) -> ReceiverStream<io::Result<tokio::net::TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    rt.spawn(async move {
        loop {
            let (mut s, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors: do not spin.
                    tracing::debug!("grpc accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (tx, token, cfg) = (tx.clone(), token.clone(), cfg.clone());
            tokio::spawn(async move {
                if s.set_nodelay(true).is_err() {
                    return;
                }
                if auth::accept(&mut s, peer, &token, &cfg).await.is_ok() {
                    let _ = tx.send(Ok(s)).await;
                }
            });
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
            Tracked {
                inner: tokio::net::TcpStream::from_std(stream).map_err(GrpcError::Socket)?,
                _closed: closed_tx,
            }
        };
        let svc = service(h, cfg);
        // The accept loop ends after the one connection; the connection's
        // task goes on until the peer closes it and drops `Tracked`.
        rt.spawn(async move {
            let one = tokio_stream::once(Ok::<_, io::Error>(io));
            if let Err(e) = builder().add_service(svc).serve_with_incoming(one).await {
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

/// The accepted stream, with a sender whose drop tells
/// [`ConnectionServer::wait`] that the connection is gone.
struct Tracked {
    inner: tokio::net::TcpStream,
    _closed: oneshot::Sender<()>,
}

impl Connected for Tracked {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

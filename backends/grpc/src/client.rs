//! The client: tonic's default channel (one HTTP/2 connection) driven by a
//! 2-worker runtime, behind blocking calls.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use futures_util::stream::{FuturesUnordered, StreamExt};
use hyper_util::rt::TokioIo;
use prost::Message;
use tokio::runtime::Runtime;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::proto::message_layer_client::MessageLayerClient;
use crate::proto::{
    CallRequest, DensePullRequest, DensePushRequest, SparsePullRequest, SparsePushRequest,
};
use crate::{auth, runtime, GrpcConfig, GrpcError};

/// Rows answered by [`GrpcClient::sparse_pull`]: one row of `dim` values per
/// key asked for, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseRows {
    /// Values per row.
    pub dim: usize,
    /// `keys.len() * dim` values.
    pub values: Vec<f32>,
}

/// A gRPC client: one channel, one connection, blocking calls.
#[derive(Debug)]
pub struct GrpcClient {
    // Declared before the runtime: the channel goes first on drop.
    client: MessageLayerClient<Channel>,
    max_message_len: usize,
    rt: Runtime,
}

impl GrpcClient {
    /// Connect to a [`crate::GrpcServer`] at `addr` with the default
    /// [`GrpcConfig`].
    pub fn connect(addr: SocketAddr) -> Result<Self, GrpcError> {
        Self::connect_with(addr, &GrpcConfig::default())
    }

    /// Connect to `addr` with `cfg`.
    pub fn connect_with(addr: SocketAddr, cfg: &GrpcConfig) -> Result<Self, GrpcError> {
        let rt = runtime("grpc-client")?;
        let uri = format!("http://{addr}");
        let ep = Endpoint::from_shared(uri.clone())
            .map_err(|source| GrpcError::Connect {
                addr: uri.clone(),
                source,
            })?
            .tcp_nodelay(true);
        let channel = if cfg.token.is_none() {
            rt.block_on(ep.connect())
        } else {
            // Each connection the channel makes proves the token first.
            let cfg = cfg.clone();
            let connector = tower::service_fn(move |_: Uri| {
                let cfg = cfg.clone();
                async move {
                    let mut s = tokio::net::TcpStream::connect(addr).await?;
                    s.set_nodelay(true)?;
                    auth::dial(&mut s, &cfg)
                        .await
                        .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
                    Ok::<_, io::Error>(TokioIo::new(s))
                }
            });
            rt.block_on(ep.connect_with_connector(connector))
        }
        .map_err(|source| GrpcError::Connect { addr: uri, source })?;
        Ok(Self::with_channel(rt, channel, cfg))
    }

    /// Speak gRPC on an already connected socket (the bench's data
    /// connection). The channel does not reconnect: once this connection is
    /// gone, calls fail with `Unavailable`.
    pub fn from_stream(stream: std::net::TcpStream, cfg: &GrpcConfig) -> Result<Self, GrpcError> {
        auth::on_std(&stream, false, cfg).map_err(GrpcError::Auth)?;
        stream
            .set_nodelay(true)
            .and_then(|()| stream.set_nonblocking(true))
            .map_err(GrpcError::Socket)?;
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "the given socket".to_owned(), |a| a.to_string());
        let rt = runtime("grpc-client")?;
        let slot = Arc::new(Mutex::new(Some(stream)));
        let connector = tower::service_fn(move |_: Uri| {
            let s = slot.lock().map(|mut g| g.take()).ok().flatten();
            async move {
                let s = s.ok_or_else(|| {
                    io::Error::new(io::ErrorKind::NotConnected, "the one connection is gone")
                })?;
                Ok::<_, io::Error>(TokioIo::new(tokio::net::TcpStream::from_std(s)?))
            }
        });
        // The authority is only the HTTP/2 `:authority` header here.
        let ep = Endpoint::from_static("http://starwire.invalid").tcp_nodelay(true);
        let channel = rt
            .block_on(ep.connect_with_connector(connector))
            .map_err(|source| GrpcError::Connect { addr: peer, source })?;
        Ok(Self::with_channel(rt, channel, cfg))
    }

    fn with_channel(rt: Runtime, channel: Channel, cfg: &GrpcConfig) -> Self {
        let client = MessageLayerClient::new(channel)
            .max_decoding_message_size(cfg.max_message_len)
            .max_encoding_message_size(cfg.max_message_len);
        Self {
            client,
            max_message_len: cfg.max_message_len,
            rt,
        }
    }

    /// A generic call: `opcode` and `payload` in, the reply payload out.
    pub fn call(&self, opcode: u8, payload: Bytes) -> Result<Bytes, GrpcError> {
        self.rt.block_on(self.call_future(opcode, payload))
    }

    /// The future of one generic call, to run on any tokio runtime.
    pub fn call_future(
        &self,
        opcode: u8,
        payload: Bytes,
    ) -> impl Future<Output = Result<Bytes, GrpcError>> + Send + 'static {
        let c = self.client.clone();
        let req = CallRequest {
            opcode: u32::from(opcode),
            payload,
        };
        // tonic would fail such a request mid-stream with a bare h2 error.
        let (len, max) = (req.encoded_len(), self.max_message_len);
        async move {
            if len > max {
                return Err(GrpcError::TooLarge { len, max });
            }
            let r = retry_unprocessed(req, |r| {
                let mut c = c.clone();
                async move { c.call(r).await }
            })
            .await?;
            Ok(r.into_inner().payload)
        }
    }

    /// All of `reqs` at once, concurrent on the one connection; the results
    /// in the order of `reqs`.
    pub fn call_many(&self, reqs: Vec<(u8, Bytes)>) -> Vec<Result<Bytes, GrpcError>> {
        let futs: Vec<_> = reqs
            .into_iter()
            .map(|(op, p)| self.call_future(op, p))
            .collect();
        self.rt.block_on(join_all(futs))
    }

    /// Keep up to `inflight` calls outstanding. While the window has room,
    /// `next` says what comes next ([`NextCall`]): a call, with a tag of
    /// the caller's that `done` gets back with its result (in completion
    /// order), an instant before which there is none (the window takes
    /// completions until then, then asks again), or the end. Returns when
    /// every started call has completed.
    ///
    /// Waiting for an instant: a tokio timer until 1.2 ms before it when
    /// it is more than 2.2 ms away, then this thread spins, polling its
    /// calls and yielding its CPU between polls, so that the next call
    /// leaves on time. tokio's timer wheel ticks in milliseconds and
    /// rounds a deadline up to the next tick, so a timer set closer
    /// would wake after the instant.
    pub fn call_pipelined<T>(
        &self,
        inflight: usize,
        mut next: impl FnMut() -> NextCall<T>,
        mut done: impl FnMut(Result<Bytes, GrpcError>, T),
    ) {
        let inflight = inflight.max(1);
        // The calls are polled by this thread (as a tonic caller's task
        // would poll them); the channel and the connection run on the
        // runtime's workers.
        self.rt.block_on(async {
            let mut outstanding = FuturesUnordered::new();
            let mut more = true;
            loop {
                let mut not_before = None;
                while more && outstanding.len() < inflight {
                    match next() {
                        NextCall::Call(op, p, tag) => {
                            let f = self.call_future(op, p);
                            outstanding.push(async move { (f.await, tag) });
                        }
                        NextCall::NotBefore(t) => {
                            not_before = Some(t);
                            break;
                        }
                        NextCall::End => more = false,
                    }
                }
                let completed = match not_before {
                    None => match outstanding.next().await {
                        Some(c) => Some(c),
                        None => break,
                    },
                    Some(t) => until(&mut outstanding, t).await,
                };
                if let Some((r, tag)) = completed {
                    done(r, tag);
                }
            }
        });
    }

    /// Rows of `var` for `keys` (a protobuf `SparsePullRequest`).
    pub fn sparse_pull(&self, var: u64, keys: Vec<u64>) -> Result<SparseRows, GrpcError> {
        let n = keys.len();
        let c = self.client.clone();
        let req = SparsePullRequest { var, keys };
        let r = self
            .rt
            .block_on(retry_unprocessed(req, |r| {
                let mut c = c.clone();
                async move { c.sparse_pull(r).await }
            }))?
            .into_inner();
        let dim = r.dim as usize;
        if n.checked_mul(dim) != Some(r.values.len()) {
            return Err(GrpcError::BadReply(format!(
                "{} values for {n} rows of width {dim}",
                r.values.len()
            )));
        }
        Ok(SparseRows {
            dim,
            values: r.values,
        })
    }

    /// Gradients for rows of `var`: `grads` is `keys.len()` rows of `dim`.
    pub fn sparse_push(
        &self,
        var: u64,
        keys: Vec<u64>,
        dim: usize,
        grads: Vec<f32>,
    ) -> Result<(), GrpcError> {
        let dim = u32::try_from(dim).map_err(|_| GrpcError::Status {
            code: tonic::Code::InvalidArgument,
            message: format!("row width {dim} is over u32"),
            wire: None,
        })?;
        let c = self.client.clone();
        let req = SparsePushRequest {
            var,
            keys,
            dim,
            grads,
        };
        self.rt.block_on(retry_unprocessed(req, |r| {
            let mut c = c.clone();
            async move { c.sparse_push(r).await }
        }))?;
        Ok(())
    }

    /// The whole dense variable `var`.
    pub fn dense_pull(&self, var: u64) -> Result<Vec<f32>, GrpcError> {
        let c = self.client.clone();
        Ok(self
            .rt
            .block_on(retry_unprocessed(DensePullRequest { var }, |r| {
                let mut c = c.clone();
                async move { c.dense_pull(r).await }
            }))?
            .into_inner()
            .values)
    }

    /// A gradient for the whole dense variable `var`.
    pub fn dense_push(&self, var: u64, grads: Vec<f32>) -> Result<(), GrpcError> {
        let c = self.client.clone();
        let req = DensePushRequest { var, grads };
        self.rt.block_on(retry_unprocessed(req, |r| {
            let mut c = c.clone();
            async move { c.dense_push(r).await }
        }))?;
        Ok(())
    }
}

/// How many times one call is sent again after the server did not process
/// it (see [`retry_unprocessed`]). One suffices in practice; the bound only
/// keeps a server that refuses everything from holding a call forever.
const UNPROCESSED_RETRIES: u32 = 8;

/// Make a unary call, sending it again when the server did not process it,
/// as gRPC's transparent retry does; a call left unprocessed when the
/// retries are spent fails `Unavailable` (the connection gone).
///
/// A call is known not to have been processed when:
///
/// - the server refused its stream (`REFUSED_STREAM`, RFC 9113 section
///   8.7). A server refuses the streams past its `max_concurrent_streams`.
///   The client learns that limit from the server's first SETTINGS frame;
///   until then hyper lets it open up to 100 streams at once, so calls
///   made right after connecting (or reconnecting) can be refused. By the
///   time of the retry the limit is known: the SETTINGS frame came before
///   the refusal on the same connection, and the client queues what the
///   limit does not let through;
/// - its stream is above the last-stream-id of the server's GOAWAY
///   (section 6.8), as when a server shuts down while a call is on its
///   way. The connection is closing, so the retry goes on a new one (a
///   client on one given socket has none, and its call fails
///   `Unavailable`);
/// - the connection never sent it (hyper's `Canceled`: the connection
///   closed, after a GOAWAY or otherwise, with the call still queued for
///   it), as the retry after a GOAWAY may be when it reaches the closing
///   connection before the channel sees it gone.
async fn retry_unprocessed<Req, Rep, F, Fut>(req: Req, mut call: F) -> Result<Rep, tonic::Status>
where
    Req: Clone,
    F: FnMut(Req) -> Fut,
    Fut: Future<Output = Result<Rep, tonic::Status>>,
{
    let mut left = UNPROCESSED_RETRIES;
    loop {
        match call(req.clone()).await {
            Err(s) if left > 0 && unprocessed(&s) => left -= 1,
            Err(s) if unprocessed(&s) => {
                return Err(tonic::Status::unavailable(s.message().to_owned()))
            }
            r => return r,
        }
    }
}

/// Whether `s` is a call the server did not process (see
/// [`retry_unprocessed`]): its stream refused (`REFUSED_STREAM`; tonic
/// already calls that `Unavailable`), left out by the server's GOAWAY
/// (which tonic calls `Internal`, after the frame's error code, usually
/// `NO_ERROR`), or never sent (tonic's `Cancelled`).
///
/// h2 gives a call a GOAWAY from the peer only when its stream is above
/// the frame's last-stream-id, or when it is opened after the frame came:
/// a stream the server may have processed that then loses its connection
/// gets an I/O error, whatever the frame's code. hyper's HTTP/2 client is
/// `Canceled` only for a request it did not hand to h2.
fn unprocessed(s: &tonic::Status) -> bool {
    let mut e = std::error::Error::source(s);
    while let Some(x) = e {
        if let Some(h) = x.downcast_ref::<h2::Error>() {
            return h.is_remote()
                && (h.is_go_away() || h.reason() == Some(h2::Reason::REFUSED_STREAM));
        }
        if let Some(h) = x.downcast_ref::<hyper::Error>() {
            if h.is_canceled() {
                return true;
            }
        }
        e = x.source();
    }
    false
}

/// What [`GrpcClient::call_pipelined`]'s source gives when its window has
/// room.
#[derive(Debug)]
pub enum NextCall<T> {
    /// Start this call (opcode, payload) now; `T` comes back with its
    /// result.
    Call(u8, Bytes, T),
    /// No call before this instant (an open-loop schedule's next due
    /// time): ask again then, or at the next completion.
    NotBefore(Instant),
    /// No more calls: the window drains.
    End,
}

/// Below this much time to an instant [`GrpcClient::call_pipelined`]
/// waits for, it spins instead of arming a timer.
const SPIN_WITHIN: Duration = Duration::from_micros(2200);

/// How long before the instant a timer is set to wake the waiting
/// thread: more than one tick of tokio's wheel, which rounds deadlines
/// up to its next millisecond.
const WAKE_EARLY: Duration = Duration::from_micros(1200);

/// The next of `outstanding` to complete before `t`, or `None` at `t`
/// (at once if `t` has passed).
async fn until<F: Future>(outstanding: &mut FuturesUnordered<F>, t: Instant) -> Option<F::Output> {
    let far = t.saturating_duration_since(Instant::now()) > SPIN_WITHIN;
    let timer = far.then(|| tokio::time::sleep_until((t - WAKE_EARLY).into()));
    let mut timer = std::pin::pin!(timer);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(Some(c)) = outstanding.poll_next_unpin(cx) {
            return Poll::Ready(Some(c));
        }
        let now = Instant::now();
        if now >= t {
            return Poll::Ready(None);
        }
        // Until the timer fires, its wake-up or a completion's; then (or
        // with no timer, the instant being near) poll again at once.
        let armed = timer
            .as_mut()
            .as_pin_mut()
            .is_some_and(|sleep| sleep.poll(cx).is_pending());
        if !armed {
            // The runtimes' workers, unpinned, may be waiting for this
            // CPU: the spin gives it up between polls.
            std::thread::yield_now();
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    })
    .await
}

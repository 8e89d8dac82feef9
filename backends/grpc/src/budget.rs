//! A server's memory budget ([`GrpcConfig::memory_budget`]): one bound
//! on the bytes that the calls of all its connections hold, what the other
//! backends' [`MemoryBudget`] bounds for their reassembly buffers and reply
//! queues.
//!
//! - A request's bytes are charged as its HTTP/2 data frames reach the
//!   service, and given back when its call is over: its reply written, or
//!   the call dropped.
//! - A reply's bytes are charged as its data frames leave the service, and
//!   given back when HTTP/2 drops each frame, once it is written to the
//!   socket. A peer that reads nothing, or never opens its flow-control
//!   window, holds its replies' bytes until the idle timeout closes it:
//!   each connection counts its replies' unsent bytes ([`Unsent`]), and
//!   unsent bytes none of which left for the idle timeout are a stall.
//! - A request that would pass the budget fails before its handler is
//!   called; a reply that would is dropped and its call ends. Both end
//!   with `Overloaded` (`ResourceExhausted`, with the wire status in the
//!   `starwire-status` metadata), as the other backends answer, and the
//!   connection keeps serving. A reply of at most [`ALWAYS_SENT`] bytes
//!   (a push's acknowledgement) is charged past the budget rather than
//!   refused: its handler has run, and a push refused after it was
//!   applied would be applied twice by a worker that retried it.
//!
//! tonic reserves a request's declared length before the bytes arrive, but
//! that is address space: pages are only used as the bytes are written,
//! and the bytes are what is charged.
//!
//! [`GrpcConfig::memory_budget`]: crate::GrpcConfig::memory_budget

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use starwire_transport::MemoryBudget;
use starwire_wire::Status as WireStatus;
use tonic::server::NamedService;
use tower::Service;

use crate::HandlerError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Replies of at most this many bytes (a gRPC data frame's 5-byte prefix
/// and a few bytes of message) are never refused.
pub(crate) const ALWAYS_SENT: usize = 64;

/// The reply bytes of one connection not yet written to its socket, and
/// since when none has been: what [`crate::server`]'s idle timeout reads
/// to close a peer that takes no reply.
#[derive(Debug)]
pub(crate) struct Unsent {
    epoch: Instant,
    bytes: AtomicUsize,
    /// Milliseconds from `epoch` to when the bytes last left, or to when
    /// the first of them was queued.
    moved_ms: AtomicU64,
}

impl Unsent {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            bytes: AtomicUsize::new(0),
            moved_ms: AtomicU64::new(0),
        }
    }

    fn stamp(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.moved_ms.store(ms, Ordering::Relaxed);
    }

    fn queued(&self, n: usize) {
        if self.bytes.fetch_add(n, Ordering::Relaxed) == 0 {
            self.stamp();
        }
    }

    fn sent(&self, n: usize) {
        self.bytes.fetch_sub(n, Ordering::Relaxed);
        self.stamp();
    }

    /// Since when reply bytes have been waiting with none leaving, if any
    /// wait.
    pub(crate) fn waiting_since(&self) -> Option<Instant> {
        if self.bytes.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let ms = self.moved_ms.load(Ordering::Relaxed);
        Some(self.epoch + Duration::from_millis(ms))
    }
}

/// A service whose calls are charged to a budget, and whose replies are
/// counted by their connection's [`Unsent`] (neither: passed through).
#[derive(Debug, Clone)]
pub(crate) struct Budgeted<S> {
    inner: S,
    budget: Option<MemoryBudget>,
}

impl<S> Budgeted<S> {
    pub(crate) fn new(inner: S, budget: Option<MemoryBudget>) -> Self {
        Self { inner, budget }
    }
}

impl<S: NamedService> NamedService for Budgeted<S> {
    const NAME: &'static str = S::NAME;
}

/// The status of a call the budget had no room for.
fn overloaded(what: &str, n: usize, budget: &MemoryBudget) -> tonic::Status {
    HandlerError::Wire {
        status: WireStatus::Overloaded,
        message: format!(
            "{what} of {n} bytes does not fit in the server's memory budget of {} bytes now \
             (--memory-budget-mb); retry",
            budget.limit()
        ),
    }
    .into_status()
}

/// The bytes one call's request holds: given back when the last of its
/// request body, its call and its reply body is dropped.
#[derive(Debug)]
struct Held {
    budget: MemoryBudget,
    bytes: AtomicUsize,
}

impl Held {
    fn charge(&self, n: usize) -> bool {
        let ok = self.budget.try_charge(n);
        if ok {
            self.bytes.fetch_add(n, Ordering::Relaxed);
        }
        ok
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.release(*self.bytes.get_mut());
    }
}

impl<S, B> Service<http::Request<B>> for Budgeted<S>
where
    S: Service<
        http::Request<Charged<B>>,
        Response = http::Response<tonic::body::Body>,
        Error = Infallible,
    >,
    S::Future: Unpin,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Call<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let unsent = req
            .extensions()
            .get::<crate::server::ConnInfo>()
            .and_then(|c| c.unsent.clone());
        let held = self.budget.clone().map(|budget| {
            Arc::new(Held {
                budget,
                bytes: AtomicUsize::new(0),
            })
        });
        let req = req.map(|body| Charged {
            body,
            held: held.clone(),
            refused: false,
        });
        Call {
            fut: self.inner.call(req),
            held,
            unsent,
        }
    }
}

/// A request body whose data is charged to its call's [`Held`].
#[derive(Debug)]
pub(crate) struct Charged<B> {
    body: B,
    held: Option<Arc<Held>>,
    refused: bool,
}

impl<B> Body for Charged<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.refused {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
            Some(Ok(f)) => f,
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => return Poll::Ready(None),
        };
        if let (Some(data), Some(held)) = (frame.data_ref(), &self.held) {
            let n = data.len();
            if !held.charge(n) {
                let status = overloaded("a request", n, &held.budget);
                self.refused = true;
                // tonic finds the status in the error and answers it.
                return Poll::Ready(Some(Err(Box::new(status))));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.refused || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A call: its reply, once the service has it, gets a [`Reply`] body.
#[derive(Debug)]
pub(crate) struct Call<F> {
    fut: F,
    held: Option<Arc<Held>>,
    unsent: Option<Arc<Unsent>>,
}

impl<F> Future for Call<F>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, Infallible>> + Unpin,
{
    type Output = Result<http::Response<tonic::body::Body>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let rsp = ready!(Pin::new(&mut self.fut).poll(cx))?;
        let (held, unsent) = (self.held.take(), self.unsent.take());
        if held.is_none() && unsent.is_none() {
            return Poll::Ready(Ok(rsp));
        }
        Poll::Ready(Ok(rsp.map(|body| {
            tonic::body::Body::new(Reply {
                body,
                held,
                unsent,
                refused: false,
            })
        })))
    }
}

/// A reply body whose data frames are charged (and counted as unsent) as
/// they leave and given back when HTTP/2 drops them; it holds its call's
/// request bytes until it is dropped.
struct Reply {
    body: tonic::body::Body,
    held: Option<Arc<Held>>,
    unsent: Option<Arc<Unsent>>,
    refused: bool,
}

/// A data frame's bytes, charged and counted until dropped.
struct Sent {
    data: Bytes,
    budget: Option<MemoryBudget>,
    unsent: Option<Arc<Unsent>>,
}

impl AsRef<[u8]> for Sent {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        let n = self.data.len();
        if let Some(b) = &self.budget {
            b.release(n);
        }
        if let Some(u) = &self.unsent {
            u.sent(n);
        }
    }
}

impl Body for Reply {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if self.refused {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
            Some(Ok(f)) => f,
            other => return Poll::Ready(other),
        };
        let data = match frame.into_data() {
            Ok(d) => d,
            Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
        };
        let n = data.len();
        let budget = self.held.as_ref().map(|h| h.budget.clone());
        if let Some(b) = &budget {
            if n <= ALWAYS_SENT {
                b.charge(n);
            } else if !b.try_charge(n) {
                // The reply is dropped; the call ends with the status
                // instead (a unary reply is one data frame, so nothing of
                // it has left).
                let status = overloaded("a reply", n, b);
                self.refused = true;
                let mut trailers = http::HeaderMap::new();
                return Poll::Ready(Some(match status.add_header(&mut trailers) {
                    Ok(()) => Ok(Frame::trailers(trailers)),
                    Err(e) => Err(e),
                }));
            }
        }
        if let Some(u) = &self.unsent {
            u.queued(n);
        }
        let sent = Sent {
            data,
            budget,
            unsent: self.unsent.clone(),
        };
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_owner(sent)))))
    }

    fn is_end_stream(&self) -> bool {
        self.refused || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.refused {
            SizeHint::with_exact(0)
        } else {
            self.body.size_hint()
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;
    use http_body_util::{BodyExt, Full};

    use super::*;

    /// The first frame of a reply of `n` bytes, under `budget`.
    fn first_frame(n: usize, budget: &MemoryBudget) -> Frame<Bytes> {
        let held = Arc::new(Held {
            budget: budget.clone(),
            bytes: AtomicUsize::new(0),
        });
        let mut reply = Reply {
            body: tonic::body::Body::new(Full::new(Bytes::from(vec![1u8; n]))),
            held: Some(held),
            unsent: None,
            refused: false,
        };
        reply
            .frame()
            .now_or_never()
            .expect("a full body is ready")
            .expect("a frame")
            .expect("no error")
    }

    /// With the budget spent, a small reply (a push's acknowledgement) is
    /// still sent, charged past the limit until written; a larger one is
    /// replaced by `Overloaded`.
    #[test]
    fn a_small_reply_is_sent_past_a_spent_budget() {
        let b = MemoryBudget::new(100);
        b.charge(100);
        let f = first_frame(ALWAYS_SENT, &b);
        assert_eq!(f.data_ref().map(Bytes::len), Some(ALWAYS_SENT));
        assert_eq!(b.used(), 100 + ALWAYS_SENT);
        drop(f);
        assert_eq!(b.used(), 100);
        let f = first_frame(ALWAYS_SENT + 1, &b);
        let t = f.trailers_ref().expect("trailers instead of the reply");
        assert_eq!(t["grpc-status"], "8", "ResourceExhausted");
        assert_eq!(t[crate::WIRE_STATUS_METADATA], "8", "Overloaded");
        assert_eq!(b.used(), 100);
    }
}

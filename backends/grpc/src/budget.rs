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
//!   socket. A peer that reads nothing holds its replies' bytes until the
//!   idle timeout closes it.
//! - A request that would pass the budget fails before its handler is
//!   called; a reply that would is dropped and its call ends. Both end
//!   with `Overloaded` (`ResourceExhausted`, with the wire status in the
//!   `starwire-status` metadata), as the other backends answer, and the
//!   connection keeps serving.
//!
//! tonic reserves a request's declared length before the bytes arrive, but
//! that is address space: pages are only used as the bytes are written,
//! and the bytes are what is charged.
//!
//! [`GrpcConfig::memory_budget`]: crate::GrpcConfig::memory_budget

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use starwire_transport::MemoryBudget;
use starwire_wire::Status as WireStatus;
use tonic::server::NamedService;
use tower::Service;

use crate::HandlerError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A service whose calls are charged to a budget (none: passed through).
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
}

impl<F> Future for Call<F>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, Infallible>> + Unpin,
{
    type Output = Result<http::Response<tonic::body::Body>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let rsp = ready!(Pin::new(&mut self.fut).poll(cx))?;
        Poll::Ready(Ok(match self.held.take() {
            None => rsp,
            Some(held) => rsp.map(|body| {
                tonic::body::Body::new(Reply {
                    body,
                    held,
                    refused: false,
                })
            }),
        }))
    }
}

/// A reply body whose data frames are charged as they leave and given
/// back when HTTP/2 drops them; it holds its call's request bytes until
/// it is dropped.
struct Reply {
    body: tonic::body::Body,
    held: Arc<Held>,
    refused: bool,
}

/// A data frame's bytes, charged until dropped.
struct Sent {
    data: Bytes,
    budget: MemoryBudget,
}

impl AsRef<[u8]> for Sent {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        self.budget.release(self.data.len());
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
        let budget = &self.held.budget;
        if budget.try_charge(data.len()) {
            let sent = Sent {
                data,
                budget: budget.clone(),
            };
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_owner(sent)))));
        }
        // The reply is dropped; the call ends with the status instead (a
        // unary reply is one data frame, so nothing of it has left).
        let status = overloaded("a reply", data.len(), budget);
        self.refused = true;
        let mut trailers = http::HeaderMap::new();
        Poll::Ready(Some(match status.add_header(&mut trailers) {
            Ok(()) => Ok(Frame::trailers(trailers)),
            Err(e) => Err(e),
        }))
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

//! Point-to-point links: the building block of drivers whose connections
//! are independent.
//!
//! A [`Transport`] moves *frames* (a 32-byte [`wire::Header`](starwire_wire::Header)
//! followed by its body) between two endpoints, reliably and in order. It
//! is poll-mode: nothing blocks, nothing reads the clock, and progress happens
//! only inside [`Transport::flush`] and [`Transport::rx_burst`], which its
//! driver calls with `now`.
//!
//! The contract every backend implements is the per-core
//! [`Driver`](crate::Driver). A TCP socket is a link of its own, so the TCP
//! driver is [`Links`](crate::Links) of [`Transport`]s, as are the
//! in-memory and fault-injecting links of tests; the io_uring, RDMA and
//! datagram drivers own their per-core queue and keep per-connection state
//! of their own instead.
//!
//! Buffers are lent, not copied: [`Transport::tx_reserve`] lends a piece of
//! the link's own transmit memory and the codec encodes the frame into it in
//! place; [`Transport::rx_burst`] lends each received frame to a sink for
//! the duration of a call, so decoders borrow it without a copy.

use std::time::Instant;

use bytes::Bytes;
use starwire_wire::FrameError;
use thiserror::Error;

/// A backend failure. Every variant ends the connection: pending requests are
/// failed by the message layer and reconnecting is explicit.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// A framing error: the peer sent bytes that are not a valid frame.
    #[error("framing error: {0}")]
    Frame(#[from] FrameError),
    /// An operating-system error.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A frame larger than the backend can carry was offered.
    #[error("frame of {len} bytes exceeds the backend maximum of {max}")]
    FrameTooLarge {
        /// Offered length.
        len: usize,
        /// Backend maximum.
        max: usize,
    },
    /// The peer stopped acknowledging (reliability core) or the link broke.
    #[error("link failure: {0}")]
    Link(String),
}

/// The backend layer. See the module documentation.
pub trait Transport {
    /// The largest frame (header included) the backend carries as one unit.
    /// Longer messages are chunked by the message layer.
    fn max_frame_len(&self) -> usize;

    /// Lend `len` bytes of transmit buffer to encode one frame in place.
    ///
    /// Returns `Ok(None)` when the backend has no room right now
    /// (back-pressure): call [`flush`](Self::flush) and retry later; nothing
    /// is lost. A reservation is completed by [`tx_commit`](Self::tx_commit);
    /// reserving again without committing abandons the earlier reservation.
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError>;

    /// Commit the frame written into the last reservation; `len` is at most
    /// the reserved length.
    fn tx_commit(&mut self, len: usize);

    /// Queue one frame made of `head` followed by the owned `segs`. Backends
    /// that can (TCP) keep the segments and write them with a vectored
    /// write, without copying; the default copies into a reservation.
    /// Returns `Ok(false)` under back-pressure.
    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        let len = gather_len(head, segs);
        let Some(buf) = self.tx_reserve(len)? else {
            return Ok(false);
        };
        copy_gather(buf, head, segs);
        self.tx_commit(len);
        Ok(true)
    }

    /// Hand everything queued to the wire: one system call or doorbell per
    /// call where the backend allows. Also drives the backend's own timers
    /// (retransmission) with `now`.
    fn flush(&mut self, now: Instant) -> Result<(), TransportError>;

    /// Lend up to `max` received frames to `sink`, in order, each valid only
    /// for the duration of its call. Returns how many were delivered.
    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError>;

    /// True while frames are queued that have not been handed to the wire
    /// (or, for reliable-datagram backends, not yet acknowledged).
    fn tx_pending(&self) -> bool;

    /// The earliest instant at which the backend needs a call even if no
    /// traffic arrives (a retransmission timer), if any.
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }
}

/// The length of a frame made of `head` followed by `segs`.
pub(crate) fn gather_len(head: &[u8], segs: &[Bytes]) -> usize {
    head.len() + segs.iter().map(Bytes::len).sum::<usize>()
}

/// Copy `head` and then `segs` to the front of `buf`, which holds at
/// least [`gather_len`] bytes: the gather of backends that cannot keep the
/// segments.
pub(crate) fn copy_gather(buf: &mut [u8], head: &[u8], segs: &[Bytes]) {
    buf[..head.len()].copy_from_slice(head);
    let mut at = head.len();
    for s in segs {
        buf[at..at + s.len()].copy_from_slice(s);
        at += s.len();
    }
}

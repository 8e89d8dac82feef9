//! [`UringTransport`]: one connection bound to a [`Ring`].
// The transmit slots a connection's stage fills come from `RingInner::refill`,
// whose contract this module keeps (see the `unsafe` blocks).
#![allow(unsafe_code)]

use std::net::TcpStream;
use std::time::Instant;

use bytes::Bytes;
use starwire_transport::{DrivenTransport, Transport, TransportError};

use crate::ring::{ConnStats, Ring};
use crate::stage::{Reserve, StageLimits, TxStage};
use crate::{UringConfig, UringError};

/// A starwire [`Transport`] over one TCP connection driven through a
/// [`Ring`]. See the crate documentation.
#[derive(Debug)]
pub struct UringTransport {
    /// Frames written since the last flush (see the `stage` module). Its
    /// fill points into the ring's pool: declared before the ring, so it
    /// is dropped first.
    stage: TxStage,
    idx: usize,
    max_frame_len: usize,
    auto_enter: bool,
    ring: Ring,
}

impl UringTransport {
    /// Bind a connected stream to `ring` and arm its receive. The
    /// stream is used only through the ring from now on.
    pub fn new(ring: &Ring, stream: TcpStream) -> Result<Self, UringError> {
        stream
            .set_nodelay(true)
            .map_err(|source| UringError::Setup {
                what: "TCP_NODELAY",
                source,
            })?;
        let loopback_send_buffer = ring.lock().cfg.loopback_send_buffer;
        if let Some(n) = loopback_send_buffer {
            starwire_transport::socket::cap_loopback_send_buffer(&stream, n).map_err(|source| {
                UringError::Setup {
                    what: "SO_SNDBUF",
                    source,
                }
            })?;
        }
        let (idx, cfg) = {
            let mut r = ring.lock();
            let idx = r.add_conn(stream);
            (idx, r.cfg.clone())
        };
        Ok(Self {
            stage: TxStage::new(StageLimits {
                max_frame_len: cfg.max_frame_len,
                slot_len: cfg.slot_len(),
                queue_limit: cfg.tx_queue_limit_bytes,
                gather_copy_threshold: cfg.gather_copy_threshold,
            }),
            idx,
            max_frame_len: cfg.max_frame_len,
            auto_enter: cfg.auto_enter,
            ring: ring.clone(),
        })
    }

    /// A transport with a ring of its own that enters by itself
    /// (`auto_enter`), e.g. for tests.
    pub fn standalone(stream: TcpStream, cfg: &UringConfig) -> Result<Self, UringError> {
        let cfg = UringConfig {
            auto_enter: true,
            ..cfg.clone()
        };
        let r = Ring::new(&cfg)?;
        Self::new(&r, stream)
    }

    /// The ring this connection is bound to.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Counters of this connection.
    pub fn stats(&self) -> ConnStats {
        self.ring.lock().conn_stats(self.idx)
    }
}

impl Drop for UringTransport {
    fn drop(&mut self) {
        let mut r = self.ring.lock();
        r.remove_conn(self.idx, self.stage.fill());
        if self.auto_enter {
            let _ = r.enter();
            r.reap();
        }
    }
}

impl DrivenTransport for UringTransport {
    /// The ring's park descriptor (see [`Ring::fd`]).
    fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.ring.fd()
    }
    /// The ring's one `io_uring_enter` of the turn. An error surfaces on
    /// the connections' next calls; it counts as work here.
    fn end_turn(&self) -> bool {
        self.ring.enter().unwrap_or(true)
    }
    /// The ring: every connection bound to one reactor shares it.
    fn driver_key(&self) -> Option<usize> {
        Some(self.ring.key())
    }
    /// A park in the ring (see [`Ring::park`]).
    fn park(
        &self,
        waker: starwire_transport::reactor::ParkWaker<'_>,
        timeout: std::time::Duration,
    ) -> Option<starwire_transport::reactor::ParkEnd> {
        self.ring.park(waker, timeout)
    }
}

impl Transport for UringTransport {
    fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Lends `len` bytes of a registered transmit slot (or of heap memory,
    /// for a frame longer than a slot). `Ok(None)` when the connection
    /// holds [`UringConfig::tx_slots_per_conn`] slots, the ring's pool is
    /// empty, or (for a long frame) the bytes waiting to be sent are at
    /// [`UringConfig::tx_queue_limit_bytes`]. The ring's lock is taken only
    /// when a new slot is needed.
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        // Twice at most: a new slot has room for any frame that fits one.
        for _ in 0..2 {
            match self.stage.reserve(len)? {
                // Borrowed from the stage, so from `self`: the range is this
                // connection's alone until it is committed and handed over.
                Reserve::Lent => return Ok(self.stage.lent()),
                Reserve::Full => return Ok(None),
                Reserve::NeedSlot => {
                    let mut r = self.ring.lock();
                    // SAFETY: `self.stage` is the stage of connection
                    // `self.idx`, hands its pieces to this ring only
                    // (`flush`, `rx_burst`, `Drop`), and is dropped before
                    // `self.ring`, the ring's `Arc`, beside it.
                    if !unsafe { r.refill(self.idx, &mut self.stage) }? {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(None)
    }

    /// # Panics
    /// Without an outstanding reservation, or when `len` exceeds it.
    fn tx_commit(&mut self, len: usize) {
        self.stage.commit(len);
    }

    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        for _ in 0..2 {
            match self.stage.gather(head, segs)? {
                Some(done) => return Ok(done),
                None => {
                    let mut r = self.ring.lock();
                    // SAFETY: as in `tx_reserve`: this connection's stage,
                    // dropped before the ring's `Arc` beside it.
                    if !unsafe { r.refill(self.idx, &mut self.stage) }? {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(false)
    }

    /// Hands what was written to the ring and queues one send SQE for
    /// everything queued (unless a send is in flight); with `auto_enter`,
    /// also enters the ring.
    fn flush(&mut self, _now: Instant) -> Result<(), TransportError> {
        let mut r = self.ring.lock();
        r.flush(self.idx, &mut self.stage)?;
        if self.auto_enter {
            r.enter().map_err(TransportError::Io)?;
            r.reap();
            r.update_view(self.idx, &mut self.stage);
        }
        Ok(())
    }

    /// Reaps completions (entering first with `auto_enter`) and lends up to
    /// `max` frames in place.
    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        if max == 0 {
            return Ok(0);
        }
        let mut r = self.ring.lock();
        r.reap();
        if self.auto_enter {
            // Also with frames buffered: a receive queued again by the last
            // `rx_burst` (single receives, or after a direct one) waits in
            // the SQ for an enter, and a caller with nothing to send makes
            // no other. `enter` makes no system call when nothing waits.
            r.enter().map_err(TransportError::Io)?;
            r.reap();
        }
        // Sends completed since the last turn: tell the stage; and take
        // back a kept slot that saw no frame since the last turn.
        r.update_view(self.idx, &mut self.stage);
        r.release_idle_fill(self.idx, &mut self.stage);
        r.rx_burst(self.idx, max, sink)
    }

    /// Frames staged here, or bytes queued or in flight in the ring as of
    /// the last `rx_burst` or `flush` (which refresh that view); no lock.
    fn tx_pending(&self) -> bool {
        self.stage.pending()
    }
}

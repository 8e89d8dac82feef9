//! [`UringDriver`]: one io_uring ring and every connection of a reactor.

use std::cell::RefCell;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_transport::reactor::{ParkEnd, ParkWaker};
use starwire_transport::{ConnId, Driver, DriverCounters, Sleep, StreamDriver, TransportError};

use crate::probe::Features;
use crate::ring::{ConnStats, Ring};
use crate::stage::Reserve;
use crate::{UringConfig, UringError, UringStats};

/// The io_uring driver of one reactor: one ring, its registered pools, and
/// every connection attached to it. See the crate documentation.
///
/// A turn is [`rx_burst`](Driver::rx_burst) (reap, then one receive pass
/// over every connection) and [`flush`](Driver::flush) (hand every
/// connection's staged frames to the ring, then one `io_uring_enter` for
/// all of them). The driver is `Send`, to be made on one thread and run
/// on another, but not `Sync`: the ring is single-issuer, so the thread of
/// its first turn is the only one that may use it from then on.
pub struct UringDriver {
    /// The ring and every connection's state. Every `&mut self` call
    /// reaches it with `RefCell::get_mut`, which checks nothing at run
    /// time; the cell is there for the few `&self` calls of the contract
    /// that must change it ([`Driver::wake_fds`] arms the ring for a
    /// `poll(2)` park) or read it (counters, `tx_pending`). None of them
    /// calls out while borrowing it, so a borrow never fails.
    ring: RefCell<Ring>,
    /// What a reactor parked in `poll(2)` waits on: the registered eventfd
    /// of a `DEFER_TASKRUN` ring, else a duplicate of the ring fd. Closed
    /// after the ring (field order), which may still signal it.
    park_fd: OwnedFd,
    cfg: UringConfig,
    parks_in_ring: bool,
}

impl std::fmt::Debug for UringDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringDriver")
            .field("park_fd", &self.park_fd)
            .field("parks_in_ring", &self.parks_in_ring)
            .finish_non_exhaustive()
    }
}

impl UringDriver {
    /// Set up a ring, its buffer pools and their registration, after
    /// probing the kernel and checking `RLIMIT_MEMLOCK`. The ring is
    /// enabled by the first turn (or park), on the thread that runs it.
    pub fn new(cfg: &UringConfig) -> Result<Self, UringError> {
        let (ring, park_fd) = Ring::new(cfg)?;
        Ok(Self {
            parks_in_ring: ring.parks_in_ring(),
            ring: RefCell::new(ring),
            park_fd,
            cfg: cfg.clone(),
        })
    }

    /// Counters of the ring.
    pub fn stats(&self) -> UringStats {
        self.ring.borrow().stats.clone()
    }

    /// Counters of connection `conn`, while it is attached.
    pub fn conn_stats(&self, conn: ConnId) -> Option<ConnStats> {
        self.ring.borrow().attached(conn.index()).map(|c| c.stats)
    }

    /// What the kernel offered when the ring was made.
    pub fn features(&self) -> Features {
        self.ring.borrow().features.clone()
    }

    /// The configuration of the ring.
    pub fn config(&self) -> &UringConfig {
        &self.cfg
    }

    #[cfg(test)]
    pub(crate) fn ring_mut(&mut self) -> &mut Ring {
        self.ring.get_mut()
    }

    /// The ring while `&self` is lent out (to `wake_fds`'s descriptors).
    #[cfg(test)]
    pub(crate) fn ring_shared(&self) -> std::cell::RefMut<'_, Ring> {
        self.ring.borrow_mut()
    }
}

/// The error of a call on a connection that is not attached, or failed.
fn gone() -> TransportError {
    TransportError::Closed
}

impl Driver for UringDriver {
    fn max_frame_len(&self) -> usize {
        self.cfg.max_frame_len
    }

    /// `io_uring_enter` calls and the eventfd drains that fell back to
    /// `read(2)`.
    fn counters(&self) -> DriverCounters {
        let ring = self.ring.borrow();
        DriverCounters {
            syscalls: Some(ring.stats.enters + ring.stats.eventfd_read_syscalls),
            ..DriverCounters::default()
        }
    }

    /// Lends `len` bytes of a registered transmit slot (or of heap memory,
    /// for a frame longer than a slot). `Ok(None)` when the connection
    /// holds [`UringConfig::tx_slots_per_conn`] slots, the ring's pool is
    /// empty, or (for a long frame) the bytes waiting to be sent are at
    /// [`UringConfig::tx_queue_limit_bytes`].
    fn tx_reserve(
        &mut self,
        conn: ConnId,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransportError> {
        let r = self.ring.get_mut();
        let idx = conn.index();
        // Twice at most: a new slot has room for any frame that fits one.
        for _ in 0..2 {
            let reserved = r.live_mut(idx).ok_or_else(gone)?.stage.reserve(len)?;
            match reserved {
                // Borrowed from the stage, so from `self`: the range is this
                // connection's alone until it is committed and handed over.
                Reserve::Lent => return Ok(r.live_mut(idx).and_then(|c| c.stage.lent())),
                Reserve::Full => return Ok(None),
                Reserve::NeedSlot => {
                    if !r.refill(idx)? {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(None)
    }

    /// # Panics
    /// Without an outstanding reservation on `conn`, or when `len` exceeds
    /// it.
    fn tx_commit(&mut self, conn: ConnId, len: usize) {
        if let Some(c) = self.ring.get_mut().live_mut(conn.index()) {
            c.stage.commit(len);
        }
    }

    fn tx_gather(
        &mut self,
        conn: ConnId,
        head: &[u8],
        segs: &[Bytes],
    ) -> Result<bool, TransportError> {
        let r = self.ring.get_mut();
        let idx = conn.index();
        for _ in 0..2 {
            match r.live_mut(idx).ok_or_else(gone)?.stage.gather(head, segs)? {
                Some(done) => return Ok(done),
                None => {
                    if !r.refill(idx)? {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(false)
    }

    /// Frames staged on `conn`, or bytes queued or in flight in the ring
    /// as of the last receive pass or flush (which refresh the stage's
    /// view).
    fn tx_pending(&self, conn: ConnId) -> bool {
        self.ring
            .borrow()
            .attached(conn.index())
            .is_some_and(|c| c.stage.pending())
    }

    /// Reaps completions, then lends up to `max` frames of each connection
    /// in place.
    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(ConnId, &[u8]),
    ) -> usize {
        if max == 0 {
            return 0;
        }
        let r = self.ring.get_mut();
        r.reap();
        let mut delivered = 0;
        for idx in 0..r.conns_len() {
            if r.live_mut(idx).is_none() {
                continue;
            }
            // Sends completed since the last turn: tell the stage; and take
            // back a kept slot that saw no frame since the last turn.
            r.update_view(idx);
            r.release_idle_fill(idx);
            let id = ConnId::new(idx as u32);
            match r.rx_burst(idx, max, &mut |f: &[u8]| sink(id, f)) {
                Ok(n) => delivered += n,
                Err(e) => r.fail(idx, e),
            }
        }
        delivered
    }

    /// Hands every connection's staged frames over (one send SQE per
    /// connection with bytes to send and none in flight), then makes the
    /// turn's one `io_uring_enter` and reaps. An enter that fails counts
    /// as work, so the next turn comes at once and tries again.
    fn flush(&mut self, _now: Instant) -> bool {
        let r = self.ring.get_mut();
        for idx in 0..r.conns_len() {
            let Some(c) = r.live_mut(idx) else {
                continue;
            };
            if !c.stage.pending() && !c.stage.has_staged() {
                continue;
            }
            if let Err(e) = r.flush(idx) {
                r.fail(idx, e);
            }
        }
        r.end_turn().unwrap_or_else(|e| {
            tracing::debug!(error = %e, "uring: io_uring_enter failed");
            true
        })
    }

    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        self.ring.get_mut().poll_failure()
    }

    /// Shuts the socket down and cancels what the kernel holds of `conn`;
    /// its memory goes once the kernel gave everything back, and its
    /// handle may be reused from then on.
    fn detach(&mut self, conn: ConnId) {
        self.ring.get_mut().remove_conn(conn.index());
    }

    /// [`Sleep::Own`] when the ring defers its completion work
    /// (`DEFER_TASKRUN`, no SQPOLL): only a reactor waiting in
    /// `io_uring_enter` runs it. Else [`Sleep::Fds`] on the ring's
    /// descriptor.
    fn sleep(&self) -> Sleep {
        if self.parks_in_ring {
            Sleep::Own
        } else {
            Sleep::Fds
        }
    }

    /// The park descriptor, armed: receives completed since the last turn
    /// queued again (spin mode: a readability poll per connection) and
    /// submitted, and a `DEFER_TASKRUN` ring's eventfd enabled until the
    /// next turn. Also what a reactor polls when [`park`](Driver::park)
    /// could not be made.
    fn wake_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        self.ring
            .borrow_mut()
            .prepare_poll_park(self.park_fd.as_fd());
        out.push(self.park_fd.as_fd());
    }

    /// One `io_uring_enter` that submits what waits (with a readability
    /// poll of `waker`), sleeps until a completion or `timeout`, and runs
    /// the completions' deferred work; then reaps. `None` on a ring that
    /// does not park in itself ([`Sleep::Fds`]) or when the enter failed.
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        self.ring.get_mut().park(waker, timeout)
    }
}

impl StreamDriver for UringDriver {
    /// Sets `TCP_NODELAY` (and the loopback send-buffer cap,
    /// [`UringConfig::loopback_send_buffer`]), then serves the stream
    /// through the ring only; its receive is queued for the next turn.
    fn attach_stream(&mut self, stream: TcpStream) -> Result<ConnId, TransportError> {
        stream.set_nodelay(true)?;
        if let Some(n) = self.cfg.loopback_send_buffer {
            starwire_transport::socket::cap_loopback_send_buffer(&stream, n)?;
        }
        let idx = self.ring.get_mut().add_conn(stream)?;
        Ok(ConnId::new(idx as u32))
    }
}

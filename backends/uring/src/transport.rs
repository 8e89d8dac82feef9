//! [`UringTransport`]: one connection bound to a [`UringReactor`].

use std::net::TcpStream;
use std::time::Instant;

use bytes::Bytes;
use starwire_transport::{DrivenTransport, Transport, TransportError};

use crate::ring::{ConnStats, UringReactor};
use crate::{UringConfig, UringError};

/// A starwire [`Transport`] over one TCP connection driven through the
/// ring of a [`UringReactor`]. See the crate documentation.
#[derive(Debug)]
pub struct UringTransport {
    reactor: UringReactor,
    idx: usize,
    max_frame_len: usize,
    auto_enter: bool,
}

impl UringTransport {
    /// Bind a connected stream to `reactor` and arm its receive. The
    /// stream is used only through the ring from now on.
    pub fn new(reactor: &UringReactor, stream: TcpStream) -> Result<Self, UringError> {
        stream
            .set_nodelay(true)
            .map_err(|source| UringError::Setup {
                what: "TCP_NODELAY",
                source,
            })?;
        let loopback_send_buffer = reactor.lock().cfg.loopback_send_buffer;
        if let Some(n) = loopback_send_buffer {
            starwire_transport::socket::cap_loopback_send_buffer(&stream, n).map_err(|source| {
                UringError::Setup {
                    what: "SO_SNDBUF",
                    source,
                }
            })?;
        }
        let (idx, max_frame_len, auto_enter) = {
            let mut r = reactor.lock();
            let idx = r.add_conn(stream);
            (idx, r.cfg.max_frame_len, r.cfg.auto_enter)
        };
        Ok(Self {
            reactor: reactor.clone(),
            idx,
            max_frame_len,
            auto_enter,
        })
    }

    /// A transport with a ring of its own that enters by itself
    /// (`auto_enter`), e.g. for tests.
    pub fn standalone(stream: TcpStream, cfg: &UringConfig) -> Result<Self, UringError> {
        let cfg = UringConfig {
            auto_enter: true,
            ..cfg.clone()
        };
        let r = UringReactor::new(&cfg)?;
        Self::new(&r, stream)
    }

    /// The reactor (ring) this connection is bound to.
    pub fn reactor(&self) -> &UringReactor {
        &self.reactor
    }

    /// Counters of this connection.
    pub fn stats(&self) -> ConnStats {
        self.reactor.lock().conn_stats(self.idx)
    }
}

impl Drop for UringTransport {
    fn drop(&mut self) {
        let mut r = self.reactor.lock();
        r.remove_conn(self.idx);
        if self.auto_enter {
            let _ = r.enter();
            r.reap();
        }
    }
}

impl DrivenTransport for UringTransport {
    /// The ring's park descriptor (see [`UringReactor::fd`]).
    fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.reactor.fd()
    }
    /// The ring's one `io_uring_enter` of the turn. An error surfaces on
    /// the connections' next calls; it counts as work here.
    fn end_turn(&self) -> bool {
        self.reactor.enter().unwrap_or(true)
    }
}

impl Transport for UringTransport {
    fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Lends `len` bytes of a registered transmit slot. `Ok(None)` when the
    /// connection holds [`UringConfig::tx_slots_per_conn`] slots or the
    /// ring's pool is empty.
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        let got = self.reactor.lock().tx_reserve(self.idx, len)?;
        // The slot range is this connection's alone until it is committed
        // and queued, and `&mut self` keeps it so for the borrow.
        Ok(got.map(|(ptr, len)| crate::sys::lend_slot(ptr, len)))
    }

    /// # Panics
    /// Without an outstanding reservation, or when `len` exceeds it.
    fn tx_commit(&mut self, len: usize) {
        self.reactor.lock().tx_commit(self.idx, len);
    }

    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        self.reactor.lock().tx_gather(self.idx, head, segs)
    }

    /// Queues one send SQE for everything queued (unless a send is in
    /// flight); with `auto_enter`, also enters the ring.
    fn flush(&mut self, _now: Instant) -> Result<(), TransportError> {
        let mut r = self.reactor.lock();
        r.flush(self.idx)?;
        if self.auto_enter {
            r.enter().map_err(TransportError::Io)?;
            r.reap();
        }
        Ok(())
    }

    /// Reaps completions (entering first with `auto_enter` when nothing is
    /// buffered) and lends up to `max` frames in place.
    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        if max == 0 {
            return Ok(0);
        }
        let mut r = self.reactor.lock();
        r.reap();
        if self.auto_enter && !r.rx_buffered(self.idx) {
            r.enter().map_err(TransportError::Io)?;
            r.reap();
        }
        r.rx_burst(self.idx, max, sink)
    }

    fn tx_pending(&self) -> bool {
        self.reactor.lock().tx_pending(self.idx)
    }
}

//! TCP backend for starwire (non-blocking sockets, vectored writes).
//!
//! [`TcpTransport`] implements [`starwire_transport::Transport`] over a
//! non-blocking [`std::net::TcpStream`] with `TCP_NODELAY`:
//!
//! * **TX**: [`tx_reserve`](Transport::tx_reserve) lends space in an owned
//!   staging buffer; [`tx_gather`](Transport::tx_gather) keeps `Bytes`
//!   segments by reference (zero copy; heads and small segments are copied
//!   into the staging buffer). The queue is bounded by
//!   [`TcpConfig::tx_queue_limit_bytes`]: beyond it `tx_reserve` returns
//!   `Ok(None)` and `tx_gather` `Ok(false)`; nothing is dropped.
//!   [`flush`](Transport::flush) hands everything to the kernel with one
//!   vectored write (`sendmsg`, up to [`MAX_IOVECS`] slices); it writes again
//!   only while the kernel accepted everything offered and more is queued.
//! * **RX**: [`rx_burst`](Transport::rx_burst) issues at most one `read` per
//!   call, and only when the buffer holds no complete frame; frames are
//!   found, every header validated, by [`Deframer`] and lent in place. The
//!   receive buffer is allocated once ([`TcpConfig::rx_buffer_len`]) and
//!   never grows.
//!
//! Connections come from [`TcpTransport::connect`], [`TcpTransport::new`]
//! (an already connected stream) or [`TcpAcceptor::poll_accept`].
//!
//! User documentation: `docs/backends/tcp.md`.
#![deny(unsafe_code)]

mod config;
mod ready;
mod rx;
mod tx;

use std::io::{self, IoSlice, Read};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Instant;

use bytes::Bytes;
use socket2::{Domain, Protocol, SockRef, Socket, Type};
use starwire_transport::{
    ConnId, Driver, DriverCounters, Link, Links, Sleep, StreamDriver, Transport, TransportError,
};
use starwire_wire::Deframer;

pub use config::{
    ConfigError, TcpConfig, DEFAULT_GATHER_COPY_THRESHOLD, DEFAULT_LOOPBACK_SEND_BUFFER,
    DEFAULT_MAX_FRAME_LEN, DEFAULT_MAX_MESSAGE_LEN, DEFAULT_RX_BUFFER_LEN,
    DEFAULT_TX_QUEUE_LIMIT_BYTES,
};
pub use ready::READY_LIST_FROM;
pub use tx::MAX_IOVECS;

use ready::Ready;
use rx::RxBuffer;
use tx::TxQueue;

/// System-call counters of one connection, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Vectored write calls made by [`Transport::flush`] (including ones that
    /// would block).
    pub write_calls: u64,
    /// Read calls made by [`Transport::rx_burst`] (including ones that would
    /// block).
    pub read_calls: u64,
    /// Bytes handed to the kernel.
    pub bytes_written: u64,
    /// Bytes received from the kernel.
    pub bytes_read: u64,
}

/// A starwire [`Transport`] over one TCP connection. See the crate
/// documentation.
#[derive(Debug)]
pub struct TcpTransport {
    stream: TcpStream,
    config: TcpConfig,
    tx: TxQueue,
    rx: RxBuffer,
    stats: TcpStats,
}

fn invalid_config(e: ConfigError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

/// Apply the socket buffer sizes of `config`.
fn apply_buffer_sizes(sock: &SockRef<'_>, config: &TcpConfig) -> io::Result<()> {
    if let Some(n) = config.socket_send_buffer {
        sock.set_send_buffer_size(n)?;
    }
    if let Some(n) = config.socket_recv_buffer {
        sock.set_recv_buffer_size(n)?;
    }
    Ok(())
}

impl TcpTransport {
    /// Wrap a connected stream: makes it non-blocking, sets `TCP_NODELAY`
    /// and the configured socket buffer sizes, and allocates the receive
    /// buffer.
    ///
    /// # Errors
    /// `InvalidInput` (carrying a [`ConfigError`]) for an inconsistent
    /// config, or the error of a socket option.
    pub fn new(stream: TcpStream, config: TcpConfig) -> io::Result<Self> {
        config.validate().map_err(invalid_config)?;
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        apply_buffer_sizes(&SockRef::from(&stream), &config)?;
        if let (None, Some(n)) = (config.socket_send_buffer, config.loopback_send_buffer) {
            starwire_transport::socket::cap_loopback_send_buffer(&stream, n)?;
        }
        Ok(Self {
            stream,
            tx: TxQueue::new(
                config.tx_queue_limit_bytes,
                config.max_frame_len,
                config.gather_copy_threshold,
            ),
            rx: RxBuffer::new(config.rx_buffer_len, Deframer::new(config.limits())),
            config,
            stats: TcpStats::default(),
        })
    }

    /// Connect (blocking) to the first address of `addr` that accepts, then
    /// switch to non-blocking mode. Socket buffer sizes are set before
    /// connecting.
    pub fn connect<A: ToSocketAddrs>(addr: A, config: TcpConfig) -> io::Result<Self> {
        config.validate().map_err(invalid_config)?;
        let mut last = None;
        for addr in addr.to_socket_addrs()? {
            match connect_one(addr, &config) {
                Ok(stream) => return Self::new(stream, config),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to")
        }))
    }

    /// The configuration in force.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }

    /// The underlying stream, e.g. to register its descriptor with a poller
    /// or to read socket options. Do not read from or write to it.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.stream.local_addr()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.stream.peer_addr()
    }

    /// System-call counters.
    pub fn stats(&self) -> TcpStats {
        self.stats
    }

    /// Bytes queued for sending and not yet accepted by the kernel.
    pub fn tx_queued_bytes(&self) -> usize {
        self.tx.queued()
    }

    /// Slices the next vectored write would carry (before the
    /// [`MAX_IOVECS`] cap).
    pub fn tx_queued_chunks(&self) -> usize {
        self.tx.chunks()
    }

    /// Allocated staging memory of the send queue; never above
    /// [`TcpConfig::tx_queue_limit_bytes`].
    pub fn tx_buffer_capacity(&self) -> usize {
        self.tx.stage_capacity()
    }

    /// Received bytes not yet delivered (at most one incomplete frame, plus
    /// complete frames left over when `max` was reached).
    pub fn rx_buffered_bytes(&self) -> usize {
        self.rx.buffered()
    }

    /// Allocated receive memory; equals [`TcpConfig::rx_buffer_len`] for the
    /// life of the connection.
    pub fn rx_buffer_capacity(&self) -> usize {
        self.rx.capacity()
    }
}

fn connect_one(addr: SocketAddr, config: &TcpConfig) -> io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    apply_buffer_sizes(&SockRef::from(&socket), config)?;
    socket.connect(&addr.into())?;
    Ok(socket.into())
}

/// One vectored write that never raises `SIGPIPE`: `sendmsg` with
/// `MSG_NOSIGNAL` (a `writev` with a flag), so a dead peer is an `EPIPE`
/// error rather than a signal that kills the process.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn send_vectored(stream: &TcpStream, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    SockRef::from(stream).send_vectored_with_flags(iov, libc::MSG_NOSIGNAL)
}

/// One vectored write (`writev`).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn send_vectored(stream: &TcpStream, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    use std::io::Write;
    (&*stream).write_vectored(iov)
}

/// Map a write error: a peer that went away is [`TransportError::Closed`].
fn write_error(e: io::Error) -> TransportError {
    match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::NotConnected
        | io::ErrorKind::WriteZero => {
            tracing::debug!(error = %e, "tcp: peer gone while writing");
            TransportError::Closed
        }
        _ => TransportError::Io(e),
    }
}

/// A [`TcpDriver`] parks in `poll(2)` on its sockets.
impl Link for TcpTransport {
    fn read_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.stream.as_fd())
    }
    /// The socket while the kernel refused queued bytes (its send buffer
    /// was full); `None` with nothing queued.
    fn write_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.tx_pending().then(|| self.stream.as_fd())
    }
}

/// The TCP driver of one reactor: its connections' sockets, each a
/// [`TcpTransport`] made with the driver's [`TcpConfig`]. A receive pass
/// reads each socket at most once, a submission writes each socket with
/// bytes queued once (TCP has no per-core queue to batch into), and an
/// idle reactor parks in `poll(2)`. With [`READY_LIST_FROM`] connections
/// or more, the sockets are in an epoll set: a pass reads only the ones
/// it names (and those that left frames in their buffer), and a park
/// polls the set's descriptor rather than every socket.
#[derive(Debug)]
pub struct TcpDriver {
    links: Links<TcpTransport>,
    config: TcpConfig,
    ready: Ready,
}

impl TcpDriver {
    /// A driver with no connections; each attached stream gets `config`.
    ///
    /// # Errors
    /// `InvalidInput` (carrying a [`ConfigError`]) for an inconsistent config.
    pub fn new(config: TcpConfig) -> io::Result<Self> {
        config.validate().map_err(invalid_config)?;
        Ok(Self {
            links: Links::new(config.max_frame_len),
            config,
            ready: Ready::new(),
        })
    }

    /// Attach an already made transport (its config may differ from the
    /// driver's, but must carry frames of the driver's maximum).
    pub fn attach(&mut self, t: TcpTransport) -> ConnId {
        use std::os::fd::AsFd;
        let id = self.links.attach(t);
        if let Some(t) = self.links.link(id) {
            self.ready.attached(id, t.stream.as_fd());
        }
        if !self.ready.is_active() && self.links.len() >= READY_LIST_FROM {
            let links = self.links.iter().map(|(c, t)| (c, t.stream.as_fd()));
            self.ready.activate(links);
        }
        id
    }

    /// The connection behind `conn`, for its counters.
    pub fn transport(&self, conn: ConnId) -> Option<&TcpTransport> {
        self.links.link(conn)
    }

    /// The connections and their handles.
    pub fn transports(&self) -> impl Iterator<Item = (ConnId, &TcpTransport)> {
        self.links.iter()
    }

    /// How many connections are attached.
    pub fn len(&self) -> usize {
        self.links.len()
    }

    /// True when no connection is attached.
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }
}

impl StreamDriver for TcpDriver {
    fn attach_stream(&mut self, stream: TcpStream) -> Result<ConnId, TransportError> {
        let t = TcpTransport::new(stream, self.config)?;
        Ok(self.attach(t))
    }
}

impl Driver for TcpDriver {
    fn max_frame_len(&self) -> usize {
        self.links.max_frame_len()
    }
    /// Read and write calls of the connections still attached.
    fn counters(&self) -> DriverCounters {
        let syscalls = self
            .transports()
            .map(|(_, t)| {
                let s = t.stats();
                s.read_calls + s.write_calls
            })
            .sum();
        DriverCounters {
            syscalls: Some(syscalls),
            ..DriverCounters::default()
        }
    }
    fn tx_reserve(
        &mut self,
        conn: ConnId,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransportError> {
        self.links.tx_reserve(conn, len)
    }
    fn tx_commit(&mut self, conn: ConnId, len: usize) {
        self.links.tx_commit(conn, len);
    }
    fn tx_gather(
        &mut self,
        conn: ConnId,
        head: &[u8],
        segs: &[Bytes],
    ) -> Result<bool, TransportError> {
        self.links.tx_gather(conn, head, segs)
    }
    fn tx_pending(&self, conn: ConnId) -> bool {
        self.links.tx_pending(conn)
    }
    fn rx_burst(&mut self, now: Instant, max: usize, sink: &mut dyn FnMut(ConnId, &[u8])) -> usize {
        use std::os::fd::AsFd;
        if !self.ready.uses_set(self.links.len()) {
            self.ready.scanning();
            return self.links.rx_burst(now, max, sink);
        }
        let visit = self.ready.collect(self.links.iter().map(|(c, _)| c));
        let mut delivered = 0;
        for &c in &visit {
            let got = self.links.rx_burst_one(c, now, max, sink);
            delivered += got;
            let live = self.links.is_live(c);
            match self.links.link(c) {
                Some(t) if live => {
                    if got >= max || t.rx.has_final() {
                        self.ready.read_again(c);
                    }
                }
                t => self.ready.remove(c, t.map(|t| t.stream.as_fd())),
            }
        }
        self.ready.done(visit);
        delivered
    }
    fn flush(&mut self, now: Instant) -> bool {
        self.links.flush(now)
    }
    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        self.links.poll_failure()
    }
    fn detach(&mut self, conn: ConnId) {
        use std::os::fd::AsFd;
        let fd = self.links.link(conn).map(|t| t.stream.as_fd());
        self.ready.remove(conn, fd);
        self.links.detach(conn);
    }
    fn sleep(&self) -> Sleep {
        Sleep::Fds
    }
    /// The epoll set's descriptor when passes use it, else every socket.
    fn wake_fds<'a>(&'a self, out: &mut Vec<std::os::fd::BorrowedFd<'a>>) {
        match self.ready.fd() {
            Some(fd) if self.ready.uses_set(self.links.len()) => out.push(fd),
            _ => self.links.wake_fds(out),
        }
    }
    fn write_fds<'a>(&'a self, out: &mut Vec<std::os::fd::BorrowedFd<'a>>) {
        self.links.write_fds(out);
    }
}

impl Transport for TcpTransport {
    fn max_frame_len(&self) -> usize {
        self.config.max_frame_len
    }

    /// Lends `len` bytes at the end of the staging buffer. `Ok(None)` when
    /// the queued bytes plus `len` would exceed
    /// [`TcpConfig::tx_queue_limit_bytes`];
    /// [`TransportError::FrameTooLarge`] when `len` exceeds
    /// [`TcpConfig::max_frame_len`].
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.tx.reserve(len)
    }

    /// # Panics
    /// Without an outstanding reservation, or when `len` exceeds it.
    fn tx_commit(&mut self, len: usize) {
        self.tx.commit(len);
    }

    /// Queues `head` (copied) and `segs` (kept by reference unless at most
    /// [`TcpConfig::gather_copy_threshold`] bytes long) without copying the
    /// large segments. Abandons an outstanding reservation.
    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        self.tx.gather(head, segs)
    }

    /// One vectored write of up to [`MAX_IOVECS`] slices; repeated only while
    /// the kernel accepted everything offered and more is queued. Stops at
    /// `EAGAIN` or a short write. A peer that went away
    /// (`EPIPE`/`ECONNRESET`) is [`TransportError::Closed`].
    fn flush(&mut self, _now: Instant) -> Result<(), TransportError> {
        let stream = &self.stream;
        let stats = &mut self.stats;
        let written = self
            .tx
            .flush_with(|iov| {
                stats.write_calls += 1;
                send_vectored(stream, iov)
            })
            .map_err(write_error)?;
        stats.bytes_written += written as u64;
        Ok(())
    }

    /// Delivers buffered complete frames; when fewer than `max` were
    /// buffered, makes one `read` into the free tail of the buffer and
    /// delivers what completed. Each frame (header included) is lent in
    /// place.
    ///
    /// Errors: [`TransportError::Frame`] for a header that fails validation
    /// (including a body over [`TcpConfig::max_frame_len`]) or a stream that
    /// ends inside a frame; [`TransportError::Closed`] at end of stream or
    /// reset, once the complete frames before it are delivered. Both are
    /// final. Frames delivered before an error in the same call are
    /// reported with `Ok(n)` and the error comes on the next call.
    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let mut stream = &self.stream;
        let stats = &mut self.stats;
        self.rx.burst(max, sink, |buf| {
            stats.read_calls += 1;
            let n = stream.read(buf)?;
            stats.bytes_read += n as u64;
            Ok(n)
        })
    }

    fn tx_pending(&self) -> bool {
        !self.tx.is_empty()
    }
}

/// A non-blocking listener that yields [`TcpTransport`]s.
#[derive(Debug)]
pub struct TcpAcceptor {
    listener: TcpListener,
    config: TcpConfig,
}

impl TcpAcceptor {
    /// Bind and listen on `addr` (with `SO_REUSEADDR`) in non-blocking mode.
    /// `SO_RCVBUF`/`SO_SNDBUF` from `config` are set on the listener so
    /// accepted sockets inherit them before the handshake.
    pub fn bind(addr: SocketAddr, config: TcpConfig) -> io::Result<Self> {
        config.validate().map_err(invalid_config)?;
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        apply_buffer_sizes(&SockRef::from(&socket), &config)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Self::from_listener(socket.into(), config)
    }

    /// Use an existing listener; it is switched to non-blocking mode.
    pub fn from_listener(listener: TcpListener, config: TcpConfig) -> io::Result<Self> {
        config.validate().map_err(invalid_config)?;
        listener.set_nonblocking(true)?;
        Ok(Self { listener, config })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The configuration given to accepted connections.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }

    /// The underlying listener, e.g. to register it with a poller.
    pub fn listener(&self) -> &TcpListener {
        &self.listener
    }

    /// Accept one pending connection without blocking: `Ok(None)` when none
    /// is pending. Connections aborted before they were accepted are
    /// skipped.
    pub fn poll_accept(&self) -> io::Result<Option<TcpTransport>> {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => return TcpTransport::new(stream, self.config).map(Some),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

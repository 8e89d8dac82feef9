//! The bounded HTTP/1.1 server behind `--metrics-addr`.
//!
//! Written here on std, with httparse for the request head, rather than
//! taken whole from a crate. tiny_http 0.12, which served the endpoint
//! before, was checked and has none of the bounds a listener open to the
//! network needs: it reads a request line or header until its CRLF with
//! no cap, takes any number of headers, queues pipelined requests without
//! limit, spawns a thread per connection with no read or write timeout,
//! ends its accept loop for good on the first accept error (`EMFILE`),
//! and a response its client never reads blocks its one serving thread,
//! so that stopping it (unblock, then join) could hang for ever. hyper
//! bounds these, but it needs a tokio runtime, which the default build
//! does not have (tonic is behind the `grpc` feature). What is left to
//! write is small: one thread polls the listener and at most
//! [`Limits::max_connections`] non-blocking connections, each answered
//! once and closed.
//!
//! The bounds ([`Limits::DEFAULT`], docs/SECURITY.md):
//!
//! * at most 4 connections served at once; a connection past them is
//!   accepted, answered `503` if its socket takes the few bytes at once,
//!   and closed (rather than left in the kernel's backlog, where a scrape
//!   would wait behind silent sockets with no deadline of ours);
//! * a request head of at most 8 KiB and 32 headers (`431` beyond either),
//!   due within 5 s of the accept (a silent or trickling client is closed
//!   then, with a best-effort `408`);
//! * one request per connection, answered with `Connection: close`; bytes
//!   after the head (a body, pipelined requests) are never parsed;
//! * the answer written within 5 s (a client that does not read it is
//!   closed then), then up to 1 s to read the client's end of the stream
//!   (discarded) so that closing does not reset an answer still in
//!   flight.
//!
//! Nothing blocks: sockets are non-blocking and `poll(2)` waits at most
//! 100 ms between looks at the stop flag, so dropping the [`Server`]
//! returns within about that, whatever its clients do. Reads and writes
//! have no timeout of their own because they never wait; the deadlines
//! above are their timeouts.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

/// The longest request head (request line, headers, the blank line).
pub(crate) const MAX_HEAD: usize = 8 * 1024;
/// The most headers a request may have.
const MAX_HEADERS: usize = 32;
/// The longest wait in `poll(2)`, so the longest a stop waits for the loop.
const TICK: Duration = Duration::from_millis(100);
/// Connections accepted per turn of the loop, so that a flood of connects
/// does not keep the loop from the connections it serves.
const ACCEPTS_PER_TURN: usize = 64;
/// Reads per turn of a lingering connection (of [`SCRATCH`] bytes each).
const LINGER_READS_PER_TURN: usize = 16;
const SCRATCH: usize = 4096;

/// The bounds of a [`Server`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Connections served at once; those past it are closed at accept.
    pub max_connections: usize,
    /// From accept to the end of the request head.
    pub head_timeout: Duration,
    /// From the answer's first byte to its last.
    pub write_timeout: Duration,
    /// After the answer: reading the client's end before closing.
    pub linger: Duration,
}

impl Limits {
    pub(crate) const DEFAULT: Limits = Limits {
        max_connections: 4,
        head_timeout: Duration::from_secs(5),
        write_timeout: Duration::from_secs(5),
        linger: Duration::from_secs(1),
    };
}

/// An answer: the status, the content type and the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

pub(crate) const TEXT: &str = "text/plain; charset=utf-8";

impl Reply {
    pub(crate) fn text(status: u16, body: impl Into<String>) -> Self {
        Reply {
            status,
            content_type: TEXT,
            body: body.into(),
        }
    }
}

/// What answers a request: its method and target (the path with any
/// query, as sent).
pub(crate) type Route = dyn Fn(&str, &str) -> Reply + Send;

/// The running server; dropping it stops it (within about [`TICK`]) and
/// closes every connection it holds.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Serve `listener` from a thread named `name`, answering each request
    /// with `route`.
    pub(crate) fn start(
        listener: TcpListener,
        name: &str,
        limits: Limits,
        route: Box<Route>,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serve(&listener, &s, limits, &*route))?;
        Ok(Server {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The loop of the server's thread, until `stop`.
fn serve(listener: &TcpListener, stop: &AtomicBool, limits: Limits, route: &Route) {
    let mut conns: Vec<Conn> = Vec::with_capacity(limits.max_connections);
    // After an accept error other than a peer's (EMFILE, ENFILE, ENOBUFS),
    // the listener is left alone for a tick: it stays readable, and
    // polling it again at once would spin.
    let mut paused_until: Option<Instant> = None;
    let mut last_warned: Option<Instant> = None;
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        conns.retain_mut(|c| {
            if now < c.deadline {
                return true;
            }
            c.expire();
            false
        });
        if paused_until.is_some_and(|t| now >= t) {
            paused_until = None;
        }
        let wait = conns
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .fold(TICK, Duration::min)
            .max(Duration::from_millis(1));
        let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX);
        {
            let listen = if paused_until.is_none() {
                PollFlags::POLLIN
            } else {
                PollFlags::empty()
            };
            let mut fds = Vec::with_capacity(1 + conns.len());
            fds.push(PollFd::new(listener.as_fd(), listen));
            fds.extend(
                conns
                    .iter()
                    .map(|c| PollFd::new(c.stream.as_fd(), c.interest())),
            );
            match nix::poll::poll(&mut fds, PollTimeout::from(ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    tracing::warn!("metrics: poll: {e}");
                    std::thread::sleep(TICK);
                    continue;
                }
            }
        }
        // At most a few connections: each is tried, ready or not (a try
        // that would block costs one system call).
        let now = Instant::now();
        conns.retain_mut(|c| c.progress(now, limits, route));
        if paused_until.is_some() {
            continue;
        }
        for _ in 0..ACCEPTS_PER_TURN {
            match listener.accept() {
                Ok((stream, peer)) => {
                    if conns.len() >= limits.max_connections {
                        tracing::debug!(%peer, "metrics: {} connections served already; closing", conns.len());
                        refuse(stream, 503, "busy: try again\n");
                    } else if let Err(e) = stream.set_nonblocking(true) {
                        tracing::debug!(%peer, "metrics: {e}");
                    } else {
                        conns.push(Conn::new(stream, peer, now, limits));
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                // A peer that reset before its accept, or a signal.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::ConnectionAborted | ErrorKind::Interrupted
                    ) => {}
                Err(e) => {
                    let quiet = match last_warned {
                        Some(t) => now.duration_since(t) < Duration::from_secs(10),
                        None => false,
                    };
                    if !quiet {
                        tracing::warn!("metrics: accepting a connection: {e}; retrying");
                        last_warned = Some(now);
                    }
                    paused_until = Some(now + TICK);
                    break;
                }
            }
        }
    }
}

/// Write a short answer if the socket takes it at once, and close.
fn refuse(stream: TcpStream, status: u16, body: &str) {
    if stream.set_nonblocking(true).is_ok() {
        let bytes = encode(&Reply::text(status, body), &[]);
        let _ = (&stream).write(&bytes);
    }
}

/// One accepted connection and where it is.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    state: State,
    /// When the current state must be over.
    deadline: Instant,
}

enum State {
    /// Reading the request head into a buffer of [`MAX_HEAD`] bytes.
    Head { buf: Box<[u8]>, len: usize },
    /// Writing the answer, `pos` bytes written.
    Write { out: Vec<u8>, pos: usize },
    /// Answered, the write side shut: reading (and dropping) what the
    /// client still sends until it closes.
    Linger,
}

/// What a request head says.
enum Head<'b> {
    Partial,
    Request { method: &'b str, target: &'b str },
    TooLarge,
    Bad(httparse::Error),
}

fn parse(buf: &[u8]) -> Head<'_> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => match (req.method, req.path) {
            (Some(method), Some(target)) => Head::Request { method, target },
            _ => Head::Partial,
        },
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Head::TooLarge,
        Ok(httparse::Status::Partial) => Head::Partial,
        Err(httparse::Error::TooManyHeaders) => Head::TooLarge,
        Err(e) => Head::Bad(e),
    }
}

impl Conn {
    fn new(stream: TcpStream, peer: SocketAddr, now: Instant, limits: Limits) -> Self {
        Conn {
            stream,
            peer,
            state: State::Head {
                buf: vec![0; MAX_HEAD].into_boxed_slice(),
                len: 0,
            },
            deadline: now + limits.head_timeout,
        }
    }

    fn interest(&self) -> PollFlags {
        match self.state {
            State::Head { .. } | State::Linger => PollFlags::POLLIN,
            State::Write { .. } => PollFlags::POLLOUT,
        }
    }

    /// The deadline passed: say why, and close (by being dropped).
    fn expire(&mut self) {
        let peer = self.peer;
        match self.state {
            State::Head { .. } => {
                tracing::debug!(%peer, "metrics: no whole request within the deadline; closing");
                let bytes = encode(&Reply::text(408, "request timeout\n"), &[]);
                let _ = self.stream.write(&bytes);
            }
            State::Write { .. } => {
                tracing::debug!(%peer, "metrics: the client did not read its answer in time; closing");
            }
            State::Linger => {}
        }
    }

    fn answer(&mut self, now: Instant, limits: Limits, reply: &Reply, extra: &[(&str, &str)]) {
        self.state = State::Write {
            out: encode(reply, extra),
            pos: 0,
        };
        self.deadline = now + limits.write_timeout;
    }

    /// Move on as far as the socket allows; false when done with (the
    /// connection is then dropped, which closes it).
    fn progress(&mut self, now: Instant, limits: Limits, route: &Route) -> bool {
        loop {
            match &mut self.state {
                State::Head { buf, len } => {
                    let n = match self.stream.read(&mut buf[*len..]) {
                        // Closed (or half-closed) before a whole head.
                        Ok(0) => return false,
                        Ok(n) => n,
                        Err(e) => return io_pending(&e, self.peer),
                    };
                    *len += n;
                    let reply = match parse(&buf[..*len]) {
                        Head::Partial => continue,
                        Head::Request { method, target } => {
                            let allow: &[(&str, &str)] = if method == "GET" {
                                &[]
                            } else {
                                &[("Allow", "GET")]
                            };
                            (route(method, target), allow)
                        }
                        Head::TooLarge => {
                            tracing::debug!(peer = %self.peer, "metrics: request head past {MAX_HEAD} bytes or {MAX_HEADERS} headers");
                            let body = format!(
                                "request head too large: at most {MAX_HEAD} bytes and {MAX_HEADERS} headers\n"
                            );
                            (Reply::text(431, body), &[][..])
                        }
                        Head::Bad(e) => {
                            tracing::debug!(peer = %self.peer, "metrics: bad request: {e}");
                            (Reply::text(400, format!("bad request: {e}\n")), &[][..])
                        }
                    };
                    self.answer(now, limits, &reply.0, reply.1);
                }
                State::Write { out, pos } => {
                    match self.stream.write(&out[*pos..]) {
                        Ok(0) => return false,
                        Ok(n) => *pos += n,
                        Err(e) => return io_pending(&e, self.peer),
                    }
                    if *pos == out.len() {
                        if self.stream.shutdown(Shutdown::Write).is_err() {
                            return false;
                        }
                        self.state = State::Linger;
                        self.deadline = now + limits.linger;
                    }
                }
                State::Linger => {
                    let mut scratch = [0u8; SCRATCH];
                    for _ in 0..LINGER_READS_PER_TURN {
                        match self.stream.read(&mut scratch) {
                            Ok(0) => return false,
                            Ok(_) => {}
                            Err(e) => return io_pending(&e, self.peer),
                        }
                    }
                    return true;
                }
            }
        }
    }
}

/// After an I/O error: true to wait for the socket, false to close.
fn io_pending(e: &std::io::Error, peer: SocketAddr) -> bool {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::Interrupted => true,
        _ => {
            tracing::debug!(%peer, "metrics: {e}");
            false
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// The whole answer: status line, headers, body.
fn encode(reply: &Reply, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        reply.status,
        reason(reply.status),
        reply.content_type,
        reply.body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(reply.body.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Generous: no test asserts speed, only that a bound holds at all.
    const PATIENCE: Duration = Duration::from_secs(30);

    fn limits(head: u64, write: u64) -> Limits {
        Limits {
            max_connections: 4,
            head_timeout: Duration::from_secs(head),
            write_timeout: Duration::from_secs(write),
            linger: Duration::from_secs(1),
        }
    }

    /// A server on a free loopback port answering `body` to any GET.
    fn server(limits: Limits, body: String) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let route = Box::new(move |method: &str, target: &str| match (method, target) {
            ("GET", "/healthz") => Reply::text(200, "ok\n"),
            ("GET", _) => Reply::text(200, body.clone()),
            _ => Reply::text(405, "GET only\n"),
        });
        Server::start(listener, "metrics-test", limits, route).unwrap()
    }

    fn connect(addr: SocketAddr) -> TcpStream {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        s.set_write_timeout(Some(PATIENCE)).unwrap();
        s
    }

    /// Everything the server sends until it closes (a reset after an
    /// answer counts as the close); panics if it keeps the connection
    /// open past [`PATIENCE`].
    fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    panic!("still open after {PATIENCE:?}; got {got:?}")
                }
                Err(_) => return got,
            }
        }
    }

    fn status(resp: &[u8]) -> u16 {
        String::from_utf8_lossy(resp)
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }

    fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let mut s = connect(addr);
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let resp = String::from_utf8(read_until_closed(&mut s)).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").expect("a whole answer");
        assert!(head.contains("\r\nConnection: close"), "{head}");
        (status(head.as_bytes()), body.to_owned())
    }

    /// Send `head` then up to 4 MiB of `filler` without a line end, from a
    /// thread, while this one reads the answer.
    fn send_endless(addr: SocketAddr, head: &'static [u8], filler: u8) -> Vec<u8> {
        let mut s = connect(addr);
        let mut w = s.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let chunk = [filler; 16 * 1024];
            let mut sent = w.write_all(head).map(|()| head.len()).unwrap_or(0);
            while sent < 4 << 20 {
                match w.write(&chunk) {
                    Ok(n) => sent += n,
                    Err(_) => break,
                }
            }
            let _ = w.shutdown(Shutdown::Write);
            sent
        });
        let resp = read_until_closed(&mut s);
        writer.join().unwrap();
        resp
    }

    #[test]
    fn endless_head_lines_are_refused_and_the_next_client_served() {
        let srv = server(limits(30, 30), "body\n".into());
        // A header line without end, then a request line without end: each
        // answered 431 once 8 KiB are in, and closed; the server keeps no
        // more of them than its 8 KiB buffer.
        let resp = send_endless(srv.addr(), b"GET /metrics HTTP/1.1\r\nX-Long: ", b'a');
        assert_eq!(status(&resp), 431, "{}", String::from_utf8_lossy(&resp));
        let resp = send_endless(srv.addr(), b"GET /", b'a');
        assert_eq!(status(&resp), 431, "{}", String::from_utf8_lossy(&resp));
        assert_eq!(get(srv.addr(), "/healthz"), (200, "ok\n".into()));
    }

    #[test]
    fn too_many_headers_and_garbage_get_typed_errors() {
        let srv = server(limits(30, 30), "body\n".into());
        let mut s = connect(srv.addr());
        let mut req = String::from("GET /metrics HTTP/1.1\r\n");
        for i in 0..=MAX_HEADERS {
            req.push_str(&format!("X-{i}: v\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).unwrap();
        assert_eq!(status(&read_until_closed(&mut s)), 431);
        let mut s = connect(srv.addr());
        s.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")
            .unwrap();
        assert_eq!(status(&read_until_closed(&mut s)), 400);
        let mut s = connect(srv.addr());
        s.write_all(b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
            .unwrap();
        let resp = String::from_utf8(read_until_closed(&mut s)).unwrap();
        assert_eq!(status(resp.as_bytes()), 405, "{resp}");
        assert!(resp.contains("\r\nAllow: GET\r\n"), "{resp}");
        assert_eq!(get(srv.addr(), "/x"), (200, "body\n".into()));
    }

    #[test]
    fn a_silent_client_is_closed_at_the_deadline_and_others_are_served_meanwhile() {
        let srv = server(limits(2, 30), "body\n".into());
        let mut silent = connect(srv.addr());
        let mut trickle = connect(srv.addr());
        trickle.write_all(b"GET /metr").unwrap();
        let start = Instant::now();
        assert_eq!(get(srv.addr(), "/healthz"), (200, "ok\n".into()));
        for s in [&mut silent, &mut trickle] {
            let resp = read_until_closed(s);
            // Closed, at the deadline (not before), with a 408 if it fitted.
            assert!(start.elapsed() >= Duration::from_millis(1500));
            assert!(resp.is_empty() || status(&resp) == 408, "{resp:?}");
        }
        assert_eq!(get(srv.addr(), "/healthz"), (200, "ok\n".into()));
    }

    /// A client with a small receive buffer that pipelines `n` GETs and
    /// never reads.
    fn stuck_reader(addr: SocketAddr, n: usize) -> TcpStream {
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        sock.connect(&addr.into()).unwrap();
        let mut s: TcpStream = sock.into();
        s.set_write_timeout(Some(PATIENCE)).unwrap();
        let reqs = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(n);
        s.write_all(reqs.as_bytes()).unwrap();
        s
    }

    #[test]
    fn drop_returns_with_stuck_clients() {
        // Deadlines far past what the drop may take.
        let srv = server(limits(600, 600), "x".repeat(16 << 20));
        let addr = srv.addr();
        let _stuck = stuck_reader(addr, 100);
        let _silent = connect(addr);
        let mut half = connect(addr);
        half.write_all(b"GET /metrics HTTP/1.1\r\nHost").unwrap();
        // Let the server take all three and start the big answer.
        std::thread::sleep(Duration::from_millis(500));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            drop(srv);
            let _ = tx.send(());
        });
        rx.recv_timeout(PATIENCE)
            .expect("the server stopped despite its stuck clients");
        // And it closed them.
        read_until_closed(&mut half);
    }

    #[test]
    fn a_client_that_does_not_read_is_closed_at_the_write_deadline() {
        let srv = server(limits(30, 2), "x".repeat(16 << 20));
        let mut stuck = stuck_reader(srv.addr(), 1);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(get(srv.addr(), "/healthz"), (200, "ok\n".into()));
        // Reading now gets part of the answer, then the close.
        stuck
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        std::thread::sleep(Duration::from_secs(3));
        stuck.set_read_timeout(Some(PATIENCE)).unwrap();
        let got = read_until_closed(&mut stuck);
        assert!(got.len() < 16 << 20, "{}", got.len());
    }

    #[test]
    fn connections_past_the_cap_are_closed_at_accept() {
        let srv = server(limits(600, 600), "body\n".into());
        let held: Vec<TcpStream> = (0..4).map(|_| connect(srv.addr())).collect();
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..8 {
            let mut s = connect(srv.addr());
            let resp = read_until_closed(&mut s);
            assert!(resp.is_empty() || status(&resp) == 503, "{resp:?}");
        }
        // A held one closes: its place is free again.
        drop(held);
        let deadline = Instant::now() + PATIENCE;
        loop {
            let mut s = connect(srv.addr());
            s.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").unwrap();
            let resp = read_until_closed(&mut s);
            if status(&resp) == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "{resp:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

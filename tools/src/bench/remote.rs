//! The control protocol of `starwire bench --listen`/`--connect` (and of
//! the loopback server thread): one JSON line per message, a data
//! listener per run. Lines are bounded ([`MAX_LINE`]), waits for a message
//! have deadlines, and the server checks the client's plan
//! ([`Plan::check`]) before it sizes or spawns anything from it.

use super::*;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum ServerMsg {
    Ready {
        port: u16,
        /// The core the server's end of the run is pinned to: its own
        /// `--cores` (a `--listen` host's) before the plan's, `null` when
        /// it is not pinned (the grpc baseline's server). Absent from an
        /// older server: the client then reports the plan's.
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            deserialize_with = "present"
        )]
        server_core: Option<Option<usize>>,
    },
    Done {
        ok: bool,
        error: Option<String>,
        /// CPU % of the server process over the run (with `--cpu-util`).
        #[serde(default)]
        cpu_pct: Option<f64>,
        /// The server driver's packet counters (dpdk).
        #[serde(default)]
        datagram: Option<packets::DatagramCounters>,
    },
    Error(String),
}

/// A field that may be absent (`None`), `null` (`Some(None)`) or set.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ClientHello {
    pub(super) plan: Plan,
}

/// Longest control line, its newline not counted. The largest message is
/// the client's hello: about 600 B of fixed fields, and 10 B for each size
/// it lists (`--all-sizes` lists 23). The server's are smaller: a port, or a
/// run's outcome with a few counters and an error text clipped to
/// [`MAX_ERROR_TEXT`]. 64 KiB holds a plan of 6000 sizes, a hundred times
/// what a bench lists, and keeps what a peer can make the other end hold
/// small.
pub(super) const MAX_LINE: usize = 64 << 10;

/// Longest error text the server puts in a message (the rest is cut), so
/// that a `done` or `error` always fits in [`MAX_LINE`].
const MAX_ERROR_TEXT: usize = 4 << 10;

/// How long an end waits for a message that comes at once: the server for
/// the client's plan (sent right after the token's proof), the client for
/// the server's `ready` (a listener bound), and either for the other to
/// take a line it writes.
pub(super) const PROMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the client waits for a run's `done` once its own end of the
/// run is over. The server ends a run when its data connections close, or
/// [`ACCEPT_TIMEOUT`] after they failed to come; the rest is room for a
/// slow teardown, while a server that hangs still ends the client.
pub(super) const DONE_TIMEOUT: Duration = Duration::from_secs(300);

/// Why a control message could not be received. The connection is closed
/// after any of them.
#[derive(Debug)]
#[non_exhaustive]
pub(super) enum ControlError {
    /// Reading the connection failed.
    Io(std::io::Error),
    /// The peer closed the connection (before or within a line).
    Closed,
    /// A line longer than `limit` bytes: refused once `limit` bytes were
    /// in, the rest not read.
    TooLong { limit: usize },
    /// No whole line within `after`.
    TimedOut { after: Duration },
    /// A line that is not the message expected; `start` is its beginning.
    Malformed {
        start: String,
        source: serde_json::Error,
    },
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlError::Io(e) => write!(f, "control connection: {e}"),
            ControlError::Closed => f.write_str("control connection closed by the peer"),
            ControlError::TooLong { limit } => write!(
                f,
                "control line refused: longer than the limit of {limit} bytes"
            ),
            ControlError::TimedOut { after } => write!(
                f,
                "control connection: no whole message within {} s",
                after.as_secs()
            ),
            ControlError::Malformed { start, source } => {
                write!(f, "bad control message {start:?}: {source}")
            }
        }
    }
}

impl std::error::Error for ControlError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ControlError::Io(e) => Some(e),
            ControlError::Malformed { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The read half of a control connection. With a deadline set, each read
/// waits only until then: a peer that trickles a line byte by byte does
/// not stretch the wait, as a plain socket timeout per read would let it.
#[derive(Debug)]
pub(super) struct ControlStream {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl std::io::Read for ControlStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let wait = match self.deadline {
            None => None,
            Some(by) => {
                let left = by.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                Some(left)
            }
        };
        self.stream.set_read_timeout(wait)?;
        self.stream.read(buf)
    }
}

/// The buffered reader of a control connection.
pub(super) type ControlReader = BufReader<ControlStream>;

pub(super) fn control_reader(stream: TcpStream) -> ControlReader {
    BufReader::new(ControlStream {
        stream,
        deadline: None,
    })
}

/// Send `v` as one line. A line over [`MAX_LINE`] is not sent: the peer
/// would refuse it.
pub(super) fn send_line<W: Write, T: Serialize>(w: &mut W, v: &T) -> Result<(), String> {
    let mut s = serde_json::to_string(v).map_err(|e| e.to_string())?;
    if s.len() > MAX_LINE {
        return Err(format!(
            "a control message of {} bytes is over the limit of {MAX_LINE}",
            s.len()
        ));
    }
    s.push('\n');
    w.write_all(s.as_bytes())
        .map_err(|e| format!("control connection: {e}"))
}

/// One line from `r`, its newline taken off, of at most `limit` bytes. A
/// longer one is refused as soon as `limit` bytes of it are in, so at most
/// `limit` and one buffer of `r` are held, whatever the peer sends.
pub(super) fn read_line_bounded<R: BufRead>(
    r: &mut R,
    limit: usize,
) -> Result<Vec<u8>, ControlError> {
    let mut line = Vec::new();
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ControlError::Io(e)),
        };
        if buf.is_empty() {
            return Err(ControlError::Closed);
        }
        let (take, end) = match buf.iter().position(|&b| b == b'\n') {
            Some(at) => (at, true),
            None => (buf.len(), false),
        };
        if line.len() + take > limit {
            return Err(ControlError::TooLong { limit });
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take + usize::from(end));
        if end {
            return Ok(line);
        }
    }
}

/// One message from `r`: a line within [`MAX_LINE`], parsed.
pub(super) fn recv_line<T: for<'de> Deserialize<'de>, R: BufRead>(
    r: &mut R,
) -> Result<T, ControlError> {
    let line = read_line_bounded(r, MAX_LINE)?;
    serde_json::from_slice(&line).map_err(|source| {
        let start = String::from_utf8_lossy(&line[..line.len().min(80)]).into_owned();
        ControlError::Malformed { start, source }
    })
}

/// [`recv_line`] from a control connection, for at most `wait` in all.
pub(super) fn recv_within<T: for<'de> Deserialize<'de>>(
    r: &mut ControlReader,
    wait: Duration,
) -> Result<T, ControlError> {
    r.get_mut().deadline = Some(Instant::now() + wait);
    let got = recv_line(r);
    r.get_mut().deadline = None;
    got.map_err(|e| match e {
        // A socket's read timeout is `WouldBlock` on Unix.
        ControlError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            ControlError::TimedOut { after: wait }
        }
        e => e,
    })
}

/// `text` cut to [`MAX_ERROR_TEXT`] bytes at a character boundary.
fn clip(mut text: String) -> String {
    if text.len() > MAX_ERROR_TEXT {
        let mut at = MAX_ERROR_TEXT;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
        text.push_str(" [cut]");
    }
    text
}

/// Tell the client why it is refused (as far as it still listens) and
/// return the same as the session's error.
fn refuse(w: &mut TcpStream, msg: String) -> Result<(), String> {
    let _ = send_line(w, &ServerMsg::Error(clip(msg.clone())));
    Err(msg)
}

/// The server side: serve one control session on `listener`.
/// `server_core` overrides the plan's server core (the listen host's own
/// `--cores`).
pub(super) fn serve(
    listener: &TcpListener,
    server_core: Option<Option<usize>>,
    telemetry: &Telemetry,
) -> Result<(), String> {
    // A peer that does not prove the token is closed, and the next one
    // taken.
    let (ctl, peer) = loop {
        let (ctl, peer) = listener
            .accept()
            .map_err(|e| format!("accepting the control connection: {e}"))?;
        if auth::accept(&ctl, auth::Purpose::Control).is_ok() {
            break (ctl, peer);
        }
    };
    tracing::debug!(%peer, "bench client connected");
    ctl.set_nodelay(true).ok();
    let mut w = ctl.try_clone().map_err(|e| e.to_string())?;
    w.set_write_timeout(Some(PROMPT_TIMEOUT))
        .map_err(|e| format!("control connection: {e}"))?;
    let mut r = control_reader(ctl);
    let plan = match recv_within::<ClientHello>(&mut r, PROMPT_TIMEOUT) {
        Ok(hello) => hello.plan,
        Err(e @ (ControlError::Closed | ControlError::Io(_))) => return Err(e.to_string()),
        Err(e) => return refuse(&mut w, e.to_string()),
    };
    // The plan comes from the network: bounded before anything is sized
    // or spawned from it.
    if let Err(e) = plan.check() {
        return refuse(&mut w, format!("plan refused: {e}"));
    }
    let core = server_core.unwrap_or(plan.server_core);
    let idle = idle_policy(Role::Ps, plan.polling)?;
    let ip = listener
        .local_addr()
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    for run in plan.runs() {
        if run.backend == Backend::Raw && run.mode == Mode::Fuse {
            continue;
        }
        // At most MAX_CONNECTIONS (`Plan::check`).
        let want = data_connections(&run);
        let data = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| format!("binding a data listener on {ip}: {e}"))?;
        let port = data.local_addr().map_err(|e| e.to_string())?.port();
        let server_core = Some(core.filter(|_| run.backend.server_pinned()));
        send_line(&mut w, &ServerMsg::Ready { port, server_core })?;
        // getrusage(2) of this process does not fail; were it to, the run
        // goes on without the figure rather than break the protocol.
        let cpu = plan.cpu_util.then(CpuMeter::start).and_then(Result::ok);
        telemetry
            .counter(
                "starwire_bench_runs",
                "Benchmark runs the server served, by backend",
                &[("backend", run.backend.name())],
            )
            .add(1);
        // The server's packet counters: a datagram backend's (dpdk).
        let res: Result<Option<packets::DatagramCounters>, String> = match run.backend {
            Backend::Raw => accept_one(data)
                .and_then(|s| auth::accept(&s, auth::Purpose::Raw).map(|()| s))
                .and_then(|s| raw::serve(s, &run, core, plan.polling))
                .map(|()| None),
            Backend::Tcp => tcp_driver(&run)
                .and_then(|d| sessions::serve(d, data, want, &run, core, idle))
                .map(|()| None),
            #[cfg(all(feature = "uring", target_os = "linux"))]
            Backend::Uring => uring_driver(idle, &run)
                .and_then(|d| sessions::serve(d, data, want, &run, core, idle))
                .map(|()| None),
            #[cfg(feature = "grpc")]
            Backend::Grpc => accept_one(data)
                .and_then(|s| grpc::serve(s, &run))
                .map(|()| None),
            #[cfg(feature = "dpdk")]
            Backend::Dpdk => dpdk::serve(data, want, &run, core, idle),
            #[cfg(all(feature = "verbs", target_os = "linux"))]
            Backend::Verbs => verbs_driver(false, &run, want)
                .and_then(|d| sessions::serve(d, data, want, &run, core, idle))
                .map(|()| None),
        };
        let datagram = res.as_ref().ok().copied().flatten();
        let res = res.map(|_| ());
        let cpu_pct = cpu.and_then(|c| c.percent().ok());
        let msg = match &res {
            Ok(()) => ServerMsg::Done {
                ok: true,
                error: None,
                cpu_pct,
                datagram,
            },
            Err(e) => ServerMsg::Done {
                ok: false,
                error: Some(clip(e.clone())),
                cpu_pct,
                datagram,
            },
        };
        send_line(&mut w, &msg)?;
        res?;
    }
    Ok(())
}

/// How long the server waits for a run's data connections.
pub(super) const ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);

/// The one data connection of a baseline run, taken from an acceptor on
/// `data` like the starwire backends' (so its preamble is read, with the
/// acceptor's timeout, before the baseline sees the socket). There is no
/// reactor: this thread takes it from the acceptor's ring, for up to
/// [`ACCEPT_TIMEOUT`].
pub(super) fn accept_one(data: TcpListener) -> Result<TcpStream, String> {
    let (tx, rx) = inboxes(1).map_err(|e| format!("data acceptor: {e}"))?;
    let mut rx = rx.into_iter().next().ok_or("data acceptor: no inbox")?;
    // Nobody parks on this waker; the acceptor's wake-ups are no-ops.
    let waker = local_waker().map_err(|e| format!("data acceptor: {e}"))?;
    let _acceptor = Acceptor::spawn(data, tx, vec![waker], AcceptConfig::default())
        .map_err(|e| format!("data acceptor: {e}"))?;
    let deadline = Instant::now() + ACCEPT_TIMEOUT;
    loop {
        if let Some(r) = rx.pop() {
            return Ok(r.stream);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the data connection did not arrive within {} s",
                ACCEPT_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `--listen`: serve clients one after another. A client's failure is
/// logged and the next is served; SIGINT or SIGTERM ends the process.
pub(super) fn listen(args: &BenchArgs, listen: &str) -> Result<(), String> {
    let addr = resolve_addr(listen)?;
    let listener = TcpListener::bind(addr).map_err(|e| format!("binding --listen {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let core = args.cores.map(|c| Some(c.server));
    let telemetry = Telemetry::new();
    let _metrics = args.metrics.serve(&telemetry)?;
    loop {
        eprintln!("starwire bench: waiting for a client on {local} (stop with Ctrl-C)");
        let served = serve(&listener, core, &telemetry);
        if args.one_off {
            return served;
        }
        match served {
            Ok(()) => tracing::info!("bench client done"),
            Err(e) => {
                tracing::warn!("bench client failed: {e}");
                // An accept that fails at once (out of file descriptors)
                // must not spin.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Cursor, Read};

    use super::*;

    /// A valid plan, as the CLI makes by default but for every mode.
    fn plan() -> Plan {
        Plan {
            backends: vec![Backend::Raw, Backend::Tcp],
            modes: vec![Mode::Lat, Mode::Rate, Mode::Bw, Mode::Fuse],
            sizes: vec![64, 4096, 1 << 20],
            inflight: Some(16),
            iters: Some(100),
            duration_s: None,
            warmup: Some(10),
            warmup_s: None,
            tensors: 100,
            repeat: 3,
            polling: true,
            client_core: Some(0),
            server_core: Some(1),
            connections: 1,
            interval_s: Some(0.5),
            bidirectional: false,
            cpu_util: true,
        }
    }

    /// Counts what is read through it.
    struct Counted<R> {
        inner: R,
        read: usize,
    }

    impl<R: Read> Read for Counted<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read += n;
            Ok(n)
        }
    }

    /// Hands out one byte per read, like a peer that trickles.
    struct ByteByByte<'a>(&'a [u8]);

    impl Read for ByteByByte<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match (self.0.split_first(), buf.first_mut()) {
                (Some((&b, rest)), Some(out)) => {
                    *out = b;
                    self.0 = rest;
                    Ok(1)
                }
                _ => Ok(0),
            }
        }
    }

    #[test]
    fn an_endless_line_is_refused_after_the_limit_not_read_to_its_end() {
        // Without a newline ever: an unbounded reader would not return.
        let mut r = BufReader::with_capacity(
            8 << 10,
            Counted {
                inner: std::io::repeat(b'7'),
                read: 0,
            },
        );
        let got = recv_line::<ClientHello, _>(&mut r);
        assert!(
            matches!(got, Err(ControlError::TooLong { limit: MAX_LINE })),
            "{got:?}"
        );
        let read = r.get_ref().read;
        assert!(read <= MAX_LINE + (8 << 10), "{read} bytes read");
        let text = got.unwrap_err().to_string();
        assert!(text.contains(&MAX_LINE.to_string()), "{text}");
    }

    #[test]
    fn a_line_at_the_limit_passes_and_one_byte_more_does_not() {
        let at = [vec![b'x'; 100], b"\n".to_vec()].concat();
        let got = read_line_bounded(&mut Cursor::new(&at), 100).unwrap();
        assert_eq!(got.len(), 100);
        let over = [vec![b'x'; 101], b"\n".to_vec()].concat();
        assert!(matches!(
            read_line_bounded(&mut Cursor::new(&over), 100),
            Err(ControlError::TooLong { limit: 100 })
        ));
        // Split into many reads, the count is over the whole line.
        let mut r = BufReader::new(ByteByByte(&over));
        assert!(matches!(
            read_line_bounded(&mut r, 100),
            Err(ControlError::TooLong { limit: 100 })
        ));
    }

    #[test]
    fn lines_come_one_at_a_time_and_a_cut_one_is_a_close() {
        let mut text = Vec::new();
        send_line(
            &mut text,
            &ServerMsg::Ready {
                port: 7,
                server_core: Some(Some(2)),
            },
        )
        .unwrap();
        send_line(&mut text, &ClientHello { plan: plan() }).unwrap();
        text.extend_from_slice(b"{\"ready\":");
        let mut r = BufReader::new(ByteByByte(&text));
        match recv_line::<ServerMsg, _>(&mut r) {
            Ok(ServerMsg::Ready {
                port: 7,
                server_core: Some(Some(2)),
            }) => {}
            other => panic!("{other:?}"),
        }
        let hello: ClientHello = recv_line(&mut r).unwrap();
        assert_eq!(hello.plan.sizes, plan().sizes);
        assert!(matches!(
            recv_line::<ServerMsg, _>(&mut r),
            Err(ControlError::Closed)
        ));
        let bad = recv_line::<ServerMsg, _>(&mut Cursor::new(b"{\"ready\":{}}\n"));
        assert!(
            matches!(bad, Err(ControlError::Malformed { .. })),
            "{bad:?}"
        );
    }

    #[test]
    fn a_ready_tells_a_pinned_core_an_unpinned_end_and_an_older_server_apart() {
        let ready = |line: &[u8]| match recv_line::<ServerMsg, _>(&mut Cursor::new(line)) {
            Ok(ServerMsg::Ready {
                port: 9,
                server_core,
            }) => server_core,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            ready(b"{\"ready\":{\"port\":9,\"server_core\":3}}\n"),
            Some(Some(3))
        );
        assert_eq!(
            ready(b"{\"ready\":{\"port\":9,\"server_core\":null}}\n"),
            Some(None)
        );
        assert_eq!(ready(b"{\"ready\":{\"port\":9}}\n"), None);
        let mut out = Vec::new();
        let unpinned = ServerMsg::Ready {
            port: 9,
            server_core: Some(None),
        };
        send_line(&mut out, &unpinned).unwrap();
        assert_eq!(out, b"{\"ready\":{\"port\":9,\"server_core\":null}}\n");
    }

    #[test]
    fn a_message_over_the_limit_is_not_sent() {
        let mut p = plan();
        p.sizes = vec![usize::MAX; MAX_LINE / 8];
        let mut out = Vec::new();
        let e = send_line(&mut out, &ClientHello { plan: p }).unwrap_err();
        assert!(e.contains("over the limit"), "{e}");
        assert!(out.is_empty());
    }

    #[test]
    fn a_long_error_text_is_clipped_to_fit_a_line() {
        let long = "é".repeat(MAX_LINE);
        let cut = clip(long);
        assert!(cut.len() <= MAX_ERROR_TEXT + 8, "{}", cut.len());
        let mut out = Vec::new();
        send_line(&mut out, &ServerMsg::Error(cut)).unwrap();
    }

    /// A connected pair on loopback: (the reader's end, the peer's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        (ours, peer)
    }

    #[test]
    fn a_trickling_peer_does_not_stretch_the_wait() {
        let (ours, mut peer) = pair();
        // A byte every 20 ms: each read alone would be well in time.
        let writer = std::thread::spawn(move || {
            for _ in 0..100 {
                if peer.write_all(b" ").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let mut r = control_reader(ours);
        let t0 = Instant::now();
        let got = recv_within::<ServerMsg>(&mut r, Duration::from_millis(300));
        let took = t0.elapsed();
        assert!(matches!(got, Err(ControlError::TimedOut { .. })), "{got:?}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
        drop(r);
        writer.join().unwrap();
    }

    /// Serve one session on a listener of this process; send `line` as
    /// the client; what the server answered and how the session ended.
    fn serve_line(line: Vec<u8>) -> (Option<ServerMsg>, Result<(), String>) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || serve(&listener, None, &Telemetry::new()));
        let ctl = TcpStream::connect(addr).unwrap();
        auth::dial(&ctl, auth::Purpose::Control).unwrap();
        let mut w = ctl.try_clone().unwrap();
        // The server may close before all of an over-long line is in.
        let writer = std::thread::spawn(move || {
            let _ = w.write_all(&line);
        });
        let mut r = control_reader(ctl);
        let answer = recv_within::<ServerMsg>(&mut r, Duration::from_secs(10)).ok();
        let served = server.join().unwrap();
        writer.join().unwrap();
        (answer, served)
    }

    #[test]
    fn the_server_refuses_a_plan_out_of_bounds_with_an_error_message() {
        let mut wide = plan();
        wide.backends = vec![Backend::Tcp];
        wide.modes = vec![Mode::Rate];
        wide.connections = 100_000;
        // Listing its runs alone would take all memory.
        let mut endless = plan();
        endless.repeat = usize::MAX;
        for (p, want) in [(wide, "--connections 100000"), (endless, "--repeat")] {
            let mut line = Vec::new();
            send_line(&mut line, &ClientHello { plan: p }).unwrap();
            let (answer, served) = serve_line(line);
            match answer {
                Some(ServerMsg::Error(e)) => assert!(e.contains(want), "{e}"),
                other => panic!("{other:?}"),
            }
            assert!(served.unwrap_err().contains(want));
        }
    }

    #[test]
    fn the_server_refuses_an_over_long_hello() {
        let (_, served) = serve_line(vec![b' '; 4 * MAX_LINE]);
        let e = served.unwrap_err();
        assert!(e.contains(&format!("limit of {MAX_LINE} bytes")), "{e}");
    }

    /// A deterministic xorshift generator.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// `line` changed once: cut, a bit flipped, a number replaced by a
    /// huge, negative or fractional one, a piece repeated, a newline or
    /// deep nesting put in.
    fn mutate(line: &[u8], rng: &mut Rng) -> Vec<u8> {
        const NUMBERS: [&str; 8] = [
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999999",
            "-1",
            "1e308",
            "4294967296",
            "0",
            "1.5",
        ];
        let mut out = line.to_vec();
        if out.is_empty() {
            return out;
        }
        let at = rng.below(out.len());
        match rng.below(6) {
            0 => out.truncate(at),
            1 => out[at] ^= 1 << rng.below(8),
            2 => {
                // Replace the digits that start at or after `at`.
                if let Some(start) = out[at..].iter().position(u8::is_ascii_digit) {
                    let start = at + start;
                    let end = out[start..]
                        .iter()
                        .position(|b| !b.is_ascii_digit())
                        .map_or(out.len(), |e| start + e);
                    let n = NUMBERS[rng.below(NUMBERS.len())];
                    out.splice(start..end, n.bytes());
                }
            }
            3 => {
                let len = rng.below(64).min(out.len() - at);
                let piece = out[at..at + len].to_vec();
                out.splice(at..at, piece);
            }
            4 => out.insert(at, b'\n'),
            _ => {
                let depth = rng.below(300);
                let nest = "[".repeat(depth);
                out.splice(at..at, nest.bytes());
            }
        }
        out
    }

    #[test]
    fn mutated_control_lines_never_panic() {
        let mut valid = Vec::new();
        let mut p = plan();
        for k in 0..4 {
            p.connections = 1 + k;
            p.backends = if k == 0 {
                vec![Backend::Raw, Backend::Tcp]
            } else {
                vec![Backend::Tcp]
            };
            p.modes = if k == 0 {
                vec![Mode::Lat, Mode::Fuse]
            } else {
                vec![Mode::Rate, Mode::Bw]
            };
            p.duration_s = (k % 2 == 1).then_some(2.5);
            send_line(&mut valid, &ClientHello { plan: p.clone() }).unwrap();
        }
        for m in [
            ServerMsg::Ready {
                port: 40000,
                server_core: Some(None),
            },
            ServerMsg::Done {
                ok: false,
                error: Some("server connection: reset".into()),
                cpu_pct: Some(97.5),
                datagram: Some(packets::DatagramCounters {
                    packets_received: 10,
                    packets_sent: 12,
                    frames_sent: 9,
                    retransmits: 1,
                }),
            },
            ServerMsg::Error("plan refused".into()),
        ] {
            send_line(&mut valid, &m).unwrap();
        }
        let lines: Vec<&[u8]> = valid.split_inclusive(|&b| b == b'\n').collect();
        let mut rng = Rng(0x5eed_cafe_f00d_d00d);
        let (mut parsed, mut passed) = (0, 0);
        for i in 0..4000 {
            let line = lines[i % lines.len()];
            let mut bytes = mutate(line, &mut rng);
            if rng.below(4) == 0 {
                bytes = mutate(&bytes, &mut rng);
            }
            let mut r = Cursor::new(&bytes);
            if let Ok(hello) = recv_line::<ClientHello, _>(&mut r) {
                parsed += 1;
                if hello.plan.check().is_ok() {
                    passed += 1;
                    // What the server sizes from a plan that passed.
                    let runs = hello.plan.runs();
                    assert!(runs.len() <= MAX_RUNS);
                    for run in runs.iter().take(64) {
                        let _ = run.duration();
                        let _ = run.interval_report();
                        let _ = sessions::tcp_config(run.max_size);
                        assert!(data_connections(run) <= MAX_CONNECTIONS);
                        if let Warmup::Iters(w) = run.warmup {
                            assert!(w.checked_add(run.iters).is_some());
                        }
                    }
                }
            }
            let _ = recv_line::<ServerMsg, _>(&mut Cursor::new(&bytes));
            let _ = read_line_bounded(&mut Cursor::new(&bytes), 64);
        }
        // The mutations reach the checks, not only the parser.
        assert!(
            parsed > 100 && passed > 50,
            "{parsed} parsed, {passed} passed"
        );
    }
}

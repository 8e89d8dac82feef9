//! The control protocol of `starwire bench --listen`/`--connect` (and of
//! the loopback server thread): one JSON line per message, a data
//! listener per run.

use super::*;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum ServerMsg {
    Ready {
        port: u16,
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

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ClientHello {
    pub(super) plan: Plan,
}

pub(super) fn send_line<T: Serialize>(w: &mut TcpStream, v: &T) -> Result<(), String> {
    let mut s = serde_json::to_string(v).map_err(|e| e.to_string())?;
    s.push('\n');
    w.write_all(s.as_bytes())
        .map_err(|e| format!("control connection: {e}"))
}

pub(super) fn recv_line<T: for<'de> Deserialize<'de>>(
    r: &mut BufReader<TcpStream>,
) -> Result<T, String> {
    let mut line = String::new();
    let n = r
        .read_line(&mut line)
        .map_err(|e| format!("control connection: {e}"))?;
    if n == 0 {
        return Err("control connection closed by the peer".into());
    }
    serde_json::from_str(&line).map_err(|e| format!("bad control message {line:?}: {e}"))
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
    let mut r = BufReader::new(ctl);
    let hello: ClientHello = recv_line(&mut r)?;
    let plan = hello.plan;
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
        // The count comes from the network: bounded before anything is
        // sized by it (the client's `validate` refuses more too).
        let want = data_connections(&run);
        if want > MAX_CONNECTIONS {
            let msg = format!("{want} data connections asked; at most {MAX_CONNECTIONS}");
            send_line(&mut w, &ServerMsg::Error(msg.clone()))?;
            return Err(msg);
        }
        let data = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| format!("binding a data listener on {ip}: {e}"))?;
        let port = data.local_addr().map_err(|e| e.to_string())?.port();
        send_line(&mut w, &ServerMsg::Ready { port })?;
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
                .and_then(|s| raw::serve(s, core, plan.polling))
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
                error: Some(e.clone()),
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

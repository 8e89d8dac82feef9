//! The raw baseline: no starwire code in the path. Plain `TcpStream`s with
//! `TCP_NODELAY`; with polling on they are non-blocking and the loop spins
//! on `recv` (an `O_NONBLOCK` socket: `recv` behaves as with `MSG_DONTWAIT`)
//! and `send`; with polling off they block. No epoll.
//!
//! Framing: an 8-byte header (`u32` payload length, `u32` op, little
//! endian) then the payload. `ECHO` is answered with the same frame, `ACK`
//! with an empty `ACK` frame.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::hist::Rtts;
use super::{Completion, Measured, Mode, RequestBudget, Run};

const HDR: usize = 8;
const OP_ECHO: u32 = 1;
const OP_ACK: u32 = 2;
/// The smallest receive buffer of an end (see [`rx_buf_len`]).
const MIN_RX_BUF: usize = 256 << 10;
const MAX_IOV: usize = 64;

fn pin(core: Option<usize>) -> Result<(), String> {
    if let Some(c) = core {
        starwire_placement::pin_current_thread(c)
            .map_err(|e| format!("pinning to CPU {c}: {e}"))?;
    }
    Ok(())
}

/// The socket settings of a raw end: those the starwire stream backends
/// give theirs (no Nagle; over loopback, the send buffer capped at
/// `DEFAULT_LOOPBACK_SEND_BUFFER`), so the baseline differs from them only
/// in what runs above the socket.
fn setup(stream: &TcpStream, polling: bool) -> Result<(), String> {
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_nonblocking(polling))
        .and_then(|()| {
            starwire_transport::socket::cap_loopback_send_buffer(
                stream,
                starwire_transport::socket::DEFAULT_LOOPBACK_SEND_BUFFER,
            )
        })
        .map_err(|e| format!("raw socket setup: {e}"))
}

/// The receive buffer of either end of `run`: two of the plan's largest
/// frames (header included), as the starwire tcp ends get two of theirs
/// (`sessions::tcp_config`'s `rx_buffer_len`), so that one `recv` can take
/// a whole message at any size; at least [`MIN_RX_BUF`].
pub(super) fn rx_buf_len(run: &Run) -> usize {
    run.max_size
        .saturating_add(HDR)
        .saturating_mul(2)
        .max(MIN_RX_BUF)
}

fn header(len: usize, op: u32) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4..].copy_from_slice(&op.to_le_bytes());
    h
}

/// The echo/ack server of one data connection of `run`, on its own thread
/// pinned to `core`; returns when the client closes.
pub fn serve(
    stream: TcpStream,
    run: &Run,
    core: Option<usize>,
    polling: bool,
) -> Result<(), String> {
    let rx_len = rx_buf_len(run);
    std::thread::Builder::new()
        .name("raw-server".into())
        .spawn(move || serve_here(stream, rx_len, core, polling))
        .map_err(|e| e.to_string())?
        .join()
        .map_err(|_| "raw server thread panicked".to_owned())?
}

fn serve_here(
    mut s: TcpStream,
    rx_len: usize,
    core: Option<usize>,
    polling: bool,
) -> Result<(), String> {
    pin(core)?;
    setup(&s, polling)?;
    let mut rx = vec![0u8; rx_len];
    let mut out: Vec<u8> = Vec::with_capacity(rx_len);
    let mut out_at = 0usize;
    let mut hdr = [0u8; HDR];
    let mut hdr_have = 0usize;
    let mut remaining = 0usize;
    let mut op = 0u32;
    loop {
        while out_at < out.len() {
            match s.write(&out[out_at..]) {
                Ok(n) => out_at += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if is_gone(&e) => return Ok(()),
                Err(e) => return Err(format!("raw server send: {e}")),
            }
        }
        if out_at == out.len() {
            out.clear();
            out_at = 0;
        }
        let n = match s.read(&mut rx) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::hint::spin_loop();
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if is_gone(&e) => return Ok(()),
            Err(e) => return Err(format!("raw server recv: {e}")),
        };
        let mut buf = &rx[..n];
        while !buf.is_empty() {
            if hdr_have < HDR {
                let take = (HDR - hdr_have).min(buf.len());
                hdr[hdr_have..hdr_have + take].copy_from_slice(&buf[..take]);
                hdr_have += take;
                buf = &buf[take..];
                if hdr_have < HDR {
                    break;
                }
                remaining = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) as usize;
                op = u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
                if op == OP_ECHO {
                    out.extend_from_slice(&hdr);
                }
            }
            let take = remaining.min(buf.len());
            if op == OP_ECHO {
                out.extend_from_slice(&buf[..take]);
            }
            remaining -= take;
            buf = &buf[take..];
            if remaining == 0 {
                if op == OP_ACK {
                    out.extend_from_slice(&header(0, OP_ACK));
                }
                hdr_have = 0;
            }
        }
    }
}

fn is_gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
    )
}

/// The load generator of one run, on a thread pinned to `core`.
pub fn client(
    stream: TcpStream,
    run: &Run,
    core: Option<usize>,
    polling: bool,
) -> Result<Measured, String> {
    let run = run.clone();
    std::thread::Builder::new()
        .name("raw-client".into())
        .spawn(move || client_here(stream, &run, core, polling))
        .map_err(|e| e.to_string())?
        .join()
        .map_err(|_| "raw client thread panicked".to_owned())?
}

fn client_here(
    mut s: TcpStream,
    run: &Run,
    core: Option<usize>,
    polling: bool,
) -> Result<Measured, String> {
    pin(core)?;
    setup(&s, polling)?;
    let (op, resp_len) = if run.echoed() {
        (OP_ECHO, HDR + run.size)
    } else {
        (OP_ACK, HDR)
    };
    let record = matches!(run.mode, Mode::Lat | Mode::Rate);
    let inflight = run.inflight as u64;
    let mut req = Vec::with_capacity(HDR + run.size);
    req.extend_from_slice(&header(run.size, op));
    req.extend((0..run.size).map(|i| i as u8));
    let mut rx = vec![0u8; rx_buf_len(run)];
    // With --rate the measured requests leave on their schedule; a
    // blocking recv could not wake at a due time, so the plan takes a rate
    // here only with polling on (`Plan::check_rate`).
    let mut budget = RequestBudget::new(run.warmup, run.iters, run.duration()).with_rate(run.rate);
    let conn = budget.add_connection();
    let mut rtts = Rtts::new();
    let mut interval = run.interval_report();
    // The outstanding requests: when each one's latency counts from (its
    // send, or when it was due with a rate), whether it is measured.
    let mut starts: VecDeque<(Instant, bool)> = VecDeque::with_capacity(run.inflight);
    let (mut started, mut completed) = (0u64, 0u64);
    let mut tx_at: Option<usize> = None;
    let mut queued = 0usize;
    let mut rx_acc = 0usize;
    let now = Instant::now();
    if budget.begin(now) {
        if let Some(r) = &mut interval {
            r.start(now);
        }
    }
    loop {
        // Queue every request that may start now (all through the
        // warm-up, then `iters` or for `--duration`), then write them with
        // one vectored send (the rest of a partly written one first).
        let now = Instant::now();
        while started - completed < inflight && budget.may_start(conn, now) {
            let origin = budget.on_send(conn, now);
            starts.push_back((origin.unwrap_or(now), origin.is_some()));
            started += 1;
            queued += 1;
            if queued == 1 {
                tx_at = Some(0);
            }
        }
        if let Some(at) = tx_at {
            let n_slices = queued.min(MAX_IOV);
            let mut iov: [IoSlice<'_>; MAX_IOV] = [IoSlice::new(&[]); MAX_IOV];
            iov[0] = IoSlice::new(&req[at..]);
            for slot in iov.iter_mut().take(n_slices).skip(1) {
                *slot = IoSlice::new(&req);
            }
            match s.write_vectored(&iov[..n_slices]) {
                Ok(n) => {
                    let mut n = n;
                    let mut at = at;
                    while n > 0 {
                        let left = req.len() - at;
                        if n >= left {
                            n -= left;
                            at = 0;
                            queued -= 1;
                        } else {
                            at += n;
                            n = 0;
                        }
                    }
                    tx_at = (queued > 0).then_some(at);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("raw client send: {e}")),
            }
        }
        let outstanding = started - completed;
        let can_send = budget.may_start(conn, now);
        if outstanding == 0 {
            // With a rate, the next request may not be due yet.
            if !can_send && !budget.scheduled_left(now) {
                break;
            }
            continue;
        }
        // Blocking mode: read only when nothing more can be sent now.
        if !polling && (tx_at.is_some() || (can_send && outstanding < inflight)) {
            continue;
        }
        let n = match s.read(&mut rx) {
            Ok(0) => return Err("raw client: server closed the connection".into()),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::hint::spin_loop();
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("raw client recv: {e}")),
        };
        rx_acc += n;
        if rx_acc >= resp_len {
            let now = Instant::now();
            while rx_acc >= resp_len {
                rx_acc -= resp_len;
                let (t0, measured) = starts
                    .pop_front()
                    .ok_or("raw client: response without a request")?;
                completed += 1;
                match budget.on_complete(measured, now) {
                    Completion::Measured => {
                        let ns = now.duration_since(t0).as_nanos() as u64;
                        if record {
                            rtts.record(ns);
                        }
                        if let Some(r) = &mut interval {
                            r.on_complete(now, record.then_some(ns));
                        }
                    }
                    Completion::Last => {
                        if let Some(r) = &mut interval {
                            r.start(now);
                        }
                    }
                    Completion::Warmup => {}
                }
            }
        }
    }
    if let (Some(mut r), Some(end)) = (interval, budget.end()) {
        r.finish(end);
    }
    Ok(Measured {
        iters: budget.measured(),
        elapsed: budget.elapsed(),
        rtts,
        ..Measured::default()
    })
}

#[cfg(test)]
mod tests {
    use super::super::Plan;
    use super::*;
    use crate::backend::Backend;

    fn run_of(sizes: Vec<usize>) -> Run {
        let p = Plan {
            backends: vec![Backend::Raw],
            modes: vec![Mode::Lat],
            sizes,
            inflight: None,
            iters: Some(10),
            duration_s: None,
            warmup: None,
            warmup_s: None,
            tensors: 1,
            repeat: 1,
            polling: true,
            client_core: None,
            server_core: None,
            connections: 1,
            interval_s: None,
            bidirectional: false,
            cpu_util: false,
        };
        p.runs().remove(0)
    }

    #[test]
    fn the_receive_buffer_holds_two_of_the_plans_largest_messages() {
        // Small plans keep the floor.
        assert_eq!(rx_buf_len(&run_of(vec![64, 4096])), MIN_RX_BUF);
        // Every run of a plan is sized by its largest message, whole.
        let big = run_of(vec![64, 1 << 20]);
        assert_eq!(big.size, 64);
        assert_eq!(rx_buf_len(&big), 2 * ((1 << 20) + HDR));
        let max = run_of(vec![super::super::MAX_SIZE]);
        assert!(rx_buf_len(&max) >= 2 * (max.size + HDR));
    }
}

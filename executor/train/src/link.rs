//! How a worker reaches one PS shard, and how a PS task hands an accepted
//! connection to the reactor that owns the shard.
//!
//! A PS task listens on one port. A worker opens one connection per shard
//! (shard = one PS reactor) and, before the starwire handshake, writes an
//! 8-byte preamble: `b"SWSH"` and the shard index as a little-endian `u32`.
//! The PS task's acceptor reads it (with a timeout) and passes the socket to
//! that reactor, so every row and variable is served by exactly one reactor
//! and no message crosses cores on the PS.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use starwire_tcp::{TcpConfig, TcpDriver};
use starwire_transport::reactor::ReactorWaker;
use starwire_transport::StreamDriver;

use crate::TrainError;

const MAGIC: &[u8; 4] = b"SWSH";
/// Longest wait for a new connection's preamble.
const PREAMBLE_TIMEOUT: Duration = Duration::from_secs(10);

/// A backend of the trainer: its name and the driver a thread makes.
pub trait Backend: Send + Sync + 'static {
    /// The driver of one thread: every connection of a PS reactor, or of a
    /// worker.
    type Driver: StreamDriver + Send + std::fmt::Debug + 'static;
    /// The name on the command line and in reports.
    const NAME: &'static str;
    /// A driver for the calling thread (one driver per thread; an io_uring
    /// ring is its thread's), whose thread polls (`polling`: busy, or
    /// before it parks) or parks at once.
    fn driver(polling: bool) -> io::Result<Self::Driver>;
}

/// The TCP backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tcp;

impl Backend for Tcp {
    type Driver = TcpDriver;
    const NAME: &'static str = "tcp";
    fn driver(_polling: bool) -> io::Result<TcpDriver> {
        TcpDriver::new(tcp_config())
    }
}

/// Transport settings for training traffic: frames of 1 MiB (bigger
/// messages are chunked by the connection), 8 MiB of send queue.
pub fn tcp_config() -> TcpConfig {
    TcpConfig {
        max_frame_len: 1 << 20,
        rx_buffer_len: 2 << 20,
        tx_queue_limit_bytes: 8 << 20,
        ..TcpConfig::default()
    }
}

/// Connect to shard `shard` of the PS task at `addr` and send the
/// preamble, retrying refused connections until `deadline` (PS tasks may
/// start after workers).
pub fn connect_shard(addr: &str, shard: u32, deadline: Instant) -> Result<TcpStream, TrainError> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| TrainError::Connect(addr.to_owned(), e))?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    loop {
        for a in &addrs {
            match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                Ok(mut s) => {
                    let mut pre = [0u8; 8];
                    pre[..4].copy_from_slice(MAGIC);
                    pre[4..].copy_from_slice(&shard.to_le_bytes());
                    s.write_all(&pre)
                        .and_then(|()| s.set_nodelay(true))
                        .map_err(|e| TrainError::Connect(addr.to_owned(), e))?;
                    return Ok(s);
                }
                Err(e) => last = e,
            }
        }
        if Instant::now() >= deadline {
            return Err(TrainError::Connect(addr.to_owned(), last));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where the acceptor sends a connection for shard `i`.
#[derive(Debug, Clone)]
pub struct ShardInbox {
    /// The reactor's queue of new connections.
    pub tx: Sender<TcpStream>,
    /// Wakes the reactor after a send.
    pub waker: ReactorWaker,
}

/// The accept thread of one PS task.
#[derive(Debug)]
pub struct Acceptor {
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
    addr: SocketAddr,
}

/// Read and check the preamble; returns the shard index.
pub fn read_preamble(s: &mut impl Read) -> io::Result<u32> {
    let mut pre = [0u8; 8];
    s.read_exact(&mut pre)?;
    if &pre[..4] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad preamble: not a starwire shard connection",
        ));
    }
    let mut idx = [0u8; 4];
    idx.copy_from_slice(&pre[4..]);
    Ok(u32::from_le_bytes(idx))
}

impl Acceptor {
    /// Accept on `listener` until stopped, routing each connection by its
    /// preamble to `inboxes[shard]`. A bad preamble or an unknown shard
    /// closes that connection only.
    pub fn spawn(listener: TcpListener, inboxes: Vec<ShardInbox>) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let join = std::thread::Builder::new()
            .name("starwire-ps-accept".into())
            .spawn(move || accept_loop(&listener, &inboxes, &st))?;
        Ok(Self {
            stop,
            join: Some(join),
            addr,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, inboxes: &[ShardInbox], stop: &AtomicBool) {
    let inboxes: Arc<[ShardInbox]> = inboxes.into();
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, peer)) => {
                // The preamble is read on a thread of its own, so a slow or
                // silent peer holds up only itself, never the next accept.
                let inboxes = inboxes.clone();
                let spawned = std::thread::Builder::new()
                    .name("starwire-ps-preamble".into())
                    .spawn(move || route(s, peer, &inboxes));
                if let Err(e) = spawned {
                    tracing::warn!(%peer, "no thread for the preamble: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                tracing::warn!("accept: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Read a new connection's preamble and hand it to its shard's reactor; a
/// bad preamble or an unknown shard closes it.
fn route(mut s: TcpStream, peer: SocketAddr, inboxes: &[ShardInbox]) {
    let r = s
        .set_nonblocking(false)
        .and_then(|()| s.set_read_timeout(Some(PREAMBLE_TIMEOUT)))
        .and_then(|()| read_preamble(&mut s));
    let shard = match r {
        Ok(i) => i as usize,
        Err(e) => {
            tracing::warn!(%peer, "rejected connection: {e}");
            return;
        }
    };
    let Some(inbox) = inboxes.get(shard) else {
        tracing::warn!(%peer, shard, "rejected connection for unknown shard");
        return;
    };
    match s.set_read_timeout(None) {
        Ok(()) => {
            if inbox.tx.send(s).is_ok() {
                inbox.waker.wake();
            }
        }
        Err(e) => tracing::warn!(%peer, "setting up connection: {e}"),
    }
}

#[cfg(all(feature = "uring", target_os = "linux"))]
pub use uring_backend::Uring;

#[cfg(all(feature = "uring", target_os = "linux"))]
mod uring_backend {
    use std::io;

    use starwire_uring::{UringConfig, UringDriver};

    use super::Backend;

    /// The io_uring backend: one ring per thread, every connection of the
    /// thread on it, one `io_uring_enter` per turn
    /// (`STARWIRE_URING_SQPOLL=1` for SQPOLL).
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Uring;

    impl Backend for Uring {
        type Driver = UringDriver;
        const NAME: &'static str = "uring";
        fn driver(polling: bool) -> io::Result<UringDriver> {
            // A polling thread receives in spin mode (`RecvMode::Spin`).
            UringDriver::new(&UringConfig::for_polling(polling)).map_err(io::Error::other)
        }
    }
}

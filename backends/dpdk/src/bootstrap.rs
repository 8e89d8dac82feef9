//! The bootstrap over TCP: before any datagram flows, the two ends of a
//! connection tell each other, over a TCP stream they already share, the
//! MAC, IPv4 address and UDP port their packets go to and the connection
//! ids to address. Each end writes one line and reads the peer's
//! ([`Hello`], with its parser and bounded reader, in
//! `starwire_datagram::hello`).
//!
//! A link may carry connections to several peers: it reads each
//! datagram's `src_conn` (our connection's id) to pick the destination
//! (`DpdkLink::add_peer`).
//!
//! A reactor's connection ([`attach_one`], `attach_stream`) exchanges its
//! line without blocking: the driver's flushes step a [`HelloExchange`]
//! until it connects the connection, so a peer that is slow or silent
//! holds up nothing else. The bench's [`bootstrap`] of many connections at
//! once blocks its own thread. Either reads at most the bytes a hello can
//! be, within [`BOOTSTRAP_TIMEOUT`].

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

pub use starwire_datagram::hello::Hello;
use starwire_datagram::hello::{HelloError, LineReader};
use starwire_datagram::{DatagramDriver, DatagramLink, Exchange, Impaired, StreamBootstrap};
use starwire_transport::{ConnId, Driver, TransportError};
use thiserror::Error;

use crate::link::DpdkLink;

/// How long a bootstrap exchange may take.
pub const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);

/// A bootstrap exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// Writing or reading the stream failed (or timed out).
    #[error("DPDK bootstrap: {0}")]
    Io(String),
    /// The peer's line is not a hello of this version.
    #[error("bad DPDK bootstrap line {line:?}: {why}")]
    BadHello {
        /// The line, without its end.
        line: String,
        /// What is wrong with it.
        why: String,
    },
    /// The ends prepared different numbers of connections.
    #[error("DPDK bootstrap: the peer has {peer} connections, this end {local}")]
    Count {
        /// The peer's.
        peer: usize,
        /// This end's.
        local: usize,
    },
    /// The driver refused to prepare or connect a connection.
    #[error("DPDK bootstrap: {0}")]
    Driver(String),
}

impl From<BootstrapError> for TransportError {
    fn from(e: BootstrapError) -> Self {
        TransportError::Link(e.to_string())
    }
}

impl From<HelloError> for BootstrapError {
    fn from(e: HelloError) -> Self {
        BootstrapError::BadHello {
            line: e.line,
            why: e.why,
        }
    }
}

fn timed_out() -> BootstrapError {
    BootstrapError::Io(format!(
        "no hello line within {} s",
        BOOTSTRAP_TIMEOUT.as_secs()
    ))
}

/// A read or write that did not fail: it would block, or was interrupted.
fn retry(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
    )
}

/// The peer's hello line, read within `deadline` and at most `max` bytes
/// long, blocking (the bench's bootstrap, on a thread of its own).
fn read_line_within(
    mut stream: &TcpStream,
    max: usize,
    deadline: Instant,
) -> Result<String, BootstrapError> {
    let mut line = LineReader::new(max);
    let mut chunk = [0u8; 512];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(timed_out)?;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| BootstrapError::Io(e.to_string()))?;
        match stream.read(&mut chunk) {
            Ok(0) => return Err(closed()),
            Ok(got) => {
                if let Some(l) = line.feed(&chunk[..got])? {
                    return Ok(l);
                }
            }
            // Timed out (the deadline check decides) or interrupted.
            Err(e) if retry(&e) => {}
            Err(e) => return Err(BootstrapError::Io(e.to_string())),
        }
    }
}

fn closed() -> BootstrapError {
    BootstrapError::Io("the peer closed before its hello".into())
}

/// A link whose connections the bootstrap can point at their peers: a
/// [`DpdkLink`], or one under a fault injector.
pub trait OnDpdk: DatagramLink {
    /// The DPDK link.
    fn dpdk(&self) -> &DpdkLink;
    /// The DPDK link, mutably.
    fn dpdk_mut(&mut self) -> &mut DpdkLink;
}

impl OnDpdk for DpdkLink {
    fn dpdk(&self) -> &DpdkLink {
        self
    }
    fn dpdk_mut(&mut self) -> &mut DpdkLink {
        self
    }
}

impl OnDpdk for Impaired<DpdkLink> {
    fn dpdk(&self) -> &DpdkLink {
        self.inner()
    }
    fn dpdk_mut(&mut self) -> &mut DpdkLink {
        self.inner_mut()
    }
}

/// Exchange hellos over `stream`: prepare `n` connections on `driver`,
/// send where they are, read the peer's, send each connection's packets
/// to the peer's address and connect it to the peer's connection of the
/// same index. Returns the connections, in order.
pub fn bootstrap<L: OnDpdk>(
    driver: &mut DatagramDriver<L>,
    stream: &TcpStream,
    n: usize,
) -> Result<Vec<ConnId>, BootstrapError> {
    let io = |e: std::io::Error| BootstrapError::Io(e.to_string());
    let mut conns = Vec::with_capacity(n);
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let (c, id) = driver
            .prepare()
            .map_err(|e| BootstrapError::Driver(e.to_string()))?;
        conns.push(c);
        ids.push(id);
    }
    let mine = Hello {
        endpoint: driver.link().dpdk().config().local,
        ids,
    };
    let deadline = Instant::now() + BOOTSTRAP_TIMEOUT;
    stream
        .set_write_timeout(Some(BOOTSTRAP_TIMEOUT))
        .map_err(io)?;
    let mut w = stream;
    w.write_all(mine.line().as_bytes()).map_err(io)?;
    let line = read_line_within(stream, Hello::max_line(n), deadline)?;
    let peer = Hello::parse(&line)?;
    if peer.ids.len() != n {
        return Err(BootstrapError::Count {
            peer: peer.ids.len(),
            local: n,
        });
    }
    for ((&c, &id), &local) in conns.iter().zip(&peer.ids).zip(&mine.ids) {
        driver.link_mut().dpdk_mut().add_peer(local, peer.endpoint);
        driver
            .connect(c, id)
            .map_err(|e| BootstrapError::Driver(e.to_string()))?;
    }
    tracing::debug!(local = %mine.endpoint, peer = %peer.endpoint, n, "DPDK bootstrap done");
    Ok(conns)
}

/// One connection per stream: a `DatagramDriver<DpdkLink>` is a
/// [`StreamDriver`](starwire_transport::StreamDriver), whose
/// `attach_stream` bootstraps the connection over the stream and then
/// lets the stream go.
impl StreamBootstrap for DpdkLink {
    fn bootstrap(
        driver: &mut DatagramDriver<Self>,
        stream: TcpStream,
    ) -> Result<ConnId, TransportError> {
        if driver.link().config().ip_from_bootstrap {
            let local = stream
                .local_addr()
                .map_err(|e| BootstrapError::Io(e.to_string()))?;
            let IpAddr::V4(ip) = local.ip() else {
                return Err(BootstrapError::Io(format!(
                    "the bootstrap connection is IPv6 ({local}); give --dpdk-ip"
                ))
                .into());
            };
            driver.link_mut().set_local_ip(ip);
        }
        attach_one(driver, stream)
    }
}

/// Bootstrap one connection on `driver` over `stream` (what
/// `attach_stream` does; for links under a fault injector too) without
/// blocking: the connection is prepared and its hello written at once,
/// and the driver's flushes read the peer's ([`HelloExchange`]) and
/// connect it. Frames sent before queue until then.
pub fn attach_one<L: OnDpdk>(
    driver: &mut DatagramDriver<L>,
    stream: TcpStream,
) -> Result<ConnId, TransportError> {
    let io = |e: std::io::Error| BootstrapError::Io(e.to_string());
    stream.set_nonblocking(true).map_err(io)?;
    let (conn, id) = driver
        .prepare()
        .map_err(|e| BootstrapError::Driver(e.to_string()))?;
    let mine = Hello {
        endpoint: driver.link().dpdk().config().local,
        ids: vec![id],
    };
    let mut x = HelloExchange {
        stream,
        id,
        out: mine.line().into_bytes(),
        sent: 0,
        line: LineReader::new(Hello::max_line(1)),
        deadline: Instant::now() + BOOTSTRAP_TIMEOUT,
    };
    // Our hello leaves now: the peer may be waiting for it.
    if let Err(e) = x.write() {
        driver.detach(conn);
        return Err(e.into());
    }
    driver.begin_exchange(conn, Box::new(x));
    Ok(conn)
}

/// One connection's hello exchange, stepped by its driver's flushes
/// ([`Exchange`]): our line written, the peer's read as it comes, within
/// [`BOOTSTRAP_TIMEOUT`] and [`Hello::max_line`] bytes; then the
/// connection is pointed at the peer and connected, and the stream goes.
/// Nothing blocks: a peer without the token that never answers holds only
/// its own connection (which the session layer's handshake timeout ends).
#[derive(Debug)]
pub struct HelloExchange {
    stream: TcpStream,
    /// Our connection's id, as our hello gave it.
    id: u32,
    /// Our hello line, and how much of it was written.
    out: Vec<u8>,
    sent: usize,
    line: LineReader,
    deadline: Instant,
}

impl HelloExchange {
    /// Write what the socket takes of our line.
    fn write(&mut self) -> Result<(), BootstrapError> {
        while self.sent < self.out.len() {
            match (&self.stream).write(&self.out[self.sent..]) {
                Ok(0) => return Err(closed()),
                Ok(n) => self.sent += n,
                Err(e) if retry(&e) => return Ok(()),
                Err(e) => return Err(BootstrapError::Io(e.to_string())),
            }
        }
        Ok(())
    }

    /// The peer's line, once it is whole and ours was written.
    fn read_if_sent(&mut self) -> Result<Option<String>, BootstrapError> {
        if self.sent < self.out.len() {
            return Ok(None);
        }
        let mut chunk = [0u8; 512];
        loop {
            match (&self.stream).read(&mut chunk) {
                Ok(0) => return Err(closed()),
                Ok(got) => {
                    if let Some(l) = self.line.feed(&chunk[..got])? {
                        return Ok(Some(l));
                    }
                }
                Err(e) if retry(&e) => return Ok(None),
                Err(e) => return Err(BootstrapError::Io(e.to_string())),
            }
        }
    }
}

impl<L: OnDpdk> Exchange<L> for HelloExchange {
    fn step(
        &mut self,
        driver: &mut DatagramDriver<L>,
        conn: ConnId,
        now: Instant,
    ) -> Result<bool, TransportError> {
        // The peer's line is read once ours has left whole.
        self.write()?;
        let line = match self.read_if_sent()? {
            Some(line) => line,
            None if now >= self.deadline => return Err(timed_out().into()),
            None => return Ok(false),
        };
        let peer = Hello::parse(&line).map_err(BootstrapError::from)?;
        let [peer_id] = peer.ids[..] else {
            return Err(BootstrapError::Count {
                peer: peer.ids.len(),
                local: 1,
            }
            .into());
        };
        driver
            .link_mut()
            .dpdk_mut()
            .add_peer(self.id, peer.endpoint);
        driver
            .connect(conn, peer_id)
            .map_err(|e| BootstrapError::Driver(e.to_string()))?;
        tracing::debug!(local = self.id, peer = %peer.endpoint, "DPDK bootstrap done");
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use starwire_datagram::udp::UdpEndpoint;

    use super::*;

    /// A connected pair of loopback streams.
    fn pair() -> (TcpStream, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    #[test]
    fn a_hello_line_is_read_whole_and_bounded_in_length_and_time() {
        let widest = Hello {
            endpoint: UdpEndpoint {
                mac: "ff:ff:ff:ff:ff:ff".parse().unwrap(),
                ip: Ipv4Addr::new(255, 255, 255, 255),
                port: u16::MAX,
            },
            ids: vec![u32::MAX; 3],
        };
        let soon = || Instant::now() + Duration::from_millis(300);
        // The widest hello of its count fits, sent in pieces.
        let (mut a, b) = pair();
        let line = widest.line();
        assert!(line.len() <= Hello::max_line(3), "{}", line.len());
        let tail = line[10..].to_owned();
        a.write_all(&line.as_bytes()[..10]).unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            a.write_all(tail.as_bytes()).unwrap();
            a
        });
        let got = read_line_within(&b, Hello::max_line(3), soon()).unwrap();
        assert_eq!(Hello::parse(&got), Ok(widest.clone()));
        drop(writer.join().unwrap());
        // A line with no end is refused once past the bound, not read on.
        let (mut a, b) = pair();
        a.write_all(&[b'A'; 4096]).unwrap();
        let e = read_line_within(&b, Hello::max_line(1), soon()).unwrap_err();
        assert!(matches!(e, BootstrapError::BadHello { .. }), "{e}");
        // A peer that sends part of a line and waits is cut at the
        // deadline, however it trickles.
        let (mut a, b) = pair();
        a.write_all(b"starwire-dpdk-hello 1").unwrap();
        let t = Instant::now();
        let e = read_line_within(&b, Hello::max_line(1), soon()).unwrap_err();
        assert!(e.to_string().contains("no hello line within"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5));
        // One that closes first.
        let (a, b) = pair();
        drop(a);
        let e = read_line_within(&b, Hello::max_line(1), soon()).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
    }
}

//! The bootstrap over TCP: before any datagram flows, the two ends of a
//! connection tell each other, over a TCP stream they already share, the
//! MAC, IPv4 address and UDP port their packets go to and the connection
//! ids to address. Each end writes one line and reads the peer's:
//!
//! ```text
//! starwire-dpdk-hello 1 MAC IP PORT ID,ID,...
//! ```
//!
//! A link may carry connections to several peers: it reads each
//! datagram's `src_conn` (our connection's id) to pick the destination
//! (`DpdkLink::add_peer`).

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

use starwire_datagram::udp::UdpEndpoint;
use starwire_datagram::{DatagramDriver, DatagramLink, Impaired, StreamBootstrap};
use starwire_transport::{ConnId, TransportError};
use thiserror::Error;

use crate::link::DpdkLink;

/// Magic word of a bootstrap line.
const HELLO: &str = "starwire-dpdk-hello";
/// Bootstrap protocol version.
const HELLO_VERSION: u32 = 1;
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

/// What each end tells the other over the bootstrap connection: where its
/// datagrams go and the connection ids to address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The sender's MAC, IPv4 address and UDP port.
    pub endpoint: UdpEndpoint,
    /// Its connection ids, in connection order.
    pub ids: Vec<u32>,
}

impl Hello {
    /// The longest line a hello of `n` connection ids can be: the fixed
    /// fields at their widest, and `n` ids of ten digits and a comma.
    pub fn max_line(n: usize) -> usize {
        const FIXED: usize = HELLO.len()
            + " 4294967295 ".len()
            + "ff:ff:ff:ff:ff:ff 255.255.255.255 65535 - \n".len();
        FIXED.saturating_add(n.saturating_mul(11))
    }

    /// The line that carries this hello, with its end.
    pub fn line(&self) -> String {
        let ids: Vec<String> = self.ids.iter().map(u32::to_string).collect();
        format!(
            "{HELLO} {HELLO_VERSION} {} {} {} {}\n",
            self.endpoint.mac,
            self.endpoint.ip,
            self.endpoint.port,
            if ids.is_empty() {
                "-".to_owned()
            } else {
                ids.join(",")
            }
        )
    }

    /// Parse a hello line.
    pub fn parse(line: &str) -> Result<Self, BootstrapError> {
        let bad = |why: &str| BootstrapError::BadHello {
            line: line.trim_end().to_owned(),
            why: why.to_owned(),
        };
        let w: Vec<&str> = line.split_whitespace().collect();
        let [magic, version, mac, ip, port, ids] = w[..] else {
            return Err(bad("expected 6 fields"));
        };
        if magic != HELLO || version != HELLO_VERSION.to_string() {
            return Err(bad("not a starwire DPDK hello of this version"));
        }
        let ids = if ids == "-" {
            Vec::new()
        } else {
            ids.split(',')
                .map(|x| x.parse::<u32>().map_err(|_| bad("connection id")))
                .collect::<Result<_, _>>()?
        };
        Ok(Hello {
            endpoint: UdpEndpoint {
                mac: mac.parse().map_err(|e| bad(&format!("{e}")))?,
                ip: ip.parse().map_err(|_| bad("IPv4 address"))?,
                port: port.parse().map_err(|_| bad("UDP port"))?,
            },
            ids,
        })
    }
}

/// The peer's hello line (up to and without its newline), read within
/// `deadline` and at most `max` bytes long: the stream comes from a peer
/// not yet authenticated, and the read runs on a shard's reactor, so
/// neither a line without end nor one trickled in may hold it longer.
/// The peer writes nothing after its line; bytes past it are dropped
/// with the stream.
fn read_line_within(
    mut stream: &TcpStream,
    max: usize,
    deadline: Instant,
) -> Result<String, BootstrapError> {
    let mut line = Vec::with_capacity(max.min(4096));
    let mut chunk = [0u8; 512];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                BootstrapError::Io(format!(
                    "no hello line within {} s",
                    BOOTSTRAP_TIMEOUT.as_secs()
                ))
            })?;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| BootstrapError::Io(e.to_string()))?;
        let got = match stream.read(&mut chunk) {
            Ok(0) => {
                return Err(BootstrapError::Io(
                    "the peer closed before its hello".into(),
                ))
            }
            Ok(got) => got,
            // A read timed out (the deadline passed) or was interrupted:
            // the deadline check above decides.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::Interrupted
                        | std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => return Err(BootstrapError::Io(e.to_string())),
        };
        let end = chunk[..got].iter().position(|&b| b == b'\n');
        line.extend_from_slice(&chunk[..end.unwrap_or(got)]);
        if line.len() > max {
            return Err(BootstrapError::BadHello {
                line: String::from_utf8_lossy(&line[..64.min(line.len())]).into_owned(),
                why: format!("longer than the {max} bytes a hello can be"),
            });
        }
        if end.is_some() {
            return String::from_utf8(line).map_err(|e| BootstrapError::BadHello {
                line: String::from_utf8_lossy(e.as_bytes()).into_owned(),
                why: "not UTF-8".into(),
            });
        }
    }
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
        attach_one(driver, &stream)
    }
}

/// Bootstrap one connection on `driver` over `stream` (what
/// `attach_stream` does; for links under a fault injector too).
pub fn attach_one<L: OnDpdk>(
    driver: &mut DatagramDriver<L>,
    stream: &TcpStream,
) -> Result<ConnId, TransportError> {
    let ids = bootstrap(driver, stream, 1)?;
    ids.first()
        .copied()
        .ok_or_else(|| TransportError::Link("DPDK bootstrap gave no connection".into()))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn hello_lines_round_trip_and_refuse_garbage() {
        let h = Hello {
            endpoint: UdpEndpoint {
                mac: "02:00:00:00:00:07".parse().unwrap(),
                ip: Ipv4Addr::new(10, 1, 2, 3),
                port: 20001,
            },
            ids: vec![0, 1, 1 << 20],
        };
        assert_eq!(Hello::parse(&h.line()), Ok(h.clone()));
        let none = Hello { ids: vec![], ..h };
        assert_eq!(Hello::parse(&none.line()), Ok(none));
        for bad in [
            "",
            "starwire-dpdk-hello 2 02:00:00:00:00:07 10.1.2.3 1 0",
            "starwire-dpdk-hello 1 02:00:00:00:00 10.1.2.3 1 0",
            "starwire-dpdk-hello 1 02:00:00:00:00:07 10.1.2 1 0",
            "starwire-dpdk-hello 1 02:00:00:00:00:07 10.1.2.3 70000 0",
            "starwire-dpdk-hello 1 02:00:00:00:00:07 10.1.2.3 1 0,x",
        ] {
            assert!(
                matches!(Hello::parse(bad), Err(BootstrapError::BadHello { .. })),
                "{bad}"
            );
        }
    }

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

//! The bootstrap hello of a UDP datagram link (the DPDK backend's): before
//! any datagram flows, each end of a connection writes one line over a TCP
//! stream the two already share, telling the other the MAC, IPv4 address
//! and UDP port its packets go to and the connection ids to address:
//!
//! ```text
//! starwire-dpdk-hello 1 MAC IP PORT ID,ID,...
//! ```
//!
//! (`-` for no ids). The stream comes from a peer not yet authenticated,
//! so [`LineReader`] takes its bytes only up to the longest line a hello
//! can be ([`Hello::max_line`]). Here, without DPDK, so that the
//! `fuzz-udp` target reaches the parser and the reader; the exchange
//! itself is `starwire_dpdk::bootstrap`.

use thiserror::Error;

use crate::udp::UdpEndpoint;

/// Magic word of a bootstrap line.
const HELLO: &str = "starwire-dpdk-hello";
/// Bootstrap protocol version.
const HELLO_VERSION: u32 = 1;
/// Bytes of a refused line kept in its error.
const QUOTED: usize = 64;

/// A peer's line that is not a hello of this version.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("bad DPDK bootstrap line {line:?}: {why}")]
pub struct HelloError {
    /// The line, without its end; from the reader, at most its first
    /// 64 bytes, invalid UTF-8 replaced.
    pub line: String,
    /// What is wrong with it.
    pub why: String,
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

    /// Parse a hello line (with or without its end).
    pub fn parse(line: &str) -> Result<Self, HelloError> {
        let bad = |why: &str| HelloError {
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

/// The peer's hello line as it arrives, at most `max` bytes long. The
/// peer writes nothing after its line; bytes past it are dropped with the
/// stream.
#[derive(Debug)]
pub struct LineReader {
    line: Vec<u8>,
    max: usize,
}

impl LineReader {
    /// A reader of a line of at most `max` bytes (its end not counted).
    pub fn new(max: usize) -> Self {
        Self {
            line: Vec::new(),
            max,
        }
    }

    /// Take `bytes` read from the stream: the line (without its newline)
    /// once it is whole; an error once it is longer than `max` or whole
    /// and not UTF-8. After an error the reader is done with: it keeps
    /// only what the error quoted.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Option<String>, HelloError> {
        let end = bytes.iter().position(|&b| b == b'\n');
        let take = &bytes[..end.unwrap_or(bytes.len())];
        if self.line.len().saturating_add(take.len()) > self.max {
            let room = QUOTED.saturating_sub(self.line.len()).min(take.len());
            self.line.extend_from_slice(&take[..room]);
            return Err(HelloError {
                line: String::from_utf8_lossy(&self.line[..QUOTED.min(self.line.len())])
                    .into_owned(),
                why: format!("longer than the {} bytes a hello can be", self.max),
            });
        }
        self.line.extend_from_slice(take);
        if end.is_none() {
            return Ok(None);
        }
        String::from_utf8(std::mem::take(&mut self.line))
            .map(Some)
            .map_err(|e| {
                let b = e.as_bytes();
                HelloError {
                    line: String::from_utf8_lossy(&b[..QUOTED.min(b.len())]).into_owned(),
                    why: "not UTF-8".into(),
                }
            })
    }
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
            assert!(Hello::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_widest_hello_fits_its_bound_and_a_longer_line_is_refused_unbuffered() {
        let widest = Hello {
            endpoint: UdpEndpoint {
                mac: "ff:ff:ff:ff:ff:ff".parse().unwrap(),
                ip: Ipv4Addr::new(255, 255, 255, 255),
                port: u16::MAX,
            },
            ids: vec![u32::MAX; 3],
        };
        let line = widest.line();
        assert!(line.len() <= Hello::max_line(3), "{}", line.len());
        // In pieces, whole.
        let mut r = LineReader::new(Hello::max_line(3));
        let (a, b) = line.as_bytes().split_at(10);
        assert_eq!(r.feed(a), Ok(None));
        assert_eq!(
            r.feed(b).unwrap().map(|l| Hello::parse(&l)),
            Some(Ok(widest))
        );
        // A line with no end: refused past the bound, keeping only what
        // it quotes.
        let mut r = LineReader::new(100);
        assert_eq!(r.feed(&[b'A'; 60]), Ok(None));
        let e = r.feed(&[b'A'; 1 << 20]).unwrap_err();
        assert!(e.why.contains("longer than the 100 bytes"), "{e}");
        assert_eq!(e.line.len(), QUOTED);
        assert!(r.line.len() <= QUOTED.max(60));
        // Not UTF-8.
        let mut r = LineReader::new(100);
        assert_eq!(r.feed(b"\xff\xfe\n").unwrap_err().why, "not UTF-8");
    }
}

//! Ethernet II + IPv4 + UDP: the encapsulation the DPDK backend puts
//! around each datagram, so its packets are routable and a kernel UDP
//! socket can receive them.
//!
//! Like smoltcp's `wire`: [`EthernetFrame`], [`Ipv4Packet`] and
//! [`UdpPacket`] are views over bytes whose `new_checked` validates every
//! length before a field is read, with getters and setters in network
//! byte order; [`UdpRepr`] is the plain description of a whole packet
//! with [`parse`](UdpRepr::parse), [`emit`](UdpRepr::emit) and
//! [`buffer_len`](UdpRepr::buffer_len). [`classify`] is the receive
//! filter: EtherType IPv4, protocol UDP, not a fragment, and the
//! destination port, read without checking more than it needs.
//!
//! Emitted packets carry a correct IPv4 header checksum and a correct UDP
//! checksum. [`UdpRepr::parse`] checks the IPv4 header checksum and every
//! length but not the UDP checksum: the reliability layer's CRC-32C
//! covers each datagram already, so the receive path reads the payload
//! once, not twice ([`UdpPacket::verify_checksum`] is there for tests and
//! tools).

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use thiserror::Error;

/// Bytes of an Ethernet II header (no VLAN tag).
pub const ETHERNET_HEADER_LEN: usize = 14;
/// Bytes of an IPv4 header without options (the only kind emitted).
pub const IPV4_HEADER_LEN: usize = 20;
/// Bytes of a UDP header.
pub const UDP_HEADER_LEN: usize = 8;
/// Bytes in front of the payload of an emitted packet.
pub const HEADERS_LEN: usize = ETHERNET_HEADER_LEN + IPV4_HEADER_LEN + UDP_HEADER_LEN;
/// Bytes of IP and UDP headers inside the IP MTU: the datagram payload an
/// IP MTU of `mtu` leaves is `mtu - IP_UDP_OVERHEAD`.
pub const IP_UDP_OVERHEAD: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN;
/// EtherType of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// IP protocol number of UDP.
pub const IP_PROTO_UDP: u8 = 17;
/// TTL of emitted packets.
pub const DEFAULT_TTL: u8 = 64;

/// A packet that is not a well-formed Ethernet/IPv4/UDP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum UdpFrameError {
    /// Shorter than a header or than a length field says.
    #[error("truncated {0} header or payload")]
    Truncated(&'static str),
    /// The EtherType is not IPv4.
    #[error("EtherType {0:#06x} is not IPv4")]
    NotIpv4(u16),
    /// The IP version nibble is not 4.
    #[error("IP version {0} is not 4")]
    IpVersion(u8),
    /// The IPv4 header length or total length is inconsistent.
    #[error("bad IPv4 length field")]
    Ipv4Length,
    /// The IPv4 header checksum does not match.
    #[error("bad IPv4 header checksum")]
    Ipv4Checksum,
    /// A fragment (more-fragments set or a non-zero offset).
    #[error("IPv4 fragment")]
    Fragment,
    /// The IP protocol is not UDP.
    #[error("IP protocol {0} is not UDP")]
    NotUdp(u8),
    /// The UDP length field is inconsistent with the IP length.
    #[error("bad UDP length field")]
    UdpLength,
}

/// A MAC address.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// ff:ff:ff:ff:ff:ff.
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

/// A MAC address that is not six `:`-separated hex bytes.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0:?} is not a MAC address (aa:bb:cc:dd:ee:ff)")]
pub struct MacAddrError(String);

impl FromStr for MacAddr {
    type Err = MacAddrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let p = parts.next().ok_or_else(|| MacAddrError(s.to_owned()))?;
            if p.is_empty() || p.len() > 2 {
                return Err(MacAddrError(s.to_owned()));
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| MacAddrError(s.to_owned()))?;
        }
        if parts.next().is_some() {
            return Err(MacAddrError(s.to_owned()));
        }
        Ok(MacAddr(out))
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// The Internet checksum (RFC 1071) arithmetic.
pub mod checksum {
    /// Add `data` to the one's-complement sum `acc` (not folded), as
    /// big-endian 16-bit words, an odd last byte padded with zero.
    pub fn add(mut acc: u64, data: &[u8]) -> u64 {
        let mut words = data.chunks_exact(4);
        for w in &mut words {
            acc += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
        }
        let rest = words.remainder();
        let mut tail = [0u8; 4];
        tail[..rest.len()].copy_from_slice(rest);
        acc + u64::from(u32::from_be_bytes(tail))
    }

    /// Fold a sum to 16 bits and complement it.
    pub fn finish(mut acc: u64) -> u16 {
        while acc >> 16 != 0 {
            acc = (acc & 0xffff) + (acc >> 16);
        }
        !(acc as u16)
    }

    /// The checksum of `data`.
    pub fn of(data: &[u8]) -> u16 {
        finish(add(0, data))
    }
}

/// A view of an Ethernet II frame.
#[derive(Debug, Clone)]
pub struct EthernetFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    /// A view without checks; field reads may panic on a short buffer.
    pub fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer long enough for the header.
    pub fn new_checked(buffer: T) -> Result<Self, UdpFrameError> {
        if buffer.as_ref().len() < ETHERNET_HEADER_LEN {
            return Err(UdpFrameError::Truncated("Ethernet"));
        }
        Ok(Self { buffer })
    }

    /// Destination MAC.
    pub fn dst(&self) -> MacAddr {
        let mut a = [0; 6];
        a.copy_from_slice(&self.buffer.as_ref()[0..6]);
        MacAddr(a)
    }

    /// Source MAC.
    pub fn src(&self) -> MacAddr {
        let mut a = [0; 6];
        a.copy_from_slice(&self.buffer.as_ref()[6..12]);
        MacAddr(a)
    }

    /// EtherType.
    pub fn ethertype(&self) -> u16 {
        be16(self.buffer.as_ref(), 12)
    }

    /// What follows the header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[ETHERNET_HEADER_LEN..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    /// Write the header fields.
    pub fn set_header(&mut self, dst: MacAddr, src: MacAddr, ethertype: u16) {
        let b = self.buffer.as_mut();
        b[0..6].copy_from_slice(&dst.0);
        b[6..12].copy_from_slice(&src.0);
        put16(b, 12, ethertype);
    }
}

/// A view of an IPv4 packet.
#[derive(Debug, Clone)]
pub struct Ipv4Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    /// A view without checks; field reads may panic on a short buffer.
    pub fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view whose version is 4 and whose header and total lengths fit
    /// the buffer (bytes past the total length are link padding).
    pub fn new_checked(buffer: T) -> Result<Self, UdpFrameError> {
        let b = buffer.as_ref();
        if b.len() < IPV4_HEADER_LEN {
            return Err(UdpFrameError::Truncated("IPv4"));
        }
        let p = Self { buffer };
        if p.version() != 4 {
            return Err(UdpFrameError::IpVersion(p.version()));
        }
        let hl = p.header_len();
        let total = usize::from(p.total_len());
        if hl < IPV4_HEADER_LEN || total < hl {
            return Err(UdpFrameError::Ipv4Length);
        }
        if total > p.buffer.as_ref().len() {
            return Err(UdpFrameError::Truncated("IPv4"));
        }
        Ok(p)
    }

    /// IP version.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[0] >> 4
    }

    /// Header length in bytes.
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[0] & 0x0f) * 4
    }

    /// Total length (header and payload).
    pub fn total_len(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    /// More-fragments flag set or a non-zero fragment offset.
    pub fn is_fragment(&self) -> bool {
        be16(self.buffer.as_ref(), 6) & 0x3fff != 0
    }

    /// Time to live.
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[8]
    }

    /// Protocol of the payload.
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[9]
    }

    /// Source address.
    pub fn src(&self) -> Ipv4Addr {
        let b = self.buffer.as_ref();
        Ipv4Addr::new(b[12], b[13], b[14], b[15])
    }

    /// Destination address.
    pub fn dst(&self) -> Ipv4Addr {
        let b = self.buffer.as_ref();
        Ipv4Addr::new(b[16], b[17], b[18], b[19])
    }

    /// Whether the header checksum is right.
    pub fn verify_checksum(&self) -> bool {
        checksum::of(&self.buffer.as_ref()[..self.header_len()]) == 0
    }

    /// The payload, up to the total length.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..usize::from(self.total_len())]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    /// Write an option-less header (don't-fragment, identification 0 as
    /// RFC 6864 allows for atomic datagrams) with its checksum.
    pub fn set_header(&mut self, src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, payload_len: u16) {
        let b = self.buffer.as_mut();
        b[0] = 0x45;
        b[1] = 0;
        put16(b, 2, IPV4_HEADER_LEN as u16 + payload_len);
        put16(b, 4, 0);
        put16(b, 6, 0x4000);
        b[8] = DEFAULT_TTL;
        b[9] = protocol;
        put16(b, 10, 0);
        b[12..16].copy_from_slice(&src.octets());
        b[16..20].copy_from_slice(&dst.octets());
        let sum = checksum::of(&b[..IPV4_HEADER_LEN]);
        put16(b, 10, sum);
    }
}

/// A view of a UDP datagram.
#[derive(Debug, Clone)]
pub struct UdpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    /// A view without checks; field reads may panic on a short buffer.
    pub fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view whose length field covers the header and fits the buffer.
    pub fn new_checked(buffer: T) -> Result<Self, UdpFrameError> {
        let b = buffer.as_ref();
        if b.len() < UDP_HEADER_LEN {
            return Err(UdpFrameError::Truncated("UDP"));
        }
        let len = usize::from(be16(b, 4));
        if len < UDP_HEADER_LEN || len > b.len() {
            return Err(UdpFrameError::UdpLength);
        }
        Ok(Self { buffer })
    }

    /// Source port.
    pub fn src_port(&self) -> u16 {
        be16(self.buffer.as_ref(), 0)
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    /// Length of header and payload.
    pub fn len(&self) -> u16 {
        be16(self.buffer.as_ref(), 4)
    }

    /// True when the length field says there is no payload.
    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) <= UDP_HEADER_LEN
    }

    /// The checksum field (0: none sent).
    pub fn checksum(&self) -> u16 {
        be16(self.buffer.as_ref(), 6)
    }

    /// The payload, up to the length field.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[UDP_HEADER_LEN..usize::from(self.len())]
    }

    /// Whether the checksum is right for a datagram between `src` and
    /// `dst` (a zero checksum, "none", passes).
    pub fn verify_checksum(&self, src: Ipv4Addr, dst: Ipv4Addr) -> bool {
        if self.checksum() == 0 {
            return true;
        }
        let len = self.len();
        let acc = pseudo_header(src, dst, len);
        checksum::finish(checksum::add(
            acc,
            &self.buffer.as_ref()[..usize::from(len)],
        )) == 0
    }
}

/// The one's-complement sum of the UDP pseudo-header.
fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, udp_len: u16) -> u64 {
    let mut p = [0u8; 12];
    p[0..4].copy_from_slice(&src.octets());
    p[4..8].copy_from_slice(&dst.octets());
    p[9] = IP_PROTO_UDP;
    p[10..12].copy_from_slice(&udp_len.to_be_bytes());
    checksum::add(0, &p)
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UdpPacket<T> {
    /// Write the header for a payload of `payload_len` bytes already in
    /// place after it, with its checksum over the pseudo-header of `src`
    /// and `dst`.
    pub fn set_header(&mut self, src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), payload_len: u16) {
        let len = UDP_HEADER_LEN as u16 + payload_len;
        let b = self.buffer.as_mut();
        put16(b, 0, src.1);
        put16(b, 2, dst.1);
        put16(b, 4, len);
        put16(b, 6, 0);
        let sum = checksum::finish(checksum::add(
            pseudo_header(src.0, dst.0, len),
            &b[..usize::from(len)],
        ));
        // 0 means "no checksum"; a computed 0 is sent as its other form.
        put16(b, 6, if sum == 0 { 0xffff } else { sum });
    }
}

/// One end of a UDP flow: where a packet comes from or goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpEndpoint {
    /// Ethernet address.
    pub mac: MacAddr,
    /// IPv4 address.
    pub ip: Ipv4Addr,
    /// UDP port.
    pub port: u16,
}

impl fmt::Display for UdpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} ({})", self.ip, self.port, self.mac)
    }
}

/// A whole Ethernet/IPv4/UDP packet, described.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpRepr {
    /// Sender.
    pub src: UdpEndpoint,
    /// Receiver.
    pub dst: UdpEndpoint,
    /// Bytes of UDP payload.
    pub payload_len: usize,
}

impl UdpRepr {
    /// Parse a packet: every length checked, the IPv4 header checksum
    /// verified, fragments refused. Returns the description and the UDP
    /// payload.
    pub fn parse(packet: &[u8]) -> Result<(Self, &[u8]), UdpFrameError> {
        let eth = EthernetFrame::new_checked(packet)?;
        if eth.ethertype() != ETHERTYPE_IPV4 {
            return Err(UdpFrameError::NotIpv4(eth.ethertype()));
        }
        let ip = Ipv4Packet::new_checked(eth.payload())?;
        if !ip.verify_checksum() {
            return Err(UdpFrameError::Ipv4Checksum);
        }
        if ip.is_fragment() {
            return Err(UdpFrameError::Fragment);
        }
        if ip.protocol() != IP_PROTO_UDP {
            return Err(UdpFrameError::NotUdp(ip.protocol()));
        }
        let ip_payload = ip.payload();
        let udp = UdpPacket::new_checked(ip_payload)?;
        if usize::from(udp.len()) != ip_payload.len() {
            return Err(UdpFrameError::UdpLength);
        }
        let start = ETHERNET_HEADER_LEN + ip.header_len() + UDP_HEADER_LEN;
        let payload = &packet[start..ETHERNET_HEADER_LEN + usize::from(ip.total_len())];
        let repr = UdpRepr {
            src: UdpEndpoint {
                mac: eth.src(),
                ip: ip.src(),
                port: udp.src_port(),
            },
            dst: UdpEndpoint {
                mac: eth.dst(),
                ip: ip.dst(),
                port: udp.dst_port(),
            },
            payload_len: payload.len(),
        };
        Ok((repr, payload))
    }

    /// Bytes of the whole packet.
    pub fn buffer_len(&self) -> usize {
        HEADERS_LEN + self.payload_len
    }

    /// Write the headers into `buf[..HEADERS_LEN]` for the payload already
    /// at `buf[HEADERS_LEN..buffer_len()]`, checksums included.
    ///
    /// # Panics
    /// If `buf` is shorter than [`buffer_len`](Self::buffer_len) or the
    /// payload does not fit an IPv4 packet (65507 bytes): the callers size
    /// both from the link MTU.
    pub fn emit(&self, buf: &mut [u8]) {
        let len = self.buffer_len();
        assert!(
            self.payload_len <= usize::from(u16::MAX) - IP_UDP_OVERHEAD && buf.len() >= len,
            "UdpRepr::emit: {} payload bytes into a buffer of {}",
            self.payload_len,
            buf.len()
        );
        let buf = &mut buf[..len];
        let payload_len = self.payload_len as u16;
        EthernetFrame::new_unchecked(&mut buf[..ETHERNET_HEADER_LEN]).set_header(
            self.dst.mac,
            self.src.mac,
            ETHERTYPE_IPV4,
        );
        let ip = &mut buf[ETHERNET_HEADER_LEN..];
        UdpPacket::new_unchecked(&mut ip[IPV4_HEADER_LEN..]).set_header(
            (self.src.ip, self.src.port),
            (self.dst.ip, self.dst.port),
            payload_len,
        );
        Ipv4Packet::new_unchecked(&mut ip[..IPV4_HEADER_LEN]).set_header(
            self.src.ip,
            self.dst.ip,
            IP_PROTO_UDP,
            UDP_HEADER_LEN as u16 + payload_len,
        );
    }
}

/// The receive filter: the UDP destination port of an IPv4 packet that is
/// not a fragment, or `None` for anything else (another EtherType or
/// protocol, a fragment, a header cut short). Reads only the fields it
/// names; [`UdpRepr::parse`] checks the rest.
pub fn classify(packet: &[u8]) -> Option<u16> {
    if packet.len() < ETHERNET_HEADER_LEN + IPV4_HEADER_LEN {
        return None;
    }
    if be16(packet, 12) != ETHERTYPE_IPV4 {
        return None;
    }
    let ip = Ipv4Packet::new_unchecked(&packet[ETHERNET_HEADER_LEN..]);
    if ip.version() != 4 || ip.protocol() != IP_PROTO_UDP || ip.is_fragment() {
        return None;
    }
    let at = ETHERNET_HEADER_LEN + ip.header_len() + 2;
    (ip.header_len() >= IPV4_HEADER_LEN && packet.len() >= at + 2).then(|| be16(packet, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr(payload_len: usize) -> UdpRepr {
        UdpRepr {
            src: UdpEndpoint {
                mac: MacAddr([2, 0, 0, 0, 0, 1]),
                ip: Ipv4Addr::new(10, 7, 0, 1),
                port: 40000,
            },
            dst: UdpEndpoint {
                mac: MacAddr([2, 0, 0, 0, 0, 2]),
                ip: Ipv4Addr::new(10, 7, 0, 2),
                port: 9000,
            },
            payload_len,
        }
    }

    fn packet(r: &UdpRepr, payload: &[u8]) -> Vec<u8> {
        let mut b = vec![0; r.buffer_len()];
        b[HEADERS_LEN..].copy_from_slice(payload);
        r.emit(&mut b);
        b
    }

    /// "hi\n" from 192.168.0.1:33000 to 192.168.0.2:5000, its checksums
    /// worked out apart from this code (RFC 1071 over the header, and over
    /// the pseudo-header and datagram).
    const REFERENCE: [u8; 45] = [
        0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00, // Ethernet
        0x45, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb9, 0x7a, 192, 168, 0, 1,
        192, 168, 0, 2, // IPv4
        0x80, 0xe8, 0x13, 0x88, 0x00, 0x0b, 0x77, 0xaa, // UDP
        b'h', b'i', b'\n',
    ];

    #[test]
    fn emits_what_linux_emits() {
        let r = UdpRepr {
            src: UdpEndpoint {
                mac: MacAddr([2, 0, 0, 0, 0, 1]),
                ip: Ipv4Addr::new(192, 168, 0, 1),
                port: 33000,
            },
            dst: UdpEndpoint {
                mac: MacAddr([2, 0, 0, 0, 0, 2]),
                ip: Ipv4Addr::new(192, 168, 0, 2),
                port: 5000,
            },
            payload_len: 3,
        };
        assert_eq!(packet(&r, b"hi\n"), REFERENCE);
        let (parsed, payload) = UdpRepr::parse(&REFERENCE).unwrap();
        assert_eq!((parsed, payload), (r, &b"hi\n"[..]));
        let udp = UdpPacket::new_checked(&REFERENCE[34..]).unwrap();
        assert!(udp.verify_checksum(r.src.ip, r.dst.ip));
    }

    #[test]
    fn round_trips_every_length() {
        for len in [0, 1, 2, 3, 4, 5, 63, 1458, 1472, 9000] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let r = repr(len);
            let b = packet(&r, &payload);
            assert_eq!(b.len(), HEADERS_LEN + len);
            let (p, pl) = UdpRepr::parse(&b).unwrap();
            assert_eq!((p, pl), (r, &payload[..]));
            assert_eq!(classify(&b), Some(9000));
            let ip = Ipv4Packet::new_checked(&b[14..]).unwrap();
            assert!(ip.verify_checksum());
            let udp = UdpPacket::new_checked(ip.payload()).unwrap();
            assert!(udp.verify_checksum(r.src.ip, r.dst.ip), "len {len}");
            // Link padding after the IP packet is ignored.
            let mut padded = b.clone();
            padded.extend_from_slice(&[0xee; 20]);
            assert_eq!(UdpRepr::parse(&padded).unwrap().1, &payload[..]);
        }
    }

    #[test]
    fn refuses_what_is_not_ours() {
        let good = packet(&repr(10), &[1; 10]);
        let with = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            b
        };
        assert_eq!(
            UdpRepr::parse(&good[..13]).unwrap_err(),
            UdpFrameError::Truncated("Ethernet")
        );
        assert_eq!(
            UdpRepr::parse(&with(12, 0x86)).unwrap_err(),
            UdpFrameError::NotIpv4(0x8600)
        );
        assert_eq!(classify(&with(12, 0x86)), None);
        assert_eq!(
            UdpRepr::parse(&with(14, 0x65)).unwrap_err(),
            UdpFrameError::IpVersion(6)
        );
        assert_eq!(
            UdpRepr::parse(&with(14, 0x44)).unwrap_err(),
            UdpFrameError::Ipv4Length
        );
        assert_eq!(
            UdpRepr::parse(&with(17, 200)).unwrap_err(),
            UdpFrameError::Truncated("IPv4")
        );
        assert_eq!(
            UdpRepr::parse(&with(22, 63)).unwrap_err(),
            UdpFrameError::Ipv4Checksum
        );
        // A corrupted payload byte passes parse (CRC-32C's job) but not the
        // UDP checksum.
        let bad = with(50, 2);
        assert!(UdpRepr::parse(&bad).is_ok());
        let ip = Ipv4Packet::new_checked(&bad[14..]).unwrap();
        let r = repr(10);
        assert!(!UdpPacket::new_checked(ip.payload())
            .unwrap()
            .verify_checksum(r.src.ip, r.dst.ip));
        assert_eq!(
            UdpRepr::parse(&good[..good.len() - 1]).unwrap_err(),
            UdpFrameError::Truncated("IPv4")
        );
    }

    /// Change a header byte and fix the IPv4 checksum, so the check under
    /// test is the one that fails.
    fn with_fixed(good: &[u8], at: usize, v: u8) -> Vec<u8> {
        let mut b = good.to_vec();
        b[at] = v;
        b[24] = 0;
        b[25] = 0;
        let sum = checksum::of(&b[14..34]);
        b[24..26].copy_from_slice(&sum.to_be_bytes());
        b
    }

    #[test]
    fn refuses_fragments_other_protocols_and_bad_udp_lengths() {
        let good = packet(&repr(10), &[1; 10]);
        assert_eq!(
            UdpRepr::parse(&with_fixed(&good, 20, 0x60)).unwrap_err(),
            UdpFrameError::Fragment
        );
        assert_eq!(classify(&with_fixed(&good, 20, 0x60)), None);
        assert_eq!(
            UdpRepr::parse(&with_fixed(&good, 21, 1)).unwrap_err(),
            UdpFrameError::Fragment
        );
        assert_eq!(
            UdpRepr::parse(&with_fixed(&good, 23, 6)).unwrap_err(),
            UdpFrameError::NotUdp(6)
        );
        assert_eq!(classify(&with_fixed(&good, 23, 6)), None);
        let mut short_udp = good.clone();
        short_udp[39] = 7;
        assert_eq!(
            UdpRepr::parse(&short_udp).unwrap_err(),
            UdpFrameError::UdpLength
        );
        let mut long_udp = good.clone();
        long_udp[39] = 19;
        assert_eq!(
            UdpRepr::parse(&long_udp).unwrap_err(),
            UdpFrameError::UdpLength
        );
    }

    #[test]
    fn parses_arbitrary_bytes_without_panicking() {
        let good = packet(&repr(40), &[9; 40]);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut b = good.clone();
            b.truncate((x % (good.len() as u64 + 1)) as usize);
            for k in 0..(x >> 61) {
                if !b.is_empty() {
                    let i = ((x >> (k * 5)) as usize) % b.len();
                    b[i] ^= (x >> 32) as u8 | 1;
                }
            }
            let _ = UdpRepr::parse(&b);
            let _ = classify(&b);
        }
    }

    #[test]
    fn mac_addresses_parse_and_print() {
        let m: MacAddr = "02:0a:FF:00:1:ee".parse().unwrap();
        assert_eq!(m, MacAddr([2, 0x0a, 0xff, 0, 1, 0xee]));
        assert_eq!(m.to_string(), "02:0a:ff:00:01:ee");
        for bad in [
            "",
            "02:0a:ff:00:01",
            "02:0a:ff:00:01:ee:01",
            "0x:00:00:00:00:00",
            "123:0:0:0:0:0",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad}");
        }
    }
}

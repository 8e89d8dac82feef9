//! ARP for IPv4 over Ethernet (RFC 826): what a DPDK port needs so that a
//! kernel peer finds our MAC by itself. A port answers each request for
//! its IPv4 address ([`ArpRepr::answer`]); nothing else of ARP is needed,
//! since the two ends of a starwire connection learn each other's MAC in
//! their bootstrap.
//!
//! [`ArpRepr`] is the plain description of a whole frame, Ethernet header
//! included, with [`parse`](ArpRepr::parse) (every length and fixed field
//! checked before anything is read), [`emit`](ArpRepr::emit) and
//! [`buffer_len`](ArpRepr::buffer_len), like [`crate::udp`]'s.

use std::net::Ipv4Addr;

use thiserror::Error;

use crate::udp::{MacAddr, ETHERNET_HEADER_LEN};

/// EtherType of ARP.
pub const ETHERTYPE_ARP: u16 = 0x0806;
/// Bytes of an ARP message for IPv4 over Ethernet.
pub const ARP_LEN: usize = 28;
/// Ethernet's shortest frame without its FCS: emitted frames are padded
/// to it.
pub const MIN_FRAME_LEN: usize = 60;
/// Hardware type Ethernet.
const HTYPE_ETHERNET: u16 = 1;
/// Protocol type IPv4.
const PTYPE_IPV4: u16 = 0x0800;

/// A frame that is not an ARP message for IPv4 over Ethernet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ArpError {
    /// Shorter than an Ethernet header and an ARP message.
    #[error("truncated ARP frame")]
    Truncated,
    /// The EtherType is not ARP.
    #[error("EtherType {0:#06x} is not ARP")]
    NotArp(u16),
    /// Not Ethernet hardware addresses and IPv4 protocol addresses.
    #[error("ARP for hardware type {htype}, protocol {ptype:#06x} (lengths {hlen}, {plen})")]
    Unsupported {
        /// Hardware type.
        htype: u16,
        /// Protocol type.
        ptype: u16,
        /// Hardware address length.
        hlen: u8,
        /// Protocol address length.
        plen: u8,
    },
    /// An operation other than request (1) or reply (2).
    #[error("ARP operation {0}")]
    Operation(u16),
}

/// What an ARP message asks or tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArpOp {
    /// Who has `target_ip`? Tell `sender_ip`.
    Request,
    /// `sender_ip` is at `sender_mac`.
    Reply,
}

/// An ARP message for IPv4 over Ethernet, in its Ethernet frame: the
/// frame's source is the sender's MAC; its destination is the target's
/// MAC for a reply, broadcast for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArpRepr {
    /// Request or reply.
    pub op: ArpOp,
    /// The sender's MAC.
    pub sender_mac: MacAddr,
    /// The sender's IPv4 address.
    pub sender_ip: Ipv4Addr,
    /// The target's MAC (zero in a request).
    pub target_mac: MacAddr,
    /// The target's IPv4 address.
    pub target_ip: Ipv4Addr,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn mac(b: &[u8], at: usize) -> MacAddr {
    let mut m = [0; 6];
    m.copy_from_slice(&b[at..at + 6]);
    MacAddr(m)
}

fn ip(b: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(b[at], b[at + 1], b[at + 2], b[at + 3])
}

impl ArpRepr {
    /// Parse an Ethernet frame holding an ARP message (padding after it
    /// is ignored).
    pub fn parse(frame: &[u8]) -> Result<Self, ArpError> {
        if frame.len() < ETHERNET_HEADER_LEN + ARP_LEN {
            return Err(ArpError::Truncated);
        }
        let ethertype = be16(frame, 12);
        if ethertype != ETHERTYPE_ARP {
            return Err(ArpError::NotArp(ethertype));
        }
        let a = &frame[ETHERNET_HEADER_LEN..ETHERNET_HEADER_LEN + ARP_LEN];
        let (htype, ptype, hlen, plen) = (be16(a, 0), be16(a, 2), a[4], a[5]);
        if (htype, ptype, hlen, plen) != (HTYPE_ETHERNET, PTYPE_IPV4, 6, 4) {
            return Err(ArpError::Unsupported {
                htype,
                ptype,
                hlen,
                plen,
            });
        }
        let op = match be16(a, 6) {
            1 => ArpOp::Request,
            2 => ArpOp::Reply,
            other => return Err(ArpError::Operation(other)),
        };
        Ok(Self {
            op,
            sender_mac: mac(a, 8),
            sender_ip: ip(a, 14),
            target_mac: mac(a, 18),
            target_ip: ip(a, 24),
        })
    }

    /// Bytes [`emit`](Self::emit) writes: the frame padded to
    /// [`MIN_FRAME_LEN`].
    pub fn buffer_len(&self) -> usize {
        MIN_FRAME_LEN
    }

    /// Write the frame into the first [`buffer_len`](Self::buffer_len)
    /// bytes of `buf`, padding zeroed.
    ///
    /// # Panics
    /// If `buf` is shorter than [`buffer_len`](Self::buffer_len).
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..MIN_FRAME_LEN];
        let (dst, op) = match self.op {
            ArpOp::Request => (MacAddr::BROADCAST, 1u16),
            ArpOp::Reply => (self.target_mac, 2u16),
        };
        b[0..6].copy_from_slice(&dst.0);
        b[6..12].copy_from_slice(&self.sender_mac.0);
        b[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
        let a = &mut b[ETHERNET_HEADER_LEN..];
        a[0..2].copy_from_slice(&HTYPE_ETHERNET.to_be_bytes());
        a[2..4].copy_from_slice(&PTYPE_IPV4.to_be_bytes());
        a[4] = 6;
        a[5] = 4;
        a[6..8].copy_from_slice(&op.to_be_bytes());
        a[8..14].copy_from_slice(&self.sender_mac.0);
        a[14..18].copy_from_slice(&self.sender_ip.octets());
        a[18..24].copy_from_slice(&self.target_mac.0);
        a[24..28].copy_from_slice(&self.target_ip.octets());
        a[ARP_LEN..].fill(0);
    }

    /// The reply of the host at `mac`, `ip` to this message: `Some` for a
    /// request for `ip` (from a sender with an address: a probe from
    /// 0.0.0.0 is answered too, as RFC 5227 asks), `None` otherwise.
    pub fn answer(&self, mac: MacAddr, ip: Ipv4Addr) -> Option<ArpRepr> {
        (self.op == ArpOp::Request && self.target_ip == ip).then_some(ArpRepr {
            op: ArpOp::Reply,
            sender_mac: mac,
            sender_ip: ip,
            target_mac: self.sender_mac,
            target_ip: self.sender_ip,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request from 10.0.0.2 (02:00:00:00:00:02) for 10.0.0.1, as
    /// `arping` or the kernel sends it, byte by byte.
    const REQUEST: [u8; 42] = [
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 2, 0, 0, 0, 0, 2, 0x08, 0x06, // Ethernet
        0, 1, 0x08, 0, 6, 4, 0, 1, // Ethernet/IPv4, request
        2, 0, 0, 0, 0, 2, 10, 0, 0, 2, // sender
        0, 0, 0, 0, 0, 0, 10, 0, 0, 1, // target
    ];

    #[test]
    fn a_request_for_our_address_gets_a_reply_to_its_sender() {
        let req = ArpRepr::parse(&REQUEST).unwrap();
        assert_eq!(req.op, ArpOp::Request);
        assert_eq!(req.sender_ip, Ipv4Addr::new(10, 0, 0, 2));
        let us = MacAddr([2, 0, 0, 0, 0, 1]);
        assert_eq!(req.answer(us, Ipv4Addr::new(10, 0, 0, 9)), None);
        let reply = req.answer(us, Ipv4Addr::new(10, 0, 0, 1)).unwrap();
        let mut buf = [0xaa; MIN_FRAME_LEN];
        reply.emit(&mut buf);
        let want: [u8; 42] = [
            2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x06, // to the asker
            0, 1, 0x08, 0, 6, 4, 0, 2, // reply
            2, 0, 0, 0, 0, 1, 10, 0, 0, 1, // we
            2, 0, 0, 0, 0, 2, 10, 0, 0, 2, // the asker
        ];
        assert_eq!(buf[..42], want);
        assert!(buf[42..].iter().all(|&b| b == 0), "zero padding");
        assert_eq!(ArpRepr::parse(&buf), Ok(reply));
        assert_eq!(reply.answer(us, Ipv4Addr::new(10, 0, 0, 1)), None);
    }

    #[test]
    fn every_refusal_is_typed() {
        assert_eq!(ArpRepr::parse(&REQUEST[..41]), Err(ArpError::Truncated));
        let mut b = REQUEST;
        b[13] = 0x00;
        assert_eq!(ArpRepr::parse(&b), Err(ArpError::NotArp(0x0800)));
        for (at, v) in [(15, 6u8), (17, 0xdd), (18, 8), (19, 16)] {
            let mut b = REQUEST;
            b[at] = v;
            assert!(
                matches!(ArpRepr::parse(&b), Err(ArpError::Unsupported { .. })),
                "byte {at}"
            );
        }
        let mut b = REQUEST;
        b[21] = 3;
        assert_eq!(ArpRepr::parse(&b), Err(ArpError::Operation(3)));
    }
}

//! The packet header of the reliability protocol.
//!
//! Every datagram starts with a fixed 36-byte header, little-endian:
//!
//! ```text
//! offset size field
//!  0     2    magic        "SD" (0x53 0x44)
//!  2     1    version      PACKET_VERSION
//!  3     1    flags        bit 0 DATA, bit 1 FIRST, bit 2 LAST; others 0
//!  4     4    dst_conn     the receiving end's connection id: what its driver routes by
//!  8     4    src_conn     the sending end's connection id: checked against the connected peer
//! 12     4    seq          packet sequence number (DATA packets; 0 otherwise)
//! 16     4    ack          cumulative ack: next sequence number expected from the peer
//! 20     8    sack         selective ack: bit i set = peer holds seq ack+1+i
//! 28     2    payload_len  bytes of payload after the header
//! 30     2    reserved     0
//! 32     4    checksum     CRC-32C over bytes 0..32 and the payload
//! 36     ..   payload      one fragment of a frame (DATA packets)
//! ```
//!
//! One datagram queue serves every connection of a driver, so each end
//! names its connections with ids of its own and the sender addresses the
//! receiver's (`dst_conn`), as QUIC's destination connection ids do. The
//! source id lets the receiver drop a packet that reaches the right slot
//! from the wrong peer connection.
//!
//! Bytes after `36 + payload_len` are ignored (Ethernet pads short frames).
//! Every packet carries `ack`/`sack`, so acknowledgements ride on data; a
//! packet without DATA is a standalone acknowledgement.

use thiserror::Error;

/// Size of the packet header in bytes.
pub const PACKET_HEADER_LEN: usize = 36;
/// Header bytes covered by the checksum (all but the checksum itself).
const CHECKED_LEN: usize = 32;
/// The magic bytes that open every packet.
pub const PACKET_MAGIC: [u8; 2] = *b"SD";
/// The packet format version this build speaks.
pub const PACKET_VERSION: u8 = 2;
/// Sequence numbers a `sack` bitmap covers beyond the cumulative ack.
pub const SACK_BITS: u32 = 64;

/// The `dst_conn` field of a packet's header, read without any check (a
/// link that sends each connection's packets to that connection's peer
/// reads it from the packets it is handed); `None` if `packet` is too
/// short to hold it.
pub fn peek_dst_conn(packet: &[u8]) -> Option<u32> {
    let b = packet.get(4..8)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The `src_conn` field of a packet's header, read without any check (a
/// link whose connections have peers of their own finds each packet's
/// peer by the sending connection, whose id is unique in its driver, where
/// the peers' ids may not be); `None` if `packet` is too short to hold it.
pub fn peek_src_conn(packet: &[u8]) -> Option<u32> {
    let b = packet.get(8..12)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Packet flag bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PacketFlags(u8);

impl PacketFlags {
    /// No flags: a standalone acknowledgement.
    pub const NONE: Self = Self(0);
    /// The packet carries a fragment and consumes a sequence number.
    pub const DATA: Self = Self(1 << 0);
    /// The fragment opens a frame.
    pub const FIRST: Self = Self(1 << 1);
    /// The fragment closes a frame.
    pub const LAST: Self = Self(1 << 2);
    const ALL: u8 = 0b111;

    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
    /// Decode, rejecting unknown bits.
    pub const fn from_bits(bits: u8) -> Option<Self> {
        if bits & !Self::ALL != 0 {
            None
        } else {
            Some(Self(bits))
        }
    }
    /// True if every bit of `other` is set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
    /// `self` with the bits of `other` added.
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

/// The decoded fixed header of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketHeader {
    /// Flag bits.
    pub flags: PacketFlags,
    /// The receiving end's id of the connection.
    pub dst_conn: u32,
    /// The sending end's id of the connection.
    pub src_conn: u32,
    /// Sequence number (DATA packets).
    pub seq: u32,
    /// Cumulative acknowledgement: the next sequence number the sender of
    /// this packet expects.
    pub ack: u32,
    /// Selective acknowledgement bitmap relative to `ack`.
    pub sack: u64,
    /// Payload bytes.
    pub payload_len: u16,
}

/// Why a datagram was rejected. Rejected datagrams are dropped silently by
/// the reliability core (and counted); they never end the connection.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PacketError {
    /// Shorter than the header or than the header says.
    #[error("truncated packet: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        have: usize,
    },
    /// Not one of ours.
    #[error("bad packet magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// Unknown version.
    #[error("unsupported packet version {0}")]
    BadVersion(u8),
    /// The checksum does not match: the packet was corrupted.
    #[error("packet checksum mismatch")]
    BadChecksum,
    /// Fields that contradict each other.
    #[error("malformed packet: {0}")]
    Malformed(&'static str),
}

/// CRC-32C (Castagnoli) over the header's first 32 bytes and the payload,
/// with the `crc32c` crate (hardware-accelerated where the CPU has it).
fn checksum(head: &[u8], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&head[..CHECKED_LEN]), payload)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

impl PacketHeader {
    /// Write the header followed by `payload` into `out`, computing the
    /// checksum. Returns the packet length, `PACKET_HEADER_LEN + payload.len()`.
    ///
    /// # Panics
    /// If `out` is too short or `payload` is longer than `u16::MAX`
    /// (`payload_len` is taken from `payload`, not from `self`).
    pub fn encode(&self, payload: &[u8], out: &mut [u8]) -> usize {
        let plen = u16::try_from(payload.len()).expect("payload longer than u16::MAX");
        let total = PACKET_HEADER_LEN + payload.len();
        let out = &mut out[..total];
        out[0..2].copy_from_slice(&PACKET_MAGIC);
        out[2] = PACKET_VERSION;
        out[3] = self.flags.bits();
        out[4..8].copy_from_slice(&self.dst_conn.to_le_bytes());
        out[8..12].copy_from_slice(&self.src_conn.to_le_bytes());
        out[12..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..20].copy_from_slice(&self.ack.to_le_bytes());
        out[20..28].copy_from_slice(&self.sack.to_le_bytes());
        out[28..30].copy_from_slice(&plen.to_le_bytes());
        out[30..32].copy_from_slice(&[0, 0]);
        out[PACKET_HEADER_LEN..].copy_from_slice(payload);
        let (head, body) = out.split_at_mut(PACKET_HEADER_LEN);
        let crc = checksum(head, body);
        head[CHECKED_LEN..PACKET_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
        total
    }

    /// Parse and verify a datagram: the header and its payload.
    pub fn decode(pkt: &[u8]) -> Result<(Self, &[u8]), PacketError> {
        let Some(h) = pkt.get(..PACKET_HEADER_LEN) else {
            return Err(PacketError::Truncated {
                needed: PACKET_HEADER_LEN,
                have: pkt.len(),
            });
        };
        if h[0..2] != PACKET_MAGIC {
            return Err(PacketError::BadMagic([h[0], h[1]]));
        }
        if h[2] != PACKET_VERSION {
            return Err(PacketError::BadVersion(h[2]));
        }
        let payload_len = u16_at(h, 28);
        let end = PACKET_HEADER_LEN + usize::from(payload_len);
        let Some(payload) = pkt.get(PACKET_HEADER_LEN..end) else {
            return Err(PacketError::Truncated {
                needed: end,
                have: pkt.len(),
            });
        };
        if checksum(h, payload) != u32_at(h, CHECKED_LEN) {
            return Err(PacketError::BadChecksum);
        }
        let flags = PacketFlags::from_bits(h[3]).ok_or(PacketError::Malformed("unknown flags"))?;
        if u16_at(h, 30) != 0 {
            return Err(PacketError::Malformed("reserved bytes set"));
        }
        let seq = u32_at(h, 12);
        if !flags.contains(PacketFlags::DATA)
            && (flags != PacketFlags::NONE || payload_len != 0 || seq != 0)
        {
            return Err(PacketError::Malformed("acknowledgement with data fields"));
        }
        let hdr = Self {
            flags,
            dst_conn: u32_at(h, 4),
            src_conn: u32_at(h, 8),
            seq,
            ack: u32_at(h, 16),
            sack: u64_at(h, 20),
            payload_len,
        };
        Ok((hdr, payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PacketHeader {
        PacketHeader {
            flags: PacketFlags::DATA.with(PacketFlags::FIRST),
            dst_conn: 0xdead_beef,
            src_conn: 0x0102_0304,
            seq: 0xffff_fff0,
            ack: 7,
            sack: 0x8000_0000_0000_0005,
            payload_len: 0,
        }
    }

    #[test]
    fn roundtrip_and_padding() {
        let payload: Vec<u8> = (0..100u8).collect();
        let mut buf = [0u8; 200];
        let n = sample().encode(&payload, &mut buf);
        assert_eq!(n, PACKET_HEADER_LEN + 100);
        let (h, p) = PacketHeader::decode(&buf[..n]).unwrap();
        assert_eq!(
            h,
            PacketHeader {
                payload_len: 100,
                ..sample()
            }
        );
        assert_eq!(p, &payload[..]);
        // Trailing padding is ignored.
        let (h2, p2) = PacketHeader::decode(&buf[..n + 30]).unwrap();
        assert_eq!(h2, h);
        assert_eq!(p2, p);
        // Truncation is caught.
        assert!(matches!(
            PacketHeader::decode(&buf[..n - 1]),
            Err(PacketError::Truncated { .. })
        ));
        assert!(matches!(
            PacketHeader::decode(&buf[..10]),
            Err(PacketError::Truncated { .. })
        ));
    }

    #[test]
    fn every_single_and_double_bit_flip_is_rejected() {
        let payload: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(37)).collect();
        let mut buf = [0u8; 128];
        let n = sample().encode(&payload, &mut buf);
        let pkt = &buf[..n];
        let bits = n * 8;
        for i in 0..bits {
            let mut c = pkt.to_vec();
            c[i / 8] ^= 1 << (i % 8);
            assert!(
                PacketHeader::decode(&c).is_err(),
                "flip of bit {i} accepted"
            );
            for j in (i + 1..bits).step_by(13) {
                let mut d = c.clone();
                d[j / 8] ^= 1 << (j % 8);
                assert!(
                    PacketHeader::decode(&d).is_err(),
                    "flip of bits {i},{j} accepted"
                );
            }
        }
    }

    #[test]
    fn malformed_acks_are_rejected() {
        let mut buf = [0u8; 64];
        let ack = PacketHeader {
            flags: PacketFlags::FIRST,
            seq: 0,
            ..sample()
        };
        let n = ack.encode(&[], &mut buf);
        assert_eq!(
            PacketHeader::decode(&buf[..n]),
            Err(PacketError::Malformed("acknowledgement with data fields"))
        );
        let bad_magic = {
            let mut b = buf;
            b[0] = b'X';
            b
        };
        assert!(matches!(
            PacketHeader::decode(&bad_magic[..n]),
            Err(PacketError::BadMagic(_))
        ));
    }

    #[test]
    fn fields_sit_at_their_documented_offsets_little_endian() {
        let hdr = PacketHeader {
            flags: PacketFlags::DATA.with(PacketFlags::LAST),
            dst_conn: 0x0403_0201,
            src_conn: 0x0807_0605,
            seq: 0x0c0b_0a09,
            ack: 0x100f_0e0d,
            sack: 0x1817_1615_1413_1211,
            payload_len: 0,
        };
        let mut buf = [0u8; 64];
        let n = hdr.encode(b"xy", &mut buf);
        assert_eq!(n, PACKET_HEADER_LEN + 2);
        assert_eq!(&buf[0..4], &[b'S', b'D', 2, 0b101]);
        assert_eq!(&buf[4..12], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&buf[12..20], &[9, 10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(&buf[20..28], &[17, 18, 19, 20, 21, 22, 23, 24]);
        assert_eq!(&buf[28..32], &[2, 0, 0, 0]);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&buf[..32]), b"xy");
        assert_eq!(&buf[32..36], &crc.to_le_bytes());
        assert_eq!(&buf[36..38], b"xy");
    }

    #[test]
    fn other_versions_are_rejected() {
        let mut buf = [0u8; 64];
        let n = sample().encode(&[], &mut buf);
        for v in [0, 1, 3, 0xff] {
            let mut c = buf;
            c[2] = v;
            assert_eq!(
                PacketHeader::decode(&c[..n]),
                Err(PacketError::BadVersion(v))
            );
        }
    }

    /// The parser's fuzz target, run as a seeded test: arbitrary bytes and
    /// mutations of valid packets never panic, and whatever is accepted
    /// encodes back to the same bytes.
    #[test]
    fn fuzzed_input_is_rejected_or_round_trips() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};

        let mut rng = SmallRng::seed_from_u64(0xf022);
        let mut accepted = 0;
        for round in 0..50_000 {
            let mut pkt = if round % 2 == 0 {
                let len = rng.gen_range(0..96);
                (0..len).map(|_| rng.gen()).collect::<Vec<u8>>()
            } else {
                let payload: Vec<u8> = (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect();
                let data = rng.gen_bool(0.7);
                let hdr = PacketHeader {
                    flags: if data {
                        PacketFlags::from_bits(rng.gen_range(0..8) | 1).unwrap()
                    } else {
                        PacketFlags::NONE
                    },
                    dst_conn: rng.gen(),
                    src_conn: rng.gen(),
                    seq: if data { rng.gen() } else { 0 },
                    ack: rng.gen(),
                    sack: rng.gen(),
                    payload_len: 0,
                };
                let payload = if data { &payload[..] } else { &[][..] };
                let mut buf = vec![0; PACKET_HEADER_LEN + payload.len()];
                hdr.encode(payload, &mut buf);
                match rng.gen_range(0..4) {
                    0 => {}
                    1 => {
                        let bit = rng.gen_range(0..buf.len() * 8);
                        buf[bit / 8] ^= 1 << (bit % 8);
                    }
                    2 => buf.truncate(rng.gen_range(0..buf.len())),
                    _ => buf.extend((0..rng.gen_range(1..8)).map(|_| rng.gen::<u8>())),
                }
                buf
            };
            if round % 7 == 0 && pkt.len() >= 4 {
                // Valid magic and version, so the deeper checks are reached.
                pkt[..3].copy_from_slice(&[b'S', b'D', PACKET_VERSION]);
            }
            if let Ok((hdr, payload)) = PacketHeader::decode(&pkt) {
                accepted += 1;
                assert_eq!(usize::from(hdr.payload_len), payload.len());
                let mut again = vec![0; PACKET_HEADER_LEN + payload.len()];
                hdr.encode(payload, &mut again);
                assert_eq!(&pkt[..again.len()], &again[..]);
            }
        }
        assert!(accepted > 5_000, "only {accepted} packets were valid");
    }
}

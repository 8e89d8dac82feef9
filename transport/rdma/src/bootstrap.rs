//! [`QpEndpoint`]: what the two sides of a verbs connection tell each other
//! over the side channel before their queue pairs can talk, encoded and
//! parsed without I/O.
//!
//! Each side sends one 64-byte message and reads the peer's:
//!
//! ```text
//!  0      4   5    6   7   8      12     16    18   20        24         40            64
//!  | SWQP | v | port | mtu | 0 | qpn | psn | lid | 0 | gid_index | gid (16) | RemoteRing (24) |
//! ```
//!
//! All integers little-endian; `v` is [`QpEndpoint::VERSION`]; `mtu` is
//! `enum ibv_mtu` (1 = 256 bytes .. 5 = 4096 bytes); the GID is in network
//! order, as verbs keeps it; the last 24 bytes are
//! [`RemoteRing::to_bytes`]. [`QpEndpoint::parse`] checks every field
//! before anything is used; the ring itself is checked by
//! [`RdmaDriver::connect`](crate::RdmaDriver::connect).

use thiserror::Error;

use crate::ring::RemoteRing;

/// Largest queue pair number and packet sequence number: both are 24-bit
/// in the InfiniBand transport header.
pub const MAX_QPN: u32 = (1 << 24) - 1;

/// One side's queue pair, port and receive ring, as the peer needs them to
/// move its queue pair to RTR and write into the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number (`dest_qp_num` at the peer).
    pub qpn: u32,
    /// First packet sequence number this side sends (`rq_psn` at the
    /// peer).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// Port GID at `gid_index` (the peer's `dgid`).
    pub gid: [u8; 16],
    /// Index of that GID in this side's table.
    pub gid_index: u32,
    /// Active MTU of this side's port, `enum ibv_mtu`; the path uses the
    /// smaller of the two.
    pub mtu: u8,
    /// Port number.
    pub port: u8,
    /// The receive ring the peer writes into.
    pub ring: RemoteRing,
}

/// A side-channel message that is not a valid [`QpEndpoint`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Not exactly [`QpEndpoint::ENCODED_LEN`] bytes.
    #[error(
        "endpoint message of {len} bytes, expected {}",
        QpEndpoint::ENCODED_LEN
    )]
    Length {
        /// Bytes received.
        len: usize,
    },
    /// The first four bytes are not `SWQP`: not a starwire peer.
    #[error("endpoint message does not start with SWQP (got {got:02x?})")]
    Magic {
        /// The bytes found.
        got: [u8; 4],
    },
    /// A version this build does not speak.
    #[error(
        "endpoint message version {got}, this build speaks {}",
        QpEndpoint::VERSION
    )]
    Version {
        /// The version found.
        got: u8,
    },
    /// A field outside its range.
    #[error("endpoint message field {field} = {value} is invalid ({why})")]
    Field {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The rule it breaks.
        why: &'static str,
    },
}

const MAGIC: [u8; 4] = *b"SWQP";

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

impl QpEndpoint {
    /// Bytes of an encoded endpoint.
    pub const ENCODED_LEN: usize = 64;
    /// The layout version written and accepted.
    pub const VERSION: u8 = 1;

    /// The encoded message.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0; Self::ENCODED_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = Self::VERSION;
        b[5] = self.port;
        b[6] = self.mtu;
        b[8..12].copy_from_slice(&self.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..18].copy_from_slice(&self.lid.to_le_bytes());
        b[20..24].copy_from_slice(&self.gid_index.to_le_bytes());
        b[24..40].copy_from_slice(&self.gid);
        b[40..64].copy_from_slice(&self.ring.to_bytes());
        b
    }

    /// Parse and check a message: length, magic, version, reserved bytes
    /// zero, `qpn` and `psn` within 24 bits (`qpn` not 0 or 1, the special
    /// QPs), `mtu` an `enum ibv_mtu`, `port` not 0.
    pub fn parse(b: &[u8]) -> Result<Self, EndpointError> {
        if b.len() != Self::ENCODED_LEN {
            return Err(EndpointError::Length { len: b.len() });
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(EndpointError::Magic { got: magic });
        }
        if b[4] != Self::VERSION {
            return Err(EndpointError::Version { got: b[4] });
        }
        let field = |field, value: u64, why| EndpointError::Field { field, value, why };
        if b[7] != 0 || u16_at(b, 18) != 0 {
            return Err(field(
                "reserved",
                u64::from(b[7]) | u64::from(u16_at(b, 18)) << 8,
                "must be 0",
            ));
        }
        let port = b[5];
        if port == 0 {
            return Err(field("port", 0, "ports are numbered from 1"));
        }
        let mtu = b[6];
        if !(1..=5).contains(&mtu) {
            return Err(field(
                "mtu",
                mtu.into(),
                "not an enum ibv_mtu (1 = 256 .. 5 = 4096 bytes)",
            ));
        }
        let qpn = u32_at(b, 8);
        if !(2..=MAX_QPN).contains(&qpn) {
            return Err(field(
                "qpn",
                qpn.into(),
                "a connected QP number is 24-bit and not 0 or 1",
            ));
        }
        let psn = u32_at(b, 12);
        if psn > MAX_QPN {
            return Err(field(
                "psn",
                psn.into(),
                "packet sequence numbers are 24-bit",
            ));
        }
        let mut gid = [0; 16];
        gid.copy_from_slice(&b[24..40]);
        let mut ring = [0; RemoteRing::ENCODED_LEN];
        ring.copy_from_slice(&b[40..64]);
        Ok(Self {
            qpn,
            psn,
            lid: u16_at(b, 16),
            gid,
            gid_index: u32_at(b, 20),
            mtu,
            port,
            ring: RemoteRing::from_bytes(&ring),
        })
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    fn random_endpoint(rng: &mut SmallRng) -> QpEndpoint {
        QpEndpoint {
            qpn: rng.gen_range(2..=MAX_QPN),
            psn: rng.gen_range(0..=MAX_QPN),
            lid: rng.gen(),
            gid: rng.gen(),
            gid_index: rng.gen(),
            mtu: rng.gen_range(1..=5),
            port: rng.gen_range(1..=u8::MAX),
            ring: RemoteRing {
                rkey: rng.gen(),
                addr: rng.gen(),
                len: rng.gen_range(0..1 << 40),
                recv_depth: rng.gen(),
            },
        }
    }

    #[test]
    fn valid_endpoints_round_trip() {
        let mut rng = SmallRng::seed_from_u64(24);
        for _ in 0..10_000 {
            let e = random_endpoint(&mut rng);
            assert_eq!(QpEndpoint::parse(&e.to_bytes()), Ok(e));
        }
    }

    #[test]
    fn every_field_is_checked() {
        let mut rng = SmallRng::seed_from_u64(7);
        let good = random_endpoint(&mut rng).to_bytes();
        let with = |i: usize, v: &[u8]| {
            let mut b = good;
            b[i..i + v.len()].copy_from_slice(v);
            QpEndpoint::parse(&b)
        };
        assert_eq!(
            QpEndpoint::parse(&good[..63]),
            Err(EndpointError::Length { len: 63 })
        );
        assert_eq!(
            QpEndpoint::parse(&[good.as_slice(), &[0]].concat()),
            Err(EndpointError::Length { len: 65 })
        );
        assert!(matches!(with(0, b"HTTP"), Err(EndpointError::Magic { .. })));
        assert_eq!(with(4, &[2]), Err(EndpointError::Version { got: 2 }));
        let field_of = |r: Result<QpEndpoint, EndpointError>| match r {
            Err(EndpointError::Field { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        };
        assert_eq!(field_of(with(5, &[0])), "port");
        assert_eq!(field_of(with(6, &[0])), "mtu");
        assert_eq!(field_of(with(6, &[6])), "mtu");
        assert_eq!(field_of(with(7, &[1])), "reserved");
        assert_eq!(field_of(with(18, &[0, 1])), "reserved");
        assert_eq!(field_of(with(8, &1u32.to_le_bytes())), "qpn");
        assert_eq!(field_of(with(8, &(1u32 << 24).to_le_bytes())), "qpn");
        assert_eq!(field_of(with(12, &(1u32 << 24).to_le_bytes())), "psn");
    }

    /// The parser's property, checked on random and mutated input (a
    /// seeded stand-in for a fuzz target): it never panics, and whatever it
    /// accepts encodes back to exactly the bytes it read.
    #[test]
    fn random_and_mutated_messages_never_panic_and_accepted_ones_round_trip() {
        let mut rng = SmallRng::seed_from_u64(0x5eed);
        let mut accepted = 0;
        for i in 0..200_000 {
            let mut b = random_endpoint(&mut rng).to_bytes().to_vec();
            match i % 4 {
                0 => {
                    let n = rng.gen_range(0..96);
                    b = (0..n).map(|_| rng.gen()).collect();
                }
                1 => {
                    let at = rng.gen_range(0..b.len());
                    b[at] ^= 1 << rng.gen_range(0..8);
                }
                2 => {
                    let at = rng.gen_range(0..b.len());
                    b[at] = [0, 1, 5, 6, 0x7f, 0x80, 0xff][rng.gen_range(0..7)];
                }
                _ => b.truncate(rng.gen_range(0..b.len())),
            }
            if let Ok(e) = QpEndpoint::parse(&b) {
                accepted += 1;
                assert_eq!(e.to_bytes().as_slice(), b.as_slice());
            }
        }
        assert!(accepted > 10_000, "mutations too destructive: {accepted}");
    }
}

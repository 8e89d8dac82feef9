//! The preamble of a shard connection, sans-IO.
//!
//! A task that serves several shards (one reactor each) listens on one
//! port. Before the starwire handshake, the dialer writes 8 bytes: the
//! magic `b"SWSH"` and the shard index, `u32` little-endian. The acceptor
//! reads them and hands the socket to the reactor that owns the shard, so
//! no message crosses cores.
//!
//! [`PreambleReader`] takes the bytes as they arrive, in any pieces, and
//! never takes more than the preamble: what follows is the connection's
//! handshake and belongs to the reactor. It rejects a peer as soon as a
//! byte differs from the magic, without waiting for the rest.

use thiserror::Error;

/// The first four bytes of every shard connection.
pub const MAGIC: [u8; 4] = *b"SWSH";

/// A parsed preamble: which shard the connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Preamble {
    /// The shard (reactor) index within the listening task.
    pub shard: u32,
}

/// Why bytes are not a preamble.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PreambleError {
    /// Byte `offset` of the magic is `found`: not a starwire shard
    /// connection.
    #[error("not a starwire shard connection: byte {offset} is {found:#04x}, not {expected:#04x}")]
    BadMagic {
        /// Where in the magic.
        offset: usize,
        /// The byte received.
        found: u8,
        /// The magic's byte.
        expected: u8,
    },
    /// Fewer than [`Preamble::LEN`] bytes.
    #[error("preamble truncated: {got} of {} bytes", Preamble::LEN)]
    Truncated {
        /// Bytes there were.
        got: usize,
    },
}

impl Preamble {
    /// Encoded length.
    pub const LEN: usize = 8;

    /// The 8 bytes that name `self.shard`.
    pub fn emit(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..].copy_from_slice(&self.shard.to_le_bytes());
        b
    }

    /// Parse the first [`Preamble::LEN`] bytes of `bytes` (the rest is not
    /// looked at). A wrong magic byte is reported before a short input.
    pub fn parse(bytes: &[u8]) -> Result<Self, PreambleError> {
        check_magic(bytes, 0)?;
        let Some(b) = bytes.get(..Self::LEN) else {
            return Err(PreambleError::Truncated { got: bytes.len() });
        };
        let mut shard = [0u8; 4];
        shard.copy_from_slice(&b[4..]);
        Ok(Self {
            shard: u32::from_le_bytes(shard),
        })
    }
}

/// Check `bytes`, found at offset `at` of a preamble, against the magic
/// (the part of them that overlaps it).
fn check_magic(bytes: &[u8], at: usize) -> Result<(), PreambleError> {
    for (i, &found) in bytes.iter().enumerate() {
        let offset = at + i;
        let Some(&expected) = MAGIC.get(offset) else {
            break;
        };
        if found != expected {
            return Err(PreambleError::BadMagic {
                offset,
                found,
                expected,
            });
        }
    }
    Ok(())
}

/// A preamble arriving in pieces. See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct PreambleReader {
    buf: [u8; Preamble::LEN],
    len: usize,
    failed: Option<PreambleError>,
}

impl PreambleReader {
    /// Nothing received yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes still missing: read at most this many from the socket, so
    /// that no byte of the handshake behind the preamble is taken.
    pub fn remaining(&self) -> usize {
        Preamble::LEN - self.len
    }

    /// Bytes taken so far.
    pub fn received(&self) -> usize {
        self.len
    }

    /// Take the next bytes of the connection: at most
    /// [`remaining`](Self::remaining) of them (the count taken comes back
    /// with the result). `Some` once the preamble is complete; an error as
    /// soon as the bytes cannot be one, and from then on.
    pub fn handle_bytes(
        &mut self,
        data: &[u8],
    ) -> Result<(usize, Option<Preamble>), PreambleError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let n = data.len().min(self.remaining());
        let taken = &data[..n];
        if let Err(e) = check_magic(taken, self.len) {
            self.failed = Some(e);
            return Err(e);
        }
        self.buf[self.len..self.len + n].copy_from_slice(taken);
        self.len += n;
        if self.len < Preamble::LEN {
            return Ok((n, None));
        }
        Preamble::parse(&self.buf).map(|p| (n, Some(p)))
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn emit_then_parse_gives_the_shard_back() {
        for shard in [0, 1, 7, 0x0102_0304, u32::MAX] {
            let b = Preamble { shard }.emit();
            assert_eq!(&b[..4], b"SWSH");
            assert_eq!(Preamble::parse(&b), Ok(Preamble { shard }));
        }
        // Little-endian, explicitly.
        assert_eq!(Preamble { shard: 0x0102_0304 }.emit()[4..], [4, 3, 2, 1]);
    }

    #[test]
    fn parse_reports_the_first_wrong_magic_byte_then_truncation() {
        assert_eq!(
            Preamble::parse(b"GET / HTTP/1.1"),
            Err(PreambleError::BadMagic {
                offset: 0,
                found: b'G',
                expected: b'S',
            })
        );
        assert_eq!(
            Preamble::parse(b"SWX"),
            Err(PreambleError::BadMagic {
                offset: 2,
                found: b'X',
                expected: b'S',
            })
        );
        assert_eq!(
            Preamble::parse(b"SWSH\x01"),
            Err(PreambleError::Truncated { got: 5 })
        );
        assert_eq!(
            Preamble::parse(b""),
            Err(PreambleError::Truncated { got: 0 })
        );
        // Bytes after the preamble are not looked at.
        assert_eq!(
            Preamble::parse(b"SWSH\x02\0\0\0trailing"),
            Ok(Preamble { shard: 2 })
        );
    }

    #[test]
    fn the_reader_takes_byte_by_byte_and_never_more_than_the_preamble() {
        let mut r = PreambleReader::new();
        let wire = [&Preamble { shard: 9 }.emit()[..], b"HELLO"].concat();
        for (i, b) in wire[..7].iter().enumerate() {
            assert_eq!(r.remaining(), 8 - i);
            assert_eq!(r.handle_bytes(&[*b]), Ok((1, None)));
        }
        // The last byte comes with the handshake behind it: one is taken.
        assert_eq!(
            r.handle_bytes(&wire[7..]),
            Ok((1, Some(Preamble { shard: 9 })))
        );
        assert_eq!(r.received(), 8);
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn the_reader_rejects_at_the_first_wrong_byte_and_stays_failed() {
        let mut r = PreambleReader::new();
        assert_eq!(r.handle_bytes(b"SW"), Ok((2, None)));
        let e = PreambleError::BadMagic {
            offset: 2,
            found: b'!',
            expected: b'S',
        };
        assert_eq!(r.handle_bytes(b"!"), Err(e));
        assert_eq!(r.handle_bytes(b"SH\0\0\0\0"), Err(e));
        assert_eq!(r.received(), 2);
    }

    /// What the preamble of `input` is, written without the reader: the
    /// oracle the fuzz test compares it with. `Ok(None)`: a valid prefix.
    fn oracle(input: &[u8]) -> Result<Option<u32>, usize> {
        for (i, &m) in MAGIC.iter().enumerate() {
            match input.get(i) {
                None => return Ok(None),
                Some(&b) if b != m => return Err(i),
                Some(_) => {}
            }
        }
        match input.get(4..8) {
            Some(s) => Ok(Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))),
            None => Ok(None),
        }
    }

    /// An input: a valid preamble, a mutated one, a prefix of one, or
    /// random bytes; with random bytes behind it half of the time.
    fn input(rng: &mut StdRng) -> Vec<u8> {
        let mut v = Preamble { shard: rng.gen() }.emit().to_vec();
        match rng.gen_range(0..4) {
            0 => {}
            1 => {
                let i = rng.gen_range(0..v.len());
                v[i] ^= 1 << rng.gen_range(0..8);
            }
            2 => v.truncate(rng.gen_range(0..v.len())),
            _ => v = (0..rng.gen_range(0..12)).map(|_| rng.gen()).collect(),
        }
        if rng.gen() {
            v.extend((0..rng.gen_range(0..16)).map(|_| rng.gen::<u8>()));
        }
        v
    }

    /// Seeded fuzzing: many inputs, each fed in random pieces. The reader
    /// must agree with the oracle, take no byte past the preamble and
    /// never panic.
    #[test]
    fn fuzz_the_reader_against_an_oracle() {
        let mut rng = StdRng::seed_from_u64(0x5357_5348);
        let (mut valid, mut rejected, mut partial) = (0, 0, 0);
        for _ in 0..20_000 {
            let input = input(&mut rng);
            let mut r = PreambleReader::new();
            let mut at = 0;
            let mut outcome = Ok(None);
            while at < input.len() {
                let piece = rng.gen_range(1..=input.len() - at);
                let room = r.remaining();
                match r.handle_bytes(&input[at..at + piece]) {
                    Ok((n, p)) => {
                        assert_eq!(n, piece.min(room));
                        at += n;
                        if let Some(p) = p {
                            outcome = Ok(Some(p.shard));
                            break;
                        }
                        assert_eq!(n, piece, "took less without finishing");
                    }
                    Err(PreambleError::BadMagic { offset, found, .. }) => {
                        assert_eq!(input[offset], found);
                        outcome = Err(offset);
                        break;
                    }
                    Err(e) => panic!("{e} from the reader"),
                }
            }
            assert_eq!(outcome, oracle(&input), "input {input:02x?}");
            match outcome {
                Ok(Some(shard)) => {
                    valid += 1;
                    assert_eq!(at, Preamble::LEN, "took bytes past the preamble");
                    assert_eq!(Preamble::parse(&input), Ok(Preamble { shard }));
                }
                Ok(None) => {
                    partial += 1;
                    assert_eq!(r.received(), input.len());
                    assert_eq!(
                        Preamble::parse(&input),
                        Err(PreambleError::Truncated { got: input.len() })
                    );
                }
                Err(_) => {
                    rejected += 1;
                    assert!(Preamble::parse(&input).is_err());
                }
            }
        }
        // Every kind of outcome was reached many times.
        assert!(valid > 1000 && rejected > 1000 && partial > 1000);
    }
}

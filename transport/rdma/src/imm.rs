//! The 32-bit immediate carried by every ring write.
//!
//! ```text
//! data:   | 0 | W |            frame length (30 bits)             |
//! credit: | 1 |  recv WRs (10 bits)  |  freed ring bytes / 64 (21 bits) |
//!          31  30                                                    0
//! ```
//!
//! * **Data** (bit 31 clear): a frame of `length` bytes was written at the
//!   sender's tail. `W` (bit 30) says the sender skipped the rest of the ring
//!   and the frame starts at offset 0.
//! * **Credit** (bit 31 set, zero-length write): the receiver freed
//!   `units * 64` ring bytes and re-posted `recv WRs` receive work requests
//!   since its previous credit message.

/// Ring placement granularity: frames start on multiples of this.
pub const SLOT: usize = 64;

const KIND_CREDIT: u32 = 1 << 31;
const DATA_WRAP: u32 = 1 << 30;
const DATA_LEN_MASK: u32 = DATA_WRAP - 1;
const CREDIT_UNITS_BITS: u32 = 21;
const CREDIT_UNITS_MASK: u32 = (1 << CREDIT_UNITS_BITS) - 1;
const CREDIT_RECVS_MASK: u32 = (1 << 10) - 1;

/// Largest frame length a data immediate can carry.
pub const MAX_DATA_LEN: usize = DATA_LEN_MASK as usize;
/// Largest ring-byte credit one credit immediate can carry.
pub const MAX_CREDIT_BYTES: usize = CREDIT_UNITS_MASK as usize * SLOT;
/// Largest receive-WR credit one credit immediate can carry.
pub const MAX_CREDIT_RECVS: u32 = CREDIT_RECVS_MASK;

/// A decoded immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Imm {
    /// A frame.
    Data {
        /// The frame starts at ring offset 0 after a skipped tail.
        wrap: bool,
        /// Frame length in bytes.
        len: usize,
    },
    /// A credit return.
    Credit {
        /// Ring bytes freed (a multiple of [`SLOT`]).
        bytes: usize,
        /// Receive WRs re-posted.
        recvs: u32,
    },
}

impl Imm {
    /// Encode. Panics in debug builds if a field exceeds its width (the
    /// ring validates its configuration so it never does).
    pub fn encode(self) -> u32 {
        match self {
            Self::Data { wrap, len } => {
                debug_assert!(len <= MAX_DATA_LEN);
                let wrap = if wrap { DATA_WRAP } else { 0 };
                wrap | (len as u32 & DATA_LEN_MASK)
            }
            Self::Credit { bytes, recvs } => {
                debug_assert!(bytes % SLOT == 0 && bytes <= MAX_CREDIT_BYTES);
                debug_assert!(recvs <= MAX_CREDIT_RECVS);
                let units = (bytes / SLOT) as u32 & CREDIT_UNITS_MASK;
                KIND_CREDIT | ((recvs & CREDIT_RECVS_MASK) << CREDIT_UNITS_BITS) | units
            }
        }
    }

    /// Decode; every 32-bit value is some immediate.
    pub fn decode(imm: u32) -> Self {
        if imm & KIND_CREDIT == 0 {
            Self::Data {
                wrap: imm & DATA_WRAP != 0,
                len: (imm & DATA_LEN_MASK) as usize,
            }
        } else {
            Self::Credit {
                bytes: (imm & CREDIT_UNITS_MASK) as usize * SLOT,
                recvs: (imm >> CREDIT_UNITS_BITS) & CREDIT_RECVS_MASK,
            }
        }
    }
}

/// `len` rounded up to a whole number of slots.
pub fn slot_len(len: usize) -> usize {
    len.div_ceil(SLOT) * SLOT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_extremes() {
        let cases = [
            Imm::Data {
                wrap: false,
                len: 0,
            },
            Imm::Data {
                wrap: true,
                len: MAX_DATA_LEN,
            },
            Imm::Credit { bytes: 0, recvs: 0 },
            Imm::Credit {
                bytes: MAX_CREDIT_BYTES,
                recvs: MAX_CREDIT_RECVS,
            },
            Imm::Credit {
                bytes: 64,
                recvs: 1,
            },
        ];
        for imm in cases {
            assert_eq!(Imm::decode(imm.encode()), imm);
        }
    }

    #[test]
    fn kind_bit_separates_data_from_credit() {
        assert_eq!(Imm::decode(0x8000_0000), Imm::Credit { bytes: 0, recvs: 0 });
        assert_eq!(Imm::decode(0x4000_0005), Imm::Data { wrap: true, len: 5 });
        assert_eq!(
            Imm::Credit {
                bytes: 128,
                recvs: 3
            }
            .encode(),
            0x8000_0000 | (3 << 21) | 2
        );
    }

    #[test]
    fn slots_round_up() {
        assert_eq!(slot_len(0), 0);
        assert_eq!(slot_len(1), 64);
        assert_eq!(slot_len(64), 64);
        assert_eq!(slot_len(65), 128);
    }
}

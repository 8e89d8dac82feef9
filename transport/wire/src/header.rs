//! The fixed 32-byte frame header.
//!
//! ```text
//! offset size field
//!  0     4    magic        "SWR1" as bytes (0x53 0x57 0x52 0x31)
//!  4     1    version      VERSION
//!  5     1    opcode       Opcode
//!  6     2    flags        Flags bits (LE)
//!  8     8    request_id   (LE) matches a response to its request; 0 = none
//! 16     2    status       Status (LE); 0 on requests
//! 18     2    shard_id     (LE) reactor/shard the body is for
//! 20     4    body_len     (LE) bytes of body that follow in THIS frame
//! 24     4    message_len  (LE) bytes of the whole message body over all chunks
//! 28     4    credit       (LE) flow-control credits granted to the peer
//! ```

use thiserror::Error;

/// Size of the frame header in bytes.
pub const HEADER_LEN: usize = 32;
/// The magic bytes that open every frame.
pub const MAGIC: [u8; 4] = *b"SWR1";
/// The wire format version this build speaks.
pub const VERSION: u8 = 1;

/// Why a frame could not be parsed.
///
/// Returned by the header, frame and chunk layers, every variant is a
/// framing error: the connection that produced it must be closed. The tensor
/// record and tensor-list parsers reuse these variants for malformed bodies;
/// the message parsers wrap those in `BodyError::Layout`, a semantic error
/// that fails only the request that carried the body.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than a header, or than the header says the frame holds.
    #[error("truncated frame: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame needs.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The magic bytes do not match.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("unsupported wire version {0}")]
    BadVersion(u8),
    /// An opcode this build does not know.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// Flag bits this build does not know.
    #[error("unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    /// A length larger than the negotiated limit.
    #[error("oversized {what}: {len} bytes exceeds the limit of {limit}")]
    Oversized {
        /// Which length.
        what: &'static str,
        /// The length on the wire.
        len: u64,
        /// The limit in force.
        limit: u64,
    },
    /// Lengths that contradict each other or overflow.
    #[error("inconsistent lengths: {0}")]
    BadLength(&'static str),
    /// A body that does not match its opcode's layout.
    #[error("malformed body: {0}")]
    Malformed(&'static str),
}

/// Frame opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Opcode {
    /// Connection handshake (both sides send one first).
    Hello = 0x01,
    /// A pure credit grant (the header's `credit` field), empty body.
    Credit = 0x02,
    /// Cancel the request named by `request_id`; empty body.
    Cancel = 0x03,
    /// Orderly close; empty body.
    Goodbye = 0x04,
    /// Keep-alive probe; empty body.
    Ping = 0x05,
    /// The second step of the handshake: the sender's proof that it holds
    /// the cluster token, and its training flags
    /// ([`crate::message::AuthMsg`]).
    Auth = 0x06,
    /// A request outside the data path; the PS protocol carries its
    /// control messages in it ([`crate::ps::Control`]).
    Rpc = 0x10,
    /// A fused list of tensors (Send/Recv fusion).
    Tensors = 0x11,
    /// A PS pull: dense variables, rows or pooled sums of rows
    /// ([`crate::ps::PullRequest`], [`crate::ps::PullResponse`]).
    SparsePull = 0x20,
    /// A PS push: gradients of dense variables, rows or pooled rows
    /// ([`crate::ps::PushRequest`]).
    SparsePush = 0x21,
    /// Unassigned in the PS protocol; the benchmarks send opaque payloads.
    DensePull = 0x22,
    /// Unassigned in the PS protocol; the benchmarks send opaque payloads.
    DensePush = 0x23,
}

impl Opcode {
    /// Decode an opcode byte.
    pub fn from_u8(v: u8) -> Result<Self, FrameError> {
        Ok(match v {
            0x01 => Self::Hello,
            0x02 => Self::Credit,
            0x03 => Self::Cancel,
            0x04 => Self::Goodbye,
            0x05 => Self::Ping,
            0x06 => Self::Auth,
            0x10 => Self::Rpc,
            0x11 => Self::Tensors,
            0x20 => Self::SparsePull,
            0x21 => Self::SparsePush,
            0x22 => Self::DensePull,
            0x23 => Self::DensePush,
            other => return Err(FrameError::UnknownOpcode(other)),
        })
    }

    /// True for opcodes handled by the connection core itself.
    pub fn is_control(self) -> bool {
        matches!(
            self,
            Self::Hello | Self::Auth | Self::Credit | Self::Cancel | Self::Goodbye | Self::Ping
        )
    }
}

/// Header flag bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(u16);

impl Flags {
    /// No flags.
    pub const NONE: Self = Self(0);
    /// This frame is a response to `request_id`.
    pub const RESPONSE: Self = Self(1 << 0);
    /// One-way: no response is expected.
    pub const ONEWAY: Self = Self(1 << 1);
    /// More chunks of this message follow.
    pub const MORE: Self = Self(1 << 2);
    /// This frame continues a chunked message (not its first chunk).
    pub const CONTINUATION: Self = Self(1 << 3);
    const ALL: u16 = 0b1111;

    /// Decode, rejecting unknown bits.
    pub fn from_bits(bits: u16) -> Result<Self, FrameError> {
        if bits & !Self::ALL != 0 {
            return Err(FrameError::UnknownFlags(bits & !Self::ALL));
        }
        Ok(Self(bits))
    }
    /// The raw bits.
    pub fn bits(self) -> u16 {
        self.0
    }
    /// True when every bit of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
    /// Union.
    #[must_use]
    pub fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
    /// Difference.
    #[must_use]
    pub fn without(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

/// Response status. Non-zero statuses are semantic errors for one request;
/// they never close the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// Success.
    Ok,
    /// The variable id is not registered.
    UnknownVariable,
    /// A tensor has the wrong shape or dtype for the variable.
    WrongShape,
    /// The body did not decode as the opcode's layout.
    BadRequest,
    /// The request was cancelled by the caller.
    Cancelled,
    /// The server failed internally.
    Internal,
    /// The RPC method id is unknown.
    UnknownMethod,
    /// The request is beyond one of the server's bounds (a reply larger
    /// than its `--max-reply-bytes`, a table at its `--max-rows`, a barrier
    /// further ahead than its `--max-wait-steps`). Retrying it will fail
    /// the same way.
    LimitExceeded,
    /// The server has no memory for the reply now (its
    /// `--memory-budget-mb` is spent on other connections' replies).
    Overloaded,
    /// A pushed gradient holds NaN or an infinity; nothing was applied.
    NonFinite,
    /// A status this build does not know (kept so it can be reported).
    Other(u16),
}

impl Status {
    /// Decode; unknown values are kept as [`Status::Other`].
    pub fn from_u16(v: u16) -> Self {
        match v {
            0 => Self::Ok,
            1 => Self::UnknownVariable,
            2 => Self::WrongShape,
            3 => Self::BadRequest,
            4 => Self::Cancelled,
            5 => Self::Internal,
            6 => Self::UnknownMethod,
            7 => Self::LimitExceeded,
            8 => Self::Overloaded,
            9 => Self::NonFinite,
            other => Self::Other(other),
        }
    }
    /// Encode.
    pub fn to_u16(self) -> u16 {
        match self {
            Self::Ok => 0,
            Self::UnknownVariable => 1,
            Self::WrongShape => 2,
            Self::BadRequest => 3,
            Self::Cancelled => 4,
            Self::Internal => 5,
            Self::UnknownMethod => 6,
            Self::LimitExceeded => 7,
            Self::Overloaded => 8,
            Self::NonFinite => 9,
            Self::Other(v) => v,
        }
    }

    /// What the status means, in a few words, for an error message.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::UnknownVariable => "unknown variable",
            Self::WrongShape => "wrong shape or kind",
            Self::BadRequest => "malformed request",
            Self::Cancelled => "cancelled",
            Self::Internal => "internal error on the server",
            Self::UnknownMethod => "unknown method",
            Self::LimitExceeded => "beyond a bound of the server",
            Self::Overloaded => "server out of memory budget, retry later",
            Self::NonFinite => "gradient not finite (NaN or infinity)",
            Self::Other(_) => "unknown status",
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame carries.
    pub opcode: Opcode,
    /// Flag bits.
    pub flags: Flags,
    /// Request id (0 when not a request or response).
    pub request_id: u64,
    /// Status of a response.
    pub status: Status,
    /// The shard (reactor) the body is addressed to.
    pub shard_id: u16,
    /// Body bytes in this frame.
    pub body_len: u32,
    /// Body bytes of the whole message, over all its chunks.
    pub message_len: u32,
    /// Credits granted to the peer by this frame.
    pub credit: u32,
}

impl Header {
    /// A header for a single-frame message with `body_len` bytes of body.
    pub fn new(opcode: Opcode, request_id: u64, body_len: u32) -> Self {
        Self {
            opcode,
            flags: Flags::NONE,
            request_id,
            status: Status::Ok,
            shard_id: 0,
            body_len,
            message_len: body_len,
            credit: 0,
        }
    }

    /// Total frame length: header plus body.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len as usize
    }

    /// Parse and validate a header from the start of `bytes`. Only the
    /// header is read; `bytes` may hold more (the body, later frames).
    /// `max_body` bounds `body_len` and `max_message` bounds `message_len`.
    pub fn parse(bytes: &[u8], max_body: u32, max_message: u32) -> Result<Self, FrameError> {
        let Some(h) = bytes.get(..HEADER_LEN) else {
            return Err(FrameError::Truncated {
                needed: HEADER_LEN,
                have: bytes.len(),
            });
        };
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if h[4] != VERSION {
            return Err(FrameError::BadVersion(h[4]));
        }
        let opcode = Opcode::from_u8(h[5])?;
        let flags = Flags::from_bits(le16(h, 6))?;
        let request_id = le64(h, 8);
        let status = Status::from_u16(le16(h, 16));
        let shard_id = le16(h, 18);
        let body_len = le32(h, 20);
        let message_len = le32(h, 24);
        let credit = le32(h, 28);
        if body_len > max_body {
            return Err(FrameError::Oversized {
                what: "frame body",
                len: body_len.into(),
                limit: max_body.into(),
            });
        }
        if message_len > max_message {
            return Err(FrameError::Oversized {
                what: "message",
                len: message_len.into(),
                limit: max_message.into(),
            });
        }
        if body_len > message_len {
            return Err(FrameError::BadLength("frame body longer than its message"));
        }
        let chunked = flags.contains(Flags::MORE) || flags.contains(Flags::CONTINUATION);
        if !chunked && body_len != message_len {
            return Err(FrameError::BadLength(
                "unchunked frame whose body differs from its message length",
            ));
        }
        if opcode.is_control() && chunked {
            return Err(FrameError::BadLength("chunked control frame"));
        }
        if opcode.is_control()
            && !matches!(opcode, Opcode::Hello | Opcode::Auth)
            && message_len != 0
        {
            return Err(FrameError::BadLength("control frame with a body"));
        }
        Ok(Self {
            opcode,
            flags,
            request_id,
            status,
            shard_id,
            body_len,
            message_len,
            credit,
        })
    }

    /// Write the header into the first [`HEADER_LEN`] bytes of `out`.
    ///
    /// # Panics
    /// If `out` is shorter than [`HEADER_LEN`]; callers size buffers with
    /// [`Header::frame_len`].
    pub fn emit(&self, out: &mut [u8]) {
        let h = &mut out[..HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = VERSION;
        h[5] = self.opcode as u8;
        h[6..8].copy_from_slice(&self.flags.bits().to_le_bytes());
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..18].copy_from_slice(&self.status.to_u16().to_le_bytes());
        h[18..20].copy_from_slice(&self.shard_id.to_le_bytes());
        h[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        h[24..28].copy_from_slice(&self.message_len.to_le_bytes());
        h[28..32].copy_from_slice(&self.credit.to_le_bytes());
    }

    /// The header as bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        self.emit(&mut b);
        b
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut h = Header::new(Opcode::SparsePull, 77, 100);
        h.flags = Flags::RESPONSE;
        h.status = Status::WrongShape;
        h.shard_id = 3;
        h.credit = 9;
        let b = h.to_bytes();
        assert_eq!(Header::parse(&b, 1 << 20, 1 << 20), Ok(h));
    }

    #[test]
    fn rejects_bad_fields() {
        let h = Header::new(Opcode::Rpc, 1, 10).to_bytes();
        assert!(matches!(
            Header::parse(&h[..31], 100, 100),
            Err(FrameError::Truncated { .. })
        ));
        let mut m = h;
        m[0] = b'X';
        assert!(matches!(
            Header::parse(&m, 100, 100),
            Err(FrameError::BadMagic(_))
        ));
        let mut v = h;
        v[4] = 9;
        assert_eq!(Header::parse(&v, 100, 100), Err(FrameError::BadVersion(9)));
        let mut o = h;
        o[5] = 0xee;
        assert_eq!(
            Header::parse(&o, 100, 100),
            Err(FrameError::UnknownOpcode(0xee))
        );
        let mut f = h;
        f[7] = 0x80;
        assert!(matches!(
            Header::parse(&f, 100, 100),
            Err(FrameError::UnknownFlags(_))
        ));
        assert!(matches!(
            Header::parse(&h, 9, 100),
            Err(FrameError::Oversized { .. })
        ));
        let mut l = Header::new(Opcode::Rpc, 1, 10);
        l.message_len = 20;
        assert!(matches!(
            Header::parse(&l.to_bytes(), 100, 100),
            Err(FrameError::BadLength(_))
        ));
        let c = Header::new(Opcode::Credit, 0, 4);
        assert!(matches!(
            Header::parse(&c.to_bytes(), 100, 100),
            Err(FrameError::BadLength(_))
        ));
        let hello = Header::new(Opcode::Hello, 0, 4);
        assert!(Header::parse(&hello.to_bytes(), 100, 100).is_ok());
    }
}

//! The parameter-server protocol: the bodies of the `SparsePull`,
//! `SparsePush` and `Rpc` opcodes as workers and PS shards exchange them.
//! Explicit little-endian layouts, checked zero-copy views over a body,
//! writers that build a message item by item into a reused `Vec<u8>`.
//!
//! ```text
//! PullRequest   u8 version=1 | u8 kind=1 | u16 reserved=0 | u32 n_items | items
//!   Dense       u8 tag=1 | [u8;3] 0 | u32 var
//!   Rows        u8 tag=2 | [u8;3] 0 | u32 var | u32 n_keys | u64 keys[n_keys]
//!   Pooled      u8 tag=3 | [u8;3] 0 | u32 var | u32 batch | u32 n_keys
//!               | u32 offsets[batch+1] | u64 keys[n_keys]
//! PullResponse  u8 version | u8 kind=2 | u16 0 | u32 n_items | u64 global_step | replies
//!   Dense       u8 tag=1 | [u8;3] 0 | u32 var | u32 len | f32 data[len]
//!   Rows        u8 tag=2 | [u8;3] 0 | u32 var | u32 dim | u32 n_keys | f32 data[n_keys*dim]
//!   Pooled      u8 tag=3 | [u8;3] 0 | u32 var | u32 dim | u32 batch  | f32 data[batch*dim]
//! PushRequest   u8 version | u8 kind=3 | u8 flags (bit 0: completes_step) | u8 0 | u32 n_items | items
//!   Dense       u8 tag=1 | [u8;3] 0 | u32 var | u32 len | f32 grad[len]
//!   Rows        u8 tag=2 | [u8;3] 0 | u32 var | u32 dim | u32 n_keys | u64 keys[n_keys]
//!               | f32 grads[n_keys*dim]
//!   Pooled      u8 tag=3 | [u8;3] 0 | u32 var | u32 dim | u32 batch | u32 n_keys
//!               | u32 offsets[batch+1] | u64 keys[n_keys] | f32 grads[batch*dim]
//! PushResponse  u8 version | u8 kind=4 | u16 0 | u32 0 | u64 global_step
//! ```
//!
//! Replies come in request order. Offsets of a pooled item give example `b`
//! the keys `keys[offsets[b]..offsets[b+1]]`; they start at 0, never
//! decrease and end at `n_keys`. Arrays are unaligned and read with
//! `from_le_bytes` (the views never copy the body; [`F32s::copy_to`] and
//! [`F32s::add_to`] decode a whole row at once).
//!
//! Every parser checks each length against the bytes left and the
//! [`Limits`] before reading, computes sizes with checked arithmetic and
//! rejects trailing bytes, so no allocation is ever sized by the input.
//!
//! [`control`] holds the control messages carried by `Rpc` (the `--sync`
//! barrier, checkpoints, counters, the end of a worker).

pub mod control;
mod pull;
mod push;
#[cfg(test)]
mod tests;

pub use control::{Control, ControlError};
pub use pull::{
    pull_dense_len, pull_pooled_len, pull_request_header_len, pull_rows_len, PullItem, PullReply,
    PullRequest, PullRequestWriter, PullResponse, PullResponseWriter,
};
pub use push::{
    parse_push_response, push_dense_len, push_pooled_len, push_request_header_len, push_rows_len,
    write_push_response, PushItem, PushRequest, PushRequestWriter, PUSH_RESPONSE_LEN,
};

/// Protocol version byte.
pub const VERSION: u8 = 1;
/// Message kind byte of a pull request.
pub const KIND_PULL_REQUEST: u8 = 1;
/// Message kind byte of a pull response.
pub const KIND_PULL_RESPONSE: u8 = 2;
/// Message kind byte of a push request.
pub const KIND_PUSH_REQUEST: u8 = 3;
/// Message kind byte of a push response.
pub const KIND_PUSH_RESPONSE: u8 = 4;
/// Item tag: dense variable.
pub const TAG_DENSE: u8 = 1;
/// Item tag: rows of deduplicated keys (`star_server`).
pub const TAG_ROWS: u8 = 2;
/// Item tag: per-example pooled sums (`star_server_lite`).
pub const TAG_POOLED: u8 = 3;
/// Push flag bit: this push completes the worker's step on this shard.
pub const FLAG_COMPLETES_STEP: u8 = 1;

const MSG_HEADER: usize = 8;
const ITEM_HEADER: usize = 8;
const RESP_HEADER: usize = 16;

/// A pull or push body that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The buffer ended before a field of `what` could be read.
    #[error("truncated {what}: need {need} bytes, have {have}")]
    Truncated {
        /// The field or section being read.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// The version byte is not [`VERSION`].
    #[error("unsupported protocol version {0}")]
    BadVersion(u8),
    /// The message-kind byte is not the one expected.
    #[error("bad message kind {got} (expected {expected})")]
    BadKind {
        /// Kind byte found.
        got: u8,
        /// Kind byte expected.
        expected: u8,
    },
    /// An item tag that is not known.
    #[error("bad item tag {0}")]
    BadTag(u8),
    /// A reserved field or flag bit is not zero.
    #[error("reserved bits set in {0}")]
    Reserved(&'static str),
    /// A length computation overflowed `usize`.
    #[error("length overflow in {0}")]
    LengthOverflow(&'static str),
    /// A count is above the configured [`Limits`].
    #[error("oversized {what}: {len} > {max}")]
    Oversized {
        /// What was counted.
        what: &'static str,
        /// Value found.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
    /// Pooled offsets do not start at 0, decrease, or do not end at the key count.
    #[error("bad pooled offsets: {0}")]
    BadOffsets(&'static str),
    /// Bytes left over after the last item.
    #[error("{0} trailing bytes after the last item")]
    Trailing(usize),
}

/// Caps on counts in a request (beyond the implicit cap of the body length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Items per message.
    pub max_items: u32,
    /// Keys (or examples) per item.
    pub max_keys: u32,
    /// Floats per item (`n_keys * dim`, `batch * dim`, dense length).
    pub max_elems: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_items: 1 << 16,
            max_keys: 1 << 24,
            max_elems: 1 << 28,
        }
    }
}

macro_rules! le_array {
    ($(#[$m:meta])* $name:ident, $t:ty, $n:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name<'a>(&'a [u8]);

        impl<'a> $name<'a> {
            /// View over `bytes` (its length must be a multiple of the element size).
            pub fn new(bytes: &'a [u8]) -> Option<Self> {
                (bytes.len() % $n == 0).then_some(Self(bytes))
            }
            /// Number of elements.
            pub fn len(&self) -> usize {
                self.0.len() / $n
            }
            /// True when empty.
            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }
            /// Element `i`.
            pub fn get(&self, i: usize) -> Option<$t> {
                let b = self.0.get(i * $n..(i + 1) * $n)?;
                let mut a = [0u8; $n];
                a.copy_from_slice(b);
                Some(<$t>::from_le_bytes(a))
            }
            /// The elements in order.
            pub fn iter(&self) -> impl ExactSizeIterator<Item = $t> + 'a {
                self.0.chunks_exact($n).map(|c| {
                    let mut a = [0u8; $n];
                    a.copy_from_slice(c);
                    <$t>::from_le_bytes(a)
                })
            }
            /// The sub-view of elements `start..end` (clamped to the length).
            pub fn slice(&self, start: usize, end: usize) -> Self {
                let end = end.min(self.len());
                let start = start.min(end);
                Self(&self.0[start * $n..end * $n])
            }
            /// The raw little-endian bytes.
            pub fn as_bytes(&self) -> &'a [u8] {
                self.0
            }
            /// Copy out.
            pub fn to_vec(&self) -> Vec<$t> {
                self.iter().collect()
            }
        }
    };
}

le_array!(
    /// Little-endian `u64` array borrowed from a message.
    U64s, u64, 8
);
le_array!(
    /// Little-endian `u32` array borrowed from a message.
    U32s, u32, 4
);
le_array!(
    /// Little-endian `f32` array borrowed from a message.
    F32s, f32, 4
);

impl<'a> F32s<'a> {
    /// The elements as `&[f32]` where they are, without decoding a copy:
    /// `None` when the bytes are not 4-aligned in memory, or on a
    /// big-endian host, where the little-endian bytes are not native
    /// `f32`s (decode with [`copy_to`](Self::copy_to) there).
    pub fn try_as_slice(&self) -> Option<&'a [f32]> {
        if cfg!(target_endian = "big") {
            return None;
        }
        bytemuck::try_cast_slice(self.0).ok()
    }
    /// Overwrite `out` with the first `out.len()` elements (whole-slice
    /// decode, no per-element bounds check). Elements missing from a short
    /// view leave the rest of `out` unchanged.
    pub fn copy_to(&self, out: &mut [f32]) {
        for (o, c) in out.iter_mut().zip(self.0.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    /// Append every element to `out`: one copy of the bytes where they
    /// are native `f32`s ([`try_as_slice`](Self::try_as_slice)), else
    /// decoded once, straight into the vector's spare room (nothing is
    /// zeroed first).
    pub fn extend_into(&self, out: &mut Vec<f32>) {
        if let Some(s) = self.try_as_slice() {
            out.extend_from_slice(s);
            return;
        }
        out.extend(
            self.0
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
    }
    /// True when no element is NaN or infinite. The fold has no early
    /// exit, so it vectorises; decoding each element as an `f32` and
    /// asking `is_finite` compiles to a compare per vector, where
    /// testing the exponent bits of a `u32` made the compiler shuffle
    /// lanes.
    pub fn all_finite(&self) -> bool {
        self.0.chunks_exact(4).fold(true, |ok, c| {
            ok & f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()
        })
    }
    /// Add the first `out.len()` elements to `out`.
    pub fn add_to(&self, out: &mut [f32]) {
        for (o, c) in out.iter_mut().zip(self.0.chunks_exact(4)) {
            *o += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    /// A reader of `buf` past its first `pos` bytes (a header already checked).
    fn at(buf: &'a [u8], pos: usize) -> Self {
        Self { buf, pos }
    }
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if n > self.left() {
            return Err(DecodeError::Truncated {
                what,
                need: n,
                have: self.left(),
            });
        }
        let b = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(b)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.bytes(1, what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.bytes(8, what)?);
        Ok(u64::from_le_bytes(a))
    }
    /// `n` elements of `size` bytes.
    fn array(&mut self, n: u64, size: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(size))
            .ok_or(DecodeError::LengthOverflow(what))?;
        self.bytes(len, what)
    }
    fn finish(&self) -> Result<(), DecodeError> {
        match self.left() {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

fn check_limit(what: &'static str, len: u64, max: u64) -> Result<(), DecodeError> {
    if len > max {
        Err(DecodeError::Oversized { what, len, max })
    } else {
        Ok(())
    }
}

fn elems(a: u32, b: u32, limits: &Limits, what: &'static str) -> Result<u64, DecodeError> {
    let n = u64::from(a)
        .checked_mul(u64::from(b))
        .ok_or(DecodeError::LengthOverflow(what))?;
    check_limit(what, n, limits.max_elems)?;
    Ok(n)
}

/// The message header: version, `kind`, flags, reserved; returns the flags
/// and the item count.
fn header(r: &mut Reader<'_>, kind: u8) -> Result<(u8, u32), DecodeError> {
    let v = r.u8("version")?;
    if v != VERSION {
        return Err(DecodeError::BadVersion(v));
    }
    let k = r.u8("kind")?;
    if k != kind {
        return Err(DecodeError::BadKind {
            got: k,
            expected: kind,
        });
    }
    let flags = r.u8("flags")?;
    if r.u8("reserved")? != 0 {
        return Err(DecodeError::Reserved("message header"));
    }
    let n = r.u32("item count")?;
    Ok((flags, n))
}

fn item_header(r: &mut Reader<'_>) -> Result<(u8, u32), DecodeError> {
    let tag = r.u8("item tag")?;
    if r.bytes(3, "item header")? != [0, 0, 0] {
        return Err(DecodeError::Reserved("item header"));
    }
    let var = r.u32("variable id")?;
    if !(TAG_DENSE..=TAG_POOLED).contains(&tag) {
        return Err(DecodeError::BadTag(tag));
    }
    Ok((tag, var))
}

fn offsets<'a>(r: &mut Reader<'a>, batch: u32, n_keys: u32) -> Result<U32s<'a>, DecodeError> {
    let raw = r.array(u64::from(batch) + 1, 4, "offsets")?;
    let offs = U32s(raw);
    let mut prev = 0u32;
    for (i, o) in offs.iter().enumerate() {
        if i == 0 && o != 0 {
            return Err(DecodeError::BadOffsets("first offset is not 0"));
        }
        if o < prev {
            return Err(DecodeError::BadOffsets("offsets decrease"));
        }
        prev = o;
    }
    if prev != n_keys {
        return Err(DecodeError::BadOffsets("last offset is not the key count"));
    }
    Ok(offs)
}

/// Start item `n` (1-based) of a message being written: bump the header's
/// item count and write the item header.
fn put_item_header(buf: &mut Vec<u8>, n: u32, tag: u8, var: u32) {
    buf[4..8].copy_from_slice(&n.to_le_bytes());
    buf.extend_from_slice(&[tag, 0, 0, 0]);
    put_u32(buf, var);
}

fn len32(n: usize) -> u32 {
    // Counts above u32::MAX cannot be encoded; saturate so the receiver
    // rejects the message instead of misreading it.
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_le_bytes());
}

fn put_u32s(buf: &mut Vec<u8>, v: &[u32]) {
    buf.reserve(v.len() * 4);
    for x in v {
        buf.extend_from_slice(&x.to_le_bytes());
    }
}

fn put_u64s(buf: &mut Vec<u8>, v: &[u64]) {
    buf.reserve(v.len() * 8);
    for x in v {
        buf.extend_from_slice(&x.to_le_bytes());
    }
}

/// Append `v` little-endian: grow once, then fill the new bytes in one
/// pass. The data of a pull reply is written with it (see
/// [`PullResponseWriter`]).
pub fn put_f32s(buf: &mut Vec<u8>, v: &[f32]) {
    if cfg!(target_endian = "little") {
        // The wire's byte order: one copy, without zeroing the room first
        // (pulls copy every row of a reply through here).
        buf.extend_from_slice(bytemuck::cast_slice(v));
        return;
    }
    let start = buf.len();
    buf.resize(start + 4 * v.len(), 0);
    for (c, x) in buf[start..].chunks_exact_mut(4).zip(v) {
        c.copy_from_slice(&x.to_le_bytes());
    }
}

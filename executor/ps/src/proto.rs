//! The pull/push protocol codec: explicit little-endian layouts, checked
//! zero-copy views over the body, writers that build a message item by item
//! into a reused `Vec<u8>`.
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

use crate::error::DecodeError;

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

impl F32s<'_> {
    /// Overwrite `out` with the first `out.len()` elements (whole-slice
    /// decode, no per-element bounds check). Elements missing from a short
    /// view leave the rest of `out` unchanged.
    pub fn copy_to(&self, out: &mut [f32]) {
        for (o, c) in out.iter_mut().zip(self.0.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
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

// ---------------------------------------------------------------- pull request

/// One item of a pull request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullItem<'a> {
    /// The whole dense variable.
    Dense {
        /// Variable id.
        var: u32,
    },
    /// The rows of (deduplicated) keys.
    Rows {
        /// Variable id.
        var: u32,
        /// Keys.
        keys: U64s<'a>,
    },
    /// Per-example sums of this shard's rows.
    Pooled {
        /// Variable id.
        var: u32,
        /// `batch + 1` offsets into `keys`.
        offsets: U32s<'a>,
        /// Keys of all examples, example after example.
        keys: U64s<'a>,
    },
}

impl PullItem<'_> {
    /// The variable id.
    pub fn var(&self) -> u32 {
        match *self {
            PullItem::Dense { var } | PullItem::Rows { var, .. } | PullItem::Pooled { var, .. } => {
                var
            }
        }
    }
}

fn pull_item<'a>(r: &mut Reader<'a>, limits: &Limits) -> Result<PullItem<'a>, DecodeError> {
    let (tag, var) = item_header(r)?;
    Ok(match tag {
        TAG_DENSE => PullItem::Dense { var },
        TAG_ROWS => {
            let n = r.u32("key count")?;
            check_limit("keys", n.into(), limits.max_keys.into())?;
            PullItem::Rows {
                var,
                keys: U64s(r.array(n.into(), 8, "keys")?),
            }
        }
        _ => {
            let batch = r.u32("batch")?;
            let n = r.u32("key count")?;
            check_limit("batch", batch.into(), limits.max_keys.into())?;
            check_limit("keys", n.into(), limits.max_keys.into())?;
            let offsets = offsets(r, batch, n)?;
            PullItem::Pooled {
                var,
                offsets,
                keys: U64s(r.array(n.into(), 8, "keys")?),
            }
        }
    })
}

/// A checked view over a pull request.
#[derive(Debug, Clone, Copy)]
pub struct PullRequest<'a> {
    body: &'a [u8],
    n_items: u32,
    limits: Limits,
}

impl<'a> PullRequest<'a> {
    /// Validate the whole request (every item) and return the view.
    pub fn parse(body: &'a [u8], limits: &Limits) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let (flags, n_items) = header(&mut r, KIND_PULL_REQUEST)?;
        if flags != 0 {
            return Err(DecodeError::Reserved("pull flags"));
        }
        check_limit("items", n_items.into(), limits.max_items.into())?;
        for _ in 0..n_items {
            pull_item(&mut r, limits)?;
        }
        r.finish()?;
        Ok(Self {
            body,
            n_items,
            limits: *limits,
        })
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.n_items as usize
    }

    /// True when there is no item.
    pub fn is_empty(&self) -> bool {
        self.n_items == 0
    }

    /// The items in order.
    pub fn items(&self) -> impl Iterator<Item = PullItem<'a>> + 'a {
        let mut r = Reader::new(self.body);
        r.pos = MSG_HEADER;
        let limits = self.limits;
        // Already validated by `parse`: an error cannot happen here, it
        // would only end the iteration.
        (0..self.n_items).map_while(move |_| pull_item(&mut r, &limits).ok())
    }
}

/// Builds a pull request into a reused buffer, item by item.
#[derive(Debug)]
pub struct PullRequestWriter<'b> {
    buf: &'b mut Vec<u8>,
    n: u32,
}

impl<'b> PullRequestWriter<'b> {
    /// Clear `buf` and write the header.
    pub fn new(buf: &'b mut Vec<u8>) -> Self {
        buf.clear();
        buf.extend_from_slice(&[VERSION, KIND_PULL_REQUEST, 0, 0, 0, 0, 0, 0]);
        Self { buf, n: 0 }
    }
    fn item(&mut self, tag: u8, var: u32) {
        self.n += 1;
        self.buf[4..8].copy_from_slice(&self.n.to_le_bytes());
        self.buf.extend_from_slice(&[tag, 0, 0, 0]);
        put_u32(self.buf, var);
    }
    /// Add a dense item.
    pub fn dense(&mut self, var: u32) -> &mut Self {
        self.item(TAG_DENSE, var);
        self
    }
    /// Add a rows item.
    pub fn rows(&mut self, var: u32, keys: &[u64]) -> &mut Self {
        self.item(TAG_ROWS, var);
        put_u32(self.buf, len32(keys.len()));
        put_u64s(self.buf, keys);
        self
    }
    /// Add a pooled item; `offsets` has `batch + 1` entries, starts at 0 and ends at `keys.len()`.
    pub fn pooled(&mut self, var: u32, offsets: &[u32], keys: &[u64]) -> &mut Self {
        self.item(TAG_POOLED, var);
        put_u32(self.buf, len32(offsets.len().saturating_sub(1)));
        put_u32(self.buf, len32(keys.len()));
        put_u32s(self.buf, offsets);
        put_u64s(self.buf, keys);
        self
    }
    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// True when nothing but the header was written.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// Encoded size of a pull request header.
pub const fn pull_request_header_len() -> usize {
    MSG_HEADER
}
/// Encoded size of a dense pull item.
pub const fn pull_dense_len() -> usize {
    ITEM_HEADER
}
/// Encoded size of a rows pull item.
pub const fn pull_rows_len(n_keys: usize) -> usize {
    ITEM_HEADER + 4 + 8 * n_keys
}
/// Encoded size of a pooled pull item.
pub const fn pull_pooled_len(batch: usize, n_keys: usize) -> usize {
    ITEM_HEADER + 8 + 4 * (batch + 1) + 8 * n_keys
}

// --------------------------------------------------------------- pull response

/// One reply of a pull response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullReply<'a> {
    /// A dense variable.
    Dense {
        /// Variable id.
        var: u32,
        /// Its values.
        data: F32s<'a>,
    },
    /// Rows in key order (zeros for keys the filter holds back).
    Rows {
        /// Variable id.
        var: u32,
        /// Row width.
        dim: u32,
        /// `n_keys * dim` floats.
        data: F32s<'a>,
    },
    /// Per-example sums.
    Pooled {
        /// Variable id.
        var: u32,
        /// Row width.
        dim: u32,
        /// `batch * dim` floats.
        data: F32s<'a>,
    },
}

fn pull_reply<'a>(r: &mut Reader<'a>, limits: &Limits) -> Result<PullReply<'a>, DecodeError> {
    let (tag, var) = item_header(r)?;
    Ok(match tag {
        TAG_DENSE => {
            let n = r.u32("length")?;
            check_limit("dense length", n.into(), limits.max_elems)?;
            PullReply::Dense {
                var,
                data: F32s(r.array(n.into(), 4, "dense data")?),
            }
        }
        t => {
            let dim = r.u32("dim")?;
            let n = r.u32("rows")?;
            check_limit("rows", n.into(), limits.max_keys.into())?;
            let e = elems(n, dim, limits, "reply data")?;
            let data = F32s(r.array(e, 4, "reply data")?);
            if t == TAG_ROWS {
                PullReply::Rows { var, dim, data }
            } else {
                PullReply::Pooled { var, dim, data }
            }
        }
    })
}

/// A checked view over a pull response.
#[derive(Debug, Clone, Copy)]
pub struct PullResponse<'a> {
    body: &'a [u8],
    n_items: u32,
    /// The shard's global step when it answered.
    pub global_step: u64,
    limits: Limits,
}

impl<'a> PullResponse<'a> {
    /// Validate the whole response.
    pub fn parse(body: &'a [u8], limits: &Limits) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let (flags, n_items) = header(&mut r, KIND_PULL_RESPONSE)?;
        if flags != 0 {
            return Err(DecodeError::Reserved("pull response flags"));
        }
        check_limit("items", n_items.into(), limits.max_items.into())?;
        let global_step = r.u64("global step")?;
        for _ in 0..n_items {
            pull_reply(&mut r, limits)?;
        }
        r.finish()?;
        Ok(Self {
            body,
            n_items,
            global_step,
            limits: *limits,
        })
    }
    /// Number of replies.
    pub fn len(&self) -> usize {
        self.n_items as usize
    }
    /// True when there is no reply.
    pub fn is_empty(&self) -> bool {
        self.n_items == 0
    }
    /// Replies in request order.
    pub fn items(&self) -> impl Iterator<Item = PullReply<'a>> + 'a {
        let mut r = Reader::new(self.body);
        r.pos = RESP_HEADER;
        let limits = self.limits;
        (0..self.n_items).map_while(move |_| pull_reply(&mut r, &limits).ok())
    }
}

/// Builds a pull response (used by the shard).
#[derive(Debug)]
pub(crate) struct PullResponseWriter<'b> {
    pub(crate) buf: &'b mut Vec<u8>,
    n: u32,
}

impl<'b> PullResponseWriter<'b> {
    pub(crate) fn new(buf: &'b mut Vec<u8>, global_step: u64) -> Self {
        buf.clear();
        buf.extend_from_slice(&[VERSION, KIND_PULL_RESPONSE, 0, 0, 0, 0, 0, 0]);
        buf.extend_from_slice(&global_step.to_le_bytes());
        Self { buf, n: 0 }
    }
    /// Start a reply; the caller then appends the data floats.
    pub(crate) fn reply(&mut self, tag: u8, var: u32, a: u32, b: Option<u32>) {
        self.n += 1;
        self.buf[4..8].copy_from_slice(&self.n.to_le_bytes());
        self.buf.extend_from_slice(&[tag, 0, 0, 0]);
        put_u32(self.buf, var);
        put_u32(self.buf, a);
        if let Some(b) = b {
            put_u32(self.buf, b);
        }
    }
}

// ---------------------------------------------------------------- push request

/// One item of a push request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushItem<'a> {
    /// Gradient of a dense variable.
    Dense {
        /// Variable id.
        var: u32,
        /// Gradient.
        grad: F32s<'a>,
    },
    /// Row gradients.
    Rows {
        /// Variable id.
        var: u32,
        /// Row width.
        dim: u32,
        /// Keys (duplicates are summed).
        keys: U64s<'a>,
        /// `n_keys * dim` floats.
        grads: F32s<'a>,
    },
    /// Pooled gradients, scattered to every key of each example.
    Pooled {
        /// Variable id.
        var: u32,
        /// Row width.
        dim: u32,
        /// `batch + 1` offsets into `keys`.
        offsets: U32s<'a>,
        /// Keys of all examples.
        keys: U64s<'a>,
        /// `batch * dim` floats.
        grads: F32s<'a>,
    },
}

impl PushItem<'_> {
    /// The variable id.
    pub fn var(&self) -> u32 {
        match *self {
            PushItem::Dense { var, .. }
            | PushItem::Rows { var, .. }
            | PushItem::Pooled { var, .. } => var,
        }
    }
}

fn push_item<'a>(r: &mut Reader<'a>, limits: &Limits) -> Result<PushItem<'a>, DecodeError> {
    let (tag, var) = item_header(r)?;
    Ok(match tag {
        TAG_DENSE => {
            let n = r.u32("length")?;
            check_limit("dense length", n.into(), limits.max_elems)?;
            PushItem::Dense {
                var,
                grad: F32s(r.array(n.into(), 4, "dense gradient")?),
            }
        }
        TAG_ROWS => {
            let dim = r.u32("dim")?;
            let n = r.u32("key count")?;
            check_limit("keys", n.into(), limits.max_keys.into())?;
            let e = elems(n, dim, limits, "row gradients")?;
            let keys = U64s(r.array(n.into(), 8, "keys")?);
            PushItem::Rows {
                var,
                dim,
                keys,
                grads: F32s(r.array(e, 4, "row gradients")?),
            }
        }
        _ => {
            let dim = r.u32("dim")?;
            let batch = r.u32("batch")?;
            let n = r.u32("key count")?;
            check_limit("batch", batch.into(), limits.max_keys.into())?;
            check_limit("keys", n.into(), limits.max_keys.into())?;
            let e = elems(batch, dim, limits, "pooled gradients")?;
            let offsets = offsets(r, batch, n)?;
            let keys = U64s(r.array(n.into(), 8, "keys")?);
            PushItem::Pooled {
                var,
                dim,
                offsets,
                keys,
                grads: F32s(r.array(e, 4, "pooled gradients")?),
            }
        }
    })
}

/// A checked view over a push request.
#[derive(Debug, Clone, Copy)]
pub struct PushRequest<'a> {
    body: &'a [u8],
    n_items: u32,
    /// The sender's last push of its step to this shard.
    pub completes_step: bool,
    limits: Limits,
}

impl<'a> PushRequest<'a> {
    /// Validate the whole request.
    pub fn parse(body: &'a [u8], limits: &Limits) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let (flags, n_items) = header(&mut r, KIND_PUSH_REQUEST)?;
        if flags & !FLAG_COMPLETES_STEP != 0 {
            return Err(DecodeError::Reserved("push flags"));
        }
        check_limit("items", n_items.into(), limits.max_items.into())?;
        for _ in 0..n_items {
            push_item(&mut r, limits)?;
        }
        r.finish()?;
        Ok(Self {
            body,
            n_items,
            completes_step: flags & FLAG_COMPLETES_STEP != 0,
            limits: *limits,
        })
    }
    /// Number of items.
    pub fn len(&self) -> usize {
        self.n_items as usize
    }
    /// True when there is no item.
    pub fn is_empty(&self) -> bool {
        self.n_items == 0
    }
    /// The items in order.
    pub fn items(&self) -> impl Iterator<Item = PushItem<'a>> + 'a {
        let mut r = Reader::new(self.body);
        r.pos = MSG_HEADER;
        let limits = self.limits;
        (0..self.n_items).map_while(move |_| push_item(&mut r, &limits).ok())
    }
}

/// Builds a push request into a reused buffer, item by item.
#[derive(Debug)]
pub struct PushRequestWriter<'b> {
    buf: &'b mut Vec<u8>,
    n: u32,
}

impl<'b> PushRequestWriter<'b> {
    /// Clear `buf` and write the header.
    pub fn new(buf: &'b mut Vec<u8>, completes_step: bool) -> Self {
        buf.clear();
        let flags = if completes_step {
            FLAG_COMPLETES_STEP
        } else {
            0
        };
        buf.extend_from_slice(&[VERSION, KIND_PUSH_REQUEST, flags, 0, 0, 0, 0, 0]);
        Self { buf, n: 0 }
    }
    fn item(&mut self, tag: u8, var: u32) {
        self.n += 1;
        self.buf[4..8].copy_from_slice(&self.n.to_le_bytes());
        self.buf.extend_from_slice(&[tag, 0, 0, 0]);
        put_u32(self.buf, var);
    }
    /// Add a dense gradient.
    pub fn dense(&mut self, var: u32, grad: &[f32]) -> &mut Self {
        self.item(TAG_DENSE, var);
        put_u32(self.buf, len32(grad.len()));
        put_f32s(self.buf, grad);
        self
    }
    /// Add row gradients (`grads.len()` should be `keys.len() * dim`; the
    /// shard rejects the request otherwise).
    pub fn rows(&mut self, var: u32, dim: u32, keys: &[u64], grads: &[f32]) -> &mut Self {
        self.item(TAG_ROWS, var);
        put_u32(self.buf, dim);
        put_u32(self.buf, len32(keys.len()));
        put_u64s(self.buf, keys);
        put_f32s(self.buf, grads);
        self
    }
    /// Add pooled gradients (`grads.len()` should be `(offsets.len() - 1) * dim`).
    pub fn pooled(
        &mut self,
        var: u32,
        dim: u32,
        offsets: &[u32],
        keys: &[u64],
        grads: &[f32],
    ) -> &mut Self {
        self.item(TAG_POOLED, var);
        put_u32(self.buf, dim);
        put_u32(self.buf, len32(offsets.len().saturating_sub(1)));
        put_u32(self.buf, len32(keys.len()));
        put_u32s(self.buf, offsets);
        put_u64s(self.buf, keys);
        put_f32s(self.buf, grads);
        self
    }
    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// True when nothing but the header was written.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// Encoded size of a push request header.
pub const fn push_request_header_len() -> usize {
    MSG_HEADER
}
/// Encoded size of a dense push item.
pub const fn push_dense_len(len: usize) -> usize {
    ITEM_HEADER + 4 + 4 * len
}
/// Encoded size of a rows push item.
pub const fn push_rows_len(n_keys: usize, dim: usize) -> usize {
    ITEM_HEADER + 8 + 8 * n_keys + 4 * n_keys * dim
}
/// Encoded size of a pooled push item.
pub const fn push_pooled_len(batch: usize, n_keys: usize, dim: usize) -> usize {
    ITEM_HEADER + 12 + 4 * (batch + 1) + 8 * n_keys + 4 * batch * dim
}

// --------------------------------------------------------------- push response

/// Length of a push response.
pub const PUSH_RESPONSE_LEN: usize = RESP_HEADER;

/// Write a push response into `out` (cleared first).
pub fn write_push_response(out: &mut Vec<u8>, global_step: u64) {
    out.clear();
    out.extend_from_slice(&[VERSION, KIND_PUSH_RESPONSE, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&global_step.to_le_bytes());
}

/// Parse a push response: the shard's global step after the push.
pub fn parse_push_response(body: &[u8]) -> Result<u64, DecodeError> {
    let mut r = Reader::new(body);
    let (flags, zero) = header(&mut r, KIND_PUSH_RESPONSE)?;
    if flags != 0 || zero != 0 {
        return Err(DecodeError::Reserved("push response header"));
    }
    let step = r.u64("global step")?;
    r.finish()?;
    Ok(step)
}

// ----------------------------------------------------------------- primitives

fn len32(n: usize) -> u32 {
    // Counts above u32::MAX cannot be encoded; saturate so the receiver
    // rejects the message instead of misreading it.
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn put_u32(buf: &mut Vec<u8>, v: u32) {
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

/// Append `v` little-endian: grow once, then fill the new bytes in one pass.
pub(crate) fn put_f32s(buf: &mut Vec<u8>, v: &[f32]) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_request_round_trip_and_sizes() {
        let mut buf = Vec::new();
        let mut w = PullRequestWriter::new(&mut buf);
        w.dense(1)
            .rows(2, &[5, 6, 7])
            .pooled(3, &[0, 2, 3], &[9, 8, 9]);
        let n = w.len();
        assert_eq!(
            n,
            pull_request_header_len() + pull_dense_len() + pull_rows_len(3) + pull_pooled_len(2, 3)
        );
        let req = PullRequest::parse(&buf, &Limits::default()).unwrap();
        let items: Vec<_> = req.items().collect();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0], PullItem::Dense { var: 1 });
        match items[1] {
            PullItem::Rows { var, keys } => {
                assert_eq!(var, 2);
                assert_eq!(keys.to_vec(), vec![5, 6, 7]);
            }
            _ => panic!("not rows"),
        }
        match items[2] {
            PullItem::Pooled { var, offsets, keys } => {
                assert_eq!(var, 3);
                assert_eq!(offsets.to_vec(), vec![0, 2, 3]);
                assert_eq!(keys.slice(2, 3).to_vec(), vec![9]);
            }
            _ => panic!("not pooled"),
        }
    }

    #[test]
    fn push_request_round_trip_and_sizes() {
        let mut buf = Vec::new();
        let mut w = PushRequestWriter::new(&mut buf, true);
        w.dense(1, &[1.0, 2.0])
            .rows(2, 2, &[4], &[0.5, 0.25])
            .pooled(3, 1, &[0, 1, 1], &[4], &[1.0, 2.0]);
        assert_eq!(
            w.len(),
            push_request_header_len()
                + push_dense_len(2)
                + push_rows_len(1, 2)
                + push_pooled_len(2, 1, 1)
        );
        let req = PushRequest::parse(&buf, &Limits::default()).unwrap();
        assert!(req.completes_step);
        let items: Vec<_> = req.items().collect();
        assert_eq!(items.len(), 3);
        assert!(matches!(items[1], PushItem::Rows { dim: 2, .. }));
    }

    #[test]
    fn decode_errors() {
        let l = Limits::default();
        let mut buf = Vec::new();
        PullRequestWriter::new(&mut buf).rows(2, &[5, 6]);
        // Truncated at every length.
        for cut in 0..buf.len() {
            assert!(matches!(
                PullRequest::parse(&buf[..cut], &l),
                Err(DecodeError::Truncated { .. })
            ));
        }
        let mut b = buf.clone();
        b[0] = 9;
        assert_eq!(
            PullRequest::parse(&b, &l).unwrap_err(),
            DecodeError::BadVersion(9)
        );
        let mut b = buf.clone();
        b[1] = KIND_PUSH_REQUEST;
        assert!(matches!(
            PullRequest::parse(&b, &l),
            Err(DecodeError::BadKind { .. })
        ));
        let mut b = buf.clone();
        b[8] = 7;
        assert_eq!(
            PullRequest::parse(&b, &l).unwrap_err(),
            DecodeError::BadTag(7)
        );
        let mut b = buf.clone();
        b[9] = 1;
        assert!(matches!(
            PullRequest::parse(&b, &l),
            Err(DecodeError::Reserved(_))
        ));
        let mut b = buf.clone();
        b.push(0);
        assert_eq!(
            PullRequest::parse(&b, &l).unwrap_err(),
            DecodeError::Trailing(1)
        );
        let small = Limits { max_keys: 1, ..l };
        assert!(matches!(
            PullRequest::parse(&buf, &small),
            Err(DecodeError::Oversized { what: "keys", .. })
        ));
        let mut b = buf.clone();
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            PullRequest::parse(&b, &l),
            Err(DecodeError::Oversized { what: "items", .. })
        ));
        // A huge element count overflows or is oversized, never allocates.
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, false).rows(1, u32::MAX, &[1], &[]);
        assert!(matches!(
            PushRequest::parse(&b, &l),
            Err(DecodeError::Oversized { .. })
        ));
        let huge = Limits {
            max_elems: u64::MAX,
            max_keys: u32::MAX,
            ..l
        };
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, false).rows(1, u32::MAX, &[1], &[]);
        b[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            PushRequest::parse(&b, &huge),
            Err(DecodeError::Truncated { .. } | DecodeError::LengthOverflow(_))
        ));
    }

    #[test]
    fn length_overflow() {
        // Only reachable where usize is narrower than the product; checked directly.
        let mut r = Reader::new(&[]);
        assert_eq!(
            r.array(u64::MAX, 8, "keys").unwrap_err(),
            DecodeError::LengthOverflow("keys")
        );
        let l = Limits {
            max_elems: u64::MAX,
            ..Limits::default()
        };
        assert_eq!(
            elems(u32::MAX, u32::MAX, &l, "x"),
            Ok(u64::from(u32::MAX) * u64::from(u32::MAX))
        );
    }

    #[test]
    fn bad_offsets() {
        let l = Limits::default();
        for offs in [[1u32, 1, 2], [0, 2, 1], [0, 1, 1]] {
            let mut b = Vec::new();
            PullRequestWriter::new(&mut b).pooled(1, &offs, &[1, 2]);
            assert!(
                matches!(PullRequest::parse(&b, &l), Err(DecodeError::BadOffsets(_))),
                "{offs:?}"
            );
        }
    }

    #[test]
    fn push_response_round_trip() {
        let mut b = Vec::new();
        write_push_response(&mut b, 77);
        assert_eq!(b.len(), PUSH_RESPONSE_LEN);
        assert_eq!(parse_push_response(&b), Ok(77));
        b[2] = 1;
        assert!(parse_push_response(&b).is_err());
    }
}

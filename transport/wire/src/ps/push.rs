//! Push requests and their responses.

use super::{
    check_limit, elems, header, item_header, len32, offsets, put_f32s, put_item_header, put_u32,
    put_u32s, put_u64s, DecodeError, F32s, Limits, Reader, U32s, U64s, FLAG_COMPLETES_STEP,
    ITEM_HEADER, KIND_PUSH_REQUEST, KIND_PUSH_RESPONSE, MSG_HEADER, RESP_HEADER, TAG_DENSE,
    TAG_POOLED, TAG_ROWS, VERSION,
};

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
            // The shard sums a pooled gradient into a row of `dim` floats
            // per distinct key: bounded as a rows push's gradients are,
            // though the request carries only the keys.
            elems(n, dim, limits, "pooled keys' rows")?;
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
    /// Whether `body` is flagged `completes_step`, from its header alone
    /// (the items are checked by [`parse`](Self::parse) when it is applied).
    pub fn peek_completes_step(body: &[u8]) -> Result<bool, DecodeError> {
        let mut r = Reader::new(body);
        let (flags, _) = header(&mut r, KIND_PUSH_REQUEST)?;
        if flags & !FLAG_COMPLETES_STEP != 0 {
            return Err(DecodeError::Reserved("push flags"));
        }
        Ok(flags & FLAG_COMPLETES_STEP != 0)
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
        let mut r = Reader::at(self.body, MSG_HEADER);
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
        put_item_header(self.buf, self.n, tag, var);
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

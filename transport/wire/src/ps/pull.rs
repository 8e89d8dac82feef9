//! Pull requests and their responses.

use super::{
    check_limit, elems, header, item_header, len32, offsets, put_item_header, put_u32, put_u32s,
    put_u64s, DecodeError, F32s, Limits, Reader, U32s, U64s, ITEM_HEADER, KIND_PULL_REQUEST,
    KIND_PULL_RESPONSE, MSG_HEADER, RESP_HEADER, TAG_DENSE, TAG_POOLED, TAG_ROWS, VERSION,
};

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

impl<'a> PullItem<'a> {
    /// The keys of a rows or pooled item; `None` for a dense one.
    pub fn keys(&self) -> Option<U64s<'a>> {
        match *self {
            PullItem::Dense { .. } => None,
            PullItem::Rows { keys, .. } | PullItem::Pooled { keys, .. } => Some(keys),
        }
    }

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
        let mut r = Reader::at(self.body, MSG_HEADER);
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
        put_item_header(self.buf, self.n, tag, var);
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
        let mut r = Reader::at(self.body, RESP_HEADER);
        let limits = self.limits;
        (0..self.n_items).map_while(move |_| pull_reply(&mut r, &limits).ok())
    }
}

/// Builds a pull response into a reused buffer: each reply's header, then
/// its floats, which the shard appends (with [`put_f32s`](super::put_f32s))
/// to the buffer the reply's method returns, straight from its rows.
#[derive(Debug)]
pub struct PullResponseWriter<'b> {
    buf: &'b mut Vec<u8>,
    n: u32,
}

impl<'b> PullResponseWriter<'b> {
    /// Clear `buf` and write the header with the shard's `global_step`.
    pub fn new(buf: &'b mut Vec<u8>, global_step: u64) -> Self {
        buf.clear();
        buf.extend_from_slice(&[VERSION, KIND_PULL_RESPONSE, 0, 0, 0, 0, 0, 0]);
        buf.extend_from_slice(&global_step.to_le_bytes());
        Self { buf, n: 0 }
    }
    fn reply(&mut self, tag: u8, var: u32, a: u32, b: Option<u32>) -> &mut Vec<u8> {
        self.n += 1;
        put_item_header(self.buf, self.n, tag, var);
        put_u32(self.buf, a);
        if let Some(b) = b {
            put_u32(self.buf, b);
        }
        self.buf
    }
    /// Start a dense reply; append its `len` floats to the returned buffer.
    pub fn dense(&mut self, var: u32, len: u32) -> &mut Vec<u8> {
        self.reply(TAG_DENSE, var, len, None)
    }
    /// Start a rows reply; append its `n_keys * dim` floats to the returned
    /// buffer.
    pub fn rows(&mut self, var: u32, dim: u32, n_keys: u32) -> &mut Vec<u8> {
        self.reply(TAG_ROWS, var, dim, Some(n_keys))
    }
    /// Start a pooled reply; append its `batch * dim` floats to the
    /// returned buffer.
    pub fn pooled(&mut self, var: u32, dim: u32, batch: u32) -> &mut Vec<u8> {
        self.reply(TAG_POOLED, var, dim, Some(batch))
    }
}

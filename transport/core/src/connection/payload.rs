//! [`Payload`]: the body of a message to send, as a gather list.

use bytes::Bytes;

/// A message payload: owned segments sent back to back (a gather list), so
/// tensors held in `Bytes` reach a vectored write without a copy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    segs: Vec<Bytes>,
    len: usize,
}

impl Payload {
    /// An empty body.
    pub fn empty() -> Self {
        Self::default()
    }
    /// A body of one segment.
    pub fn from_bytes(b: impl Into<Bytes>) -> Self {
        let b = b.into();
        let len = b.len();
        Self { segs: vec![b], len }
    }
    /// Append a segment.
    pub fn push(&mut self, b: Bytes) {
        self.len += b.len();
        if !b.is_empty() {
            self.segs.push(b);
        }
    }
    /// Move `other`'s segments to the end of this body.
    pub fn append(&mut self, other: Payload) {
        self.len += other.len;
        self.segs.extend(other.segs);
    }
    /// Total length.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The segments.
    pub fn segments(&self) -> &[Bytes] {
        &self.segs
    }
    /// The segments covering `[from, from + n)`, sliced without copying.
    pub(super) fn slice(&self, from: usize, n: usize, out: &mut Vec<Bytes>) {
        out.clear();
        let mut skip = from;
        let mut want = n;
        for s in &self.segs {
            if want == 0 {
                break;
            }
            if skip >= s.len() {
                skip -= s.len();
                continue;
            }
            let take = (s.len() - skip).min(want);
            out.push(s.slice(skip..skip + take));
            want -= take;
            skip = 0;
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Self::from_bytes(v)
    }
}

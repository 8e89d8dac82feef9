//! Fused tensor lists: the body of an `Opcode::Tensors` message.
//!
//! ```text
//! offset size      field
//!  0     4         count     u32 LE: number of tensor records
//!  4     4         reserved  must be zero
//!  8     ...       count tensor records (see `tensor`), each a multiple of 8 long
//! ```
//!
//! The records fill the body exactly: no bytes may follow the last one.

use crate::header::FrameError;
use crate::le;
use crate::tensor::{TensorRecord, TensorView, MIN_RECORD_LEN};

/// Bytes before the first record.
pub const LIST_HEAD_LEN: usize = 8;

/// A validated list of tensor records borrowed from a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorList<'a> {
    count: u32,
    records: &'a [u8],
}

impl<'a> TensorList<'a> {
    /// Parse and validate the whole body: the head and every record.
    ///
    /// A `count` larger than the body could hold (each record takes at least
    /// [`MIN_RECORD_LEN`] bytes) is rejected with [`FrameError::BadLength`]
    /// before any record is looked at; nothing is allocated. Bytes after the
    /// last record are rejected with [`FrameError::BadLength`] too.
    pub fn parse(body: &'a [u8]) -> Result<Self, FrameError> {
        let count = le::u32_at(body, 0)?;
        if le::u32_at(body, 4)? != 0 {
            return Err(FrameError::Malformed(
                "non-zero reserved field in tensor list",
            ));
        }
        let records = body.get(LIST_HEAD_LEN..).unwrap_or_default();
        if count as usize > records.len() / MIN_RECORD_LEN {
            return Err(FrameError::BadLength(
                "tensor count exceeds what the body can hold",
            ));
        }
        let mut off = 0usize;
        for _ in 0..count {
            let rest = records.get(off..).unwrap_or_default();
            let (_, used) = TensorView::parse(rest)?;
            off += used;
        }
        if off != records.len() {
            return Err(FrameError::BadLength("bytes after the last tensor record"));
        }
        Ok(Self { count, records })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    /// True when the list holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Iterate the tensors in order.
    pub fn iter(&self) -> TensorIter<'a> {
        TensorIter {
            rest: self.records,
            left: self.count,
        }
    }
}

impl<'a> IntoIterator for TensorList<'a> {
    type Item = TensorView<'a>;
    type IntoIter = TensorIter<'a>;
    fn into_iter(self) -> TensorIter<'a> {
        self.iter()
    }
}

/// Iterator over the tensors of a [`TensorList`].
#[derive(Debug, Clone)]
pub struct TensorIter<'a> {
    rest: &'a [u8],
    left: u32,
}

impl<'a> Iterator for TensorIter<'a> {
    type Item = TensorView<'a>;
    fn next(&mut self) -> Option<TensorView<'a>> {
        if self.left == 0 {
            return None;
        }
        // Already validated by `TensorList::parse`; an error cannot happen
        // but would simply end the iteration.
        let (v, used) = TensorView::parse(self.rest).ok()?;
        self.rest = self.rest.get(used..).unwrap_or_default();
        self.left -= 1;
        Some(v)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.left as usize))
    }
}

/// Encoded body length of a list of `tensors`.
pub fn encoded_len<T: TensorRecord>(tensors: &[T]) -> usize {
    tensors
        .iter()
        .fold(LIST_HEAD_LEN, |n, t| n.saturating_add(t.encoded_len()))
}

/// Write the body for `tensors` into `out`; returns
/// [`encoded_len`]`(tensors)`.
///
/// # Panics
/// If `out` is too short, there are more than `u32::MAX` tensors, or a
/// tensor is invalid (see [`TensorRecord::emit`]).
pub fn emit<T: TensorRecord>(tensors: &[T], out: &mut [u8]) -> usize {
    let len = encoded_len(tensors);
    le::need(out, len, "tensors::emit");
    let count = u32::try_from(tensors.len()).expect("more than u32::MAX tensors");
    le::put_u32(out, 0, count);
    le::put_u32(out, 4, 0);
    let mut off = LIST_HEAD_LEN;
    for t in tensors {
        off += t.emit(&mut out[off..]);
    }
    off
}

/// Incremental encoder of a tensor list into a caller-provided buffer
/// (for example a backend's transmit reservation).
#[derive(Debug)]
pub struct TensorListWriter<'b> {
    out: &'b mut [u8],
    off: usize,
    count: u32,
}

impl<'b> TensorListWriter<'b> {
    /// Start a list in `out`. Fails with [`FrameError::Truncated`] when
    /// `out` cannot hold the 8-byte list head.
    pub fn new(out: &'b mut [u8]) -> Result<Self, FrameError> {
        if out.len() < LIST_HEAD_LEN {
            return Err(FrameError::Truncated {
                needed: LIST_HEAD_LEN,
                have: out.len(),
            });
        }
        Ok(Self {
            out,
            off: LIST_HEAD_LEN,
            count: 0,
        })
    }

    /// Bytes written so far, head included.
    pub fn len(&self) -> usize {
        self.off
    }

    /// True when no tensor has been pushed yet.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes still free in the buffer.
    pub fn remaining(&self) -> usize {
        self.out.len() - self.off
    }

    /// Append one tensor; returns its record length. Fails with
    /// [`FrameError::Truncated`] (nothing written) when it does not fit, so
    /// the caller can finish this list and start another.
    ///
    /// # Panics
    /// If the tensor is invalid (see [`TensorRecord::emit`]).
    pub fn push<T: TensorRecord + ?Sized>(&mut self, t: &T) -> Result<usize, FrameError> {
        let len = t.encoded_len();
        if len > self.remaining() {
            return Err(FrameError::Truncated {
                needed: self.off.saturating_add(len),
                have: self.out.len(),
            });
        }
        let count = self
            .count
            .checked_add(1)
            .ok_or(FrameError::BadLength("more than u32::MAX tensors"))?;
        let n = t.emit(&mut self.out[self.off..]);
        self.off += n;
        self.count = count;
        Ok(n)
    }

    /// Write the list head and return the body length.
    pub fn finish(self) -> usize {
        le::put_u32(self.out, 0, self.count);
        le::put_u32(self.out, 4, 0);
        self.off
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, TensorRef};

    fn sample() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let a: Vec<u8> = (0..12).collect();
        let b: Vec<u8> = [3i64, -1].iter().flat_map(|x| x.to_le_bytes()).collect();
        let c: Vec<u8> = [0.5f32].iter().flat_map(|x| x.to_le_bytes()).collect();
        (a, b, c)
    }

    #[test]
    fn round_trip_and_writer_agree() {
        let (a, b, c) = sample();
        let ts = [
            TensorRef::new(1, DType::U8, &[3, 4], &a).unwrap(),
            TensorRef::new(2, DType::I64, &[2], &b).unwrap(),
            TensorRef::new(3, DType::F32, &[], &c).unwrap(),
        ];
        let len = encoded_len(&ts);
        let mut body = vec![0xcc; len];
        assert_eq!(emit(&ts, &mut body), len);
        let list = TensorList::parse(&body).unwrap();
        assert_eq!(list.len(), 3);
        let got: Vec<_> = list.iter().collect();
        assert_eq!(got[0].key(), 1);
        assert_eq!(got[0].data(), &a[..]);
        assert_eq!(got[1].i64s().unwrap().collect::<Vec<_>>(), vec![3, -1]);
        assert_eq!(got[2].f32s().unwrap().collect::<Vec<_>>(), vec![0.5]);
        for v in &got {
            assert!(body.as_ptr_range().contains(&v.data().as_ptr()));
        }

        let mut buf = vec![0u8; len + 5];
        let mut w = TensorListWriter::new(&mut buf).unwrap();
        assert!(w.is_empty());
        for t in &ts {
            w.push(t).unwrap();
        }
        // the forwarded views re-encode identically
        let n = w.finish();
        assert_eq!(&buf[..n], &body[..]);
        let mut fwd = vec![0u8; encoded_len(&got)];
        emit(&got, &mut fwd);
        assert_eq!(fwd, body);
    }

    #[test]
    fn writer_reports_full() {
        let (a, _, _) = sample();
        let t = TensorRef::new(1, DType::U8, &[12], &a).unwrap();
        let mut buf = [0u8; 60];
        let mut w = TensorListWriter::new(&mut buf).unwrap();
        assert_eq!(w.push(&t).unwrap(), 48);
        assert!(matches!(w.push(&t), Err(FrameError::Truncated { .. })));
        assert_eq!(w.finish(), 56);
        assert!(TensorList::parse(&buf[..56]).is_ok());
        assert!(matches!(
            TensorListWriter::new(&mut [0u8; 4]),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn empty_list() {
        let mut body = [0u8; 8];
        assert_eq!(emit::<TensorRef<'_>>(&[], &mut body), 8);
        let l = TensorList::parse(&body).unwrap();
        assert!(l.is_empty());
        assert_eq!(l.iter().count(), 0);
    }

    #[test]
    fn rejects() {
        assert!(matches!(
            TensorList::parse(&[0; 4]),
            Err(FrameError::Truncated { .. })
        ));
        let mut body = [0u8; 8];
        body[4] = 1;
        assert!(matches!(
            TensorList::parse(&body),
            Err(FrameError::Malformed(_))
        ));
        // huge count, small body: rejected before any loop
        let mut body = [0u8; 72];
        body[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            TensorList::parse(&body),
            Err(FrameError::BadLength(
                "tensor count exceeds what the body can hold"
            ))
        );
        // trailing bytes
        let (a, _, _) = sample();
        let t = TensorRef::new(1, DType::U8, &[12], &a).unwrap();
        let mut body = vec![0u8; encoded_len(&[t]) + 8];
        emit(&[t], &mut body);
        assert_eq!(
            TensorList::parse(&body),
            Err(FrameError::BadLength("bytes after the last tensor record"))
        );
        // a bad record inside
        body.truncate(encoded_len(&[t]));
        body[LIST_HEAD_LEN + 9] = 9;
        assert!(matches!(
            TensorList::parse(&body),
            Err(FrameError::Malformed(_))
        ));
    }
}

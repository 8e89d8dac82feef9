//! Embedding rows read where they arrived: the rows feed of a lookup as
//! ranges of little-endian bytes inside pull replies, decoded as the
//! pooling reads them instead of being copied into a tensor first.

use std::sync::Arc;

use crate::error::GraphError;
use crate::tensor::Tensor;

/// One range of consecutive rows, in one shared buffer.
#[derive(Debug, Clone, PartialEq)]
struct Part {
    /// The first row it holds.
    first: usize,
    /// The buffer (a pull reply body).
    buf: Arc<Vec<u8>>,
    /// Where its first row starts in `buf`, in bytes.
    at: usize,
}

/// Unique embedding rows `[U, dim]` as little-endian `f32`s in shared
/// buffers: rows `0..U` are the concatenation of the parts added with
/// [`WireRows::push`], in order. Reading a row decodes it in place, so the
/// rows of a pull reply feed a lookup without a copy.
#[derive(Debug, Clone, PartialEq)]
pub struct WireRows {
    dim: usize,
    rows: usize,
    parts: Vec<Part>,
}

impl WireRows {
    /// No rows yet, each `dim` wide.
    pub fn new(dim: usize) -> Self {
        Self {
            dim,
            rows: 0,
            parts: Vec::new(),
        }
    }

    /// Append the `rows` rows that start `at` bytes into `buf`.
    ///
    /// # Errors
    /// [`GraphError::Shape`] when they do not fit in `buf`.
    pub fn push(&mut self, buf: Arc<Vec<u8>>, at: usize, rows: usize) -> Result<(), GraphError> {
        let end = rows
            .checked_mul(self.dim)
            .and_then(|n| n.checked_mul(4))
            .and_then(|n| n.checked_add(at));
        if !matches!(end, Some(e) if e <= buf.len()) {
            return Err(GraphError::Shape {
                op: "EmbeddingLookup",
                detail: format!(
                    "{rows} rows of {} at byte {at} overrun a {}-byte buffer",
                    self.dim,
                    buf.len()
                ),
            });
        }
        if rows > 0 {
            self.parts.push(Part {
                first: self.rows,
                buf,
                at,
            });
            self.rows += rows;
        }
        Ok(())
    }

    /// The number of rows `U`.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The row width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Copy into a `[U, dim]` tensor.
    pub fn to_tensor(&self) -> Tensor {
        let mut data = Vec::with_capacity(self.rows * self.dim);
        for r in 0..self.rows {
            data.extend(decode(self.row_bytes(r)));
        }
        Tensor::from_parts(vec![self.rows, self.dim], data)
    }

    /// Row `r`'s bytes. `r < self.rows()`; the parts are few (one per PS
    /// shard), so a scan from the last finds it at once.
    fn row_bytes(&self, r: usize) -> &[u8] {
        let p = self
            .parts
            .iter()
            .rev()
            .find(|p| p.first <= r)
            .expect("row 0 is in the first part");
        let start = p.at + (r - p.first) * self.dim * 4;
        &p.buf[start..start + self.dim * 4]
    }
}

fn decode(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Unique rows as the pooling kernels read them: a tensor, or rows in
/// place in pull replies.
pub(crate) trait RowSource {
    /// `(U, dim)`.
    fn shape2(&self) -> (usize, usize);
    /// Append row `r` to `out`.
    fn extend_row(&self, r: usize, out: &mut Vec<f32>);
    /// Add row `r` to `out` element by element.
    fn add_row(&self, r: usize, out: &mut [f32]);
}

impl RowSource for WireRows {
    fn shape2(&self) -> (usize, usize) {
        (self.rows, self.dim)
    }

    fn extend_row(&self, r: usize, out: &mut Vec<f32>) {
        out.extend(decode(self.row_bytes(r)));
    }

    fn add_row(&self, r: usize, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(decode(self.row_bytes(r))) {
            *o += v;
        }
    }
}

/// A tensor's rows; it is a matrix (the run checked its feeds).
impl RowSource for Tensor {
    fn shape2(&self) -> (usize, usize) {
        self.as_matrix().unwrap_or((0, 0))
    }

    fn extend_row(&self, r: usize, out: &mut Vec<f32>) {
        let d = self.shape2().1;
        out.extend_from_slice(&self.data()[r * d..(r + 1) * d]);
    }

    fn add_row(&self, r: usize, out: &mut [f32]) {
        let d = self.shape2().1;
        for (o, &v) in out.iter_mut().zip(&self.data()[r * d..(r + 1) * d]) {
            *o += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn rows_span_parts_in_order_and_decode_exactly() {
        let a = Arc::new([vec![9, 9, 9], le(&[1.0, -0.0, 2.5, f32::MIN_POSITIVE])].concat());
        let b = Arc::new(le(&[7.0, 8.0]));
        let mut w = WireRows::new(2);
        w.push(a, 3, 2).unwrap();
        w.push(b.clone(), 0, 0).unwrap();
        w.push(b, 0, 1).unwrap();
        assert_eq!((w.rows(), w.dim()), (3, 2));
        let t = w.to_tensor();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(t.data()),
            bits(&[1.0, -0.0, 2.5, f32::MIN_POSITIVE, 7.0, 8.0])
        );
        let mut out = vec![1.0, 1.0];
        w.add_row(2, &mut out);
        assert_eq!(out, [8.0, 9.0]);
    }

    #[test]
    fn rows_past_the_buffer_are_refused() {
        let mut w = WireRows::new(2);
        assert!(w.push(Arc::new(vec![0; 15]), 0, 2).is_err());
        assert!(w.push(Arc::new(vec![0; 16]), 1, 2).is_err());
        assert!(w.push(Arc::new(vec![0; 16]), 0, usize::MAX).is_err());
        assert_eq!(w.rows(), 0);
    }
}

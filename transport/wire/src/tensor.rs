//! One tensor record: a fixed 24-byte head, the dims, the data, padding.
//!
//! ```text
//! offset        size        field
//!  0            8           key        u64 LE: rendezvous / tensor-name id, 0 if unused
//!  8            1           dtype      DType code
//!  9            1           rank       0..=8
//! 10            2           reserved   must be zero
//! 12            4           pad        must be zero
//! 16            8           byte_len   u64 LE: bytes of data = product(dims) × dtype size
//! 24            8 × rank    dims       u64 LE each
//! 24 + 8·rank   byte_len    data       little-endian elements, row-major
//! ...           0..=7       padding    zeros up to the next multiple of 8
//! ```
//!
//! The data starts at `24 + 8·rank` bytes from the record start, which is
//! always a multiple of 8, so the "pad to 8" before the data is empty in this
//! version. Records start 8-aligned inside a body and bodies start 32 bytes
//! into a frame, so data is 8-aligned relative to the frame start.
//!
//! Parsing validates every length before reading, computes the element count
//! with checked arithmetic, and yields a [`TensorView`] that borrows the
//! input. Encoding uses [`TensorRef`].

use core::slice::ChunksExact;

use crate::header::FrameError;
use crate::le;

/// Bytes of the fixed part of a tensor record, before the dims.
pub const TENSOR_HEAD_LEN: usize = 24;
/// Largest rank accepted.
pub const MAX_RANK: usize = 8;
/// The smallest possible record: a rank-0 scalar (one element padded to 8)
/// or a rank-1 empty tensor (one dim, no data) are both 32 bytes.
pub const MIN_RECORD_LEN: usize = 32;

/// Zero bytes for padding, for gather-writers (see [`TensorRef::padding`]).
pub const ZERO_PAD: [u8; 8] = [0; 8];

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[allow(clippy::upper_case_acronyms)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 1,
    /// IEEE 754 binary16.
    F16 = 2,
    /// bfloat16 (the upper half of an `f32`).
    BF16 = 3,
    /// Signed 64-bit integer (ids).
    I64 = 4,
    /// Unsigned byte.
    U8 = 5,
}

impl DType {
    /// Decode a dtype code; `None` for codes this build does not know.
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::F32,
            2 => Self::F16,
            3 => Self::BF16,
            4 => Self::I64,
            5 => Self::U8,
            _ => return None,
        })
    }

    /// The wire code.
    pub const fn to_u8(self) -> u8 {
        self as u8
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::I64 => 8,
            Self::U8 => 1,
        }
    }

    /// True for the floating-point dtypes.
    pub const fn is_float(self) -> bool {
        matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }
}

/// The element count of `dims`, or `BadLength` when it overflows `u64`.
///
/// The rule is order independent: the product of the non-zero dims must fit
/// in a `u64`; a zero dim then makes the count zero.
pub fn element_count(dims: impl IntoIterator<Item = u64>) -> Result<u64, FrameError> {
    let mut n: u64 = 1;
    let mut zero = false;
    for d in dims {
        if d == 0 {
            zero = true;
        } else {
            n = n
                .checked_mul(d)
                .ok_or(FrameError::BadLength("tensor element count overflows u64"))?;
        }
    }
    Ok(if zero { 0 } else { n })
}

fn byte_len_for(dtype: DType, n: u64) -> Result<u64, FrameError> {
    n.checked_mul(dtype.size() as u64)
        .ok_or(FrameError::BadLength("tensor byte length overflows u64"))
}

/// The dims of a [`TensorView`], read from the borrowed bytes on demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims<'a> {
    bytes: &'a [u8],
}

impl<'a> Dims<'a> {
    /// The rank.
    pub fn len(&self) -> usize {
        self.bytes.len() / 8
    }
    /// True for a rank-0 (scalar) tensor.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// Dim `i`, or `None` past the rank.
    pub fn get(&self, i: usize) -> Option<u64> {
        le::u64_at(self.bytes, i.checked_mul(8)?).ok()
    }
    /// Iterate the dims.
    pub fn iter(&self) -> DimsIter<'a> {
        DimsIter(self.bytes.chunks_exact(8))
    }
}

impl<'a> IntoIterator for Dims<'a> {
    type Item = u64;
    type IntoIter = DimsIter<'a>;
    fn into_iter(self) -> DimsIter<'a> {
        self.iter()
    }
}

macro_rules! le_iter {
    ($(#[$m:meta])* $name:ident, $t:ty, $n:literal, $conv:expr) => {
        $(#[$m])*
        #[derive(Debug, Clone)]
        pub struct $name<'a>(ChunksExact<'a, u8>);

        impl Iterator for $name<'_> {
            type Item = $t;
            fn next(&mut self) -> Option<$t> {
                let c = self.0.next()?;
                <[u8; $n]>::try_from(c).ok().map($conv)
            }
            fn size_hint(&self) -> (usize, Option<usize>) {
                self.0.size_hint()
            }
        }
        impl DoubleEndedIterator for $name<'_> {
            fn next_back(&mut self) -> Option<$t> {
                let c = self.0.next_back()?;
                <[u8; $n]>::try_from(c).ok().map($conv)
            }
        }
        impl ExactSizeIterator for $name<'_> {}
    };
}

le_iter!(
    /// Iterator over dims (`u64`, little-endian on the wire).
    DimsIter, u64, 8, u64::from_le_bytes
);
le_iter!(
    /// Iterator over `f32` elements decoded from little-endian bytes.
    F32s, f32, 4, f32::from_le_bytes
);
le_iter!(
    /// Iterator over `i64` elements decoded from little-endian bytes.
    I64s, i64, 8, i64::from_le_bytes
);
le_iter!(
    /// Iterator over raw 16-bit elements (`F16` / `BF16` bit patterns).
    U16s, u16, 2, u16::from_le_bytes
);

/// Convert IEEE binary16 bits to `f32` (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: shift the mantissa up until its leading one is the
            // implicit bit, lowering the exponent by one per shift.
            let mut e: u32 = 127 - 15 + 1;
            let mut m = man;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// Convert bfloat16 bits to `f32` (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Floating-point elements of any float dtype, widened to `f32`.
#[derive(Debug, Clone)]
pub struct WidenedF32s<'a> {
    inner: WidenInner<'a>,
}

#[derive(Debug, Clone)]
enum WidenInner<'a> {
    F32(F32s<'a>),
    F16(U16s<'a>),
    BF16(U16s<'a>),
}

impl Iterator for WidenedF32s<'_> {
    type Item = f32;
    fn next(&mut self) -> Option<f32> {
        match &mut self.inner {
            WidenInner::F32(i) => i.next(),
            WidenInner::F16(i) => i.next().map(f16_to_f32),
            WidenInner::BF16(i) => i.next().map(bf16_to_f32),
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.inner {
            WidenInner::F32(i) => i.size_hint(),
            WidenInner::F16(i) | WidenInner::BF16(i) => i.size_hint(),
        }
    }
}
impl ExactSizeIterator for WidenedF32s<'_> {}

/// A validated tensor record borrowed from a frame. No copy, no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView<'a> {
    key: u64,
    dtype: DType,
    num_elements: u64,
    dims: &'a [u8],
    data: &'a [u8],
    record: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Parse the record at the start of `bytes`, returning the view and the
    /// record's length including its trailing padding (a multiple of 8).
    ///
    /// Errors: [`FrameError::Truncated`] when the head, dims, data or
    /// padding run past `bytes`; [`FrameError::Malformed`] for an unknown
    /// dtype, a rank above [`MAX_RANK`], non-zero reserved or padding bytes;
    /// [`FrameError::BadLength`] when the element count or byte length
    /// overflows or `byte_len` is not `product(dims) × dtype size`.
    pub fn parse(bytes: &'a [u8]) -> Result<(Self, usize), FrameError> {
        let have = bytes.len();
        if have < TENSOR_HEAD_LEN {
            return Err(FrameError::Truncated {
                needed: TENSOR_HEAD_LEN,
                have,
            });
        }
        let key = le::u64_at(bytes, 0)?;
        let dtype = DType::from_u8(le::u8_at(bytes, 8)?)
            .ok_or(FrameError::Malformed("unknown tensor dtype"))?;
        let rank = usize::from(le::u8_at(bytes, 9)?);
        if rank > MAX_RANK {
            return Err(FrameError::Malformed("tensor rank above 8"));
        }
        if le::u16_at(bytes, 10)? != 0 || le::u32_at(bytes, 12)? != 0 {
            return Err(FrameError::Malformed(
                "non-zero reserved bytes in tensor record",
            ));
        }
        let byte_len = le::u64_at(bytes, 16)?;
        let data_start = TENSOR_HEAD_LEN + 8 * rank; // ≤ 88, a multiple of 8
        let Some(dims) = bytes.get(TENSOR_HEAD_LEN..data_start) else {
            return Err(FrameError::Truncated {
                needed: data_start,
                have,
            });
        };
        let num_elements = element_count(Dims { bytes: dims }.iter())?;
        if byte_len != byte_len_for(dtype, num_elements)? {
            return Err(FrameError::BadLength(
                "tensor byte_len does not match product(dims) × dtype size",
            ));
        }
        let room = have - data_start;
        let data_len = match usize::try_from(byte_len) {
            Ok(n) if n <= room => n,
            _ => {
                return Err(FrameError::Truncated {
                    needed: usize::try_from(byte_len)
                        .unwrap_or(usize::MAX)
                        .saturating_add(data_start),
                    have,
                })
            }
        };
        let data_end = data_start + data_len;
        let record_len = le::align8(data_end);
        let (Some(data), Some(pad)) = (
            bytes.get(data_start..data_end),
            bytes.get(data_end..record_len),
        ) else {
            return Err(FrameError::Truncated {
                needed: record_len,
                have,
            });
        };
        if pad.iter().any(|&b| b != 0) {
            return Err(FrameError::Malformed("non-zero tensor padding"));
        }
        let record = bytes.get(..record_len).unwrap_or_default();
        Ok((
            Self {
                key,
                dtype,
                num_elements,
                dims,
                data,
                record,
            },
            record_len,
        ))
    }

    /// Parse a buffer that holds exactly one record (trailing padding
    /// included) and nothing else.
    pub fn parse_exact(bytes: &'a [u8]) -> Result<Self, FrameError> {
        let (v, used) = Self::parse(bytes)?;
        if used != bytes.len() {
            return Err(FrameError::BadLength("bytes after the tensor record"));
        }
        Ok(v)
    }

    /// The rendezvous / tensor-name id (0 if unused).
    pub fn key(&self) -> u64 {
        self.key
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The rank (number of dims).
    pub fn rank(&self) -> usize {
        self.dims.len() / 8
    }
    /// The dims, read from the borrowed bytes.
    pub fn dims(&self) -> Dims<'a> {
        Dims { bytes: self.dims }
    }
    /// Dim `i`, or `None` past the rank.
    pub fn dim(&self, i: usize) -> Option<u64> {
        self.dims().get(i)
    }
    /// Number of elements (product of the dims; 1 for a scalar).
    pub fn num_elements(&self) -> u64 {
        self.num_elements
    }
    /// The element bytes (little-endian), borrowed from the input.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
    /// The whole record, padding included, borrowed from the input.
    pub fn record(&self) -> &'a [u8] {
        self.record
    }

    /// The elements of an `F32` tensor, or `None` for another dtype.
    pub fn f32s(&self) -> Option<F32s<'a>> {
        (self.dtype == DType::F32).then(|| F32s(self.data.chunks_exact(4)))
    }
    /// The elements of an `I64` tensor, or `None` for another dtype.
    pub fn i64s(&self) -> Option<I64s<'a>> {
        (self.dtype == DType::I64).then(|| I64s(self.data.chunks_exact(8)))
    }
    /// The raw bit patterns of an `F16` or `BF16` tensor, or `None`.
    pub fn u16_bits(&self) -> Option<U16s<'a>> {
        matches!(self.dtype, DType::F16 | DType::BF16).then(|| U16s(self.data.chunks_exact(2)))
    }
    /// The elements of any float tensor (`F32`, `F16`, `BF16`) widened to
    /// `f32`, or `None` for an integer dtype.
    pub fn widened_f32s(&self) -> Option<WidenedF32s<'a>> {
        let inner = match self.dtype {
            DType::F32 => WidenInner::F32(F32s(self.data.chunks_exact(4))),
            DType::F16 => WidenInner::F16(U16s(self.data.chunks_exact(2))),
            DType::BF16 => WidenInner::BF16(U16s(self.data.chunks_exact(2))),
            DType::I64 | DType::U8 => return None,
        };
        Some(WidenedF32s { inner })
    }

    /// The data of an `F32` tensor as `&[f32]` without copying.
    ///
    /// `None` when the dtype is not `F32`, when the data is not 4-aligned in
    /// memory (it is 8-aligned relative to the frame, so this holds when the
    /// receive buffer itself is 4-aligned), or on a big-endian host, where
    /// the little-endian wire bytes are not native `f32`s: use
    /// [`f32s`](Self::f32s) there.
    pub fn try_as_f32_slice(&self) -> Option<&'a [f32]> {
        if self.dtype != DType::F32 || cfg!(target_endian = "big") {
            return None;
        }
        bytemuck::try_cast_slice(self.data).ok()
    }

    /// The data of an `I64` tensor as `&[i64]` without copying; `None` on a
    /// dtype mismatch, misalignment or a big-endian host (see
    /// [`try_as_f32_slice`](Self::try_as_f32_slice)).
    pub fn try_as_i64_slice(&self) -> Option<&'a [i64]> {
        if self.dtype != DType::I64 || cfg!(target_endian = "big") {
            return None;
        }
        bytemuck::try_cast_slice(self.data).ok()
    }
}

/// A tensor to encode, borrowing its dims and little-endian data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRef<'a> {
    /// Rendezvous / tensor-name id, 0 if unused.
    pub key: u64,
    /// Element type.
    pub dtype: DType,
    /// Dims, at most [`MAX_RANK`].
    pub dims: &'a [u64],
    /// Element bytes, little-endian, `product(dims) × dtype.size()` long.
    pub data: &'a [u8],
}

impl<'a> TensorRef<'a> {
    /// A checked tensor reference (see [`check`](Self::check)).
    pub fn new(
        key: u64,
        dtype: DType,
        dims: &'a [u64],
        data: &'a [u8],
    ) -> Result<Self, FrameError> {
        let t = Self {
            key,
            dtype,
            dims,
            data,
        };
        t.check()?;
        Ok(t)
    }

    /// Check what a receiver will check: rank ≤ [`MAX_RANK`] and
    /// `data.len() == product(dims) × dtype size` without overflow.
    pub fn check(&self) -> Result<(), FrameError> {
        if self.dims.len() > MAX_RANK {
            return Err(FrameError::Malformed("tensor rank above 8"));
        }
        let n = byte_len_for(self.dtype, element_count(self.dims.iter().copied())?)?;
        if u64::try_from(self.data.len()).ok() != Some(n) {
            return Err(FrameError::BadLength(
                "tensor byte_len does not match product(dims) × dtype size",
            ));
        }
        Ok(())
    }

    /// Bytes written by [`emit_header`](Self::emit_header): the fixed head
    /// and the dims (`24 + 8 × rank`).
    pub fn header_len(&self) -> usize {
        TENSOR_HEAD_LEN.saturating_add(self.dims.len().saturating_mul(8))
    }

    /// Zero bytes that follow the data to reach a multiple of 8 (0..=7).
    pub fn padding_len(&self) -> usize {
        (8 - self.data.len() % 8) % 8
    }

    /// The padding that follows the data, as a static slice of zeros.
    pub fn padding(&self) -> &'static [u8] {
        ZERO_PAD.get(..self.padding_len()).unwrap_or_default()
    }

    /// The whole record's length: head, dims, data and padding.
    pub fn encoded_len(&self) -> usize {
        self.header_len()
            .saturating_add(self.data.len())
            .saturating_add(self.padding_len())
    }

    /// Write the head and dims (everything but the data) into `out` and
    /// return [`header_len`](Self::header_len). A gather-writer then sends
    /// [`data`](Self::data) and [`padding`](Self::padding) (that is,
    /// [`padding_len`](Self::padding_len) zero bytes) as further segments.
    ///
    /// # Panics
    /// If [`check`](Self::check) fails or `out` is too short.
    pub fn emit_header(&self, out: &mut [u8]) -> usize {
        if let Err(e) = self.check() {
            panic!("TensorRef::emit_header on an invalid tensor: {e}");
        }
        let len = self.header_len();
        le::need(out, len, "TensorRef::emit_header");
        le::put_u64(out, 0, self.key);
        out[8] = self.dtype.to_u8();
        out[9] = self.dims.len() as u8;
        out[10..16].fill(0);
        le::put_u64(out, 16, self.data.len() as u64);
        for (i, d) in self.dims.iter().enumerate() {
            le::put_u64(out, TENSOR_HEAD_LEN + 8 * i, *d);
        }
        len
    }

    /// Write the whole record into `out` and return
    /// [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If [`check`](Self::check) fails or `out` is too short.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        let len = self.encoded_len();
        le::need(out, len, "TensorRef::emit");
        let h = self.emit_header(out);
        let data_end = h + self.data.len();
        out[h..data_end].copy_from_slice(self.data);
        out[data_end..len].fill(0);
        len
    }
}

/// Anything that can be written as one tensor record: a [`TensorRef`] to
/// encode, or a received [`TensorView`] to forward (its record is copied
/// verbatim). Message reprs are generic over it.
pub trait TensorRecord {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Rank.
    fn rank(&self) -> usize;
    /// Dim `i`, or `None` past the rank.
    fn dim(&self, i: usize) -> Option<u64>;
    /// Encoded record length, padding included.
    fn encoded_len(&self) -> usize;
    /// Write the record; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short, or the tensor is invalid (a [`TensorRef`]
    /// whose [`check`](TensorRef::check) fails).
    fn emit(&self, out: &mut [u8]) -> usize;
}

impl TensorRecord for TensorRef<'_> {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn rank(&self) -> usize {
        self.dims.len()
    }
    fn dim(&self, i: usize) -> Option<u64> {
        self.dims.get(i).copied()
    }
    fn encoded_len(&self) -> usize {
        TensorRef::encoded_len(self)
    }
    fn emit(&self, out: &mut [u8]) -> usize {
        TensorRef::emit(self, out)
    }
}

impl TensorRecord for TensorView<'_> {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn rank(&self) -> usize {
        TensorView::rank(self)
    }
    fn dim(&self, i: usize) -> Option<u64> {
        TensorView::dim(self, i)
    }
    fn encoded_len(&self) -> usize {
        self.record.len()
    }
    fn emit(&self, out: &mut [u8]) -> usize {
        let len = self.record.len();
        le::need(out, len, "TensorView::emit");
        out[..len].copy_from_slice(self.record);
        len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(t: &TensorRef<'_>) -> Vec<u8> {
        let mut out = vec![0xaa; t.encoded_len()];
        assert_eq!(t.emit(&mut out), out.len());
        out
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn round_trip_f32_rank2() {
        let data = f32_bytes(&[1.0, 2.0, 3.0, -4.5, 5.0, 6.0]);
        let t = TensorRef::new(42, DType::F32, &[2, 3], &data).unwrap();
        let b = enc(&t);
        assert_eq!(b.len(), 24 + 16 + 24);
        let (v, used) = TensorView::parse(&b).unwrap();
        assert_eq!(used, b.len());
        assert_eq!(v.key(), 42);
        assert_eq!(v.dtype(), DType::F32);
        assert_eq!(v.rank(), 2);
        assert_eq!(v.dims().iter().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(v.dim(1), Some(3));
        assert_eq!(v.dim(2), None);
        assert_eq!(v.num_elements(), 6);
        assert_eq!(
            v.f32s().unwrap().collect::<Vec<_>>(),
            vec![1.0, 2.0, 3.0, -4.5, 5.0, 6.0]
        );
        assert!(v.i64s().is_none());
        // zero copy
        assert!(b.as_ptr_range().contains(&v.data().as_ptr()));
        assert_eq!(v.data().as_ptr() as usize - b.as_ptr() as usize, 40);
        // re-emitting a view reproduces the bytes
        let mut again = vec![0; TensorRecord::encoded_len(&v)];
        TensorRecord::emit(&v, &mut again);
        assert_eq!(again, b);
    }

    #[test]
    fn padding_and_gather_header() {
        let data = [1u8, 2, 3];
        let t = TensorRef::new(0, DType::U8, &[3], &data).unwrap();
        assert_eq!(t.header_len(), 32);
        assert_eq!(t.padding_len(), 5);
        assert_eq!(t.padding(), &[0; 5]);
        assert_eq!(t.encoded_len(), 40);
        let mut gathered = vec![0; t.header_len()];
        t.emit_header(&mut gathered);
        gathered.extend_from_slice(t.data);
        gathered.extend_from_slice(t.padding());
        assert_eq!(gathered, enc(&t));
        let v = TensorView::parse_exact(&gathered).unwrap();
        assert_eq!(v.data(), &data);
    }

    #[test]
    fn scalar_and_empty() {
        let s = 7i64.to_le_bytes();
        let t = TensorRef::new(1, DType::I64, &[], &s).unwrap();
        let b = enc(&t);
        assert_eq!(b.len(), MIN_RECORD_LEN);
        let v = TensorView::parse_exact(&b).unwrap();
        assert_eq!(v.num_elements(), 1);
        assert!(v.dims().is_empty());
        assert_eq!(v.i64s().unwrap().collect::<Vec<_>>(), vec![7]);
        let e = TensorRef::new(1, DType::F32, &[0, u64::MAX], &[]).unwrap();
        let b = enc(&e);
        assert_eq!(b.len(), 40);
        let v = TensorView::parse_exact(&b).unwrap();
        assert_eq!(v.num_elements(), 0);
        assert_eq!(v.f32s().unwrap().count(), 0);
    }

    #[test]
    fn half_floats_widen() {
        // 1.0, -2.0, 65504 (max), smallest subnormal, +inf
        let f16: [u16; 5] = [0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00];
        let data: Vec<u8> = f16.iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = TensorRef::new(0, DType::F16, &[5], &data).unwrap();
        let b = enc(&t);
        let v = TensorView::parse_exact(&b).unwrap();
        let w: Vec<f32> = v.widened_f32s().unwrap().collect();
        assert_eq!(w, vec![1.0, -2.0, 65504.0, 2f32.powi(-24), f32::INFINITY]);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        let bf: Vec<u8> = [0x3f80u16, 0xc040]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = TensorRef::new(0, DType::BF16, &[2], &bf).unwrap();
        let b = enc(&t);
        let v = TensorView::parse_exact(&b).unwrap();
        assert_eq!(
            v.widened_f32s().unwrap().collect::<Vec<_>>(),
            vec![1.0, -3.0]
        );
        assert_eq!(v.u16_bits().unwrap().len(), 2);
        assert!(v.f32s().is_none());
    }

    #[test]
    fn slices_when_aligned() {
        let data = f32_bytes(&[1.0, 2.0]);
        let t = TensorRef::new(0, DType::F32, &[2], &data).unwrap();
        // an 8-aligned buffer: u64 storage
        let mut store = vec![0u64; t.encoded_len() / 8];
        let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut store);
        t.emit(buf);
        let v = TensorView::parse_exact(buf).unwrap();
        if cfg!(target_endian = "little") {
            assert_eq!(v.try_as_f32_slice(), Some(&[1.0f32, 2.0][..]));
        }
        assert_eq!(v.try_as_i64_slice(), None);
        // misaligned copy: one byte in
        let mut shifted = vec![0u8; buf.len() + 1];
        shifted[1..].copy_from_slice(buf);
        let v = TensorView::parse_exact(&shifted[1..]).unwrap();
        assert_eq!(v.try_as_f32_slice(), None);
        assert_eq!(v.f32s().unwrap().collect::<Vec<_>>(), vec![1.0, 2.0]);
    }

    #[test]
    fn validation_errors() {
        let data = f32_bytes(&[1.0, 2.0, 3.0]);
        let good = enc(&TensorRef::new(0, DType::F32, &[3], &data).unwrap());
        assert!(matches!(
            TensorView::parse(&good[..10]),
            Err(FrameError::Truncated { .. })
        ));
        assert!(matches!(
            TensorView::parse(&good[..28]),
            Err(FrameError::Truncated { .. })
        ));
        assert!(matches!(
            TensorView::parse(&good[..40]),
            Err(FrameError::Truncated { .. })
        ));
        assert!(matches!(
            TensorView::parse(&good[..44]),
            Err(FrameError::Truncated { .. })
        ));
        let mut b = good.clone();
        b[8] = 99;
        assert_eq!(
            TensorView::parse(&b),
            Err(FrameError::Malformed("unknown tensor dtype"))
        );
        let mut b = good.clone();
        b[9] = 255;
        assert_eq!(
            TensorView::parse(&b),
            Err(FrameError::Malformed("tensor rank above 8"))
        );
        let mut b = good.clone();
        b[11] = 1;
        assert!(matches!(
            TensorView::parse(&b),
            Err(FrameError::Malformed(_))
        ));
        let mut b = good.clone();
        b[13] = 1;
        assert!(matches!(
            TensorView::parse(&b),
            Err(FrameError::Malformed(_))
        ));
        let mut b = good.clone();
        b[16] = 8;
        assert!(matches!(
            TensorView::parse(&b),
            Err(FrameError::BadLength(_))
        ));
        let mut b = good.clone();
        *b.last_mut().unwrap() = 1;
        assert_eq!(
            TensorView::parse(&b),
            Err(FrameError::Malformed("non-zero tensor padding"))
        );
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(
            TensorView::parse_exact(&b),
            Err(FrameError::BadLength(_))
        ));
        // dims product overflow
        let mut b = good.clone();
        b[9] = 2;
        b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        b[32..40].copy_from_slice(&2u64.to_le_bytes());
        assert_eq!(
            TensorView::parse(&b),
            Err(FrameError::BadLength("tensor element count overflows u64"))
        );
        // byte length overflow: count fits u64, × 4 does not
        let mut b = good.clone();
        b[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert_eq!(
            TensorView::parse(&b),
            Err(FrameError::BadLength("tensor byte length overflows u64"))
        );
        // huge but consistent byte_len: truncated, not a panic
        let mut b = good.clone();
        b[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        b[16..24].copy_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(matches!(
            TensorView::parse(&b),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn ref_check() {
        assert!(matches!(
            TensorRef::new(0, DType::F32, &[2], &[0; 4]),
            Err(FrameError::BadLength(_))
        ));
        assert!(matches!(
            TensorRef::new(0, DType::U8, &[1; 9], &[0; 1]),
            Err(FrameError::Malformed(_))
        ));
        assert!(matches!(
            TensorRef::new(0, DType::U8, &[u64::MAX, 3], &[]),
            Err(FrameError::BadLength(_))
        ));
    }

    #[test]
    #[should_panic(expected = "invalid tensor")]
    fn emit_invalid_panics() {
        let t = TensorRef {
            key: 0,
            dtype: DType::F32,
            dims: &[2],
            data: &[0; 4],
        };
        let mut out = [0u8; 64];
        t.emit(&mut out);
    }
}

//! Bounds-checked little-endian readers and (panicking) writers.
//!
//! Readers never panic: they return [`FrameError::Truncated`] when the field
//! does not lie inside the slice. Writers are used on the emit path only,
//! where the caller has sized the buffer; they panic on a short buffer.

use crate::header::FrameError;

fn field<const N: usize>(b: &[u8], at: usize) -> Result<[u8; N], FrameError> {
    let end = at
        .checked_add(N)
        .ok_or(FrameError::BadLength("field offset overflows"))?;
    match b.get(at..end).and_then(|s| <[u8; N]>::try_from(s).ok()) {
        Some(a) => Ok(a),
        None => Err(FrameError::Truncated {
            needed: end,
            have: b.len(),
        }),
    }
}

pub(crate) fn u8_at(b: &[u8], at: usize) -> Result<u8, FrameError> {
    field::<1>(b, at).map(|a| a[0])
}
pub(crate) fn u16_at(b: &[u8], at: usize) -> Result<u16, FrameError> {
    field(b, at).map(u16::from_le_bytes)
}
pub(crate) fn u32_at(b: &[u8], at: usize) -> Result<u32, FrameError> {
    field(b, at).map(u32::from_le_bytes)
}
pub(crate) fn u64_at(b: &[u8], at: usize) -> Result<u64, FrameError> {
    field(b, at).map(u64::from_le_bytes)
}

pub(crate) fn put_u16(out: &mut [u8], at: usize, v: u16) {
    out[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(out: &mut [u8], at: usize, v: u64) {
    out[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Round `n` up to a multiple of 8, saturating at the largest multiple of 8.
pub(crate) const fn align8(n: usize) -> usize {
    match n.checked_add(7) {
        Some(v) => v & !7,
        None => usize::MAX & !7,
    }
}

/// Panic with a clear message when `out` cannot hold `needed` bytes.
#[track_caller]
pub(crate) fn need(out: &[u8], needed: usize, what: &str) {
    assert!(
        out.len() >= needed,
        "{what}: output buffer of {} bytes, need {needed}",
        out.len()
    );
}

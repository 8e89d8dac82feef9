//! Feature hashing: a categorical value of one field becomes a 64-bit key.
//!
//! `key = xxh3_64_with_seed(value, seed(field))`, where
//! `seed(field) = (field + 1) * 0x9E37_79B9_7F4A_7C15` (wrapping) is the field
//! index times the 64-bit golden ratio, so the same string in two fields gives
//! two unrelated keys. Key 0 is reserved for "missing": a value whose hash is 0
//! is remapped to [`ZERO_REMAP`]. The function is part of the data format (keys
//! land in checkpoints and on the wire), so it is pinned by a golden-value test
//! and must never change.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The key that stands for "this field is missing" in [`crate::Batch::keys`].
pub const MISSING_KEY: u64 = 0;

/// The key a value gets when its xxh3 hash happens to be 0 (the missing key).
pub const ZERO_REMAP: u64 = 0x5EED_0000_0000_0001;

/// The xxh3 seed of one field: its index plus one times the golden ratio.
#[inline]
pub fn field_seed(field: u32) -> u64 {
    (u64::from(field) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Hash the raw bytes `value` of categorical field `field` (0-based, `C1` is
/// field 0) to a key. Never returns [`MISSING_KEY`].
#[inline]
pub fn feature_hash(field: u32, value: &[u8]) -> u64 {
    match xxh3_64_with_seed(value, field_seed(field)) {
        MISSING_KEY => ZERO_REMAP,
        key => key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_values() {
        assert_eq!(field_seed(0), 0x9E37_79B9_7F4A_7C15);
        assert_eq!(field_seed(1), 0x3C6E_F372_FE94_F82A);
        // Pinned: changing the hash changes every key of every checkpoint.
        assert_eq!(feature_hash(0, b"68fd1e64"), GOLDEN[0]);
        assert_eq!(feature_hash(1, b"68fd1e64"), GOLDEN[1]);
        assert_eq!(feature_hash(25, b""), GOLDEN[2]);
        assert_eq!(feature_hash(7, b"a"), GOLDEN[3]);
    }

    // Computed independently with the reference C implementation (the
    // `xxhash` Python binding): `xxh3_64_intdigest(value, seed=field_seed)`.
    const GOLDEN: [u64; 4] = [
        0x48ca_70cd_6f37_5251,
        0x7687_7f5b_9e58_70ec,
        0xf567_499e_5137_d853,
        0xe79c_8696_c505_52e0,
    ];

    #[test]
    fn salted_by_field() {
        for f in 0..26 {
            assert_ne!(
                feature_hash(f, b"05db9164"),
                feature_hash(f + 1, b"05db9164")
            );
        }
        assert_ne!(feature_hash(3, b"abc"), feature_hash(3, b"abd"));
    }

    #[test]
    fn never_missing() {
        for f in 0..64u32 {
            for v in 0..2000u32 {
                assert_ne!(feature_hash(f, &v.to_le_bytes()), MISSING_KEY);
            }
        }
    }
}

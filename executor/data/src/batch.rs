//! [`Batch`]: a column-friendly, reusable block of examples.

/// Number of numeric (integer count) fields of a Criteo example (`I1..I13`).
pub const NUM_NUMERIC: usize = 13;
/// Number of categorical fields of a Criteo example (`C1..C26`).
pub const NUM_CATEGORICAL: usize = 26;

/// A block of examples, stored row-major in flat vectors so that one batch
/// can be reused across calls without allocating (`clear` keeps capacity).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// Number of examples.
    pub len: usize,
    /// Click labels, 0.0 or 1.0; `len` entries.
    pub labels: Vec<f32>,
    /// Transformed numeric features ([`transform_count`]), `len * 13` entries,
    /// row-major; a missing value is 0.0.
    pub numeric: Vec<f32>,
    /// Categorical keys ([`crate::feature_hash`]), `len * 26` entries,
    /// row-major; 0 ([`crate::MISSING_KEY`]) is a missing value.
    pub keys: Vec<u64>,
}

impl Batch {
    /// An empty batch with room for `n` examples.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            len: 0,
            labels: Vec::with_capacity(n),
            numeric: Vec::with_capacity(n * NUM_NUMERIC),
            keys: Vec::with_capacity(n * NUM_CATEGORICAL),
        }
    }

    /// Remove every example, keeping the allocations.
    pub fn clear(&mut self) {
        self.len = 0;
        self.labels.clear();
        self.numeric.clear();
        self.keys.clear();
    }

    /// Whether the batch holds no example.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 13 numeric features of example `i`.
    ///
    /// # Panics
    /// If `i >= len`.
    pub fn numeric_row(&self, i: usize) -> &[f32] {
        &self.numeric[i * NUM_NUMERIC..(i + 1) * NUM_NUMERIC]
    }

    /// The 26 keys of example `i`.
    ///
    /// # Panics
    /// If `i >= len`.
    pub fn key_row(&self, i: usize) -> &[u64] {
        &self.keys[i * NUM_CATEGORICAL..(i + 1) * NUM_CATEGORICAL]
    }

    /// Append all examples of `other`.
    pub fn extend_from(&mut self, other: &Batch) {
        self.len += other.len;
        self.labels.extend_from_slice(&other.labels);
        self.numeric.extend_from_slice(&other.numeric);
        self.keys.extend_from_slice(&other.keys);
    }
}

/// The numeric transform applied to a Criteo integer count `x`:
/// `ln(1 + x)` for `x >= 0` and `-ln(1 - x)` for `x < 0` (a sign-symmetric
/// log, so the rare negative values of `I2` stay ordered and finite).
/// A missing value is 0.0 and does not go through this function.
#[inline]
pub fn transform_count(x: i64) -> f32 {
    match usize::try_from(x) {
        Ok(i) if i < SMALL_COUNTS => SMALL_COUNT_TABLE[i],
        _ => transform_count_exact(x),
    }
}

/// Counts below this are transformed by table lookup (same values).
const SMALL_COUNTS: usize = 4096;

static SMALL_COUNT_TABLE: std::sync::LazyLock<Vec<f32>> = std::sync::LazyLock::new(|| {
    (0..SMALL_COUNTS as i64)
        .map(transform_count_exact)
        .collect()
});

fn transform_count_exact(x: i64) -> f32 {
    // Computed in f64 so that the value read from a file and the value the
    // generator produced round to the same f32 whatever the magnitude.
    if x >= 0 {
        (x as f64).ln_1p() as f32
    } else {
        -((-(x as f64)).ln_1p() as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transform_values() {
        assert_eq!(transform_count(0), 0.0);
        assert!((transform_count(1) - std::f32::consts::LN_2).abs() < 1e-7);
        assert!((transform_count(-1) + std::f32::consts::LN_2).abs() < 1e-7);
        assert!((transform_count(99) - 100f32.ln()).abs() < 1e-6);
        assert!(transform_count(i64::MIN).is_finite());
        assert!(transform_count(i64::MAX).is_finite());
        for x in [0, 1, 4095, 4096, 4097, 1 << 40, -5] {
            assert_eq!(transform_count(x), transform_count_exact(x));
        }
    }

    #[test]
    fn clear_keeps_capacity() {
        let mut b = Batch::with_capacity(4);
        b.len = 1;
        b.labels.push(1.0);
        b.numeric.extend_from_slice(&[0.0; NUM_NUMERIC]);
        b.keys.extend_from_slice(&[7; NUM_CATEGORICAL]);
        let cap = b.keys.capacity();
        b.clear();
        assert!(b.is_empty());
        assert!(b.keys.is_empty());
        assert_eq!(b.keys.capacity(), cap);
    }
}

//! Software prefetch of table rows and key map entries.
//!
//! The PS's row loops (copying pulled rows into a reply, applying the
//! optimizer to pushed rows) touch rows at random places in a table of
//! hundreds of MB, so nearly every row is a cache miss, and a loop body
//! long enough to copy or update a whole row keeps the CPU from running
//! far enough ahead to overlap the next row's misses by itself. Asking
//! for a row a few iterations before it is needed overlaps them
//! (`executor/ps/benches/shard.rs` measures the effect). No crate offers a stable
//! prefetch; `core::arch` does, behind `unsafe`, so this module holds it.
#![allow(unsafe_code)]

/// How many rows ahead the loops prefetch.
pub(crate) const DISTANCE: usize = 8;

/// How many keys ahead the key loops prefetch their probes: a probe's
/// loop body is a few dozen instructions, far shorter than a row's copy
/// or update, so it needs more iterations to cover a miss.
pub(crate) const PROBE_DISTANCE: usize = 24;

/// The items `keys()` yields, each with the one [`PROBE_DISTANCE`] places
/// ahead of it (`None` for the last few): a key loop prefetches the probe
/// of the key ahead, then handles the current one. (`keys` makes the
/// iterator twice: the wire's iterators are not `Clone`.)
#[inline]
pub(crate) fn probe_ahead<I: Iterator>(
    keys: impl Fn() -> I,
) -> impl Iterator<Item = (I::Item, Option<I::Item>)> {
    let mut ahead = keys().skip(PROBE_DISTANCE);
    keys().map(move |k| (k, ahead.next()))
}

/// Hint that `row` will be read or written soon: one prefetch per cache
/// line. A no-op on targets without the intrinsic.
#[inline(always)]
pub(crate) fn row(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = row.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(row);
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch only hints the cache: it has no
            // architectural effect, reads nothing into the program and
            // never faults, whatever the address; this one is inside `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Hint that `value` (a hash map entry) will be read or written soon: the
/// cache line it starts in. A no-op on targets without the intrinsic.
#[inline(always)]
pub(crate) fn entry<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = (value as *const T).cast::<i8>();
        // SAFETY: as in `row`: a prefetch has no architectural effect and
        // never faults; this address is that of a live reference.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_ahead_pairs_each_key_with_the_one_probe_distance_later() {
        let keys: Vec<u64> = (0..PROBE_DISTANCE as u64 + 5).collect();
        let got: Vec<(u64, Option<u64>)> = probe_ahead(|| keys.iter().copied()).collect();
        assert_eq!(got.len(), keys.len());
        for (i, &(k, ahead)) in got.iter().enumerate() {
            assert_eq!(k, i as u64);
            assert_eq!(ahead, keys.get(i + PROBE_DISTANCE).copied(), "key {i}");
        }
        let short: Vec<_> = probe_ahead(|| [7u64, 8].into_iter()).collect();
        assert_eq!(short, [(7, None), (8, None)]);
    }
}

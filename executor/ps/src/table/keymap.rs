//! [`KeyMap`]: a table's key -> [`Held`] map.
//!
//! An open-addressing table of our own, not `std`'s (hashbrown's) map,
//! because the PS's key loops need to ask where a key's entry lives before
//! they look it up: a pull or push probes thousands of keys at random
//! places in a map of megabytes, each probe a cache miss, and
//! [`KeyMap::prefetch`] lets a loop start the probe of a key several keys
//! ahead so the misses overlap. `std`'s map hides its buckets, and its
//! probes of independent keys showed in the profile as loads waiting on
//! memory one after the other.
//!
//! Linear probing over a power-of-two array of [`Entry`]s, at most half
//! full; an entry whose `Held::index` is [`NO_ROW`] is empty (`NO_ROW` is
//! never a row index). The hash is seeded per map, as for the table's other
//! maps: keys come from peers ([`crate::keyhash`]).

use std::hash::BuildHasher;

use super::rows::Held;
use super::NO_ROW;
use crate::keyhash::KeyState;
use crate::prefetch;

/// A key and its row ([`Held`]): 16 bytes, aligned to 16, so that four
/// entries share a cache line and none straddles two. A probe is one
/// cache miss, on the line [`KeyMap::prefetch`] asked for; the array's
/// allocation (glibc's `malloc` puts a large block 16 bytes past a page
/// boundary) would otherwise split entries across two lines, the second
/// not prefetched. The row's bookkeeping is not here but beside the rows
/// ([`super::rows::Meta`]): an entry is written only when its key gets a
/// row, and a map of half the size stays in the caches longer.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Entry {
    key: u64,
    slot: Held,
}

/// The entry of an empty position.
const EMPTY: Entry = Entry {
    key: 0,
    slot: Held { index: NO_ROW },
};

/// Fewest entries of a map that holds anything.
const MIN_ENTRIES: usize = 16;

/// Where a key is, or where it would go: [`KeyMap::find`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// The key's entry.
    At(usize),
    /// The empty position the key would take ([`KeyMap::insert_at`]).
    Vacant(usize),
}

/// Keys to [`Held`]s (see the module documentation).
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyMap {
    /// A power of two long (or empty); at most half full.
    entries: Vec<Entry>,
    len: usize,
    /// The map's own seed: it stays across growth.
    hasher: KeyState,
}

impl KeyMap {
    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when there is no key.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    /// The position a probe for `key` starts at (the map is not empty).
    fn home(&self, key: u64) -> usize {
        self.hasher.hash_one(key) as usize & self.mask()
    }

    /// Hint that `key` will be looked up soon: the cache line its probe
    /// starts at is asked for now. `None` (no key ahead) does nothing.
    #[inline]
    pub(crate) fn prefetch(&self, key: Option<u64>) {
        if let Some(key) = key.filter(|_| !self.entries.is_empty()) {
            prefetch::entry(&self.entries[self.home(key)]);
        }
    }

    /// Where `key` is, or the empty position it would take. An empty map
    /// has no position: `None`.
    pub(crate) fn find(&self, key: u64) -> Option<Found> {
        if self.entries.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        // At most half full: the probe meets an empty entry.
        loop {
            let e = &self.entries[i];
            if e.slot.index == NO_ROW {
                return Some(Found::Vacant(i));
            }
            if e.key == key {
                return Some(Found::At(i));
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot at position `at` (a [`Found::At`]).
    pub(crate) fn slot_mut(&mut self, at: usize) -> &mut Held {
        &mut self.entries[at].slot
    }

    /// What the map holds for `key`.
    pub(crate) fn get(&self, key: u64) -> Option<&Held> {
        match self.find(key)? {
            Found::At(i) => Some(&self.entries[i].slot),
            Found::Vacant(_) => None,
        }
    }

    /// True when `key` has a slot.
    pub(crate) fn contains_key(&self, key: u64) -> bool {
        matches!(self.find(key), Some(Found::At(_)))
    }

    /// Add `key` (which has no slot) with `slot` at `found`, what
    /// [`Self::find`] returned for it with no change to the map since;
    /// `None` (an empty map) is fine too. Returns the key's position.
    pub(crate) fn insert_at(&mut self, found: Option<Found>, key: u64, slot: Held) -> usize {
        debug_assert_ne!(slot.index, NO_ROW);
        if (self.len + 1) * 2 > self.entries.len() {
            self.grow(self.len + 1);
            return self.insert_new(key, slot);
        }
        match found {
            Some(Found::Vacant(i)) => {
                self.entries[i] = Entry { key, slot };
                self.len += 1;
                i
            }
            _ => self.insert_new(key, slot),
        }
    }

    /// Put a key known to be absent, with room for it; returns its position.
    fn insert_new(&mut self, key: u64, slot: Held) -> usize {
        let mask = self.mask();
        let mut i = self.home(key);
        while self.entries[i].slot.index != NO_ROW {
            i = (i + 1) & mask;
        }
        self.entries[i] = Entry { key, slot };
        self.len += 1;
        i
    }

    /// Make room for `n` keys in all without growing again.
    pub(crate) fn reserve(&mut self, n: usize) {
        let want = self.len.saturating_add(n);
        if want.saturating_mul(2) > self.entries.len() {
            self.grow(want);
        }
    }

    /// Re-place every entry in an array with room for `want` keys.
    fn grow(&mut self, want: usize) {
        let size = want
            .saturating_mul(2)
            .max(MIN_ENTRIES)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX / 2 + 1);
        self.rebuild(size, |_| true);
    }

    /// Re-place the entries `keep` is true for in an array of `size`.
    fn rebuild(&mut self, size: usize, mut keep: impl FnMut(&Held) -> bool) {
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; size]);
        self.len = 0;
        for e in old {
            if e.slot.index != NO_ROW && keep(&e.slot) {
                self.insert_new(e.key, e.slot);
            }
        }
    }

    /// The keys, in no particular order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries
            .iter()
            .filter(|e| e.slot.index != NO_ROW)
            .map(|e| e.key)
    }

    /// Keep the slots `keep` is true for (called once per slot).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Held) -> bool) {
        let mut verdicts = Vec::with_capacity(self.len);
        for e in &self.entries {
            if e.slot.index != NO_ROW {
                verdicts.push(keep(&e.slot));
            }
        }
        if verdicts.iter().all(|&k| k) {
            return;
        }
        let mut v = verdicts.into_iter();
        let size = self.entries.len();
        // Linear probing cannot leave holes in a run of entries, so the
        // kept ones are placed again.
        self.rebuild(size, |_| v.next().unwrap_or(true));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// Add `key` with `slot`; false (and no change) when it has one.
    fn insert(m: &mut KeyMap, key: u64, slot: Held) -> bool {
        let found = m.find(key);
        if matches!(found, Some(Found::At(_))) {
            return false;
        }
        m.insert_at(found, key, slot);
        true
    }

    fn slot(index: u32) -> Held {
        Held { index }
    }

    #[test]
    fn finds_what_it_holds_across_growth_and_retain() {
        let mut m = KeyMap::default();
        assert!(m.get(5).is_none());
        m.prefetch(Some(5));
        // Keys that collide in the low bits, and 0 and u64::MAX.
        let keys: Vec<u64> = (0..5000u64)
            .map(|i| i << 20)
            .chain([u64::MAX, 7, 1 << 63])
            .collect();
        for (i, &k) in keys.iter().enumerate() {
            assert!(insert(&mut m, k, slot(i as u32)), "key {k}");
            assert!(!insert(&mut m, k, slot(0)), "key {k} again");
        }
        assert_eq!(m.len(), keys.len());
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(m.get(k).map(|s| s.index), Some(i as u32), "key {k}");
        }
        assert!(!m.contains_key(1));
        let mut seen: Vec<u64> = m.keys().collect();
        seen.sort_unstable();
        let mut want = keys.clone();
        want.sort_unstable();
        assert_eq!(seen, want);
        m.retain(|s| s.index % 3 != 0);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(m.contains_key(k), i % 3 != 0, "key {k}");
        }
        assert_eq!(
            m.len(),
            keys.iter().enumerate().filter(|(i, _)| i % 3 != 0).count()
        );
        let Some(Found::At(at)) = m.find(keys[1]) else {
            panic!("key {} kept", keys[1]);
        };
        m.slot_mut(at).index = 9;
        assert_eq!(m.get(keys[1]).map(|s| s.index), Some(9));
    }

    #[test]
    fn no_entry_straddles_two_cache_lines() {
        assert_eq!(std::mem::size_of::<Entry>(), 16);
        let mut m = KeyMap::default();
        m.reserve(100_000);
        assert_eq!(m.entries.as_ptr() as usize % 16, 0);
    }

    #[test]
    fn insert_at_a_vacant_position_found_before() {
        let mut m = KeyMap::default();
        let f = m.find(4);
        assert_eq!(f, None);
        m.insert_at(f, 4, slot(1));
        for k in 10..40 {
            let f = m.find(k);
            assert!(matches!(f, Some(Found::Vacant(_))));
            m.insert_at(f, k, slot(k as u32));
        }
        for k in 10..40 {
            let Some(Found::At(i)) = m.find(k) else {
                panic!("key {k} missing");
            };
            assert_eq!(m.slot_mut(i).index, k as u32);
        }
        m.reserve(1000);
        assert_eq!(m.get(4).map(|s| s.index), Some(1));
        assert_eq!(m.len(), 31);
    }

    /// How far from its home position `key` sits (it is in the map).
    fn probe_len(m: &KeyMap, key: u64) -> usize {
        let Some(Found::At(at)) = m.find(key) else {
            panic!("key {key} is not in the map");
        };
        at.wrapping_sub(m.home(key)) & m.mask()
    }

    /// Keys made to share one home slot under an unkeyed FxHash
    /// (`k * K` with its high bits zero, `K` FxHash's multiplier) are
    /// spread by each map's seed: no key sits far from its home. Under
    /// FxHash the 4096 keys formed one run, the last 4095 slots from home.
    #[test]
    fn keys_crafted_against_an_unkeyed_hash_do_not_share_a_probe_run() {
        const K: u64 = 0xf1357aea2e62a9c5;
        // K's inverse modulo 2^64, by Newton's iteration (K is odd).
        let mut inv = K;
        for _ in 0..6 {
            inv = inv.wrapping_mul(2u64.wrapping_sub(K.wrapping_mul(inv)));
        }
        assert_eq!(K.wrapping_mul(inv), 1);
        let keys: Vec<u64> = (1..=4096u64).map(|i| (i << 12).wrapping_mul(inv)).collect();
        let mut m = KeyMap::default();
        for (i, &k) in keys.iter().enumerate() {
            assert!(insert(&mut m, k, slot(i as u32)));
        }
        let longest = keys.iter().map(|&k| probe_len(&m, k)).max().unwrap();
        assert!(longest < 100, "a probe run of {longest} slots");
        // Two maps hash the same key apart (their seeds differ), so an
        // order learnt from one map says nothing of another.
        let other = KeyMap::default();
        assert_ne!(
            keys.iter()
                .map(|&k| m.hasher.hash_one(k))
                .collect::<Vec<_>>(),
            keys.iter()
                .map(|&k| other.hasher.hash_one(k))
                .collect::<Vec<_>>()
        );
    }
}

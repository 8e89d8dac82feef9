//! The frequency filter's counters (`filter_freq > 1`): how often each key
//! without a row was pulled, for at most `filter_capacity` keys at once.
//!
//! The counters are bounded, so a full map must choose. It used to refuse
//! every new key once full: on data with a long tail of ids seen once
//! (CTR logs hold billions), the map filled with them and no key that came
//! later was ever admitted, however often it was pulled, for the rest of
//! the run (or until `steps_to_live` expired counters). Now a new key
//! takes the place of a counter chosen by CLOCK (second chance): the
//! counters sit in a ring in the order they were made; a counter pulled
//! again since it last came round is passed over once, one that was not
//! is dropped. A tail id seen once is dropped when its turn comes; a key
//! pulled again within a turn of the ring keeps its count. So a key is
//! admitted when it reaches `filter_freq` pulls while the map holds it,
//! about within the last `filter_capacity` new keys, rather than never.
//!
//! Hand-written: the map needs the ring beside it (a key's place in it, a
//! mark), which no LRU/CLOCK crate keeps for `u64` keys with the per-map
//! seeded hasher the PS needs ([`crate::keyhash`]).

use std::collections::VecDeque;

use super::{Map, Pending};

/// A key's counter and its place in the ring: 24 bytes (a [`Pending`]'s
/// fields, laid out with the mark in what would be padding).
#[derive(Debug, Clone, Copy)]
struct Entry {
    count: u32,
    /// Pulled again since the ring last came round to it.
    referenced: bool,
    last_seen: u64,
    /// When it was made: its place in the ring is `(key, made)`.
    made: u64,
}

impl Entry {
    fn pending(&self) -> Pending {
        Pending {
            count: self.count,
            last_seen: self.last_seen,
        }
    }
}

/// What [`Counters::count`] did with a pull of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// The key's count now.
    Now(u32),
    /// Counted from 1 in the place of another key's counter (the map was
    /// full).
    Replaced,
    /// Not counted: the map holds no counter at all (`filter_capacity`
    /// 0).
    Refused,
}

/// The counters of one table. See the module documentation.
#[derive(Debug, Clone, Default)]
pub(crate) struct Counters {
    map: Map<Entry>,
    /// `(key, made)` in the order the counters were made; an entry whose
    /// counter is gone (admitted, expired, dropped, or made again) is
    /// skipped when the ring comes to it.
    ring: VecDeque<(u64, u64)>,
    /// The next counter's `made`.
    next: u64,
}

impl Counters {
    /// Counters restored from a checkpoint: the ring in the order of the
    /// keys' last pull (then key), the oldest first. At most `capacity`
    /// are kept, the latest pulled: a run resumed with a smaller
    /// `--filter-capacity` holds its bound from the start (rather than
    /// dropping the surplus all at once at its first new key). Also
    /// returns how many were dropped.
    pub(crate) fn restored(
        counters: impl IntoIterator<Item = (u64, Pending)>,
        capacity: usize,
    ) -> (Self, u64) {
        let mut all: Vec<(u64, Pending)> = counters.into_iter().collect();
        all.sort_unstable_by_key(|&(k, p)| (p.last_seen, k));
        let dropped = all.len().saturating_sub(capacity);
        let mut c = Self::default();
        c.map.reserve(all.len() - dropped);
        for &(key, pending) in &all[dropped..] {
            c.make(key, pending);
        }
        (c, dropped as u64)
    }

    fn make(&mut self, key: u64, pending: Pending) {
        let made = self.next;
        self.next += 1;
        self.map.insert(
            key,
            Entry {
                count: pending.count,
                referenced: false,
                last_seen: pending.last_seen,
                made,
            },
        );
        self.ring.push_back((key, made));
    }

    /// Keys counted.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The counter of `key` (tests).
    #[cfg(test)]
    pub(crate) fn get(&self, key: u64) -> Option<Pending> {
        self.map.get(&key).map(Entry::pending)
    }

    /// Every counter, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Pending)> + '_ {
        self.map.iter().map(|(&k, e)| (k, e.pending()))
    }

    /// Count a pull of `key` at `step`, holding at most `capacity`
    /// counters.
    pub(crate) fn count(&mut self, key: u64, step: u64, capacity: usize) -> Counted {
        if let Some(e) = self.map.get_mut(&key) {
            e.count += 1;
            e.last_seen = step;
            e.referenced = true;
            return Counted::Now(e.count);
        }
        if capacity == 0 {
            return Counted::Refused;
        }
        let mut replaced = false;
        while self.map.len() >= capacity && self.drop_one() {
            replaced = true;
        }
        self.make(
            key,
            Pending {
                count: 1,
                last_seen: step,
            },
        );
        if replaced {
            Counted::Replaced
        } else {
            Counted::Now(1)
        }
    }

    /// Drop the counter the ring comes to first that was not pulled again
    /// since it last came round (those that were go round once more);
    /// false when there is none.
    fn drop_one(&mut self) -> bool {
        while let Some((key, made)) = self.ring.pop_front() {
            let Some(e) = self.map.get_mut(&key).filter(|e| e.made == made) else {
                continue;
            };
            if std::mem::take(&mut e.referenced) {
                self.ring.push_back((key, made));
                continue;
            }
            self.map.remove(&key);
            return true;
        }
        false
    }

    /// Forget `key`'s counter (it got its row).
    pub(crate) fn remove(&mut self, key: u64) {
        if self.map.remove(&key).is_some() {
            self.compact();
        }
    }

    /// Keep the counters `keep(key, counter)` is true for.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u64, &Pending) -> bool) {
        self.map.retain(|&k, e| keep(k, &e.pending()));
        self.compact();
    }

    /// Drop the ring's entries of counters that are gone once they are a
    /// third of it, so that it stays within 1.5 times the counters (and a
    /// few): with the map's 24-byte entries, about 50 bytes a counter.
    fn compact(&mut self) {
        if self.ring.len() > self.map.len() + self.map.len() / 2 + 64 {
            let map = &self.map;
            self.ring
                .retain(|(k, made)| map.get(k).is_some_and(|e| e.made == *made));
        }
    }

    /// Entries in the ring, counters gone included (tests).
    #[cfg(test)]
    pub(crate) fn ring_len(&self) -> usize {
        self.ring.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(c: &Counters) -> Vec<(u64, u32)> {
        let mut v: Vec<(u64, u32)> = c.iter().map(|(k, p)| (k, p.count)).collect();
        v.sort_unstable();
        v
    }

    /// Full, a new key takes the place of the oldest counter not pulled
    /// again since the ring last came round; one pulled again is passed
    /// over once and keeps its count.
    #[test]
    fn a_full_map_drops_the_counter_the_ring_comes_to_first_not_pulled_again() {
        let mut c = Counters::default();
        assert_eq!(c.count(1, 0, 2), Counted::Now(1));
        assert_eq!(c.count(2, 0, 2), Counted::Now(1));
        assert_eq!(c.count(1, 1, 2), Counted::Now(2));
        // 1 was pulled again: 2 goes.
        assert_eq!(c.count(3, 2, 2), Counted::Replaced);
        assert_eq!(counts(&c), [(1, 2), (3, 1)]);
        // 1 has had its second chance: it goes now, though 3 is newer.
        assert_eq!(c.count(4, 3, 2), Counted::Replaced);
        assert_eq!(counts(&c), [(3, 1), (4, 1)]);
        assert_eq!(c.get(1), None);
    }

    /// A stream of keys seen once never stops a key pulled often from
    /// being counted up (the old map refused every key once full).
    #[test]
    fn a_long_tail_of_keys_seen_once_does_not_starve_a_hot_key() {
        let mut c = Counters::default();
        let mut hot = 0;
        for (i, tail) in (1_000u64..1_000 + 10_000).enumerate() {
            c.count(tail, i as u64, 64);
            if i % 16 == 0 {
                if let Counted::Now(n) = c.count(7, i as u64, 64) {
                    hot = n;
                }
            }
        }
        assert!(c.len() <= 64);
        assert_eq!(hot, 625, "every pull of the hot key counted");
        assert!(
            c.ring_len() <= c.len() + c.len() / 2 + 64 + 1,
            "{}",
            c.ring_len()
        );
    }

    /// An entry is 24 bytes.
    #[test]
    fn an_entry_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 24);
    }

    /// Removed and expired counters leave the ring within bounds, and a
    /// key counted again after its counter went starts from 1.
    #[test]
    fn the_ring_stays_within_one_and_a_half_times_the_counters() {
        let mut c = Counters::default();
        for k in 0..1_000u64 {
            c.count(k, k, 4_096);
        }
        for k in 0..990u64 {
            c.remove(k);
        }
        assert_eq!(c.len(), 10);
        assert!(
            c.ring_len() <= c.len() + c.len() / 2 + 64,
            "{}",
            c.ring_len()
        );
        c.retain(|k, _| k % 2 == 0);
        assert_eq!(c.len(), 5);
        assert_eq!(c.count(3, 5_000, 4_096), Counted::Now(1));
        assert_eq!(
            c.count(990, 5_000, 0),
            Counted::Now(2),
            "a counter held counts on"
        );
        assert_eq!(Counters::default().count(9, 0, 0), Counted::Refused);
    }

    /// Restored counters go round in the order of their last pull.
    #[test]
    fn restored_counters_go_round_oldest_pull_first() {
        let p = |count, last_seen| Pending { count, last_seen };
        let (mut c, dropped) = Counters::restored([(5, p(1, 9)), (6, p(1, 2)), (7, p(2, 4))], 3);
        assert_eq!(dropped, 0);
        assert_eq!(c.count(8, 10, 3), Counted::Replaced);
        assert_eq!(counts(&c), [(5, 1), (7, 2), (8, 1)]);
        assert_eq!(c.count(9, 11, 3), Counted::Replaced);
        assert_eq!(counts(&c), [(5, 1), (8, 1), (9, 1)]);
        // Restored under a smaller capacity: the latest pulled are kept.
        let (c, dropped) = Counters::restored([(5, p(1, 9)), (6, p(1, 2)), (7, p(2, 4))], 2);
        assert_eq!(dropped, 1);
        assert_eq!(counts(&c), [(5, 1), (7, 2)]);
        assert_eq!(c.ring_len(), 2);
    }
}

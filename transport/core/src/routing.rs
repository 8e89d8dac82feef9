//! Routing of embedding ids to parameter servers and their reactors.
//!
//! A parameter server shards its rows over its reactors, so a request must
//! reach the reactor that owns its rows: a PS never scatters one request
//! across its own cores. A worker therefore keeps one connection per
//! (PS, reactor) pair and splits each batch of ids by hash, as PS-Plus maps
//! servers to cores. The hash is fixed (a 64-bit finaliser) so every worker
//! and every PS agree on it without coordination.

/// Where an id lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardAddr {
    /// Parameter-server task index.
    pub ps: u32,
    /// Reactor (shard) index on that server.
    pub reactor: u16,
}

/// The id → (PS, reactor) map of one cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Router {
    ps: u32,
    reactors: u16,
}

/// Mixes the bits of `id` (the SplitMix64 finaliser), so that ids that are
/// raw feature hashes or small sequential integers spread evenly.
pub fn mix(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Router {
    /// A router over `ps` servers with `reactors` reactors each (both ≥ 1).
    pub fn new(ps: u32, reactors: u16) -> Self {
        Self {
            ps: ps.max(1),
            reactors: reactors.max(1),
        }
    }

    /// Number of (PS, reactor) shards.
    pub fn shards(&self) -> usize {
        self.ps as usize * usize::from(self.reactors)
    }

    /// The shard that owns `id`.
    pub fn route(&self, id: i64) -> ShardAddr {
        let h = mix(id as u64);
        let ps = (h % u64::from(self.ps)) as u32;
        let reactor = ((h / u64::from(self.ps)) % u64::from(self.reactors)) as u16;
        ShardAddr { ps, reactor }
    }

    /// Dense index of a shard, `ps * reactors + reactor`.
    pub fn index(&self, a: ShardAddr) -> usize {
        a.ps as usize * usize::from(self.reactors) + usize::from(a.reactor)
    }

    /// Split `ids` into one bucket per shard (by [`index`](Self::index)),
    /// keeping each id's position so the rows that come back can be put
    /// in place. `buckets` is cleared and reused.
    pub fn split(&self, ids: &[i64], buckets: &mut Vec<Vec<(u32, i64)>>) {
        buckets.resize_with(self.shards(), Vec::new);
        for b in buckets.iter_mut() {
            b.clear();
        }
        for (pos, &id) in ids.iter().enumerate() {
            let i = self.index(self.route(id));
            buckets[i].push((pos as u32, id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_id_goes_to_exactly_one_shard_and_positions_are_kept() {
        let r = Router::new(3, 4);
        let ids: Vec<i64> = (0..10_000).map(|i| i * 7919 - 5000).collect();
        let mut buckets = Vec::new();
        r.split(&ids, &mut buckets);
        assert_eq!(buckets.len(), 12);
        let mut seen = vec![false; ids.len()];
        for (i, b) in buckets.iter().enumerate() {
            for &(pos, id) in b {
                assert_eq!(ids[pos as usize], id);
                assert_eq!(r.index(r.route(id)), i);
                assert!(!seen[pos as usize]);
                seen[pos as usize] = true;
            }
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn sequential_ids_spread_over_all_shards() {
        let r = Router::new(2, 8);
        let mut counts = vec![0usize; r.shards()];
        for id in 0..16_000 {
            counts[r.index(r.route(id))] += 1;
        }
        // Each of 16 shards should get about 1000; allow a wide band.
        for c in counts {
            assert!((700..1300).contains(&c), "uneven spread: {c}");
        }
    }

    #[test]
    fn routing_is_stable() {
        // Workers and servers must agree forever: pin a few values.
        let r = Router::new(4, 2);
        assert_eq!(r.route(0), r.route(0));
        assert_eq!(mix(0), 0xe220_a839_7b1d_cdaf);
    }
}

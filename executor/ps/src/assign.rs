//! Variable assignment: which PS task holds each variable, in the manner
//! of PS-Plus.
//!
//! Embedding tables at or above [`AssignOptions::shard_threshold_bytes`]
//! (default 0: every table) are sharded by key over all PS with
//! [`shard_of`]; every other variable is assigned whole to one PS by a
//! [`Strategy`]:
//!
//! * `RoundRobin`: in the given order.
//! * `Greedy`: largest bytes first onto the PS with the fewest bytes.
//! * `Anneal { seed, iters }`: simulated annealing from the greedy
//!   assignment, minimising `max/mean(bytes) + max/mean(expected requests)`
//!   over the PS, with moves (one variable to another PS) and swaps (two
//!   variables on different PS). Deterministic for a seed; the best assignment
//!   seen is returned, so its cost is never above greedy's.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::var::mix;

/// What assignment knows of a variable.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VarStats {
    /// Variable id.
    pub id: u32,
    /// Name (for reports).
    pub name: String,
    /// True for an embedding table (candidate for sharding).
    pub embedding: bool,
    /// Expected resident bytes (weights and optimizer slots); see [`estimate`].
    pub bytes: u64,
    /// Expected load per step, in any unit consistent across variables
    /// (e.g. rows pulled per step); see [`estimate`].
    pub expected_requests: f64,
}

/// How whole variables are assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Strategy {
    /// In order, PS 0, 1, ...
    RoundRobin,
    /// Largest first onto the least-loaded PS (by bytes).
    Greedy,
    /// Simulated annealing over bytes and requests, starting from greedy.
    Anneal {
        /// RNG seed.
        seed: u64,
        /// Number of proposed moves.
        iters: u32,
    },
}

/// Options of [`assign_with`]. The default threshold 0 shards every table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AssignOptions {
    /// Embedding tables with at least this many bytes are sharded over all PS.
    pub shard_threshold_bytes: u64,
}

/// Where a variable lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Location {
    /// Whole on this PS.
    Ps(usize),
    /// Sharded by key over all PS ([`shard_of`]).
    Sharded,
}

/// The result of [`assign`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VariableAssignment {
    /// Number of PS.
    pub num_ps: usize,
    /// The strategy used.
    pub strategy: Strategy,
    /// Location of every variable, by id.
    pub locations: BTreeMap<u32, Location>,
    /// Bytes per PS.
    pub bytes: Vec<u64>,
    /// Expected requests per PS.
    pub requests: Vec<f64>,
}

/// Per-PS loads and balance ratios of an assignment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssignmentReport {
    /// Strategy name.
    pub strategy: String,
    /// Bytes per PS.
    pub bytes: Vec<u64>,
    /// Expected requests per PS.
    pub requests: Vec<f64>,
    /// Whole variables per PS.
    pub whole_vars: Vec<usize>,
    /// Number of sharded tables.
    pub sharded_vars: usize,
    /// max / mean of bytes (1 = perfect balance).
    pub bytes_max_over_mean: f64,
    /// max / mean of expected requests.
    pub requests_max_over_mean: f64,
    /// The annealing cost: the sum of the two ratios.
    pub cost: f64,
}

/// The PS shard of a key: the splitmix64 finaliser of `key ^
/// 0x5053_5348_4152_4421`, then multiply-shift (`(h * n) >> 64`) onto
/// `0..num_shards`. Fixed: changing it changes which shard holds every row.
/// `num_shards` 0 is treated as 1.
pub fn shard_of(key: u64, num_shards: usize) -> usize {
    let h = mix(key ^ 0x5053_5348_4152_4421);
    ((u128::from(h) * num_shards.max(1) as u128) >> 64) as usize
}

fn max_over_mean<T: Copy + Into<f64>>(v: &[T]) -> f64 {
    let n = v.len().max(1) as f64;
    let sum: f64 = v.iter().map(|&x| x.into()).sum();
    let max = v.iter().map(|&x| x.into()).fold(0.0, f64::max);
    if sum <= 0.0 {
        1.0
    } else {
        max / (sum / n)
    }
}

fn cost(bytes: &[f64], req: &[f64]) -> f64 {
    max_over_mean(bytes) + max_over_mean(req)
}

/// [`assign_with`] with the default options.
pub fn assign(vars: &[VarStats], num_ps: usize, strategy: Strategy) -> VariableAssignment {
    assign_with(vars, num_ps, strategy, &AssignOptions::default())
}

/// Assign `vars` to `num_ps` PS (0 is treated as 1).
pub fn assign_with(
    vars: &[VarStats],
    num_ps: usize,
    strategy: Strategy,
    opts: &AssignOptions,
) -> VariableAssignment {
    let n = num_ps.max(1);
    let mut base_bytes = vec![0.0f64; n];
    let mut base_req = vec![0.0f64; n];
    let mut locations = BTreeMap::new();
    let mut whole: Vec<usize> = Vec::new();
    for (i, v) in vars.iter().enumerate() {
        if v.embedding && v.bytes >= opts.shard_threshold_bytes {
            locations.insert(v.id, Location::Sharded);
            for p in 0..n {
                base_bytes[p] += v.bytes as f64 / n as f64;
                base_req[p] += v.expected_requests / n as f64;
            }
        } else {
            whole.push(i);
        }
    }
    let mut assign = vec![0usize; whole.len()];
    match strategy {
        Strategy::RoundRobin => {
            for (j, a) in assign.iter_mut().enumerate() {
                *a = j % n;
            }
        }
        Strategy::Greedy | Strategy::Anneal { .. } => {
            greedy(vars, &whole, &base_bytes, &mut assign);
            if let Strategy::Anneal { seed, iters } = strategy {
                anneal(
                    vars,
                    &whole,
                    &base_bytes,
                    &base_req,
                    &mut assign,
                    seed,
                    iters,
                );
            }
        }
    }
    let (mut bytes, mut requests) = (base_bytes, base_req);
    for (j, &i) in whole.iter().enumerate() {
        bytes[assign[j]] += vars[i].bytes as f64;
        requests[assign[j]] += vars[i].expected_requests;
        locations.insert(vars[i].id, Location::Ps(assign[j]));
    }
    VariableAssignment {
        num_ps: n,
        strategy,
        locations,
        bytes: bytes.iter().map(|b| b.round() as u64).collect(),
        requests,
    }
}

fn greedy(vars: &[VarStats], whole: &[usize], base: &[f64], assign: &mut [usize]) {
    let mut load = base.to_vec();
    let mut order: Vec<usize> = (0..whole.len()).collect();
    // Largest first; ties by id so the result does not depend on input order.
    order.sort_by(|&a, &b| {
        let (va, vb) = (&vars[whole[a]], &vars[whole[b]]);
        vb.bytes.cmp(&va.bytes).then(va.id.cmp(&vb.id))
    });
    for j in order {
        let p = (0..load.len())
            .min_by(|&a, &b| load[a].total_cmp(&load[b]))
            .unwrap_or(0);
        assign[j] = p;
        load[p] += vars[whole[j]].bytes as f64;
    }
}

fn anneal(
    vars: &[VarStats],
    whole: &[usize],
    base_bytes: &[f64],
    base_req: &[f64],
    assign: &mut [usize],
    seed: u64,
    iters: u32,
) {
    let n = base_bytes.len();
    if n < 2 || whole.is_empty() {
        return;
    }
    let (mut bytes, mut req) = (base_bytes.to_vec(), base_req.to_vec());
    for (j, &i) in whole.iter().enumerate() {
        bytes[assign[j]] += vars[i].bytes as f64;
        req[assign[j]] += vars[i].expected_requests;
    }
    let mut cur = cost(&bytes, &req);
    let mut best = (cur, assign.to_vec());
    let mut state = seed ^ 0xA11E_A1ED;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(state)
    };
    let (t0, t1) = (0.05f64, 1e-4f64);
    let m = whole.len() as u64;
    for it in 0..iters {
        let temp = t0 * (t1 / t0).powf(f64::from(it) / f64::from(iters.max(1)));
        let a = (next() % m) as usize;
        let (pa, va) = (assign[a], &vars[whole[a]]);
        let swap = next() & 1 == 1 && m > 1;
        let (b, pb) = if swap {
            let b = (next() % m) as usize;
            (Some(b), assign[b])
        } else {
            let mut p = (next() % (n as u64 - 1)) as usize;
            if p >= pa {
                p += 1;
            }
            (None, p)
        };
        if pa == pb {
            continue;
        }
        let mv = |bytes: &mut [f64], req: &mut [f64], v: &VarStats, from: usize, to: usize| {
            bytes[from] -= v.bytes as f64;
            req[from] -= v.expected_requests;
            bytes[to] += v.bytes as f64;
            req[to] += v.expected_requests;
        };
        mv(&mut bytes, &mut req, va, pa, pb);
        if let Some(b) = b {
            mv(&mut bytes, &mut req, &vars[whole[b]], pb, pa);
        }
        let c = cost(&bytes, &req);
        let accept = c <= cur || {
            let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
            u < ((cur - c) / temp).exp()
        };
        if accept {
            cur = c;
            assign[a] = pb;
            if let Some(b) = b {
                assign[b] = pa;
            }
            if c < best.0 {
                best = (c, assign.to_vec());
            }
        } else {
            mv(&mut bytes, &mut req, va, pb, pa);
            if let Some(b) = b {
                mv(&mut bytes, &mut req, &vars[whole[b]], pa, pb);
            }
        }
    }
    assign.copy_from_slice(&best.1);
}

impl VariableAssignment {
    /// Where variable `id` lives.
    pub fn location(&self, id: u32) -> Option<Location> {
        self.locations.get(&id).copied()
    }

    /// Ids of the whole variables on PS `ps`.
    pub fn vars_on(&self, ps: usize) -> Vec<u32> {
        self.locations
            .iter()
            .filter(|(_, l)| **l == Location::Ps(ps))
            .map(|(&id, _)| id)
            .collect()
    }

    /// Loads and balance ratios.
    pub fn report(&self) -> AssignmentReport {
        let bytes_f: Vec<f64> = self.bytes.iter().map(|&b| b as f64).collect();
        let mut whole_vars = vec![0; self.num_ps];
        let mut sharded_vars = 0;
        for l in self.locations.values() {
            match l {
                Location::Ps(p) => whole_vars[*p] += 1,
                Location::Sharded => sharded_vars += 1,
            }
        }
        let b = max_over_mean(&bytes_f);
        let r = max_over_mean(&self.requests);
        AssignmentReport {
            strategy: format!("{:?}", self.strategy),
            bytes: self.bytes.clone(),
            requests: self.requests.clone(),
            whole_vars,
            sharded_vars,
            bytes_max_over_mean: b,
            requests_max_over_mean: r,
            cost: b + r,
        }
    }
}

impl fmt::Display for AssignmentReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // "placement" as in the `--placement` flag that chose the strategy.
        writeln!(
            f,
            "placement {} ({} sharded tables)",
            self.strategy, self.sharded_vars
        )?;
        writeln!(
            f,
            "{:>4} {:>16} {:>14} {:>6}",
            "ps", "bytes", "requests", "vars"
        )?;
        for p in 0..self.bytes.len() {
            writeln!(
                f,
                "{:>4} {:>16} {:>14.1} {:>6}",
                p, self.bytes[p], self.requests[p], self.whole_vars[p]
            )?;
        }
        write!(
            f,
            "max/mean bytes {:.3}  requests {:.3}  cost {:.3}",
            self.bytes_max_over_mean, self.requests_max_over_mean, self.cost
        )
    }
}

pub mod estimate {
    //! Estimates that feed [`super::VarStats`].

    /// Bookkeeping bytes per embedding row besides its floats: the key (8),
    /// access step and update count (16), the map entry and the boxed
    /// slice's pointer and length (about 24).
    pub const ROW_OVERHEAD_BYTES: u64 = 48;

    /// Resident bytes of an embedding table holding `distinct_keys` rows of
    /// `dim` floats with `slots` optimizer slots each.
    pub fn table_bytes(distinct_keys: u64, dim: usize, slots: usize) -> u64 {
        let row = 4 * dim as u64 * (1 + slots as u64) + ROW_OVERHEAD_BYTES;
        distinct_keys.saturating_mul(row)
    }

    /// Resident bytes of a dense variable of `elements` floats with `slots` slots.
    pub fn dense_bytes(elements: usize, slots: usize) -> u64 {
        4 * elements as u64 * (1 + slots as u64)
    }

    /// Expected distinct rows pulled per step of `batch` examples, from a
    /// data sample of `sample_examples` examples in which key `k` occurred
    /// `key_counts[k]` times: `sum_k 1 - (1 - p_k)^batch` with
    /// `p_k = min(1, count_k / sample_examples)`.
    pub fn table_requests(key_counts: &[u64], sample_examples: u64, batch: u64) -> f64 {
        if sample_examples == 0 {
            return 0.0;
        }
        let b = batch.min(i32::MAX as u64) as i32;
        key_counts
            .iter()
            .map(|&c| {
                let p = (c as f64 / sample_examples as f64).min(1.0);
                1.0 - (1.0 - p).powi(b)
            })
            .sum()
    }
}

/// A benchmark model for assignment: `n` whole variables whose sizes follow
/// a Zipf law (`1e8 / (i + 1)^exponent` bytes) and whose request loads are
/// drawn independently of size (10 to 1009 per step, from `seed`), as
/// PS-Plus's assignment problem has them: big tables are not always the hot
/// ones.
pub fn zipf_model(n: usize, exponent: f64, seed: u64) -> Vec<VarStats> {
    (0..n as u32)
        .map(|i| {
            let bytes = (1e8 / f64::from(i + 1).powf(exponent)) as u64;
            let r = 10.0 + (mix(u64::from(i) ^ seed.rotate_left(17)) % 1000) as f64;
            VarStats {
                id: i,
                name: format!("v{i}"),
                embedding: false,
                bytes,
                expected_requests: r,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zipf_model() -> Vec<VarStats> {
        super::zipf_model(32, 1.1, 0)
    }

    #[test]
    fn greedy_and_anneal_beat_round_robin() {
        let vars = zipf_model();
        let rr = assign(&vars, 4, Strategy::RoundRobin).report();
        let gr = assign(&vars, 4, Strategy::Greedy).report();
        let an = assign(
            &vars,
            4,
            Strategy::Anneal {
                seed: 7,
                iters: 20_000,
            },
        )
        .report();
        println!("{rr}\n{gr}\n{an}");
        assert!(
            gr.bytes_max_over_mean <= rr.bytes_max_over_mean,
            "{gr}\n{rr}"
        );
        assert!(
            an.bytes_max_over_mean <= rr.bytes_max_over_mean,
            "{an}\n{rr}"
        );
        assert!(an.cost <= gr.cost, "{an}\n{gr}");
        // The total is conserved.
        let total: u64 = vars.iter().map(|v| v.bytes).sum();
        let assigned: u64 = an.bytes.iter().sum();
        assert!(assigned.abs_diff(total) <= 4);
        assert!(an.to_string().contains("max/mean bytes"));
        let json = serde_json::to_string(&an).unwrap();
        assert!(json.contains("requests_max_over_mean"));
    }

    #[test]
    fn anneal_is_deterministic() {
        let vars = zipf_model();
        let s = Strategy::Anneal {
            seed: 3,
            iters: 5000,
        };
        assert_eq!(assign(&vars, 4, s), assign(&vars, 4, s));
    }

    #[test]
    fn tables_are_sharded() {
        let mut vars = zipf_model();
        vars[0].embedding = true;
        vars[5].embedding = true;
        let p = assign(&vars, 3, Strategy::Greedy);
        assert_eq!(p.location(0), Some(Location::Sharded));
        assert_eq!(p.location(5), Some(Location::Sharded));
        assert!(matches!(p.location(1), Some(Location::Ps(_))));
        assert_eq!(p.report().sharded_vars, 2);
        let q = assign_with(
            &vars,
            3,
            Strategy::Greedy,
            &AssignOptions {
                shard_threshold_bytes: vars[0].bytes,
            },
        );
        assert_eq!(q.location(0), Some(Location::Sharded));
        assert!(matches!(q.location(5), Some(Location::Ps(_))));
    }

    #[test]
    fn shard_of_is_in_range_and_balanced() {
        let mut counts = [0u32; 5];
        for k in 1..50_001u64 {
            counts[shard_of(k, 5)] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        assert_eq!(shard_of(123, 1), 0);
        assert_eq!(shard_of(123, 0), 0);
    }

    #[test]
    fn estimates() {
        assert_eq!(
            estimate::table_bytes(10, 8, 1),
            10 * (64 + estimate::ROW_OVERHEAD_BYTES)
        );
        assert_eq!(estimate::dense_bytes(10, 2), 120);
        // A key in every example is pulled every step; a rare one rarely.
        let r = estimate::table_requests(&[100, 1], 100, 10);
        assert!((r - (1.0 + (1.0 - 0.99f64.powi(10)))).abs() < 1e-9);
    }
}

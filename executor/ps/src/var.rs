//! Variable descriptions and deterministic initialisation.
//!
//! # Initialisation scheme
//!
//! Every initial value is a pure function of `(seed, var id, key, element
//! index)`, so a row gets the same values whichever shard creates it and
//! whenever it is created (first pull, or again after eviction). An
//! embedding table with a default value matrix (DeepRec's
//! `default_value_dim = N`, see [`crate::TablePolicy`]) gives a new key the
//! values below for key `key % N`.
//!
//! ```text
//! var_seed  = mix(seed ^ mix(var_id + 0x5357_5053))          // "SWPS"
//! row_seed  = mix(var_seed ^ key)          (dense variables: key = 0)
//! u(j)      = mix(row_seed + (j + 1) * 0x9E37_79B9_7F4A_7C15) // the row's j-th 64-bit draw
//! uniform   = top 24 bits of u(j) / 2^24                      // in [0, 1)
//! ```
//!
//! `mix` is the splitmix64 finaliser. `Uniform { scale }` maps to
//! `[-scale, scale)`; `GlorotUniform` to `[-l, l)` with
//! `l = sqrt(6 / (fan_in + fan_out))` (dense: the first and last dimension,
//! a 1-D shape uses its length for both; embedding rows: `fan_in = fan_out = dim`).
//! Element `j` of a uniform row uses draw `u(j)`.
//!
//! `Normal { std }` uses the Marsaglia polar method, an exact transform
//! (no approximation of the normal law) that yields two independent normals
//! per accepted draw with one `ln` and one `sqrt` and no trigonometry. The
//! row's draws `u(0), u(1), ...` are consumed in order; each gives a point
//! `(x, y)` in `(-1, 1)^2` from its two 32-bit halves (`h / 2^31 - 1`,
//! recentred by half a step so 0 is never hit exactly); with
//! `s = x^2 + y^2` the point is rejected when `s >= 1` (about 21.5% of
//! draws) and otherwise gives elements `2i` and `2i + 1` (`i` counts the
//! accepted points) as `x * f` and `y * f` with `f = sqrt(-2 ln s / s)`; a
//! row of odd width drops the last `y * f`. Element `j` is therefore still a
//! pure function of `(seed, var id, key, j)`. With 32-bit coordinates the
//! largest magnitude is about 8.9 standard deviations (the previous
//! Box-Muller scheme, one `cos` and one `ln` per element, stopped at 6.7).
//! The computation is in `f64`, rounded to `f32` at the end. After 64
//! consecutive rejections (probability `0.215^64`, never seen in practice)
//! the pair falls back to Box-Muller on the last draw, so the loop is
//! bounded.

use serde::{Deserialize, Serialize};

/// What a variable is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VarKind {
    /// A dense tensor held whole by one shard.
    Dense {
        /// Dimensions; the element count is their product.
        shape: Vec<usize>,
    },
    /// A hash embedding table, sharded by key over every shard.
    Embedding {
        /// Row width.
        dim: usize,
    },
}

/// How a variable (or a new embedding row) is initialised.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// Uniform in `[-scale, scale)`.
    Uniform {
        /// Half-width.
        scale: f32,
    },
    /// Normal with mean 0.
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// Glorot (Xavier) uniform.
    GlorotUniform,
}

/// A variable of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VarDef {
    /// Id used on the wire.
    pub id: u32,
    /// Human-readable name.
    pub name: String,
    /// Dense or embedding.
    pub kind: VarKind,
    /// Initialiser.
    pub init: Init,
}

impl VarDef {
    /// Element count of a dense variable, row width of an embedding.
    pub fn width(&self) -> usize {
        match &self.kind {
            VarKind::Dense { shape } => shape.iter().product(),
            VarKind::Embedding { dim } => *dim,
        }
    }

    /// `(fan_in, fan_out)` used by [`Init::GlorotUniform`].
    fn fans(&self) -> (usize, usize) {
        match &self.kind {
            VarKind::Dense { shape } => match shape.as_slice() {
                [] => (1, 1),
                [n] => (*n, *n),
                s => (s[0], s[s.len() - 1]),
            },
            VarKind::Embedding { dim } => (*dim, *dim),
        }
    }

    /// Fill `out` with the initial values of row `key` (0 for dense variables).
    pub fn init_values(&self, seed: u64, key: u64, out: &mut [f32]) {
        let row_seed = mix(var_seed(seed, self.id) ^ key);
        let draw = |j: usize| mix(row_seed.wrapping_add((j as u64 + 1).wrapping_mul(GOLDEN)));
        match self.init {
            Init::Zeros => out.fill(0.0),
            Init::Uniform { scale } => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = (unit(draw(j)) * 2.0 - 1.0) * scale;
                }
            }
            Init::GlorotUniform => {
                let (fi, fo) = self.fans();
                let l = (6.0 / (fi + fo).max(1) as f64).sqrt() as f32;
                for (j, o) in out.iter_mut().enumerate() {
                    *o = (unit(draw(j)) * 2.0 - 1.0) * l;
                }
            }
            Init::Normal { std } => fill_normal(row_seed, f64::from(std), out),
        }
    }
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser (a bijection on `u64`).
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn var_seed(seed: u64, id: u32) -> u64 {
    mix(seed ^ mix(u64::from(id) + 0x5357_5053))
}

/// Fill `out` with normals of deviation `std` (Marsaglia polar method, see
/// the module docs): the row's draws `u(0), u(1), ...` in order, two
/// elements per accepted draw.
fn fill_normal(row_seed: u64, std: f64, out: &mut [f32]) {
    let mut draw = 0u64;
    let mut rejected = 0u32;
    let mut j = 0;
    while j < out.len() {
        // `black_box`: otherwise LLVM turns the rejection search into a
        // 16-lane SIMD scan that computes 16 draws per accepted point.
        let u = mix(row_seed.wrapping_add((std::hint::black_box(draw) + 1).wrapping_mul(GOLDEN)));
        draw += 1;
        let (x, y) = (coord((u >> 32) as u32), coord(u as u32));
        let s = x * x + y * y;
        let (a, b) = if s < 1.0 {
            // s > 0: both coordinates are at least 2^-32 in magnitude.
            let f = (-2.0 * s.ln() / s).sqrt() * std;
            (x * f, y * f)
        } else if rejected < 63 {
            rejected += 1;
            continue;
        } else {
            // 64 rejections in a row (probability 0.215^64, never seen in
            // practice): Box-Muller on this draw keeps the loop bounded.
            let u1 = (f64::from((u >> 32) as u32) + 1.0) / 4_294_967_296.0;
            let u2 = f64::from(u as u32) / 4_294_967_296.0;
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let (sin, cos) = (std::f64::consts::TAU * u2).sin_cos();
            (r * cos, r * sin)
        };
        rejected = 0;
        out[j] = a as f32;
        if let Some(o) = out.get_mut(j + 1) {
            *o = b as f32;
        }
        j += 2;
    }
}

/// A 32-bit draw as a point of `(-1, 1)`, centred in its step of `2^-31`.
fn coord(h: u32) -> f64 {
    (f64::from(h) + 0.5) * (1.0 / 2_147_483_648.0) - 1.0
}

fn unit(u: u64) -> f32 {
    (u >> 40) as f32 / 16_777_216.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emb(init: Init) -> VarDef {
        VarDef {
            id: 7,
            name: "e".into(),
            kind: VarKind::Embedding { dim: 64 },
            init,
        }
    }

    #[test]
    fn init_is_deterministic_and_key_dependent() {
        let v = emb(Init::Uniform { scale: 0.5 });
        let (mut a, mut b, mut c) = (vec![0.0; 64], vec![0.0; 64], vec![0.0; 64]);
        v.init_values(1, 42, &mut a);
        v.init_values(1, 42, &mut b);
        v.init_values(1, 43, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|x| (-0.5..0.5).contains(x)));
        let mut d = vec![0.0; 64];
        v.init_values(2, 42, &mut d);
        assert_ne!(a, d);
    }

    #[test]
    fn normal_has_roughly_the_right_moments() {
        let v = emb(Init::Normal { std: 2.0 });
        let mut row = vec![0.0f32; 64];
        let (mut s, mut s2, mut n) = (0.0f64, 0.0f64, 0.0f64);
        for k in 1..200u64 {
            v.init_values(3, k, &mut row);
            for &x in &row {
                s += f64::from(x);
                s2 += f64::from(x) * f64::from(x);
                n += 1.0;
            }
        }
        let mean = s / n;
        let var = s2 / n - mean * mean;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
    }

    #[test]
    fn normal_element_does_not_depend_on_the_row_width() {
        // Element j is a function of (seed, var id, key, j): an odd-width
        // row is the prefix of the next even width.
        let mut five = VarDef {
            kind: VarKind::Embedding { dim: 5 },
            ..emb(Init::Normal { std: 1.0 })
        };
        let mut a = vec![0.0f32; 5];
        five.init_values(4, 99, &mut a);
        five.kind = VarKind::Embedding { dim: 6 };
        let mut b = vec![0.0f32; 6];
        five.init_values(4, 99, &mut b);
        assert_eq!(a[..], b[..5]);
        assert!(b.iter().all(|x| x.is_finite() && *x != 0.0));
    }

    #[test]
    fn glorot_bounds() {
        let v = VarDef {
            id: 1,
            name: "w".into(),
            kind: VarKind::Dense {
                shape: vec![10, 30],
            },
            init: Init::GlorotUniform,
        };
        let mut w = vec![0.0; 300];
        v.init_values(0, 0, &mut w);
        let l = (6.0f32 / 40.0).sqrt();
        assert!(w.iter().all(|x| x.abs() <= l));
        assert!(w.iter().any(|x| x.abs() > l / 2.0));
    }
}

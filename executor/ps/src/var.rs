//! Variable descriptions and deterministic initialisation.
//!
//! # Initialisation scheme
//!
//! Every initial value is a pure function of `(seed, var id, key, element
//! index)`, so a row gets the same values whichever shard creates it and
//! whenever it is created (first pull, or again after eviction):
//!
//! ```text
//! var_seed  = mix(seed ^ mix(var_id + 0x5357_5053))          // "SWPS"
//! row_seed  = mix(var_seed ^ key)          (dense variables: key = 0)
//! u(j)      = mix(row_seed + (j + 1) * 0x9E37_79B9_7F4A_7C15) // one 64-bit draw per element j
//! uniform   = top 24 bits of u(j) / 2^24                      // in [0, 1)
//! ```
//!
//! `mix` is the splitmix64 finaliser. `Uniform { scale }` maps to
//! `[-scale, scale)`; `GlorotUniform` to `[-l, l)` with
//! `l = sqrt(6 / (fan_in + fan_out))` (dense: the first and last dimension,
//! a 1-D shape uses its length for both; embedding rows: `fan_in = fan_out = dim`);
//! `Normal { std }` uses Box-Muller on the two 32-bit halves of `u(j)`.

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
            Init::Normal { std } => {
                for (j, o) in out.iter_mut().enumerate() {
                    let u = draw(j);
                    // u1 in (0, 1] so ln is finite; u2 in [0, 1).
                    let u1 = ((u >> 32) as f64 + 1.0) / 4_294_967_296.0;
                    let u2 = (u & 0xFFFF_FFFF) as f64 / 4_294_967_296.0;
                    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                    *o = (z * f64::from(std)) as f32;
                }
            }
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

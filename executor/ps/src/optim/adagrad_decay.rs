//! DeepRec's `AdagradDecayOptimizer`: Adagrad whose accumulator decays, so
//! a row's step size does not shrink for ever on a stream that never ends.
//!
//! Per row, with `p` the number of decays applied to it so far:
//!
//! ```text
//! if global_step / decay_step > p:   acc = max(acc * decay_rate, baseline); p += 1
//! acc += g^2
//! w   -= lr * g / sqrt(acc)
//! ```
//!
//! as DeepRec's `SparseApplyAdagradDecay` kernel does (one decay per update
//! at most, however many periods passed; `baseline` is the initial
//! accumulator). The slots are `acc` (as wide as the row) and `p` (one per
//! column too, so every slot has the row's width; only the first is read),
//! stored as `f32`: exact up to 2^24 decays.

/// AdagradDecay's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AdagradDecay {
    pub lr: f32,
    pub decay_step: u64,
    pub decay_rate: f32,
    pub baseline: f32,
}

impl AdagradDecay {
    /// One step on a row at `global_step`: `slots` is `[acc.., p..]`.
    pub(crate) fn apply(&self, w: &mut [f32], slots: &mut [f32], g: &[f32], global_step: u64) {
        let n = w.len();
        let (acc, power) = slots.split_at_mut(n);
        let g = &g[..n];
        let periods = global_step / self.decay_step.max(1);
        if n > 0 && periods as f64 > f64::from(power[0]) {
            for a in acc.iter_mut() {
                *a = (*a * self.decay_rate).max(self.baseline);
            }
            let p = power[0] + 1.0;
            power[..n].fill(p);
        }
        let lr = self.lr;
        for ((w, a), g) in w.iter_mut().zip(acc.iter_mut()).zip(g) {
            *a += g * g;
            *w -= lr * g / a.sqrt();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: AdagradDecay = AdagradDecay {
        lr: 0.1,
        decay_step: 10,
        decay_rate: 0.5,
        baseline: 0.1,
    };

    #[test]
    fn no_decay_before_the_first_period_is_adagrad() {
        let mut w = [1.0f32];
        let mut s = [0.1f32, 0.0];
        D.apply(&mut w, &mut s, &[1.0], 9);
        assert!((s[0] - 1.1).abs() < 1e-6);
        assert_eq!(s[1], 0.0);
        assert!((w[0] - (1.0 - 0.1 / 1.1f32.sqrt())).abs() < 1e-6);
    }

    #[test]
    fn decays_once_per_update_down_to_the_baseline() {
        let mut w = [0.0f32, 0.0];
        let mut s = [4.0f32, 0.15, 0.0, 0.0];
        // Step 35: three periods passed, one decay applied now.
        D.apply(&mut w, &mut s, &[0.0, 0.0], 35);
        assert_eq!(&s[..2], &[2.0, 0.1]);
        assert_eq!(&s[2..], &[1.0, 1.0]);
        D.apply(&mut w, &mut s, &[0.0, 0.0], 35);
        assert_eq!(&s[..2], &[1.0, 0.1]);
        D.apply(&mut w, &mut s, &[0.0, 0.0], 35);
        D.apply(&mut w, &mut s, &[2.0, 0.0], 35);
        // Caught up (p = 3): no more decay, just the square.
        assert_eq!(&s[..2], &[0.5 + 4.0, 0.1]);
        assert_eq!(s[2], 3.0);
    }
}

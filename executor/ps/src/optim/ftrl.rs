//! FTRL-Proximal (McMahan et al., "Ad Click Prediction: a View from the
//! Trenches", KDD 2013, algorithm 1), per coordinate, as TensorFlow's
//! `FtrlOptimizer` and DeepRec compute it with `learning_rate_power = -0.5`:
//!
//! ```text
//! n'     = n + g^2
//! sigma  = (sqrt(n') - sqrt(n)) / alpha
//! z     += g - sigma * w
//! w      = 0                                             if |z| <= l1
//!        = (sign(z) l1 - z) / ((beta + sqrt(n')) / alpha + 2 l2)  otherwise
//! ```
//!
//! `alpha` is the learning rate, `l1` and `l2` TensorFlow's
//! `l1_regularization_strength` and `l2_regularization_strength` (its L2
//! term is `l2 w^2`, hence `2 l2`), `beta` its `beta`. The slots are `n`
//! (starting at the initial accumulator, as TensorFlow's
//! `initial_accumulator_value`) and `z` (starting at 0). The weight is a
//! function of the slots, so a row's initial value only enters through the
//! first `sigma * w`.

/// FTRL's hyper-parameters, and `scale`, the factor of this push's
/// gradient (the warm-up's and the staleness rule's, 1 for a fresh push
/// after the warm-up): they scale the gradient, not `alpha`, because the
/// weight is a function of the slots and a smaller `alpha` would shrink
/// the weight itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Ftrl {
    pub alpha: f32,
    pub beta: f32,
    pub l1: f32,
    pub l2: f32,
    pub scale: f32,
}

impl Ftrl {
    /// One step on a row: `slots` is `[n.., z..]`, each as wide as `w`.
    pub(crate) fn apply(&self, w: &mut [f32], slots: &mut [f32], g: &[f32]) {
        let n = w.len();
        let (acc, z) = slots.split_at_mut(n);
        let z = &mut z[..n];
        let g = &g[..n];
        let inv_alpha = 1.0 / self.alpha;
        let l2x2 = 2.0 * self.l2;
        for (((w, a), z), &g) in w.iter_mut().zip(acc.iter_mut()).zip(z.iter_mut()).zip(g) {
            let g = g * self.scale;
            let a_new = *a + g * g;
            let sqrt_new = a_new.sqrt();
            let sigma = (sqrt_new - a.sqrt()) * inv_alpha;
            *z += g - sigma * *w;
            *a = a_new;
            *w = if z.abs() <= self.l1 {
                0.0
            } else {
                (z.signum() * self.l1 - *z) / ((self.beta + sqrt_new) * inv_alpha + l2x2)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: Ftrl = Ftrl {
        alpha: 0.5,
        beta: 1.0,
        l1: 0.1,
        l2: 0.05,
        scale: 1.0,
    };

    #[test]
    fn step_by_hand() {
        // n = 0.1, z = 0, w = 0.2, g = 0.6.
        let mut w = [0.2f32];
        let mut s = [0.1f32, 0.0];
        F.apply(&mut w, &mut s, &[0.6]);
        let n_new = 0.1f32 + 0.36;
        let sigma = (n_new.sqrt() - 0.1f32.sqrt()) / 0.5;
        let z = 0.6 - sigma * 0.2;
        let want = (0.1 - z) / ((1.0 + n_new.sqrt()) / 0.5 + 0.1);
        assert!((s[0] - n_new).abs() < 1e-6);
        assert!((s[1] - z).abs() < 1e-6);
        assert!((w[0] - want).abs() < 1e-6, "{} vs {want}", w[0]);
        assert!(w[0] < 0.0, "a positive gradient moves the weight down");
    }

    #[test]
    fn l1_keeps_small_weights_at_zero() {
        let mut w = [0.0f32, 0.0];
        let mut s = [0.1f32, 0.1, 0.0, 0.0];
        // |z| = 0.05 <= l1 for the first coordinate; 0.5 > l1 for the second.
        F.apply(&mut w, &mut s, &[0.05, -0.5]);
        assert_eq!(w[0], 0.0);
        assert!(w[1] > 0.0, "{w:?}");
    }

    #[test]
    fn minimises_a_quadratic() {
        // f(w) = (w - 3)^2 / 2, no regularisation: FTRL converges to 3.
        let f = Ftrl {
            alpha: 1.0,
            beta: 1.0,
            l1: 0.0,
            l2: 0.0,
            scale: 1.0,
        };
        let mut w = [0.0f32];
        let mut s = [0.1f32, 0.0];
        for _ in 0..2000 {
            let g = w[0] - 3.0;
            f.apply(&mut w, &mut s, &[g]);
        }
        assert!((w[0] - 3.0).abs() < 1e-2, "{w:?}");
    }
}

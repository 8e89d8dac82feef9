//! Delay-compensated asynchronous SGD (Zheng et al., "Asynchronous
//! Stochastic Gradient Descent with Delay Compensation", ICML 2017), in its
//! adaptive form (DC-ASGD-a), with Adagrad as the base rule.
//!
//! A worker's gradient `g` was computed on the values `w_bak` it pulled;
//! by the time it is applied the shard holds `w`. The paper approximates
//! the gradient at `w` with a first-order Taylor step whose Hessian is the
//! diagonal of the gradient's outer product, `g ⊙ g`:
//!
//! ```text
//! ms  = m ms + (1 - m) g²                    (a moving average of g²)
//! g̃   = g + λ0 / √(ms + ε) ⊙ g ⊙ g ⊙ (w - w_bak)
//! acc += g̃²
//! w   -= lr g̃ / √acc
//! ```
//!
//! `λ0 / √ms` is the paper's adaptive λ (its section 5), which keeps the
//! compensation's size independent of the gradient's scale. The paper's
//! base update is SGD; here it is Adagrad, the default rule of
//! `starwire train`, so `dc_asgd` differs from `adagrad` only by the
//! compensation. The slots are `acc` (from the initial accumulator) and
//! `ms` (from 0). Without `w_bak` (a push whose worker's pull the shard did
//! not see) the compensation is 0 and the step is Adagrad's.

/// DC-ASGD-a's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DcAsgd {
    pub lr: f32,
    /// The paper's λ0.
    pub lambda: f32,
    /// The paper's `m`, the moving average's decay.
    pub momentum: f32,
}

/// Keeps `1 / √(ms + EPS)` finite on a coordinate whose gradients were all 0.
const EPS: f32 = 1e-7;

impl DcAsgd {
    /// One step on a row: `slots` is `[acc.., ms..]`, each as wide as `w`;
    /// `bak` the values the gradient was computed on, if known.
    pub(crate) fn apply(&self, w: &mut [f32], slots: &mut [f32], g: &[f32], bak: Option<&[f32]>) {
        #[cfg(target_arch = "x86_64")]
        if wide::apply(self, w, slots, g, bak) {
            return;
        }
        self.step(w, slots, g, bak);
    }

    /// [`Self::apply`]'s loops, inlined into each caller so that they are
    /// compiled for the caller's instruction set.
    #[inline(always)]
    fn step(&self, w: &mut [f32], slots: &mut [f32], g: &[f32], bak: Option<&[f32]>) {
        let n = w.len();
        let (acc, ms) = slots.split_at_mut(n);
        let ms = &mut ms[..n];
        let g = &g[..n];
        let (lr, lambda, m) = (self.lr, self.lambda, self.momentum);
        match bak {
            Some(bak) => {
                let bak = &bak[..n];
                for ((((w, a), s), &g), &b) in w
                    .iter_mut()
                    .zip(acc.iter_mut())
                    .zip(ms.iter_mut())
                    .zip(g)
                    .zip(bak)
                {
                    *s = m * *s + (1.0 - m) * g * g;
                    let gc = g + lambda / (*s + EPS).sqrt() * g * g * (*w - b);
                    *a += gc * gc;
                    *w -= lr * gc / a.sqrt();
                }
            }
            None => {
                for (((w, a), s), &g) in w.iter_mut().zip(acc.iter_mut()).zip(ms.iter_mut()).zip(g)
                {
                    *s = m * *s + (1.0 - m) * g * g;
                    *a += g * g;
                    *w -= lr * g / a.sqrt();
                }
            }
        }
    }
}

/// The step compiled for AVX, on CPUs that have it (the build targets
/// baseline x86-64, four lanes). Each coordinate takes two square roots and
/// two divisions; with eight lanes an embedding row of 8 is one pass.
/// `train --workers 64` (whose default optimizer this is) ran 1.017× the
/// samples/s of the baseline build on the 2-vCPU VM (14 alternated rounds;
/// docs/TRAIN.md, "Many workers"). The results are the same bits: the same
/// IEEE operations in the same order, and Rust fuses no multiply-add
/// unasked.
#[cfg(target_arch = "x86_64")]
mod wide {
    #![allow(unsafe_code)]

    use super::DcAsgd;

    /// True when this CPU has AVX (the detection is cached by `std`).
    #[inline]
    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("avx")
    }

    /// [`DcAsgd::apply`] with AVX, when this CPU has it ([`available`]);
    /// false (nothing done) when it has not.
    pub(super) fn apply(
        d: &DcAsgd,
        w: &mut [f32],
        slots: &mut [f32],
        g: &[f32],
        bak: Option<&[f32]>,
    ) -> bool {
        if !available() {
            return false;
        }
        // SAFETY: `available()` said the CPU has AVX.
        unsafe { step_avx(d, w, slots, g, bak) };
        true
    }

    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    unsafe fn step_avx(
        d: &DcAsgd,
        w: &mut [f32],
        slots: &mut [f32],
        g: &[f32],
        bak: Option<&[f32]>,
    ) {
        d.step(w, slots, g, bak);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX path gives the bits of the baseline path, over widths that
    /// are and are not multiples of the lanes, with and without `w_bak`.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx_steps_are_the_baseline_steps_bit_for_bit() {
        if !wide::available() {
            eprintln!("no AVX on this CPU: only the baseline path runs here");
            return;
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        for n in [1usize, 3, 8, 13, 16, 64] {
            for with_bak in [true, false] {
                let w0: Vec<f32> = (0..n).map(|_| next()).collect();
                let s0: Vec<f32> = (0..2 * n).map(|_| next().abs() + 0.1).collect();
                let g: Vec<f32> = (0..n).map(|_| next()).collect();
                let bak: Vec<f32> = (0..n).map(|_| next()).collect();
                let bak = with_bak.then_some(&bak[..]);
                let (mut w1, mut s1) = (w0.clone(), s0.clone());
                let (mut w2, mut s2) = (w0.clone(), s0.clone());
                D.step(&mut w1, &mut s1, &g, bak);
                assert!(wide::apply(&D, &mut w2, &mut s2, &g, bak));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&w1), bits(&w2), "n {n}, bak {with_bak}");
                assert_eq!(bits(&s1), bits(&s2), "n {n}, bak {with_bak}");
            }
        }
    }

    const D: DcAsgd = DcAsgd {
        lr: 0.5,
        lambda: 2.0,
        momentum: 0.9,
    };

    #[test]
    fn step_by_hand() {
        // acc = 0.1, ms = 0.4, w = 1.0 now, pulled at 0.25, g = 0.5.
        let mut w = [1.0f32];
        let mut s = [0.1f32, 0.4];
        D.apply(&mut w, &mut s, &[0.5], Some(&[0.25]));
        let ms = 0.9f32 * 0.4 + 0.1 * 0.25;
        let gc = 0.5 + 2.0 / (ms + EPS).sqrt() * 0.25 * 0.75;
        let acc = 0.1 + gc * gc;
        assert!((s[1] - ms).abs() < 1e-6, "{s:?}");
        assert!((s[0] - acc).abs() < 1e-5, "{s:?}");
        assert!((w[0] - (1.0 - 0.5 * gc / acc.sqrt())).abs() < 1e-6, "{w:?}");
    }

    #[test]
    fn unmoved_values_or_no_backup_are_adagrad() {
        for bak in [Some(&[0.3f32, -0.2][..]), None] {
            let mut w = [0.3f32, -0.2];
            let mut s = [0.1f32, 0.1, 0.0, 0.0];
            D.apply(&mut w, &mut s, &[1.0, -2.0], bak);
            assert!((s[0] - 1.1).abs() < 1e-6 && (s[1] - 4.1).abs() < 1e-6);
            assert!((w[0] - (0.3 - 0.5 / 1.1f32.sqrt())).abs() < 1e-6, "{w:?}");
            assert!((w[1] - (-0.2 + 0.5 * 2.0 / 4.1f32.sqrt())).abs() < 1e-6);
            assert!(
                (s[2] - 0.1).abs() < 1e-6 && (s[3] - 0.4).abs() < 1e-6,
                "{s:?}"
            );
        }
    }

    #[test]
    fn compensation_pulls_back_towards_the_minimum() {
        // The shard moved the weight past where the gradient points: the
        // compensated gradient is larger, and the step goes further back.
        let mut plain = [2.0f32];
        let mut comp = [2.0f32];
        let (mut s1, mut s2) = ([0.1f32, 1.0], [0.1f32, 1.0]);
        D.apply(&mut plain, &mut s1, &[1.0], None);
        D.apply(&mut comp, &mut s2, &[1.0], Some(&[1.0]));
        assert!(comp[0] < plain[0], "{comp:?} {plain:?}");
        // A weight the shard moved the other way is compensated less.
        let mut other = [0.0f32];
        let mut s3 = [0.1f32, 1.0];
        D.apply(&mut other, &mut s3, &[1.0], Some(&[1.0]));
        assert!(other[0] - 0.0 > comp[0] - 2.0, "{other:?}");
    }
}

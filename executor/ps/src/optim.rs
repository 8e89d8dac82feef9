//! Optimizers: SGD, Adagrad, Adam, FTRL-Proximal (`optim/ftrl.rs`), DeepRec's
//! AdagradDecay (`optim/adagrad_decay.rs`) and delay-compensated ASGD
//! (`optim/dc_asgd.rs`), one update rule used by both the dense variables and the
//! sparse (row-wise) embedding updates.
//!
//! Sparse variants update only the rows a push touches; duplicate keys of a
//! push are summed first (see [`crate::PsShard::handle_push`]).
//!
//! Adam's bias correction is per row for embeddings: each row carries its own
//! step count `t`, incremented when the row is updated, so a row updated for
//! the first time at global step 10 000 gets the same first update as a row
//! updated at step 1. TensorFlow's LazyAdam and DeepRec's sparse Adam differ:
//! they update only the touched rows too, but bias-correct with the
//! variable's global count of applies. Dense variables have one step count
//! per variable. `t` is saved in checkpoints.

use serde::{Deserialize, Serialize};

mod adagrad_decay;
mod dc_asgd;
mod ftrl;

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// `w -= lr * g`.
    Sgd,
    /// `acc += g^2; w -= lr * g / sqrt(acc)`.
    Adagrad,
    /// Adam with bias correction.
    Adam,
    /// FTRL-Proximal (its rule and source: `optim/ftrl.rs`).
    Ftrl,
    /// Adagrad with a decaying accumulator (`optim/adagrad_decay.rs`).
    AdagradDecay,
    /// Adagrad on delay-compensated gradients (`optim/dc_asgd.rs`).
    DcAsgd,
}

impl OptimizerKind {
    /// Every kind with its command-line name.
    pub const ALL: [(&'static str, OptimizerKind); 6] = [
        ("sgd", OptimizerKind::Sgd),
        ("adagrad", OptimizerKind::Adagrad),
        ("adam", OptimizerKind::Adam),
        ("ftrl", OptimizerKind::Ftrl),
        ("adagrad_decay", OptimizerKind::AdagradDecay),
        ("dc_asgd", OptimizerKind::DcAsgd),
    ];

    /// The kind named `name` on the command line.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|&(_, k)| k)
    }

    /// Slot vectors per variable or row.
    pub fn slots(self) -> usize {
        match self {
            OptimizerKind::Sgd => 0,
            OptimizerKind::Adagrad => 1,
            OptimizerKind::Adam
            | OptimizerKind::Ftrl
            | OptimizerKind::AdagradDecay
            | OptimizerKind::DcAsgd => 2,
        }
    }

    /// True when the rule reads the values a gradient was computed on
    /// (the shard keeps each worker's last pull for it).
    pub fn needs_pulled_values(self) -> bool {
        self == OptimizerKind::DcAsgd
    }
}

/// How a push's rate depends on its staleness: the updates the row (or
/// dense variable) received between the worker's pull and this push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum StalenessLr {
    /// Every push at the full rate.
    #[default]
    None,
    /// `lr / √max(1, τ)`.
    Sqrt,
    /// `lr / max(1, τ)` (Zhang et al., "Staleness-aware Async-SGD for
    /// Distributed Deep Learning", IJCAI 2016, with τ counted per row).
    Linear,
}

impl StalenessLr {
    /// Every rule with its command-line name.
    pub const ALL: [(&'static str, StalenessLr); 3] = [
        ("none", StalenessLr::None),
        ("sqrt", StalenessLr::Sqrt),
        ("linear", StalenessLr::Linear),
    ];

    /// The factor applied to the rate of an update of staleness `tau`.
    #[inline]
    pub fn factor(self, tau: u64) -> f32 {
        let t = tau.max(1) as f32;
        match self {
            StalenessLr::None => 1.0,
            StalenessLr::Sqrt => 1.0 / t.sqrt(),
            StalenessLr::Linear => 1.0 / t,
        }
    }
}

/// Optimizer configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// Which rule.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f32,
    /// The initial accumulator of Adagrad, FTRL and AdagradDecay (default
    /// 0.1; AdagradDecay's decay never takes it below this).
    pub initial_accumulator: f32,
    /// Adam's beta1 (default 0.9).
    pub beta1: f32,
    /// Adam's beta2 (default 0.999).
    pub beta2: f32,
    /// Adam's epsilon (default 1e-8).
    pub epsilon: f32,
    /// FTRL's `beta` (default 0).
    pub ftrl_beta: f32,
    /// FTRL's `l1_regularization_strength` (default 0).
    pub l1: f32,
    /// FTRL's `l2_regularization_strength` (default 0).
    pub l2: f32,
    /// AdagradDecay's `accumulator_decay_step` (default 100 000 global steps).
    pub decay_step: u64,
    /// AdagradDecay's `accumulator_decay_rate` (default 0.9).
    pub decay_rate: f32,
    /// Learning-rate warm-up: the rate grows linearly from `lr / N` at
    /// global step 0 to `lr` at global step `N - 1` (0: none).
    pub warmup_steps: u64,
    /// DC-ASGD's λ0 (default 8, chosen by measurement: docs/TRAIN.md,
    /// "Many workers").
    #[serde(default = "default_dc_lambda")]
    pub dc_lambda: f32,
    /// DC-ASGD's moving-average decay `m` (default 0.95).
    #[serde(default = "default_dc_momentum")]
    pub dc_momentum: f32,
    /// How a push's rate depends on its staleness (default none).
    #[serde(default)]
    pub staleness_lr: StalenessLr,
}

fn default_dc_lambda() -> f32 {
    8.0
}

fn default_dc_momentum() -> f32 {
    0.95
}

impl OptimizerConfig {
    /// Plain SGD.
    pub fn sgd(lr: f32) -> Self {
        Self::with_kind(OptimizerKind::Sgd, lr)
    }
    /// Adagrad with initial accumulator 0.1.
    pub fn adagrad(lr: f32) -> Self {
        Self::with_kind(OptimizerKind::Adagrad, lr)
    }
    /// Adam with beta1 0.9, beta2 0.999, epsilon 1e-8.
    pub fn adam(lr: f32) -> Self {
        Self::with_kind(OptimizerKind::Adam, lr)
    }
    /// `kind` with the default hyper-parameters.
    pub fn with_kind(kind: OptimizerKind, lr: f32) -> Self {
        Self {
            kind,
            lr,
            initial_accumulator: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            ftrl_beta: 0.0,
            l1: 0.0,
            l2: 0.0,
            decay_step: 100_000,
            decay_rate: 0.9,
            warmup_steps: 0,
            dc_lambda: default_dc_lambda(),
            dc_momentum: default_dc_momentum(),
            staleness_lr: StalenessLr::None,
        }
    }

    /// Checks every hyper-parameter, whichever kind reads it, so that no
    /// update can produce NaN or an infinity from the configuration alone
    /// (an `initial_accumulator` of 0, for one, makes Adagrad's first zero
    /// gradient compute 0 / 0). The first field out of range is the error:
    ///
    /// | field | range |
    /// |---|---|
    /// | `lr` | finite, above 0 |
    /// | `initial_accumulator` | finite, above 0 |
    /// | `beta1`, `beta2` | in [0, 1) |
    /// | `epsilon` | finite, above 0 |
    /// | `ftrl_beta`, `l1`, `l2`, `dc_lambda` | finite, 0 or more |
    /// | `decay_step` | 1 or more |
    /// | `decay_rate` | in (0, 1] |
    /// | `dc_momentum` | in [0, 1) |
    ///
    /// [`crate::PsShard::try_new`] calls it; [`crate::PsShard::new`] does
    /// not.
    pub fn validate(&self) -> Result<(), OptimizerConfigError> {
        let bad = |field: &'static str, value: f32, expected: &'static str| {
            Err(OptimizerConfigError {
                field,
                value,
                expected,
            })
        };
        let positive = |v: f32| v.is_finite() && v > 0.0;
        let non_negative = |v: f32| v.is_finite() && v >= 0.0;
        // `contains` is false for NaN, and the ranges are bounded.
        let below_one = |v: f32| (0.0..1.0).contains(&v);
        for (field, v) in [
            ("lr", self.lr),
            ("initial_accumulator", self.initial_accumulator),
            ("epsilon", self.epsilon),
        ] {
            if !positive(v) {
                return bad(field, v, "a finite number above 0");
            }
        }
        for (field, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !below_one(v) {
                return bad(field, v, "in [0, 1)");
            }
        }
        for (field, v) in [
            ("ftrl_beta", self.ftrl_beta),
            ("l1", self.l1),
            ("l2", self.l2),
            ("dc_lambda", self.dc_lambda),
        ] {
            if !non_negative(v) {
                return bad(field, v, "a finite number, 0 or more");
            }
        }
        if self.decay_step == 0 {
            return bad("decay_step", 0.0, "1 or more");
        }
        if !(positive(self.decay_rate) && self.decay_rate <= 1.0) {
            return bad("decay_rate", self.decay_rate, "in (0, 1]");
        }
        if !below_one(self.dc_momentum) {
            return bad("dc_momentum", self.dc_momentum, "in [0, 1)");
        }
        Ok(())
    }

    /// True when the shard keeps what each worker pulled for this rule:
    /// the update counts (a staleness-aware rate) and the values
    /// (DC-ASGD).
    pub fn tracks_pulls(&self) -> bool {
        self.kind.needs_pulled_values() || self.staleness_lr != StalenessLr::None
    }

    /// The learning rate at `global_step`, after the warm-up.
    #[inline]
    pub fn lr_at(&self, global_step: u64) -> f32 {
        if global_step < self.warmup_steps {
            (f64::from(self.lr) * (global_step + 1) as f64 / self.warmup_steps as f64) as f32
        } else {
            self.lr
        }
    }

    /// Number of slot vectors (each as wide as the variable or row).
    pub fn slots(&self) -> usize {
        self.kind.slots()
    }

    /// Initial slot values; `slots.len()` is `self.slots() * width`.
    pub fn init_slots(&self, slots: &mut [f32]) {
        match self.kind {
            OptimizerKind::Adagrad => slots.fill(self.initial_accumulator),
            OptimizerKind::Sgd | OptimizerKind::Adam => slots.fill(0.0),
            OptimizerKind::Ftrl | OptimizerKind::AdagradDecay | OptimizerKind::DcAsgd => {
                // [acc.., z.. or decay count..]
                let (acc, second) = slots.split_at_mut(slots.len() / 2);
                acc.fill(self.initial_accumulator);
                second.fill(0.0);
            }
        }
    }

    /// Apply gradient `g` to `w` with `slots` (`[m.. , v..]` for Adam,
    /// `[acc..]` for Adagrad, `[n.., z..]` for FTRL, `[acc.., decays..]` for
    /// AdagradDecay, `[acc.., ms..]` for DC-ASGD); `t` is the step count
    /// including this update (>= 1), used by Adam's bias correction, and
    /// `global_step` the shard's global step, which schedules
    /// AdagradDecay's decay. DC-ASGD without the pulled values (see
    /// [`Self::apply_stale`]) compensates nothing.
    #[inline]
    pub fn apply(&self, w: &mut [f32], slots: &mut [f32], g: &[f32], t: u64, global_step: u64) {
        self.apply_stale(w, slots, g, t, global_step, Pulled::default());
    }

    /// [`Self::apply`] for a gradient computed on older values: `pulled`
    /// says how stale it is and, for DC-ASGD, what it was computed on.
    pub fn apply_stale(
        &self,
        w: &mut [f32],
        slots: &mut [f32],
        g: &[f32],
        t: u64,
        global_step: u64,
        pulled: Pulled<'_>,
    ) {
        // One branch per call (per row); the loops below run over slices
        // re-sliced to one length, so they have no bounds checks and no
        // branches and the compiler vectorises them.
        let n = w.len();
        debug_assert_eq!(g.len(), n);
        debug_assert_eq!(slots.len(), self.slots() * n);
        let g = &g[..n];
        let mut lr = self.lr_at(global_step);
        if let Some(tau) = pulled.staleness {
            lr *= self.staleness_lr.factor(tau);
        }
        match self.kind {
            OptimizerKind::Sgd => {
                for (w, g) in w.iter_mut().zip(g) {
                    *w -= lr * g;
                }
            }
            OptimizerKind::Adagrad => {
                let acc = &mut slots[..n];
                for ((w, a), g) in w.iter_mut().zip(acc.iter_mut()).zip(g) {
                    *a += g * g;
                    *w -= lr * g / a.sqrt();
                }
            }
            OptimizerKind::Adam => {
                let (m, v) = slots.split_at_mut(n);
                let v = &mut v[..n];
                let (b1, b2) = (f64::from(self.beta1), f64::from(self.beta2));
                let t = t.clamp(1, i32::MAX as u64) as i32;
                let lr_t = (f64::from(lr) * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t))) as f32;
                let (b1, b2, eps) = (self.beta1, self.beta2, self.epsilon);
                let (c1, c2) = (1.0 - b1, 1.0 - b2);
                for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                    *m = b1 * *m + c1 * g;
                    *v = b2 * *v + c2 * g * g;
                    *w -= lr_t * *m / (v.sqrt() + eps);
                }
            }
            // FTRL's weight is a function of its slots, not a step from
            // the last weight: a smaller alpha for one push would shrink the
            // row's whole weight for that push. The warm-up and staleness
            // factors scale the push's gradient instead, with alpha the
            // base rate.
            OptimizerKind::Ftrl => ftrl::Ftrl {
                alpha: self.lr,
                beta: self.ftrl_beta,
                l1: self.l1,
                l2: self.l2,
                scale: if self.lr > 0.0 { lr / self.lr } else { 1.0 },
            }
            .apply(w, slots, g),
            OptimizerKind::AdagradDecay => adagrad_decay::AdagradDecay {
                lr,
                decay_step: self.decay_step,
                decay_rate: self.decay_rate,
                baseline: self.initial_accumulator,
            }
            .apply(w, slots, g, global_step),
            OptimizerKind::DcAsgd => dc_asgd::DcAsgd {
                lr,
                lambda: self.dc_lambda,
                momentum: self.dc_momentum,
            }
            .apply(w, slots, g, pulled.values),
        }
    }
}

/// A hyper-parameter of an [`OptimizerConfig`] out of its range
/// ([`OptimizerConfig::validate`]).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("optimizer {field} must be {expected}, got {value}")]
pub struct OptimizerConfigError {
    /// The field of [`OptimizerConfig`] (`"lr"`, `"beta1"`, ...).
    pub field: &'static str,
    /// Its value (`decay_step`, an integer, is refused only at 0).
    pub value: f32,
    /// The range it must be in.
    pub expected: &'static str,
}

/// What the shard knows of the pull a gradient was computed on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pulled<'a> {
    /// Updates the row or variable received since that pull, if known.
    pub staleness: Option<u64>,
    /// Its values then, if kept (as wide as the row or variable).
    pub values: Option<&'a [f32]>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stale push on FTRL moves a row by its (scaled) gradient, not by
    /// rescaling the row's weight: after 20 fresh pushes, a tiny stale one
    /// barely moves the weight (scaling alpha made it 0.187 from 0.749).
    #[test]
    fn a_stale_ftrl_push_scales_its_gradient_not_the_weight() {
        let mut o = OptimizerConfig::with_kind(OptimizerKind::Ftrl, 0.1);
        o.staleness_lr = StalenessLr::Linear;
        o.l1 = 0.0;
        o.l2 = 0.0;
        o.ftrl_beta = 0.0;
        let mut w = [0.0f32];
        let mut slots = [0.0f32; 2];
        o.init_slots(&mut slots);
        for t in 1..=20 {
            o.apply(&mut w, &mut slots, &[-1.0], t, t);
        }
        let before = w[0];
        assert!(before > 0.5, "{before}");
        let pulled = Pulled {
            staleness: Some(4),
            values: None,
        };
        o.apply_stale(&mut w, &mut slots, &[1e-3], 21, 21, pulled);
        assert!(
            (w[0] - before).abs() < 0.01 * before,
            "{before} -> {}",
            w[0]
        );
    }

    #[test]
    fn sgd_step() {
        let o = OptimizerConfig::sgd(0.5);
        let mut w = [1.0, 2.0];
        o.apply(&mut w, &mut [], &[2.0, -2.0], 1, 1);
        assert_eq!(w, [0.0, 3.0]);
    }

    #[test]
    fn adagrad_step() {
        let o = OptimizerConfig::adagrad(0.1);
        let mut w = [1.0f32];
        let mut s = [0.0f32];
        o.init_slots(&mut s);
        assert_eq!(s, [0.1]);
        o.apply(&mut w, &mut s, &[1.0], 1, 1);
        assert!((s[0] - 1.1).abs() < 1e-6);
        assert!((w[0] - (1.0 - 0.1 / 1.1f32.sqrt())).abs() < 1e-6);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        // With bias correction the first Adam step is lr * sign(g).
        let o = OptimizerConfig::adam(0.01);
        let mut w = [0.0f32, 0.0];
        let mut s = [0.0f32; 4];
        o.apply(&mut w, &mut s, &[3.0, -0.2], 1, 1);
        assert!((w[0] + 0.01).abs() < 1e-5, "{w:?}");
        assert!((w[1] - 0.01).abs() < 1e-5, "{w:?}");
        assert!((s[0] - 0.3).abs() < 1e-6);
    }

    #[test]
    fn new_kinds_have_two_slots_initialised_per_half() {
        for kind in [
            OptimizerKind::Ftrl,
            OptimizerKind::AdagradDecay,
            OptimizerKind::DcAsgd,
        ] {
            let o = OptimizerConfig::with_kind(kind, 0.1);
            assert_eq!(o.slots(), 2);
            let mut s = [9.0f32; 6];
            o.init_slots(&mut s);
            assert_eq!(s, [0.1, 0.1, 0.1, 0.0, 0.0, 0.0]);
            let mut w = [0.0f32; 3];
            o.apply(&mut w, &mut s, &[1.0, 0.0, -1.0], 1, 1);
            assert!(w[0] < 0.0 && w[1] == 0.0 && w[2] > 0.0, "{kind:?}: {w:?}");
        }
    }

    #[test]
    fn warmup_ramps_the_rate_linearly() {
        let o = OptimizerConfig {
            warmup_steps: 4,
            ..OptimizerConfig::sgd(1.0)
        };
        assert_eq!(
            [0, 1, 2, 3, 4, 100].map(|s| o.lr_at(s)),
            [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
        );
        let mut w = [0.0f32];
        o.apply(&mut w, &mut [], &[1.0], 1, 0);
        assert_eq!(w, [-0.25]);
        assert_eq!(OptimizerConfig::sgd(0.5).lr_at(0), 0.5);
    }

    #[test]
    fn staleness_divides_the_rate_of_a_stale_update() {
        let o = OptimizerConfig {
            staleness_lr: StalenessLr::Linear,
            ..OptimizerConfig::sgd(1.0)
        };
        let stale = |tau| Pulled {
            staleness: Some(tau),
            values: None,
        };
        let mut w = [0.0f32];
        o.apply_stale(&mut w, &mut [], &[1.0], 1, 0, stale(4));
        assert_eq!(w, [-0.25]);
        // 0 and 1 take the full rate, as does an update of unknown staleness.
        o.apply_stale(&mut w, &mut [], &[1.0], 1, 0, stale(0));
        o.apply(&mut w, &mut [], &[1.0], 1, 0);
        assert_eq!(w, [-2.25]);
        assert_eq!(StalenessLr::Sqrt.factor(16), 0.25);
        assert_eq!(StalenessLr::None.factor(16), 1.0);
        assert!(o.tracks_pulls() && !OptimizerConfig::sgd(1.0).tracks_pulls());
    }

    #[test]
    fn dc_asgd_compensates_with_the_pulled_values() {
        let o = OptimizerConfig::with_kind(OptimizerKind::DcAsgd, 0.5);
        assert!(o.tracks_pulls());
        let (mut a, mut b) = ([1.0f32], [1.0f32]);
        let (mut sa, mut sb) = ([0.0f32; 2], [0.0f32; 2]);
        o.init_slots(&mut sa);
        o.init_slots(&mut sb);
        o.apply(&mut a, &mut sa, &[1.0], 1, 0);
        let pulled = Pulled {
            staleness: Some(3),
            values: Some(&[0.0]),
        };
        o.apply_stale(&mut b, &mut sb, &[1.0], 1, 0, pulled);
        assert!(b[0] < a[0], "{b:?} {a:?}");
        assert_eq!(sa[1], sb[1], "the same moving average of g²");
    }

    /// The configuration `validate` exists for: Adagrad from an
    /// accumulator of 0 turns a zero gradient into a NaN weight.
    #[test]
    fn a_zero_initial_accumulator_is_refused_before_it_makes_nan() {
        let o = OptimizerConfig {
            initial_accumulator: 0.0,
            ..OptimizerConfig::adagrad(0.1)
        };
        let mut w = [1.0f32];
        let mut s = [0.0f32];
        o.init_slots(&mut s);
        o.apply(&mut w, &mut s, &[0.0], 1, 1);
        assert!(w[0].is_nan(), "{w:?}");
        let e = o.validate().unwrap_err();
        assert_eq!((e.field, e.value), ("initial_accumulator", 0.0));
        assert_eq!(
            e.to_string(),
            "optimizer initial_accumulator must be a finite number above 0, got 0"
        );
    }

    /// The field `validate` names for `o` changed by `set`.
    fn refused(set: impl FnOnce(&mut OptimizerConfig)) -> &'static str {
        let mut o = OptimizerConfig::adagrad(0.1);
        set(&mut o);
        match o.validate() {
            Err(e) => e.field,
            Ok(()) => panic!("accepted {o:?}"),
        }
    }

    #[test]
    fn every_kind_validates_with_its_defaults_and_the_edges_of_the_ranges() {
        for (_, kind) in OptimizerKind::ALL {
            assert_eq!(OptimizerConfig::with_kind(kind, 0.05).validate(), Ok(()));
        }
        let edges = OptimizerConfig {
            beta1: 0.0,
            beta2: 0.0,
            ftrl_beta: 0.0,
            l1: 0.0,
            l2: 0.0,
            dc_lambda: 0.0,
            dc_momentum: 0.0,
            decay_step: 1,
            decay_rate: 1.0,
            ..OptimizerConfig::with_kind(OptimizerKind::Ftrl, f32::MIN_POSITIVE)
        };
        assert_eq!(edges.validate(), Ok(()));
    }

    #[test]
    fn a_rate_that_is_not_a_positive_number_is_refused() {
        for lr in [0.0, -0.1, f32::NAN, f32::INFINITY] {
            assert_eq!(refused(|o| o.lr = lr), "lr", "{lr}");
        }
        let e = OptimizerConfig::sgd(-0.5).validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "optimizer lr must be a finite number above 0, got -0.5"
        );
    }

    #[test]
    fn adam_betas_outside_zero_to_one_and_a_non_positive_epsilon_are_refused() {
        for b in [1.0, 1.5, -0.1, f32::NAN] {
            assert_eq!(refused(|o| o.beta1 = b), "beta1", "{b}");
            assert_eq!(refused(|o| o.beta2 = b), "beta2", "{b}");
        }
        for eps in [0.0, -1e-8, f32::NAN] {
            assert_eq!(refused(|o| o.epsilon = eps), "epsilon", "{eps}");
        }
    }

    #[test]
    fn a_negative_or_non_finite_ftrl_or_dc_asgd_strength_is_refused() {
        for v in [-0.1, f32::NAN, f32::NEG_INFINITY, f32::INFINITY] {
            assert_eq!(refused(|o| o.ftrl_beta = v), "ftrl_beta", "{v}");
            assert_eq!(refused(|o| o.l1 = v), "l1", "{v}");
            assert_eq!(refused(|o| o.l2 = v), "l2", "{v}");
            assert_eq!(refused(|o| o.dc_lambda = v), "dc_lambda", "{v}");
        }
    }

    #[test]
    fn adagrad_decay_and_dc_asgd_decays_out_of_range_are_refused() {
        assert_eq!(refused(|o| o.decay_step = 0), "decay_step");
        for r in [0.0, -0.5, 1.01, f32::NAN] {
            assert_eq!(refused(|o| o.decay_rate = r), "decay_rate", "{r}");
        }
        for m in [1.0, -0.01, f32::NAN] {
            assert_eq!(refused(|o| o.dc_momentum = m), "dc_momentum", "{m}");
        }
    }

    #[test]
    fn names_round_trip() {
        for (name, kind) in OptimizerKind::ALL {
            assert_eq!(OptimizerKind::from_name(name), Some(kind));
        }
        assert_eq!(OptimizerKind::from_name("lamb"), None);
    }
}

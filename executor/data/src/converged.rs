//! The converged reference: L2-regularised logistic regression fitted to
//! the optimum with L-BFGS, its L2 strength chosen on a validation split.
//!
//! The model is the one [`crate::reference::ReferenceLr`] trains by
//! stochastic steps (`sigmoid(b + sum_j v_j x_j + sum_k w_k)`, one weight per
//! present key, 13 numeric weights and a bias), but here the objective
//!
//! ```text
//! f(w) = mean_i logloss(y_i, sigmoid(z_i)) + l2 / 2 * |w without b|^2
//! ```
//!
//! is minimised over all examples held in memory, so the result does not
//! depend on a learning rate or on how many passes were made, only on `l2`.
//! It is the figure a distributed run is measured against on data with no
//! known true model.
//!
//! L-BFGS (Nocedal and Wright, *Numerical Optimization*, algorithm 7.4, the
//! two-loop recursion) with a backtracking Armijo line search. The initial
//! inverse Hessian is `gamma D`, `D` the inverse of a diagonal bound of the
//! Hessian and `gamma = s'y / y'Dy` (Oren-Luenberger scaling), so the
//! bias, the numeric weights and rare keys, whose curvatures differ by
//! orders of magnitude, are stepped alike. One pass is one
//! evaluation of `f` and its gradient over the examples; the fit is
//! converged when the gradient's Euclidean norm is at most
//! [`ConvergedOptions::tolerance`].
//!
//! Choosing `l2`: every [`VALIDATION_EVERY`]th example is held out; for each
//! strength of [`ConvergedOptions::l2_grid`], from the largest down (each fit
//! starts from the previous one's weights), the model is fitted on the rest
//! and scored by AUC on the held-out examples, stopping after two strengths
//! in a row score below the best; the best strength (the larger one on a
//! tie) is then refitted on every example.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::batch::{Batch, NUM_CATEGORICAL, NUM_NUMERIC};
use crate::hash::MISSING_KEY;
use crate::metrics::auc;

/// One example in `VALIDATION_EVERY` (those with `i % VALIDATION_EVERY ==
/// VALIDATION_EVERY - 1`) is held out to choose the L2 strength.
pub const VALIDATION_EVERY: usize = 10;
/// Bias and numeric weights come first in the parameter vector.
const DENSE: usize = 1 + NUM_NUMERIC;
/// A missing key in the design matrix.
const NONE: u32 = u32::MAX;

/// Settings of a converged fit.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvergedOptions {
    /// L2 strengths to choose from on the validation split; one value fits
    /// with it directly (no split).
    pub l2_grid: Vec<f64>,
    /// Most passes (objective and gradient evaluations) per fit.
    pub max_passes: u32,
    /// Converged when the gradient's Euclidean norm is at most this.
    pub tolerance: f64,
    /// Pairs of L-BFGS history.
    pub memory: usize,
}

impl Default for ConvergedOptions {
    fn default() -> Self {
        Self {
            l2_grid: vec![1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6],
            max_passes: 400,
            tolerance: 1e-5,
            memory: 6,
        }
    }
}

/// How one fit ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitStatus {
    /// The L2 strength.
    pub l2: f64,
    /// The gradient norm reached the tolerance.
    pub converged: bool,
    /// Objective and gradient evaluations.
    pub passes: u32,
    /// Euclidean norm of the final gradient.
    pub grad_norm: f64,
    /// The final objective.
    pub objective: f64,
}

/// The outcome of [`ConvergedLr::fit`].
#[derive(Debug, Clone, PartialEq)]
pub struct ConvergedReport {
    /// The final fit on every example, with the chosen strength.
    pub fit: FitStatus,
    /// Per strength tried: the validation fit and its validation AUC
    /// (empty when the grid had one value).
    pub validation: Vec<(FitStatus, f64)>,
    /// Passes of every fit together.
    pub total_passes: u32,
}

/// Errors of a converged fit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConvergedError {
    /// No example to fit.
    #[error("no training examples")]
    Empty,
    /// More distinct keys than the design matrix indexes.
    #[error("more than {} distinct keys", u32::MAX - 1)]
    TooManyKeys,
    /// The grid is empty or holds a negative or non-finite strength.
    #[error("invalid L2 grid: {0:?}")]
    Grid(Vec<f64>),
    /// The validation split has only one class, so it cannot rank models.
    #[error("the validation split needs positive and negative examples")]
    OneClassValidation,
}

/// The examples as a sparse design matrix.
struct Design {
    labels: Vec<f32>,
    numeric: Vec<f32>,
    /// Per example, the parameter index (minus [`DENSE`]) of each key, or
    /// [`NONE`].
    keys: Vec<u32>,
    key_ids: Vec<u64>,
}

impl Design {
    fn new(examples: &Batch) -> Result<Self, ConvergedError> {
        let mut index: FxHashMap<u64, u32> = FxHashMap::default();
        let mut key_ids = Vec::new();
        let mut keys = Vec::with_capacity(examples.keys.len());
        for &k in &examples.keys {
            if k == MISSING_KEY {
                keys.push(NONE);
                continue;
            }
            let next = u32::try_from(key_ids.len())
                .ok()
                .filter(|&n| n != NONE)
                .ok_or(ConvergedError::TooManyKeys)?;
            let id = *index.entry(k).or_insert_with(|| {
                key_ids.push(k);
                next
            });
            keys.push(id);
        }
        Ok(Self {
            labels: examples.labels.clone(),
            numeric: examples.numeric.clone(),
            keys,
            key_ids,
        })
    }

    fn params(&self) -> usize {
        DENSE + self.key_ids.len()
    }

    fn logit(&self, w: &[f64], i: usize) -> f64 {
        let mut z = w[0];
        let num = &self.numeric[i * NUM_NUMERIC..(i + 1) * NUM_NUMERIC];
        for (wj, &x) in w[1..DENSE].iter().zip(num) {
            z += wj * f64::from(x);
        }
        for &k in &self.keys[i * NUM_CATEGORICAL..(i + 1) * NUM_CATEGORICAL] {
            if k != NONE {
                z += w[DENSE + k as usize];
            }
        }
        z
    }

    /// The diagonal of an upper bound of the objective's Hessian
    /// (`sigmoid' <= 1/4`): the initial inverse Hessian of L-BFGS is its
    /// inverse, which evens out the scales of the bias, the numeric
    /// weights (features up to ~15) and the keys (a rare key's curvature is
    /// about `l2`).
    fn hessian_bound(&self, l2: f64, use_row: impl Fn(usize) -> bool) -> Vec<f64> {
        let mut h = vec![0.0; self.params()];
        let mut n = 0usize;
        for i in (0..self.labels.len()).filter(|&i| use_row(i)) {
            n += 1;
            h[0] += 1.0;
            let num = &self.numeric[i * NUM_NUMERIC..(i + 1) * NUM_NUMERIC];
            for (hj, &x) in h[1..DENSE].iter_mut().zip(num) {
                *hj += f64::from(x) * f64::from(x);
            }
            for &k in &self.keys[i * NUM_CATEGORICAL..(i + 1) * NUM_CATEGORICAL] {
                if k != NONE {
                    h[DENSE + k as usize] += 1.0;
                }
            }
        }
        let scale = 0.25 / n.max(1) as f64;
        // The bias is not regularised; a floor keeps an unused weight's
        // entry positive when l2 is 0.
        h[0] = (h[0] * scale).max(1e-12);
        for hj in &mut h[1..] {
            *hj = (*hj * scale + l2).max(1e-12);
        }
        h
    }

    /// `f(w)` over the examples `use_row` accepts, and its gradient into `g`.
    fn objective(&self, w: &[f64], l2: f64, use_row: impl Fn(usize) -> bool, g: &mut [f64]) -> f64 {
        g.fill(0.0);
        let mut loss = 0.0;
        let mut n = 0usize;
        for i in (0..self.labels.len()).filter(|&i| use_row(i)) {
            n += 1;
            let z = self.logit(w, i);
            let y = f64::from(self.labels[i] > 0.5);
            // log(1 + e^z) - y z, computed without overflow.
            loss += z.max(0.0) + (-z.abs()).exp().ln_1p() - y * z;
            let d = sigmoid(z) - y;
            g[0] += d;
            let num = &self.numeric[i * NUM_NUMERIC..(i + 1) * NUM_NUMERIC];
            for (gj, &x) in g[1..DENSE].iter_mut().zip(num) {
                *gj += d * f64::from(x);
            }
            for &k in &self.keys[i * NUM_CATEGORICAL..(i + 1) * NUM_CATEGORICAL] {
                if k != NONE {
                    g[DENSE + k as usize] += d;
                }
            }
        }
        let inv = 1.0 / n.max(1) as f64;
        let mut reg = 0.0;
        g[0] *= inv;
        for (gj, &wj) in g[1..].iter_mut().zip(&w[1..]) {
            *gj = *gj * inv + l2 * wj;
            reg += wj * wj;
        }
        loss * inv + 0.5 * l2 * reg
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Minimise [`Design::objective`] from `w` (updated in place).
fn lbfgs(
    d: &Design,
    l2: f64,
    use_row: impl Fn(usize) -> bool + Copy,
    w: &mut [f64],
    opts: &ConvergedOptions,
) -> FitStatus {
    let n = w.len();
    let mut g = vec![0.0; n];
    let mut f = d.objective(w, l2, use_row, &mut g);
    let mut passes = 1u32;
    // (s, y, 1 / s'y), newest last.
    let mut hist: VecDeque<(Vec<f64>, Vec<f64>, f64)> = VecDeque::new();
    let mut dir = vec![0.0; n];
    let mut w_new = vec![0.0; n];
    let mut g_new = vec![0.0; n];
    let mut alpha = vec![0.0; opts.memory.max(1)];
    let diag = d.hessian_bound(l2, use_row);
    let status = |f, g: &[f64], passes, converged| FitStatus {
        l2,
        converged,
        passes,
        grad_norm: dot(g, g).sqrt(),
        objective: f,
    };
    loop {
        let gnorm = dot(&g, &g).sqrt();
        if gnorm <= opts.tolerance {
            return status(f, &g, passes, true);
        }
        if passes >= opts.max_passes {
            return status(f, &g, passes, false);
        }
        // Two-loop recursion: dir = -H g.
        for (x, gi) in dir.iter_mut().zip(&g) {
            *x = -gi;
        }
        for (j, (s, y, rho)) in hist.iter().enumerate().rev() {
            alpha[j] = rho * dot(s, &dir);
            for (x, yi) in dir.iter_mut().zip(y) {
                *x -= alpha[j] * yi;
            }
        }
        let gamma = match hist.back() {
            Some((s, y, _)) => dot(s, y) / y.iter().zip(&diag).map(|(v, h)| v * v / h).sum::<f64>(),
            None => 1.0,
        };
        for (x, h) in dir.iter_mut().zip(&diag) {
            *x *= gamma / h;
        }
        for (j, (s, y, rho)) in hist.iter().enumerate() {
            let beta = rho * dot(y, &dir);
            for (x, si) in dir.iter_mut().zip(s) {
                *x += (alpha[j] - beta) * si;
            }
        }
        let mut slope = dot(&dir, &g);
        if slope >= 0.0 {
            // Not a descent direction (curvature pairs gone stale): restart
            // from steepest descent.
            hist.clear();
            for (x, gi) in dir.iter_mut().zip(&g) {
                *x = -gi / gnorm;
            }
            slope = -gnorm;
        }
        let mut step = 1.0;
        let f_new = loop {
            for ((wn, wi), di) in w_new.iter_mut().zip(w.iter()).zip(&dir) {
                *wn = wi + step * di;
            }
            let fv = d.objective(&w_new, l2, use_row, &mut g_new);
            passes += 1;
            if fv.is_finite() && fv <= f + 1e-4 * step * slope {
                break Some(fv);
            }
            step *= 0.5;
            if passes >= opts.max_passes || step < 1e-20 {
                break None;
            }
        };
        let Some(f_new) = f_new else {
            return status(f, &g, passes, false);
        };
        let (mut s, mut y) = match hist.len() >= opts.memory.max(1) {
            true => {
                let (s, y, _) = hist.pop_front().expect("history is full");
                (s, y)
            }
            false => (vec![0.0; n], vec![0.0; n]),
        };
        for i in 0..n {
            s[i] = w_new[i] - w[i];
            y[i] = g_new[i] - g[i];
        }
        let sy = dot(&s, &y);
        if sy > 1e-16 {
            hist.push_back((s, y, 1.0 / sy));
        }
        w.copy_from_slice(&w_new);
        std::mem::swap(&mut g, &mut g_new);
        f = f_new;
    }
}

/// A logistic regression fitted to convergence (see the module docs).
#[derive(Debug, Clone)]
pub struct ConvergedLr {
    bias: f64,
    numeric: [f64; NUM_NUMERIC],
    keys: FxHashMap<u64, f64>,
}

impl ConvergedLr {
    /// Fit on `examples`, choosing the L2 strength as `opts` says.
    pub fn fit(
        examples: &Batch,
        opts: &ConvergedOptions,
    ) -> Result<(Self, ConvergedReport), ConvergedError> {
        if examples.len == 0 {
            return Err(ConvergedError::Empty);
        }
        let grid = &opts.l2_grid;
        if grid.is_empty() || grid.iter().any(|l| !l.is_finite() || *l < 0.0) {
            return Err(ConvergedError::Grid(grid.clone()));
        }
        let d = Design::new(examples)?;
        let mut w = vec![0.0; d.params()];
        let mut validation = Vec::new();
        let mut total_passes = 0;
        let l2 = if let [l2] = grid[..] {
            l2
        } else {
            let held = |i: usize| i % VALIDATION_EVERY == VALIDATION_EVERY - 1;
            let rows: Vec<usize> = (0..examples.len).filter(|&i| held(i)).collect();
            let labels: Vec<f32> = rows.iter().map(|&i| d.labels[i]).collect();
            let mut sorted = grid.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let mut best: Option<(f64, f64, Vec<f64>)> = None;
            let mut worse = 0;
            for l2 in sorted {
                let st = lbfgs(&d, l2, |i| !held(i), &mut w, opts);
                total_passes += st.passes;
                let probs: Vec<f32> = rows
                    .iter()
                    .map(|&i| sigmoid(d.logit(&w, i)) as f32)
                    .collect();
                let a = auc(&labels, &probs);
                if a.is_nan() {
                    return Err(ConvergedError::OneClassValidation);
                }
                validation.push((st, a));
                if best.as_ref().map_or(true, |(_, b, _)| a > *b) {
                    best = Some((l2, a, w.clone()));
                    worse = 0;
                } else {
                    worse += 1;
                    if worse == 2 {
                        break;
                    }
                }
            }
            let (l2, _, wb) = best.expect("the grid is not empty");
            w = wb;
            l2
        };
        let fit = lbfgs(&d, l2, |_| true, &mut w, opts);
        total_passes += fit.passes;
        let keys = d
            .key_ids
            .iter()
            .zip(&w[DENSE..])
            .map(|(&k, &v)| (k, v))
            .collect();
        let mut numeric = [0.0; NUM_NUMERIC];
        numeric.copy_from_slice(&w[1..DENSE]);
        Ok((
            Self {
                bias: w[0],
                numeric,
                keys,
            },
            ConvergedReport {
                fit,
                validation,
                total_passes,
            },
        ))
    }

    /// The weight of `key` (0 if never seen).
    pub fn key_weight(&self, key: u64) -> f64 {
        self.keys.get(&key).copied().unwrap_or(0.0)
    }

    /// The predicted click probability of example `i` of `batch`.
    ///
    /// # Panics
    /// If `i >= batch.len`.
    pub fn predict(&self, batch: &Batch, i: usize) -> f32 {
        let mut z = self.bias;
        for (wj, &x) in self.numeric.iter().zip(batch.numeric_row(i)) {
            z += wj * f64::from(x);
        }
        for &k in batch.key_row(i) {
            if k != MISSING_KEY {
                z += self.key_weight(k);
            }
        }
        sigmoid(z) as f32
    }

    /// Predictions for every example of `batch`, into `out` (cleared first).
    pub fn predict_batch(&self, batch: &Batch, out: &mut Vec<f32>) {
        out.clear();
        out.extend((0..batch.len).map(|i| self.predict(batch, i)));
    }
}

#[inline]
fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{Synthetic, SyntheticSpec};

    fn data(n: u64) -> (Synthetic, Batch) {
        let spec = SyntheticSpec {
            examples_per_epoch: n,
            ..Default::default()
        };
        let mut train = Synthetic::train(spec).unwrap();
        let all = train.collect_epoch();
        (train, all)
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (_, b) = data(300);
        let d = Design::new(&b).unwrap();
        let mut w: Vec<f64> = (0..d.params())
            .map(|i| ((i * 37 % 11) as f64 - 5.0) * 0.03)
            .collect();
        let mut g = vec![0.0; w.len()];
        let l2 = 0.01;
        d.objective(&w, l2, |_| true, &mut g);
        let mut scratch = vec![0.0; w.len()];
        for j in [0, 1, 5, DENSE, DENSE + 7, d.params() - 1] {
            let h = 1e-6;
            w[j] += h;
            let up = d.objective(&w, l2, |_| true, &mut scratch);
            w[j] -= 2.0 * h;
            let down = d.objective(&w, l2, |_| true, &mut scratch);
            w[j] += h;
            let fd = (up - down) / (2.0 * h);
            assert!((fd - g[j]).abs() < 1e-6, "param {j}: {fd} vs {}", g[j]);
        }
    }

    #[test]
    fn converges_and_beats_the_stochastic_reference_objective() {
        let (train, b) = data(20_000);
        let opts = ConvergedOptions {
            l2_grid: vec![1e-3],
            ..Default::default()
        };
        let (m, rep) = ConvergedLr::fit(&b, &opts).unwrap();
        assert!(rep.fit.converged, "{rep:?}");
        assert!(rep.fit.grad_norm <= opts.tolerance);
        assert!(rep.validation.is_empty());
        // At the optimum the gradient vanishes: the mean prediction equals
        // the click rate (the bias is not regularised).
        let mut p = Vec::new();
        m.predict_batch(&b, &mut p);
        let mean_p: f64 = p.iter().map(|&x| f64::from(x)).sum::<f64>() / p.len() as f64;
        let ctr: f64 = b.labels.iter().map(|&y| f64::from(y)).sum::<f64>() / b.len as f64;
        assert!((mean_p - ctr).abs() < 1e-3, "{mean_p} vs {ctr}");
        let eval = train.eval_stream(5_000).collect_epoch();
        m.predict_batch(&eval, &mut p);
        let got = auc(&eval.labels, &p);
        let oracle = train.model().oracle_auc(&eval);
        assert!(got > oracle - 0.05, "{got} vs oracle {oracle}");
    }

    #[test]
    fn grid_is_searched_on_the_validation_split() {
        let (_, b) = data(5_000);
        let opts = ConvergedOptions {
            l2_grid: vec![1e-4, 1.0],
            max_passes: 100,
            ..Default::default()
        };
        let (_, rep) = ConvergedLr::fit(&b, &opts).unwrap();
        assert_eq!(rep.validation.len(), 2);
        // Largest first; a strength of 1 flattens the keys' weights.
        assert_eq!(rep.validation[0].0.l2, 1.0);
        assert_eq!(rep.fit.l2, 1e-4, "{rep:?}");
        assert!(rep.total_passes >= rep.fit.passes + rep.validation[0].0.passes);
    }

    #[test]
    fn bad_input_is_an_error() {
        let opts = ConvergedOptions::default();
        assert_eq!(
            ConvergedLr::fit(&Batch::default(), &opts).unwrap_err(),
            ConvergedError::Empty
        );
        let (_, b) = data(100);
        let bad = ConvergedOptions {
            l2_grid: vec![-1.0],
            ..Default::default()
        };
        assert!(matches!(
            ConvergedLr::fit(&b, &bad),
            Err(ConvergedError::Grid(_))
        ));
        let mut one_class = b.clone();
        one_class.labels.fill(1.0);
        assert_eq!(
            ConvergedLr::fit(&one_class, &opts).unwrap_err(),
            ConvergedError::OneClassValidation
        );
    }

    #[test]
    fn tight_pass_budget_reports_not_converged() {
        let (_, b) = data(2_000);
        let opts = ConvergedOptions {
            l2_grid: vec![1e-6],
            max_passes: 3,
            tolerance: 1e-12,
            ..Default::default()
        };
        let (_, rep) = ConvergedLr::fit(&b, &opts).unwrap();
        assert!(!rep.fit.converged);
        assert!(rep.fit.passes <= 3);
    }
}

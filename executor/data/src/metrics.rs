//! Evaluation metrics: exact AUC and clipped log loss.

/// Probabilities are clipped to `[LOGLOSS_EPS, 1 - LOGLOSS_EPS]` in [`logloss`].
pub const LOGLOSS_EPS: f64 = 1e-7;

/// Area under the ROC curve, exact.
///
/// A label counts as positive when it is above 0.5. The scores are sorted
/// (`f64::total_cmp` order) and ranked 1..n; tied scores all get the average
/// of their ranks; then `AUC = (R+ - P(P+1)/2) / (P N)` where `R+` is the sum
/// of the positives' ranks (the Mann-Whitney U statistic over `P N`). Ties
/// between a positive and a negative thus count one half. Returns NaN when
/// there is no positive or no negative, or when the lengths differ.
pub fn auc(labels: &[f32], scores: &[f32]) -> f64 {
    if labels.len() != scores.len() {
        return f64::NAN;
    }
    let mut order: Vec<u32> = (0..labels.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| scores[a as usize].total_cmp(&scores[b as usize]));
    let positives = labels.iter().filter(|&&l| l > 0.5).count() as f64;
    let negatives = labels.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    let mut rank_sum = 0.0f64;
    let mut i = 0;
    while i < order.len() {
        let s = scores[order[i] as usize];
        let mut j = i + 1;
        while j < order.len() && scores[order[j] as usize].total_cmp(&s).is_eq() {
            j += 1;
        }
        // Ranks i+1 ..= j share the average (i + 1 + j) / 2.
        let avg = (i + 1 + j) as f64 / 2.0;
        let pos = order[i..j]
            .iter()
            .filter(|&&k| labels[k as usize] > 0.5)
            .count();
        rank_sum += avg * pos as f64;
        i = j;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

/// Mean log loss `-(y ln p + (1-y) ln(1-p))` with `p` clipped to
/// `[LOGLOSS_EPS, 1 - LOGLOSS_EPS]`; a label above 0.5 is a positive.
/// Returns NaN for empty input or differing lengths.
pub fn logloss(labels: &[f32], probs: &[f32]) -> f64 {
    if labels.len() != probs.len() || labels.is_empty() {
        return f64::NAN;
    }
    let sum: f64 = labels
        .iter()
        .zip(probs)
        .map(|(&y, &p)| {
            let p = f64::from(p).clamp(LOGLOSS_EPS, 1.0 - LOGLOSS_EPS);
            if y > 0.5 {
                -p.ln()
            } else {
                -(1.0 - p).ln()
            }
        })
        .sum();
    sum / labels.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_hand_computed() {
        // Perfect and reversed ranking.
        assert_eq!(auc(&[0.0, 0.0, 1.0, 1.0], &[0.1, 0.2, 0.3, 0.4]), 1.0);
        assert_eq!(auc(&[1.0, 1.0, 0.0, 0.0], &[0.1, 0.2, 0.3, 0.4]), 0.0);
        // Pairs (pos, neg): (0.8, 0.1) win, (0.8, 0.9) loss, (0.4, 0.1) win,
        // (0.4, 0.9) loss -> 2/4.
        assert_eq!(auc(&[1.0, 0.0, 1.0, 0.0], &[0.8, 0.1, 0.4, 0.9]), 0.5);
        // Pairs: (0.5 vs 0.5) tie = 0.5, (0.5 vs 0.2) win = 1,
        // (0.7 vs 0.5) win, (0.7 vs 0.2) win -> 3.5/4.
        assert_eq!(auc(&[1.0, 1.0, 0.0, 0.0], &[0.5, 0.7, 0.5, 0.2]), 0.875);
        // All tied: 0.5.
        assert_eq!(auc(&[1.0, 0.0, 0.0], &[0.3, 0.3, 0.3]), 0.5);
        // 3 pos, 2 neg: pos scores 0.9, 0.6, 0.3; neg 0.7, 0.2.
        // wins: 0.9>both (2), 0.6>0.2 (1), 0.3>0.2 (1) -> 4/6.
        let a = auc(&[1.0, 0.0, 1.0, 1.0, 0.0], &[0.9, 0.7, 0.6, 0.3, 0.2]);
        assert!((a - 4.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn auc_degenerate() {
        assert!(auc(&[1.0, 1.0], &[0.1, 0.2]).is_nan());
        assert!(auc(&[], &[]).is_nan());
        assert!(auc(&[1.0, 0.0], &[0.1]).is_nan());
    }

    #[test]
    fn logloss_hand_computed() {
        let l = logloss(&[1.0, 0.0], &[0.8, 0.4]);
        let want = -(0.8f64.ln() + 0.6f64.ln()) / 2.0;
        assert!((l - want).abs() < 1e-6, "{l} vs {want}");
        // Clipping: a confident wrong answer costs -ln(1e-7), not infinity.
        let l = logloss(&[1.0], &[0.0]);
        assert!((l - 16.118_095_650_958_32).abs() < 1e-9);
        assert!(logloss(&[], &[]).is_nan());
    }
}

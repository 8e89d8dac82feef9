//! The kernels: forward and gradient of every op, single-threaded and
//! deterministic (every reduction runs in a fixed order).

use crate::error::GraphError;
use crate::tensor::Tensor;
use crate::wire_rows::RowSource;

/// How the embedding rows of one example are pooled into one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Combiner {
    /// The sum of the rows.
    Sum,
    /// The mean of the rows; an example with no keys gives a zero row.
    Mean,
}

fn shape_err(op: &'static str, detail: String) -> GraphError {
    GraphError::Shape { op, detail }
}

fn matrix(op: &'static str, what: &str, t: &Tensor) -> Result<(usize, usize), GraphError> {
    t.as_matrix()
        .ok_or_else(|| shape_err(op, format!("{what} must be a matrix, got {:?}", t.shape())))
}

/// `a [M,K] x b [K,N] -> [M,N]`.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor, GraphError> {
    let (m, k) = matrix("MatMul", "lhs", a)?;
    let (k2, n) = matrix("MatMul", "rhs", b)?;
    if k != k2 {
        return Err(shape_err(
            "MatMul",
            format!("inner dimensions differ: {:?} x {:?}", a.shape(), b.shape()),
        ));
    }
    let (ad, bd) = (a.data(), b.data());
    let out = if n == 1 {
        matvec(ad, bd, m, k)
    } else {
        matmul_rows(ad, bd, m, k, n)
    };
    Ok(Tensor::from_parts(vec![m, n], out))
}

/// `a [M,K] x b [K,N]`, each output row the sum of `b`'s rows scaled by
/// its row of `a`, in order (an axpy over `N` that vectorises).
fn matmul_rows(ad: &[f32], bd: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        let orow = &mut out[i * n..(i + 1) * n];
        for p in 0..k {
            let av = ad[i * k + p];
            let brow = &bd[p * n..(p + 1) * n];
            for (o, &bv) in orow.iter_mut().zip(brow) {
                *o += av * bv;
            }
        }
    }
    out
}

/// Rows of [`matvec`] summed together, each in its own accumulator.
const MATVEC_ROWS: usize = 8;

/// `a [M,K] x b [K]`: each output is its row's products summed in order
/// from 0, as [`matmul_rows`] sums them (the same bits).
/// With one output column that loop is a chain of dependent additions per
/// row, one product at a time (a logistic regression's last layer spent
/// 4% of the issue-6 train step there); here [`MATVEC_ROWS`] rows' chains
/// run side by side.
fn matvec(a: &[f32], b: &[f32], m: usize, k: usize) -> Vec<f32> {
    let b = &b[..k];
    let mut out = vec![0.0f32; m];
    let mut blocks = out.chunks_exact_mut(MATVEC_ROWS);
    let mut i = 0;
    for o in &mut blocks {
        let rows: [&[f32]; MATVEC_ROWS] = std::array::from_fn(|r| &a[(i + r) * k..(i + r + 1) * k]);
        let mut acc = [0.0f32; MATVEC_ROWS];
        for (p, &bv) in b.iter().enumerate() {
            for r in 0..MATVEC_ROWS {
                acc[r] += rows[r][p] * bv;
            }
        }
        o.copy_from_slice(&acc);
        i += MATVEC_ROWS;
    }
    for o in blocks.into_remainder() {
        let row = &a[i * k..(i + 1) * k];
        let mut acc = 0.0f32;
        for (&av, &bv) in row.iter().zip(b) {
            acc += av * bv;
        }
        *o = acc;
        i += 1;
    }
    out
}

/// Gradient of `a` in `a x b`: `g [M,N] x b^T -> [M,K]`.
pub(crate) fn matmul_grad_lhs(g: &Tensor, b: &Tensor) -> Result<Tensor, GraphError> {
    let (m, n) = matrix("MatMul'", "grad", g)?;
    let (k, n2) = matrix("MatMul'", "rhs", b)?;
    if n != n2 {
        return Err(shape_err("MatMul'", "grad/rhs mismatch".into()));
    }
    // b^T first, so the inner loop is an axpy over contiguous rows (it
    // vectorises; a dot product's ordered f32 sum does not).
    let bd = b.data();
    let mut bt = vec![0.0f32; n * k];
    for p in 0..k {
        for j in 0..n {
            bt[j * k + p] = bd[p * n + j];
        }
    }
    let gd = g.data();
    let mut out = vec![0.0f32; m * k];
    for i in 0..m {
        let orow = &mut out[i * k..(i + 1) * k];
        for j in 0..n {
            let gv = gd[i * n + j];
            for (o, &bv) in orow.iter_mut().zip(&bt[j * k..(j + 1) * k]) {
                *o += gv * bv;
            }
        }
    }
    Ok(Tensor::from_parts(vec![m, k], out))
}

/// Gradient of `b` in `a x b`: `a^T x g -> [K,N]`.
pub(crate) fn matmul_grad_rhs(a: &Tensor, g: &Tensor) -> Result<Tensor, GraphError> {
    let (m, k) = matrix("MatMul'", "lhs", a)?;
    let (m2, n) = matrix("MatMul'", "grad", g)?;
    if m != m2 {
        return Err(shape_err("MatMul'", "lhs/grad mismatch".into()));
    }
    let (ad, gd) = (a.data(), g.data());
    let out = if n == 1 && k > 0 {
        // One output column: each row of `a` scaled by its gradient and
        // added to the output, rows in order (the sums of
        // `matmul_rhs_rows`, which with `n = 1` went one product at a time).
        let mut out = vec![0.0f32; k];
        for (row, &gv) in ad.chunks_exact(k).zip(&gd[..m]) {
            for (o, &av) in out.iter_mut().zip(row) {
                *o += av * gv;
            }
        }
        out
    } else {
        matmul_rhs_rows(ad, gd, m, k, n)
    };
    Ok(Tensor::from_parts(vec![k, n], out))
}

/// `a^T [K,M] x g [M,N]`: `g`'s rows scaled by `a`'s entries, added into
/// the output rows, `a`'s rows in order.
fn matmul_rhs_rows(ad: &[f32], gd: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; k * n];
    for i in 0..m {
        let grow = &gd[i * n..(i + 1) * n];
        for p in 0..k {
            let av = ad[i * k + p];
            let orow = &mut out[p * n..(p + 1) * n];
            for (o, &gv) in orow.iter_mut().zip(grow) {
                *o += av * gv;
            }
        }
    }
    out
}

/// How the right operand of `Add` is broadcast.
fn add_broadcast(a: &Tensor, b: &Tensor) -> Result<bool, GraphError> {
    if a.shape() == b.shape() {
        return Ok(false);
    }
    let (_, n) = matrix("Add", "lhs", a)?;
    match b.shape() {
        [bn] | [1, bn] if *bn == n => Ok(true),
        _ => Err(shape_err(
            "Add",
            format!("cannot add {:?} to {:?}", b.shape(), a.shape()),
        )),
    }
}

/// `a + b`, where `b` has `a`'s shape or is a bias `[N]`/`[1,N]` added to every row.
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor, GraphError> {
    let mut out = a.data().to_vec();
    if add_broadcast(a, b)? {
        // A zero-width bias (`[B,0] + [0]`) adds nothing (and `n = 0` is
        // no chunk size).
        let n = b.len().max(1);
        for row in out.chunks_exact_mut(n) {
            for (o, &bv) in row.iter_mut().zip(b.data()) {
                *o += bv;
            }
        }
    } else {
        for (o, &bv) in out.iter_mut().zip(b.data()) {
            *o += bv;
        }
    }
    Ok(Tensor::from_parts(a.shape().to_vec(), out))
}

/// Gradient of the right operand of `Add`: `g` itself, or its column sums.
pub(crate) fn add_grad_rhs(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor, GraphError> {
    if !add_broadcast(a, b)? {
        return Ok(g.clone());
    }
    let n = b.len();
    let mut out = vec![0.0f32; n];
    // `max(1)`: a zero-width `g` has no elements, so no rows to sum.
    for row in g.data().chunks_exact(n.max(1)) {
        for (o, &gv) in out.iter_mut().zip(row) {
            *o += gv;
        }
    }
    Ok(Tensor::from_parts(b.shape().to_vec(), out))
}

/// `max(x, 0)`.
pub(crate) fn relu(x: &Tensor) -> Tensor {
    let out = x.data().iter().map(|&v| v.max(0.0)).collect();
    Tensor::from_parts(x.shape().to_vec(), out)
}

/// Gradient of `relu`, from its output: `g` where the output is positive.
pub(crate) fn relu_grad(out: &Tensor, g: &Tensor) -> Tensor {
    let d = out
        .data()
        .iter()
        .zip(g.data())
        .map(|(&o, &gv)| if o > 0.0 { gv } else { 0.0 })
        .collect();
    Tensor::from_parts(out.shape().to_vec(), d)
}

/// `parts[0] + parts[1] + ...`: one output, summed in input order, written
/// into `out`'s allocation.
pub(crate) fn add_n(parts: &[&Tensor], mut out: Vec<f32>) -> Result<Tensor, GraphError> {
    let Some((first, rest)) = parts.split_first() else {
        return Err(shape_err("AddN", "no input".into()));
    };
    out.clear();
    out.extend_from_slice(first.data());
    for p in rest {
        if p.shape() != first.shape() {
            return Err(shape_err(
                "AddN",
                format!("cannot add {:?} to {:?}", p.shape(), first.shape()),
            ));
        }
        for (o, &v) in out.iter_mut().zip(p.data()) {
            *o += v;
        }
    }
    Ok(Tensor::from_parts(first.shape().to_vec(), out))
}

/// Concatenation of matrices with the same row count along columns, written
/// into `out`'s allocation.
pub(crate) fn concat(parts: &[&Tensor], mut out: Vec<f32>) -> Result<Tensor, GraphError> {
    let first = parts
        .first()
        .ok_or_else(|| shape_err("Concat", "no inputs".into()))?;
    let (rows, _) = matrix("Concat", "input", first)?;
    let mut widths = Vec::with_capacity(parts.len());
    for p in parts {
        let (r, c) = matrix("Concat", "input", p)?;
        if r != rows {
            return Err(shape_err(
                "Concat",
                format!("row counts differ: {rows} vs {r}"),
            ));
        }
        widths.push(c);
    }
    let total: usize = widths.iter().sum();
    out.clear();
    out.reserve(rows * total);
    for i in 0..rows {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p.data()[i * w..(i + 1) * w]);
        }
    }
    Ok(Tensor::from_parts(vec![rows, total], out))
}

/// Gradient of input `k` of `concat`: the columns `start..start+width` of `g`.
pub(crate) fn concat_grad(g: &Tensor, start: usize, width: usize) -> Result<Tensor, GraphError> {
    let (rows, total) = matrix("Concat'", "grad", g)?;
    if start + width > total {
        return Err(shape_err("Concat'", "slice out of range".into()));
    }
    let mut out = Vec::with_capacity(rows * width);
    for row in g.data().chunks_exact(total.max(1)).take(rows) {
        out.extend_from_slice(&row[start..start + width]);
    }
    Ok(Tensor::from_parts(vec![rows, width], out))
}

/// Mean sigmoid cross-entropy of `logits [B,1]` against `labels [B,1]`.
/// Returns the loss as a `[1]` tensor and the probabilities `[B,1]`.
pub(crate) fn sigmoid_cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
) -> Result<(Tensor, Tensor), GraphError> {
    let (b, one) = matrix("SigmoidCrossEntropy", "logits", logits)?;
    if one != 1 || labels.shape() != logits.shape() {
        return Err(shape_err(
            "SigmoidCrossEntropy",
            format!(
                "logits {:?} and labels {:?} must both be [B,1]",
                logits.shape(),
                labels.shape()
            ),
        ));
    }
    let mut sum = 0.0f64;
    let mut probs = Vec::with_capacity(b);
    for (&x, &y) in logits.data().iter().zip(labels.data()) {
        // Stable form: max(x,0) - x*y + ln(1 + e^-|x|).
        let l = x.max(0.0) - x * y + (-x.abs()).exp().ln_1p();
        sum += f64::from(l);
        probs.push(sigmoid(x));
    }
    let loss = if b == 0 { 0.0 } else { (sum / b as f64) as f32 };
    Ok((Tensor::scalar(loss), Tensor::from_parts(vec![b, 1], probs)))
}

fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Gradient of the mean loss w.r.t. the logits: `g * (p - y) / B`.
pub(crate) fn sigmoid_cross_entropy_grad(probs: &Tensor, labels: &Tensor, g: f32) -> Tensor {
    let b = probs.len().max(1) as f32;
    let d = probs
        .data()
        .iter()
        .zip(labels.data())
        .map(|(&p, &y)| g * (p - y) / b)
        .collect();
    Tensor::from_parts(probs.shape().to_vec(), d)
}

/// Checks a ragged key layout: `offsets` has `B+1` non-decreasing entries from
/// 0 to `index.len()`, and every entry of `index` is below `rows`.
pub fn check_ragged(
    lookup: usize,
    rows: usize,
    index: &[u32],
    offsets: &[u32],
) -> Result<(), GraphError> {
    let bad = |detail: String| GraphError::BadOffsets {
        index: lookup,
        detail,
    };
    match (offsets.first(), offsets.last()) {
        (Some(0), Some(&last)) if last as usize == index.len() => {}
        _ => {
            return Err(bad(format!(
                "offsets must run from 0 to {} (len B+1 >= 1)",
                index.len()
            )))
        }
    }
    if offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad("offsets decrease".into()));
    }
    if let Some(&key_index) = index.iter().find(|&&i| i as usize >= rows) {
        return Err(GraphError::KeyIndexOutOfRange {
            index: lookup,
            key_index,
            rows,
        });
    }
    Ok(())
}

/// Pools unique embedding rows `[U,D]` into one row per example `[B,D]`.
///
/// `index[j]` is the row of key occurrence `j`; example `b` owns occurrences
/// `offsets[b]..offsets[b+1]`. The layout must pass [`check_ragged`].
pub fn combine(
    rows: &Tensor,
    index: &[u32],
    offsets: &[u32],
    combiner: Combiner,
) -> Result<Tensor, GraphError> {
    let (u, _) = matrix("EmbeddingLookup", "rows", rows)?;
    check_ragged(0, u, index, offsets)?;
    Ok(combine_into(rows, index, offsets, combiner, Vec::new()))
}

/// [`combine`] written into `out`'s allocation (its contents are ignored).
/// An example's first row is copied and the others added to it, so the
/// output is written once and never zeroed first. The layout must pass
/// [`check_ragged`]: a run checks every feed once, when it places it.
pub(crate) fn combine_into(
    rows: &dyn RowSource,
    index: &[u32],
    offsets: &[u32],
    combiner: Combiner,
    mut out: Vec<f32>,
) -> Tensor {
    let (_, d) = rows.shape2();
    let b = offsets.len().saturating_sub(1);
    out.clear();
    out.reserve(b * d);
    for w in offsets.windows(2) {
        let occ = &index[w[0] as usize..w[1] as usize];
        let Some((&first, rest)) = occ.split_first() else {
            out.resize(out.len() + d, 0.0);
            continue;
        };
        let start = out.len();
        rows.extend_row(first as usize, &mut out);
        let orow = &mut out[start..];
        for &r in rest {
            rows.add_row(r as usize, orow);
        }
        if combiner == Combiner::Mean {
            let inv = 1.0 / occ.len() as f32;
            orow.iter_mut().for_each(|o| *o *= inv);
        }
    }
    Tensor::from_parts(vec![b, d], out)
}

/// One lookup's feed, as [`sum_combined_into`] reads it.
pub(crate) struct Bags<'a> {
    pub(crate) rows: &'a dyn RowSource,
    pub(crate) index: &'a [u32],
    pub(crate) offsets: &'a [u32],
    pub(crate) combiner: Combiner,
}

/// The sum of the pooled lookups `parts` (`AddN` of [`combine`]s), with
/// each part's bags added straight into the output instead of being
/// pooled into a `[B,D]` tensor of their own first. The result is
/// bit-identical to the two steps: the first part is [`combine_into`],
/// and each later part adds, per example, exactly the row `combine` would
/// have written (zeros for an empty bag, the one row of a bag of one,
/// else the pooled row), in part order. Every part's layout must pass
/// [`check_ragged`], as for [`combine_into`].
pub(crate) fn sum_combined_into(parts: &[Bags<'_>], out: Vec<f32>) -> Result<Tensor, GraphError> {
    let Some((first, rest)) = parts.split_first() else {
        return Err(shape_err("AddN", "no input".into()));
    };
    let mut sum = combine_into(first.rows, first.index, first.offsets, first.combiner, out);
    let shape = sum.shape().to_vec();
    let (b, d) = (shape[0], shape[1]);
    let out = sum.data_mut();
    let mut bag = Vec::new();
    for p in rest {
        let (_, pd) = p.rows.shape2();
        if pd != d || p.offsets.len() != b + 1 {
            return Err(shape_err(
                "AddN",
                format!("cannot add [{}, {pd}] to {shape:?}", p.offsets.len() - 1),
            ));
        }
        for (orow, w) in out.chunks_exact_mut(d.max(1)).zip(p.offsets.windows(2)) {
            match &p.index[w[0] as usize..w[1] as usize] {
                [] => orow.iter_mut().for_each(|o| *o += 0.0),
                // A mean of one row scales it by exactly 1.
                &[r] => p.rows.add_row(r as usize, orow),
                &[r, ref more @ ..] => {
                    bag.clear();
                    p.rows.extend_row(r as usize, &mut bag);
                    more.iter()
                        .for_each(|&r| p.rows.add_row(r as usize, &mut bag));
                    if p.combiner == Combiner::Mean {
                        let inv = 1.0 / (more.len() + 1) as f32;
                        bag.iter_mut().for_each(|x| *x *= inv);
                    }
                    orow.iter_mut().zip(&bag).for_each(|(o, &v)| *o += v);
                }
            }
        }
    }
    Ok(sum)
}

/// Maps a gradient w.r.t. the pooled tensor `[B,D]` back to the unique rows
/// `[num_rows, D]`: each occurrence adds its example's gradient (scaled by
/// `1/count` for `Mean`), summed per unique row in occurrence order.
pub fn scatter_pooled_grad(
    grad: &Tensor,
    index: &[u32],
    offsets: &[u32],
    num_rows: usize,
    combiner: Combiner,
) -> Result<Tensor, GraphError> {
    check_ragged(0, num_rows, index, offsets)?;
    scatter_pooled_grad_into(grad, index, offsets, num_rows, combiner, Vec::new())
}

/// [`scatter_pooled_grad`] written into `out`'s allocation (its contents
/// are ignored). The layout must pass [`check_ragged`], as for
/// [`combine_into`].
///
/// A row's first occurrence writes `0.0 + g` and later ones add, which
/// is what adding every occurrence to a zeroed row computes, bit for bit
/// (`0.0 + g` turns a `-0.0` into `0.0` as the zeroed row did); only rows
/// no occurrence names are zeroed. The output is written in one pass
/// instead of being cleared first.
pub(crate) fn scatter_pooled_grad_into(
    grad: &Tensor,
    index: &[u32],
    offsets: &[u32],
    num_rows: usize,
    combiner: Combiner,
    mut out: Vec<f32>,
) -> Result<Tensor, GraphError> {
    let (b, d) = matrix("EmbeddingLookup'", "grad", grad)?;
    if offsets.len() != b + 1 {
        return Err(shape_err(
            "EmbeddingLookup'",
            format!(
                "grad has {b} rows but offsets describe {}",
                offsets.len() - 1
            ),
        ));
    }
    let len = num_rows
        .checked_mul(d)
        .ok_or_else(|| shape_err("EmbeddingLookup'", "row count overflows".into()))?;
    // Only the room past the stale contents is zeroed here: a stale row is
    // overwritten by its first occurrence, or zeroed below when it has none.
    out.truncate(len);
    out.resize(len, 0.0);
    let mut seen = vec![false; num_rows];
    for (e, w) in offsets.windows(2).enumerate() {
        let occ = &index[w[0] as usize..w[1] as usize];
        let scale = match combiner {
            Combiner::Sum => 1.0,
            Combiner::Mean if occ.is_empty() => continue,
            Combiner::Mean => 1.0 / occ.len() as f32,
        };
        let grow = &grad.data()[e * d..(e + 1) * d];
        for &r in occ {
            let r = r as usize;
            let orow = &mut out[r * d..(r + 1) * d];
            if std::mem::replace(&mut seen[r], true) {
                orow.iter_mut()
                    .zip(grow)
                    .for_each(|(o, &gv)| *o += gv * scale);
            } else {
                orow.iter_mut()
                    .zip(grow)
                    .for_each(|(o, &gv)| *o = 0.0 + gv * scale);
            }
        }
    }
    for (orow, _) in out
        .chunks_exact_mut(d.max(1))
        .zip(&seen)
        .filter(|(_, &s)| !s)
    {
        orow.fill(0.0);
    }
    Ok(Tensor::from_parts(vec![num_rows, d], out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_column_matmuls_give_the_general_loops_bits() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut draw = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Values of mixed magnitudes, so the summation order shows.
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 10f32.powi((x % 7) as i32 - 3)
        };
        for (m, k) in [(0, 5), (1, 1), (7, 3), (8, 77), (13, 77), (512, 77), (9, 0)] {
            let a: Vec<f32> = (0..m * k).map(|_| draw()).collect();
            let b: Vec<f32> = (0..k).map(|_| draw()).collect();
            let g: Vec<f32> = (0..m).map(|_| draw()).collect();
            let ta = Tensor::from_parts(vec![m, k], a.clone());
            let out = matmul(&ta, &Tensor::from_parts(vec![k, 1], b.clone())).unwrap();
            let want = matmul_rows(&a, &b, m, k, 1);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(out.shape(), [m, 1]);
            assert_eq!(bits(out.data()), bits(&want), "matmul {m}x{k}");
            let grad = matmul_grad_rhs(&ta, &Tensor::from_parts(vec![m, 1], g.clone())).unwrap();
            let want = matmul_rhs_rows(&a, &g, m, k, 1);
            assert_eq!(grad.shape(), [k, 1]);
            assert_eq!(bits(grad.data()), bits(&want), "matmul_grad_rhs {m}x{k}");
        }
    }

    /// Rows `[u, d]` of varied values, negative zeros among them.
    fn rows(u: usize, d: usize, seed: u32) -> Tensor {
        let data = (0..u * d)
            .map(
                |i| match (i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 7 {
                    0 => -0.0,
                    k => (k as f32 - 3.3) * 0.37 + (seed as f32) * 1e-3,
                },
            )
            .collect();
        Tensor::from_parts(vec![u, d], data)
    }

    #[test]
    fn sum_combined_is_bit_identical_to_add_n_of_combines() {
        let d = 5;
        // Per part: occurrences per example (empty, one, several bags).
        let layouts: [&[usize]; 4] = [&[1, 0, 2, 1], &[0, 1, 1, 3], &[1, 1, 0, 0], &[2, 0, 1, 1]];
        for combiner in [Combiner::Sum, Combiner::Mean] {
            let feeds: Vec<(Tensor, Vec<u32>, Vec<u32>)> = layouts
                .iter()
                .enumerate()
                .map(|(p, bags)| {
                    let n: usize = bags.iter().sum();
                    let u = n.max(1);
                    let index = (0..n as u32)
                        .map(|j| (j * 3 + p as u32) % u as u32)
                        .collect();
                    let mut offsets = vec![0u32];
                    for &c in *bags {
                        offsets.push(offsets.last().unwrap() + c as u32);
                    }
                    (rows(u, d, p as u32), index, offsets)
                })
                .collect();
            let combined: Vec<Tensor> = feeds
                .iter()
                .map(|(r, i, o)| combine(r, i, o, combiner).unwrap())
                .collect();
            let want = add_n(&combined.iter().collect::<Vec<_>>(), Vec::new()).unwrap();
            let bags: Vec<Bags<'_>> = feeds
                .iter()
                .map(|(rows, index, offsets)| Bags {
                    rows,
                    index,
                    offsets,
                    combiner,
                })
                .collect();
            let got = sum_combined_into(&bags, vec![9.0; 3]).unwrap();
            assert_eq!(got.shape(), want.shape());
            let bits = |t: &Tensor| t.data().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{combiner:?}");
        }
    }

    /// Scattering into a stale buffer gives the bits of adding every
    /// occurrence to a zeroed row: `-0.0` gradients come out `0.0`, rows
    /// no occurrence names come out zero, stale NaNs do not leak.
    #[test]
    fn scatter_into_a_stale_buffer_matches_zeroed_rows_bit_for_bit() {
        let d = 3;
        let grad = Tensor::from_parts(
            vec![4, d],
            vec![
                -0.0, 1.5, -2.25, 0.5, -0.0, 3.0, 7.0, -1.0, 0.125, -0.0, -0.0, 2.0,
            ],
        );
        // Row 4 is never named; example 2's bag is empty.
        let index = [1u32, 0, 1, 3, 2, 1];
        let offsets = [0u32, 2, 4, 4, 6];
        for combiner in [Combiner::Sum, Combiner::Mean] {
            let mut want = vec![0.0f32; 5 * d];
            for (e, w) in offsets.windows(2).enumerate() {
                let occ = &index[w[0] as usize..w[1] as usize];
                let scale = match combiner {
                    Combiner::Sum => 1.0,
                    Combiner::Mean if occ.is_empty() => continue,
                    Combiner::Mean => 1.0 / occ.len() as f32,
                };
                for &r in occ {
                    for j in 0..d {
                        want[r as usize * d + j] += grad.data()[e * d + j] * scale;
                    }
                }
            }
            for stale in [Vec::new(), vec![f32::NAN; 2 * d], vec![-0.0; 9 * d]] {
                let got =
                    scatter_pooled_grad_into(&grad, &index, &offsets, 5, combiner, stale).unwrap();
                assert_eq!(got.shape(), &[5, d]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got.data()), bits(&want), "{combiner:?}");
            }
        }
    }

    #[test]
    fn sum_combined_refuses_parts_of_other_shapes() {
        let (a, b) = (rows(2, 3, 1), rows(2, 4, 2));
        let part = |rows| Bags {
            rows,
            index: &[0, 1],
            offsets: &[0, 1, 2],
            combiner: Combiner::Sum,
        };
        assert!(sum_combined_into(&[part(&a), part(&b)], Vec::new()).is_err());
        let fewer = Bags {
            rows: &a,
            index: &[0],
            offsets: &[0, 1],
            combiner: Combiner::Sum,
        };
        assert!(sum_combined_into(&[part(&a), fewer], Vec::new()).is_err());
    }
}

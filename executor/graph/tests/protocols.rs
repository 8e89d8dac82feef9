//! `star_server` and `star_server_lite` agree; `lr` learns.

mod common;

use common::*;
use starwire_graph::*;

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 + 1e-5 * x.abs().max(y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

fn protocols_agree(spec: ModelSpec, b: usize) {
    let model = Model::build(spec.clone()).unwrap();
    let robust = partition(&model, Protocol::StarServer);
    let lite = partition(&model, Protocol::StarServerLite);
    assert!(robust
        .pulls()
        .lookups
        .iter()
        .all(|l| l.form == PullForm::Rows));
    assert!(lite
        .pulls()
        .lookups
        .iter()
        .all(|l| l.form == PullForm::Pooled));
    assert_eq!(robust.pulls().dense, lite.pulls().dense);

    let mut store = Store::new(&model, 21);
    let batch = batch(&mut rng(22), &spec, b);
    let (rf, layouts) = step_feeds(&robust, &mut store, &batch);
    let (lf, _) = step_feeds(&lite, &mut store, &batch);
    let exec = Executor::new(0).unwrap();
    let ro = robust.forward_backward(&exec, rf.clone()).unwrap();
    let lo = lite.forward_backward(&exec, lf.clone()).unwrap();

    close(&[ro.loss], &[lo.loss], "loss");
    close(&ro.probs, &lo.probs, "probs");
    assert_eq!(robust.forward(&exec, rf).unwrap(), ro.probs);
    assert_eq!(lite.forward(&exec, lf).unwrap(), lo.probs);
    assert_eq!(ro.dense_grads.len(), lo.dense_grads.len());
    for ((va, ga), (vb, gb)) in ro.dense_grads.iter().zip(&lo.dense_grads) {
        assert_eq!(va, vb);
        close(ga.data(), gb.data(), "dense grad");
    }
    let mut nonzero = 0;
    for (((rg, lg), lay), pull) in ro
        .lookup_grads
        .iter()
        .zip(&lo.lookup_grads)
        .zip(&layouts)
        .zip(&lite.pulls().lookups)
    {
        let (LookupGrad::Rows(rows), LookupGrad::Pooled(pooled)) = (rg, lg) else {
            panic!("wrong gradient forms");
        };
        assert_eq!(pooled.shape(), &[b, pull.dim]);
        let mapped = scatter_pooled_grad(
            pooled,
            &lay.index,
            &lay.offsets,
            lay.unique.len(),
            pull.spec.combiner,
        )
        .unwrap();
        assert_eq!(rows.shape(), mapped.shape());
        close(rows.data(), mapped.data(), "row grad");
        nonzero += rows.data().iter().filter(|v| **v != 0.0).count();
    }
    assert!(nonzero > 0, "some row gradients are non-zero");
}

#[test]
fn lr_protocols_agree() {
    protocols_agree(small_lr(), 8);
}

#[test]
fn wdl_protocols_agree() {
    protocols_agree(small_wdl(), 8);
}

#[test]
fn criteo_shaped_wdl_protocols_agree() {
    let spec = ModelSpec::wdl(4);
    let model = Model::build(spec.clone()).unwrap();
    assert!(model.variables().len() >= 20);
    assert_eq!(model.lookups().len(), 27);
    protocols_agree(spec, 16);
}

#[test]
fn model_shapes_and_names() {
    let lr = Model::build(ModelSpec::lr(8)).unwrap();
    let names: Vec<&str> = lr.variables().iter().map(|v| v.name.as_str()).collect();
    // One table per categorical field (TensorFlow's linear model), then the
    // linear layer.
    let mut want: Vec<String> = (0..26).map(|f| format!("lr_emb_{f}")).collect();
    want.extend(["lr_w".to_string(), "lr_b".to_string()]);
    assert_eq!(names, want);
    for v in &lr.variables()[..26] {
        assert_eq!(v.kind, VarKind::Embedding { dim: 8 });
    }
    assert_eq!(
        lr.variables()[26].kind,
        VarKind::Dense { shape: vec![21, 1] }
    );
    assert_eq!(lr.variables()[27].kind, VarKind::Dense { shape: vec![1] });
    assert_eq!(lr.lookups().len(), 26);
    for (f, l) in lr.lookups().iter().enumerate() {
        assert_eq!(l.fields, vec![f]);
        assert_eq!(l.var, VarId(f as u32));
        assert_eq!(l.combiner, Combiner::Sum);
    }

    let wdl = Model::build(ModelSpec::wdl(8)).unwrap();
    assert_eq!(wdl.variables().len(), 3 + 26 + 6);
    assert_eq!(wdl.variables()[0].kind, VarKind::Embedding { dim: 1 });
    assert_eq!(wdl.lookups()[3].fields, vec![2]);
    assert_eq!(wdl.lookups()[3].combiner, Combiner::Mean);
    for (i, v) in wdl.variables().iter().enumerate() {
        assert_eq!(v.id, VarId(i as u32));
    }
    let p = partition(&wdl, Protocol::StarServer);
    assert!(p
        .pulls()
        .dense
        .iter()
        .any(|d| d.shape == vec![13 + 26 * 8, 64]));

    let mut bad = ModelSpec::wdl(8);
    bad.hidden = vec![64, 0];
    assert!(matches!(
        Model::build(bad),
        Err(GraphError::InvalidGraph(_))
    ));
    assert!(Model::build(ModelSpec::lr(0)).is_err());
}

/// A separable toy problem: the label is decided by which half of a
/// vocabulary field 0's key comes from, and by the sign of numeric 0.
#[test]
fn lr_learns_a_separable_toy_problem() {
    let spec = ModelSpec {
        kind: ModelKind::Lr,
        num_dense: 2,
        num_fields: 2,
        embedding_dim: 2,
        hidden: vec![],
    };
    let model = Model::build(spec.clone()).unwrap();
    let p = partition(&model, Protocol::StarServer);
    let mut store = Store::new(&model, 5);
    // Start from zero dense weights, small rows.
    for t in store.dense.values_mut() {
        t.data_mut().iter_mut().for_each(|v| *v = 0.0);
    }
    let mut r = rng(6);
    let batches: Vec<Batch> = (0..4)
        .map(|_| {
            let mut b = batch(&mut r, &spec, 32);
            for (e, ex) in b.keys.iter_mut().enumerate() {
                let y = b.labels.data()[e];
                let base = if y > 0.5 { 0 } else { 100 };
                ex[0] = vec![base + (e as u64 % 5)];
                b.numeric.data_mut()[e * 2] = if y > 0.5 { 1.0 } else { -1.0 };
            }
            b
        })
        .collect();
    let exec = Executor::new(0).unwrap();
    let lr = 0.5f32;
    let mut losses = Vec::new();
    for step in 0..60 {
        let b = &batches[step % batches.len()];
        let (feeds, layouts) = step_feeds(&p, &mut store, b);
        let out = p.forward_backward(&exec, feeds).unwrap();
        assert!(out.loss.is_finite());
        losses.push(out.loss);
        for (var, g) in &out.dense_grads {
            let w = store.dense.get_mut(var).unwrap();
            w.data_mut()
                .iter_mut()
                .zip(g.data())
                .for_each(|(w, g)| *w -= lr * g);
        }
        for ((g, lay), pull) in out
            .lookup_grads
            .iter()
            .zip(&layouts)
            .zip(&p.pulls().lookups)
        {
            let LookupGrad::Rows(g) = g else {
                panic!("rows expected")
            };
            for (u, &key) in lay.unique.iter().enumerate() {
                let mut row = store.row(pull.spec.var, key);
                row.iter_mut()
                    .zip(&g.data()[u * pull.dim..(u + 1) * pull.dim])
                    .for_each(|(w, g)| *w -= lr * g);
                store.rows.insert((pull.spec.var, key), row);
            }
        }
    }
    // Zero weights: every logit is 0, so the first loss is ln 2.
    let first = losses[0];
    let last: f32 = losses[losses.len() - 4..].iter().sum::<f32>() / 4.0;
    assert!(
        (first - std::f32::consts::LN_2).abs() < 1e-5,
        "first {first}"
    );
    assert!(last < 0.3 * first, "loss went from {first} to {last}");
}

#[test]
fn dedup_keeps_first_seen_order() {
    let (u, i) = dedup(&[7, 3, 7, 9, 3, 3]);
    assert_eq!(u, vec![7, 3, 9]);
    assert_eq!(i, vec![0, 1, 0, 2, 1, 1]);
    let (u, i) = dedup(&[]);
    assert!(u.is_empty() && i.is_empty());
}

#[test]
fn a_reused_dedup_forgets_the_previous_keys() {
    let mut d = Dedup::default();
    let (mut u, mut i) = (vec![1], vec![5]);
    d.run(&[7, 3, 7], &mut u, &mut i);
    assert_eq!((u.as_slice(), i.as_slice()), (&[7, 3][..], &[0, 1, 0][..]));
    d.run(&[3, 9, 9], &mut u, &mut i);
    assert_eq!((u.as_slice(), i.as_slice()), (&[3, 9][..], &[0, 1, 1][..]));
}

#[test]
fn steps_with_kept_buffers_match_fresh_ones() {
    for spec in [small_lr(), small_wdl()] {
        let model = Model::build(spec.clone()).unwrap();
        let p = partition(&model, Protocol::StarServer);
        let mut store = Store::new(&model, 5);
        let exec = Executor::new(0).unwrap();
        let mut bufs = RunBuffers::default();
        // Batches of changing sizes: kept buffers are reused across shapes.
        for (i, b) in [16, 16, 5, 32].into_iter().enumerate() {
            let batch = batch(&mut rng(40 + i as u64), &spec, b);
            let (f, _) = step_feeds(&p, &mut store, &batch);
            let fresh = p.forward_backward(&exec, f.clone()).unwrap();
            let kept = p.forward_backward_with(&exec, f, &mut bufs).unwrap();
            assert_eq!(kept, fresh, "step {i}");
            bufs.give_back(p.graph(), kept.lookup_grads);
        }
    }
}

/// Many keys, many repeats, keys that differ only in high or low bits,
/// and a table reused across lengths: the same result as a plain scan.
#[test]
fn dedup_matches_a_plain_scan_on_colliding_keys() {
    let mut d = Dedup::default();
    let (mut u, mut i) = (Vec::new(), Vec::new());
    for (n, seed) in [(1000usize, 1u64), (3, 2), (0, 3), (4097, 4), (17, 5)] {
        let mut x = seed;
        let keys: Vec<u64> = (0..n)
            .map(|j| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                match j % 3 {
                    0 => (x >> 60) << 48,
                    1 => x >> 59,
                    _ => x % 97,
                }
            })
            .collect();
        d.run(&keys, &mut u, &mut i);
        let mut want_u: Vec<u64> = Vec::new();
        let want_i: Vec<u32> = keys
            .iter()
            .map(|k| match want_u.iter().position(|w| w == k) {
                Some(p) => p as u32,
                None => {
                    want_u.push(*k);
                    want_u.len() as u32 - 1
                }
            })
            .collect();
        assert_eq!(u, want_u, "n {n}");
        assert_eq!(i, want_i, "n {n}");
    }
}

//! End-to-end tests of `PsShard` through the codec.

use starwire_ps::{Init, OptimizerConfig, PsError, PsShard, ShardConfig, VarDef, VarKind};
use starwire_wire::ps::{
    parse_push_response, DecodeError, Limits, PullReply, PullRequestWriter, PullResponse,
    PushRequestWriter,
};

const EMB: u32 = 10;
const W: u32 = 20;
const DIM: usize = 4;

fn vars() -> Vec<VarDef> {
    vec![
        VarDef {
            id: EMB,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: DIM },
            init: Init::Uniform { scale: 0.1 },
        },
        VarDef {
            id: W,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![2, 3] },
            init: Init::GlorotUniform,
        },
    ]
}

fn shard(cfg: ShardConfig) -> PsShard {
    PsShard::new(0, &vars(), cfg)
}

fn sgd() -> ShardConfig {
    ShardConfig {
        seed: 5,
        optimizer: OptimizerConfig::sgd(1.0),
        ..ShardConfig::default()
    }
}

/// Pull and return the replies as owned vectors.
fn pull(s: &mut PsShard, build: impl FnOnce(&mut PullRequestWriter<'_>)) -> (u64, Vec<Vec<f32>>) {
    let mut req = Vec::new();
    build(&mut PullRequestWriter::new(&mut req));
    let mut out = Vec::new();
    s.handle_pull(&req, &mut out).unwrap();
    let r = PullResponse::parse(&out, &Limits::default()).unwrap();
    let items = r
        .items()
        .map(|i| match i {
            PullReply::Dense { data, .. }
            | PullReply::Rows { data, .. }
            | PullReply::Pooled { data, .. } => data.to_vec(),
        })
        .collect();
    (r.global_step, items)
}

fn push(s: &mut PsShard, completes: bool, build: impl FnOnce(&mut PushRequestWriter<'_>)) -> u64 {
    let mut req = Vec::new();
    build(&mut PushRequestWriter::new(&mut req, completes));
    let mut out = Vec::new();
    s.handle_push(&req, &mut out).unwrap();
    parse_push_response(&out).unwrap()
}

fn init_row(key: u64) -> Vec<f32> {
    let mut r = vec![0.0; DIM];
    vars()[0].init_values(5, key, &mut r);
    r
}

fn snapshot(s: &PsShard) -> Vec<u8> {
    let mut b = Vec::new();
    s.save(&mut b).unwrap();
    b
}

#[test]
fn rows_pull_creates_seeded_rows_and_push_updates() {
    let mut s = shard(sgd());
    let (step, items) = pull(&mut s, |w| {
        w.rows(EMB, &[1, 2]);
    });
    assert_eq!(step, 0);
    assert_eq!(items[0][..DIM], init_row(1)[..]);
    assert_eq!(items[0][DIM..], init_row(2)[..]);
    assert_eq!(s.table(EMB).unwrap().len(), 2);
    // Key 1 appears in two items and twice in one: all summed.
    let g = [1.0f32; DIM];
    let step = push(&mut s, true, |w| {
        w.rows(EMB, DIM as u32, &[1, 1], &[g, g].concat()).rows(
            EMB,
            DIM as u32,
            &[1, 2],
            &[g, g].concat(),
        );
    });
    assert_eq!(step, 1);
    let t = s.table(EMB).unwrap();
    for (a, b) in t.get(1).unwrap().iter().zip(init_row(1)) {
        assert!((a - (b - 3.0)).abs() < 1e-6);
    }
    for (a, b) in t.get(2).unwrap().iter().zip(init_row(2)) {
        assert!((a - (b - 1.0)).abs() < 1e-6);
    }
}

#[test]
fn pooled_pull_sums_and_pooled_push_scatters() {
    let mut a = shard(sgd());
    let mut b = shard(sgd());
    // Example 0: keys 1, 2; example 1: none; example 2: keys 2, 2, 3.
    let offsets = [0u32, 2, 2, 5];
    let keys = [1u64, 2, 2, 2, 3];
    let (_, items) = pull(&mut a, |w| {
        w.pooled(EMB, &offsets, &keys);
    });
    let p = &items[0];
    assert_eq!(p.len(), 3 * DIM);
    for j in 0..DIM {
        assert!((p[j] - (init_row(1)[j] + init_row(2)[j])).abs() < 1e-6);
        assert_eq!(p[DIM + j], 0.0);
        assert!((p[2 * DIM + j] - (2.0 * init_row(2)[j] + init_row(3)[j])).abs() < 1e-6);
    }
    // Pooled push == rows push of the per-key sums.
    let grads: Vec<f32> = (0..3 * DIM).map(|i| i as f32 * 0.1).collect();
    push(&mut a, true, |w| {
        w.pooled(EMB, DIM as u32, &offsets, &keys, &grads);
    });
    pull(&mut b, |w| {
        w.rows(EMB, &[1, 2, 3]);
    });
    let (g0, g2) = (&grads[..DIM], &grads[2 * DIM..]);
    let per_key: Vec<f32> = (0..DIM)
        .map(|j| g0[j])
        .chain((0..DIM).map(|j| g0[j] + 2.0 * g2[j]))
        .chain((0..DIM).map(|j| g2[j]))
        .collect();
    push(&mut b, true, |w| {
        w.rows(EMB, DIM as u32, &[1, 2, 3], &per_key);
    });
    for k in 1..=3 {
        let (x, y) = (
            a.table(EMB).unwrap().get(k).unwrap(),
            b.table(EMB).unwrap().get(k).unwrap(),
        );
        for (x, y) in x.iter().zip(y) {
            assert!((x - y).abs() < 1e-6, "key {k}");
        }
    }
}

#[test]
fn dense_pull_and_push() {
    let mut s = shard(sgd());
    let (_, items) = pull(&mut s, |w| {
        w.dense(W);
    });
    let mut init = vec![0.0; 6];
    vars()[1].init_values(5, 0, &mut init);
    assert_eq!(items[0], init);
    push(&mut s, false, |w| {
        w.dense(W, &[1.0; 6]).dense(W, &[0.5; 6]);
    });
    assert_eq!(s.global_step(), 0);
    let d = s.dense(W).unwrap();
    assert_eq!(d.updates(), 1);
    for (a, b) in d.values().iter().zip(&init) {
        assert!((a - (b - 1.5)).abs() < 1e-6);
    }
}

#[test]
fn filter_returns_zeros_until_admitted() {
    let mut s = shard(ShardConfig {
        filter_freq: 2,
        ..sgd()
    });
    let (_, items) = pull(&mut s, |w| {
        w.rows(EMB, &[9]);
    });
    assert_eq!(items[0], vec![0.0; DIM]);
    push(&mut s, true, |w| {
        w.rows(EMB, DIM as u32, &[9], &[1.0; DIM]);
    });
    let t = s.table(EMB).unwrap();
    assert_eq!(
        (t.len(), t.stats().ignored_pushes, t.stats().filtered_pulls),
        (0, 1, 1)
    );
    let (_, items) = pull(&mut s, |w| {
        w.rows(EMB, &[9]);
    });
    assert_eq!(items[0], init_row(9));
}

#[test]
fn filter_counts_a_key_once_per_pooled_request() {
    let mut s = shard(ShardConfig {
        filter_freq: 3,
        ..sgd()
    });
    // Key 9 occurs three times in one batch (twice in example 0, once in
    // example 1, and again in a second item): one count, not four.
    let (_, items) = pull(&mut s, |w| {
        w.pooled(EMB, &[0, 2, 3], &[9, 9, 9])
            .pooled(EMB, &[0, 1], &[9]);
    });
    assert_eq!(items, vec![vec![0.0; 2 * DIM], vec![0.0; DIM]]);
    let t = s.table(EMB).unwrap();
    assert_eq!(
        (t.len(), t.pending_len(), t.stats().filtered_pulls),
        (0, 1, 4)
    );
    // Second request: count 2, still filtered.
    pull(&mut s, |w| {
        w.pooled(EMB, &[0, 2], &[9, 9]);
    });
    assert_eq!(s.table(EMB).unwrap().len(), 0);
    // Third request admits it at the first occurrence; the others in the
    // same request see the new row.
    let (_, items) = pull(&mut s, |w| {
        w.pooled(EMB, &[0, 2], &[9, 9]);
    });
    let r = init_row(9);
    let twice: Vec<f32> = r.iter().map(|x| x + x).collect();
    assert_eq!(items[0], twice);
    let t = s.table(EMB).unwrap();
    assert_eq!((t.len(), t.pending_len(), t.stats().admitted), (1, 0, 1));
    // The rows protocol counts the same way: once per request.
    pull(&mut s, |w| {
        w.rows(EMB, &[7, 7]).pooled(EMB, &[0, 1], &[7]);
    });
    pull(&mut s, |w| {
        w.rows(EMB, &[7]);
    });
    assert_eq!(s.table(EMB).unwrap().get(7), None);
    pull(&mut s, |w| {
        w.rows(EMB, &[7]);
    });
    assert_eq!(s.table(EMB).unwrap().get(7), Some(&init_row(7)[..]));
}

#[test]
fn global_step_drives_eviction() {
    let mut s = shard(ShardConfig {
        steps_to_live: 3,
        evict_interval: 2,
        ..sgd()
    });
    pull(&mut s, |w| {
        w.rows(EMB, &[1, 2]);
    });
    // Key 2 is touched at step 1 and 2; key 1 only at step 0.
    for _ in 0..3 {
        pull(&mut s, |w| {
            w.rows(EMB, &[2]);
        });
        push(&mut s, true, |w| {
            w.rows(EMB, DIM as u32, &[2], &[0.0; DIM]);
        });
    }
    // Step 2: evicted nothing (2 - 0 < 3); step 3 is not a multiple of 2.
    assert_eq!(s.global_step(), 3);
    assert_eq!(s.table(EMB).unwrap().len(), 2);
    push(&mut s, true, |_| {});
    // Step 4: key 1 (last access 0) evicted, key 2 (last access 2) kept.
    let t = s.table(EMB).unwrap();
    assert_eq!((t.len(), t.stats().evicted), (1, 1));
    assert!(t.get(2).is_some());
}

#[test]
fn every_error_kind_leaves_state_unchanged() {
    let mut s = shard(sgd());
    pull(&mut s, |w| {
        w.rows(EMB, &[1, 2, 3]).dense(W);
    });
    let before = snapshot(&s);
    let mut req = Vec::new();
    let mut out = vec![1, 2, 3];
    let g = [1.0f32; DIM];

    // Valid first item, bad second: nothing applied.
    PushRequestWriter::new(&mut req, true)
        .rows(EMB, DIM as u32, &[1], &g)
        .rows(99, DIM as u32, &[1], &g);
    assert_eq!(
        s.handle_push(&req, &mut out),
        Err(PsError::UnknownVariable(99))
    );
    assert!(out.is_empty());

    PushRequestWriter::new(&mut req, true)
        .rows(EMB, DIM as u32, &[1], &g)
        .rows(W, DIM as u32, &[1], &g);
    assert!(matches!(
        s.handle_push(&req, &mut out),
        Err(PsError::KindMismatch {
            var: W,
            item: "rows",
            var_kind: "dense"
        })
    ));
    PushRequestWriter::new(&mut req, true).dense(EMB, &[1.0; 4]);
    assert!(matches!(
        s.handle_push(&req, &mut out),
        Err(PsError::KindMismatch {
            var: EMB,
            var_kind: "embedding",
            ..
        })
    ));
    PushRequestWriter::new(&mut req, true).dense(W, &[1.0; 5]);
    assert!(matches!(
        s.handle_push(&req, &mut out),
        Err(PsError::ShapeMismatch {
            var: W,
            expected: 6,
            got: 5,
            ..
        })
    ));
    PushRequestWriter::new(&mut req, true).rows(EMB, 3, &[1], &[1.0; 3]);
    assert!(matches!(
        s.handle_push(&req, &mut out),
        Err(PsError::ShapeMismatch {
            var: EMB,
            expected: 4,
            got: 3,
            ..
        })
    ));
    // Grads shorter than keys * dim: truncated.
    PushRequestWriter::new(&mut req, true).rows(EMB, DIM as u32, &[1, 2], &g);
    assert!(matches!(
        s.handle_push(&req, &mut out),
        Err(PsError::Decode(DecodeError::Truncated { .. }))
    ));
    // Pulls: a new key in the first item must not be created.
    PullRequestWriter::new(&mut req)
        .rows(EMB, &[77])
        .pooled(W, &[0, 1], &[1]);
    assert!(matches!(
        s.handle_pull(&req, &mut out),
        Err(PsError::KindMismatch { item: "pooled", .. })
    ));
    PullRequestWriter::new(&mut req)
        .rows(EMB, &[77])
        .dense(1234);
    assert_eq!(
        s.handle_pull(&req, &mut out),
        Err(PsError::UnknownVariable(1234))
    );
    assert!(matches!(
        s.handle_pull(&[1, 1, 0], &mut out),
        Err(PsError::Decode(DecodeError::Truncated { .. }))
    ));
    assert!(matches!(
        s.handle_pull(&[2, 1, 0, 0, 0, 0, 0, 0], &mut out),
        Err(PsError::Decode(DecodeError::BadVersion(2)))
    ));

    assert_eq!(snapshot(&s), before);
    assert_eq!(s.global_step(), 0);
    assert!(s.table(EMB).unwrap().get(77).is_none());
    assert_eq!(s.stats().errors, 10);
}

#[test]
fn byte_counters() {
    let mut s = shard(sgd());
    let mut req = Vec::new();
    PullRequestWriter::new(&mut req).rows(EMB, &[1, 2]);
    let mut out = Vec::new();
    s.handle_pull(&req, &mut out).unwrap();
    let st = s.stats();
    assert_eq!(st.pulls, 1);
    assert_eq!(st.request_bytes, req.len() as u64);
    assert_eq!(st.response_bytes, out.len() as u64);
    assert_eq!(out.len(), 16 + 16 + 2 * DIM * 4);
}

#[test]
fn sparse_adam_uses_per_row_step_counts() {
    let cfg = ShardConfig {
        optimizer: OptimizerConfig::adam(0.01),
        ..sgd()
    };
    let mut s = shard(cfg);
    let g = [1.0f32; DIM];
    pull(&mut s, |w| {
        w.rows(EMB, &[1]);
    });
    for _ in 0..5 {
        push(&mut s, true, |w| {
            w.rows(EMB, DIM as u32, &[1], &g);
        });
    }
    // Key 2 is first updated at global step 5: its first Adam step is the
    // bias-corrected one (lr * sign(g)), as key 1's was at step 0.
    pull(&mut s, |w| {
        w.rows(EMB, &[2]);
    });
    push(&mut s, true, |w| {
        w.rows(EMB, DIM as u32, &[2], &g);
    });
    let t = s.table(EMB).unwrap();
    for (a, b) in t.get(2).unwrap().iter().zip(init_row(2)) {
        assert!((a - (b - 0.01)).abs() < 1e-5, "{a} {b}");
    }
    // Slots: m and v of key 2 after one update.
    let slots = t.slots(2).unwrap();
    assert!((slots[0] - 0.1).abs() < 1e-6);
    assert!((slots[DIM] - 0.001).abs() < 1e-6);
    let r = s.report();
    assert_eq!((r.rows, r.tables.admitted, r.global_step), (2, 2, 6));
}

#[test]
fn adagrad_slots_start_at_the_initial_accumulator() {
    let mut s = shard(ShardConfig {
        optimizer: OptimizerConfig::adagrad(0.1),
        ..sgd()
    });
    pull(&mut s, |w| {
        w.rows(EMB, &[4]);
    });
    assert_eq!(s.table(EMB).unwrap().slots(4).unwrap(), &[0.1; DIM]);
    assert_eq!(s.dense(W).unwrap().slots(), &[0.1; 6]);
}

#[test]
fn oversized_reply_is_refused() {
    let mut s = shard(ShardConfig {
        limits: starwire_wire::ps::Limits {
            max_elems: 8,
            ..Default::default()
        },
        ..sgd()
    });
    let mut req = Vec::new();
    let mut out = Vec::new();
    PullRequestWriter::new(&mut req).rows(EMB, &[1, 2, 3]);
    assert!(matches!(
        s.handle_pull(&req, &mut out),
        Err(PsError::Decode(DecodeError::Oversized {
            what: "reply",
            len: 12,
            max: 8
        }))
    ));
    assert!(s.table(EMB).unwrap().is_empty());
}

fn adam() -> ShardConfig {
    ShardConfig {
        seed: 5,
        optimizer: OptimizerConfig::adam(0.1),
        ..ShardConfig::default()
    }
}

/// Gradient rows `g * (j + 1)` for the `j`-th key of `keys`.
fn grads(keys: &[u64], g: f32) -> Vec<f32> {
    (0..keys.len())
        .flat_map(|j| [g * (j + 1) as f32; DIM])
        .collect()
}

#[test]
fn a_push_of_unique_keys_updates_rows_as_an_accumulated_one_does() {
    // `direct` gets each step's keys as one item (applied straight from the
    // request); `split` gets them as two items of one request (accumulated
    // first). Adam's per-row step counts and the access steps must agree.
    let (mut direct, mut split) = (shard(adam()), shard(adam()));
    for s in [&mut direct, &mut split] {
        pull(s, |w| {
            w.rows(EMB, &[1, 2, 3, 4, 5]);
        });
    }
    for keys in [vec![4u64, 1, 5], vec![1, 2], vec![3, 1, 2, 5]] {
        let g = grads(&keys, 0.5);
        push(&mut direct, true, |w| {
            w.rows(EMB, DIM as u32, &keys, &g);
        });
        let h = keys.len() / 2;
        push(&mut split, true, |w| {
            w.rows(EMB, DIM as u32, &keys[..h], &g[..h * DIM]).rows(
                EMB,
                DIM as u32,
                &keys[h..],
                &g[h * DIM..],
            );
        });
    }
    assert_eq!(snapshot(&direct), snapshot(&split));
    assert_ne!(direct.table(EMB).unwrap().get(1).unwrap(), &init_row(1)[..]);
}

#[test]
fn a_push_item_with_a_repeated_or_unknown_key_sums_and_ignores_as_before() {
    let mut s = shard(sgd());
    pull(&mut s, |w| {
        w.rows(EMB, &[1, 2, 3]);
    });
    let keys = [1u64, 2, 1, 9];
    push(&mut s, true, |w| {
        w.rows(EMB, DIM as u32, &keys, &grads(&keys, 1.0));
    });
    let t = s.table(EMB).unwrap();
    // SGD with lr 1: key 1 moved by 1 + 3, key 2 by 2; key 9 has no row.
    for (k, moved) in [(1, 4.0), (2, 2.0), (3, 0.0)] {
        for (a, b) in t.get(k).unwrap().iter().zip(init_row(k)) {
            assert!((a - (b - moved)).abs() < 1e-6, "key {k}");
        }
    }
    assert_eq!(t.stats().ignored_pushes, 1);
    // The rows of the refused item go straight to the table next time.
    push(&mut s, true, |w| {
        w.rows(EMB, DIM as u32, &[3, 1], &grads(&[3, 1], 1.0));
    });
    let t = s.table(EMB).unwrap();
    for (a, b) in t.get(3).unwrap().iter().zip(init_row(3)) {
        assert!((a - (b - 1.0)).abs() < 1e-6);
    }
}

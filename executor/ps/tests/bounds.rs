//! The shard's bounds on what one request may cost: the size of a pull's
//! reply, the rows of a table, and gradients that are not finite. Each is
//! refused with a typed error and leaves the shard as it was.

use starwire_ps::{
    Init, NoRoom, OptimizerConfig, PsError, PsShard, ShardConfig, TableFull, VarDef, VarKind,
};
use starwire_wire::ps::{PullRequestWriter, PushRequestWriter};

const EMB: u32 = 10;
const W: u32 = 20;
const DIM: usize = 4;
/// Floats of the dense variable.
const DENSE: usize = 1000;

fn shard(cfg: ShardConfig) -> PsShard {
    let vars = vec![
        VarDef {
            id: EMB,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: DIM },
            init: Init::Uniform { scale: 0.1 },
        },
        VarDef {
            id: W,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![DENSE] },
            init: Init::GlorotUniform,
        },
    ];
    PsShard::new(
        0,
        &vars,
        ShardConfig {
            optimizer: OptimizerConfig::sgd(1.0),
            ..cfg
        },
    )
}

fn pull(s: &mut PsShard, build: impl FnOnce(&mut PullRequestWriter<'_>)) -> Result<usize, PsError> {
    let mut req = Vec::new();
    build(&mut PullRequestWriter::new(&mut req));
    let mut out = Vec::new();
    s.handle_pull(&req, &mut out).map(|()| out.len())
}

fn push(s: &mut PsShard, build: impl FnOnce(&mut PushRequestWriter<'_>)) -> Result<(), PsError> {
    let mut req = Vec::new();
    build(&mut PushRequestWriter::new(&mut req, true));
    let mut out = Vec::new();
    s.handle_push(&req, &mut out)
}

fn snapshot(s: &PsShard) -> Vec<u8> {
    let mut b = Vec::new();
    s.save(&mut b).unwrap();
    b
}

#[test]
fn a_pull_of_many_small_items_whose_reply_would_be_huge_is_refused_before_allocating() {
    let mut s = shard(ShardConfig {
        max_reply_bytes: 1 << 20,
        ..ShardConfig::default()
    });
    // Each item is 8 bytes of request and 4 KB of reply: the sum, not any
    // one item, passes the bound (the attack the bound is for, with 65,536
    // items of a large dense variable).
    let n = 1000;
    let e = pull(&mut s, |w| {
        for _ in 0..n {
            w.dense(W);
        }
    })
    .unwrap_err();
    assert!(
        matches!(e, PsError::ReplyTooLarge { max, at_least } if max == 1 << 20 && at_least > max),
        "{e}"
    );
    assert!(e.to_string().contains("--max-reply-bytes"), "{e}");
    assert_eq!(s.stats().errors, 1);
    // Under the bound it is served.
    let len = pull(&mut s, |w| {
        for _ in 0..100 {
            w.dense(W);
        }
    })
    .unwrap();
    assert!(len <= 1 << 20 && len > 100 * DENSE * 4);
}

#[test]
fn a_table_at_max_rows_refuses_new_keys_and_keeps_serving_known_ones() {
    let mut s = shard(ShardConfig {
        max_rows: 10,
        ..ShardConfig::default()
    });
    let first: Vec<u64> = (0..8).collect();
    pull(&mut s, |w| {
        w.rows(EMB, &first);
    })
    .unwrap();
    let before = snapshot(&s);
    // 8 + 3 new > 10: refused, nothing created.
    let e = pull(&mut s, |w| {
        w.rows(EMB, &[1, 2, 100, 101, 102]);
    })
    .unwrap_err();
    assert_eq!(
        e,
        PsError::TableFull(TableFull {
            var: EMB,
            rows: 8,
            why: NoRoom::MaxRows
        })
    );
    assert_eq!(snapshot(&s), before, "a refused pull changed the shard");
    // Duplicates and known keys do not count: 8 + 2 new = 10 fits, over
    // two items of the same table.
    pull(&mut s, |w| {
        w.rows(EMB, &[0, 1, 100, 100]).rows(EMB, &[101, 2]);
    })
    .unwrap();
    assert_eq!(s.table(EMB).unwrap().len(), 10);
    // Pooled pulls are bounded the same way.
    let e = pull(&mut s, |w| {
        w.pooled(EMB, &[0, 1, 2], &[3, 999]);
    })
    .unwrap_err();
    assert!(matches!(e, PsError::TableFull(_)), "{e}");
    // Known keys are still served.
    pull(&mut s, |w| {
        w.rows(EMB, &first).pooled(EMB, &[0, 2], &[100, 101]);
    })
    .unwrap();
}

#[test]
fn nan_and_infinite_gradients_are_refused_and_change_nothing() {
    let mut s = shard(ShardConfig::default());
    pull(&mut s, |w| {
        w.rows(EMB, &[1, 2]);
    })
    .unwrap();
    let before = snapshot(&s);
    let good = vec![0.5f32; DIM];
    let dense_ok = vec![0.1f32; DENSE];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut g = good.clone();
        g[2] = bad;
        // A good dense item first: it must not be applied either.
        let e = push(&mut s, |w| {
            w.dense(W, &dense_ok)
                .rows(EMB, DIM as u32, &[1, 2], &[good.clone(), g].concat());
        })
        .unwrap_err();
        assert_eq!(e, PsError::NonFinite { var: EMB }, "{bad}");
        let mut d = dense_ok.clone();
        d[7] = bad;
        let e = push(&mut s, |w| {
            w.dense(W, &d);
        })
        .unwrap_err();
        assert_eq!(e, PsError::NonFinite { var: W }, "{bad}");
        // Pooled gradients too.
        let e = push(&mut s, |w| {
            w.pooled(EMB, DIM as u32, &[0, 1], &[1], &g_of(bad));
        })
        .unwrap_err();
        assert_eq!(e, PsError::NonFinite { var: EMB });
    }
    // Two finite gradients whose sum overflows are refused too.
    let big = vec![f32::MAX; DIM];
    let e = push(&mut s, |w| {
        w.rows(EMB, DIM as u32, &[1, 1], &[big.clone(), big].concat());
    })
    .unwrap_err();
    assert_eq!(e, PsError::NonFinite { var: EMB });
    assert_eq!(snapshot(&s), before, "a refused push changed the shard");
    assert_eq!(s.global_step(), 0, "a refused push completed a step");
    // The accumulators were emptied: a good push applies only itself.
    push(&mut s, |w| {
        w.rows(EMB, DIM as u32, &[1], &good);
    })
    .unwrap();
    assert_eq!(s.global_step(), 1);
    assert_ne!(snapshot(&s), before);
}

#[test]
fn a_refused_push_gives_back_the_update_counts_of_rows_it_would_have_updated_directly() {
    let mut s = shard(ShardConfig {
        optimizer: OptimizerConfig::adam(0.1),
        ..ShardConfig::default()
    });
    pull(&mut s, |w| {
        w.rows(EMB, &[1, 2, 3]);
    })
    .unwrap();
    // Two steps on, so a counted update would move the rows' access step
    // as well as their update count.
    for _ in 0..2 {
        push(&mut s, |w| {
            w.rows(EMB, DIM as u32, &[3], &g_of(0.5));
        })
        .unwrap();
    }
    let before = snapshot(&s);
    let mut d = vec![0.1f32; DENSE];
    d[9] = f32::NAN;
    // The rows item is finite, with unique keys (it goes straight to the
    // rows); the dense item after it is not.
    let e = push(&mut s, |w| {
        w.rows(EMB, DIM as u32, &[2, 1], &[g_of(0.5), g_of(0.25)].concat())
            .dense(W, &d);
    })
    .unwrap_err();
    assert_eq!(e, PsError::NonFinite { var: W });
    assert_eq!(snapshot(&s), before, "a refused push changed the shard");
    // The same rows item alone is applied, once.
    let mut twin = shard(ShardConfig {
        optimizer: OptimizerConfig::adam(0.1),
        ..ShardConfig::default()
    });
    assert!(twin.restore(&mut before.as_slice()).is_ok());
    for t in [&mut s, &mut twin] {
        push(t, |w| {
            w.rows(EMB, DIM as u32, &[2, 1], &[g_of(0.5), g_of(0.25)].concat());
        })
        .unwrap();
    }
    assert_eq!(snapshot(&s), snapshot(&twin));
}

fn g_of(x: f32) -> Vec<f32> {
    let mut g = vec![0.0; DIM];
    g[0] = x;
    g
}

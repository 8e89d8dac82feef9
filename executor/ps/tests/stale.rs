//! Pushes applied with what their worker pulled: the staleness-aware rate
//! and DC-ASGD through `PsShard::handle_pull_from` / `handle_push_from`.

use starwire_ps::{
    Init, OptimizerConfig, OptimizerKind, PsShard, Pulled, ShardConfig, StalenessLr, VarDef,
    VarKind,
};
use starwire_wire::ps::{Limits, PullReply, PullRequestWriter, PullResponse, PushRequestWriter};

const EMB: u32 = 1;
const DENSE: u32 = 2;

fn shard(optimizer: OptimizerConfig) -> PsShard {
    let vars = [
        VarDef {
            id: EMB,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 2 },
            init: Init::Uniform { scale: 0.1 },
        },
        VarDef {
            id: DENSE,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![2] },
            init: Init::GlorotUniform,
        },
    ];
    let cfg = ShardConfig {
        seed: 3,
        optimizer,
        ..ShardConfig::default()
    };
    PsShard::new(0, &vars, cfg)
}

/// Worker `w` pulls key 7 and the dense variable; the values of both.
fn pull(s: &mut PsShard, w: Option<u32>) -> Vec<Vec<f32>> {
    let mut req = Vec::new();
    PullRequestWriter::new(&mut req)
        .rows(EMB, &[7])
        .dense(DENSE);
    let mut out = Vec::new();
    s.handle_pull_from(w, &req, &mut out).unwrap();
    let r = PullResponse::parse(&out, &Limits::default()).unwrap();
    r.items()
        .map(|i| match i {
            PullReply::Dense { data, .. }
            | PullReply::Rows { data, .. }
            | PullReply::Pooled { data, .. } => data.to_vec(),
        })
        .collect()
}

/// Worker `w` pushes gradient `g` to key 7 and to the dense variable.
fn push(s: &mut PsShard, w: Option<u32>, g: [f32; 2]) {
    let mut req = Vec::new();
    PushRequestWriter::new(&mut req, true)
        .rows(EMB, 2, &[7], &g)
        .dense(DENSE, &g);
    s.handle_push_from(w, &req, &mut Vec::new()).unwrap();
}

fn now(s: &PsShard) -> Vec<Vec<f32>> {
    vec![
        s.table(EMB).unwrap().get(7).unwrap().to_vec(),
        s.dense(DENSE).unwrap().values().to_vec(),
    ]
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .all(|(x, y)| (x - y).abs() < 1e-6)
}

#[test]
fn a_push_stale_by_two_updates_takes_half_the_rate() {
    let opt = OptimizerConfig {
        staleness_lr: StalenessLr::Linear,
        ..OptimizerConfig::sgd(1.0)
    };
    let mut s = shard(opt);
    let v0 = pull(&mut s, Some(0));
    pull(&mut s, Some(1));
    pull(&mut s, Some(2));
    // Staleness 0 and 1: the full rate.
    push(&mut s, Some(0), [1.0, -1.0]);
    push(&mut s, Some(1), [1.0, -1.0]);
    // Staleness 2: half.
    push(&mut s, Some(2), [1.0, -1.0]);
    let moved = |v: &[Vec<f32>], d: f32| -> Vec<Vec<f32>> {
        v.iter().map(|r| vec![r[0] - d, r[1] + d]).collect()
    };
    assert!(close(&now(&s), &moved(&v0, 2.5)), "{:?} {v0:?}", now(&s));
    // Worker 2 pulls again: its next push is fresh. A push of no known
    // worker takes the full rate too.
    pull(&mut s, Some(2));
    push(&mut s, Some(2), [1.0, -1.0]);
    push(&mut s, None, [1.0, -1.0]);
    assert!(close(&now(&s), &moved(&v0, 4.5)), "{:?}", now(&s));
}

#[test]
fn dc_asgd_compensates_a_push_with_its_workers_pulled_values() {
    let opt = OptimizerConfig::with_kind(OptimizerKind::DcAsgd, 0.5);
    let mut s = shard(opt);
    let v0 = pull(&mut s, Some(0));
    pull(&mut s, Some(1));
    push(&mut s, Some(0), [1.0, -0.5]);
    let v1 = now(&s);
    let slots1: Vec<Vec<f32>> = vec![
        s.table(EMB).unwrap().slots(7).unwrap().to_vec(),
        s.dense(DENSE).unwrap().slots().to_vec(),
    ];
    // Worker 1's gradient was computed on v0; the shard holds v1.
    push(&mut s, Some(1), [0.5, 0.25]);
    let mut want = v1.clone();
    for (j, (w, sl)) in want.iter_mut().zip(slots1).enumerate() {
        let mut sl = sl;
        let pulled = Pulled {
            staleness: Some(1),
            values: Some(&v0[j]),
        };
        opt.apply_stale(w, &mut sl, &[0.5, 0.25], 2, 1, pulled);
    }
    assert!(close(&now(&s), &want), "{:?} {want:?}", now(&s));
    // Without the record (an unknown sender) the same push is Adagrad's:
    // the compensation made a difference.
    let mut t = shard(opt);
    pull(&mut t, Some(0));
    push(&mut t, Some(0), [1.0, -0.5]);
    assert!(close(&now(&t), &v1));
    push(&mut t, None, [0.5, 0.25]);
    assert!(!close(&now(&s), &now(&t)), "{:?}", now(&t));
}

/// A DC-ASGD shard with frequency filter `filter_freq`, keys 1..=12
/// pulled once by no known worker (with `filter_freq` 2 that admits them
/// on their next pull).
fn dc_shard(filter_freq: u32) -> PsShard {
    let cfg = ShardConfig {
        seed: 5,
        optimizer: OptimizerConfig::with_kind(OptimizerKind::DcAsgd, 0.5),
        filter_freq,
        ..ShardConfig::default()
    };
    let vars = [VarDef {
        id: EMB,
        name: "emb".into(),
        kind: VarKind::Embedding { dim: 3 },
        init: Init::Uniform { scale: 0.1 },
    }];
    let mut s = PsShard::new(0, &vars, cfg);
    pull_keys(&mut s, None, &(1..=12).collect::<Vec<_>>());
    s
}

/// How a worker's pull is recorded.
#[derive(Clone, Copy)]
enum Reply {
    /// `handle_pull_from`: values copied from the reply.
    Copied,
    /// `handle_pull_shared`, the reply attached as it is (aligned): values
    /// read from it.
    Shared,
    /// `handle_pull_shared`, the reply attached one byte off alignment:
    /// values copied out of it.
    Misaligned,
}

fn pull_keys(s: &mut PsShard, w: Option<u32>, keys: &[u64]) {
    pull_keys_as(s, w, keys, Reply::Copied);
}

fn pull_keys_as(s: &mut PsShard, w: Option<u32>, keys: &[u64], how: Reply) {
    let mut req = Vec::new();
    PullRequestWriter::new(&mut req).rows(EMB, keys);
    let mut out = Vec::new();
    match (how, w) {
        (Reply::Copied, _) | (_, None) => s.handle_pull_from(w, &req, &mut out).unwrap(),
        (Reply::Shared, Some(w)) => {
            s.handle_pull_shared(w, &req, &mut out).unwrap();
            s.attach_pull_reply(w, &bytes::Bytes::from(out));
        }
        (Reply::Misaligned, Some(w)) => {
            s.handle_pull_shared(w, &req, &mut out).unwrap();
            let mut off = vec![0u8];
            off.extend_from_slice(&out);
            let reply = bytes::Bytes::from(off).slice(1..);
            s.attach_pull_reply(w, &reply);
            // The values were copied out of it.
            assert!(reply.is_unique());
        }
    }
}

fn push_keys(s: &mut PsShard, w: Option<u32>, keys: &[u64]) {
    let g: Vec<f32> = keys
        .iter()
        .flat_map(|&k| [k as f32 * 0.1, -0.3, 1.0 / k as f32])
        .collect();
    let mut req = Vec::new();
    PushRequestWriter::new(&mut req, true).rows(EMB, 3, keys, &g);
    s.handle_push_from(w, &req, &mut Vec::new()).unwrap();
}

/// Every row's weights and slots, as bits.
fn bits(s: &PsShard) -> Vec<u32> {
    let t = s.table(EMB).unwrap();
    (1..=12)
        .flat_map(|k| t.get(k).unwrap().iter().chain(t.slots(k).unwrap()))
        .map(|x| x.to_bits())
        .collect()
}

/// Three workers' pulls and pushes; `known` false sends the pushes as
/// no known worker's.
fn run(s: &mut PsShard, known: bool) {
    run_as(s, known, Reply::Copied);
}

fn run_as(s: &mut PsShard, known: bool, how: Reply) {
    let pull_keys = |s: &mut PsShard, w, keys: &[u64]| pull_keys_as(s, w, keys, how);
    let by = |w: u32| known.then_some(w);
    let a: Vec<u64> = (1..=8).collect();
    let b: Vec<u64> = (4..=12).collect();
    pull_keys(s, Some(0), &a);
    pull_keys(s, Some(1), &b);
    pull_keys(s, Some(2), &[9, 2, 9]);
    // In pull order (matched by position), out of order (by key), a key
    // pulled twice (its first pull), a key not pulled.
    push_keys(s, by(0), &a);
    push_keys(s, by(1), &b.iter().rev().copied().collect::<Vec<_>>());
    push_keys(s, by(2), &[9, 2, 11]);
    // Two pulls before one push: both are kept.
    pull_keys(s, Some(0), &[1, 2]);
    push_keys(s, by(1), &[5, 6]);
    pull_keys(s, Some(0), &[3, 2]);
    push_keys(s, by(0), &[1, 2, 3]);
}

#[test]
fn a_shared_reply_is_held_until_the_push_is_applied() {
    let mut s = dc_shard(0);
    let mut req = Vec::new();
    PullRequestWriter::new(&mut req).rows(EMB, &[1, 2, 3]);
    let mut out = Vec::new();
    s.handle_pull_shared(0, &req, &mut out).unwrap();
    let reply = bytes::Bytes::from(out);
    s.attach_pull_reply(0, &reply);
    assert!(
        !reply.is_unique(),
        "the record reads the values from the reply"
    );
    push_keys(&mut s, Some(0), &[1, 2, 3]);
    assert!(reply.is_unique(), "the applied push used the record up");
}

#[test]
fn dc_asgd_rows_recorded_from_the_reply_update_as_rows_looked_up() {
    // Without a filter a rows pull is recorded from its request and
    // reply; with one, from the table. The updates must be the same.
    let (mut copied, mut looked_up) = (dc_shard(0), dc_shard(2));
    run(&mut copied, true);
    run(&mut looked_up, true);
    assert_eq!(bits(&copied), bits(&looked_up));
    // The records made a difference: pushes of no known worker update
    // otherwise.
    let mut plain = dc_shard(0);
    run(&mut plain, false);
    assert_ne!(bits(&copied), bits(&plain));
    // Recorded by their place in a reply attached as it leaves (a network
    // server's), read from it or, misaligned, copied out of it: the same.
    for how in [Reply::Shared, Reply::Misaligned] {
        let mut shared = dc_shard(0);
        run_as(&mut shared, true, how);
        assert_eq!(bits(&copied), bits(&shared));
    }
}

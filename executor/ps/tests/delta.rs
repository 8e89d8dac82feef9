//! Incremental checkpoints: a delta applied onto its base gives the shard
//! the delta was taken from, byte for byte; a delta holds only the rows
//! touched since its base; bad deltas are refused and change nothing.

use starwire_ps::delta::{DeltaHeader, TouchedRows};
use starwire_ps::{CheckpointError, Init, OptimizerConfig, PsShard, ShardConfig, VarDef, VarKind};
use starwire_wire::ps::{Limits, PullRequestWriter, PushRequestWriter};

fn vars() -> Vec<VarDef> {
    vec![
        VarDef {
            id: 1,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 4 },
            init: Init::Normal { std: 0.05 },
        },
        VarDef {
            id: 2,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![8] },
            init: Init::Uniform { scale: 0.2 },
        },
    ]
}

fn cfg() -> ShardConfig {
    ShardConfig {
        seed: 5,
        optimizer: OptimizerConfig::adam(0.01),
        filter_freq: 2,
        ..ShardConfig::default()
    }
}

/// `steps` training steps on keys from `lo`, each request recorded.
fn train(s: &mut PsShard, touched: &mut TouchedRows, lo: u64, steps: u64) {
    let (mut req, mut out) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let keys: Vec<u64> = (0..6).map(|i| lo + (step * 5 + i * i) % 30).collect();
        PullRequestWriter::new(&mut req).rows(1, &keys).dense(2);
        s.handle_pull(&req, &mut out).unwrap();
        touched.record_pull(s, &req);
        let grads: Vec<f32> = (0..keys.len() * 4)
            .map(|i| (i as f32 - 9.0) * 0.01)
            .collect();
        PushRequestWriter::new(&mut req, true)
            .rows(1, 4, &keys, &grads)
            .dense(2, &[0.1; 8]);
        s.handle_push(&req, &mut out).unwrap();
        touched.record_push(s, &req);
    }
}

fn save(s: &PsShard) -> Vec<u8> {
    let mut b = Vec::new();
    s.save(&mut b).unwrap();
    b
}

#[test]
fn a_delta_on_its_base_is_the_shard_it_was_taken_from() {
    let mut s = PsShard::new(0, &vars(), cfg());
    let mut touched = TouchedRows::new(Limits::default());
    train(&mut s, &mut touched, 1, 12);
    let base = save(&s);
    let base_step = s.global_step();
    touched.clear();
    // Later steps touch some of the old keys and new ones.
    train(&mut s, &mut touched, 20, 8);
    let mut delta = Vec::new();
    s.save_delta(base_step, &touched, &mut delta).unwrap();
    let full = save(&s);
    // Only the touched rows: smaller than the full checkpoint.
    assert!(
        delta.len() < full.len(),
        "{} vs {}",
        delta.len(),
        full.len()
    );
    let h = DeltaHeader::parse(&delta).unwrap();
    assert_eq!((h.step, h.base, h.shard_index), (20, base_step, 0));

    let mut r = PsShard::new(0, &vars(), cfg());
    r.restore(&mut base.as_slice()).unwrap();
    r.apply_delta(&mut delta.as_slice()).unwrap();
    assert!(save(&r) == full, "base + delta differs from the shard");

    // A delta applies only onto its base.
    let mut wrong = PsShard::new(0, &vars(), cfg());
    let before = save(&wrong);
    let e = wrong.apply_delta(&mut delta.as_slice()).unwrap_err();
    assert!(matches!(e, CheckpointError::Mismatch(_)), "{e}");
    assert!(save(&wrong) == before, "a refused delta changed the shard");
    // A flipped byte is caught by the CRC.
    let mut bad = delta.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    let mut r = PsShard::new(0, &vars(), cfg());
    r.restore(&mut base.as_slice()).unwrap();
    assert!(matches!(
        r.apply_delta(&mut bad.as_slice()),
        Err(CheckpointError::Checksum { .. })
    ));
    assert!(matches!(
        DeltaHeader::parse(&delta[..20]),
        Err(CheckpointError::Truncated(_))
    ));
    assert!(matches!(
        DeltaHeader::parse(&base),
        Err(CheckpointError::BadMagic)
    ));
}

/// Nothing touched: the delta holds no row, and applies as a no-op.
#[test]
fn an_empty_delta_holds_no_rows() {
    let mut s = PsShard::new(0, &vars(), cfg());
    let mut touched = TouchedRows::new(Limits::default());
    train(&mut s, &mut touched, 1, 5);
    let base = save(&s);
    let mut delta = Vec::new();
    s.save_delta(s.global_step(), &TouchedRows::default(), &mut delta)
        .unwrap();
    let mut r = PsShard::new(0, &vars(), cfg());
    r.restore(&mut base.as_slice()).unwrap();
    r.apply_delta(&mut delta.as_slice()).unwrap();
    assert!(save(&r) == base);
}

/// Pulls and pushes, served or refused, record only the keys that have
/// rows: those of a variable the shard does not hold, past a full table,
/// held back by the frequency filter or pushed without a row are not kept
/// (a peer could otherwise grow the record without bound).
#[test]
fn refused_requests_record_only_keys_with_rows() {
    let mut s = PsShard::new(
        0,
        &vars(),
        ShardConfig {
            filter_freq: 0,
            max_rows: 8,
            ..cfg()
        },
    );
    let mut touched = TouchedRows::new(Limits::default());
    let (mut req, mut out) = (Vec::new(), Vec::new());
    let keys: Vec<u64> = (0..4).collect();
    PullRequestWriter::new(&mut req).rows(1, &keys);
    s.handle_pull(&req, &mut out).unwrap();
    touched.record_pull(&s, &req);
    assert_eq!(touched.len(), 4);
    // No variable 9 on this shard.
    PullRequestWriter::new(&mut req).rows(9, &[100, 101, 102]);
    assert!(s.handle_pull(&req, &mut out).is_err());
    touched.record_pull(&s, &req);
    assert_eq!(touched.len(), 4);
    // Past max_rows: refused, nothing made.
    let many: Vec<u64> = (1_000..1_100).collect();
    PullRequestWriter::new(&mut req).rows(1, &many);
    assert!(s.handle_pull(&req, &mut out).is_err());
    touched.record_pull(&s, &req);
    assert_eq!(touched.len(), 4);
    let grads = vec![0.1f32; many.len() * 4];
    PushRequestWriter::new(&mut req, true).rows(9, 4, &many, &grads);
    assert!(s.handle_push(&req, &mut out).is_err());
    touched.record_push(&s, &req);
    assert_eq!(touched.len(), 4);
    // Served: a push of keys with no row (ignored), and a pull of keys
    // the filter holds back, touch no row.
    PushRequestWriter::new(&mut req, true).rows(1, 4, &many, &grads);
    s.handle_push(&req, &mut out).unwrap();
    touched.record_push(&s, &req);
    assert_eq!(touched.len(), 4);
    let mut filtered = PsShard::new(
        0,
        &vars(),
        ShardConfig {
            filter_freq: 3,
            ..cfg()
        },
    );
    PullRequestWriter::new(&mut req).rows(1, &many);
    filtered.handle_pull(&req, &mut out).unwrap();
    let mut held_back = TouchedRows::new(Limits::default());
    held_back.record_pull(&filtered, &req);
    assert_eq!(held_back.len(), 0);
}

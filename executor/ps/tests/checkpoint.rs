//! Checkpoint round trips, corruption and atomic writes.

use starwire_ps::layout::ShardLayout;
use starwire_ps::{
    write_atomic, CheckpointError, Init, Manifest, OptimizerConfig, OptimizerKind, Position,
    PsShard, ShardConfig, VarDef, VarKind, WorkerProgress,
};
use starwire_wire::ps::{Limits, PullRequestWriter, PullResponse, PushRequestWriter};

fn vars() -> Vec<VarDef> {
    vec![
        VarDef {
            id: 1,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 8 },
            init: Init::Normal { std: 0.05 },
        },
        VarDef {
            id: 2,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![16] },
            init: Init::Uniform { scale: 0.2 },
        },
    ]
}

fn cfg() -> ShardConfig {
    cfg_with(OptimizerConfig::adam(0.01))
}

fn cfg_with(optimizer: OptimizerConfig) -> ShardConfig {
    ShardConfig {
        seed: 11,
        optimizer,
        filter_freq: 2,
        steps_to_live: 50,
        ..ShardConfig::default()
    }
}

/// A shard with rows, pending filter counters, Adam slots and a global step.
fn trained() -> PsShard {
    trained_with(cfg())
}

fn trained_with(cfg: ShardConfig) -> PsShard {
    let mut s = PsShard::new(3, &vars(), cfg);
    let (mut req, mut out) = (Vec::new(), Vec::new());
    for step in 0..20u64 {
        let keys: Vec<u64> = (0..10).map(|i| 1 + (step * 7 + i * i) % 40).collect();
        PullRequestWriter::new(&mut req).rows(1, &keys).dense(2);
        s.handle_pull(&req, &mut out).unwrap();
        let grads: Vec<f32> = (0..keys.len() * 8)
            .map(|i| (i as f32 - 30.0) * 0.01)
            .collect();
        PushRequestWriter::new(&mut req, true)
            .rows(1, 8, &keys, &grads)
            .dense(2, &[0.1; 16]);
        s.handle_push(&req, &mut out).unwrap();
    }
    // Seen once: pending in the frequency filter.
    PullRequestWriter::new(&mut req).rows(1, &[100, 101, 102]);
    s.handle_pull(&req, &mut out).unwrap();
    s
}

fn save(s: &PsShard) -> Vec<u8> {
    let mut b = Vec::new();
    s.save(&mut b).unwrap();
    b
}

fn pull_all(s: &mut PsShard) -> Vec<u8> {
    let (mut req, mut out) = (Vec::new(), Vec::new());
    let keys: Vec<u64> = (1..=45).chain(100..=102).collect();
    PullRequestWriter::new(&mut req)
        .rows(1, &keys)
        .pooled(1, &[0, 3, 10], &keys[..10])
        .dense(2);
    s.handle_pull(&req, &mut out).unwrap();
    PullResponse::parse(&out, &Limits::default()).unwrap();
    out
}

#[test]
fn save_restore_is_identical() {
    let s = trained();
    assert!(s.table(1).unwrap().pending_len() > 0);
    assert!(!s.table(1).unwrap().is_empty());
    let bytes = save(&s);
    let mut r = PsShard::new(3, &vars(), cfg());
    r.restore(&mut bytes.as_slice()).unwrap();
    assert_eq!(r.global_step(), s.global_step());
    let (a, b) = (s.table(1).unwrap(), r.table(1).unwrap());
    assert_eq!(a.len(), b.len());
    assert_eq!(a.stats(), b.stats());
    assert_eq!(a.pending_len(), b.pending_len());
    for k in (1..=45).chain(100..=102) {
        assert_eq!(a.get(k), b.get(k));
        assert_eq!(a.slots(k), b.slots(k));
    }
    assert_eq!(s.dense(2), r.dense(2));
    // Same bytes again, and the same answers (including filter admissions).
    assert_eq!(save(&r), bytes);
    let mut s = s;
    assert_eq!(pull_all(&mut s), pull_all(&mut r));
    assert_eq!(save(&s), save(&r));
}

#[test]
fn ftrl_adagrad_decay_and_dc_asgd_slots_round_trip() {
    let decay = OptimizerConfig {
        decay_step: 5,
        decay_rate: 0.5,
        ..OptimizerConfig::with_kind(OptimizerKind::AdagradDecay, 0.1)
    };
    let ftrl = OptimizerConfig {
        l1: 0.01,
        l2: 0.1,
        ftrl_beta: 1.0,
        ..OptimizerConfig::with_kind(OptimizerKind::Ftrl, 0.1)
    };
    let dc = OptimizerConfig::with_kind(OptimizerKind::DcAsgd, 0.1);
    for opt in [decay, ftrl, dc] {
        let s = trained_with(cfg_with(opt));
        let bytes = save(&s);
        let mut r = PsShard::new(3, &vars(), cfg_with(opt));
        r.restore(&mut bytes.as_slice()).unwrap();
        let (a, b) = (s.table(1).unwrap(), r.table(1).unwrap());
        let mut seen = 0;
        for k in 1..=45 {
            assert_eq!(a.slots(k), b.slots(k), "{:?}", opt.kind);
            if let Some(sl) = a.slots(k) {
                assert_eq!(sl.len(), 16, "two slots of width 8");
                // The second slot moved: z for FTRL, the decay count for
                // AdagradDecay (20 steps of 5), the moving average of g²
                // for DC-ASGD.
                seen += usize::from(sl[8..].iter().any(|&x| x != 0.0));
            }
        }
        assert!(seen > 0, "{:?}", opt.kind);
        assert_eq!(s.dense(2), r.dense(2));
        // A shard of another optimizer does not take the checkpoint.
        let mut other = PsShard::new(3, &vars(), cfg());
        assert!(matches!(
            other.restore(&mut bytes.as_slice()),
            Err(CheckpointError::Mismatch(_))
        ));
    }
}

#[test]
fn corrupt_and_truncated_checkpoints_are_errors() {
    let s = trained();
    let bytes = save(&s);
    let mut r = PsShard::new(3, &vars(), cfg());
    let fresh = save(&r);
    for cut in [0, 5, 15, 40, bytes.len() / 2, bytes.len() - 1] {
        let e = r.restore(&mut &bytes[..cut]).unwrap_err();
        assert!(
            matches!(
                e,
                CheckpointError::Truncated(_) | CheckpointError::Checksum { .. }
            ),
            "cut {cut}: {e}"
        );
    }
    let mut b = bytes.clone();
    b[100] ^= 0x40;
    assert!(matches!(
        r.restore(&mut b.as_slice()),
        Err(CheckpointError::Checksum { .. })
    ));
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(matches!(
        r.restore(&mut b.as_slice()),
        Err(CheckpointError::BadMagic)
    ));
    let mut b = bytes.clone();
    b[8] = 9;
    assert!(matches!(
        r.restore(&mut b.as_slice()),
        Err(CheckpointError::BadVersion(9))
    ));
    // Wrong shard index / wrong model.
    let mut other = PsShard::new(4, &vars(), cfg());
    assert!(matches!(
        other.restore(&mut bytes.as_slice()),
        Err(CheckpointError::Mismatch(_))
    ));
    let mut v = vars();
    v[1].kind = VarKind::Dense { shape: vec![17] };
    let mut other = PsShard::new(3, &v, cfg());
    assert!(matches!(
        other.restore(&mut bytes.as_slice()),
        Err(CheckpointError::Mismatch(_))
    ));
    // Nothing was changed by the failed restores.
    assert_eq!(save(&r), fresh);
}

#[test]
fn atomic_write_and_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let s = trained();
    let path = dir.path().join("shard-3.ckpt");
    write_atomic(&path, |w| s.save(w)).unwrap();
    let mut r = PsShard::new(3, &vars(), cfg());
    r.restore(&mut std::fs::File::open(&path).unwrap()).unwrap();
    assert_eq!(save(&r), save(&s));
    // A failing writer leaves the old file and no temporary behind.
    let err = write_atomic(&path, |w| {
        w.write_all(b"partial")?;
        Err(CheckpointError::Corrupt("injected".into()))
    });
    assert!(err.is_err());
    assert_eq!(std::fs::read(&path).unwrap(), save(&s));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

    let missing = dir.path().join("no-such-dir").join("x.ckpt");
    assert!(matches!(
        write_atomic(&missing, |w| s.save(w)),
        Err(CheckpointError::Io(_))
    ));

    let m = Manifest {
        format_version: starwire_ps::checkpoint::FORMAT_VERSION,
        global_step: s.global_step(),
        shard_count: 1,
        seed: 11,
        model: serde_json::json!({"model": "lr"}),
        shard_files: vec!["shard-3.ckpt".into()],
        workers: vec![WorkerProgress {
            worker: 0,
            epoch: 1,
            offset: 4096,
            steps: 20,
            examples: 86_016,
            deal_block: 4096,
            workers: Some(2),
        }],
        shard_steps: vec![s.global_step()],
    };
    let mpath = dir.path().join("manifest.json");
    write_atomic(&mpath, |w| Ok(w.write_all(m.to_json()?.as_bytes())?)).unwrap();
    let back = Manifest::from_json(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    assert_eq!(back, m);
    assert!(matches!(
        Manifest::from_json("{"),
        Err(CheckpointError::Manifest(_))
    ));
    // Without shard steps (an older manifest) it still reads; with the
    // wrong number of them it is corrupt.
    let mut old = serde_json::to_value(&m).unwrap();
    old.as_object_mut().unwrap().remove("shard_steps");
    let back = Manifest::from_json(&old.to_string()).unwrap();
    assert!(back.shard_steps.is_empty());
    // A position without its dealing block was dealt one at a time.
    let mut old = serde_json::to_value(&m).unwrap();
    old["workers"][0]
        .as_object_mut()
        .unwrap()
        .remove("deal_block");
    let back = Manifest::from_json(&old.to_string()).unwrap();
    assert_eq!(back.workers[0].deal_block, 1);
    // A position without its worker count was counted in shares not
    // known: the count is not checked.
    let mut old = serde_json::to_value(&m).unwrap();
    assert_eq!(old["workers"][0]["workers"], 2);
    old["workers"][0].as_object_mut().unwrap().remove("workers");
    let back = Manifest::from_json(&old.to_string()).unwrap();
    assert_eq!(back.workers[0].workers, None);
    // Nor is it written when not known.
    let s = back.to_json().unwrap();
    let again: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert!(again["workers"][0].get("workers").is_none(), "{s}");
    // A count of workers that has no such worker is corrupt.
    for n in [0u64, 1] {
        let mut bad = m.clone();
        bad.workers[0].worker = 1;
        bad.workers[0].workers = Some(n);
        let e = Manifest::from_json(&bad.to_json().unwrap()).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::Corrupt(w) if w.contains("which have no worker 1")),
            "{n}: {e}"
        );
    }
    let mut bad = m.clone();
    bad.shard_steps = vec![1, 2];
    assert!(matches!(
        Manifest::from_json(&bad.to_json().unwrap()),
        Err(CheckpointError::Corrupt(_))
    ));
    // A position with counts no run reaches (the manifest is plain JSON,
    // edited or damaged) is corrupt: the worker would resume from it.
    for (field, v) in [
        ("steps", WorkerProgress::MAX_STEPS + 1),
        ("steps", u64::MAX),
        ("examples", u64::MAX),
        ("epoch", u64::MAX),
    ] {
        let mut bad = serde_json::to_value(&m).unwrap();
        bad["workers"][0][field] = v.into();
        let e = Manifest::from_json(&bad.to_string()).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::Corrupt(w) if w.contains(field)),
            "{field} {v}: {e}"
        );
        let p = serde_json::to_vec(&bad["workers"][0]).unwrap();
        assert!(WorkerProgress::from_json(&p).is_err(), "{field} {v}");
    }
    assert_eq!(
        WorkerProgress::from_json(&serde_json::to_vec(&m.workers[0]).unwrap()).unwrap(),
        m.workers[0]
    );
    let mut bad = m.clone();
    bad.format_version = 7;
    assert!(matches!(
        Manifest::from_json(&bad.to_json().unwrap()),
        Err(CheckpointError::BadVersion(7))
    ));
}

/// Each worker's applied pushes go into the file (format 2), so a shard
/// restored from it acknowledges a restarted worker's replayed push
/// without applying it; a format 1 file, without them, still restores.
#[test]
fn worker_steps_round_trip_and_a_version_1_file_restores() {
    let mut s = trained();
    let (mut req, mut out) = (Vec::new(), Vec::new());
    PushRequestWriter::new(&mut req, true).dense(2, &[0.1; 16]);
    for _ in 0..3 {
        assert!(s.handle_worker_push(4, &req, &mut out).unwrap());
    }
    let bytes = save(&s);
    let mut r = PsShard::new(3, &vars(), cfg());
    r.restore(&mut bytes.as_slice()).unwrap();
    let applied: Vec<_> = r.applied_steps().applied().collect();
    assert_eq!(applied, vec![(4, Position { steps: 3, parts: 0 })]);
    assert_eq!(save(&r), bytes);
    r.handle_resume(4, 2).unwrap();
    let step = r.global_step();
    assert!(!r.handle_worker_push(4, &req, &mut out).unwrap());
    assert_eq!(r.global_step(), step, "acknowledged, not applied");
    assert!(r.handle_worker_push(4, &req, &mut out).unwrap());
    assert_eq!(r.global_step(), step + 1);

    // The same state as format 1: no worker record before the CRC.
    let mut v1 = bytes[..bytes.len() - 4 - (8 + 16)].to_vec();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    let crc = crc32c::crc32c(&v1);
    v1.extend_from_slice(&crc.to_le_bytes());
    let mut old = PsShard::new(3, &vars(), cfg());
    old.restore(&mut v1.as_slice()).unwrap();
    assert_eq!(old.global_step(), s.global_step());
    assert_eq!(old.applied_steps().applied().count(), 0);
    assert_eq!(pull_all(&mut old), pull_all(&mut s));
}

/// A shard file read without its model: its layout, and an empty shard of
/// that layout that restores the file to the same bytes; every cut of the
/// file is an error, not a panic.
#[test]
fn a_layout_read_from_the_file_alone_restores_it() {
    let s = trained();
    let bytes = save(&s);
    let l = ShardLayout::parse(&bytes).unwrap();
    assert_eq!((l.version, l.shard_index), (2, 3));
    assert_eq!(l.global_step, s.global_step());
    assert_eq!(l.optimizer, OptimizerKind::Adam);
    let ids: Vec<(u32, bool, usize)> = l
        .vars
        .iter()
        .map(|v| (v.id, v.embedding, v.width))
        .collect();
    assert_eq!(ids, vec![(1, true, 8), (2, false, 16)]);
    assert!(l.vars[0].rows > 0 && l.vars[0].pending > 0, "{l:?}");
    let mut r = l.shard().unwrap();
    r.restore(&mut bytes.as_slice()).unwrap();
    assert_eq!(save(&r), bytes);
    for cut in [0, 12, 40, bytes.len() / 2, bytes.len() - 1] {
        assert!(ShardLayout::parse(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

/// A table's width is a count the file gives when the shard is built from
/// the file's layout: restoring a table of the widest width and no rows
/// allocates no row (a row buffer of that width would be 48 GiB).
#[test]
fn a_wide_table_without_rows_restores_without_a_row_buffer() {
    let defs = [VarDef {
        id: 7,
        name: "wide".into(),
        kind: VarKind::Embedding {
            dim: u32::MAX as usize,
        },
        init: Init::Zeros,
    }];
    let cfg = ShardConfig {
        default_value_dim: 0,
        ..cfg()
    };
    let bytes = save(&PsShard::new(0, &defs, cfg));
    let l = ShardLayout::parse(&bytes).unwrap();
    assert_eq!((l.vars[0].width, l.vars[0].rows), (u32::MAX as usize, 0));
    let mut r = l.shard().unwrap();
    r.restore(&mut bytes.as_slice()).unwrap();
    assert_eq!(save(&r), bytes);
}

/// A worker's task index indexes the restored applied steps: an index
/// beyond `MAX_WORKER_INDEX` is refused, not a vector of 2^32 entries.
#[test]
fn a_worker_index_past_the_bound_is_refused() {
    use starwire_ps::checkpoint::MAX_WORKER_INDEX;
    let bytes = save(&PsShard::new(0, &[], cfg()));
    // The file ends with the worker count, its reserved word and the CRC.
    let mut b = bytes[..bytes.len() - 12].to_vec();
    for w in [u32::MAX, MAX_WORKER_INDEX + 1] {
        b.truncate(bytes.len() - 12);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&w.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&9u64.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        let e = ShardLayout::parse(&b).unwrap_err();
        assert!(matches!(e, CheckpointError::Corrupt(_)), "{e}");
        let mut s = PsShard::new(0, &[], cfg());
        let e = s.restore(&mut b.as_slice()).unwrap_err();
        assert!(matches!(e, CheckpointError::Corrupt(_)), "{e}");
    }
    // The bound itself restores.
    b.truncate(bytes.len() - 12);
    for v in [1, 0, MAX_WORKER_INDEX, 0] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&9u64.to_le_bytes());
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    let l = ShardLayout::parse(&b).unwrap();
    assert_eq!(
        l.workers,
        vec![(MAX_WORKER_INDEX, Position { steps: 9, parts: 0 })]
    );
}

/// The live requests bound the worker index as the reader does: a pull,
/// push or resume from a task index past `MAX_WORKER_INDEX` is refused
/// and changes nothing, and the bound itself is served.
#[test]
fn requests_from_a_worker_index_past_the_bound_are_refused() {
    use starwire_ps::checkpoint::MAX_WORKER_INDEX;
    use starwire_ps::PsError;
    let mut s = trained_with(cfg_with(OptimizerConfig::with_kind(
        OptimizerKind::DcAsgd,
        0.1,
    )));
    let before = save(&s);
    let (mut req, mut out) = (Vec::new(), Vec::new());
    let keys = [1u64, 2, 3];
    for w in [MAX_WORKER_INDEX + 1, u32::MAX] {
        PullRequestWriter::new(&mut req).rows(1, &keys);
        let e = s.handle_pull_from(Some(w), &req, &mut out).unwrap_err();
        assert!(matches!(e, PsError::WorkerIndex(x) if x == w), "{e}");
        PushRequestWriter::new(&mut req, true).rows(1, 8, &keys, &[0.1; 24]);
        let e = s.handle_worker_push(w, &req, &mut out).unwrap_err();
        assert!(matches!(e, PsError::WorkerIndex(x) if x == w), "{e}");
        let e = s.handle_push_from(Some(w), &req, &mut out).unwrap_err();
        assert!(matches!(e, PsError::WorkerIndex(x) if x == w), "{e}");
        let e = s.handle_resume(w, 0).unwrap_err();
        assert!(matches!(e, PsError::WorkerIndex(x) if x == w), "{e}");
    }
    assert_eq!(save(&s), before);
    PullRequestWriter::new(&mut req).rows(1, &keys);
    s.handle_pull_from(Some(MAX_WORKER_INDEX), &req, &mut out)
        .unwrap();
    PushRequestWriter::new(&mut req, true).rows(1, 8, &keys, &[0.1; 24]);
    assert!(s
        .handle_worker_push(MAX_WORKER_INDEX, &req, &mut out)
        .unwrap());
}

/// The header alone names the shard and its step, as the whole file does.
#[test]
fn a_header_read_alone_names_the_shard_and_step() {
    let s = trained();
    let b = save(&s);
    let h = starwire_ps::checkpoint::read_header(&mut &b[..]).unwrap();
    assert_eq!(h.version, starwire_ps::checkpoint::FORMAT_VERSION);
    assert_eq!(h.shard_index, 3);
    assert_eq!(h.global_step, s.global_step());
    assert_eq!(h.global_step, ShardLayout::parse(&b).unwrap().global_step);
    assert!(matches!(
        starwire_ps::checkpoint::read_header(&mut &b[..20]),
        Err(CheckpointError::Truncated(_))
    ));
    let mut bad = b.clone();
    bad[0] ^= 1;
    assert!(matches!(
        starwire_ps::checkpoint::read_header(&mut &bad[..]),
        Err(CheckpointError::BadMagic)
    ));
}

/// `create_dir_durable` creates every missing directory down to the one
/// asked for, and leaves one that exists as it is.
#[test]
fn durable_directories_are_created_down_to_the_one_asked_for() {
    let root = tempfile::tempdir().unwrap();
    let deep = root.path().join("a").join("b").join("c");
    starwire_ps::create_dir_durable(&deep).unwrap();
    assert!(deep.is_dir());
    std::fs::write(deep.join("f"), b"x").unwrap();
    starwire_ps::create_dir_durable(&deep).unwrap();
    assert_eq!(std::fs::read(deep.join("f")).unwrap(), b"x");
    let file = root.path().join("plain");
    std::fs::write(&file, b"").unwrap();
    assert!(starwire_ps::create_dir_durable(&file.join("under")).is_err());
}

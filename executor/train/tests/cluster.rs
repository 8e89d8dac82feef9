//! End-to-end runs of the local loopback cluster: PS reactors and workers
//! as threads, real TCP connections.

use starwire_graph::{ModelKind, Protocol};
use starwire_ps::OptimizerKind;
use starwire_train::source::DataSource;
use starwire_train::{run_local, TrainConfig};

fn small() -> TrainConfig {
    TrainConfig {
        train_examples: 16_384,
        eval_examples: 4_096,
        batch_size: 256,
        epochs: 1,
        lr: 0.3,
        ps_reactors: 2,
        ..TrainConfig::default()
    }
}

#[test]
fn lr_learns_on_the_local_cluster() {
    let r = run_local(&TrainConfig {
        epochs: 2,
        train_examples: 40_000,
        ..small()
    })
    .unwrap();
    assert_eq!(r.samples, 80_000);
    assert_eq!(r.workers, 2);
    assert_eq!(r.shards, 2);
    let oracle = r.oracle_auc.unwrap();
    assert!(r.auc > 0.70, "auc {} (oracle {oracle})", r.auc);
    assert!(oracle - r.auc < 0.05, "auc {} oracle {oracle}", r.auc);
    assert_eq!(r.intervals.len(), 1, "one interval (epoch 1 of 2)");
    // Every shard saw every worker step complete (2 workers).
    for s in &r.shard_stats {
        assert_eq!(s["global_step"].as_u64().unwrap(), r.steps, "{s}");
    }
    // One reactor per shard, one network thread per worker; the default
    // config pins and polls nothing.
    let reactors: Vec<(&str, usize)> = r
        .reactors
        .iter()
        .map(|x| (x.role.job_name(), x.index))
        .collect();
    assert_eq!(
        reactors,
        [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    );
    assert!(r.reactors.iter().all(|x| x.cpu.is_none() && !x.polling));
}

/// The two partitionings compute the same thing: with one worker the run
/// is deterministic, so the losses agree to float tolerance. (Bytes are not
/// compared: `lr` looks up each field in its own table, one key per example,
/// so lite has nothing to pool and moves a `[B, D]` partial sum per field
/// and shard where robust moves the batch's unique rows.)
#[test]
fn star_server_and_lite_agree() {
    for model in [ModelKind::Lr, ModelKind::Wdl] {
        let base = TrainConfig {
            workers: 1,
            model,
            steps: Some(30),
            optimizer: OptimizerKind::Sgd,
            lr: 0.05,
            ..small()
        };
        let robust = run_local(&base).unwrap();
        let lite = run_local(&TrainConfig {
            protocol: Protocol::StarServerLite,
            ..base.clone()
        })
        .unwrap();
        assert_eq!(robust.steps, 30);
        assert_eq!(lite.steps, 30);
        let d = (robust.final_train_loss - lite.final_train_loss).abs();
        assert!(
            d < 1e-4 * robust.final_train_loss.abs().max(1.0),
            "{model:?}: losses {} vs {}",
            robust.final_train_loss,
            lite.final_train_loss
        );
        assert!((robust.logloss - lite.logloss).abs() < 1e-4, "{model:?}");
    }
}

#[test]
fn fusion_sends_one_pull_and_one_push_per_shard() {
    let base = TrainConfig {
        workers: 1,
        model: ModelKind::Wdl,
        steps: Some(10),
        ..small()
    };
    let fused = run_local(&base).unwrap();
    let unfused = run_local(&TrainConfig {
        tensor_fuse: false,
        ..base.clone()
    })
    .unwrap();
    // Fused: per step, one pull and one push to each of the 2 shards.
    assert!(
        (fused.requests_per_step - 4.0).abs() < 1e-9,
        "{}",
        fused.requests_per_step
    );
    // Unfused: one request per tensor (35 variables, 27 lookups split
    // over shards), many more.
    assert!(
        unfused.requests_per_step > 40.0,
        "{}",
        unfused.requests_per_step
    );
    // Same computation either way.
    assert!((fused.final_train_loss - unfused.final_train_loss).abs() < 1e-6);
}

#[test]
fn sync_mode_runs_equal_steps_with_a_barrier() {
    let r = run_local(&TrainConfig {
        sync: true,
        workers: 3,
        ..small()
    })
    .unwrap();
    // 16384 / 3 = 5461 examples each (the smallest share), 22 batches of
    // 256 each, the last partial.
    assert_eq!(r.steps, 3 * 22);
    for s in &r.shard_stats {
        assert_eq!(s["global_step"].as_u64().unwrap(), 66);
    }
    assert_eq!(
        (r.examples_trained, r.examples_planned),
        (16_384, Some(16_384))
    );
    // Three epochs: the cap is per epoch, not cut short overall.
    let r = run_local(&TrainConfig {
        sync: true,
        workers: 2,
        epochs: 3,
        train_examples: 1000,
        ..small()
    })
    .unwrap();
    assert_eq!(r.samples, 3000);
    assert_eq!(r.intervals.len(), 2);
}

#[test]
fn checkpoint_restores_the_saved_state() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        checkpoint_dir: Some(dir.path().to_owned()),
        optimizer: OptimizerKind::Adam,
        lr: 0.01,
        ..small()
    };
    let first = run_local(&cfg).unwrap();
    assert_eq!(first.checkpoint.as_deref(), Some(dir.path()));
    assert!(first.resumed_from_step.is_none());
    let files: Vec<_> = (0..first.shards)
        .map(|s| std::fs::read(dir.path().join(format!("shard-{s:04}.ckpt"))).unwrap())
        .collect();
    // Resume: the data is already consumed, so no step runs; the restored
    // state is evaluated and saved again, byte for byte the same.
    let second = run_local(&cfg).unwrap();
    assert_eq!(second.resumed_from_step, Some(first.steps));
    assert_eq!(second.steps, 0);
    assert!((second.auc - first.auc).abs() < 1e-12);
    for (s, before) in files.iter().enumerate() {
        let after = std::fs::read(dir.path().join(format!("shard-{s:04}.ckpt"))).unwrap();
        assert!(*before == after, "shard {s} differs after restore");
    }
    // A different cluster shape is refused.
    let e = run_local(&TrainConfig {
        ps_reactors: 1,
        ..cfg
    })
    .unwrap_err();
    assert!(e.to_string().contains("shards"), "{e}");
}

/// `starwire ps` refuses a checkpoint of another shard count, as the local
/// cluster does: restoring 2 of 4 shards would lose the rows of the others.
#[test]
fn a_ps_task_refuses_a_checkpoint_of_another_shard_count() {
    let dir = tempfile::tempdir().unwrap();
    let m = starwire_ps::Manifest {
        format_version: starwire_ps::checkpoint::FORMAT_VERSION,
        global_step: 64,
        shard_count: 4,
        seed: 1,
        model: serde_json::json!({}),
        shard_files: (0..4)
            .map(|s| format!("steps/64/shard-{s:04}.ckpt"))
            .collect(),
        workers: Vec::new(),
        shard_steps: vec![64; 4],
    };
    std::fs::write(dir.path().join("manifest.json"), m.to_json().unwrap()).unwrap();
    let cfg = TrainConfig {
        checkpoint_dir: Some(dir.path().to_owned()),
        ps: 1,
        ps_reactors: 2,
        ..small()
    };
    // Stopped already: a task that went on would restore, checkpoint and end.
    let e = stopped_ps_task_error(&cfg);
    assert!(
        e.contains("the checkpoint has 4 shards, this cluster 2"),
        "{e}"
    );
}

/// The error of PS task 0 of `cfg`, started already stopped (a task that
/// went past its checks would bind, restore, checkpoint and end).
fn stopped_ps_task_error(cfg: &TrainConfig) -> String {
    let stop = std::sync::atomic::AtomicBool::new(true);
    starwire_train::run_ps_task(
        cfg,
        0,
        "127.0.0.1:0".parse().unwrap(),
        starwire_train::cluster::PsLifetime {
            exit_when_done: false,
            stop: &stop,
        },
    )
    .unwrap_err()
    .to_string()
}

/// An optimizer hyper-parameter out of range, set through the library
/// (the command line checks its own flags), is refused before a PS binds
/// or a shard is built: the local cluster, a PS task and `make_shard` each
/// answer a configuration error naming the field.
#[test]
fn an_optimizer_out_of_range_is_refused_by_every_entry() {
    let zero_acc = TrainConfig {
        optimizer_params: starwire_ps::OptimizerConfig {
            initial_accumulator: 0.0,
            ..starwire_ps::OptimizerConfig::adagrad(0.05)
        },
        ..small()
    };
    let e = run_local(&zero_acc).unwrap_err();
    assert!(matches!(e, starwire_train::TrainError::Config(_)), "{e}");
    assert!(
        e.to_string()
            .contains("optimizer initial_accumulator must be a finite number above 0, got 0"),
        "{e}"
    );
    let negative_lr = TrainConfig {
        lr: -0.1,
        ..small()
    };
    let e = stopped_ps_task_error(&negative_lr);
    assert!(e.contains("optimizer lr must be"), "{e}");
    let adam = TrainConfig {
        optimizer: OptimizerKind::Adam,
        optimizer_params: starwire_ps::OptimizerConfig {
            beta1: 1.0,
            ..starwire_ps::OptimizerConfig::adam(0.05)
        },
        ..small()
    };
    let plan = starwire_train::cluster::plan(&adam).unwrap();
    let e = starwire_train::cluster::make_shard(&adam, &plan, 0, None).unwrap_err();
    assert!(
        e.to_string()
            .contains("optimizer beta1 must be in [0, 1), got 1"),
        "{e}"
    );
}

/// `--checkpoint-every-steps` with `--sync`: each checkpoint's shard files
/// hold exactly the steps it names, every worker's progress is recorded,
/// old ones are removed, and a run resumes from one.
#[test]
fn checkpoints_during_a_sync_run_are_consistent_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 16 384 examples, 2 workers, batches of 256: 32 steps each, global
    // step 64 at the end; capped at 48, with a checkpoint every 16.
    let cfg = TrainConfig {
        sync: true,
        checkpoint_dir: Some(d.to_owned()),
        checkpoint_every_steps: Some(16),
        ..small()
    };
    // No evaluation: its pulls would add rows after the last step.
    let first = run_local(&TrainConfig {
        steps: Some(48),
        eval_examples: 0,
        ..cfg.clone()
    })
    .unwrap();
    assert_eq!(first.steps, 48);
    // Checkpoints at 16, 32 and 48; the latest two are kept.
    let steps = d.join("steps");
    let mut kept: Vec<String> = std::fs::read_dir(&steps)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    kept.sort();
    assert_eq!(kept, ["32", "48"]);
    // Taken at global step 48, the last step: the same state the end of
    // the run wrote, byte for byte, on every shard.
    for s in 0..first.shards {
        let mid = std::fs::read(steps.join("48").join(format!("shard-{s:04}.ckpt"))).unwrap();
        let end = std::fs::read(d.join(format!("shard-{s:04}.ckpt"))).unwrap();
        assert!(
            mid == end,
            "shard {s}: the checkpoint at 48 is not the state at 48"
        );
    }
    for w in 0..2 {
        let p: serde_json::Value = serde_json::from_slice(
            &std::fs::read(steps.join("48").join(format!("worker-{w:04}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(p["steps"], 24, "{p}");
        assert_eq!(p["offset"], 24 * 256, "{p}");
        assert_eq!(p["examples"], 24 * 256, "{p}");
    }
    // Resume from the checkpoint at 32, as after a crash right after it.
    let mpath = d.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["global_step"] = 32.into();
    m["shard_steps"] = serde_json::json!([32, 32]);
    m["shard_files"] = serde_json::json!(["steps/32/shard-0000.ckpt", "steps/32/shard-0001.ckpt"]);
    m["workers"] = serde_json::json!([
        {"worker": 0, "epoch": 0, "offset": 4096, "steps": 16, "examples": 4096},
        {"worker": 1, "epoch": 0, "offset": 4096, "steps": 16, "examples": 4096},
    ]);
    std::fs::write(&mpath, m.to_string()).unwrap();
    let second = run_local(&cfg).unwrap();
    assert_eq!(second.resumed_from_step, Some(32));
    assert_eq!(second.steps, 32, "each worker runs its 16 steps left");
    assert_eq!(second.samples, 32 * 256);
    // What the model holds: the checkpoint's examples and those since.
    assert_eq!(
        (second.examples_trained, second.examples_planned),
        (16_384, Some(16_384))
    );
    // A file outside the checkpoint directory is refused.
    m["shard_files"] = serde_json::json!(["../x", "steps/32/shard-0001.ckpt"]);
    std::fs::write(&mpath, m.to_string()).unwrap();
    let e = run_local(&cfg).unwrap_err().to_string();
    assert!(e.contains("not inside the checkpoint directory"), "{e}");
}

#[test]
fn criteo_file_trains_like_the_generator() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.tsv");
    let spec = starwire_data::SyntheticSpec {
        seed: 1,
        examples_per_epoch: 16_384,
        ..Default::default()
    };
    starwire_data::write_criteo(&train, 16_384, spec).unwrap();
    let cfg = TrainConfig {
        workers: 1,
        steps: Some(40),
        ..small()
    };
    let from_gen = run_local(&cfg).unwrap();
    let from_file = run_local(&TrainConfig {
        train: DataSource::Criteo(train.clone()),
        ..cfg.clone()
    })
    .unwrap();
    assert!((from_gen.final_train_loss - from_file.final_train_loss).abs() < 1e-9);
    // A bad line is an error with its line number, or skipped when asked.
    let mut text = std::fs::read_to_string(&train).unwrap();
    text.insert_str(0, "1\tnot-a-number\n");
    std::fs::write(&train, text).unwrap();
    let e = run_local(&TrainConfig {
        train: DataSource::Criteo(train.clone()),
        ..cfg.clone()
    })
    .unwrap_err();
    assert!(e.to_string().contains("line 1"), "{e}");
    let r = run_local(&TrainConfig {
        train: DataSource::Criteo(train),
        skip_bad_lines: true,
        ..cfg
    })
    .unwrap();
    assert_eq!(r.skipped_lines, 1);
}

/// `skipped_lines` counts the bad lines of every epoch, read between steps
/// or ahead of them, up to where a step cap stops the run.
#[test]
fn skipped_lines_are_counted_over_every_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.tsv");
    // Two bad lines, one in each worker's share of the lines.
    let mut lines = criteo_lines(4_096);
    lines.insert(0, "1\tnot-a-number".into());
    lines.insert(1, "0\talso-bad".into());
    write_lines(&train, &lines);
    for prefetch in [0, 2] {
        let cfg = TrainConfig {
            workers: 2,
            epochs: 2,
            eval_examples: 0,
            skip_bad_lines: true,
            prefetch: Some(prefetch),
            train: DataSource::Criteo(train.clone()),
            ..small()
        };
        let r = run_local(&cfg).unwrap();
        assert_eq!(
            (r.samples, r.skipped_lines),
            (8_192, 4),
            "prefetch {prefetch}"
        );
        // Stopped by --steps at the end of epoch 1 (8 steps of 256 per
        // worker), and in the middle of epoch 2.
        for (steps, skipped) in [(16, 2), (20, 4)] {
            let r = run_local(&TrainConfig {
                steps: Some(steps),
                ..cfg.clone()
            })
            .unwrap();
            assert_eq!(
                (r.steps, r.skipped_lines),
                (steps, skipped),
                "prefetch {prefetch}"
            );
        }
    }
}

/// A directory of gzip files: two workers each read two of the four files
/// whole (DeepRec's WorkQueue split), and together see every example once
/// per epoch.
#[test]
fn a_directory_of_gz_files_is_dealt_out_to_workers() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("all.tsv");
    let spec = starwire_data::SyntheticSpec {
        seed: 1,
        examples_per_epoch: 8_192,
        ..Default::default()
    };
    starwire_data::write_criteo(&plain, 8_192, spec).unwrap();
    let text = std::fs::read_to_string(&plain).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let parts = dir.path().join("parts");
    std::fs::create_dir(&parts).unwrap();
    for (i, chunk) in lines.chunks(2_048).enumerate() {
        let f = std::fs::File::create(parts.join(format!("part-{i}.tsv.gz"))).unwrap();
        let mut e = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
        e.write_all((chunk.join("\n") + "\n").as_bytes()).unwrap();
        e.finish().unwrap();
    }
    let cfg = TrainConfig {
        workers: 2,
        epochs: 1,
        train: DataSource::Criteo(parts.clone()),
        ..small()
    };
    let r = run_local(&cfg).unwrap();
    assert_eq!(r.samples, 8_192);
    assert!(r.auc > 0.6, "{}", r.auc);
    // The same through a glob pattern.
    let glob = run_local(&TrainConfig {
        train: DataSource::Criteo(parts.join("part-*.tsv.gz")),
        ..cfg
    })
    .unwrap();
    assert_eq!(glob.samples, 8_192);
}

/// `n` Criteo lines of the generator (seed 1).
fn criteo_lines(n: u64) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("all.tsv");
    let spec = starwire_data::SyntheticSpec {
        seed: 1,
        examples_per_epoch: n,
        ..Default::default()
    };
    starwire_data::write_criteo(&f, n, spec).unwrap();
    let text = std::fs::read_to_string(&f).unwrap();
    text.lines().map(str::to_owned).collect()
}

/// Write `lines` to `path`, gzip-compressed if its name ends in `.gz`.
fn write_lines(path: &std::path::Path, lines: &[String]) {
    use std::io::Write;
    let text = lines.join("\n") + "\n";
    if path.extension().is_some_and(|e| e == "gz") {
        let f = std::fs::File::create(path).unwrap();
        let mut e = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
        e.write_all(text.as_bytes()).unwrap();
        e.finish().unwrap();
    } else {
        std::fs::write(path, text).unwrap();
    }
}

/// `--sync` on a gzip file: the steps of an epoch are counted from its
/// lines, not its compressed bytes, so every line is trained each epoch.
#[test]
fn a_sync_run_on_a_gz_file_trains_every_line_each_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train.tsv.gz");
    write_lines(&train, &criteo_lines(4_000));
    let r = run_local(&TrainConfig {
        sync: true,
        workers: 2,
        epochs: 2,
        eval_examples: 0,
        train: DataSource::Criteo(train),
        ..small()
    })
    .unwrap();
    // Two shares of 2 000 lines: 8 steps an epoch each (the last of 208).
    assert_eq!((r.steps, r.samples), (32, 8_000));
    assert_eq!(
        (r.examples_trained, r.examples_planned),
        (8_000, Some(8_000))
    );
}

/// `--sync` on a directory (and a glob pattern) of files: each worker's
/// steps an epoch are counted over its own files, and every line is
/// trained.
#[test]
fn a_sync_run_on_a_directory_of_files_trains_them_all() {
    let dir = tempfile::tempdir().unwrap();
    let lines = criteo_lines(2_000);
    let parts = dir.path().join("parts");
    std::fs::create_dir(&parts).unwrap();
    write_lines(&parts.join("part-0.tsv"), &lines[..1_000]);
    write_lines(&parts.join("part-1.tsv.gz"), &lines[1_000..]);
    let cfg = TrainConfig {
        sync: true,
        workers: 2,
        epochs: 2,
        eval_examples: 0,
        train: DataSource::Criteo(parts.clone()),
        ..small()
    };
    let r = run_local(&cfg).unwrap();
    // A file each: 4 steps an epoch (the last of 232).
    assert_eq!((r.steps, r.samples), (16, 4_000));
    assert_eq!(r.examples_planned, Some(4_000));
    let glob = run_local(&TrainConfig {
        train: DataSource::Criteo(parts.join("part-*")),
        ..cfg
    })
    .unwrap();
    assert_eq!((glob.steps, glob.samples), (16, 4_000));
}

/// `--sync` on files whose batches are not all full (a batch does not
/// span files): every worker takes the steps of the share with the
/// fewest, and a run resumed from a checkpoint past a file's end takes
/// the steps an uninterrupted one takes from there, training each line
/// it trains once.
#[test]
fn a_sync_run_on_short_files_resumes_past_a_file_boundary() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let lines = criteo_lines(800);
    let parts = d.join("parts");
    std::fs::create_dir(&parts).unwrap();
    // Worker 0 reads parts 0, 2 and 4 (100 lines each: 3 steps an epoch),
    // worker 1 parts 1, 3 (100 each) and 5 (300: batches of 256 and 44),
    // 4 steps: both take 3, worker 1 its batches of 100, 100 and 256.
    let mut at = 0;
    for (i, n) in [100, 100, 100, 100, 100, 300].into_iter().enumerate() {
        write_lines(&parts.join(format!("part-{i}.tsv")), &lines[at..at + n]);
        at += n;
    }
    let ckpt = d.join("ckpt");
    let cfg = TrainConfig {
        sync: true,
        workers: 2,
        epochs: 2,
        eval_examples: 0,
        train: DataSource::Criteo(parts),
        checkpoint_dir: Some(ckpt.clone()),
        checkpoint_every_steps: Some(10),
        ..small()
    };
    let first = run_local(&cfg).unwrap();
    let per_epoch = 300 + 456;
    assert_eq!((first.steps, first.samples), (12, 2 * per_epoch));
    assert_eq!(
        (first.examples_trained, first.examples_planned),
        (2 * per_epoch, Some(2 * per_epoch))
    );
    // The checkpoint at global step 10: each worker after its 2 batches
    // of 100 lines of epoch 1, the ends of two files.
    let steps = ckpt.join("steps");
    let at10: Vec<serde_json::Value> = (0..2)
        .map(|w| {
            serde_json::from_slice(
                &std::fs::read(steps.join("10").join(format!("worker-{w:04}.json"))).unwrap(),
            )
            .unwrap()
        })
        .collect();
    for p in &at10 {
        assert_eq!(
            (&p["epoch"], &p["steps"], &p["offset"]),
            (&1.into(), &5.into(), &200.into()),
            "{p}"
        );
    }
    // Resume there: each worker's last step of the epoch, no more.
    let mpath = ckpt.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["global_step"] = 10.into();
    m["shard_steps"] = serde_json::json!([10, 10]);
    m["shard_files"] = serde_json::json!(["steps/10/shard-0000.ckpt", "steps/10/shard-0001.ckpt"]);
    m["workers"] = serde_json::json!(at10);
    std::fs::write(&mpath, m.to_string()).unwrap();
    let second = run_local(&cfg).unwrap();
    assert_eq!(second.resumed_from_step, Some(10));
    assert_eq!((second.steps, second.samples), (2, 100 + 256));
    assert_eq!(second.examples_trained, 2 * per_epoch);
}

#[test]
fn steps_flag_is_the_total_over_workers() {
    let r = run_local(&TrainConfig {
        workers: 3,
        steps: Some(10),
        ..small()
    })
    .unwrap();
    assert_eq!(r.steps, 10);
    // Steps of 4, 3 and 3 batches of 256.
    assert_eq!((r.examples_trained, r.examples_planned), (2560, Some(2560)));
}

/// With two PS, small tables are assigned whole to one shard and large ones
/// sharded; workers route every key of a whole table to its shard.
#[test]
fn wdl_on_two_ps_routes_whole_and_sharded_tables() {
    for protocol in [Protocol::StarServer, Protocol::StarServerLite] {
        let r = run_local(&TrainConfig {
            ps: 2,
            model: ModelKind::Wdl,
            protocol,
            steps: Some(16),
            ..small()
        })
        .unwrap();
        assert_eq!(r.shards, 4);
        assert_eq!(r.steps, 16);
        assert!(
            r.assignment.whole_vars.iter().sum::<usize>() > 0,
            "{:?}",
            r.assignment
        );
        assert!(r.assignment.sharded_vars > 0);
    }
}

/// Every task computes the variable assignment alone, so it must be the same each
/// time, for every strategy.
#[test]
fn assignment_is_deterministic() {
    for assignment in [
        starwire_ps::Strategy::RoundRobin,
        starwire_ps::Strategy::Greedy,
        starwire_ps::Strategy::Anneal {
            seed: 3,
            iters: 20_000,
        },
    ] {
        let cfg = TrainConfig {
            ps: 4,
            model: ModelKind::Wdl,
            assignment,
            ..small()
        };
        let a = starwire_train::cluster::plan(&cfg).unwrap();
        let b = starwire_train::cluster::plan(&cfg).unwrap();
        assert_eq!(a.layout.home_shard, b.layout.home_shard, "{assignment:?}");
        assert_eq!(a.assignment.bytes, b.assignment.bytes);
    }
}

/// Every backend trains the same model to the same place: with one worker
/// the run is deterministic, so the losses agree across backends.
#[test]
fn every_backend_computes_the_same_steps() {
    let base = TrainConfig {
        workers: 1,
        steps: Some(12),
        model: ModelKind::Wdl,
        ..small()
    };
    let tcp = run_local(&base).unwrap();
    for &(name, backend) in starwire_train::BackendKind::ALL {
        // DPDK needs EAL arguments and a port, set up once per process by
        // the command: training over it runs in the starwire CLI's tests
        // (net_ring) and in ci/dpdk-netns.sh.
        #[cfg(feature = "dpdk")]
        if backend == starwire_train::BackendKind::Dpdk {
            eprintln!("{name}: skipped: needs --eal (tested through the CLI)");
            continue;
        }
        // Verbs needs a device; hosts without one (ENOSYS here) skip it.
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        if backend == starwire_train::BackendKind::Verbs {
            match starwire_verbs::VerbsDevice::open(&starwire_verbs::DeviceSpec::default()) {
                Ok(dev) => starwire_train::backend::set_verbs_device(dev),
                Err(e) => {
                    eprintln!("{name}: skipped: {e}");
                    continue;
                }
            }
        }
        for fuse in [true, false] {
            let r = run_local(&TrainConfig {
                backend,
                tensor_fuse: fuse,
                ..base.clone()
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(r.backend, name);
            assert_eq!(r.steps, 12, "{name}");
            assert!(
                (r.final_train_loss - tcp.final_train_loss).abs() < 1e-9,
                "{name} fuse {fuse}: {} vs tcp {}",
                r.final_train_loss,
                tcp.final_train_loss
            );
        }
    }
}

/// `inproc` (no network) runs the barrier of `--sync` from the workers'
/// own threads, learns like the network backends, and refuses to be a task
/// of a cluster across processes.
#[test]
fn inproc_trains_with_a_barrier_and_only_in_one_process() {
    let r = run_local(&TrainConfig {
        backend: starwire_train::BackendKind::Inproc,
        sync: true,
        workers: 3,
        ..small()
    })
    .unwrap();
    assert_eq!(r.backend, "inproc");
    // The shards sit behind locks: only the workers' threads are listed.
    let workers: Vec<usize> = r.reactors.iter().map(|x| x.index).collect();
    assert_eq!(workers, [0, 1, 2]);
    assert!(r.reactors.iter().all(|x| x.role.job_name() == "worker"));
    assert_eq!(r.steps, 3 * 22);
    for s in &r.shard_stats {
        assert_eq!(s["global_step"].as_u64().unwrap(), 66);
    }
    assert!(r.auc > 0.65, "auc {}", r.auc);
    let cfg = TrainConfig {
        backend: starwire_train::BackendKind::Inproc,
        ..small()
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let lifetime = starwire_train::cluster::PsLifetime {
        exit_when_done: true,
        stop: &stop,
    };
    let e =
        starwire_train::run_ps_task(&cfg, 0, "127.0.0.1:0".parse().unwrap(), lifetime).unwrap_err();
    assert!(e.to_string().contains("inproc"), "{e}");
    let e = starwire_train::run_worker_task(&cfg, &["127.0.0.1:1".into()], 0).unwrap_err();
    assert!(e.to_string().contains("inproc"), "{e}");
}

/// With `--worker-handoff on` the worker thread hands its requests to its
/// network reactors and computes the same steps: with one worker the run
/// is deterministic, so losses and AUC agree with the worker that turns
/// its own connections, on every backend with reactors. The reactors are
/// listed as the worker's.
#[test]
fn worker_handoff_computes_the_same_steps() {
    let base = TrainConfig {
        workers: 1,
        steps: Some(12),
        model: ModelKind::Wdl,
        worker_reactors: 2,
        ..small()
    };
    for &(name, backend) in starwire_train::BackendKind::ALL {
        if !matches!(name, "tcp" | "uring") {
            continue;
        }
        let off = run_local(&TrainConfig {
            backend,
            ..base.clone()
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let on = run_local(&TrainConfig {
            backend,
            worker_handoff: true,
            ..base.clone()
        })
        .unwrap_or_else(|e| panic!("{name} handoff: {e}"));
        assert!(!off.worker_handoff && on.worker_handoff, "{name}");
        assert_eq!(on.steps, 12, "{name}");
        assert!(
            (on.final_train_loss - off.final_train_loss).abs() < 1e-9,
            "{name}: {} vs {}",
            on.final_train_loss,
            off.final_train_loss
        );
        assert!((on.auc - off.auc).abs() < 1e-9, "{name}");
        assert_eq!(on.requests_per_step, off.requests_per_step, "{name}");
        assert_eq!(on.bytes_per_step, off.bytes_per_step, "{name}");
        let listed = |r: &starwire_train::TrainReport| -> Vec<(&'static str, usize)> {
            r.reactors
                .iter()
                .map(|x| (x.role.job_name(), x.index))
                .collect()
        };
        assert_eq!(listed(&off), [("ps", 0), ("ps", 1), ("worker", 0)]);
        // Two shards, two network reactors.
        assert_eq!(
            listed(&on),
            [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
        );
    }
}

/// Two asynchronous workers with the hand-off, polling, learn as well as
/// without it; each worker's network reactors are listed, at most one per
/// shard.
#[test]
fn worker_handoff_learns_like_the_worker_thread() {
    let base = TrainConfig {
        epochs: 2,
        ..small()
    };
    let off = run_local(&base).unwrap();
    let on = run_local(&TrainConfig {
        worker_handoff: true,
        worker_polling: true,
        worker_reactors: 3,
        ..base.clone()
    })
    .unwrap();
    assert_eq!(on.samples, off.samples);
    assert!(on.auc > 0.70, "auc {}", on.auc);
    assert!((on.auc - off.auc).abs() < 0.01, "{} vs {}", on.auc, off.auc);
    for s in &on.shard_stats {
        assert_eq!(s["global_step"].as_u64().unwrap(), on.steps, "{s}");
    }
    let workers: Vec<(usize, bool)> = on
        .reactors
        .iter()
        .filter(|x| x.role.job_name() == "worker")
        .map(|x| (x.index, x.polling))
        .collect();
    assert_eq!(workers, [(0, true), (1, true), (2, true), (3, true)]);
}

#[test]
fn worker_handoff_needs_a_backend_with_reactors() {
    let e = run_local(&TrainConfig {
        backend: starwire_train::BackendKind::Inproc,
        worker_handoff: true,
        ..small()
    })
    .unwrap_err();
    assert!(e.to_string().contains("--worker-handoff"), "{e}");
}

/// The checkpoint files a run wrote into `dir`, shard by shard.
fn shard_files(dir: &std::path::Path, shards: usize) -> Vec<Vec<u8>> {
    (0..shards)
        .map(|s| std::fs::read(dir.join(format!("shard-{s:04}.ckpt"))).unwrap())
        .collect()
}

/// `--sync` is synchronous SGD: each step's pushes are summed in
/// worker-index order and applied once, so two runs of the same seed end
/// with the same model, byte for byte, whatever order the pushes reached
/// the shards in; over the network and in process alike, fused or not.
#[test]
fn two_sync_runs_of_one_seed_end_bit_identical() {
    for (backend, fuse) in [
        (starwire_train::BackendKind::Tcp, true),
        (starwire_train::BackendKind::Tcp, false),
        (starwire_train::BackendKind::Inproc, true),
    ] {
        let mut models = Vec::new();
        let mut losses = Vec::new();
        for _ in 0..2 {
            let dir = tempfile::tempdir().unwrap();
            let r = run_local(&TrainConfig {
                backend,
                tensor_fuse: fuse,
                sync: true,
                workers: 3,
                train_examples: 6_144,
                eval_examples: 1_024,
                optimizer: OptimizerKind::Adagrad,
                checkpoint_dir: Some(dir.path().to_owned()),
                ..small()
            })
            .unwrap();
            // 2048 examples each: 8 steps per worker.
            assert_eq!(r.steps, 24);
            for s in &r.shard_stats {
                assert_eq!(s["global_step"].as_u64().unwrap(), 24);
            }
            models.push(shard_files(dir.path(), r.shards));
            losses.push(r.final_train_loss);
        }
        assert!(
            models[0] == models[1],
            "{backend:?} fuse {fuse}: two sync runs of one seed differ"
        );
        assert_eq!(losses[0].to_bits(), losses[1].to_bits());
    }
}

/// `--checkpoint-every-secs` with `--sync`: a checkpoint taken mid-run at
/// the step worker 0 picked holds that step on every shard, with every
/// worker's position; resumed from it (as after a crash right after it),
/// the run ends with the model an uninterrupted run ends with, byte for
/// byte.
#[test]
fn a_sync_run_resumed_from_a_timed_checkpoint_ends_bit_identical() {
    let cfg = TrainConfig {
        sync: true,
        workers: 2,
        // Two epochs of 40 steps per worker: 160 global steps.
        epochs: 2,
        train_examples: 10_160,
        eval_examples: 0,
        batch_size: 128,
        ..small()
    };
    // Uninterrupted, no checkpoint during the run.
    let whole = tempfile::tempdir().unwrap();
    let r = run_local(&TrainConfig {
        checkpoint_dir: Some(whole.path().to_owned()),
        ..cfg.clone()
    })
    .unwrap();
    assert_eq!(r.steps, 160);
    let expected = shard_files(whole.path(), r.shards);
    // With a checkpoint every 50 ms (a release build runs the 160 steps in
    // about 140 ms): copy the first manifest seen during the run and the
    // files it names, as a crash would have left them.
    let timed = tempfile::tempdir().unwrap();
    let saved = tempfile::tempdir().unwrap();
    let run = {
        let cfg = TrainConfig {
            checkpoint_dir: Some(timed.path().to_owned()),
            checkpoint_every_secs: Some(std::time::Duration::from_millis(50)),
            ..cfg.clone()
        };
        std::thread::spawn(move || run_local(&cfg))
    };
    let mpath = timed.path().join("manifest.json");
    let mut manifest = None;
    while !run.is_finished() && manifest.is_none() {
        if let Ok(text) = std::fs::read_to_string(&mpath) {
            let m: serde_json::Value = serde_json::from_str(&text).unwrap();
            for f in m["shard_files"].as_array().unwrap() {
                let rel = f.as_str().unwrap();
                let to = saved.path().join(rel);
                std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                std::fs::copy(timed.path().join(rel), to).unwrap();
            }
            std::fs::write(saved.path().join("manifest.json"), &text).unwrap();
            manifest = Some(m);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let r = run.join().unwrap().unwrap();
    assert_eq!(r.steps, 160);
    // The timed run's model is the uninterrupted one's.
    assert!(shard_files(timed.path(), r.shards) == expected);
    let m = manifest.expect("no checkpoint during the run");
    let c = m["global_step"].as_u64().unwrap();
    assert!(c > 0 && c < 160 && c % 2 == 0, "{m}");
    assert_eq!(m["shard_steps"], serde_json::json!([c, c]), "{m}");
    for w in m["workers"].as_array().unwrap() {
        assert_eq!(w["steps"].as_u64(), Some(c / 2), "{m}");
    }
    // Resumed from it: the remaining steps, and the same model.
    let resumed = run_local(&TrainConfig {
        checkpoint_dir: Some(saved.path().to_owned()),
        ..cfg
    })
    .unwrap();
    assert_eq!(resumed.resumed_from_step, Some(c));
    assert_eq!(resumed.steps, 160 - c);
    // Two epochs of 10 160: the timed checkpoint's examples (every batch
    // full but each epoch's last) and those since.
    assert_eq!(
        (resumed.examples_trained, resumed.examples_planned),
        (20_320, Some(20_320))
    );
    assert!(
        shard_files(saved.path(), resumed.shards) == expected,
        "resumed at global step {c}, the model differs from an uninterrupted run's"
    );
}

/// `--checkpoint-every-steps` without `--sync`: every worker stops at
/// each checkpoint step, so each shard file holds every worker's first
/// `C / workers` steps and the manifest their positions; a run resumed
/// from one trains each example once.
#[test]
fn checkpoints_during_an_async_run_record_every_worker_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 16 384 examples, 2 workers, batches of 256: 32 steps each.
    let cfg = TrainConfig {
        checkpoint_dir: Some(d.to_owned()),
        checkpoint_every_steps: Some(16),
        eval_examples: 0,
        ..small()
    };
    let first = run_local(&cfg).unwrap();
    assert_eq!(first.steps, 64);
    assert_eq!(
        (first.examples_trained, first.examples_planned),
        (16_384, Some(16_384))
    );
    let steps = d.join("steps");
    let mut kept: Vec<String> = std::fs::read_dir(&steps)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    kept.sort();
    assert_eq!(kept, ["48", "64"]);
    for w in 0..2 {
        let p: serde_json::Value = serde_json::from_slice(
            &std::fs::read(steps.join("48").join(format!("worker-{w:04}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (&p["steps"], &p["offset"], &p["examples"]),
            (&24.into(), &(24 * 256).into(), &(24 * 256).into()),
            "{p}"
        );
    }
    // Resume from the checkpoint at 48, as after a crash right after it:
    // each shard restores its step 48 (checked against the manifest) and
    // each worker trains its 8 steps left.
    let mpath = d.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["global_step"] = 48.into();
    m["shard_steps"] = serde_json::json!([48, 48]);
    m["shard_files"] = serde_json::json!(["steps/48/shard-0000.ckpt", "steps/48/shard-0001.ckpt"]);
    m["workers"] = serde_json::json!([
        serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(steps.join("48/worker-0000.json")).unwrap()
        )
        .unwrap(),
        serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(steps.join("48/worker-0001.json")).unwrap()
        )
        .unwrap(),
    ]);
    let at_48 = m.to_string();
    std::fs::write(&mpath, &at_48).unwrap();
    let second = run_local(&cfg).unwrap();
    assert_eq!(second.resumed_from_step, Some(48));
    assert_eq!(second.steps, 16);
    assert_eq!(
        (second.examples_trained, second.examples_planned),
        (16_384, Some(16_384))
    );
    // Positions count into shares dealt a batch at a time: another batch
    // size deals other shares, and resuming with it is refused.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    assert_eq!(m["workers"][0]["deal_block"], 256);
    let other = TrainConfig {
        batch_size: 128,
        ..cfg.clone()
    };
    let e = run_local(&other).unwrap_err().to_string();
    assert!(
        e.contains("dealt 256 example(s) at a time, and this run deals 128"),
        "{e}"
    );
    // Worker 1 alone refuses its position, under a delay bound: worker 0
    // starts and waits for worker 1's turns. The first failure stops the
    // PS tasks, so the run ends with worker 1's error, not with worker 0's
    // after its request timeout, over the network and in process.
    let mut m: serde_json::Value = serde_json::from_str(&at_48).unwrap();
    m["workers"][1]["deal_block"] = 512.into();
    std::fs::write(&mpath, m.to_string()).unwrap();
    for backend in [
        starwire_train::BackendKind::Tcp,
        starwire_train::BackendKind::Inproc,
    ] {
        let bounded = TrainConfig {
            bounded_delay: Some(1),
            backend,
            ..cfg.clone()
        };
        let t = std::time::Instant::now();
        let e = run_local(&bounded).unwrap_err().to_string();
        assert!(
            e.contains("worker 1's checkpointed position counts into a share dealt 512"),
            "{backend:?}: {e}"
        );
        // Not a hang until the 120 s timeout.
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "{backend:?}: worker 0 waited {:?}",
            t.elapsed()
        );
    }
}

/// Asynchronous checkpoints during the run on a Criteo file: every worker
/// counts each worker's share before it starts (so each stops at every
/// checkpoint step it reaches), records its position in its share, and a
/// run resumed from a checkpoint trains each line once.
#[test]
fn checkpoints_during_an_async_run_on_a_criteo_file_record_positions_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let train = d.join("train.tsv");
    let spec = starwire_data::SyntheticSpec {
        seed: 1,
        examples_per_epoch: 16_000,
        ..Default::default()
    };
    // Two shares of 8 000 lines: 31 full batches of 256 and one of 64.
    starwire_data::write_criteo(&train, 16_000, spec).unwrap();
    let ckpt = d.join("ckpt");
    let cfg = TrainConfig {
        train: DataSource::Criteo(train),
        checkpoint_dir: Some(ckpt.clone()),
        checkpoint_every_steps: Some(16),
        eval_examples: 0,
        ..small()
    };
    let first = run_local(&cfg).unwrap();
    assert_eq!((first.steps, first.examples_trained), (64, 16_000));
    let steps = ckpt.join("steps");
    let mut kept: Vec<String> = std::fs::read_dir(&steps)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    kept.sort();
    assert_eq!(kept, ["48", "64"]);
    let at48: Vec<serde_json::Value> = (0..2)
        .map(|w| {
            serde_json::from_slice(
                &std::fs::read(steps.join("48").join(format!("worker-{w:04}.json"))).unwrap(),
            )
            .unwrap()
        })
        .collect();
    for p in &at48 {
        assert_eq!(
            (&p["steps"], &p["offset"], &p["examples"]),
            (&24.into(), &(24 * 256).into(), &(24 * 256).into()),
            "{p}"
        );
    }
    // Resume from the checkpoint at 48: each worker reads past its 6 144
    // lines and trains its last 8 steps (1 856 lines).
    let mpath = ckpt.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    m["global_step"] = 48.into();
    m["shard_steps"] = serde_json::json!([48, 48]);
    m["shard_files"] = serde_json::json!(["steps/48/shard-0000.ckpt", "steps/48/shard-0001.ckpt"]);
    m["workers"] = serde_json::json!(at48);
    std::fs::write(&mpath, m.to_string()).unwrap();
    let second = run_local(&cfg).unwrap();
    assert_eq!(second.resumed_from_step, Some(48));
    assert_eq!((second.steps, second.samples), (16, 2 * 1_856));
    assert_eq!(second.examples_trained, 16_000);
}

/// A Criteo file's shares are dealt a line at a time whatever the batch,
/// so the dealing block does not tell them apart: a checkpoint's positions
/// record how many workers' shares they count into, and a run with
/// another `--workers` refuses them (else it would skip lines never
/// trained in its smaller shares, and retrain the data of the workers the
/// checkpoint has no position of), with `--sync` or not.
#[test]
fn a_criteo_checkpoint_refuses_another_worker_count() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let train = d.join("train.tsv");
    let spec = starwire_data::SyntheticSpec {
        seed: 3,
        examples_per_epoch: 8_000,
        ..Default::default()
    };
    starwire_data::write_criteo(&train, 8_000, spec).unwrap();
    for sync in [false, true] {
        let ckpt = d.join(format!("ckpt-{sync}"));
        let cfg = TrainConfig {
            train: DataSource::Criteo(train.clone()),
            checkpoint_dir: Some(ckpt.clone()),
            checkpoint_every_steps: Some(16),
            eval_examples: 0,
            workers: 2,
            sync,
            ..small()
        };
        let first = run_local(&cfg).unwrap();
        assert_eq!(first.examples_trained, 8_000, "sync {sync}");
        let mpath = ckpt.join("manifest.json");
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
        for w in 0..2 {
            assert_eq!(
                (&m["workers"][w]["deal_block"], &m["workers"][w]["workers"]),
                (&1.into(), &2.into()),
                "sync {sync}: {m}"
            );
        }
        // The positions taken during the run record it too.
        let steps = ckpt.join("steps");
        let taken: Vec<_> = std::fs::read_dir(&steps)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(!taken.is_empty(), "sync {sync}");
        for step in &taken {
            for w in 0..2 {
                let f = step.join(format!("worker-{w:04}.json"));
                let Ok(b) = std::fs::read(&f) else {
                    // A synchronous run's positions are computed.
                    assert!(sync, "{}", f.display());
                    continue;
                };
                let p: serde_json::Value = serde_json::from_slice(&b).unwrap();
                assert_eq!(p["workers"], 2, "{}: {p}", f.display());
            }
        }
        for workers in [4, 1] {
            let other = TrainConfig {
                workers,
                ..cfg.clone()
            };
            let e = run_local(&other).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(e, starwire_train::TrainError::Config(_))
                    && msg.contains("one of 2 worker(s)' shares")
                    && msg.contains(&format!("deals it to {workers} worker(s)")),
                "sync {sync}, {workers} workers: {msg}"
            );
        }
        // A manifest written before the count was recorded is not
        // checked: with 2 workers again it resumes at its end.
        let mut old = m.clone();
        for w in 0..2 {
            old["workers"][w].as_object_mut().unwrap().remove("workers");
        }
        std::fs::write(&mpath, old.to_string()).unwrap();
        let again = run_local(&cfg).unwrap();
        assert_eq!(again.examples_trained, 8_000, "sync {sync}");
    }
}

/// `--checkpoint-every-secs` without `--sync`: shard 0 decides, at the
/// workers' votes (every 16 steps of each), which global steps are
/// checkpoint steps, and every worker stops at each: each step directory
/// holds every shard's file and every worker's position at that step.
#[test]
fn timed_checkpoints_during_an_async_run_stop_every_worker_at_one_step() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 16 384 examples, 2 workers, batches of 256: 32 steps each, votes at
    // their steps 16 and 32 (global steps 32 and 64). With 0 s, every
    // worker wants a checkpoint at each of its votes, whichever votes first.
    let cfg = TrainConfig {
        checkpoint_dir: Some(d.to_owned()),
        checkpoint_every_secs: Some(std::time::Duration::ZERO),
        eval_examples: 0,
        ..small()
    };
    let r = run_local(&cfg).unwrap();
    assert_eq!(r.steps, 64);
    assert_eq!(
        (r.examples_trained, r.examples_planned),
        (16_384, Some(16_384))
    );
    let steps = d.join("steps");
    let kept: Vec<u64> = std::fs::read_dir(&steps)
        .unwrap()
        .map(|e| {
            e.unwrap()
                .file_name()
                .into_string()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert!(kept.contains(&32), "{kept:?}");
    for c in kept {
        assert!(c == 32 || c == 64, "{c}");
        let at = steps.join(c.to_string());
        for s in 0..r.shards {
            assert!(at.join(format!("shard-{s:04}.ckpt")).exists(), "{c}");
        }
        for w in 0..2 {
            let p: serde_json::Value = serde_json::from_slice(
                &std::fs::read(at.join(format!("worker-{w:04}.json"))).unwrap(),
            )
            .unwrap();
            let k = c / 2;
            assert_eq!(
                (&p["steps"], &p["offset"], &p["examples"]),
                (&k.into(), &(k * 256).into(), &(k * 256).into()),
                "{p}"
            );
        }
    }
}

/// `--delta-every-steps`: each shard writes the rows touched since its
/// last full checkpoint; the latest delta applied onto that checkpoint
/// gives the shard as it was at the delta's step, byte for byte (here the
/// end of the run).
#[test]
fn a_delta_on_its_full_checkpoint_is_the_shard_at_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = TrainConfig {
        sync: true,
        steps: Some(48),
        eval_examples: 0,
        checkpoint_dir: Some(d.to_owned()),
        checkpoint_every_steps: Some(32),
        delta_every_steps: Some(8),
        ..small()
    };
    let r = run_local(&cfg).unwrap();
    assert_eq!(r.steps, 48);
    // Full at 32; the deltas since then replace each other: 48 is left.
    let kept: Vec<String> = std::fs::read_dir(d.join("deltas"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(kept, ["48"]);
    let plan = starwire_train::cluster::plan(&cfg).unwrap();
    for s in 0..r.shards {
        let name = format!("shard-{s:04}");
        let mut shard = starwire_train::cluster::make_shard(&cfg, &plan, s, None).unwrap();
        let full = std::fs::read(d.join("steps/32").join(format!("{name}.ckpt"))).unwrap();
        shard.restore(&mut full.as_slice()).unwrap();
        let delta = std::fs::read(d.join("deltas/48").join(format!("{name}.delta"))).unwrap();
        assert!(delta.len() < full.len() * 2);
        shard.apply_delta(&mut delta.as_slice()).unwrap();
        let mut now = Vec::new();
        shard.save(&mut now).unwrap();
        let end = std::fs::read(d.join(format!("{name}.ckpt"))).unwrap();
        assert!(now == end, "shard {s}: base + delta is not the shard at 48");
    }
    let e = run_local(&TrainConfig {
        steps_to_live: 10,
        ..cfg
    })
    .unwrap_err();
    assert!(e.to_string().contains("--delta-every-steps 8"), "{e}");
}

/// `--bounded-delay 0` takes the asynchronous steps one at a time in
/// round-robin order: no step lands between another's pull and push, so
/// every push is measured at staleness 0, on every backend, whatever the
/// threads' timing.
#[test]
fn a_zero_delay_bound_runs_the_steps_one_at_a_time() {
    for backend in [
        starwire_train::BackendKind::Tcp,
        starwire_train::BackendKind::Inproc,
    ] {
        // 5 workers of 1024 examples: 4 steps each, all of them bounded.
        let r = run_local(&TrainConfig {
            backend,
            workers: 5,
            train_examples: 5 * 1024,
            bounded_delay: Some(0),
            ..small()
        })
        .unwrap();
        assert_eq!((r.steps, r.bounded_delay), (20, Some(0)), "{backend:?}");
        // One step in flight is one worker whatever the CPUs: a step at a
        // time.
        assert_eq!(r.turn_steps, Some(1), "{backend:?}");
        let st = r.staleness;
        assert_eq!((st.max, st.pushes), (0, 20 * 2), "{backend:?}: {st:?}");
        for s in &r.shard_stats {
            assert_eq!(s["global_step"].as_u64().unwrap(), 20, "{s}");
        }
    }
}

/// A bounded run that checkpoints every 10 global steps takes one step a
/// turn whatever the CPUs (a block would not reach the checkpoint step
/// together with the other workers' and the run would wait forever), and
/// refuses more.
#[test]
fn checkpoints_during_a_bounded_run_take_one_step_a_turn() {
    let dir = tempfile::tempdir().unwrap();
    // 5 workers of 1024 examples: 4 steps each, 20 in all.
    let cfg = TrainConfig {
        workers: 5,
        train_examples: 5 * 1024,
        bounded_delay: Some(4),
        checkpoint_dir: Some(dir.path().to_owned()),
        checkpoint_every_steps: Some(10),
        eval_examples: 0,
        ..small()
    };
    let r = run_local(&cfg).unwrap();
    assert_eq!((r.steps, r.turn_steps), (20, Some(1)));
    let e = run_local(&TrainConfig {
        turn_steps: Some(2),
        ..cfg
    })
    .unwrap_err();
    assert!(e.to_string().contains("--turn-steps 2"), "{e}");
}

/// `--turn-steps 3` under a zero bound: each worker takes three steps in a
/// row, then one (4 steps each), still one step at a time, and every step
/// is taken.
#[test]
fn steps_in_a_row_keep_the_bound() {
    let r = run_local(&TrainConfig {
        workers: 5,
        train_examples: 5 * 1024,
        bounded_delay: Some(0),
        turn_steps: Some(3),
        ..small()
    })
    .unwrap();
    assert_eq!((r.steps, r.turn_steps), (20, Some(3)));
    let st = r.staleness;
    assert_eq!((st.max, st.pushes), (0, 20 * 2), "{st:?}");
    for s in &r.shard_stats {
        assert_eq!(s["global_step"].as_u64().unwrap(), 20, "{s}");
    }
}

//! `starwire checkpoint`: `inspect` reads a checkpoint directory, and
//! `apply-delta` brings a full shard file to a delta's step, byte for byte
//! the shard a full checkpoint of that step holds.

use std::process::Output;

mod common;

use common::text;

fn starwire(args: &[&str]) -> Output {
    common::starwire(args).output().expect("run starwire")
}

#[test]
fn apply_delta_gives_the_full_checkpoint_of_its_step_and_inspect_lists_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ds = d.to_str().unwrap();
    // 48 synchronous global steps: a full checkpoint at 32, deltas every
    // 8 after it (the one of 48 is kept), and the end of the run at 48.
    let o = starwire(&[
        "train",
        "--sync",
        "--steps",
        "48",
        "--train-examples",
        "16384",
        "--eval-examples",
        "0",
        "--batch-size",
        "256",
        "--epochs",
        "1",
        "--checkpoint-dir",
        ds,
        "--checkpoint-every-steps",
        "32",
        "--delta-every-steps",
        "8",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shards: Vec<String> = std::fs::read_dir(d.join("deltas/48"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!shards.is_empty());
    let out = tempfile::tempdir().unwrap();
    for f in &shards {
        let name = f.trim_end_matches(".delta");
        let base = d.join("steps/32").join(format!("{name}.ckpt"));
        let delta = d.join("deltas/48").join(f);
        let to = out.path().join(format!("{name}.ckpt"));
        let o = starwire(&[
            "checkpoint",
            "apply-delta",
            "--base",
            base.to_str().unwrap(),
            "--delta",
            delta.to_str().unwrap(),
            "--out",
            to.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert!(
            text(&o.stdout).contains("global step 48"),
            "{}",
            text(&o.stdout)
        );
        let end = std::fs::read(d.join(format!("{name}.ckpt"))).unwrap();
        assert!(
            std::fs::read(&to).unwrap() == end,
            "{name}: base + delta is not the full checkpoint of step 48"
        );
    }
    // A delta on another base is refused, naming the file.
    let base = d.join("steps/32/shard-0000.ckpt");
    let o = starwire(&[
        "checkpoint",
        "apply-delta",
        "--base",
        d.join("shard-0000.ckpt").to_str().unwrap(),
        "--delta",
        d.join("deltas/48").join(&shards[0]).to_str().unwrap(),
        "--out",
        out.path().join("x.ckpt").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("a delta against global step 32"), "{e}");
    assert!(base.exists());

    let o = starwire(&["checkpoint", "inspect", ds]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = text(&o.stdout);
    assert!(s.contains("global step 48"), "{s}");
    assert!(
        s.contains("shard 0: shard-0000.ckpt: format 2, global step 48"),
        "{s}"
    );
    assert!(s.contains("embedding, dim"), "{s}");
    assert!(
        s.contains("shard 0, global step 48 on the full checkpoint of step 32"),
        "{s}"
    );
}

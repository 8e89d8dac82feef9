//! Checkpoints during the run (`--checkpoint-every-steps N` and
//! `--checkpoint-every-secs S`, with `--sync`).
//!
//! A checkpoint is taken at every global step `C` that is a multiple of
//! `N`. With `--sync` every worker pushes its step, then waits at a
//! barrier for the global step `C` before it pushes the next one, so when
//! a shard's global step becomes `C` its state holds exactly every
//! worker's first `C / workers` steps, on every shard alike: the shard
//! writes its file then, inside the push that completed the step, before
//! any barrier is released. Each worker writes its progress after the
//! step before it pushes it (the barrier may release the others as soon as
//! the push lands); once the barrier lets worker 0 through, every shard
//! file and every worker's progress is in place, and it writes the
//! manifest.
//!
//! `--checkpoint-every-secs S` without `--sync`: the workers are not in
//! lockstep, so worker 0 cannot pick a step the others have not passed.
//! Shard 0 decides instead: every worker, at each of its steps that is a
//! multiple of [`VOTE_EVERY_STEPS`], asks it whether the global step that
//! step completes is a checkpoint step (`CHECKPOINT_VOTE`), wanting one
//! once `S` has passed since the last checkpoint it stopped at (each
//! worker by its own clock); the first vote on a step decides it
//! for all. On a yes, worker 0 asks every shard to write its file at that
//! step (`CHECKPOINT_AT`) before it pushes its step, and the barrier of
//! `--checkpoint-every-steps` follows.
//!
//! `--checkpoint-every-secs S` with `--sync`: once `S` has passed since the last
//! checkpoint, worker 0 picks the global step `C` its next step completes
//! and, before pushing that step, asks every shard to write its file at
//! `C` (`CHECKPOINT_AT`); its push cannot be applied before the shards
//! have the request (one ordered connection per shard), so every shard
//! writes at `C`, inside the push that completes it, as above. With
//! `--sync` the workers move in lockstep, so every worker's position at
//! `C` follows from the step count (the same number of steps per epoch
//! for all) and its batches of an epoch, counted before the run (full but
//! a file's last, for Criteo files): worker 0 writes them
//! into the manifest without the workers writing files.
//!
//! Each checkpoint lives in `DIR/steps/C/`; `DIR/manifest.json` names the
//! latest complete one. A crash before the manifest leaves the previous
//! checkpoint whole. Worker 0 removes the step directories older than the
//! one before the latest.

use std::path::{Path, PathBuf};

use starwire_ps::WorkerProgress;

use super::roles::{read_manifest, write_manifest};
use super::shares::{deal_block, examples_after, EpochBatches};
use super::{Plan, TrainConfig};
use crate::handler::shard_file;
use crate::net::Exchange;
use crate::worker::control_one;
use crate::TrainError;
use starwire_wire::ps::Control;

/// The directory of the checkpoint at global step `c` inside `dir`.
pub fn step_dir(dir: &Path, c: u64) -> PathBuf {
    dir.join("steps").join(c.to_string())
}

/// Whether global step `c` is a checkpoint step of `--checkpoint-every-steps
/// every` (0: none).
pub fn is_checkpoint_step(c: u64, every: u64) -> bool {
    every > 0 && c > 0 && c % every == 0
}

/// Create the directory of the checkpoint at global step `c` inside `dir`
/// and make its entries durable: `steps/` and `dir` are synced, so a crash
/// after the files in it were written (each synced with its directory by
/// `write_atomic`) cannot lose the directory that names them.
pub fn create_step_dir(dir: &Path, c: u64) -> std::io::Result<PathBuf> {
    let d = step_dir(dir, c);
    starwire_ps::create_dir_durable(&d)?;
    // Synced even if they existed: another task may have created them.
    std::fs::File::open(dir.join("steps"))?.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(d)
}

pub(super) fn progress_file(dir: &Path, c: u64, worker: u32) -> PathBuf {
    step_dir(dir, c).join(format!("worker-{worker:04}.json"))
}

fn ck(path: &Path) -> impl Fn(String) -> TrainError + '_ {
    move |reason| TrainError::Checkpoint {
        path: path.to_owned(),
        reason,
    }
}

/// Asynchronously, with `--checkpoint-every-secs`, every worker asks
/// shard 0 at each of its steps that is a multiple of this whether the
/// global step that step completes is a checkpoint step.
pub const VOTE_EVERY_STEPS: u64 = 16;

/// Whether a worker's step `s` (counted from 1) is one it votes at.
pub(super) fn is_vote_step(s: u64) -> bool {
    s % VOTE_EVERY_STEPS == 0
}

/// Ask shard 0 whether global step `c` is a checkpoint step, wanting one
/// or not; every worker gets the answer of the first vote on `c`.
pub(super) fn vote(net: &mut dyn Exchange, c: u64, want: bool) -> Result<bool, TrainError> {
    match control_one(net, 0, &Control::CheckpointVote { step: c, want })?[..] {
        [d @ (0 | 1)] => Ok(d == 1),
        _ => Err(TrainError::Remote(
            "CHECKPOINT_VOTE reply is not one byte 0 or 1".into(),
        )),
    }
}

/// `--checkpoint-every-steps` needs a `--checkpoint-dir` and a multiple
/// of the workers (the global step moves by one per worker each step of
/// all).
pub(super) fn check(cfg: &TrainConfig) -> Result<(), TrainError> {
    // An asynchronous checkpoint stops every worker after its step `C / W`
    // and waits for global step `C`: the steps before `C` in the bounded
    // order must be those steps, which holds for one step a turn only.
    let applied = super::delay::applied_turn_steps(cfg);
    if let Some(k) = applied.filter(|&k| k > 1 && cfg.checkpoints_during_run()) {
        return Err(TrainError::Config(format!(
            "--turn-steps {k}: checkpoints during an asynchronous run stop every worker at the \
             same step, which needs one step a turn (--turn-steps 1)"
        )));
    }
    if let Some(n) = cfg.delta_every_steps {
        let bad = |why: &str| {
            Err(TrainError::Config(format!(
                "--delta-every-steps {n}: {why}"
            )))
        };
        if cfg.checkpoint_dir.is_none() {
            return bad("needs --checkpoint-dir");
        }
        if n == 0 {
            return bad("must be positive");
        }
        if cfg.steps_to_live > 0 {
            return bad(
                "--steps-to-live evicts rows a delta does not list (take full checkpoints)",
            );
        }
    }
    if let Some(s) = cfg.checkpoint_every_secs {
        let bad = |why: &str| {
            Err(TrainError::Config(format!(
                "--checkpoint-every-secs {}: {why}",
                s.as_secs_f64()
            )))
        };
        if cfg.checkpoint_dir.is_none() {
            return bad("needs --checkpoint-dir");
        }
    }
    let Some(n) = cfg.checkpoint_every_steps else {
        return Ok(());
    };
    let bad = |why: &str| {
        Err(TrainError::Config(format!(
            "--checkpoint-every-steps {n}: {why}"
        )))
    };
    if cfg.checkpoint_dir.is_none() {
        return bad("needs --checkpoint-dir");
    }
    if n == 0 || n % cfg.workers as u64 != 0 {
        return bad(&format!(
            "must be a positive multiple of the {} workers (train --workers, or the hosts \
             of --worker-hosts or TF_CONFIG; the global step moves by one per worker each \
             step)",
            cfg.workers
        ));
    }
    Ok(())
}

/// A worker about to push the step that completes global step `c`: its
/// progress after that step, for the manifest.
pub(super) fn write_progress(
    dir: &Path,
    c: u64,
    progress: &WorkerProgress,
) -> Result<(), TrainError> {
    let path = progress_file(dir, c, progress.worker);
    let ck = ck(&path);
    create_step_dir(dir, c).map_err(|e| ck(e.to_string()))?;
    let json = serde_json::to_vec(progress).map_err(|e| ck(e.to_string()))?;
    starwire_ps::write_atomic(&path, |w| {
        w.write_all(&json)
            .map_err(starwire_ps::CheckpointError::from)
    })
    .map_err(|e| ck(e.to_string()))
}

/// Worker 0, through the barrier of checkpoint step `c`: every shard file
/// and every worker's progress is in `DIR/steps/c/`; write the manifest
/// naming them, then remove the step directories before the previous
/// checkpoint.
pub(super) fn complete(
    cfg: &TrainConfig,
    plan: &Plan,
    dir: &Path,
    c: u64,
) -> Result<(), TrainError> {
    let mut workers = Vec::with_capacity(cfg.workers);
    for w in 0..cfg.workers as u32 {
        let path = progress_file(dir, c, w);
        let ck = ck(&path);
        let text = std::fs::read(&path).map_err(|e| ck(e.to_string()))?;
        let p = WorkerProgress::from_json(&text).map_err(|e| ck(e.to_string()))?;
        if p.worker != w {
            return Err(ck(format!("holds worker {}'s progress", p.worker)));
        }
        workers.push(p);
    }
    publish(cfg, plan, dir, c, workers)
}

/// Every worker's position after `k` synchronous steps of `epoch_steps`
/// steps per epoch: all run the same steps, so `k` steps are
/// `k / epoch_steps` epochs and `k % epoch_steps` batches of each
/// worker's share, `shares` (full but where a run of them ends: a batch
/// does not span files).
pub(super) fn sync_progress(
    cfg: &TrainConfig,
    k: u64,
    epoch_steps: Option<u64>,
    shares: &[EpochBatches],
) -> Vec<WorkerProgress> {
    let e = epoch_steps.unwrap_or(0).max(1);
    (0..cfg.workers as u32)
        .zip(shares)
        .map(|(worker, share)| WorkerProgress {
            worker,
            epoch: k / e,
            offset: share.examples_in(k % e),
            steps: k,
            examples: examples_after(cfg, share, k, epoch_steps),
            deal_block: deal_block(cfg) as u64,
            workers: Some(cfg.workers as u64),
        })
        .collect()
}

/// Worker 0, through the barrier of checkpoint step `c` (every shard file
/// is in `DIR/steps/c/`): write the manifest naming the files and
/// `workers`' progress, then remove the step directories before the
/// previous checkpoint.
pub(super) fn publish(
    cfg: &TrainConfig,
    plan: &Plan,
    dir: &Path,
    c: u64,
    workers: Vec<WorkerProgress>,
) -> Result<(), TrainError> {
    let previous = read_manifest(dir)?.map(|m| m.global_step);
    check_shard_files(dir, plan.shards, c)?;
    let rel = Path::new("steps").join(c.to_string());
    let files = (0..plan.shards)
        .map(|s| rel.join(shard_file(s)).to_string_lossy().into_owned())
        .collect();
    write_manifest(cfg, plan, dir, files, vec![c; plan.shards], workers)?;
    tracing::info!(target: "status", global_step = c, "checkpoint written into {}", dir.display());
    prune(dir, [Some(c), previous]);
    Ok(())
}

/// Every shard file of checkpoint step `c` is in `DIR/steps/c/` and its
/// header names the shard and step `c`: a shard whose write failed (out of
/// space) reported it to the pushing worker only, and the barrier released
/// the others all the same, so worker 0 looks before it names the files.
/// On an error the manifest is not written: it still names the previous
/// checkpoint, which is whole.
fn check_shard_files(dir: &Path, shards: usize, c: u64) -> Result<(), TrainError> {
    for s in 0..shards {
        let path = step_dir(dir, c).join(shard_file(s));
        let ck = ck(&path);
        let fail = |reason: String| {
            ck(format!(
                "checkpoint at global step {c} not written (the manifest still names the \
                 previous one): {reason}"
            ))
        };
        let mut f = std::fs::File::open(&path).map_err(|e| fail(e.to_string()))?;
        let h = starwire_ps::checkpoint::read_header(&mut f).map_err(|e| fail(e.to_string()))?;
        if h.shard_index != s as u64 || h.global_step != c {
            return Err(fail(format!(
                "the file holds shard {} at global step {}",
                h.shard_index, h.global_step
            )));
        }
    }
    Ok(())
}

/// Remove the step directories of `dir` older than those of `keep`; a
/// failure only costs disk space, so it is a warning.
fn prune(dir: &Path, keep: [Option<u64>; 2]) {
    let steps = dir.join("steps");
    let Ok(entries) = std::fs::read_dir(&steps) else {
        return;
    };
    // Only older directories go: without --sync a worker may already be
    // writing its progress into the next checkpoint's directory.
    let Some(oldest) = keep.iter().flatten().min().copied() else {
        return;
    };
    for e in entries.flatten() {
        let step = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok());
        if step.is_some_and(|s| s < oldest) {
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                tracing::warn!("removing the old checkpoint {}: {err}", e.path().display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard file of step `c`'s header alone (all the check reads).
    fn header(dir: &Path, c: u64, shard: usize, step: u64) {
        let mut b = starwire_ps::checkpoint::MAGIC.to_vec();
        b.extend_from_slice(&starwire_ps::checkpoint::FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&(shard as u64).to_le_bytes());
        b.extend_from_slice(&step.to_le_bytes());
        std::fs::create_dir_all(step_dir(dir, c)).unwrap();
        std::fs::write(step_dir(dir, c).join(shard_file(shard)), b).unwrap();
    }

    /// A shard file missing (its write failed) or of another step: the
    /// manifest is not written and still names the previous checkpoint.
    #[test]
    fn a_checkpoint_with_a_shard_file_missing_is_not_published() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TrainConfig {
            ps_reactors: 2,
            checkpoint_dir: Some(dir.path().to_owned()),
            ..TrainConfig::default()
        };
        let plan = super::super::plan(&cfg).unwrap();
        assert_eq!(plan.shards, 2);
        let named = || read_manifest(dir.path()).unwrap().map(|m| m.global_step);
        for s in 0..2 {
            header(dir.path(), 32, s, 32);
        }
        publish(&cfg, &plan, dir.path(), 32, Vec::new()).unwrap();
        assert_eq!(named(), Some(32));
        // Step 64: shard 1's file was never written.
        header(dir.path(), 64, 0, 64);
        let e = publish(&cfg, &plan, dir.path(), 64, Vec::new()).unwrap_err();
        assert!(e.to_string().contains("shard-0001.ckpt"), "{e}");
        assert_eq!(named(), Some(32));
        assert!(
            step_dir(dir.path(), 32).exists(),
            "the previous one is kept"
        );
        // A file left of another step is not this checkpoint's.
        header(dir.path(), 64, 1, 32);
        let e = publish(&cfg, &plan, dir.path(), 64, Vec::new()).unwrap_err();
        assert!(e.to_string().contains("at global step 32"), "{e}");
        assert_eq!(named(), Some(32));
        header(dir.path(), 64, 1, 64);
        publish(&cfg, &plan, dir.path(), 64, Vec::new()).unwrap();
        assert_eq!(named(), Some(64));
    }

    #[test]
    fn checkpoint_steps_are_the_positive_multiples() {
        assert!(!is_checkpoint_step(0, 4));
        assert!(!is_checkpoint_step(6, 4));
        assert!(is_checkpoint_step(8, 4));
        assert!(!is_checkpoint_step(8, 0), "0: never");
    }

    #[test]
    fn steps_in_a_row_refuse_asynchronous_checkpoints_during_the_run() {
        let run = |turn_steps, sync| TrainConfig {
            sync,
            workers: 2,
            train_examples: 10_000,
            bounded_delay: (!sync).then_some(4),
            turn_steps,
            checkpoint_dir: Some("/tmp/x".into()),
            checkpoint_every_secs: Some(std::time::Duration::from_secs(1)),
            ..TrainConfig::default()
        };
        let e = check(&run(Some(3), false)).unwrap_err();
        assert!(e.to_string().contains("--turn-steps 3"), "{e}");
        assert!(check(&run(Some(1), false)).is_ok());
        assert!(check(&run(None, false)).is_ok());
        assert!(check(&run(Some(3), true)).is_ok(), "--sync takes no turns");
    }

    #[test]
    fn the_flag_needs_a_directory_and_a_multiple_of_the_workers() {
        let ok = TrainConfig {
            sync: true,
            workers: 2,
            checkpoint_dir: Some("/tmp/x".into()),
            checkpoint_every_steps: Some(4),
            ..TrainConfig::default()
        };
        assert!(check(&ok).is_ok());
        let not_sync = TrainConfig {
            sync: false,
            ..ok.clone()
        };
        assert!(check(&not_sync).is_ok());
        // Criteo files' shares are counted when the workers start.
        assert!(check(&TrainConfig {
            train: crate::source::DataSource::Criteo("/tmp/x.tsv".into()),
            ..not_sync
        })
        .is_ok());
        for (cfg, says) in [
            (
                TrainConfig {
                    checkpoint_dir: None,
                    ..ok.clone()
                },
                "needs --checkpoint-dir",
            ),
            (
                TrainConfig {
                    checkpoint_every_steps: Some(3),
                    ..ok.clone()
                },
                "multiple of the 2 workers",
            ),
        ] {
            let e = check(&cfg).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        let secs = TrainConfig {
            checkpoint_every_steps: None,
            checkpoint_every_secs: Some(std::time::Duration::from_secs(30)),
            ..ok.clone()
        };
        assert!(check(&secs).is_ok());
        assert!(check(&TrainConfig {
            sync: false,
            ..secs.clone()
        })
        .is_ok());
        let e = check(&TrainConfig {
            checkpoint_dir: None,
            ..secs
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--checkpoint-every-secs 30: needs --checkpoint-dir"),
            "{e}"
        );
    }

    /// Where a worker's batches are not all full (a file's last), its
    /// position counts the examples of its batches, not full ones; a
    /// worker whose share has more steps than the epoch's stops there.
    #[test]
    fn sync_progress_counts_short_batches_at_file_ends() {
        let cfg = TrainConfig {
            workers: 2,
            batch_size: 256,
            epochs: 2,
            ..TrainConfig::default()
        };
        let shares = [
            EpochBatches::new(vec![100, 100, 100], 256),
            EpochBatches::new(vec![100, 100, 300], 256),
        ];
        let p = sync_progress(&cfg, 5, Some(3), &shares);
        let got: Vec<_> = p.iter().map(|p| (p.epoch, p.offset, p.examples)).collect();
        assert_eq!(got, [(1, 200, 300 + 200), (1, 200, 456 + 200)]);
        // At the end of the run: every epoch, cut to 3 steps.
        let p = sync_progress(&cfg, 6, Some(3), &shares);
        assert_eq!((p[1].epoch, p[1].examples), (2, 2 * 456));
    }

    /// Lockstep workers' positions follow from the step count, across
    /// epochs.
    #[test]
    fn sync_progress_counts_full_batches_and_epochs() {
        let cfg = TrainConfig {
            workers: 2,
            batch_size: 100,
            epochs: 3,
            ..TrainConfig::default()
        };
        let shares = vec![EpochBatches::new(vec![500], 100); 2];
        let p = sync_progress(&cfg, 13, Some(5), &shares);
        assert_eq!(p.len(), 2);
        assert_eq!(
            (
                p[1].worker,
                p[1].epoch,
                p[1].offset,
                p[1].steps,
                p[1].examples
            ),
            (1, 2, 300, 13, 1300)
        );
    }
}

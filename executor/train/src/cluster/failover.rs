//! A worker task's failover (`starwire worker` with `--checkpoint-dir`):
//! when its connections to a PS task fail, it reconnects (the dial retries
//! with backoff up to `--connect-timeout`), asks every shard for its
//! incarnation, and when a PS task restarted ([`TrainError::PeerRestarted`])
//! it goes on from its position in the checkpoint the restarted task
//! restored, as every other worker does: with `--sync` every step after the
//! checkpoint is trained again from the same model on the same data, so the
//! run ends as an uninterrupted one would.
//!
//! A connection that failed while its PS task lives on (the same
//! incarnation answers) is not rolled back: what that task applied since
//! the checkpoint is still there, so the error stands.

use std::time::Instant;

use starwire_ps::WorkerProgress;
use starwire_wire::ps::Control;

use super::roles::read_manifest;
use super::{TrainConfig, WorkerNet};
use crate::worker::control_all;
use crate::TrainError;

/// At most this many PS restarts are gone through in one worker run.
pub(super) const MAX_RESTARTS: u32 = 16;

/// Each shard's `field` of `STATS` (a number).
fn stats_field(
    net: &mut dyn WorkerNet,
    shards: usize,
    field: &str,
) -> Result<Vec<u64>, TrainError> {
    control_all(net, shards, &Control::Stats)?
        .iter()
        .map(|b| {
            serde_json::from_slice::<serde_json::Value>(b)
                .ok()
                .and_then(|v| v[field].as_u64())
                .ok_or_else(|| TrainError::Remote(format!("STATS without the shard's {field}")))
        })
        .collect()
}

/// Each shard's incarnation (the PS task's, from `STATS`).
pub(super) fn incarnations(net: &mut dyn WorkerNet, shards: usize) -> Result<Vec<u64>, TrainError> {
    stats_field(net, shards, "incarnation")
}

/// The global step the restarted PS tasks restored (from `STATS`; the
/// highest over the shards, which a consistent checkpoint makes the step of
/// each shard that applied any step).
pub(super) fn restored_step(net: &mut dyn WorkerNet, shards: usize) -> Result<u64, TrainError> {
    Ok(stats_field(net, shards, "restored_step")?
        .into_iter()
        .max()
        .unwrap_or(0))
}

/// The first shard whose incarnation changed, as the typed event.
pub(super) fn restarted(before: &[u64], now: &[u64]) -> Option<TrainError> {
    before
        .iter()
        .zip(now)
        .enumerate()
        .find(|(_, (b, n))| b != n)
        .map(|(shard, (&previous, &now))| TrainError::PeerRestarted {
            shard,
            previous,
            now,
        })
}

/// Whether `e` is a lost connection, which a restarted PS explains.
pub(super) fn is_link_failure(e: &TrainError) -> bool {
    matches!(e, TrainError::Link(..) | TrainError::Io(_))
}

/// What the worker resumes from after a restart: its position in the
/// checkpoint of global step `restored`, the one the restarted PS restored
/// (0: none, from the start). The manifest names it, unless worker 0 wrote
/// a newer one after the PS read it (a checkpoint completed as the PS
/// died): then the step directory's own record of this worker's position
/// is read.
pub(super) fn rollback(
    cfg: &TrainConfig,
    index: usize,
    restored: u64,
) -> Result<(Option<u64>, Option<WorkerProgress>), TrainError> {
    let Some(dir) = cfg.checkpoint_dir.as_deref().filter(|_| restored > 0) else {
        return Ok((None, None));
    };
    let m = read_manifest(dir)?;
    if let Some(m) = m.filter(|m| m.global_step == restored) {
        let p = m.workers.into_iter().find(|p| p.worker as usize == index);
        return Ok((Some(restored), p));
    }
    let path = super::periodic::progress_file(dir, restored, index as u32);
    let fail = |reason: String| TrainError::Checkpoint {
        path: path.clone(),
        reason: format!(
            "the restarted PS restored global step {restored}, whose position of this worker \
             is not in the manifest: {reason}"
        ),
    };
    let text = std::fs::read(&path).map_err(|e| fail(e.to_string()))?;
    let p = WorkerProgress::from_json(&text).map_err(|e| fail(e.to_string()))?;
    Ok((Some(restored), Some(p)))
}

/// The step a worker resumes at, from each shard's record of its steps
/// (none: the shard has no record of it) and `from`, its position in the
/// checkpoint: the lowest of the steps the shards hold, and no higher than
/// `from` when a shard has no record of the worker (a PS task restarted
/// without a checkpoint, or from one older than the worker's first push):
/// that shard needs every step after `from` replayed, which the shards
/// that hold them acknowledge without applying them again.
fn resume_step(records: &[Option<u64>], from: u64) -> u64 {
    let held = records.iter().flatten().copied().min();
    let missing = records.iter().any(Option::is_none).then_some(from);
    held.into_iter().chain(missing).min().unwrap_or(from)
}

/// The step worker `index` resumes at, `from` being its position's (its
/// checkpoint's, 0 without one): the lowest of its steps the shards hold
/// (`STATS` `worker_steps`: applied, or with `--sync` kept for the step
/// being gathered), or `from` when lower and a shard has no record of it
/// (see [`resume_step`]).
/// Every shard is told (`RESUME_AT`), so one that holds more of its steps
/// acknowledges their replayed pushes without applying them again: the
/// worker, killed and restarted, trains each example once. With `--sync`
/// its first step then waits for the others' (the barrier of the steps it
/// passed over), so the run goes on as if it had not died; only when the
/// shards disagree (it died between its pushes of one step to two shards,
/// and one of them applied that step) is its replayed step computed on
/// that shard's newer values, which is said at warn.
pub(super) fn resume_at(
    net: &mut dyn WorkerNet,
    shards: usize,
    index: usize,
    from: u64,
    sync: bool,
) -> Result<u64, TrainError> {
    let key = index.to_string();
    let mut records: Vec<Option<u64>> = Vec::new();
    for b in control_all(net, shards, &Control::Stats)? {
        let v: serde_json::Value = serde_json::from_slice(&b)
            .map_err(|e| TrainError::Remote(format!("STATS is not JSON: {e}")))?;
        records.push(v["worker_steps"][key.as_str()].as_u64());
    }
    let held: Vec<u64> = records.iter().flatten().copied().collect();
    let at = resume_step(&records, from);
    if at < from {
        return Err(TrainError::Remote(format!(
            "the PS has applied {at} of worker {index}'s steps, fewer than its position in the \
             checkpoint ({from} steps): the checkpoint is not the PS's"
        )));
    }
    control_all(net, shards, &Control::ResumeAt(at))?;
    if at > from {
        tracing::info!(
            target: "status",
            worker = index,
            "the PS holds this worker's first {at} steps: passing over the {} after its \
             checkpoint's position without training them again",
            at - from
        );
    }
    if sync && held.iter().any(|&n| n != at) {
        tracing::warn!(
            worker = index,
            "the shards hold different numbers of this worker's steps ({held:?}): its step {at} \
             is trained again on the values of the shards that applied it already, so the run \
             differs from an uninterrupted one in that step (each example is still trained \
             once)"
        );
    }
    Ok(at)
}

/// A restart gone through, for the report.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Failover {
    /// The global step rolled back to (none: the start).
    pub rolled_back_to: Option<u64>,
    /// From the failure seen to the connections up again, seconds.
    pub reconnect_seconds: f64,
}

/// Time since `t`, in seconds.
pub(super) fn since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_ps::Manifest;

    fn progress(worker: u32, steps: u64) -> WorkerProgress {
        WorkerProgress {
            worker,
            epoch: 0,
            offset: steps * 10,
            steps,
            examples: steps * 10,
            deal_block: 10,
            workers: Some(2),
        }
    }

    /// A shard with no record of the worker (its PS task restarted
    /// without a checkpoint) needs every step after the checkpoint's
    /// position: the worker resumes there, not at the lowest step another
    /// shard holds.
    #[test]
    fn a_shard_without_a_record_resumes_at_the_checkpoint_position() {
        // Two PS tasks: PS 1 restarted fresh, PS 0 holds 15 steps.
        assert_eq!(resume_step(&[Some(15), None], 0), 0);
        assert_eq!(resume_step(&[None, Some(15)], 0), 0);
        assert_eq!(resume_step(&[Some(40), None], 32), 32);
        // Every shard holds a record: the lowest.
        assert_eq!(resume_step(&[Some(15), Some(12)], 0), 12);
        assert_eq!(resume_step(&[Some(40), Some(36)], 32), 36);
        // No shard does: the checkpoint's position.
        assert_eq!(resume_step(&[None, None], 32), 32);
        assert_eq!(resume_step(&[], 32), 32);
        // A shard behind the checkpoint is still reported (below `from`).
        assert_eq!(resume_step(&[Some(10), None], 32), 10);
    }

    /// The manifest names the restored step, or a newer one (written as
    /// the PS died): the step directory's record is read then.
    #[test]
    fn rollback_goes_to_the_restored_step() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TrainConfig {
            checkpoint_dir: Some(dir.path().to_owned()),
            ..TrainConfig::default()
        };
        let m = Manifest {
            format_version: starwire_ps::checkpoint::FORMAT_VERSION,
            global_step: 96,
            shard_count: 1,
            seed: 1,
            model: serde_json::json!({}),
            shard_files: vec!["steps/96/shard-0000.ckpt".into()],
            workers: vec![progress(0, 48), progress(1, 48)],
            shard_steps: vec![96],
        };
        std::fs::write(dir.path().join("manifest.json"), m.to_json().unwrap()).unwrap();
        assert_eq!(
            rollback(&cfg, 1, 96).unwrap(),
            (Some(96), Some(progress(1, 48)))
        );
        assert_eq!(rollback(&cfg, 1, 0).unwrap(), (None, None));
        let e = rollback(&cfg, 1, 64).unwrap_err().to_string();
        assert!(e.contains("restored global step 64"), "{e}");
        super::super::periodic::write_progress(dir.path(), 64, &progress(1, 32)).unwrap();
        assert_eq!(
            rollback(&cfg, 1, 64).unwrap(),
            (Some(64), Some(progress(1, 32)))
        );
    }
}

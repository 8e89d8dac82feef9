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

/// Each shard's incarnation (the PS task's, from `STATS`).
pub(super) fn incarnations(net: &mut dyn WorkerNet, shards: usize) -> Result<Vec<u64>, TrainError> {
    control_all(net, shards, &Control::Stats)?
        .iter()
        .map(|b| {
            serde_json::from_slice::<serde_json::Value>(b)
                .ok()
                .and_then(|v| v["incarnation"].as_u64())
                .ok_or_else(|| TrainError::Remote("STATS without the shard's incarnation".into()))
        })
        .collect()
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
/// checkpoint the restarted PS restored (none: from the start).
pub(super) fn rollback(
    cfg: &TrainConfig,
    index: usize,
) -> Result<(Option<u64>, Option<WorkerProgress>), TrainError> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok((None, None));
    };
    let m = read_manifest(dir)?;
    let step = m.as_ref().map(|m| m.global_step);
    let p = m.and_then(|m| m.workers.into_iter().find(|p| p.worker as usize == index));
    Ok((step, p))
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

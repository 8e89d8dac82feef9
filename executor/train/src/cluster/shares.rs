//! How much of the data each worker trains, known before the run: its
//! step cap, its share of an epoch, the examples after its first `k`
//! steps, and the steps every worker reaches (the checkpoint steps of an
//! asynchronous run).

use super::TrainConfig;
use starwire_data::Deal;

use crate::source::{DataSource, Reader};
use crate::TrainError;

/// Worker `w`'s total step cap from `--steps N`: N split as evenly as
/// possible, so the workers together run exactly N.
pub(super) fn step_cap(cfg: &TrainConfig, w: usize) -> Option<u64> {
    let n = cfg.workers as u64;
    cfg.steps.map(|s| s / n + u64::from((w as u64) < s % n))
}

/// Examples in one epoch of the training data: known for the generator,
/// counted (one line per example) for a file.
fn epoch_examples(cfg: &TrainConfig) -> Result<u64, TrainError> {
    match &cfg.train {
        DataSource::Synthetic => Ok(cfg.train_examples),
        DataSource::Criteo(p) => {
            use std::io::Read;
            let mut f = std::fs::File::open(p).map_err(|e| {
                TrainError::Data(starwire_data::DataError::Open {
                    path: p.clone(),
                    source: e,
                })
            })?;
            let mut buf = vec![0u8; 1 << 20];
            let (mut lines, mut last) = (0u64, b'\n');
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
                last = buf[n - 1];
            }
            Ok(lines + u64::from(last != b'\n'))
        }
    }
}

/// The generator's examples dealt to a worker at a time.
///
/// Asynchronously, a batch, at most an even share (so that every worker
/// has examples when there are as many examples as workers): every
/// worker's share is then whole batches but for the block that ends the
/// epoch, and, when the batch is the block, the workers together take as
/// many steps an epoch as one worker would ([`Deal`]).
///
/// With `--sync`, one: every worker takes the steps of the smallest share
/// an epoch, which dealt one at a time is at most one example short of the
/// largest, where a block more would be left out of the epoch.
///
/// Criteo files, one line at a time: a worker reads several files, each
/// from its first line, so blocks would deal every file's first block to
/// the same workers, and many short files would leave the others idle.
pub fn deal_block(cfg: &TrainConfig) -> usize {
    match cfg.train {
        DataSource::Synthetic if !cfg.sync => {
            let even = cfg.train_examples / cfg.workers.max(1) as u64;
            let even = usize::try_from(even).unwrap_or(usize::MAX).max(1);
            cfg.batch_size.max(1).min(even)
        }
        _ => 1,
    }
}

/// Worker `w`'s deal of the training data.
pub fn deal(cfg: &TrainConfig, w: usize) -> Result<Deal, TrainError> {
    Deal::new(w, cfg.workers, deal_block(cfg)).map_err(|e| TrainError::Config(e.to_string()))
}

/// Examples in worker `w`'s share of one epoch, when known without
/// reading the data (the generator's, by its [`deal`]).
pub(super) fn share_examples(cfg: &TrainConfig, w: usize) -> Option<u64> {
    match cfg.train {
        DataSource::Synthetic => deal(cfg, w).ok().map(|d| d.share(cfg.train_examples)),
        DataSource::Criteo(_) => None,
    }
}

/// Examples worker `w` trains in one epoch and the steps it takes: its
/// share, cut to `epoch_cap` batches under `--sync`.
fn epoch_plan(cfg: &TrainConfig, share: u64, epoch_cap: Option<u64>) -> (u64, u64) {
    let b = cfg.batch_size.max(1) as u64;
    let steps = share.div_ceil(b);
    match epoch_cap {
        Some(c) if c < steps => (c * b, c),
        _ => (share, steps),
    }
}

/// Examples of worker `w` in the first `k` of its steps of an
/// uninterrupted run (none: its share is not known).
pub(super) fn examples_after(
    cfg: &TrainConfig,
    w: usize,
    k: u64,
    epoch_cap: Option<u64>,
) -> Option<u64> {
    let (per_epoch, steps) = epoch_plan(cfg, share_examples(cfg, w)?, epoch_cap);
    if steps == 0 {
        return Some(0);
    }
    let full = (k / steps).min(cfg.epochs);
    let rest = if full < cfg.epochs {
        ((k % steps) * cfg.batch_size as u64).min(per_epoch)
    } else {
        0
    };
    Some(full * per_epoch + rest)
}

/// Steps an uninterrupted run takes, asynchronously, on worker `w` whose
/// share of an epoch is `share` examples.
fn steps_planned(cfg: &TrainConfig, w: usize, share: u64) -> u64 {
    let per_epoch = share.div_ceil(cfg.batch_size.max(1) as u64);
    let all = per_epoch.saturating_mul(cfg.epochs);
    step_cap(cfg, w).map_or(all, |c| c.min(all))
}

/// The steps each worker of an uninterrupted run takes, by worker, when
/// every share is known without reading the data (none for Criteo files).
pub(super) fn known_steps(cfg: &TrainConfig) -> Option<Vec<u64>> {
    (0..cfg.workers)
        .map(|w| share_examples(cfg, w).map(|n| steps_planned(cfg, w, n)))
        .collect()
}

/// Asynchronous checkpoints during the run stop every worker at the same
/// step: the last step every worker reaches (none: no worker). The
/// generator's shares are known; Criteo files' are counted by reading
/// every worker's share (one pass over the data per worker).
pub(super) fn last_common_step(cfg: &TrainConfig) -> Result<Option<u64>, TrainError> {
    let mut min = None;
    for w in 0..cfg.workers {
        let share = match (&cfg.train, share_examples(cfg, w)) {
            (_, Some(n)) => n,
            (DataSource::Criteo(p), None) => {
                Reader::count_share(p, deal(cfg, w)?, cfg.skip_bad_lines)?
            }
            (DataSource::Synthetic, None) => 0,
        };
        let steps = steps_planned(cfg, w, share);
        min = Some(min.map_or(steps, |m: u64| m.min(steps)));
    }
    Ok(min)
}

/// Examples an uninterrupted run trains on worker `w`: every epoch of its
/// share, up to its `--steps` cap.
pub fn examples_planned(cfg: &TrainConfig, w: usize) -> Result<Option<u64>, TrainError> {
    let epoch_cap = sync_epoch_steps(cfg)?;
    let k = step_cap(cfg, w).unwrap_or(u64::MAX);
    Ok(examples_after(cfg, w, k, epoch_cap))
}

/// With `--sync`, every worker runs the same number of steps per epoch (a
/// barrier waits for all of them): the batches of the smallest share.
pub(super) fn sync_epoch_steps(cfg: &TrainConfig) -> Result<Option<u64>, TrainError> {
    if !cfg.sync {
        return Ok(None);
    }
    // Dealt one at a time (`deal_block`): the smallest share is an even one.
    let min_share = epoch_examples(cfg)? / cfg.workers as u64;
    if min_share == 0 {
        return Err(TrainError::Config(format!(
            "--sync with {} workers needs at least one example per worker",
            cfg.workers
        )));
    }
    Ok(Some(min_share.div_ceil(cfg.batch_size as u64)))
}

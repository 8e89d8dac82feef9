//! How much of the data each worker trains, known before the run: its
//! step cap, its share of an epoch, the examples after its first `k`
//! steps, and the steps every worker reaches (the checkpoint steps of an
//! asynchronous run).

use std::sync::{Arc, Mutex};

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

/// A worker's batches of one epoch, in the order it reads them: runs of
/// examples, each read in full batches but for its last (the generator's
/// share is one run; a batch does not span Criteo files, so each file
/// ends a run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochBatches {
    runs: Vec<u64>,
    batch: u64,
}

impl EpochBatches {
    /// `runs` of examples read in batches of `batch_size`.
    pub fn new(runs: Vec<u64>, batch_size: usize) -> Self {
        Self {
            runs,
            batch: batch_size.max(1) as u64,
        }
    }

    /// Steps an epoch.
    pub fn steps(&self) -> u64 {
        self.runs.iter().map(|r| r.div_ceil(self.batch)).sum()
    }

    /// Examples in the first `k` steps of an epoch (all of them when `k`
    /// is at least [`steps`](Self::steps)).
    pub fn examples_in(&self, mut k: u64) -> u64 {
        let mut n = 0u64;
        for &r in &self.runs {
            let s = r.div_ceil(self.batch);
            if k < s {
                return n + k * self.batch;
            }
            n += r;
            k -= s;
        }
        n
    }
}

/// Worker `w`'s batches of one epoch: the generator's from its deal,
/// Criteo files' counted by reading its share.
fn epoch_batches(cfg: &TrainConfig, w: usize) -> Result<EpochBatches, TrainError> {
    let runs = match (&cfg.train, share_examples(cfg, w)) {
        (_, Some(n)) => vec![n],
        (DataSource::Criteo(p), None) => {
            Reader::count_share(p, deal(cfg, w)?, cfg.skip_bad_lines, cfg.batch_size)?
        }
        (DataSource::Synthetic, None) => Vec::new(),
    };
    Ok(EpochBatches::new(runs, cfg.batch_size))
}

/// Worker `w`'s examples of each of the files of `lines` lines that it
/// reads, as they are dealt to `workers` (`starwire_data::files`): whole
/// files, file `i` to worker `i % workers`, when there are as many files
/// as workers; else the lines `w` modulo `workers` of every file.
fn dealt(lines: &[u64], w: usize, workers: usize) -> Vec<u64> {
    let (w, n) = (w as u64, workers.max(1) as u64);
    let runs: Vec<u64> = if lines.len() >= workers {
        lines
            .iter()
            .skip(w as usize)
            .step_by(workers.max(1))
            .copied()
            .collect()
    } else {
        lines
            .iter()
            .map(|&c| c / n + u64::from(w < c % n))
            .collect()
    };
    runs.into_iter().filter(|&r| r > 0).collect()
}

/// Every worker's batches of one epoch, counted once per [`ShareCache`]
/// (Criteo files are read once to count their lines; with
/// `--skip-bad-lines`, whose bad lines are no examples, each worker's
/// share is read as it reads it: once over the data when every worker has
/// files of its own, once per worker when they split lines).
#[derive(Debug, Clone, Default)]
pub struct ShareCache(Arc<Mutex<Option<Arc<Vec<EpochBatches>>>>>);

impl ShareCache {
    /// Every worker's batches of one epoch under `cfg`, by worker.
    pub fn get(&self, cfg: &TrainConfig) -> Result<Arc<Vec<EpochBatches>>, TrainError> {
        // Held while counting: the other workers wait for the count
        // rather than read the data again.
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(all) = g.as_ref().filter(|a| a.len() == cfg.workers) {
            return Ok(all.clone());
        }
        let all = Arc::new(match &cfg.train {
            // Every line is an example (or an error): each file's lines,
            // read once, give every worker's share.
            DataSource::Criteo(p) if !cfg.skip_bad_lines => {
                let lines = starwire_data::files::line_counts(p)?;
                (0..cfg.workers)
                    .map(|w| EpochBatches::new(dealt(&lines, w, cfg.workers), cfg.batch_size))
                    .collect()
            }
            _ => (0..cfg.workers)
                .map(|w| epoch_batches(cfg, w))
                .collect::<Result<Vec<_>, _>>()?,
        });
        *g = Some(all.clone());
        Ok(all)
    }
}

/// Examples worker `w` trains in one epoch and the steps it takes: its
/// share, cut to `epoch_cap` steps under `--sync`.
fn epoch_plan(share: &EpochBatches, epoch_cap: Option<u64>) -> (u64, u64) {
    let steps = share.steps();
    let steps = epoch_cap.map_or(steps, |c| c.min(steps));
    (share.examples_in(steps), steps)
}

/// Examples of a worker whose batches of an epoch are `share` in the
/// first `k` of its steps of an uninterrupted run.
pub(super) fn examples_after(
    cfg: &TrainConfig,
    share: &EpochBatches,
    k: u64,
    epoch_cap: Option<u64>,
) -> u64 {
    let (per_epoch, steps) = epoch_plan(share, epoch_cap);
    if steps == 0 {
        return 0;
    }
    let full = (k / steps).min(cfg.epochs);
    let rest = if full < cfg.epochs {
        share.examples_in(k % steps)
    } else {
        0
    };
    full * per_epoch + rest
}

/// Steps an uninterrupted run takes, asynchronously, on worker `w` that
/// takes `per_epoch` steps an epoch.
fn steps_planned(cfg: &TrainConfig, w: usize, per_epoch: u64) -> u64 {
    let all = per_epoch.saturating_mul(cfg.epochs);
    step_cap(cfg, w).map_or(all, |c| c.min(all))
}

/// The steps each worker of an uninterrupted run takes, by worker, when
/// every share is known without reading the data (none for Criteo files).
pub(super) fn known_steps(cfg: &TrainConfig) -> Option<Vec<u64>> {
    let b = cfg.batch_size.max(1) as u64;
    (0..cfg.workers)
        .map(|w| share_examples(cfg, w).map(|n| steps_planned(cfg, w, n.div_ceil(b))))
        .collect()
}

/// Asynchronous checkpoints during the run stop every worker at the same
/// step: the last step every worker reaches (none: no worker). The
/// generator's shares are known; Criteo files' are counted by reading
/// every worker's share.
pub(super) fn last_common_step(
    cfg: &TrainConfig,
    cache: &ShareCache,
) -> Result<Option<u64>, TrainError> {
    let all = cache.get(cfg)?;
    Ok(all
        .iter()
        .enumerate()
        .map(|(w, share)| steps_planned(cfg, w, share.steps()))
        .min())
}

/// Examples an uninterrupted run trains on worker `w`: every epoch of its
/// share, up to its `--steps` cap (none: Criteo files asynchronously,
/// whose shares are not counted unless a checkpoint needs them).
pub fn examples_planned(
    cfg: &TrainConfig,
    cache: &ShareCache,
    w: usize,
) -> Result<Option<u64>, TrainError> {
    let counted =
        cfg.sync || cfg.checkpoints_during_run() || matches!(cfg.train, DataSource::Synthetic);
    if !counted {
        return Ok(None);
    }
    let all = cache.get(cfg)?;
    let epoch_cap = sync_epoch_steps(cfg, cache)?;
    let k = step_cap(cfg, w).unwrap_or(u64::MAX);
    Ok(all.get(w).map(|s| examples_after(cfg, s, k, epoch_cap)))
}

/// With `--sync`, every worker runs the same number of steps per epoch (a
/// barrier waits for all of them): those of the share with the fewest.
pub(super) fn sync_epoch_steps(
    cfg: &TrainConfig,
    cache: &ShareCache,
) -> Result<Option<u64>, TrainError> {
    if !cfg.sync {
        return Ok(None);
    }
    let all = cache.get(cfg)?;
    let min = all.iter().map(EpochBatches::steps).min().unwrap_or(0);
    if min == 0 {
        return Err(TrainError::Config(format!(
            "--sync with {} workers needs at least one example per worker{}",
            cfg.workers,
            match &cfg.train {
                DataSource::Criteo(p) => format!(" in {}", p.display()),
                DataSource::Synthetic => String::new(),
            }
        )));
    }
    Ok(Some(min))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shares computed from each file's lines are those a worker's
    /// reader counts by reading its share, whole files or split lines.
    #[test]
    fn shares_from_line_counts_are_those_the_readers_count() {
        let dir = tempfile::tempdir().unwrap();
        let spec = starwire_data::SyntheticSpec::default();
        for (i, n) in [700u64, 256, 1, 1000, 513].into_iter().enumerate() {
            let f = dir.path().join(format!("part-{i}.tsv"));
            starwire_data::write_criteo(&f, n, spec).unwrap();
        }
        let lines = starwire_data::files::line_counts(dir.path()).unwrap();
        assert_eq!(lines, [700, 256, 1, 1000, 513]);
        for workers in [1, 2, 5, 6, 9] {
            let cfg = TrainConfig {
                train: DataSource::Criteo(dir.path().to_owned()),
                workers,
                batch_size: 128,
                ..TrainConfig::default()
            };
            for w in 0..workers {
                let read = Reader::count_share(dir.path(), deal(&cfg, w).unwrap(), false, 128)
                    .map(|runs| EpochBatches::new(runs, 128))
                    .unwrap();
                let counted = EpochBatches::new(dealt(&lines, w, workers), 128);
                assert_eq!(counted.steps(), read.steps(), "{w} of {workers}");
                for k in 0..=read.steps() {
                    assert_eq!(
                        counted.examples_in(k),
                        read.examples_in(k),
                        "{w}/{workers} {k}"
                    );
                }
            }
        }
    }
}

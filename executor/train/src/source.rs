//! Training and evaluation data: the synthetic generator or Criteo TSV
//! files (plain or `.gz`, a file, a directory or a glob pattern), split
//! across workers (see [`starwire_data::files`]).

use std::path::PathBuf;
use std::sync::Arc;

use starwire_data::criteo::ReaderOptions;
use starwire_data::{Batch, CriteoFiles, DataError, Synthetic, TrueModel};

/// Where examples come from (`--train` / `--eval`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// The built-in generator.
    Synthetic,
    /// Criteo-format TSV: a file, a directory or a glob pattern; `.gz`
    /// files are decompressed.
    Criteo(PathBuf),
}

impl std::str::FromStr for DataSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "synthetic" {
            Ok(DataSource::Synthetic)
        } else if let Some(p) = s.strip_prefix("criteo:") {
            if p.is_empty() {
                return Err("criteo: needs a path, e.g. criteo:/data/day_0.tsv".into());
            }
            Ok(DataSource::Criteo(PathBuf::from(p)))
        } else {
            Err(format!("expected synthetic or criteo:PATH, got {s:?}"))
        }
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Synthetic => f.write_str("synthetic"),
            DataSource::Criteo(p) => write!(f, "criteo:{}", p.display()),
        }
    }
}

/// An open stream of batches for one worker.
/// Examples read at a time when a share is counted.
const COUNT_BATCH: usize = 4096;

#[derive(Debug)]
pub enum Reader {
    /// A share of the synthetic stream.
    Synthetic(Synthetic),
    /// A share of the files (or of their lines).
    Criteo(CriteoFiles),
}

impl Reader {
    /// Worker `worker` of `workers`'s share of the training data.
    pub fn train(
        src: &DataSource,
        model: &Arc<TrueModel>,
        examples: u64,
        worker: usize,
        workers: usize,
        skip_bad_lines: bool,
    ) -> Result<Self, DataError> {
        Ok(match src {
            DataSource::Synthetic => Reader::Synthetic(
                Synthetic::new(model.clone(), starwire_data::Stream::Train, examples)
                    .split(worker, workers)?,
            ),
            DataSource::Criteo(p) => Reader::Criteo(CriteoFiles::open(
                p,
                ReaderOptions {
                    skip_bad_lines,
                    worker,
                    workers,
                    ..ReaderOptions::default()
                },
            )?),
        })
    }

    /// The evaluation set (synthetic: `n` held-out examples sharing the
    /// true weights).
    pub fn eval(
        src: &DataSource,
        model: &Arc<TrueModel>,
        n: u64,
        skip_bad_lines: bool,
    ) -> Result<Self, DataError> {
        Ok(match src {
            DataSource::Synthetic => Reader::Synthetic(Synthetic::new(
                model.clone(),
                starwire_data::Stream::Eval,
                n,
            )),
            DataSource::Criteo(p) => Reader::Criteo(CriteoFiles::open(
                p,
                ReaderOptions {
                    skip_bad_lines,
                    ..ReaderOptions::default()
                },
            )?),
        })
    }

    /// Up to `max` examples into `batch`; 0 at the end of the epoch. A
    /// file's errors name the file.
    /// Examples in worker `worker`'s share of one epoch of the Criteo
    /// files at `path`, counted by reading the share.
    pub fn count_share(
        path: &std::path::Path,
        worker: usize,
        workers: usize,
        skip_bad_lines: bool,
    ) -> Result<u64, DataError> {
        let mut r = CriteoFiles::open(
            path,
            ReaderOptions {
                skip_bad_lines,
                worker,
                workers,
                ..ReaderOptions::default()
            },
        )?;
        let mut batch = Batch::with_capacity(COUNT_BATCH);
        let mut n = 0u64;
        loop {
            let k = r.next_batch(COUNT_BATCH, &mut batch)?;
            if k == 0 {
                return Ok(n);
            }
            n += k as u64;
        }
    }

    pub fn next_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError> {
        match self {
            Reader::Synthetic(s) => Ok(s.next_batch(max, batch)),
            Reader::Criteo(r) => r.next_batch(max, batch),
        }
    }

    /// Start the next epoch.
    pub fn rewind(&mut self) -> Result<(), DataError> {
        match self {
            Reader::Synthetic(s) => {
                s.rewind();
                Ok(())
            }
            Reader::Criteo(r) => {
                r.rewind();
                Ok(())
            }
        }
    }

    /// Lines skipped as bad (Criteo with `--skip-bad-lines`).
    pub fn skipped(&self) -> u64 {
        match self {
            Reader::Synthetic(_) => 0,
            Reader::Criteo(r) => r.skipped(),
        }
    }
}

//! Training and evaluation data: the synthetic generator or a Criteo TSV
//! file, split across workers.

use std::path::PathBuf;
use std::sync::Arc;

use starwire_data::criteo::{CriteoReader, ReaderOptions};
use starwire_data::{Batch, DataError, Synthetic, TrueModel};

/// Where examples come from (`--train` / `--eval`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// The built-in generator.
    Synthetic,
    /// A Criteo-format TSV file.
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
#[derive(Debug)]
pub enum Reader {
    /// A share of the synthetic stream.
    Synthetic(Synthetic),
    /// A share of the lines of the file at the path.
    Criteo(CriteoReader, PathBuf),
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
            DataSource::Criteo(p) => Reader::Criteo(
                CriteoReader::open(
                    p,
                    ReaderOptions {
                        skip_bad_lines,
                        worker,
                        workers,
                        ..ReaderOptions::default()
                    },
                )?,
                p.clone(),
            ),
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
            DataSource::Criteo(p) => Reader::Criteo(
                CriteoReader::open(
                    p,
                    ReaderOptions {
                        skip_bad_lines,
                        ..ReaderOptions::default()
                    },
                )?,
                p.clone(),
            ),
        })
    }

    /// Up to `max` examples into `batch`; 0 at the end of the epoch. A
    /// file's errors name the file.
    pub fn next_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError> {
        match self {
            Reader::Synthetic(s) => Ok(s.next_batch(max, batch)),
            Reader::Criteo(r, p) => r.next_batch(max, batch).map_err(|e| e.in_file(p)),
        }
    }

    /// Start the next epoch.
    pub fn rewind(&mut self) -> Result<(), DataError> {
        match self {
            Reader::Synthetic(s) => {
                s.rewind();
                Ok(())
            }
            Reader::Criteo(r, p) => r.rewind().map_err(|e| e.in_file(p)),
        }
    }

    /// Lines skipped as bad (Criteo with `--skip-bad-lines`).
    pub fn skipped(&self) -> u64 {
        match self {
            Reader::Synthetic(_) => 0,
            Reader::Criteo(r, _) => r.counters().skipped,
        }
    }
}

//! Training and evaluation data: the synthetic generator or Criteo TSV
//! files (plain or `.gz`, a file, a directory or a glob pattern), split
//! across workers (see [`starwire_data::files`]).

use std::path::PathBuf;
use std::sync::Arc;

use starwire_data::criteo::ReaderOptions;
use starwire_data::{Batch, CriteoFiles, DataError, Deal, Synthetic, TrueModel};

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

/// Examples a share is counted in at most (its batch's capacity).
const COUNT_BATCH: usize = 4096;

/// An open stream of batches for one worker.
#[derive(Debug)]
pub enum Reader {
    /// A share of the synthetic stream.
    Synthetic(Synthetic),
    /// A share of the files (or of their lines).
    Criteo(CriteoFiles),
}

impl Reader {
    /// One worker's share of the training data, as `deal` deals it (Criteo
    /// files deal lines one at a time, whatever its block: see
    /// [`starwire_data::files`]).
    pub fn train(
        src: &DataSource,
        model: &Arc<TrueModel>,
        examples: u64,
        deal: Deal,
        skip_bad_lines: bool,
    ) -> Result<Self, DataError> {
        Ok(match src {
            DataSource::Synthetic => Reader::Synthetic(
                Synthetic::new(model.clone(), starwire_data::Stream::Train, examples).split(deal),
            ),
            DataSource::Criteo(p) => Reader::Criteo(CriteoFiles::open(
                p,
                ReaderOptions {
                    skip_bad_lines,
                    worker: deal.worker(),
                    workers: deal.workers(),
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

    /// One worker's share (`deal`) of one epoch of the Criteo files at
    /// `path`, counted by reading it in batches of `batch_size` as the
    /// worker does: the examples of each run of batches that are full but
    /// for the run's last (a batch does not span files, so a file's last
    /// batch may be short). Bad lines skipped with `skip_bad_lines` are
    /// not examples.
    pub fn count_share(
        path: &std::path::Path,
        deal: Deal,
        skip_bad_lines: bool,
        batch_size: usize,
    ) -> Result<Vec<u64>, DataError> {
        let mut r = CriteoFiles::open(
            path,
            ReaderOptions {
                skip_bad_lines,
                worker: deal.worker(),
                workers: deal.workers(),
                ..ReaderOptions::default()
            },
        )?;
        let b = batch_size.max(1);
        let mut batch = Batch::with_capacity(b.min(COUNT_BATCH));
        let (mut runs, mut run) = (Vec::new(), 0u64);
        loop {
            let k = r.next_batch(b, &mut batch)?;
            if k == 0 {
                if run > 0 {
                    runs.push(run);
                }
                return Ok(runs);
            }
            run += k as u64;
            if k < b {
                runs.push(std::mem::take(&mut run));
            }
        }
    }

    /// Up to `max` examples into `batch`; 0 at the end of the epoch. A
    /// file's errors name the file.
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

/// A [`Reader`] on a thread of its own that reads up to `depth` batches
/// ahead of the worker (`--prefetch N`, TensorFlow's `Dataset.prefetch`):
/// the batches of the next steps are generated or parsed while the worker
/// waits for the PS, instead of between its steps. Batches come back
/// through a channel for reuse, so reading ahead allocates nothing after
/// the first few.
///
/// Epochs keep their order: the thread stops at an epoch's end until
/// [`Prefetch::rewind`]; a rewind in the middle of an epoch (a step cap)
/// drops the batches read ahead of it, which are told apart by the epoch
/// they were read in.
#[derive(Debug)]
pub struct Prefetch {
    /// Epochs rewound so far: batches of an earlier one are dropped.
    generation: u64,
    rx: std::sync::mpsc::Receiver<Ahead>,
    tx: std::sync::mpsc::Sender<Command>,
    /// Lines skipped as bad up to the last batch taken.
    skipped: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A batch read ahead (`None`: the epoch's end), with the epoch it was
/// read in and the reader's skipped lines after it.
#[derive(Debug)]
struct Ahead {
    generation: u64,
    batch: Result<Option<Batch>, DataError>,
    skipped: u64,
}

#[derive(Debug)]
enum Command {
    /// A batch taken, back for reuse.
    Reuse(Batch),
    /// Start the next epoch.
    Rewind,
}

/// The reading thread's state.
struct Producer {
    reader: Reader,
    /// Batches back from the worker, to read into.
    spare: Vec<Batch>,
    /// Epochs rewound so far.
    generation: u64,
    tx: std::sync::mpsc::SyncSender<Ahead>,
}

impl Producer {
    /// Act on `c`; true for a rewind.
    fn take(&mut self, c: Command) -> bool {
        match c {
            Command::Reuse(b) => {
                self.spare.push(b);
                false
            }
            Command::Rewind => {
                self.generation += 1;
                if let Err(e) = self.reader.rewind() {
                    self.send(Err(e));
                }
                true
            }
        }
    }

    /// Read the next batch and send it: `Some(true)` at the epoch's end
    /// or an error, `None` when the worker is gone.
    fn read(&mut self, batch_size: usize) -> Option<bool> {
        let mut b = self
            .spare
            .pop()
            .unwrap_or_else(|| Batch::with_capacity(batch_size));
        let batch = match self.reader.next_batch(batch_size, &mut b) {
            Ok(0) => Ok(None),
            Ok(_) => Ok(Some(b)),
            Err(e) => Err(e),
        };
        let end = !matches!(batch, Ok(Some(_)));
        self.send(batch).then_some(end)
    }

    /// Send `batch` as this epoch's; false when the worker is gone.
    fn send(&self, batch: Result<Option<Batch>, DataError>) -> bool {
        let a = Ahead {
            generation: self.generation,
            batch,
            skipped: self.reader.skipped(),
        };
        self.tx.send(a).is_ok()
    }
}

impl Prefetch {
    /// Read `reader` ahead by up to `depth` batches of `batch_size` on a
    /// thread named `name` (pinned to `cpu` when given, the worker's own
    /// core: the reader then runs in the time the worker waits).
    pub fn start(
        reader: Reader,
        batch_size: usize,
        depth: usize,
        name: String,
        cpu: Option<usize>,
    ) -> std::io::Result<Self> {
        let (tx_ahead, rx) = std::sync::mpsc::sync_channel::<Ahead>(depth.max(1));
        let (tx, rx_cmd) = std::sync::mpsc::channel::<Command>();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            // Pinning is a placement hint here: a reader that cannot be
            // pinned still reads.
            let _pinned = crate::cluster::PinnedThread::pin(cpu);
            let mut p = Producer {
                reader,
                spare: Vec::new(),
                generation: 0,
                tx: tx_ahead,
            };
            loop {
                // Take what the worker sent back; a rewind starts the
                // next epoch.
                while let Ok(c) = rx_cmd.try_recv() {
                    p.take(c);
                }
                let Some(end) = p.read(batch_size) else {
                    return;
                };
                if end {
                    // Nothing more this epoch: wait for the rewind (or the
                    // worker's end, when the channel closes).
                    loop {
                        match rx_cmd.recv() {
                            Ok(c) => {
                                if p.take(c) {
                                    break;
                                }
                            }
                            Err(_) => return,
                        }
                    }
                }
            }
        })?;
        Ok(Self {
            generation: 0,
            rx,
            tx,
            skipped: 0,
            thread: Some(thread),
        })
    }

    /// The next batch into `batch` (its old contents go back for reuse);
    /// 0 at the end of the epoch.
    pub fn next_batch(&mut self, batch: &mut Batch) -> Result<usize, crate::TrainError> {
        loop {
            let Ok(a) = self.rx.recv() else {
                return Err(crate::TrainError::Internal(
                    "the prefetching reader's thread stopped".into(),
                ));
            };
            if a.generation != self.generation {
                // Read ahead of a rewind: not this epoch's.
                if let Ok(Some(b)) = a.batch {
                    let _ = self.tx.send(Command::Reuse(b));
                }
                continue;
            }
            self.skipped = a.skipped;
            return match a.batch? {
                None => Ok(0),
                Some(b) => {
                    let old = std::mem::replace(batch, b);
                    if old.labels.capacity() > 0 {
                        let _ = self.tx.send(Command::Reuse(old));
                    }
                    Ok(batch.len)
                }
            };
        }
    }

    /// Start the next epoch.
    pub fn rewind(&mut self) {
        self.generation += 1;
        let _ = self.tx.send(Command::Rewind);
    }

    /// Lines skipped as bad (Criteo with `--skip-bad-lines`) up to the
    /// last batch taken.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        // Closing the channels ends the thread: its next send or receive
        // fails. Replace them so the thread sees both closed, then wait.
        let (_, rx) = std::sync::mpsc::sync_channel(0);
        drop(std::mem::replace(&mut self.rx, rx));
        let (tx, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A worker's batches: read between its steps, or ahead on a thread of
/// their own ([`Prefetch`]).
#[derive(Debug)]
pub enum Batches {
    /// Read by the worker itself, `batch_size` at a time.
    Inline(Reader, usize),
    /// Read ahead.
    Ahead(Prefetch),
}

impl Batches {
    /// The next batch; 0 at the end of the epoch.
    pub fn next_batch(&mut self, batch: &mut Batch) -> Result<usize, crate::TrainError> {
        match self {
            Batches::Inline(r, n) => Ok(r.next_batch(*n, batch)?),
            Batches::Ahead(p) => p.next_batch(batch),
        }
    }

    /// Start the next epoch.
    pub fn rewind(&mut self) -> Result<(), crate::TrainError> {
        match self {
            Batches::Inline(r, _) => Ok(r.rewind()?),
            Batches::Ahead(p) => {
                p.rewind();
                Ok(())
            }
        }
    }

    /// Lines skipped as bad (Criteo with `--skip-bad-lines`).
    pub fn skipped(&self) -> u64 {
        match self {
            Batches::Inline(r, _) => r.skipped(),
            Batches::Ahead(p) => p.skipped(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_data::SyntheticSpec;

    fn reader(examples: u64) -> Reader {
        let model = Arc::new(TrueModel::new(SyntheticSpec::default()).unwrap());
        Reader::train(
            &DataSource::Synthetic,
            &model,
            examples,
            Deal::default(),
            false,
        )
        .unwrap()
    }

    /// Every batch `b` yields until the epoch's end, with `cut` batches
    /// at most (then a rewind in the middle of the epoch).
    fn epoch(b: &mut Batches, cut: usize) -> Vec<Vec<u64>> {
        let mut out = Vec::new();
        let mut batch = Batch::with_capacity(0);
        while out.len() < cut && b.next_batch(&mut batch).unwrap() > 0 {
            out.push(batch.keys[..batch.len * starwire_data::NUM_CATEGORICAL].to_vec());
        }
        b.rewind().unwrap();
        out
    }

    #[test]
    fn read_ahead_yields_the_inline_batches_in_order_across_rewinds() {
        // 10 batches of 64 and one of 40 per epoch; full epochs and epochs
        // cut short, where the batches read ahead are dropped.
        for depth in [1, 3] {
            let mut inline = Batches::Inline(reader(680), 64);
            let p = Prefetch::start(reader(680), 64, depth, "test-input".into(), None).unwrap();
            let mut ahead = Batches::Ahead(p);
            for cut in [usize::MAX, 2, 0, usize::MAX, 5, usize::MAX] {
                let want = epoch(&mut inline, cut);
                let got = epoch(&mut ahead, cut);
                assert_eq!(got.len(), want.len(), "depth {depth} cut {cut}");
                assert!(got == want, "depth {depth} cut {cut}");
                if cut == usize::MAX {
                    assert_eq!(got.len(), 11);
                }
            }
        }
    }

    #[test]
    fn dropping_a_reader_that_is_ahead_ends_its_thread() {
        let p = Prefetch::start(reader(100_000), 64, 2, "test-input".into(), None).unwrap();
        // Its channel is full by now; the drop must not wait for a reader
        // blocked on it.
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(p);
    }

    #[test]
    fn a_read_error_reaches_the_worker() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.tsv");
        std::fs::write(&path, "1\tnot-a-row\n").unwrap();
        let r = Reader::train(
            &DataSource::Criteo(path),
            &Arc::new(TrueModel::new(SyntheticSpec::default()).unwrap()),
            0,
            Deal::default(),
            false,
        )
        .unwrap();
        let mut b = Batches::Ahead(Prefetch::start(r, 8, 1, "test-input".into(), None).unwrap());
        let e = b.next_batch(&mut Batch::with_capacity(8)).unwrap_err();
        assert!(matches!(e, crate::TrainError::Data(_)), "{e}");
    }
}

//! Criteo data spread over files: a file, a directory or a glob pattern,
//! plain or gzip-compressed, and each worker's share of it.
//!
//! [`expand`] turns a path into a sorted list of files: a directory gives
//! the regular files directly inside it (hidden files skipped), a path
//! with `*`, `?` or `[` is a glob pattern, anything else is one file. A
//! file whose name ends in `.gz` is read through a gzip decoder (several
//! concatenated members, as `cat a.gz b.gz` makes, are read as one
//! stream).
//!
//! The share of worker `w` of `W`, as DeepRec's `WorkQueue` deals files
//! out: with at least `W` files, file `i` goes to worker `i % W` and is read
//! whole; with fewer files than workers, every worker reads every file and
//! takes the lines whose index within the file is `w` modulo `W` (so one
//! big file is still split evenly). Bad lines are reported with the file
//! and the 1-based line number within it.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;

use crate::batch::Batch;
use crate::criteo::{CriteoReader, DataError, ReaderOptions};

/// Read buffer of each open file.
const BUFFER: usize = 1 << 20;

/// The files `path` names, sorted: a directory's regular files, a glob
/// pattern's matches, or the file itself. None found is an error naming
/// the path.
pub fn expand(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    let text = path.to_string_lossy();
    let mut files = if path.is_dir() {
        let rd = std::fs::read_dir(path).map_err(|source| DataError::Open {
            path: path.to_owned(),
            source,
        })?;
        let mut v = Vec::new();
        for e in rd {
            let e = e.map_err(|e| DataError::Io(e).in_file(path))?;
            let hidden = e.file_name().to_string_lossy().starts_with('.');
            if !hidden && e.path().is_file() {
                v.push(e.path());
            }
        }
        v
    } else if text.contains(['*', '?', '[']) {
        glob::glob(&text)
            .map_err(|_| DataError::Options("invalid glob pattern"))?
            .filter_map(Result::ok)
            .filter(|p| p.is_file())
            .collect()
    } else {
        std::fs::metadata(path).map_err(|source| DataError::Open {
            path: path.to_owned(),
            source,
        })?;
        vec![path.to_owned()]
    };
    files.sort();
    if files.is_empty() {
        return Err(DataError::Open {
            path: path.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no data files there"),
        });
    }
    Ok(files)
}

/// Open one file for [`CriteoReader`], decompressing `.gz`.
fn open(path: &Path) -> Result<Box<dyn BufRead + Send>, DataError> {
    let file = File::open(path).map_err(|source| DataError::Open {
        path: path.to_owned(),
        source,
    })?;
    Ok(if path.extension().is_some_and(|e| e == "gz") {
        Box::new(BufReader::with_capacity(
            BUFFER,
            MultiGzDecoder::new(BufReader::new(file)),
        ))
    } else {
        Box::new(BufReader::with_capacity(BUFFER, file))
    })
}

/// A worker's share of a list of Criteo files, read in order, in epochs.
pub struct CriteoFiles {
    /// The files this reader opens, in order.
    files: Vec<PathBuf>,
    /// Options of each file's reader (its line split, if any).
    opts: ReaderOptions,
    next: usize,
    current: Option<(CriteoReader<Box<dyn BufRead + Send>>, usize)>,
    /// Lines skipped in the files finished this epoch.
    skipped_done: u64,
}

impl std::fmt::Debug for CriteoFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriteoFiles")
            .field("files", &self.files)
            .field("opts", &self.opts)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl CriteoFiles {
    /// The share of worker `opts.worker` of `opts.workers` of the files
    /// `path` names (see the module docs).
    pub fn open(path: &Path, opts: ReaderOptions) -> Result<Self, DataError> {
        if opts.workers == 0 || opts.worker >= opts.workers {
            return Err(DataError::Options("worker must be below workers"));
        }
        let all = expand(path)?;
        let (files, opts) = if all.len() >= opts.workers {
            let mine = all
                .into_iter()
                .enumerate()
                .filter(|(i, _)| i % opts.workers == opts.worker)
                .map(|(_, p)| p)
                .collect();
            let whole = ReaderOptions {
                worker: 0,
                workers: 1,
                ..opts
            };
            (mine, whole)
        } else {
            (all, opts)
        };
        Ok(Self {
            files,
            opts,
            next: 0,
            current: None,
            skipped_done: 0,
        })
    }

    /// The files this reader reads, in order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Clear `batch` and fill it with up to `max` examples; 0 at the end
    /// of the last file. A batch does not span files. Errors name the file.
    pub fn next_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError> {
        loop {
            if let Some((r, i)) = &mut self.current {
                let n = r
                    .next_batch(max, batch)
                    .map_err(|e| e.in_file(&self.files[*i]))?;
                if n > 0 {
                    return Ok(n);
                }
                self.skipped_done += r.counters().skipped;
                self.current = None;
            }
            let Some(path) = self.files.get(self.next) else {
                batch.clear();
                return Ok(0);
            };
            let r = CriteoReader::new(open(path)?, self.opts)?;
            self.current = Some((r, self.next));
            self.next += 1;
        }
    }

    /// Start the next epoch from the first file.
    pub fn rewind(&mut self) {
        self.next = 0;
        self.current = None;
        self.skipped_done = 0;
    }

    /// Lines skipped as bad this epoch (with `skip_bad_lines`).
    pub fn skipped(&self) -> u64 {
        self.skipped_done
            + self
                .current
                .as_ref()
                .map_or(0, |(r, _)| r.counters().skipped)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::synthetic::{Synthetic, SyntheticSpec};

    /// `n` synthetic examples as Criteo lines.
    fn lines(n: u64) -> (String, Batch) {
        let spec = SyntheticSpec {
            examples_per_epoch: n,
            ..Default::default()
        };
        let mut s = Synthetic::train(spec).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("all.tsv");
        s.write_criteo(&f).unwrap();
        s.rewind();
        (std::fs::read_to_string(&f).unwrap(), s.collect_epoch())
    }

    fn gz(path: &Path, text: &str) {
        let mut e =
            flate2::write::GzEncoder::new(File::create(path).unwrap(), flate2::Compression::fast());
        e.write_all(text.as_bytes()).unwrap();
        e.finish().unwrap();
    }

    fn read_all(r: &mut CriteoFiles) -> Batch {
        let (mut all, mut b) = (Batch::default(), Batch::default());
        while r.next_batch(100, &mut b).unwrap() > 0 {
            all.extend_from(&b);
        }
        all
    }

    #[test]
    fn a_directory_of_plain_and_gz_files_reads_as_the_concatenation() {
        let (text, want) = lines(300);
        let v: Vec<&str> = text.lines().collect();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("part-0.tsv"), v[..100].join("\n") + "\n").unwrap();
        gz(
            &dir.path().join("part-1.tsv.gz"),
            &(v[100..250].join("\n") + "\n"),
        );
        std::fs::write(dir.path().join("part-2.tsv"), v[250..].join("\n") + "\n").unwrap();
        std::fs::write(dir.path().join(".hidden"), "junk\n").unwrap();
        let mut r = CriteoFiles::open(dir.path(), ReaderOptions::default()).unwrap();
        assert_eq!(r.files().len(), 3);
        assert_eq!(read_all(&mut r), want);
        r.rewind();
        assert_eq!(read_all(&mut r), want, "a second epoch");
        // A glob pattern picks the gz file alone.
        let pat = dir.path().join("*.gz");
        let mut r = CriteoFiles::open(&pat, ReaderOptions::default()).unwrap();
        assert_eq!(read_all(&mut r).len, 150);
    }

    #[test]
    fn workers_take_whole_files_or_split_lines() {
        let (text, want) = lines(120);
        let v: Vec<&str> = text.lines().collect();
        let dir = tempfile::tempdir().unwrap();
        for (i, chunk) in v.chunks(30).enumerate() {
            std::fs::write(dir.path().join(format!("f{i}")), chunk.join("\n") + "\n").unwrap();
        }
        let share = |worker, workers| {
            let opts = ReaderOptions {
                worker,
                workers,
                ..Default::default()
            };
            let mut r = CriteoFiles::open(dir.path(), opts).unwrap();
            let files = r.files().to_vec();
            (files, read_all(&mut r))
        };
        // Four files, two workers: files 0 and 2, then 1 and 3, whole.
        let (f0, b0) = share(0, 2);
        let (f1, b1) = share(1, 2);
        assert_eq!(
            f0.iter()
                .map(|p| p.file_name().unwrap().to_str().unwrap())
                .collect::<Vec<_>>(),
            ["f0", "f2"]
        );
        assert_eq!(f1.len(), 2);
        assert_eq!(b0.len + b1.len, want.len);
        assert_eq!(b0.labels[..30], want.labels[..30]);
        assert_eq!(b1.labels[..30], want.labels[30..60]);
        // Four files, eight workers: each reads every file, one line in 8.
        let total: usize = (0..8).map(|w| share(w, 8).1.len).sum();
        assert_eq!(total, want.len);
        assert_eq!(share(3, 8).0.len(), 4);
    }

    #[test]
    fn a_bad_line_names_its_file_and_line() {
        let (text, _) = lines(5);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.tsv"), &text).unwrap();
        let mut bad: Vec<&str> = text.lines().collect();
        bad[2] = "2\tnot a line";
        gz(&dir.path().join("b.tsv.gz"), &(bad.join("\n") + "\n"));
        let mut r = CriteoFiles::open(dir.path(), ReaderOptions::default()).unwrap();
        let mut b = Batch::default();
        let e = loop {
            match r.next_batch(100, &mut b) {
                Ok(0) => panic!("no error"),
                Ok(_) => {}
                Err(e) => break e.to_string(),
            }
        };
        assert!(e.contains("b.tsv.gz") && e.contains("bad line 3"), "{e}");
        let skip = ReaderOptions {
            skip_bad_lines: true,
            ..Default::default()
        };
        let mut r = CriteoFiles::open(dir.path(), skip).unwrap();
        assert_eq!(read_all(&mut r).len, 9);
        assert_eq!(r.skipped(), 1);
    }

    #[test]
    fn nothing_to_read_is_an_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let e = CriteoFiles::open(dir.path(), ReaderOptions::default()).unwrap_err();
        assert!(
            e.to_string().contains(&dir.path().display().to_string()),
            "{e}"
        );
        let e = CriteoFiles::open(&dir.path().join("x*.gz"), ReaderOptions::default()).unwrap_err();
        assert!(matches!(e, DataError::Open { .. }), "{e}");
        let e = CriteoFiles::open(&dir.path().join("missing.tsv"), ReaderOptions::default());
        assert!(matches!(e, Err(DataError::Open { .. })));
        std::fs::write(dir.path().join("corrupt.gz"), "not gzip\n").unwrap();
        let mut r =
            CriteoFiles::open(&dir.path().join("corrupt.gz"), ReaderOptions::default()).unwrap();
        let e = r.next_batch(10, &mut Batch::default()).unwrap_err();
        assert!(e.to_string().contains("corrupt.gz"), "{e}");
    }
}

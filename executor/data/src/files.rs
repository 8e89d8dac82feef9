//! Criteo data spread over files: a file, a directory or a glob pattern,
//! plain or gzip-compressed, and each worker's share of it.
//!
//! [`expand`] turns a path into a sorted list of files: a directory gives
//! the regular files directly inside it (hidden files skipped), a path
//! that exists is that one file (even if its name has `*`, `?` or `[`),
//! and any other path with `*`, `?` or `[` is a glob pattern (in which
//! `[[]`, `[*]` and `[?]` match those characters literally). A
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

/// The files `path` names, sorted: a directory's regular files, the file
/// itself if it exists, or else a glob pattern's matches. None found is an
/// error naming the path; so is an invalid pattern, and a directory the
/// pattern cannot read is an error naming that directory.
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
    } else if text.contains(['*', '?', '[']) && std::fs::symlink_metadata(path).is_err() {
        let matches = glob::glob(&text).map_err(|e| DataError::Pattern {
            pattern: text.clone().into_owned(),
            pos: e.pos,
            msg: e.msg,
        })?;
        let mut v = Vec::new();
        for m in matches {
            let p = m.map_err(|e| DataError::Open {
                path: e.path().to_owned(),
                source: e.into(),
            })?;
            if p.is_file() {
                v.push(p);
            }
        }
        v
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

/// The lines of each file `path` names ([`expand`], in its order), read
/// once: a line ends at a newline, and a last one without is a line too.
/// Every line is an example or a bad line, so without `skip_bad_lines`
/// these give every worker's share of an epoch without reading it once
/// per worker (see the module documentation for how files and lines are
/// dealt).
pub fn line_counts(path: &Path) -> Result<Vec<u64>, DataError> {
    expand(path)?
        .iter()
        .map(|f| {
            let mut input = open(f)?;
            let (mut lines, mut last) = (0u64, b'\n');
            loop {
                let buf = input
                    .fill_buf()
                    .map_err(|e| DataError::from(e).in_file(f))?;
                let Some(&end) = buf.last() else {
                    break;
                };
                lines += memchr::memchr_iter(b'\n', buf).count() as u64;
                last = end;
                let n = buf.len();
                input.consume(n);
            }
            Ok(lines + u64::from(last != b'\n'))
        })
        .collect()
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

    /// Each file's lines, read once, are what every reader of it counts:
    /// a last line without its newline is one, a `.gz` file's are its
    /// text's, and each worker's share follows from them.
    #[test]
    fn line_counts_are_each_files_lines_as_the_readers_count_them() {
        let (text, _) = lines(250);
        let v: Vec<&str> = text.lines().collect();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.tsv"), v[..100].join("\n") + "\n").unwrap();
        gz(
            &dir.path().join("b.tsv.gz"),
            &(v[100..170].join("\n") + "\n"),
        );
        // No newline after the last line.
        std::fs::write(dir.path().join("c.tsv"), v[170..].join("\n")).unwrap();
        std::fs::write(dir.path().join("d.tsv"), "").unwrap();
        assert_eq!(line_counts(dir.path()).unwrap(), [100, 70, 80, 0]);
        for workers in [1, 3, 4, 7] {
            for worker in 0..workers {
                let opts = ReaderOptions {
                    worker,
                    workers,
                    ..ReaderOptions::default()
                };
                let mut r = CriteoFiles::open(dir.path(), opts).unwrap();
                let per_file: Vec<u64> = line_counts(dir.path())
                    .unwrap()
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| match 4 >= workers {
                        true if i % workers == worker => n,
                        true => 0,
                        false => {
                            n / workers as u64 + u64::from((worker as u64) < n % workers as u64)
                        }
                    })
                    .collect();
                let want: u64 = per_file.iter().sum();
                assert_eq!(read_all(&mut r).len as u64, want, "{worker} of {workers}");
            }
        }
        assert!(matches!(
            line_counts(&dir.path().join("none")),
            Err(DataError::Open { .. })
        ));
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

    #[test]
    fn a_truncated_gz_file_says_how_far_it_got() {
        let (text, _) = lines(400);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("cut.tsv.gz");
        gz(&f, &text);
        let bytes = std::fs::read(&f).unwrap();
        std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
        let mut r = CriteoFiles::open(&f, ReaderOptions::default()).unwrap();
        let (mut b, mut read) = (Batch::default(), 0u64);
        let e = loop {
            match r.next_batch(1, &mut b) {
                Ok(0) => panic!("no error after {read} lines"),
                Ok(_) => read += 1,
                Err(e) => break e,
            }
        };
        assert!(read > 0 && read < 400, "{read}");
        let msg = e.to_string();
        assert!(
            msg.contains("cut.tsv.gz") && msg.contains(&format!("after {read} lines")),
            "{msg}"
        );
        // Still an i/o error of the decoder's kind, in the file.
        let DataError::InFile { source, .. } = e else {
            panic!("{e:?}")
        };
        assert!(
            matches!(&*source, DataError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof),
            "{source:?}"
        );
    }

    #[test]
    fn an_existing_path_is_read_as_is_though_it_looks_like_a_pattern() {
        let (text, _) = lines(8);
        let v: Vec<&str> = text.lines().collect();
        let dir = tempfile::tempdir().unwrap();
        let literal = dir.path().join("data[1].tsv");
        std::fs::write(&literal, v[..5].join("\n") + "\n").unwrap();
        // What `data[1].tsv` matches as a pattern.
        std::fs::write(dir.path().join("data1.tsv"), v[5..].join("\n") + "\n").unwrap();
        let mut r = CriteoFiles::open(&literal, ReaderOptions::default()).unwrap();
        assert_eq!(r.files(), std::slice::from_ref(&literal));
        assert_eq!(read_all(&mut r).len, 5);
        // A path that does not exist is a pattern; `[[]` matches `[`.
        let escaped = dir.path().join("data[[]1].tsv");
        let r = CriteoFiles::open(&escaped, ReaderOptions::default()).unwrap();
        assert_eq!(r.files(), [literal]);
        let r = CriteoFiles::open(&dir.path().join("data?.tsv"), ReaderOptions::default());
        assert_eq!(r.unwrap().files(), [dir.path().join("data1.tsv")]);
    }

    #[test]
    fn an_invalid_pattern_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let pat = dir.path().join("day_[1.tsv");
        let e = CriteoFiles::open(&pat, ReaderOptions::default()).unwrap_err();
        let bracket = pat.to_str().unwrap().chars().position(|c| c == '[');
        assert!(
            matches!(e, DataError::Pattern { pos, .. } if Some(pos) == bracket),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(&pat.display().to_string()) && msg.contains("invalid glob pattern"),
            "{msg}"
        );
    }

    #[test]
    fn a_directory_a_pattern_cannot_read_is_an_error_naming_it() {
        use std::os::unix::fs::PermissionsExt;
        let (text, _) = lines(3);
        let dir = tempfile::tempdir().unwrap();
        for sub in ["a", "b"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
            std::fs::write(dir.path().join(sub).join("x.tsv"), &text).unwrap();
        }
        let locked = dir.path().join("b");
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
        let readable = std::fs::read_dir(&locked).is_ok();
        let got = CriteoFiles::open(&dir.path().join("*/*.tsv"), ReaderOptions::default());
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
        if readable {
            eprintln!("skipped: permissions are not enforced for this user (root?)");
            return;
        }
        let e = got.unwrap_err();
        assert!(matches!(e, DataError::Open { .. }), "{e:?}");
        assert!(e.to_string().contains(&locked.display().to_string()), "{e}");
    }
}

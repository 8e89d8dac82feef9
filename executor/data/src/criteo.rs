//! Criteo TSV reader.
//!
//! One example per line: `label \t I1 .. I13 \t C1 .. C26`, 40 tab-separated
//! columns. The label is `0` or `1`; `I*` are decimal integers (optionally
//! negative), `C*` are opaque strings (in the Criteo data, 8 hex characters)
//! hashed with [`feature_hash`] using the categorical field index (`C1` is 0).
//! Any column except the label may be empty, meaning missing. A trailing `\r`
//! is ignored.
//!
//! Lines are read through a buffer reused for the whole file: the fast path
//! allocates nothing per line. A line longer than
//! [`ReaderOptions::max_line_len`] is a bad line and is never buffered whole.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::batch::{transform_count, Batch, NUM_CATEGORICAL, NUM_NUMERIC};
use crate::hash::{feature_hash, MISSING_KEY};

/// Number of tab-separated columns of a Criteo line.
pub const CRITEO_COLUMNS: usize = 1 + NUM_NUMERIC + NUM_CATEGORICAL;

/// Why a line was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BadLineReason {
    /// The line does not have 40 columns (the count found, capped at 41).
    ColumnCount(usize),
    /// The label is not `0` or `1`.
    Label,
    /// An integer column (`I1` is 1) is not a decimal i64.
    Integer(usize),
    /// The line is longer than [`ReaderOptions::max_line_len`].
    TooLong,
}

impl std::fmt::Display for BadLineReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ColumnCount(n) => write!(f, "{n} columns, expected {CRITEO_COLUMNS}"),
            Self::Label => f.write_str("label is not 0 or 1"),
            Self::Integer(i) => write!(f, "column I{i} is not an integer"),
            Self::TooLong => f.write_str("line too long"),
        }
    }
}

/// Errors of the data readers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// Opening the file failed.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading, seeking or writing failed. An error of
    /// [`CriteoReader::next_batch`] says how many lines of the input it had
    /// read (its kind is the underlying error's, which is its source).
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// A malformed line (1-based line number) and `skip_bad_lines` was off.
    #[error("bad line {line}: {reason}")]
    BadLine {
        /// 1-based line number in the file.
        line: u64,
        /// What is wrong with it.
        reason: BadLineReason,
    },
    /// Invalid reader or generator options (e.g. `worker >= workers`).
    #[error("invalid options: {0}")]
    Options(&'static str),
    /// A data path that is not an existing file and not a valid glob
    /// pattern either.
    #[error("invalid glob pattern {pattern}: {msg} at character {pos}")]
    Pattern {
        /// The path, as given.
        pattern: String,
        /// The 0-based index of the character where the pattern is invalid.
        pos: usize,
        /// What is wrong with it.
        msg: &'static str,
    },
    /// An invalid [`crate::SyntheticSpec`].
    #[error("invalid synthetic spec: {0}")]
    Spec(&'static str),
    /// An error reading the file at `path` (see [`DataError::in_file`]).
    #[error("{}: {source}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What went wrong in it.
        #[source]
        source: Box<DataError>,
    },
}

/// A read error of [`CriteoReader::next_batch`], after `lines` complete
/// lines of the input (a truncated or corrupt `.gz` file: how far it got).
#[derive(Debug, thiserror::Error)]
#[error("{source} after {lines} lines")]
struct ReadFailed {
    lines: u64,
    source: io::Error,
}

/// `e`, saying that `lines` lines had been read; of the same kind.
fn read_failed(e: io::Error, lines: u64) -> DataError {
    DataError::Io(io::Error::new(e.kind(), ReadFailed { lines, source: e }))
}

impl DataError {
    /// This error, saying that it happened in the file at `path` (errors
    /// that name their file already are kept as they are).
    pub fn in_file(self, path: &Path) -> Self {
        match self {
            e @ (DataError::Open { .. } | DataError::InFile { .. }) => e,
            e => DataError::InFile {
                path: path.to_owned(),
                source: Box::new(e),
            },
        }
    }
}

/// Options of [`CriteoReader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderOptions {
    /// Skip (and count) malformed lines instead of failing.
    pub skip_bad_lines: bool,
    /// This reader's share: it takes the lines whose 0-based index `i`
    /// satisfies `i % workers == worker`.
    pub worker: usize,
    /// Number of readers splitting the file (at least 1).
    pub workers: usize,
    /// Longest accepted line in bytes, newline excluded.
    pub max_line_len: usize,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        Self {
            skip_bad_lines: false,
            worker: 0,
            workers: 1,
            max_line_len: 64 * 1024,
        }
    }
}

/// Counters of a [`CriteoReader`] since it was opened or rewound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReaderCounters {
    /// Lines seen in the file (including other workers' lines).
    pub lines: u64,
    /// Lines of this worker parsed into examples.
    pub examples: u64,
    /// Lines of this worker skipped as malformed.
    pub skipped: u64,
}

/// A buffered reader of a Criteo TSV file, or of one worker's share of it.
#[derive(Debug)]
pub struct CriteoReader<R = BufReader<File>> {
    input: R,
    opts: ReaderOptions,
    line: Vec<u8>,
    counters: ReaderCounters,
}

impl CriteoReader<BufReader<File>> {
    /// Open `path` for reading.
    pub fn open(path: impl AsRef<Path>, opts: ReaderOptions) -> Result<Self, DataError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| DataError::Open {
            path: path.to_owned(),
            source,
        })?;
        Self::new(BufReader::with_capacity(1 << 20, file), opts)
    }
}

impl<R: BufRead + Seek> CriteoReader<R> {
    /// Go back to the start of the input for another epoch; resets counters.
    pub fn rewind(&mut self) -> Result<(), DataError> {
        self.input.seek(SeekFrom::Start(0))?;
        self.counters = ReaderCounters::default();
        Ok(())
    }
}

impl<R: BufRead> CriteoReader<R> {
    /// Read from any buffered input.
    pub fn new(input: R, opts: ReaderOptions) -> Result<Self, DataError> {
        if opts.workers == 0 {
            return Err(DataError::Options("workers must be at least 1"));
        }
        if opts.worker >= opts.workers {
            return Err(DataError::Options("worker must be below workers"));
        }
        Ok(Self {
            input,
            opts,
            line: Vec::with_capacity(1024),
            counters: ReaderCounters::default(),
        })
    }

    /// The counters so far.
    pub fn counters(&self) -> ReaderCounters {
        self.counters
    }

    /// Clear `batch` and fill it with up to `max` examples of this worker.
    /// Returns the number read; 0 means the end of the input.
    pub fn next_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError> {
        batch.clear();
        let Self {
            input,
            opts,
            line,
            counters,
        } = self;
        while batch.len < max {
            let buf = input
                .fill_buf()
                .map_err(|e| read_failed(e, counters.lines))?;
            if buf.is_empty() {
                break;
            }
            let index = counters.lines;
            let mine = index % opts.workers as u64 == opts.worker as u64;
            // Fast path: the whole line is in the reader's buffer and is
            // parsed in place. Otherwise it is gathered into `line`.
            let parsed = if let Some(p) = memchr::memchr(b'\n', buf) {
                let parsed = if !mine {
                    None
                } else if p > opts.max_line_len {
                    Some(Err(BadLineReason::TooLong))
                } else {
                    Some(parse_line(trim_cr(&buf[..p]), batch))
                };
                input.consume(p + 1);
                parsed
            } else {
                let too_long = read_long_line(input, line, opts.max_line_len)
                    .map_err(|e| read_failed(e, counters.lines))?;
                if !mine {
                    None
                } else if too_long {
                    Some(Err(BadLineReason::TooLong))
                } else {
                    Some(parse_line(trim_cr(line), batch))
                }
            };
            counters.lines += 1;
            match parsed {
                None => {}
                Some(Ok(())) => counters.examples += 1,
                Some(Err(_)) if opts.skip_bad_lines => counters.skipped += 1,
                Some(Err(reason)) => {
                    return Err(DataError::BadLine {
                        line: index + 1,
                        reason,
                    })
                }
            }
        }
        Ok(batch.len)
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Read one line that does not fit in the input's buffer into `line`
/// (without its newline), keeping at most `limit` bytes; returns whether
/// the line was longer than `limit` (its remainder is consumed and dropped).
/// The caller has checked that the input is not at its end.
fn read_long_line<R: BufRead>(input: &mut R, line: &mut Vec<u8>, limit: usize) -> io::Result<bool> {
    line.clear();
    let mut too_long = false;
    loop {
        let buf = input.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        let (chunk, used, done) = match memchr::memchr(b'\n', buf) {
            Some(p) => (&buf[..p], p + 1, true),
            None => (buf, buf.len(), false),
        };
        if !too_long {
            if line.len() + chunk.len() > limit {
                too_long = true;
                line.clear();
            } else {
                line.extend_from_slice(chunk);
            }
        }
        input.consume(used);
        if done {
            break;
        }
    }
    Ok(too_long)
}

/// Parse one line (no newline) and append it to `batch`; on error `batch`
/// is left unchanged.
pub fn parse_line(line: &[u8], batch: &mut Batch) -> Result<(), BadLineReason> {
    let mut cols = [&[][..]; CRITEO_COLUMNS];
    let mut n = 0;
    let mut start = 0;
    for tab in memchr::memchr_iter(b'\t', line) {
        if n == CRITEO_COLUMNS - 1 {
            return Err(BadLineReason::ColumnCount(CRITEO_COLUMNS + 1));
        }
        cols[n] = &line[start..tab];
        n += 1;
        start = tab + 1;
    }
    cols[n] = &line[start..];
    n += 1;
    if n != CRITEO_COLUMNS {
        return Err(BadLineReason::ColumnCount(n));
    }
    let label = match cols[0] {
        b"0" => 0.0,
        b"1" => 1.0,
        _ => return Err(BadLineReason::Label),
    };
    let mut numeric = [0f32; NUM_NUMERIC];
    for (j, slot) in numeric.iter_mut().enumerate() {
        let col = cols[1 + j];
        if !col.is_empty() {
            let x = parse_i64(col).ok_or(BadLineReason::Integer(j + 1))?;
            *slot = transform_count(x);
        }
    }
    batch.labels.push(label);
    batch.numeric.extend_from_slice(&numeric);
    for (f, col) in cols[1 + NUM_NUMERIC..].iter().enumerate() {
        batch.keys.push(if col.is_empty() {
            MISSING_KEY
        } else {
            feature_hash(f as u32, col)
        });
    }
    batch.len += 1;
    Ok(())
}

/// A decimal i64 with an optional leading `-`; `None` on anything else or
/// on overflow. (Hand-written: `str::parse` would need a UTF-8 check first.)
fn parse_i64(s: &[u8]) -> Option<i64> {
    let (neg, digits) = match s.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, s),
    };
    if digits.is_empty() {
        return None;
    }
    let mut v: i64 = 0;
    for &c in digits {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?;
        v = if neg {
            v.checked_sub(i64::from(d))?
        } else {
            v.checked_add(i64::from(d))?
        };
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn errors_in_a_file_name_it_once() {
        let bad = DataError::BadLine {
            line: 3,
            reason: BadLineReason::ColumnCount(2),
        }
        .in_file(Path::new("/data/day_0.tsv"));
        assert_eq!(
            bad.to_string(),
            "/data/day_0.tsv: bad line 3: 2 columns, expected 40"
        );
        let again = bad.in_file(Path::new("/elsewhere"));
        assert!(again.to_string().starts_with("/data/day_0.tsv: bad line 3"));
        let open = DataError::Open {
            path: "/x".into(),
            source: io::ErrorKind::NotFound.into(),
        }
        .in_file(Path::new("/x"));
        assert!(matches!(open, DataError::Open { .. }));
    }

    fn line(label: &str, ints: &[&str; 13], cats: &[&str; 26]) -> String {
        let mut s = label.to_owned();
        for c in ints.iter().chain(cats.iter()) {
            s.push('\t');
            s.push_str(c);
        }
        s
    }

    fn good(label: &str) -> String {
        let mut ints = [""; 13];
        ints[0] = "3";
        ints[1] = "-1";
        let mut cats = ["68fd1e64"; 26];
        cats[25] = "";
        line(label, &ints, &cats)
    }

    fn reader(text: &str, opts: ReaderOptions) -> CriteoReader<Cursor<Vec<u8>>> {
        CriteoReader::new(Cursor::new(text.as_bytes().to_vec()), opts).unwrap()
    }

    #[test]
    fn parses_a_line() {
        let text = format!("{}\n{}\r\n", good("1"), good("0"));
        let mut r = reader(&text, ReaderOptions::default());
        let mut b = Batch::default();
        assert_eq!(r.next_batch(10, &mut b).unwrap(), 2);
        assert_eq!(b.labels, vec![1.0, 0.0]);
        assert_eq!(b.numeric[0], 4f32.ln());
        assert_eq!(b.numeric[1], -(2f32.ln()));
        assert_eq!(&b.numeric[2..13], &[0.0; 11]);
        assert_eq!(b.keys[0], feature_hash(0, b"68fd1e64"));
        assert_eq!(b.keys[1], feature_hash(1, b"68fd1e64"));
        assert_eq!(b.keys[25], MISSING_KEY);
        assert_eq!(b.key_row(1), b.key_row(0));
        assert_eq!(r.next_batch(10, &mut b).unwrap(), 0);
        assert_eq!(r.counters().lines, 2);
    }

    #[test]
    fn bad_lines_error_or_skip() {
        let mut ints = [""; 13];
        ints[4] = "12x";
        let bad_int = line("0", &ints, &[""; 26]);
        let bad_label = good("2");
        let short = "1\t2\t3".to_owned();
        let text = format!(
            "{}\n{bad_int}\n{bad_label}\n{short}\n\n{}",
            good("0"),
            good("1")
        );
        let mut r = reader(&text, ReaderOptions::default());
        let mut b = Batch::default();
        let err = r.next_batch(10, &mut b).unwrap_err();
        assert!(matches!(
            err,
            DataError::BadLine {
                line: 2,
                reason: BadLineReason::Integer(5)
            }
        ));
        let opts = ReaderOptions {
            skip_bad_lines: true,
            ..Default::default()
        };
        let mut r = reader(&text, opts);
        assert_eq!(r.next_batch(10, &mut b).unwrap(), 2);
        assert_eq!(b.labels, vec![0.0, 1.0]);
        assert_eq!(b.len, 2);
        assert_eq!(b.keys.len(), 52);
        assert_eq!(
            r.counters(),
            ReaderCounters {
                lines: 6,
                examples: 2,
                skipped: 4
            }
        );
    }

    #[test]
    fn reasons() {
        let mut b = Batch::default();
        assert_eq!(parse_line(b"", &mut b), Err(BadLineReason::ColumnCount(1)));
        let long = format!("{}\t", good("0"));
        assert_eq!(
            parse_line(long.as_bytes(), &mut b),
            Err(BadLineReason::ColumnCount(41))
        );
        let mut ints = [""; 13];
        ints[12] = "99999999999999999999";
        let overflow = line("1", &ints, &[""; 26]);
        assert_eq!(
            parse_line(overflow.as_bytes(), &mut b),
            Err(BadLineReason::Integer(13))
        );
        ints[12] = "-";
        let dash = line("1", &ints, &[""; 26]);
        assert_eq!(
            parse_line(dash.as_bytes(), &mut b),
            Err(BadLineReason::Integer(13))
        );
        assert_eq!(b.len, 0);
        assert!(b.labels.is_empty() && b.numeric.is_empty() && b.keys.is_empty());
        assert_eq!(parse_i64(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_i64(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_i64(b"9223372036854775808"), None);
    }

    #[test]
    fn too_long_line_is_bad_not_buffered() {
        let huge = "1".repeat(10_000);
        let text = format!("{huge}\n{}\n", good("1"));
        let opts = ReaderOptions {
            max_line_len: 1000,
            ..Default::default()
        };
        let mut r = reader(&text, opts);
        let mut b = Batch::default();
        assert!(matches!(
            r.next_batch(10, &mut b),
            Err(DataError::BadLine {
                line: 1,
                reason: BadLineReason::TooLong
            })
        ));
        assert!(r.line.capacity() < 5000);
        assert_eq!(r.counters().lines, 1);
        let mut r = reader(
            &text,
            ReaderOptions {
                skip_bad_lines: true,
                ..opts
            },
        );
        assert_eq!(r.next_batch(10, &mut b).unwrap(), 1);
        assert_eq!(r.counters().skipped, 1);
    }

    #[test]
    fn workers_split_lines_and_rewind() {
        let text: String = (0..10)
            .map(|i| good(if i % 3 == 0 { "1" } else { "0" }) + "\n")
            .collect();
        let mut all = Vec::new();
        for w in 0..3 {
            let opts = ReaderOptions {
                worker: w,
                workers: 3,
                ..Default::default()
            };
            let mut r = reader(&text, opts);
            let mut b = Batch::default();
            let mut got = 0;
            while r.next_batch(2, &mut b).unwrap() > 0 {
                got += b.len;
                all.extend(b.labels.iter().copied());
            }
            assert_eq!(got, if w == 0 { 4 } else { 3 });
            r.rewind().unwrap();
            assert_eq!(r.next_batch(100, &mut b).unwrap(), got);
        }
        assert_eq!(all.iter().filter(|&&l| l == 1.0).count(), 4);
        assert!(CriteoReader::new(
            Cursor::new(Vec::new()),
            ReaderOptions {
                worker: 1,
                workers: 1,
                ..Default::default()
            }
        )
        .is_err());
    }

    #[test]
    fn lines_longer_than_the_buffer() {
        // A tiny read buffer forces every line through the slow path.
        let text: String = (0..7)
            .map(|i| good(if i % 2 == 0 { "1" } else { "0" }) + "\r\n")
            .collect();
        let text = format!("{text}{}", good("1")); // no final newline
        let mut fast = reader(&text, ReaderOptions::default());
        let mut slow = CriteoReader::new(
            std::io::BufReader::with_capacity(16, Cursor::new(text.into_bytes())),
            ReaderOptions::default(),
        )
        .unwrap();
        let (mut a, mut b) = (Batch::default(), Batch::default());
        assert_eq!(fast.next_batch(100, &mut a).unwrap(), 8);
        assert_eq!(slow.next_batch(100, &mut b).unwrap(), 8);
        assert_eq!(a, b);
        assert_eq!(slow.counters(), fast.counters());
        let long = format!("{}\n", good("1"));
        let mut slow = CriteoReader::new(
            std::io::BufReader::with_capacity(16, Cursor::new(long.into_bytes())),
            ReaderOptions {
                max_line_len: 100,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(matches!(
            slow.next_batch(1, &mut b),
            Err(DataError::BadLine {
                line: 1,
                reason: BadLineReason::TooLong
            })
        ));
        assert!(slow.line.capacity() <= 1024);
    }

    #[test]
    fn mutated_input_never_panics() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let base: String = (0..4).map(|_| good("1") + "\n").collect();
        let alphabet = b"\t\n\r-0123456789abcdef\xff";
        let mut b = Batch::default();
        for _ in 0..1500 {
            let mut bytes = base.clone().into_bytes();
            for _ in 0..rng.gen_range(1..8) {
                if bytes.is_empty() {
                    break;
                }
                let at = rng.gen_range(0..bytes.len());
                match rng.gen_range(0..4) {
                    0 => bytes[at] = alphabet[rng.gen_range(0..alphabet.len())],
                    1 => bytes.insert(at, alphabet[rng.gen_range(0..alphabet.len())]),
                    2 => {
                        bytes.remove(at);
                    }
                    _ => bytes.truncate(at.max(1)),
                }
            }
            let opts = ReaderOptions {
                skip_bad_lines: rng.gen(),
                max_line_len: rng.gen_range(10..400),
                ..Default::default()
            };
            let mut r = CriteoReader::new(
                std::io::BufReader::with_capacity(rng.gen_range(8..64), Cursor::new(bytes)),
                opts,
            )
            .unwrap();
            loop {
                match r.next_batch(3, &mut b) {
                    Ok(0) => break,
                    Ok(n) => {
                        assert_eq!(b.labels.len(), n);
                        assert_eq!(b.numeric.len(), n * NUM_NUMERIC);
                        assert_eq!(b.keys.len(), n * NUM_CATEGORICAL);
                        assert!(b.numeric.iter().all(|x| x.is_finite()));
                    }
                    Err(DataError::BadLine { line, .. }) => {
                        assert!(!opts.skip_bad_lines);
                        assert!(line >= 1 && line <= r.counters().lines);
                        assert_eq!(b.keys.len(), b.len * NUM_CATEGORICAL);
                        break;
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            let c = r.counters();
            assert!(c.examples + c.skipped <= c.lines);
        }
    }

    #[test]
    fn open_missing_file() {
        assert!(matches!(
            CriteoReader::open("/nonexistent/criteo.tsv", ReaderOptions::default()),
            Err(DataError::Open { .. })
        ));
    }
}

//! The machinery the stable-toolchain drivers share: their command line,
//! the mutate-run-keep loop under `catch_unwind`, saving a failing input,
//! and the progress and summary lines.
//!
//! A driver binary names a [`Target`] and calls [`main`]. Every driver
//! takes
//!
//! ```text
//! [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]
//! ```
//!
//! and, where its [`Spec`] says so, `--max-len N`, `--corpus DIR` and
//! `--save-corpus`. Without `--seconds` or `--iters` it runs for 10 s.
//!
//! Each iteration copies a corpus entry (half the time a built-in seed, so
//! valid structure stays common), lets the target mutate it into an input
//! and choose the rest of the run, and runs it under `catch_unwind`. An
//! input whose outcome key is new joins the corpus. A panic or a failed
//! oracle saves the input to `OUT/<prefix>-<seed>-<iter>.bin` and ends the
//! run with status 1; `--replay FILE` runs one saved input.

use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, Instant};

use rand::Rng;

use crate::{save_input, Mutation, Mutator};

/// What tells one driver's command line and corpus from another's.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The binary's name, for messages and the usage line.
    pub name: &'static str,
    /// `--seed` when it is not given.
    pub seed: u64,
    /// `--out` when it is not given.
    pub out: &'static str,
    /// The longest input; `--max-len` when it is not given.
    pub max_len: usize,
    /// Whether `--max-len N` is taken (else `max_len` is fixed).
    pub max_len_flag: bool,
    /// Whether `--corpus DIR` (extra seeds) and `--save-corpus` are taken.
    pub corpus_flags: bool,
    /// The corpus grows to this many entries; then a new entry replaces
    /// one that is not a built-in seed.
    pub max_corpus: usize,
    /// Failing inputs are saved as `OUT/<failure_prefix>-<seed>-<iter>.bin`.
    pub failure_prefix: &'static str,
}

/// One fuzz target, as the driver loop sees it.
pub trait Target {
    /// The driver's name and options.
    const SPEC: Spec;
    /// The mutations that suit the target's corpus entries.
    type Mutation: Mutation;
    /// The choices of one run that its input bytes do not hold.
    type Case;
    /// What a run is judged by: an input whose key was not seen before
    /// joins the corpus.
    type Key: Eq + Hash;

    /// The built-in seed corpus.
    fn seeds(&self) -> Vec<Vec<u8>>;

    /// Keys of the starting corpus, known before fuzzing starts (none
    /// unless the target says).
    fn known(&mut self, _corpus: &[Vec<u8>]) -> Vec<Self::Key> {
        Vec::new()
    }

    /// Make `input`, a copy of a corpus entry, the input of one run
    /// (mutating it with `m`; `corpus` supplies splice partners), and
    /// choose the rest of the run.
    fn prepare(
        &mut self,
        m: &mut Mutator<Self::Mutation>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> Self::Case;

    /// The part of an input that joins the corpus: all of it unless the
    /// target puts run choices in front of the entry.
    fn entry<'a>(&self, input: &'a [u8]) -> &'a [u8] {
        input
    }

    /// Run one input and count its outcome. `Err` says what failed when
    /// an oracle reports rather than panics. Runs under `catch_unwind`.
    fn run(&mut self, case: &Self::Case, input: &[u8]) -> Result<Self::Key, String>;

    /// What a failure report says about the case, after the input's size.
    fn describe(&self, _case: &Self::Case) -> String {
        String::new()
    }

    /// The target's counts so far, for a progress line.
    fn progress(&self) -> String;

    /// Lines of the final report.
    fn summary(&self) -> Vec<String>;

    /// Run one saved input, printing what it did; false if an oracle
    /// that reports failed.
    fn replay(&mut self, input: &[u8]) -> bool;

    /// Run one input under every choice of a run that the input does not
    /// hold itself (both limits, with and without a token): the body that
    /// the AFL drivers (`transport/wire/fuzz/afl`) and the corpus replay
    /// test run. `Err` says which oracle failed; a panic is a crash.
    fn check(&mut self, input: &[u8]) -> Result<(), String>;
}

/// A driver's options, parsed once from its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Stop after this many seconds.
    pub seconds: Option<u64>,
    /// Stop after this many inputs.
    pub iters: Option<u64>,
    /// Seed of the mutator's random source.
    pub seed: u64,
    /// Extra seeds: every file of this directory.
    pub corpus: Option<PathBuf>,
    /// Where failing inputs (and a saved corpus) go.
    pub out: PathBuf,
    /// Inputs are kept at most this long.
    pub max_len: usize,
    /// Save the corpus grown past the built-in seeds to `OUT/corpus`.
    pub save_corpus: bool,
    /// Run only this input.
    pub replay: Option<PathBuf>,
}

/// A command line a driver does not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgError {
    /// `-h` or `--help`: the usage line was asked for.
    Help,
    /// A flag this driver does not take.
    Unknown(String),
    /// A flag given without its value.
    Missing(String),
    /// A value that is not a number.
    NotANumber {
        /// The flag.
        flag: String,
        /// Its value.
        value: String,
    },
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Help => f.write_str("usage asked for"),
            Self::Unknown(flag) => write!(f, "unknown option {flag}"),
            Self::Missing(flag) => write!(f, "{flag} needs a value"),
            Self::NotANumber { flag, value } => write!(f, "{flag} {value}: not a number"),
        }
    }
}

impl std::error::Error for ArgError {}

impl Options {
    /// Parse `args` (without the program name) as `spec`'s driver takes
    /// them.
    pub fn parse(spec: &Spec, args: impl IntoIterator<Item = String>) -> Result<Self, ArgError> {
        let mut o = Options {
            seconds: None,
            iters: None,
            seed: spec.seed,
            corpus: None,
            out: PathBuf::from(spec.out),
            max_len: spec.max_len,
            save_corpus: false,
            replay: None,
        };
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            match flag.as_str() {
                "--seconds" => o.seconds = Some(number(&flag, value(&mut args, &flag)?)?),
                "--iters" => o.iters = Some(number(&flag, value(&mut args, &flag)?)?),
                "--seed" => o.seed = number(&flag, value(&mut args, &flag)?)?,
                "--out" => o.out = PathBuf::from(value(&mut args, &flag)?),
                "--replay" => o.replay = Some(PathBuf::from(value(&mut args, &flag)?)),
                "--max-len" if spec.max_len_flag => {
                    o.max_len = number(&flag, value(&mut args, &flag)?)?;
                }
                "--corpus" if spec.corpus_flags => {
                    o.corpus = Some(PathBuf::from(value(&mut args, &flag)?));
                }
                "--save-corpus" if spec.corpus_flags => o.save_corpus = true,
                "-h" | "--help" => return Err(ArgError::Help),
                _ => return Err(ArgError::Unknown(flag)),
            }
        }
        if o.seconds.is_none() && o.iters.is_none() {
            o.seconds = Some(10);
        }
        Ok(o)
    }
}

fn value(args: &mut impl Iterator<Item = String>, flag: &str) -> Result<String, ArgError> {
    args.next()
        .ok_or_else(|| ArgError::Missing(flag.to_string()))
}

fn number<N: FromStr>(flag: &str, value: String) -> Result<N, ArgError> {
    value.parse().map_err(|_| ArgError::NotANumber {
        flag: flag.to_string(),
        value,
    })
}

/// The usage line of `spec`'s driver.
pub fn usage(spec: &Spec) -> String {
    let mut u = format!("usage: {} [--seconds N | --iters N] [--seed S]", spec.name);
    if spec.corpus_flags {
        u.push_str(" [--corpus DIR]");
    }
    u.push_str(" [--out DIR]");
    if spec.max_len_flag {
        u.push_str(" [--max-len N]");
    }
    if spec.corpus_flags {
        u.push_str(" [--save-corpus]");
    }
    u.push_str(" [--replay FILE]");
    u
}

/// A driver's `main`: parse the command line, then replay one input or
/// fuzz. Exits 2 on a bad command line or an unreadable `--replay` file,
/// 1 when an input failed.
pub fn main<T: Target>(mut target: T) -> ExitCode {
    let spec = &T::SPEC;
    let opts = match Options::parse(spec, std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            if e != ArgError::Help {
                eprintln!("{}: {e}", spec.name);
            }
            eprintln!("{}", usage(spec));
            return ExitCode::from(2);
        }
    };
    if let Some(file) = &opts.replay {
        let data = match std::fs::read(file) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("cannot read {}: {e}", file.display());
                return ExitCode::from(2);
            }
        };
        return if target.replay(&data) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    match run(&opts, &mut target) {
        Ok(_) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

/// Fuzz `target` as `opts` say. Returns how many inputs ran, or the path
/// a failing input was saved to.
pub fn run<T: Target>(opts: &Options, target: &mut T) -> Result<u64, PathBuf> {
    let spec = &T::SPEC;
    let mut corpus = target.seeds();
    let n_seeds = corpus.len();
    if let Some(dir) = &opts.corpus {
        match std::fs::read_dir(dir) {
            Ok(entries) => {
                for e in entries.flatten() {
                    if let Ok(d) = std::fs::read(e.path()) {
                        corpus.push(d);
                    }
                }
            }
            Err(e) => eprintln!("cannot read corpus {}: {e}", dir.display()),
        }
    }
    let extra = if spec.corpus_flags {
        format!(", {} from --corpus", corpus.len() - n_seeds)
    } else {
        String::new()
    };
    println!(
        "{}: seed {} | {n_seeds} built-in seeds{extra} | max_len {}",
        spec.name, opts.seed, opts.max_len
    );

    let mut m = Mutator::<T::Mutation>::new(opts.seed, opts.max_len);
    let mut seen: HashSet<T::Key> = target.known(&corpus).into_iter().collect();
    let start = Instant::now();
    let deadline = opts.seconds.map(|s| start + Duration::from_secs(s));
    let mut last_report = start;
    let mut execs = 0u64;
    let mut input = Vec::new();
    loop {
        if opts.iters.is_some_and(|n| execs >= n) {
            break;
        }
        if execs % 256 == 0 {
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                break;
            }
            if now - last_report >= Duration::from_secs(10) {
                last_report = now;
                println!(
                    "  {:>6.1}s  execs {execs}  corpus {}  {}",
                    (now - start).as_secs_f64(),
                    corpus.len(),
                    target.progress()
                );
            }
        }
        let pool = if m.rng().gen_bool(0.5) {
            n_seeds
        } else {
            corpus.len()
        };
        let base = m.rng().gen_range(0..pool);
        input.clear();
        input.extend_from_slice(&corpus[base]);
        let case = target.prepare(&mut m, &mut input, &corpus);
        let result = catch_unwind(AssertUnwindSafe(|| target.run(&case, &input)));
        execs += 1;
        let failure = match result {
            Ok(Ok(key)) => {
                if seen.insert(key) {
                    let entry = target.entry(&input).to_vec();
                    if corpus.len() < spec.max_corpus {
                        corpus.push(entry);
                    } else {
                        let i = m.rng().gen_range(n_seeds..corpus.len());
                        corpus[i] = entry;
                    }
                }
                continue;
            }
            Ok(Err(what)) => what,
            Err(_) => "PANIC".to_string(),
        };
        let name = format!("{}-{}-{execs}.bin", spec.failure_prefix, opts.seed);
        let p = save_input(&opts.out, &name, &input);
        eprintln!(
            "{failure}\non an input of {} bytes{}; saved to {}",
            input.len(),
            target.describe(&case),
            p.display()
        );
        eprintln!(
            "replay: cargo run --release -p starwire-wire-fuzz --bin {} -- --replay {}",
            spec.name,
            p.display()
        );
        return Err(p);
    }

    let secs = start.elapsed().as_secs_f64().max(1e-9);
    println!(
        "done: {execs} execs in {secs:.1}s = {:.0} execs/s | corpus {} ({} outcomes)",
        execs as f64 / secs,
        corpus.len(),
        seen.len()
    );
    for line in target.summary() {
        println!("  {line}");
    }
    if opts.save_corpus {
        let dir = opts.out.join("corpus");
        for (i, c) in corpus.iter().enumerate().skip(n_seeds) {
            save_input(&dir, &format!("{i:05}.bin"), c);
        }
        println!(
            "  saved {} inputs to {}",
            corpus.len() - n_seeds,
            dir.display()
        );
    }
    Ok(execs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Frames;

    const SPEC: Spec = Spec {
        name: "fuzz-test",
        seed: 9,
        out: "/nonexistent/out",
        max_len: 300,
        max_len_flag: true,
        corpus_flags: true,
        max_corpus: 16,
        failure_prefix: "fail",
    };

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options_take_every_flag() {
        let o = Options::parse(
            &SPEC,
            args(
                "--seconds 3 --iters 7 --seed 11 --corpus c --out o --max-len 64 \
                 --save-corpus --replay r",
            ),
        )
        .unwrap();
        assert_eq!(
            o,
            Options {
                seconds: Some(3),
                iters: Some(7),
                seed: 11,
                corpus: Some("c".into()),
                out: "o".into(),
                max_len: 64,
                save_corpus: true,
                replay: Some("r".into()),
            }
        );
    }

    #[test]
    fn options_default_from_the_spec() {
        let o = Options::parse(&SPEC, args("")).unwrap();
        assert_eq!(o.seconds, Some(10));
        assert_eq!(o.iters, None);
        assert_eq!(o.seed, 9);
        assert_eq!(o.out, PathBuf::from("/nonexistent/out"));
        assert_eq!(o.max_len, 300);
        assert!(!o.save_corpus && o.corpus.is_none() && o.replay.is_none());
        // --iters alone does not add a time limit.
        let o = Options::parse(&SPEC, args("--iters 5")).unwrap();
        assert_eq!((o.seconds, o.iters), (None, Some(5)));
    }

    #[test]
    fn options_reject_what_the_driver_does_not_take() {
        let narrow = Spec {
            max_len_flag: false,
            corpus_flags: false,
            ..SPEC
        };
        for flag in ["--max-len 5", "--corpus d", "--save-corpus", "--bogus"] {
            let first = flag.split(' ').next().unwrap().to_string();
            assert_eq!(
                Options::parse(&narrow, args(flag)),
                Err(ArgError::Unknown(first))
            );
        }
        assert_eq!(
            Options::parse(&SPEC, args("--seed")),
            Err(ArgError::Missing("--seed".into()))
        );
        assert_eq!(
            Options::parse(&SPEC, args("--iters ten")),
            Err(ArgError::NotANumber {
                flag: "--iters".into(),
                value: "ten".into()
            })
        );
        assert_eq!(Options::parse(&SPEC, args("-h")), Err(ArgError::Help));
    }

    #[test]
    fn usage_lists_the_flags_taken() {
        assert_eq!(
            usage(&SPEC),
            "usage: fuzz-test [--seconds N | --iters N] [--seed S] [--corpus DIR] \
             [--out DIR] [--max-len N] [--save-corpus] [--replay FILE]"
        );
        let narrow = Spec {
            max_len_flag: false,
            corpus_flags: false,
            ..SPEC
        };
        assert_eq!(
            usage(&narrow),
            "usage: fuzz-test [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]"
        );
    }

    /// Keys inputs by length; fails (by `Err`, or by a panic) on an input
    /// holding the byte `bad`.
    #[derive(Debug)]
    struct Toy {
        bad: Option<u8>,
        panic: bool,
        runs: u64,
    }

    impl Target for Toy {
        const SPEC: Spec = SPEC;
        type Mutation = Frames;
        type Case = ();
        type Key = usize;

        fn seeds(&self) -> Vec<Vec<u8>> {
            vec![vec![1, 2, 3], vec![4; 40]]
        }

        fn prepare(&mut self, m: &mut Mutator<Frames>, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
            m.mutate(input, corpus);
        }

        fn run(&mut self, _: &(), input: &[u8]) -> Result<usize, String> {
            self.runs += 1;
            if self.bad.is_some_and(|b| input.contains(&b)) {
                assert!(!self.panic, "found it");
                return Err("found it".into());
            }
            Ok(input.len())
        }

        fn progress(&self) -> String {
            format!("runs {}", self.runs)
        }

        fn summary(&self) -> Vec<String> {
            vec![self.progress()]
        }

        fn replay(&mut self, input: &[u8]) -> bool {
            self.run(&(), input).is_ok()
        }

        fn check(&mut self, input: &[u8]) -> Result<(), String> {
            self.run(&(), input).map(drop)
        }
    }

    fn out_dir(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("starwire-fuzz-{name}-{}", std::process::id()))
    }

    #[test]
    fn runs_the_iterations_asked_for() {
        let out = out_dir("iters");
        let opts = Options {
            iters: Some(2_000),
            out: out.clone(),
            save_corpus: true,
            ..Options::parse(&SPEC, args("--seed 1")).unwrap()
        };
        let mut toy = Toy {
            bad: None,
            panic: false,
            runs: 0,
        };
        assert_eq!(run(&opts, &mut toy), Ok(2_000));
        assert_eq!(toy.runs, 2_000);
        // The corpus grew past the seeds (new lengths), to its cap.
        let saved = std::fs::read_dir(out.join("corpus")).unwrap().count();
        assert_eq!(saved, SPEC.max_corpus - 2);
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn saves_the_input_that_fails_or_panics() {
        for panic in [false, true] {
            let out = out_dir(if panic { "panic" } else { "fail" });
            let opts = Options {
                iters: Some(1_000_000),
                out: out.clone(),
                ..Options::parse(&SPEC, args("--seed 2")).unwrap()
            };
            let mut toy = Toy {
                bad: Some(0xff),
                panic,
                runs: 0,
            };
            let saved = run(&opts, &mut toy).unwrap_err();
            assert_eq!(saved, out.join(format!("fail-2-{}.bin", toy.runs)));
            let input = std::fs::read(&saved).unwrap();
            assert!(input.contains(&0xff));
            if !panic {
                assert!(!toy.replay(&input));
            }
            std::fs::remove_dir_all(&out).unwrap();
        }
    }
}

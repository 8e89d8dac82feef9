//! `fuzz-decode`: a mutation fuzzer for `starwire_wire::decode_any` that runs
//! on the stable toolchain.
//!
//! ```text
//! fuzz-decode [--seconds N | --iters N] [--seed S] [--corpus DIR]
//!             [--out DIR] [--max-len N] [--save-corpus] [--replay FILE]
//! ```
//!
//! It starts from a seed corpus of valid frames of every opcode (plus the
//! files of `--corpus DIR`), mutates a random corpus entry each iteration,
//! runs the decoder under `catch_unwind` with the default and with small
//! limits, and keeps inputs whose outcome signature is new. On a panic it
//! writes the input to `OUT/crash-<seed>-<iter>.bin` and exits with status 1.
//! `--replay FILE` runs a single input (for example a crash) and exits.
#![deny(unsafe_code)]

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rand::Rng;
use starwire_wire::{decode_any, Limits};
use starwire_wire_fuzz::{
    frame_error_kind, outcome_signature, save_input, seeds, Mutator, SMALL_LIMITS,
};

const MAX_CORPUS: usize = 8192;

#[derive(Debug)]
struct Args {
    seconds: Option<u64>,
    iters: Option<u64>,
    seed: u64,
    corpus: Option<PathBuf>,
    out: PathBuf,
    max_len: usize,
    save_corpus: bool,
    replay: Option<PathBuf>,
}

fn usage() -> ! {
    eprintln!(
        "usage: fuzz-decode [--seconds N | --iters N] [--seed S] [--corpus DIR] \
         [--out DIR] [--max-len N] [--save-corpus] [--replay FILE]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        seconds: None,
        iters: None,
        seed: 0x5357_5231,
        corpus: None,
        out: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out")),
        max_len: 1 << 16,
        save_corpus: false,
        replay: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        let num = |s: String| s.parse::<u64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--seconds" => a.seconds = Some(num(val())),
            "--iters" => a.iters = Some(num(val())),
            "--seed" => a.seed = num(val()),
            "--corpus" => a.corpus = Some(PathBuf::from(val())),
            "--out" => a.out = PathBuf::from(val()),
            "--max-len" => a.max_len = num(val()) as usize,
            "--save-corpus" => a.save_corpus = true,
            "--replay" => a.replay = Some(PathBuf::from(val())),
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    if a.seconds.is_none() && a.iters.is_none() {
        a.seconds = Some(10);
    }
    a
}

fn main() -> ExitCode {
    let args = parse_args();

    if let Some(file) = &args.replay {
        let data = std::fs::read(file).unwrap_or_else(|e| {
            eprintln!("cannot read {}: {e}", file.display());
            std::process::exit(2)
        });
        for limits in [Limits::default(), SMALL_LIMITS] {
            println!("{limits:?}: {:?}", decode_any(&data, &limits));
        }
        return ExitCode::SUCCESS;
    }

    let mut corpus = seeds::corpus();
    let n_seeds = corpus.len();
    if let Some(dir) = &args.corpus {
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
    println!(
        "fuzz-decode: seed {} | {} built-in seeds, {} from --corpus | max_len {}",
        args.seed,
        n_seeds,
        corpus.len() - n_seeds,
        args.max_len
    );

    let mut m = Mutator::new(args.seed, args.max_len);
    let mut seen: HashSet<u64> = HashSet::new();
    for c in &corpus {
        for l in [Limits::default(), SMALL_LIMITS] {
            seen.insert(outcome_signature(&decode_any(c, &l)));
        }
    }

    let start = Instant::now();
    let deadline = args.seconds.map(|s| start + Duration::from_secs(s));
    let mut last_report = start;
    let (mut execs, mut full, mut body_err, mut frame_err) = (0u64, 0u64, 0u64, 0u64);
    let mut kinds: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut input = Vec::new();
    loop {
        if args.iters.is_some_and(|n| execs >= n) {
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
                    "  {:>6.1}s  execs {execs}  corpus {}  ok {full}  body-err {body_err}  frame-err {frame_err}",
                    (now - start).as_secs_f64(),
                    corpus.len()
                );
            }
        }
        // Half the time start from a built-in seed, so structure stays valid.
        let pool = if m.rng().gen_bool(0.5) {
            n_seeds
        } else {
            corpus.len()
        };
        let base = m.rng().gen_range(0..pool);
        input.clear();
        input.extend_from_slice(&corpus[base]);
        m.mutate(&mut input, &corpus);
        let limits = if m.rng().gen_bool(0.5) {
            Limits::default()
        } else {
            SMALL_LIMITS
        };
        let result = catch_unwind(AssertUnwindSafe(|| decode_any(&input, &limits)));
        execs += 1;
        let r = match result {
            Ok(r) => r,
            Err(_) => {
                let p = save_input(
                    &args.out,
                    &format!("crash-{}-{execs}.bin", args.seed),
                    &input,
                );
                eprintln!(
                    "PANIC on input of {} bytes with {limits:?}; saved to {}",
                    input.len(),
                    p.display()
                );
                eprintln!(
                    "replay: cargo run --release -p starwire-wire-fuzz --bin fuzz-decode -- --replay {}",
                    p.display()
                );
                return ExitCode::FAILURE;
            }
        };
        match &r {
            Ok(s) if s.body_errors == 0 => full += 1,
            Ok(_) => body_err += 1,
            Err(e) => {
                frame_err += 1;
                *kinds.entry(frame_error_kind(e)).or_default() += 1;
            }
        }
        if seen.insert(outcome_signature(&r)) {
            if corpus.len() < MAX_CORPUS {
                corpus.push(input.clone());
            } else {
                let i = m.rng().gen_range(n_seeds..corpus.len());
                corpus[i] = input.clone();
            }
        }
    }

    let secs = start.elapsed().as_secs_f64().max(1e-9);
    println!(
        "done: {execs} execs in {secs:.1}s = {:.0} execs/s",
        execs as f64 / secs
    );
    println!(
        "  decoded fully {full} | decoded with body errors {body_err} | framing errors {frame_err} | corpus {} ({} signatures)",
        corpus.len(),
        seen.len()
    );
    println!("  framing errors by kind: {kinds:?}");
    if args.save_corpus {
        let dir = args.out.join("corpus");
        for (i, c) in corpus.iter().enumerate().skip(n_seeds) {
            save_input(&dir, &format!("{i:05}.bin"), c);
        }
        println!(
            "  saved {} inputs to {}",
            corpus.len() - n_seeds,
            dir.display()
        );
    }
    ExitCode::SUCCESS
}

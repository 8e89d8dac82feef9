//! `fuzz-deframe`: a mutation fuzzer for `starwire_wire::Deframer` that runs
//! on the stable toolchain.
//!
//! ```text
//! fuzz-deframe [--seconds N | --iters N] [--seed S] [--out DIR]
//!              [--max-len N] [--replay FILE]
//! ```
//!
//! Each iteration mutates a stream of the corpus (the built-in seeds, plus
//! streams that gave a new outcome), puts control bytes in front (limits,
//! frames per scan, piece sizes; see `starwire_wire_fuzz::Feed`) and runs
//! `check_deframe` under `catch_unwind`: the deframer, fed the stream in
//! those pieces, must lend the same frames and end with the same error as
//! parsing the stream whole. On a panic or a difference it writes the
//! input to `OUT/deframe-<seed>-<iter>.bin` and exits with status 1.
//! `--replay FILE` runs a single input and exits.

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rand::Rng;
use starwire_wire_fuzz::{check_deframe, frame_error_kind, save_input, seeds, Feed, Mutator};

const MAX_CORPUS: usize = 8192;

#[derive(Debug)]
struct Args {
    seconds: Option<u64>,
    iters: Option<u64>,
    seed: u64,
    out: PathBuf,
    max_len: usize,
    replay: Option<PathBuf>,
}

fn usage() -> ! {
    eprintln!(
        "usage: fuzz-deframe [--seconds N | --iters N] [--seed S] [--out DIR] \
         [--max-len N] [--replay FILE]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        seconds: None,
        iters: None,
        seed: 0x5357_5231,
        out: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out")),
        max_len: 1 << 16,
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
            "--out" => a.out = PathBuf::from(val()),
            "--max-len" => a.max_len = num(val()) as usize,
            "--replay" => a.replay = Some(PathBuf::from(val())),
            _ => usage(),
        }
    }
    if a.seconds.is_none() && a.iters.is_none() {
        a.seconds = Some(10);
    }
    a
}

/// Piece sizes: mostly short (cuts inside headers and bodies), some long
/// (many frames per piece).
fn piece_sizes(m: &mut Mutator) -> Vec<u8> {
    let k = m.rng().gen_range(1..=4);
    (0..k)
        .map(|_| match m.rng().gen_range(0..4) {
            0 | 1 => m.rng().gen_range(0..64),
            2 => m.rng().gen_range(128..=255),
            _ => m.rng().gen(),
        })
        .collect()
}

fn main() -> ExitCode {
    let args = parse_args();

    if let Some(file) = &args.replay {
        let data = std::fs::read(file).unwrap_or_else(|e| {
            eprintln!("cannot read {}: {e}", file.display());
            std::process::exit(2)
        });
        println!("{:?}", Feed::parse(&data));
        return match check_deframe(&data) {
            Ok(out) => {
                println!("same as the reference: {out:?}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("differs: {e}");
                ExitCode::FAILURE
            }
        };
    }

    let mut corpus = seeds::corpus();
    let n_seeds = corpus.len();
    println!(
        "fuzz-deframe: seed {} | {} built-in seeds | max_len {}",
        args.seed, n_seeds, args.max_len
    );

    let mut m = Mutator::new(args.seed, args.max_len);
    let mut seen: HashSet<(usize, &'static str, bool)> = HashSet::new();
    let start = Instant::now();
    let deadline = args.seconds.map(|s| start + Duration::from_secs(s));
    let mut last_report = start;
    let (mut execs, mut frames) = (0u64, 0u64);
    let mut ends: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut stream = Vec::new();
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
                    "  {:>6.1}s  execs {execs}  frames {frames}  corpus {}",
                    (now - start).as_secs_f64(),
                    corpus.len()
                );
            }
        }
        // Half the time from a built-in seed, so long runs of valid frames
        // stay common; a fifth of those unmutated.
        let pool = if m.rng().gen_bool(0.5) {
            n_seeds
        } else {
            corpus.len()
        };
        let base = m.rng().gen_range(0..pool);
        stream.clear();
        stream.extend_from_slice(&corpus[base]);
        if m.rng().gen_bool(0.8) {
            m.mutate(&mut stream, &corpus);
        }
        let small = m.rng().gen_bool(0.5);
        let max = m.rng().gen_range(0..8);
        let pieces = piece_sizes(&mut m);
        let mut input = Feed::control(small, max, &pieces);
        input.extend_from_slice(&stream);
        let result = catch_unwind(AssertUnwindSafe(|| check_deframe(&input)));
        execs += 1;
        let failure = match result {
            Ok(Ok(out)) => {
                frames += out.frames.len() as u64;
                let end = out.end.as_ref().map_or_else(frame_error_kind, |()| "whole");
                *ends.entry(end).or_default() += 1;
                if seen.insert((out.frames.len().min(4), end, small)) {
                    if corpus.len() < MAX_CORPUS {
                        corpus.push(stream.clone());
                    } else {
                        let i = m.rng().gen_range(n_seeds..corpus.len());
                        corpus[i] = stream.clone();
                    }
                }
                continue;
            }
            Ok(Err(diff)) => format!("DIFFERENCE: {diff}"),
            Err(_) => "PANIC".to_string(),
        };
        let p = save_input(
            &args.out,
            &format!("deframe-{}-{execs}.bin", args.seed),
            &input,
        );
        eprintln!(
            "{failure}\non an input of {} bytes; saved to {}",
            input.len(),
            p.display()
        );
        eprintln!(
            "replay: cargo run --release -p starwire-wire-fuzz --bin fuzz-deframe -- --replay {}",
            p.display()
        );
        return ExitCode::FAILURE;
    }

    let secs = start.elapsed().as_secs_f64().max(1e-9);
    println!(
        "done: {execs} execs in {secs:.1}s = {:.0} execs/s, {frames} frames lent",
        execs as f64 / secs
    );
    println!(
        "  streams ended by kind: {ends:?} | corpus {} ({} outcomes)",
        corpus.len(),
        seen.len()
    );
    ExitCode::SUCCESS
}

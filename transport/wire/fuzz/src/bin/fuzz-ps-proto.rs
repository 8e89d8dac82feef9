//! `fuzz-ps-proto`: a mutation fuzzer for the PS codec and request handlers
//! that runs on the stable toolchain.
//!
//! ```text
//! fuzz-ps-proto [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]
//! ```
//!
//! Starts from valid seeds, mutates a corpus entry per iteration, runs it
//! through a long-lived small shard (rebuilt every 50 000 inputs) under
//! `catch_unwind`, and keeps inputs with a new outcome. A panic (a crash or
//! a failed oracle, see the `ps` module docs) writes the input to
//! `OUT/crash-<seed>-<iter>.bin` (`OUT` defaults to `corpus-out/ps` in this
//! crate) and exits with status 1.
#![deny(unsafe_code)]

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rand::Rng;
use starwire_wire_fuzz::ps::{seeds, Mutator, Outcome, Target};

const MAX_CORPUS: usize = 4096;

fn usage() -> ! {
    eprintln!(
        "usage: fuzz-ps-proto [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]"
    );
    std::process::exit(2)
}

fn main() -> ExitCode {
    let (mut seconds, mut iters, mut seed) = (None, None, 0x5053_u64);
    let mut out = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/ps"));
    let mut replay = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        let num = |s: String| s.parse::<u64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--seconds" => seconds = Some(num(val())),
            "--iters" => iters = Some(num(val())),
            "--seed" => seed = num(val()),
            "--out" => out = PathBuf::from(val()),
            "--replay" => replay = Some(PathBuf::from(val())),
            _ => usage(),
        }
    }
    if let Some(f) = replay {
        let data = std::fs::read(&f).unwrap_or_else(|e| {
            eprintln!("cannot read {}: {e}", f.display());
            std::process::exit(2)
        });
        println!("{:?}", Target::new().run(&data, true));
        return ExitCode::SUCCESS;
    }
    if seconds.is_none() && iters.is_none() {
        seconds = Some(10);
    }

    let mut corpus = seeds::corpus();
    let n_seeds = corpus.len();
    println!("fuzz-ps-proto: seed {seed} | {n_seeds} seeds");
    let mut m = Mutator::new(seed, 1 << 14);
    let mut target = Target::new();
    let mut seen: HashSet<Outcome> = HashSet::new();
    let mut kinds: BTreeMap<&'static str, u64> = BTreeMap::new();
    let (mut execs, mut ok) = (0u64, 0u64);
    let start = Instant::now();
    let deadline = seconds.map(|s| start + Duration::from_secs(s));
    let mut input = Vec::new();
    loop {
        if iters.is_some_and(|n| execs >= n) {
            break;
        }
        if execs % 256 == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        if execs % 50_000 == 0 {
            target = Target::new();
        }
        let pool = if m.rng().gen_bool(0.5) {
            n_seeds
        } else {
            corpus.len()
        };
        let base = m.rng().gen_range(0..pool);
        input.clear();
        input.extend_from_slice(&corpus[base]);
        m.mutate(&mut input, &corpus);
        let check = m.rng().gen_ratio(1, 16);
        let r = catch_unwind(AssertUnwindSafe(|| target.run(&input, check)));
        execs += 1;
        let o = match r {
            Ok(o) => o,
            Err(_) => {
                let _ = std::fs::create_dir_all(&out);
                let p = out.join(format!("crash-{seed}-{execs}.bin"));
                if let Err(e) = std::fs::write(&p, &input) {
                    eprintln!("cannot write {}: {e}", p.display());
                }
                eprintln!(
                    "PANIC on input of {} bytes; saved to {}",
                    input.len(),
                    p.display()
                );
                eprintln!(
                    "replay: cargo run --release -p starwire-wire-fuzz --bin fuzz-ps-proto -- --replay {}",
                    p.display()
                );
                return ExitCode::FAILURE;
            }
        };
        match o {
            Outcome::Ok { .. } => ok += 1,
            Outcome::Err(k) => *kinds.entry(k).or_default() += 1,
        }
        if seen.insert(o) {
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
        "done: {execs} execs in {secs:.1}s = {:.0} execs/s | accepted {ok} | outcomes {}",
        execs as f64 / secs,
        seen.len()
    );
    println!("  errors by kind: {kinds:?}");
    let t = &target.shard;
    println!("  shard: global step {} | {:?}", t.global_step(), t.stats());
    ExitCode::SUCCESS
}

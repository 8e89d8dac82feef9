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
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::{driver, Deframe};

fn main() -> ExitCode {
    driver::main(Deframe::default())
}

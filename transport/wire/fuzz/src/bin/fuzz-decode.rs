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
//! runs the decoder under `catch_unwind` with the default or with small
//! limits, and keeps inputs whose outcome signature is new. On a panic it
//! writes the input to `OUT/crash-<seed>-<iter>.bin` and exits with status 1.
//! `--replay FILE` runs a single input (for example a crash) and exits.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::{driver, Decode};

fn main() -> ExitCode {
    driver::main(Decode::default())
}

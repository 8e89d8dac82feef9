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

use std::process::ExitCode;

use starwire_wire_fuzz::driver;
use starwire_wire_fuzz::ps::Handlers;

fn main() -> ExitCode {
    driver::main(Handlers::default())
}

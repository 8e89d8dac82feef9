//! `fuzz-checkpoint`: a mutation fuzzer for the PS checkpoint readers
//! (shard files and deltas) that runs on the stable toolchain.
//!
//! ```text
//! fuzz-checkpoint [--seconds N | --iters N] [--seed S] [--corpus DIR]
//!                 [--out DIR] [--save-corpus] [--replay FILE]
//! ```
//!
//! Starts from shard files and deltas of a small trained shard, mutates a
//! corpus entry per iteration and writes its CRC again most of the time,
//! then runs the layout parser, the restore and the delta apply under
//! `catch_unwind` with the oracles of the `checkpoint` module docs,
//! counting the largest allocation of each run. A panic or a failed
//! oracle writes the input to `OUT/crash-<seed>-<iter>.bin` (`OUT`
//! defaults to `corpus-out/checkpoint` in this crate) and exits with
//! status 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::checkpoint::Checkpoint;
use starwire_wire_fuzz::driver;
use starwire_wire_fuzz::peak::Counting;

#[global_allocator]
static ALLOC: Counting = Counting;

fn main() -> ExitCode {
    driver::main(Checkpoint::default())
}

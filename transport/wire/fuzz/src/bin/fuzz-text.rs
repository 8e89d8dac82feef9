//! `fuzz-text`: a mutation fuzzer for the text parsers that read what users
//! and peers supply (`starwire_config`: `HostPort`, host lists, the
//! `.endpoint_map`, `TF_CONFIG` and the DeepRec settings variables;
//! `starwire_data`: the Criteo TSV reader, plain and gzip) that runs on the
//! stable toolchain.
//!
//! ```text
//! fuzz-text [--seconds N | --iters N] [--seed S] [--corpus DIR]
//!           [--out DIR] [--max-len N] [--save-corpus] [--replay FILE]
//! ```
//!
//! An input's first byte chooses the parser. It mutates valid inputs of
//! each (separators, boundary numbers, fields and lines, invalid UTF-8),
//! checks that no parser panics or fails outside its typed errors, that
//! what is accepted writes back to text that parses to the same, that the
//! settings and the Criteo reader agree with references written from their
//! documented syntax (gzip or not), and that no allocation outgrows the
//! input, counting each run's largest with its global allocator (see the
//! `text` module docs). A failing input is saved to
//! `OUT/text-<seed>-<iter>.bin` (`OUT` defaults to `corpus-out/text` in
//! this crate) and the driver exits with status 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::driver;
use starwire_wire_fuzz::peak::Counting;
use starwire_wire_fuzz::text::Text;

#[global_allocator]
static ALLOC: Counting = Counting;

fn main() -> ExitCode {
    driver::main(Text::default())
}

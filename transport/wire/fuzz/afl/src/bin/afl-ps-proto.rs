//! AFL++ driver of the `fuzz-ps-proto` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::ps::Handlers;

fn main() {
    starwire_wire_fuzz_afl::run(Handlers::default());
}

//! AFL++ driver of the `fuzz-decode` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::Decode;

fn main() {
    starwire_wire_fuzz_afl::run(Decode::default());
}

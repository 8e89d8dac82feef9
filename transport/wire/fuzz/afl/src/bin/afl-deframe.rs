//! AFL++ driver of the `fuzz-deframe` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::Deframe;

fn main() {
    starwire_wire_fuzz_afl::run(Deframe::default());
}

//! AFL++ driver of the `fuzz-checkpoint` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::checkpoint::Checkpoint;

fn main() {
    starwire_wire_fuzz_afl::run(Checkpoint::default());
}

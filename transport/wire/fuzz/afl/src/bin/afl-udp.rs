//! AFL++ driver of the `fuzz-udp` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::Udp;

fn main() {
    starwire_wire_fuzz_afl::run(Udp::default());
}

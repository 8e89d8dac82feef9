//! AFL++ driver of the `fuzz-datagram` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::datagram::Datagram;

fn main() {
    starwire_wire_fuzz_afl::run(Datagram::default());
}

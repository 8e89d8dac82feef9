//! AFL++ driver of the `fuzz-handshake` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::handshake::Handshake;

fn main() {
    starwire_wire_fuzz_afl::run(Handshake::default());
}

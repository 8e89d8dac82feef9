//! AFL++ driver of the `fuzz-qp-endpoint` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::endpoint::Endpoint;

fn main() {
    starwire_wire_fuzz_afl::run(Endpoint::default());
}

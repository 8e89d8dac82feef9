//! AFL++ driver of the `fuzz-rdma-ring` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::rdma_ring::RdmaRing;

fn main() {
    starwire_wire_fuzz_afl::run(RdmaRing::default());
}

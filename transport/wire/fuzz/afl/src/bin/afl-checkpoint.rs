//! AFL++ driver of the `fuzz-checkpoint` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::checkpoint::Checkpoint;
use starwire_wire_fuzz::peak::Counting;

// The target's allocation bound is measured with it, as in
// `fuzz-checkpoint` and the corpus replay: without it the bound is never
// checked here, and an input the replay refuses could join the corpus.
#[global_allocator]
static ALLOC: Counting = Counting;

fn main() {
    starwire_wire_fuzz_afl::run(Checkpoint::default());
}

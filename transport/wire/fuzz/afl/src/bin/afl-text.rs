//! AFL++ driver of the `fuzz-text` target (see ci/fuzz-afl.sh).
#![deny(unsafe_code)]

use starwire_wire_fuzz::peak::Counting;
use starwire_wire_fuzz::text::Text;

// The target's allocation bound is measured with it, as in `fuzz-text`
// and the corpus replay: without it the bound is never checked here, and
// an input the replay refuses could join the corpus.
#[global_allocator]
static ALLOC: Counting = Counting;

fn main() {
    starwire_wire_fuzz_afl::run(Text::default());
}

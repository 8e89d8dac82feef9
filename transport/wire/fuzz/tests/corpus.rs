//! Every file of the corpus in the repository (`corpus/<target>/`, kept
//! by the AFL++ runs of ci/fuzz-afl.sh) through its target's one-input
//! body, [`Target::check`]: the inputs that reached the most code stay
//! reached in CI, without AFL++.

use std::path::Path;

use starwire_wire_fuzz::checkpoint::Checkpoint;
use starwire_wire_fuzz::datagram::Datagram;
use starwire_wire_fuzz::driver::Target;
use starwire_wire_fuzz::endpoint::Endpoint;
use starwire_wire_fuzz::handshake::Handshake;
use starwire_wire_fuzz::peak::Counting;
use starwire_wire_fuzz::ps::Handlers;
use starwire_wire_fuzz::rdma_ring::RdmaRing;
use starwire_wire_fuzz::text::Text;
use starwire_wire_fuzz::{Decode, Deframe, Udp};

// The checkpoint and text targets' allocation bounds are measured with it
// (their stable and AFL++ drivers install it too, so an input kept by a
// run met the bound the replay checks).
#[global_allocator]
static ALLOC: Counting = Counting;

/// Run every corpus file of `T` (at least one must exist); the count.
fn replay<T: Target>(mut t: T) -> usize {
    let name = T::SPEC.name.trim_start_matches("fuzz-");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: empty corpus", dir.display());
    for f in &files {
        let input = std::fs::read(f).expect("read");
        if let Err(e) = t.check(&input) {
            panic!("{}: {e}", f.display());
        }
    }
    eprintln!("{name}: {} corpus files", files.len());
    files.len()
}

#[test]
fn every_corpus_file_passes_its_target() {
    let n = replay(Decode::default())
        + replay(Deframe::default())
        + replay(Handshake::default())
        + replay(Handlers::default())
        + replay(Udp::default())
        + replay(Endpoint::default())
        + replay(Checkpoint::default())
        + replay(RdmaRing::default())
        + replay(Datagram::default())
        + replay(Text::default());
    eprintln!("{n} corpus files replayed");
}

/// The checkpoint target's allocation oracle sees this binary's
/// allocations: the counting allocator is the one installed.
#[test]
fn allocations_are_counted() {
    starwire_wire_fuzz::peak::reset();
    let v = std::hint::black_box(vec![1u8; 3 << 20]);
    assert!(starwire_wire_fuzz::peak::largest() >= v.len());
    starwire_wire_fuzz::peak::reset();
    assert!(starwire_wire_fuzz::peak::largest() < v.len());
}

//! The conformance suite over drivers of in-memory links.

use starwire_transport::conformance;
use starwire_transport::testing::{FaultSpec, Faulty, MemTransport};

#[test]
fn in_memory_links() {
    conformance::run_all("mem", || MemTransport::pair(4096, 64));
}

#[test]
fn in_memory_links_small_frames_and_tight_capacity() {
    conformance::run_all("mem-small", || MemTransport::pair(256, 2));
}

#[test]
fn many_more_in_memory_links() {
    conformance::run_all_drivers("mem-256", 256, |n| {
        conformance::link_pairs(n, || MemTransport::pair(1024, 8))
    });
}

#[test]
fn fault_wrapper_with_no_faults_is_transparent() {
    conformance::run_all("faulty-0", || {
        let (a, b) = MemTransport::pair(4096, 64);
        let spec = FaultSpec::default();
        (Faulty::new(a, spec), Faulty::new(b, spec))
    });
}

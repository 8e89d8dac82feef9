//! Shared helpers for starwire benchmarks.
#![deny(unsafe_code)]

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Pins the calling thread to CPU `core`.
///
/// Returns an error if the core does not exist or is outside the allowed
/// CPU set (benchmarks then simply run unpinned).
pub fn pin_current_thread(core: usize) -> nix::Result<()> {
    let mut set = CpuSet::new();
    set.set(core)?;
    // Pid 0 means the calling thread.
    sched_setaffinity(Pid::from_raw(0), &set)
}

//! Pinning the calling thread (`sched_setaffinity` on thread id 0).

use nix::sched::{sched_getaffinity, sched_getcpu, sched_setaffinity};
use nix::unistd::Pid;

use crate::cpuset::{CpuId, CpuSet};
use crate::error::PlacementError;

/// `Pid` 0 means "the calling thread" for the affinity syscalls.
fn this_thread() -> Pid {
    Pid::from_raw(0)
}

/// Pins the calling thread to `cpu`.
///
/// # Errors
/// - [`PlacementError::CpuOutOfRange`] if `cpu` cannot be put in an affinity
///   mask (`>= CPU_SETSIZE`).
/// - [`PlacementError::SetAffinity`] if the kernel refuses (typically
///   `EINVAL`: the CPU is offline or outside the cgroup's cpuset).
pub fn pin_current_thread(cpu: CpuId) -> Result<(), PlacementError> {
    set_current_thread_affinity(&std::iter::once(cpu).collect())
}

/// Pins the calling thread to `cpu` after checking that `cpu` is in `usable`
/// (e.g. [`CpuSet::process_affinity`]).
///
/// # Errors
/// [`PlacementError::CpuNotUsable`] if `cpu` is not in `usable`, otherwise as
/// [`pin_current_thread`].
pub fn pin_current_thread_within(cpu: CpuId, usable: &CpuSet) -> Result<(), PlacementError> {
    if !usable.contains(cpu) {
        return Err(PlacementError::CpuNotUsable {
            cpu,
            usable: usable.clone(),
        });
    }
    pin_current_thread(cpu)
}

/// Sets the calling thread's affinity to `cpus` (e.g. to undo a pin by
/// restoring [`CpuSet::process_affinity`]).
///
/// # Errors
/// [`PlacementError::EmptyAffinity`] for an empty set, otherwise as
/// [`pin_current_thread`].
pub fn set_current_thread_affinity(cpus: &CpuSet) -> Result<(), PlacementError> {
    if cpus.is_empty() {
        return Err(PlacementError::EmptyAffinity);
    }
    let mask = cpus.to_nix()?;
    sched_setaffinity(this_thread(), &mask).map_err(|source| PlacementError::SetAffinity {
        cpus: cpus.clone(),
        source,
    })
}

/// The calling thread's affinity mask.
///
/// # Errors
/// [`PlacementError::GetAffinity`] if the syscall fails.
pub fn current_thread_affinity() -> Result<CpuSet, PlacementError> {
    sched_getaffinity(this_thread())
        .map(|mask| CpuSet::from_nix(&mask))
        .map_err(|source| PlacementError::GetAffinity { source })
}

/// The CPU the calling thread is running on right now (`sched_getcpu`).
/// Only stable if the thread is pinned to a single CPU.
///
/// # Errors
/// [`PlacementError::GetCpu`] if the syscall fails.
pub fn current_cpu() -> Result<CpuId, PlacementError> {
    sched_getcpu().map_err(|source| PlacementError::GetCpu { source })
}

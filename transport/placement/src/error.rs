//! [`PlacementError`].

use std::path::PathBuf;

use crate::cpuset::{CpuId, CpuListError, CpuSet};

/// Everything that can fail in this crate.
///
/// One variant per failing call; variants wrapping a lower-level failure keep
/// it as [`std::error::Error::source`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// `sched_getaffinity` failed.
    #[error("sched_getaffinity failed")]
    GetAffinity {
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// `sched_setaffinity` failed (e.g. `EINVAL`: the CPU is offline or
    /// outside the cgroup cpuset).
    #[error("sched_setaffinity to cpus {cpus} failed")]
    SetAffinity {
        /// The mask that was requested.
        cpus: CpuSet,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// `sched_getcpu` failed.
    #[error("sched_getcpu failed")]
    GetCpu {
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// A CPU id cannot be represented in the kernel affinity mask
    /// (`>= CPU_SETSIZE`, see [`CpuSet::affinity_capacity`]).
    #[error("cpu {cpu} cannot be put in an affinity mask (capacity {capacity} cpus)")]
    CpuOutOfRange {
        /// The offending CPU.
        cpu: CpuId,
        /// `CPU_SETSIZE`.
        capacity: usize,
    },
    /// A CPU was asked for that is not in the usable set (the process
    /// affinity, or the set given to [`pin_current_thread_within`]).
    ///
    /// [`pin_current_thread_within`]: crate::pin_current_thread_within
    #[error("cpu {cpu} is not in the usable cpu set {{{usable}}}")]
    CpuNotUsable {
        /// The offending CPU.
        cpu: CpuId,
        /// The usable set it was checked against.
        usable: CpuSet,
    },
    /// An empty affinity mask was requested.
    #[error("cannot set an empty cpu affinity")]
    EmptyAffinity,
    /// [`plan`](crate::plan) was asked for zero reactors.
    #[error("cannot plan placement for zero reactors")]
    NoReactors,
    /// [`plan`](crate::plan) was given an empty usable cpu set.
    #[error("the usable cpu set is empty")]
    NoUsableCpus,
    /// [`Placement::Fixed`](crate::Placement::Fixed) with an empty list.
    #[error("fixed placement has an empty cpu list")]
    EmptyCpuList,
    /// [`Placement::Fixed`](crate::Placement::Fixed) names a CPU twice.
    #[error("fixed placement lists cpu {cpu} more than once")]
    DuplicateCpu {
        /// The repeated CPU.
        cpu: CpuId,
    },
    /// A placement string (`FromStr for Placement`) has an unknown mode.
    #[error(
        "invalid placement {input:?} (expected unpinned, max-spread, max-pack, \
         fixed:<cpulist> or near:<device>)"
    )]
    InvalidPlacement {
        /// The rejected text.
        input: String,
    },
    /// The cpulist of a `fixed:<cpulist>` placement string did not parse.
    #[error("invalid cpu list in placement {input:?}")]
    PlacementCpuList {
        /// The rejected text.
        input: String,
        /// The cpulist error.
        #[source]
        source: CpuListError,
    },
    /// Reading a sysfs file or directory failed.
    #[error("reading {}", path.display())]
    ReadSysfs {
        /// File or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A sysfs `cpulist` / `local_cpulist` file did not parse.
    #[error("parsing cpulist file {}", path.display())]
    ParseSysfsCpuList {
        /// The file.
        path: PathBuf,
        /// The cpulist error.
        #[source]
        source: CpuListError,
    },
    /// A sysfs `numa_node` file did not parse.
    #[error("parsing numa_node file {}", path.display())]
    ParseSysfsNumaNode {
        /// The file.
        path: PathBuf,
        /// The integer error.
        #[source]
        source: std::num::ParseIntError,
    },
    /// hwloc rejected the I/O type filter (`hwloc_topology_set_io_types_filter`).
    #[cfg(feature = "hwloc")]
    #[error("hwloc: setting the I/O type filter failed")]
    HwlocIoFilter {
        /// The hwloc error.
        #[source]
        source: hwlocality::errors::HybridError<hwlocality::topology::builder::TypeFilterError>,
    },
    /// hwloc rejected an XML topology string (`hwloc_topology_set_xmlbuffer`).
    #[cfg(feature = "hwloc")]
    #[error("hwloc: loading the XML topology failed")]
    HwlocXml {
        /// The hwloc error.
        #[source]
        source: hwlocality::topology::builder::StringInputError,
    },
    /// hwloc accepted an XML topology string but could not load it
    /// (`hwloc_topology_load`). Which of the two steps rejects bad XML
    /// depends on the XML backend hwloc was built with: libxml2 parses when
    /// the buffer is set, hwloc's own minimal parser when it is loaded.
    #[cfg(feature = "hwloc")]
    #[error("hwloc: the XML topology is invalid")]
    HwlocXmlLoad {
        /// The hwloc error.
        #[source]
        source: hwlocality::errors::RawHwlocError,
    },
    /// Reading an hwloc XML topology file failed.
    #[cfg(feature = "hwloc")]
    #[error("reading hwloc XML topology file {}", path.display())]
    ReadHwlocXml {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// hwloc failed to build the topology (`hwloc_topology_load`).
    #[cfg(feature = "hwloc")]
    #[error("hwloc: building the topology failed")]
    HwlocBuild {
        /// The hwloc error.
        #[source]
        source: hwlocality::errors::RawHwlocError,
    },
}

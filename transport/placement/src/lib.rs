//! Placement of starwire reactors on CPU cores, as plain data.
//!
//! starwire runs one shared-nothing reactor per core. This crate decides
//! *which* core each reactor gets, and pins the reactor thread there:
//!
//! 1. Get the usable CPUs: [`CpuSet::process_affinity`] (respects `taskset`,
//!    `numactl`, container cpusets).
//! 2. Get the machine layout: [`Topology::detect`] (hwloc with the `hwloc`
//!    feature, sysfs otherwise).
//! 3. [`plan`] a [`Placement`] for `n` reactors in a [`ReactorMode`]: you get
//!    a [`Plan`] with one [`ReactorPlacement`] per reactor (`Option` CPU),
//!    whether the CPUs are oversubscribed, and [`PlanWarning`]s to show the
//!    operator (also logged with `tracing::warn!`).
//! 4. On each reactor thread, [`ReactorPlacement::apply_to_current_thread`]
//!    (or [`pin_current_thread`]).
//!
//! ```
//! use starwire_placement::{plan, CpuSet, Placement, ReactorMode, Topology};
//!
//! let usable: CpuSet = "0-7".parse()?;
//! let topology = Topology::default(); // or Topology::detect()?
//! let plan = plan(&Placement::MaxPack, 10, ReactorMode::Polling, &usable, &topology)?;
//! // Busy-polling reactors need a core each: 10 were clamped to 8.
//! assert_eq!(plan.reactors.len(), 8);
//! assert!(plan.clamped() && !plan.oversubscribed);
//! for warning in &plan.warnings {
//!     eprintln!("warning: {warning}");
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Clamping and oversubscription
//!
//! With `n` reactors requested and `c` usable CPUs (for
//! [`Placement::Fixed`], the length of its list):
//!
//! - `n <= c`: every reactor has a CPU of its own.
//! - `n > c` and [`ReactorMode::Polling`]: the plan is **clamped** to `c`
//!   reactors, one per CPU, with [`PlanWarning::ReactorsClamped`]; start only
//!   `plan.reactors.len()` reactors. Two spinning reactors on one core would
//!   just steal each other's time slices.
//! - `n > c` and [`ReactorMode::PollThenPark`]: all `n` reactors are kept,
//!   reactor `i` on the `(i mod c)`-th CPU; [`Plan::oversubscribed`] is set
//!   (with [`PlanWarning::Oversubscribed`]) so the runtime makes reactors
//!   park when idle instead of spinning.
//!
//! # Features
//!
//! - `hwloc`: [`Topology::detect`] uses hwloc (via `hwlocality`; needs the
//!   system hwloc library, Debian packages `libhwloc-dev libudev-dev
//!   pkg-config`), which sees NUMA nodes and PCI/OS devices even where sysfs
//!   lacks them, and adds `Topology::from_hwloc`, `Topology::from_hwloc_xml`,
//!   `Topology::from_hwloc_xml_file` and `Topology::detect_hwloc`. Without
//!   it, [`sysfs`] is read directly.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod cpuset;
mod error;
#[cfg(feature = "hwloc")]
mod hwloc;
mod pin;
mod placement;
pub mod sysfs;
mod topology;

pub use cpuset::{parse_cpulist_ordered, CpuId, CpuListError, CpuSet, MAX_CPUS};
pub use error::PlacementError;
pub use pin::{
    current_cpu, current_thread_affinity, pin_current_thread, pin_current_thread_within,
    set_current_thread_affinity,
};
pub use placement::{plan, Placement, Plan, PlanWarning, ReactorMode, ReactorPlacement};
pub use topology::{Device, NumaNode, Topology};

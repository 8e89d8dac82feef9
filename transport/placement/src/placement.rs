//! [`Placement`] modes and the [`plan`] function turning one into a [`Plan`].

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use crate::cpuset::{parse_cpulist_ordered, write_ranges, CpuId, CpuSet};
use crate::error::PlacementError;
use crate::pin::pin_current_thread;
use crate::topology::Topology;

/// How reactors are placed on CPUs.
///
/// Every mode first restricts itself to the *usable* CPUs handed to [`plan`]
/// (normally [`CpuSet::process_affinity`]), then orders them; reactor `i`
/// takes the `i`-th CPU of that order. See the crate docs and
/// `docs/PLACEMENT.md` for clamping and oversubscription.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Placement {
    /// Do not pin: reactor threads float over the usable CPUs and the kernel
    /// schedules them. DeepRec's `*_DISABLE_PIN_CORES` variables map here.
    /// Reactor counts are still checked against the number of usable CPUs.
    Unpinned,
    /// Reactor `i` is pinned to `cpus[i]`, in the given order. Every CPU must
    /// be usable and appear once. Text form: `fixed:4-7,0` (order kept).
    Fixed(Vec<CpuId>),
    /// Spread reactors across NUMA nodes: round-robin over nodes, lowest free
    /// CPU of each node in turn (node 0 cpu, node 1 cpu, node 0 cpu, ...).
    /// Maximises aggregate memory bandwidth and cache.
    MaxSpread,
    /// Pack reactors: fill the usable CPUs of node 0 in ascending order, then
    /// node 1, ... Keeps reactors sharing memory and last-level caches.
    MaxPack,
    /// Put reactors next to a NIC: CPUs local to the device first (ascending),
    /// then the rest of its NUMA node, then the other nodes in
    /// [`Placement::MaxPack`] order. Falls back to `MaxPack`, with a warning,
    /// when the device or its locality is unknown or none of its CPUs is
    /// usable.
    NearDevice {
        /// Interface name, e.g. `eth1`.
        device: String,
    },
}

impl fmt::Display for Placement {
    /// The text form accepted by `FromStr`: `unpinned`, `max-spread`,
    /// `max-pack`, `fixed:<cpulist>`, `near:<device>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Unpinned => f.write_str("unpinned"),
            Placement::Fixed(cpus) => {
                f.write_str("fixed:")?;
                write_ranges(f, cpus.iter().copied())
            }
            Placement::MaxSpread => f.write_str("max-spread"),
            Placement::MaxPack => f.write_str("max-pack"),
            Placement::NearDevice { device } => write!(f, "near:{device}"),
        }
    }
}

impl FromStr for Placement {
    type Err = PlacementError;

    /// Parses `unpinned` (or `none`), `max-spread` (`maxspread`, `spread`),
    /// `max-pack` (`maxpack`, `pack`), `fixed:<cpulist>` (or
    /// `list:<cpulist>`; order kept) and `near:<device>` (or
    /// `near-device:<device>`). Mode names are case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let input = s.trim();
        let invalid = || PlacementError::InvalidPlacement {
            input: s.to_owned(),
        };
        let (mode, arg) = match input.split_once(':') {
            Some((mode, arg)) => (mode.trim().to_ascii_lowercase(), Some(arg.trim())),
            None => (input.to_ascii_lowercase(), None),
        };
        match (mode.as_str(), arg) {
            ("unpinned" | "none", None) => Ok(Placement::Unpinned),
            ("max-spread" | "maxspread" | "spread", None) => Ok(Placement::MaxSpread),
            ("max-pack" | "maxpack" | "pack", None) => Ok(Placement::MaxPack),
            ("fixed" | "list", Some(list)) => parse_cpulist_ordered(list)
                .map(Placement::Fixed)
                .map_err(|source| PlacementError::PlacementCpuList {
                    input: s.to_owned(),
                    source,
                }),
            ("near" | "near-device", Some(device)) if !device.is_empty() => {
                Ok(Placement::NearDevice {
                    device: device.to_owned(),
                })
            }
            _ => Err(invalid()),
        }
    }
}

/// Whether reactors busy-poll, which decides what happens when there are
/// more reactors than usable CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReactorMode {
    /// Reactors spin on their queues and never sleep: each needs a core of
    /// its own. More reactors than usable CPUs are **clamped**: the plan has
    /// one reactor per usable CPU and a [`PlanWarning::ReactorsClamped`].
    Polling,
    /// Reactors poll, then park (sleep on an eventfd/futex) when idle, so
    /// several can share a core. More reactors than usable CPUs are kept; they
    /// wrap around the CPU order and the plan is marked
    /// [`Plan::oversubscribed`].
    PollThenPark,
}

/// Where one reactor goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReactorPlacement {
    /// Reactor index, `0..plan.reactors.len()`.
    pub reactor: usize,
    /// CPU to pin the reactor thread to; `None` for [`Placement::Unpinned`].
    pub cpu: Option<CpuId>,
    /// NUMA node of `cpu`, if the topology knows it.
    pub numa_node: Option<usize>,
}

impl ReactorPlacement {
    /// Applies this placement to the calling thread: pins it to `cpu`, or
    /// does nothing when unpinned. Call it first thing on the reactor thread.
    ///
    /// # Errors
    /// See [`pin_current_thread`].
    pub fn apply_to_current_thread(&self) -> Result<(), PlacementError> {
        match self.cpu {
            Some(cpu) => pin_current_thread(cpu),
            None => Ok(()),
        }
    }
}

/// Something the caller should know about a plan; also logged with
/// `tracing::warn!` by [`plan`]. `Display` gives a one-line message for CLIs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PlanWarning {
    /// [`ReactorMode::Polling`] with more reactors than usable CPUs: the
    /// reactor count was reduced to `cpus`.
    ReactorsClamped {
        /// Reactors asked for.
        requested: usize,
        /// Usable CPUs = reactors in the plan.
        cpus: usize,
    },
    /// [`ReactorMode::PollThenPark`] with more reactors than usable CPUs:
    /// reactors share CPUs and must park when idle.
    Oversubscribed {
        /// Reactors in the plan.
        reactors: usize,
        /// Usable CPUs they share.
        cpus: usize,
    },
    /// [`Placement::NearDevice`] names a device the topology does not have.
    DeviceNotFound {
        /// The device.
        device: String,
    },
    /// The device exists but its NUMA node / local CPUs are unknown.
    DeviceLocalityUnknown {
        /// The device.
        device: String,
    },
    /// None of the CPUs local to the device is usable.
    DeviceCpusNotUsable {
        /// The device.
        device: String,
        /// Its local CPUs.
        local_cpus: CpuSet,
    },
}

impl fmt::Display for PlanWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanWarning::ReactorsClamped { requested, cpus } => write!(
                f,
                "{requested} polling reactors requested but only {cpus} usable cpus: \
                 clamped to {cpus} reactors"
            ),
            PlanWarning::Oversubscribed { reactors, cpus } => write!(
                f,
                "{reactors} reactors share {cpus} usable cpus: reactors will poll, then park"
            ),
            PlanWarning::DeviceNotFound { device } => write!(
                f,
                "device {device:?} not found in the topology: using max-pack order"
            ),
            PlanWarning::DeviceLocalityUnknown { device } => write!(
                f,
                "NUMA locality of device {device:?} is unknown: using max-pack order"
            ),
            PlanWarning::DeviceCpusNotUsable { device, local_cpus } => write!(
                f,
                "none of the cpus local to device {device:?} ({local_cpus}) is usable: \
                 using max-pack order"
            ),
        }
    }
}

/// The outcome of [`plan`]: one entry per reactor to start.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Plan {
    /// One entry per reactor to start, indexed by reactor. May be shorter
    /// than `requested` (clamping).
    pub reactors: Vec<ReactorPlacement>,
    /// Reactor count asked for.
    pub requested: usize,
    /// More reactors than usable CPUs share them; they must poll, then park
    /// when idle instead of spinning. Only ever set with
    /// [`ReactorMode::PollThenPark`].
    pub oversubscribed: bool,
    /// Everything worth telling the operator (already logged via `tracing`).
    pub warnings: Vec<PlanWarning>,
}

impl Plan {
    /// Whether the reactor count was reduced below `requested`.
    pub fn clamped(&self) -> bool {
        self.reactors.len() < self.requested
    }

    /// The CPU of each reactor, in reactor order.
    pub fn cpus(&self) -> Vec<Option<CpuId>> {
        self.reactors.iter().map(|r| r.cpu).collect()
    }
}

/// Turns a placement into a plan for `reactors` reactors.
///
/// - `usable`: CPUs the reactors may use, normally
///   [`CpuSet::process_affinity`]. CPUs outside it are never assigned.
/// - `topology`: NUMA nodes and devices ([`Topology::detect`]); may be empty.
///
/// Order of CPUs per mode: see [`Placement`]. Then, with `n` requested
/// reactors and `c` usable CPUs in the order (for `Fixed`, the list length):
///
/// - `n <= c`: reactor `i` gets the `i`-th CPU; no CPU is shared.
/// - `n > c`, [`ReactorMode::Polling`]: **clamped** to `c` reactors (one per
///   CPU), with [`PlanWarning::ReactorsClamped`].
/// - `n > c`, [`ReactorMode::PollThenPark`]: all `n` reactors, reactor `i` on
///   CPU `i mod c`; [`Plan::oversubscribed`] is set, with
///   [`PlanWarning::Oversubscribed`].
///
/// `Unpinned` follows the same count rules (with `c` = usable CPUs) but every
/// entry has `cpu: None`.
///
/// Warnings are also emitted with `tracing::warn!`.
///
/// # Errors
/// - [`PlacementError::NoReactors`] if `reactors == 0`.
/// - [`PlacementError::NoUsableCpus`] if `usable` is empty.
/// - For `Fixed`: [`PlacementError::EmptyCpuList`],
///   [`PlacementError::DuplicateCpu`], or [`PlacementError::CpuNotUsable`]
///   for a CPU outside `usable`.
pub fn plan(
    placement: &Placement,
    reactors: usize,
    mode: ReactorMode,
    usable: &CpuSet,
    topology: &Topology,
) -> Result<Plan, PlacementError> {
    if reactors == 0 {
        return Err(PlacementError::NoReactors);
    }
    if usable.is_empty() {
        return Err(PlacementError::NoUsableCpus);
    }
    let mut warnings = Vec::new();
    let order = cpu_order(placement, usable, topology, &mut warnings)?;
    let pinned = !matches!(placement, Placement::Unpinned);
    let cpus = order.len();

    let count = match mode {
        ReactorMode::Polling if reactors > cpus => {
            warnings.push(PlanWarning::ReactorsClamped {
                requested: reactors,
                cpus,
            });
            cpus
        }
        _ => reactors,
    };
    let oversubscribed = count > cpus;
    if oversubscribed {
        warnings.push(PlanWarning::Oversubscribed {
            reactors: count,
            cpus,
        });
    }

    let entries = (0..count)
        .map(|reactor| {
            let cpu = pinned.then(|| order[reactor % cpus]);
            ReactorPlacement {
                reactor,
                cpu,
                numa_node: cpu.and_then(|cpu| topology.node_of_cpu(cpu)),
            }
        })
        .collect();

    for warning in &warnings {
        tracing::warn!(%placement, "{warning}");
    }
    Ok(Plan {
        reactors: entries,
        requested: reactors,
        oversubscribed,
        warnings,
    })
}

/// Usable CPUs in the order reactors take them.
fn cpu_order(
    placement: &Placement,
    usable: &CpuSet,
    topology: &Topology,
    warnings: &mut Vec<PlanWarning>,
) -> Result<Vec<CpuId>, PlacementError> {
    Ok(match placement {
        Placement::Unpinned => usable.iter().collect(),
        Placement::Fixed(cpus) => {
            if cpus.is_empty() {
                return Err(PlacementError::EmptyCpuList);
            }
            let mut seen = BTreeSet::new();
            for &cpu in cpus {
                if !usable.contains(cpu) {
                    return Err(PlacementError::CpuNotUsable {
                        cpu,
                        usable: usable.clone(),
                    });
                }
                if !seen.insert(cpu) {
                    return Err(PlacementError::DuplicateCpu { cpu });
                }
            }
            cpus.clone()
        }
        Placement::MaxPack => usable_by_node(usable, topology).concat(),
        Placement::MaxSpread => round_robin(usable_by_node(usable, topology)),
        Placement::NearDevice { device } => near_device(device, usable, topology, warnings),
    })
}

/// Usable CPUs grouped by NUMA node (nodes in id order, CPUs ascending);
/// usable CPUs the topology does not place in any node form a last group.
fn usable_by_node(usable: &CpuSet, topology: &Topology) -> Vec<Vec<CpuId>> {
    let mut nodes: Vec<&crate::topology::NumaNode> = topology.numa_nodes.iter().collect();
    nodes.sort_by_key(|node| node.id);
    let mut placed = CpuSet::new();
    let mut groups = Vec::new();
    for node in nodes {
        let cpus: Vec<CpuId> = node
            .cpus
            .intersection(usable)
            .difference(&placed)
            .iter()
            .collect();
        placed.extend(cpus.iter().copied());
        if !cpus.is_empty() {
            groups.push(cpus);
        }
    }
    let rest: Vec<CpuId> = usable.difference(&placed).iter().collect();
    if !rest.is_empty() {
        groups.push(rest);
    }
    groups
}

fn round_robin(groups: Vec<Vec<CpuId>>) -> Vec<CpuId> {
    let longest = groups.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|i| groups.iter().filter_map(move |g| g.get(i).copied()))
        .collect()
}

fn near_device(
    device: &str,
    usable: &CpuSet,
    topology: &Topology,
    warnings: &mut Vec<PlanWarning>,
) -> Vec<CpuId> {
    let pack = usable_by_node(usable, topology).concat();
    let Some(dev) = topology.device(device) else {
        warnings.push(PlanWarning::DeviceNotFound {
            device: device.to_owned(),
        });
        return pack;
    };
    let node_cpus = dev
        .numa_node
        .and_then(|id| topology.node(id))
        .map(|node| node.cpus.clone())
        .unwrap_or_default();
    let local = if dev.local_cpus.is_empty() {
        node_cpus.clone()
    } else {
        dev.local_cpus.clone()
    };
    if local.is_empty() {
        warnings.push(PlanWarning::DeviceLocalityUnknown {
            device: device.to_owned(),
        });
        return pack;
    }
    let near = local.intersection(usable);
    if near.is_empty() {
        warnings.push(PlanWarning::DeviceCpusNotUsable {
            device: device.to_owned(),
            local_cpus: local,
        });
        return pack;
    }
    // Tier 1: device-local CPUs; tier 2: the rest of its node; tier 3: others.
    let same_node = node_cpus.intersection(usable).difference(&near);
    let mut order: Vec<CpuId> = near.iter().chain(same_node.iter()).collect();
    order.extend(
        pack.into_iter()
            .filter(|&cpu| !near.contains(cpu) && !same_node.contains(cpu)),
    );
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Device, NumaNode};

    fn set(text: &str) -> CpuSet {
        text.parse().unwrap()
    }

    /// Two nodes of four CPUs; eth1 on node 1 (local cpus unknown, so the
    /// node's cpus are used), eth2 local to 6-7 only, lo without locality.
    fn two_nodes() -> Topology {
        Topology {
            numa_nodes: vec![
                NumaNode {
                    id: 0,
                    cpus: set("0-3"),
                },
                NumaNode {
                    id: 1,
                    cpus: set("4-7"),
                },
            ],
            devices: vec![
                Device {
                    name: "eth1".into(),
                    numa_node: Some(1),
                    local_cpus: CpuSet::new(),
                },
                Device {
                    name: "eth2".into(),
                    numa_node: Some(1),
                    local_cpus: set("6-7"),
                },
                Device {
                    name: "lo".into(),
                    numa_node: None,
                    local_cpus: CpuSet::new(),
                },
            ],
        }
    }

    fn cpus_of(plan: &Plan) -> Vec<CpuId> {
        plan.cpus().into_iter().map(Option::unwrap).collect()
    }

    #[test]
    fn max_pack_fills_node_zero_first() {
        let p = plan(
            &Placement::MaxPack,
            5,
            ReactorMode::Polling,
            &set("0-7"),
            &two_nodes(),
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![0, 1, 2, 3, 4]);
        assert_eq!(
            p.reactors.iter().map(|r| r.numa_node).collect::<Vec<_>>(),
            vec![Some(0), Some(0), Some(0), Some(0), Some(1)]
        );
        assert!(p.warnings.is_empty());
        assert!(!p.oversubscribed && !p.clamped());
    }

    #[test]
    fn max_spread_alternates_nodes() {
        let p = plan(
            &Placement::MaxSpread,
            5,
            ReactorMode::Polling,
            &set("0-7"),
            &two_nodes(),
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![0, 4, 1, 5, 2]);
        // Uneven usable sets: node 0 only has cpu 3 usable.
        let p = plan(
            &Placement::MaxSpread,
            4,
            ReactorMode::Polling,
            &set("3-6"),
            &two_nodes(),
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![3, 4, 5, 6]);
    }

    #[test]
    fn empty_topology_is_one_group() {
        let t = Topology::default();
        let p = plan(
            &Placement::MaxSpread,
            3,
            ReactorMode::Polling,
            &set("2,5,9"),
            &t,
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![2, 5, 9]);
        assert_eq!(p.reactors[0].numa_node, None);
    }

    #[test]
    fn near_device_puts_its_node_first() {
        let dev = Placement::NearDevice {
            device: "eth1".into(),
        };
        let p = plan(&dev, 6, ReactorMode::Polling, &set("0-7"), &two_nodes()).unwrap();
        assert_eq!(cpus_of(&p), vec![4, 5, 6, 7, 0, 1]);
        assert!(p.warnings.is_empty());
    }

    #[test]
    fn near_device_local_cpus_then_node_then_rest() {
        let dev = Placement::NearDevice {
            device: "eth2".into(),
        };
        let p = plan(&dev, 8, ReactorMode::Polling, &set("0-7"), &two_nodes()).unwrap();
        assert_eq!(cpus_of(&p), vec![6, 7, 4, 5, 0, 1, 2, 3]);
    }

    #[test]
    fn near_device_fallbacks_warn() {
        let t = two_nodes();
        let usable = set("0-7");
        let run = |device: &str, usable: &CpuSet| {
            plan(
                &Placement::NearDevice {
                    device: device.into(),
                },
                2,
                ReactorMode::Polling,
                usable,
                &t,
            )
            .unwrap()
        };
        let p = run("eth9", &usable);
        assert_eq!(cpus_of(&p), vec![0, 1]);
        assert_eq!(
            p.warnings,
            vec![PlanWarning::DeviceNotFound {
                device: "eth9".into()
            }]
        );
        let p = run("lo", &usable);
        assert_eq!(
            p.warnings,
            vec![PlanWarning::DeviceLocalityUnknown {
                device: "lo".into()
            }]
        );
        let p = run("eth1", &set("0-3"));
        assert_eq!(cpus_of(&p), vec![0, 1]);
        assert!(matches!(
            p.warnings.as_slice(),
            [PlanWarning::DeviceCpusNotUsable { local_cpus, .. }] if *local_cpus == set("4-7")
        ));
    }

    #[test]
    fn polling_reactors_are_clamped() {
        let p = plan(
            &Placement::MaxPack,
            6,
            ReactorMode::Polling,
            &set("0-3"),
            &two_nodes(),
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![0, 1, 2, 3]);
        assert_eq!(p.requested, 6);
        assert!(p.clamped());
        assert!(!p.oversubscribed);
        assert_eq!(
            p.warnings,
            vec![PlanWarning::ReactorsClamped {
                requested: 6,
                cpus: 4
            }]
        );
        assert!(p.warnings[0].to_string().contains("clamped to 4"));
    }

    #[test]
    fn parking_reactors_share_cpus() {
        let p = plan(
            &Placement::MaxPack,
            5,
            ReactorMode::PollThenPark,
            &set("0-1"),
            &two_nodes(),
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![0, 1, 0, 1, 0]);
        assert!(p.oversubscribed);
        assert!(!p.clamped());
        assert_eq!(
            p.warnings,
            vec![PlanWarning::Oversubscribed {
                reactors: 5,
                cpus: 2
            }]
        );
        // Not oversubscribed when it fits.
        let p = plan(
            &Placement::MaxPack,
            2,
            ReactorMode::PollThenPark,
            &set("0-1"),
            &two_nodes(),
        )
        .unwrap();
        assert!(!p.oversubscribed);
        assert!(p.warnings.is_empty());
    }

    #[test]
    fn unpinned_has_no_cpus_but_same_count_rules() {
        let t = two_nodes();
        let p = plan(
            &Placement::Unpinned,
            3,
            ReactorMode::Polling,
            &set("0-1"),
            &t,
        )
        .unwrap();
        assert_eq!(p.cpus(), vec![None, None]);
        assert!(p.clamped());
        let p = plan(
            &Placement::Unpinned,
            3,
            ReactorMode::PollThenPark,
            &set("0-1"),
            &t,
        )
        .unwrap();
        assert_eq!(p.cpus(), vec![None, None, None]);
        assert!(p.oversubscribed);
        assert_eq!(p.reactors[2].reactor, 2);
    }

    #[test]
    fn fixed_keeps_order_and_validates() {
        let t = two_nodes();
        let usable = set("0-7");
        let p = plan(
            &Placement::Fixed(vec![5, 1, 3]),
            3,
            ReactorMode::Polling,
            &usable,
            &t,
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![5, 1, 3]);
        let p = plan(
            &Placement::Fixed(vec![5, 1]),
            3,
            ReactorMode::Polling,
            &usable,
            &t,
        )
        .unwrap();
        assert_eq!(cpus_of(&p), vec![5, 1]);
        assert!(p.clamped());
        assert!(matches!(
            plan(
                &Placement::Fixed(vec![1, 9]),
                2,
                ReactorMode::Polling,
                &usable,
                &t
            ),
            Err(PlacementError::CpuNotUsable { cpu: 9, .. })
        ));
        assert!(matches!(
            plan(
                &Placement::Fixed(vec![1, 1]),
                2,
                ReactorMode::Polling,
                &usable,
                &t
            ),
            Err(PlacementError::DuplicateCpu { cpu: 1 })
        ));
        assert!(matches!(
            plan(
                &Placement::Fixed(vec![]),
                2,
                ReactorMode::Polling,
                &usable,
                &t
            ),
            Err(PlacementError::EmptyCpuList)
        ));
    }

    #[test]
    fn rejects_degenerate_inputs() {
        let t = two_nodes();
        assert!(matches!(
            plan(&Placement::MaxPack, 0, ReactorMode::Polling, &set("0"), &t),
            Err(PlacementError::NoReactors)
        ));
        assert!(matches!(
            plan(
                &Placement::Unpinned,
                1,
                ReactorMode::Polling,
                &CpuSet::new(),
                &t
            ),
            Err(PlacementError::NoUsableCpus)
        ));
    }

    #[test]
    fn placement_text_round_trips() {
        for (text, placement) in [
            ("unpinned", Placement::Unpinned),
            ("max-spread", Placement::MaxSpread),
            ("max-pack", Placement::MaxPack),
            ("fixed:4-7,0", Placement::Fixed(vec![4, 5, 6, 7, 0])),
            (
                "near:eth1",
                Placement::NearDevice {
                    device: "eth1".into(),
                },
            ),
        ] {
            assert_eq!(text.parse::<Placement>().unwrap(), placement);
            assert_eq!(placement.to_string(), text);
        }
        assert_eq!("Spread".parse::<Placement>().unwrap(), Placement::MaxSpread);
        assert_eq!(
            " list: 3,1 ".parse::<Placement>().unwrap(),
            Placement::Fixed(vec![3, 1])
        );
        assert!(matches!(
            "bogus".parse::<Placement>(),
            Err(PlacementError::InvalidPlacement { .. })
        ));
        assert!(matches!(
            "near:".parse::<Placement>(),
            Err(PlacementError::InvalidPlacement { .. })
        ));
        assert!(matches!(
            "unpinned:3".parse::<Placement>(),
            Err(PlacementError::InvalidPlacement { .. })
        ));
        assert!(matches!(
            "fixed:3-1".parse::<Placement>(),
            Err(PlacementError::PlacementCpuList { .. })
        ));
    }
}

//! [`Topology`]: NUMA nodes and device locality, as plain data.

use crate::cpuset::{CpuId, CpuSet};
use crate::error::PlacementError;

/// One NUMA node and the CPUs attached to it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NumaNode {
    /// OS index of the node (`N` in `/sys/devices/system/node/nodeN`).
    pub id: usize,
    /// CPUs local to the node. Empty for memory-only nodes (CXL, HBM).
    pub cpus: CpuSet,
}

/// An I/O device (NIC) and where it sits.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Device {
    /// OS name, e.g. `eth1` (or an RDMA device name like `mlx5_0` from hwloc).
    pub name: String,
    /// NUMA node the device is attached to, if the platform reports one
    /// (sysfs reports `-1` on single-node machines and for virtual devices).
    pub numa_node: Option<usize>,
    /// CPUs close to the device (sysfs `local_cpulist`, or the cpuset of the
    /// device's first non-I/O ancestor in hwloc). Empty when unknown.
    pub local_cpus: CpuSet,
}

/// Machine topology as plain data: NUMA nodes and device locality.
///
/// Built by [`Topology::detect`] (hwloc with the `hwloc` feature, sysfs
/// otherwise), by [`Topology::from_sysfs`] from any sysfs-shaped directory, or
/// by hand (tests, replaying a remote machine's layout). An empty topology is
/// valid: [`plan`](crate::plan) then treats all usable CPUs as one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Topology {
    /// NUMA nodes, ordered by `id`.
    pub numa_nodes: Vec<NumaNode>,
    /// Devices (network interfaces), ordered by name.
    pub devices: Vec<Device>,
}

impl Topology {
    /// Discovers the topology of this machine.
    ///
    /// With the `hwloc` feature this asks hwloc (keeping I/O objects so NICs
    /// are seen) and falls back to sysfs, with a `tracing` warning, if hwloc
    /// fails. Without it, reads sysfs under `/sys`.
    ///
    /// # Errors
    /// The sysfs reader's errors ([`PlacementError::ReadSysfs`],
    /// [`PlacementError::ParseSysfsCpuList`],
    /// [`PlacementError::ParseSysfsNumaNode`]).
    pub fn detect() -> Result<Topology, PlacementError> {
        #[cfg(feature = "hwloc")]
        {
            match Topology::detect_hwloc() {
                Ok(topology) => return Ok(topology),
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "hwloc topology discovery failed; falling back to sysfs"
                    );
                }
            }
        }
        Topology::from_sysfs(std::path::Path::new(crate::sysfs::SYSFS_ROOT))
    }

    /// Reads the topology from a sysfs tree rooted at `root` (normally `/sys`).
    /// See [`crate::sysfs`] for the files used.
    ///
    /// # Errors
    /// See [`crate::sysfs::read_topology`].
    pub fn from_sysfs(root: &std::path::Path) -> Result<Topology, PlacementError> {
        crate::sysfs::read_topology(root)
    }

    /// The node with OS index `id`.
    pub fn node(&self, id: usize) -> Option<&NumaNode> {
        self.numa_nodes.iter().find(|node| node.id == id)
    }

    /// The NUMA node `cpu` belongs to.
    pub fn node_of_cpu(&self, cpu: CpuId) -> Option<usize> {
        self.numa_nodes
            .iter()
            .find(|node| node.cpus.contains(cpu))
            .map(|node| node.id)
    }

    /// The device named `name`.
    pub fn device(&self, name: &str) -> Option<&Device> {
        self.devices.iter().find(|device| device.name == name)
    }

    /// CPUs close to device `name`: its `local_cpus`, or else the CPUs of its
    /// NUMA node. `None` if the device is unknown; an empty set if its
    /// locality is unknown.
    pub fn device_cpus(&self, name: &str) -> Option<CpuSet> {
        let device = self.device(name)?;
        if !device.local_cpus.is_empty() {
            return Some(device.local_cpus.clone());
        }
        Some(
            device
                .numa_node
                .and_then(|id| self.node(id))
                .map(|node| node.cpus.clone())
                .unwrap_or_default(),
        )
    }

    /// All CPUs of all nodes.
    pub fn cpus(&self) -> CpuSet {
        self.numa_nodes
            .iter()
            .flat_map(|node| node.cpus.iter())
            .collect()
    }

    /// Sorts nodes by id and devices by name (the documented order).
    pub(crate) fn normalize(&mut self) {
        self.numa_nodes.sort_by_key(|node| node.id);
        self.devices.sort_by(|a, b| a.name.cmp(&b.name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo() -> Topology {
        Topology {
            numa_nodes: vec![
                NumaNode {
                    id: 0,
                    cpus: "0-3".parse().unwrap(),
                },
                NumaNode {
                    id: 1,
                    cpus: "4-7".parse().unwrap(),
                },
            ],
            devices: vec![
                Device {
                    name: "eth1".into(),
                    numa_node: Some(1),
                    local_cpus: CpuSet::new(),
                },
                Device {
                    name: "eth0".into(),
                    numa_node: None,
                    local_cpus: "0-1".parse().unwrap(),
                },
                Device {
                    name: "veth".into(),
                    numa_node: None,
                    local_cpus: CpuSet::new(),
                },
            ],
        }
    }

    #[test]
    fn lookups() {
        let t = topo();
        assert_eq!(t.node_of_cpu(5), Some(1));
        assert_eq!(t.node_of_cpu(9), None);
        assert_eq!(t.cpus(), "0-7".parse().unwrap());
        // Falls back to the node's cpus when local_cpus is unknown.
        assert_eq!(t.device_cpus("eth1"), Some("4-7".parse().unwrap()));
        assert_eq!(t.device_cpus("eth0"), Some("0-1".parse().unwrap()));
        assert_eq!(t.device_cpus("veth"), Some(CpuSet::new()));
        assert_eq!(t.device_cpus("nope"), None);
    }
}

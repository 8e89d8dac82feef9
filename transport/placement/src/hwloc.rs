//! Topology from hwloc (`hwloc` feature).

use std::path::Path;

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::{TopologyBuilder, TypeFilter};

use crate::cpuset::CpuSet;
use crate::error::PlacementError;
use crate::topology::{Device, NumaNode, Topology};

fn to_cpuset(set: &hwlocality::cpu::cpuset::CpuSet) -> CpuSet {
    set.iter_set().map(usize::from).collect()
}

/// Keeps every I/O object (bridges, PCI devices, OS devices): hwloc drops
/// them by default, and a NIC's locality is found through them.
fn keep_io(builder: TopologyBuilder) -> Result<TopologyBuilder, PlacementError> {
    builder
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(|source| PlacementError::HwlocIoFilter { source })
}

fn build(builder: TopologyBuilder) -> Result<hwlocality::Topology, PlacementError> {
    builder
        .build()
        .map_err(|source| PlacementError::HwlocBuild { source })
}

/// Whether an OS device is a NIC (Ethernet/IP interface or RDMA device).
fn is_nic(object: &TopologyObject) -> bool {
    matches!(
        object.attributes(),
        Some(ObjectAttributes::OSDevice(attr))
            if matches!(attr.device_type(), OSDeviceType::Network | OSDeviceType::OpenFabrics)
    )
}

impl Topology {
    /// Converts an hwloc topology: every NUMA node (OS index and cpuset) and
    /// every network / OpenFabrics OS device. A device's `local_cpus` is the
    /// cpuset of its first non-I/O ancestor (the package or machine its PCI
    /// bus hangs off); its `numa_node` is set when that ancestor's nodeset is
    /// exactly one node.
    pub fn from_hwloc(topology: &hwlocality::Topology) -> Topology {
        let numa_nodes = topology
            .objects_with_type(ObjectType::NUMANode)
            .filter_map(|node| {
                Some(NumaNode {
                    id: node.os_index()?,
                    cpus: node.cpuset().map(|s| to_cpuset(&s)).unwrap_or_default(),
                })
            })
            .collect();
        let devices = topology
            .os_devices()
            .filter(|object| is_nic(object))
            .filter_map(|object| {
                let name = object.name()?.to_string_lossy().into_owned();
                let ancestor = object.first_non_io_ancestor();
                let local_cpus = ancestor
                    .and_then(|a| a.cpuset())
                    .map(|s| to_cpuset(&s))
                    .unwrap_or_default();
                let numa_node = ancestor.and_then(|a| a.nodeset()).and_then(|nodes| {
                    if nodes.weight() == Some(1) {
                        nodes.first_set().map(usize::from)
                    } else {
                        None
                    }
                });
                Some(Device {
                    name,
                    numa_node,
                    local_cpus,
                })
            })
            .collect();
        let mut out = Topology {
            numa_nodes,
            devices,
        };
        out.normalize();
        out
    }

    /// Discovers this machine's topology with hwloc, I/O objects included.
    ///
    /// # Errors
    /// [`PlacementError::HwlocIoFilter`] or [`PlacementError::HwlocBuild`].
    pub fn detect_hwloc() -> Result<Topology, PlacementError> {
        let topology = build(keep_io(hwlocality::Topology::builder())?)?;
        Ok(Topology::from_hwloc(&topology))
    }

    /// Loads an hwloc XML topology (as written by `lstopo file.xml`), I/O
    /// objects included.
    ///
    /// # Errors
    /// [`PlacementError::HwlocXml`] or [`PlacementError::HwlocXmlLoad`] if
    /// hwloc rejects the text (when it is set or when it is loaded, by XML
    /// backend), [`PlacementError::HwlocIoFilter`] as
    /// [`Topology::detect_hwloc`].
    pub fn from_hwloc_xml(xml: &str) -> Result<Topology, PlacementError> {
        let builder = hwlocality::Topology::builder()
            .from_xml(xml)
            .map_err(|source| PlacementError::HwlocXml { source })?;
        let topology = keep_io(builder)?
            .build()
            .map_err(|source| PlacementError::HwlocXmlLoad { source })?;
        Ok(Topology::from_hwloc(&topology))
    }

    /// Loads an hwloc XML topology file, I/O objects included.
    ///
    /// The file is read here and handed to hwloc as a buffer (hwloc's own
    /// file loader reports a missing file with an errno `hwlocality` does not
    /// expect, and panics).
    ///
    /// # Errors
    /// [`PlacementError::ReadHwlocXml`] if the file cannot be read, or as
    /// [`Topology::from_hwloc_xml`].
    pub fn from_hwloc_xml_file(path: &Path) -> Result<Topology, PlacementError> {
        let xml = std::fs::read_to_string(path).map_err(|source| PlacementError::ReadHwlocXml {
            path: path.to_owned(),
            source,
        })?;
        Topology::from_hwloc_xml(&xml)
    }
}

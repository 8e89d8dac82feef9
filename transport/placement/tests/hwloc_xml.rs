//! hwloc path: a two-NUMA-node XML topology with NIC `eth1` under a PCI
//! device attached to package 1 (NUMA node 1).
#![cfg(feature = "hwloc")]

use std::path::PathBuf;

use starwire_placement::{plan, CpuSet, Placement, PlanWarning, ReactorMode, Topology};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/two_numa.xml")
}

fn set(text: &str) -> CpuSet {
    text.parse().unwrap()
}

#[test]
fn xml_fixture_loads_nodes_and_nic() {
    let topology = Topology::from_hwloc_xml_file(&fixture()).unwrap();
    let nodes: Vec<(usize, String)> = topology
        .numa_nodes
        .iter()
        .map(|n| (n.id, n.cpus.to_string()))
        .collect();
    assert_eq!(nodes, vec![(0, "0-3".to_owned()), (1, "4-7".to_owned())]);
    let nic = topology
        .device("eth1")
        .expect("eth1 is an OS device in the fixture");
    assert_eq!(nic.numa_node, Some(1));
    assert_eq!(nic.local_cpus, set("4-7"));
}

#[test]
fn nic_on_node_one_gets_node_one_cores_first() {
    let xml = std::fs::read_to_string(fixture()).unwrap();
    let topology = Topology::from_hwloc_xml(&xml).unwrap();
    let near = Placement::NearDevice {
        device: "eth1".into(),
    };

    let p = plan(&near, 4, ReactorMode::Polling, &set("0-7"), &topology).unwrap();
    assert_eq!(p.cpus(), vec![Some(4), Some(5), Some(6), Some(7)]);
    assert!(p.reactors.iter().all(|r| r.numa_node == Some(1)));
    assert!(p.warnings.is_empty());

    // More reactors than node 1 has: node 1 first, then node 0.
    let p = plan(&near, 6, ReactorMode::Polling, &set("0-7"), &topology).unwrap();
    assert_eq!(
        p.cpus(),
        vec![Some(4), Some(5), Some(6), Some(7), Some(0), Some(1)]
    );

    // Only part of node 1 usable: its usable cores still lead.
    let p = plan(&near, 3, ReactorMode::Polling, &set("0-3,6"), &topology).unwrap();
    assert_eq!(p.cpus(), vec![Some(6), Some(0), Some(1)]);

    // Without the NIC hint the same topology packs node 0 first.
    let p = plan(
        &Placement::MaxPack,
        4,
        ReactorMode::Polling,
        &set("0-7"),
        &topology,
    )
    .unwrap();
    assert_eq!(p.cpus(), vec![Some(0), Some(1), Some(2), Some(3)]);
}

#[test]
fn only_nics_are_listed_as_devices() {
    // The fixture has exactly one network OS device; nothing else is a NIC.
    let topology = Topology::from_hwloc_xml_file(&fixture()).unwrap();
    let names: Vec<&str> = topology.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, vec!["eth1"]);
}

#[test]
fn unknown_nic_falls_back_with_warning() {
    let topology = Topology::from_hwloc_xml_file(&fixture()).unwrap();
    let p = plan(
        &Placement::NearDevice {
            device: "eth7".into(),
        },
        2,
        ReactorMode::Polling,
        &set("0-7"),
        &topology,
    )
    .unwrap();
    assert_eq!(p.cpus(), vec![Some(0), Some(1)]);
    assert_eq!(
        p.warnings,
        vec![PlanWarning::DeviceNotFound {
            device: "eth7".into()
        }]
    );
}

#[test]
fn invalid_xml_is_a_typed_error() {
    // Rejected when the buffer is set (hwloc with libxml2) or when it is
    // loaded (hwloc's own minimal parser, as Debian's libhwloc15 has).
    let err = Topology::from_hwloc_xml("<topology>nope").unwrap_err();
    assert!(
        matches!(
            err,
            starwire_placement::PlacementError::HwlocXml { .. }
                | starwire_placement::PlacementError::HwlocXmlLoad { .. }
        ),
        "{err:?}"
    );
    assert!(std::error::Error::source(&err).is_some());
    let err = Topology::from_hwloc_xml_file(&fixture().with_file_name("missing.xml")).unwrap_err();
    assert!(matches!(
        err,
        starwire_placement::PlacementError::ReadHwlocXml { .. }
    ));
}

#[test]
fn detects_this_machine() {
    let topology = Topology::detect_hwloc().unwrap();
    assert!(!topology.numa_nodes.is_empty());
    let usable = CpuSet::process_affinity().unwrap();
    assert!(!topology.cpus().intersection(&usable).is_empty());
}

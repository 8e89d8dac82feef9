//! sysfs path: a fake sysfs tree in a temporary directory.

use std::fs;
use std::path::{Path, PathBuf};

use starwire_placement::{plan, sysfs, CpuSet, Placement, PlacementError, ReactorMode, Topology};

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "starwire-placement-{tag}-{}-{nanos}",
            std::process::id()
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn write(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

fn set(text: &str) -> CpuSet {
    text.parse().unwrap()
}

/// Two nodes (0: 0-3,8-11; 1: 4-7,12-15), a memory-only node 2, a NIC on
/// node 1, a NIC with numa_node -1, a virtio-style NIC whose attributes live
/// on the parent of `device`, and `lo` without a device.
fn fake_sysfs(root: &Path) {
    write(root, "devices/system/node/node0/cpulist", "0-3,8-11\n");
    write(root, "devices/system/node/node1/cpulist", "4-7,12-15\n");
    write(root, "devices/system/node/node2/cpulist", "\n");
    write(root, "devices/system/node/online", "0-2\n");
    write(root, "devices/system/node/possible", "0-2\n");
    write(root, "class/net/eth1/device/numa_node", "1\n");
    write(root, "class/net/eth1/device/local_cpulist", "4-7,12-15\n");
    write(root, "class/net/eth0/device/numa_node", "-1\n");
    write(root, "class/net/eth0/device/local_cpulist", "0-15\n");
    // virtio: class/net/ens3/device -> .../virtio0, attributes on its parent.
    write(root, "pci/0000:00:03.0/numa_node", "0\n");
    write(root, "pci/0000:00:03.0/local_cpulist", "0-3,8-11\n");
    fs::create_dir_all(root.join("pci/0000:00:03.0/virtio0")).unwrap();
    fs::create_dir_all(root.join("class/net/ens3")).unwrap();
    std::os::unix::fs::symlink(
        root.join("pci/0000:00:03.0/virtio0"),
        root.join("class/net/ens3/device"),
    )
    .unwrap();
    fs::create_dir_all(root.join("class/net/lo")).unwrap();
}

#[test]
fn reads_nodes_and_nics_from_fake_sysfs() {
    let dir = TempDir::new("read");
    fake_sysfs(&dir.0);
    let topology = Topology::from_sysfs(&dir.0).unwrap();

    let nodes: Vec<(usize, String)> = topology
        .numa_nodes
        .iter()
        .map(|n| (n.id, n.cpus.to_string()))
        .collect();
    assert_eq!(
        nodes,
        vec![
            (0, "0-3,8-11".to_owned()),
            (1, "4-7,12-15".to_owned()),
            (2, String::new())
        ]
    );

    let names: Vec<&str> = topology.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, vec!["ens3", "eth0", "eth1", "lo"]);
    let eth1 = topology.device("eth1").unwrap();
    assert_eq!(eth1.numa_node, Some(1));
    assert_eq!(eth1.local_cpus, set("4-7,12-15"));
    let eth0 = topology.device("eth0").unwrap();
    assert_eq!(eth0.numa_node, None);
    assert_eq!(eth0.local_cpus, set("0-15"));
    let ens3 = topology.device("ens3").unwrap();
    assert_eq!(ens3.numa_node, Some(0));
    assert_eq!(ens3.local_cpus, set("0-3,8-11"));
    let lo = topology.device("lo").unwrap();
    assert_eq!(lo.numa_node, None);
    assert!(lo.local_cpus.is_empty());
}

#[test]
fn nic_from_sysfs_orders_its_node_first() {
    let dir = TempDir::new("plan");
    fake_sysfs(&dir.0);
    let topology = Topology::from_sysfs(&dir.0).unwrap();
    let p = plan(
        &Placement::NearDevice {
            device: "eth1".into(),
        },
        10,
        ReactorMode::Polling,
        &set("0-15"),
        &topology,
    )
    .unwrap();
    let cpus: Vec<usize> = p.cpus().into_iter().map(Option::unwrap).collect();
    assert_eq!(cpus, vec![4, 5, 6, 7, 12, 13, 14, 15, 0, 1]);
}

#[test]
fn non_numa_kernel_falls_back_to_online_cpus() {
    let dir = TempDir::new("nonuma");
    write(&dir.0, "devices/system/cpu/online", "0-5\n");
    let topology = Topology::from_sysfs(&dir.0).unwrap();
    assert_eq!(topology.numa_nodes.len(), 1);
    assert_eq!(topology.numa_nodes[0].id, 0);
    assert_eq!(topology.numa_nodes[0].cpus, set("0-5"));
    assert!(topology.devices.is_empty());
}

#[test]
fn empty_root_is_an_empty_topology() {
    let dir = TempDir::new("empty");
    assert_eq!(Topology::from_sysfs(&dir.0).unwrap(), Topology::default());
}

#[test]
fn malformed_files_are_errors_naming_the_path() {
    let dir = TempDir::new("bad-cpulist");
    write(&dir.0, "devices/system/node/node0/cpulist", "0-x\n");
    match Topology::from_sysfs(&dir.0) {
        Err(PlacementError::ParseSysfsCpuList { path, .. }) => {
            assert!(path.ends_with("node0/cpulist"), "{}", path.display());
        }
        other => panic!("expected ParseSysfsCpuList, got {other:?}"),
    }

    let dir = TempDir::new("bad-numa");
    write(&dir.0, "class/net/eth9/device/numa_node", "one\n");
    match sysfs::read_topology(&dir.0) {
        Err(PlacementError::ParseSysfsNumaNode { path, .. }) => {
            assert!(
                path.ends_with("eth9/device/numa_node"),
                "{}",
                path.display()
            );
        }
        other => panic!("expected ParseSysfsNumaNode, got {other:?}"),
    }
}

#[test]
fn unreadable_entries_are_read_errors() {
    // A directory where a file is expected: read_to_string fails with
    // EISDIR, which is an error, not "missing".
    let dir = TempDir::new("isdir");
    fs::create_dir_all(dir.0.join("devices/system/node/node0/cpulist")).unwrap();
    assert!(matches!(
        Topology::from_sysfs(&dir.0),
        Err(PlacementError::ReadSysfs { .. })
    ));
}

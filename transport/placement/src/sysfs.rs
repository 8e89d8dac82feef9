//! Topology from Linux sysfs (the path used without the `hwloc` feature).
//!
//! Files read, relative to the sysfs root (normally `/sys`):
//!
//! | file | gives |
//! | --- | --- |
//! | `devices/system/node/node<N>/cpulist` | CPUs of NUMA node `N` |
//! | `devices/system/cpu/online` | CPUs of the single node 0 when the kernel has no `node/` directory (built without NUMA) |
//! | `class/net/<dev>/device/numa_node` | NUMA node of a NIC (`-1`: unknown) |
//! | `class/net/<dev>/device/local_cpulist` | CPUs close to a NIC |
//!
//! When `device/numa_node` or `device/local_cpulist` is missing the parent of
//! `device` is tried (`device/../numa_node`): a virtio NIC's `device` is the
//! virtio bus device, whose parent is the PCI function carrying the
//! attributes. Missing files mean "unknown", not an error; unreadable or
//! malformed files are errors naming the path.
//!
//! The `parse_*` functions take file contents, so they can be tested without
//! a sysfs.

use std::io;
use std::num::ParseIntError;
use std::path::{Path, PathBuf};

use crate::cpuset::{CpuListError, CpuSet};
use crate::error::PlacementError;
use crate::topology::{Device, NumaNode, Topology};

/// Where sysfs is mounted.
pub const SYSFS_ROOT: &str = "/sys";

/// Parses the contents of a `cpulist` / `local_cpulist` file.
///
/// # Errors
/// [`CpuListError`] on malformed contents.
pub fn parse_cpulist(text: &str) -> Result<CpuSet, CpuListError> {
    text.parse()
}

/// Parses the contents of a `numa_node` file: a node id, or a negative
/// number (the kernel writes `-1`) meaning "no NUMA affinity known".
///
/// # Errors
/// [`ParseIntError`] if the text is not an integer.
pub fn parse_numa_node(text: &str) -> Result<Option<usize>, ParseIntError> {
    let text = text.trim();
    if text.starts_with('-') {
        text.parse::<i64>()?;
        Ok(None)
    } else {
        text.parse::<usize>().map(Some)
    }
}

/// Parses a `devices/system/node` entry name: `"node12"` → `Some(12)`;
/// other entries (`online`, `possible`, `has_cpu`, ...) → `None`.
pub fn parse_node_dir_name(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("node")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Reads NUMA nodes and network devices from the sysfs tree at `root`.
///
/// # Errors
/// - [`PlacementError::ReadSysfs`] when a directory or file exists but cannot
///   be read.
/// - [`PlacementError::ParseSysfsCpuList`] /
///   [`PlacementError::ParseSysfsNumaNode`] for malformed contents.
pub fn read_topology(root: &Path) -> Result<Topology, PlacementError> {
    let mut topology = Topology {
        numa_nodes: read_nodes(root)?,
        devices: read_net_devices(root)?,
    };
    topology.normalize();
    Ok(topology)
}

fn read_nodes(root: &Path) -> Result<Vec<NumaNode>, PlacementError> {
    let node_dir = root.join("devices/system/node");
    let Some(names) = read_dir_names(&node_dir)? else {
        // Kernel without CONFIG_NUMA: one implicit node holding every online CPU.
        let online = root.join("devices/system/cpu/online");
        return Ok(match read_cpulist_file(&online)? {
            Some(cpus) => vec![NumaNode { id: 0, cpus }],
            None => Vec::new(),
        });
    };
    let mut nodes = Vec::new();
    for name in names {
        let Some(id) = parse_node_dir_name(&name) else {
            continue;
        };
        let cpus = read_cpulist_file(&node_dir.join(&name).join("cpulist"))?.unwrap_or_default();
        nodes.push(NumaNode { id, cpus });
    }
    Ok(nodes)
}

fn read_net_devices(root: &Path) -> Result<Vec<Device>, PlacementError> {
    let net_dir = root.join("class/net");
    let Some(names) = read_dir_names(&net_dir)? else {
        return Ok(Vec::new());
    };
    let mut devices = Vec::new();
    for name in names {
        let device_dir = net_dir.join(&name).join("device");
        let numa_node = match read_with_parent_fallback(&device_dir, "numa_node")? {
            Some((path, text)) => parse_numa_node(&text)
                .map_err(|source| PlacementError::ParseSysfsNumaNode { path, source })?,
            None => None,
        };
        let local_cpus = match read_with_parent_fallback(&device_dir, "local_cpulist")? {
            Some((path, text)) => parse_cpulist(&text)
                .map_err(|source| PlacementError::ParseSysfsCpuList { path, source })?,
            None => CpuSet::new(),
        };
        devices.push(Device {
            name,
            numa_node,
            local_cpus,
        });
    }
    Ok(devices)
}

/// Reads `device/<file>`, else `device/../<file>`; returns the path that was read.
fn read_with_parent_fallback(
    device_dir: &Path,
    file: &str,
) -> Result<Option<(PathBuf, String)>, PlacementError> {
    for path in [device_dir.join(file), device_dir.join("..").join(file)] {
        if let Some(text) = read_optional(&path)? {
            return Ok(Some((path, text)));
        }
    }
    Ok(None)
}

fn read_cpulist_file(path: &Path) -> Result<Option<CpuSet>, PlacementError> {
    read_optional(path)?
        .map(|text| {
            parse_cpulist(&text).map_err(|source| PlacementError::ParseSysfsCpuList {
                path: path.to_owned(),
                source,
            })
        })
        .transpose()
}

/// File contents, or `None` if the file (or a parent) does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, PlacementError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if is_missing(&e) => Ok(None),
        Err(source) => Err(PlacementError::ReadSysfs {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Sorted entry names of a directory, or `None` if it does not exist.
fn read_dir_names(dir: &Path) -> Result<Option<Vec<String>>, PlacementError> {
    let err = |source| PlacementError::ReadSysfs {
        path: dir.to_owned(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if is_missing(&e) => return Ok(None),
        Err(e) => return Err(err(e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(err)?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    Ok(Some(names))
}

fn is_missing(e: &io::Error) -> bool {
    // NotADirectory: `lo/device` missing shows up as ENOTDIR for `device/..`
    // on some filesystems; both mean "this attribute does not exist".
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_node_text() {
        assert_eq!(parse_numa_node("1\n").unwrap(), Some(1));
        assert_eq!(parse_numa_node("0").unwrap(), Some(0));
        assert_eq!(parse_numa_node("-1\n").unwrap(), None);
        assert!(parse_numa_node("x").is_err());
        assert!(parse_numa_node("-x").is_err());
        assert!(parse_numa_node("").is_err());
    }

    #[test]
    fn node_dir_names() {
        assert_eq!(parse_node_dir_name("node0"), Some(0));
        assert_eq!(parse_node_dir_name("node12"), Some(12));
        assert_eq!(parse_node_dir_name("node"), None);
        assert_eq!(parse_node_dir_name("online"), None);
        assert_eq!(parse_node_dir_name("node1x"), None);
        assert_eq!(parse_node_dir_name("has_cpu"), None);
    }

    #[test]
    fn cpulist_text() {
        assert_eq!(parse_cpulist("0-1\n").unwrap(), "0,1".parse().unwrap());
        assert!(parse_cpulist("0-\n").is_err());
    }

    #[test]
    fn reads_this_machines_sysfs() {
        // Real files: every Linux machine has at least one node (or the
        // `cpu/online` fallback) with at least one CPU.
        let topology = read_topology(Path::new(SYSFS_ROOT)).unwrap();
        assert!(!topology.numa_nodes.is_empty());
        assert!(!topology.cpus().is_empty());
    }
}

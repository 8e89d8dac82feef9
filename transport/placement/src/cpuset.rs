//! [`CpuSet`]: a set of logical CPU ids, and the Linux "cpulist" text format.

use std::collections::BTreeSet;
use std::fmt;
use std::num::ParseIntError;
use std::str::FromStr;

use nix::sched::{sched_getaffinity, CpuSet as NixCpuSet};
use nix::unistd::Pid;

use crate::error::PlacementError;

/// A logical CPU id, as the kernel numbers them (`/sys/devices/system/cpu/cpuN`).
pub type CpuId = usize;

/// Largest CPU id accepted when parsing a cpulist (exclusive bound).
///
/// Matches the largest `NR_CPUS` Linux can be configured with on x86-64
/// (`CONFIG_MAXSMP`). It only guards against absurd ranges such as
/// `0-4294967295` allocating gigabytes; the affinity syscalls are further
/// limited to [`CpuSet::affinity_capacity`].
pub const MAX_CPUS: usize = 8192;

/// Error parsing a Linux cpulist string (`"0-3,8,10-15:2/4"`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CpuListError {
    /// A CPU id (or a stride number) is not a decimal integer.
    #[error("invalid number {token:?} in cpulist")]
    InvalidNumber {
        /// The offending token.
        token: String,
        /// Why it did not parse.
        #[source]
        source: ParseIntError,
    },
    /// A range whose end is below its start (`"5-3"`).
    #[error("reversed range {start}-{end} in cpulist")]
    ReversedRange {
        /// First CPU of the range.
        start: CpuId,
        /// Last CPU of the range.
        end: CpuId,
    },
    /// A CPU id at or above [`MAX_CPUS`].
    #[error("cpu {cpu} is out of range (max {max})", max = MAX_CPUS - 1)]
    CpuTooLarge {
        /// The offending CPU id.
        cpu: CpuId,
    },
    /// A malformed `start-end:used/group` stride (`used` must be in `1..=group`).
    #[error("invalid stride {used}/{group} in cpulist")]
    InvalidStride {
        /// CPUs used per group.
        used: usize,
        /// Group size.
        group: usize,
    },
    /// An empty element, e.g. `"1,,2"` or a trailing comma.
    #[error("empty element in cpulist")]
    EmptyElement,
}

/// A set of logical CPU ids.
///
/// Plain data: it is not tied to the affinity syscalls, and it can hold CPUs
/// that do not exist on this machine (e.g. one read from a topology fixture).
/// Iteration is in ascending CPU order.
///
/// The text form (`Display` / `FromStr`) is the Linux *cpulist* format used by
/// `/sys/devices/system/node/node0/cpulist`, `taskset -c` and `isolcpus=`:
/// comma-separated ids and inclusive ranges, e.g. `"0-3,8"`. Parsing also
/// accepts the kernel's stride form `"0-15:2/4"` (in each group of 4 CPUs
/// starting at 0, use the first 2: `0,1,4,5,8,9,12,13`) and surrounding
/// whitespace (sysfs files end with a newline). The empty string is the empty
/// set.
///
/// ```
/// use starwire_placement::CpuSet;
/// let set: CpuSet = "0-3,8".parse().unwrap();
/// assert_eq!(set.len(), 5);
/// assert!(set.contains(8));
/// assert_eq!(set.to_string(), "0-3,8");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuSet {
    cpus: BTreeSet<CpuId>,
}

impl CpuSet {
    /// The empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a Linux cpulist (same as `str::parse`).
    ///
    /// # Errors
    /// [`CpuListError`] if `text` is not a valid cpulist.
    pub fn parse_cpulist(text: &str) -> Result<Self, CpuListError> {
        text.parse()
    }

    /// Formats as a Linux cpulist, compressing runs into ranges (`"0-3,8"`).
    /// Same as `to_string()`.
    pub fn to_cpulist(&self) -> String {
        self.to_string()
    }

    /// Adds `cpu`; returns whether it was newly inserted.
    pub fn insert(&mut self, cpu: CpuId) -> bool {
        self.cpus.insert(cpu)
    }

    /// Removes `cpu`; returns whether it was present.
    pub fn remove(&mut self, cpu: CpuId) -> bool {
        self.cpus.remove(&cpu)
    }

    /// Whether `cpu` is in the set.
    pub fn contains(&self, cpu: CpuId) -> bool {
        self.cpus.contains(&cpu)
    }

    /// Number of CPUs in the set.
    pub fn len(&self) -> usize {
        self.cpus.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.cpus.is_empty()
    }

    /// Lowest CPU id in the set.
    pub fn first(&self) -> Option<CpuId> {
        self.cpus.first().copied()
    }

    /// Highest CPU id in the set.
    pub fn last(&self) -> Option<CpuId> {
        self.cpus.last().copied()
    }

    /// CPU ids in ascending order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = CpuId> + ExactSizeIterator + '_ {
        self.cpus.iter().copied()
    }

    /// CPUs in both sets.
    #[must_use]
    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        self.cpus.intersection(&other.cpus).copied().collect()
    }

    /// CPUs in either set.
    #[must_use]
    pub fn union(&self, other: &CpuSet) -> CpuSet {
        self.cpus.union(&other.cpus).copied().collect()
    }

    /// CPUs in `self` but not in `other`.
    #[must_use]
    pub fn difference(&self, other: &CpuSet) -> CpuSet {
        self.cpus.difference(&other.cpus).copied().collect()
    }

    /// Whether every CPU of `self` is in `other`.
    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.cpus.is_subset(&other.cpus)
    }

    /// Number of CPU ids the affinity syscalls can address
    /// (`CPU_SETSIZE`, 1024 with glibc). [`pin_current_thread`] rejects CPUs
    /// at or above it with [`PlacementError::CpuOutOfRange`].
    ///
    /// [`pin_current_thread`]: crate::pin_current_thread
    pub fn affinity_capacity() -> usize {
        NixCpuSet::count()
    }

    /// The CPUs the process may run on: the affinity mask of the process's
    /// main thread (`sched_getaffinity(getpid())`), which is what `taskset`,
    /// `numactl --physcpubind` and container cpusets restrict. This is the
    /// "usable" set that [`plan`](crate::plan) expects.
    ///
    /// Unlike [`current_thread_affinity`](crate::current_thread_affinity) it
    /// is not affected by a reactor thread having pinned itself already.
    ///
    /// # Errors
    /// [`PlacementError::GetAffinity`] if the syscall fails.
    pub fn process_affinity() -> Result<CpuSet, PlacementError> {
        let mask = sched_getaffinity(Pid::this())
            .map_err(|source| PlacementError::GetAffinity { source })?;
        Ok(Self::from_nix(&mask))
    }

    /// Converts from nix's fixed-size `cpu_set_t` wrapper.
    pub fn from_nix(mask: &NixCpuSet) -> CpuSet {
        (0..NixCpuSet::count())
            .filter(|&cpu| mask.is_set(cpu).unwrap_or(false))
            .collect()
    }

    /// Converts to nix's fixed-size `cpu_set_t` wrapper.
    ///
    /// # Errors
    /// [`PlacementError::CpuOutOfRange`] for the first CPU at or above
    /// [`CpuSet::affinity_capacity`].
    pub fn to_nix(&self) -> Result<NixCpuSet, PlacementError> {
        let mut mask = NixCpuSet::new();
        for cpu in self.iter() {
            mask.set(cpu).map_err(|_| PlacementError::CpuOutOfRange {
                cpu,
                capacity: NixCpuSet::count(),
            })?;
        }
        Ok(mask)
    }
}

impl FromIterator<CpuId> for CpuSet {
    fn from_iter<I: IntoIterator<Item = CpuId>>(iter: I) -> Self {
        CpuSet {
            cpus: iter.into_iter().collect(),
        }
    }
}

impl Extend<CpuId> for CpuSet {
    fn extend<I: IntoIterator<Item = CpuId>>(&mut self, iter: I) {
        self.cpus.extend(iter);
    }
}

impl<'a> IntoIterator for &'a CpuSet {
    type Item = CpuId;
    type IntoIter = std::iter::Copied<std::collections::btree_set::Iter<'a, CpuId>>;

    fn into_iter(self) -> Self::IntoIter {
        self.cpus.iter().copied()
    }
}

impl From<&[CpuId]> for CpuSet {
    fn from(cpus: &[CpuId]) -> Self {
        cpus.iter().copied().collect()
    }
}

impl FromStr for CpuSet {
    type Err = CpuListError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_cpulist_ordered(s).map(|cpus| cpus.into_iter().collect())
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_ranges(f, self.iter())
    }
}

/// Writes CPU ids as a cpulist, compressing each ascending run of consecutive
/// ids into `a-b`. Order is preserved (used for ordered `Fixed` lists too).
pub(crate) fn write_ranges(
    f: &mut impl fmt::Write,
    cpus: impl IntoIterator<Item = CpuId>,
) -> fmt::Result {
    let mut iter = cpus.into_iter();
    let Some(mut start) = iter.next() else {
        return Ok(());
    };
    let mut end = start;
    let mut first = true;
    let mut flush = |f: &mut dyn fmt::Write, start: CpuId, end: CpuId| -> fmt::Result {
        if !first {
            f.write_char(',')?;
        }
        first = false;
        if start == end {
            write!(f, "{start}")
        } else {
            write!(f, "{start}-{end}")
        }
    };
    for cpu in iter {
        if end.checked_add(1) == Some(cpu) {
            end = cpu;
        } else {
            flush(f, start, end)?;
            start = cpu;
            end = cpu;
        }
    }
    flush(f, start, end)
}

/// Parses a cpulist keeping element order and duplicates
/// (`"4-5,0"` → `[4, 5, 0]`). [`CpuSet::from_str`] sorts and deduplicates;
/// this order-preserving form backs [`Placement::Fixed`](crate::Placement::Fixed).
///
/// # Errors
/// [`CpuListError`] on malformed input.
pub fn parse_cpulist_ordered(text: &str) -> Result<Vec<CpuId>, CpuListError> {
    let text = text.trim();
    let mut out = Vec::new();
    if text.is_empty() {
        return Ok(out);
    }
    for element in text.split(',') {
        let element = element.trim();
        if element.is_empty() {
            return Err(CpuListError::EmptyElement);
        }
        let (range, stride) = match element.split_once(':') {
            Some((range, stride)) => (range, Some(stride)),
            None => (element, None),
        };
        let (start, end) = match range.split_once('-') {
            Some((a, b)) => (parse_cpu(a)?, parse_cpu(b)?),
            None => {
                let cpu = parse_cpu(range)?;
                (cpu, cpu)
            }
        };
        if end < start {
            return Err(CpuListError::ReversedRange { start, end });
        }
        let (used, group) = match stride {
            None => (1, 1),
            Some(stride) => {
                let (used, group) = stride.split_once('/').ok_or(CpuListError::EmptyElement)?;
                let used = parse_number(used)?;
                let group = parse_number(group)?;
                if used == 0 || group == 0 || used > group {
                    return Err(CpuListError::InvalidStride { used, group });
                }
                (used, group)
            }
        };
        out.extend((start..=end).filter(|cpu| (cpu - start) % group < used));
    }
    Ok(out)
}

fn parse_number(token: &str) -> Result<usize, CpuListError> {
    let token = token.trim();
    token
        .parse::<usize>()
        .map_err(|source| CpuListError::InvalidNumber {
            token: token.to_owned(),
            source,
        })
}

fn parse_cpu(token: &str) -> Result<CpuId, CpuListError> {
    let cpu = parse_number(token)?;
    if cpu >= MAX_CPUS {
        return Err(CpuListError::CpuTooLarge { cpu });
    }
    Ok(cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> CpuSet {
        text.parse().unwrap()
    }

    #[test]
    fn parses_ids_and_ranges() {
        assert_eq!(set("0-3,8").iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 8]);
        assert_eq!(set("7").iter().collect::<Vec<_>>(), vec![7]);
        assert_eq!(set(" 2,0-1\n").iter().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(set("").is_empty());
        assert!(set("\n").is_empty());
    }

    #[test]
    fn parses_kernel_stride_form() {
        assert_eq!(
            set("0-15:2/4").iter().collect::<Vec<_>>(),
            vec![0, 1, 4, 5, 8, 9, 12, 13]
        );
        assert_eq!(set("1-9:1/4").iter().collect::<Vec<_>>(), vec![1, 5, 9]);
    }

    #[test]
    fn rejects_malformed_lists() {
        assert!(matches!(
            "3-1".parse::<CpuSet>(),
            Err(CpuListError::ReversedRange { start: 3, end: 1 })
        ));
        assert!(matches!(
            "1,,2".parse::<CpuSet>(),
            Err(CpuListError::EmptyElement)
        ));
        assert!(matches!(
            "0,".parse::<CpuSet>(),
            Err(CpuListError::EmptyElement)
        ));
        assert!(matches!(
            "a-3".parse::<CpuSet>(),
            Err(CpuListError::InvalidNumber { ref token, .. }) if token == "a"
        ));
        assert!(matches!(
            "0-4294967295".parse::<CpuSet>(),
            Err(CpuListError::CpuTooLarge { cpu: 4_294_967_295 })
        ));
        assert!(matches!(
            "0-7:3/2".parse::<CpuSet>(),
            Err(CpuListError::InvalidStride { used: 3, group: 2 })
        ));
        assert!(matches!(
            "-1".parse::<CpuSet>(),
            Err(CpuListError::InvalidNumber { .. })
        ));
    }

    #[test]
    fn formats_compressed_ranges() {
        let s: CpuSet = [8, 0, 1, 2, 3, 10, 12, 13].into_iter().collect();
        assert_eq!(s.to_string(), "0-3,8,10,12-13");
        assert_eq!(CpuSet::new().to_string(), "");
        assert_eq!(set("5").to_cpulist(), "5");
    }

    #[test]
    fn round_trips() {
        for text in ["0", "0-1", "0-3,8", "1,3,5-9,64-127,1000"] {
            assert_eq!(set(text).to_string(), text);
        }
    }

    #[test]
    fn ordered_parse_keeps_order() {
        assert_eq!(parse_cpulist_ordered("4-5,0").unwrap(), vec![4, 5, 0]);
        assert_eq!(parse_cpulist_ordered("1,1").unwrap(), vec![1, 1]);
    }

    #[test]
    fn set_operations() {
        let a = set("0-5");
        let b = set("4-9");
        assert_eq!(a.intersection(&b), set("4-5"));
        assert_eq!(a.union(&b), set("0-9"));
        assert_eq!(a.difference(&b), set("0-3"));
        assert!(set("1-2").is_subset(&a));
        assert!(!b.is_subset(&a));
        assert_eq!(a.first(), Some(0));
        assert_eq!(b.last(), Some(9));
    }

    #[test]
    fn nix_conversion_round_trips_and_bounds() {
        let s = set("0,3,17");
        let mask = s.to_nix().unwrap();
        assert_eq!(CpuSet::from_nix(&mask), s);
        let too_big = set(&CpuSet::affinity_capacity().to_string());
        assert!(matches!(
            too_big.to_nix(),
            Err(PlacementError::CpuOutOfRange { cpu, .. }) if cpu == CpuSet::affinity_capacity()
        ));
    }

    #[test]
    fn process_affinity_is_nonempty_and_within_capacity() {
        let usable = CpuSet::process_affinity().unwrap();
        assert!(!usable.is_empty());
        assert!(usable.last().unwrap() < CpuSet::affinity_capacity());
    }
}

//! Registered-memory buffer pool for starwire backends.
//!
//! A [`BufPool`] is one anonymous mapping cut into fixed-size slots. Kernel
//! bypass and io_uring backends register the whole mapping once (io_uring
//! fixed buffers, an RDMA memory region) and then lend slots to the codec
//! without copying. The pool is owned by one reactor: [`BufPool::take`] and
//! [`BufPool::give`] are plain `&mut self` calls on a free list, with no lock
//! and no atomic.
//!
//! The mapping uses 2 MiB huge pages (`MAP_HUGETLB`) when the system has
//! them reserved and falls back to ordinary pages (with
//! `MADV_HUGEPAGE`, so transparent huge pages can still back it) when it has
//! none; [`BufPool::pages`] tells which one happened and why. Either way
//! the pages are populated at creation, so no page fault lands on the data
//! path.
//!
//! The kernel or a device writes registered memory without any Rust borrow,
//! so the pool lends a slot's bytes only through `unsafe` methods
//! ([`BufPool::slot`], [`BufPool::slot_mut`]) that lend exactly the range
//! asked for: the caller proves, from its own protocol, that the device does
//! not touch that range while the borrow lives. Addresses
//! ([`BufPool::base_ptr`], [`BufPool::slot_ptr`]) are safe to take; handing
//! them to the kernel is the backend's `unsafe` step.
//!
//! Registered memory is pinned and counted against `RLIMIT_MEMLOCK` for a
//! process without `CAP_IPC_LOCK`. [`check_memlock`] compares the bytes a
//! backend is about to register with that limit and returns
//! [`MemlockError`], which names the limit and how to raise it, instead of
//! letting the kernel answer a bare `ENOMEM`.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod lend;

use std::fmt;

use memmap2::{Advice, MmapMut, MmapOptions, MmapRaw};
use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
use thiserror::Error;

/// Size of a huge page used by the pool: 2 MiB.
pub const HUGE_PAGE_LEN: usize = 2 << 20;
/// `log2(HUGE_PAGE_LEN)`, the `MAP_HUGE_*` page-size selector.
const HUGE_PAGE_BITS: u8 = 21;
/// Capability number of `CAP_IPC_LOCK` (linux/capability.h).
const CAP_IPC_LOCK: u32 = 14;

/// Whether to try huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePolicy {
    /// Try 2 MiB huge pages, fall back to ordinary pages.
    #[default]
    Try,
    /// Ordinary pages only.
    Never,
}

/// What backs a pool's mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pages {
    /// 2 MiB huge pages from the hugetlb pool.
    Huge,
    /// Ordinary pages; `huge_error` says why huge pages were not used
    /// (`None` when they were not tried).
    Normal {
        /// The error of the `MAP_HUGETLB` attempt.
        huge_error: Option<String>,
    },
}

impl fmt::Display for Pages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pages::Huge => f.write_str("2 MiB huge pages"),
            Pages::Normal { huge_error: None } => f.write_str("4 KiB pages"),
            Pages::Normal {
                huge_error: Some(e),
            } => write!(f, "4 KiB pages (huge pages unavailable: {e})"),
        }
    }
}

/// A pool that could not be made.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Zero slots, zero-length slots, or a size that overflows.
    #[error("invalid pool geometry: {slots} slots of {slot_len} bytes")]
    Geometry {
        /// Requested slot count.
        slots: usize,
        /// Requested slot length.
        slot_len: usize,
    },
    /// The anonymous mapping failed.
    #[error("mapping {len} bytes: {source}")]
    Map {
        /// Bytes requested.
        len: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A byte range outside the pool's slots: an unknown slot, or bytes past
/// the end of a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("{len} bytes at offset {off} of slot {slot} are outside the pool ({slots} slots of {slot_len} bytes)")]
pub struct SlotRangeError {
    /// The slot's index.
    pub slot: usize,
    /// Requested offset inside the slot.
    pub off: usize,
    /// Requested length.
    pub len: usize,
    /// Slots in the pool.
    pub slots: usize,
    /// Length of one slot.
    pub slot_len: usize,
}

/// Index of a slot of a [`BufPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(u32);

impl SlotId {
    /// The id of slot `i` (for pools whose slots are addressed by index,
    /// such as io_uring buffer ids). [`BufPool::give`] still checks that
    /// the slot was lent.
    pub fn from_index(i: usize) -> Self {
        Self(i as u32)
    }

    /// The slot's index, `0..slots`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Fixed-size slots in one anonymous mapping. See the crate documentation.
pub struct BufPool {
    /// Raw, not `MmapMut`: `MmapMut` reaches its bytes through `Deref`,
    /// which would make a reference over the whole mapping (slots the
    /// kernel is writing included) each time an address is taken.
    map: MmapRaw,
    slot_len: usize,
    slots: usize,
    free: Vec<u32>,
    /// `lent[i]` is true while slot `i` is out; catches double returns.
    lent: Vec<bool>,
    pages: Pages,
}

impl fmt::Debug for BufPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufPool")
            .field("slot_len", &self.slot_len)
            .field("slots", &self.slots)
            .field("free", &self.free.len())
            .field("pages", &self.pages)
            .finish()
    }
}

impl BufPool {
    /// Map `slots * slot_len` bytes (rounded up to the page size in use).
    pub fn new(slot_len: usize, slots: usize, huge: HugePolicy) -> Result<Self, PoolError> {
        let bad = || PoolError::Geometry { slots, slot_len };
        if slot_len == 0 || slots == 0 || u32::try_from(slots).is_err() {
            return Err(bad());
        }
        let len = slot_len.checked_mul(slots).ok_or_else(bad)?;
        let (map, pages) = match huge {
            HugePolicy::Try => {
                let huge_len = len.div_ceil(HUGE_PAGE_LEN) * HUGE_PAGE_LEN;
                match MmapOptions::new()
                    .len(huge_len)
                    .huge(Some(HUGE_PAGE_BITS))
                    .populate()
                    .map_anon()
                {
                    Ok(m) => (MmapRaw::from(m), Pages::Huge),
                    Err(e) => (
                        MmapRaw::from(map_normal(len)?),
                        Pages::Normal {
                            huge_error: Some(e.to_string()),
                        },
                    ),
                }
            }
            HugePolicy::Never => (
                MmapRaw::from(map_normal(len)?),
                Pages::Normal { huge_error: None },
            ),
        };
        Ok(Self {
            map,
            slot_len,
            slots,
            free: (0..slots as u32).rev().collect(),
            lent: vec![false; slots],
            pages,
        })
    }

    /// What backs the mapping.
    pub fn pages(&self) -> &Pages {
        &self.pages
    }

    /// Length of one slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots not lent out.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Bytes of the mapping (what a backend registers).
    pub fn mapped_len(&self) -> usize {
        self.map.len()
    }

    /// Start of the mapping, for registration with the kernel. The pointer
    /// stays valid, at the same address, for the life of the pool; it is
    /// taken without making a reference, so writing through it (as the
    /// kernel does) invalidates nothing.
    pub fn base_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// Address of a slot's first byte (inside the registered range).
    pub fn slot_ptr(&self, id: SlotId) -> *const u8 {
        self.map.as_ptr().wrapping_add(id.index() * self.slot_len)
    }

    /// Lend a free slot; `None` when all are out.
    pub fn take(&mut self) -> Option<SlotId> {
        let i = self.free.pop()?;
        self.lent[i as usize] = true;
        Some(SlotId(i))
    }

    /// Return a lent slot.
    ///
    /// # Panics
    /// When the slot is not lent (a double return, or an id of another pool).
    pub fn give(&mut self, id: SlotId) {
        assert!(
            self.lent.get(id.index()).copied().unwrap_or(false),
            "slot {} returned but not lent",
            id.0
        );
        self.lent[id.index()] = false;
        self.free.push(id.0);
    }

    /// The slot holding `ptr`, if it points into the pool.
    pub fn slot_of(&self, ptr: *const u8) -> Option<SlotId> {
        let off = (ptr as usize).checked_sub(self.map.as_ptr() as usize)?;
        (off < self.slots * self.slot_len).then(|| SlotId((off / self.slot_len) as u32))
    }
}

fn map_normal(len: usize) -> Result<MmapMut, PoolError> {
    let mut map = MmapOptions::new()
        .len(len)
        .map_anon()
        .map_err(|source| PoolError::Map { len, source })?;
    // Transparent huge pages may still back it; failure (THP disabled) is
    // harmless.
    let _ = map.advise(Advice::HugePage);
    // Touch every page now: a first-touch fault (a 2 MiB clear with
    // transparent huge pages) must not land on the data path. (MAP_POPULATE
    // would fault before the advice, with small pages.)
    for b in map.iter_mut().step_by(4096) {
        *b = 0;
    }
    Ok(map)
}

/// The locked-memory situation of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemlockStatus {
    /// The soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited.
    pub limit: Option<u64>,
    /// The process has `CAP_IPC_LOCK` in its effective set, so the kernel
    /// does not apply the limit.
    pub cap_ipc_lock: bool,
}

/// Registering the requested memory would exceed `RLIMIT_MEMLOCK`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum MemlockError {
    /// The limit is below the bytes to register.
    #[error(
        "RLIMIT_MEMLOCK is {limit} bytes but {needed} bytes of registered buffers are needed \
         (this process lacks CAP_IPC_LOCK); raise the limit: `ulimit -l {kib}` (or unlimited) \
         in the shell, `LimitMEMLOCK={needed}` (or infinity) in the systemd unit, \
         `--ulimit memlock={needed}:{needed}` (or -1) for docker, or `memlock` in \
         /etc/security/limits.conf; or use smaller buffers"
    )]
    TooLow {
        /// Bytes to register.
        needed: u64,
        /// The soft limit in force.
        limit: u64,
        /// `needed` in KiB, rounded up, as `ulimit -l` takes it.
        kib: u64,
    },
    /// The limit could not be read.
    #[error("reading RLIMIT_MEMLOCK: {0}")]
    Getrlimit(#[source] nix::Error),
}

/// Whether the effective capability set of this process holds
/// `CAP_IPC_LOCK` (read from `/proc/self/status`; false when unreadable).
pub fn has_cap_ipc_lock() -> bool {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// The current limit and capability.
pub fn memlock_status() -> Result<MemlockStatus, MemlockError> {
    let (soft, _) = getrlimit(Resource::RLIMIT_MEMLOCK).map_err(MemlockError::Getrlimit)?;
    Ok(MemlockStatus {
        limit: (soft != RLIM_INFINITY).then_some(soft),
        cap_ipc_lock: has_cap_ipc_lock(),
    })
}

/// Check that `needed` bytes may be registered (pinned) by this process.
///
/// The kernel counts pinned pages of all rings and regions of the user
/// together, so this is a necessary check, not a sufficient one: a backend
/// should still map an `ENOMEM` from registration to the same advice.
pub fn check_memlock(needed: u64) -> Result<MemlockStatus, MemlockError> {
    let st = memlock_status()?;
    match st.limit {
        Some(limit) if !st.cap_ipc_lock && needed > limit => Err(MemlockError::TooLow {
            needed,
            limit,
            kib: needed.div_ceil(1024),
        }),
        _ => Ok(st),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_lent_once_and_disjoint() {
        let mut p = BufPool::new(4096, 8, HugePolicy::Try).unwrap();
        assert!(p.mapped_len() >= 8 * 4096);
        let mut ids = Vec::new();
        while let Some(id) = p.take() {
            ids.push(id);
        }
        assert_eq!(ids.len(), 8);
        assert_eq!(p.free_slots(), 0);
        let mut starts: Vec<_> = ids.iter().map(|&id| p.slot_ptr(id) as usize).collect();
        starts.sort_unstable();
        assert!(starts.windows(2).all(|w| w[1] - w[0] >= 4096));
        for id in &ids {
            assert_eq!(p.slot_of(p.slot_ptr(*id).wrapping_add(17)), Some(*id));
        }
        p.give(ids[3]);
        assert_eq!(p.take(), Some(ids[3]));
        assert_eq!(p.slot_of(p.base_ptr().wrapping_add(8 * 4096)), None);
    }

    #[test]
    #[should_panic(expected = "returned but not lent")]
    fn double_return_panics() {
        let mut p = BufPool::new(64, 2, HugePolicy::Never).unwrap();
        let id = p.take().unwrap();
        p.give(id);
        p.give(id);
    }

    #[test]
    fn falls_back_to_normal_pages_and_says_why() {
        let p = BufPool::new(1 << 20, 3, HugePolicy::Try).unwrap();
        let hugetlb_free: u64 = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("HugePages_Free:"))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0);
        if hugetlb_free < 2 {
            match p.pages() {
                Pages::Normal {
                    huge_error: Some(e),
                } => assert!(!e.is_empty()),
                other => panic!("expected the fallback, got {other:?}"),
            }
        }
        let p = BufPool::new(1 << 20, 3, HugePolicy::Never).unwrap();
        assert_eq!(p.pages(), &Pages::Normal { huge_error: None });
        assert_eq!(p.mapped_len(), 3 << 20);
    }

    #[test]
    fn rejects_bad_geometry() {
        assert!(matches!(
            BufPool::new(0, 4, HugePolicy::Never),
            Err(PoolError::Geometry { .. })
        ));
        assert!(matches!(
            BufPool::new(usize::MAX, 4, HugePolicy::Never),
            Err(PoolError::Geometry { .. })
        ));
    }

    #[test]
    fn memlock_error_names_the_limit_and_the_fixes() {
        let e = MemlockError::TooLow {
            needed: 16 << 20,
            limit: 8 << 20,
            kib: 16 << 10,
        };
        let s = e.to_string();
        for want in [
            "RLIMIT_MEMLOCK",
            "8388608",
            "16777216",
            "ulimit -l 16384",
            "LimitMEMLOCK=",
            "--ulimit memlock=",
        ] {
            assert!(s.contains(want), "{want} missing from {s}");
        }
        // The process's own status is readable; with the capability (root
        // here) any amount passes.
        let st = memlock_status().unwrap();
        if st.cap_ipc_lock || st.limit.is_none() {
            assert!(check_memlock(u64::MAX / 2).is_ok());
        } else {
            assert!(check_memlock(u64::MAX / 2).is_err());
        }
    }
}

//! A registered memory region backed by its own buffer-pool mapping.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;
use starwire_bufpool::{BufPool, HugePolicy};
use starwire_rdma::RegisteredMem;

use super::{last_errno, rc_errno, Pd};

/// A region registered for local and remote write (`ibv_reg_mr`), over a
/// page-aligned anonymous mapping it owns (a one-slot
/// [`BufPool`]: 2 MiB huge pages where the system has them reserved,
/// populated up front). The NIC may write it at any time, so its bytes are
/// reached only through [`Mr::mem`], a `RegisteredMem` whose lending
/// methods are `unsafe`.
pub(crate) struct Mr {
    mr: NonNull<ffi::ibv_mr>,
    base: NonNull<u8>,
    len: usize,
    /// Unmapped after the deregistration in `Drop`.
    _pool: BufPool,
    _pd: Arc<Pd>,
}

// SAFETY: the region and its mapping are owned by this value; moving them
// to another thread moves that ownership (libibverbs deregisters from any
// thread).
unsafe impl Send for Mr {}

/// Why a region could not be registered: the errno (`ENOMEM` from the
/// mapping or from pinning).
pub(crate) type RegError = i32;

impl Mr {
    /// Map `len` zeroed bytes and register them in `pd` for local write,
    /// and for remote write when `remote_write`.
    pub(crate) fn register(pd: &Arc<Pd>, len: usize, remote_write: bool) -> Result<Self, RegError> {
        let pool = BufPool::new(len, 1, HugePolicy::Try).map_err(|_| libc::ENOMEM)?;
        let base = NonNull::new(pool.base_ptr() as *mut u8).ok_or(libc::ENOMEM)?;
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        let access = access.0 as i32;
        // SAFETY: `pool` maps at least `len` bytes, owned by this region
        // and unmapped only after `ibv_dereg_mr` (`Drop`); nothing holds a
        // Rust reference to them (the pool lends none, `mem` gives a raw
        // view), so the NIC writing them invalidates nothing.
        let mr = unsafe { ffi::ibv_reg_mr(pd.as_ptr(), pool.base_ptr() as *mut _, len, access) };
        let mr = NonNull::new(mr).ok_or_else(last_errno)?;
        Ok(Self {
            mr,
            base,
            len,
            _pool: pool,
            _pd: Arc::clone(pd),
        })
    }

    /// Local key.
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the region is live; a plain field read.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    /// Remote key.
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: the region is live; a plain field read.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// The address of the first byte (what peers put in `remote_addr`).
    pub(crate) fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A view of the region's bytes, for as long as the region is
    /// borrowed.
    pub(crate) fn mem(&self) -> RegisteredMem<'_> {
        // SAFETY: `base` starts the mapping, which holds at least `len`
        // bytes and lives (at the same address) as long as `self`, and no
        // Rust reference to it exists but those `RegisteredMem`'s unsafe
        // methods lend.
        unsafe { RegisteredMem::from_raw_parts(self.base, self.len) }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once in `register`, deregistered once, here,
        // before the mapping (`self._pool`) is unmapped and before the
        // protection domain (`self._pd`) can go.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_dereg_mr failed");
        }
    }
}

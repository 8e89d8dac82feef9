//! The unsafe fence: every call into libibverbs (through rdma-sys) and
//! every raw pointer it returns live here, and nowhere else in the crate.
//!
//! Each verbs object is one Rust value with one `Drop` that releases it
//! (`ibv_free_device_list`, `ibv_close_device`, `ibv_dealloc_pd`,
//! `ibv_destroy_comp_channel`, `ibv_destroy_cq`, `ibv_destroy_qp`,
//! `ibv_dereg_mr`). An object holds an `Arc` of what it was created from,
//! so the C objects are released in the order libibverbs requires (a queue
//! pair before its completion queue and protection domain, a region before
//! its protection domain, everything before its context) whatever order
//! the Rust values are dropped in.
//!
//! No function here trusts a pointer from its caller: the one that could,
//! posting sends (the CPU copies an inline send's bytes inside
//! `ibv_post_send`), checks every source range against the regions it is
//! given ([`Qp::post_send`]). Memory the NIC may write (a region
//! registered for remote write) is allocated and owned by the region
//! itself ([`Mr`]) and reached only through
//! `starwire_rdma::RegisteredMem`, whose lending methods are `unsafe`.
#![allow(unsafe_code)]

mod cq;
mod mr;
mod qp;

use std::ffi::CStr;
use std::os::fd::{BorrowedFd, RawFd};
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

pub(crate) use cq::{CompChannel, Cq, Wc, POLL_MAX};
pub(crate) use mr::Mr;
pub(crate) use qp::{PostScratch, Qp, QpCreate, RtrAttr, RtsAttr, SendWr};

/// `errno` of the calling thread, as libibverbs left it.
pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// A verb's negative or positive errno return as a positive errno.
fn rc_errno(rc: c_int) -> i32 {
    match rc {
        0 => 0,
        // Most verbs return the errno; a few return -1 and set errno.
        -1 => last_errno(),
        r => r.abs(),
    }
}

/// `strerror(errno)`.
pub(crate) fn strerror(errno: i32) -> &'static str {
    nix::errno::Errno::from_raw(errno).desc()
}

/// Put `fd` in non-blocking mode, so reading an event that is not there
/// returns `EAGAIN` instead of parking the reactor inside libibverbs.
fn set_nonblocking(fd: RawFd) -> Result<(), i32> {
    // SAFETY: `fcntl` with F_GETFL/F_SETFL reads and sets flags of a
    // descriptor; an invalid one yields EBADF, nothing is dereferenced.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(last_errno());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(last_errno());
    }
    Ok(())
}

/// A C string owned by libibverbs, copied.
///
/// # Safety
///
/// `p` is null or points at a NUL-terminated string valid for the call.
unsafe fn c_string(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated (the caller's promise).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The array `ibv_get_device_list` returns.
pub(crate) struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    /// `ibv_get_device_list`; the errno when it fails (`ENOSYS` on a
    /// kernel without uverbs).
    pub(crate) fn get() -> Result<Self, i32> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the call; the returned
        // array is freed only by `Drop`.
        let p = unsafe { ffi::ibv_get_device_list(&mut n) };
        match NonNull::new(p) {
            Some(list) => Ok(Self {
                list,
                len: usize::try_from(n).unwrap_or(0),
            }),
            None => Err(last_errno()),
        }
    }

    /// How many devices were found.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn device(&self, i: usize) -> Option<*mut ffi::ibv_device> {
        if i >= self.len {
            return None;
        }
        // SAFETY: the array holds `len` device pointers (then a NULL), and
        // lives until `Drop`.
        Some(unsafe { *self.list.as_ptr().add(i) })
    }

    /// The kernel name of device `i` (`ibv_get_device_name`).
    pub(crate) fn name(&self, i: usize) -> Option<String> {
        let dev = self.device(i)?;
        // SAFETY: `dev` is a device of the live list; the name it returns
        // is a NUL-terminated string owned by the device.
        Some(unsafe { c_string(ffi::ibv_get_device_name(dev)) })
    }

    /// Open device `i` (`ibv_open_device`). The context outlives the list.
    pub(crate) fn open(&self, i: usize) -> Result<Context, i32> {
        let dev = self.device(i).ok_or(libc::ENODEV)?;
        let name = self.name(i).unwrap_or_default();
        // SAFETY: `dev` is a device of the live list. The context it
        // returns stays valid after the list is freed (ibv_get_device_list(3)).
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        let ctx = NonNull::new(ctx).ok_or_else(last_errno)?;
        let ctx = Context { ctx, name };
        set_nonblocking(ctx.async_raw_fd())?;
        Ok(ctx)
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the array came from `ibv_get_device_list` and is freed
        // once, here; contexts opened from it do not depend on it.
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) };
    }
}

/// What `ibv_query_device` reports, the fields starwire uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceAttr {
    pub(crate) fw_ver: String,
    pub(crate) node_guid: u64,
    pub(crate) max_qp: u32,
    pub(crate) max_qp_wr: u32,
    pub(crate) max_cqe: u32,
    pub(crate) max_mr_size: u64,
    pub(crate) max_sge: u32,
    pub(crate) phys_port_cnt: u8,
}

/// What `ibv_query_port` reports, the fields starwire uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortAttr {
    pub(crate) state: String,
    pub(crate) active: bool,
    /// `enum ibv_mtu` (1 = 256 bytes .. 5 = 4096 bytes).
    pub(crate) active_mtu: u8,
    pub(crate) lid: u16,
    /// `IBV_LINK_LAYER_*`: 1 InfiniBand, 2 Ethernet, 0 unspecified.
    pub(crate) link_layer: u8,
    pub(crate) gid_tbl_len: u32,
    pub(crate) max_msg_sz: u32,
}

/// An asynchronous event (`ibv_get_async_event`), already acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AsyncEvent {
    /// `ibv_event_type_str`.
    pub(crate) what: String,
    /// The queue pair it names, for QP events.
    pub(crate) qp_num: Option<u32>,
    /// The port it names, for port events.
    pub(crate) port: Option<u32>,
}

/// An open device (`struct ibv_context`).
pub(crate) struct Context {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts may be used from any thread and from
// several at once (the library and its providers lock what they share);
// the pointer is owned, not aliased by Rust references.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// The device's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }

    fn async_raw_fd(&self) -> RawFd {
        // SAFETY: the context is live; `async_fd` is a plain field.
        unsafe { (*self.ctx.as_ptr()).async_fd }
    }

    /// The descriptor that is readable while an asynchronous event waits.
    pub(crate) fn async_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to the context, which closes it
        // only in `ibv_close_device`, after this borrow ends.
        unsafe { BorrowedFd::borrow_raw(self.async_raw_fd()) }
    }

    /// `ibv_query_device`.
    pub(crate) fn query_device(&self) -> Result<DeviceAttr, i32> {
        // SAFETY: all-zero is a valid `ibv_device_attr` (integers and
        // arrays); the call fills it.
        let mut a: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_device(self.as_ptr(), &mut a) };
        if rc != 0 {
            return Err(rc_errno(rc));
        }
        let fw: Vec<u8> = a
            .fw_ver
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let pos = |v: c_int| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttr {
            fw_ver: String::from_utf8_lossy(&fw).into_owned(),
            node_guid: u64::from_be(a.node_guid),
            max_qp: pos(a.max_qp),
            max_qp_wr: pos(a.max_qp_wr),
            max_cqe: pos(a.max_cqe),
            max_mr_size: a.max_mr_size,
            max_sge: pos(a.max_sge),
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    /// `ibv_query_port`.
    pub(crate) fn query_port(&self, port: u8) -> Result<PortAttr, i32> {
        // SAFETY: all-zero is a valid `ibv_port_attr` (integers only).
        let mut a: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer of the size the
        // call is told (`___ibv_query_port` passes `sizeof`).
        let rc = unsafe { ffi::___ibv_query_port(self.as_ptr(), port, &mut a) };
        if rc != 0 {
            return Err(rc_errno(rc));
        }
        // SAFETY: `ibv_port_state_str` returns a static string.
        let state = unsafe { c_string(ffi::ibv_port_state_str(a.state)) };
        Ok(PortAttr {
            state,
            active: a.state == ffi::ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: u8::try_from(a.active_mtu).unwrap_or(0),
            lid: a.lid,
            link_layer: a.link_layer,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            max_msg_sz: a.max_msg_sz,
        })
    }

    /// `ibv_query_gid`.
    pub(crate) fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16], i32> {
        let index = c_int::try_from(index).map_err(|_| libc::EINVAL)?;
        // SAFETY: all-zero is a valid `ibv_gid` (bytes).
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.as_ptr(), port, index, &mut gid) };
        if rc != 0 {
            return Err(rc_errno(rc));
        }
        // SAFETY: every bit pattern of the union is a valid `raw`.
        Ok(unsafe { gid.raw })
    }

    /// The next asynchronous event, if one waits (the descriptor is
    /// non-blocking), acknowledged at once.
    pub(crate) fn next_async_event(&self) -> Option<AsyncEvent> {
        // SAFETY: all-zero is a valid `ibv_async_event` (a null pointer in
        // the union and event type 0).
        let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer; with the
        // descriptor non-blocking the call returns -1 (EAGAIN) at once when
        // no event waits.
        if unsafe { ffi::ibv_get_async_event(self.as_ptr(), &mut ev) } != 0 {
            return None;
        }
        use ffi::ibv_event_type as T;
        let t = ev.event_type;
        let qp_event = matches!(
            t,
            T::IBV_EVENT_QP_FATAL
                | T::IBV_EVENT_QP_REQ_ERR
                | T::IBV_EVENT_QP_ACCESS_ERR
                | T::IBV_EVENT_COMM_EST
                | T::IBV_EVENT_SQ_DRAINED
                | T::IBV_EVENT_PATH_MIG
                | T::IBV_EVENT_PATH_MIG_ERR
                | T::IBV_EVENT_QP_LAST_WQE_REACHED
        );
        let port_event = matches!(
            t,
            T::IBV_EVENT_PORT_ACTIVE
                | T::IBV_EVENT_PORT_ERR
                | T::IBV_EVENT_LID_CHANGE
                | T::IBV_EVENT_PKEY_CHANGE
                | T::IBV_EVENT_SM_CHANGE
                | T::IBV_EVENT_CLIENT_REREGISTER
                | T::IBV_EVENT_GID_CHANGE
        );
        let qp_num = if qp_event {
            // SAFETY: for QP events the element is the QP, which cannot be
            // destroyed before the event is acknowledged (below); reading
            // its number is a plain field read.
            Some(unsafe { (*ev.element.qp).qp_num })
        } else {
            None
        };
        let port = if port_event {
            // SAFETY: for port events the element is the port number.
            u32::try_from(unsafe { ev.element.port_num }).ok()
        } else {
            None
        };
        // SAFETY: `ibv_event_type_str` returns a static string.
        let what = unsafe { c_string(ffi::ibv_event_type_str(t)) };
        // SAFETY: `ev` came from `ibv_get_async_event` and is acknowledged
        // once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Some(AsyncEvent { what, qp_num, port })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made from the context holds an `Arc` of
        // it, so none is left; the context is closed once, here.
        let rc = unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::warn!(device = %self.name, errno = rc_errno(rc), "ibv_close_device failed");
        }
    }
}

/// A protection domain (`ibv_alloc_pd`): one per device.
pub(crate) struct Pd {
    pd: NonNull<ffi::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: a protection domain is used from any thread (regions and queue
// pairs of several reactors are made in it); libibverbs locks what it
// shares.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub(crate) fn alloc(ctx: &Arc<Context>) -> Result<Self, i32> {
        // SAFETY: a live context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(last_errno)?;
        Ok(Self {
            pd,
            ctx: Arc::clone(ctx),
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }

    /// The device context.
    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: regions and queue pairs hold an `Arc` of the domain, so
        // none is left; deallocated once, here, before the context (which
        // `self.ctx` keeps alive until after this).
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc_errno(rc), "ibv_dealloc_pd failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use super::*;

    /// rdma-sys redeclares several verbs structs by hand (unions bindgen
    /// could not derive); their sizes must be C's, or every work request
    /// and completion would be misread.
    #[test]
    fn struct_sizes_match_c() {
        assert_eq!(size_of::<ffi::ibv_wc>(), 48);
        assert_eq!(size_of::<ffi::ibv_send_wr>(), 128);
        assert_eq!(size_of::<ffi::ibv_recv_wr>(), 32);
        assert_eq!(size_of::<ffi::ibv_qp_attr>(), 144);
        assert_eq!(size_of::<ffi::ibv_sge>(), 16);
        assert_eq!(size_of::<ffi::ibv_gid>(), 16);
        assert_eq!(size_of::<ffi::ibv_ah_attr>(), 32);
        assert_eq!(size_of::<ffi::ibv_async_event>(), 16);
    }

    #[test]
    fn errno_returns_are_positive() {
        assert_eq!(rc_errno(0), 0);
        assert_eq!(rc_errno(libc::EINVAL), libc::EINVAL);
        assert_eq!(rc_errno(-libc::ENOMEM), libc::ENOMEM);
        assert_eq!(strerror(libc::ENOSYS), "Function not implemented");
    }
}

//! Every call into DPDK, behind safe types: the one module of this crate
//! allowed `unsafe`.
//!
//! * [`eal_init`] runs `rte_eal_init` (the caller makes it once per
//!   process); [`register_thread`] makes the calling thread an lcore.
//! * [`Mempool`] owns a packet-buffer pool and frees it on drop.
//! * [`Mbuf`] owns one packet buffer and gives it back to its pool on drop
//!   unless it was handed to a transmit queue. An `Mbuf` holds no handle
//!   to its pool (an `Arc` clone per packet would cost the data path an
//!   atomic read-modify-write each way); whatever holds mbufs holds a
//!   handle to their pool instead (an `Arc<Mempool>`, or a [`Queue`],
//!   whose device holds one) and gives its mbufs back in an explicit
//!   `Drop` before that handle goes, so no field order is relied upon.
//! * [`Device`] is a started port (stopped and closed on drop); a
//!   [`Queue`] is one of its rx/tx queue pairs, owned by one holder at a
//!   time, so a burst never races another on the same queue: the device
//!   hands its queues out once ([`Device::take_queues`]).

use std::ffi::{c_char, CStr, CString};
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use starwire_dpdk_sys as sys;

/// Bytes of data room in a pool's mbuf after the headroom.
pub(crate) const MBUF_DATA_ROOM: usize =
    (sys::RTE_MBUF_DEFAULT_BUF_SIZE - sys::RTE_PKTMBUF_HEADROOM) as usize;

/// `rte_errno` of the calling thread, with DPDK's text for it.
fn last_error() -> (i32, String) {
    // SAFETY: reads a thread-local int; no precondition.
    let errno = unsafe { sys::sw_rte_errno() };
    (errno, strerror(errno))
}

/// DPDK's text for an error number (`rte_strerror`), which covers both
/// libc's numbers and DPDK's own.
pub(crate) fn strerror(errno: i32) -> String {
    // SAFETY: rte_strerror accepts any number and returns a pointer to a
    // NUL-terminated string in a static or thread-local buffer, copied out
    // before anything else can overwrite it on this thread.
    let text = unsafe { CStr::from_ptr(sys::rte_strerror(errno)) };
    text.to_string_lossy().into_owned()
}

/// A negative DPDK return value as (errno, text).
fn negative(ret: i32) -> (i32, String) {
    let errno = ret.saturating_neg();
    (errno, strerror(errno))
}

/// Run `rte_eal_init` with `args` (the program name first). Returns the
/// error number and DPDK's reason on failure.
///
/// The caller calls this at most once per process at a time (the crate's
/// `eal` module holds the once-only state); DPDK refuses a second
/// successful initialisation with `EALREADY` anyway.
pub(crate) fn eal_init(args: &[String]) -> Result<(), (i32, String)> {
    let owned: Vec<CString> = args
        .iter()
        .map(|a| CString::new(a.as_str()))
        .collect::<Result<_, _>>()
        .map_err(|_| {
            (
                nix::libc::EINVAL,
                "an EAL argument contains a NUL byte".to_owned(),
            )
        })?;
    // The EAL keeps pointers into argv (device arguments, the saved
    // command line for telemetry) for the life of the process, so argv and
    // its strings are leaked on purpose: this happens once per process.
    let strings: &'static mut [CString] = Box::leak(owned.into_boxed_slice());
    let argv: &'static mut [*mut c_char] = Box::leak(
        strings
            .iter_mut()
            .map(|s| s.as_ptr().cast_mut())
            .chain(std::iter::once(std::ptr::null_mut()))
            .collect::<Vec<_>>()
            .into_boxed_slice(),
    );
    let argc = i32::try_from(args.len())
        .map_err(|_| (nix::libc::EINVAL, "too many EAL arguments".to_owned()))?;
    // SAFETY: argv holds argc pointers to NUL-terminated strings followed
    // by NULL, all leaked above so they outlive the EAL, which may permute
    // the array and keep pointers into it.
    let ret = unsafe { sys::rte_eal_init(argc, argv.as_mut_ptr()) };
    if ret < 0 {
        return Err(last_error());
    }
    Ok(())
}

/// The calling thread's lcore id, if it has one.
pub(crate) fn lcore_id() -> Option<u32> {
    // SAFETY: reads a thread-local variable of the EAL; no precondition.
    let id = unsafe { sys::sw_lcore_id() };
    (id != sys::LCORE_ID_ANY).then_some(id)
}

/// Make the calling thread an lcore (`rte_thread_register`), so mempool
/// caches and per-lcore state work on it. The EAL must be initialised.
pub(crate) fn register_thread() -> Result<u32, (i32, String)> {
    if let Some(id) = lcore_id() {
        return Ok(id);
    }
    // SAFETY: the caller holds an initialised EAL (the only way to reach
    // this crate's callers); registering a thread has no other precondition.
    let ret = unsafe { sys::rte_thread_register() };
    if ret < 0 {
        return Err(last_error());
    }
    lcore_id().ok_or((0, "rte_thread_register gave no lcore id".to_owned()))
}

/// Give the calling thread's lcore id back (`rte_thread_unregister`).
pub(crate) fn unregister_thread() {
    // SAFETY: a no-op for a thread that is not registered; otherwise it
    // releases the id of the calling thread only.
    unsafe { sys::rte_thread_unregister() }
}

/// Ports the EAL probed and can use.
pub(crate) fn port_count() -> u16 {
    // SAFETY: reads the ethdev table; valid once the EAL is initialised,
    // and returns 0 before.
    unsafe { sys::rte_eth_dev_count_avail() }
}

/// Whether `port` names a probed port.
pub(crate) fn port_is_valid(port: u16) -> bool {
    // SAFETY: checks the id against the ethdev table; any id is accepted.
    unsafe { sys::rte_eth_dev_is_valid_port(port) == 1 }
}

/// What a port is and can do (from `rte_eth_dev_info_get` and friends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DevInfo {
    pub name: String,
    pub driver: String,
    pub max_rx_queues: u16,
    pub max_tx_queues: u16,
    pub rx_desc_max: u16,
    pub tx_desc_max: u16,
    pub max_mtu: u16,
    pub socket: i32,
}

/// Describe a valid port.
pub(crate) fn dev_info(port: u16) -> Result<DevInfo, (i32, String)> {
    let mut info = MaybeUninit::<sys::rte_eth_dev_info>::zeroed();
    // SAFETY: info points to writable memory of the struct's size; DPDK
    // fills it (it zeroes it first itself) and validates the port id.
    let ret = unsafe { sys::rte_eth_dev_info_get(port, info.as_mut_ptr()) };
    if ret != 0 {
        return Err(negative(ret));
    }
    // SAFETY: a zeroed rte_eth_dev_info is a valid value (integers, raw
    // pointers and plain structs), and DPDK has filled it in.
    let info = unsafe { info.assume_init() };
    let driver = if info.driver_name.is_null() {
        String::new()
    } else {
        // SAFETY: a non-null driver_name is the driver's static
        // NUL-terminated name.
        unsafe { CStr::from_ptr(info.driver_name) }
            .to_string_lossy()
            .into_owned()
    };
    let mut name = [0 as c_char; sys::RTE_ETH_NAME_MAX_LEN as usize];
    // SAFETY: name has RTE_ETH_NAME_MAX_LEN bytes, the most DPDK writes
    // (NUL included).
    let ret = unsafe { sys::rte_eth_dev_get_name_by_port(port, name.as_mut_ptr()) };
    let name = if ret == 0 {
        // SAFETY: DPDK wrote a NUL-terminated name into the buffer.
        unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        String::new()
    };
    // SAFETY: any port id is accepted; SOCKET_ID_ANY for none known.
    let socket = unsafe { sys::rte_eth_dev_socket_id(port) };
    Ok(DevInfo {
        name,
        driver,
        max_rx_queues: info.max_rx_queues,
        max_tx_queues: info.max_tx_queues,
        rx_desc_max: info.rx_desc_lim.nb_max,
        tx_desc_max: info.tx_desc_lim.nb_max,
        max_mtu: info.max_mtu,
        socket,
    })
}

/// The port's MAC address.
pub(crate) fn mac_addr(port: u16) -> Result<[u8; 6], (i32, String)> {
    let mut a = sys::rte_ether_addr::default();
    // SAFETY: a is a valid rte_ether_addr to fill; the port id is checked.
    let ret = unsafe { sys::rte_eth_macaddr_get(port, &mut a) };
    if ret != 0 {
        return Err(negative(ret));
    }
    Ok(a.addr_bytes)
}

/// The port's MTU (`rte_eth_dev_get_mtu`).
pub(crate) fn mtu(port: u16) -> Result<u16, (i32, String)> {
    let mut mtu = 0u16;
    // SAFETY: mtu is a valid u16 to fill; the port id is checked.
    let ret = unsafe { sys::rte_eth_dev_get_mtu(port, &mut mtu) };
    if ret != 0 {
        return Err(negative(ret));
    }
    Ok(mtu)
}

/// A port's link as `rte_eth_link_get_nowait` reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LinkState {
    pub up: bool,
    pub speed_mbps: u32,
    pub full_duplex: bool,
}

/// Read the link state without waiting.
pub(crate) fn link(port: u16) -> Result<LinkState, (i32, String)> {
    let mut l = sys::rte_eth_link::default();
    // SAFETY: l is a valid rte_eth_link to fill; the port id is checked.
    let ret = unsafe { sys::rte_eth_link_get_nowait(port, &mut l) };
    if ret != 0 {
        return Err(negative(ret));
    }
    Ok(LinkState {
        up: u32::from(l.link_status()) == sys::RTE_ETH_LINK_UP,
        speed_mbps: l.link_speed,
        full_duplex: u32::from(l.link_duplex()) == sys::RTE_ETH_LINK_FULL_DUPLEX,
    })
}

/// A port's basic counters (`rte_eth_stats_get`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EthStats {
    pub ipackets: u64,
    pub opackets: u64,
    pub ibytes: u64,
    pub obytes: u64,
    pub imissed: u64,
    pub ierrors: u64,
    pub oerrors: u64,
    pub rx_nombuf: u64,
}

pub(crate) fn stats(port: u16) -> Result<EthStats, (i32, String)> {
    let mut s = sys::rte_eth_stats::default();
    // SAFETY: s is a valid rte_eth_stats to fill; the port id is checked.
    let ret = unsafe { sys::rte_eth_stats_get(port, &mut s) };
    if ret != 0 {
        return Err(negative(ret));
    }
    Ok(EthStats {
        ipackets: s.ipackets,
        opackets: s.opackets,
        ibytes: s.ibytes,
        obytes: s.obytes,
        imissed: s.imissed,
        ierrors: s.ierrors,
        oerrors: s.oerrors,
        rx_nombuf: s.rx_nombuf,
    })
}

/// The port's extended counters, by name (`rte_eth_xstats_get`).
pub(crate) fn xstats(port: u16) -> Result<Vec<(String, u64)>, (i32, String)> {
    // SAFETY: a null array with size 0 asks for the count only.
    let n = unsafe { sys::rte_eth_xstats_get_names(port, std::ptr::null_mut(), 0) };
    if n < 0 {
        return Err(negative(n));
    }
    let n = n as usize;
    let mut names = vec![sys::rte_eth_xstat_name::default(); n];
    let mut values = vec![sys::rte_eth_xstat::default(); n];
    // SAFETY: names has room for n entries, the size passed.
    let got = unsafe { sys::rte_eth_xstats_get_names(port, names.as_mut_ptr(), n as u32) };
    if got < 0 {
        return Err(negative(got));
    }
    // SAFETY: values has room for n entries, the size passed.
    let got_v = unsafe { sys::rte_eth_xstats_get(port, values.as_mut_ptr(), n as u32) };
    if got_v < 0 {
        return Err(negative(got_v));
    }
    let count = (got as usize).min(got_v as usize).min(n);
    Ok(values[..count]
        .iter()
        .filter_map(|v| {
            let name = names.get(v.id as usize)?;
            // SAFETY: DPDK writes NUL-terminated names of at most
            // RTE_ETH_XSTATS_NAME_SIZE bytes into each entry, zeroed before.
            let name = unsafe { CStr::from_ptr(name.name.as_ptr()) };
            Some((name.to_string_lossy().into_owned(), v.value))
        })
        .collect())
}

/// A pool of packet buffers (`rte_pktmbuf_pool_create`), freed on drop.
#[derive(Debug)]
pub(crate) struct Mempool {
    pool: NonNull<sys::rte_mempool>,
    size: u32,
    /// The name given to DPDK (for logs, and the tests' record of frees).
    name: Box<str>,
}

// SAFETY: a mempool with the default (multi-producer, multi-consumer ring)
// handler may be used and freed from any thread.
unsafe impl Send for Mempool {}
// SAFETY: every operation through &Mempool (allocating, counting) is
// thread-safe for the default handler.
unsafe impl Sync for Mempool {}

impl Mempool {
    /// A pool of `size` mbufs with `cache` per lcore and the default data
    /// room, on NUMA `socket`. `packed` lays the mbufs end to end in one
    /// chunk (`RTE_MEMPOOL_F_NO_IOVA_CONTIG`) rather than keeping each
    /// within a page: for a device that reads the pool as one array of
    /// equal frames and does no DMA (`net_af_xdp` registers it as its
    /// UMEM).
    pub(crate) fn new(
        name: &str,
        size: u32,
        cache: u32,
        socket: i32,
        packed: bool,
    ) -> Result<Self, (i32, String)> {
        let cname = CString::new(name)
            .map_err(|_| (nix::libc::EINVAL, "pool name has a NUL byte".to_owned()))?;
        let room = sys::RTE_MBUF_DEFAULT_BUF_SIZE as u16;
        let pool = if packed {
            // SAFETY: as below; the shim makes the pool as
            // rte_pktmbuf_pool_create does, with one flag more.
            unsafe { sys::sw_pktmbuf_pool_create_packed(cname.as_ptr(), size, cache, room, socket) }
        } else {
            // SAFETY: cname is a valid NUL-terminated name (DPDK copies
            // it); the sizes are plain numbers DPDK checks.
            unsafe { sys::rte_pktmbuf_pool_create(cname.as_ptr(), size, cache, 0, room, socket) }
        };
        match NonNull::new(pool) {
            Some(pool) => Ok(Self {
                pool,
                size,
                name: name.into(),
            }),
            None => Err(last_error()),
        }
    }

    /// Mbufs in the pool.
    pub(crate) fn size(&self) -> u32 {
        self.size
    }

    /// Mbufs free right now (in the pool and in lcore caches).
    pub(crate) fn available(&self) -> u32 {
        // SAFETY: the pool is live while self is.
        unsafe { sys::rte_mempool_avail_count(self.pool.as_ptr()) }
    }

    /// Take one mbuf, or `None` when the pool is empty.
    pub(crate) fn alloc(&self) -> Option<Mbuf> {
        // SAFETY: the pool is live while self is; allocation is thread-safe.
        let m = unsafe { sys::sw_pktmbuf_alloc(self.pool.as_ptr()) };
        NonNull::new(m).map(|m| Mbuf { m })
    }
}

impl Drop for Mempool {
    fn drop(&mut self) {
        let available = self.available();
        if available < self.size {
            // Mbufs left in a device's software rings (net_ring keeps what
            // was sent and never received) are lost with the pool; mbufs
            // this crate owns never are (see below).
            tracing::debug!(
                pool = &*self.name,
                available,
                size = self.size,
                "mempool freed with mbufs outstanding"
            );
        }
        #[cfg(test)]
        freed::record(&self.name, available, self.size);
        // SAFETY: this runs when the last Arc of the pool goes. Each
        // Device holds one until it has stopped and closed its port (which
        // releases the mbufs in its rings). Every holder of Mbufs holds a
        // handle to their pool (an Arc<Mempool>, or a Queue whose Device
        // holds one) and gives its mbufs back in its own Drop, which runs
        // before any of its fields, that handle included, is dropped:
        // DpdkLink, Demux (link.rs), Slot and Lease (steer.rs). So no
        // Mbuf of this crate outlives the pool.
        unsafe { sys::rte_mempool_free(self.pool.as_ptr()) }
    }
}

/// What each pool had back when it was freed, for the tests that check
/// that mbufs go back before their pool does (a pool freed first would
/// show them missing here, then take them back into freed memory).
#[cfg(test)]
pub(crate) mod freed {
    use std::sync::Mutex;

    /// (pool name, mbufs available, pool size) of each pool freed.
    static FREED: Mutex<Vec<(String, u32, u32)>> = Mutex::new(Vec::new());

    pub(super) fn record(name: &str, available: u32, size: u32) {
        let mut f = FREED.lock().unwrap_or_else(|e| e.into_inner());
        f.push((name.to_owned(), available, size));
    }

    /// (available, size) when the pool named `name` was freed, if it was.
    pub(crate) fn take(name: &str) -> Option<(u32, u32)> {
        let mut f = FREED.lock().unwrap_or_else(|e| e.into_inner());
        let i = f.iter().position(|(n, _, _)| n == name)?;
        let (_, available, size) = f.remove(i);
        Some((available, size))
    }
}

/// One packet buffer, owned: it goes back to its pool on drop. The
/// transparent layout lets a slice of them be a DPDK burst array.
#[derive(Debug)]
#[repr(transparent)]
pub(crate) struct Mbuf {
    m: NonNull<sys::rte_mbuf>,
}

// SAFETY: an mbuf is owned by exactly one Mbuf; freeing it from another
// thread is allowed by the pool's multi-producer handler.
unsafe impl Send for Mbuf {}

impl Mbuf {
    /// The packet's bytes in its first segment.
    pub(crate) fn data(&self) -> &[u8] {
        // SAFETY: the mbuf is owned by self; its data pointer and data_len
        // describe initialised bytes inside its buffer, alive while self
        // is and not written while borrowed shared.
        unsafe {
            let p = sys::sw_pktmbuf_data(self.m.as_ptr());
            let len = sys::sw_pktmbuf_data_len(self.m.as_ptr());
            std::slice::from_raw_parts(p, usize::from(len))
        }
    }

    /// Segments in the packet.
    pub(crate) fn segments(&self) -> u16 {
        // SAFETY: the mbuf is owned by self.
        unsafe { sys::sw_pktmbuf_nb_segs(self.m.as_ptr()) }
    }

    /// The whole buffer from the data's start, for writing a packet.
    pub(crate) fn room_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mbuf is owned by self and not yet handed to a queue;
        // the range from the data pointer to the end of the buffer is
        // inside the buffer the pool allocated for it. Bytes not written
        // since the last use may hold an old packet: u8 has no invalid
        // values.
        unsafe {
            let p = sys::sw_pktmbuf_data(self.m.as_ptr());
            let room = sys::sw_pktmbuf_room(self.m.as_ptr());
            std::slice::from_raw_parts_mut(p, usize::from(room))
        }
    }

    /// Make the packet the first `len` bytes of [`room_mut`](Self::room_mut)
    /// (at most the room).
    pub(crate) fn set_len(&mut self, len: u16) {
        // SAFETY: the mbuf is owned by self.
        let room = unsafe { sys::sw_pktmbuf_room(self.m.as_ptr()) };
        let len = len.min(room);
        // SAFETY: the mbuf is owned by self; len fits the first segment.
        unsafe { sys::sw_pktmbuf_set_len(self.m.as_ptr(), len) }
    }
}

impl Drop for Mbuf {
    fn drop(&mut self) {
        // SAFETY: self owns the mbuf; it goes back to its pool once.
        unsafe { sys::sw_pktmbuf_free(self.m.as_ptr()) }
    }
}

/// How to set up a port.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceSetup {
    pub queues: u16,
    pub rx_desc: u16,
    pub tx_desc: u16,
}

/// Which setup step failed, with DPDK's error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SetupError {
    Configure(i32, String),
    AdjustDesc(i32, String),
    RxQueue(u16, i32, String),
    TxQueue(u16, i32, String),
    Start(i32, String),
}

/// A configured and started port; stopped and closed when the last
/// holder (its [`Queue`]s and the port handle) drops it.
#[derive(Debug)]
pub(crate) struct Device {
    port: u16,
    queues: u16,
    /// Set by the one [`take_queues`](Self::take_queues) that hands the
    /// queue pairs out.
    queues_taken: AtomicBool,
    rx_desc: u16,
    tx_desc: u16,
    /// The receive queues fill from it; it outlives them.
    pool: Arc<Mempool>,
}

impl Device {
    /// Configure `setup.queues` rx/tx queue pairs on a valid, stopped
    /// `port`, their receive rings filled from `pool`, and start it.
    pub(crate) fn start(
        port: u16,
        setup: DeviceSetup,
        pool: Arc<Mempool>,
        socket: i32,
    ) -> Result<Self, SetupError> {
        // A zeroed rte_eth_conf is DPDK's documented default: no
        // multi-queue mode, no offloads, the MTU the port has.
        let conf = sys::rte_eth_conf::default();
        // SAFETY: conf is a valid configuration; the port id is checked.
        let ret = unsafe { sys::rte_eth_dev_configure(port, setup.queues, setup.queues, &conf) };
        if ret != 0 {
            let (e, s) = negative(ret);
            return Err(SetupError::Configure(e, s));
        }
        let (mut rx_desc, mut tx_desc) = (setup.rx_desc, setup.tx_desc);
        // SAFETY: both point to valid u16s DPDK rounds to the port's limits.
        let ret =
            unsafe { sys::rte_eth_dev_adjust_nb_rx_tx_desc(port, &mut rx_desc, &mut tx_desc) };
        if ret != 0 {
            let (e, s) = negative(ret);
            return Err(SetupError::AdjustDesc(e, s));
        }
        let socket = u32::try_from(socket).unwrap_or(sys::SOCKET_ID_ANY as u32);
        for q in 0..setup.queues {
            // SAFETY: the port is configured with setup.queues queues; a
            // null rxconf asks for the driver's default; the pool is live
            // (self keeps it) for as long as the queue can use it.
            let ret = unsafe {
                sys::rte_eth_rx_queue_setup(
                    port,
                    q,
                    rx_desc,
                    socket,
                    std::ptr::null(),
                    pool.pool.as_ptr(),
                )
            };
            if ret != 0 {
                let (e, s) = negative(ret);
                return Err(SetupError::RxQueue(q, e, s));
            }
            // SAFETY: as above; a null txconf asks for the default.
            let ret =
                unsafe { sys::rte_eth_tx_queue_setup(port, q, tx_desc, socket, std::ptr::null()) };
            if ret != 0 {
                let (e, s) = negative(ret);
                return Err(SetupError::TxQueue(q, e, s));
            }
        }
        // SAFETY: every queue is set up.
        let ret = unsafe { sys::rte_eth_dev_start(port) };
        if ret != 0 {
            let (e, s) = negative(ret);
            return Err(SetupError::Start(e, s));
        }
        Ok(Self {
            port,
            queues: setup.queues,
            queues_taken: AtomicBool::new(false),
            rx_desc,
            tx_desc,
            pool,
        })
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Receive and transmit descriptors per queue, as the port took them.
    pub(crate) fn descriptors(&self) -> (u16, u16) {
        (self.rx_desc, self.tx_desc)
    }

    pub(crate) fn pool(&self) -> &Arc<Mempool> {
        &self.pool
    }

    /// The queue pairs, handed out once: a burst on a queue must never
    /// race another on the same queue, so each has one owner. `None` once
    /// they were taken (by any thread, even if dropped since): the bursts
    /// of [`Queue`] rely on this for their soundness.
    pub(crate) fn take_queues(self: &Arc<Self>) -> Option<Vec<Queue>> {
        // Only the swap's atomicity matters: exactly one call sees false.
        if self.queues_taken.swap(true, Ordering::Relaxed) {
            return None;
        }
        let queues = (0..self.queues)
            .map(|queue| Queue {
                dev: Arc::clone(self),
                queue,
            })
            .collect();
        Some(queues)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: no Queue is left (each holds an Arc of self), so no
        // burst runs; stopping then closing a started port is allowed.
        unsafe {
            sys::rte_eth_dev_stop(self.port);
            sys::rte_eth_dev_close(self.port);
        }
    }
}

/// One rx/tx queue pair of a started port, with one owner: only
/// [`Device::take_queues`] makes them, once per device, so no two `Queue`s
/// name the same queue.
#[derive(Debug)]
pub(crate) struct Queue {
    dev: Arc<Device>,
    queue: u16,
}

impl Queue {
    /// The queue's index on its port.
    pub(crate) fn index(&self) -> u16 {
        self.queue
    }

    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// One `rte_eth_rx_burst` of up to `max` packets, appended to `out`.
    pub(crate) fn rx_burst(&mut self, out: &mut Vec<Mbuf>, max: u16) -> usize {
        out.reserve(usize::from(max));
        let spare = out.spare_capacity_mut();
        // SAFETY: the port is started and the queue set up (self's Device
        // is alive); no other Queue names this queue (`take_queues` hands
        // each out once) and &mut self makes this the only burst on it;
        // spare has room for max pointers, of which DPDK writes the first
        // n it returns.
        let n = unsafe {
            sys::sw_eth_rx_burst(self.dev.port, self.queue, spare.as_mut_ptr().cast(), max)
        };
        let len = out.len() + usize::from(n);
        // SAFETY: DPDK wrote n valid, distinct, owned mbuf pointers (an
        // Mbuf is a transparent non-null pointer) after the old length.
        unsafe { out.set_len(len) };
        usize::from(n)
    }

    /// One `rte_eth_tx_burst` of `pkts` from the front; the packets the
    /// device took are removed, the rest stay (the ring was full).
    pub(crate) fn tx_burst(&mut self, pkts: &mut Vec<Mbuf>) -> usize {
        if pkts.is_empty() {
            return 0;
        }
        let n = u16::try_from(pkts.len()).unwrap_or(u16::MAX);
        // SAFETY: the port is started and the queue set up; no other Queue
        // names this queue (`take_queues` hands each out once) and &mut
        // self makes this the only burst on it; pkts holds n owned mbufs
        // laid out as DPDK's pointer array. The device owns the first
        // `sent` afterwards.
        let sent =
            unsafe { sys::sw_eth_tx_burst(self.dev.port, self.queue, pkts.as_mut_ptr().cast(), n) };
        // The device frees the ones it took once sent: not our Drop.
        for m in pkts.drain(..usize::from(sent)) {
            std::mem::forget(m);
        }
        usize::from(sent)
    }
}

/// The text of a flow call's failure: the driver's message, else DPDK's
/// text for the error number.
///
/// # Safety
/// `msg` is null or the `message` a failed flow call left in its
/// `rte_flow_error`: a NUL-terminated string that outlives this call.
unsafe fn flow_error(ret: i32, msg: *const c_char) -> (i32, String) {
    let (errno, text) = negative(ret);
    if msg.is_null() {
        return (errno, text);
    }
    // SAFETY: the caller passes a NUL-terminated string that lives
    // through this call; it is copied out at once.
    let msg = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
    if msg == text {
        return (errno, text);
    }
    (errno, format!("{msg} ({text})"))
}

/// Whether port `port` (probed; started or not) takes a rule sending
/// IPv4/UDP packets to `udp_dst` to receive queue `queue`
/// (`rte_flow_validate`).
pub(crate) fn flow_validate(port: u16, udp_dst: u16, queue: u16) -> Result<(), (i32, String)> {
    let mut flow = std::ptr::null_mut();
    let mut msg = std::ptr::null();
    // SAFETY: flow and msg are valid places to write; the shim builds the
    // pattern and actions on its stack and validates them on a port id
    // DPDK checks.
    let ret = unsafe { sys::sw_flow_udp_to_queue(port, udp_dst, queue, 0, &mut flow, &mut msg) };
    if ret != 0 {
        // SAFETY: msg is null or the failed call's rte_flow_error message,
        // which drivers set to a string literal.
        return Err(unsafe { flow_error(ret, msg) });
    }
    Ok(())
}

/// An `rte_flow` rule of a started port, sending IPv4/UDP packets to one
/// UDP port to one receive queue; destroyed on drop, before its port can
/// stop (it holds the device).
#[derive(Debug)]
pub(crate) struct FlowRule {
    dev: Arc<Device>,
    flow: NonNull<sys::rte_flow>,
}

// SAFETY: the rule is a handle of its port; rte_flow calls on a port are
// serialised by ethdev for drivers that are not thread-safe, so it may be
// destroyed from any thread.
unsafe impl Send for FlowRule {}

impl FlowRule {
    /// Steer IPv4/UDP packets to `udp_dst` to receive queue `queue` of
    /// `dev` (`rte_flow_create`).
    pub(crate) fn create(
        dev: &Arc<Device>,
        udp_dst: u16,
        queue: u16,
    ) -> Result<Self, (i32, String)> {
        let mut flow = std::ptr::null_mut();
        let mut msg = std::ptr::null();
        // SAFETY: as in flow_validate; the port is started while dev
        // lives, and dev outlives the rule.
        let ret =
            unsafe { sys::sw_flow_udp_to_queue(dev.port, udp_dst, queue, 1, &mut flow, &mut msg) };
        if ret != 0 {
            // SAFETY: as in flow_validate.
            return Err(unsafe { flow_error(ret, msg) });
        }
        match NonNull::new(flow) {
            Some(flow) => Ok(Self {
                dev: Arc::clone(dev),
                flow,
            }),
            None => Err((0, "rte_flow_create gave no rule".to_owned())),
        }
    }
}

impl Drop for FlowRule {
    fn drop(&mut self) {
        // SAFETY: the rule was created on this port, which is still
        // started (self holds the device), and is destroyed once.
        let ret = unsafe { sys::sw_flow_destroy(self.dev.port, self.flow.as_ptr()) };
        if ret != 0 {
            tracing::debug!(port = self.dev.port, ret, "rte_flow_destroy failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_devices_queues_are_handed_out_once() {
        crate::testing::eal();
        let pool =
            Mempool::new("starwire_unit_p0", 1023, 32, sys::SOCKET_ID_ANY, false).expect("mempool");
        let setup = DeviceSetup {
            queues: 2,
            rx_desc: 128,
            tx_desc: 128,
        };
        let dev = Device::start(0, setup, Arc::new(pool), sys::SOCKET_ID_ANY).expect("start");
        let dev = Arc::new(dev);
        let queues = dev
            .take_queues()
            .expect("the first call hands the queues out");
        let indices: Vec<u16> = queues.iter().map(Queue::index).collect();
        assert_eq!(indices, [0, 1]);
        assert!(dev.take_queues().is_none(), "a second call is refused");
        let other = Arc::clone(&dev);
        let refused = std::thread::spawn(move || other.take_queues().is_none())
            .join()
            .unwrap();
        assert!(refused, "from another thread too");
        drop(queues);
        assert!(
            dev.take_queues().is_none(),
            "even once the first holders are gone"
        );
    }
}

//! One io_uring ring and everything it serves: [`Ring`] owns the
//! `IoUring`, the registered transmit pool, the receive pool with its
//! provided-buffer ring, and every connection (`Conn`: its socket, its
//! transmit stage, its receive state) that completions are dispatched to.
//! The driver (`crate::UringDriver`) is its only user and holds it by
//! value, so no call takes a lock.
//!
//! This module holds the structs, their construction and teardown, and the
//! per-connection entry points; the rest is split along its seams: [`op`]
//! (what a completion's user data says), [`submit`] (entering the ring and
//! dispatching completions), [`send`], [`receive`] and [`park`].
// The ring lends the kernel its memory through `sys`'s unsafe functions;
// each call says, in its SAFETY line, which invariant of `Ring` (the
// `sys` module documentation) keeps that memory for the kernel.
#![allow(unsafe_code)]

mod op;
mod own;
mod park;
mod receive;
mod send;
mod submit;

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use bytes::Bytes;
use io_uring::{cqueue, types::SubmitArgs, types::Timespec, IoUring};
use starwire_bufpool::{check_memlock, BufPool, Pages, SlotId};
use starwire_transport::reactor::{ParkEnd, ParkWaker};
use starwire_transport::{ConnId, TransportError};
use starwire_wire::FrameError;

use crate::probe::{probe, Features};
use crate::stage::{StageLimits, TxStage};
use crate::sys::{self, BufRing, SendMsg, Sock};
use crate::{RecvMode, UringConfig, UringError, UringStats};

use op::{armed_recv_op, user_data, BGID, OP_CANCEL, OP_EVENTFD, OP_POLL, OP_RECV_OWN};
use own::OwnBuf;
use receive::OWN_BID;
use send::unref_slot;
use submit::CQE_BATCH;

/// One queued piece of outgoing bytes.
#[derive(Debug)]
pub(crate) enum TxSeg {
    /// `len` bytes at `off` in a transmit slot.
    Slot { id: SlotId, off: usize, len: usize },
    /// A segment kept by reference.
    Shared(Bytes),
}

impl TxSeg {
    fn len(&self) -> usize {
        match self {
            Self::Slot { len, .. } => *len,
            Self::Shared(b) => b.len(),
        }
    }
}

/// A send the kernel holds.
struct Inflight {
    segs: Vec<TxSeg>,
    /// Read by the kernel until the result completion; kept here for that.
    msg: Box<SendMsg>,
    total: usize,
    /// A plain send (no `MSG_WAITALL`): a short count is resumed, not an
    /// error.
    resumable: bool,
    /// Its number among the connection's zero-copy sends.
    seq: u16,
    /// Its notification came before its result (not seen, but allowed).
    notif_seen: bool,
}

/// How the receive side ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxEnd {
    Eof,
    Reset,
    Errno(i32),
}

/// Per-connection state, reached by completions through the slab index.
pub(crate) struct Conn {
    stream: Option<TcpStream>,
    /// The socket as SQEs name it.
    sock: Sock,
    // Transmit.
    /// Frames written since the last flush (module `stage`), handed over
    /// to `queue` by `flush` or when the stage needs a new slot.
    pub(crate) stage: TxStage,
    queue: VecDeque<TxSeg>,
    queued_bytes: usize,
    slots_held: usize,
    inflight: Option<Inflight>,
    /// Zero-copy sends whose result came but whose notification did not
    /// yet: (sequence number, pieces). Their memory stays referenced until
    /// the kernel lets go of the pages, but the next send does not wait:
    /// over TCP the notification comes only once the peer acknowledged the
    /// data, which a delayed acknowledgement can hold back for tens of
    /// milliseconds.
    zc_held: VecDeque<(u16, Vec<TxSeg>)>,
    /// Bytes in `zc_held`, counted against `tx_queue_limit_bytes`.
    zc_held_bytes: usize,
    /// Sequence number of the next zero-copy send.
    zc_seq: u16,
    /// The buffers of the last completed send (its piece list and its
    /// `msghdr` with iovecs), emptied and kept for the next one: a send per
    /// busy turn allocated both afresh, and grew them by doubling, about
    /// eight allocations a send.
    spare: Option<(Vec<TxSeg>, Box<SendMsg>)>,
    send_error: Option<i32>,
    zero_copy: bool,
    // Receive.
    /// (buffer id, offset, end) of received bytes not yet consumed; buffer
    /// id [`OWN_BID`] is `own`.
    chunks: VecDeque<(u16, u32, u32)>,
    /// The connection's own receive buffer, for spin and single receives
    /// (`UringConfig::rx_conn_buf_len`, allocated at the first one). Each
    /// receive goes to its front once everything before was consumed, so
    /// the kernel's copy lands on the same cache-hot, aligned lines turn
    /// after turn (see [`OWN_ALIGN`]).
    own: OwnBuf,
    /// Where the next receive into `own` goes (rounded up to `OWN_ALIGN`),
    /// or, while one is in flight, where it started.
    own_end: u32,
    /// Chunks of `own` not yet consumed.
    own_refs: u32,
    /// A frame straddling buffers, being reassembled; also the target of
    /// direct receives (into its spare capacity).
    partial: Vec<u8>,
    /// The frame in `partial` is long enough for direct receives: its
    /// length.
    direct_want: Option<usize>,
    /// A direct receive into `partial` is in flight.
    direct_inflight: bool,
    /// A direct receive completed the frame in `partial`.
    direct_ready: bool,
    /// The last frame delivered was long (at least `rx_direct_min`): the
    /// next header is received directly.
    large_run: bool,
    /// Short frames delivered since the last long one (see
    /// [`after_frame`]).
    short_since_long: u32,
    /// The armed (multishot or single) receive was asked to stop for a
    /// direct receive.
    cancel_sent: bool,
    rx_end: Option<RxEnd>,
    frame_error: Option<FrameError>,
    recv_armed: bool,
    /// A park poll (`RecvMode::Spin`) is armed.
    poll_armed: bool,
    /// Detached: its handle is gone; the slot is freed once quiet.
    closing: bool,
    /// Reported failed (`Ring::fail`): skipped by the receive pass and
    /// the flush until detached.
    failed: bool,
    pub(crate) stats: ConnStats,
}

/// Counters of one connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Send SQEs issued.
    pub sends: u64,
    /// Of which zero-copy.
    pub zc_sends: u64,
    /// Zero-copy sends the kernel reported as copied.
    pub zc_copied: u64,
    /// Receive completions carrying data.
    pub recv_cqes: u64,
    /// Frames committed for sending.
    pub frames_sent: u64,
    /// Frames delivered.
    pub frames_received: u64,
    /// Bytes the kernel accepted.
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
}

impl Conn {
    fn quiet(&self) -> bool {
        self.inflight.is_none() && self.zc_held.is_empty() && !self.recv_armed && !self.poll_armed
    }
}

/// Memory the kernel writes into without pinning it (the provided
/// receive buffers and their ring): dropped with its owner unless
/// [`leak`](Self::leak)ed, when the ring goes with receives still armed.
struct KernelMem<T> {
    mem: std::mem::ManuallyDrop<T>,
    leaked: bool,
}

impl<T> KernelMem<T> {
    fn new(mem: T) -> Self {
        Self {
            mem: std::mem::ManuallyDrop::new(mem),
            leaked: false,
        }
    }

    /// Never free it: the kernel may still write to it.
    fn leak(&mut self) {
        self.leaked = true;
    }
}

impl<T> std::ops::Deref for KernelMem<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.mem
    }
}

impl<T> std::ops::DerefMut for KernelMem<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.mem
    }
}

impl<T> Drop for KernelMem<T> {
    fn drop(&mut self) {
        if !self.leaked {
            // SAFETY: dropped here once, and `mem` is not used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.mem) };
        }
    }
}

/// One io_uring ring, the memory it uses and the connections it serves.
pub(crate) struct Ring {
    // Field order is drop order: the ring goes before the memory it
    // references.
    /// With the count of requests in flight (`sys::Uring`).
    ring: sys::Uring,
    conns: Vec<Option<Conn>>,
    buf_ring: KernelMem<BufRing>,
    rx_pool: KernelMem<BufPool>,
    tx_pool: BufPool,
    pub(crate) cfg: UringConfig,
    pub(crate) features: Features,
    pub(crate) stats: UringStats,
    /// References to each transmit slot: one for the filling connection,
    /// one per queued or in-flight piece.
    slot_refs: Vec<u16>,
    /// Per receive buffer: bytes the kernel has filled (incremental
    /// consumption packs several receives into one buffer).
    rx_fill: Vec<u32>,
    /// Per receive buffer: chunks not yet consumed.
    rx_refs: Vec<u32>,
    /// Per receive buffer: the kernel is done with it (no `BUF_MORE`).
    rx_kernel_done: Vec<bool>,
    /// Receives to queue (again) at the next enter: a single receive that
    /// completed, a multishot one that ended, one after `ENOBUFS` or after
    /// a direct receive.
    rearm: Vec<usize>,
    /// A notification gave back held zero-copy bytes since the last
    /// [`Ring::end_turn`]: the turn that sees it counts as work, so
    /// a connection held back by them gets a turn with a fresh view.
    tx_freed: bool,
    /// Connections whose next receive is a direct one, not yet queued.
    direct: Vec<usize>,
    /// How parked-mode receives are armed: `None` multishot, else single
    /// receives of at most this many bytes (`RecvMode::Single`, or a
    /// kernel without multishot receive).
    single_len: Option<u32>,
    /// Slots of the registered file table (0: none registered).
    file_slots: u32,
    /// `RecvMode::Spin`: a non-blocking receive per connection per turn.
    spin: bool,
    /// The ring descriptor registered in a thread's io_uring context:
    /// (index, the thread's [`thread_token`]).
    registered: Option<(u32, u64)>,
    sqpoll: bool,
    /// False until the first `enter` enabled the (disabled) ring.
    enabled: bool,
    /// The registered eventfd parks wait on (`DEFER_TASKRUN`); owned by
    /// the driver, which drops it after this.
    park_eventfd: Option<RawFd>,
    /// The eventfd is enabled for a park and must be drained.
    eventfd_armed: bool,
    /// What a drain of the eventfd reads (boxed: the kernel writes it
    /// while the read is in flight).
    eventfd_buf: Box<std::cell::UnsafeCell<u64>>,
    /// A read draining the eventfd is in flight.
    eventfd_read_inflight: bool,
    /// The reactor waker (its [`ParkWaker::id`]) the last park was for.
    waker_id: u64,
    /// The generation (in its user data) of the armed poll of that
    /// waker's eventfd.
    waker_poll: Option<u64>,
    /// The generation of the last waker poll armed.
    waker_gen: u64,
    /// That poll completed since the last park: the reactor was woken.
    waker_fired: bool,
    /// Scratch of `reap`: (user data, result, flags) of completions.
    cqe_batch: Vec<(u64, i32, u32)>,
    /// Scratch of `rx_burst`: receive buffers whose last chunk it consumed.
    rx_freed: Vec<u16>,
    /// Where `queue_spin_receives` and `push_park_polls` start their next
    /// pass over the connections: after the last one a full SQ stopped
    /// them at, so that with more connections than SQ entries every one
    /// gets its turn (starting at 0 each time starved the ones past the
    /// SQ's size for good).
    conn_cursor: usize,
    /// Connections found failed, not yet reported (`Driver::poll_failure`).
    failures: VecDeque<(ConnId, TransportError)>,
}

fn os(e: std::io::Error, what: &'static str) -> UringError {
    UringError::Setup { what, source: e }
}

impl Ring {
    /// Set up a ring, its buffer pools and their registration, after
    /// probing the kernel and checking `RLIMIT_MEMLOCK`. Returns it with
    /// its park descriptor (see [`Ring::prepare_poll_park`]), which the
    /// caller closes after dropping the ring.
    pub(crate) fn new(cfg: &UringConfig) -> Result<(Self, OwnedFd), UringError> {
        cfg.validate()?;
        // The limit first: without CAP_IPC_LOCK, even probing creates rings
        // whose memory counts against it, and a limit that is too low then
        // shows as a bare ENOMEM from io_uring_setup.
        check_memlock(cfg.registered_bytes())?;
        let features = probe().map_err(UringError::Unavailable)?;
        if let Some(why) = features.unusable() {
            return Err(UringError::Unavailable(std::io::Error::other(why)));
        }
        let tx_pool =
            BufPool::new(cfg.slot_len(), cfg.tx_slots, cfg.huge_pages).map_err(UringError::Pool)?;
        check_memlock(tx_pool.mapped_len() as u64)?;
        let rx_pool =
            BufPool::new(cfg.rx_buf_len, cfg.rx_bufs, cfg.huge_pages).map_err(UringError::Pool)?;
        let mut b = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder();
        b.setup_cqsize(cfg.cq_entries);
        let sqpoll = cfg.sqpoll_idle_ms.is_some();
        if let Some(idle) = cfg.sqpoll_idle_ms {
            b.setup_sqpoll(idle);
        } else {
            // Created disabled: a single-issuer ring belongs to the thread
            // that enables it, which is the reactor's (first `enter`), not
            // the thread that set it up.
            if features.single_issuer {
                b.setup_single_issuer().setup_r_disabled();
            }
            if features.defer_taskrun && cfg.defer_taskrun {
                b.setup_defer_taskrun().setup_taskrun_flag();
            } else if features.coop_taskrun {
                b.setup_coop_taskrun().setup_taskrun_flag();
            }
        }
        let mut ring = b
            .build(cfg.sq_entries)
            .map_err(|e| os(e, "io_uring_setup"))?;
        // SAFETY: the transmit pool's whole mapping, which `Ring` drops
        // after the ring (field order).
        match unsafe { sys::register_buffer(&ring, tx_pool.base_ptr(), tx_pool.mapped_len()) } {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                // The pre-check passed but the user's pinned total is over:
                // the same advice applies.
                let limit = starwire_bufpool::memlock_status()?.limit.unwrap_or(0);
                let needed = tx_pool.mapped_len() as u64;
                return Err(UringError::Memlock(
                    starwire_bufpool::MemlockError::TooLow {
                        needed,
                        limit,
                        kib: needed.div_ceil(1024),
                    },
                ));
            }
            Err(e) => return Err(os(e, "IORING_REGISTER_BUFFERS")),
        }
        let entries = (cfg.rx_bufs as u16).next_power_of_two();
        let mut buf_ring = BufRing::new(entries).map_err(|e| os(e, "mapping the buffer ring"))?;
        // SAFETY: `Ring` drops the buffer ring after the ring (field
        // order).
        unsafe { buf_ring.register(&ring, BGID, features.pbuf_incremental) }
            .map_err(|e| os(e, "IORING_REGISTER_PBUF_RING"))?;
        for i in 0..cfg.rx_bufs {
            let id = slot_id(i);
            // SAFETY: buffer `i` of the receive pool, `rx_buf_len` bytes,
            // given to the kernel once; `Ring` drops the pool after
            // the ring (field order) and reads a buffer only where a
            // completion reported bytes, adding it again only once they
            // were consumed (`release_rx_quiet`).
            unsafe { buf_ring.add(rx_pool.slot_ptr(id), cfg.rx_buf_len as u32, i as u16) };
        }
        buf_ring.publish();
        let defer = features.defer_taskrun && cfg.defer_taskrun && !sqpoll;
        let fd = if defer {
            // Deferred work wakes neither poll(2) on the ring fd nor a
            // sleeping task outside io_uring_enter, but it signals a
            // registered eventfd. The eventfd stays disabled while the
            // reactor polls and is enabled only for a park on it
            // (`prepare_poll_park`).
            let efd = nix::sys::eventfd::EventFd::from_value_and_flags(
                0,
                nix::sys::eventfd::EfdFlags::EFD_NONBLOCK
                    | nix::sys::eventfd::EfdFlags::EFD_CLOEXEC,
            )
            .map_err(|e| os(e.into(), "eventfd"))?;
            ring.submitter()
                .register_eventfd(efd.as_raw_fd())
                .map_err(|e| os(e, "IORING_REGISTER_EVENTFD"))?;
            ring.completion().disable_eventfd();
            OwnedFd::from(efd)
        } else {
            ring.as_fd()
                .try_clone_to_owned()
                .map_err(|e| os(e, "dup of the ring fd"))?
        };
        // Single receives of at most `recv_chunk_len` (validated to fit a
        // u32) unless multishot was asked for and the kernel has it.
        let single_len = (cfg.recv != RecvMode::Multishot || !features.recv_multishot)
            .then(|| u32::try_from(cfg.recv_chunk_len).unwrap_or(u32::MAX));
        // A registered file table spares every request the descriptor
        // lookup; the kernel caps its size at RLIMIT_NOFILE. Connections
        // beyond it, or a kernel that refuses, use plain descriptors.
        let file_slots = nofile_soft().min(MAX_FILE_SLOTS);
        let file_slots = match sys::register_file_table(&ring, file_slots) {
            Ok(()) => file_slots,
            Err(e) => {
                tracing::debug!(error = %e, "uring: no registered file table");
                0
            }
        };
        let disabled = features.single_issuer && cfg.sqpoll_idle_ms.is_none();
        let stats = UringStats {
            file_slots,
            tx_pages: pages_name(tx_pool.pages()),
            registered_bytes: tx_pool.mapped_len() as u64,
            ..UringStats::default()
        };
        let park_eventfd = defer.then(|| fd.as_raw_fd());
        let ring = Self {
            ring: sys::Uring::new(ring),
            conns: Vec::new(),
            buf_ring: KernelMem::new(buf_ring),
            rx_pool: KernelMem::new(rx_pool),
            tx_pool,
            cfg: cfg.clone(),
            features,
            stats,
            slot_refs: vec![0; cfg.tx_slots],
            rx_fill: vec![0; cfg.rx_bufs],
            rx_refs: vec![0; cfg.rx_bufs],
            rx_kernel_done: vec![false; cfg.rx_bufs],
            rearm: Vec::new(),
            direct: Vec::new(),
            tx_freed: false,
            single_len,
            file_slots,
            spin: cfg.recv == RecvMode::Spin,
            registered: None,
            sqpoll,
            enabled: !disabled,
            park_eventfd,
            eventfd_armed: false,
            eventfd_buf: Box::new(std::cell::UnsafeCell::new(0)),
            eventfd_read_inflight: false,
            waker_id: 0,
            waker_poll: None,
            waker_gen: 0,
            waker_fired: false,
            cqe_batch: Vec::with_capacity(CQE_BATCH),
            rx_freed: Vec::new(),
            conn_cursor: 0,
            failures: VecDeque::new(),
        };
        Ok((ring, fd))
    }

    /// True when a reactor parks inside the ring ([`park`](Self::park)):
    /// it defers its completion work (`DEFER_TASKRUN`, no SQPOLL), which
    /// only an issuer waiting in `io_uring_enter` runs.
    pub(crate) fn parks_in_ring(&self) -> bool {
        self.park_eventfd.is_some()
    }

    /// Make the park descriptor `park_fd` (from [`new`](Self::new)) ready
    /// for a reactor to `poll(2)`: readable when completions or deferred
    /// work wait.
    ///
    /// Called only when the reactor is about to park; for a
    /// `DEFER_TASKRUN` ring this enables the eventfd (the next
    /// [`end_turn`](Self::end_turn) disables and drains it again), and
    /// makes it readable at once when work is already pending.
    pub(crate) fn prepare_poll_park(&mut self, park_fd: BorrowedFd<'_>) {
        if self.spin {
            // Submitted below, with nothing else: a poll takes no data.
            self.arm_park_polls();
        } else if !self.rearm.is_empty() || !self.direct.is_empty() {
            // Receives completed by the last enter wait to be queued again
            // (a caller may park without another turn): queue them now,
            // or no data would wake this park.
            if let Err(e) = self.enter() {
                tracing::debug!(error = %e, "uring: re-arming receives before a park failed");
            }
        }
        // The park polls above, and what a park in the ring queued and
        // could not submit (it failed, and the reactor polls instead).
        self.submit_queued();
        if self.park_eventfd.is_some() && !self.eventfd_armed {
            self.eventfd_armed = true;
            self.ring.completion().enable_eventfd();
            let pending = {
                let sq = self.ring.submission();
                sq.taskrun() || sq.cq_overflow()
            } || !self.ring.completion().is_empty();
            if pending {
                // Work raced with enabling: do not sleep on it.
                let _ = nix::unistd::write(park_fd, &1u64.to_ne_bytes());
            }
        }
    }

    /// Park the calling reactor (the ring's issuer) in the ring: one
    /// `io_uring_enter` that submits what waits (receives to queue again,
    /// spin mode's readability polls, a readability poll of `waker`),
    /// sleeps until a completion is posted or `timeout`, and runs the
    /// deferred work of the completions that wake it; then reap. It
    /// replaces a `poll(2)` on the park descriptor, the eventfd's signal
    /// and drain, and the enter that followed.
    ///
    /// `None` unless the ring defers its work
    /// ([`parks_in_ring`](Self::parks_in_ring)); and `None` when the enter
    /// fails for a reason a retry does not cure, so that the reactor polls
    /// the park descriptor instead.
    pub(crate) fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        self.park_eventfd?;
        let (fd, pending, ready) = self.prepare_park(waker)?;
        let start = std::time::Instant::now();
        let r = match ready {
            true if pending == 0 => Ok(0),
            true => sys::enter_raw(fd, pending as u32, 0),
            false => sys::enter_wait(fd, pending as u32, timeout),
        };
        self.finish_park(r, !ready, start.elapsed() >= timeout)
    }

    /// The end of a reactor turn: submit what the connections queued and
    /// run deferred completion work with one `io_uring_enter`, if there is
    /// anything to do; then reap completions. Returns true when it
    /// submitted or reaped anything.
    pub(crate) fn end_turn(&mut self) -> std::io::Result<bool> {
        let entered = self.enter()?;
        let reaped = self.reap();
        let freed = std::mem::take(&mut self.tx_freed);
        Ok(reaped > 0 || entered || freed)
    }
}

/// Most slots of a ring's registered file table.
const MAX_FILE_SLOTS: u32 = 1024;

/// The soft `RLIMIT_NOFILE`, as a table size.
fn nofile_soft() -> u32 {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) => u32::try_from(soft).unwrap_or(u32::MAX),
        Err(_) => 0,
    }
}

/// A number unique to the calling thread for the life of the process
/// (thread ids and thread-local addresses are reused after a thread ends;
/// a ring registered by an ended thread must not look like ours).
fn thread_token() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TOKEN.with(|t| *t)
}

fn pages_name(p: &Pages) -> String {
    p.to_string()
}

fn slot_id(i: usize) -> SlotId {
    starwire_bufpool::SlotId::from_index(i)
}

impl Ring {
    fn maybe_free(&mut self, idx: usize) {
        let free = matches!(self.conns.get(idx), Some(Some(c)) if c.closing && c.quiet());
        if free {
            if let Some(c) = self.conns[idx].take() {
                self.drop_conn_memory(c);
            }
        }
    }

    fn drop_conn_memory(&mut self, mut c: Conn) {
        if let Sock::Fixed(slot) = c.sock {
            // The table's reference is the last one to the socket: until
            // it goes the socket stays open. The kernel refuses the update
            // only off the ring's issuer thread (a driver used by a thread
            // other than its reactor's); the slot then keeps the socket
            // until the next connection in it or the ring's end, and the
            // peer saw the end anyway (`remove_conn` shut the socket down).
            if let Err(e) = sys::set_file_slot(&self.ring, slot, -1) {
                tracing::debug!(error = %e, slot, "uring: clearing a file-table slot failed");
            }
        }
        // Nothing of the connection is in flight or queued any more: no
        // SQE names its descriptor, which may close now (`remove_conn`).
        drop(c.stream.take());
        for seg in std::mem::take(&mut c.queue) {
            if let TxSeg::Slot { id, .. } = seg {
                unref_slot(&mut self.tx_pool, &mut self.slot_refs, &mut c, id);
            }
        }
        for (bid, _, _) in c.chunks.drain(..) {
            if bid != OWN_BID {
                self.release_rx_quiet(bid);
            }
        }
        self.buf_ring.publish();
    }

    // ---- the connection-facing side, called by the driver ----

    /// Serve `stream` as a new connection (its receive queued for the
    /// next enter). Returns its index, which its completions carry.
    pub(crate) fn add_conn(&mut self, stream: TcpStream) -> Result<usize, TransportError> {
        let fd = stream.as_raw_fd();
        // A peer whose address is unknown (the socket already failed) is
        // taken as remote; its sends fail anyway.
        let loopback = starwire_transport::socket::peer_is_loopback(&stream).unwrap_or(false);
        let idx = self
            .conns
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.conns.len());
        // Handles are 32 bits (`ConnId`); user data has room for 40.
        let Ok(slot) = u32::try_from(idx) else {
            return Err(TransportError::Io(std::io::Error::other(
                "uring: no connection handle left",
            )));
        };
        let sock = if slot < self.file_slots && sys::set_file_slot(&self.ring, slot, fd).is_ok() {
            // The update replaced whatever the slot still held.
            Sock::Fixed(slot)
        } else {
            // Off the issuer thread of an enabled ring the table refuses
            // updates: the connection names its socket by descriptor.
            Sock::Fd(fd)
        };
        let cfg = &self.cfg;
        let c = Conn {
            stream: Some(stream),
            sock,
            stage: TxStage::new(StageLimits {
                max_frame_len: cfg.max_frame_len,
                slot_len: cfg.slot_len(),
                queue_limit: cfg.tx_queue_limit_bytes,
                gather_copy_threshold: cfg.gather_copy_threshold,
            }),
            queue: VecDeque::new(),
            queued_bytes: 0,
            slots_held: 0,
            inflight: None,
            zc_held: VecDeque::new(),
            zc_held_bytes: 0,
            zc_seq: 0,
            spare: None,
            send_error: None,
            zero_copy: cfg.zero_copy
                && (!loopback || cfg.zero_copy_loopback)
                && (self.features.sendmsg_zc || self.features.send_zc),
            chunks: VecDeque::new(),
            partial: Vec::new(),
            direct_want: None,
            direct_inflight: false,
            direct_ready: false,
            large_run: false,
            short_since_long: 0,
            cancel_sent: false,
            rx_end: None,
            frame_error: None,
            recv_armed: false,
            own: OwnBuf::default(),
            own_end: 0,
            own_refs: 0,
            poll_armed: false,
            closing: false,
            failed: false,
            stats: ConnStats::default(),
        };
        if idx == self.conns.len() {
            self.conns.push(Some(c));
        } else {
            self.conns[idx] = Some(c);
        }
        if !self.spin {
            self.rearm.push(idx);
            self.rearm_receives();
        }
        Ok(idx)
    }

    /// Connection `idx`, unless detached (or never attached).
    pub(crate) fn attached(&self, idx: usize) -> Option<&Conn> {
        match self.conns.get(idx) {
            Some(Some(c)) if !c.closing => Some(c),
            _ => None,
        }
    }

    /// Connection `idx`, mutably, if attached and not failed: one the
    /// message layer may still write frames into.
    pub(crate) fn live_mut(&mut self, idx: usize) -> Option<&mut Conn> {
        match self.conns.get_mut(idx) {
            Some(Some(c)) if !c.closing && !c.failed => Some(c),
            _ => None,
        }
    }

    /// One past the highest connection index in use.
    pub(crate) fn conns_len(&self) -> usize {
        self.conns.len()
    }

    pub(crate) fn conn(&self, idx: usize) -> &Conn {
        self.conns[idx].as_ref().expect("live connection")
    }

    /// Requests whose last completion has not been reaped.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> u64 {
        self.ring.in_flight()
    }

    /// Report connection `idx` failed with `e`, once; the receive pass
    /// and the flush skip it from now on.
    pub(crate) fn fail(&mut self, idx: usize, e: TransportError) {
        if let Some(Some(c)) = self.conns.get_mut(idx) {
            if !c.failed && !c.closing {
                c.failed = true;
                self.failures.push_back((ConnId::new(idx as u32), e));
            }
        }
    }

    /// The next failure not yet reported.
    pub(crate) fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        self.failures.pop_front()
    }

    /// Connection `idx` was detached: what its stage holds is dropped, its
    /// socket shut down and its requests cancelled; the slot is freed once
    /// the kernel gave back everything of it.
    pub(crate) fn remove_conn(&mut self, idx: usize) {
        let own = self.own_receives();
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        if c.closing {
            return;
        }
        if let Some(id) = c.stage.discard() {
            unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
        }
        c.closing = true;
        let id = ConnId::new(idx as u32);
        self.failures.retain(|(f, _)| *f != id);
        // Shut the socket down so the peer sees the end now and the armed
        // receive completes. The descriptor stays open until the slot is
        // freed (`drop_conn_memory`): an SQE queued and not yet submitted
        // (the receive `add_conn` queued, say) may name it by number
        // (`Sock::Fd`), and a number closed now could be another socket's
        // by the next enter, whose bytes the receive would then take.
        if let Some(s) = c.stream.as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if c.recv_armed {
            let _ = sys::push_cancel(
                &mut self.ring,
                user_data(idx, armed_recv_op(c, own)),
                user_data(idx, OP_CANCEL),
            );
        }
        if c.poll_armed {
            let fd_ud = user_data(idx, OP_POLL);
            let _ = sys::push_cancel(&mut self.ring, fd_ud, user_data(idx, OP_CANCEL));
        }
        self.maybe_free(idx);
    }
}

impl Ring {
    /// Requests the kernel may hold: all those in flight under SQPOLL
    /// (its thread takes queued SQEs at any time), else those in flight
    /// less the SQEs still queued (only an enter submits them; a ring
    /// never enabled holds none).
    fn kernel_held(&mut self) -> u64 {
        let in_flight = self.ring.in_flight();
        if self.sqpoll {
            in_flight
        } else {
            in_flight.saturating_sub(self.queued() as u64)
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The registration holds a reference to the ring file: undo it on
        // the thread that made it. Dropped elsewhere, it goes when that
        // thread exits.
        if let Some((i, t)) = self.registered {
            if t == thread_token() {
                let _ = sys::unregister_ring_fd(&self.ring, i);
            }
        }
        // Cancel what the kernel still holds and wait (bounded) for the
        // completions, so no request outlives the memory it points into.
        if self.kernel_held() == 0 {
            return;
        }
        let _ = sys::push_cancel_all(&mut self.ring, u64::MAX);
        let ts = Timespec::new().nsec(10_000_000);
        let args = SubmitArgs::new().timespec(&ts);
        for _ in 0..100 {
            if self.ring.submitter().submit_with_args(1, &args).is_err() {
                // EEXIST: dropped on a thread other than the ring's issuer
                // (a shard handed back after its reactor stopped). The
                // kernel cancels what is left when the ring closes.
                break;
            }
            loop {
                let Some(cqe) = self.ring.completion().next() else {
                    break;
                };
                // The cancellation's own completion too: it was counted
                // when it was queued.
                if !cqueue::more(cqe.flags()) {
                    self.ring.completed();
                }
                if cqe.user_data() & 0xff == OP_EVENTFD {
                    self.eventfd_read_inflight = false;
                }
            }
            if self.ring.in_flight() == 0 {
                break;
            }
        }
        if self.kernel_held() > 0 {
            // Requests the kernel may still hold: a direct receive writes
            // into its connection's frame buffer, so leak those buffers
            // rather than free memory the kernel could write to.
            // Likewise the memory of sends whose notification did not
            // come (the kernel may still transmit from those pages; slots
            // are in the pool's mapping, which the pinned pages outlive).
            // A multishot receive writes into the provided buffers at the
            // addresses their ring names, which nothing pins, and the ring
            // may outlive this value (its descriptor is duplicated for the
            // park, and registered on its issuer thread): leak both.
            self.buf_ring.leak();
            self.rx_pool.leak();
            if self.eventfd_read_inflight {
                // The kernel may still write the count.
                std::mem::forget(std::mem::take(&mut self.eventfd_buf));
            }
            let own = self.own_receives();
            for c in self.conns.iter_mut().flatten() {
                if c.direct_inflight {
                    std::mem::forget(std::mem::take(&mut c.partial));
                }
                if c.recv_armed && armed_recv_op(c, own) == OP_RECV_OWN {
                    c.own.leak();
                }
                std::mem::forget(std::mem::take(&mut c.zc_held));
                if let Some(inf) = c.inflight.take() {
                    std::mem::forget(inf);
                }
            }
        }
    }
}

#[cfg(test)]
mod testing {
    use std::net::{SocketAddr, TcpListener, TcpStream};

    /// An `Rpc` frame of `id` whose body is `body` bytes of `id`.
    pub(super) fn rpc_frame(id: u64, body: usize) -> Vec<u8> {
        let mut f = starwire_wire::Header::new(starwire_wire::Opcode::Rpc, id, body as u32)
            .to_bytes()
            .to_vec();
        f.resize(f.len() + body, id as u8);
        f
    }

    pub(super) fn loopback_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{loopback_pair, rpc_frame};
    use super::*;
    use crate::UringDriver;
    use std::io::{Read, Write};

    /// The identity of the open file behind `fd`, or `None` when `fd` is
    /// closed.
    fn file_id(fd: RawFd) -> Option<(u64, u64)> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `st` is valid for the write of one `stat`; a closed
        // `fd` is reported (EBADF), not used.
        if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::EBADF), "fstat: {e}");
            return None;
        }
        // SAFETY: `fstat` succeeded, so it filled `st`.
        let st = unsafe { st.assume_init() };
        Some((st.st_dev, st.st_ino))
    }

    /// A connection named by its descriptor (no file-table slot) detached
    /// before its receive was submitted: the receive SQE names the
    /// descriptor by number, so the socket stays open until the slot is
    /// freed (after the enter that submits and ends that receive), and a
    /// socket opened meanwhile can neither take that number nor lose its
    /// bytes to the receive.
    #[test]
    fn a_detached_connection_keeps_its_descriptor_until_its_slot_is_freed() {
        for recv in [RecvMode::Single, RecvMode::Multishot] {
            let cfg = UringConfig {
                recv,
                ..UringConfig::default()
            };
            let mut d = UringDriver::new(&cfg).unwrap();
            let r = d.ring_mut();
            // No file table: the SQEs name the socket by descriptor.
            r.file_slots = 0;
            let (a, _peer) = loopback_pair();
            let fd = a.as_raw_fd();
            let id = file_id(fd).expect("open");
            let idx = r.add_conn(a).unwrap();
            assert_eq!(r.conn(idx).sock, Sock::Fd(fd), "{recv:?}");
            assert!(r.queued() > 0, "{recv:?}: the receive is not submitted yet");
            r.remove_conn(idx);
            assert!(
                r.conns[idx].is_some(),
                "{recv:?}: freed with a receive queued"
            );
            assert_eq!(
                file_id(fd),
                Some(id),
                "{recv:?}: the descriptor a queued SQE names was closed"
            );
            // Another connection's socket, opened while the SQE waits.
            let (mut x, mut y) = loopback_pair();
            assert!(
                x.as_raw_fd() != fd && y.as_raw_fd() != fd,
                "{recv:?}: the number was reused"
            );
            let frame = rpc_frame(7, 64);
            y.write_all(&frame).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while r.conns[idx].is_some() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{recv:?}: never freed"
                );
                r.end_turn().unwrap();
            }
            // Freed: the socket went with the slot (the number may have
            // been taken by another thread's file since).
            assert_ne!(
                file_id(fd),
                Some(id),
                "{recv:?}: the socket outlived its slot"
            );
            // The other socket's bytes are all still there.
            let mut got = vec![0u8; frame.len()];
            x.read_exact(&mut got).unwrap();
            assert_eq!(got, frame, "{recv:?}");
        }
    }
}

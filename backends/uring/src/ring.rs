//! One ring per reactor, shared by the connections bound to it.
//!
//! [`RingInner`] owns the `IoUring`, the registered transmit pool, the
//! receive pool with its provided-buffer ring, and the per-connection
//! state (`Conn`) that completions are dispatched to. Transports queue SQEs
//! and read their connection's state; [`UringReactor::enter`] makes the one
//! `io_uring_enter` of a reactor turn.
// The ring lends the kernel its memory through `sys`'s unsafe functions;
// each call says, in its SAFETY line, which invariant of `RingInner` (the
// `sys` module documentation) keeps that memory for the kernel.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

/// The ring's lock. Nearly every acquisition is the reactor thread's own
/// (three a turn: `rx_burst`, `flush`, the enter; a park in the ring
/// lets go of it while it sleeps), uncontended; other
/// threads take it rarely (a transport made or dropped elsewhere, counters)
/// and briefly (at most one non-blocking `io_uring_enter`). A spin lock
/// whose unlock is a plain release store suits that better than
/// `std::sync::Mutex`, whose unlock is a locked exchange that waits for
/// the turn's stores to drain: +0.5% to +1.0% on the rate bench together
/// with the per-chunk receive loop (18 alternating pairs, 11-25). A waiter
/// yields its time slice between tries, so a holder preempted on the same
/// core is not spun against. There is no poisoning: a panic in a critical
/// section unwinds through the guard, which unlocks.
type Mutex<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;
type MutexGuard<'a, T> = spin::mutex::SpinMutexGuard<'a, T>;

use bytes::Bytes;
use io_uring::{cqueue, types::SubmitArgs, types::Timespec, IoUring};
use starwire_bufpool::{check_memlock, BufPool, Pages, SlotId};
use starwire_transport::reactor::{ParkEnd, ParkWaker};
use starwire_transport::TransportError;
use starwire_wire::{FrameError, Header, HEADER_LEN};

use crate::probe::{probe, Features};
use crate::stage::{Handover, RingView, TxStage};
use crate::sys::{self, BufRing, RecvWait, SendKind, SendMsg, SlotPtr, Sock};
use crate::{RecvMode, UringConfig, UringError, UringStats};

/// Buffer group of the receive pool.
const BGID: u16 = 7;
const OP_RECV: u64 = 1;
const OP_SEND: u64 = 2;
const OP_CANCEL: u64 = 3;
/// A one-shot readability poll armed before a park (`RecvMode::Spin`).
const OP_POLL: u64 = 4;
/// A single-shot receive straight into a frame buffer.
const OP_RECV_DIRECT: u64 = 5;
/// A receive into the connection's own buffer (`RecvMode::Spin`, non-blocking,
/// and `RecvMode::Single`).
const OP_RECV_OWN: u64 = 6;
/// A read draining the park eventfd, submitted with the first enter after
/// a park (its user data carries no connection).
const OP_EVENTFD: u64 = 7;
/// A one-shot readability poll of the reactor's eventfd, armed by a park
/// in the ring (its user data carries no connection).
const OP_WAKER: u64 = 8;
/// The "buffer id" of chunks in a connection's own receive buffer (never a
/// provided buffer's: those are below 32768).
const OWN_BID: u16 = u16::MAX;
/// Receives into a connection's own buffer start on this boundary.
///
/// Measured here (AMD EPYC guest, 11-25): with 4128-byte frames, whose
/// length is 32 mod 64, receives that continued where the last one ended
/// (incremental provided buffers) started every other frame on an odd half
/// cache line, and the receiving side's `copy_to_user` took 4 to 10 times
/// as long per byte as tcp's into the front of its buffer: the rate bench
/// fell to 0.53-0.86x tcp in most runs, and never with 4096-byte frames
/// (`docs/backends/uring.md`, "Where receives land").
const OWN_ALIGN: usize = 64;
/// A connection's receive waits while its own buffer has less room than
/// this and still holds unconsumed bytes: the application is behind, and
/// the buffer starts over once it caught up.
const OWN_MIN_ROOM: usize = 4096;
/// Spin mode skips a connection's receive while this many received chunks
/// wait to be consumed: the application is behind.
const SPIN_MAX_CHUNKS: usize = 16;
/// Completions copied out of the CQ at a time (see `RingInner::reap`).
const CQE_BATCH: usize = 32;
/// Most iovecs in one send.
const MAX_IOV: usize = 64;

/// Most zero-copy sends of one connection waiting for their notifications.
const ZC_HELD_MAX: usize = 256;

/// Bits of a completion's user data that carry the connection index
/// (above the op byte, below a zero-copy send's sequence number).
const CONN_MASK: u64 = (1 << 40) - 1;

fn user_data(conn: usize, op: u64) -> u64 {
    (((conn as u64) & CONN_MASK) << 8) | op
}

/// A send's user data: with the connection's sequence number of its
/// zero-copy sends in the top 16 bits, which its notification carries too.
fn send_user_data(conn: usize, seq: u16) -> u64 {
    user_data(conn, OP_SEND) | (u64::from(seq) << 48)
}

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
    // Transmit. Frames are written outside the lock, in the transport's
    // stage (module `stage`), and handed over here by `flush`.
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
    own: Box<[u8]>,
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
    /// The transport was dropped; free the slot once quiet.
    closing: bool,
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
    /// Keep a send's buffers, emptied, for the connection's next send.
    fn keep_spare(&mut self, mut segs: Vec<TxSeg>, mut msg: Box<SendMsg>) {
        segs.clear();
        msg.iov.clear();
        self.spare = Some((segs, msg));
    }

    fn quiet(&self) -> bool {
        self.inflight.is_none() && self.zc_held.is_empty() && !self.recv_armed && !self.poll_armed
    }
}

pub(crate) struct RingInner {
    // Field order is drop order: the ring goes before the memory it
    // references.
    ring: IoUring,
    conns: Vec<Option<Conn>>,
    buf_ring: BufRing,
    rx_pool: BufPool,
    tx_pool: BufPool,
    pub(crate) cfg: UringConfig,
    pub(crate) features: Features,
    stats: UringStats,
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
    /// [`UringReactor::enter`]: the turn that sees it counts as work, so
    /// a transport held back by them gets a turn with a fresh view.
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
    /// the [`UringReactor`], which drops it after this.
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
    /// SQEs whose completion has not been reaped.
    outstanding: u64,
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
    /// File-table slots of connections freed on another thread, whose
    /// clearing the kernel refused there (`EEXIST`: a single-issuer ring
    /// takes table updates from its issuer only). The table still holds
    /// their sockets open, so the issuer's next enter clears them.
    stale_slots: Vec<u32>,
}

/// A ring and the memory it uses, shared by the connections of one reactor.
///
/// Cheap to clone. The mutex is never contended (one reactor thread uses
/// it); it exists so a shard holding the ring can be handed back to the
/// thread that spawned the reactor.
#[derive(Clone)]
pub struct UringReactor {
    pub(crate) inner: Arc<Mutex<RingInner>>,
    /// What a parked reactor polls: the registered eventfd of a
    /// `DEFER_TASKRUN` ring, else a duplicate of the ring fd.
    fd: Arc<OwnedFd>,
}

impl std::fmt::Debug for UringReactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringReactor")
            .field("fd", &self.fd)
            .finish_non_exhaustive()
    }
}

fn os(e: std::io::Error, what: &'static str) -> UringError {
    UringError::Setup { what, source: e }
}

impl UringReactor {
    /// Set up a ring, its buffer pools and their registration, after
    /// probing the kernel and checking `RLIMIT_MEMLOCK`.
    pub fn new(cfg: &UringConfig) -> Result<Self, UringError> {
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
        // SAFETY: the transmit pool's whole mapping, which `RingInner` drops
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
        // SAFETY: `RingInner` drops the buffer ring after the ring (field
        // order).
        unsafe { buf_ring.register(&ring, BGID, features.pbuf_incremental) }
            .map_err(|e| os(e, "IORING_REGISTER_PBUF_RING"))?;
        for i in 0..cfg.rx_bufs {
            let id = slot_id(i);
            // SAFETY: buffer `i` of the receive pool, `rx_buf_len` bytes,
            // given to the kernel once; `RingInner` drops the pool after
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
            // reactor polls and is enabled only for a park (`fd()`).
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
        Ok(Self {
            inner: Arc::new(Mutex::new(RingInner {
                ring,
                conns: Vec::new(),
                buf_ring,
                rx_pool,
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
                park_eventfd: defer.then(|| fd.as_raw_fd()),
                eventfd_armed: false,
                eventfd_buf: Box::new(std::cell::UnsafeCell::new(0)),
                eventfd_read_inflight: false,
                waker_id: 0,
                waker_poll: None,
                waker_gen: 0,
                waker_fired: false,
                outstanding: 0,
                cqe_batch: Vec::with_capacity(CQE_BATCH),
                rx_freed: Vec::new(),
                conn_cursor: 0,
                stale_slots: Vec::new(),
            })),
            fd: Arc::new(fd),
        })
    }

    /// This ring's identity (equal for clones of one reactor).
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.inner) as *const () as usize
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, RingInner> {
        self.inner.lock()
    }

    /// The ring's file descriptor (a duplicate): readable when completions
    /// or deferred work wait, for a reactor to park on.
    ///
    /// The reactor asks for it only when it is about to park; for a
    /// `DEFER_TASKRUN` ring this enables the eventfd (the next
    /// [`enter`](Self::enter) disables and drains it again), and makes it
    /// readable at once when work is already pending.
    pub fn fd(&self) -> BorrowedFd<'_> {
        let mut r = self.lock();
        if r.spin {
            // Submitted below, with nothing else: a poll takes no data.
            r.push_park_polls();
        } else if !r.rearm.is_empty() || !r.direct.is_empty() {
            // Receives completed by the last enter wait to be queued again
            // (a caller may park without another turn): queue them now,
            // or no data would wake this park.
            if let Err(e) = r.enter() {
                tracing::debug!(error = %e, "uring: re-arming receives before a park failed");
            }
        }
        // The park polls above, and what a park in the ring queued and
        // could not submit (it failed, and the reactor polls instead).
        r.submit_queued();
        if r.park_eventfd.is_some() && !r.eventfd_armed {
            r.eventfd_armed = true;
            r.ring.completion().enable_eventfd();
            let pending = {
                let sq = r.ring.submission();
                sq.taskrun() || sq.cq_overflow()
            } || !r.ring.completion().is_empty();
            if pending {
                // Work raced with enabling: do not sleep on it.
                let _ = nix::unistd::write(self.fd.as_fd(), &1u64.to_ne_bytes());
            }
        }
        self.fd.as_fd()
    }

    /// Park the calling reactor (the ring's issuer) in the ring: one
    /// `io_uring_enter` that submits what waits (receives to queue again,
    /// spin mode's readability polls, a readability poll of `waker`),
    /// sleeps until a completion is posted or `timeout`, and runs the
    /// deferred work of the completions that wake it; then reap. It
    /// replaces the `poll(2)` on [`fd`](Self::fd), the eventfd's signal and
    /// drain, and the enter that followed. The ring's lock is not held
    /// while it sleeps.
    ///
    /// `None` unless the ring defers its work (`DEFER_TASKRUN`, no
    /// SQPOLL): only there does a waiting issuer run that work itself;
    /// and `None` when the enter fails for a reason a retry does not cure,
    /// so that the reactor polls [`fd`](Self::fd) instead.
    pub fn park(&self, waker: ParkWaker<'_>, timeout: Duration) -> Option<ParkEnd> {
        let (fd, pending, ready) = {
            let mut r = self.lock();
            r.park_eventfd?;
            r.prepare_park(waker)?
        };
        let start = std::time::Instant::now();
        // Unlocked: other threads (a transport made elsewhere, counters)
        // may take the lock meanwhile. Only this thread submits (a
        // single-issuer ring), and the SQEs it submits are the first
        // `pending` ones, queued above; any queued meanwhile wait for the
        // next enter.
        let r = match ready {
            true if pending == 0 => Ok(0),
            true => sys::enter_raw(fd, pending as u32, 0),
            false => sys::enter_wait(fd, pending as u32, timeout),
        };
        let mut inner = self.lock();
        inner.finish_park(r, !ready, start.elapsed() >= timeout)
    }

    /// Submit what the connections queued and run deferred completion work
    /// with one `io_uring_enter`, if there is anything to do; then reap
    /// completions. Call once per reactor turn. Returns true when it
    /// submitted or reaped anything.
    pub fn enter(&self) -> Result<bool, UringError> {
        let mut r = self.lock();
        let entered = r.enter().map_err(|e| os(e, "io_uring_enter"))?;
        let reaped = r.reap();
        let freed = std::mem::take(&mut r.tx_freed);
        Ok(reaped > 0 || entered || freed)
    }

    /// Counters of this ring.
    pub fn stats(&self) -> UringStats {
        self.lock().stats.clone()
    }

    /// What the kernel offered when the ring was made.
    pub fn features(&self) -> Features {
        self.lock().features.clone()
    }

    /// The configuration of this ring.
    pub fn config(&self) -> UringConfig {
        self.lock().cfg.clone()
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

/// Short frames after a long one before the connection gives back the
/// frame buffer the long one left (up to `max_frame_len`): enough that a
/// stream alternating long and short frames keeps it, few enough that a
/// connection which sent one long frame does not hold it for good.
const RELEASE_AFTER_SHORT: u32 = 64;

/// A frame buffer at least this long (or at least `rx_direct_min`, when
/// that is smaller) is a long frame's, given back after a run of short
/// frames. Without the cap, turning direct receives off (`rx_direct_min`
/// above `max_frame_len`) kept every buffer a long frame had been
/// reassembled in, up to 1 MiB per connection, for good.
const LONG_BUFFER_MIN: usize = 128 * 1024;

/// Bookkeeping after `c` delivered a frame of `len` bytes, with `partial`
/// empty: whether the next header is received directly, and whether the
/// frame buffer of a past long frame is given back (returned true).
fn after_frame(c: &mut Conn, len: usize, direct_min: usize) -> bool {
    debug_assert!(c.partial.is_empty() && !c.direct_inflight);
    c.large_run = len >= direct_min;
    let long = direct_min.min(LONG_BUFFER_MIN);
    if len >= long || c.partial.capacity() < long {
        c.short_since_long = 0;
        return false;
    }
    c.short_since_long += 1;
    if c.short_since_long < RELEASE_AFTER_SHORT {
        return false;
    }
    c.short_since_long = 0;
    c.partial = Vec::new();
    true
}

fn unref_slot(pool: &mut BufPool, refs: &mut [u16], c: &mut Conn, id: SlotId) {
    let r = &mut refs[id.index()];
    *r -= 1;
    if *r == 0 {
        pool.give(id);
        c.slots_held -= 1;
    }
}

/// The op of `c`'s armed receive (its user data's low byte), on a ring
/// whose single or spin receives go into the connections' own buffers
/// (`own`) or not (multishot).
fn armed_recv_op(c: &Conn, own: bool) -> u64 {
    if c.direct_inflight {
        OP_RECV_DIRECT
    } else if own {
        OP_RECV_OWN
    } else {
        OP_RECV
    }
}

/// What [`queue_own_recv`] did.
enum OwnRecv {
    Queued,
    /// The buffer is short of room and still holds unconsumed bytes: the
    /// receive waits until the application consumed them.
    NoRoom,
    SqFull,
}

/// Queue a receive of at most `max` bytes into `c`'s own buffer (allocated
/// here the first time, `own_len` long): from the start once every chunk
/// before was consumed, else after the last, on an `OWN_ALIGN` boundary.
///
/// # Safety
/// `c` is a connection of the ring that owns `ring`, kept by it as the
/// `sys` module's "Own receive buffers" says: while the receive is armed
/// (`recv_armed`, set here) `c.own` is neither freed, resized nor read
/// past the chunks received before it, and it is leaked if the ring goes
/// with the receive outstanding.
unsafe fn queue_own_recv(
    ring: &mut IoUring,
    c: &mut Conn,
    idx: usize,
    own_len: usize,
    max: usize,
    wait: RecvWait,
) -> OwnRecv {
    debug_assert!(!c.recv_armed);
    if c.own.is_empty() {
        c.own = vec![0u8; own_len].into_boxed_slice();
    }
    if c.own_refs == 0 {
        c.own_end = 0;
    }
    let at = (c.own_end as usize).next_multiple_of(OWN_ALIGN);
    let room = c.own.len().saturating_sub(at);
    if room < OWN_MIN_ROOM && c.own_refs > 0 {
        return OwnRecv::NoRoom;
    }
    // `own` is at most 1 GiB (validated), so `at` and the length fit.
    let len = room.min(max) as u32;
    let ptr = c.own[at..].as_mut_ptr();
    // SAFETY: `ptr..ptr + len` is inside `own` (`len` is at most the room
    // past `at`), past every unconsumed chunk, and the caller keeps it for
    // the kernel until the completion (this function's contract).
    if !unsafe { sys::push_recv_into(ring, c.sock, ptr, len, wait, user_data(idx, OP_RECV_OWN)) } {
        return OwnRecv::SqFull;
    }
    c.own_end = at as u32;
    c.recv_armed = true;
    OwnRecv::Queued
}

impl RingInner {
    /// One `io_uring_enter` when SQEs wait, deferred work is flagged
    /// (`IORING_SQ_TASKRUN`) or the CQ overflowed. Returns whether it
    /// entered.
    pub(crate) fn enter(&mut self) -> std::io::Result<bool> {
        if !self.enabled {
            self.ring.submitter().register_enable_rings()?;
            self.enabled = true;
        }
        self.clear_stale_slots();
        let drains = self.queue_eventfd_drain();
        let direct_spun = self.queue_direct_receives();
        self.rearm_receives();
        let spun = drains
            + direct_spun
            + if self.spin {
                self.queue_spin_receives()
            } else {
                0
            };
        let (pending, taskrun, overflow, wakeup) = {
            let mut sq = self.ring.submission();
            sq.sync();
            (
                sq.len(),
                sq.taskrun(),
                sq.cq_overflow(),
                self.sqpoll && sq.need_wakeup(),
            )
        };
        if pending == 0 && !taskrun && !overflow && !wakeup {
            return Ok(false);
        }
        if self.sqpoll && !wakeup && !taskrun && !overflow {
            // The kernel thread picks the SQEs up without a system call.
            self.ring.submission().sync();
            self.stats.sqes += pending as u64;
            self.outstanding += pending as u64;
            return Ok(pending > spun);
        }
        let registered = self.registered_index();
        // GETEVENTS only when the kernel flagged deferred completion work
        // (or the CQ overflowed, or SQPOLL needs a wakeup): what completes
        // while the SQEs are issued is posted by the submission itself,
        // and GETEVENTS adds a pass through the wait path to every call.
        // Under COOP_TASKRUN, task work runs on any entry anyway.
        let mut flags = if taskrun || overflow {
            sys::ENTER_GETEVENTS
        } else {
            0
        };
        self.stats.enters += 1;
        if registered.is_some() {
            self.stats.registered_enters += 1;
        }
        loop {
            let r = if self.sqpoll {
                // The crate adds the wakeup flag the kernel thread needs.
                self.ring.submit()
            } else {
                sys::enter(&self.ring, registered, pending as u32, flags)
            };
            match r {
                Ok(n) => {
                    self.stats.sqes += n as u64;
                    self.outstanding += n as u64;
                    // Spin receives alone are no work: a reactor whose
                    // turns only asked for data it did not get is idle and
                    // may park.
                    return Ok(pending > spun || taskrun || overflow || wakeup);
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    // The CQ is full: reap, then retry.
                    self.reap();
                    flags |= sys::ENTER_GETEVENTS;
                    self.stats.enters += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The ring's registered descriptor for the calling thread: registered
    /// on the first enter of a thread (the reactor's), used only by that
    /// thread (registrations are per thread).
    fn registered_index(&mut self) -> Option<u32> {
        let me = thread_token();
        match self.registered {
            Some((i, t)) if t == me => Some(i),
            Some(_) => None,
            None if self.sqpoll => None,
            None => match sys::register_ring_fd(&self.ring) {
                Ok(i) => {
                    self.registered = Some((i, me));
                    Some(i)
                }
                Err(e) => {
                    // Not fatal: enters go through the plain descriptor.
                    tracing::debug!(error = %e, "uring: IORING_REGISTER_RING_FDS failed");
                    self.registered = Some((u32::MAX, u64::MAX));
                    None
                }
            },
        }
    }

    /// The locked first half of [`UringReactor::park`]: queue what the
    /// park submits and say how to enter: the descriptor (the registered
    /// index or the ring fd, with its flag), the SQEs queued, and whether
    /// completions are already there (no sleep). `None` when the ring
    /// cannot be entered (the reactor then polls instead).
    fn prepare_park(&mut self, waker: ParkWaker<'_>) -> Option<(sys::EnterFd, usize, bool)> {
        if !self.enabled {
            if let Err(e) = self.ring.submitter().register_enable_rings() {
                tracing::warn!(error = %e, "uring: enabling the ring for a park failed");
                return None;
            }
            self.enabled = true;
        }
        self.clear_stale_slots();
        if self.spin {
            // Readability polls, submitted by the park's own enter (a
            // full SQ is submitted first, then the rest are queued).
            if self.push_park_polls() {
                self.submit_queued();
                self.push_park_polls();
            }
        } else {
            // Receives completed by the last enter go back in with this
            // one, or no data would end the park.
            self.queue_direct_receives();
            self.rearm_receives();
        }
        if self.waker_id != waker.id {
            if let Some(gen) = self.waker_poll.take() {
                // Another waker (the reactor run again on this thread with
                // a new eventfd): its number may even be the old one's,
                // so cancel the old poll; its completion is ignored (an
                // older generation).
                let target = user_data(gen as usize, OP_WAKER);
                let ud = user_data(CONN_MASK as usize, OP_CANCEL);
                self.push_or_submit(|ring| sys::push_cancel(ring, target, ud));
            }
            self.waker_fired = false;
            self.waker_id = waker.id;
        }
        // A poll that fired in a turn's reap ends this park at once
        // (`ready`); the next park arms another.
        if self.waker_poll.is_none() && !self.waker_fired {
            self.waker_gen = (self.waker_gen + 1) & CONN_MASK;
            let ud = user_data(self.waker_gen as usize, OP_WAKER);
            let fd = Sock::Fd(waker.fd.as_raw_fd());
            if !self.push_or_submit(|ring| sys::push_poll_in(ring, fd, ud)) {
                // Without the poll a wake-up could not end the sleep:
                // poll(2) instead (`fd()` submits what is queued).
                return None;
            }
            self.waker_poll = Some(self.waker_gen);
        }
        // Completions reaped since the last turn (the waker's among
        // them) end the park before it starts.
        let pending = self.queued();
        let ready = self.waker_fired || !self.ring.completion().is_empty();
        let registered = self.registered_index();
        let fd = sys::EnterFd::new(&self.ring, registered);
        if !ready || pending > 0 {
            self.stats.enters += 1;
            self.stats.registered_enters += u64::from(registered.is_some());
        }
        self.stats.ring_parks += u64::from(!ready);
        Some((fd, pending, ready))
    }

    /// The locked second half of [`UringReactor::park`]: account the
    /// enter's result `r`, reap, and say what ended the park (`slept`: it
    /// waited; `expired`: its whole timeout passed).
    fn finish_park(
        &mut self,
        r: std::io::Result<usize>,
        slept: bool,
        expired: bool,
    ) -> Option<ParkEnd> {
        let mut interrupted = false;
        match r {
            // The count submitted: a wait that timed out after submitting
            // returns it too, so only the reap below tells the ends apart.
            Ok(n) => {
                self.stats.sqes += n as u64;
                self.outstanding += n as u64;
            }
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) =>
            {
                // A signal, or a full CQ (the reap below makes room).
                interrupted = true;
            }
            Err(e) => {
                // Completions left in the CQ make `fd()` wake the poll at
                // once; SQEs left in the SQ are submitted by `fd()`.
                tracing::warn!(error = %e, "uring: park enter failed; polling instead");
                return None;
            }
        }
        let reaped = self.reap();
        Some(if std::mem::take(&mut self.waker_fired) {
            ParkEnd::Waker
        } else if reaped == 0 && slept && expired && !interrupted {
            ParkEnd::Timeout
        } else {
            ParkEnd::Input
        })
    }

    /// Clear the file-table slots that connections freed on another
    /// thread left holding their sockets (`stale_slots`). Called by the
    /// issuer, at each enter.
    fn clear_stale_slots(&mut self) {
        if self.stale_slots.is_empty() {
            return;
        }
        let mut stale = std::mem::take(&mut self.stale_slots);
        stale.retain(|&slot| sys::set_file_slot(&self.ring, slot, -1).is_err());
        self.stale_slots = stale;
    }

    /// SQEs queued and not yet submitted.
    fn queued(&mut self) -> usize {
        let mut sq = self.ring.submission();
        sq.sync();
        sq.len()
    }

    /// Queue an SQE with `push`; when the SQ is full, submit what is
    /// queued and try once more. Returns whether it was queued.
    fn push_or_submit(&mut self, push: impl Fn(&mut IoUring) -> bool) -> bool {
        if push(&mut self.ring) {
            return true;
        }
        self.stats.sq_full += 1;
        self.submit_queued();
        push(&mut self.ring)
    }

    /// Submit what is queued with a plain enter (no wait, no receives
    /// added): room in a full SQ, or polls before a park.
    fn submit_queued(&mut self) {
        let pending = self.queued();
        if pending == 0 {
            return;
        }
        let registered = self.registered_index();
        self.stats.enters += 1;
        self.stats.registered_enters += u64::from(registered.is_some());
        match sys::enter(&self.ring, registered, pending as u32, 0) {
            Ok(n) => {
                self.stats.sqes += n as u64;
                self.outstanding += n as u64;
            }
            Err(e) => tracing::debug!(error = %e, "uring: submitting a full SQ"),
        }
    }

    /// After a park: disable the eventfd again and queue a read that
    /// drains it, so that the enter this turn makes anyway does the drain
    /// and the park costs no `read(2)` of its own. The read is
    /// `RWF_NOWAIT`, so it completes inside that enter, with the count or
    /// `-EAGAIN` (nothing was written: the park ended otherwise).
    /// A full SQ, or a drain still in flight, falls back to `read(2)`.
    /// Returns the SQEs queued (0 or 1). `IORING_OP_READ` came with 5.6,
    /// older than any kernel this backend accepts (5.19).
    fn queue_eventfd_drain(&mut self) -> usize {
        let Some(efd) = self.park_eventfd.filter(|_| self.eventfd_armed) else {
            return 0;
        };
        self.eventfd_armed = false;
        self.ring.completion().disable_eventfd();
        self.stats.eventfd_reads += 1;
        if !self.eventfd_read_inflight {
            let buf: *mut u64 = self.eventfd_buf.get();
            let ud = user_data(CONN_MASK as usize, OP_EVENTFD);
            // SAFETY: the ring's boxed `eventfd_buf`, neither read nor
            // replaced while the read is in flight (`eventfd_read_inflight`,
            // set below) and leaked if the ring goes with it outstanding
            // (`sys`, "Eventfd drains").
            if unsafe { sys::push_read_u64(&mut self.ring, efd, buf, ud) } {
                self.eventfd_read_inflight = true;
                return 1;
            }
        }
        let mut b = [0u8; 8];
        // EAGAIN (nothing written) is fine.
        let _ = nix::unistd::read(efd, &mut b);
        self.stats.eventfd_read_syscalls += 1;
        0
    }

    /// Single and spin receives go into each connection's own buffer; only
    /// multishot ones (`single_len` `None` outside spin mode) draw from the
    /// provided buffers.
    fn own_receives(&self) -> bool {
        self.spin || self.single_len.is_some()
    }

    /// Connection indices from `conn_cursor` on, wrapping around.
    fn pass_order(&self) -> std::iter::Chain<std::ops::Range<usize>, std::ops::Range<usize>> {
        let n = self.conns.len();
        let start = self.conn_cursor.min(n);
        (start..n).chain(0..start)
    }

    /// `RecvMode::Spin`: queue a non-blocking receive into its own buffer
    /// for every connection that has none in flight and is keeping up with
    /// what it received. It takes what the socket holds, up to the room
    /// left, and completes inside the same enter (or with `-EAGAIN`).
    fn queue_spin_receives(&mut self) -> usize {
        let mut queued = 0;
        let own_len = self.cfg.rx_conn_buf_len;
        for idx in self.pass_order() {
            let Some(c) = self.conns[idx].as_mut() else {
                continue;
            };
            if c.closing
                || c.recv_armed
                || c.rx_end.is_some()
                || c.direct_want.is_some()
                || c.chunks.len() >= SPIN_MAX_CHUNKS
            {
                continue;
            }
            // SAFETY: `c` is this ring's connection, whose `own` the ring
            // keeps while its receive is armed (`sys`, "Own receive
            // buffers").
            match unsafe {
                queue_own_recv(&mut self.ring, c, idx, own_len, usize::MAX, RecvWait::Now)
            } {
                OwnRecv::Queued => queued += 1,
                OwnRecv::NoRoom => {}
                OwnRecv::SqFull => {
                    self.stats.sq_full += 1;
                    // The rest first next time.
                    self.conn_cursor = idx;
                    break;
                }
            }
        }
        queued
    }

    /// Queue a direct receive for each connection waiting for one: the
    /// rest of its frame, straight into the frame buffer. A multishot
    /// receive still armed is cancelled first (the bytes it already took
    /// arrive as chunks, in order, before its last completion), and chunks
    /// still waiting are consumed by `rx_burst` first; either way the
    /// connection stays on the list until its receive is queued.
    ///
    /// Returns how many non-blocking (spin mode) receives it queued: like
    /// spin receives, they are no work by themselves, so a reactor whose
    /// peer went quiet in the middle of a long frame (or after one) may
    /// still park.
    fn queue_direct_receives(&mut self) -> usize {
        if self.direct.is_empty() {
            return 0;
        }
        let mut queued = 0;
        let mut keep = Vec::new();
        let own = self.own_receives();
        for idx in std::mem::take(&mut self.direct) {
            let Some(Some(c)) = self.conns.get_mut(idx) else {
                continue;
            };
            let Some(frame_len) = c.direct_want else {
                continue;
            };
            if c.closing || c.rx_end.is_some() || c.direct_inflight {
                continue;
            }
            if !c.chunks.is_empty() {
                keep.push(idx);
                continue;
            }
            if c.recv_armed {
                if !self.spin && !c.cancel_sent {
                    let target = user_data(idx, armed_recv_op(c, own));
                    if sys::push_cancel(&mut self.ring, target, user_data(idx, OP_CANCEL)) {
                        c.cancel_sent = true;
                        self.stats.direct_cancels += 1;
                    }
                }
                keep.push(idx);
                continue;
            }
            let have = c.partial.len();
            let want = frame_len.saturating_sub(have);
            let Ok(len) = u32::try_from(want) else {
                // Frames are bounded by max_frame_len (at most 1 GiB).
                continue;
            };
            if len == 0 {
                continue;
            }
            c.partial.reserve_exact(want);
            let ptr = c.partial.spare_capacity_mut().as_mut_ptr().cast::<u8>();
            let wait = if self.spin {
                RecvWait::Now
            } else {
                RecvWait::All
            };
            // SAFETY: `len` bytes of `partial`'s spare capacity (reserved
            // above), which the ring leaves alone while the receive is in
            // flight (`direct_inflight`, set below) and leaks if it goes
            // with it outstanding (`sys`, "Direct receives").
            if !unsafe {
                sys::push_recv_into(
                    &mut self.ring,
                    c.sock,
                    ptr,
                    len,
                    wait,
                    user_data(idx, OP_RECV_DIRECT),
                )
            } {
                self.stats.sq_full += 1;
                keep.push(idx);
                continue;
            }
            c.recv_armed = true;
            c.direct_inflight = true;
            self.stats.direct_recvs += 1;
            queued += usize::from(self.spin);
        }
        self.direct = keep;
        queued
    }

    /// A direct receive completed: take its bytes into the frame buffer.
    fn complete_direct(&mut self, idx: usize, res: i32) {
        let spin = self.spin;
        let (max_body, max_message) = self.frame_limits();
        let direct_min = self.cfg.rx_direct_min;
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        c.recv_armed = false;
        c.direct_inflight = false;
        match res {
            n if n > 0 => {
                let n = n as usize;
                // SAFETY: the direct receive that completed was given
                // `partial`'s spare capacity from its length on, and the
                // `Vec` was left alone while it was in flight (`sys`,
                // "Direct receives"); the kernel wrote the `n` bytes.
                if !unsafe { sys::commit_received(&mut c.partial, n) } {
                    c.rx_end = Some(RxEnd::Errno(libc::EINVAL));
                    return;
                }
                self.stats.recv_cqes += 1;
                self.stats.direct_bytes += n as u64;
                c.stats.recv_cqes += 1;
                c.stats.bytes_received += n as u64;
                if c.closing {
                    return;
                }
                let have = c.partial.len();
                if have < HEADER_LEN {
                    // Short (non-blocking, or interrupted): ask again.
                    self.direct.push(idx);
                    return;
                }
                match Header::parse(&c.partial, max_body, max_message) {
                    Ok(h) if have >= h.frame_len() => {
                        // Complete: `rx_burst` delivers it and decides how
                        // the next frame is received.
                        c.direct_want = None;
                        c.direct_ready = true;
                    }
                    Ok(h) if h.frame_len() >= direct_min => {
                        // The rest of a long frame (or its body, after a
                        // direct receive of its header): again.
                        c.direct_want = Some(h.frame_len());
                        self.direct.push(idx);
                    }
                    Ok(_) => {
                        // A header that opens a short frame: its body comes
                        // the usual way.
                        c.direct_want = None;
                        if !spin {
                            self.rearm.push(idx);
                        }
                    }
                    Err(_) => {
                        // `rx_burst` reports it.
                        c.direct_want = None;
                        c.direct_ready = true;
                    }
                }
            }
            0 => c.rx_end = Some(RxEnd::Eof),
            e if e == -libc::EAGAIN => {
                self.stats.rx_empty += 1;
                if !c.closing {
                    self.direct.push(idx);
                }
            }
            e if e == -libc::ECONNRESET || e == -libc::EPIPE => {
                c.rx_end = Some(RxEnd::Reset);
            }
            e if e == -libc::ECANCELED => {}
            e => c.rx_end = Some(RxEnd::Errno(-e)),
        }
    }

    /// `RecvMode::Spin`, before a park: queue a one-shot readability poll
    /// for every connection that has none (the caller submits them). A
    /// poll consumes no data, so it cannot reorder the stream; its
    /// completion only wakes the reactor, whose next turns receive.
    /// Returns true when the SQ filled up first.
    fn push_park_polls(&mut self) -> bool {
        for idx in self.pass_order() {
            let Some(c) = self.conns[idx].as_mut() else {
                continue;
            };
            if c.closing || c.poll_armed || c.rx_end.is_some() {
                continue;
            }
            if !sys::push_poll_in(&mut self.ring, c.sock, user_data(idx, OP_POLL)) {
                self.stats.sq_full += 1;
                self.conn_cursor = idx;
                return true;
            }
            c.poll_armed = true;
            self.stats.park_polls += 1;
        }
        false
    }

    /// Dispatch every available completion. Returns how many, not
    /// counting spin receives that found no data.
    pub(crate) fn reap(&mut self) -> usize {
        // Copied out a batch at a time: each `completion()` synchronises
        // with the kernel's tail and, when dropped, publishes the head, so
        // one per completion cost two atomic operations each.
        let mut batch = std::mem::take(&mut self.cqe_batch);
        let mut n = 0;
        loop {
            batch.clear();
            batch.extend(
                self.ring
                    .completion()
                    .take(CQE_BATCH)
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            if batch.is_empty() {
                break;
            }
            for &(ud, res, flags) in &batch {
                let op = ud & 0xff;
                let empty = op == OP_EVENTFD
                    || op == OP_WAKER
                    || (res == -libc::EAGAIN
                        && (op == OP_RECV || op == OP_RECV_DIRECT || op == OP_RECV_OWN));
                n += usize::from(!empty);
                self.complete(ud, res, flags);
            }
        }
        self.cqe_batch = batch;
        n
    }

    fn complete(&mut self, ud: u64, res: i32, flags: u32) {
        let idx = ((ud >> 8) & CONN_MASK) as usize;
        let op = ud & 0xff;
        let more = cqueue::more(flags);
        if !more {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
        match op {
            OP_RECV => self.complete_recv(idx, res, flags),
            OP_RECV_DIRECT => self.complete_direct(idx, res),
            OP_RECV_OWN => self.complete_own(idx, res),
            OP_SEND => self.complete_send(idx, res, flags, (ud >> 48) as u16),
            OP_POLL => {
                if let Some(Some(c)) = self.conns.get_mut(idx) {
                    c.poll_armed = false;
                }
            }
            OP_EVENTFD => {
                self.eventfd_read_inflight = false;
                return;
            }
            OP_WAKER => {
                // Only the armed poll's completion counts (a cancelled
                // one, of an earlier waker, carries another generation).
                if self.waker_poll == Some(idx as u64) {
                    self.waker_poll = None;
                    self.waker_fired = true;
                }
                return;
            }
            _ => {}
        }
        self.maybe_free(idx);
    }

    /// A multishot receive's completion (the only receives that draw
    /// from the provided buffers).
    fn complete_recv(&mut self, idx: usize, res: i32, flags: u32) {
        let more = cqueue::more(flags);
        let bid = cqueue::buffer_select(flags);
        // Account the bytes in the buffer first: with incremental
        // consumption they start where the last receive into it ended.
        let chunk = match bid {
            Some(b) if usize::from(b) < self.rx_fill.len() => {
                let b_ = usize::from(b);
                let start = self.rx_fill[b_];
                let n = res.max(0) as u32;
                self.rx_fill[b_] = start + n;
                self.rx_refs[b_] += 1;
                if !cqueue::buffer_more(flags) {
                    self.rx_kernel_done[b_] = true;
                }
                Some((b, start, start + n))
            }
            _ => None,
        };
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            if let Some((b, ..)) = chunk {
                self.release_rx(b);
            }
            return;
        };
        if !more {
            c.recv_armed = false;
            c.cancel_sent = false;
        }
        match res {
            n if n > 0 => {
                self.stats.recv_cqes += 1;
                c.stats.recv_cqes += 1;
                c.stats.bytes_received += n as u64;
                match chunk {
                    Some(ch) if !c.closing => c.chunks.push_back(ch),
                    Some((b, ..)) => self.release_rx(b),
                    None => c.rx_end = Some(RxEnd::Errno(libc::EINVAL)),
                }
                if !more && !self.conns[idx].as_ref().is_some_and(|c| c.closing) {
                    self.rearm.push(idx);
                }
            }
            0 => {
                c.rx_end = Some(RxEnd::Eof);
                if let Some((b, ..)) = chunk {
                    self.release_rx(b);
                }
            }
            e if e == -libc::ENOBUFS => {
                self.stats.rx_enobufs += 1;
                if !c.closing {
                    self.rearm.push(idx);
                }
            }
            e if e == -libc::ECONNRESET || e == -libc::EPIPE => {
                c.rx_end = Some(RxEnd::Reset);
            }
            e if e == -libc::ECANCELED => {
                // Stopped for a direct receive (re-armed once that is
                // done; `rearm_receives` skips it until then) or closing.
                if !c.closing {
                    self.rearm.push(idx);
                }
            }
            e => c.rx_end = Some(RxEnd::Errno(-e)),
        }
    }

    /// A receive into the connection's own buffer completed.
    fn complete_own(&mut self, idx: usize, res: i32) {
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        c.recv_armed = false;
        c.cancel_sent = false;
        match res {
            n if n > 0 => {
                let start = c.own_end as usize;
                let end = start + n as usize;
                if end > c.own.len() {
                    // More than the room it was given: not a kernel that
                    // keeps to the requested length.
                    c.rx_end = Some(RxEnd::Errno(libc::EINVAL));
                    return;
                }
                self.stats.recv_cqes += 1;
                c.stats.recv_cqes += 1;
                c.stats.bytes_received += n as u64;
                if c.closing {
                    return;
                }
                // `end` is within `own`, at most 1 GiB.
                c.chunks.push_back((OWN_BID, start as u32, end as u32));
                c.own_end = end as u32;
                c.own_refs += 1;
                if !self.spin {
                    // A single receive: the next goes at the next enter.
                    self.rearm.push(idx);
                }
            }
            0 => c.rx_end = Some(RxEnd::Eof),
            e if e == -libc::EAGAIN && self.spin => self.stats.rx_empty += 1,
            e if e == -libc::ECONNRESET || e == -libc::EPIPE => {
                c.rx_end = Some(RxEnd::Reset);
            }
            e if e == -libc::EAGAIN || e == -libc::ECANCELED => {
                // Stopped for a direct receive (re-armed once that is
                // done; `rearm_receives` skips it until then), or closing.
                if !c.closing && !self.spin {
                    self.rearm.push(idx);
                }
            }
            e => c.rx_end = Some(RxEnd::Errno(-e)),
        }
    }

    fn complete_send(&mut self, idx: usize, res: i32, flags: u32, seq: u16) {
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        if cqueue::notif(flags) {
            // The kernel let go of the pages of zero-copy send `seq`.
            if res & sys::NOTIF_USAGE_ZC_COPIED != 0 {
                self.stats.zc_copied += 1;
                c.stats.zc_copied += 1;
                if c.zero_copy {
                    c.zero_copy = false;
                    self.stats.zc_fallbacks += 1;
                    tracing::debug!(
                        conn = idx,
                        "uring: zero-copy send was copied; plain send from now on"
                    );
                }
            }
            if let Some(pos) = c.zc_held.iter().position(|(s, _)| *s == seq) {
                self.tx_freed = true;
                let (_, segs) = c.zc_held.remove(pos).expect("found above");
                for seg in segs {
                    c.zc_held_bytes -= seg.len();
                    if let TxSeg::Slot { id, .. } = seg {
                        unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
                    }
                }
            } else if let Some(inf) = c.inflight.as_mut().filter(|i| i.seq == seq) {
                inf.notif_seen = true;
            }
            return;
        }
        // The send's result: the send is over, whatever comes after.
        let Some(mut inf) = c.inflight.take() else {
            return;
        };
        let mut done = 0;
        if res < 0 {
            if res != -libc::ECANCELED {
                c.send_error = Some(-res);
            }
        } else {
            done = res as usize;
            c.stats.bytes_sent += res as u64;
        }
        if done < inf.total && c.send_error.is_none() && !inf.resumable {
            // Zero-copy sends carry MSG_WAITALL and return short only on an
            // error or a signal: the stream cannot be resumed in order, so
            // end the connection.
            c.send_error = Some(libc::EIO);
        }
        // A notification still due holds the pages, not the stream: the
        // pieces wait for it in `zc_held` and the next send may go.
        if cqueue::more(flags) && !inf.notif_seen {
            c.zc_held_bytes += inf.total;
            c.zc_held
                .push_back((inf.seq, std::mem::take(&mut inf.segs)));
            c.keep_spare(Vec::with_capacity(MAX_IOV), inf.msg);
            return;
        }
        // A plain send that the socket took only part of (it was full) is
        // resumed: the unsent rest goes back to the front of the queue, in
        // order, for the next flush; what was sent lets go of its memory.
        // This keeps the socket topped up every turn, as a non-blocking
        // write(2) does, instead of one send waiting in the kernel for room.
        let resume = done < inf.total && c.send_error.is_none();
        let mut skip = done;
        let mut rest: Vec<TxSeg> = Vec::new();
        for seg in inf.segs.drain(..) {
            let len = seg.len();
            if skip >= len {
                skip -= len;
                if let TxSeg::Slot { id, .. } = seg {
                    unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
                }
                continue;
            }
            let seg = match seg {
                TxSeg::Slot { id, off, len } => TxSeg::Slot {
                    id,
                    off: off + skip,
                    len: len - skip,
                },
                TxSeg::Shared(b) => TxSeg::Shared(b.slice(skip..)),
            };
            skip = 0;
            if resume {
                rest.push(seg);
            } else if let TxSeg::Slot { id, .. } = seg {
                unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
            }
        }
        c.keep_spare(inf.segs, inf.msg);
        if !rest.is_empty() {
            self.stats.short_sends += 1;
        }
        for seg in rest.into_iter().rev() {
            c.queued_bytes += seg.len();
            c.queue.push_front(seg);
        }
    }

    /// One chunk of buffer `bid` was consumed; give the buffer back to the
    /// kernel once the kernel is done with it and no chunk is left.
    fn release_rx(&mut self, bid: u16) {
        if self.release_rx_quiet(bid) {
            self.buf_ring.publish();
        }
    }

    fn release_rx_quiet(&mut self, bid: u16) -> bool {
        let b = usize::from(bid);
        self.rx_refs[b] -= 1;
        if self.rx_refs[b] > 0 || !self.rx_kernel_done[b] {
            return false;
        }
        self.rx_fill[b] = 0;
        self.rx_kernel_done[b] = false;
        let id = slot_id(b);
        // SAFETY: buffer `b` of the receive pool, whose chunks were all
        // consumed and which the kernel is done with (no `BUF_MORE`): it
        // goes back to the kernel as at setup (`Ring::new`).
        unsafe {
            self.buf_ring
                .add(self.rx_pool.slot_ptr(id), self.cfg.rx_buf_len as u32, bid)
        };
        true
    }

    fn rearm_receives(&mut self) {
        if self.rearm.is_empty() {
            return;
        }
        let mut keep = Vec::new();
        for idx in std::mem::take(&mut self.rearm) {
            let Some(Some(c)) = self.conns.get_mut(idx) else {
                continue;
            };
            if c.closing || c.recv_armed || c.rx_end.is_some() || c.direct_want.is_some() {
                continue;
            }
            let queued = match self.single_len {
                // Single receives go into the connection's own buffer.
                // SAFETY: `c` is this ring's connection, whose `own` the
                // ring keeps while its receive is armed (`sys`, "Own
                // receive buffers").
                Some(max) => match unsafe {
                    queue_own_recv(
                        &mut self.ring,
                        c,
                        idx,
                        self.cfg.rx_conn_buf_len,
                        max as usize,
                        RecvWait::Some,
                    )
                } {
                    OwnRecv::Queued => true,
                    // `rx_burst` asks again once it consumed the chunks.
                    OwnRecv::NoRoom => continue,
                    OwnRecv::SqFull => false,
                },
                None => {
                    sys::push_recv_multishot(&mut self.ring, c.sock, BGID, user_data(idx, OP_RECV))
                }
            };
            if queued {
                c.recv_armed = true;
                self.stats.recv_arms += 1;
            } else {
                keep.push(idx);
            }
        }
        self.rearm = keep;
    }

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
            // it goes the socket stays open and the peer sees no end.
            // Off the issuer thread the kernel refuses; the issuer's next
            // enter clears it.
            if sys::set_file_slot(&self.ring, slot, -1).is_err() {
                self.stale_slots.push(slot);
            }
        }
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

    // ---- the connection-facing side, called by `UringTransport` ----

    pub(crate) fn add_conn(&mut self, stream: TcpStream) -> usize {
        let fd = stream.as_raw_fd();
        // A peer whose address is unknown (the socket already failed) is
        // taken as remote; its sends fail anyway.
        let loopback = starwire_transport::socket::peer_is_loopback(&stream).unwrap_or(false);
        let idx = self
            .conns
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.conns.len());
        let sock = match u32::try_from(idx) {
            Ok(slot)
                if slot < self.file_slots && sys::set_file_slot(&self.ring, slot, fd).is_ok() =>
            {
                // The update replaced whatever the slot still held.
                self.stale_slots.retain(|&s| s != slot);
                Sock::Fixed(slot)
            }
            // Off the issuer thread of an enabled ring the table refuses
            // updates: the connection names its socket by descriptor.
            _ => Sock::Fd(fd),
        };
        let c = Conn {
            stream: Some(stream),
            sock,
            queue: VecDeque::new(),
            queued_bytes: 0,
            slots_held: 0,
            inflight: None,
            zc_held: VecDeque::new(),
            zc_held_bytes: 0,
            zc_seq: 0,
            spare: None,
            send_error: None,
            zero_copy: self.cfg.zero_copy
                && (!loopback || self.cfg.zero_copy_loopback)
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
            own: Box::default(),
            own_end: 0,
            own_refs: 0,
            poll_armed: false,
            closing: false,
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
        idx
    }

    pub(crate) fn conn(&self, idx: usize) -> &Conn {
        self.conns[idx].as_ref().expect("live connection")
    }

    pub(crate) fn conn_stats(&self, idx: usize) -> ConnStats {
        self.conn(idx).stats
    }

    /// The transport of `idx` went away; `fill` is the slot its stage was
    /// filling (what it staged is dropped).
    pub(crate) fn remove_conn(&mut self, idx: usize, fill: Option<SlotId>) {
        let own = self.own_receives();
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        if let Some(id) = fill {
            unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
        }
        c.closing = true;
        // Shut the socket down so the peer sees the end now and the armed
        // receive completes; the file itself closes when the
        // kernel drops its last reference.
        if let Some(s) = c.stream.take() {
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

    /// Queue what the transport of `idx` staged, in order, let go of the
    /// slot it stopped filling, and refresh its view of the ring. The fill
    /// is kept when `keep_fill` (or a reservation in it is outstanding).
    pub(crate) fn hand_over(&mut self, idx: usize, st: &mut TxStage, keep_fill: bool) {
        let h = st.take_handover(keep_fill);
        self.queue_handover(idx, st, h);
        self.update_view(idx, st);
    }

    /// Queue the pieces of a hand-over, after the bookkeeping.
    fn queue_handover(&mut self, idx: usize, st: &mut TxStage, h: Handover) {
        self.account_handover(idx, &h);
        let c = self.conns[idx].as_mut().expect("live connection");
        let mut segs = h.segs;
        for seg in segs.drain(..) {
            c.queued_bytes += seg.len();
            // A piece that continues the last queued one in the same slot
            // (a kept fill flushed while a send is in flight) joins it: one
            // iovec and one reference instead of one per flush.
            if let (
                TxSeg::Slot { id, off, len },
                Some(TxSeg::Slot {
                    id: pid,
                    off: poff,
                    len: plen,
                }),
            ) = (&seg, c.queue.back_mut())
            {
                if id == pid && *poff + *plen == *off {
                    *plen += len;
                    self.slot_refs[id.index()] -= 1;
                    continue;
                }
            }
            c.queue.push_back(seg);
        }
        st.return_segs(segs);
    }

    /// The bookkeeping of a hand-over, wherever its pieces go: a
    /// reference per slot piece, the fill let go of, the counters.
    fn account_handover(&mut self, idx: usize, h: &Handover) {
        let c = self.conns[idx].as_mut().expect("live connection");
        for seg in &h.segs {
            if let TxSeg::Slot { id, .. } = seg {
                self.slot_refs[id.index()] += 1;
            }
        }
        if let Some(id) = h.release {
            unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
        }
        c.stats.frames_sent += h.frames;
        self.stats.frames_sent += h.frames;
        self.stats.tx_heap_frames += h.heap_frames;
    }

    /// Tell the transport of `idx` what its stage cannot know: the bytes
    /// queued here, whether anything waits or is in flight, and a send
    /// error.
    pub(crate) fn update_view(&self, idx: usize, st: &mut TxStage) {
        let c = self.conn(idx);
        st.view = RingView {
            queued: c.queued_bytes + c.zc_held_bytes,
            pending: c.inflight.is_some() || !c.queue.is_empty(),
            send_error: c.send_error,
        };
    }

    /// Give back the fill the transport of `idx` kept across a flush, once
    /// it saw no frame for a turn.
    pub(crate) fn release_idle_fill(&mut self, idx: usize, st: &mut TxStage) {
        if let Some(id) = st.take_idle_fill() {
            let c = self.conns[idx].as_mut().expect("live connection");
            unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
        }
    }

    /// A new slot for the transport of `idx` to write into, after handing
    /// over what it staged and letting go of its full one. `Ok(false)`
    /// under back-pressure: the connection holds
    /// [`UringConfig::tx_slots_per_conn`] slots, or the pool is empty.
    ///
    /// # Safety
    /// `st` is the stage of the transport of connection `idx`: it hands its
    /// pieces over to this ring only, and is last used while that
    /// transport still holds this ring (an `Arc` of it), so the pool's
    /// mapping outlives the fill it gets here.
    pub(crate) unsafe fn refill(
        &mut self,
        idx: usize,
        st: &mut TxStage,
    ) -> Result<bool, TransportError> {
        self.hand_over(idx, st, false);
        self.check_send_error(idx)?;
        let per_conn = self.cfg.tx_slots_per_conn;
        let c = self.conns[idx].as_mut().expect("live connection");
        if c.slots_held >= per_conn {
            return Ok(false);
        }
        let Some(id) = self.tx_pool.take() else {
            self.stats.tx_pool_empty += 1;
            return Ok(false);
        };
        self.slot_refs[id.index()] = 1;
        c.slots_held += 1;
        // SAFETY: slot `id` of this ring's pool, `slot_len` bytes, just
        // taken for this connection alone (one reference, the fill's): the
        // ring reads only what the stage hands over and returns the slot
        // to the pool only once the fill's reference is dropped; the
        // caller keeps the mapping alive for the stage (this function's
        // contract).
        unsafe { st.set_fill(id, SlotPtr::new(self.tx_pool.slot_ptr(id))) };
        Ok(true)
    }

    fn check_send_error(&self, idx: usize) -> Result<(), TransportError> {
        match self.conn(idx).send_error {
            None => Ok(()),
            Some(e) if e == libc::EPIPE || e == libc::ECONNRESET => Err(TransportError::Closed),
            Some(e) => Err(TransportError::Io(std::io::Error::from_raw_os_error(e))),
        }
    }

    /// Hand over what the transport of `idx` staged, and queue one send
    /// SQE for everything queued, unless one is in flight.
    pub(crate) fn flush(&mut self, idx: usize, st: &mut TxStage) -> Result<(), TransportError> {
        // A flush that sent frames keeps the fill for the next turn's ones
        // while it has room and the pool is not short; otherwise (and when
        // nothing was staged) the fill goes back, unless a reservation in
        // it is outstanding. A kept fill that sees no frame for a turn goes
        // back at the next `rx_burst` (`release_idle_fill`), so an idle
        // connection holds no transmit memory, and a ring's pool serves
        // any number of connections.
        let keep = st.has_staged()
            && st.fill_room() >= self.cfg.slot_len() / 4
            && 2 * self.tx_pool.free_slots() >= self.tx_pool.slots();
        let h = st.take_handover(keep);
        let c = self.conn(idx);
        if c.inflight.is_none()
            && c.queue.is_empty()
            && c.send_error.is_none()
            && !h.segs.is_empty()
            && h.segs.len() <= MAX_IOV
        {
            // Nothing queued before these pieces: they become the send as
            // they are, without a pass through the queue.
            self.account_handover(idx, &h);
            let c = self.conns[idx].as_mut().expect("live connection");
            let (spare_segs, msg) = c
                .spare
                .take()
                .unwrap_or_else(|| (Vec::with_capacity(MAX_IOV), SendMsg::with_capacity(MAX_IOV)));
            st.return_segs(spare_segs);
            let total = h.segs.iter().map(TxSeg::len).sum();
            c.queued_bytes += total;
            self.submit_send(idx, h.segs, msg, total);
            self.update_view(idx, st);
            return Ok(());
        }
        self.queue_handover(idx, st, h);
        let r = self.send_queued(idx);
        self.update_view(idx, st);
        r
    }

    /// One send SQE for what is queued (at most `MAX_IOV` pieces), unless
    /// a send is in flight.
    fn send_queued(&mut self, idx: usize) -> Result<(), TransportError> {
        self.check_send_error(idx)?;
        let c = self.conns[idx].as_mut().expect("live connection");
        if c.inflight.is_some() {
            return Ok(());
        }
        if c.queue.is_empty() {
            return Ok(());
        }
        let (mut segs, msg) = c
            .spare
            .take()
            .unwrap_or_else(|| (Vec::with_capacity(MAX_IOV), SendMsg::with_capacity(MAX_IOV)));
        debug_assert!(segs.is_empty() && msg.iov.is_empty());
        let mut total = 0;
        while segs.len() < MAX_IOV {
            let Some(seg) = c.queue.pop_front() else {
                break;
            };
            total += seg.len();
            segs.push(seg);
        }
        self.submit_send(idx, segs, msg, total);
        Ok(())
    }

    /// Queue one send SQE for `segs` (`total` bytes, counted in the
    /// connection's `queued_bytes`), their iovecs written into `msg`. When
    /// the SQ is full they go back to the front of the queue, in order.
    fn submit_send(&mut self, idx: usize, segs: Vec<TxSeg>, mut msg: Box<SendMsg>, total: usize) {
        let zc_ok = self.features.sendmsg_zc;
        let zc_fixed_ok = self.features.send_zc;
        let threshold = self.cfg.zero_copy_threshold;
        let c = self.conns[idx].as_mut().expect("live connection");
        let mut segs = segs;
        debug_assert!(msg.iov.is_empty() && segs.len() <= MAX_IOV);
        for seg in &segs {
            let (ptr, len) = match seg {
                TxSeg::Slot { id, off, len } => {
                    (self.tx_pool.slot_ptr(*id).wrapping_add(*off), *len)
                }
                TxSeg::Shared(b) => (b.as_ptr(), b.len()),
            };
            msg.iov.push(sys::iovec(ptr, len));
        }
        c.queued_bytes -= total;
        msg.seal();
        // Past `ZC_HELD_MAX` sends waiting for their notifications, send
        // plainly: it bounds the list, and keeps sequence numbers (16
        // bits) unique among the sends a notification may be for.
        let kind = if c.zero_copy && total >= threshold && c.zc_held.len() < ZC_HELD_MAX {
            match &segs[..] {
                [TxSeg::Slot { .. }] if zc_fixed_ok => SendKind::ZeroCopyFixed(0),
                _ if zc_ok => SendKind::ZeroCopyMsg,
                _ => SendKind::Plain,
            }
        } else {
            SendKind::Plain
        };
        let seq = if kind == SendKind::Plain { 0 } else { c.zc_seq };
        // SAFETY: `msg` is sealed; it and the pieces its iovecs point into
        // (pool slots with a reference each, `Bytes` held by the pieces,
        // each within its slot or buffer) go into `inflight` below, and on
        // to `zc_held` until a zero-copy send's notification: the ring
        // keeps them until then and leaks them if it goes first (`sys`,
        // "Send buffers"). A fixed-buffer send is one slot piece, inside
        // registered buffer 0, the whole pool.
        if !unsafe { sys::push_send(&mut self.ring, c.sock, &msg, kind, send_user_data(idx, seq)) }
        {
            // SQ full: put everything back, in order, and retry next flush.
            for seg in segs.drain(..).rev() {
                c.queued_bytes += seg.len();
                c.queue.push_front(seg);
            }
            c.keep_spare(segs, msg);
            self.stats.sq_full += 1;
            return;
        }
        c.stats.sends += 1;
        self.stats.sends += 1;
        if kind != SendKind::Plain {
            c.stats.zc_sends += 1;
            self.stats.zc_sends += 1;
            c.zc_seq = c.zc_seq.wrapping_add(1);
        }
        c.inflight = Some(Inflight {
            segs,
            msg,
            total,
            resumable: kind == SendKind::Plain,
            seq,
            notif_seen: false,
        });
    }

    /// The largest body and message a received header may announce.
    fn frame_limits(&self) -> (u32, u32) {
        let max_body = u32::try_from(self.cfg.max_frame_len - HEADER_LEN).unwrap_or(u32::MAX);
        let max_message = u32::try_from(self.cfg.max_message_len).unwrap_or(u32::MAX);
        (max_body, max_message)
    }

    /// Deliver up to `max` complete frames in place (reassembling frames
    /// that straddle buffers), then the end of the stream if it came.
    pub(crate) fn rx_burst(
        &mut self,
        idx: usize,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let (max_body, max_message) = self.frame_limits();
        let buf_len = self.cfg.rx_buf_len;
        let direct_min = self.cfg.rx_direct_min;
        let c = self.conns[idx].as_mut().expect("live connection");
        if let Some(e) = &c.frame_error {
            return Err(TransportError::Frame(e.clone()));
        }
        let mut n = 0;
        let mut released = 0;
        let mut freed = std::mem::take(&mut self.rx_freed);
        let mut err = None;
        // Out of the connection while frames are read from it (the heap
        // memory stays where it is; a receive in flight writes only past
        // the chunks read here), back right after the loop. A sink that
        // panics leaks it rather than free memory a receive may still
        // write into (the receive's completion then finds the buffer
        // empty and ends the connection).
        let own = std::mem::ManuallyDrop::new(std::mem::take(&mut c.own));
        if c.direct_ready {
            // A direct receive completed the frame in `partial`.
            c.direct_ready = false;
            match Header::parse(&c.partial, max_body, max_message) {
                Ok(h) if h.frame_len() == c.partial.len() => {
                    sink(&c.partial);
                    c.partial.clear();
                    c.stats.frames_received += 1;
                    released += usize::from(after_frame(c, h.frame_len(), direct_min));
                    n += 1;
                }
                Ok(_) => err = Some(FrameError::BadLength("direct receive overran its frame")),
                Err(e) => err = Some(e),
            }
        }
        while n < max && err.is_none() {
            let Some(&(bid, off, end)) = c.chunks.front() else {
                break;
            };
            debug_assert!(!c.direct_inflight, "chunks while a direct receive runs");
            let data = if bid == OWN_BID {
                &own[off as usize..end as usize]
            } else {
                let id = slot_id(usize::from(bid));
                &self.rx_pool.slot(id)[off as usize..buf_len.min(end as usize)]
            };
            let used;
            if !c.partial.is_empty() {
                let have = c.partial.len();
                let want = if have < HEADER_LEN {
                    HEADER_LEN
                } else {
                    match Header::parse(&c.partial, max_body, max_message) {
                        Ok(h) => h.frame_len(),
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                };
                let take = (want - have).min(data.len());
                c.partial.extend_from_slice(&data[..take]);
                used = take;
                if c.partial.len() >= HEADER_LEN {
                    match Header::parse(&c.partial, max_body, max_message) {
                        Ok(h) if c.partial.len() == h.frame_len() => {
                            sink(&c.partial);
                            c.partial.clear();
                            c.stats.frames_received += 1;
                            released += usize::from(after_frame(c, h.frame_len(), direct_min));
                            n += 1;
                        }
                        Ok(_) => {}
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                }
            } else {
                // Every complete frame of this chunk in one pass: the chunk
                // bookkeeping above and below runs once per chunk, not once
                // per frame (a burst of answers is 16 or more frames in one
                // receive).
                let mut pos = 0;
                loop {
                    let rest = &data[pos..];
                    if rest.len() < HEADER_LEN {
                        c.partial.extend_from_slice(rest);
                        pos = data.len();
                        break;
                    }
                    match Header::parse(rest, max_body, max_message) {
                        Ok(h) if h.frame_len() <= rest.len() => {
                            sink(&rest[..h.frame_len()]);
                            pos += h.frame_len();
                            c.stats.frames_received += 1;
                            released += usize::from(after_frame(c, h.frame_len(), direct_min));
                            n += 1;
                            if n >= max || pos == data.len() {
                                break;
                            }
                        }
                        Ok(_) => {
                            c.partial.extend_from_slice(rest);
                            pos = data.len();
                            break;
                        }
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                }
                if err.is_some() {
                    // The connection is unusable from here; where its chunk
                    // stood no longer matters.
                    break;
                }
                used = pos;
            }
            let off = off + used as u32;
            if off >= end {
                c.chunks.pop_front();
                if bid == OWN_BID {
                    c.own_refs -= 1;
                } else {
                    freed.push(bid);
                }
            } else if let Some(f) = c.chunks.front_mut() {
                f.1 = off;
            }
        }
        c.own = std::mem::ManuallyDrop::into_inner(own);
        self.stats.frames_received += n as u64;
        self.stats.rx_buffers_released += released as u64;
        let c = self.conns[idx].as_mut().expect("live connection");
        if let Some(e) = err {
            tracing::debug!(error = %e, "uring: bad frame");
            c.frame_error = Some(e.clone());
            for b in freed.drain(..) {
                self.release_rx(b);
            }
            self.rx_freed = freed;
            if n > 0 {
                return Ok(n);
            }
            return Err(TransportError::Frame(e));
        }
        if c.chunks.is_empty() && !c.direct_inflight && !c.direct_ready {
            // Receive the rest of a long frame straight into `partial`
            // (`queue_direct_receives`); after a long frame, receive the
            // next header that way too, so that its body does not land in
            // the provided buffers first.
            let have = c.partial.len();
            let want = if have >= HEADER_LEN {
                Header::parse(&c.partial, max_body, max_message)
                    .ok()
                    .map(|h| h.frame_len())
                    .filter(|&len| len >= direct_min && len > have)
            } else if c.large_run {
                Some(HEADER_LEN)
            } else {
                None
            };
            if want.is_some() && c.direct_want.is_none() {
                self.direct.push(idx);
            }
            c.direct_want = want;
            if want.is_none()
                && !self.spin
                && !c.recv_armed
                && !c.closing
                && c.rx_end.is_none()
                && !self.rearm.contains(&idx)
            {
                // Back to the (multishot or single) receive.
                self.rearm.push(idx);
            }
        }
        let end = if c.chunks.is_empty() { c.rx_end } else { None };
        let partial = c.partial.len();
        let truncated_need = (partial >= HEADER_LEN)
            .then(|| Header::parse(&c.partial, max_body, max_message).ok())
            .flatten()
            .map_or(HEADER_LEN, |h| h.frame_len());
        for b in freed.drain(..) {
            self.release_rx(b);
        }
        self.rx_freed = freed;
        if n > 0 {
            return Ok(n);
        }
        match end {
            None => Ok(0),
            Some(RxEnd::Eof) if partial > 0 => {
                let e = FrameError::Truncated {
                    needed: truncated_need,
                    have: partial,
                };
                self.conns[idx].as_mut().expect("live").frame_error = Some(e.clone());
                Err(TransportError::Frame(e))
            }
            Some(RxEnd::Eof) | Some(RxEnd::Reset) => Err(TransportError::Closed),
            Some(RxEnd::Errno(e)) => Err(TransportError::Io(std::io::Error::from_raw_os_error(e))),
        }
    }
}

impl Drop for RingInner {
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
        if self.outstanding == 0 {
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
            while let Some(cqe) = self.ring.completion().next() {
                if !cqueue::more(cqe.flags()) && cqe.user_data() != u64::MAX {
                    self.outstanding = self.outstanding.saturating_sub(1);
                }
                if cqe.user_data() & 0xff == OP_EVENTFD {
                    self.eventfd_read_inflight = false;
                }
            }
            if self.outstanding == 0 {
                break;
            }
        }
        if self.outstanding > 0 {
            // Requests the kernel may still hold: a direct receive writes
            // into its connection's frame buffer, so leak those buffers
            // rather than free memory the kernel could write to.
            // Likewise the memory of sends whose notification did not
            // come (the kernel may still transmit from those pages; slots
            // are in the pool's mapping, which the pinned pages outlive).
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
                    std::mem::forget(std::mem::take(&mut c.own));
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
mod tests {
    use super::*;
    use std::net::{SocketAddr, TcpListener};

    /// `IORING_CQE_F_MORE` and `IORING_CQE_F_NOTIF`.
    const F_MORE: u32 = 1 << 1;
    const F_NOTIF: u32 = 1 << 3;

    /// An `Rpc` frame of `id` whose body is `body` bytes of `id`.
    fn rpc_frame(id: u64, body: usize) -> Vec<u8> {
        let mut f = starwire_wire::Header::new(starwire_wire::Opcode::Rpc, id, body as u32)
            .to_bytes()
            .to_vec();
        f.resize(f.len() + body, id as u8);
        f
    }

    fn loopback_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    /// A ring that tries zero copy from 1 KiB, on loopback too, and a
    /// connected pair for it. This machine's kernel has `SEND_ZC`.
    fn zc_ring() -> (UringReactor, TcpStream, TcpStream) {
        let cfg = UringConfig {
            zero_copy_loopback: true,
            zero_copy_threshold: 1024,
            ..UringConfig::default()
        };
        let r = UringReactor::new(&cfg).unwrap();
        assert!(r.features().send_zc, "{:?}", r.features());
        let (a, b) = loopback_pair();
        (r, a, b)
    }

    /// Queue one send of a 4 KiB registered slot on `idx`; returns the slot.
    fn send_slot(g: &mut RingInner, idx: usize) -> SlotId {
        let id = g.tx_pool.take().expect("a free slot");
        g.slot_refs[id.index()] = 1;
        let c = g.conns[idx].as_mut().unwrap();
        c.slots_held += 1;
        c.queue.push_back(TxSeg::Slot {
            id,
            off: 0,
            len: 4096,
        });
        c.queued_bytes += 4096;
        g.send_queued(idx).unwrap();
        id
    }

    /// A zero-copy send's notification holds the send's memory, not the
    /// stream: once its result came, the next send goes, and the slot
    /// returns to the pool only with the notification (which may come in
    /// any order). Driven by made-up completions: nothing is submitted.
    #[test]
    fn zero_copy_notifications_hold_memory_not_the_stream() {
        let (r, a, _b) = zc_ring();
        let mut g = r.lock();
        let idx = g.add_conn(a);
        let free = g.tx_pool.free_slots();
        let s0 = send_slot(&mut g, idx);
        assert_eq!(g.stats.zc_sends, 1);
        assert_eq!(
            g.conns[idx]
                .as_ref()
                .unwrap()
                .inflight
                .as_ref()
                .unwrap()
                .seq,
            0
        );
        // Its result, with a notification to come: the next send may go.
        g.complete(send_user_data(idx, 0), 4096, F_MORE);
        let c = g.conns[idx].as_ref().unwrap();
        assert!(
            c.inflight.is_none() && c.zc_held.len() == 1,
            "held, not in flight"
        );
        assert_eq!(c.zc_held_bytes, 4096);
        let s1 = send_slot(&mut g, idx);
        assert_eq!(g.stats.zc_sends, 2, "the second send did not wait");
        g.complete(send_user_data(idx, 1), 4096, F_MORE);
        assert_eq!(g.conns[idx].as_ref().unwrap().zc_held.len(), 2);
        assert_eq!(g.tx_pool.free_slots(), free - 2);
        // The second notification first: only its slot goes back.
        g.complete(send_user_data(idx, 1), 0, F_NOTIF);
        let c = g.conns[idx].as_ref().unwrap();
        assert_eq!(c.zc_held.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0]);
        assert_eq!(c.zc_held_bytes, 4096);
        assert_eq!((g.slot_refs[s1.index()], g.slot_refs[s0.index()]), (0, 1));
        // The first, reported copied: its slot goes back, and the
        // connection sends plainly from now on.
        g.complete(send_user_data(idx, 0), sys::NOTIF_USAGE_ZC_COPIED, F_NOTIF);
        let c = g.conns[idx].as_ref().unwrap();
        assert!(c.zc_held.is_empty() && c.zc_held_bytes == 0 && c.slots_held == 0);
        assert!(!c.zero_copy && c.inflight.is_none());
        assert_eq!(g.tx_pool.free_slots(), free);
        assert_eq!((g.stats.zc_copied, g.stats.zc_fallbacks), (1, 1));
        send_slot(&mut g, idx);
        assert_eq!(g.stats.zc_sends, 2, "plain after the copied report");
    }

    /// A notification that comes before its send's result (allowed, not
    /// seen) frees nothing early: the result then releases the pieces
    /// itself, and nothing is left held. A notification that gave back
    /// held bytes makes the next `enter` report work.
    #[test]
    fn zero_copy_notification_before_result_and_the_freed_turn() {
        let (r, a, _b) = zc_ring();
        {
            let mut g = r.lock();
            let idx = g.add_conn(a);
            let free = g.tx_pool.free_slots();
            let s0 = send_slot(&mut g, idx);
            g.complete(send_user_data(idx, 0), 0, F_NOTIF);
            assert_eq!(g.slot_refs[s0.index()], 1, "still in flight");
            assert!(!g.tx_freed);
            g.complete(send_user_data(idx, 0), 4096, F_MORE);
            let c = g.conns[idx].as_ref().unwrap();
            assert!(c.inflight.is_none() && c.zc_held.is_empty() && c.zc_held_bytes == 0);
            assert_eq!(g.tx_pool.free_slots(), free);
        }
        // A held send freed by its notification raises the flag, and the
        // next enter reports work for it alone (a fresh ring: nothing to
        // submit, nothing to reap).
        let (r, a, _b) = zc_ring();
        let idx = r.lock().add_conn(a);
        r.enter().unwrap();
        assert!(!r.enter().unwrap(), "an idle ring");
        {
            let mut g = r.lock();
            let c = g.conns[idx].as_mut().unwrap();
            c.zc_held
                .push_back((5, vec![TxSeg::Shared(Bytes::from_static(&[7; 64]))]));
            c.zc_held_bytes = 64;
            g.complete(send_user_data(idx, 5), 0, F_NOTIF);
            assert!(g.tx_freed && g.conns[idx].as_ref().unwrap().zc_held_bytes == 0);
        }
        assert!(r.enter().unwrap(), "the turn after a release is work");
        assert!(!r.enter().unwrap(), "once");
    }

    /// A single receive that completed in the last enter is queued again
    /// when the reactor asks for its park descriptor, so that data arriving
    /// during the park wakes it even when no turn ran in between.
    #[test]
    fn a_park_queues_the_completed_single_receive_again() {
        use std::io::Write;
        let cfg = UringConfig::default();
        assert_eq!(cfg.recv, RecvMode::Single);
        let r = UringReactor::new(&cfg).unwrap();
        let (a, mut b) = loopback_pair();
        let idx = r.lock().add_conn(a);
        let frame = |id: u64| rpc_frame(id, 8);
        b.write_all(&frame(1)).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while r.lock().conn(idx).chunks.is_empty() {
            assert!(std::time::Instant::now() < deadline, "no data");
            r.enter().unwrap();
        }
        assert!(
            !r.lock().conn(idx).recv_armed,
            "completed, to be queued again"
        );
        // The park: no turn, no enter; the descriptor queues the receive.
        let fd = r.fd();
        assert!(
            r.lock().conn(idx).recv_armed,
            "queued again before the park"
        );
        b.write_all(&frame(2)).unwrap();
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut pfds = [PollFd::new(fd, PollFlags::POLLIN)];
        let n = nix::poll::poll(&mut pfds, PollTimeout::from(5000u16)).unwrap();
        assert_eq!(n, 1, "the park woke for the second frame");
    }

    /// A park in the ring that queued its SQEs and then failed to enter
    /// (the reactor polls instead): the park descriptor submits them, in
    /// each mode, so data still wakes the poll.
    #[test]
    fn a_failed_park_leaves_nothing_unsubmitted_for_the_poll() {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        use nix::sys::eventfd::{EfdFlags, EventFd};
        use std::io::Write;
        use std::os::fd::AsFd;
        for recv in [RecvMode::Single, RecvMode::Spin] {
            let cfg = UringConfig {
                recv,
                ..UringConfig::default()
            };
            let r = UringReactor::new(&cfg).unwrap();
            let (a, mut b) = loopback_pair();
            let idx = r.lock().add_conn(a);
            b.write_all(&rpc_frame(1, 8)).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while r.lock().conn(idx).chunks.is_empty() {
                assert!(std::time::Instant::now() < deadline, "{recv:?}: no data");
                r.enter().unwrap();
            }
            let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK).unwrap();
            let waker = ParkWaker {
                fd: efd.as_fd(),
                id: 1,
            };
            // The park's first half queues the receive (or poll) and the
            // waker's poll; its enter never happens.
            let (_, pending, ready) = r.lock().prepare_park(waker).unwrap();
            assert!(pending >= 2 && !ready, "{recv:?}: {pending} {ready}");
            let fd = r.fd();
            assert_eq!(r.lock().ring.submission().len(), 0, "{recv:?}: left queued");
            b.write_all(&rpc_frame(2, 8)).unwrap();
            let mut pfds = [PollFd::new(fd, PollFlags::POLLIN)];
            let n = nix::poll::poll(&mut pfds, PollTimeout::from(5000u16)).unwrap();
            assert_eq!(n, 1, "{recv:?}: the poll slept through the data");
        }
    }

    /// Spin receives into the connection's own buffer start at its front
    /// when everything before was consumed, else after the unconsumed
    /// chunk on an `OWN_ALIGN` boundary; frames of any length come out
    /// whole.
    #[test]
    fn own_buffer_receives_start_aligned_and_from_the_front() {
        use std::io::Write;
        let cfg = UringConfig {
            recv: RecvMode::Spin,
            ..UringConfig::default()
        };
        let r = UringReactor::new(&cfg).unwrap();
        let (a, mut b) = loopback_pair();
        let idx = r.lock().add_conn(a);
        // 32-byte header + 100 bytes: 132, not a multiple of 64.
        let frame = |id: u64| rpc_frame(id, 100);
        let wait_chunks = |n: usize| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while r.lock().conn(idx).chunks.len() < n {
                assert!(std::time::Instant::now() < deadline, "no data");
                r.enter().unwrap();
            }
            r.lock()
                .conn(idx)
                .chunks
                .iter()
                .copied()
                .collect::<Vec<_>>()
        };
        b.write_all(&frame(1)).unwrap();
        assert_eq!(wait_chunks(1), vec![(OWN_BID, 0, 132)]);
        // Not consumed yet: the next receive goes after it, aligned.
        b.write_all(&frame(2)).unwrap();
        assert_eq!(wait_chunks(2), vec![(OWN_BID, 0, 132), (OWN_BID, 192, 324)]);
        let mut got = Vec::new();
        let n = r
            .lock()
            .rx_burst(idx, 8, &mut |f: &[u8]| got.push(f.to_vec()))
            .unwrap();
        assert_eq!((n, got), (2, vec![frame(1), frame(2)]));
        assert_eq!(r.lock().conn(idx).own_refs, 0);
        // All consumed: the next receive starts at the front again.
        b.write_all(&frame(3)).unwrap();
        assert_eq!(wait_chunks(1), vec![(OWN_BID, 0, 132)]);
    }
}

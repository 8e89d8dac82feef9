//! Settings, errors and counters of the io_uring backend.

use starwire_bufpool::{HugePolicy, MemlockError, PoolError};
use starwire_wire::HEADER_LEN;
use thiserror::Error;

/// Settings of one ring (one [`UringDriver`](crate::UringDriver)) and its
/// connections. Both ends of a
/// connection should agree on `max_frame_len` and `max_message_len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UringConfig {
    /// Submission queue entries. Default 256.
    pub sq_entries: u32,
    /// Completion queue entries (multishot receives post many). Default 4096.
    pub cq_entries: u32,
    /// The largest frame, header included. Longer messages are chunked by
    /// the message layer. Default 1 MiB, as for the tcp backend. Frames up
    /// to [`tx_slot_len`](Self::tx_slot_len) are written into registered
    /// slots; a longer one sends its large `Bytes` segments by reference
    /// (`tx_gather`) or is reserved in heap memory (`tx_reserve`), and is
    /// received straight into a frame buffer (see
    /// [`rx_direct_min`](Self::rx_direct_min)).
    pub max_frame_len: usize,
    /// Length of one slot of the registered transmit pool. Default 64 KiB.
    pub tx_slot_len: usize,
    /// A frame at least this long, once its header has arrived, is
    /// received with single-shot `RECV`s into one frame-sized buffer
    /// instead of through the provided buffers: the kernel copies the body
    /// once, to where it is delivered, and no user-space copy follows.
    /// Default 128 KiB; at least 4 KiB (a shorter frame costs more as a
    /// receive of its own than its copy out of a provided buffer). A value
    /// above `max_frame_len` turns direct receives off.
    pub rx_direct_min: usize,
    /// The largest `message_len` a received header may announce. Default
    /// 256 MiB.
    pub max_message_len: usize,
    /// Transmit slots in the registered pool of the ring. Default 32
    /// (2 MiB with the default slot length; the common memlock limit is 8 MiB per
    /// user, shared by all rings). A connection holds slots only while
    /// frames are being written or sent.
    pub tx_slots: usize,
    /// Transmit slots one connection may hold. Default 8.
    pub tx_slots_per_conn: usize,
    /// Bound of the bytes kept by reference (`tx_gather`, reservations
    /// longer than a slot) per connection, together with those of
    /// zero-copy sends waiting for their notification. Default 4 MiB.
    pub tx_queue_limit_bytes: usize,
    /// `tx_gather` copies segments shorter than this next to the frame
    /// head; longer ones are sent from the caller's `Bytes`. Default 4096.
    pub gather_copy_threshold: usize,
    /// Length of one provided receive buffer ([`RecvMode::Multishot`]).
    /// Default 512 KiB: a 64 KiB
    /// frame straddles two buffers (and is reassembled by a copy) once in
    /// eight buffers instead of nearly always.
    pub rx_buf_len: usize,
    /// Provided receive buffers of the ring. Default 16 (8 MiB).
    pub rx_bufs: usize,
    /// Length of a connection's own receive buffer, which
    /// [`RecvMode::Spin`] and [`RecvMode::Single`] receives go into
    /// (allocated at the connection's first receive; `Multishot` uses the
    /// provided buffers). A receive starts at the buffer's front once the
    /// application consumed everything before it, as a `recv(2)` loop
    /// does, else after the unconsumed bytes on a 64-byte boundary: the
    /// kernel's copy lands on cache-hot, aligned memory
    /// (`docs/backends/uring.md`, "Receive"). Frames longer than it are
    /// reassembled as frames straddling provided buffers are. Default
    /// 256 KiB; at least 4 KiB, at most 1 GiB.
    pub rx_conn_buf_len: usize,
    /// Try zero-copy sends for large sends. Default true.
    pub zero_copy: bool,
    /// Try them on connections to a loopback peer too. Default false: the
    /// kernel copies such sends anyway (in the receive path, where the
    /// pinned pages cannot go), so the first one only comes back reported
    /// copied. That probe is not free: it waits in the socket until all of
    /// it is taken (`MSG_WAITALL`), and with BBR as the congestion control
    /// that wait ended BBR's startup in every run of a 64 KiB stream
    /// measured here (six of six), after which the stream was paced
    /// (`docs/backends/uring.md`, "Zero-copy sends").
    pub zero_copy_loopback: bool,
    /// Sends of at least this many bytes go zero-copy. Default 32 KiB.
    pub zero_copy_threshold: usize,
    /// SQPOLL with this idle time (ms) instead of task-run flags; needs a
    /// spare core. Default `None`; `STARWIRE_URING_SQPOLL=1` sets 1000.
    pub sqpoll_idle_ms: Option<u32>,
    /// Use `DEFER_TASKRUN` where the kernel has it instead of
    /// `COOP_TASKRUN`. Default true (`STARWIRE_URING_DEFER_TASKRUN=0` turns
    /// it off). Deferred work does not wake a task in `poll(2)` on the ring
    /// fd, so such a ring registers an eventfd, enabled only while the
    /// reactor parks.
    pub defer_taskrun: bool,
    /// How connections receive. Default [`RecvMode::Single`];
    /// `STARWIRE_URING_RECV=single|multishot|spin` overrides what
    /// [`for_polling`](Self::for_polling) picks.
    pub recv: RecvMode,
    /// Most bytes one [`RecvMode::Single`] receive takes. Default 128 KiB.
    /// A receive submitted while a burst is still arriving takes this much
    /// and completes, the frames in it are answered in the next enter, and
    /// the next receive goes with those answers: the sender gets its
    /// acknowledgements while it is still sending, as a `recv(2)` that
    /// returns what has arrived gives it. Without the bound one receive
    /// took all a window's frames and both ends fell into lockstep
    /// (`docs/backends/uring.md`, "Receive").
    pub recv_chunk_len: usize,
    /// Try huge pages for the pools.
    pub huge_pages: HugePolicy,
    /// `SO_SNDBUF` set on a connection whose peer is a loopback address;
    /// `None` leaves it to autotuning. Default
    /// [`DEFAULT_LOOPBACK_SEND_BUFFER`](starwire_transport::socket::DEFAULT_LOOPBACK_SEND_BUFFER),
    /// which says why. A caller that sized the socket's send buffer itself
    /// sets `None`.
    pub loopback_send_buffer: Option<usize>,
}

/// Default [`UringConfig::recv_chunk_len`].
pub const DEFAULT_RECV_CHUNK_LEN: usize = 128 << 10;

/// Smallest [`UringConfig::rx_direct_min`].
const MIN_RX_DIRECT: usize = 4096;

impl Default for UringConfig {
    fn default() -> Self {
        Self {
            sq_entries: 256,
            cq_entries: 4096,
            max_frame_len: 1 << 20,
            tx_slot_len: 64 << 10,
            rx_direct_min: 128 << 10,
            max_message_len: 256 << 20,
            tx_slots: 32,
            tx_slots_per_conn: 8,
            tx_queue_limit_bytes: 4 << 20,
            gather_copy_threshold: 4096,
            rx_buf_len: 512 << 10,
            rx_bufs: 16,
            rx_conn_buf_len: 256 << 10,
            zero_copy: true,
            zero_copy_loopback: false,
            zero_copy_threshold: 32 << 10,
            sqpoll_idle_ms: None,
            defer_taskrun: true,
            recv: RecvMode::Single,
            recv_chunk_len: DEFAULT_RECV_CHUNK_LEN,
            huge_pages: HugePolicy::Try,
            loopback_send_buffer: Some(starwire_transport::socket::DEFAULT_LOOPBACK_SEND_BUFFER),
        }
    }
}

impl UringConfig {
    /// The defaults with `STARWIRE_URING_SQPOLL=1` applied.
    pub fn from_env() -> Self {
        let mut c = Self::default();
        if std::env::var("STARWIRE_URING_SQPOLL").is_ok_and(|v| v.trim() == "1") {
            c.sqpoll_idle_ms = Some(1000);
        }
        if std::env::var("STARWIRE_URING_DEFER_TASKRUN").is_ok_and(|v| v.trim() == "0") {
            c.defer_taskrun = false;
        }
        if let Some(m) = RecvMode::from_env() {
            c.recv = m;
        }
        c
    }

    /// [`from_env`](Self::from_env) for a reactor that busy-polls
    /// (`busy_poll`) or parks: a busy-polling reactor receives with
    /// [`RecvMode::Spin`], unless `STARWIRE_URING_RECV` says otherwise.
    pub fn for_polling(busy_poll: bool) -> Self {
        let mut c = Self::from_env();
        if busy_poll && RecvMode::from_env().is_none() {
            c.recv = RecvMode::Spin;
        }
        c
    }

    /// Check that the settings are consistent.
    pub fn validate(&self) -> Result<(), UringError> {
        let bad = |what: &'static str| Err(UringError::Config(what));
        if self.max_frame_len < HEADER_LEN || self.max_frame_len > (1 << 30) {
            return bad("max_frame_len must be within 32 bytes..1 GiB");
        }
        if self.tx_slot_len < HEADER_LEN || self.tx_slot_len > (1 << 30) {
            return bad("tx_slot_len must be within 32 bytes..1 GiB");
        }
        if u32::try_from(self.max_message_len).is_err() {
            return bad("max_message_len exceeds u32::MAX");
        }
        if self.tx_slots == 0 || self.tx_slots_per_conn == 0 {
            return bad("tx_slots and tx_slots_per_conn must be positive");
        }
        if self.tx_slots > usize::from(u16::MAX) {
            return bad("tx_slots must be below 65536");
        }
        if self.rx_bufs == 0 || self.rx_bufs > 32768 || self.rx_buf_len < HEADER_LEN {
            return bad("rx_bufs must be within 1..=32768 and rx_buf_len at least 32");
        }
        if u32::try_from(self.rx_buf_len).is_err() {
            return bad("rx_buf_len exceeds u32::MAX");
        }
        if self.tx_queue_limit_bytes < self.max_frame_len {
            return bad("tx_queue_limit_bytes is below max_frame_len");
        }
        if self.recv_chunk_len < HEADER_LEN || u32::try_from(self.recv_chunk_len).is_err() {
            return bad("recv_chunk_len must be within 32 bytes..4 GiB");
        }
        if self.rx_conn_buf_len < 4096 || self.rx_conn_buf_len > (1 << 30) {
            return bad("rx_conn_buf_len must be within 4 KiB..1 GiB");
        }
        if self.rx_direct_min < MIN_RX_DIRECT {
            return bad("rx_direct_min must be at least 4096 (above max_frame_len turns direct receives off)");
        }
        Ok(())
    }

    /// Bytes registered with the kernel (pinned) by one ring.
    pub fn registered_bytes(&self) -> u64 {
        (self.slot_len() as u64).saturating_mul(self.tx_slots as u64)
    }

    /// The length of a transmit slot: [`tx_slot_len`](Self::tx_slot_len),
    /// or less when frames are shorter.
    pub(crate) fn slot_len(&self) -> usize {
        self.tx_slot_len.min(self.max_frame_len)
    }
}

/// How the connections of a ring receive.
///
/// All deliver the same bytes; they differ in how the kernel learns that
/// the reactor wants data, in how much one receive takes, and in where it
/// puts it: `Single` and `Spin` receive into the connection's own buffer
/// ([`UringConfig::rx_conn_buf_len`]), `Multishot` into the ring's
/// provided buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvMode {
    /// One single-shot `RECV` per connection at a time into its own
    /// buffer, of at most [`UringConfig::recv_chunk_len`] bytes, queued
    /// again at the first
    /// enter after its completion was reaped (or before a park). Submitted while data waits,
    /// it completes inside that enter; submitted on an empty socket, it
    /// waits there (the kernel arms a poll) and completes through task work
    /// when data comes. No system call while nothing arrives: the mode for
    /// reactors that park, and the default. Against `Multishot` it costs
    /// one SQE per receive and keeps a burst in bounded pieces, answered
    /// piece by piece (`docs/backends/uring.md`, "Receive").
    Single,
    /// One multishot `RECV` per connection, armed once. Arriving data wakes
    /// the socket's poll callback, which queues task work that the next
    /// `io_uring_enter` runs; that work takes everything the socket holds.
    /// No system call while nothing arrives, and no SQE per receive; but
    /// with parking reactors a window of medium frames (64 KiB) arrives
    /// whole before it is answered, and both ends fall into lockstep.
    Multishot,
    /// Each reactor turn queues one non-blocking (`MSG_DONTWAIT`) `RECV`
    /// per connection with the turn's sends; it completes inside that same
    /// `io_uring_enter`, with data or `-EAGAIN`. It receives into the
    /// connection's own buffer and takes what the socket holds, up to the
    /// room left there. This skips the poll wakeup and task-work hop of
    /// multishot (docs/backends/uring.md has the round trips measured), at
    /// the price of one enter per idle turn, as a spinning `recv(2)` pays. The mode
    /// for busy-polling reactors. Before a reactor parks, each connection
    /// arms a one-shot `POLL_ADD` so that data wakes it.
    Spin,
}

impl RecvMode {
    /// `STARWIRE_URING_RECV`: `single`, `multishot` or `spin` (anything
    /// else is ignored).
    pub fn from_env() -> Option<Self> {
        match std::env::var("STARWIRE_URING_RECV").ok()?.trim() {
            "single" => Some(Self::Single),
            "spin" => Some(Self::Spin),
            "multishot" => Some(Self::Multishot),
            _ => None,
        }
    }

    /// `single`, `multishot` or `spin`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Single => "single",
            Self::Spin => "spin",
            Self::Multishot => "multishot",
        }
    }
}

/// The backend could not be set up.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum UringError {
    /// io_uring cannot be used here (old kernel, `io_uring_disabled`,
    /// seccomp).
    #[error("io_uring unavailable: {0}")]
    Unavailable(#[source] std::io::Error),
    /// `RLIMIT_MEMLOCK` is too low for the registered buffers.
    #[error(transparent)]
    Memlock(#[from] MemlockError),
    /// A buffer pool could not be mapped.
    #[error("buffer pool: {0}")]
    Pool(#[source] PoolError),
    /// A setup call failed.
    #[error("{what}: {source}")]
    Setup {
        /// The call.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Inconsistent settings.
    #[error("invalid uring config: {0}")]
    Config(&'static str),
    /// The ring's submission queue is full when arming a receive.
    #[error("submission queue full")]
    SubmissionQueueFull,
}

/// Counters of one ring.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UringStats {
    /// `io_uring_enter` system calls.
    pub enters: u64,
    /// Drains of the park eventfd (one after each `poll(2)` park on the
    /// park descriptor of a `DEFER_TASKRUN` ring, `Driver::wake_fds`;
    /// parks in the ring need none), each a read submitted with the turn's
    /// enter.
    pub eventfd_reads: u64,
    /// Of those, drains done by a `read(2)` of their own (the SQ was full).
    pub eventfd_read_syscalls: u64,
    /// SQEs submitted.
    pub sqes: u64,
    /// Send SQEs.
    pub sends: u64,
    /// Zero-copy send SQEs.
    pub zc_sends: u64,
    /// Zero-copy sends the kernel reported as copied.
    pub zc_copied: u64,
    /// Connections that switched from zero-copy to plain sends.
    pub zc_fallbacks: u64,
    /// Receive completions with data.
    pub recv_cqes: u64,
    /// Receives armed (first arm and re-arms).
    pub recv_arms: u64,
    /// Receives that found no provided buffer (`ENOBUFS`).
    pub rx_enobufs: u64,
    /// [`RecvMode::Spin`] receives that found no data (`EAGAIN`).
    pub rx_empty: u64,
    /// One-shot polls armed before a park ([`RecvMode::Spin`]).
    pub park_polls: u64,
    /// Parks waited inside `io_uring_enter` (`Driver::park`).
    pub ring_parks: u64,
    /// Slots of the ring's registered file table (connections beyond it
    /// use plain descriptors; 0 when the kernel refused the table).
    pub file_slots: u32,
    /// Enters through the registered ring descriptor
    /// (`IORING_ENTER_REGISTERED_RING`).
    pub registered_enters: u64,
    /// Frames committed for sending.
    pub frames_sent: u64,
    /// Frames delivered.
    pub frames_received: u64,
    /// Reservations refused because the ring's pool was empty.
    pub tx_pool_empty: u64,
    /// Sends postponed because the SQ was full.
    pub sq_full: u64,
    /// Plain sends the socket took only part of (full); the rest was
    /// queued again for the next flush.
    pub short_sends: u64,
    /// Receives straight into a frame buffer (frames of at least
    /// [`UringConfig::rx_direct_min`] bytes).
    pub direct_recvs: u64,
    /// Bytes those receives brought.
    pub direct_bytes: u64,
    /// Frame buffers left by a long frame and given back after 64 short
    /// frames in a row.
    pub rx_buffers_released: u64,
    /// Multishot receives cancelled to make way for a direct receive.
    pub direct_cancels: u64,
    /// Frames longer than a transmit slot queued from heap memory (a
    /// `tx_reserve` beyond the slot, or a `tx_gather` whose copied part
    /// exceeds it).
    pub tx_heap_frames: u64,
    /// What backs the registered pool.
    pub tx_pages: String,
    /// Bytes registered as fixed buffers.
    pub registered_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_accepts_the_defaults_and_bounds_rx_direct_min() {
        assert!(UringConfig::default().validate().is_ok());
        for bad in [0, 1, HEADER_LEN, MIN_RX_DIRECT - 1] {
            let c = UringConfig {
                rx_direct_min: bad,
                ..UringConfig::default()
            };
            assert!(
                matches!(c.validate(), Err(UringError::Config(m)) if m.contains("rx_direct_min")),
                "rx_direct_min {bad}"
            );
        }
        for ok in [MIN_RX_DIRECT, usize::MAX] {
            let c = UringConfig {
                rx_direct_min: ok,
                ..UringConfig::default()
            };
            assert!(c.validate().is_ok(), "rx_direct_min {ok}");
        }
    }
}

//! io_uring backend for starwire (fixed buffers, multishot receive,
//! zero-copy send, batched submission).
//!
//! A [`UringDriver`] is one io_uring ring, one per reactor thread, and
//! every connection of that reactor (a [`ConnId`](starwire_transport::ConnId)
//! each, attached with
//! [`attach_stream`](starwire_transport::StreamDriver::attach_stream)). It
//! owns the ring, its pools and each connection's state by value: no call
//! takes a lock.
//!
//! * **Submission.** Connections only queue SQEs; the driver's `flush`
//!   makes one `io_uring_enter` per reactor turn for all of them, and only
//!   when SQEs wait or the kernel flagged deferred completion work
//!   (`IORING_SQ_TASKRUN`). Rings use `SINGLE_ISSUER` + `DEFER_TASKRUN` +
//!   `TASKRUN_FLAG` (or `COOP_TASKRUN` where `DEFER_TASKRUN` is missing),
//!   the ring's own descriptor registered for the reactor thread and
//!   sockets in a registered file table, or SQPOLL when
//!   [`UringConfig::sqpoll_idle_ms`] is set (`STARWIRE_URING_SQPOLL=1`).
//! * **TX.** `tx_reserve` lends space in a slot of the registered (fixed)
//!   buffer pool ([`starwire_bufpool::BufPool`]); `tx_gather` keeps large
//!   `Bytes` segments by reference. `flush` sends everything a connection
//!   queued with one `SENDMSG` (one send in flight per connection keeps
//!   the stream in order). Sends of at least
//!   [`UringConfig::zero_copy_threshold`] bytes go out as `SEND_ZC` (from
//!   the fixed buffer) or `SENDMSG_ZC` with `IORING_SEND_ZC_REPORT_USAGE`;
//!   buffers are reused only after the notification, and a connection
//!   whose zero-copy sends come back copied (always on loopback and veth)
//!   switches to plain sends.
//! * **RX.** One single-shot `RECV` of at most
//!   [`UringConfig::recv_chunk_len`] per connection at a time, queued again
//!   at the enter after the last one completed ([`RecvMode::Single`], for
//!   reactors that park), or one non-blocking receive per connection per
//!   turn, submitted with the turn's sends ([`RecvMode::Spin`], for polling
//!   reactors, with a one-shot poll armed before a park): both into the
//!   connection's own buffer, from its front once everything before was
//!   consumed. Or one multishot `RECV` per connection armed once, drawing
//!   from the ring's provided-buffer ring ([`RecvMode::Multishot`], on
//!   request). Frames are lent in place from those buffers, and a frame
//!   straddling two chunks is reassembled in a bounded per-connection
//!   buffer. Provided buffers go back to the kernel once consumed.
//! * **Parking.** A `DEFER_TASKRUN` ring parks its reactor inside
//!   `io_uring_enter` ([`Sleep::Own`](starwire_transport::Sleep::Own));
//!   other rings in `poll(2)` on the ring's descriptor
//!   ([`Sleep::Fds`](starwire_transport::Sleep::Fds)).
//! * **Kernel features** are probed ([`probe`]); a missing op falls back to
//!   its plain form where one exists ([`Features::fallbacks`]).
//! * **Memory lock limit.** The registered bytes are checked against
//!   `RLIMIT_MEMLOCK` first ([`UringError::Memlock`] says how to raise it).
//!
//! User documentation: `docs/backends/uring.md`.
#![deny(unsafe_code)]

#[cfg(target_os = "linux")]
mod config;
#[cfg(target_os = "linux")]
mod driver;
#[cfg(target_os = "linux")]
mod probe;
#[cfg(target_os = "linux")]
mod ring;
#[cfg(target_os = "linux")]
mod stage;
#[cfg(target_os = "linux")]
mod sys;

#[cfg(target_os = "linux")]
pub use config::{RecvMode, UringConfig, UringError, UringStats, DEFAULT_RECV_CHUNK_LEN};
#[cfg(target_os = "linux")]
pub use driver::UringDriver;
#[cfg(target_os = "linux")]
pub use probe::{probe, Features};
#[cfg(target_os = "linux")]
pub use ring::ConnStats;
#[cfg(target_os = "linux")]
pub use starwire_bufpool::{HugePolicy, MemlockError};

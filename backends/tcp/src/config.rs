//! Limits and tuning knobs of the TCP backend.

use starwire_wire::{Limits, HEADER_LEN};
use thiserror::Error;

/// Default largest frame, header included: 1 MiB.
pub const DEFAULT_MAX_FRAME_LEN: usize = 1 << 20;
/// Default largest message (`message_len` over all chunks): 256 MiB.
pub const DEFAULT_MAX_MESSAGE_LEN: usize = 256 << 20;
/// Default bound of the send queue: 4 MiB (four maximum-size frames).
pub const DEFAULT_TX_QUEUE_LIMIT_BYTES: usize = 4 << 20;
/// Default receive buffer: 2 MiB (two maximum-size frames).
pub const DEFAULT_RX_BUFFER_LEN: usize = 2 << 20;
/// Default [`TcpConfig::gather_copy_threshold`]: 256 bytes.
pub const DEFAULT_GATHER_COPY_THRESHOLD: usize = 256;
/// Default [`TcpConfig::loopback_send_buffer`] (shared with the io_uring
/// backend): 512 KiB requested.
pub use starwire_transport::socket::DEFAULT_LOOPBACK_SEND_BUFFER;

/// Configuration of one TCP connection (see `docs/backends/tcp.md`).
///
/// Both ends should agree on [`max_frame_len`](Self::max_frame_len) and
/// [`max_message_len`](Self::max_message_len): a receiver rejects a frame
/// that exceeds its own limits with a framing error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpConfig {
    /// The largest frame, header included, that is sent or accepted.
    /// Longer messages are chunked by the message layer. At least
    /// [`HEADER_LEN`], at most `HEADER_LEN + u32::MAX`.
    /// Default [`DEFAULT_MAX_FRAME_LEN`] (1 MiB).
    pub max_frame_len: usize,
    /// The largest `message_len` a received header may announce; at most
    /// `u32::MAX`. Default [`DEFAULT_MAX_MESSAGE_LEN`] (256 MiB).
    pub max_message_len: usize,
    /// Bound of the send queue in bytes (staged and gathered bytes not yet
    /// written). `tx_reserve`/`tx_gather` report back-pressure beyond it.
    /// At least `max_frame_len`. Default [`DEFAULT_TX_QUEUE_LIMIT_BYTES`].
    pub tx_queue_limit_bytes: usize,
    /// Size of the receive buffer, allocated once per connection; it never
    /// grows. At least `2 * max_frame_len`. Larger values mean larger reads
    /// and fewer tail moves. Default [`DEFAULT_RX_BUFFER_LEN`] (2 MiB).
    pub rx_buffer_len: usize,
    /// `tx_gather` copies segments of at most this many bytes into the
    /// staging buffer instead of holding them as separate `iovec`s; larger
    /// segments are kept by reference (zero copy). `0` keeps every segment
    /// by reference. Default [`DEFAULT_GATHER_COPY_THRESHOLD`].
    pub gather_copy_threshold: usize,
    /// `SO_SNDBUF` to request from the kernel; `None` keeps the system
    /// default (autotuning).
    pub socket_send_buffer: Option<usize>,
    /// `SO_RCVBUF` to request from the kernel; `None` keeps the system
    /// default (autotuning). Applied before `connect`/`listen` when the
    /// backend creates the socket, so window scaling takes it into account.
    pub socket_recv_buffer: Option<usize>,
    /// `SO_SNDBUF` for a connection whose peer is a loopback address, when
    /// [`socket_send_buffer`](Self::socket_send_buffer) is `None`; `None`
    /// leaves loopback to autotuning too. Default
    /// [`DEFAULT_LOOPBACK_SEND_BUFFER`], which says why.
    pub loopback_send_buffer: Option<usize>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            max_message_len: DEFAULT_MAX_MESSAGE_LEN,
            tx_queue_limit_bytes: DEFAULT_TX_QUEUE_LIMIT_BYTES,
            rx_buffer_len: DEFAULT_RX_BUFFER_LEN,
            gather_copy_threshold: DEFAULT_GATHER_COPY_THRESHOLD,
            socket_send_buffer: None,
            socket_recv_buffer: None,
            loopback_send_buffer: Some(DEFAULT_LOOPBACK_SEND_BUFFER),
        }
    }
}

/// A [`TcpConfig`] whose limits contradict each other.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `max_frame_len` is below the header size or above what a header can
    /// describe.
    #[error("max_frame_len {0} must be within {HEADER_LEN}..={max}", max = max_frame_limit())]
    MaxFrameLen(usize),
    /// `max_message_len` does not fit the header's 32-bit field.
    #[error("max_message_len {0} exceeds u32::MAX")]
    MaxMessageLen(usize),
    /// The send queue cannot hold one maximum-size frame.
    #[error("tx_queue_limit_bytes {limit} is below max_frame_len {max_frame_len}")]
    TxQueueLimit {
        /// Configured limit.
        limit: usize,
        /// Configured maximum frame.
        max_frame_len: usize,
    },
    /// The receive buffer is smaller than two maximum-size frames.
    #[error("rx_buffer_len {len} is below 2 * max_frame_len ({max_frame_len})")]
    RxBufferLen {
        /// Configured buffer length.
        len: usize,
        /// Configured maximum frame.
        max_frame_len: usize,
    },
}

fn max_frame_limit() -> u64 {
    HEADER_LEN as u64 + u64::from(u32::MAX)
}

impl TcpConfig {
    /// Check that the limits are consistent.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_frame_len < HEADER_LEN || self.max_frame_len as u64 > max_frame_limit() {
            return Err(ConfigError::MaxFrameLen(self.max_frame_len));
        }
        if u32::try_from(self.max_message_len).is_err() {
            return Err(ConfigError::MaxMessageLen(self.max_message_len));
        }
        if self.tx_queue_limit_bytes < self.max_frame_len {
            return Err(ConfigError::TxQueueLimit {
                limit: self.tx_queue_limit_bytes,
                max_frame_len: self.max_frame_len,
            });
        }
        if self.rx_buffer_len / 2 < self.max_frame_len {
            return Err(ConfigError::RxBufferLen {
                len: self.rx_buffer_len,
                max_frame_len: self.max_frame_len,
            });
        }
        Ok(())
    }

    /// The limits every received header is checked against.
    pub(crate) fn limits(&self) -> Limits {
        Limits::new(
            u32::try_from(self.max_frame_len - HEADER_LEN).unwrap_or(u32::MAX),
            u32::try_from(self.max_message_len).unwrap_or(u32::MAX),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        assert_eq!(TcpConfig::default().validate(), Ok(()));
    }

    #[test]
    fn rejects_inconsistent_limits() {
        let d = TcpConfig::default();
        let c = TcpConfig {
            max_frame_len: 8,
            ..d
        };
        assert_eq!(c.validate(), Err(ConfigError::MaxFrameLen(8)));
        let c = TcpConfig {
            tx_queue_limit_bytes: d.max_frame_len - 1,
            ..d
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::TxQueueLimit { .. })
        ));
        let c = TcpConfig {
            rx_buffer_len: 2 * d.max_frame_len - 1,
            ..d
        };
        assert!(matches!(c.validate(), Err(ConfigError::RxBufferLen { .. })));
        let c = TcpConfig {
            rx_buffer_len: 2 * d.max_frame_len,
            ..d
        };
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(d.limits().max_frame_len(), d.max_frame_len);
    }
}

//! The lossy datagram service underneath the reliability core.

use std::time::Instant;

use thiserror::Error;

/// A datagram-link failure.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LinkError {
    /// A packet longer than the link MTU was committed; it was not sent.
    #[error("packet of {len} bytes exceeds the link MTU of {mtu}")]
    Oversized {
        /// Committed length.
        len: usize,
        /// The link MTU.
        mtu: usize,
    },
    /// `tx_commit` without a matching `tx_alloc`, or longer than allocated.
    #[error("tx_commit of {len} bytes without a matching tx_alloc (allocated: {allocated:?})")]
    BadCommit {
        /// Committed length.
        len: usize,
        /// Length of the outstanding allocation, if any.
        allocated: Option<usize>,
    },
    /// The device failed (port down, queue error).
    #[error("device error: {0}")]
    Device(String),
}

/// An unreliable datagram service: packets of at most [`mtu`](Self::mtu)
/// bytes that may be lost, duplicated, reordered or corrupted.
///
/// This is what the DPDK backend implements, one instance per port queue
/// pair (one per core), shared by every connection of the core's
/// [`DatagramDriver`](crate::DatagramDriver): [`tx_alloc`](Self::tx_alloc)
/// lends the data room of an mbuf, [`tx_commit`](Self::tx_commit) sets its
/// data length and queues it for the next burst,
/// [`tx_burst_flush`](Self::tx_burst_flush) is one `rte_eth_tx_burst` of
/// everything queued (the batch send), and [`rx_burst`](Self::rx_burst) is
/// one `rte_eth_rx_burst` whose mbufs are lent to the sink in place and
/// freed afterwards. Nothing here blocks or reads the clock.
pub trait DatagramLink {
    /// The largest datagram, in bytes, the link carries (the payload of an
    /// Ethernet frame after the L2/L3 headers the driver adds).
    fn mtu(&self) -> usize;

    /// Lend `len` bytes of transmit buffer for one packet. Returns `None`
    /// when no buffer is free (TX ring or mempool exhausted): call
    /// [`tx_burst_flush`](Self::tx_burst_flush) and retry. Allocating again
    /// without committing abandons (and reuses) the earlier buffer.
    /// `len` should not exceed [`mtu`](Self::mtu).
    fn tx_alloc(&mut self, len: usize) -> Option<&mut [u8]>;

    /// Queue the first `len` bytes of the last allocation as one packet.
    /// A packet longer than the MTU is refused with
    /// [`LinkError::Oversized`] and not sent.
    fn tx_commit(&mut self, len: usize) -> Result<(), LinkError>;

    /// Hand every queued packet to the device (one burst). Returns how many
    /// packets were handed over.
    fn tx_burst_flush(&mut self, now: Instant) -> Result<usize, LinkError>;

    /// Receive up to `max` packets, lending each to `sink` in place for the
    /// duration of the call. Returns how many were lent.
    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, LinkError>;

    /// The driver freed our connection `local_conn` (its id until then):
    /// a link that keeps something per connection (a peer address) lets
    /// it go. Nothing by default.
    fn forget(&mut self, local_conn: u32) {
        let _ = local_conn;
    }
}

//! starwire's reliable-datagram layer: the protocol the DPDK backend runs
//! over lossy MTU-sized datagrams, written sans-IO so the driver stays thin.
//!
//! * [`DatagramLink`]: the lossy datagram service a driver implements
//!   (lent TX buffers, TX/RX bursts), mirroring DPDK's mbufs and
//!   `rte_eth_tx_burst`/`rte_eth_rx_burst`.
//! * [`ReliableCore`]: the protocol itself, sans-IO (like `quinn-proto`):
//!   frames, datagrams and `now` go in; datagrams, frames and deadlines come
//!   out. It fragments frames into packets of at most the MTU, numbers them,
//!   acknowledges cumulatively and selectively (piggybacked or standalone,
//!   delayed by time and packet count), retransmits on a backed-off timer and
//!   on selective-ack holes, bounds both windows, drops corrupted and
//!   duplicate packets, and delivers frames in order, exactly once.
//! * [`Reliable`]: a [`ReliableCore`] driven over a [`DatagramLink`], as a
//!   [`starwire_transport::Transport`].
//! * [`LossyLink`]: an in-memory link pair that loses, duplicates, reorders
//!   and corrupts packets deterministically per seed, for tests.
//!
//! The packet format and protocol rules are in [`packet`] and in
//! `docs/backends/datagram.md`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod core;
pub mod link;
pub mod lossy;
pub mod packet;
pub mod reliable;

pub use crate::core::{ConfigError, CoreStats, ReliableConfig, ReliableCore};
pub use crate::link::{DatagramLink, LinkError};
pub use crate::lossy::{LinkStats, LossConfig, LossyLink};
pub use crate::packet::{PacketError, PacketFlags, PacketHeader, PACKET_HEADER_LEN};
pub use crate::reliable::Reliable;

//! starwire's reliable-datagram layer: the protocol the DPDK backend runs
//! over lossy MTU-sized datagrams, written sans-IO so the driver stays thin.
//!
//! * [`DatagramLink`]: the lossy datagram service a device provides (lent
//!   TX buffers, one TX burst, one RX burst), mirroring DPDK's mbufs and
//!   `rte_eth_tx_burst`/`rte_eth_rx_burst` on one queue pair.
//! * [`ReliableCore`]: the protocol of one connection, sans-IO (like
//!   `quinn-proto`): frames, datagrams and `now` go in; datagrams, frames
//!   and deadlines come out. It fragments frames into packets of at most the
//!   MTU, numbers them, acknowledges cumulatively and selectively
//!   (piggybacked or standalone, delayed by time and packet count),
//!   retransmits on a backed-off timer and on selective-ack holes, bounds
//!   both windows, drops corrupted and duplicate packets, and delivers
//!   frames in order, exactly once.
//! * [`DatagramDriver`]: the [`Driver`](starwire_transport::Driver) of one
//!   reactor: one link shared by every connection, a [`ReliableCore`] per
//!   connection, packets routed by the connection id in their header, one
//!   burst per flush and per receive pass.
//! * [`LossyLink`]: an in-memory link pair that loses, duplicates, reorders
//!   and corrupts packets deterministically per seed, for tests;
//!   [`Impaired`] does the same to what is sent over any other link (a
//!   real DPDK port).
//! * [`udp`]: the Ethernet/IPv4/UDP encapsulation of the DPDK backend;
//!   [`arp`]: the ARP messages it answers; [`hello`]: the line each end
//!   of its connections sends the other before any datagram.
//!
//! The packet format and protocol rules are in [`packet`] and in
//! `docs/backends/datagram.md`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod arp;
pub mod core;
pub mod driver;
mod faults;
pub mod hello;
pub mod impair;
pub mod link;
pub mod lossy;
pub mod packet;
pub mod udp;

pub use crate::core::{
    ConfigError, ConnIds, CoreStats, ReliableConfig, ReliableCore, BACKLOG_FRAMES_LEN,
};
pub use crate::driver::{
    DatagramDriver, DatagramError, DatagramStats, Exchange, StreamBootstrap, IDLE_NAP,
    MAX_CONNECTIONS,
};
pub use crate::impair::{ImpairStats, Impaired};
pub use crate::link::{DatagramLink, LinkError};
pub use crate::lossy::{LinkStats, LossConfig, LossyLink};
pub use crate::packet::{PacketError, PacketFlags, PacketHeader, PACKET_HEADER_LEN};

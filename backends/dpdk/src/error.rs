//! What can go wrong setting up DPDK, one variant per failing step, each
//! with DPDK's own reason where it gave one.

use thiserror::Error;

/// Setting up the EAL, a port or a thread failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DpdkError {
    /// The EAL arguments could not be split into words (an open quote).
    #[error("EAL arguments {args:?}: {why}")]
    EalArgs {
        /// The arguments as given.
        args: String,
        /// What is wrong with them.
        why: String,
    },
    /// `rte_eal_init` failed.
    #[error("DPDK EAL initialisation with {args:?} failed: {reason} (rte_errno {errno})")]
    EalInit {
        /// The arguments it ran with.
        args: String,
        /// `rte_errno`.
        errno: i32,
        /// `rte_strerror(rte_errno)`.
        reason: String,
    },
    /// The EAL runs already with other arguments: it initialises once per
    /// process.
    #[error(
        "the DPDK EAL is already initialised in this process with {running:?}; it cannot be \
         initialised again with {asked:?}"
    )]
    EalAlreadyInitialised {
        /// The arguments the EAL runs with.
        running: String,
        /// The arguments asked for now.
        asked: String,
    },
    /// A `net_af_xdp` or `net_af_packet` device names a network interface
    /// that does not exist (checked before the EAL, whose own message
    /// would be a generic probe failure).
    #[error(
        "{driver} device {vdev:?}: network interface {iface:?} does not exist \
         (see `ip link`; in a namespace, run inside it)"
    )]
    InterfaceMissing {
        /// The poll-mode driver (`net_af_xdp`, `net_af_packet`).
        driver: String,
        /// The `--vdev` argument.
        vdev: String,
        /// The interface it names.
        iface: String,
    },
    /// The port index names no port the EAL probed.
    #[error(
        "no DPDK port {port}: the EAL probed {available} port(s); add a device to the EAL \
         arguments (e.g. --vdev=net_ring0, --vdev=net_af_xdp,iface=veth0) or pick another \
         --dpdk-port"
    )]
    NoPort {
        /// The port asked for.
        port: u16,
        /// How many ports exist.
        available: u16,
    },
    /// A port query (`rte_eth_dev_info_get`, MAC, MTU, link) failed.
    #[error("DPDK port {port}: {call} failed: {reason} (errno {errno})")]
    PortQuery {
        /// The port.
        port: u16,
        /// The DPDK function.
        call: &'static str,
        /// Its error number.
        errno: i32,
        /// DPDK's text for it.
        reason: String,
    },
    /// The mbuf count asked for cannot fill the port's rings.
    #[error(
        "too few mbufs for DPDK port {port}: {asked} asked, {need} needed ({why}); \
         raise the mbuf count or lower the queue depths"
    )]
    TooFewMbufs {
        /// The port.
        port: u16,
        /// The mbufs asked for.
        asked: u32,
        /// The fewest that work.
        need: u32,
        /// Where the need comes from.
        why: String,
    },
    /// `rte_pktmbuf_pool_create` failed (most often: not enough memory
    /// for the pool under the EAL's `-m`).
    #[error("creating a pool of {mbufs} mbufs for DPDK port {port} failed: {reason} (rte_errno {errno})")]
    Mempool {
        /// The port.
        port: u16,
        /// Pool size.
        mbufs: u32,
        /// `rte_errno`.
        errno: i32,
        /// DPDK's text for it.
        reason: String,
    },
    /// Configuring or starting the port failed.
    #[error("DPDK port {port}: {step} failed: {reason} (errno {errno})")]
    PortSetup {
        /// The port.
        port: u16,
        /// The step (`rte_eth_dev_configure`, `rte_eth_rx_queue_setup(3)`, ...).
        step: String,
        /// Its error number.
        errno: i32,
        /// DPDK's text for it.
        reason: String,
    },
    /// The port's link stayed down.
    #[error("DPDK port {port}: link still down after {waited_ms} ms")]
    LinkDown {
        /// The port.
        port: u16,
        /// How long we waited.
        waited_ms: u64,
    },
    /// Another link of the shared queue is bound to the UDP port.
    #[error("UDP port {udp_port} is already bound on DPDK queue {queue}")]
    UdpPortInUse {
        /// The queue index.
        queue: u16,
        /// The UDP port.
        udp_port: u16,
    },
    /// `rte_thread_register` failed (all `RTE_MAX_LCORE` ids in use).
    #[error("registering this thread with the DPDK EAL failed: {reason} (rte_errno {errno})")]
    ThreadRegister {
        /// `rte_errno`.
        errno: i32,
        /// DPDK's text for it.
        reason: String,
    },
    /// The port has no queue pair left to take.
    #[error("DPDK port {port}: no queue pair left")]
    NoQueue {
        /// The port index.
        port: u16,
    },
    /// Every queue pair of a port's queue set is held by a link.
    #[error(
        "DPDK port {port}: all {queues} queue pairs are held by links; set up one per \
         reactor (--dpdk-queues)"
    )]
    QueuesTaken {
        /// The port index.
        port: u16,
        /// Queue pairs in the set.
        queues: usize,
    },
    /// The process's port was closed (its command is done).
    #[error("the DPDK port is closed")]
    PortClosed,
    /// A datagram driver refused the link's settings.
    #[error("DPDK datagram driver: {0}")]
    Driver(String),
    /// The bootstrap connection cannot name this end's address.
    #[error("DPDK bootstrap address: {0}")]
    Bootstrap(String),
}

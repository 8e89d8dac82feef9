//! The backends the trainer's sessions run over: the driver each PS
//! reactor and each worker thread makes, and the transport settings of
//! training traffic.

use std::io;

use starwire_tcp::{TcpConfig, TcpDriver};
use starwire_transport::StreamDriver;

/// A backend of the trainer: its name and the driver a thread makes.
pub trait Backend: Send + Sync + 'static {
    /// The driver of one thread: every connection of a PS reactor, or of a
    /// worker.
    type Driver: StreamDriver + Send + std::fmt::Debug + 'static;
    /// The name on the command line and in reports.
    const NAME: &'static str;
    /// A driver for the calling thread (one driver per thread; an io_uring
    /// ring is its thread's), whose thread polls (`polling`: busy, or
    /// before it parks) or parks at once.
    fn driver(polling: bool) -> io::Result<Self::Driver>;
}

/// The TCP backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tcp;

impl Backend for Tcp {
    type Driver = TcpDriver;
    const NAME: &'static str = "tcp";
    fn driver(_polling: bool) -> io::Result<TcpDriver> {
        TcpDriver::new(tcp_config())
    }
}

/// Transport settings for training traffic: frames of 1 MiB (bigger
/// messages are chunked by the connection), 8 MiB of send queue.
pub fn tcp_config() -> TcpConfig {
    TcpConfig {
        max_frame_len: 1 << 20,
        rx_buffer_len: 2 << 20,
        tx_queue_limit_bytes: 8 << 20,
        ..TcpConfig::default()
    }
}

#[cfg(all(feature = "uring", target_os = "linux"))]
pub use uring_backend::Uring;

#[cfg(all(feature = "uring", target_os = "linux"))]
mod uring_backend {
    use std::io;

    use starwire_uring::{UringConfig, UringDriver};

    use super::Backend;

    /// The io_uring backend: one ring per thread, every connection of the
    /// thread on it, one `io_uring_enter` per turn
    /// (`STARWIRE_URING_SQPOLL=1` for SQPOLL).
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Uring;

    impl Backend for Uring {
        type Driver = UringDriver;
        const NAME: &'static str = "uring";
        fn driver(polling: bool) -> io::Result<UringDriver> {
            // A polling thread receives in spin mode (`RecvMode::Spin`).
            UringDriver::new(&UringConfig::for_polling(polling)).map_err(io::Error::other)
        }
    }
}

#[cfg(all(feature = "verbs", target_os = "linux"))]
pub use verbs_backend::{set_verbs_device, Verbs};

#[cfg(all(feature = "verbs", target_os = "linux"))]
mod verbs_backend {
    use std::io;
    use std::sync::OnceLock;

    use starwire_rdma::{RdmaDriver, RingConfig};
    use starwire_verbs::{NicConfig, VerbsDevice, VerbsDriver, VerbsNic};

    use super::Backend;

    /// The device every verbs driver of the process uses: opened once, so
    /// the process has one protection domain per device.
    static DEVICE: OnceLock<VerbsDevice> = OnceLock::new();

    /// Use `dev` for the verbs backend of this process (the first call
    /// wins).
    pub fn set_verbs_device(dev: VerbsDevice) {
        let _ = DEVICE.set(dev);
    }

    /// The RDMA verbs backend: one completion queue per thread, a queue
    /// pair and a ring per connection, each set up over its TCP connection.
    /// Rings carry frames of 1 MiB, as the TCP backend's.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Verbs;

    impl Backend for Verbs {
        type Driver = VerbsDriver;
        const NAME: &'static str = "verbs";
        fn driver(_polling: bool) -> io::Result<VerbsDriver> {
            let dev = DEVICE.get().ok_or_else(|| {
                io::Error::other("the verbs backend has no device (set_verbs_device)")
            })?;
            let nic = VerbsNic::new(dev, NicConfig::default()).map_err(io::Error::other)?;
            let ring = RingConfig {
                ring_len: 2 << 20,
                staging_len: 2 << 20,
                ..RingConfig::default()
            };
            let rdma = RdmaDriver::new(nic, ring).map_err(io::Error::other)?;
            Ok(VerbsDriver::new(rdma))
        }
    }
}

#[cfg(feature = "dpdk")]
pub use dpdk_backend::Dpdk;

#[cfg(feature = "dpdk")]
mod dpdk_backend {
    use std::io;

    use starwire_datagram::ReliableConfig;
    use starwire_dpdk::{DpdkContext, DpdkDriver};

    use super::Backend;

    /// The DPDK backend: each thread's driver is a link of its own on the
    /// process's DPDK port ([`DpdkContext`], set up by the command from
    /// `--eal`, `--dpdk-port` and `--dpdk-ip`), bound to a UDP port of its
    /// own, so every PS reactor and worker of one process shares the port.
    /// Each connection is bootstrapped over the TCP stream the roles dial
    /// and accept as for tcp (`StreamDriver::attach_stream`); its frames
    /// then travel as reliable datagrams through the port.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Dpdk;

    impl Backend for Dpdk {
        type Driver = DpdkDriver;
        const NAME: &'static str = "dpdk";
        /// A DPDK queue has no receive interrupt: the thread polls
        /// whatever `polling` says.
        fn driver(_polling: bool) -> io::Result<DpdkDriver> {
            let ctx = DpdkContext::get().map_err(io::Error::other)?;
            // Mempool caches are per EAL thread.
            ctx.register_thread();
            ctx.driver(ctx.ip_or_loopback(), ReliableConfig::default())
                .map_err(io::Error::other)
        }
    }
}

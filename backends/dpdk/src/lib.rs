//! The DPDK backend of starwire: kernel bypass over DPDK poll-mode
//! drivers (`net_ring`, `net_af_packet`, `net_af_xdp`, PCI NICs).
//!
//! * [`Eal`]: the EAL, initialised once per process from `--eal "ARGS"`
//!   or `STARWIRE_EAL_ARGS`, and [`Eal::register_thread`] for reactor
//!   threads DPDK did not start.
//! * [`Port`]: a port by index, its rx/tx queue pairs, one mempool sized
//!   from their depths, its MTU, MAC, link and counters.
//! * [`DpdkLink`]: a [`DatagramLink`](starwire_datagram::DatagramLink)
//!   over one queue pair, carrying each datagram in Ethernet/IPv4/UDP
//!   ([`starwire_datagram::udp`]); under a
//!   [`DatagramDriver`](starwire_datagram::DatagramDriver) it is one
//!   reactor's driver. A port with a queue pair per link is a
//!   [`QueueSet`]: each link leases a pair, steered to it by `rte_flow`
//!   or handed its packets by the other links over lock-free rings
//!   ([`steer`]). Links that share one queue pair go through a
//!   [`SharedQueue`], which demultiplexes by UDP destination port.
//!
//! * [`DpdkContext`]: the process's port, opened once and shared by its
//!   links; [`bootstrap`]: the exchange of addresses and connection ids
//!   over a TCP stream, which makes a `DatagramDriver<DpdkLink>` a
//!   [`StreamDriver`](starwire_transport::StreamDriver).
//!
//! Every call into DPDK is in the private `ffi` module, the only place
//! this crate allows `unsafe`; the raw bindings are `starwire-dpdk-sys`.
//! `docs/backends/dpdk.md` says what runs and how.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod bootstrap;
pub mod context;
pub mod eal;
pub mod error;
#[allow(unsafe_code)]
mod ffi;
pub mod link;
pub mod port;
pub mod steer;

pub use crate::bootstrap::{bootstrap, BootstrapError, Hello, OnDpdk};
pub use crate::context::{CloseOnDrop, ContextConfig, DpdkContext, DpdkDriver};
pub use crate::eal::{eal_args, split_args, Eal, EAL_ARGS_ENV};
pub use crate::error::DpdkError;
pub use crate::link::{DpdkLink, DpdkLinkStats, LinkConfig, SharedQueue};
pub use crate::port::{DeviceInfo, LinkStatus, Port, PortConfig, PortQueue, PortStats};
pub use crate::steer::{probe_steering, QueueSet, Steering, HANDOVER_HOLD};

/// What the unit tests share: the EAL initialises once per process, so
/// every unit test that needs it passes these same arguments (a second
/// initialisation with them returns the running EAL), and each opens a
/// ring-backed port of its own, as a port closes for good when it stops.
#[cfg(test)]
pub(crate) mod testing {
    use crate::Eal;

    /// Ring-backed ports without hugepages or PCI devices: port 0 for
    /// `ffi`'s test, 1 and 2 for `link`'s, 3 to 5 for `steer`'s.
    const EAL_ARGS: &str = "--no-huge --no-pci --no-shconf -m 512 --vdev=net_ring0 \
        --vdev=net_ring1 --vdev=net_ring2 --vdev=net_ring3 --vdev=net_ring4 \
        --vdev=net_ring5";

    /// The EAL, with the calling thread registered as an lcore.
    pub(crate) fn eal() -> &'static Eal {
        let eal = Eal::init(EAL_ARGS).expect("EAL");
        eal.register_thread().expect("lcore");
        eal
    }
}

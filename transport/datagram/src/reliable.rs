//! [`Reliable`]: the reliability core driven over a [`DatagramLink`], as a
//! [`Transport`].

use std::time::Instant;

use starwire_transport::{Link, Transport, TransportError};

use crate::core::{ConfigError, ReliableConfig, ReliableCore};
use crate::link::{DatagramLink, LinkError};

/// A reliable, ordered frame transport over a lossy datagram link: a thin
/// driver that moves packets between a [`ReliableCore`] and a
/// [`DatagramLink`].
///
/// * [`flush`](Transport::flush) runs the timers, then writes every packet
///   the core has to send (retransmissions, new data, a due
///   acknowledgement) into buffers lent by [`DatagramLink::tx_alloc`] and
///   hands them over with [`DatagramLink::tx_burst_flush`] (a second burst
///   only if the link's TX ring filled up).
/// * [`rx_burst`](Transport::rx_burst) delivers frames already reassembled,
///   pulls one burst of up to [`ReliableConfig::rx_batch`] packets from the
///   link (single-packet frames arriving in order are lent to the sink
///   straight from the link's buffer), runs the timers and sends what became
///   due (acknowledgements), so a peer that only receives still acknowledges.
#[derive(Debug)]
pub struct Reliable<L> {
    link: L,
    core: ReliableCore,
}

fn link_err(e: LinkError) -> TransportError {
    TransportError::Link(format!("datagram link: {e}"))
}

impl<L: DatagramLink> Reliable<L> {
    /// Wrap `link`; packets are sized to its MTU.
    pub fn new(link: L, cfg: ReliableConfig) -> Result<Self, ConfigError> {
        let core = ReliableCore::new(cfg, link.mtu())?;
        Ok(Self { link, core })
    }

    /// The protocol state.
    pub fn core(&self) -> &ReliableCore {
        &self.core
    }

    /// The link.
    pub fn link(&self) -> &L {
        &self.link
    }

    /// The link, mutably.
    pub fn link_mut(&mut self) -> &mut L {
        &mut self.link
    }

    /// Take the parts apart.
    pub fn into_parts(self) -> (L, ReliableCore) {
        (self.link, self.core)
    }

    fn transmit(&mut self, now: Instant) -> Result<(), TransportError> {
        let mtu = self.core.mtu();
        while self.core.wants_transmit(now) {
            if self.link.tx_alloc(mtu).is_none() {
                // TX ring full: push this burst out and try once more.
                self.link.tx_burst_flush(now).map_err(link_err)?;
            }
            let Some(buf) = self.link.tx_alloc(mtu) else {
                break;
            };
            let Some(len) = self.core.poll_transmit(now, buf) else {
                break;
            };
            self.link.tx_commit(len).map_err(link_err)?;
        }
        self.link.tx_burst_flush(now).map_err(link_err)?;
        Ok(())
    }
}

/// A driver of reliable datagram links busy-polls: a link has no
/// descriptor to park on.
impl<L: DatagramLink> Link for Reliable<L> {}

impl<L: DatagramLink> Transport for Reliable<L> {
    fn max_frame_len(&self) -> usize {
        self.core.max_frame_len()
    }

    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.core.tx_reserve(len)
    }

    fn tx_commit(&mut self, len: usize) {
        self.core.tx_commit(len);
    }

    fn flush(&mut self, now: Instant) -> Result<(), TransportError> {
        self.core.check()?;
        self.core.handle_timeout(now);
        self.core.check()?;
        self.transmit(now)
    }

    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        self.core.check()?;
        let mut budget = max;
        budget -= self.core.deliver(budget, sink);
        let core = &mut self.core;
        let batch = core.config().rx_batch;
        self.link
            .rx_burst(now, batch, &mut |pkt| {
                core.handle_packet(now, pkt, sink, &mut budget);
            })
            .map_err(link_err)?;
        budget -= self.core.deliver(budget, sink);
        self.core.check()?;
        self.core.handle_timeout(now);
        self.core.check()?;
        self.transmit(now)?;
        Ok(max - budget)
    }

    fn tx_pending(&self) -> bool {
        self.core.tx_pending()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.core.poll_timeout()
    }
}

//! Congestion control of [`ReliableCore`](super::ReliableCore): a
//! loss-based congestion window in packets, additive increase and
//! multiplicative decrease (NewReno's rules, RFC 5681 and RFC 6582, on
//! packets rather than bytes).
//!
//! The window starts at the whole send window: on a fabric with room the
//! first burst goes at once, as eRPC's sessions start at line rate, and a
//! run without loss never meets the congestion window. A loss episode
//! (fast retransmission or a retransmission timeout) halves the packets
//! in flight, once per episode: losses of packets sent before the
//! reduction are the same congestion. The window then grows by one packet
//! per window of packets acknowledged, up to the send window.
//!
//! A timeout halves too instead of falling to the minimum as TCP's does.
//! The core resends one packet on a timeout because a timeout is as often
//! a peer that was not scheduled as a loss (see `handle_timeout`); a
//! lost tail shows up in the acknowledgement of that packet and is
//! answered then.
//!
//! Delay-based control (eRPC's Timely, Swift) needs round-trip times
//! steadier than those of busy-polling processes that share cores; loss is
//! the signal every link here gives.

use super::seq_lt;

#[derive(Debug, Clone)]
pub(super) struct CongestionWindow {
    cwnd: u32,
    /// Largest window: the send window.
    max: u32,
    /// Smallest window a decrease leaves.
    min: u32,
    /// Packets acknowledged towards the next one-packet increase.
    acked: u32,
    /// Set by a decrease to the next sequence number to send: the episode
    /// lasts until everything sent before it is acknowledged.
    recovery_end: Option<u32>,
}

impl CongestionWindow {
    pub(super) fn new(max: u32, min: u32) -> Self {
        Self {
            cwnd: max,
            max,
            min: min.min(max),
            acked: 0,
            recovery_end: None,
        }
    }

    /// Packets that may be in the network (sent, neither cumulatively nor
    /// selectively acknowledged) before no new packet goes.
    pub(super) fn window(&self) -> u32 {
        self.cwnd
    }

    /// `newly` packets were acknowledged, `snd_una` is the oldest one
    /// still unacknowledged. Ends a loss episode once everything sent
    /// before it is acknowledged; after an episode the window grows by
    /// one packet per window acknowledged.
    pub(super) fn on_acked(&mut self, newly: u32, snd_una: u32) {
        if let Some(end) = self.recovery_end {
            // The acknowledgement that ends the episode leaves the reduced
            // window as it is; growth starts after it.
            if !seq_lt(snd_una, end) {
                self.recovery_end = None;
            }
            return;
        }
        self.acked += newly;
        while self.acked >= self.cwnd && self.cwnd < self.max {
            self.acked -= self.cwnd;
            self.cwnd += 1;
        }
        if self.cwnd >= self.max {
            self.acked = 0;
        }
    }

    /// A loss was detected while `flight` packets were in flight and
    /// `next_new` is the next sequence number to send. Returns whether the
    /// window was reduced (the first loss of an episode).
    pub(super) fn on_loss(&mut self, flight: u32, next_new: u32) -> bool {
        if self.recovery_end.is_some() {
            return false;
        }
        self.cwnd = (flight / 2).clamp(self.min, self.max);
        self.acked = 0;
        self.recovery_end = Some(next_new);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::CongestionWindow;

    #[test]
    fn starts_at_the_send_window_and_never_exceeds_it() {
        let mut c = CongestionWindow::new(256, 4);
        assert_eq!(c.window(), 256);
        c.on_acked(10_000, 10_000);
        assert_eq!(c.window(), 256);
    }

    #[test]
    fn a_loss_episode_halves_the_flight_once() {
        let mut c = CongestionWindow::new(256, 4);
        assert!(c.on_loss(100, 1000));
        assert_eq!(c.window(), 50);
        // More losses of packets sent before the reduction: same episode.
        assert!(!c.on_loss(100, 1010));
        assert_eq!(c.window(), 50);
        // Acknowledgements inside the episode do not grow the window.
        c.on_acked(60, 999);
        assert_eq!(c.window(), 50);
        // Everything sent before the reduction acknowledged: the episode
        // ends, and a new loss halves again.
        c.on_acked(1, 1000);
        assert!(c.on_loss(50, 1100));
        assert_eq!(c.window(), 25);
    }

    #[test]
    fn the_window_never_falls_below_its_minimum() {
        let mut c = CongestionWindow::new(256, 4);
        assert!(c.on_loss(3, 10));
        assert_eq!(c.window(), 4);
        // A minimum above the send window is the send window.
        let c = CongestionWindow::new(8, 16);
        assert_eq!(c.window(), 8);
    }

    #[test]
    fn grows_one_packet_per_window_acknowledged() {
        let mut c = CongestionWindow::new(256, 4);
        c.on_loss(20, 100);
        assert_eq!(c.window(), 10);
        c.on_acked(20, 100);
        assert_eq!(c.window(), 10, "the episode's end does not count");
        c.on_acked(9, 109);
        assert_eq!(c.window(), 10, "9 of 10 acknowledged");
        c.on_acked(1, 110);
        assert_eq!(c.window(), 11);
        c.on_acked(11 + 12, 130);
        assert_eq!(c.window(), 13);
    }

    #[test]
    fn sequence_numbers_wrap() {
        let mut c = CongestionWindow::new(64, 2);
        assert!(c.on_loss(40, 5)); // sent up to 4 after a wrap
        c.on_acked(10, u32::MAX - 3);
        assert!(!c.on_loss(40, 6), "still the episode before 5");
        c.on_acked(10, 5);
        assert!(c.on_loss(20, 30));
        assert_eq!(c.window(), 10);
    }
}

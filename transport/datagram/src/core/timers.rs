//! The clock side of [`ReliableCore`]: the next deadline, the
//! retransmission timeout with its backoff, and the RTT estimate that
//! sets it.

use std::time::{Duration, Instant};

use super::ReliableCore;

impl ReliableCore {
    /// The earliest instant the core needs [`handle_timeout`](Self::handle_timeout)
    /// or a transmit pass: the retransmission deadline, the delayed-ack
    /// deadline, or the last `now` seen if packets are waiting to be sent.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.failed.is_some() {
            return None;
        }
        let immediate = if !self.retx.is_empty() || self.new_data_ready() {
            self.last_now
        } else {
            None
        };
        [self.rto_deadline, self.ack_deadline, immediate]
            .into_iter()
            .flatten()
            .min()
    }

    /// Run the timers at `now`: on a retransmission timeout the oldest
    /// unacknowledged packet is queued again (on the n-th timeout in a
    /// row, the 2^(n-1) oldest) and the timeout backs off, until the next
    /// RTT sample (an acknowledgement of a packet sent only once: Karn's
    /// algorithm, see `on_ack`);
    /// after [`dead_after_timeouts`](crate::ReliableConfig::dead_after_timeouts)
    /// consecutive timeouts without progress the connection fails.
    ///
    /// One packet, not the window: a timeout is as often a peer that was
    /// not scheduled for a while (its packets wait in its receive ring) as
    /// a loss, and the acknowledgement of that one packet, when it is the
    /// only one that arrived, reports the rest of a lost tail as missing
    /// for fast retransmission (see `on_ack`). Timeouts in a row double
    /// the packets resent, so that a lossy link (where one packet and its
    /// acknowledgement are both lost ten times in a row often enough) does
    /// not fail the connection.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = Some(now);
        if self.failed.is_some() {
            return;
        }
        let Some(deadline) = self.rto_deadline else {
            return;
        };
        if deadline > now {
            return;
        }
        if self.snd_una == self.next_new {
            self.rto_deadline = None;
            return;
        }
        self.timeouts += 1;
        self.stats.timeouts += 1;
        if self.timeouts >= self.cfg.dead_after_timeouts {
            let why = format!(
                "peer unreachable: {} consecutive retransmission timeouts without an \
                 acknowledgement (last RTO {:?}, {} packets unacknowledged)",
                self.timeouts,
                self.current_rto(),
                self.in_flight()
            );
            self.fail(why);
            return;
        }
        // Kept across acknowledgements without an RTT sample, so it only
        // saturates; `current_rto` caps the factor anyway.
        self.backoff = self.backoff.saturating_add(1);
        tracing::debug!(
            conn = self.ids.local,
            snd_una = self.snd_una,
            rto = ?self.current_rto(),
            timeouts = self.timeouts,
            "retransmission timeout"
        );
        // The n-th timeout in a row resends the 2^(n-1) oldest packets
        // the peer has not reported (at most 256): one for a peer that was
        // not scheduled, more for a link that lost the last tries too.
        let probes = 1usize << (self.timeouts - 1).min(8);
        let sent = self.sent_in_flight() as usize;
        let mut queued = 0;
        for (i, p) in self.snd_buf.iter_mut().take(sent).enumerate() {
            if queued == probes {
                break;
            }
            if !p.sacked && !p.in_retx {
                p.in_retx = true;
                p.by_timeout = true;
                self.retx.push_back(self.snd_una.wrapping_add(i as u32));
                queued += 1;
            }
        }
        self.congestion();
        self.rto_deadline = Some(now + self.current_rto());
    }

    pub(super) fn rtt_sample(&mut self, rtt: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(srtt) => {
                let dev = if srtt > rtt { srtt - rtt } else { rtt - srtt };
                self.rttvar = (self.rttvar * 3 + dev) / 4;
                self.srtt = Some((srtt * 7 + rtt) / 8);
            }
        }
        let srtt = self.srtt.unwrap_or(rtt);
        self.rto = (srtt + (self.rttvar * 4).max(self.cfg.ack_delay))
            .clamp(self.cfg.rto_min, self.cfg.rto_max);
    }
}

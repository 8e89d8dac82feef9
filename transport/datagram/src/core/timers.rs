//! The clock side of [`ReliableCore`]: the next deadline, the
//! retransmission timeout with its backoff, and the RTT estimate that
//! sets it.

use std::time::{Duration, Instant};

use super::ReliableCore;
use crate::packet::SACK_BITS;

impl ReliableCore {
    /// The earliest instant the core needs [`handle_timeout`](Self::handle_timeout)
    /// or a transmit pass: the retransmission deadline, the delayed-ack
    /// deadline, or the last `now` seen if packets are waiting to be sent.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.failed.is_some() {
            return None;
        }
        let immediate = if !self.retx.is_empty() || self.next_new != self.snd_nxt {
            self.last_now
        } else {
            None
        };
        [self.rto_deadline, self.ack_deadline, immediate]
            .into_iter()
            .flatten()
            .min()
    }

    /// Run the timers at `now`: on a retransmission timeout the
    /// unacknowledged packets the peer can report on (the oldest
    /// unacknowledged one and the selective-ack range after it) are queued
    /// again and the timeout backs off; after
    /// [`dead_after_timeouts`](crate::ReliableConfig::dead_after_timeouts)
    /// consecutive timeouts without progress the connection fails.
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
        self.backoff += 1;
        tracing::debug!(
            conn = self.ids.local,
            snd_una = self.snd_una,
            rto = ?self.current_rto(),
            timeouts = self.timeouts,
            "retransmission timeout"
        );
        let sent = self.next_new.wrapping_sub(self.snd_una) as usize;
        let visible = sent.min(1 + SACK_BITS as usize);
        for (i, p) in self.snd_buf.iter_mut().take(visible).enumerate() {
            if !p.sacked && !p.in_retx {
                p.in_retx = true;
                self.retx.push_back(self.snd_una.wrapping_add(i as u32));
            }
        }
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

//! The receive side of [`ReliableCore`]: acknowledgements that free the
//! send buffer (and mark packets for fast retransmission), and data
//! packets reordered and reassembled into frames, delivered in order
//! exactly once.

use std::time::Instant;

use super::{seq_diff, seq_lt, ReliableCore, RxPacket, ACKS_OWED_MAX, FAST_RETRANSMIT_THRESHOLD};
use crate::packet::{PacketError, PacketFlags, PacketHeader, SACK_BITS};

impl ReliableCore {
    fn on_ack(&mut self, now: Instant, ack: u32, sack: u64) {
        if seq_lt(self.next_new, ack) {
            // Acknowledges data never sent: a confused or foreign peer.
            self.stats.bad_acks += 1;
            return;
        }
        let mut progress = false;
        let mut sample: Option<Instant> = None;
        let mut delivered = self.delivered_serial;
        // The latest serial of a packet a timeout sent again, when this
        // acknowledgement covers others too: then its earlier transmission
        // most likely arrived with them (the timeout fired while the peer
        // was not running, not for a loss), and its latest serial would
        // mark every packet sent between the two transmissions as lost.
        // Alone, it is the retransmission that arrived, after a loss.
        let mut by_timeout: Option<u64> = None;
        let mut newly = 0u32;
        if seq_lt(self.snd_una, ack) {
            let n = ack.wrapping_sub(self.snd_una);
            for _ in 0..n {
                let Some(p) = self.snd_buf.pop_front() else {
                    break;
                };
                if p.sacked {
                    self.sacked -= 1;
                } else {
                    newly += 1;
                    if p.by_timeout {
                        by_timeout = Some(p.serial);
                    } else {
                        delivered = delivered.max(p.serial);
                    }
                    if p.tx_count == 1 {
                        sample = p.sent_at;
                    }
                }
                // Its frame's last packet: the frame is done with.
                if p.flags.contains(PacketFlags::LAST) {
                    if let Some(frame) = self.tx_frames.pop_front() {
                        self.tx_frames_base += 1;
                        self.recycle_frame(frame);
                    }
                }
            }
            self.snd_una = ack;
            progress = true;
        }
        if sack != 0 {
            for i in 0..SACK_BITS {
                if sack & (1 << i) == 0 {
                    continue;
                }
                let s = ack.wrapping_add(1 + i);
                if !seq_lt(s, self.next_new) {
                    break;
                }
                if seq_lt(s, self.snd_una) {
                    continue;
                }
                let p = &mut self.snd_buf[s.wrapping_sub(self.snd_una) as usize];
                if !p.sacked {
                    p.sacked = true;
                    self.sacked += 1;
                    progress = true;
                    newly += 1;
                    if p.by_timeout {
                        by_timeout = Some(p.serial);
                        continue;
                    }
                    delivered = delivered.max(p.serial);
                    if p.tx_count == 1 {
                        sample = sample.max(p.sent_at);
                    }
                }
            }
        }
        if newly > 0 {
            self.cc.on_acked(newly, self.snd_una);
        }
        if progress {
            self.timeouts = 0;
            // Karn's algorithm (RFC 6298 §5.7): the backed-off timeout is
            // kept until an RTT sample, from a packet sent only once, says
            // what the timeout should be. An acknowledgement of
            // retransmissions alone gives none: were the backoff dropped
            // there, a path whose round trip outgrew the timeout would
            // time out every packet, each acknowledged only once resent,
            // and the estimate would never learn the longer round trip.
            if let Some(sent) = sample {
                self.backoff = 0;
                self.rtt_sample(now.saturating_duration_since(sent));
            }
            self.rto_deadline = if self.snd_una == self.next_new {
                None
            } else {
                Some(now + self.current_rto())
            };
        }
        if let (Some(serial), 1) = (by_timeout, newly) {
            delivered = delivered.max(serial);
        }
        if delivered > self.delivered_serial {
            self.delivered_serial = delivered;
            // A packet that this acknowledgement reports missing although
            // one sent well after it arrived is lost (or its retransmission
            // is): retransmit it now rather than at the timeout. Packets
            // beyond the reported range are unknown, not missing.
            let sent = self.next_new.wrapping_sub(self.snd_una);
            let end = ack.wrapping_add(1 + SACK_BITS);
            let reported = if seq_lt(self.snd_una, end) {
                end.wrapping_sub(self.snd_una).min(sent)
            } else {
                0
            };
            let mut lost = false;
            for (i, p) in self.snd_buf.iter_mut().take(reported as usize).enumerate() {
                if !p.sacked && !p.in_retx && p.serial + FAST_RETRANSMIT_THRESHOLD <= delivered {
                    p.in_retx = true;
                    p.by_timeout = false;
                    self.retx.push_back(self.snd_una.wrapping_add(i as u32));
                    self.stats.fast_retransmits += 1;
                    lost = true;
                }
            }
            if lost {
                self.congestion();
            }
        }
    }

    /// Process one received datagram at `now`: verify it, then
    /// [`handle_parsed`](Self::handle_parsed). Corrupted and malformed
    /// packets are dropped and counted.
    pub fn handle_packet(
        &mut self,
        now: Instant,
        pkt: &[u8],
        sink: &mut dyn FnMut(&[u8]),
        budget: &mut usize,
    ) {
        let (hdr, payload) = match PacketHeader::decode(pkt) {
            Ok(x) => x,
            Err(e) => {
                self.last_now = Some(now);
                if self.failed.is_none() {
                    self.stats.packets_received += 1;
                    if e == PacketError::BadChecksum {
                        self.stats.dropped_corrupt += 1;
                    } else {
                        self.stats.dropped_malformed += 1;
                    }
                    tracing::trace!("dropped a packet: {e}");
                }
                return;
            }
        };
        self.handle_parsed(now, &hdr, payload, sink, budget);
    }

    /// Process one verified datagram (`hdr` and `payload` as
    /// [`PacketHeader::decode`] returned them) at `now`.
    ///
    /// Foreign, duplicate and out-of-window packets are dropped (and
    /// counted). Acknowledgements update the send side. Data is buffered
    /// and reassembled; a frame completed in order while no earlier frame
    /// waits is lent to `sink` directly from the datagram if `*budget`
    /// allows (which it then decrements), otherwise it waits for
    /// [`deliver`](Self::deliver). Pass a zero budget to always buffer.
    pub fn handle_parsed(
        &mut self,
        now: Instant,
        hdr: &PacketHeader,
        payload: &[u8],
        sink: &mut dyn FnMut(&[u8]),
        budget: &mut usize,
    ) {
        self.last_now = Some(now);
        if self.failed.is_some() {
            return;
        }
        self.stats.packets_received += 1;
        if hdr.dst_conn != self.ids.local || hdr.src_conn != self.ids.peer {
            self.stats.dropped_foreign += 1;
            return;
        }
        if let Some(closed) = self.closed_at.as_mut() {
            // The linger runs from the peer's last packet: its
            // retransmissions, backed off, may come later than one linger
            // after the close.
            *closed = (*closed).max(now);
        }
        self.on_ack(now, hdr.ack, hdr.sack);
        if !hdr.flags.contains(PacketFlags::DATA) {
            return;
        }
        let off = seq_diff(hdr.seq, self.rcv_nxt);
        if off < 0 {
            // Already delivered: our acknowledgement was probably lost.
            // Each such packet gets an acknowledgement of its own, as TCP
            // answers each with one: the sender's resent packets then
            // bring back as many chances for it to arrive (one per burst
            // was lost ten times in a row on a link losing 30 %).
            self.stats.duplicates += 1;
            self.acks_owed = (self.acks_owed + 1).min(ACKS_OWED_MAX);
            self.ack_deadline = Some(now);
            return;
        }
        let off = off as u32;
        if off >= self.cfg.window {
            self.stats.out_of_window += 1;
            self.ack_deadline = Some(now);
            return;
        }
        let frag = hdr.flags;
        if off > 0 {
            let off = off as usize;
            if self.reorder.len() <= off {
                self.reorder.resize_with(off + 1, || None);
            }
            if self.reorder[off].is_some() {
                self.stats.duplicates += 1;
            } else {
                let mut data = self.buf();
                data.extend_from_slice(payload);
                self.reorder[off] = Some(RxPacket { flags: frag, data });
                self.stats.out_of_order += 1;
            }
            // A gap: tell the sender at once (duplicate ack with SACK).
            self.ack_deadline = Some(now);
            return;
        }
        // In order.
        if self.backlog_full() {
            // Not taken: the peer sends it again (see `ready_frames`).
            self.stats.dropped_backlog += 1;
            return;
        }
        self.reorder.pop_front();
        self.rcv_nxt = self.rcv_nxt.wrapping_add(1);
        self.accept(frag, payload, sink, budget);
        let mut filled_gap = false;
        while matches!(self.reorder.front(), Some(Some(_))) {
            let Some(Some(p)) = self.reorder.pop_front() else {
                unreachable!()
            };
            self.rcv_nxt = self.rcv_nxt.wrapping_add(1);
            self.accept(p.flags, &p.data, sink, budget);
            self.recycle(p.data);
            filled_gap = true;
        }
        self.rx_unacked += 1;
        if filled_gap || self.rx_unacked >= self.cfg.ack_every {
            self.ack_deadline = Some(now);
        } else if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now + self.cfg.ack_delay);
        }
    }

    /// An in-order fragment.
    fn accept(
        &mut self,
        flags: PacketFlags,
        data: &[u8],
        sink: &mut dyn FnMut(&[u8]),
        budget: &mut usize,
    ) {
        if self.failed.is_some() {
            return;
        }
        let first = flags.contains(PacketFlags::FIRST);
        let last = flags.contains(PacketFlags::LAST);
        if first && self.assembling {
            return self.fail("protocol violation: a fragment opens a frame inside another".into());
        }
        if !first && !self.assembling {
            return self.fail("protocol violation: a continuation fragment outside a frame".into());
        }
        let so_far = if first { 0 } else { self.assembly.len() };
        if so_far + data.len() > self.cfg.max_frame_len {
            return self.fail(format!(
                "protocol violation: a frame longer than the maximum of {} bytes",
                self.cfg.max_frame_len
            ));
        }
        if first && last {
            if self.closed_at.is_some() {
                return;
            }
            if self.ready.is_empty() && *budget > 0 {
                *budget -= 1;
                self.stats.frames_delivered += 1;
                sink(data);
            } else {
                let mut frame = self.frame_buf();
                frame.clear();
                frame.extend_from_slice(data);
                self.ready_bytes += frame.len();
                self.ready.push_back(frame);
            }
            return;
        }
        if first {
            self.assembling = true;
            self.assembly.clear();
        }
        // One frame buffer, kept from frame to frame with its capacity:
        // each fragment is copied into it once.
        self.assembly.extend_from_slice(data);
        if last {
            self.assembling = false;
            if self.closed_at.is_some() {
                self.assembly.clear();
            } else if self.ready.is_empty() && *budget > 0 {
                *budget -= 1;
                self.stats.frames_delivered += 1;
                sink(&self.assembly);
                self.assembly.clear();
            } else {
                let mut fresh = self.frame_buf();
                fresh.clear();
                let frame = std::mem::replace(&mut self.assembly, fresh);
                self.ready_bytes += frame.len();
                self.ready.push_back(frame);
            }
        }
    }

    /// Lend up to `max` reassembled frames to `sink`, in order. Returns how
    /// many were delivered.
    pub fn deliver(&mut self, max: usize, sink: &mut dyn FnMut(&[u8])) -> usize {
        let mut n = 0;
        while n < max {
            let Some(frame) = self.ready.pop_front() else {
                break;
            };
            self.ready_bytes -= frame.len();
            sink(&frame);
            self.recycle_frame(frame);
            n += 1;
        }
        self.stats.frames_delivered += n as u64;
        n
    }
}

//! The send side of [`ReliableCore`]: frames staged and fragmented into
//! the send buffer, and the packets [`poll_transmit`](ReliableCore::poll_transmit)
//! writes (retransmissions first, then new data, then a due standalone
//! acknowledgement).

use std::time::Instant;

use starwire_transport::TransportError;

use super::{fragments, seq_lt, ReliableCore, TxPacket};
use crate::packet::{PacketFlags, PacketHeader, SACK_BITS};

impl ReliableCore {
    /// Lend `len` bytes of staging space for one frame. The bytes hold
    /// whatever an earlier frame of the connection left there (the buffer
    /// is reused unzeroed): write every byte you commit.
    ///
    /// `Ok(None)` when the send window cannot take the frame's fragments
    /// now (back-pressure; retry after acknowledgements arrive).
    /// A frame longer than [`max_frame_len`](Self::max_frame_len) fails with
    /// [`TransportError::FrameTooLarge`].
    pub fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.check()?;
        if len > self.cfg.max_frame_len {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.cfg.max_frame_len,
            });
        }
        let need = fragments(len, self.max_payload) as u64;
        if u64::from(self.in_flight()) + need > u64::from(self.cfg.window) {
            self.stats.window_full += 1;
            self.reserved = None;
            return Ok(None);
        }
        if self.stage.len() < len {
            self.stage.resize(len, 0);
        }
        self.reserved = Some(len);
        Ok(Some(&mut self.stage[..len]))
    }

    /// Commit the first `len` bytes of the last reservation as one frame:
    /// it is fragmented into packets that enter the send buffer.
    ///
    /// # Panics
    /// If `len` exceeds the reservation. A commit without a reservation is
    /// ignored (and asserts in debug builds).
    pub fn tx_commit(&mut self, len: usize) {
        let Some(reserved) = self.reserved.take() else {
            debug_assert!(false, "tx_commit without tx_reserve");
            return;
        };
        assert!(
            len <= reserved,
            "tx_commit({len}) beyond the reservation of {reserved}"
        );
        // The staging buffer becomes the frame's buffer, and each
        // fragment a range of it: no copy until the packet is written.
        let fresh = self.frame_buf();
        let frame = std::mem::replace(&mut self.stage, fresh);
        let number = self.tx_frames_base + self.tx_frames.len() as u64;
        self.tx_frames.push_back(frame);
        let n = fragments(len, self.max_payload);
        for i in 0..n {
            let start = i * self.max_payload;
            let end = (start + self.max_payload).min(len);
            let mut flags = PacketFlags::NONE;
            if i == 0 {
                flags = flags.with(PacketFlags::FIRST);
            }
            if i == n - 1 {
                flags = flags.with(PacketFlags::LAST);
            }
            self.push_fragment(flags, number, start, end - start);
        }
        self.stats.frames_sent += 1;
    }

    fn push_fragment(&mut self, flags: PacketFlags, frame: u64, start: usize, len: usize) {
        self.snd_buf.push_back(TxPacket {
            flags,
            frame,
            start,
            len,
            sent_at: None,
            serial: 0,
            tx_count: 0,
            sacked: false,
            in_retx: false,
            by_timeout: false,
        });
        self.snd_nxt = self.snd_nxt.wrapping_add(1);
    }

    fn ack_due(&self, now: Instant) -> bool {
        self.acks_owed > 0 || self.ack_deadline.is_some_and(|d| d <= now)
    }

    /// True if [`poll_transmit`](Self::poll_transmit) may produce a packet
    /// at `now`.
    pub fn wants_transmit(&self, now: Instant) -> bool {
        self.failed.is_none()
            && (!self.retx.is_empty() || self.new_data_ready() || self.ack_due(now))
    }

    /// Write the next packet to send into `buf` (at least
    /// [`mtu`](Self::mtu) bytes) and return its length: a retransmission,
    /// else new data, else a due standalone acknowledgement. `None` when
    /// nothing needs sending.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        self.last_now = Some(now);
        if self.failed.is_some() {
            return None;
        }
        while let Some(seq) = self.retx.pop_front() {
            if seq_lt(seq, self.snd_una) || !seq_lt(seq, self.next_new) {
                continue;
            }
            let idx = seq.wrapping_sub(self.snd_una) as usize;
            let p = &mut self.snd_buf[idx];
            if !p.in_retx {
                continue;
            }
            p.in_retx = false;
            if p.sacked {
                continue;
            }
            self.stats.retransmits += 1;
            return Some(self.emit_data(now, seq, buf));
        }
        if self.new_data_ready() {
            let seq = self.next_new;
            self.next_new = seq.wrapping_add(1);
            self.stats.data_packets_sent += 1;
            return Some(self.emit_data(now, seq, buf));
        }
        if self.ack_due(now) {
            let hdr = PacketHeader {
                flags: PacketFlags::NONE,
                dst_conn: self.ids.peer,
                src_conn: self.ids.local,
                seq: 0,
                ack: self.rcv_nxt,
                sack: self.sack_bits(),
                payload_len: 0,
            };
            self.acked();
            self.stats.acks_sent += 1;
            return Some(hdr.encode(&[], buf));
        }
        None
    }

    fn emit_data(&mut self, now: Instant, seq: u32, buf: &mut [u8]) -> usize {
        let ack = self.rcv_nxt;
        let sack = self.sack_bits();
        let idx = seq.wrapping_sub(self.snd_una) as usize;
        self.tx_serial += 1;
        let p = &mut self.snd_buf[idx];
        p.sent_at = Some(now);
        p.serial = self.tx_serial;
        p.tx_count += 1;
        let hdr = PacketHeader {
            flags: PacketFlags::DATA.with(p.flags),
            dst_conn: self.ids.peer,
            src_conn: self.ids.local,
            seq,
            ack,
            sack,
            payload_len: 0,
        };
        let frame = &self.tx_frames[(p.frame - self.tx_frames_base) as usize];
        let n = hdr.encode(&frame[p.start..p.start + p.len], buf);
        if self.rto_deadline.is_none() {
            self.rto_deadline = Some(now + self.current_rto());
        }
        self.acked();
        n
    }

    /// An acknowledgement went out (standalone or piggybacked).
    fn acked(&mut self) {
        self.ack_deadline = None;
        self.rx_unacked = 0;
        self.acks_owed = self.acks_owed.saturating_sub(1);
    }

    fn sack_bits(&self) -> u64 {
        let mut bits = 0u64;
        for (i, slot) in self
            .reorder
            .iter()
            .skip(1)
            .take(SACK_BITS as usize)
            .enumerate()
        {
            if slot.is_some() {
                bits |= 1 << i;
            }
        }
        bits
    }
}

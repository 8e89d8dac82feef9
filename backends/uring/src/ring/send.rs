//! The send side: what a connection's stage hands over, one send SQE per
//! connection at a time (plain, or zero copy), and the completions and
//! zero-copy notifications that give the memory back.
// Hands the kernel send buffers (`sys::push_send`) and a connection's stage
// its slots (`TxStage::set_fill`).
#![allow(unsafe_code)]

use io_uring::cqueue;
use starwire_bufpool::{BufPool, SlotId};
use starwire_transport::TransportError;

use super::op::send_user_data;
use super::{Conn, Inflight, Ring, TxSeg};
use crate::stage::{Handover, RingView};
use crate::sys::{self, SendKind, SendMsg, SlotPtr};

/// Most iovecs in one send.
const MAX_IOV: usize = 64;

/// Most zero-copy sends of one connection waiting for their notifications.
const ZC_HELD_MAX: usize = 256;

pub(super) fn unref_slot(pool: &mut BufPool, refs: &mut [u16], c: &mut Conn, id: SlotId) {
    let r = &mut refs[id.index()];
    *r -= 1;
    if *r == 0 {
        pool.give(id);
        c.slots_held -= 1;
    }
}

impl Conn {
    /// Keep a send's buffers, emptied, for the connection's next send.
    fn keep_spare(&mut self, mut segs: Vec<TxSeg>, mut msg: Box<SendMsg>) {
        segs.clear();
        msg.iov.clear();
        self.spare = Some((segs, msg));
    }
}

impl Ring {
    pub(super) fn complete_send(&mut self, idx: usize, res: i32, flags: u32, seq: u16) {
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        if cqueue::notif(flags) {
            // The kernel let go of the pages of zero-copy send `seq`.
            if res & sys::NOTIF_USAGE_ZC_COPIED != 0 {
                self.stats.zc_copied += 1;
                c.stats.zc_copied += 1;
                if c.zero_copy {
                    c.zero_copy = false;
                    self.stats.zc_fallbacks += 1;
                    tracing::debug!(
                        conn = idx,
                        "uring: zero-copy send was copied; plain send from now on"
                    );
                }
            }
            if let Some(pos) = c.zc_held.iter().position(|(s, _)| *s == seq) {
                self.tx_freed = true;
                let (_, segs) = c.zc_held.remove(pos).expect("found above");
                for seg in segs {
                    c.zc_held_bytes -= seg.len();
                    if let TxSeg::Slot { id, .. } = seg {
                        unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
                    }
                }
            } else if let Some(inf) = c.inflight.as_mut().filter(|i| i.seq == seq) {
                inf.notif_seen = true;
            }
            return;
        }
        // The send's result: the send is over, whatever comes after.
        let Some(mut inf) = c.inflight.take() else {
            return;
        };
        let mut done = 0;
        if res < 0 {
            if res != -libc::ECANCELED {
                c.send_error = Some(-res);
            }
        } else {
            done = res as usize;
            c.stats.bytes_sent += res as u64;
        }
        if done < inf.total && c.send_error.is_none() && !inf.resumable {
            // Zero-copy sends carry MSG_WAITALL and return short only on an
            // error or a signal: the stream cannot be resumed in order, so
            // end the connection.
            c.send_error = Some(libc::EIO);
        }
        // A notification still due holds the pages, not the stream: the
        // pieces wait for it in `zc_held` and the next send may go.
        if cqueue::more(flags) && !inf.notif_seen {
            c.zc_held_bytes += inf.total;
            c.zc_held
                .push_back((inf.seq, std::mem::take(&mut inf.segs)));
            c.keep_spare(Vec::with_capacity(MAX_IOV), inf.msg);
            return;
        }
        // A plain send that the socket took only part of (it was full) is
        // resumed: the unsent rest goes back to the front of the queue, in
        // order, for the next flush; what was sent lets go of its memory.
        // This keeps the socket topped up every turn, as a non-blocking
        // write(2) does, instead of one send waiting in the kernel for room.
        let resume = done < inf.total && c.send_error.is_none();
        let mut skip = done;
        let mut rest: Vec<TxSeg> = Vec::new();
        for seg in inf.segs.drain(..) {
            let len = seg.len();
            if skip >= len {
                skip -= len;
                if let TxSeg::Slot { id, .. } = seg {
                    unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
                }
                continue;
            }
            let seg = match seg {
                TxSeg::Slot { id, off, len } => TxSeg::Slot {
                    id,
                    off: off + skip,
                    len: len - skip,
                },
                TxSeg::Shared(b) => TxSeg::Shared(b.slice(skip..)),
            };
            skip = 0;
            if resume {
                rest.push(seg);
            } else if let TxSeg::Slot { id, .. } = seg {
                unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
            }
        }
        c.keep_spare(inf.segs, inf.msg);
        if !rest.is_empty() {
            self.stats.short_sends += 1;
        }
        for seg in rest.into_iter().rev() {
            c.queued_bytes += seg.len();
            c.queue.push_front(seg);
        }
    }

    /// Queue what connection `idx` staged, in order, let go of the slot
    /// it stopped filling, and refresh its stage's view of the ring. The
    /// fill is kept when `keep_fill` (or a reservation in it is
    /// outstanding).
    pub(crate) fn hand_over(&mut self, idx: usize, keep_fill: bool) {
        let c = self.conns[idx].as_mut().expect("live connection");
        let h = c.stage.take_handover(keep_fill);
        self.queue_handover(idx, h);
        self.update_view(idx);
    }

    /// Queue the pieces of a hand-over, after the bookkeeping.
    fn queue_handover(&mut self, idx: usize, h: Handover) {
        self.account_handover(idx, &h);
        let c = self.conns[idx].as_mut().expect("live connection");
        let mut segs = h.segs;
        for seg in segs.drain(..) {
            c.queued_bytes += seg.len();
            // A piece that continues the last queued one in the same slot
            // (a kept fill flushed while a send is in flight) joins it: one
            // iovec and one reference instead of one per flush.
            if let (
                TxSeg::Slot { id, off, len },
                Some(TxSeg::Slot {
                    id: pid,
                    off: poff,
                    len: plen,
                }),
            ) = (&seg, c.queue.back_mut())
            {
                if id == pid && *poff + *plen == *off {
                    *plen += len;
                    self.slot_refs[id.index()] -= 1;
                    continue;
                }
            }
            c.queue.push_back(seg);
        }
        c.stage.return_segs(segs);
    }

    /// The bookkeeping of a hand-over, wherever its pieces go: a
    /// reference per slot piece, the fill let go of, the counters.
    fn account_handover(&mut self, idx: usize, h: &Handover) {
        let c = self.conns[idx].as_mut().expect("live connection");
        for seg in &h.segs {
            if let TxSeg::Slot { id, .. } = seg {
                self.slot_refs[id.index()] += 1;
            }
        }
        if let Some(id) = h.release {
            unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
        }
        c.stats.frames_sent += h.frames;
        self.stats.frames_sent += h.frames;
        self.stats.tx_heap_frames += h.heap_frames;
    }

    /// Tell the stage of connection `idx` what it cannot know: the bytes
    /// queued here, whether anything waits or is in flight, and a send
    /// error.
    pub(crate) fn update_view(&mut self, idx: usize) {
        let c = self.conns[idx].as_mut().expect("live connection");
        c.stage.view = RingView {
            queued: c.queued_bytes + c.zc_held_bytes,
            pending: c.inflight.is_some() || !c.queue.is_empty(),
            send_error: c.send_error,
        };
    }

    /// Give back the fill connection `idx` kept across a flush, once it
    /// saw no frame for a turn.
    pub(crate) fn release_idle_fill(&mut self, idx: usize) {
        let c = self.conns[idx].as_mut().expect("live connection");
        if let Some(id) = c.stage.take_idle_fill() {
            unref_slot(&mut self.tx_pool, &mut self.slot_refs, c, id);
        }
    }

    /// A new slot for connection `idx`'s stage to write into, after
    /// handing over what it staged and letting go of its full one.
    /// `Ok(false)` under back-pressure: the connection holds
    /// [`UringConfig::tx_slots_per_conn`](crate::UringConfig::tx_slots_per_conn)
    /// slots, or the pool is empty.
    pub(crate) fn refill(&mut self, idx: usize) -> Result<bool, TransportError> {
        self.hand_over(idx, false);
        self.check_send_error(idx)?;
        let per_conn = self.cfg.tx_slots_per_conn;
        let c = self.conns[idx].as_mut().expect("live connection");
        if c.slots_held >= per_conn {
            return Ok(false);
        }
        let Some(id) = self.tx_pool.take() else {
            self.stats.tx_pool_empty += 1;
            return Ok(false);
        };
        self.slot_refs[id.index()] = 1;
        c.slots_held += 1;
        // SAFETY: slot `id` of this ring's pool, `slot_len` bytes, just
        // taken for this connection alone (one reference, the fill's): the
        // ring reads only what the stage hands over and returns the slot
        // to the pool only once the fill's reference is dropped. The stage
        // is the connection's, which this ring owns and drops before the
        // pool (field order), and hands its pieces to this ring only.
        unsafe {
            c.stage
                .set_fill(id, SlotPtr::new(self.tx_pool.slot_ptr(id)))
        };
        Ok(true)
    }

    fn check_send_error(&self, idx: usize) -> Result<(), TransportError> {
        match self.conn(idx).send_error {
            None => Ok(()),
            Some(e) if e == libc::EPIPE || e == libc::ECONNRESET => Err(TransportError::Closed),
            Some(e) => Err(TransportError::Io(std::io::Error::from_raw_os_error(e))),
        }
    }

    /// Hand over what connection `idx` staged, and queue one send SQE for
    /// everything queued, unless one is in flight.
    pub(crate) fn flush(&mut self, idx: usize) -> Result<(), TransportError> {
        // A flush that sent frames keeps the fill for the next turn's ones
        // while it has room and the pool is not short; otherwise (and when
        // nothing was staged) the fill goes back, unless a reservation in
        // it is outstanding. A kept fill that sees no frame for a turn goes
        // back at the next `rx_burst` (`release_idle_fill`), so an idle
        // connection holds no transmit memory, and a ring's pool serves
        // any number of connections.
        let c = self.conns[idx].as_mut().expect("live connection");
        let keep = c.stage.has_staged()
            && c.stage.fill_room() >= self.cfg.slot_len() / 4
            && 2 * self.tx_pool.free_slots() >= self.tx_pool.slots();
        let h = c.stage.take_handover(keep);
        if c.inflight.is_none()
            && c.queue.is_empty()
            && c.send_error.is_none()
            && !h.segs.is_empty()
            && h.segs.len() <= MAX_IOV
        {
            // Nothing queued before these pieces: they become the send as
            // they are, without a pass through the queue.
            self.account_handover(idx, &h);
            let c = self.conns[idx].as_mut().expect("live connection");
            let (spare_segs, msg) = c
                .spare
                .take()
                .unwrap_or_else(|| (Vec::with_capacity(MAX_IOV), SendMsg::with_capacity(MAX_IOV)));
            c.stage.return_segs(spare_segs);
            let total = h.segs.iter().map(TxSeg::len).sum();
            c.queued_bytes += total;
            self.submit_send(idx, h.segs, msg, total);
            self.update_view(idx);
            return Ok(());
        }
        self.queue_handover(idx, h);
        let r = self.send_queued(idx);
        self.update_view(idx);
        r
    }

    /// One send SQE for what is queued (at most `MAX_IOV` pieces), unless
    /// a send is in flight.
    fn send_queued(&mut self, idx: usize) -> Result<(), TransportError> {
        self.check_send_error(idx)?;
        let c = self.conns[idx].as_mut().expect("live connection");
        if c.inflight.is_some() {
            return Ok(());
        }
        if c.queue.is_empty() {
            return Ok(());
        }
        let (mut segs, msg) = c
            .spare
            .take()
            .unwrap_or_else(|| (Vec::with_capacity(MAX_IOV), SendMsg::with_capacity(MAX_IOV)));
        debug_assert!(segs.is_empty() && msg.iov.is_empty());
        let mut total = 0;
        while segs.len() < MAX_IOV {
            let Some(seg) = c.queue.pop_front() else {
                break;
            };
            total += seg.len();
            segs.push(seg);
        }
        self.submit_send(idx, segs, msg, total);
        Ok(())
    }

    /// Queue one send SQE for `segs` (`total` bytes, counted in the
    /// connection's `queued_bytes`), their iovecs written into `msg`. When
    /// the SQ is full they go back to the front of the queue, in order.
    fn submit_send(&mut self, idx: usize, segs: Vec<TxSeg>, mut msg: Box<SendMsg>, total: usize) {
        let zc_ok = self.features.sendmsg_zc;
        let zc_fixed_ok = self.features.send_zc;
        let threshold = self.cfg.zero_copy_threshold;
        let c = self.conns[idx].as_mut().expect("live connection");
        let mut segs = segs;
        debug_assert!(msg.iov.is_empty() && segs.len() <= MAX_IOV);
        for seg in &segs {
            let (ptr, len) = match seg {
                TxSeg::Slot { id, off, len } => {
                    (self.tx_pool.slot_ptr(*id).wrapping_add(*off), *len)
                }
                TxSeg::Shared(b) => (b.as_ptr(), b.len()),
            };
            msg.iov.push(sys::iovec(ptr, len));
        }
        c.queued_bytes -= total;
        msg.seal();
        // Past `ZC_HELD_MAX` sends waiting for their notifications, send
        // plainly: it bounds the list, and keeps sequence numbers (16
        // bits) unique among the sends a notification may be for.
        let kind = if c.zero_copy && total >= threshold && c.zc_held.len() < ZC_HELD_MAX {
            match &segs[..] {
                [TxSeg::Slot { .. }] if zc_fixed_ok => SendKind::ZeroCopyFixed(0),
                _ if zc_ok => SendKind::ZeroCopyMsg,
                _ => SendKind::Plain,
            }
        } else {
            SendKind::Plain
        };
        let seq = if kind == SendKind::Plain { 0 } else { c.zc_seq };
        // SAFETY: `msg` is sealed; it and the pieces its iovecs point into
        // (pool slots with a reference each, `Bytes` held by the pieces,
        // each within its slot or buffer) go into `inflight` below, and on
        // to `zc_held` until a zero-copy send's notification: the ring
        // keeps them until then and leaks them if it goes first (`sys`,
        // "Send buffers"). A fixed-buffer send is one slot piece, inside
        // registered buffer 0, the whole pool.
        if !unsafe { sys::push_send(&mut self.ring, c.sock, &msg, kind, send_user_data(idx, seq)) }
        {
            // SQ full: put everything back, in order, and retry next flush.
            for seg in segs.drain(..).rev() {
                c.queued_bytes += seg.len();
                c.queue.push_front(seg);
            }
            c.keep_spare(segs, msg);
            self.stats.sq_full += 1;
            return;
        }
        c.stats.sends += 1;
        self.stats.sends += 1;
        if kind != SendKind::Plain {
            c.stats.zc_sends += 1;
            self.stats.zc_sends += 1;
            c.zc_seq = c.zc_seq.wrapping_add(1);
        }
        c.inflight = Some(Inflight {
            segs,
            msg,
            total,
            resumable: kind == SendKind::Plain,
            seq,
            notif_seen: false,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::loopback_pair;
    use super::*;
    use crate::{UringConfig, UringDriver};
    use bytes::Bytes;
    use std::net::TcpStream;

    /// `IORING_CQE_F_MORE` and `IORING_CQE_F_NOTIF`.
    const F_MORE: u32 = 1 << 1;
    const F_NOTIF: u32 = 1 << 3;

    /// A ring that tries zero copy from 1 KiB, on loopback too, and a
    /// connected pair for it. This machine's kernel has `SEND_ZC`.
    fn zc_ring() -> (UringDriver, TcpStream, TcpStream) {
        let cfg = UringConfig {
            zero_copy_loopback: true,
            zero_copy_threshold: 1024,
            ..UringConfig::default()
        };
        let r = UringDriver::new(&cfg).unwrap();
        assert!(r.features().send_zc, "{:?}", r.features());
        let (a, b) = loopback_pair();
        (r, a, b)
    }

    /// Queue one send of a 4 KiB registered slot on `idx`; returns the slot.
    fn send_slot(g: &mut Ring, idx: usize) -> SlotId {
        let id = g.tx_pool.take().expect("a free slot");
        g.slot_refs[id.index()] = 1;
        let c = g.conns[idx].as_mut().unwrap();
        c.slots_held += 1;
        c.queue.push_back(TxSeg::Slot {
            id,
            off: 0,
            len: 4096,
        });
        c.queued_bytes += 4096;
        g.send_queued(idx).unwrap();
        id
    }

    /// A zero-copy send's notification holds the send's memory, not the
    /// stream: once its result came, the next send goes, and the slot
    /// returns to the pool only with the notification (which may come in
    /// any order). Driven by made-up completions: nothing is submitted.
    #[test]
    fn zero_copy_notifications_hold_memory_not_the_stream() {
        let (mut r, a, _b) = zc_ring();
        let g = r.ring_mut();
        let idx = g.add_conn(a).unwrap();
        let free = g.tx_pool.free_slots();
        let s0 = send_slot(g, idx);
        assert_eq!(g.stats.zc_sends, 1);
        assert_eq!(
            g.conns[idx]
                .as_ref()
                .unwrap()
                .inflight
                .as_ref()
                .unwrap()
                .seq,
            0
        );
        // Its result, with a notification to come: the next send may go.
        g.complete(send_user_data(idx, 0), 4096, F_MORE);
        let c = g.conns[idx].as_ref().unwrap();
        assert!(
            c.inflight.is_none() && c.zc_held.len() == 1,
            "held, not in flight"
        );
        assert_eq!(c.zc_held_bytes, 4096);
        let s1 = send_slot(g, idx);
        assert_eq!(g.stats.zc_sends, 2, "the second send did not wait");
        g.complete(send_user_data(idx, 1), 4096, F_MORE);
        assert_eq!(g.conns[idx].as_ref().unwrap().zc_held.len(), 2);
        assert_eq!(g.tx_pool.free_slots(), free - 2);
        // The second notification first: only its slot goes back.
        g.complete(send_user_data(idx, 1), 0, F_NOTIF);
        let c = g.conns[idx].as_ref().unwrap();
        assert_eq!(c.zc_held.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0]);
        assert_eq!(c.zc_held_bytes, 4096);
        assert_eq!((g.slot_refs[s1.index()], g.slot_refs[s0.index()]), (0, 1));
        // The first, reported copied: its slot goes back, and the
        // connection sends plainly from now on.
        g.complete(send_user_data(idx, 0), sys::NOTIF_USAGE_ZC_COPIED, F_NOTIF);
        let c = g.conns[idx].as_ref().unwrap();
        assert!(c.zc_held.is_empty() && c.zc_held_bytes == 0 && c.slots_held == 0);
        assert!(!c.zero_copy && c.inflight.is_none());
        assert_eq!(g.tx_pool.free_slots(), free);
        assert_eq!((g.stats.zc_copied, g.stats.zc_fallbacks), (1, 1));
        send_slot(g, idx);
        assert_eq!(g.stats.zc_sends, 2, "plain after the copied report");
    }

    /// A notification that comes before its send's result (allowed, not
    /// seen) frees nothing early: the result then releases the pieces
    /// itself, and nothing is left held. A notification that gave back
    /// held bytes makes the next `enter` report work.
    #[test]
    fn zero_copy_notification_before_result_and_the_freed_turn() {
        let (mut r, a, _b) = zc_ring();
        {
            let g = r.ring_mut();
            let idx = g.add_conn(a).unwrap();
            let free = g.tx_pool.free_slots();
            let s0 = send_slot(g, idx);
            g.complete(send_user_data(idx, 0), 0, F_NOTIF);
            assert_eq!(g.slot_refs[s0.index()], 1, "still in flight");
            assert!(!g.tx_freed);
            g.complete(send_user_data(idx, 0), 4096, F_MORE);
            let c = g.conns[idx].as_ref().unwrap();
            assert!(c.inflight.is_none() && c.zc_held.is_empty() && c.zc_held_bytes == 0);
            assert_eq!(g.tx_pool.free_slots(), free);
        }
        // A held send freed by its notification raises the flag, and the
        // next enter reports work for it alone (a fresh ring: nothing to
        // submit, nothing to reap).
        let (mut r, a, _b) = zc_ring();
        let g = r.ring_mut();
        let idx = g.add_conn(a).unwrap();
        g.end_turn().unwrap();
        assert!(!g.end_turn().unwrap(), "an idle ring");
        {
            let c = g.conns[idx].as_mut().unwrap();
            c.zc_held
                .push_back((5, vec![TxSeg::Shared(Bytes::from_static(&[7; 64]))]));
            c.zc_held_bytes = 64;
            g.complete(send_user_data(idx, 5), 0, F_NOTIF);
            assert!(g.tx_freed && g.conns[idx].as_ref().unwrap().zc_held_bytes == 0);
        }
        assert!(g.end_turn().unwrap(), "the turn after a release is work");
        assert!(!g.end_turn().unwrap(), "once");
    }
}

//! Parking in the ring: the two halves of a park around its enter, the
//! readability polls armed before one, and the drain of the park eventfd
//! after it.
// Lends the kernel the eventfd drain's buffer (`sys::push_read_u64`).
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;

use starwire_transport::reactor::{ParkEnd, ParkWaker};

use super::op::{user_data, CONN_MASK, OP_CANCEL, OP_EVENTFD, OP_POLL, OP_WAKER};
use super::Ring;
use crate::sys::{self, Sock};

impl Ring {
    /// The first half of [`Ring::park`]: queue what the
    /// park submits and say how to enter: the descriptor (the registered
    /// index or the ring fd, with its flag), the SQEs queued, and whether
    /// completions are already there (no sleep). `None` when the ring
    /// cannot be entered (the reactor then polls instead).
    pub(super) fn prepare_park(
        &mut self,
        waker: ParkWaker<'_>,
    ) -> Option<(sys::EnterFd, usize, bool)> {
        if !self.enabled {
            if let Err(e) = self.ring.submitter().register_enable_rings() {
                tracing::warn!(error = %e, "uring: enabling the ring for a park failed");
                return None;
            }
            self.enabled = true;
        }
        if self.spin {
            // Readability polls, submitted by the park's own enter (each
            // full SQ is submitted first, then the rest are queued).
            self.arm_park_polls();
        } else {
            // Receives completed by the last enter go back in with this
            // one, or no data would end the park.
            self.queue_direct_receives();
            self.rearm_receives();
        }
        if self.waker_id != waker.id {
            if let Some(gen) = self.waker_poll.take() {
                // Another waker (the reactor run again on this thread with
                // a new eventfd): its number may even be the old one's,
                // so cancel the old poll; its completion is ignored (an
                // older generation).
                let target = user_data(gen as usize, OP_WAKER);
                let ud = user_data(CONN_MASK as usize, OP_CANCEL);
                self.push_or_submit(|ring| sys::push_cancel(ring, target, ud));
            }
            self.waker_fired = false;
            self.waker_id = waker.id;
        }
        // A poll that fired in a turn's reap ends this park at once
        // (`ready`); the next park arms another.
        if self.waker_poll.is_none() && !self.waker_fired {
            self.waker_gen = (self.waker_gen + 1) & CONN_MASK;
            let ud = user_data(self.waker_gen as usize, OP_WAKER);
            let fd = Sock::Fd(waker.fd.as_raw_fd());
            if !self.push_or_submit(|ring| sys::push_poll_in(ring, fd, ud)) {
                // Without the poll a wake-up could not end the sleep:
                // poll(2) instead (`prepare_poll_park` submits what is
                // queued).
                return None;
            }
            self.waker_poll = Some(self.waker_gen);
        }
        // Completions reaped since the last turn (the waker's among
        // them) end the park before it starts.
        let pending = self.queued();
        let ready = self.waker_fired || !self.ring.completion().is_empty();
        let registered = self.registered_index();
        let fd = sys::EnterFd::new(&self.ring, registered);
        if !ready || pending > 0 {
            self.stats.enters += 1;
            self.stats.registered_enters += u64::from(registered.is_some());
        }
        self.stats.ring_parks += u64::from(!ready);
        Some((fd, pending, ready))
    }

    /// The second half of [`Ring::park`]: account the
    /// enter's result `r`, reap, and say what ended the park (`slept`: it
    /// waited; `expired`: its whole timeout passed).
    pub(super) fn finish_park(
        &mut self,
        r: std::io::Result<usize>,
        slept: bool,
        expired: bool,
    ) -> Option<ParkEnd> {
        let mut interrupted = false;
        match r {
            // The count submitted: a wait that timed out after submitting
            // returns it too, so only the reap below tells the ends apart.
            Ok(n) => self.stats.sqes += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) =>
            {
                // A signal, or a full CQ (the reap below makes room).
                interrupted = true;
            }
            Err(e) => {
                // Completions left in the CQ make the park descriptor
                // readable at once; SQEs left in the SQ are submitted by
                // `prepare_poll_park`.
                tracing::warn!(error = %e, "uring: park enter failed; polling instead");
                return None;
            }
        }
        let reaped = self.reap();
        Some(if std::mem::take(&mut self.waker_fired) {
            ParkEnd::Waker
        } else if reaped == 0 && slept && expired && !interrupted {
            ParkEnd::Timeout
        } else {
            ParkEnd::Input
        })
    }

    /// After a park: disable the eventfd again and queue a read that
    /// drains it, so that the enter this turn makes anyway does the drain
    /// and the park costs no `read(2)` of its own. The read is
    /// `RWF_NOWAIT`, so it completes inside that enter, with the count or
    /// `-EAGAIN` (nothing was written: the park ended otherwise).
    /// A full SQ, or a drain still in flight, falls back to `read(2)`.
    /// Returns the SQEs queued (0 or 1). `IORING_OP_READ` came with 5.6,
    /// older than any kernel this backend accepts (5.19).
    pub(super) fn queue_eventfd_drain(&mut self) -> usize {
        let Some(efd) = self.park_eventfd.filter(|_| self.eventfd_armed) else {
            return 0;
        };
        self.eventfd_armed = false;
        self.ring.completion().disable_eventfd();
        self.stats.eventfd_reads += 1;
        if !self.eventfd_read_inflight {
            let buf: *mut u64 = self.eventfd_buf.get();
            let ud = user_data(CONN_MASK as usize, OP_EVENTFD);
            // SAFETY: the ring's boxed `eventfd_buf`, neither read nor
            // replaced while the read is in flight (`eventfd_read_inflight`,
            // set below) and leaked if the ring goes with it outstanding
            // (`sys`, "Eventfd drains").
            if unsafe { sys::push_read_u64(&mut self.ring, efd, buf, ud) } {
                self.eventfd_read_inflight = true;
                return 1;
            }
        }
        let mut b = [0u8; 8];
        // EAGAIN (nothing written) is fine.
        let _ = nix::unistd::read(efd, &mut b);
        self.stats.eventfd_read_syscalls += 1;
        0
    }

    /// `RecvMode::Spin`, before a park: a readability poll for every
    /// connection that has none ([`push_park_polls`](Self::push_park_polls)),
    /// submitting the SQ each time it fills up, as often as that takes
    /// (with more connections than SQ entries, once was not enough: the
    /// connections past the second SQ's worth slept through their data).
    /// The last SQEs stay queued for the caller to submit.
    pub(super) fn arm_park_polls(&mut self) {
        // Each pass after a submit resumes where the full SQ stopped the
        // last one (`conn_cursor`) and arms at least one connection, as
        // the submit made room: one pass per connection, and the one that
        // finds them all armed, is the most it takes.
        for _ in 0..=self.conns.len() {
            if !self.push_park_polls() {
                return;
            }
            if !self.submit_queued() {
                break;
            }
        }
        tracing::debug!("uring: no room in the SQ for every park poll");
    }

    /// `RecvMode::Spin`, before a park: queue a one-shot readability poll
    /// for every connection that has none (the caller submits them). A
    /// poll consumes no data, so it cannot reorder the stream; its
    /// completion only wakes the reactor, whose next turns receive.
    /// Returns true when the SQ filled up first.
    pub(super) fn push_park_polls(&mut self) -> bool {
        for idx in self.pass_order() {
            let Some(c) = self.conns[idx].as_mut() else {
                continue;
            };
            if c.closing || c.poll_armed || c.rx_end.is_some() {
                continue;
            }
            if !sys::push_poll_in(&mut self.ring, c.sock, user_data(idx, OP_POLL)) {
                self.stats.sq_full += 1;
                self.conn_cursor = idx;
                return true;
            }
            c.poll_armed = true;
            self.stats.park_polls += 1;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{loopback_pair, rpc_frame};
    use super::*;
    use crate::{RecvMode, UringConfig, UringDriver};
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    use starwire_transport::Driver;
    use std::io::Write;

    /// Enter `d`'s ring until connection `idx` holds received bytes.
    fn until_chunks(d: &mut UringDriver, idx: usize, what: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while d.ring_mut().conn(idx).chunks.is_empty() {
            assert!(std::time::Instant::now() < deadline, "{what}: no data");
            d.ring_mut().end_turn().unwrap();
        }
    }

    /// A single receive that completed in the last enter is queued again
    /// when the reactor asks for its park descriptor, so that data arriving
    /// during the park wakes it even when no turn ran in between.
    #[test]
    fn a_park_queues_the_completed_single_receive_again() {
        let cfg = UringConfig::default();
        assert_eq!(cfg.recv, RecvMode::Single);
        let mut d = UringDriver::new(&cfg).unwrap();
        let (a, mut b) = loopback_pair();
        let idx = d.ring_mut().add_conn(a).unwrap();
        b.write_all(&rpc_frame(1, 8)).unwrap();
        until_chunks(&mut d, idx, "single");
        assert!(
            !d.ring_mut().conn(idx).recv_armed,
            "completed, to be queued again"
        );
        // The park: no turn, no enter; the descriptor queues the receive.
        let mut fds = Vec::new();
        d.wake_fds(&mut fds);
        assert!(
            d.ring_shared().conn(idx).recv_armed,
            "queued again before the park"
        );
        b.write_all(&rpc_frame(2, 8)).unwrap();
        let mut pfds = [PollFd::new(fds[0], PollFlags::POLLIN)];
        let n = nix::poll::poll(&mut pfds, PollTimeout::from(5000u16)).unwrap();
        assert_eq!(n, 1, "the park woke for the second frame");
    }

    /// A park in the ring that queued its SQEs and then failed to enter
    /// (the reactor polls instead): the park descriptor submits them, in
    /// each mode, so data still wakes the poll.
    #[test]
    fn a_failed_park_leaves_nothing_unsubmitted_for_the_poll() {
        use nix::sys::eventfd::{EfdFlags, EventFd};
        use std::os::fd::AsFd;
        for recv in [RecvMode::Single, RecvMode::Spin] {
            let cfg = UringConfig {
                recv,
                ..UringConfig::default()
            };
            let mut d = UringDriver::new(&cfg).unwrap();
            let (a, mut b) = loopback_pair();
            let idx = d.ring_mut().add_conn(a).unwrap();
            b.write_all(&rpc_frame(1, 8)).unwrap();
            until_chunks(&mut d, idx, &format!("{recv:?}"));
            let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK).unwrap();
            let waker = ParkWaker {
                fd: efd.as_fd(),
                id: 1,
            };
            // The park's first half queues the receive (or poll) and the
            // waker's poll; its enter never happens.
            let (_, pending, ready) = d.ring_mut().prepare_park(waker).unwrap();
            assert!(pending >= 2 && !ready, "{recv:?}: {pending} {ready}");
            let mut fds = Vec::new();
            d.wake_fds(&mut fds);
            assert_eq!(d.ring_shared().queued(), 0, "{recv:?}: left queued");
            b.write_all(&rpc_frame(2, 8)).unwrap();
            let mut pfds = [PollFd::new(fds[0], PollFlags::POLLIN)];
            let n = nix::poll::poll(&mut pfds, PollTimeout::from(5000u16)).unwrap();
            assert_eq!(n, 1, "{recv:?}: the poll slept through the data");
        }
    }

    /// Spin mode with more connections than SQ entries: a park (in the
    /// ring, or on the park descriptor) arms a readability poll for every
    /// connection, submitting a full SQ as often as it takes; one
    /// without would sleep through its data.
    #[test]
    fn a_park_polls_every_connection_of_a_small_sq() {
        use nix::sys::eventfd::{EfdFlags, EventFd};
        use std::os::fd::AsFd;
        let n = 19;
        for (in_ring, sqpoll) in [(false, false), (true, false), (false, true)] {
            let cfg = UringConfig {
                recv: RecvMode::Spin,
                sq_entries: 4,
                sqpoll_idle_ms: sqpoll.then_some(1000),
                ..UringConfig::default()
            };
            let mut d = match UringDriver::new(&cfg) {
                Ok(d) => d,
                Err(e) if sqpoll => {
                    println!("SQPOLL case skipped: no SQPOLL ring here ({e})");
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            let mut peers = Vec::new();
            for _ in 0..n {
                let (a, b) = loopback_pair();
                d.ring_mut().add_conn(a).unwrap();
                peers.push(b);
            }
            // A turn first, as a reactor's: it enables the ring.
            d.ring_mut().end_turn().unwrap();
            let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK).unwrap();
            if in_ring {
                let waker = ParkWaker {
                    fd: efd.as_fd(),
                    id: 1,
                };
                d.ring_mut().prepare_park(waker).unwrap();
            } else {
                let mut fds = Vec::new();
                d.wake_fds(&mut fds);
            }
            let r = d.ring_mut();
            let armed = (0..r.conns_len()).filter(|&i| r.conn(i).poll_armed).count();
            assert_eq!(
                armed, n,
                "in ring {in_ring}, SQPOLL {sqpoll}: connections left without a poll"
            );
            assert_eq!(r.stats.park_polls, n as u64, "{in_ring} {sqpoll}");
        }
    }
}

//! Entering the ring and reaping it: the one `io_uring_enter` of a turn,
//! the plain submits a full SQ or a park needs, and the dispatch of
//! completions to the connections.

use io_uring::cqueue;

use super::op::{
    CONN_MASK, OP_EVENTFD, OP_POLL, OP_RECV, OP_RECV_DIRECT, OP_RECV_OWN, OP_SEND, OP_WAKER,
};
use super::{thread_token, Ring};
use crate::sys;

/// Completions copied out of the CQ at a time (see `Ring::reap`).
pub(super) const CQE_BATCH: usize = 32;

impl Ring {
    /// One `io_uring_enter` when SQEs wait, deferred work is flagged
    /// (`IORING_SQ_TASKRUN`) or the CQ overflowed. Returns whether it
    /// entered.
    pub(crate) fn enter(&mut self) -> std::io::Result<bool> {
        if !self.enabled {
            self.ring.submitter().register_enable_rings()?;
            self.enabled = true;
        }
        let drains = self.queue_eventfd_drain();
        let direct_spun = self.queue_direct_receives();
        self.rearm_receives();
        let spun = drains
            + direct_spun
            + if self.spin {
                self.queue_spin_receives()
            } else {
                0
            };
        let (pending, taskrun, overflow, wakeup) = {
            let mut sq = self.ring.submission();
            sq.sync();
            (
                sq.len(),
                sq.taskrun(),
                sq.cq_overflow(),
                self.sqpoll && sq.need_wakeup(),
            )
        };
        if pending == 0 && !taskrun && !overflow && !wakeup {
            return Ok(false);
        }
        if self.sqpoll && !wakeup && !taskrun && !overflow {
            // The kernel thread picks the SQEs up without a system call.
            // (They were counted in flight when queued: `sys::push`.)
            self.ring.submission().sync();
            self.stats.sqes += pending as u64;
            return Ok(pending > spun);
        }
        let registered = self.registered_index();
        // GETEVENTS only when the kernel flagged deferred completion work
        // (or the CQ overflowed, or SQPOLL needs a wakeup): what completes
        // while the SQEs are issued is posted by the submission itself,
        // and GETEVENTS adds a pass through the wait path to every call.
        // Under COOP_TASKRUN, task work runs on any entry anyway.
        let mut flags = if taskrun || overflow {
            sys::ENTER_GETEVENTS
        } else {
            0
        };
        self.stats.enters += 1;
        if registered.is_some() {
            self.stats.registered_enters += 1;
        }
        loop {
            let r = if self.sqpoll {
                // The crate adds the wakeup flag the kernel thread needs.
                self.ring.submit()
            } else {
                sys::enter(&self.ring, registered, pending as u32, flags)
            };
            match r {
                Ok(n) => {
                    self.stats.sqes += n as u64;
                    // Spin receives alone are no work: a reactor whose
                    // turns only asked for data it did not get is idle and
                    // may park.
                    return Ok(pending > spun || taskrun || overflow || wakeup);
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    // The CQ is full: reap, then retry.
                    self.reap();
                    flags |= sys::ENTER_GETEVENTS;
                    self.stats.enters += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The ring's registered descriptor for the calling thread: registered
    /// on the first enter of a thread (the reactor's), used only by that
    /// thread (registrations are per thread).
    pub(super) fn registered_index(&mut self) -> Option<u32> {
        let me = thread_token();
        match self.registered {
            Some((i, t)) if t == me => Some(i),
            Some(_) => None,
            None if self.sqpoll => None,
            None => match sys::register_ring_fd(&self.ring) {
                Ok(i) => {
                    self.registered = Some((i, me));
                    Some(i)
                }
                Err(e) => {
                    // Not fatal: enters go through the plain descriptor.
                    tracing::debug!(error = %e, "uring: IORING_REGISTER_RING_FDS failed");
                    self.registered = Some((u32::MAX, u64::MAX));
                    None
                }
            },
        }
    }

    /// SQEs queued and not yet submitted.
    pub(super) fn queued(&mut self) -> usize {
        let mut sq = self.ring.submission();
        sq.sync();
        sq.len()
    }

    /// Queue an SQE with `push`; when the SQ is full, submit what is
    /// queued and try once more. Returns whether it was queued.
    pub(super) fn push_or_submit(&mut self, push: impl Fn(&mut sys::Uring) -> bool) -> bool {
        if push(&mut self.ring) {
            return true;
        }
        self.stats.sq_full += 1;
        self.submit_queued();
        push(&mut self.ring)
    }

    /// Submit what is queued with a plain enter (no wait, no receives
    /// added): room in a full SQ, or polls before a park. Returns false
    /// when the enter failed (nothing was submitted).
    pub(super) fn submit_queued(&mut self) -> bool {
        let pending = self.queued();
        if pending == 0 {
            return true;
        }
        if self.sqpoll {
            return self.submit_queued_sqpoll(pending);
        }
        let registered = self.registered_index();
        self.stats.enters += 1;
        self.stats.registered_enters += u64::from(registered.is_some());
        match sys::enter(&self.ring, registered, pending as u32, 0) {
            Ok(n) => {
                self.stats.sqes += n as u64;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "uring: submitting a full SQ");
                false
            }
        }
    }

    /// [`submit_queued`](Self::submit_queued) under SQPOLL: the kernel
    /// thread takes what is queued, and an enter only wakes it when it
    /// went to sleep (the crate adds `IORING_ENTER_SQ_WAKEUP` then; a
    /// plain enter did nothing, and a full SQ stayed full). A full SQ is
    /// waited on until the thread made room (`IORING_ENTER_SQ_WAIT`), as
    /// the callers submit it for room.
    fn submit_queued_sqpoll(&mut self, pending: usize) -> bool {
        let full = self.ring.submission().is_full();
        let r = self.ring.submit().and_then(|_| {
            if full {
                self.ring.submitter().squeue_wait()
            } else {
                Ok(0)
            }
        });
        match r {
            Ok(_) => {
                self.stats.sqes += pending as u64;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "uring: waking the SQPOLL thread failed");
                false
            }
        }
    }

    /// Dispatch every available completion. Returns how many, not
    /// counting spin receives that found no data.
    pub(crate) fn reap(&mut self) -> usize {
        // Copied out a batch at a time: each `completion()` synchronises
        // with the kernel's tail and, when dropped, publishes the head, so
        // one per completion cost two atomic operations each.
        let mut batch = std::mem::take(&mut self.cqe_batch);
        let mut n = 0;
        loop {
            batch.clear();
            batch.extend(
                self.ring
                    .completion()
                    .take(CQE_BATCH)
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            if batch.is_empty() {
                break;
            }
            for &(ud, res, flags) in &batch {
                let op = ud & 0xff;
                let empty = op == OP_EVENTFD
                    || op == OP_WAKER
                    || (res == -libc::EAGAIN
                        && (op == OP_RECV || op == OP_RECV_DIRECT || op == OP_RECV_OWN));
                n += usize::from(!empty);
                self.complete(ud, res, flags);
            }
        }
        self.cqe_batch = batch;
        n
    }

    pub(super) fn complete(&mut self, ud: u64, res: i32, flags: u32) {
        let idx = ((ud >> 8) & CONN_MASK) as usize;
        let op = ud & 0xff;
        let more = cqueue::more(flags);
        if !more {
            self.ring.completed();
        }
        match op {
            OP_RECV => self.complete_recv(idx, res, flags),
            OP_RECV_DIRECT => self.complete_direct(idx, res),
            OP_RECV_OWN => self.complete_own(idx, res),
            OP_SEND => self.complete_send(idx, res, flags, (ud >> 48) as u16),
            OP_POLL => {
                if let Some(Some(c)) = self.conns.get_mut(idx) {
                    c.poll_armed = false;
                }
            }
            OP_EVENTFD => {
                self.eventfd_read_inflight = false;
                return;
            }
            OP_WAKER => {
                // Only the armed poll's completion counts (a cancelled
                // one, of an earlier waker, carries another generation).
                if self.waker_poll == Some(idx as u64) {
                    self.waker_poll = None;
                    self.waker_fired = true;
                }
                return;
            }
            _ => {}
        }
        self.maybe_free(idx);
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::loopback_pair;
    use super::*;
    use crate::{RecvMode, UringConfig, UringDriver};

    /// `IORING_ENTER_SQ_WAKEUP`.
    const SQ_WAKEUP: u32 = 1 << 1;

    /// Under SQPOLL the kernel thread takes SQEs as they are pushed,
    /// without an enter of the ring's: the in-flight count still holds
    /// every armed receive, so the ring's `Drop` cancels and waits for
    /// them (a count that reached 0 would free the provided buffers the
    /// receives write into).
    #[test]
    fn sqpoll_counts_the_receives_the_kernel_thread_took() {
        let cfg = UringConfig {
            sqpoll_idle_ms: Some(1000),
            recv: RecvMode::Multishot,
            ..UringConfig::default()
        };
        let mut d = match UringDriver::new(&cfg) {
            Ok(d) => d,
            Err(e) => {
                println!("skipped: no SQPOLL ring here ({e})");
                return;
            }
        };
        let r = d.ring_mut();
        let mut peers = Vec::new();
        let n = 4;
        for _ in 0..n {
            let (a, b) = loopback_pair();
            let idx = r.add_conn(a).unwrap();
            assert!(r.conn(idx).recv_armed);
            peers.push(b);
        }
        // Let the kernel thread take the receives by itself (woken if it
        // went to sleep), with no enter of the ring's own.
        let fd = sys::EnterFd::new(&r.ring, None);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while r.queued() > 0 {
            assert!(std::time::Instant::now() < deadline, "never taken");
            if r.ring.submission().need_wakeup() {
                sys::enter_raw(fd, 0, SQ_WAKEUP).unwrap();
            }
            std::thread::yield_now();
        }
        // A turn with nothing queued: nothing to add there.
        r.end_turn().unwrap();
        assert_eq!(r.in_flight(), n, "armed receives not counted");
    }
}

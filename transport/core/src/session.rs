//! [`Sessions`]: the message layer of every connection of one
//! [`Driver`], and the run-to-completion turn a reactor performs over
//! them: one receive pass, the frames each connection has to send, one
//! submission.

use std::time::{Duration, Instant};

use crate::connection::{ConnConfig, ConnError, Connection, Event, Incoming};
use crate::driver::{ConnId, Driver};

/// Frames taken from each connection per turn.
pub const RX_BURST: usize = 32;

/// What one turn did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TurnStats {
    /// Frames received.
    pub rx_frames: usize,
    /// Frames handed to the backend.
    pub tx_frames: usize,
    /// The driver's submission took in input ([`Driver::flush`]) that
    /// the next receive pass delivers, so the turn is not idle even when
    /// no frame moved.
    pub submitted: bool,
}

impl TurnStats {
    /// True when the turn moved anything.
    pub fn busy(&self) -> bool {
        self.rx_frames + self.tx_frames > 0 || self.submitted
    }
}

/// The message layer of every connection of one [`Driver`]: what a
/// reactor turns. Connections are attached to the driver by the backend
/// (its `attach`) and then [`insert`](Self::insert)ed here under their
/// [`ConnId`].
#[derive(Debug)]
pub struct Sessions<D> {
    driver: D,
    slots: Vec<Option<Slot>>,
    live: usize,
}

#[derive(Debug)]
struct Slot {
    conn: Connection,
    reassembled: Vec<u8>,
    failed: Option<ConnError>,
    /// [`ConnConfig::idle_timeout`] and what it is measured from.
    idle: Option<Idle>,
}

/// A connection's idle timeout and the instants it is measured from.
#[derive(Debug)]
struct Idle {
    timeout: Duration,
    /// The last frame received or data frame sent (`None` until the first
    /// turn sees the connection).
    last_active: Option<Instant>,
    /// Since when queued messages could not leave.
    stalled_since: Option<Instant>,
    /// [`Connection::data_frames_sent`] at the last look.
    sent: u64,
}

impl Idle {
    /// Whether the connection broke its idle timeout at `now`, given it
    /// has `queued` messages waiting; updates the instants.
    fn check(&mut self, conn: &Connection, now: Instant) -> Option<ConnError> {
        let sent = conn.data_frames_sent();
        let moved = sent != self.sent;
        self.sent = sent;
        let last = *self.last_active.get_or_insert(now);
        if moved {
            self.last_active = Some(now);
        }
        self.stalled_since = match (conn.queued() > 0, moved) {
            (false, _) | (true, true) => None,
            (true, false) => Some(self.stalled_since.unwrap_or(now)),
        };
        if self
            .stalled_since
            .is_some_and(|t| now.saturating_duration_since(t) >= self.timeout)
        {
            return Some(ConnError::TimedOut(
                "the peer read none of its replies within the idle timeout",
            ));
        }
        if !moved && now.saturating_duration_since(last) >= self.timeout {
            return Some(ConnError::TimedOut(
                "nothing received or sent within the idle timeout",
            ));
        }
        None
    }

    /// When [`check`](Self::check) would next fail the connection.
    fn deadline(&self) -> Option<Instant> {
        let idle = self.last_active.map(|t| t + self.timeout);
        let stall = self.stalled_since.map(|t| t + self.timeout);
        match (idle, stall) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl<D: Driver> Sessions<D> {
    /// No connections yet, over `driver`.
    pub fn new(driver: D) -> Self {
        Self {
            driver,
            slots: Vec::new(),
            live: 0,
        }
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The driver, mutably (to attach connections).
    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.driver
    }

    /// Start the message layer of `id`, a connection just attached to the
    /// driver; its handshake is queued.
    pub fn insert(&mut self, id: ConnId, cfg: ConnConfig) {
        let i = id.index();
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, || None);
        }
        let idle = cfg.idle_timeout.map(|timeout| Idle {
            timeout,
            last_active: None,
            stalled_since: None,
            sent: 0,
        });
        let conn = Connection::new(cfg, self.driver.max_frame_len());
        if self.slots[i].is_none() {
            self.live += 1;
        }
        self.slots[i] = Some(Slot {
            conn,
            reassembled: Vec::new(),
            failed: None,
            idle,
        });
    }

    /// The connection `id`, to queue requests and responses.
    pub fn conn(&mut self, id: ConnId) -> Option<&mut Connection> {
        self.slots
            .get_mut(id.index())
            .and_then(Option::as_mut)
            .map(|s| &mut s.conn)
    }

    /// The connection `id`, read-only.
    pub fn conn_ref(&self, id: ConnId) -> Option<&Connection> {
        self.slots
            .get(id.index())
            .and_then(Option::as_ref)
            .map(|s| &s.conn)
    }

    /// Handles of the connections held.
    pub fn ids(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(i, _)| ConnId::new(i as u32))
    }

    /// How many connections are held.
    pub fn len(&self) -> usize {
        self.live
    }

    /// True when no connection is held.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The earliest instant at which a turn has timer work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let conns = self
            .slots
            .iter()
            .flatten()
            .filter(|s| s.failed.is_none())
            .flat_map(|s| {
                [
                    s.conn.poll_timeout(),
                    s.idle.as_ref().and_then(Idle::deadline),
                ]
            })
            .flatten()
            .min();
        match (conns, self.driver.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// One turn over every connection: one receive pass (each message to
    /// `on_msg`, which may queue answers on the connection it is given),
    /// timers, the frames each connection has to send, and one
    /// submission. A connection that fails is reported by
    /// [`poll_failed`](Self::poll_failed).
    pub fn turn(
        &mut self,
        now: Instant,
        on_msg: &mut dyn FnMut(ConnId, &mut Connection, Incoming<'_>),
    ) -> TurnStats {
        let mut stats = TurnStats::default();
        let slots = &mut self.slots;
        stats.rx_frames = self
            .driver
            .rx_burst(now, RX_BURST, &mut |id: ConnId, frame: &[u8]| {
                let Some(Some(s)) = slots.get_mut(id.index()) else {
                    return;
                };
                if s.failed.is_some() {
                    return;
                }
                if let Some(idle) = s.idle.as_mut() {
                    idle.last_active = Some(now);
                }
                match s.conn.handle_frame(frame, &mut s.reassembled) {
                    Ok(Some(msg)) => {
                        on_msg(id, &mut s.conn, msg);
                        // A reassembled message's buffer is not kept: its
                        // bytes were charged to the budget only until now.
                        if s.reassembled.capacity() > 0 {
                            s.reassembled = Vec::new();
                        }
                    }
                    Ok(None) => {}
                    Err(e) => s.failed = Some(e),
                }
            });
        self.take_failures();
        (stats.tx_frames, stats.submitted) = self.transmit(now);
        stats
    }

    /// Send what the connections queued, without receiving: timers, each
    /// connection's frames, one submission.
    pub fn flush(&mut self, now: Instant) -> TurnStats {
        let (tx_frames, submitted) = self.transmit(now);
        TurnStats {
            rx_frames: 0,
            tx_frames,
            submitted,
        }
    }

    /// Frames written, and whether the driver's submission did work.
    fn transmit(&mut self, now: Instant) -> (usize, bool) {
        let mut frames = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(s) = slot.as_mut() else { continue };
            if s.failed.is_some() {
                continue;
            }
            s.conn.handle_timeout(now);
            // A connection that failed outside a frame still sends what it
            // queued for its peer (why it closes), then fails.
            if let Some(e) = s.conn.take_error() {
                let id = ConnId::new(i as u32);
                if s.conn.wants_transmit() {
                    if let Ok(n) = s.conn.poll_transmit(&mut self.driver.tx(id)) {
                        frames += n;
                    }
                }
                s.failed = Some(e);
                continue;
            }
            if !s.conn.wants_transmit() {
                if let Some(e) = s.idle.as_mut().and_then(|i| i.check(&s.conn, now)) {
                    s.conn.fail(e);
                    s.failed = s.conn.take_error();
                }
                continue;
            }
            let id = ConnId::new(i as u32);
            match s.conn.poll_transmit(&mut self.driver.tx(id)) {
                Ok(n) => {
                    frames += n;
                    if let Some(e) = s.idle.as_mut().and_then(|i| i.check(&s.conn, now)) {
                        s.conn.fail(e);
                        s.failed = s.conn.take_error();
                    }
                }
                Err(e) => {
                    if let ConnError::Transport(t) = &e {
                        s.conn.handle_transport_error(t);
                    }
                    s.failed = Some(e);
                }
            }
        }
        let submitted = self.driver.flush(now);
        self.take_failures();
        (frames, submitted)
    }

    fn take_failures(&mut self) {
        while let Some((id, e)) = self.driver.poll_failure() {
            if let Some(Some(s)) = self.slots.get_mut(id.index()) {
                s.conn.handle_transport_error(&e);
                if s.failed.is_none() {
                    s.failed = Some(e.into());
                }
            }
        }
    }

    /// A connection that failed (or was closed by its peer): removed here
    /// and detached from the driver, with its message layer (whose
    /// [`Connection::poll_event`] still holds the failed requests) and the
    /// reason.
    pub fn poll_failed(&mut self) -> Option<(ConnId, Connection, ConnError)> {
        let (id, s, error) = self.take_failed()?;
        self.driver.detach(id);
        Some((id, s.conn, error))
    }

    /// Like [`poll_failed`](Self::poll_failed), but the failed connection
    /// is handed to `f` while it is still attached, with the driver, to
    /// read what the driver keeps of it (its counters); it is detached
    /// once `f` returns. `None` when no connection failed.
    pub fn poll_failed_with<R>(
        &mut self,
        f: impl FnOnce(ConnId, &mut Connection, &ConnError, &D) -> R,
    ) -> Option<R> {
        let (id, mut s, error) = self.take_failed()?;
        let r = f(id, &mut s.conn, &error, &self.driver);
        self.driver.detach(id);
        Some(r)
    }

    /// The first failed connection, out of its slot but still attached.
    fn take_failed(&mut self) -> Option<(ConnId, Slot, ConnError)> {
        let i = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.failed.is_some()))?;
        let mut s = self.slots[i].take()?;
        self.live -= 1;
        let error = s.failed.take()?;
        Some((ConnId::new(i as u32), s, error))
    }

    /// End connection `id` for a reason of the layer above (its peer broke
    /// the application's protocol): it is closed, nothing more of it is
    /// received or sent, and [`poll_failed`](Self::poll_failed) hands it
    /// out with `reason` (unless it had failed already). False when `id`
    /// is not held.
    pub fn end(&mut self, id: ConnId, reason: ConnError) -> bool {
        let Some(Some(s)) = self.slots.get_mut(id.index()) else {
            return false;
        };
        if s.failed.is_none() {
            s.conn.close();
            s.failed = Some(reason);
        }
        true
    }

    /// Hand every event of the connections held to `f`, connection by
    /// connection. A failed connection's events stay with it, for
    /// whoever takes it from [`poll_failed`](Self::poll_failed).
    pub fn poll_events(&mut self, f: &mut dyn FnMut(ConnId, &mut Connection, Event)) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(s) = slot.as_mut().filter(|s| s.failed.is_none()) else {
                continue;
            };
            while let Some(ev) = s.conn.poll_event() {
                f(ConnId::new(i as u32), &mut s.conn, ev);
            }
        }
    }

    /// True when no connection held has anything left to send: nothing
    /// queued in its message layer and nothing its driver has not handed
    /// to the wire; nor has the driver for connections already detached
    /// ([`Driver::winding_down`]).
    pub fn is_drained(&self) -> bool {
        !self.driver.winding_down()
            && self.slots.iter().enumerate().all(|(i, s)| {
                s.as_ref().map_or(true, |s| {
                    !s.conn.wants_transmit() && !self.driver.tx_pending(ConnId::new(i as u32))
                })
            })
    }

    /// Remove `id` (after an orderly close, say) and detach it from the
    /// driver. Returns its message layer.
    pub fn remove(&mut self, id: ConnId) -> Option<Connection> {
        let s = self.slots.get_mut(id.index())?.take()?;
        self.live -= 1;
        self.driver.detach(id);
        Some(s.conn)
    }
}

#[cfg(test)]
mod tests {
    use starwire_wire::{Opcode, Status};

    use super::*;
    use crate::connection::{Event, Payload, PeerInfo, RequestError, TaskRole};
    use crate::driver::Links;
    use crate::testing::MemTransport;
    use crate::transport::TransportError;

    type Mem = Sessions<Links<MemTransport>>;

    fn config(role: TaskRole, i: usize) -> ConnConfig {
        ConnConfig::new(PeerInfo {
            role,
            job: "test".into(),
            task_index: i as u32,
            incarnation: 1,
            shards: 1,
        })
    }

    /// Connect a new link pair at both sides.
    fn connect(a: &mut Mem, b: &mut Mem, i: usize) -> (ConnId, ConnId) {
        let (la, lb) = MemTransport::pair(1024, 16);
        let (ia, ib) = (a.driver_mut().attach(la), b.driver_mut().attach(lb));
        a.insert(ia, config(TaskRole::Worker, i));
        b.insert(ib, config(TaskRole::Ps, i));
        (ia, ib)
    }

    /// Turn both sides `rounds` times; `b` answers every request.
    fn turns(a: &mut Mem, b: &mut Mem, rounds: usize) -> usize {
        let mut responses = 0;
        let now = Instant::now();
        for _ in 0..rounds {
            a.turn(now, &mut |_, _, m| {
                if let Incoming::Response { status, .. } = m {
                    assert_eq!(status, Status::Ok);
                    responses += 1;
                }
            });
            b.turn(now, &mut |_, c, m| {
                if let Incoming::Request { id, opcode, .. } = m {
                    c.respond(id, opcode, Status::Ok, Payload::empty())
                        .expect("respond");
                }
            });
        }
        responses
    }

    fn request(s: &mut Mem, id: ConnId) -> u64 {
        let c = s.conn(id).expect("held");
        c.request(Opcode::Rpc, 0, Payload::from(vec![1, 2, 3]), None)
            .expect("queue")
    }

    #[test]
    fn poll_failed_detaches_the_failed_connection_only() {
        let (mut a, mut b) = (Mem::new(Links::new(1024)), Mem::new(Links::new(1024)));
        let (a0, b0) = connect(&mut a, &mut b, 0);
        let (a1, _) = connect(&mut a, &mut b, 1);
        turns(&mut a, &mut b, 4);
        assert!(a.conn_ref(a0).is_some_and(Connection::is_established));
        assert!(b.poll_failed().is_none());

        // The server end of connection 0 goes away with a request pending.
        let lost = request(&mut a, a0);
        b.remove(b0).expect("held");
        turns(&mut a, &mut b, 2);
        let (id, mut conn, e) = a.poll_failed().expect("a failure");
        assert_eq!(id, a0);
        assert!(
            matches!(e, ConnError::Transport(TransportError::Closed)),
            "{e}"
        );
        assert!(conn.is_closed());
        let mut events = std::iter::from_fn(|| conn.poll_event());
        assert!(events.any(|e| matches!(
            e,
            Event::RequestFailed { id, error: RequestError::ConnectionLost(_) } if id == lost
        )));
        assert!(a.poll_failed().is_none(), "reported twice");
        assert!(a.conn(a0).is_none());
        assert!(a.driver().link(a0).is_none(), "not detached");
        assert_eq!(a.len(), 1);
        assert_eq!(a.ids().collect::<Vec<_>>(), [a1]);

        // Connection 1 goes on.
        request(&mut a, a1);
        assert_eq!(turns(&mut a, &mut b, 4), 1);
        assert!(a.poll_failed().is_none() && b.poll_failed().is_none());
    }

    #[test]
    fn remove_detaches_and_the_slot_serves_the_next_connection() {
        let (mut a, mut b) = (Mem::new(Links::new(1024)), Mem::new(Links::new(1024)));
        let (a0, b0) = connect(&mut a, &mut b, 0);
        let (a1, b1) = connect(&mut a, &mut b, 1);
        turns(&mut a, &mut b, 4);

        let conn = a.remove(a0).expect("held");
        assert!(conn.is_established());
        assert!(a.remove(a0).is_none());
        assert!(a.conn(a0).is_none());
        assert!(a.driver().link(a0).is_none(), "not detached");
        assert_eq!(a.len(), 1);
        // The far end sees its link closed; connection 1 is untouched.
        turns(&mut a, &mut b, 2);
        let (id, _, e) = b.poll_failed().expect("the far end failed");
        assert_eq!(id, b0);
        assert!(
            matches!(e, ConnError::Transport(TransportError::Closed)),
            "{e}"
        );
        assert!(b.poll_failed().is_none());

        // The freed slots serve a new connection at both ends.
        let (n0, m0) = connect(&mut a, &mut b, 2);
        assert_eq!((n0, m0), (a0, b0));
        turns(&mut a, &mut b, 4);
        let peer = a
            .conn_ref(n0)
            .and_then(Connection::peer)
            .expect("established");
        assert_eq!(peer.task_index, 2);
        request(&mut a, n0);
        request(&mut a, a1);
        assert_eq!(turns(&mut a, &mut b, 4), 2);
        assert_eq!((a.len(), b.len()), (2, 2));
        assert!(b.conn_ref(b1).is_some_and(Connection::is_established));
    }
}

//! A [`Connection`] bound to its [`Transport`]: the run-to-completion turn
//! a reactor performs for each connection it owns.

use std::time::Instant;

use crate::connection::{ConnConfig, ConnError, Connection, Event, Incoming};
use crate::driver::{ConnId, Driver};
use crate::transport::Transport;

/// Frames taken from the backend per turn.
pub const RX_BURST: usize = 32;

/// A connection and its backend.
#[derive(Debug)]
pub struct Session<T> {
    conn: Connection,
    transport: T,
    reassembled: Vec<u8>,
}

/// What one turn did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TurnStats {
    /// Frames received.
    pub rx_frames: usize,
    /// Frames handed to the backend.
    pub tx_frames: usize,
}

impl TurnStats {
    /// True when the turn moved anything.
    pub fn busy(&self) -> bool {
        self.rx_frames + self.tx_frames > 0
    }
}

impl<T: Transport> Session<T> {
    /// Bind a new connection to `transport`; the handshake is queued.
    pub fn new(cfg: ConnConfig, transport: T) -> Self {
        let conn = Connection::new(cfg, transport.max_frame_len());
        Self {
            conn,
            transport,
            reassembled: Vec::new(),
        }
    }

    /// The connection, to queue requests and responses.
    pub fn conn(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// The connection, read-only.
    pub fn conn_ref(&self) -> &Connection {
        &self.conn
    }

    /// The backend.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The backend, mutably.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The next connection event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.conn.poll_event()
    }

    /// The earliest instant at which a turn has timer work.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.conn.poll_timeout(), self.transport.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// One turn: receive a burst and hand each message to `on_msg` (which
    /// may queue responses on the connection it is given), fire timers,
    /// write queued frames and flush them with one backend call.
    ///
    /// An error ends the connection: pending requests have been failed
    /// (see [`Connection::poll_event`]) and the session should be dropped.
    pub fn turn(
        &mut self,
        now: Instant,
        on_msg: &mut dyn FnMut(&mut Connection, Incoming<'_>),
    ) -> Result<TurnStats, ConnError> {
        let mut stats = TurnStats::default();
        let conn = &mut self.conn;
        let scratch = &mut self.reassembled;
        let mut failed: Option<ConnError> = None;
        let rx = self.transport.rx_burst(now, RX_BURST, &mut |frame: &[u8]| {
            if failed.is_some() {
                return;
            }
            match conn.handle_frame(frame, scratch) {
                Ok(Some(msg)) => on_msg(conn, msg),
                Ok(None) => {}
                Err(e) => failed = Some(e),
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        match rx {
            Ok(n) => stats.rx_frames = n,
            Err(e) => {
                self.conn.handle_transport_error(&e);
                return Err(e.into());
            }
        }
        self.conn.handle_timeout(now);
        self.transmit(now, &mut stats)?;
        Ok(stats)
    }

    /// Write and flush queued frames without receiving.
    pub fn flush(&mut self, now: Instant) -> Result<TurnStats, ConnError> {
        let mut stats = TurnStats::default();
        self.transmit(now, &mut stats)?;
        Ok(stats)
    }

    fn transmit(&mut self, now: Instant, stats: &mut TurnStats) -> Result<(), ConnError> {
        let r = self.conn.poll_transmit(&mut self.transport).and_then(|n| {
            stats.tx_frames = n;
            if n > 0 || self.transport.tx_pending() || self.transport.poll_timeout().is_some() {
                self.transport.flush(now)?;
            }
            Ok(())
        });
        if let Err(ConnError::Transport(e)) = &r {
            self.conn.handle_transport_error(e);
        }
        r
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
        let conn = Connection::new(cfg, self.driver.max_frame_len());
        if self.slots[i].is_none() {
            self.live += 1;
        }
        self.slots[i] = Some(Slot {
            conn,
            reassembled: Vec::new(),
            failed: None,
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
            .filter_map(|s| s.conn.poll_timeout())
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
                match s.conn.handle_frame(frame, &mut s.reassembled) {
                    Ok(Some(msg)) => on_msg(id, &mut s.conn, msg),
                    Ok(None) => {}
                    Err(e) => s.failed = Some(e),
                }
            });
        self.take_failures();
        stats.tx_frames = self.transmit(now);
        stats
    }

    /// Send what the connections queued, without receiving: timers, each
    /// connection's frames, one submission.
    pub fn flush(&mut self, now: Instant) -> TurnStats {
        TurnStats {
            rx_frames: 0,
            tx_frames: self.transmit(now),
        }
    }

    fn transmit(&mut self, now: Instant) -> usize {
        let mut frames = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(s) = slot.as_mut() else { continue };
            if s.failed.is_some() {
                continue;
            }
            s.conn.handle_timeout(now);
            if !s.conn.wants_transmit() {
                continue;
            }
            let id = ConnId::new(i as u32);
            match s.conn.poll_transmit(&mut self.driver.tx(id)) {
                Ok(n) => frames += n,
                Err(e) => {
                    if let ConnError::Transport(t) = &e {
                        s.conn.handle_transport_error(t);
                    }
                    s.failed = Some(e);
                }
            }
        }
        self.driver.flush(now);
        self.take_failures();
        frames
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
        let i = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.failed.is_some()))?;
        let s = self.slots[i].take()?;
        self.live -= 1;
        let id = ConnId::new(i as u32);
        self.driver.detach(id);
        Some((id, s.conn, s.failed.expect("failed")))
    }

    /// The connection [`poll_failed`](Self::poll_failed) hands out next,
    /// while it is still attached to the driver: to read what the driver
    /// keeps of it (its counters) before it goes.
    pub fn next_failed(&self) -> Option<ConnId> {
        let i = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.failed.is_some()))?;
        Some(ConnId::new(i as u32))
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

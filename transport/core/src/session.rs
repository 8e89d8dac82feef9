//! A [`Connection`] bound to its [`Transport`]: the run-to-completion turn
//! a reactor performs for each connection it owns.

use std::time::Instant;

use crate::connection::{ConnConfig, ConnError, Connection, Event, Incoming};
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

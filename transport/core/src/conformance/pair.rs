//! [`Pair`]: the message layer of every connection of two drivers, turned
//! from one thread on a virtual clock.

use std::collections::HashMap;
use std::time::Instant;

use super::{DriverPair, IDLE_LIMIT, STEP};
use crate::connection::{ConnConfig, ConnError, Connection, Incoming, PeerInfo, TaskRole};
use crate::driver::{ConnId, Driver};
use crate::session::Sessions;

/// The worker at the client end of connection `i` (incarnation 11) or the
/// PS at its server end (incarnation 22): each end names its connection in
/// the handshake, so a peer seen on the wrong connection shows.
pub(crate) fn peer(role: TaskRole, index: usize, incarnation: u64) -> PeerInfo {
    PeerInfo {
        role,
        job: match role {
            TaskRole::Ps => "ps".into(),
            TaskRole::Worker => "worker".into(),
        },
        task_index: u32::try_from(index).expect("fewer than 2^32 connections"),
        incarnation,
        shards: 1,
    }
}

/// Which driver of a [`Pair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The client (worker) side.
    A,
    /// The server (PS) side.
    B,
}

/// A connection that failed while a [`Pair`] was driven; it has been
/// removed from its [`Sessions`] and detached from its driver.
#[derive(Debug)]
pub struct Failed {
    /// The side it failed on.
    pub side: Side,
    /// Its index in the pair.
    pub index: usize,
    /// Its message layer, whose events still hold the failed requests.
    pub conn: Connection,
    /// Why it failed.
    pub error: ConnError,
}

/// A handler of the messages of one side: the connection's index in the
/// pair, its message layer (to answer on), the message.
pub type OnMessage<'h> = dyn FnMut(usize, &mut Connection, Incoming<'_>) + 'h;

/// The message layer of the `n` connections of a [`DriverPair`], with a
/// virtual clock. Connection `i` is `a_ids[i]` on `a` and `b_ids[i]` on
/// `b`; handlers and accessors name connections by `i`.
#[derive(Debug)]
pub struct Pair<A, B> {
    /// The client side.
    pub a: Sessions<A>,
    /// The server side.
    pub b: Sessions<B>,
    /// The client side's handle of each connection.
    pub a_ids: Vec<ConnId>,
    /// The server side's handle of each connection.
    pub b_ids: Vec<ConnId>,
    /// The virtual clock.
    pub now: Instant,
    a_index: HashMap<ConnId, usize>,
    b_index: HashMap<ConnId, usize>,
}

impl<A: Driver, B: Driver> Pair<A, B> {
    /// Connections with default settings: the client end of connection
    /// `i` is worker `i` (incarnation 11), the server end PS `i`
    /// (incarnation 22).
    pub fn new(drivers: DriverPair<A, B>) -> Self {
        Self::with(
            drivers,
            |i| ConnConfig::new(peer(TaskRole::Worker, i, 11)),
            |i| ConnConfig::new(peer(TaskRole::Ps, i, 22)),
        )
    }

    /// Connections whose ends get the settings `ca(i)` and `cb(i)`.
    pub fn with(
        drivers: DriverPair<A, B>,
        mut ca: impl FnMut(usize) -> ConnConfig,
        mut cb: impl FnMut(usize) -> ConnConfig,
    ) -> Self {
        let DriverPair { a, a_ids, b, b_ids } = drivers;
        assert_eq!(a_ids.len(), b_ids.len(), "both sides name each connection");
        let mut a = Sessions::new(a);
        let mut b = Sessions::new(b);
        for (i, (&ia, &ib)) in a_ids.iter().zip(&b_ids).enumerate() {
            a.insert(ia, ca(i));
            b.insert(ib, cb(i));
        }
        let index = |ids: &[ConnId]| ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        Self {
            a_index: index(&a_ids),
            b_index: index(&b_ids),
            a,
            b,
            a_ids,
            b_ids,
            now: Instant::now(),
        }
    }

    /// How many connections the pair was made with.
    pub fn connections(&self) -> usize {
        self.a_ids.len()
    }

    /// The client end of connection `i`.
    ///
    /// # Panics
    /// When it failed or was removed.
    pub fn a(&mut self, i: usize) -> &mut Connection {
        self.a
            .conn(self.a_ids[i])
            .unwrap_or_else(|| panic!("connection {i} is gone at a"))
    }

    /// The server end of connection `i`.
    ///
    /// # Panics
    /// When it failed or was removed.
    pub fn b(&mut self, i: usize) -> &mut Connection {
        self.b
            .conn(self.b_ids[i])
            .unwrap_or_else(|| panic!("connection {i} is gone at b"))
    }

    /// Drive both sides until `done` holds, handing messages to the two
    /// handlers. Panics when a connection fails, or after too many rounds
    /// without progress.
    pub fn drive(
        &mut self,
        on_a: &mut OnMessage<'_>,
        on_b: &mut OnMessage<'_>,
        done: &mut dyn FnMut(&mut Self) -> bool,
    ) {
        self.drive_with(
            on_a,
            on_b,
            &mut |f| panic!("connection {} failed at {:?}: {}", f.index, f.side, f.error),
            done,
        );
    }

    /// Like [`drive`](Self::drive), but each connection that fails is
    /// handed to `on_failed`.
    pub fn drive_with(
        &mut self,
        on_a: &mut OnMessage<'_>,
        on_b: &mut OnMessage<'_>,
        on_failed: &mut dyn FnMut(Failed),
        done: &mut dyn FnMut(&mut Self) -> bool,
    ) {
        let mut idle = 0;
        while !done(self) {
            let now = self.now;
            let (a_index, b_index) = (&self.a_index, &self.b_index);
            let sa = self.a.turn(now, &mut |id, c, m| on_a(a_index[&id], c, m));
            let sb = self.b.turn(now, &mut |id, c, m| on_b(b_index[&id], c, m));
            let failed = self.take_failed(on_failed);
            if sa.busy() || sb.busy() || failed {
                idle = 0;
                self.now += STEP;
                continue;
            }
            idle += 1;
            assert!(
                idle < IDLE_LIMIT,
                "no progress after {IDLE_LIMIT} idle rounds"
            );
            // Nothing moved: let time pass to the next timer.
            let next = [self.a.poll_timeout(), self.b.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            self.now = match next {
                Some(t) if t > self.now => t,
                _ => self.now + STEP,
            };
        }
    }

    fn take_failed(&mut self, on_failed: &mut dyn FnMut(Failed)) -> bool {
        let mut any = false;
        while let Some((id, conn, error)) = self.a.poll_failed() {
            any = true;
            let index = self.a_index[&id];
            on_failed(Failed {
                side: Side::A,
                index,
                conn,
                error,
            });
        }
        while let Some((id, conn, error)) = self.b.poll_failed() {
            any = true;
            let index = self.b_index[&id];
            on_failed(Failed {
                side: Side::B,
                index,
                conn,
                error,
            });
        }
        any
    }

    /// Drive until every connection's handshake completed at both ends.
    pub fn establish(&mut self) {
        self.drive(&mut |_, _, _| {}, &mut |_, _, _| {}, &mut |p| {
            (0..p.connections()).all(|i| {
                let a = p.a.conn_ref(p.a_ids[i]);
                let b = p.b.conn_ref(p.b_ids[i]);
                a.is_some_and(Connection::is_established)
                    && b.is_some_and(Connection::is_established)
            })
        });
    }
}

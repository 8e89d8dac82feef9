//! The conformance suite every driver passes.
//!
//! A backend's tests call [`run_all_drivers`] with a function that makes two
//! drivers joined by `n` connections (a [`DriverPair`]); backends made of
//! point-to-point links may call [`run_all`] with a function that makes one
//! connected pair of links instead, and get [`LINKS`] of them in two
//! [`Links`] drivers.
//!
//! Every case runs on all `n` connections of one driver at once. The suite
//! checks the driver (frames in order, exactly once, at every size up to
//! the maximum, under back-pressure), the message layer over it
//! (handshake, request/response, one-way order, chunking, send-queue
//! back-pressure, credits, deadlines, cancellation, orderly close, restart
//! detection), and that connections are independent: what is sent on one
//! connection arrives on its peer and nowhere else (every frame and message
//! names its connection, and each receiver checks the name), and one
//! connection's failure or close leaves the others undisturbed.
//!
//! Both drivers are turned through [`Sessions`](crate::Sessions) (the
//! frame case drives them directly) from one thread on a virtual clock
//! that jumps to the next timer when nothing moves, so lossy backends
//! retransmit deterministically. The functions panic on a violation: they
//! are test assertions.

mod frames;
mod isolation;
mod messages;
mod pair;

use std::collections::HashSet;
use std::time::Duration;

use crate::driver::{ConnId, Driver, Link, Links};
use crate::transport::Transport;

pub use frames::frames_in_order;
pub use isolation::failure_and_close_are_isolated;
pub use messages::{
    chunked_messages, close_fails_pending, credit_window, deadline_and_cancel, handshake,
    oneway_order, restart_detection, rpc_echo, send_queue_backpressure,
};
pub use pair::{Failed, Pair, Side};

/// The fewest connections [`run_all_drivers`] runs its cases on: enough
/// that a driver's per-connection tables, its fairness and its batching
/// are exercised.
pub const MIN_CONNECTIONS: usize = 64;

/// How many link pairs [`run_all`] puts into its two drivers.
pub const LINKS: usize = MIN_CONNECTIONS;

/// Turns without progress before a case gives up (and fails).
const IDLE_LIMIT: usize = 200_000;
/// Virtual time that passes per round.
const STEP: Duration = Duration::from_micros(20);

/// Two drivers with `n` connections between them: `a_ids[i]` on `a` is
/// connected to `b_ids[i]` on `b`. `a` plays the client (worker) end of
/// every connection, `b` the server (PS) end.
#[derive(Debug)]
pub struct DriverPair<A, B> {
    /// The client-side driver.
    pub a: A,
    /// Its end of each connection.
    pub a_ids: Vec<ConnId>,
    /// The server-side driver.
    pub b: B,
    /// Its end of each connection, in the order of `a_ids`.
    pub b_ids: Vec<ConnId>,
}

impl<A, B> DriverPair<A, B> {
    /// How many connections join the two drivers.
    pub fn connections(&self) -> usize {
        self.a_ids.len()
    }

    /// Panics unless both sides name `n` distinct connections.
    fn check_shape(&self, n: usize) {
        assert_eq!(self.a_ids.len(), n, "a has other than {n} connections");
        assert_eq!(self.b_ids.len(), n, "b has other than {n} connections");
        let distinct = |ids: &[ConnId]| ids.iter().collect::<HashSet<_>>().len() == ids.len();
        assert!(distinct(&self.a_ids), "a names a connection twice");
        assert!(distinct(&self.b_ids), "b names a connection twice");
    }
}

/// One conformance case.
type Case<A, B> = fn(DriverPair<A, B>);

/// Run every case on `n` (at least [`MIN_CONNECTIONS`]) connections
/// between two fresh drivers made by `make(n)`; `name` labels the backend
/// in the logs.
pub fn run_all_drivers<A, B>(name: &str, n: usize, mut make: impl FnMut(usize) -> DriverPair<A, B>)
where
    A: Driver,
    B: Driver,
{
    assert!(
        n >= MIN_CONNECTIONS,
        "the suite runs on at least {MIN_CONNECTIONS} connections, not {n}"
    );
    let cases: [(&str, Case<A, B>); 11] = [
        ("frames_in_order", frames_in_order),
        ("handshake", handshake),
        ("rpc_echo", rpc_echo),
        ("oneway_order", oneway_order),
        ("chunked_messages", chunked_messages),
        ("send_queue_backpressure", send_queue_backpressure),
        ("credit_window", credit_window),
        ("deadline_and_cancel", deadline_and_cancel),
        ("close_fails_pending", close_fails_pending),
        ("restart_detection", restart_detection),
        (
            "failure_and_close_are_isolated",
            failure_and_close_are_isolated,
        ),
    ];
    for (case, f) in cases {
        tracing::info!(backend = name, case, connections = n, "conformance");
        let pair = make(n);
        pair.check_shape(n);
        f(pair);
    }
}

/// Run every case over [`LINKS`] pairs of links made by `make`, each side's
/// links in one [`Links`] driver.
pub fn run_all<A: Link, B: Link>(name: &str, mut make: impl FnMut() -> (A, B)) {
    run_all_drivers(name, LINKS, |n| link_pairs(n, &mut make));
}

/// Two [`Links`] drivers joined by `n` pairs of links made by `make`. Each
/// driver carries the largest frame all of its links carry.
pub fn link_pairs<A: Link, B: Link>(
    n: usize,
    mut make: impl FnMut() -> (A, B),
) -> DriverPair<Links<A>, Links<B>> {
    let pairs: Vec<(A, B)> = (0..n).map(|_| make()).collect();
    let max_a = pairs.iter().map(|(a, _)| Transport::max_frame_len(a)).min();
    let max_b = pairs.iter().map(|(_, b)| Transport::max_frame_len(b)).min();
    let mut a = Links::new(max_a.unwrap_or(0));
    let mut b = Links::new(max_b.unwrap_or(0));
    let mut a_ids = Vec::with_capacity(n);
    let mut b_ids = Vec::with_capacity(n);
    for (la, lb) in pairs {
        a_ids.push(a.attach(la));
        b_ids.push(b.attach(lb));
    }
    DriverPair { a, a_ids, b, b_ids }
}

//! One connection's failure or close leaves the others undisturbed.

use std::cell::Cell;
use std::collections::HashSet;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::SeedableRng;
use starwire_wire::{Header, Opcode};

use super::messages::{check_tag, echo, echo_round, tagged};
use super::pair::{Failed, Pair, Side};
use super::DriverPair;
use crate::connection::{Connection, Event, Incoming, Payload};
use crate::driver::Driver;

/// Requests each connection has in flight when the victims are hit.
const LOAD: usize = 16;
/// The victims' requests carry this deadline: a driver that cannot tell
/// its peer went away (a queue pair, a datagram link with nothing in
/// flight) leaves them pending until it passes.
const VICTIM_DEADLINE: Duration = Duration::from_millis(50);

/// What happens to connection `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Nothing: it must not notice the others.
    Survive,
    /// The client sends a frame no receiver accepts: the server end fails.
    Corrupt,
    /// The server drops its end without a word.
    Drop,
    /// The server closes its end in order.
    Close,
}

fn fate(i: usize) -> Fate {
    match i % 8 {
        1 => Fate::Corrupt,
        3 => Fate::Drop,
        5 => Fate::Close,
        _ => Fate::Survive,
    }
}

/// With requests in flight on every connection, one in eight connections
/// gets a frame its receiver rejects, one in eight is dropped by the
/// server and one in eight closed by it. Every survivor's requests come
/// back (and later ones too, once the victims are detached at both ends);
/// every victim's requests fail; only victims fail, each once.
pub fn failure_and_close_are_isolated<A: Driver, B: Driver>(drivers: DriverPair<A, B>) {
    let mut p = Pair::new(drivers);
    let n = p.connections();
    let all: Vec<usize> = (0..n).collect();
    let survivors: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| fate(i) == Fate::Survive)
        .collect();
    echo_round(&mut p, &all, 4, 256, 7);

    let deadline = p.now + VICTIM_DEADLINE;
    let mut rng = SmallRng::seed_from_u64(8);
    let mut ids: Vec<HashSet<u64>> = vec![HashSet::new(); n];
    for (i, ids) in ids.iter_mut().enumerate() {
        let d = (fate(i) != Fate::Survive).then_some(deadline);
        for _ in 0..LOAD {
            let body = Payload::from(tagged(i, true, 64, &mut rng));
            ids.insert(p.a(i).request(Opcode::Rpc, 0, body, d).expect("queue"));
        }
    }
    for i in 0..n {
        match fate(i) {
            Fate::Survive => {}
            Fate::Corrupt => {
                // Ahead of the requests, which go out at the next turn.
                let mut f = Header::new(Opcode::Rpc, 1, 4).to_bytes().to_vec();
                f[4] = 42; // the header's version
                f.extend_from_slice(&[0; 4]);
                let conn = p.a_ids[i];
                let buf = p.a.driver_mut().tx_reserve(conn, f.len());
                let buf = buf
                    .expect("tx_reserve")
                    .expect("room on an idle connection");
                buf[..f.len()].copy_from_slice(&f);
                p.a.driver_mut().tx_commit(conn, f.len());
            }
            Fate::Drop => {
                p.b.remove(p.b_ids[i]).expect("the server holds it");
            }
            Fate::Close => p.b(i).close(),
        }
    }
    // The goodbyes leave before the requests they refuse arrive.
    p.b.flush(p.now);

    let answered: Vec<Cell<usize>> = (0..n).map(|_| Cell::new(0)).collect();
    let mut failed_at_b = vec![0usize; n];
    let mut events: Vec<Vec<Event>> = vec![Vec::new(); n];
    let mut on_a = |i: usize, _: &mut Connection, m: Incoming<'_>| match m {
        Incoming::Response { id, body, .. } => {
            check_tag(body, i, "response");
            assert_eq!(
                fate(i),
                Fate::Survive,
                "connection {i}: a response from a victim"
            );
            assert!(
                ids[i].contains(&id),
                "connection {i}: response {id} to no request"
            );
            answered[i].set(answered[i].get() + 1);
        }
        Incoming::Request { .. } => panic!("connection {i}: the client got a request"),
    };
    let mut on_failed = |mut f: Failed| {
        let i = f.index;
        assert_ne!(
            fate(i),
            Fate::Survive,
            "connection {i} failed at {:?} though nothing happened to it: {}",
            f.side,
            f.error
        );
        match f.side {
            Side::A => events[i].extend(std::iter::from_fn(|| f.conn.poll_event())),
            Side::B => failed_at_b[i] += 1,
        }
    };
    p.drive_with(&mut on_a, &mut echo, &mut on_failed, &mut |p| {
        (0..n).all(|i| match fate(i) {
            Fate::Survive => answered[i].get() == LOAD,
            _ => {
                p.a.conn(p.a_ids[i])
                    .map_or(true, |c| c.pending_requests() == 0)
            }
        })
    });

    for i in 0..n {
        if let Some(c) = p.a.conn(p.a_ids[i]) {
            events[i].extend(std::iter::from_fn(|| c.poll_event()));
        }
        let mut ended = HashSet::new();
        for e in &events[i] {
            // Lost with the connection, or past its deadline where the
            // driver cannot tell.
            if let Event::RequestFailed { id, .. } = e {
                assert!(
                    ended.insert(*id),
                    "connection {i}: request {id} failed twice"
                );
            }
        }
        match fate(i) {
            Fate::Survive => assert!(ended.is_empty(), "connection {i}: requests failed"),
            _ => assert_eq!(ended, ids[i], "connection {i}: requests left hanging"),
        }
        if fate(i) == Fate::Corrupt {
            assert_eq!(
                failed_at_b[i], 1,
                "connection {i}: the bad frame was not reported once"
            );
        } else {
            assert!(failed_at_b[i] <= 1, "connection {i}: reported twice");
        }
    }

    // Detach what is left of the victims at both ends; the survivors go on.
    for i in 0..n {
        if fate(i) != Fate::Survive {
            p.a.remove(p.a_ids[i]);
            p.b.remove(p.b_ids[i]);
        }
    }
    assert_eq!(p.a.len(), survivors.len());
    assert_eq!(p.b.len(), survivors.len());
    echo_round(&mut p, &survivors, LOAD, 1024, 9);
}

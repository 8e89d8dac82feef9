//! The hand-off under load: compute threads hand exchanges to a worker's
//! network reactors through the M:N queue, over real TCP connections to an
//! echo server, and every reply must come back to the thread that asked,
//! in the place of its request, answered on its shard's connection.

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use starwire_train::backend::{Backend, Tcp};
use starwire_train::handoff::{self, ComputeEnd, HandoffConfig};
use starwire_train::net::{Exchange, Reply, Request};
use starwire_transport::accept::{dial, inboxes, AcceptConfig, Acceptor};
use starwire_transport::reactor::{IdlePolicy, Reactor, ReactorSpec};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{
    ConnConfig, ConnError, ConnId, Connection, Driver, Endpoint, Incoming, Payload, PeerInfo,
    Service, TaskRole,
};

fn peer(role: TaskRole) -> ConnConfig {
    ConnConfig::new(PeerInfo {
        role,
        job: "t".into(),
        task_index: 0,
        incarnation: 1,
        shards: 1,
    })
}

/// Answers each request with the shard its connection was routed to
/// (4 bytes, little-endian) followed by the request's body; answers
/// nothing when `silent`.
#[derive(Debug, Default)]
struct Echo {
    shard_of: Vec<u32>,
    silent: bool,
}

impl<D: Driver> Service<D> for Echo {
    fn on_attach(&mut self, id: ConnId, shard: u32, _now: Instant) {
        if self.shard_of.len() <= id.index() {
            self.shard_of.resize(id.index() + 1, u32::MAX);
        }
        self.shard_of[id.index()] = shard;
    }

    fn on_message(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        let Incoming::Request {
            id: rid,
            opcode,
            body,
            ..
        } = msg
        else {
            return Ok(());
        };
        if self.silent {
            return Ok(());
        }
        let mut out = self.shard_of[id.index()].to_le_bytes().to_vec();
        out.extend_from_slice(body);
        conn.respond(rid, opcode, Status::Ok, Payload::from(out))
            .map_err(|_| ConnError::Protocol("reply not queued"))
    }
}

type EchoReactor = Reactor<Endpoint<<Tcp as Backend>::Driver, Echo>>;

/// An echo server of `shards` shards, one reactor each.
struct Server {
    addr: String,
    _acceptor: Acceptor,
    reactors: Vec<EchoReactor>,
}

impl Server {
    fn start(shards: usize, silent: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rxs) = inboxes(shards).unwrap();
        let reactors: Vec<EchoReactor> = rxs
            .into_iter()
            .enumerate()
            .map(|(s, rx)| {
                Reactor::spawn(ReactorSpec::new(s), move |_| {
                    let echo = Echo {
                        silent,
                        ..Echo::default()
                    };
                    Endpoint::new(Tcp::driver(false).unwrap(), echo, peer(TaskRole::Ps))
                        .with_inbox(rx)
                })
                .unwrap()
            })
            .collect();
        let wakers = reactors.iter().map(Reactor::waker).collect();
        let acceptor = Acceptor::spawn(listener, tx, wakers, AcceptConfig::default()).unwrap();
        Self {
            addr,
            _acceptor: acceptor,
            reactors,
        }
    }

    fn dial(&self, shards: usize) -> Vec<std::net::TcpStream> {
        let deadline = Instant::now() + Duration::from_secs(10);
        (0..shards)
            .map(|s| dial(&self.addr, s as u32, deadline).unwrap())
            .collect()
    }

    fn stop(self) {
        for r in self.reactors {
            r.stop().unwrap();
        }
    }
}

fn config(reactors: usize, producers: usize, idle: IdlePolicy) -> HandoffConfig {
    HandoffConfig {
        reactors: (0..reactors)
            .map(|r| ReactorSpec {
                idle,
                // A lost wake-up shows as a park this long.
                max_park: Duration::from_secs(600),
                ..ReactorSpec::new(r)
            })
            .collect(),
        producers,
        wait: idle,
        polling: idle != IdlePolicy::Park,
        conn: peer(TaskRole::Worker),
        timeout: Duration::from_secs(30),
        telemetry: starwire_telemetry::Telemetry::new(),
    }
}

/// A small deterministic generator.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// `exchanges` exchanges of 0 to 8 requests to random shards, every
/// reply checked; the requests sent.
fn hammer(end: &mut ComputeEnd, lane: u64, shards: usize, exchanges: u64) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15 ^ (lane + 1);
    let mut replies: Vec<Reply> = Vec::new();
    let mut sent = 0;
    for e in 0..exchanges {
        let k = next(&mut x) % 9;
        let reqs: Vec<(usize, Vec<u8>)> = (0..k)
            .map(|i| {
                let shard = (next(&mut x) % shards as u64) as usize;
                // Bodies of different lengths, naming who asked for what.
                let len = (next(&mut x) % 64) as usize;
                let mut body = [lane, e, i].map(u64::to_le_bytes).concat();
                body.resize(body.len() + len, i as u8);
                (shard, body)
            })
            .collect();
        let batch = reqs
            .iter()
            .map(|(shard, body)| Request {
                shard: *shard,
                opcode: Opcode::Rpc,
                body: Payload::from(body.clone()),
            })
            .collect();
        end.exchange(batch, &mut replies)
            .unwrap_or_else(|e| panic!("lane {lane} exchange {e}"));
        assert_eq!(replies.len(), reqs.len(), "lane {lane} exchange {e}");
        for (r, (shard, body)) in replies.iter().zip(&reqs) {
            assert_eq!(r.status, Some(Status::Ok));
            let (on, echoed) = r.body.split_at(4);
            assert_eq!(u32::from_le_bytes(on.try_into().unwrap()) as usize, *shard);
            assert_eq!(echoed, &body[..], "lane {lane} exchange {e}");
        }
        sent += k;
    }
    sent
}

/// Several compute threads over two reactors and three shards (reactor 0
/// holds shards 0 and 2): every reply reaches its thread in its place.
fn run(producers: usize, idle: IdlePolicy, exchanges: u64) {
    const SHARDS: usize = 3;
    let t0 = Instant::now();
    let server = Server::start(SHARDS, false);
    let (ends, reactors) =
        handoff::spawn::<Tcp>(server.dial(SHARDS), &config(2, producers, idle)).unwrap();
    assert_eq!(reactors.len(), 2);
    let handles: Vec<_> = ends
        .into_iter()
        .enumerate()
        .map(|(lane, mut end)| {
            thread::spawn(move || {
                end.connect().unwrap();
                let sent = hammer(&mut end, lane as u64, SHARDS, exchanges);
                let t = end.traffic();
                assert_eq!(t.requests, sent, "lane {lane}");
                assert!(t.received > t.sent, "every reply carries 4 more bytes");
                end.close();
                sent
            })
        })
        .collect();
    let sent: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(sent > exchanges * producers as u64, "{sent}");
    // Every compute end closed: the reactors close their connections and
    // end.
    reactors.join().unwrap();
    server.stop();
    // No part waited for a park to time out (a run on a loaded machine
    // takes seconds; a lost wake-up costs ten minutes).
    assert!(
        t0.elapsed() < Duration::from_secs(180),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn many_exchanges_of_several_compute_threads_parking() {
    run(3, IdlePolicy::Park, 2000);
}

#[test]
fn many_exchanges_of_several_compute_threads_polling_then_parking() {
    run(2, IdlePolicy::PollThenPark(Duration::from_micros(20)), 1000);
}

#[test]
fn many_exchanges_of_one_busy_polling_compute_thread() {
    run(1, IdlePolicy::BusyPoll, 500);
}

/// A compute thread waiting on a reactor that is stopped hears that it
/// ended instead of waiting forever; the reactors' own failures (a server
/// that goes) fail the exchange too.
#[test]
fn a_reactor_that_ends_fails_the_exchange_waiting_on_it() {
    let server = Server::start(1, true);
    let (mut ends, reactors) =
        handoff::spawn::<Tcp>(server.dial(1), &config(1, 1, IdlePolicy::Park)).unwrap();
    let mut end = ends.pop().unwrap();
    end.connect().unwrap();
    let waiter = thread::spawn(move || {
        let req = Request {
            shard: 0,
            opcode: Opcode::Rpc,
            body: Payload::from(vec![1, 2, 3]),
        };
        let r = end.exchange(vec![req], &mut Vec::new());
        (r, end)
    });
    thread::sleep(Duration::from_millis(100));
    assert!(!waiter.is_finished(), "the server answers nothing");
    drop(reactors);
    let (r, mut end) = waiter.join().unwrap();
    let e = r.unwrap_err();
    assert!(e.to_string().contains("ended"), "{e}");
    // Nothing is sent to a reactor that ended.
    let e = end.exchange(
        vec![Request {
            shard: 0,
            opcode: Opcode::Rpc,
            body: Payload::empty(),
        }],
        &mut Vec::new(),
    );
    assert!(e.is_err());
    server.stop();

    // A server that goes fails the exchange with its link.
    let server = Server::start(2, false);
    let (mut ends, reactors) =
        handoff::spawn::<Tcp>(server.dial(2), &config(2, 1, IdlePolicy::Park)).unwrap();
    let mut end = ends.pop().unwrap();
    end.connect().unwrap();
    assert!(hammer(&mut end, 0, 2, 20) > 0);
    server.stop();
    let reqs = (0..2)
        .map(|shard| Request {
            shard,
            opcode: Opcode::Rpc,
            body: Payload::empty(),
        })
        .collect();
    let e = end.exchange(reqs, &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("link to shard"), "{e}");
    end.close();
    reactors.join().unwrap();
}

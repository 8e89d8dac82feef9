//! The session layer over the tcp driver: an acceptor routes dialed
//! connections by shard to two echo reactors, each an `Endpoint` with its
//! inbox; the client is an `Endpoint` turned by the test's own thread.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use starwire_tcp::{TcpConfig, TcpDriver};
use starwire_transport::accept::{dial, inboxes, AcceptConfig, Acceptor};
use starwire_transport::reactor::{local_waker, IdlePolicy, Reactor, ReactorSpec};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{
    ConnConfig, ConnError, ConnId, Connection, Endpoint, Event, Incoming, Payload, PeerInfo,
    Service, Sessions, TaskRole,
};

const CONNECTIONS: usize = 16;
const REQUESTS: usize = 20;

fn config(role: TaskRole) -> ConnConfig {
    ConnConfig::new(PeerInfo {
        role,
        job: "t".into(),
        task_index: 0,
        incarnation: 1,
        shards: 2,
    })
}

/// Echoes every request; finished once `want` connections have come and
/// gone.
#[derive(Debug, Default)]
struct Echo {
    shards: Vec<u32>,
    served: usize,
    closed: usize,
    want: usize,
}

impl Service<TcpDriver> for Echo {
    fn on_attach(&mut self, _id: ConnId, shard: u32, _now: Instant) {
        self.shards.push(shard);
    }
    fn on_message(
        &mut self,
        _id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        let Incoming::Request {
            id, opcode, body, ..
        } = msg
        else {
            return Ok(());
        };
        self.served += 1;
        conn.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()))
            .map_err(|_| ConnError::Protocol("reply not queued"))
    }
    fn on_closed(
        &mut self,
        id: ConnId,
        _conn: &mut Connection,
        error: &ConnError,
        driver: &TcpDriver,
        _now: Instant,
    ) {
        assert!(matches!(error, ConnError::Closed), "{error}");
        // Still attached: its counters can be read.
        assert!(driver
            .transport(id)
            .is_some_and(|t| t.stats().read_calls > 0));
        self.closed += 1;
    }
    fn finished(&self) -> bool {
        self.closed >= self.want
    }
}

/// Once every connection is up, sends `REQUESTS` requests on each, whose
/// bodies name the connection and the request.
#[derive(Debug, Default)]
struct Client {
    connected: usize,
    sent: bool,
    answered: usize,
    /// By [`ConnId::index`]: replies so far.
    answered_on: Vec<usize>,
}

fn body(id: ConnId, k: usize) -> Vec<u8> {
    format!("{}:{k}", id.index()).into_bytes()
}

impl Service<TcpDriver> for Client {
    fn on_message(
        &mut self,
        id: ConnId,
        _conn: &mut Connection,
        msg: Incoming<'_>,
        _now: Instant,
    ) -> Result<(), ConnError> {
        if let Incoming::Response {
            status, body: b, ..
        } = msg
        {
            assert_eq!(status, Status::Ok);
            if self.answered_on.len() <= id.index() {
                self.answered_on.resize(id.index() + 1, 0);
            }
            let k = &mut self.answered_on[id.index()];
            assert_eq!(b, body(id, *k), "replies in order, each its own");
            *k += 1;
            self.answered += 1;
        }
        Ok(())
    }
    fn on_event(&mut self, _id: ConnId, _conn: &mut Connection, ev: Event, _now: Instant) {
        if matches!(ev, Event::Connected(_)) {
            self.connected += 1;
        }
    }
    fn poll(&mut self, sessions: &mut Sessions<TcpDriver>, _now: Instant) -> bool {
        if self.sent || self.connected < CONNECTIONS {
            return false;
        }
        self.sent = true;
        let ids: Vec<ConnId> = sessions.ids().collect();
        for id in ids {
            let c = sessions.conn(id).expect("held");
            for k in 0..REQUESTS {
                c.request(Opcode::Rpc, 0, Payload::from(body(id, k)), None)
                    .expect("queued");
            }
        }
        true
    }
}

#[test]
fn an_acceptor_and_endpoints_echo_over_tcp() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let (tx, rxs) = inboxes(2).expect("queue");
    let mut servers = Vec::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        let mut spec = ReactorSpec::new(i);
        spec.idle = IdlePolicy::Park;
        let r = Reactor::spawn(spec, move |_| {
            let driver = TcpDriver::new(TcpConfig::default()).expect("driver");
            let echo = Echo {
                want: CONNECTIONS / 2,
                ..Echo::default()
            };
            Endpoint::new(driver, echo, config(TaskRole::Ps)).with_inbox(rx)
        })
        .expect("server reactor");
        servers.push(r);
    }
    let wakers = servers.iter().map(Reactor::waker).collect();
    let acceptor =
        Acceptor::spawn(listener, tx, wakers, AcceptConfig::default()).expect("acceptor");
    let addr = acceptor.local_addr().to_string();

    let driver = TcpDriver::new(TcpConfig::default()).expect("driver");
    let mut client = Endpoint::new(driver, Client::default(), config(TaskRole::Worker));
    let deadline = Instant::now() + Duration::from_secs(5);
    for i in 0..CONNECTIONS {
        let shard = (i % 2) as u32;
        let s = dial(&addr, shard, deadline).expect("dial");
        client
            .attach_stream(s, shard, Instant::now())
            .expect("attach");
    }
    let waker = local_waker().expect("waker");
    let want = CONNECTIONS * REQUESTS;
    client.run_until(&waker, IdlePolicy::Park, Duration::from_millis(50), |c| {
        c.answered == want
    });
    assert_eq!(client.service().connected, CONNECTIONS);
    client.close_all(Instant::now());

    for (i, r) in servers.into_iter().enumerate() {
        let (ep, _) = r.join().expect("server");
        let echo = ep.service();
        assert_eq!(echo.shards, vec![i as u32; CONNECTIONS / 2]);
        assert_eq!(echo.served, CONNECTIONS / 2 * REQUESTS);
        assert!(ep.sessions().is_empty());
    }
    assert_eq!(acceptor.stats().routed, CONNECTIONS as u64);
}

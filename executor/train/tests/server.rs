//! A PS shard reactor under bad input: errors go back as statuses or end
//! only the offending connection; the shard keeps serving everyone else.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytes::Bytes;
use starwire_ps::{PsShard, ShardConfig, VarDef};
use starwire_tcp::TcpDriver;
use starwire_train::backend::tcp_config;
use starwire_train::handler::ShardHandler;
use starwire_train::net::{Exchange, Reply, Request, SessionNet, WorkerService};
use starwire_train::server::ShardService;
use starwire_transport::accept::{dial, inboxes, AcceptConfig, Acceptor};
use starwire_transport::reactor::{IdlePolicy, Reactor, ReactorSpec};
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{ConnConfig, Endpoint, Payload, PeerInfo, TaskRole};
use starwire_wire::ps::{Control, PullRequestWriter, PullResponse};

fn peer(role: TaskRole, task_index: u32) -> ConnConfig {
    ConnConfig::new(PeerInfo {
        role,
        job: "t".into(),
        task_index,
        incarnation: 7,
        shards: 1,
    })
}

struct Ps {
    reactor: Reactor<Endpoint<TcpDriver, ShardService<ShardHandler>>>,
    acceptor: Acceptor,
    addr: String,
}

impl Ps {
    /// Whether the reactor thread has exited (its shard finished).
    fn reactor_finished(&self) -> bool {
        self.reactor.is_finished()
    }
}

fn start(expected: usize) -> Ps {
    let vars = [
        VarDef {
            id: 0,
            name: "w".into(),
            kind: starwire_ps::VarKind::Dense { shape: vec![4] },
            init: starwire_ps::Init::Zeros,
        },
        VarDef {
            id: 1,
            name: "emb".into(),
            kind: starwire_ps::VarKind::Embedding { dim: 2 },
            init: starwire_ps::Init::Uniform { scale: 0.1 },
        },
    ];
    let shard = PsShard::new(0, &vars, ShardConfig::default());
    let (tx, mut rxs) = inboxes(1).unwrap();
    let rx = rxs.pop().unwrap();
    let spec = ReactorSpec {
        index: 0,
        cpu: None,
        idle: IdlePolicy::Park,
        max_park: Duration::from_millis(20),
    };
    let reactor = Reactor::spawn(spec, move |_| {
        let handler = ShardHandler::new(shard, 0);
        Endpoint::new(
            TcpDriver::new(tcp_config()).unwrap(),
            ShardService::new(0, handler, expected),
            peer(TaskRole::Ps, 0),
        )
        .with_inbox(rx)
    })
    .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let acceptor = Acceptor::spawn(l, tx, vec![reactor.waker()], AcceptConfig::default()).unwrap();
    Ps {
        reactor,
        acceptor,
        addr,
    }
}

/// Worker `index`'s connection to the shard.
fn client(addr: &str, index: u32) -> SessionNet<TcpDriver> {
    let s = dial(addr, 0, Instant::now() + Duration::from_secs(5)).unwrap();
    let now = Instant::now();
    // Well under the acceptor's 10 s preamble timeout: a silent peer must
    // not hold up this handshake.
    let service = WorkerService::new(1, Duration::from_secs(3), now);
    let mut ep = Endpoint::new(
        TcpDriver::new(tcp_config()).unwrap(),
        service,
        peer(TaskRole::Worker, index),
    );
    ep.attach_stream(s, 0, now).unwrap();
    SessionNet::new(ep, false).unwrap()
}

fn one(net: &mut SessionNet<TcpDriver>, opcode: Opcode, body: Vec<u8>) -> Reply {
    let mut replies = Vec::new();
    net.exchange(
        vec![Request {
            shard: 0,
            opcode,
            body: Payload::from_bytes(Bytes::from(body)),
        }],
        &mut replies,
    )
    .unwrap();
    replies.pop().unwrap()
}

fn pull(vars: &[(u32, Option<&[u64]>)]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = PullRequestWriter::new(&mut buf);
    for (v, keys) in vars {
        match keys {
            None => {
                w.dense(*v);
            }
            Some(k) => {
                w.rows(*v, k);
            }
        }
    }
    buf
}

#[test]
fn errors_are_statuses_and_end_only_the_bad_connection() {
    let ps = start(2);
    // A peer that connects and says nothing.
    let _silent = TcpStream::connect(&ps.addr).unwrap();
    let mut good = client(&ps.addr, 0);

    // An unknown variable: a status for this request, connection lives.
    let r = one(&mut good, Opcode::SparsePull, pull(&[(99, None)]));
    assert_eq!(r.status, Some(Status::UnknownVariable));
    assert!(String::from_utf8_lossy(&r.body).contains("99"));
    // A truncated body: BadRequest.
    let mut b = pull(&[(1, Some(&[5, 6, 7]))]);
    b.truncate(b.len() - 3);
    assert_eq!(
        one(&mut good, Opcode::SparsePull, b).status,
        Some(Status::BadRequest)
    );
    // Rows asked of a dense variable: WrongShape.
    assert_eq!(
        one(&mut good, Opcode::SparsePull, pull(&[(0, Some(&[1]))])).status,
        Some(Status::WrongShape)
    );
    // An unknown control method and an opcode a shard does not serve.
    assert_eq!(
        one(&mut good, Opcode::Rpc, vec![77]).status,
        Some(Status::UnknownMethod)
    );
    assert_eq!(
        one(&mut good, Opcode::Tensors, vec![]).status,
        Some(Status::UnknownMethod)
    );

    // A connection with a bad preamble is dropped by the acceptor...
    let mut bad = TcpStream::connect(&ps.addr).unwrap();
    bad.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    // ...and one that sends garbage after a valid preamble is closed by
    // the reactor with a framing error.
    let mut garbage = TcpStream::connect(&ps.addr).unwrap();
    garbage.write_all(b"SWSH\0\0\0\0").unwrap();
    garbage.write_all(&[0xAB; 64]).unwrap();
    std::thread::sleep(Duration::from_millis(100));

    // The good connection is still served, with correct data.
    let r = one(
        &mut good,
        Opcode::SparsePull,
        pull(&[(0, None), (1, Some(&[5, 6]))]),
    );
    assert_eq!(r.status, Some(Status::Ok));
    let resp = PullResponse::parse(&r.body, &Default::default()).unwrap();
    assert_eq!(resp.len(), 2);

    // Stats.
    let stats = one(&mut good, Opcode::Rpc, Control::Stats.encode());
    let v: serde_json::Value = serde_json::from_slice(&stats.body).unwrap();
    assert_eq!(v["errors"].as_u64().unwrap(), 3, "{v}");
    // A peer does not choose where the PS writes: without its own
    // --checkpoint-dir the shard refuses.
    let r = one(
        &mut good,
        Opcode::Rpc,
        Control::Checkpoint("/tmp/x").encode(),
    );
    assert_eq!(r.status, Some(Status::Internal));
    assert!(String::from_utf8_lossy(&r.body).contains("--checkpoint-dir"));
    // A second worker that goes away without DONE is lost: it counts
    // toward finishing (a dead worker must not keep the PS up for ever)
    // and is named at the end; the garbage connection, which never
    // completed a handshake, does not count.
    let other = client(&ps.addr, 1);
    drop(other);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!ps.reactor_finished(), "one worker is still connected");
    assert_eq!(
        one(&mut good, Opcode::Rpc, Control::Done.encode()).status,
        Some(Status::Ok)
    );
    let (ep, _) = ps.reactor.join().unwrap();
    let shard = ep.service();
    assert_eq!(shard.server().lost(), vec![1], "worker 1 died unfinished");
    assert!(shard.server().service().failed() >= 5);
    assert!(
        shard.closed_connections() >= 1,
        "the garbage connection was closed"
    );
    let st = ps.acceptor.stats();
    assert_eq!(st.bad_preamble, 1, "{st:?}");
    assert_eq!(st.routed, 3, "{st:?}");
}

#[test]
fn a_lost_worker_that_rejoins_and_finishes_is_done() {
    let ps = start(2);
    // Worker 1 dies without DONE, then rejoins and finishes; worker 0
    // finishes. Counted by task, worker 1's two connections are one worker.
    drop(client(&ps.addr, 1));
    std::thread::sleep(Duration::from_millis(100));
    let mut again = client(&ps.addr, 1);
    assert_eq!(
        one(&mut again, Opcode::Rpc, Control::Done.encode()).status,
        Some(Status::Ok)
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(!ps.reactor_finished(), "worker 0 has not finished");
    let mut w0 = client(&ps.addr, 0);
    assert_eq!(
        one(&mut w0, Opcode::Rpc, Control::Done.encode()).status,
        Some(Status::Ok)
    );
    drop((again, w0));
    let (ep, _) = ps.reactor.join().unwrap();
    assert!(ep.service().server().lost().is_empty());
}

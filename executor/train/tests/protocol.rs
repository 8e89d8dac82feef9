//! The PS protocol end to end between client cores ([`PsClient`], one per
//! worker, in a [`WorkerService`]) and two server cores ([`PsServer`], in
//! a [`ShardService`]), each on the endpoint the trainer runs them on, over
//! in-memory connections on a virtual clock: pull, push, the `WAIT_STEP`
//! barrier, checkpoint and `DONE`; and timeouts that fire only because
//! virtual time passes. Nothing here sleeps or reads the clock after the
//! start: a round that moves nothing jumps the clock to the next deadline.
//!
//! [`PsClient`]: starwire_train::psclient::PsClient
//! [`PsServer`]: starwire_train::psserver::PsServer

use std::path::Path;
use std::time::{Duration, Instant};

use starwire_ps::{Init, OptimizerConfig, PsShard, ShardConfig, VarDef, VarKind};
use starwire_train::handler::{shard_file, ShardHandler};
use starwire_train::net::{Reply, Request, WorkerService};
use starwire_train::psserver::MAX_HELD_REQUESTS;
use starwire_train::server::ShardService;
use starwire_train::TrainError;
use starwire_transport::testing::MemTransport;
use starwire_transport::wire::{Opcode, Status};
use starwire_transport::{ConnConfig, Endpoint, Links, Payload, PeerInfo, TaskRole};
use starwire_wire::ps::{
    parse_push_response, Control, Limits, PullReply, PullRequestWriter, PullResponse,
    PushRequestWriter,
};

const SHARDS: usize = 2;
/// The dense variable, held by shard 0.
const W: u32 = 0;
/// The embedding table, sharded by key over both shards.
const EMB: u32 = 1;
const DIM: usize = 4;
const LR: f32 = 0.5;
const TIMEOUT: Duration = Duration::from_secs(5);
/// Virtual time per round that moved something.
const STEP: Duration = Duration::from_micros(20);
/// Rounds that move nothing, with no deadline ahead, before a test fails.
const STUCK: usize = 1000;

fn vars(shard: usize) -> Vec<VarDef> {
    let mut v = vec![VarDef {
        id: EMB,
        name: "emb".into(),
        kind: VarKind::Embedding { dim: DIM },
        init: Init::Uniform { scale: 0.1 },
    }];
    if shard == 0 {
        v.push(VarDef {
            id: W,
            name: "w".into(),
            kind: VarKind::Dense { shape: vec![3] },
            init: Init::GlorotUniform,
        });
    }
    v
}

fn shard_config() -> ShardConfig {
    ShardConfig {
        seed: 7,
        optimizer: OptimizerConfig::sgd(LR),
        ..ShardConfig::default()
    }
}

fn peer(role: TaskRole, index: u32) -> ConnConfig {
    ConnConfig::new(PeerInfo {
        role,
        job: "t".into(),
        task_index: index,
        incarnation: 1,
        shards: 1,
    })
}

/// Frames of in-memory connections.
const MAX_FRAME: usize = 1 << 16;

type Mem = Links<MemTransport>;

/// One server core and the connections of every worker, on one endpoint.
struct Server {
    ep: Endpoint<Mem, ShardService<ShardHandler>>,
    /// Never turned: a shard that does not answer.
    silent: bool,
}

/// A worker's client core and its connections, one per shard.
struct Client {
    ep: Endpoint<Mem, WorkerService>,
}

/// Workers connected to two server cores, and the virtual clock.
struct Cluster {
    clients: Vec<Client>,
    servers: Vec<Server>,
    now: Instant,
}

impl Cluster {
    /// Two fresh shards checkpointing into `dir`, and `workers` clients
    /// connected to both (the handshakes run on the virtual clock).
    fn connected(dir: &Path, workers: usize) -> Self {
        let mut c = Self::unconnected(dir, workers);
        c.drive(|c| {
            c.clients
                .iter()
                .all(|w| w.ep.service().client().is_connected())
        })
        .expect("handshakes");
        c
    }

    fn unconnected(dir: &Path, workers: usize) -> Self {
        let now = Instant::now();
        let mut servers: Vec<Server> = (0..SHARDS)
            .map(|i| {
                let handler = ShardHandler {
                    checkpoint_dir: Some(dir.to_owned()),
                    ..ShardHandler::new(PsShard::new(i, &vars(i), shard_config()), i)
                };
                Server {
                    ep: Endpoint::new(
                        Links::new(MAX_FRAME),
                        ShardService::new(i, handler, workers),
                        peer(TaskRole::Ps, 0),
                    ),
                    silent: false,
                }
            })
            .collect();
        let mut clients = Vec::new();
        for w in 0..workers {
            let mut ep = Endpoint::new(
                Links::new(MAX_FRAME),
                WorkerService::new(SHARDS, TIMEOUT, now),
                peer(TaskRole::Worker, w as u32),
            );
            for (s, srv) in servers.iter_mut().enumerate() {
                let (a, b) = MemTransport::pair(MAX_FRAME, 64);
                let id = ep.sessions_mut().driver_mut().attach(a);
                ep.open(id, s as u32, now);
                let id = srv.ep.sessions_mut().driver_mut().attach(b);
                srv.ep.open(id, 0, now);
            }
            clients.push(Client { ep });
        }
        Self {
            clients,
            servers,
            now,
        }
    }

    /// One round at the virtual `now`: every client's endpoint, then every
    /// server's. Returns whether anything moved.
    fn round(&mut self) -> Result<bool, TrainError> {
        let mut busy = false;
        for c in &mut self.clients {
            busy |= c.ep.turn(self.now);
            if let Some(e) = c.ep.service_mut().take_error() {
                return Err(e);
            }
        }
        for srv in self.servers.iter_mut().filter(|s| !s.silent) {
            busy |= srv.ep.turn(self.now);
            assert_eq!(
                srv.ep.service().closed_connections(),
                0,
                "a server connection ended"
            );
        }
        Ok(busy)
    }

    /// The earliest timer of any endpoint (its sessions' or its client's).
    fn next_deadline(&self) -> Option<Instant> {
        let servers = self.servers.iter().map(|s| s.ep.next_deadline());
        let clients = self.clients.iter().map(|c| c.ep.next_deadline());
        clients.chain(servers).flatten().min()
    }

    /// Run rounds until one moves nothing, without letting time jump.
    fn settle(&mut self) -> Result<(), TrainError> {
        while self.round()? {
            self.now += STEP;
        }
        Ok(())
    }

    /// Run rounds until `done` or an error; time moves by [`STEP`] per
    /// busy round and jumps to the next deadline when nothing moves.
    fn drive(&mut self, mut done: impl FnMut(&Self) -> bool) -> Result<(), TrainError> {
        let mut idle = 0;
        while !done(self) {
            if self.round()? {
                idle = 0;
                self.now += STEP;
                continue;
            }
            idle += 1;
            assert!(idle < STUCK, "nothing moves and nothing is due");
            self.now = match self.next_deadline() {
                Some(t) if t > self.now => t,
                _ => self.now + STEP,
            };
        }
        Ok(())
    }

    /// Start worker `w`'s exchange, as its `Exchange::exchange` does.
    fn start(&mut self, w: usize, reqs: Vec<Request>) -> Result<(), TrainError> {
        let (service, sessions) = self.clients[w].ep.parts_mut();
        service.start(sessions, reqs, Vec::new(), self.now)
    }

    /// Drive worker `w`'s exchange to its end; its replies.
    fn finish(&mut self, w: usize) -> Result<Vec<Reply>, TrainError> {
        let r = self.drive(|c| c.clients[w].ep.service().client().is_done());
        let replies = self.clients[w].ep.service_mut().finish();
        r.map(|()| replies)
    }

    /// One exchange of worker `w`.
    fn exchange_of(&mut self, w: usize, reqs: Vec<Request>) -> Result<Vec<Reply>, TrainError> {
        self.start(w, reqs)?;
        self.finish(w)
    }

    /// One exchange of worker 0.
    fn exchange(&mut self, reqs: Vec<Request>) -> Result<Vec<Reply>, TrainError> {
        self.exchange_of(0, reqs)
    }

    fn global_steps(&self) -> Vec<u64> {
        self.servers
            .iter()
            .map(|s| s.ep.service().handler().shard.global_step())
            .collect()
    }
}

fn req(shard: usize, opcode: Opcode, body: Vec<u8>) -> Request {
    Request {
        shard,
        opcode,
        body: Payload::from(body),
    }
}

fn ok(r: &Reply) -> &[u8] {
    assert_eq!(
        r.status,
        Some(Status::Ok),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    &r.body
}

/// Keys 1..=12 by shard (`shard_of`), each shard with some.
fn keys() -> Vec<Vec<u64>> {
    let mut by = vec![Vec::new(); SHARDS];
    for k in 1..=12u64 {
        by[starwire_ps::shard_of(k, SHARDS)].push(k);
    }
    assert!(by.iter().all(|k| !k.is_empty()), "{by:?}");
    by
}

/// The pull of `W` and every key's row: one fused request per shard.
fn pull_bodies(keys: &[Vec<u64>]) -> Vec<Vec<u8>> {
    (0..SHARDS)
        .map(|s| {
            let mut b = Vec::new();
            let mut w = PullRequestWriter::new(&mut b);
            if s == 0 {
                w.dense(W);
            }
            w.rows(EMB, &keys[s]);
            b
        })
        .collect()
}

/// Pulled values: `W`, and every key's row by shard, in key order.
#[derive(Debug, Clone, PartialEq)]
struct Pulled {
    w: Vec<f32>,
    rows: Vec<Vec<f32>>,
    steps: Vec<u64>,
}

fn pull(c: &mut Cluster, keys: &[Vec<u64>]) -> (Pulled, Vec<Vec<u8>>) {
    let bodies = pull_bodies(keys);
    let reqs = bodies
        .into_iter()
        .enumerate()
        .map(|(s, b)| req(s, Opcode::SparsePull, b))
        .collect();
    let replies = c.exchange(reqs).expect("pull");
    let mut p = Pulled {
        w: Vec::new(),
        rows: Vec::new(),
        steps: Vec::new(),
    };
    for (s, r) in replies.iter().enumerate() {
        let resp = PullResponse::parse(ok(r), &Limits::default()).unwrap();
        p.steps.push(resp.global_step);
        for item in resp.items() {
            match item {
                PullReply::Dense { var: W, data } => p.w = data.to_vec(),
                PullReply::Rows {
                    var: EMB,
                    dim,
                    data,
                } => {
                    assert_eq!(dim as usize, DIM);
                    assert_eq!(data.len(), keys[s].len() * DIM);
                    p.rows.push(data.to_vec());
                }
                other => panic!("unexpected reply {other:?}"),
            }
        }
    }
    assert_eq!(p.w.len(), 3);
    assert_eq!(p.rows.len(), SHARDS);
    (p, replies.into_iter().map(|r| r.body).collect())
}

/// A distinct gradient for element `j` of key `k`'s row.
fn grad(k: u64, j: usize) -> f32 {
    k as f32 * 0.25 - j as f32 * 0.125
}

const W_GRAD: [f32; 3] = [1.0, -2.0, 0.5];

#[test]
fn pull_push_barrier_checkpoint_done() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 2);
    let keys = keys();
    // Worker 0 trains; worker 1 takes part in the barrier and says DONE.

    // Pull: every row exists (filter off) at global step 0.
    let (v0, _) = pull(&mut c, &keys);
    assert_eq!(v0.steps, vec![0; SHARDS]);
    assert!(v0.rows.iter().flatten().any(|&x| x != 0.0));

    // Push one step: a gradient per row and for W, each push completing
    // the step on its shard.
    let reqs = (0..SHARDS)
        .map(|s| {
            let mut b = Vec::new();
            let mut w = PushRequestWriter::new(&mut b, true);
            if s == 0 {
                w.dense(W, &W_GRAD);
            }
            let g: Vec<f32> = keys[s]
                .iter()
                .flat_map(|&k| (0..DIM).map(move |j| grad(k, j)))
                .collect();
            w.rows(EMB, DIM as u32, &keys[s], &g);
            req(s, Opcode::SparsePush, b)
        })
        .collect();
    for r in c.exchange(reqs).expect("push") {
        assert_eq!(parse_push_response(ok(&r)), Ok(1));
    }
    assert_eq!(c.global_steps(), vec![1; SHARDS]);

    // Pull again: every value moved by exactly -LR * gradient (SGD).
    let (v1, _) = pull(&mut c, &keys);
    assert_eq!(v1.steps, vec![1; SHARDS]);
    for (j, (&a, &b)) in v0.w.iter().zip(&v1.w).enumerate() {
        assert_eq!(b, a - LR * W_GRAD[j], "w[{j}]");
    }
    for (s, shard_keys) in keys.iter().enumerate() {
        for (i, &k) in shard_keys.iter().enumerate() {
            for j in 0..DIM {
                let (a, b) = (v0.rows[s][i * DIM + j], v1.rows[s][i * DIM + j]);
                assert_eq!(b, a - LR * grad(k, j), "key {k} element {j}");
            }
        }
    }

    // Barrier: worker 0 waits for step 2 on both shards; it is held (no
    // reply, before any deadline) until worker 1's push completes step 2
    // on each shard, and then answered with the step. An already reached
    // WAIT_STEP(1) is answered at once.
    let wait = |n| Control::WaitStep(n).encode();
    let empty_push = || {
        let mut b = Vec::new();
        PushRequestWriter::new(&mut b, true);
        b
    };
    let held_at = c.now;
    c.start(
        0,
        (0..SHARDS).map(|s| req(s, Opcode::Rpc, wait(2))).collect(),
    )
    .unwrap();
    c.settle().unwrap();
    assert!(
        !c.clients[0].ep.service().client().is_done(),
        "the barrier was not held"
    );
    assert_eq!(c.global_steps(), vec![1; SHARDS]);
    let pushes = (0..SHARDS)
        .map(|s| req(s, Opcode::SparsePush, empty_push()))
        .collect();
    for r in c.exchange_of(1, pushes).expect("worker 1's push") {
        assert_eq!(parse_push_response(ok(&r)), Ok(2));
    }
    let replies = c.finish(0).expect("barrier");
    for (s, r) in replies.iter().enumerate() {
        assert_eq!(ok(r), 2u64.to_le_bytes(), "barrier, shard {s}");
    }
    assert!(
        c.now - held_at < TIMEOUT,
        "released by the push, not a timer"
    );
    let replies = c.exchange(vec![req(1, Opcode::Rpc, wait(1))]).unwrap();
    assert_eq!(ok(&replies[0]), 2u64.to_le_bytes());

    // Checkpoint: each shard writes its file and answers with the step it
    // holds; restored into fresh shards, they answer the next pull with
    // the same bytes as the live shards.
    let d = dir.path().to_str().unwrap();
    let reqs = (0..SHARDS)
        .map(|s| req(s, Opcode::Rpc, Control::Checkpoint(d).encode()))
        .collect();
    for r in c.exchange(reqs).expect("checkpoint") {
        assert_eq!(ok(&r), 2u64.to_le_bytes());
    }
    let mut restored: Vec<PsShard> = (0..SHARDS)
        .map(|s| {
            let mut shard = PsShard::new(s, &vars(s), shard_config());
            let mut f = std::fs::File::open(dir.path().join(shard_file(s))).unwrap();
            shard.restore(&mut f).unwrap();
            assert_eq!(shard.global_step(), 2);
            shard
        })
        .collect();
    let (v2, live) = pull(&mut c, &keys);
    assert_eq!(
        (&v2.w, &v2.rows),
        (&v1.w, &v1.rows),
        "empty pushes move nothing"
    );
    for (s, body) in pull_bodies(&keys).iter().enumerate() {
        let mut out = Vec::new();
        restored[s].handle_pull(body, &mut out).unwrap();
        assert_eq!(out, live[s], "shard {s}'s checkpoint");
    }

    // DONE: the shards are finished once both workers are.
    let stats = c
        .exchange(vec![req(0, Opcode::Rpc, Control::Stats.encode())])
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(ok(&stats[0])).unwrap();
    assert_eq!(v["global_step"].as_u64(), Some(2), "{v}");
    assert_eq!(v["pushes"].as_u64(), Some(2), "{v}");
    let done = || {
        (0..SHARDS)
            .map(|s| req(s, Opcode::Rpc, Control::Done.encode()))
            .collect()
    };
    for w in 0..2 {
        assert!(
            c.servers
                .iter()
                .all(|s| !s.ep.service().server().finished()),
            "worker {w}"
        );
        for r in c.exchange_of(w, done()).expect("done") {
            assert!(ok(&r).is_empty());
        }
    }
    assert!(c.servers.iter().all(|s| s.ep.service().server().finished()));
    let t = c.clients[0].ep.service().client().traffic();
    assert_eq!(t.requests, 2 + 2 + 2 + 2 + 1 + 2 + 2 + 1 + 2);
}

/// A barrier no push will release fails the exchange exactly at its
/// deadline, reached only by advancing the virtual clock; the late reply,
/// once the step gets there, is dropped, and the connection serves on.
#[test]
fn an_unanswered_barrier_times_out_on_the_virtual_clock() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 1);
    let start = c.now;
    let e = c
        .exchange(vec![req(1, Opcode::Rpc, Control::WaitStep(3).encode())])
        .unwrap_err();
    assert!(
        matches!(&e, TrainError::Link(1, m) if m.contains("deadline exceeded")),
        "{e}"
    );
    assert_eq!(c.now - start, TIMEOUT, "failed at the deadline, not before");
    assert_eq!(c.global_steps(), vec![0; SHARDS]);

    // Three steps later the shard releases the barrier; its reply comes
    // after the deadline and is not taken for one of these pushes.
    let reqs = (0..3)
        .map(|_| {
            let mut b = Vec::new();
            PushRequestWriter::new(&mut b, true);
            req(1, Opcode::SparsePush, b)
        })
        .collect();
    let replies = c.exchange(reqs).expect("pushes after a timeout");
    let steps: Vec<_> = replies
        .iter()
        .map(|r| parse_push_response(ok(r)).unwrap())
        .collect();
    assert_eq!(steps, vec![1, 2, 3]);
    let (p, _) = pull(&mut c, &keys());
    assert_eq!(p.steps, vec![0, 3]);
}

/// A shard whose connection goes once it has answered (a PS whose shards
/// finish one by one after every worker's `DONE`) does not fail the
/// exchange still waiting on another shard; the next request to it fails
/// with why its connection ended.
#[test]
fn a_connection_that_goes_after_its_reply_fails_only_what_it_owes() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 1);
    c.servers[1].silent = true;
    let stats = || Control::Stats.encode();
    c.start(
        0,
        vec![req(0, Opcode::Rpc, stats()), req(1, Opcode::Rpc, stats())],
    )
    .unwrap();
    c.settle().unwrap();
    assert!(!c.clients[0].ep.service().client().is_done());
    // Shard 0 has answered; its end of the connection goes.
    let id = c.servers[0].ep.sessions().ids().next().unwrap();
    c.servers[0].ep.sessions_mut().remove(id).unwrap();
    c.settle().unwrap();
    assert_eq!(
        c.clients[0].ep.sessions().len(),
        1,
        "shard 0's connection ended"
    );
    c.servers[1].silent = false;
    let replies = c.finish(0).unwrap();
    assert!(replies.iter().all(|r| r.status == Some(Status::Ok)));
    let e = c.exchange(vec![req(0, Opcode::Rpc, stats())]).unwrap_err();
    assert!(
        matches!(&e, TrainError::Link(0, m) if m.contains("closed")),
        "{e}"
    );
    // While shard 1 owes a reply, losing its connection fails the exchange.
    c.start(0, vec![req(1, Opcode::Rpc, stats())]).unwrap();
    c.servers[1].silent = true;
    c.settle().unwrap();
    let id = c.servers[1].ep.sessions().ids().next().unwrap();
    c.servers[1].ep.sessions_mut().remove(id).unwrap();
    let e = c.settle().unwrap_err();
    assert!(matches!(&e, TrainError::Link(1, _)), "{e}");
}

/// Shards that never answer the handshake: connecting fails once the
/// virtual clock reaches the timeout.
#[test]
fn a_silent_shard_times_the_handshake_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::unconnected(dir.path(), 1);
    // Shard 1's server end stays open but never turns.
    c.servers[1].silent = true;
    let start = c.now;
    let e = c
        .drive(|c| c.clients[0].ep.service().client().is_connected())
        .unwrap_err();
    assert!(
        matches!(&e, TrainError::Link(1, m) if m.contains("handshake")),
        "{e}"
    );
    assert_eq!(c.now - start, TIMEOUT);
}

/// A dense push of `g` to every element of `W` (shard 0), completing the
/// step.
fn dense_push(g: f32) -> Vec<u8> {
    let mut b = Vec::new();
    PushRequestWriter::new(&mut b, true).dense(W, &[g; 3]);
    b
}

fn pulled_w(r: &Reply) -> Vec<f32> {
    let resp = PullResponse::parse(ok(r), &Limits::default()).unwrap();
    match resp.items().next() {
        Some(PullReply::Dense { var: W, data }) => data.to_vec(),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// The bounded step's one exchange: worker 0's push, its `WAIT_STEP` and
/// its pull go together. The shard applies the push, holds the wait, and
/// holds the pull behind it (unanswered, though it could be served) until
/// worker 1's push reaches the step; then it answers the wait and the
/// pull in order, the pull with the values after both pushes.
#[test]
fn a_request_behind_a_held_barrier_waits_for_it_and_keeps_its_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 2);
    let mut pull_w = Vec::new();
    PullRequestWriter::new(&mut pull_w).dense(W);
    let w0 = pulled_w(
        &c.exchange(vec![req(0, Opcode::SparsePull, pull_w.clone())])
            .unwrap()[0],
    );
    c.start(
        0,
        vec![
            req(0, Opcode::SparsePush, dense_push(1.0)),
            req(0, Opcode::Rpc, Control::WaitStep(2).encode()),
            req(0, Opcode::SparsePull, pull_w.clone()),
        ],
    )
    .unwrap();
    c.settle().unwrap();
    assert_eq!(c.global_steps()[0], 1, "worker 0's push is applied");
    assert!(!c.clients[0].ep.service().client().is_done());
    let held: usize = (0..4)
        .map(|k| c.servers[0].ep.service().server().held(k))
        .sum();
    assert_eq!(held, 1, "the pull is held behind the barrier");
    let r = c
        .exchange_of(1, vec![req(0, Opcode::SparsePush, dense_push(2.0))])
        .unwrap();
    assert_eq!(parse_push_response(ok(&r[0])), Ok(2));
    let replies = c.finish(0).unwrap();
    assert_eq!(parse_push_response(ok(&replies[0])), Ok(1));
    assert_eq!(ok(&replies[1]), 2u64.to_le_bytes());
    let after: Vec<f32> = w0.iter().map(|v| v - LR * 3.0).collect();
    assert_eq!(pulled_w(&replies[2]), after, "pulled after both pushes");

    // A wait the shard has reached is answered at once, and what follows
    // it is not held.
    let replies = c
        .exchange(vec![
            req(0, Opcode::Rpc, Control::WaitStep(1).encode()),
            req(0, Opcode::SparsePull, pull_w),
        ])
        .unwrap();
    assert_eq!(ok(&replies[0]), 2u64.to_le_bytes());
    assert_eq!(pulled_w(&replies[1]), after);
}

/// A worker that waits for its turns (it has sent a `WAIT_STEP`) gets its
/// push's reply with the wait's, when the barrier behind the push is
/// answered, rather than on its own before: one reply to wake for where
/// there were two. A push with no barrier behind it is answered on the
/// shard's next turn, and a worker that never waited is answered at once.
#[test]
fn a_push_reply_leaves_with_the_barrier_behind_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 2);
    let mut pull_w = Vec::new();
    PullRequestWriter::new(&mut pull_w).dense(W);
    let wait = |n: u64| req(0, Opcode::Rpc, Control::WaitStep(n).encode());
    c.exchange(vec![wait(0)]).unwrap();
    let received = |c: &Cluster| c.clients[0].ep.service().client().traffic().received;
    let before = received(&c);
    c.start(
        0,
        vec![
            req(0, Opcode::SparsePush, dense_push(1.0)),
            wait(2),
            req(0, Opcode::SparsePull, pull_w.clone()),
        ],
    )
    .unwrap();
    c.settle().unwrap();
    assert_eq!(c.global_steps()[0], 1, "worker 0's push is applied");
    assert_eq!(
        received(&c),
        before,
        "nothing answered while the barrier holds"
    );
    // Worker 1 never waited: its push is answered without a barrier.
    c.start(1, vec![req(0, Opcode::SparsePush, dense_push(2.0))])
        .unwrap();
    c.settle().unwrap();
    assert!(c.clients[1].ep.service().client().is_done());
    let r = c.clients[1].ep.service_mut().finish();
    assert_eq!(parse_push_response(ok(&r[0])), Ok(2));
    let replies = c.finish(0).unwrap();
    assert_eq!(parse_push_response(ok(&replies[0])), Ok(1), "as applied");
    assert_eq!(ok(&replies[1]), 2u64.to_le_bytes());
    let w = pulled_w(&replies[2]);

    // Its last push, with no wait behind it (as a worker's final flush):
    // answered on the shard's next turn, with no timer.
    let at = c.now;
    c.start(0, vec![req(0, Opcode::SparsePush, dense_push(1.0))])
        .unwrap();
    c.settle().unwrap();
    assert!(c.clients[0].ep.service().client().is_done());
    assert!(c.now - at < TIMEOUT);
    let r = c.clients[0].ep.service_mut().finish();
    assert_eq!(parse_push_response(ok(&r[0])), Ok(3));
    // And a pull right behind a push gets both replies, in order.
    let replies = c
        .exchange(vec![
            req(0, Opcode::SparsePush, dense_push(1.0)),
            req(0, Opcode::SparsePull, pull_w),
        ])
        .unwrap();
    assert_eq!(parse_push_response(ok(&replies[0])), Ok(4));
    let after: Vec<f32> = w.iter().map(|v| v - LR * 2.0).collect();
    assert_eq!(pulled_w(&replies[1]), after);
}

/// Two barriers in one exchange: the second (and the pull behind it) is
/// held behind the first, and holds again once the first is answered.
#[test]
fn a_barrier_behind_a_barrier_holds_again_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 2);
    let mut pull_w = Vec::new();
    PullRequestWriter::new(&mut pull_w).dense(W);
    c.start(
        0,
        vec![
            req(0, Opcode::Rpc, Control::WaitStep(1).encode()),
            req(0, Opcode::Rpc, Control::WaitStep(2).encode()),
            req(0, Opcode::SparsePull, pull_w),
        ],
    )
    .unwrap();
    c.settle().unwrap();
    let held = |c: &Cluster| -> usize {
        (0..4)
            .map(|k| c.servers[0].ep.service().server().held(k))
            .sum()
    };
    assert_eq!(held(&c), 2);
    c.exchange_of(1, vec![req(0, Opcode::SparsePush, dense_push(1.0))])
        .unwrap();
    c.settle().unwrap();
    assert!(!c.clients[0].ep.service().client().is_done());
    assert_eq!(held(&c), 1, "the second barrier holds the pull");
    c.exchange_of(1, vec![req(0, Opcode::SparsePush, dense_push(1.0))])
        .unwrap();
    let replies = c.finish(0).unwrap();
    assert_eq!(ok(&replies[0]), 1u64.to_le_bytes());
    assert_eq!(ok(&replies[1]), 2u64.to_le_bytes());
    assert_eq!(
        PullResponse::parse(ok(&replies[2]), &Limits::default())
            .unwrap()
            .global_step,
        2
    );
}

/// Past `MAX_HELD_REQUESTS` behind a held barrier, a request is answered
/// `LimitExceeded` at once; those held are answered in order once the
/// barrier is.
#[test]
fn requests_past_the_held_bound_are_refused_and_the_held_ones_served() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Cluster::connected(dir.path(), 2);
    let mut pull_w = Vec::new();
    PullRequestWriter::new(&mut pull_w).dense(W);
    let mut reqs = vec![req(0, Opcode::Rpc, Control::WaitStep(1).encode())];
    reqs.extend((0..=MAX_HELD_REQUESTS).map(|_| req(0, Opcode::SparsePull, pull_w.clone())));
    c.start(0, reqs).unwrap();
    c.settle().unwrap();
    c.exchange_of(1, vec![req(0, Opcode::SparsePush, dense_push(1.0))])
        .unwrap();
    let replies = c.finish(0).unwrap();
    assert_eq!(ok(&replies[0]), 1u64.to_le_bytes());
    for r in &replies[1..=MAX_HELD_REQUESTS] {
        assert_eq!(
            PullResponse::parse(ok(r), &Limits::default())
                .unwrap()
                .global_step,
            1
        );
    }
    assert_eq!(
        replies[MAX_HELD_REQUESTS + 1].status,
        Some(Status::LimitExceeded)
    );
}

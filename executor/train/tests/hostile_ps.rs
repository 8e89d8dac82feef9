//! A worker against a PS whose pull replies are damaged on the way: a
//! reply of the other form (rows for a pooled pull and back), a body cut
//! short, bytes flipped at random, a reply with one item too many or too
//! few, and a refusal. The PS is a live task (tcp, the real `start_ps`
//! wiring); the damage is done between its connection and the worker's
//! step, so every reply the worker reads is one a broken or hostile PS
//! could send.
//!
//! The worker must turn each into an error of its own (or, for flipped
//! float bytes that still parse, a step), never a panic; and a good step
//! must follow on the same connection.

use starwire_data::{Batch, MISSING_KEY, NUM_CATEGORICAL, NUM_NUMERIC};
use starwire_graph::{partition, Executor, Protocol};
use starwire_tcp::TcpDriver;
use starwire_train::backend::Tcp;
use starwire_train::cluster::{connect, plan, start_ps, ProcessReactors, ReactorLayout};
use starwire_train::net::{Exchange, Reply, Request, SessionNet, Traffic};
use starwire_train::worker::{control_all, WorkerCore};
use starwire_train::{TrainConfig, TrainError};
use starwire_transport::wire::{Opcode, Status};
use starwire_wire::ps::{Control, Limits, PullReply, PullResponse, PullResponseWriter};

const BATCH: usize = 16;

/// How a pull reply is damaged.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Rows items become pooled ones of the same floats, and back.
    OtherForm,
    /// The body ends `n` bytes early.
    Cut(usize),
    /// `n` bytes at seeded places get flipped.
    Flip(u64, usize),
    /// The last item is dropped.
    ItemMissing,
    /// The last item is sent twice.
    ItemTwice,
    /// The shard refuses the pull.
    Refused,
}

/// An [`Exchange`] that damages every pull reply of its inner one.
struct Damaging<'a> {
    inner: &'a mut SessionNet<TcpDriver>,
    damage: Damage,
}

impl Exchange for Damaging<'_> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let pulls: Vec<bool> = reqs
            .iter()
            .map(|r| r.opcode == Opcode::SparsePull)
            .collect();
        self.inner.exchange(reqs, replies)?;
        for (r, pull) in replies.iter_mut().zip(pulls) {
            if pull {
                damage(self.damage, r);
            }
        }
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
}

fn damage(d: Damage, r: &mut Reply) {
    assert_eq!(r.status, Some(Status::Ok), "the live PS answered");
    match d {
        Damage::OtherForm | Damage::ItemMissing | Damage::ItemTwice => {
            r.body = rewrite(&r.body, d);
        }
        Damage::Cut(n) => {
            let keep = r.body.len().saturating_sub(n);
            r.body.truncate(keep);
        }
        Damage::Flip(seed, n) => {
            let mut x = 2 * seed + 1;
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x as usize) % r.body.len();
                r.body[at] ^= (x >> 32) as u8 | 1;
            }
        }
        Damage::Refused => {
            r.status = Some(Status::Internal);
            r.body.clear();
        }
    }
}

/// The reply `body` written again with its items changed by `d`.
fn rewrite(body: &[u8], d: Damage) -> Vec<u8> {
    let resp = PullResponse::parse(body, &Limits::default()).expect("the PS's reply parses");
    let mut items: Vec<PullReply<'_>> = resp.items().collect();
    match d {
        Damage::ItemMissing => {
            items.pop();
        }
        Damage::ItemTwice => {
            let last = *items.last().expect("an item");
            items.push(last);
        }
        _ => {}
    }
    let mut out = Vec::new();
    let mut w = PullResponseWriter::new(&mut out, resp.global_step);
    for item in items {
        let (buf, data) = match (item, d) {
            (PullReply::Dense { var, data }, _) => (w.dense(var, data.len() as u32), data),
            (PullReply::Rows { var, dim, data }, Damage::OtherForm) => {
                let n = data.len() as u32 / dim.max(1);
                (w.pooled(var, dim, n), data)
            }
            (PullReply::Pooled { var, dim, data }, Damage::OtherForm) => {
                let n = data.len() as u32 / dim.max(1);
                (w.rows(var, dim, n), data)
            }
            (PullReply::Rows { var, dim, data }, _) => {
                let n = data.len() as u32 / dim.max(1);
                (w.rows(var, dim, n), data)
            }
            (PullReply::Pooled { var, dim, data }, _) => {
                let n = data.len() as u32 / dim.max(1);
                (w.pooled(var, dim, n), data)
            }
        };
        buf.extend_from_slice(data.as_bytes());
    }
    out
}

/// A batch of `BATCH` examples with keys drawn from `seed`.
fn batch(seed: u64) -> Batch {
    let mut b = Batch::with_capacity(BATCH);
    let mut x = 2 * seed + 1;
    for i in 0..BATCH {
        b.labels.push((i % 2) as f32);
        b.numeric
            .extend((0..NUM_NUMERIC).map(|j| (i + j) as f32 / 16.0));
        b.keys.extend((0..NUM_CATEGORICAL).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A small range, so rows repeat; never the missing key.
            MISSING_KEY + 1 + x % 500
        }));
        b.len += 1;
    }
    b
}

#[test]
fn damaged_pull_replies_are_errors_of_the_worker_not_panics() {
    let damages = [
        Damage::OtherForm,
        Damage::Cut(1),
        Damage::Cut(5),
        Damage::Cut(100),
        Damage::ItemMissing,
        Damage::ItemTwice,
        Damage::Refused,
    ];
    for protocol in [Protocol::StarServer, Protocol::StarServerLite] {
        let cfg = TrainConfig {
            ps: 1,
            workers: 1,
            batch_size: BATCH,
            protocol,
            ..TrainConfig::default()
        };
        let plan = plan(&cfg).expect("plan");
        let layout =
            ReactorLayout::detect(&cfg, &ProcessReactors::ps_task(&cfg, 0)).expect("layout");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let ps = start_ps::<Tcp>(&cfg, &plan, 0, listener, 1, None, &layout).expect("PS");
        let addr = ps.addr().to_string();
        let mut net = connect::<Tcp>(&cfg, &[addr], 0, plan.shards).expect("connect");
        let core = || {
            WorkerCore::new(
                partition(&plan.model, protocol),
                plan.layout.clone(),
                cfg.tensor_fuse,
                Executor::new(0).unwrap(),
            )
        };
        let flips = (0..40u64).map(|s| Damage::Flip(s, 1 + (s as usize % 4)));
        for (i, d) in damages.into_iter().chain(flips).enumerate() {
            // A core of its own: a failed step leaves its state mid-step.
            let mut worker = core();
            let mut bad = Damaging {
                inner: &mut net,
                damage: d,
            };
            let r = worker.step(&mut bad, &batch(i as u64));
            match (d, r) {
                // Flipped float bytes may still be a reply of the right
                // shape; flipped header bytes must be an error.
                (Damage::Flip(..), Ok(_)) => {}
                (_, Err(TrainError::Remote(_))) => {}
                (d, r) => panic!("{protocol:?}, {d:?}: {r:?}"),
            }
            // The connection still serves a good step.
            let mut good = core();
            good.step(&mut net, &batch(1000 + i as u64))
                .unwrap_or_else(|e| panic!("{protocol:?}: a good step after {d:?}: {e}"));
        }
        control_all(&mut net, plan.shards, &Control::Done).expect("DONE");
        net.close();
        ps.join().expect("the PS finishes when its worker is done");
    }
}

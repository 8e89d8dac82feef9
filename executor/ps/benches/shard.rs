//! Throughput of the request handlers on one shard: rows pull, rows push
//! (Adagrad), pooled pull and pooled push, with 4096 keys of dim 16 from a
//! 100 000-key working set; and of new-row initialisation (4096 rows of
//! dim 64 per iteration, normal and uniform), which a pull pays for every
//! key it sees for the first time.
//!
//! `ps_table_1m`: the shape of `starwire train --model lr --embedding-dim
//! 64 --batch-size 512` on a table far larger than the caches. 1M rows of
//! dim 64 with Adagrad (512 MiB of rows and accumulators, 24 MiB of map),
//! requests of 6,656 keys (26 features x 512 samples / 2 shards) spread
//! over the whole table, so nearly every row access misses as in a
//! production table: `pull_rows` (probe, copy into the reply),
//! `push_rows` (accumulate, Adagrad on row and accumulator) and
//! `pull_new` (every row created, a fresh shard every 64 requests);
//! `push_after_pull` and `push_after_pull_probed`: a push after a pull of
//! the same keys, from a known worker (whose push finds the entries where
//! its pull did) and from an unknown one (which probes for them).
//!
//! `ps_dc_asgd_1m`: the shape of `starwire train --workers 64` (DC-ASGD,
//! dim 8, 6,656 keys a request) on 1M rows: a push one update stale, so
//! that every row is compensated with the values its worker pulled, read
//! from the pull's reply as a network server keeps it
//! (`handle_pull_shared`, `attach_pull_reply`).

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use starwire_ps::{Init, OptimizerConfig, OptimizerKind, PsShard, ShardConfig, VarDef, VarKind};
use starwire_wire::ps::{PullRequestWriter, PushRequestWriter};

const DIM: usize = 16;
const KEYS: usize = 4096;

fn keys(round: u64) -> Vec<u64> {
    (0..KEYS as u64)
        .map(|i| 1 + (i * 0x9E37_79B9 + round * 7919) % 100_000)
        .collect()
}

/// A shard of one `dim`-wide embedding table (id 1) with Adagrad.
fn adagrad_shard(dim: usize) -> PsShard {
    shard_with(dim, OptimizerConfig::adagrad(0.05))
}

/// A shard of one `dim`-wide embedding table (id 1) with `optimizer`.
fn shard_with(dim: usize, optimizer: OptimizerConfig) -> PsShard {
    let vars = [VarDef {
        id: 1,
        name: "emb".into(),
        kind: VarKind::Embedding { dim },
        init: Init::Uniform { scale: 0.01 },
    }];
    let cfg = ShardConfig {
        optimizer,
        ..ShardConfig::default()
    };
    PsShard::new(0, &vars, cfg)
}

fn shard() -> PsShard {
    let mut s = adagrad_shard(DIM);
    // Warm: create every row of the working set.
    let all: Vec<u64> = (1..=100_000).collect();
    let (mut req, mut out) = (Vec::new(), Vec::new());
    PullRequestWriter::new(&mut req).rows(1, &all);
    s.handle_pull(&req, &mut out).expect("warm-up pull");
    s
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("ps_shard");
    g.throughput(Throughput::Elements(KEYS as u64));
    let mut s = shard();
    let k = keys(1);
    let grads = vec![0.001f32; KEYS * DIM];
    let offsets: Vec<u32> = (0..=KEYS as u32 / 8).map(|b| b * 8).collect();
    let pooled_grads = vec![0.001f32; (offsets.len() - 1) * DIM];
    let (mut req, mut out) = (Vec::new(), Vec::new());

    PullRequestWriter::new(&mut req).rows(1, &k);
    let pull_rows = req.clone();
    PushRequestWriter::new(&mut req, true).rows(1, DIM as u32, &k, &grads);
    let push_rows = req.clone();
    PullRequestWriter::new(&mut req).pooled(1, &offsets, &k);
    let pull_pooled = req.clone();
    PushRequestWriter::new(&mut req, true).pooled(1, DIM as u32, &offsets, &k, &pooled_grads);
    let push_pooled = req.clone();

    for (name, body, is_push) in [
        ("pull_rows", &pull_rows, false),
        ("push_rows", &push_rows, true),
        ("pull_pooled", &pull_pooled, false),
        ("push_pooled", &push_pooled, true),
    ] {
        g.bench_with_input(BenchmarkId::new(name, KEYS), body, |b, body| {
            b.iter(|| {
                if is_push {
                    s.handle_push(body, &mut out).expect("push");
                } else {
                    s.handle_pull(body, &mut out).expect("pull");
                }
            })
        });
    }
    g.finish();
}

fn bench_init(c: &mut Criterion) {
    let mut g = c.benchmark_group("ps_init");
    g.throughput(Throughput::Elements(KEYS as u64));
    let mut row = vec![0.0f32; 64];
    for (name, init) in [
        ("normal", Init::Normal { std: 0.01 }),
        ("uniform", Init::Uniform { scale: 0.01 }),
    ] {
        let def = VarDef {
            id: 1,
            name: "emb".into(),
            kind: VarKind::Embedding { dim: 64 },
            init,
        };
        g.bench_function(BenchmarkId::new(name, KEYS), |b| {
            b.iter(|| {
                for k in 0..KEYS as u64 {
                    def.init_values(7, k, &mut row);
                }
                row[0]
            })
        });
    }
    g.finish();
}

const BIG_DIM: usize = 64;
const BIG_ROWS: u64 = 1 << 20;
const BIG_KEYS: usize = 6656;

/// Request `round`'s keys: distinct, spread over `0..BIG_ROWS`.
fn big_keys(round: u64) -> Vec<u64> {
    (0..BIG_KEYS as u64)
        .map(|i| (i * 157 + round * 7_368_787).wrapping_mul(0x9E37_79B9_7F4A_7C15) % BIG_ROWS)
        .collect()
}

fn bench_big_table(c: &mut Criterion) {
    let mut g = c.benchmark_group("ps_table_1m");
    g.throughput(Throughput::Elements(BIG_KEYS as u64));
    let (mut req, mut out) = (Vec::new(), Vec::new());
    let mut s = adagrad_shard(BIG_DIM);
    let all: Vec<u64> = (0..BIG_ROWS).collect();
    for chunk in all.chunks(1 << 16) {
        PullRequestWriter::new(&mut req).rows(1, chunk);
        s.handle_pull(&req, &mut out).expect("fill");
    }
    let rounds = 64;
    let pulls: Vec<Vec<u8>> = (0..rounds)
        .map(|r| {
            PullRequestWriter::new(&mut req).rows(1, &big_keys(r));
            req.clone()
        })
        .collect();
    let grads: Vec<f32> = (0..BIG_KEYS * BIG_DIM)
        .map(|i| ((i % 7) as f32 - 3.0) * 1e-3)
        .collect();
    let pushes: Vec<Vec<u8>> = (0..rounds)
        .map(|r| {
            PushRequestWriter::new(&mut req, true).rows(1, BIG_DIM as u32, &big_keys(r), &grads);
            req.clone()
        })
        .collect();
    let mut i = 0;
    g.bench_function(BenchmarkId::new("pull_rows", BIG_KEYS), |b| {
        b.iter(|| {
            i += 1;
            s.handle_pull(&pulls[i % pulls.len()], &mut out)
                .expect("pull");
        })
    });
    g.bench_function(BenchmarkId::new("push_rows", BIG_KEYS), |b| {
        b.iter(|| {
            i += 1;
            s.handle_push(&pushes[i % pushes.len()], &mut out)
                .expect("push");
        })
    });
    // A worker's push after its pull of the same keys: from a known
    // worker it finds each key's entry where the pull did, from an
    // unknown one it probes for them (only the push is timed).
    for (name, worker) in [
        ("push_after_pull", Some(0)),
        ("push_after_pull_probed", None),
    ] {
        g.bench_function(BenchmarkId::new(name, BIG_KEYS), |b| {
            b.iter_custom(|iters| {
                let mut total = std::time::Duration::ZERO;
                for _ in 0..iters {
                    i += 1;
                    let r = i % pulls.len();
                    s.handle_pull_from(worker, &pulls[r], &mut out)
                        .expect("pull");
                    let t = std::time::Instant::now();
                    s.handle_push_from(worker, &pushes[r], &mut out)
                        .expect("push");
                    total += t.elapsed();
                }
                total
            })
        });
    }
    drop(s);
    g.bench_function(BenchmarkId::new("pull_new", BIG_KEYS), |b| {
        b.iter_custom(|iters| {
            let mut total = std::time::Duration::ZERO;
            let mut fresh = adagrad_shard(BIG_DIM);
            for n in 0..iters {
                if n % 64 == 0 {
                    fresh = adagrad_shard(BIG_DIM);
                }
                let first = (n % 64) * BIG_KEYS as u64;
                let keys: Vec<u64> = (first..first + BIG_KEYS as u64).collect();
                PullRequestWriter::new(&mut req).rows(1, &keys);
                let t = std::time::Instant::now();
                fresh.handle_pull(&req, &mut out).expect("pull new");
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
}

fn bench_dc_asgd(c: &mut Criterion) {
    const DIM: usize = 8;
    let mut g = c.benchmark_group("ps_dc_asgd_1m");
    g.throughput(Throughput::Elements(BIG_KEYS as u64));
    let (mut req, mut out) = (Vec::new(), Vec::new());
    let mut s = shard_with(DIM, OptimizerConfig::with_kind(OptimizerKind::DcAsgd, 0.05));
    let all: Vec<u64> = (0..BIG_ROWS).collect();
    for chunk in all.chunks(1 << 16) {
        PullRequestWriter::new(&mut req).rows(1, chunk);
        s.handle_pull(&req, &mut out).expect("fill");
    }
    let rounds = 64;
    let grads: Vec<f32> = (0..BIG_KEYS * DIM)
        .map(|i| ((i % 7) as f32 - 3.0) * 1e-3)
        .collect();
    let (pulls, pushes): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..rounds)
        .map(|r| {
            PullRequestWriter::new(&mut req).rows(1, &big_keys(r));
            let pull = req.clone();
            PushRequestWriter::new(&mut req, true).rows(1, DIM as u32, &big_keys(r), &grads);
            (pull, req.clone())
        })
        .unzip();
    let mut i = 0;
    // Worker 0 pulls, worker 1 pulls and pushes the same rows, then worker
    // 0's push (timed) finds every row one update past its pull.
    g.bench_function(BenchmarkId::new("push_stale", BIG_KEYS), |b| {
        b.iter_custom(|iters| {
            let mut total = std::time::Duration::ZERO;
            for _ in 0..iters {
                i += 1;
                let r = i % pulls.len();
                s.handle_pull_shared(0, &pulls[r], &mut out).expect("pull");
                let reply = Bytes::from(std::mem::take(&mut out));
                s.attach_pull_reply(0, &reply);
                s.handle_pull_from(Some(1), &pulls[r], &mut out)
                    .expect("pull");
                s.handle_push_from(Some(1), &pushes[r], &mut out)
                    .expect("push");
                let t = std::time::Instant::now();
                s.handle_push_from(Some(0), &pushes[r], &mut out)
                    .expect("push");
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
}

criterion_group!(benches, bench, bench_init, bench_big_table, bench_dc_asgd);
criterion_main!(benches);

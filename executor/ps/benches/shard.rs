//! Throughput of the request handlers on one shard: rows pull, rows push
//! (Adagrad), pooled pull and pooled push, with 4096 keys of dim 16 from a
//! 100 000-key working set; and of new-row initialisation (4096 rows of
//! dim 64 per iteration, normal and uniform), which a pull pays for every
//! key it sees for the first time.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use starwire_ps::proto::{PullRequestWriter, PushRequestWriter};
use starwire_ps::{Init, OptimizerConfig, PsShard, ShardConfig, VarDef, VarKind};

const DIM: usize = 16;
const KEYS: usize = 4096;

fn keys(round: u64) -> Vec<u64> {
    (0..KEYS as u64)
        .map(|i| 1 + (i * 0x9E37_79B9 + round * 7919) % 100_000)
        .collect()
}

fn shard() -> PsShard {
    let vars = [VarDef {
        id: 1,
        name: "emb".into(),
        kind: VarKind::Embedding { dim: DIM },
        init: Init::Uniform { scale: 0.01 },
    }];
    let mut s = PsShard::new(
        0,
        &vars,
        ShardConfig {
            optimizer: OptimizerConfig::adagrad(0.05),
            ..ShardConfig::default()
        },
    );
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

criterion_group!(benches, bench, bench_init);
criterion_main!(benches);

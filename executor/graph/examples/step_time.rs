//! Times one Criteo-shaped `wdl` training step (both protocols) inline and
//! with compute threads: `cargo run --release -p starwire-graph --example
//! step_time -- [batch] [dim] [iters]`. A rough figure, not a benchmark.
#![deny(unsafe_code)]

use std::time::Instant;

use starwire_graph::*;

fn feeds(p: &Partitioned, b: usize) -> StepFeeds {
    // Deterministic pseudo-random values; no RNG crate needed here.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut val = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let dense = p
        .pulls()
        .dense
        .iter()
        .map(|d| {
            let n = d.shape.iter().product();
            (d.var, Tensor::new(d.shape.clone(), val(n)).unwrap())
        })
        .collect();
    let lookups = p
        .pulls()
        .lookups
        .iter()
        .map(|l| {
            let per = l.spec.fields.len();
            let index: Vec<u32> = (0..b * per).map(|i| (i % 97) as u32).collect();
            let offsets = (0..=b).map(|e| (e * per) as u32).collect();
            let rows = Tensor::new(vec![97, l.dim], val(97 * l.dim)).unwrap();
            match l.form {
                PullForm::Rows => LookupFeed::Rows {
                    rows,
                    index,
                    offsets,
                },
                PullForm::Pooled => {
                    LookupFeed::Pooled(combine(&rows, &index, &offsets, l.spec.combiner).unwrap())
                }
            }
        })
        .collect();
    StepFeeds {
        numeric: Tensor::new(vec![b, 13], val(b * 13)).unwrap(),
        labels: Tensor::new(vec![b, 1], (0..b).map(|e| (e % 2) as f32).collect()).unwrap(),
        dense,
        lookups,
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric arguments"))
        .collect();
    let (b, dim, iters) = (
        *args.first().unwrap_or(&512),
        *args.get(1).unwrap_or(&16),
        *args.get(2).unwrap_or(&20),
    );
    let model = Model::build(ModelSpec::wdl(dim)).unwrap();
    for protocol in [Protocol::StarServer, Protocol::StarServerLite] {
        let p = partition(&model, protocol);
        let f = feeds(&p, b);
        for threads in [0, 1, 2] {
            let exec = Executor::new(threads).unwrap();
            p.forward_backward(&exec, f.clone()).unwrap();
            let t = Instant::now();
            for _ in 0..iters {
                p.forward_backward(&exec, f.clone()).unwrap();
            }
            let per = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
            println!("{protocol:?} B={b} D={dim} threads={threads}: {per:.3} ms/step");
        }
    }
}

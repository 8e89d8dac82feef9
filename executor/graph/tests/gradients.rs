//! Finite-difference checks of every op's gradient and of both whole models.

mod common;

use std::sync::Arc;

use common::*;
use starwire_graph::*;

const B: usize = 4;

/// Builds `head(leaves) -> [B,k]`, projects it to logits with a variable
/// `[k,1]`, and checks every gradient by finite differences.
fn check_op(
    dense: Vec<(VarId, Vec<usize>)>,
    lookups: Vec<(LookupFeed, Combiner)>,
    k: usize,
    head: impl FnOnce(&mut GraphBuilder, &[NodeId], &[NodeId]) -> NodeId,
) {
    let mut r = rng(7);
    let mut g = GraphBuilder::new();
    let labels = g.input(0, 1);
    let vars: Vec<NodeId> = dense
        .iter()
        .map(|(v, s)| g.variable(*v, s.clone()))
        .collect();
    let looks: Vec<NodeId> = lookups
        .iter()
        .enumerate()
        .map(|(slot, (feed, c))| match feed {
            LookupFeed::Rows { rows, .. } => {
                g.lookup(VarId(100 + slot as u32), slot, rows.shape()[1], *c)
            }
            LookupFeed::WireRows { rows, .. } => {
                g.lookup(VarId(100 + slot as u32), slot, rows.dim(), *c)
            }
            LookupFeed::Pooled(t) => g.node(
                Op::Pooled {
                    var: VarId(100 + slot as u32),
                    slot,
                    dim: t.shape()[1],
                    combiner: *c,
                },
                vec![],
            ),
        })
        .collect();
    let h = head(&mut g, &vars, &looks);
    let p = g.variable(VarId(99), vec![k, 1]);
    let logits = g.matmul(h, p);
    let loss = g.sigmoid_cross_entropy(logits, labels);
    let graph = Arc::new(g.build(loss).unwrap());
    let mut feeds = GraphFeeds {
        inputs: vec![common::labels(&mut r, B)],
        dense: dense
            .into_iter()
            .map(|(v, s)| (v, rand_tensor(&mut r, s)))
            .collect(),
        lookups: lookups.into_iter().map(|(f, _)| f).collect(),
    };
    feeds
        .dense
        .push((VarId(99), rand_tensor(&mut r, vec![k, 1])));
    let exec = Executor::new(0).unwrap();
    let n = fd_check(|f| run_graph(&graph, &exec, f), &feeds);
    assert!(n > 0);
}

#[test]
fn matmul_gradients() {
    check_op(
        vec![(VarId(0), vec![B, 3]), (VarId(1), vec![3, 2])],
        vec![],
        2,
        |g, v, _| g.matmul(v[0], v[1]),
    );
}

#[test]
fn add_gradients_same_shape_and_broadcast() {
    for bias in [vec![B, 3], vec![3], vec![1, 3]] {
        check_op(
            vec![(VarId(0), vec![B, 3]), (VarId(1), bias)],
            vec![],
            3,
            |g, v, _| g.add(v[0], v[1]),
        );
    }
}

#[test]
fn add_n_gradients_with_repeated_and_fanned_out_inputs() {
    // v0 twice (its gradient is twice the output's), a lookup, and v1, which
    // also feeds the concat next to the sum.
    check_op(
        vec![(VarId(0), vec![B, 2]), (VarId(1), vec![B, 2])],
        vec![(rows_feed(6), Combiner::Sum)],
        4,
        |g, v, l| {
            let s = g.add_n(vec![v[0], l[0], v[1], v[0]]);
            g.concat(vec![s, v[1]])
        },
    );
}

#[test]
fn relu_gradients() {
    check_op(vec![(VarId(0), vec![B, 5])], vec![], 5, |g, v, _| {
        g.relu(v[0])
    });
}

#[test]
fn concat_gradients() {
    check_op(
        vec![
            (VarId(0), vec![B, 2]),
            (VarId(1), vec![B, 3]),
            (VarId(2), vec![B, 1]),
        ],
        vec![],
        6,
        |g, v, _| g.concat(v.to_vec()),
    );
}

#[test]
fn sigmoid_cross_entropy_gradients() {
    // The head is the identity on a [B,1] variable; the projection is 1x1.
    check_op(vec![(VarId(0), vec![B, 1])], vec![], 1, |_, v, _| v[0]);
}

fn rows_feed(seed: u64) -> LookupFeed {
    let mut r = rng(seed);
    // Four examples: keys {0,1}, {}, {2,2,0}, {1}. Rows 0 and 2 repeat.
    LookupFeed::Rows {
        rows: rand_tensor(&mut r, vec![3, 2]),
        index: vec![0, 1, 2, 2, 0, 1],
        offsets: vec![0, 2, 2, 5, 6],
    }
}

#[test]
fn embedding_lookup_gradients() {
    for c in [Combiner::Sum, Combiner::Mean] {
        check_op(vec![], vec![(rows_feed(3), c)], 2, |_, _, l| l[0]);
    }
}

#[test]
fn pooled_gradients() {
    let t = rand_tensor(&mut rng(4), vec![B, 3]);
    check_op(
        vec![],
        vec![(LookupFeed::Pooled(t), Combiner::Mean)],
        3,
        |_, _, l| l[0],
    );
}

#[test]
fn fan_out_and_repeated_inputs_sum_gradients() {
    // x feeds relu, add (twice, once directly) and concat.
    check_op(
        vec![(VarId(0), vec![B, 3])],
        vec![(rows_feed(5), Combiner::Sum)],
        8,
        |g, v, l| {
            let y = g.relu(v[0]);
            let z = g.add(v[0], y);
            let zz = g.add(z, v[0]);
            g.concat(vec![zz, v[0], l[0]])
        },
    );
}

fn check_model(spec: ModelSpec, protocol: Protocol) {
    let model = Model::build(spec.clone()).unwrap();
    let p = partition(&model, protocol);
    let mut store = Store::new(&model, 11);
    let b = batch(&mut rng(12), &spec, 5);
    let (feeds, _) = step_feeds(&p, &mut store, &b);
    let feeds = graph_feeds(feeds);
    let exec = Executor::new(0).unwrap();
    let n = fd_check(|f| run_graph(p.graph(), &exec, f), &feeds);
    assert!(n >= 16, "checked {n}");
}

#[test]
fn lr_model_gradients_both_protocols() {
    check_model(small_lr(), Protocol::StarServer);
    check_model(small_lr(), Protocol::StarServerLite);
}

#[test]
fn wdl_model_gradients_both_protocols() {
    check_model(small_wdl(), Protocol::StarServer);
    check_model(small_wdl(), Protocol::StarServerLite);
}

/// The rows of `t` as little-endian bytes split over two buffers (as two
/// shards' replies), with a few bytes of header before each part.
fn wire(t: &Tensor) -> WireRows {
    let (u, d) = t.as_matrix().unwrap();
    let le = |rows: std::ops::Range<usize>| -> Vec<u8> {
        let mut v = vec![0xee; 5];
        v.extend(
            t.data()[rows.start * d..rows.end * d]
                .iter()
                .flat_map(|x| x.to_le_bytes()),
        );
        v
    };
    let mut w = WireRows::new(d);
    w.push(Arc::new(le(0..u / 2)), 5, u / 2).unwrap();
    w.push(Arc::new(le(u / 2..u)), 5, u - u / 2).unwrap();
    w
}

/// A run fed the rows in place (`WireRows`) gives the bits of the same run
/// fed them as tensors: loss, probabilities and every gradient, reusing
/// the run's buffers or not.
#[test]
fn wire_rows_feeds_run_bit_identical_to_tensor_rows() {
    for spec in [small_lr(), small_wdl()] {
        let model = Model::build(spec.clone()).unwrap();
        let p = partition(&model, Protocol::StarServer);
        let mut store = Store::new(&model, 21);
        let b = batch(&mut rng(22), &spec, 7);
        let (feeds, _) = step_feeds(&p, &mut store, &b);
        let feeds = graph_feeds(feeds);
        let mut wired = feeds.clone();
        for f in &mut wired.lookups {
            if let LookupFeed::Rows {
                rows,
                index,
                offsets,
            } = f
            {
                *f = LookupFeed::WireRows {
                    rows: wire(rows),
                    index: index.clone(),
                    offsets: offsets.clone(),
                };
            }
        }
        let exec = Executor::new(0).unwrap();
        let want = run_graph(p.graph(), &exec, &feeds);
        let mut bufs = RunBuffers::default();
        for _ in 0..2 {
            let got = p
                .graph()
                .run_with(&exec, wired.clone(), true, &mut bufs)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(got.loss.to_bits(), want.loss.to_bits());
            assert_eq!(bits(&got.probs), bits(&want.probs));
            assert_eq!(got.dense_grads.len(), want.dense_grads.len());
            for ((_, g), (_, w)) in got.dense_grads.iter().zip(&want.dense_grads) {
                assert_eq!(bits(g.data()), bits(w.data()));
            }
            for (g, w) in got.lookup_grads.iter().zip(&want.lookup_grads) {
                match (g, w) {
                    (LookupGrad::Rows(g), LookupGrad::Rows(w)) => {
                        assert_eq!(g.shape(), w.shape());
                        assert_eq!(bits(g.data()), bits(w.data()));
                    }
                    _ => panic!("rows gradients expected"),
                }
            }
            bufs.give_back(p.graph(), got.lookup_grads);
        }
    }
}

//! Malformed graphs and feeds give typed errors, never panics.

mod common;

use common::*;
use starwire_graph::*;

fn setup(protocol: Protocol) -> (Partitioned, StepFeeds) {
    let spec = small_wdl();
    let model = Model::build(spec.clone()).unwrap();
    let p = partition(&model, protocol);
    let mut store = Store::new(&model, 41);
    let b = batch(&mut rng(42), &spec, 6);
    (p.clone(), step_feeds(&p, &mut store, &b).0)
}

fn run(p: &Partitioned, f: StepFeeds) -> Result<StepOutput, GraphError> {
    p.forward_backward(&Executor::new(0).unwrap(), f)
}

#[test]
fn dense_feed_errors() {
    let (p, good) = setup(Protocol::StarServer);
    assert!(run(&p, good.clone()).is_ok());

    let mut f = good.clone();
    f.dense.pop();
    assert!(matches!(run(&p, f), Err(GraphError::MissingFeed(_))));

    let mut f = good.clone();
    f.dense.push(f.dense[0].clone());
    assert!(matches!(run(&p, f), Err(GraphError::DuplicateFeed(_))));

    let mut f = good.clone();
    f.dense.push((VarId(999), Tensor::scalar(0.0)));
    assert!(matches!(
        run(&p, f),
        Err(GraphError::UnknownVariable(VarId(999)))
    ));

    let mut f = good.clone();
    f.dense[0].1 = Tensor::zeros(vec![2, 2]).unwrap();
    assert!(matches!(
        run(&p, f),
        Err(GraphError::Shape { op: "Variable", .. })
    ));

    let mut f = good.clone();
    f.numeric = Tensor::zeros(vec![6, 4]).unwrap();
    assert!(matches!(
        run(&p, f),
        Err(GraphError::Shape { op: "Input", .. })
    ));

    let mut f = good.clone();
    f.numeric = Tensor::zeros(vec![5, 3]).unwrap();
    assert!(matches!(run(&p, f), Err(GraphError::Shape { .. })));

    let mut f = good;
    f.labels = Tensor::zeros(vec![6]).unwrap();
    assert!(matches!(run(&p, f), Err(GraphError::Shape { .. })));
}

fn with_rows(
    good: &StepFeeds,
    edit: impl FnOnce(&mut Tensor, &mut Vec<u32>, &mut Vec<u32>),
) -> StepFeeds {
    let mut f = good.clone();
    let LookupFeed::Rows {
        rows,
        index,
        offsets,
    } = &mut f.lookups[1]
    else {
        panic!("rows feed expected")
    };
    edit(rows, index, offsets);
    f
}

#[test]
fn lookup_feed_errors() {
    let (p, good) = setup(Protocol::StarServer);

    let f = with_rows(&good, |r, idx, _| idx.push(r.shape()[0] as u32));
    // The extra occurrence also breaks the last offset; fix it to isolate the index error.
    let f = with_rows(&f, |r, idx, off| {
        *off.last_mut().unwrap() = idx.len() as u32;
        let _ = r;
    });
    assert!(matches!(
        run(&p, f),
        Err(GraphError::KeyIndexOutOfRange { index: 1, .. })
    ));

    let f = with_rows(&good, |_, _, off| off[0] = 1);
    assert!(matches!(
        run(&p, f),
        Err(GraphError::BadOffsets { index: 1, .. })
    ));
    let f = with_rows(&good, |_, _, off| off.clear());
    assert!(matches!(run(&p, f), Err(GraphError::BadOffsets { .. })));
    let f = with_rows(&good, |_, idx, off| {
        idx.extend([0, 0]);
        let n = off.len();
        off[n - 2] = idx.len() as u32;
        off[n - 1] = idx.len() as u32 - 1;
    });
    assert!(matches!(run(&p, f), Err(GraphError::BadOffsets { .. })));
    let f = with_rows(&good, |_, _, off| off.push(u32::MAX));
    assert!(matches!(run(&p, f), Err(GraphError::BadOffsets { .. })));
    let f = with_rows(&good, |r, _, _| {
        *r = Tensor::zeros(vec![r.shape()[0], 7]).unwrap()
    });
    assert!(matches!(
        run(&p, f),
        Err(GraphError::Shape {
            op: "EmbeddingLookup",
            ..
        })
    ));
    // A different batch size in one lookup is refused up front.
    let f = with_rows(&good, |_, _, off| {
        let last = *off.last().unwrap();
        off.push(last);
    });
    assert!(matches!(
        run(&p, f),
        Err(GraphError::Shape {
            op: "EmbeddingLookup",
            ..
        })
    ));

    let mut f = good.clone();
    f.lookups[2] = LookupFeed::Pooled(Tensor::zeros(vec![6, 2]).unwrap());
    assert!(matches!(
        run(&p, f),
        Err(GraphError::WrongFeedForm {
            index: 2,
            expected: "rows"
        })
    ));
    let mut f = good;
    f.lookups.pop();
    assert!(matches!(run(&p, f), Err(GraphError::MissingFeed(_))));

    let (lite, good) = setup(Protocol::StarServerLite);
    let mut f = good.clone();
    f.lookups[0] = LookupFeed::Rows {
        rows: Tensor::zeros(vec![1, 1]).unwrap(),
        index: vec![],
        offsets: vec![0; 7],
    };
    assert!(matches!(
        run(&lite, f),
        Err(GraphError::WrongFeedForm {
            index: 0,
            expected: "pooled"
        })
    ));
    let mut f = good;
    f.lookups[3] = LookupFeed::Pooled(Tensor::zeros(vec![6, 3]).unwrap());
    assert!(matches!(
        run(&lite, f),
        Err(GraphError::Shape { op: "Pooled", .. })
    ));
}

#[test]
fn graph_builder_errors() {
    let mut g = GraphBuilder::new();
    let a = g.input(0, 1);
    assert!(matches!(
        g.clone().build(a),
        Err(GraphError::InvalidGraph(_))
    ));
    let r = g.node(Op::Relu, vec![a, a]);
    assert!(g.clone().build(r).is_err());

    let mut g = GraphBuilder::new();
    let a = g.input(0, 1);
    let b = g.input(0, 1);
    let l = g.sigmoid_cross_entropy(a, b);
    assert!(matches!(g.build(l), Err(GraphError::InvalidGraph(m)) if m.contains("twice")));

    let mut g = GraphBuilder::new();
    let a = g.input(1, 1);
    let l = g.sigmoid_cross_entropy(a, a);
    assert!(matches!(g.build(l), Err(GraphError::InvalidGraph(m)) if m.contains("no node")));

    let mut g = GraphBuilder::new();
    let a = g.input(0, 1);
    // A node id from another builder that points past this graph's nodes.
    let mut other = GraphBuilder::new();
    let far = (0..6).map(|s| other.input(s, 1)).last().unwrap();
    let fwd = g.node(Op::Relu, vec![far]);
    let l = g.sigmoid_cross_entropy(fwd, a);
    assert!(g.build(l).is_err());
}

#[test]
fn kernels_reject_bad_layouts() {
    let rows = Tensor::zeros(vec![2, 3]).unwrap();
    assert!(combine(&rows, &[0, 2], &[0, 2], Combiner::Sum).is_err());
    assert!(combine(&rows, &[0, 1], &[0, 1], Combiner::Sum).is_err());
    let g = Tensor::zeros(vec![1, 3]).unwrap();
    assert!(scatter_pooled_grad(&g, &[0], &[0, 1], 2, Combiner::Mean).is_ok());
    assert!(scatter_pooled_grad(&g, &[0], &[0, 0, 1], 2, Combiner::Mean).is_err());
    assert!(scatter_pooled_grad(&g, &[0], &[0, 1], usize::MAX, Combiner::Sum).is_err());
    assert!(matches!(
        Tensor::new(vec![2, 2], vec![1.0]),
        Err(TensorError::LenMismatch { .. })
    ));
}

#[test]
fn empty_examples_pool_to_zero() {
    let rows = Tensor::new(vec![1, 2], vec![1.0, 2.0]).unwrap();
    let m = combine(&rows, &[0, 0], &[0, 0, 2], Combiner::Mean).unwrap();
    assert_eq!(m.data(), &[0.0, 0.0, 1.0, 2.0]);
    let s = combine(&rows, &[0, 0], &[0, 0, 2], Combiner::Sum).unwrap();
    assert_eq!(s.data(), &[0.0, 0.0, 2.0, 4.0]);
}

#[test]
fn empty_batch_runs() {
    for protocol in [Protocol::StarServer, Protocol::StarServerLite] {
        let spec = small_wdl();
        let model = Model::build(spec.clone()).unwrap();
        let p = partition(&model, protocol);
        let mut store = Store::new(&model, 43);
        let b = batch(&mut rng(44), &spec, 0);
        let (feeds, _) = step_feeds(&p, &mut store, &b);
        let out = p
            .forward_backward(&Executor::new(0).unwrap(), feeds)
            .unwrap();
        assert_eq!(out.loss, 0.0);
        assert!(out.probs.is_empty());
        assert!(out
            .dense_grads
            .iter()
            .all(|(_, g)| g.data().iter().all(|v| *v == 0.0)));
    }
}

/// Every batch-shaped feed must agree on the batch size `B`: a `[1,D]`
/// lookup feed must not be broadcast as a bias over `B` rows.
#[test]
fn feeds_must_agree_on_the_batch_size() {
    let spec = small_wdl();
    let model = Model::build(spec.clone()).unwrap();
    let lite = partition(&model, Protocol::StarServerLite);
    let mut store = Store::new(&model, 45);
    let b = batch(&mut rng(46), &spec, 8);
    let (good, _) = step_feeds(&lite, &mut store, &b);
    assert!(run(&lite, good.clone()).is_ok());

    // Lookup 0 is the wide embedding (width 1), added to the wide `[B,1]`.
    let mut f = good.clone();
    f.lookups[0] = LookupFeed::Pooled(Tensor::zeros(vec![1, 1]).unwrap());
    let e = run(&lite, f).unwrap_err();
    assert!(
        matches!(&e, GraphError::Shape { op: "Pooled", detail } if detail.contains("lookup 0")),
        "{e}"
    );
    // Any other pooled lookup too.
    let mut f = good.clone();
    f.lookups[2] = LookupFeed::Pooled(Tensor::zeros(vec![7, 2]).unwrap());
    let e = run(&lite, f).unwrap_err();
    assert!(
        matches!(&e, GraphError::Shape { op: "Pooled", detail } if detail.contains("lookup 2")),
        "{e}"
    );
    // Labels and numeric input.
    let mut f = good.clone();
    f.labels = Tensor::zeros(vec![1, 1]).unwrap();
    let e = run(&lite, f).unwrap_err();
    assert!(
        matches!(&e, GraphError::Shape { op: "Input", detail } if detail.contains("input 1")),
        "{e}"
    );
    let mut f = good;
    f.numeric = Tensor::zeros(vec![1, 3]).unwrap();
    assert!(matches!(
        run(&lite, f),
        Err(GraphError::Shape { op: "Input", .. })
    ));

    // Rows feeds: offsets must have B+1 entries.
    let robust = partition(&model, Protocol::StarServer);
    let (good, _) = step_feeds(&robust, &mut store, &b);
    assert!(run(&robust, good.clone()).is_ok());
    let mut f = good.clone();
    f.lookups[0] = LookupFeed::Rows {
        rows: Tensor::zeros(vec![1, 1]).unwrap(),
        index: vec![0],
        offsets: vec![0, 1],
    };
    let e = run(&robust, f).unwrap_err();
    assert!(
        matches!(&e, GraphError::Shape { op: "EmbeddingLookup", detail } if detail.contains("lookup 0")),
        "{e}"
    );
    // Empty offsets are still a layout error.
    let mut f = good;
    f.lookups[0] = LookupFeed::Rows {
        rows: Tensor::zeros(vec![1, 1]).unwrap(),
        index: vec![],
        offsets: vec![],
    };
    assert!(matches!(
        run(&robust, f),
        Err(GraphError::BadOffsets { index: 0, .. })
    ));
}

/// A batch of examples with no columns: `[B,0] + [0]` is `[B,0]`.
#[test]
fn adding_zero_width_tensors() {
    for bias in [vec![0], vec![1, 0]] {
        let mut g = GraphBuilder::new();
        let labels = g.input(0, 1);
        let x = g.variable(VarId(0), vec![3, 0]);
        let b = g.variable(VarId(1), bias.clone());
        let s = g.add(x, b);
        let w = g.variable(VarId(2), vec![0, 1]);
        let logits = g.matmul(s, w);
        let loss = g.sigmoid_cross_entropy(logits, labels);
        let graph = std::sync::Arc::new(g.build(loss).unwrap());
        let feeds = GraphFeeds {
            inputs: vec![Tensor::zeros(vec![3, 1]).unwrap()],
            dense: vec![
                (VarId(0), Tensor::zeros(vec![3, 0]).unwrap()),
                (VarId(1), Tensor::zeros(bias.clone()).unwrap()),
                (VarId(2), Tensor::zeros(vec![0, 1]).unwrap()),
            ],
            lookups: vec![],
        };
        let out = graph.run(&Executor::new(0).unwrap(), feeds, true).unwrap();
        assert_eq!(out.probs, vec![0.5; 3]);
        let (_, gb) = out
            .dense_grads
            .iter()
            .find(|(v, _)| *v == VarId(1))
            .unwrap();
        assert_eq!(gb.shape(), bias.as_slice());
    }
}

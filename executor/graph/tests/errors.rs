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
    // A different batch size in one lookup is caught by the ops.
    let f = with_rows(&good, |_, _, off| {
        let last = *off.last().unwrap();
        off.push(last);
    });
    assert!(matches!(run(&p, f), Err(GraphError::Shape { .. })));

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

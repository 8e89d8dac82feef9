//! The executor gives bit-identical results inline and with compute threads,
//! under concurrent and repeated runs.

mod common;

use common::*;
use starwire_graph::*;

fn bits(out: &StepOutput) -> Vec<u32> {
    let mut v = vec![out.loss.to_bits()];
    v.extend(out.probs.iter().map(|p| p.to_bits()));
    for (var, g) in &out.dense_grads {
        v.push(var.0);
        v.extend(g.data().iter().map(|x| x.to_bits()));
    }
    for g in &out.lookup_grads {
        let (LookupGrad::Rows(t) | LookupGrad::Pooled(t)) = g;
        v.extend(t.data().iter().map(|x| x.to_bits()));
    }
    v
}

struct Case {
    p: Partitioned,
    feeds: StepFeeds,
    expected: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let inline = Executor::new(0).unwrap();
    let mut out = Vec::new();
    for (i, spec) in [small_lr(), small_wdl(), ModelSpec::wdl(4)]
        .into_iter()
        .enumerate()
    {
        let model = Model::build(spec.clone()).unwrap();
        for protocol in [Protocol::StarServer, Protocol::StarServerLite] {
            let p = partition(&model, protocol);
            let mut store = Store::new(&model, 31 + i as u64);
            let b = batch(&mut rng(32 + i as u64), &spec, 24);
            let (feeds, _) = step_feeds(&p, &mut store, &b);
            let expected = bits(&p.forward_backward(&inline, feeds.clone()).unwrap());
            out.push(Case { p, feeds, expected });
        }
    }
    out
}

#[test]
fn threads_give_bit_identical_results() {
    let cases = cases();
    // Threshold 0 hands every op off; the default hands off only big ones.
    for exec in [
        Executor::with_threshold(2, 0).unwrap(),
        Executor::with_threshold(1, 0).unwrap(),
        Executor::with_threshold(3, 2000).unwrap(),
        Executor::new(2).unwrap(),
    ] {
        let before = exec.handoffs();
        for c in &cases {
            for _ in 0..3 {
                let got = bits(&c.p.forward_backward(&exec, c.feeds.clone()).unwrap());
                assert!(got == c.expected, "threads {} differ", exec.threads());
            }
        }
        // At B=24 no op reaches the default 1 MFLOP; the low thresholds
        // must have handed some off.
        if exec.handoff_flops() <= 2000 {
            assert!(exec.handoffs() > before, "some ops ran on compute threads");
        }
    }
}

#[test]
fn inline_executor_never_hands_off() {
    let exec = Executor::new(0).unwrap();
    for c in &cases() {
        let got = bits(&c.p.forward_backward(&exec, c.feeds.clone()).unwrap());
        assert!(got == c.expected);
    }
    assert_eq!(exec.handoffs(), 0);
    // A threshold above every op keeps everything inline too.
    let exec = Executor::with_threshold(2, u64::MAX).unwrap();
    let c = &cases()[0];
    c.p.forward_backward(&exec, c.feeds.clone()).unwrap();
    assert_eq!(exec.handoffs(), 0);
}

#[test]
fn concurrent_runs_stress() {
    let cases = cases();
    let exec = Executor::with_threshold(2, 500).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (cases, exec) = (&cases, &exec);
            s.spawn(move || {
                for round in 0..25 {
                    let c = &cases[(t + round) % cases.len()];
                    let got = bits(&c.p.forward_backward(exec, c.feeds.clone()).unwrap());
                    assert!(got == c.expected, "thread {t} round {round} differs");
                    let probs = c.p.forward(exec, c.feeds.clone()).unwrap();
                    let want: Vec<u32> = c.expected[1..=probs.len()].to_vec();
                    assert_eq!(probs.iter().map(|p| p.to_bits()).collect::<Vec<_>>(), want);
                }
            });
        }
    });
}

#[test]
fn errors_come_back_from_compute_threads() {
    // Labels with the wrong row count are refused before anything runs.
    let exec = Executor::with_threshold(2, 0).unwrap();
    let c = &cases()[1];
    let mut feeds = c.feeds.clone();
    feeds.labels = Tensor::zeros(vec![3, 1]).unwrap();
    assert!(matches!(
        c.p.forward_backward(&exec, feeds),
        Err(GraphError::Shape { op: "Input", .. })
    ));
    // Variables whose shapes the graph gets wrong only fail inside the
    // matmul kernel, on a compute thread.
    let mut g = GraphBuilder::new();
    let labels = g.input(0, 1);
    let x = g.variable(VarId(0), vec![2, 3]);
    let w = g.variable(VarId(1), vec![4, 1]);
    let logits = g.matmul(x, w);
    let loss = g.sigmoid_cross_entropy(logits, labels);
    let graph = std::sync::Arc::new(g.build(loss).unwrap());
    let feeds = GraphFeeds {
        inputs: vec![Tensor::zeros(vec![2, 1]).unwrap()],
        dense: vec![
            (VarId(0), Tensor::zeros(vec![2, 3]).unwrap()),
            (VarId(1), Tensor::zeros(vec![4, 1]).unwrap()),
        ],
        lookups: vec![],
    };
    let before = exec.handoffs();
    for _ in 0..10 {
        assert!(matches!(
            graph.run(&exec, feeds.clone(), true),
            Err(GraphError::Shape { op: "MatMul", .. })
        ));
    }
    assert!(exec.handoffs() > before);
    // And the executor still works afterwards.
    let got = bits(&c.p.forward_backward(&exec, c.feeds.clone()).unwrap());
    assert!(got == c.expected);
}

#[test]
fn executor_reports_its_configuration() {
    let e = Executor::new(0).unwrap();
    assert_eq!(e.threads(), 0);
    assert_eq!(e.handoff_flops(), DEFAULT_HANDOFF_FLOPS);
    assert_eq!(Executor::with_threshold(2, 7).unwrap().threads(), 2);
}

/// A step's buffers come back for the next step even when the last task
/// ran on a compute thread: the thread lets go of the run before the
/// caller wakes up.
#[test]
fn buffers_come_back_from_compute_threads() {
    let spec = small_wdl();
    let model = Model::build(spec.clone()).unwrap();
    let p = partition(&model, Protocol::StarServer);
    let mut store = Store::new(&model, 51);
    let b = batch(&mut rng(52), &spec, 16);
    let (feeds, _) = step_feeds(&p, &mut store, &b);
    // Every task goes to the one compute thread, the last one included.
    let exec = Executor::with_threshold(1, 0).unwrap();
    let mut bufs = RunBuffers::default();
    for step in 0..3000 {
        p.forward_backward_with(&exec, feeds.clone(), &mut bufs)
            .unwrap();
        let kept = bufs.take_rows_feed(0);
        assert!(
            kept.index.capacity() > 0 && kept.offsets.capacity() > 0,
            "step {step}: the rows feed's buffers were not kept"
        );
    }
}

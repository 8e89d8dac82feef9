//! The full-size reference figure: logistic regression with Adagrad, 2 epochs
//! of the default 200k synthetic examples, evaluated on 100k eval examples
//! against the true model, plus generation and parsing throughput.
//!
//! `cargo run -p starwire-data --release --example reference [epochs] [batch] [lr initial_accumulator [seed [examples]]]`
#![deny(unsafe_code)]

use std::time::Instant;

use starwire_data::{
    auc, logloss, Batch, CriteoReader, Optimizer, ReaderOptions, ReferenceLr, Synthetic,
    SyntheticSpec,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let epochs: usize = args.next().map_or(Ok(2), |a| a.parse())?;
    let batch_size: usize = args.next().map_or(Ok(256), |a| a.parse())?;
    let optimizer = match (args.next(), args.next()) {
        (Some(lr), Some(acc)) => Optimizer::Adagrad {
            lr: lr.parse()?,
            initial_accumulator: acc.parse()?,
        },
        _ => Optimizer::DEFAULT_ADAGRAD,
    };
    println!("{optimizer:?}, batch {batch_size}, {epochs} epochs");
    let mut spec = SyntheticSpec::default();
    if let Some(seed) = args.next() {
        spec.seed = seed.parse()?;
    }
    if let Some(n) = args.next() {
        spec.examples_per_epoch = n.parse()?;
    }

    let t = Instant::now();
    let mut train = Synthetic::train(spec)?;
    println!(
        "model built in {:.3}s, bias {:.3}",
        t.elapsed().as_secs_f64(),
        train.model().bias()
    );

    // Generation throughput (one core).
    let mut b = Batch::with_capacity(4096);
    let t = Instant::now();
    let mut n = 0;
    while train.next_batch(4096, &mut b) > 0 {
        n += b.len;
    }
    let gen_rate = n as f64 / t.elapsed().as_secs_f64();
    println!("generate: {n} examples, {:.2} M examples/s", gen_rate / 1e6);
    train.rewind();

    // Parsing throughput.
    let dir = std::env::temp_dir().join(format!("starwire-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("train.tsv");
    train.write_criteo(&path)?;
    let bytes = std::fs::metadata(&path)?.len();
    let mut reader = CriteoReader::open(&path, ReaderOptions::default())?;
    let t = Instant::now();
    let mut n = 0;
    while reader.next_batch(4096, &mut b)? > 0 {
        n += b.len;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "parse: {n} examples, {:.2} M examples/s, {:.0} MB/s",
        n as f64 / secs / 1e6,
        bytes as f64 / secs / 1e6
    );
    std::fs::remove_dir_all(&dir)?;

    let eval = train.eval_stream(100_000).collect_epoch();
    let oracle = train.model().oracle_auc(&eval);
    let oracle_probs: Vec<f32> = (0..eval.len)
        .map(|i| train.model().oracle_prob(&eval, i))
        .collect();
    println!(
        "oracle: auc {oracle:.4} logloss {:.4} (eval ctr {:.4})",
        logloss(&eval.labels, &oracle_probs),
        eval.labels.iter().sum::<f32>() / eval.len as f32
    );

    let mut model = ReferenceLr::new(optimizer);
    let mut p = Vec::new();
    let t = Instant::now();
    for epoch in 1..=epochs {
        train.rewind();
        while train.next_batch(batch_size, &mut b) > 0 {
            model.fit_batch(&b);
        }
        model.predict_batch(&eval, &mut p);
        let a = auc(&eval.labels, &p);
        println!(
            "epoch {epoch}: auc {a:.4} (oracle - {:.4}) logloss {:.4} keys {}",
            oracle - a,
            logloss(&eval.labels, &p),
            model.num_keys()
        );
    }
    println!("training took {:.2}s", t.elapsed().as_secs_f64());
    Ok(())
}

//! Generation and parsing throughput, one core.
//!
//! `cargo run -p starwire-data --release --example throughput [examples]`
//!
//! Prints rates per second of wall-clock time and, on Linux, per second of
//! this (single-threaded) process's CPU time from `/proc/self/schedstat`,
//! which stays meaningful on a shared, loaded machine.
#![deny(unsafe_code)]

use std::time::Instant;

use starwire_data::{Batch, CriteoReader, ReaderOptions, Synthetic, SyntheticSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::args()
        .nth(1)
        .map_or(Ok(1_000_000), |a| a.parse())?;
    let mut generator = Synthetic::train(SyntheticSpec {
        examples_per_epoch: n,
        ..Default::default()
    })?;
    let mut batch = Batch::with_capacity(4096);

    let clock = Clock::start();
    let mut drawn = 0;
    while generator.next_batch(4096, &mut batch) > 0 {
        drawn += batch.len;
    }
    clock.report("generate", drawn);

    let dir = tempfile_dir()?;
    let path = dir.join("synthetic.tsv");
    generator.write_criteo(&path)?;
    let bytes = std::fs::metadata(&path)?.len();
    let mut reader = CriteoReader::open(&path, ReaderOptions::default())?;
    println!("file: {:.0} MB", bytes as f64 / 1e6);
    let clock = Clock::start();
    let mut parsed = 0;
    while reader.next_batch(4096, &mut batch)? > 0 {
        parsed += batch.len;
    }
    clock.report("parse", parsed);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("starwire-data-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

struct Clock {
    wall: Instant,
    cpu_ns: Option<u64>,
}

impl Clock {
    fn start() -> Self {
        Self {
            wall: Instant::now(),
            cpu_ns: cpu_ns(),
        }
    }

    fn report(&self, what: &str, n: usize) {
        let wall = self.wall.elapsed().as_secs_f64();
        print!(
            "{what}: {n} examples, {:.2} M/s wall",
            n as f64 / wall / 1e6
        );
        if let (Some(a), Some(b)) = (self.cpu_ns, cpu_ns()) {
            let cpu = (b - a) as f64 / 1e9;
            print!(", {:.2} M/s per CPU-second", n as f64 / cpu / 1e6);
        }
        println!();
    }
}

/// Time this process has spent on a CPU, in ns (Linux only).
fn cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

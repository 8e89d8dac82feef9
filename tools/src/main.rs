//! `starwire`: train sparse models on PS/worker clusters, and benchmark,
//! soak-test and inspect starwire transports.
//! See docs/CLI.md.
#![deny(unsafe_code)]

mod backend;
mod bench;
mod info;
mod rdma;
mod report;
mod soak;
mod stats;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// starwire: benchmark, soak-test and inspect starwire transports.
#[derive(Debug, Parser)]
#[command(name = "starwire", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Compare the raw-socket baseline with starwire backends
    /// (latency, message rate, bandwidth, fusion).
    Bench(bench::BenchArgs),
    /// Many connections for a while; checks for lost, duplicated, corrupted
    /// and reordered messages.
    Soak(soak::SoakArgs),
    /// Backends, kernel features, topology and effective settings.
    Info(info::InfoArgs),
    /// Train a sparse model on a local loopback cluster (PS and workers as
    /// threads of this process); the main job.
    Train(train::TrainArgs),
    /// Run one PS task of a multi-host cluster.
    Ps(train::RoleArgs),
    /// Run one worker task of a multi-host cluster.
    Worker(train::RoleArgs),
    /// Compare the strategies of assigning variables to PS tasks
    /// (`--placement` rr, greedy, anneal) on a model.
    Place(train::PlaceArgs),
    /// Write the synthetic data set as a Criteo TSV file.
    Data(train::DataArgs),
    /// Train the single-process reference logistic regression on the same
    /// data (the check on `train`).
    Reference(train::ReferenceArgs),
    /// The standard suite across every compiled-in backend: report.md,
    /// report.json and SVG plots in --out DIR.
    Report(report::ReportArgs),
}

/// `on|off`, or any boolean the DeepRec variables accept (true/false/1/0).
pub(crate) fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => starwire_config::parse_bool(s)
            .ok_or_else(|| format!("expected on or off, got {:?}", s.trim())),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Command::Bench(a) => bench::main(a).map(|()| true),
        Command::Soak(a) => soak::main(a),
        Command::Info(a) => info::main(a).map(|()| true),
        Command::Train(a) => train::main(a).map(|()| true),
        Command::Ps(a) => train::ps_main(a).map(|()| true),
        Command::Worker(a) => train::worker_main(a).map(|()| true),
        Command::Place(a) => train::place_main(a).map(|()| true),
        Command::Data(a) => train::data_main(a).map(|()| true),
        Command::Reference(a) => train::reference_main(a).map(|()| true),
        Command::Report(a) => report::main(a, Some(&train::ReportTrain)).map(|()| true),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("starwire: error: {e}");
            ExitCode::FAILURE
        }
    }
}

//! `starwire`: train sparse models on PS/worker clusters, and benchmark,
//! soak-test and inspect starwire transports.
//! See docs/CLI.md.
#![deny(unsafe_code)]

mod backend;
mod bench;
mod checkpoint;
#[cfg(feature = "dpdk")]
mod dpdk;
mod failure;
mod guard;
mod info;
mod launch;
mod logging;
mod metrics;
mod progress;
mod rdma;
mod report;
mod rss;
mod soak;
mod stats;
mod train;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use failure::Failure;

/// `starwire --version`: the package version and the commit it was built
/// from (`unknown` outside a git checkout).
pub(crate) const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("STARWIRE_GIT_COMMIT"),
    ")"
);

/// starwire: benchmark, soak-test and inspect starwire transports.
#[derive(Debug, Parser)]
#[command(name = "starwire", version = VERSION, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
    #[command(flatten)]
    log: logging::LogArgs,
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
    Train(train::LocalArgs),
    /// Run one PS task of a multi-host cluster.
    Ps(launch::PsArgs),
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
    /// Inspect a checkpoint directory, or bring a full shard file to an
    /// incremental checkpoint's step (apply-delta).
    Checkpoint(checkpoint::CheckpointArgs),
    /// The standard suite across every compiled-in backend: report.md,
    /// report.json and SVG plots in --out DIR.
    Report(report::ReportArgs),
    /// Print a completion script for SHELL (bash, zsh, fish, elvish,
    /// powershell) on stdout.
    Completions(CompletionsArgs),
}

/// `starwire completions SHELL`.
#[derive(Debug, clap::Args)]
struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
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

/// The command line: [`Cli`], with `ps` and `worker` flags grouped by
/// role in `--help` ([`train::role_headings`]).
fn command() -> clap::Command {
    train::role_headings(Cli::command())
}

fn main() -> ExitCode {
    let cli = Cli::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit());
    logging::init(&cli.log);
    let r: Result<bool, Failure> = match cli.cmd {
        Command::Bench(a) => bench::validate(&a)
            .map_err(Failure::Usage)
            .and_then(|()| Ok(bench::main(a)?))
            .map(|()| true),
        Command::Soak(a) => soak::validate(&a)
            .map_err(Failure::Usage)
            .and_then(|()| soak::main(a)),
        Command::Info(a) => info::main(a).map(|()| true),
        Command::Train(a) => train::main(a).map(|()| true),
        Command::Ps(a) => train::ps_main(a).map(|()| true),
        Command::Worker(a) => train::worker_main(a).map(|()| true),
        Command::Place(a) => train::place_main(a).map(|()| true).map_err(Failure::Usage),
        Command::Data(a) => train::data_main(a).map(|()| true),
        Command::Reference(a) => train::reference_main(a)
            .map(|()| true)
            .map_err(Failure::Run),
        Command::Checkpoint(a) => checkpoint::main(a).map(|()| true).map_err(Failure::Run),
        Command::Report(a) => report::main(a, Some(&train::ReportTrain))
            .map(|()| true)
            .map_err(Failure::Run),
        Command::Completions(a) => {
            clap_complete::generate(a.shell, &mut command(), "starwire", &mut std::io::stdout());
            Ok(true)
        }
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("starwire: error: {}", e.message());
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command line is well formed, and every flag
    /// [`train::role_headings`] names is one of `ps` and `worker` (it
    /// would panic building the command otherwise).
    #[test]
    fn the_command_line_with_role_headings_is_well_formed() {
        let cmd = command();
        cmd.clone().debug_assert();
        let heading = |sub: &str, id: &str| {
            cmd.find_subcommand(sub)
                .and_then(|c| c.get_arguments().find(|a| a.get_id() == id))
                .and_then(|a| a.get_help_heading())
                .map(str::to_owned)
        };
        assert_eq!(heading("ps", "max_rows").as_deref(), Some("PS options"));
        assert_eq!(
            heading("worker", "prefetch").as_deref(),
            Some("Worker options")
        );
        assert_eq!(heading("train", "prefetch"), None);
    }
}

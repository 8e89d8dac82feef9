//! Logs and progress lines on stderr, through tracing.
//!
//! By default warnings, errors, status lines (the `status` target: what
//! runs and where it serves) and progress lines (the `progress` target: PS
//! and worker progress every `--log-every`) show; `--quiet` hides
//! progress. `RUST_LOG` replaces the default filter
//! (`--quiet` still hides progress). Colour only when stderr is a
//! terminal. `--log-format json` writes one JSON object per line. Lines
//! are written through [`crate::progress::LogWriter`], which hides a
//! progress bar while a line is written.

use std::io::IsTerminal;

use clap::{Args, ValueEnum};
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields).
    Json,
}

/// The logging flags, accepted by every command.
#[derive(Debug, Clone, Default, Args)]
pub struct LogArgs {
    /// Hide progress lines (warnings and errors still show).
    #[arg(long, global = true)]
    pub quiet: bool,
    /// Log lines on stderr as text or json.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Warnings, errors, progress and status lines.
const DEFAULT_FILTER: &str = "warn,progress=info,status=info";

/// The filter: `RUST_LOG` if set, else [`DEFAULT_FILTER`]; `quiet` turns
/// the `progress` target off (a later directive for a target replaces an
/// earlier one).
fn filter(quiet: bool, rust_log: Option<&str>) -> EnvFilter {
    let quiet = if quiet { ",progress=off" } else { "" };
    let default = || EnvFilter::new(format!("{DEFAULT_FILTER}{quiet}"));
    match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        Some(s) => EnvFilter::try_new(format!("{s}{quiet}")).unwrap_or_else(|e| {
            eprintln!("starwire: RUST_LOG={s:?} ignored: {e}");
            default()
        }),
        None => default(),
    }
}

/// Install the subscriber for this process.
pub fn init(a: &LogArgs) {
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = filter(a.quiet, rust_log.as_deref());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(crate::progress::LogWriter)
        .with_ansi(std::io::stderr().is_terminal());
    match a.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_hides_progress_whatever_rust_log_says() {
        for rust_log in [None, Some("info"), Some("debug,progress=info")] {
            let f = filter(true, rust_log).to_string();
            assert!(f.contains("progress=off"), "{rust_log:?}: {f}");
        }
        let f = filter(false, None).to_string();
        assert!(
            f.contains("progress=info") && !f.contains("progress=off"),
            "{f}"
        );
        // A RUST_LOG that does not parse falls back to the default.
        let f = filter(false, Some("=nonsense=")).to_string();
        assert!(f.contains("progress=info"), "{f}");
    }
}

//! How a command fails, and the exit status that says so: 2 for a usage
//! error (a bad flag or value, a combination of flags that cannot work,
//! a backend that is not compiled in), 1 for a failure at run time (a
//! peer that went away, a file that cannot be read, a failed soak).
//!
//! Flags whose values can be checked alone are checked by clap (it exits
//! with 2 and names the flag); checks across flags return
//! [`Failure::Usage`].

use std::process::ExitCode;

/// A command's failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The command line cannot work: exit status 2.
    Usage(String),
    /// The run failed: exit status 1.
    Run(String),
}

impl From<String> for Failure {
    /// Errors are run-time errors unless a command says otherwise.
    fn from(s: String) -> Self {
        Failure::Run(s)
    }
}

impl Failure {
    /// The exit status.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            Failure::Usage(_) => ExitCode::from(2),
            Failure::Run(_) => ExitCode::FAILURE,
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        match self {
            Failure::Usage(m) | Failure::Run(m) => m,
        }
    }
}

/// A count that must be at least 1 (`--ps`, `--workers`, ...), for
/// clap's `value_parser`.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("expected a whole number: {e}")),
    }
}

/// Most PS tasks or workers `starwire train` starts in its one process:
/// each is a thread with its own sockets and reactors, and past this many
/// the process runs out of descriptors far from the flag's cause.
pub const MAX_LOCAL_TASKS: usize = 1024;

/// A count of local tasks (`train --ps`, `--workers`) for clap's
/// `value_parser`: from 1 to [`MAX_LOCAL_TASKS`].
pub fn local_tasks(s: &str) -> Result<usize, String> {
    match at_least_one(s)? {
        n if n > MAX_LOCAL_TASKS => Err(format!(
            "{n} is over {MAX_LOCAL_TASKS}, the most one process runs (start ps and worker \
             processes for a larger cluster)"
        )),
        n => Ok(n),
    }
}

/// A `HOST:PORT` (`--metrics-addr`), for clap's `value_parser`: a host
/// (a name, an IPv4 address or a bracketed IPv6 one) and a port number.
/// The host is resolved when the endpoint starts.
pub fn host_port(s: &str) -> Result<String, String> {
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(format!("expected HOST:PORT, got {s:?}"));
    };
    if host.is_empty() {
        return Err(format!(
            "no host in {s:?} (HOST:PORT; 0.0.0.0 for every address)"
        ));
    }
    port.parse::<u16>()
        .map_err(|e| format!("port {port:?} in {s:?}: {e}"))?;
    Ok(s.to_owned())
}

/// A finite number above 0 (`reference --lr`, `place --zipf`, ...), for
/// clap's `value_parser`: NaN, infinities, 0 and negatives are refused.
pub fn positive_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("expected a finite number above 0, got {v}")),
        Err(e) => Err(format!("expected a number: {e}")),
    }
}

/// [`positive_f64`] for an `f32` flag (the value must be finite as an
/// `f32` too).
pub fn positive_f32(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("expected a finite number above 0, got {v}")),
        Err(e) => Err(format!("expected a number: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_start_at_one() {
        assert_eq!(at_least_one("3"), Ok(3));
        assert_eq!(at_least_one(" 1 "), Ok(1));
        assert!(at_least_one("0").unwrap_err().contains("at least 1"));
        assert!(at_least_one("-1").is_err());
        assert!(at_least_one("two").is_err());
    }

    #[test]
    fn positive_numbers_are_finite_and_above_zero() {
        assert_eq!(positive_f64("1e-5"), Ok(1e-5));
        assert_eq!(positive_f32(" 0.5 "), Ok(0.5));
        for bad in ["nan", "NaN", "inf", "-inf", "0", "-1", "1e39x", ""] {
            assert!(positive_f64(bad).is_err(), "{bad}");
            assert!(positive_f32(bad).is_err(), "{bad}");
        }
        // Finite as an f64, infinite as an f32.
        assert!(positive_f32("1e39").is_err());
    }

    #[test]
    fn usage_exits_2_and_run_time_1() {
        assert_eq!(Failure::Usage("x".into()).exit_code(), ExitCode::from(2));
        assert_eq!(Failure::from("y".to_owned()).exit_code(), ExitCode::FAILURE);
        assert_eq!(Failure::Usage("x".into()).message(), "x");
    }
}

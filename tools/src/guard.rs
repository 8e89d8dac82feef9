//! The flags of the cluster token and of a PS task's bounds, shared by
//! `train`, `ps`, `worker` (and the token ones by `bench`). See
//! docs/SECURITY.md.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use starwire_train::cluster::Guard;
use starwire_transport::auth::TOKEN_ENV;
use starwire_transport::ClusterToken;

/// Where the cluster token comes from, and whether a listener may do
/// without one.
#[derive(Debug, Clone, Args)]
pub struct TokenArgs {
    /// File holding the cluster token (at least 16 bytes; else
    /// STARWIRE_CLUSTER_TOKEN). Every task of a cluster needs the same.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Serve starwire peers on a non-loopback address without a token.
    #[arg(long)]
    pub insecure: bool,
}

impl TokenArgs {
    /// The token of `--token-file`, else of the environment, if any.
    pub fn token(&self) -> Result<Option<ClusterToken>, String> {
        match &self.token_file {
            Some(p) => ClusterToken::from_file(p).map(Some),
            None => ClusterToken::from_env(),
        }
        .map_err(|e| match &self.token_file {
            Some(_) => e.to_string(),
            None => format!("{TOKEN_ENV}: {e}"),
        })
    }
}

/// The cluster token and the bounds of a PS task (`train` and `ps`).
#[derive(Debug, Clone, Args)]
pub struct GuardArgs {
    /// The token.
    #[command(flatten)]
    pub token: TokenArgs,
    /// Most connections a PS task holds at once (at least 1); more are
    /// closed at accept [default: 1024; `train` raises it to what its
    /// local cluster holds].
    #[arg(long, value_parser = crate::failure::at_least_one)]
    pub max_connections: Option<usize>,
    /// Seconds a peer may take from connect to the end of its handshake.
    #[arg(long, default_value_t = 10)]
    pub handshake_timeout_secs: u64,
    /// Close a PS connection that receives and sends nothing, or whose
    /// peer reads none of its replies, for this many seconds (0: never).
    #[arg(long, default_value_t = 600)]
    pub idle_timeout_secs: u64,
    /// One budget, in MiB, for the reassembly buffers and reply queues of
    /// all connections of a PS task, and the pushes kept for a --sync step
    /// (on --backend grpc: the requests being served and the replies not
    /// yet written).
    #[arg(long, default_value_t = 1024)]
    pub memory_budget_mb: usize,
    /// Largest pull reply a PS shard writes; a larger pull is refused.
    #[arg(long, default_value_t = 256 << 20)]
    pub max_reply_bytes: usize,
    /// Most rows of each embedding table on a PS shard.
    #[arg(long, default_value_t = 100_000_000)]
    pub max_rows: usize,
    /// Furthest ahead of the global step a WAIT_STEP barrier may be.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_wait_steps: u64,
}

impl GuardArgs {
    /// The flags as the trainer takes them.
    pub fn guard(&self) -> Result<Guard, String> {
        Ok(Guard {
            token: self.token.token()?,
            insecure: self.token.insecure,
            max_connections: self
                .max_connections
                .unwrap_or(starwire_transport::accept::DEFAULT_MAX_CONNECTIONS),
            handshake_timeout: Duration::from_secs(self.handshake_timeout_secs.max(1)),
            idle_timeout: (self.idle_timeout_secs > 0)
                .then(|| Duration::from_secs(self.idle_timeout_secs)),
            memory_budget_mb: self.memory_budget_mb,
            max_reply_bytes: self.max_reply_bytes,
            max_rows: self.max_rows,
            max_wait_steps: self.max_wait_steps,
        })
    }
}

/// Exit status of a listener refused for want of a token.
pub const EXIT_INSECURE: u8 = 2;

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        g: GuardArgs,
    }

    #[test]
    fn the_defaults_are_the_trainers() {
        let g = Cli::parse_from(["x"]).g.guard().expect("guard");
        let d = Guard::default();
        assert_eq!(Guard { token: None, ..g }, Guard { token: None, ..d });
    }

    #[test]
    fn a_token_file_is_read_and_a_short_one_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let p = dir.path().join("token");
        std::fs::write(&p, "0123456789abcdef0123\n").expect("write");
        let a = Cli::parse_from(["x", "--token-file", p.to_str().expect("utf-8")]);
        let g = a.g.guard().expect("guard");
        assert_eq!(
            g.token,
            Some(ClusterToken::new(b"0123456789abcdef0123").expect("token"))
        );
        std::fs::write(&p, "short").expect("write");
        let e = a.g.guard().expect_err("too short");
        assert!(e.contains("at least 16"), "{e}");
        let g = Cli::parse_from(["x", "--idle-timeout-secs", "0"]).g.guard();
        assert_eq!(g.expect("guard").idle_timeout, None);
    }
}

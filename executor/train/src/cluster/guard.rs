//! Who may talk to a PS task and what any one peer may cost it: the
//! cluster token, the bounds of a PS task, and the training flags every
//! task of a cluster must agree on (see docs/SECURITY.md).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use starwire_ps::OptimizerKind;
use starwire_transport::accept::{AcceptConfig, DEFAULT_MAX_CONNECTIONS};
use starwire_transport::{ClusterToken, ConnConfig, MemoryBudget};

use super::config::{model_name, protocol_name, TrainConfig};
use crate::TrainError;

/// The cluster token and a PS task's bounds (`--token-file`,
/// `--max-connections`, ...). The defaults are the flags' defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Guard {
    /// The cluster token; `None`: peers are not authenticated (loopback
    /// or `--insecure` only).
    pub token: Option<ClusterToken>,
    /// Listen on a non-loopback address without a token (`--insecure`).
    pub insecure: bool,
    /// Most connections a PS task holds at once.
    pub max_connections: usize,
    /// How long a peer may take from connect to the end of its
    /// handshake.
    pub handshake_timeout: Duration,
    /// A connection that moves nothing (or whose peer reads nothing) this
    /// long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
    /// One budget, in MiB, for the reassembly buffers and reply queues of
    /// all of a PS task's connections.
    pub memory_budget_mb: usize,
    /// Largest pull reply, in bytes.
    pub max_reply_bytes: usize,
    /// Most rows of each table on a shard.
    pub max_rows: usize,
    /// Furthest a `WAIT_STEP` may be ahead of the global step.
    pub max_wait_steps: u64,
}

/// `--handshake-timeout-secs` default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// `--idle-timeout-secs` default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// `--memory-budget-mb` default.
pub const DEFAULT_MEMORY_BUDGET_MB: usize = 1024;

impl Default for Guard {
    fn default() -> Self {
        Self {
            token: None,
            insecure: false,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            memory_budget_mb: DEFAULT_MEMORY_BUDGET_MB,
            max_reply_bytes: starwire_ps::DEFAULT_MAX_REPLY_BYTES,
            max_rows: starwire_ps::DEFAULT_MAX_ROWS,
            max_wait_steps: crate::psserver::DEFAULT_MAX_WAIT_STEPS,
        }
    }
}

impl Guard {
    /// Refuse to serve peers on `addr` without a token unless it is a
    /// loopback address or `--insecure` was given (every backend, the gRPC
    /// baseline included, authenticates its peers with the token).
    pub fn check_listen(&self, addr: SocketAddr) -> Result<(), TrainError> {
        check_listen(addr, self.token.is_some(), self.insecure)
    }

    /// What the acceptor of a PS task enforces.
    pub(super) fn accept_config(&self) -> AcceptConfig {
        AcceptConfig {
            preamble_timeout: self.handshake_timeout,
            max_connections: self.max_connections,
            ..AcceptConfig::default()
        }
    }

    /// `cc` with the token and training flags of `cfg`, and, for a PS
    /// task (`budget`), its timeouts and memory budget.
    pub(super) fn apply(
        &self,
        cfg: &TrainConfig,
        mut cc: ConnConfig,
        budget: Option<&MemoryBudget>,
    ) -> ConnConfig {
        cc.token = self.token.clone();
        cc.flags = Arc::from(training_flags(cfg));
        cc.handshake_timeout = Some(self.handshake_timeout);
        if let Some(b) = budget {
            cc.idle_timeout = self.idle_timeout;
            cc.budget = Some(b.clone());
        }
        cc
    }

    /// The memory budget of a PS task.
    pub(crate) fn budget(&self) -> MemoryBudget {
        MemoryBudget::new(self.memory_budget_mb.saturating_mul(1 << 20))
    }
}

/// Refuse a non-loopback `addr` that serves starwire peers without a
/// token, unless `insecure`. The error says what to do.
pub fn check_listen(addr: SocketAddr, token: bool, insecure: bool) -> Result<(), TrainError> {
    if token || insecure || addr.ip().is_loopback() {
        return Ok(());
    }
    Err(TrainError::Insecure(format!(
        "refusing to serve starwire peers on {addr} without a cluster token: anyone who can reach \
         it could read and change the model. Set STARWIRE_CLUSTER_TOKEN or --token-file PATH on \
         every task, or pass --insecure"
    )))
}

/// The training flags every task of a cluster must be given alike, as
/// `name=value` lines (compared in the handshake): those that decide the
/// variables, their shards, their values and the steps.
pub fn training_flags(cfg: &TrainConfig) -> String {
    let mut out = String::new();
    let mut put = |name: &str, value: &dyn std::fmt::Display| {
        out.push_str(name);
        out.push('=');
        out.push_str(&value.to_string());
        out.push('\n');
    };
    put("ps", &cfg.ps);
    put("workers", &cfg.workers);
    put("protocol", &protocol_name(cfg.protocol));
    put("model", &model_name(cfg.model));
    put("train", &cfg.train);
    put("epochs", &cfg.epochs);
    put(
        "steps",
        &cfg.steps.map_or("none".to_string(), |s| s.to_string()),
    );
    put("batch-size", &cfg.batch_size);
    put("embedding-dim", &cfg.embedding_dim);
    put("optimizer", &format!("{:?}", cfg.optimizer).to_lowercase());
    put("lr", &cfg.lr);
    if cfg.lr_scaling != super::config::LrScaling::None || cfg.lr_warmup_steps > 0 {
        put("lr-scaling", &cfg.lr_scaling.name());
        put("lr-warmup-steps", &cfg.lr_warmup_steps);
    }
    let o = &cfg.optimizer_params;
    match cfg.optimizer {
        OptimizerKind::Ftrl => {
            put("beta", &o.ftrl_beta);
            put("l1-regularization-strength", &o.l1);
            put("l2-regularization-strength", &o.l2);
        }
        OptimizerKind::AdagradDecay => {
            put("accumulator-decay-step", &o.decay_step);
            put("accumulator-decay-rate", &o.decay_rate);
        }
        OptimizerKind::DcAsgd => put("dc-lambda", &o.dc_lambda),
        OptimizerKind::Sgd | OptimizerKind::Adagrad | OptimizerKind::Adam => {}
    }
    if o.staleness_lr != starwire_ps::StalenessLr::None {
        put(
            "staleness-lr",
            &format!("{:?}", o.staleness_lr).to_lowercase(),
        );
    }
    // Every worker places every step of the bounded order: a worker with
    // other steps in a row would wait for steps that never come. Given to
    // some tasks and not others, it differs from the PS's for some worker.
    if let Some(k) = cfg
        .turn_steps
        .filter(|_| super::delay::applied_turn_steps(cfg).is_some())
    {
        put("turn-steps", &k);
    }
    put("placement", &format!("{:?}", cfg.assignment));
    put("tensor-fuse", &cfg.tensor_fuse);
    put("sync", &cfg.sync);
    put(
        "checkpoint-every-steps",
        &cfg.checkpoint_every_steps
            .map_or("none".to_string(), |s| s.to_string()),
    );
    put(
        "checkpoint-every-secs",
        &cfg.checkpoint_every_secs
            .map_or("none".to_string(), |s| s.as_secs_f64().to_string()),
    );
    put("seed", &cfg.seed);
    put("filter-freq", &cfg.filter_freq);
    put("steps-to-live", &cfg.steps_to_live);
    put("default-value-dim", &cfg.default_value_dim);
    put("train-examples", &cfg.train_examples);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_loopback_listener_needs_a_token_or_insecure() {
        let any: SocketAddr = "0.0.0.0:7000".parse().expect("addr");
        let lo: SocketAddr = "127.0.0.1:7000".parse().expect("addr");
        let lo6: SocketAddr = "[::1]:7000".parse().expect("addr");
        assert!(check_listen(lo, false, false).is_ok());
        assert!(check_listen(lo6, false, false).is_ok());
        let e = check_listen(any, false, false).expect_err("refused");
        assert!(e.to_string().contains("STARWIRE_CLUSTER_TOKEN"), "{e}");
        assert!(check_listen(any, true, false).is_ok());
        assert!(check_listen(any, false, true).is_ok());
    }

    #[test]
    fn training_flags_name_what_differs() {
        let a = TrainConfig::default();
        let b = TrainConfig {
            embedding_dim: 64,
            ..TrainConfig::default()
        };
        let d = starwire_transport::auth::flags_differ(&training_flags(&a), &training_flags(&b));
        assert_eq!(d, ["--embedding-dim (8 here, 64 at the peer)"]);
        assert!(training_flags(&a).len() < starwire_wire::message::MAX_CONFIG_LEN);
        // Under a bound, the steps in a row when given.
        let bounded = |turn_steps| TrainConfig {
            bounded_delay: Some(4),
            turn_steps,
            ..TrainConfig::default()
        };
        let d = starwire_transport::auth::flags_differ(
            &training_flags(&bounded(None)),
            &training_flags(&bounded(Some(3))),
        );
        assert_eq!(d, ["--turn-steps (unset here, 3 at the peer)"]);
        let d = starwire_transport::auth::flags_differ(
            &training_flags(&bounded(Some(1))),
            &training_flags(&bounded(Some(3))),
        );
        assert_eq!(d, ["--turn-steps (1 here, 3 at the peer)"]);
    }
}

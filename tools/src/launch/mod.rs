//! Starting `starwire ps` and `starwire worker` the way launchers do:
//! TensorFlow's and DeepRec's flag spellings, the task's job from the
//! subcommand or `--job-name`, the address a PS listens on (`--bind`),
//! and how long a task keeps trying to reach its peers
//! (`--connect-timeout`). See docs/CONFIG.md and deploy/README.md.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::time::{Duration, Instant};

use clap::Args;
use starwire_config::{HostPort, Role};
use starwire_train::TrainError;
use starwire_transport::accept::DialError;

use crate::failure::Failure;

#[cfg(test)]
mod deploy_tests;

/// How long `starwire ps` and `starwire worker` keep trying to reach a
/// peer.
#[derive(Debug, Clone, Args)]
pub struct ConnectArgs {
    /// Seconds to keep retrying, with backoff, a PS name that does not
    /// resolve yet or a PS that does not accept yet (a PS: its own host
    /// entry, when --bind does not give an IP) before failing.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_CONNECT_TIMEOUT_SECS)]
    pub connect_timeout: u64,
}

/// `--connect-timeout`'s default.
const DEFAULT_CONNECT_TIMEOUT_SECS: u64 =
    starwire_train::cluster::DEFAULT_CONNECT_TIMEOUT.as_secs();

impl ConnectArgs {
    /// The bound as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.connect_timeout)
    }

    /// The run-time failure of a task that gave up on its peers, or could
    /// not listen: names the address, the bound, and the fix.
    pub fn failure(&self, e: TrainError) -> Failure {
        match &e {
            TrainError::Dial(DialError::Resolve { .. } | DialError::Connect { .. }) => {
                Failure::Run(format!(
                    "{e}; gave up after --connect-timeout {} s",
                    self.connect_timeout
                ))
            }
            TrainError::Listen { addr, source }
                if source.kind() == std::io::ErrorKind::AddrNotAvailable =>
            {
                Failure::Run(format!(
                    "{e}; {} is not an address of this host: give the PS \
                     --bind 0.0.0.0:{} (or this host's address)",
                    addr.ip(),
                    addr.port()
                ))
            }
            _ => crate::train::train_failure(e),
        }
    }
}

/// `starwire ps --bind ADDR`: where the PS listens, instead of the
/// address its own host entry resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bind {
    /// An IP or a host name without a port: the port is the task's own.
    Host(String),
    /// `host:port` or `[ipv6]:port`.
    HostPort(HostPort),
}

impl FromStr for Bind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Ok(hp) = HostPort::parse(s) {
            return Ok(Bind::HostPort(hp));
        }
        let bare = s
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .unwrap_or(s);
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Ok(Bind::Host(ip.to_string()));
        }
        // A host name: checked by the host:port parser with a stand-in port.
        match HostPort::parse(&format!("{s}:1")) {
            Ok(hp) if !s.contains(':') => Ok(Bind::Host(hp.host().to_owned())),
            _ => Err(format!(
                "expected IP, HOST, IP:PORT, HOST:PORT or [IPv6]:PORT, got {s:?}"
            )),
        }
    }
}

impl Bind {
    /// The `host:port` to listen on, the port taken from `own` (the task's
    /// entry in the cluster) when the flag gives none.
    fn endpoint(&self, own: &HostPort) -> String {
        match self {
            Bind::HostPort(hp) => hp.to_string(),
            Bind::Host(host) if host.contains(':') => format!("[{host}]:{}", own.port()),
            Bind::Host(host) => format!("{host}:{}", own.port()),
        }
    }
}

/// `starwire ps`: the cluster flags, `--bind`, and the training flags.
#[derive(Debug, Clone, Args)]
pub struct PsArgs {
    /// Listen here: IP or HOST (with the port of this task's entry in
    /// the cluster), or IP:PORT, HOST:PORT, [IPv6]:PORT. Default: the
    /// address this task's own entry resolves to. In a container, 0.0.0.0.
    #[arg(long, value_name = "ADDR")]
    pub bind: Option<Bind>,
    /// Exit once every worker of the cluster is done (a batch job),
    /// instead of serving until SIGTERM or SIGINT. Either way, a worker
    /// that died unfinished makes the exit status non-zero.
    #[arg(long)]
    pub exit_when_done: bool,
    #[command(flatten)]
    pub role: crate::train::RoleArgs,
}

/// The address a PS listens on: `--bind`, else its own entry `own`,
/// resolved by retrying until `deadline` (a headless service's name
/// appears once the pod has an address).
pub fn listen_addr(
    bind: Option<&Bind>,
    own: &HostPort,
    deadline: Instant,
) -> Result<SocketAddr, String> {
    let endpoint = bind.map_or_else(|| own.to_string(), |b| b.endpoint(own));
    let found = starwire_transport::accept::resolve(&endpoint, deadline).map_err(|e| {
        format!(
            "{e}; the PS listens on {}: give it --bind ADDR",
            if bind.is_some() {
                "the address --bind names"
            } else {
                "the address of its own entry in the cluster"
            }
        )
    })?;
    found
        .first()
        .copied()
        .ok_or_else(|| format!("{endpoint}: no address"))
}

/// The `--job-name` and `--task-index` to resolve the cluster with, for
/// the subcommand of `role`: `--job-name` must name that role (`ps` for
/// `starwire ps`; `worker` or `chief` for `starwire worker`); without it,
/// a `--task-index` is the subcommand's job's, and with neither the task
/// comes from `TF_CONFIG`.
pub fn job_flags(
    role: Role,
    job_name: Option<&str>,
    task_index: Option<u32>,
) -> Result<Option<String>, String> {
    let Some(job) = job_name else {
        return Ok(task_index.map(|_| role.job_name().to_owned()));
    };
    let job = job.trim();
    let fits = match role {
        Role::Ps => job == "ps",
        Role::Worker => job == "worker" || job == "chief",
    };
    if fits {
        return Ok(Some(job.to_owned()));
    }
    let allowed = match role {
        Role::Ps => "ps",
        Role::Worker => "worker or chief",
    };
    Err(format!(
        "--job-name {job:?} does not fit `starwire {role}`: expected {allowed} \
         (or leave --job-name out; the subcommand names the job)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cli(args: &[&str]) -> Result<crate::Cli, clap::Error> {
        crate::Cli::try_parse_from([&["starwire"], args].concat())
    }

    #[test]
    fn tf_and_deeprec_spellings_parse_equal_to_ours() {
        let cluster = |ps, workers, job, index| {
            vec![ps, "a:1,b:2", workers, "c:3", job, "worker", index, "0"]
        };
        for cmd in ["worker", "info"] {
            let ours = cli(&[
                &[cmd][..],
                &cluster("--ps-hosts", "--worker-hosts", "--job-name", "--task-index"),
            ]
            .concat())
            .expect("our spelling");
            let tf = cli(&[
                &[cmd][..],
                &cluster("--ps_hosts", "--worker_hosts", "--job_name", "--task_index"),
            ]
            .concat())
            .expect("TF's spelling");
            assert_eq!(format!("{:?}", ours.cmd), format!("{:?}", tf.cmd), "{cmd}");
        }
        // `=` forms too, and on `starwire ps`.
        let ours = cli(&[
            "ps",
            "--ps-hosts=a:1",
            "--worker-hosts=c:3",
            "--task-index=0",
        ])
        .unwrap();
        let tf = cli(&[
            "ps",
            "--ps_hosts=a:1",
            "--worker_hosts=c:3",
            "--task_index=0",
        ])
        .unwrap();
        assert_eq!(format!("{:?}", ours.cmd), format!("{:?}", tf.cmd));
        // An unknown spelling is still a usage error.
        let e = cli(&["worker", "--ps_host", "a:1"]).expect_err("not a flag");
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
    }

    #[test]
    fn connect_timeout_defaults_to_300_s() {
        let Ok(crate::Cli {
            cmd: crate::Command::Worker(w),
            ..
        }) = cli(&["worker"])
        else {
            panic!("worker parses");
        };
        assert_eq!(w.connect.timeout(), Duration::from_secs(300));
        assert!(cli(&["worker", "--connect-timeout", "-1"]).is_err());
        assert!(cli(&["worker", "--bind", "0.0.0.0"]).is_err(), "ps only");
    }

    #[test]
    fn the_job_name_must_fit_the_subcommand() {
        assert_eq!(job_flags(Role::Ps, None, None), Ok(None));
        assert_eq!(job_flags(Role::Ps, None, Some(1)), Ok(Some("ps".into())));
        assert_eq!(
            job_flags(Role::Ps, Some("ps"), Some(1)),
            Ok(Some("ps".into()))
        );
        assert_eq!(
            job_flags(Role::Worker, Some("chief"), None),
            Ok(Some("chief".into()))
        );
        let e = job_flags(Role::Ps, Some("worker"), Some(0)).unwrap_err();
        assert!(
            e.contains("--job-name \"worker\"") && e.contains("starwire ps"),
            "{e}"
        );
        assert!(job_flags(Role::Worker, Some("ps"), Some(0)).is_err());
        assert!(job_flags(Role::Worker, Some("evaluator"), None).is_err());
    }

    #[test]
    fn bind_takes_an_ip_a_host_or_either_with_a_port() {
        let own = HostPort::parse("starwire-ps-0.starwire-ps:2222").unwrap();
        let ep = |s: &str| s.parse::<Bind>().map(|b| b.endpoint(&own));
        assert_eq!(ep("0.0.0.0"), Ok("0.0.0.0:2222".into()));
        assert_eq!(ep("::"), Ok("[::]:2222".into()));
        assert_eq!(ep("[::]"), Ok("[::]:2222".into()));
        assert_eq!(ep("0.0.0.0:3333"), Ok("0.0.0.0:3333".into()));
        assert_eq!(ep("[::1]:3333"), Ok("[::1]:3333".into()));
        assert_eq!(ep("localhost"), Ok("localhost:2222".into()));
        assert_eq!(ep("Localhost:3333"), Ok("localhost:3333".into()));
        for bad in ["", "a b", "0.0.0.0:0", "0.0.0.0:x", "::1:"] {
            assert!(bad.parse::<Bind>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn listen_addr_resolves_the_bind_or_the_own_entry() {
        let now = Instant::now();
        let own = HostPort::parse("127.0.0.1:2222").unwrap();
        assert_eq!(
            listen_addr(None, &own, now),
            Ok("127.0.0.1:2222".parse().unwrap())
        );
        let any: Bind = "0.0.0.0".parse().unwrap();
        assert_eq!(
            listen_addr(Some(&any), &own, now),
            Ok("0.0.0.0:2222".parse().unwrap())
        );
        let own = HostPort::parse("starwire-ps-0.invalid:2222").unwrap();
        let e = listen_addr(None, &own, now).unwrap_err();
        assert!(
            e.starts_with("resolving starwire-ps-0.invalid:2222: ") && e.contains("--bind"),
            "{e}"
        );
        assert_eq!(
            listen_addr(Some(&any), &own, now),
            Ok("0.0.0.0:2222".parse().unwrap())
        );
    }
}

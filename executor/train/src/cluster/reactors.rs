//! Where the reactors of a training process run and how they idle.
//!
//! A process's reactors are its PS reactors (one per shard of the PS tasks
//! it runs) and each of its workers' network threads: with the hand-off
//! (`--worker-handoff on`), the worker's network reactors; without it, the
//! worker thread, which runs the worker's requests and its graph. The
//! pinned ones get
//! their CPUs from one starwire-placement plan, so the PS tasks and workers
//! of the local cluster do not share CPUs while there are CPUs to spare.
//! Which reactors poll, park or are pinned comes from the network settings
//! (starwire-config: DeepRec's variables, flag overrides).

use std::marker::PhantomData;
use std::ops::Range;
use std::time::Duration;

use serde::{Serialize, Serializer};
use starwire_config::{Role, Settings, Source};
use starwire_placement::{
    current_thread_affinity, pin_current_thread, plan, set_current_thread_affinity, CpuId, CpuSet,
    Placement, PlanWarning, ReactorMode, Topology,
};
use starwire_transport::reactor::{IdlePolicy, ReactorSpec};

use super::{BackendKind, TrainConfig};
use crate::TrainError;

/// How long a polling PS reactor polls before it parks when the process
/// has more reactors than usable CPUs and `STARWIRE_IDLE_POLL_US` is 0:
/// reactors sharing a core must park when idle (see docs/PLACEMENT.md).
pub const OVERSUBSCRIBED_IDLE_POLL: Duration = Duration::from_micros(50);

/// Longest single park of a PS reactor or a worker's network reactor, so
/// a reactor with no timers still re-checks its inbox.
const MAX_PARK: Duration = Duration::from_millis(100);

impl TrainConfig {
    /// Takes the reactor settings of both roles, as starwire-config
    /// resolved them (flags, then DeepRec's variables, then defaults).
    pub fn apply_settings(&mut self, s: &Settings) {
        self.ps_polling = s.ps.polling.value;
        self.worker_polling = s.worker.polling.value;
        self.ps_reactors = s.ps.cores.value;
        self.ps_reactors_fit_host = s.ps.cores.source == Source::Default;
        self.worker_reactors = s.worker.cores.value;
        self.pin_ps = s.ps.pin_cores.value;
        self.pin_workers = s.worker.pin_cores.value;
        self.idle_poll_us = s.ps.idle_poll_us.value;
    }

    /// Whether workers hand their requests to network reactors:
    /// `--worker-handoff on` on a backend whose workers drive sessions.
    pub fn handoff(&self) -> bool {
        self.worker_handoff && runs_reactors(self.backend)
    }

    /// Network threads of each worker: with the hand-off, its network
    /// reactors (`NETWORK_WORKER_CORE_NUMBER`, at most one per shard, since
    /// each holds whole connections); without it, one, the worker thread.
    pub fn worker_network_threads(&self) -> usize {
        if self.handoff() {
            let shards = self.ps.max(1) * self.ps_reactors.max(1);
            self.worker_reactors.clamp(1, shards)
        } else {
            1
        }
    }

    /// `--worker-handoff on` needs workers that drive sessions: inproc and
    /// grpc have no network reactors to hand requests to.
    pub(super) fn check_handoff(&self) -> Result<(), TrainError> {
        if self.worker_handoff && !runs_reactors(self.backend) {
            return Err(TrainError::Config(
                "--worker-handoff on hands a worker's requests to network reactors, which only \
                 the tcp, uring, dpdk and verbs backends have"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Whether the backend serves shards on PS reactors and has workers drive
/// their own sessions (tcp, uring, dpdk, verbs). inproc and grpc serve
/// shards behind locks, and their workers block instead of polling.
fn runs_reactors(b: BackendKind) -> bool {
    match b {
        BackendKind::Tcp => true,
        #[cfg(all(feature = "uring", target_os = "linux"))]
        BackendKind::Uring => true,
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        BackendKind::Verbs => true,
        BackendKind::Inproc => false,
        #[cfg(feature = "grpc")]
        BackendKind::Grpc => false,
        #[cfg(feature = "dpdk")]
        BackendKind::Dpdk => true,
    }
}

fn serialize_role<S: Serializer>(role: &Role, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(role.job_name())
}

/// One reactor as the reports list it (`reactors` in the JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReactorReport {
    /// `ps` or `worker`.
    #[serde(serialize_with = "serialize_role")]
    pub role: Role,
    /// The shard (ps); the worker (worker, without the hand-off); the
    /// worker's network reactor, `worker × reactors per worker + reactor`
    /// (worker, with the hand-off).
    pub index: usize,
    /// The CPU it is pinned to, if pinned.
    pub cpu: Option<CpuId>,
    /// Whether it polls.
    pub polling: bool,
}

/// One line for the text output: per role, how many reactors, where and
/// whether they poll.
pub fn summary(reactors: &[ReactorReport]) -> String {
    let mut parts = Vec::new();
    for role in Role::ALL {
        let mine: Vec<&ReactorReport> = reactors.iter().filter(|r| r.role == role).collect();
        let Some(first) = mine.first() else {
            continue;
        };
        let cpus: Vec<String> = mine
            .iter()
            .filter_map(|r| r.cpu.map(|c| c.to_string()))
            .collect();
        let place = if cpus.is_empty() {
            "unpinned".to_owned()
        } else {
            format!("cpus {}", cpus.join(","))
        };
        let polling = if first.polling {
            "polling"
        } else {
            "no polling"
        };
        parts.push(format!("{} {role} ({place}; {polling})", mine.len()));
    }
    if parts.is_empty() {
        "reactors: none".to_owned()
    } else {
        format!("reactors: {}", parts.join(", "))
    }
}

/// The reactors one process runs: PS shards and workers, by index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessReactors {
    /// Shards served by this process's PS tasks.
    pub ps_shards: Range<usize>,
    /// Workers of this process.
    pub workers: Range<usize>,
}

impl ProcessReactors {
    /// The local cluster: every PS task and every worker.
    pub fn local(cfg: &TrainConfig) -> Self {
        ProcessReactors {
            ps_shards: 0..cfg.ps * cfg.ps_reactors.max(1),
            workers: 0..cfg.workers,
        }
    }

    /// PS task `index` alone.
    pub fn ps_task(cfg: &TrainConfig, index: usize) -> Self {
        let r = cfg.ps_reactors.max(1);
        ProcessReactors {
            ps_shards: index * r..(index + 1) * r,
            workers: 0..0,
        }
    }

    /// Worker `index` alone.
    pub fn worker(index: usize) -> Self {
        ProcessReactors {
            ps_shards: 0..0,
            workers: index..index + 1,
        }
    }
}

/// Where each reactor of a process runs and how its PS reactors idle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorLayout {
    /// `(shard, cpu)` of every PS reactor.
    ps: Vec<(usize, Option<CpuId>)>,
    ps_polling: bool,
    ps_idle: IdlePolicy,
    /// `(index, cpu)` of every worker network thread, worker by worker:
    /// index `w × per_worker + r` is worker `w`'s `r`-th.
    workers: Vec<(usize, Option<CpuId>)>,
    /// Network threads per worker.
    per_worker: usize,
    /// The worker threads hand their requests to network reactors.
    handoff: bool,
    worker_polling: bool,
    /// How a worker's network reactors idle, and how its worker thread
    /// waits for their replies (with the hand-off).
    worker_idle: IdlePolicy,
    /// What the operator should know (the plan's warnings, reactors
    /// sharing CPUs).
    pub warnings: Vec<String>,
}

impl ReactorLayout {
    /// Places `which` on the CPUs this process may use, with this
    /// machine's topology (hwloc under the `hwloc` feature, else sysfs).
    pub fn detect(cfg: &TrainConfig, which: &ProcessReactors) -> Result<Self, TrainError> {
        let usable = CpuSet::process_affinity()?;
        let pinning = (cfg.pin_ps && runs_reactors(cfg.backend) && !which.ps_shards.is_empty())
            || (cfg.pin_workers && !which.workers.is_empty());
        // Only a pinned plan orders CPUs by topology.
        let topology = if pinning {
            Topology::detect().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "reading the CPU topology; placing as if on one node");
                Topology::default()
            })
        } else {
            Topology::default()
        };
        Self::new(cfg, which, &usable, &topology)
    }

    /// Places `which` on `usable` CPUs laid out as `topology`: the pinned
    /// reactors (PS ones first, then workers) take the CPUs of one plan,
    /// near `cfg.device` when given; unpinned ones get none.
    pub fn new(
        cfg: &TrainConfig,
        which: &ProcessReactors,
        usable: &CpuSet,
        topology: &Topology,
    ) -> Result<Self, TrainError> {
        let ps: Vec<usize> = if runs_reactors(cfg.backend) {
            which.ps_shards.clone().collect()
        } else {
            Vec::new()
        };
        let workers: Vec<usize> = which.workers.clone().collect();
        let handoff = cfg.handoff();
        let per_worker = cfg.worker_network_threads();
        let worker_threads = workers.len() * per_worker;
        let pinned_ps = if cfg.pin_ps { ps.len() } else { 0 };
        let pinned_workers = if cfg.pin_workers { worker_threads } else { 0 };
        let pinned = pinned_ps + pinned_workers;
        let mut warnings = Vec::new();
        let cpus: Vec<Option<CpuId>> = if pinned > 0 {
            let placement = match &cfg.device {
                Some(device) => Placement::NearDevice {
                    device: device.clone(),
                },
                None => Placement::MaxPack,
            };
            // Never clamped: the shard count is part of the cluster's
            // configuration, so reactors beyond the CPUs share them.
            let p = plan(
                &placement,
                pinned,
                ReactorMode::PollThenPark,
                usable,
                topology,
            )?;
            warnings.extend(
                p.warnings
                    .iter()
                    .filter(|w| !matches!(w, PlanWarning::Oversubscribed { .. }))
                    .map(ToString::to_string),
            );
            p.cpus()
        } else {
            Vec::new()
        };
        let (ps_cpus, worker_cpus) = cpus.split_at(pinned_ps.min(cpus.len()));
        let cpu_of = |cpus: &[Option<CpuId>], i: usize| cpus.get(i).copied().flatten();

        // With the hand-off, a worker thread waiting for replies may poll
        // too.
        let threads = ps.len() + worker_threads + if handoff { workers.len() } else { 0 };
        let oversubscribed = threads > usable.len();
        let wanted = starwire_config::IdlePolicy::from_polling(cfg.ps_polling, cfg.idle_poll_us);
        let ps_idle = idle_policy(wanted, oversubscribed);
        if !ps.is_empty() && ps_idle != to_reactor_idle(wanted) {
            warnings.push(format!(
                "{threads} reactors share {} usable cpus: polling PS reactors poll {} us, \
                 then park",
                usable.len(),
                OVERSUBSCRIBED_IDLE_POLL.as_micros()
            ));
        }
        let wanted =
            starwire_config::IdlePolicy::from_polling(cfg.worker_polling, cfg.idle_poll_us);
        let worker_idle = idle_policy(wanted, oversubscribed);
        if handoff && !workers.is_empty() && worker_idle != to_reactor_idle(wanted) {
            warnings.push(format!(
                "{threads} threads share {} usable cpus: polling worker network reactors and \
                 worker threads poll {} us, then park",
                usable.len(),
                OVERSUBSCRIBED_IDLE_POLL.as_micros()
            ));
        }
        if handoff && !workers.is_empty() && cfg.worker_reactors > per_worker {
            warnings.push(format!(
                "NETWORK_WORKER_CORE_NUMBER is {} but a worker has {per_worker} connections: \
                 {per_worker} network reactors each",
                cfg.worker_reactors
            ));
        }
        Ok(ReactorLayout {
            ps: ps
                .iter()
                .enumerate()
                .map(|(i, &s)| (s, cpu_of(ps_cpus, i)))
                .collect(),
            ps_polling: cfg.ps_polling,
            ps_idle,
            workers: (0..worker_threads)
                .map(|i| {
                    let (w, r) = (workers[i / per_worker], i % per_worker);
                    (w * per_worker + r, cpu_of(worker_cpus, i))
                })
                .collect(),
            per_worker,
            handoff,
            worker_polling: cfg.worker_polling && runs_reactors(cfg.backend),
            worker_idle,
            warnings,
        })
    }

    /// The spec of shard `shard`'s reactor.
    pub fn ps_spec(&self, shard: usize) -> Result<ReactorSpec, TrainError> {
        let &(_, cpu) =
            self.ps.iter().find(|(s, _)| *s == shard).ok_or_else(|| {
                TrainError::Internal(format!("no reactor placed for shard {shard}"))
            })?;
        Ok(ReactorSpec {
            index: shard,
            cpu,
            idle: self.ps_idle,
            max_park: MAX_PARK,
        })
    }

    /// The CPU of worker `worker`'s worker thread, if pinned: without the
    /// hand-off it is the worker's network thread; with it, it is not a
    /// reactor and is not pinned.
    pub fn worker_cpu(&self, worker: usize) -> Option<CpuId> {
        if self.handoff {
            return None;
        }
        self.workers
            .iter()
            .find(|(w, _)| *w == worker)
            .and_then(|&(_, cpu)| cpu)
    }

    /// Whether the workers hand their requests to network reactors.
    pub fn handoff(&self) -> bool {
        self.handoff
    }

    /// The specs of worker `worker`'s network reactors (with the
    /// hand-off), in order: reactor `r` serves the worker's shards `s`
    /// with `s % reactors == r`.
    pub fn worker_specs(&self, worker: usize) -> Result<Vec<ReactorSpec>, TrainError> {
        let first = worker * self.per_worker;
        (first..first + self.per_worker)
            .map(|index| {
                let &(_, cpu) =
                    self.workers
                        .iter()
                        .find(|(i, _)| *i == index)
                        .ok_or_else(|| {
                            TrainError::Internal(format!(
                                "no network reactor placed for worker {worker}"
                            ))
                        })?;
                Ok(ReactorSpec {
                    index,
                    cpu,
                    idle: self.worker_idle,
                    max_park: MAX_PARK,
                })
            })
            .collect()
    }

    /// How a worker thread waits for its network reactors' replies.
    pub fn worker_wait(&self) -> IdlePolicy {
        self.worker_idle
    }

    /// Every reactor, PS ones first.
    pub fn report(&self) -> Vec<ReactorReport> {
        let ps = self.ps.iter().map(|&(index, cpu)| ReactorReport {
            role: Role::Ps,
            index,
            cpu,
            polling: self.ps_polling,
        });
        let workers = self.workers.iter().map(|&(index, cpu)| ReactorReport {
            role: Role::Worker,
            index,
            cpu,
            polling: self.worker_polling,
        });
        ps.chain(workers).collect()
    }
}

fn to_reactor_idle(p: starwire_config::IdlePolicy) -> IdlePolicy {
    match p {
        starwire_config::IdlePolicy::Park => IdlePolicy::Park,
        starwire_config::IdlePolicy::BusyPoll => IdlePolicy::BusyPoll,
        starwire_config::IdlePolicy::PollThenPark(d) => IdlePolicy::PollThenPark(d),
    }
}

/// The idle policy the settings ask for, except that reactors sharing
/// CPUs never spin forever.
fn idle_policy(wanted: starwire_config::IdlePolicy, oversubscribed: bool) -> IdlePolicy {
    match to_reactor_idle(wanted) {
        IdlePolicy::BusyPoll if oversubscribed => {
            IdlePolicy::PollThenPark(OVERSUBSCRIBED_IDLE_POLL)
        }
        p => p,
    }
}

/// The calling thread pinned to one CPU until dropped, when it gets back
/// the affinity it had. Threads it starts meanwhile inherit the pin, so a
/// worker pins itself after starting its compute threads.
#[derive(Debug)]
pub struct PinnedThread {
    previous: Option<CpuSet>,
    /// Affinity is per thread: the guard must drop where it was made.
    _not_send: PhantomData<*const ()>,
}

impl PinnedThread {
    /// Pins the calling thread to `cpu`; `None` leaves it as it is.
    pub fn pin(cpu: Option<CpuId>) -> Result<Self, TrainError> {
        let previous = match cpu {
            Some(cpu) => {
                let previous = current_thread_affinity()?;
                pin_current_thread(cpu)?;
                Some(previous)
            }
            None => None,
        };
        Ok(PinnedThread {
            previous,
            _not_send: PhantomData,
        })
    }
}

impl Drop for PinnedThread {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            if let Err(e) = set_current_thread_affinity(&previous) {
                tracing::warn!(error = %e, "restoring a worker thread's CPU affinity");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_config::{FlagOverride, Overrides};
    use starwire_placement::{Device, NumaNode};

    fn set(text: &str) -> CpuSet {
        text.parse().unwrap()
    }

    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    /// The local cluster's config from `env` (1 PS, 2 workers).
    fn local(env: &[(&str, &str)]) -> TrainConfig {
        let mut cfg = TrainConfig::default();
        let s =
            Settings::resolve(cfg.workers, cfg.ps, &env_of(env), &Overrides::default()).unwrap();
        cfg.apply_settings(&s);
        cfg
    }

    fn specs(layout: &ReactorLayout, shards: Range<usize>) -> Vec<ReactorSpec> {
        shards.map(|s| layout.ps_spec(s).unwrap()).collect()
    }

    #[test]
    fn settings_reach_the_config() {
        let cfg = local(&[
            ("PS_ENABLE_POLLING", "1"),
            ("NETWORK_PS_CORE_NUMBER", "3"),
            ("PS_DISABLE_PIN_CORES", "false"),
            ("WORKER_ENABLE_POLLING", "true"),
            ("STARWIRE_IDLE_POLL_US", "20"),
        ]);
        assert!(cfg.ps_polling && cfg.worker_polling && cfg.pin_ps);
        assert!(
            !cfg.pin_workers,
            "WORKER_DISABLE_PIN_CORES defaults to true"
        );
        assert_eq!(cfg.ps_reactors, 3);
        assert!(
            !cfg.ps_reactors_fit_host,
            "a given value is the cluster's shape"
        );
        assert_eq!(cfg.idle_poll_us, 20);
        // min(2, 1 PS task) network reactors per worker.
        assert_eq!(cfg.worker_reactors, 1);
        // Defaults: min(8, 2 workers) PS reactors, nothing polls or pins.
        let cfg = local(&[]);
        assert_eq!(cfg.ps_reactors, 2);
        assert!(cfg.ps_reactors_fit_host);
        assert!(!cfg.ps_polling && !cfg.worker_polling && !cfg.pin_ps && !cfg.pin_workers);
        // A flag wins over the environment.
        let mut o = Overrides::default();
        o.ps.disable_pin_cores = Some(FlagOverride::new("--pin-cores", false));
        let env = [("PS_DISABLE_PIN_CORES", "true")];
        let s = Settings::resolve(2, 1, &env_of(&env), &o).unwrap();
        let mut cfg = TrainConfig::default();
        cfg.apply_settings(&s);
        assert!(cfg.pin_ps);
    }

    #[test]
    fn idle_policy_follows_polling_and_idle_poll_time() {
        let usable = set("0-7");
        let topo = Topology::default();
        let idle = |env: &[(&str, &str)]| {
            let cfg = local(env);
            let l = ReactorLayout::new(&cfg, &ProcessReactors::local(&cfg), &usable, &topo);
            l.unwrap().ps_spec(0).unwrap().idle
        };
        assert_eq!(idle(&[]), IdlePolicy::Park);
        assert_eq!(idle(&[("STARWIRE_IDLE_POLL_US", "100")]), IdlePolicy::Park);
        assert_eq!(idle(&[("PS_ENABLE_POLLING", "1")]), IdlePolicy::BusyPoll);
        assert_eq!(
            idle(&[("PS_ENABLE_POLLING", "1"), ("STARWIRE_IDLE_POLL_US", "100")]),
            IdlePolicy::PollThenPark(Duration::from_micros(100))
        );
    }

    #[test]
    fn reactors_sharing_cpus_do_not_spin_forever() {
        // 2 PS reactors and 2 workers on 2 CPUs.
        let cfg = local(&[("PS_ENABLE_POLLING", "1")]);
        let which = ProcessReactors::local(&cfg);
        let l = ReactorLayout::new(&cfg, &which, &set("0-1"), &Topology::default()).unwrap();
        assert_eq!(
            l.ps_spec(1).unwrap().idle,
            IdlePolicy::PollThenPark(OVERSUBSCRIBED_IDLE_POLL)
        );
        assert_eq!(l.warnings.len(), 1, "{:?}", l.warnings);
        // An idle-poll time asked for is kept.
        let cfg = local(&[("PS_ENABLE_POLLING", "1"), ("STARWIRE_IDLE_POLL_US", "7")]);
        let l = ReactorLayout::new(&cfg, &which, &set("0-1"), &Topology::default()).unwrap();
        assert_eq!(
            l.ps_spec(0).unwrap().idle,
            IdlePolicy::PollThenPark(Duration::from_micros(7))
        );
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    }

    #[test]
    fn pinned_reactors_take_the_cpus_of_one_plan() {
        let cfg = local(&[
            ("PS_DISABLE_PIN_CORES", "0"),
            ("WORKER_DISABLE_PIN_CORES", "0"),
            ("PS_ENABLE_POLLING", "1"),
        ]);
        let which = ProcessReactors::local(&cfg);
        let l = ReactorLayout::new(&cfg, &which, &set("2-9"), &Topology::default()).unwrap();
        let cpus: Vec<Option<usize>> = specs(&l, 0..2).iter().map(|s| s.cpu).collect();
        assert_eq!(cpus, vec![Some(2), Some(3)]);
        assert_eq!(l.worker_cpu(0), Some(4));
        assert_eq!(l.worker_cpu(1), Some(5));
        assert_eq!(
            l.report(),
            vec![
                ReactorReport {
                    role: Role::Ps,
                    index: 0,
                    cpu: Some(2),
                    polling: true
                },
                ReactorReport {
                    role: Role::Ps,
                    index: 1,
                    cpu: Some(3),
                    polling: true
                },
                ReactorReport {
                    role: Role::Worker,
                    index: 0,
                    cpu: Some(4),
                    polling: false
                },
                ReactorReport {
                    role: Role::Worker,
                    index: 1,
                    cpu: Some(5),
                    polling: false
                },
            ]
        );
        // More reactors than CPUs wrap around instead of being dropped.
        let l = ReactorLayout::new(&cfg, &which, &set("0-2"), &Topology::default()).unwrap();
        let cpus: Vec<Option<usize>> = l.report().iter().map(|r| r.cpu).collect();
        assert_eq!(cpus, vec![Some(0), Some(1), Some(2), Some(0)]);
    }

    #[test]
    fn unpinned_roles_get_no_cpu_and_leave_cpus_to_the_pinned() {
        let cfg = local(&[("WORKER_DISABLE_PIN_CORES", "false")]);
        let which = ProcessReactors::local(&cfg);
        let l = ReactorLayout::new(&cfg, &which, &set("0-7"), &Topology::default()).unwrap();
        assert!(specs(&l, 0..2).iter().all(|s| s.cpu.is_none()));
        assert_eq!(l.worker_cpu(0), Some(0));
        assert_eq!(l.worker_cpu(1), Some(1));
        let json = serde_json::to_value(l.report()).unwrap();
        assert_eq!(
            json[0],
            serde_json::json!({"role": "ps", "index": 0, "cpu": null, "polling": false})
        );
        assert_eq!(json[3]["cpu"], 1);
        assert_eq!(json[3]["role"], "worker");
        // Nothing pinned: no CPU anywhere.
        let cfg = local(&[]);
        let l = ReactorLayout::new(&cfg, &which, &set("0-7"), &Topology::default()).unwrap();
        assert!(l.report().iter().all(|r| r.cpu.is_none()));
    }

    #[test]
    fn a_named_device_puts_reactors_on_its_cores_first() {
        let topo = Topology {
            numa_nodes: vec![
                NumaNode {
                    id: 0,
                    cpus: set("0-3"),
                },
                NumaNode {
                    id: 1,
                    cpus: set("4-7"),
                },
            ],
            devices: vec![Device {
                name: "eth1".into(),
                numa_node: Some(1),
                local_cpus: set("6-7"),
            }],
        };
        let mut cfg = local(&[("PS_DISABLE_PIN_CORES", "false")]);
        cfg.device = Some("eth1".into());
        let l = ReactorLayout::new(&cfg, &ProcessReactors::ps_task(&cfg, 1), &set("0-7"), &topo)
            .unwrap();
        let specs = specs(&l, 2..4);
        assert_eq!(
            specs.iter().map(|s| (s.index, s.cpu)).collect::<Vec<_>>(),
            vec![(2, Some(6)), (3, Some(7))]
        );
        assert!(l.ps_spec(0).is_err(), "shard 0 is PS task 0's");
        // An unknown device falls back to node 0 first, with a warning.
        cfg.device = Some("eth9".into());
        let l = ReactorLayout::new(&cfg, &ProcessReactors::ps_task(&cfg, 0), &set("0-7"), &topo)
            .unwrap();
        assert_eq!(l.ps_spec(0).unwrap().cpu, Some(0));
        assert!(l.warnings[0].contains("eth9"), "{:?}", l.warnings);
    }

    #[test]
    fn backends_without_reactors_list_only_workers() {
        let mut cfg = local(&[
            ("PS_DISABLE_PIN_CORES", "0"),
            ("WORKER_ENABLE_POLLING", "1"),
        ]);
        cfg.backend = BackendKind::Inproc;
        let l = ReactorLayout::new(
            &cfg,
            &ProcessReactors::local(&cfg),
            &set("0-7"),
            &Topology::default(),
        )
        .unwrap();
        let r = l.report();
        assert_eq!(r.len(), 2);
        assert!(r.iter().all(|r| r.role == Role::Worker && !r.polling));
        let l = ReactorLayout::new(
            &cfg,
            &ProcessReactors::ps_task(&cfg, 0),
            &set("0-7"),
            &Topology::default(),
        )
        .unwrap();
        assert!(l.report().is_empty());
        assert_eq!(summary(&l.report()), "reactors: none");
    }

    #[test]
    fn one_worker_alone() {
        let cfg = local(&[
            ("WORKER_DISABLE_PIN_CORES", "0"),
            ("WORKER_ENABLE_POLLING", "1"),
        ]);
        let l = ReactorLayout::new(
            &cfg,
            &ProcessReactors::worker(3),
            &set("4-5"),
            &Topology::default(),
        )
        .unwrap();
        assert_eq!(
            l.report(),
            vec![ReactorReport {
                role: Role::Worker,
                index: 3,
                cpu: Some(4),
                polling: true
            }]
        );
        assert_eq!(l.worker_cpu(0), None);
        assert_eq!(summary(&l.report()), "reactors: 1 worker (cpus 4; polling)");
    }

    #[test]
    fn handoff_places_each_workers_network_reactors() {
        let mut cfg = local(&[
            ("WORKER_DISABLE_PIN_CORES", "0"),
            ("WORKER_ENABLE_POLLING", "1"),
            ("NETWORK_WORKER_CORE_NUMBER", "2"),
        ]);
        cfg.worker_handoff = true;
        assert!(cfg.handoff());
        assert_eq!(cfg.worker_network_threads(), 2);
        let which = ProcessReactors::local(&cfg);
        // 2 PS reactors, 2 × 2 network reactors and 2 worker threads on 8
        // CPUs: the network reactors take the first four (the PS ones are
        // not pinned), the worker threads none.
        let l = ReactorLayout::new(&cfg, &which, &set("0-7"), &Topology::default()).unwrap();
        assert!(l.handoff());
        assert_eq!((l.worker_cpu(0), l.worker_cpu(1)), (None, None));
        let specs = l.worker_specs(1).unwrap();
        assert_eq!(
            specs.iter().map(|s| (s.index, s.cpu)).collect::<Vec<_>>(),
            vec![(2, Some(2)), (3, Some(3))]
        );
        assert!(specs.iter().all(|s| s.idle == IdlePolicy::BusyPoll));
        assert_eq!(l.worker_wait(), IdlePolicy::BusyPoll);
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        assert_eq!(
            summary(&l.report()),
            "reactors: 2 ps (unpinned; no polling), 4 worker (cpus 0,1,2,3; polling)"
        );
        // On 4 CPUs the 8 threads share: the polling ones poll, then park.
        let l = ReactorLayout::new(&cfg, &which, &set("0-3"), &Topology::default()).unwrap();
        let shared = IdlePolicy::PollThenPark(OVERSUBSCRIBED_IDLE_POLL);
        assert_eq!(l.worker_wait(), shared);
        assert_eq!(l.worker_specs(0).unwrap()[1].idle, shared);
        assert!(
            l.warnings[0].contains("worker network reactors"),
            "{:?}",
            l.warnings
        );
        // At most one reactor per shard (connection).
        cfg.worker_reactors = 5;
        assert_eq!(cfg.worker_network_threads(), 2);
        let l = ReactorLayout::new(&cfg, &which, &set("0-7"), &Topology::default()).unwrap();
        assert!(
            l.warnings[0].contains("NETWORK_WORKER_CORE_NUMBER is 5"),
            "{:?}",
            l.warnings
        );
        // A PS task runs no worker: it says nothing of the workers' reactors.
        let l = ReactorLayout::new(
            &cfg,
            &ProcessReactors::ps_task(&cfg, 0),
            &set("0-7"),
            &Topology::default(),
        )
        .unwrap();
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        // `starwire worker 3`: its own reactors only.
        let l = ReactorLayout::new(
            &cfg,
            &ProcessReactors::worker(3),
            &set("4-5"),
            &Topology::default(),
        )
        .unwrap();
        let listed: Vec<(usize, Option<usize>)> =
            l.report().iter().map(|r| (r.index, r.cpu)).collect();
        assert_eq!(listed, vec![(6, Some(4)), (7, Some(5))]);
        assert!(l.worker_specs(0).is_err(), "worker 0 is not this process's");
        // Without reactors there is nothing to hand requests to.
        cfg.backend = BackendKind::Inproc;
        assert!(!cfg.handoff());
        assert_eq!(cfg.worker_network_threads(), 1);
        assert!(cfg.check_handoff().is_err());
        cfg.worker_handoff = false;
        assert!(cfg.check_handoff().is_ok());
    }

    #[test]
    fn summary_names_roles_cpus_and_polling() {
        let cfg = local(&[("PS_DISABLE_PIN_CORES", "0"), ("PS_ENABLE_POLLING", "1")]);
        let l = ReactorLayout::new(
            &cfg,
            &ProcessReactors::local(&cfg),
            &set("0-7"),
            &Topology::default(),
        )
        .unwrap();
        assert_eq!(
            summary(&l.report()),
            "reactors: 2 ps (cpus 0,1; polling), 2 worker (unpinned; no polling)"
        );
    }

    #[test]
    fn pinning_restores_the_previous_affinity() {
        let before = current_thread_affinity().unwrap();
        let cpu = before.iter().next().unwrap();
        {
            let _pinned = PinnedThread::pin(Some(cpu)).unwrap();
            assert_eq!(current_thread_affinity().unwrap(), CpuSet::from_iter([cpu]));
        }
        assert_eq!(current_thread_affinity().unwrap(), before);
        let _none = PinnedThread::pin(None).unwrap();
        assert_eq!(current_thread_affinity().unwrap(), before);
    }
}

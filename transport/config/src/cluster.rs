//! Cluster spec: which ps and worker tasks exist, and which one we are.

use std::collections::HashMap;
use std::fmt;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::hostport::HostPort;

/// Environment variable holding TensorFlow's cluster JSON.
pub const TF_CONFIG: &str = "TF_CONFIG";

/// Flag names used in error messages for [`ClusterFlags`].
pub mod flag {
    /// `--ps-hosts`.
    pub const PS_HOSTS: &str = "--ps-hosts";
    /// `--worker-hosts`.
    pub const WORKER_HOSTS: &str = "--worker-hosts";
    /// `--job-name`.
    pub const JOB_NAME: &str = "--job-name";
    /// `--task-index`.
    pub const TASK_INDEX: &str = "--task-index";
}

/// A starwire role. A TensorFlow chief is a [`Role::Worker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Parameter server.
    Ps,
    /// Worker (including the chief).
    Worker,
}

impl Role {
    /// Both roles, ps first.
    pub const ALL: [Role; 2] = [Role::Ps, Role::Worker];

    /// TensorFlow's job name: `"ps"` or `"worker"`.
    pub fn job_name(self) -> &'static str {
        match self {
            Role::Ps => "ps",
            Role::Worker => "worker",
        }
    }

    /// The role this role's tasks connect to: workers talk to ps and ps
    /// serve workers.
    pub fn peer(self) -> Role {
        match self {
            Role::Ps => Role::Worker,
            Role::Worker => Role::Ps,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.job_name())
    }
}

/// One task of the cluster. Displayed the TensorFlow way,
/// `/job:worker/task:3`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId {
    /// The task's role.
    pub role: Role,
    /// Index within the role's host list (for workers: with the chief as 0).
    pub index: u32,
}

impl TaskId {
    /// A parameter-server task.
    pub fn ps(index: u32) -> Self {
        TaskId {
            role: Role::Ps,
            index,
        }
    }

    /// A worker task.
    pub fn worker(index: u32) -> Self {
        TaskId {
            role: Role::Worker,
            index,
        }
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/job:{}/task:{}", self.role.job_name(), self.index)
    }
}

/// The validated list of ps and worker endpoints.
///
/// Invariants (checked by [`ClusterSpec::new`]): both lists are non-empty
/// and no endpoint appears twice (across both lists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    ps: Vec<HostPort>,
    workers: Vec<HostPort>,
}

impl ClusterSpec {
    /// Validates and builds a cluster spec.
    pub fn new(ps: Vec<HostPort>, workers: Vec<HostPort>) -> Result<Self, ConfigError> {
        if ps.is_empty() {
            return Err(ConfigError::EmptyJob { job: "ps" });
        }
        if workers.is_empty() {
            return Err(ConfigError::EmptyJob { job: "worker" });
        }
        let spec = ClusterSpec { ps, workers };
        let mut seen: HashMap<&HostPort, TaskId> = HashMap::new();
        for role in Role::ALL {
            for (i, hp) in spec.hosts(role).iter().enumerate() {
                let task = TaskId {
                    role,
                    index: i as u32,
                };
                if let Some(first) = seen.insert(hp, task) {
                    return Err(ConfigError::DuplicateEndpoint {
                        endpoint: hp.clone(),
                        first,
                        second: task,
                    });
                }
            }
        }
        Ok(spec)
    }

    /// The ps endpoints, by task index.
    pub fn ps(&self) -> &[HostPort] {
        &self.ps
    }

    /// The worker endpoints, by task index (the chief, if any, is 0).
    pub fn workers(&self) -> &[HostPort] {
        &self.workers
    }

    /// The endpoints of one role.
    pub fn hosts(&self, role: Role) -> &[HostPort] {
        match role {
            Role::Ps => &self.ps,
            Role::Worker => &self.workers,
        }
    }

    /// The endpoint of a task, if it exists.
    pub fn endpoint(&self, task: TaskId) -> Option<&HostPort> {
        self.hosts(task.role).get(task.index as usize)
    }

    /// Checks that `task` exists in this spec.
    pub fn check_task(&self, task: TaskId) -> Result<(), ConfigError> {
        let len = self.hosts(task.role).len();
        if (task.index as usize) < len {
            Ok(())
        } else {
            Err(ConfigError::TaskIndexOutOfRange { task, len })
        }
    }

    /// Every task with its endpoint: ps first, then workers.
    pub fn tasks(&self) -> impl Iterator<Item = (TaskId, &HostPort)> + '_ {
        Role::ALL
            .into_iter()
            .flat_map(move |role| self.role_tasks(role))
    }

    fn role_tasks(&self, role: Role) -> impl Iterator<Item = (TaskId, &HostPort)> + '_ {
        self.hosts(role).iter().enumerate().map(move |(i, hp)| {
            (
                TaskId {
                    role,
                    index: i as u32,
                },
                hp,
            )
        })
    }

    /// The tasks that `task` connects to (for a worker: every ps; for a ps:
    /// every worker), with their endpoints.
    pub fn peers(&self, task: TaskId) -> impl Iterator<Item = (TaskId, &HostPort)> + '_ {
        self.role_tasks(task.role.peer())
    }

    /// Number of peer tasks `task` connects to: for a worker, the number of
    /// ps; for a ps, the number of workers. Depends only on the role.
    pub fn peer_count(&self, task: TaskId) -> usize {
        self.hosts(task.role.peer()).len()
    }

    /// The "connections" DeepRec uses for default core numbers:
    /// [`peer_count`](Self::peer_count), at least 1.
    pub fn connections(&self, task: TaskId) -> usize {
        self.peer_count(task).max(1)
    }

    /// Maps every endpoint (ps first, then workers) through `f`.
    pub(crate) fn map_endpoints<E>(
        &self,
        mut f: impl FnMut(TaskId, &HostPort) -> Result<HostPort, E>,
    ) -> Result<(Vec<HostPort>, Vec<HostPort>), E> {
        let ps = self
            .role_tasks(Role::Ps)
            .map(|(t, hp)| f(t, hp))
            .collect::<Result<Vec<_>, E>>()?;
        let workers = self
            .role_tasks(Role::Worker)
            .map(|(t, hp)| f(t, hp))
            .collect::<Result<Vec<_>, E>>()?;
        Ok((ps, workers))
    }
}

/// Cluster flags as given on the command line (`None` = flag not given).
///
/// Host lists are comma-separated `host:port` (IPv6 in brackets).
/// `job_name` is `ps`, `worker` or `chief`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterFlags {
    /// `--ps-hosts h:p,h:p`.
    pub ps_hosts: Option<String>,
    /// `--worker-hosts h:p,h:p` (worker 0 is the chief).
    pub worker_hosts: Option<String>,
    /// `--job-name ps|worker|chief`.
    pub job_name: Option<String>,
    /// `--task-index N`.
    pub task_index: Option<u32>,
}

/// Parses a comma-separated host list given with `flag`.
pub fn parse_host_list(flag: &str, value: &str) -> Result<Vec<HostPort>, ConfigError> {
    if value.trim().is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .enumerate()
        .map(|(i, item)| {
            HostPort::parse(item).map_err(|e| ConfigError::InvalidFlag {
                flag: flag.to_owned(),
                value: value.to_owned(),
                reason: format!("entry {} ({:?}): {e}", i + 1, item.trim()),
            })
        })
        .collect()
}

/// The parts of `TF_CONFIG` starwire uses. Unknown keys are ignored.
///
/// A missing job is `None` (it may still come from a flag); the `"chief"`
/// host, if any, is already the first entry of `workers`, and `task` is
/// already mapped to starwire's numbering (see [`ClusterConfig`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TfConfig {
    /// `cluster.ps`.
    pub ps: Option<Vec<HostPort>>,
    /// `cluster.chief` followed by `cluster.worker`.
    pub workers: Option<Vec<HostPort>>,
    /// `task`, mapped to starwire's role and index.
    pub task: Option<TaskId>,
}

#[derive(Deserialize)]
struct RawTfConfig {
    #[serde(default)]
    cluster: Option<HashMap<String, serde_json::Value>>,
    #[serde(default)]
    task: Option<RawTask>,
}

#[derive(Deserialize)]
struct RawTask {
    #[serde(rename = "type", default)]
    job: Option<String>,
    #[serde(default)]
    index: Option<u32>,
}

fn tf_err(reason: impl Into<String>) -> ConfigError {
    ConfigError::TfConfig {
        reason: reason.into(),
    }
}

impl TfConfig {
    /// Parses the `TF_CONFIG` JSON.
    ///
    /// Accepted: `{"cluster": {"ps": [..], "worker": [..], "chief": [..]},
    /// "task": {"type": "ps"|"worker"|"chief", "index": N}}`. Other cluster
    /// jobs (e.g. `"evaluator"`) and other top-level keys are ignored. A
    /// missing `"index"` means 0, as in TensorFlow. A task of type
    /// `"evaluator"` (or any other job) is rejected: it takes no part in
    /// ps/worker traffic.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let raw: RawTfConfig =
            serde_json::from_str(json).map_err(|source| ConfigError::TfConfigJson { source })?;
        let mut cluster = raw.cluster.unwrap_or_default();
        let mut take = |job: &str| -> Result<Option<Vec<HostPort>>, ConfigError> {
            let Some(value) = cluster.remove(job) else {
                return Ok(None);
            };
            let items: Vec<String> = serde_json::from_value(value).map_err(|e| {
                tf_err(format!(
                    "cluster.{job} must be a list of \"host:port\" strings: {e}"
                ))
            })?;
            items
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    HostPort::parse(s)
                        .map_err(|e| tf_err(format!("cluster.{job}[{i}] = {s:?}: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        };
        let ps = take("ps")?;
        let chief = take("chief")?;
        let worker = take("worker")?;
        let chiefs = chief.as_ref().map_or(0, Vec::len);
        if chiefs > 1 {
            return Err(tf_err(format!(
                "cluster.chief must have exactly one host, has {chiefs}"
            )));
        }
        let workers = match (chief, worker) {
            (None, None) => None,
            (c, w) => Some(
                c.into_iter()
                    .flatten()
                    .chain(w.into_iter().flatten())
                    .collect(),
            ),
        };

        let task = match raw.task {
            None
            | Some(RawTask {
                job: None,
                index: None,
            }) => None,
            Some(RawTask { job: None, .. }) => {
                return Err(tf_err("task has an \"index\" but no \"type\""));
            }
            Some(RawTask {
                job: Some(job),
                index,
            }) => {
                let index = index.unwrap_or(0);
                let task = match job.as_str() {
                    "ps" => TaskId::ps(index),
                    "worker" => TaskId::worker(
                        index
                            .checked_add(chiefs as u32)
                            .ok_or_else(|| tf_err(format!("task index {index} is out of range")))?,
                    ),
                    "chief" => {
                        if chiefs == 0 {
                            return Err(tf_err("task type is \"chief\" but cluster has no chief"));
                        }
                        if index != 0 {
                            return Err(tf_err(format!(
                                "task is chief with index {index}; there is only chief 0"
                            )));
                        }
                        TaskId::worker(0)
                    }
                    _ => {
                        return Err(ConfigError::UnsupportedJob {
                            job,
                            origin: TF_CONFIG,
                            reason: unsupported_reason(),
                        })
                    }
                };
                Some(task)
            }
        };
        Ok(TfConfig { ps, workers, task })
    }
}

fn unsupported_reason() -> &'static str {
    "only ps, worker and chief tasks take part in ps/worker training traffic"
}

/// The resolved cluster: the validated spec and this process's task.
///
/// Sources, in order of precedence (highest first):
///
/// 1. TensorFlow-style flags ([`ClusterFlags`]): `--ps-hosts`,
///    `--worker-hosts`, `--job-name`, `--task-index`.
/// 2. The `TF_CONFIG` JSON set by TensorFlow launchers ([`TfConfig`]).
///
/// Each host list is taken from its flag if the flag is given, else from
/// `TF_CONFIG`. The task is taken from the flags if `--job-name` is given
/// (then `--task-index` is read too), else from `TF_CONFIG`'s `"task"`.
///
/// # Chief
///
/// starwire has two roles, [`Role::Ps`] and [`Role::Worker`]; a chief is a
/// worker. With flags, TensorFlow's convention applies: worker 0 is the
/// chief, and `--job-name chief` means worker task 0. In `TF_CONFIG`,
/// `"chief"` is a job of its own with one host; starwire's worker list is
/// the chief followed by the `"worker"` list, so the chief is worker 0 and
/// `TF_CONFIG` worker *i* is starwire worker *i + 1*. Without a chief,
/// indices are unchanged. `--task-index` always indexes the flat worker
/// list (`--worker-hosts`, or the one built from `TF_CONFIG`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// All tasks.
    pub spec: ClusterSpec,
    /// This process's task (guaranteed to exist in `spec`).
    pub task: TaskId,
}

impl ClusterConfig {
    /// Resolves the cluster from flags and the `TF_CONFIG` text (`None` or
    /// blank = unset). Flags win over `TF_CONFIG`, per host list and for the
    /// task as a whole; see [`ClusterConfig`].
    pub fn resolve(flags: &ClusterFlags, tf_config: Option<&str>) -> Result<Self, ConfigError> {
        let tf = match tf_config {
            Some(text) if !text.trim().is_empty() => TfConfig::parse(text)?,
            _ => TfConfig::default(),
        };
        let ps = match &flags.ps_hosts {
            Some(v) => parse_host_list(flag::PS_HOSTS, v)?,
            None => tf.ps.unwrap_or_default(),
        };
        let workers = match &flags.worker_hosts {
            Some(v) => parse_host_list(flag::WORKER_HOSTS, v)?,
            None => tf.workers.unwrap_or_default(),
        };
        let spec = ClusterSpec::new(ps, workers)?;
        let task = match &flags.job_name {
            Some(job) => task_from_flags(job, flags.task_index)?,
            None if flags.task_index.is_some() => {
                return Err(ConfigError::InvalidFlag {
                    flag: flag::TASK_INDEX.to_owned(),
                    value: flags.task_index.unwrap_or_default().to_string(),
                    reason: format!("{} must be given too", flag::JOB_NAME),
                });
            }
            None => tf.task.ok_or(ConfigError::MissingTask)?,
        };
        spec.check_task(task)?;
        Ok(ClusterConfig { spec, task })
    }

    /// [`resolve`](Self::resolve) with `TF_CONFIG` read from the process
    /// environment.
    pub fn from_process_env(flags: &ClusterFlags) -> Result<Self, ConfigError> {
        let tf = crate::process_env(TF_CONFIG);
        Self::resolve(flags, tf.as_deref())
    }

    /// Number of peer tasks this process connects to.
    pub fn peer_count(&self) -> usize {
        self.spec.peer_count(self.task)
    }
}

fn task_from_flags(job: &str, index: Option<u32>) -> Result<TaskId, ConfigError> {
    let missing_index = || ConfigError::InvalidFlag {
        flag: flag::JOB_NAME.to_owned(),
        value: job.to_owned(),
        reason: format!("{} must be given too", flag::TASK_INDEX),
    };
    match job.trim() {
        "ps" => Ok(TaskId::ps(index.ok_or_else(missing_index)?)),
        "worker" => Ok(TaskId::worker(index.ok_or_else(missing_index)?)),
        "chief" => match index {
            None | Some(0) => Ok(TaskId::worker(0)),
            Some(i) => Err(ConfigError::InvalidFlag {
                flag: flag::TASK_INDEX.to_owned(),
                value: i.to_string(),
                reason: "the chief is worker 0; its task index must be 0".to_owned(),
            }),
        },
        "evaluator" => Err(ConfigError::UnsupportedJob {
            job: job.to_owned(),
            origin: flag::JOB_NAME,
            reason: unsupported_reason(),
        }),
        _ => Err(ConfigError::InvalidFlag {
            flag: flag::JOB_NAME.to_owned(),
            value: job.to_owned(),
            reason: "expected ps, worker or chief".to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hps(list: &[&str]) -> Vec<HostPort> {
        list.iter().map(|s| HostPort::parse(s).unwrap()).collect()
    }

    fn flags(ps: &str, workers: &str, job: &str, index: Option<u32>) -> ClusterFlags {
        ClusterFlags {
            ps_hosts: Some(ps.into()),
            worker_hosts: Some(workers.into()),
            job_name: Some(job.into()),
            task_index: index,
        }
    }

    const TF: &str = r#"{
        "cluster": {
            "chief": ["c:1"],
            "ps": ["p0:1", "p1:1"],
            "worker": ["w0:1", "w1:1", "w2:1"],
            "evaluator": ["e:1"]
        },
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
        "rpc_layer": "grpc"
    }"#;

    #[test]
    fn role_names_and_task_display() {
        assert_eq!(Role::Ps.job_name(), "ps");
        assert_eq!(Role::Worker.job_name(), "worker");
        assert_eq!(Role::Ps.peer(), Role::Worker);
        assert_eq!(TaskId::worker(3).to_string(), "/job:worker/task:3");
    }

    #[test]
    fn flags_only() {
        let c = ClusterConfig::resolve(
            &flags("p0:1,p1:1", "w0:1, w1:1 ,[::1]:5", "worker", Some(2)),
            None,
        )
        .unwrap();
        assert_eq!(c.spec.ps(), hps(&["p0:1", "p1:1"]));
        assert_eq!(c.spec.workers(), hps(&["w0:1", "w1:1", "[::1]:5"]));
        assert_eq!(c.task, TaskId::worker(2));
        assert_eq!(c.peer_count(), 2);
        assert_eq!(c.spec.endpoint(c.task), Some(&hps(&["[::1]:5"])[0]));
    }

    #[test]
    fn tf_config_chief_is_worker_zero_and_workers_shift() {
        let tf = TfConfig::parse(TF).unwrap();
        assert_eq!(tf.ps, Some(hps(&["p0:1", "p1:1"])));
        assert_eq!(tf.workers, Some(hps(&["c:1", "w0:1", "w1:1", "w2:1"])));
        // TF_CONFIG worker 1 is starwire worker 2.
        assert_eq!(tf.task, Some(TaskId::worker(2)));

        let chief = TF.replace(r#""type": "worker", "index": 1"#, r#""type": "chief""#);
        let c = ClusterConfig::resolve(&ClusterFlags::default(), Some(&chief)).unwrap();
        assert_eq!(c.task, TaskId::worker(0));
        assert_eq!(c.spec.endpoint(c.task), Some(&hps(&["c:1"])[0]));

        let last = TF.replace(r#""index": 1"#, r#""index": 2"#);
        let c = ClusterConfig::resolve(&ClusterFlags::default(), Some(&last)).unwrap();
        assert_eq!(c.task, TaskId::worker(3));
        assert_eq!(c.spec.endpoint(c.task), Some(&hps(&["w2:1"])[0]));

        let out = TF.replace(r#""index": 1"#, r#""index": 3"#);
        assert!(matches!(
            ClusterConfig::resolve(&ClusterFlags::default(), Some(&out)),
            Err(ConfigError::TaskIndexOutOfRange { task, len: 4 }) if task == TaskId::worker(4)
        ));
    }

    #[test]
    fn tf_config_without_chief_keeps_indices() {
        let json = r#"{"cluster":{"ps":["p:1"],"worker":["w0:1","w1:1"]},
                       "task":{"type":"worker","index":1}}"#;
        let c = ClusterConfig::resolve(&ClusterFlags::default(), Some(json)).unwrap();
        assert_eq!(c.task, TaskId::worker(1));
        let ps = json.replace(r#""type":"worker","index":1"#, r#""type":"ps""#);
        let c = ClusterConfig::resolve(&ClusterFlags::default(), Some(&ps)).unwrap();
        assert_eq!(c.task, TaskId::ps(0), "missing index means 0");
        assert_eq!(c.peer_count(), 2);
    }

    #[test]
    fn tf_config_chief_errors() {
        let two = r#"{"cluster":{"ps":["p:1"],"chief":["a:1","b:1"]}}"#;
        assert!(matches!(
            TfConfig::parse(two),
            Err(ConfigError::TfConfig { .. })
        ));
        let no_chief = r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"chief"}}"#;
        assert!(matches!(
            TfConfig::parse(no_chief),
            Err(ConfigError::TfConfig { .. })
        ));
        let chief1 = r#"{"cluster":{"chief":["c:1"]},"task":{"type":"chief","index":1}}"#;
        assert!(matches!(
            TfConfig::parse(chief1),
            Err(ConfigError::TfConfig { .. })
        ));
    }

    #[test]
    fn tf_config_evaluator_and_unknown_jobs() {
        let eval = r#"{"cluster":{"ps":["p:1"],"worker":["w:1"],"evaluator":["e:1"]},
                       "task":{"type":"evaluator","index":0}}"#;
        let err = ClusterConfig::resolve(&ClusterFlags::default(), Some(eval)).unwrap_err();
        assert!(
            matches!(&err, ConfigError::UnsupportedJob { job, origin: "TF_CONFIG", .. } if job == "evaluator"),
            "{err}"
        );
        // But an evaluator listed in the cluster is ignored.
        let ok = eval.replace("evaluator\",\"index", "ps\",\"index");
        let c = ClusterConfig::resolve(&ClusterFlags::default(), Some(&ok)).unwrap();
        assert_eq!(c.task, TaskId::ps(0));
        assert_eq!(c.spec.workers().len(), 1);
        let odd = r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"master"}}"#;
        assert!(matches!(
            TfConfig::parse(odd),
            Err(ConfigError::UnsupportedJob { .. })
        ));
    }

    #[test]
    fn tf_config_bad_json() {
        for bad in [
            "{",
            "not json",
            r#"{"cluster": 5}"#,
            r#"{"task": {"type": "ps", "index": -1}}"#,
            r#"{"task": {"type": "ps", "index": "0"}}"#,
        ] {
            let err = TfConfig::parse(bad).unwrap_err();
            assert!(
                matches!(err, ConfigError::TfConfigJson { .. }),
                "{bad}: {err}"
            );
            assert!(err.to_string().starts_with("TF_CONFIG"), "{err}");
        }
        for bad in [
            r#"{"cluster": {"ps": "p:1"}}"#,
            r#"{"cluster": {"ps": [1]}}"#,
            r#"{"cluster": {"worker": ["nope"]}}"#,
            r#"{"task": {"index": 1}}"#,
        ] {
            let err = TfConfig::parse(bad).unwrap_err();
            assert!(matches!(err, ConfigError::TfConfig { .. }), "{bad}: {err}");
        }
        let err = TfConfig::parse(r#"{"cluster": {"worker": ["w:1", "nope"]}}"#).unwrap_err();
        assert!(err.to_string().contains("cluster.worker[1]"), "{err}");
    }

    #[test]
    fn tf_config_ignores_unknown_and_empty() {
        assert_eq!(TfConfig::parse("{}").unwrap(), TfConfig::default());
        let t = TfConfig::parse(r#"{"x": [1, {"y": null}], "task": {}}"#).unwrap();
        assert_eq!(t, TfConfig::default());
        // Blank TF_CONFIG counts as unset.
        let c = ClusterConfig::resolve(&flags("p:1", "w:1", "ps", Some(0)), Some("  ")).unwrap();
        assert_eq!(c.task, TaskId::ps(0));
    }

    #[test]
    fn flags_override_tf_config() {
        // Both lists and the task from flags.
        let c =
            ClusterConfig::resolve(&flags("x:1", "y:1,z:1", "worker", Some(1)), Some(TF)).unwrap();
        assert_eq!(c.spec.ps(), hps(&["x:1"]));
        assert_eq!(c.spec.workers(), hps(&["y:1", "z:1"]));
        assert_eq!(c.task, TaskId::worker(1));

        // Only --ps-hosts: workers and task come from TF_CONFIG.
        let f = ClusterFlags {
            ps_hosts: Some("x:1".into()),
            ..Default::default()
        };
        let c = ClusterConfig::resolve(&f, Some(TF)).unwrap();
        assert_eq!(c.spec.ps(), hps(&["x:1"]));
        assert_eq!(c.spec.workers().len(), 4);
        assert_eq!(c.task, TaskId::worker(2));

        // Only the task from flags.
        let f = ClusterFlags {
            job_name: Some("ps".into()),
            task_index: Some(1),
            ..Default::default()
        };
        let c = ClusterConfig::resolve(&f, Some(TF)).unwrap();
        assert_eq!(c.task, TaskId::ps(1));
        assert_eq!(c.spec.ps().len(), 2);

        // A flag that is wrong is an error even if TF_CONFIG is fine.
        let f = ClusterFlags {
            worker_hosts: Some("bad".into()),
            ..Default::default()
        };
        let err = ClusterConfig::resolve(&f, Some(TF)).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidFlag { flag, .. } if flag == "--worker-hosts"),
            "{err}"
        );
    }

    #[test]
    fn flag_chief_is_worker_zero() {
        let c = ClusterConfig::resolve(&flags("p:1", "w0:1,w1:1", "chief", None), None).unwrap();
        assert_eq!(c.task, TaskId::worker(0));
        let c = ClusterConfig::resolve(&flags("p:1", "w0:1,w1:1", "chief", Some(0)), None).unwrap();
        assert_eq!(c.task, TaskId::worker(0));
        let err =
            ClusterConfig::resolve(&flags("p:1", "w0:1,w1:1", "chief", Some(1)), None).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidFlag { flag, .. } if flag == "--task-index"),
            "{err}"
        );
    }

    #[test]
    fn flag_errors() {
        let err = ClusterConfig::resolve(&flags("p:1", "w:1", "boss", Some(0)), None).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidFlag { flag, value, .. } if flag == "--job-name" && value == "boss")
        );
        let err =
            ClusterConfig::resolve(&flags("p:1", "w:1", "evaluator", Some(0)), None).unwrap_err();
        assert!(matches!(
            err,
            ConfigError::UnsupportedJob {
                origin: "--job-name",
                ..
            }
        ));
        let err = ClusterConfig::resolve(&flags("p:1", "w:1", "ps", None), None).unwrap_err();
        assert!(err.to_string().contains("--task-index"), "{err}");
        let f = ClusterFlags {
            task_index: Some(0),
            ..flags("p:1", "w:1", "ps", None)
        };
        let f = ClusterFlags {
            job_name: None,
            ..f
        };
        let err = ClusterConfig::resolve(&f, None).unwrap_err();
        assert!(err.to_string().contains("--job-name"), "{err}");
        let err =
            ClusterConfig::resolve(&flags("p:1,,q:1", "w:1", "ps", Some(0)), None).unwrap_err();
        assert!(err.to_string().contains("entry 2"), "{err}");
        let err = ClusterConfig::resolve(&flags("p:1,q", "w:1", "ps", Some(0)), None).unwrap_err();
        assert!(err.to_string().contains("--ps-hosts"), "{err}");
    }

    #[test]
    fn out_of_range_index() {
        let err =
            ClusterConfig::resolve(&flags("p:1,q:1", "w:1", "ps", Some(2)), None).unwrap_err();
        assert!(
            matches!(err, ConfigError::TaskIndexOutOfRange { task, len: 2 } if task == TaskId::ps(2))
        );
        assert_eq!(
            err_string(&flags("p:1", "w:1", "worker", Some(1))),
            "task /job:worker/task:1 does not exist: job worker has 1 task(s)"
        );
    }

    fn err_string(f: &ClusterFlags) -> String {
        ClusterConfig::resolve(f, None).unwrap_err().to_string()
    }

    #[test]
    fn empty_and_missing() {
        assert!(matches!(
            ClusterConfig::resolve(&flags("", "w:1", "ps", Some(0)), None),
            Err(ConfigError::EmptyJob { job: "ps" })
        ));
        assert!(matches!(
            ClusterConfig::resolve(&ClusterFlags::default(), None),
            Err(ConfigError::EmptyJob { job: "ps" })
        ));
        let json = r#"{"cluster":{"ps":["p:1"]}}"#;
        assert!(matches!(
            ClusterConfig::resolve(&ClusterFlags::default(), Some(json)),
            Err(ConfigError::EmptyJob { job: "worker" })
        ));
        let json = r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]}}"#;
        assert!(matches!(
            ClusterConfig::resolve(&ClusterFlags::default(), Some(json)),
            Err(ConfigError::MissingTask)
        ));
    }

    #[test]
    fn duplicate_endpoints_rejected() {
        let err = ClusterSpec::new(hps(&["a:1", "b:1"]), hps(&["c:1", "B:1"])).unwrap_err();
        assert!(matches!(
            err,
            ConfigError::DuplicateEndpoint { first, second, .. }
                if first == TaskId::ps(1) && second == TaskId::worker(1)
        ));
        let err = ClusterSpec::new(hps(&["a:1"]), hps(&["[::1]:1", "[0::1]:1"])).unwrap_err();
        assert!(matches!(err, ConfigError::DuplicateEndpoint { .. }));
        // Same host, different port is fine.
        ClusterSpec::new(hps(&["a:1"]), hps(&["a:2"])).unwrap();
    }

    #[test]
    fn peers_and_counts() {
        let s = ClusterSpec::new(hps(&["p0:1", "p1:1"]), hps(&["w0:1", "w1:1", "w2:1"])).unwrap();
        assert_eq!(s.peer_count(TaskId::worker(0)), 2);
        assert_eq!(s.peer_count(TaskId::ps(1)), 3);
        assert_eq!(s.connections(TaskId::ps(0)), 3);
        let peers: Vec<_> = s.peers(TaskId::worker(2)).map(|(t, _)| t).collect();
        assert_eq!(peers, vec![TaskId::ps(0), TaskId::ps(1)]);
        assert_eq!(s.tasks().count(), 5);
        assert_eq!(s.tasks().nth(2).unwrap().0, TaskId::worker(0));
        assert!(s.check_task(TaskId::worker(2)).is_ok());
        assert!(s.check_task(TaskId::worker(3)).is_err());
        assert_eq!(s.endpoint(TaskId::ps(5)), None);
    }
}

//! The crate's error type.

use std::path::PathBuf;

use crate::cluster::TaskId;
use crate::hostport::{HostPort, HostPortError};

/// Any configuration error. Every variant names what was wrong and where it
/// came from: the flag, the environment variable, or the file and line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A command-line flag has a value that cannot be used.
    #[error("invalid value {value:?} for {flag}: {reason}")]
    InvalidFlag {
        /// The flag, e.g. `--ps-hosts`.
        flag: String,
        /// The offending value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An environment variable has a value that cannot be used.
    #[error("invalid value {value:?} for environment variable {var}: expected {expected}")]
    InvalidEnv {
        /// The variable, e.g. `PS_ENABLE_POLLING`.
        var: &'static str,
        /// The offending value, as read.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },

    /// `TF_CONFIG` is not valid JSON, or has the wrong shape
    /// (e.g. `"ps"` is not a list of strings).
    #[error("TF_CONFIG is not valid: {source}")]
    TfConfigJson {
        /// The JSON error, with line and column.
        #[source]
        source: serde_json::Error,
    },

    /// `TF_CONFIG` is valid JSON but describes an unusable cluster.
    #[error("TF_CONFIG: {reason}")]
    TfConfig {
        /// What is wrong.
        reason: String,
    },

    /// Neither flags nor `TF_CONFIG` describe the cluster's `job`.
    #[error("no {job} hosts: give --{job}-hosts or list them in TF_CONFIG")]
    EmptyJob {
        /// `"ps"` or `"worker"`.
        job: &'static str,
    },

    /// Neither flags nor `TF_CONFIG` say which task this process is.
    #[error("no task: give --job-name and --task-index, or set \"task\" in TF_CONFIG")]
    MissingTask,

    /// The task's job is not one that takes part in starwire's transport.
    #[error("unsupported job {job:?} (from {origin}): {reason}")]
    UnsupportedJob {
        /// The job name as given.
        job: String,
        /// `--job-name` or `TF_CONFIG`.
        origin: &'static str,
        /// Why it is not supported.
        reason: &'static str,
    },

    /// The task index is not within the job's task list.
    #[error("task {task} does not exist: job {job} has {len} task(s)", job = task.role.job_name())]
    TaskIndexOutOfRange {
        /// The requested task.
        task: TaskId,
        /// How many tasks the job has.
        len: usize,
    },

    /// The same endpoint is given to two tasks.
    #[error("endpoint {endpoint} is listed twice: for {first} and for {second}")]
    DuplicateEndpoint {
        /// The repeated endpoint.
        endpoint: HostPort,
        /// The task it was first listed for.
        first: TaskId,
        /// The task it was listed for again.
        second: TaskId,
    },

    /// A line of an endpoint map file is malformed.
    #[error("{}:{line}: {reason}", path.display())]
    EndpointMapLine {
        /// The file (as given for messages).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: EndpointMapLineError,
    },

    /// An endpoint map file exists but cannot be read.
    #[error("cannot read endpoint map {}: {source}", path.display())]
    EndpointMapIo {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// What is at the endpoint map's path is not a regular file (a
    /// directory, a FIFO, a device): it is not read.
    #[error("endpoint map {} is not a regular file", path.display())]
    EndpointMapNotAFile {
        /// The path.
        path: PathBuf,
    },

    /// An endpoint map file is larger than any cluster's could be: it is
    /// not read.
    #[error("endpoint map {} is larger than {limit} bytes", path.display())]
    EndpointMapTooLarge {
        /// The file.
        path: PathBuf,
        /// The most read, [`crate::MAX_ENDPOINT_MAP_BYTES`].
        limit: u64,
    },

    /// An endpoint map is present but has no entry for a task's endpoint.
    #[error("endpoint map {} has no entry for {endpoint} ({task})", path.display())]
    EndpointNotMapped {
        /// The map file.
        path: PathBuf,
        /// The unmapped (gRPC) endpoint.
        endpoint: HostPort,
        /// The task it belongs to.
        task: TaskId,
    },

    /// Two tasks map to the same fast endpoint.
    #[error(
        "endpoint map {}: {first} and {second} both map to {endpoint}",
        path.display()
    )]
    DuplicateFastEndpoint {
        /// The map file.
        path: PathBuf,
        /// The shared fast endpoint.
        endpoint: HostPort,
        /// The first task mapped to it.
        first: TaskId,
        /// The second task mapped to it.
        second: TaskId,
    },
}

/// What is wrong with one line of an endpoint map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointMapLineError {
    /// The line has no `=`.
    #[error("missing '=': expected grpc_host:port=fast_host:port")]
    MissingEquals,
    /// The line has more than one `=`.
    #[error("more than one '=': expected grpc_host:port=fast_host:port")]
    ExtraEquals,
    /// The left-hand (gRPC) endpoint is invalid.
    #[error("bad grpc endpoint {text:?}: {error}")]
    BadKey {
        /// The text left of `=`.
        text: String,
        /// Why it is invalid.
        error: HostPortError,
    },
    /// The right-hand (fast) endpoint is invalid.
    #[error("bad fast endpoint {text:?}: {error}")]
    BadValue {
        /// The text right of `=`.
        text: String,
        /// Why it is invalid.
        error: HostPortError,
    },
    /// The gRPC endpoint was already mapped on an earlier line.
    #[error("duplicate key {key}: already mapped on line {first_line}")]
    DuplicateKey {
        /// The repeated key.
        key: HostPort,
        /// 1-based line of the first mapping.
        first_line: usize,
    },
    /// The line is not valid UTF-8.
    #[error("line is not valid UTF-8")]
    InvalidUtf8,
}

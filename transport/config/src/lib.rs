//! Configuration for starwire: the cluster spec (TensorFlow flags or
//! `TF_CONFIG`), DeepRec's `.endpoint_map`, and DeepRec's network tuning
//! environment variables.
//!
//! Everything is sans-IO where possible: parsers take strings, and the
//! environment is passed in as a lookup function
//! (`&impl Fn(&str) -> Option<String>`), so tests never touch the process
//! environment. Thin `from_process_env` wrappers read the real one.
//!
//! * [`ClusterConfig::resolve`] — which tasks exist and which one we are.
//! * [`EndpointMap`] — gRPC endpoint → fast endpoint.
//! * [`NetworkSettings::resolve`] / [`Settings`] — polling, core numbers,
//!   pinning, each value with its [`Source`].
//!
//! User documentation: `docs/CONFIG.md`.
#![deny(unsafe_code)]

mod cluster;
mod endpoint_map;
mod error;
mod hostport;
mod settings;

pub use cluster::{
    flag, parse_host_list, ClusterConfig, ClusterFlags, ClusterSpec, Role, TaskId, TfConfig,
    TF_CONFIG,
};
pub use endpoint_map::{
    EndpointMap, EndpointMapEntry, ENDPOINT_MAP_FILE, MAX_ENDPOINT_MAP_BYTES,
    TF_SEASTAR_ENDPOINT_MAP_PATH,
};
pub use error::{ConfigError, EndpointMapLineError};
pub use hostport::{HostPort, HostPortError};
pub use settings::{
    parse_bool, vars, FlagOverride, IdlePolicy, NetworkSettings, Overrides, RoleOverrides, Setting,
    SettingRow, Settings, Source, DEFAULT_PS_MAX_CORES, DEFAULT_WORKER_MAX_CORES,
};

/// Reads a variable from the process environment, for use as the `env`
/// argument of the resolvers. A value that is not valid Unicode is returned
/// lossily converted, so that it fails validation with an error naming the
/// variable instead of being silently treated as unset.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

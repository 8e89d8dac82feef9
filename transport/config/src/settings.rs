//! Network tuning settings with the source of each value.

use std::fmt;
use std::time::Duration;

use crate::cluster::{ClusterSpec, Role};
use crate::error::ConfigError;

/// Variable names.
pub mod vars {
    /// Busy-poll worker reactors (DeepRec).
    pub const WORKER_ENABLE_POLLING: &str = "WORKER_ENABLE_POLLING";
    /// Busy-poll ps reactors (DeepRec).
    pub const PS_ENABLE_POLLING: &str = "PS_ENABLE_POLLING";
    /// Reactor cores of a ps (DeepRec).
    pub const NETWORK_PS_CORE_NUMBER: &str = "NETWORK_PS_CORE_NUMBER";
    /// Reactor cores of a worker (DeepRec).
    pub const NETWORK_WORKER_CORE_NUMBER: &str = "NETWORK_WORKER_CORE_NUMBER";
    /// Do not pin worker reactors to cores (DeepRec).
    pub const WORKER_DISABLE_PIN_CORES: &str = "WORKER_DISABLE_PIN_CORES";
    /// Do not pin ps reactors to cores (DeepRec).
    pub const PS_DISABLE_PIN_CORES: &str = "PS_DISABLE_PIN_CORES";
    /// Idle busy-poll time before parking, in µs (starwire only).
    pub const STARWIRE_IDLE_POLL_US: &str = "STARWIRE_IDLE_POLL_US";
}

/// Default cap on a ps's core number (DeepRec).
pub const DEFAULT_PS_MAX_CORES: usize = 8;
/// Default cap on a worker's core number (DeepRec).
pub const DEFAULT_WORKER_MAX_CORES: usize = 2;

/// The variables of one role.
#[derive(Debug, Clone, Copy)]
struct RoleVars {
    polling: &'static str,
    cores: &'static str,
    disable_pin: &'static str,
    max_default_cores: usize,
}

fn role_vars(role: Role) -> RoleVars {
    match role {
        Role::Ps => RoleVars {
            polling: vars::PS_ENABLE_POLLING,
            cores: vars::NETWORK_PS_CORE_NUMBER,
            disable_pin: vars::PS_DISABLE_PIN_CORES,
            max_default_cores: DEFAULT_PS_MAX_CORES,
        },
        Role::Worker => RoleVars {
            polling: vars::WORKER_ENABLE_POLLING,
            cores: vars::NETWORK_WORKER_CORE_NUMBER,
            disable_pin: vars::WORKER_DISABLE_PIN_CORES,
            max_default_cores: DEFAULT_WORKER_MAX_CORES,
        },
    }
}

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The built-in default.
    Default,
    /// The named environment variable.
    Environment(&'static str),
    /// The named command-line flag.
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Environment(var) => write!(f, "env {var}"),
            Source::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// An effective value and its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    /// The value in force.
    pub value: T,
    /// Where it came from.
    pub source: Source,
}

/// A value given by a command-line flag, with the flag's name for display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagOverride<T> {
    /// The flag as the user wrote it, e.g. `--ps-enable-polling`.
    pub flag: String,
    /// The value.
    pub value: T,
}

impl<T> FlagOverride<T> {
    /// A flag override.
    pub fn new(flag: impl Into<String>, value: T) -> Self {
        FlagOverride {
            flag: flag.into(),
            value,
        }
    }
}

/// Flag overrides of one role's variables. Each field mirrors the variable
/// of the same meaning (note `disable_pin_cores`, like the variable).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoleOverrides {
    /// Overrides `*_ENABLE_POLLING`.
    pub enable_polling: Option<FlagOverride<bool>>,
    /// Overrides `NETWORK_*_CORE_NUMBER` (must be ≥ 1).
    pub core_number: Option<FlagOverride<usize>>,
    /// Overrides `*_DISABLE_PIN_CORES`.
    pub disable_pin_cores: Option<FlagOverride<bool>>,
}

/// All flag overrides. Flags win over the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Overrides of the `PS_*` / `NETWORK_PS_*` variables.
    pub ps: RoleOverrides,
    /// Overrides of the `WORKER_*` / `NETWORK_WORKER_*` variables.
    pub worker: RoleOverrides,
    /// Overrides `STARWIRE_IDLE_POLL_US`.
    pub idle_poll_us: Option<FlagOverride<u64>>,
}

impl Overrides {
    /// The overrides of one role.
    pub fn role(&self, role: Role) -> &RoleOverrides {
        match role {
            Role::Ps => &self.ps,
            Role::Worker => &self.worker,
        }
    }

    /// Mutable overrides of one role.
    pub fn role_mut(&mut self, role: Role) -> &mut RoleOverrides {
        match role {
            Role::Ps => &mut self.ps,
            Role::Worker => &mut self.worker,
        }
    }
}

/// What a reactor does when it finds no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Park (block in the OS) at once. Polling disabled.
    Park,
    /// Busy-poll forever. Polling enabled, idle-poll time 0.
    BusyPoll,
    /// Busy-poll for this long, then park. Polling enabled, idle-poll
    /// time > 0.
    PollThenPark(Duration),
}

impl IdlePolicy {
    /// The policy of a reactor with polling on or off and an idle-poll time
    /// of `idle_poll_us` µs (`STARWIRE_IDLE_POLL_US`): off parks at once;
    /// on polls forever with 0, else polls that long, then parks.
    pub fn from_polling(polling: bool, idle_poll_us: u64) -> Self {
        match (polling, idle_poll_us) {
            (false, _) => IdlePolicy::Park,
            (true, 0) => IdlePolicy::BusyPoll,
            (true, us) => IdlePolicy::PollThenPark(Duration::from_micros(us)),
        }
    }
}

const BOOL_EXPECTED: &str = "true, false, 1 or 0 (any case)";
const CORES_EXPECTED: &str = "an integer from 1 to 1024";

/// Most reactor cores a role may ask for: each is a thread with its own
/// descriptors, and past this many a typo (`5000`) would start thousands
/// of them and fail far from its cause.
pub const MAX_CORES: usize = 1024;
const MICROS_EXPECTED: &str = "an integer number of microseconds >= 0";

/// Parses a boolean the DeepRec/TensorFlow way: `true`/`false`/`1`/`0`, any
/// case, surrounding whitespace ignored.
pub fn parse_bool(s: &str) -> Option<bool> {
    let s = s.trim();
    if s == "1" || s.eq_ignore_ascii_case("true") {
        Some(true)
    } else if s == "0" || s.eq_ignore_ascii_case("false") {
        Some(false)
    } else {
        None
    }
}

fn parse_digits<T: std::str::FromStr>(s: &str) -> Option<T> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Resolves one value: flag, else environment (parsed), else default.
fn resolve<T: Clone>(
    var: &'static str,
    flag: Option<&FlagOverride<T>>,
    env: &impl Fn(&str) -> Option<String>,
    parse: impl Fn(&str) -> Option<T>,
    expected: &'static str,
    default: T,
) -> Result<Setting<T>, ConfigError> {
    if let Some(f) = flag {
        return Ok(Setting {
            value: f.value.clone(),
            source: Source::Flag(f.flag.clone()),
        });
    }
    match env(var) {
        Some(raw) => match parse(&raw) {
            Some(value) => Ok(Setting {
                value,
                source: Source::Environment(var),
            }),
            None => Err(ConfigError::InvalidEnv {
                var,
                value: raw,
                expected,
            }),
        },
        None => Ok(Setting {
            value: default,
            source: Source::Default,
        }),
    }
}

/// Effective network settings for one role: DeepRec's environment
/// variables plus one starwire-only variable, each with the source of its
/// effective value.
///
/// Precedence, highest first: command-line flag ([`Overrides`]), environment
/// variable, default.
///
/// | variable | default | meaning |
/// |---|---|---|
/// | `WORKER_ENABLE_POLLING`, `PS_ENABLE_POLLING` | `false` | busy-poll the reactors of that role |
/// | `NETWORK_WORKER_CORE_NUMBER` | min(2, connections) | reactor cores of a worker |
/// | `NETWORK_PS_CORE_NUMBER` | min(8, connections) | reactor cores of a ps |
/// | `WORKER_DISABLE_PIN_CORES`, `PS_DISABLE_PIN_CORES` | `true` | do not pin reactors to cores |
/// | `STARWIRE_IDLE_POLL_US` (starwire only) | `0` | with polling on: µs to poll before parking, 0 = never park |
///
/// "connections" is the number of peer tasks (for a ps, the workers; for a
/// worker, the ps), at least 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkSettings {
    /// The role these settings are for.
    pub role: Role,
    /// Peer tasks used for the default core number (at least 1).
    pub connections: usize,
    /// Busy polling of the reactors (`*_ENABLE_POLLING`).
    pub polling: Setting<bool>,
    /// Reactor cores (`NETWORK_*_CORE_NUMBER`), ≥ 1.
    pub cores: Setting<usize>,
    /// Whether reactors are pinned to cores: the *negation* of
    /// `*_DISABLE_PIN_CORES`.
    pub pin_cores: Setting<bool>,
    /// Idle busy-poll time before parking in µs (`STARWIRE_IDLE_POLL_US`);
    /// only used when polling is enabled.
    pub idle_poll_us: Setting<u64>,
}

impl NetworkSettings {
    /// Resolves the settings of `role` from defaults, `env` and `overrides`.
    ///
    /// `connections` is the number of peer tasks (see
    /// [`ClusterSpec::peer_count`]); 0 is treated as 1.
    pub fn resolve(
        role: Role,
        connections: usize,
        env: &impl Fn(&str) -> Option<String>,
        overrides: &Overrides,
    ) -> Result<Self, ConfigError> {
        let v = role_vars(role);
        let o = overrides.role(role);
        let connections = connections.max(1);
        let polling = resolve(
            v.polling,
            o.enable_polling.as_ref(),
            env,
            parse_bool,
            BOOL_EXPECTED,
            false,
        )?;
        if let Some(f) = &o.core_number {
            if f.value == 0 || f.value > MAX_CORES {
                return Err(ConfigError::InvalidFlag {
                    flag: f.flag.clone(),
                    value: f.value.to_string(),
                    reason: format!("expected {CORES_EXPECTED}"),
                });
            }
        }
        let cores = resolve(
            v.cores,
            o.core_number.as_ref(),
            env,
            |s| parse_digits::<usize>(s).filter(|n| (1..=MAX_CORES).contains(n)),
            CORES_EXPECTED,
            v.max_default_cores.min(connections),
        )?;
        let disable_pin = resolve(
            v.disable_pin,
            o.disable_pin_cores.as_ref(),
            env,
            parse_bool,
            BOOL_EXPECTED,
            true,
        )?;
        let idle_poll_us = resolve(
            vars::STARWIRE_IDLE_POLL_US,
            overrides.idle_poll_us.as_ref(),
            env,
            parse_digits::<u64>,
            MICROS_EXPECTED,
            0,
        )?;
        Ok(NetworkSettings {
            role,
            connections,
            polling,
            cores,
            pin_cores: Setting {
                value: !disable_pin.value,
                source: disable_pin.source,
            },
            idle_poll_us,
        })
    }

    /// [`resolve`](Self::resolve) with the process environment.
    pub fn from_process_env(
        role: Role,
        connections: usize,
        overrides: &Overrides,
    ) -> Result<Self, ConfigError> {
        Self::resolve(role, connections, &crate::process_env, overrides)
    }

    /// What an idle reactor does: see [`IdlePolicy`].
    pub fn idle_policy(&self) -> IdlePolicy {
        IdlePolicy::from_polling(self.polling.value, self.idle_poll_us.value)
    }

    /// This role's three DeepRec variables as display rows, values as the
    /// variables spell them.
    pub fn rows(&self) -> Vec<SettingRow> {
        let v = role_vars(self.role);
        let cores_note = (self.cores.source == Source::Default).then(|| {
            format!(
                "min({}, {} connection{})",
                v.max_default_cores,
                self.connections,
                if self.connections == 1 { "" } else { "s" }
            )
        });
        vec![
            SettingRow {
                variable: v.polling,
                value: self.polling.value.to_string(),
                source: self.polling.source.clone(),
                note: None,
            },
            SettingRow {
                variable: v.cores,
                value: self.cores.value.to_string(),
                source: self.cores.source.clone(),
                note: cores_note,
            },
            SettingRow {
                variable: v.disable_pin,
                value: (!self.pin_cores.value).to_string(),
                source: self.pin_cores.source.clone(),
                note: None,
            },
        ]
    }

    fn idle_row(&self) -> SettingRow {
        SettingRow {
            variable: vars::STARWIRE_IDLE_POLL_US,
            value: self.idle_poll_us.value.to_string(),
            source: self.idle_poll_us.source.clone(),
            note: Some("starwire only".to_owned()),
        }
    }
}

impl fmt::Display for NetworkSettings {
    /// Aligned `VARIABLE  VALUE  SOURCE` lines: the role's three DeepRec
    /// variables and `STARWIRE_IDLE_POLL_US`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rows = self.rows();
        rows.push(self.idle_row());
        write_rows(f, &rows)
    }
}

/// One line of a settings listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingRow {
    /// The environment variable.
    pub variable: &'static str,
    /// The effective value, as the variable spells it.
    pub value: String,
    /// Where it came from.
    pub source: Source,
    /// Extra detail, e.g. how a default was computed.
    pub note: Option<String>,
}

fn write_rows(f: &mut fmt::Formatter<'_>, rows: &[SettingRow]) -> fmt::Result {
    let var_w = rows.iter().map(|r| r.variable.len()).max().unwrap_or(0);
    let val_w = rows.iter().map(|r| r.value.len()).max().unwrap_or(0);
    for r in rows {
        let source = match &r.note {
            Some(note) => format!("{} ({note})", r.source),
            None => r.source.to_string(),
        };
        writeln!(f, "{:<var_w$}  {:<val_w$}  {source}", r.variable, r.value)?;
    }
    Ok(())
}

/// The settings of both roles: everything `starwire info` shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Settings a ps would use.
    pub ps: NetworkSettings,
    /// Settings a worker would use.
    pub worker: NetworkSettings,
}

impl Settings {
    /// Resolves both roles. `ps_connections` is the number of workers,
    /// `worker_connections` the number of ps.
    pub fn resolve(
        ps_connections: usize,
        worker_connections: usize,
        env: &impl Fn(&str) -> Option<String>,
        overrides: &Overrides,
    ) -> Result<Self, ConfigError> {
        Ok(Settings {
            ps: NetworkSettings::resolve(Role::Ps, ps_connections, env, overrides)?,
            worker: NetworkSettings::resolve(Role::Worker, worker_connections, env, overrides)?,
        })
    }

    /// Resolves both roles with connections taken from `spec`.
    pub fn for_cluster(
        spec: &ClusterSpec,
        env: &impl Fn(&str) -> Option<String>,
        overrides: &Overrides,
    ) -> Result<Self, ConfigError> {
        Self::resolve(spec.workers().len(), spec.ps().len(), env, overrides)
    }

    /// [`for_cluster`](Self::for_cluster) with the process environment.
    pub fn from_process_env(
        spec: &ClusterSpec,
        overrides: &Overrides,
    ) -> Result<Self, ConfigError> {
        Self::for_cluster(spec, &crate::process_env, overrides)
    }

    /// The settings of one role.
    pub fn role(&self, role: Role) -> &NetworkSettings {
        match role {
            Role::Ps => &self.ps,
            Role::Worker => &self.worker,
        }
    }

    /// All seven variables as display rows: the worker's three, the ps's
    /// three, then `STARWIRE_IDLE_POLL_US`.
    pub fn rows(&self) -> Vec<SettingRow> {
        let mut rows = self.worker.rows();
        rows.extend(self.ps.rows());
        rows.push(self.ps.idle_row());
        rows
    }
}

impl fmt::Display for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_rows(f, &self.rows())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn none(_: &str) -> Option<String> {
        None
    }

    fn ns(
        role: Role,
        conns: usize,
        pairs: &[(&str, &str)],
    ) -> Result<NetworkSettings, ConfigError> {
        NetworkSettings::resolve(role, conns, &env_of(pairs), &Overrides::default())
    }

    #[test]
    fn defaults() {
        let ps = NetworkSettings::resolve(Role::Ps, 20, &none, &Overrides::default()).unwrap();
        assert_eq!(
            ps.polling,
            Setting {
                value: false,
                source: Source::Default
            }
        );
        assert_eq!(ps.cores.value, 8);
        assert!(!ps.pin_cores.value, "pinning is disabled by default");
        assert_eq!(ps.pin_cores.source, Source::Default);
        assert_eq!(ps.idle_poll_us.value, 0);
        assert_eq!(ps.idle_policy(), IdlePolicy::Park);
        let w = ns(Role::Worker, 20, &[]).unwrap();
        assert_eq!(w.cores.value, 2);
        assert!(!w.polling.value && !w.pin_cores.value);
    }

    #[test]
    fn default_cores_follow_connections() {
        for (conns, ps, worker) in [
            (0, 1, 1),
            (1, 1, 1),
            (2, 2, 2),
            (3, 3, 2),
            (8, 8, 2),
            (9, 8, 2),
        ] {
            assert_eq!(
                ns(Role::Ps, conns, &[]).unwrap().cores.value,
                ps,
                "ps {conns}"
            );
            assert_eq!(
                ns(Role::Worker, conns, &[]).unwrap().cores.value,
                worker,
                "worker {conns}"
            );
        }
        assert_eq!(ns(Role::Ps, 0, &[]).unwrap().connections, 1);
    }

    #[test]
    fn every_boolean_spelling() {
        let cases = [
            ("true", true),
            ("TRUE", true),
            ("True", true),
            ("tRuE", true),
            ("1", true),
            (" 1 ", true),
            ("\ttrue\n", true),
            ("false", false),
            ("FALSE", false),
            ("False", false),
            ("0", false),
            ("  false ", false),
        ];
        for (raw, want) in cases {
            assert_eq!(parse_bool(raw), Some(want), "{raw:?}");
            let s = ns(Role::Worker, 4, &[(vars::WORKER_ENABLE_POLLING, raw)]).unwrap();
            assert_eq!(s.polling.value, want, "{raw:?}");
            assert_eq!(
                s.polling.source,
                Source::Environment(vars::WORKER_ENABLE_POLLING)
            );
            let s = ns(Role::Ps, 4, &[(vars::PS_DISABLE_PIN_CORES, raw)]).unwrap();
            assert_eq!(s.pin_cores.value, !want, "{raw:?}");
        }
        for bad in ["", " ", "yes", "no", "on", "2", "-1", "t", "truee", "0x1"] {
            assert_eq!(parse_bool(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn invalid_values_name_the_variable() {
        let cases: &[(Role, &str, &str)] = &[
            (Role::Ps, vars::PS_ENABLE_POLLING, "yes"),
            (Role::Worker, vars::WORKER_ENABLE_POLLING, ""),
            (Role::Ps, vars::PS_DISABLE_PIN_CORES, "2"),
            (Role::Worker, vars::WORKER_DISABLE_PIN_CORES, "off"),
            (Role::Ps, vars::NETWORK_PS_CORE_NUMBER, "0"),
            (Role::Ps, vars::NETWORK_PS_CORE_NUMBER, "-3"),
            (Role::Ps, vars::NETWORK_PS_CORE_NUMBER, "1025"),
            (Role::Worker, vars::NETWORK_WORKER_CORE_NUMBER, "5000"),
            (Role::Worker, vars::NETWORK_WORKER_CORE_NUMBER, "2.5"),
            (Role::Worker, vars::NETWORK_WORKER_CORE_NUMBER, "+2"),
            (
                Role::Worker,
                vars::NETWORK_WORKER_CORE_NUMBER,
                "99999999999999999999999",
            ),
            (Role::Ps, vars::STARWIRE_IDLE_POLL_US, "10us"),
        ];
        for &(role, var, value) in cases {
            let err = ns(role, 4, &[(var, value)]).unwrap_err();
            match &err {
                ConfigError::InvalidEnv {
                    var: v, value: got, ..
                } => {
                    assert_eq!(*v, var);
                    assert_eq!(got, value);
                }
                other => panic!("{var}={value:?}: {other:?}"),
            }
            let msg = err.to_string();
            assert!(
                msg.contains(var) && msg.contains(&format!("{value:?}")),
                "{msg}"
            );
        }
    }

    #[test]
    fn other_roles_variables_are_not_read() {
        // A bad PS_ variable does not affect resolving a worker.
        let w = ns(Role::Worker, 4, &[(vars::PS_ENABLE_POLLING, "bogus")]).unwrap();
        assert!(!w.polling.value);
        assert!(ns(Role::Ps, 4, &[(vars::PS_ENABLE_POLLING, "bogus")]).is_err());
    }

    #[test]
    fn environment_values() {
        let env = [
            (vars::NETWORK_PS_CORE_NUMBER, " 12 "),
            (vars::PS_ENABLE_POLLING, "1"),
            (vars::PS_DISABLE_PIN_CORES, "false"),
        ];
        let s = ns(Role::Ps, 3, &env).unwrap();
        assert_eq!(s.cores.value, 12, "explicit value is not capped");
        assert_eq!(
            s.cores.source,
            Source::Environment(vars::NETWORK_PS_CORE_NUMBER)
        );
        assert!(s.polling.value);
        assert!(s.pin_cores.value);
        assert_eq!(
            s.pin_cores.source,
            Source::Environment(vars::PS_DISABLE_PIN_CORES)
        );
    }

    #[test]
    fn flags_override_environment() {
        let env = env_of(&[
            (vars::WORKER_ENABLE_POLLING, "false"),
            (vars::NETWORK_WORKER_CORE_NUMBER, "bogus"),
            (vars::WORKER_DISABLE_PIN_CORES, "true"),
            (vars::STARWIRE_IDLE_POLL_US, "5"),
        ]);
        let mut o = Overrides::default();
        o.worker.enable_polling = Some(FlagOverride::new("--worker-enable-polling", true));
        o.worker.core_number = Some(FlagOverride::new("--worker-cores", 3));
        o.worker.disable_pin_cores = Some(FlagOverride::new("--worker-disable-pin-cores", false));
        o.idle_poll_us = Some(FlagOverride::new("--idle-poll-us", 50));
        let s = NetworkSettings::resolve(Role::Worker, 10, &env, &o).unwrap();
        assert_eq!(
            s.polling,
            Setting {
                value: true,
                source: Source::Flag("--worker-enable-polling".into())
            }
        );
        assert_eq!(s.cores.value, 3);
        assert_eq!(s.cores.source, Source::Flag("--worker-cores".into()));
        assert!(s.pin_cores.value);
        assert_eq!(s.idle_poll_us.value, 50);
        assert_eq!(
            s.idle_policy(),
            IdlePolicy::PollThenPark(Duration::from_micros(50))
        );

        // Worker flags do not apply to the ps.
        let env = env_of(&[]);
        let p = NetworkSettings::resolve(Role::Ps, 10, &env, &o).unwrap();
        assert_eq!(p.polling.source, Source::Default);

        o.worker.core_number = Some(FlagOverride::new("--worker-cores", 0));
        let err = NetworkSettings::resolve(Role::Worker, 10, &env, &o).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidFlag { flag, .. } if flag == "--worker-cores"),
            "{err}"
        );
    }

    #[test]
    fn idle_policy() {
        let s = |p: &str, us: &str| {
            ns(
                Role::Ps,
                1,
                &[
                    (vars::PS_ENABLE_POLLING, p),
                    (vars::STARWIRE_IDLE_POLL_US, us),
                ],
            )
            .unwrap()
            .idle_policy()
        };
        assert_eq!(s("0", "0"), IdlePolicy::Park);
        assert_eq!(s("0", "100"), IdlePolicy::Park);
        assert_eq!(s("1", "0"), IdlePolicy::BusyPoll);
        assert_eq!(
            s("1", "100"),
            IdlePolicy::PollThenPark(Duration::from_micros(100))
        );
    }

    #[test]
    fn settings_for_cluster_and_display() {
        use crate::HostPort;
        let hp = |s: &str| HostPort::parse(s).unwrap();
        let spec = ClusterSpec::new(
            vec![hp("p0:1"), hp("p1:1"), hp("p2:1")],
            (0..10).map(|i| hp(&format!("w{i}:1"))).collect(),
        )
        .unwrap();
        let env = env_of(&[(vars::WORKER_ENABLE_POLLING, "TRUE")]);
        let mut o = Overrides::default();
        o.role_mut(Role::Ps).core_number = Some(FlagOverride::new("--ps-cores", 4));
        let s = Settings::for_cluster(&spec, &env, &o).unwrap();
        assert_eq!(s.ps.connections, 10);
        assert_eq!(s.worker.connections, 3);
        assert_eq!(s.role(Role::Ps).cores.value, 4);
        assert_eq!(s.role(Role::Worker).cores.value, 2);
        assert_eq!(s.rows().len(), 7);

        let text = s.to_string();
        let want = "\
WORKER_ENABLE_POLLING       true   env WORKER_ENABLE_POLLING
NETWORK_WORKER_CORE_NUMBER  2      default (min(2, 3 connections))
WORKER_DISABLE_PIN_CORES    true   default
PS_ENABLE_POLLING           false  default
NETWORK_PS_CORE_NUMBER      4      flag --ps-cores
PS_DISABLE_PIN_CORES        true   default
STARWIRE_IDLE_POLL_US       0      default (starwire only)
";
        assert_eq!(text, want);

        let one = ns(Role::Ps, 1, &[]).unwrap().to_string();
        assert_eq!(one.lines().count(), 4);
        assert!(one.contains("min(8, 1 connection)"), "{one}");
    }
}

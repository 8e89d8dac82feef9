//! Where the soak's reactors run and how they idle. The client side runs
//! as a worker and the server side as a PS: each reads its role's DeepRec
//! variables, and a flag overrides them. Where neither a flag nor a
//! variable says, the soak's own defaults apply: polling on and reactors
//! pinned, so that by default a soak drives the fast path.

use std::time::Duration;

use starwire_config::{
    ConfigError, FlagOverride, NetworkSettings, Overrides, Role, Setting, Source,
};
use starwire_placement::{plan, CpuId, CpuSet, Placement, ReactorMode, Topology};
use starwire_telemetry::Telemetry;
use starwire_train::cluster::OVERSUBSCRIBED_IDLE_POLL;
use starwire_transport::reactor::{IdlePolicy, ReactorSpec};

use super::remote::Ends;
use super::SoakArgs;
use crate::failure::Failure;

/// Polling where neither `--polling` nor the side's `*_ENABLE_POLLING`
/// says.
const DEFAULT_POLLING: bool = true;
/// Pinning where the side's `*_DISABLE_PIN_CORES` does not say.
const DEFAULT_PINNED: bool = true;

/// Longest single park of a soak reactor.
const MAX_PARK: Duration = Duration::from_millis(50);

/// One side of the soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Client,
    Server,
}

impl Side {
    /// The role whose variables the side reads.
    fn role(self) -> Role {
        match self {
            Side::Client => Role::Worker,
            Side::Server => Role::Ps,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Side::Client => "client",
            Side::Server => "server",
        }
    }
}

/// How one side's reactors run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SideSettings {
    /// Reactors, at most one per connection.
    pub reactors: usize,
    pub polling: bool,
    pub pinned: bool,
}

/// Both sides' settings, and what the operator should know of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SoakSettings {
    pub client: SideSettings,
    pub server: SideSettings,
    /// `STARWIRE_IDLE_POLL_US`, one variable for both roles.
    pub idle_poll_us: u64,
    pub warnings: Vec<String>,
}

impl SoakSettings {
    fn side(&self, side: Side) -> &SideSettings {
        match side {
            Side::Client => &self.client,
            Side::Server => &self.server,
        }
    }
}

/// The settings of `args` with the variables `env` reads: a flag, else
/// the variable, else the soak's default (`NETWORK_*_CORE_NUMBER`'s
/// default is DeepRec's, min(2 or 8, connections)).
pub(super) fn settings(
    args: &SoakArgs,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<SoakSettings, ConfigError> {
    let mut o = Overrides::default();
    if let Some(on) = args.polling {
        for role in Role::ALL {
            o.role_mut(role).enable_polling = Some(FlagOverride::new("--polling", on));
        }
    }
    if let Some(n) = args.client_reactors {
        o.worker.core_number = Some(FlagOverride::new("--client-reactors", n));
    }
    if let Some(n) = args.server_reactors {
        o.ps.core_number = Some(FlagOverride::new("--server-reactors", n));
    }
    let n = args.connections;
    let resolve = |side: Side| NetworkSettings::resolve(side.role(), n, env, &o);
    let (client, server) = (resolve(Side::Client)?, resolve(Side::Server)?);
    let mut warnings = Vec::new();
    let mut side = |side: Side, s: &NetworkSettings| SideSettings {
        reactors: one_per_connection(side, &s.cores, n, &mut warnings),
        polling: given_or(&s.polling, DEFAULT_POLLING),
        pinned: given_or(&s.pin_cores, DEFAULT_PINNED),
    };
    Ok(SoakSettings {
        client: side(Side::Client, &client),
        server: side(Side::Server, &server),
        idle_poll_us: client.idle_poll_us.value,
        warnings,
    })
}

/// A flag's or variable's value, else the soak's `default`.
fn given_or(s: &Setting<bool>, default: bool) -> bool {
    if s.source == Source::Default {
        default
    } else {
        s.value
    }
}

/// A side's reactors: a reactor beyond the connections would have none to
/// serve, so a count above them is cut to them, with a warning.
fn one_per_connection(
    side: Side,
    cores: &Setting<usize>,
    connections: usize,
    warnings: &mut Vec<String>,
) -> usize {
    let n = connections.max(1);
    if cores.value > n {
        warnings.push(format!(
            "{} {} reactors ({}) for {n} connections: {n} run, one per connection",
            cores.value,
            side.name(),
            cores.source
        ));
    }
    cores.value.min(n)
}

/// Where each reactor runs and how it idles.
pub(super) struct Layout {
    /// Per client reactor, its CPU if pinned (`None` for every one when
    /// the client side runs in another process).
    pub client_cpus: Vec<Option<CpuId>>,
    /// Per server reactor, the same.
    pub server_cpus: Vec<Option<CpuId>>,
    pub client_idle: IdlePolicy,
    pub server_idle: IdlePolicy,
    /// The idle policies of the sides here, for the report.
    pub idle_name: String,
    /// Which of the sides here are pinned, for the text report.
    pub pinning: String,
    /// More reactors here than usable CPUs.
    pub oversubscribed: bool,
    /// Usable CPUs.
    pub cpus: usize,
    /// Where the client reactors publish their counts.
    pub telemetry: Telemetry,
}

impl Layout {
    /// How `side`'s reactors idle.
    pub fn idle(&self, side: Side) -> IdlePolicy {
        match side {
            Side::Client => self.client_idle,
            Side::Server => self.server_idle,
        }
    }

    /// The spec of `side`'s reactor `k` (server reactors are numbered after
    /// the clients').
    pub fn spec(&self, side: Side, k: usize) -> ReactorSpec {
        let (index, cpu) = match side {
            Side::Client => (k, self.client_cpus[k]),
            Side::Server => (self.client_cpus.len() + k, self.server_cpus[k]),
        };
        ReactorSpec {
            index,
            cpu,
            idle: self.idle(side),
            max_park: MAX_PARK,
        }
    }
}

/// The layout of `args` on the CPUs this process may use: the settings
/// from the process environment (an invalid variable is a usage error),
/// placed on this machine's topology.
pub(super) fn layout(args: &SoakArgs) -> Result<Layout, Failure> {
    let s =
        settings(args, &starwire_config::process_env).map_err(|e| Failure::Usage(e.to_string()))?;
    for w in &s.warnings {
        tracing::warn!("{w}");
    }
    let usable = CpuSet::process_affinity()
        .map_err(|e| Failure::Run(format!("reading CPU affinity: {e}")))?;
    let topology = Topology::detect().unwrap_or_default();
    Ok(place(&s, &Ends::of(args), &usable, &topology)?)
}

/// Place the reactors of `s` that `ends` runs here on `usable` CPUs laid
/// out as `topology`: those of pinned sides (clients first) on the CPUs of
/// one plan, the others nowhere in particular. Reactors sharing CPUs poll,
/// then park, instead of spinning.
fn place(
    s: &SoakSettings,
    ends: &Ends,
    usable: &CpuSet,
    topology: &Topology,
) -> Result<Layout, String> {
    let here = |side: Side| {
        if ends.runs(side) {
            s.side(side).reactors
        } else {
            0
        }
    };
    let pinned = |side: Side| if s.side(side).pinned { here(side) } else { 0 };
    let reactors = here(Side::Client) + here(Side::Server);
    let (pinned_clients, pinned_servers) = (pinned(Side::Client), pinned(Side::Server));
    let cpus = if pinned_clients + pinned_servers > 0 {
        plan(
            &Placement::MaxPack,
            pinned_clients + pinned_servers,
            ReactorMode::PollThenPark,
            usable,
            topology,
        )
        .map_err(|e| format!("placing {} reactors: {e}", pinned_clients + pinned_servers))?
        .cpus()
    } else {
        Vec::new()
    };
    let (client_cpus, server_cpus) = cpus.split_at(pinned_clients);
    let cpus_of = |cpus: &[Option<CpuId>], side: Side| -> Vec<Option<CpuId>> {
        (0..s.side(side).reactors)
            .map(|k| cpus.get(k).copied().flatten())
            .collect()
    };
    let oversubscribed = reactors > usable.len();
    let idle = |side: Side| idle_policy(s.side(side).polling, s.idle_poll_us, oversubscribed);
    let ((client_idle, client_name), (server_idle, server_name)) =
        (idle(Side::Client), idle(Side::Server));
    let pin_name = |side: Side| {
        if s.side(side).pinned {
            "pinned"
        } else {
            "unpinned"
        }
    };
    let (mut idle_name, pinning) = match (ends.runs(Side::Client), ends.runs(Side::Server)) {
        (true, false) => (client_name, pin_name(Side::Client).to_owned()),
        (false, true) => (server_name, pin_name(Side::Server).to_owned()),
        _ => (
            both(client_name, server_name),
            both(
                pin_name(Side::Client).to_owned(),
                pin_name(Side::Server).to_owned(),
            ),
        ),
    };
    let polls_here = [Side::Client, Side::Server]
        .into_iter()
        .any(|side| ends.runs(side) && s.side(side).polling);
    if oversubscribed && polls_here {
        idle_name += &format!(": {reactors} reactors on {} cpus", usable.len());
    }
    Ok(Layout {
        client_cpus: cpus_of(client_cpus, Side::Client),
        server_cpus: cpus_of(server_cpus, Side::Server),
        client_idle,
        server_idle,
        idle_name,
        pinning,
        oversubscribed,
        cpus: usable.len(),
        telemetry: Telemetry::new(),
    })
}

/// One description of both sides when they agree, else each side's.
fn both(client: String, server: String) -> String {
    if client == server {
        client
    } else {
        format!("client {client}, server {server}")
    }
}

/// The idle policy of a side and its name: polling off parks; on, it
/// polls forever, or for `idle_poll_us` µs, then parks; and with more
/// reactors than CPUs (`oversubscribed`) a reactor never polls forever.
fn idle_policy(polling: bool, idle_poll_us: u64, oversubscribed: bool) -> (IdlePolicy, String) {
    if !polling {
        return (IdlePolicy::Park, "park".to_owned());
    }
    let poll = match (idle_poll_us, oversubscribed) {
        (0, false) => return (IdlePolicy::BusyPoll, "busy-poll".to_owned()),
        (0, true) => OVERSUBSCRIBED_IDLE_POLL,
        (us, _) => Duration::from_micros(us),
    };
    (
        IdlePolicy::PollThenPark(poll),
        format!("poll-then-park ({} us)", poll.as_micros()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soak::tests::soak_args as args;

    /// The settings of `flags` with only `vars` set.
    fn resolved(flags: &[&str], vars: &[(&str, &str)]) -> Result<SoakSettings, ConfigError> {
        let env = |k: &str| {
            vars.iter()
                .find(|(v, _)| *v == k)
                .map(|(_, value)| value.to_string())
        };
        settings(&args(flags), &env)
    }

    fn side(reactors: usize, polling: bool, pinned: bool) -> SideSettings {
        SideSettings {
            reactors,
            polling,
            pinned,
        }
    }

    fn cpus(n: usize) -> CpuSet {
        (0..n).collect()
    }

    /// With nothing said, both sides poll and are pinned (the soak's
    /// defaults); a role's variables decide for its side only, and
    /// `--polling` for both, over the variables.
    #[test]
    fn a_sides_variables_decide_its_polling_and_pinning_over_the_soaks_defaults() {
        let s = resolved(&["--connections", "4"], &[]).unwrap();
        assert_eq!(
            (s.client, s.server),
            (side(2, true, true), side(4, true, true))
        );
        let vars = [
            ("WORKER_ENABLE_POLLING", "false"),
            ("PS_DISABLE_PIN_CORES", "true"),
        ];
        let s = resolved(&["--connections", "4"], &vars).unwrap();
        assert_eq!(
            (s.client, s.server),
            (side(2, false, true), side(4, true, false))
        );
        let vars = [
            ("WORKER_ENABLE_POLLING", "false"),
            ("PS_ENABLE_POLLING", "true"),
            ("WORKER_DISABLE_PIN_CORES", "false"),
        ];
        let s = resolved(&["--connections", "4", "--polling", "on"], &vars).unwrap();
        assert!(s.client.polling && s.server.polling);
        let s = resolved(&["--connections", "4", "--polling", "off"], &vars).unwrap();
        assert!(!s.client.polling && !s.server.polling);
        assert!(s.client.pinned && s.server.pinned);
    }

    /// A core number above the connections, from a flag or a variable,
    /// runs one reactor per connection and says so, naming where it came
    /// from; the defaults never exceed them.
    #[test]
    fn reactors_beyond_the_connections_are_cut_with_a_warning() {
        let vars = [("NETWORK_PS_CORE_NUMBER", "4")];
        let s = resolved(&["--connections", "2", "--client-reactors", "3"], &vars).unwrap();
        assert_eq!((s.client.reactors, s.server.reactors), (2, 2));
        assert_eq!(s.warnings.len(), 2, "{:?}", s.warnings);
        assert!(s.warnings[0].contains("3 client reactors (flag --client-reactors)"));
        assert!(s.warnings[1].contains("4 server reactors (env NETWORK_PS_CORE_NUMBER)"));
        let s = resolved(&["--connections", "1"], &[]).unwrap();
        assert_eq!((s.client.reactors, s.server.reactors), (1, 1));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        let s = resolved(&["--connections", "16"], &vars).unwrap();
        assert_eq!((s.client.reactors, s.server.reactors), (2, 4));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    /// An invalid variable is an error naming it (a usage error in
    /// [`layout`]).
    #[test]
    fn an_invalid_core_number_is_an_error_naming_the_variable() {
        for (var, value) in [
            ("NETWORK_PS_CORE_NUMBER", "0"),
            ("NETWORK_WORKER_CORE_NUMBER", "x"),
            ("PS_ENABLE_POLLING", "yes"),
        ] {
            let e = resolved(&[], &[(var, value)]).unwrap_err();
            assert!(e.to_string().contains(var), "{e}");
        }
    }

    /// Only pinned sides get CPUs, from one plan, clients first; an
    /// unpinned side's reactors have none.
    #[test]
    fn only_pinned_sides_take_cpus() {
        let topo = Topology::default();
        let mut s = resolved(&["--connections", "4"], &[]).unwrap();
        s.client = side(2, true, true);
        s.server = side(2, true, true);
        let lay = place(&s, &Ends::Local, &cpus(4), &topo).unwrap();
        assert_eq!(lay.client_cpus, [Some(0), Some(1)]);
        assert_eq!(lay.server_cpus, [Some(2), Some(3)]);
        assert_eq!(lay.pinning, "pinned");
        s.client.pinned = false;
        let lay = place(&s, &Ends::Local, &cpus(4), &topo).unwrap();
        assert_eq!(lay.client_cpus, [None, None]);
        assert_eq!(lay.server_cpus, [Some(0), Some(1)]);
        assert_eq!(lay.pinning, "client unpinned, server pinned");
        s.server.pinned = false;
        let lay = place(&s, &Ends::Local, &cpus(4), &topo).unwrap();
        assert_eq!(lay.server_cpus, [None, None]);
        assert_eq!(lay.pinning, "unpinned");
        assert_eq!(lay.spec(Side::Server, 1).index, 3);
        // A side in another process takes no CPUs here.
        s.server.pinned = true;
        let lay = place(&s, &Ends::Connect("h:1".into()), &cpus(4), &topo).unwrap();
        assert_eq!(lay.server_cpus, [None, None]);
        assert_eq!(lay.pinning, "unpinned");
    }

    /// Each side idles as its polling says; with more reactors here than
    /// CPUs, polling ones poll, then park.
    #[test]
    fn each_side_idles_as_its_polling_says() {
        let topo = Topology::default();
        let mut s = resolved(&["--connections", "4"], &[]).unwrap();
        s.client = side(1, true, false);
        s.server = side(1, false, false);
        let lay = place(&s, &Ends::Local, &cpus(2), &topo).unwrap();
        assert_eq!(
            (lay.client_idle, lay.server_idle),
            (IdlePolicy::BusyPoll, IdlePolicy::Park)
        );
        assert_eq!(lay.idle_name, "client busy-poll, server park");
        assert!(!lay.oversubscribed);
        s.server.polling = true;
        s.server.reactors = 2;
        let lay = place(&s, &Ends::Local, &cpus(2), &topo).unwrap();
        assert!(lay.oversubscribed);
        assert_eq!(
            lay.server_idle,
            IdlePolicy::PollThenPark(OVERSUBSCRIBED_IDLE_POLL)
        );
        assert_eq!(
            lay.idle_name,
            "poll-then-park (50 us): 3 reactors on 2 cpus"
        );
        s.client.polling = false;
        let lay = place(&s, &Ends::Local, &cpus(2), &topo).unwrap();
        assert_eq!(
            lay.idle_name,
            "client park, server poll-then-park (50 us): 3 reactors on 2 cpus"
        );
        // The server alone fits.
        let lay = place(&s, &Ends::Listen("h:1".into()), &cpus(2), &topo).unwrap();
        assert_eq!(
            (lay.server_idle, lay.oversubscribed),
            (IdlePolicy::BusyPoll, false)
        );
        s.idle_poll_us = 7;
        let lay = place(&s, &Ends::Listen("h:1".into()), &cpus(2), &topo).unwrap();
        assert_eq!(lay.idle_name, "poll-then-park (7 us)");
    }
}

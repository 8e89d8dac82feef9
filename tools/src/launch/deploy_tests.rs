//! The files of `deploy/` checked against the code, since no registry is
//! reachable to build the image here: the Kubernetes example's TF_CONFIG
//! of every pod parses, through starwire's own resolution, to the cluster
//! the StatefulSets and Services make; its arguments are `starwire`'s
//! flags; the Dockerfile's build and run steps are the READMEs' commands.

use std::collections::BTreeMap;
use std::path::Path;

use clap::Parser;
use serde_json::Value;
use starwire_config::{ClusterConfig, ClusterFlags, HostPort, Role, TaskId};

use crate::{Cli, Command};

fn repo_file(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The subset of YAML the example is written in: block mappings and
/// sequences by indentation, plain, quoted and JSON flow scalars, comment
/// lines. Enough to read the example as Kubernetes would, not a YAML
/// parser.
mod mini_yaml {
    use serde_json::Value;

    /// The documents of a `---`-separated stream.
    pub fn documents(text: &str) -> Vec<Value> {
        let mut docs = Vec::new();
        let mut lines = Vec::new();
        for raw in text.lines().chain(["---"]) {
            if raw.trim_end() == "---" {
                if !lines.is_empty() {
                    let mut i = 0;
                    docs.push(block(&mut lines, &mut i, 0));
                    assert_eq!(i, lines.len(), "unread YAML at {:?}", lines.get(i));
                    lines.clear();
                }
                continue;
            }
            let content = raw.trim_start();
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            lines.push((raw.len() - content.len(), content.trim_end().to_owned()));
        }
        docs
    }

    fn is_item(s: &str) -> bool {
        s == "-" || s.starts_with("- ")
    }

    fn block(lines: &mut [(usize, String)], i: &mut usize, indent: usize) -> Value {
        let seq = is_item(&lines[*i].1);
        if seq {
            let mut items = Vec::new();
            while *i < lines.len() && lines[*i].0 == indent && is_item(&lines[*i].1) {
                let rest = lines[*i].1[1..].trim_start().to_owned();
                if key_value(&rest).is_some() {
                    // `- key: value`: a mapping whose first line is the
                    // item's.
                    lines[*i] = (indent + 2, rest);
                    items.push(block(lines, i, indent + 2));
                } else {
                    *i += 1;
                    items.push(scalar(&rest));
                }
            }
            return Value::Array(items);
        }
        let mut map = serde_json::Map::new();
        while *i < lines.len() && lines[*i].0 == indent && !is_item(&lines[*i].1) {
            let (key, rest) = key_value(&lines[*i].1)
                .unwrap_or_else(|| panic!("expected key: value, got {:?}", lines[*i].1));
            *i += 1;
            let value = if !rest.is_empty() {
                scalar(&rest)
            } else if *i < lines.len() && lines[*i].0 > indent {
                let inner = lines[*i].0;
                block(lines, i, inner)
            } else {
                Value::Null
            };
            assert!(map.insert(key.clone(), value).is_none(), "key {key} twice");
        }
        Value::Object(map)
    }

    fn key_value(s: &str) -> Option<(String, String)> {
        if s.starts_with(['\'', '"', '[', '{']) {
            return None;
        }
        let (k, v) = s
            .split_once(": ")
            .or_else(|| s.strip_suffix(':').map(|k| (k, "")))?;
        Some((k.trim().to_owned(), v.trim().to_owned()))
    }

    fn scalar(s: &str) -> Value {
        if s.starts_with(['[', '{', '"']) {
            return serde_json::from_str(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        }
        if let Some(inner) = s.strip_prefix('\'') {
            let inner = inner.strip_suffix('\'').expect("closing quote");
            return Value::String(inner.replace("''", "'"));
        }
        let plain = s.split(" #").next().unwrap_or(s).trim();
        if let Ok(n) = plain.parse::<i64>() {
            return n.into();
        }
        match plain {
            "true" => true.into(),
            "false" => false.into(),
            "null" | "~" => Value::Null,
            _ => plain.into(),
        }
    }
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    v.pointer(path)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {path} in {v}"))
}

/// `$(VAR)` references of a Kubernetes `env` value, expanded from `vars`
/// as the kubelet does.
fn expand(value: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(at) = rest.find("$(") {
        out.push_str(&rest[..at]);
        let end = rest[at..].find(')').expect("closing paren") + at;
        let name = &rest[at + 2..end];
        out.push_str(
            vars.get(name)
                .unwrap_or_else(|| panic!("$({name}) is not an earlier variable")),
        );
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// The example's StatefulSets and headless Services.
struct Example {
    sets: Vec<Value>,
    services: BTreeMap<String, Value>,
}

fn example() -> Example {
    let docs = mini_yaml::documents(&repo_file("deploy/k8s/starwire.yaml"));
    let kind = |d: &Value, k: &str| d["kind"] == k;
    let sets: Vec<Value> = docs
        .iter()
        .filter(|d| kind(d, "StatefulSet"))
        .cloned()
        .collect();
    let services = docs
        .iter()
        .filter(|d| kind(d, "Service"))
        .map(|d| (str_at(d, "/metadata/name").to_owned(), d.clone()))
        .collect();
    assert_eq!(sets.len(), 2, "a StatefulSet per role");
    Example { sets, services }
}

/// A StatefulSet's role: the subcommand of its container's arguments,
/// which must parse as `starwire`'s command line.
fn role_of(set: &Value) -> (Role, Vec<String>) {
    let args: Vec<String> =
        serde_json::from_value(set["spec"]["template"]["spec"]["containers"][0]["args"].clone())
            .expect("args: a list of strings");
    let cli = Cli::try_parse_from(std::iter::once("starwire".to_owned()).chain(args.clone()))
        .unwrap_or_else(|e| panic!("{args:?} are not starwire's flags: {e}"));
    let role = match cli.cmd {
        Command::Ps(_) => Role::Ps,
        Command::Worker(_) => Role::Worker,
        _ => panic!("{args:?}: expected ps or worker"),
    };
    (role, args)
}

/// The value of `--flag` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).map(String::as_str)
}

#[test]
fn every_pods_tf_config_parses_to_the_cluster_the_example_makes() {
    let ex = example();
    // The endpoints the StatefulSets and their headless Services make:
    // POD.SERVICE:PORT for each ordinal.
    let mut hosts: BTreeMap<Role, Vec<HostPort>> = BTreeMap::new();
    for set in &ex.sets {
        let (role, _) = role_of(set);
        let name = str_at(set, "/metadata/name");
        let service = str_at(set, "/spec/serviceName");
        let svc = &ex.services[service];
        assert_eq!(svc["spec"]["clusterIP"], "None", "{service} is headless");
        assert_eq!(svc["spec"]["publishNotReadyAddresses"], true);
        assert_eq!(
            svc["spec"]["selector"], set["spec"]["template"]["metadata"]["labels"],
            "{service} selects {name}'s pods"
        );
        let port = svc["spec"]["ports"][0]["port"].as_u64().expect("port");
        let replicas = set["spec"]["replicas"].as_u64().expect("replicas");
        assert_eq!(set["spec"]["podManagementPolicy"], "Parallel");
        hosts.insert(
            role,
            (0..replicas)
                .map(|i| HostPort::parse(&format!("{name}-{i}.{service}:{port}")).unwrap())
                .collect(),
        );
    }
    for set in &ex.sets {
        let (role, args) = role_of(set);
        let container = &set["spec"]["template"]["spec"]["containers"][0];
        let env = container["env"].as_array().expect("env");
        assert_eq!(
            str_at(&env[0], "/valueFrom/fieldRef/fieldPath"),
            "metadata.labels['apps.kubernetes.io/pod-index']",
            "POD_INDEX is the pod's ordinal"
        );
        let replicas = set["spec"]["replicas"].as_u64().unwrap();
        for ordinal in 0..replicas {
            // The environment of pod `ordinal`, as the kubelet builds it.
            let mut vars = BTreeMap::new();
            for e in env {
                let name = str_at(e, "/name").to_owned();
                let value = match e.get("value").and_then(Value::as_str) {
                    Some(v) => expand(v, &vars),
                    None if name == "POD_INDEX" => ordinal.to_string(),
                    None => continue,
                };
                vars.insert(name, value);
            }
            let tf = &vars["TF_CONFIG"];
            // Resolved as `starwire ps` / `starwire worker` resolve it.
            let flags = ClusterFlags {
                ps_hosts: flag(&args, "--ps-hosts").map(str::to_owned),
                worker_hosts: flag(&args, "--worker-hosts").map(str::to_owned),
                job_name: super::job_flags(role, flag(&args, "--job-name"), None).unwrap(),
                task_index: None,
            };
            let c = ClusterConfig::resolve(&flags, Some(tf))
                .unwrap_or_else(|e| panic!("pod {ordinal} of {role}: {e}\n{tf}"));
            assert_eq!(c.spec.ps(), &hosts[&Role::Ps][..], "{tf}");
            assert_eq!(c.spec.workers(), &hosts[&Role::Worker][..], "{tf}");
            assert_eq!(
                c.task,
                TaskId {
                    role,
                    index: ordinal as u32
                }
            );
        }
    }
}

#[test]
fn the_example_binds_serves_metrics_and_reads_the_token_from_a_secret() {
    let ex = example();
    for set in &ex.sets {
        let (role, args) = role_of(set);
        let pod = &set["spec"]["template"];
        let container = &pod["spec"]["containers"][0];
        let ports: Vec<u64> = container["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .map(|p| p["containerPort"].as_u64().expect("containerPort"))
            .collect();
        // Metrics: the annotated port is the one --metrics-addr serves.
        let metrics = flag(&args, "--metrics-addr").expect("--metrics-addr");
        let metrics_port: u64 = metrics.rsplit_once(':').unwrap().1.parse().unwrap();
        let notes = &pod["metadata"]["annotations"];
        assert_eq!(notes["prometheus.io/scrape"], "true");
        assert_eq!(notes["prometheus.io/path"], "/metrics");
        assert_eq!(notes["prometheus.io/port"], metrics_port.to_string());
        assert!(ports.contains(&metrics_port), "{ports:?}");
        assert_eq!(
            str_at(container, "/readinessProbe/httpGet/path"),
            "/healthz"
        );
        // The PS listens on every address of the pod, on its own port.
        if role == Role::Ps {
            assert_eq!(flag(&args, "--bind"), Some("0.0.0.0"));
            assert!(ports.contains(&2222), "{ports:?}");
        }
        assert!(flag(&args, "--connect-timeout").is_some());
        let token = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "STARWIRE_CLUSTER_TOKEN")
            .expect("the cluster token");
        assert_eq!(
            str_at(token, "/valueFrom/secretKeyRef/name"),
            "starwire-cluster-token"
        );
        assert_eq!(str_at(token, "/valueFrom/secretKeyRef/key"), "token");
    }
}

/// The `RUN`, `COPY`, `ENTRYPOINT` and `CMD` instructions of a stage, by
/// stage (`FROM` lines start one), continuation lines joined.
fn dockerfile_stages(text: &str) -> Vec<Vec<(String, String)>> {
    let mut stages: Vec<Vec<(String, String)>> = Vec::new();
    let mut joined = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            joined.push_str(head.trim_end());
            joined.push(' ');
            continue;
        }
        joined.push_str(line);
        let full = std::mem::take(&mut joined);
        let (op, rest) = full.split_once(' ').unwrap_or((&full, ""));
        if op == "FROM" {
            stages.push(Vec::new());
        }
        if let Some(stage) = stages.last_mut() {
            stage.push((op.to_owned(), rest.trim().to_owned()));
        }
    }
    stages
}

#[test]
fn the_dockerfile_builds_and_runs_what_the_readmes_say() {
    let stages = dockerfile_stages(&repo_file("deploy/Dockerfile"));
    let readme = repo_file("README.md");
    let deploy = repo_file("deploy/README.md");
    assert_eq!(stages.len(), 2, "a builder and a runtime stage");
    let find = |stage: &[(String, String)], op: &str| -> Vec<String> {
        stage
            .iter()
            .filter(|(o, _)| o == op)
            .map(|(_, r)| r.clone())
            .collect()
    };
    // The builder runs the README's build command, locked to Cargo.lock.
    let builds: Vec<String> = find(&stages[0], "RUN")
        .into_iter()
        .filter(|r| r.contains("cargo"))
        .collect();
    assert_eq!(builds, ["cargo build --release --locked"]);
    assert!(readme.contains("`cargo build --release`"));
    assert!(
        deploy.contains(&format!("`{}`", builds[0])),
        "deploy/README.md"
    );
    assert!(deploy.contains("docker build -f deploy/Dockerfile -t starwire:latest"));
    // The runtime stage is slim, builds nothing, and runs the binary the
    // build made (tools/Cargo.toml's [[bin]]).
    let from = &find(&stages[1], "FROM")[0];
    assert_eq!(from, "debian:bookworm-slim");
    let runtime_runs = find(&stages[1], "RUN").join(" ");
    assert!(
        !runtime_runs.contains("cargo") && !runtime_runs.contains("-dev"),
        "{runtime_runs}"
    );
    let copies = find(&stages[1], "COPY");
    assert_eq!(
        copies,
        ["--from=builder /src/target/release/starwire /usr/local/bin/starwire"]
    );
    let bin = repo_file("tools/Cargo.toml");
    assert!(bin.contains("[[bin]]\nname = \"starwire\""));
    let entry: Vec<String> =
        serde_json::from_str(&find(&stages[1], "ENTRYPOINT")[0]).expect("exec form");
    assert_eq!(
        entry.last().map(String::as_str),
        Some("/usr/local/bin/starwire")
    );
    // The default command, and every `docker run` of deploy/README.md,
    // are starwire command lines.
    let cmd: Vec<String> = serde_json::from_str(&find(&stages[1], "CMD")[0]).expect("exec form");
    let mut lines = vec![cmd];
    for run in deploy
        .lines()
        .filter_map(|l| l.trim().strip_prefix("docker run "))
    {
        let words: Vec<&str> = run.split_whitespace().collect();
        let image = words
            .iter()
            .position(|w| *w == "starwire:latest")
            .unwrap_or_else(|| panic!("no image in docker run {run}"));
        lines.push(words[image + 1..].iter().map(|w| w.to_string()).collect());
    }
    assert!(lines.len() >= 3, "deploy/README.md runs a ps and a worker");
    for args in lines {
        Cli::try_parse_from(std::iter::once("starwire".to_owned()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    }
}

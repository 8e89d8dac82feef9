//! [`Text`]: the text parsers that read what users and peers supply, as a
//! driver target (`fuzz-text`), with [`Texts`], byte-level mutations aimed
//! at their separators and numbers.
//!
//! An input's first byte chooses the parser ([`Kind`], the byte modulo 7);
//! the Settings and Criteo kinds take a few option bytes after it, and the
//! rest is the text:
//!
//! | kind | after the first byte | parsers |
//! |---|---|---|
//! | `hostport` | the text | `HostPort::parse`, `parse_host_list` |
//! | `endpoint-map` | a `.endpoint_map` file | `EndpointMap::parse_bytes`, `EndpointMap::parse` |
//! | `tf-config` | `TF_CONFIG` | `TfConfig::parse`, `ClusterConfig::resolve` |
//! | `settings` | PS and worker connections, then `NAME=value` lines | `Settings::resolve` |
//! | `criteo` | options, read buffer, batch size, then a TSV file | `CriteoReader` |
//! | `criteo-gz` | options, gzip shape, batch size, then a TSV file | `CriteoFiles` on a `.gz` of it |
//! | `gz` | options, unused, batch size, then a `.gz` file | `CriteoFiles` |
//!
//! Besides "no panic", and every error being the crate's typed error, a run
//! checks:
//!
//! * `hostport`: an accepted endpoint displays to text that parses back to
//!   it and displays the same (the normal form is a fixpoint), in brackets
//!   exactly when it is IPv6; surrounding whitespace changes nothing, and
//!   neither does the case of a host name or IPv4 address. A host list is
//!   empty for blank text, else one endpoint per comma, or the error names
//!   the flag, the value and the first bad entry.
//! * `endpoint-map`: `parse_bytes` and `parse` agree on UTF-8 text; an
//!   accepted map looks every entry up, its lines rise, and its entries
//!   written back as `grpc=fast` lines parse to the same mappings; a refused
//!   map names a line that exists, the lines before it parse, the file cut
//!   after it fails the same way, and the error's text, endpoint error or
//!   first line agrees with that line and the lines before it.
//! * `tf-config`: an accepted config written back as JSON (the chief folded
//!   into the workers, as parsed) parses to the same; the only errors are
//!   `TfConfigJson`, `TfConfig` and `UnsupportedJob`; `ClusterConfig::resolve`
//!   with no flags fails with the same error, or gives what a reference
//!   written from its documentation gives (empty jobs, duplicate endpoints,
//!   no task, the task's index out of range, else the lists and the task).
//! * `settings`: `Settings::resolve` agrees with a reference written from
//!   the variables' documented syntax (value, source, or the first bad
//!   variable with the value as read), and the settings' rows (values "as
//!   the variables spell them") read back as an environment give the same
//!   values, each from the environment.
//! * `criteo`: the reader yields exactly the examples, skipped count, line
//!   count and first bad line (number and reason) of a reference that splits
//!   the text into lines and columns itself, so never more fields than a
//!   line has, through any read buffer and batch size; every batch is
//!   consistent (`len` rows in each column, at most the size asked for); a
//!   rewound reader reads the same again from zeroed counters.
//! * `criteo-gz`: the text wrapped in gzip (stored blocks, one to three
//!   members, sometimes broken in its framing) and read as a `.gz` file
//!   gives the same as the reference; a broken stream may instead stop
//!   early with an I/O error, after a prefix of the examples. Errors name
//!   the file.
//! * `gz`: a mutated gzip file (seeded with a `gzip -9` chunk): consistent
//!   batches, typed errors naming the file.
//! * No single allocation made by the parsers during a run passes
//!   [`alloc_bound`] of the input's length (measured where
//!   [`crate::peak::Counting`] is the global allocator, as in `fuzz-text`).
//!
//! ```text
//! cargo run --release -p starwire-wire-fuzz --bin fuzz-text -- --seconds 30 --seed 1
//! ```

use std::collections::{BTreeMap, HashSet};
use std::io::{BufReader, Cursor};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::rngs::SmallRng;
use rand::Rng;
use starwire_config::{
    parse_host_list, vars, ClusterConfig, ClusterFlags, ConfigError, EndpointMap,
    EndpointMapLineError, HostPort, HostPortError, Overrides, Role, Settings, Source, TaskId,
    TfConfig,
};
use starwire_data::{
    feature_hash, transform_count, BadLineReason, Batch, CriteoFiles, CriteoReader, DataError,
    ReaderOptions, CRITEO_COLUMNS, MISSING_KEY, NUM_CATEGORICAL, NUM_NUMERIC,
};

use crate::driver::{Spec, Target};
use crate::mutate::{delete, duplicate, flip_bit, insert_random, splice, truncate};
use crate::{peak, Mutation, Mutator};

/// Which parser an input feeds: its first byte modulo 7.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `HostPort::parse` and `parse_host_list`.
    HostPort,
    /// `EndpointMap::parse_bytes` and `EndpointMap::parse`.
    EndpointMap,
    /// `TfConfig::parse` and `ClusterConfig::resolve`.
    TfConfig,
    /// `Settings::resolve` on an environment.
    Settings,
    /// `CriteoReader` on a plain TSV file in memory.
    Criteo,
    /// `CriteoFiles` on a TSV file the target wraps in gzip.
    CriteoGz,
    /// `CriteoFiles` on a gzip file as given.
    Gz,
}

impl Kind {
    /// Every kind, by selector.
    pub const ALL: [Kind; 7] = [
        Kind::HostPort,
        Kind::EndpointMap,
        Kind::TfConfig,
        Kind::Settings,
        Kind::Criteo,
        Kind::CriteoGz,
        Kind::Gz,
    ];

    /// The kind an input's first byte selects.
    pub fn of(selector: u8) -> Kind {
        Self::ALL[usize::from(selector) % Self::ALL.len()]
    }

    /// Option bytes between the selector and the text.
    pub fn header_len(self) -> usize {
        match self {
            Kind::HostPort | Kind::EndpointMap | Kind::TfConfig => 0,
            Kind::Settings => 2,
            Kind::Criteo | Kind::CriteoGz | Kind::Gz => 3,
        }
    }

    /// A short name, for reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::HostPort => "hostport",
            Kind::EndpointMap => "endpoint-map",
            Kind::TfConfig => "tf-config",
            Kind::Settings => "settings",
            Kind::Criteo => "criteo",
            Kind::CriteoGz => "criteo-gz",
            Kind::Gz => "gz",
        }
    }
}

/// An input split into its kind, its option bytes (missing ones read as 0)
/// and its text.
fn split(input: &[u8]) -> (Kind, [u8; 3], &[u8]) {
    let Some((&sel, rest)) = input.split_first() else {
        return (Kind::HostPort, [0; 3], &[]);
    };
    let kind = Kind::of(sel);
    let n = kind.header_len().min(rest.len());
    let mut opts = [0u8; 3];
    opts[..n].copy_from_slice(&rest[..n]);
    (kind, opts, &rest[n..])
}

/// The largest single allocation the parsers may make on an input of
/// `len` bytes of kind `kind`: 64 bytes per input byte (a JSON array of
/// one-digit numbers is 32-byte values per two bytes, in a `Vec` that
/// doubles) over a fixed part; the gzip kinds add `CriteoFiles`'s 1 MiB
/// read buffer and the decoder's state.
pub fn alloc_bound(kind: Kind, len: usize) -> usize {
    let fixed = match kind {
        Kind::CriteoGz | Kind::Gz => 2 << 20,
        _ => 64 << 10,
    };
    fixed + 64 * len
}

/// Run `f` (a library call), raising `peak` to the largest allocation it
/// made.
fn measure<T>(peak: &mut usize, f: impl FnOnce() -> T) -> T {
    peak::reset();
    let r = f();
    *peak = (*peak).max(peak::largest());
    r
}

/// What one run did: its kind, its outcome, a detail and a size class.
pub type Key = (Kind, &'static str, &'static str, u8);

// ---------------------------------------------------------------------
// Names of errors.

fn hostport_kind(e: &HostPortError) -> &'static str {
    match e {
        HostPortError::Empty => "Empty",
        HostPortError::MissingPort => "MissingPort",
        HostPortError::EmptyHost => "EmptyHost",
        HostPortError::BadPort(_) => "BadPort",
        HostPortError::UnbracketedIpv6 => "UnbracketedIpv6",
        HostPortError::BadIpv6(_) => "BadIpv6",
        HostPortError::BadHostChar(_) => "BadHostChar",
        _ => "other",
    }
}

fn config_kind(e: &ConfigError) -> &'static str {
    match e {
        ConfigError::InvalidFlag { .. } => "InvalidFlag",
        ConfigError::InvalidEnv { .. } => "InvalidEnv",
        ConfigError::TfConfigJson { .. } => "TfConfigJson",
        ConfigError::TfConfig { .. } => "TfConfig",
        ConfigError::EmptyJob { .. } => "EmptyJob",
        ConfigError::MissingTask => "MissingTask",
        ConfigError::UnsupportedJob { .. } => "UnsupportedJob",
        ConfigError::TaskIndexOutOfRange { .. } => "TaskIndexOutOfRange",
        ConfigError::DuplicateEndpoint { .. } => "DuplicateEndpoint",
        ConfigError::EndpointMapLine { .. } => "EndpointMapLine",
        ConfigError::EndpointMapIo { .. } => "EndpointMapIo",
        ConfigError::EndpointNotMapped { .. } => "EndpointNotMapped",
        ConfigError::DuplicateFastEndpoint { .. } => "DuplicateFastEndpoint",
        _ => "other",
    }
}

fn line_kind(e: &EndpointMapLineError) -> (&'static str, &'static str) {
    match e {
        EndpointMapLineError::MissingEquals => ("MissingEquals", ""),
        EndpointMapLineError::ExtraEquals => ("ExtraEquals", ""),
        EndpointMapLineError::BadKey { error, .. } => ("BadKey", hostport_kind(error)),
        EndpointMapLineError::BadValue { error, .. } => ("BadValue", hostport_kind(error)),
        EndpointMapLineError::DuplicateKey { .. } => ("DuplicateKey", ""),
        EndpointMapLineError::InvalidUtf8 => ("InvalidUtf8", ""),
        _ => ("other", ""),
    }
}

fn reason_kind(r: &BadLineReason) -> &'static str {
    match r {
        BadLineReason::ColumnCount(_) => "ColumnCount",
        BadLineReason::Label => "Label",
        BadLineReason::Integer(_) => "Integer",
        BadLineReason::TooLong => "TooLong",
        _ => "other",
    }
}

fn class(n: usize) -> u8 {
    n.min(4) as u8
}

// ---------------------------------------------------------------------
// host:port and host lists.

const HOST_FLAG: &str = "--ps-hosts";

/// `HostPort::parse` and `parse_host_list` on `text`.
pub fn check_hostport(text: &[u8], peak: &mut usize) -> Result<Key, String> {
    // Flags reach the parsers as UTF-8 (clap), TF_CONFIG lossily converted.
    let s = String::from_utf8_lossy(text);
    let r = measure(peak, || HostPort::parse(&s));
    let padded = format!(" \t{s}\r\n\u{2003}");
    if HostPort::parse(&padded) != r {
        return Err(format!(
            "{s:?} parses as {r:?}, with whitespace around as {:?}",
            HostPort::parse(&padded)
        ));
    }
    let outcome = match &r {
        Ok(hp) => {
            if hp.port() == 0 {
                return Err(format!("{s:?} accepted with port 0"));
            }
            let shown = hp.to_string();
            match HostPort::parse(&shown) {
                Ok(again) if again == *hp => {
                    if again.to_string() != shown {
                        return Err(format!("{shown:?} displays again as {again}"));
                    }
                }
                other => {
                    return Err(format!(
                        "{s:?} parses as {hp:?}, displayed {shown:?}, which parses as {other:?}"
                    ))
                }
            }
            if hp.is_ipv6() != shown.starts_with('[') {
                return Err(format!("{hp:?} displays as {shown:?}"));
            }
            if !s.trim_start().starts_with('[') {
                let upper = s.to_ascii_uppercase();
                if HostPort::parse(&upper).as_ref() != Ok(hp) {
                    return Err(format!(
                        "{s:?} parses as {hp:?}, {upper:?} as {:?}",
                        HostPort::parse(&upper)
                    ));
                }
            }
            if hp.is_ipv6() {
                "ipv6"
            } else {
                "ok"
            }
        }
        Err(e) => {
            if s.trim().is_empty() && *e != HostPortError::Empty {
                return Err(format!("blank {s:?} refused as {e:?}"));
            }
            let _ = e.to_string();
            hostport_kind(e)
        }
    };

    // The host list: blank is empty, else one endpoint per comma.
    let list = measure(peak, || parse_host_list(HOST_FLAG, &s));
    let items: Vec<&str> = s.split(',').collect();
    let first_bad = items
        .iter()
        .enumerate()
        .find_map(|(i, it)| HostPort::parse(it).err().map(|_| i));
    let list_outcome = match (&list, s.trim().is_empty(), first_bad) {
        (Ok(l), true, _) if l.is_empty() => "blank",
        (Ok(l), false, None) => {
            let want: Vec<HostPort> = items.iter().filter_map(|i| i.parse().ok()).collect();
            if *l != want {
                return Err(format!(
                    "host list {s:?} parses as {l:?}, entries as {want:?}"
                ));
            }
            "list"
        }
        (
            Err(ConfigError::InvalidFlag {
                flag,
                value,
                reason,
            }),
            false,
            Some(i),
        ) => {
            let entry = format!("entry {} ", i + 1);
            if flag != HOST_FLAG || *value != s || !reason.starts_with(&entry) {
                return Err(format!(
                    "host list {s:?}: error names {flag} {value:?} {reason:?}, \
                     the first bad entry is {}",
                    i + 1
                ));
            }
            "list-refused"
        }
        _ => {
            return Err(format!(
                "host list {s:?} gives {list:?}; first bad entry {first_bad:?}"
            ))
        }
    };
    Ok((Kind::HostPort, outcome, list_outcome, class(items.len())))
}

// ---------------------------------------------------------------------
// .endpoint_map

const MAP_PATH: &str = "fuzz/.endpoint_map";

fn pairs(m: &EndpointMap) -> Vec<(HostPort, HostPort)> {
    m.iter().map(|(g, f)| (g.clone(), f.clone())).collect()
}

/// Compare two parses of the same map text.
fn same_map(
    a: &Result<EndpointMap, ConfigError>,
    b: &Result<EndpointMap, ConfigError>,
) -> Result<(), String> {
    match (a, b) {
        (Ok(x), Ok(y)) if x.entries() == y.entries() => Ok(()),
        (
            Err(ConfigError::EndpointMapLine {
                line: l1,
                reason: r1,
                ..
            }),
            Err(ConfigError::EndpointMapLine {
                line: l2,
                reason: r2,
                ..
            }),
        ) if l1 == l2 && r1 == r2 => Ok(()),
        _ => Err(format!("{a:?} against {b:?}")),
    }
}

/// `EndpointMap::parse_bytes` (and `parse`) on `text`.
pub fn check_endpoint_map(text: &[u8], peak: &mut usize) -> Result<Key, String> {
    let r = measure(peak, || EndpointMap::parse_bytes(MAP_PATH, text));
    if let Ok(s) = std::str::from_utf8(text) {
        let r2 = measure(peak, || EndpointMap::parse(MAP_PATH, s));
        same_map(&r, &r2).map_err(|e| format!("parse_bytes and parse disagree: {e}"))?;
    }
    let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
    match &r {
        Ok(m) => {
            if m.path() != Path::new(MAP_PATH) || m.len() != m.entries().len() {
                return Err(format!("map of {} entries: {m:?}", m.entries().len()));
            }
            let mut last = 0;
            for e in m.entries() {
                if e.line <= last || e.line > lines.len() {
                    return Err(format!("entry on line {} after line {last}", e.line));
                }
                last = e.line;
                if m.lookup(&e.grpc) != Some(&e.fast) {
                    return Err(format!("{} looks up {:?}", e.grpc, m.lookup(&e.grpc)));
                }
            }
            let written: String = m.iter().map(|(g, f)| format!("{g}={f}\n")).collect();
            match EndpointMap::parse(MAP_PATH, &written) {
                Ok(again) if pairs(&again) == pairs(m) => {}
                other => {
                    return Err(format!(
                        "map written back as {written:?} parses as {other:?}"
                    ))
                }
            }
            Ok((Kind::EndpointMap, "ok", "", class(m.len())))
        }
        Err(ConfigError::EndpointMapLine { path, line, reason }) => {
            let line = *line;
            if path != Path::new(MAP_PATH) || line == 0 || line > lines.len() {
                return Err(format!("error names {}:{line}", path.display()));
            }
            // The lines before it parse; cut after it, it fails the same way.
            let before = EndpointMap::parse_bytes(MAP_PATH, &lines[..line - 1].join(&b'\n'));
            let Ok(before) = before else {
                return Err(format!(
                    "refused at line {line}, the lines before it give {before:?}"
                ));
            };
            let cut = EndpointMap::parse_bytes(MAP_PATH, &lines[..line].join(&b'\n'));
            same_map(&r, &cut).map_err(|e| format!("cut after the bad line: {e}"))?;
            let text = lines[line - 1];
            let utf8 = std::str::from_utf8(text).is_ok();
            match reason {
                EndpointMapLineError::InvalidUtf8 if !utf8 => {}
                EndpointMapLineError::InvalidUtf8 => {
                    return Err(format!("line {line} is UTF-8, refused as not"));
                }
                _ if !utf8 => return Err(format!("line {line} is not UTF-8: {reason:?}")),
                EndpointMapLineError::BadKey { text: t, error }
                | EndpointMapLineError::BadValue { text: t, error }
                    if HostPort::parse(t).as_ref() != Err(error) || t.trim() != t =>
                {
                    return Err(format!(
                        "{reason:?}, but {t:?} parses as {:?}",
                        HostPort::parse(t)
                    ));
                }
                EndpointMapLineError::DuplicateKey { key, first_line }
                    if !before
                        .entries()
                        .iter()
                        .any(|e| e.line == *first_line && e.grpc == *key) =>
                {
                    return Err(format!(
                        "{reason:?}, but the lines before it map {:?}",
                        before.entries()
                    ));
                }
                _ => {}
            }
            let _ = r.as_ref().map_err(|e| e.to_string());
            let (k, detail) = line_kind(reason);
            Ok((Kind::EndpointMap, k, detail, class(before.len())))
        }
        Err(e) => Err(format!("untyped map error {e:?}")),
    }
}

// ---------------------------------------------------------------------
// TF_CONFIG

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_list(hosts: &[HostPort]) -> String {
    let items: Vec<String> = hosts.iter().map(|h| json_str(&h.to_string())).collect();
    format!("[{}]", items.join(", "))
}

/// `tf` as TF_CONFIG JSON: the workers as one `"worker"` list (a chief is
/// already its first entry) and the task in starwire's numbering.
pub fn tf_config_json(tf: &TfConfig) -> String {
    let mut cluster = Vec::new();
    if let Some(ps) = &tf.ps {
        cluster.push(format!("\"ps\": {}", json_list(ps)));
    }
    if let Some(w) = &tf.workers {
        cluster.push(format!("\"worker\": {}", json_list(w)));
    }
    let mut out = format!("{{\"cluster\": {{{}}}", cluster.join(", "));
    if let Some(t) = tf.task {
        out.push_str(&format!(
            ", \"task\": {{\"type\": \"{}\", \"index\": {}}}",
            t.role.job_name(),
            t.index
        ));
    }
    out.push('}');
    out
}

/// What `ClusterConfig::resolve` with no flags must give for a parsed
/// `tf`, as its documentation says: the error's kind and what it names, or
/// the lists and the task.
fn reference_resolve(tf: &TfConfig) -> Result<(Vec<HostPort>, Vec<HostPort>, TaskId), String> {
    let ps = tf.ps.clone().unwrap_or_default();
    let workers = tf.workers.clone().unwrap_or_default();
    if ps.is_empty() {
        return Err("EmptyJob ps".into());
    }
    if workers.is_empty() {
        return Err("EmptyJob worker".into());
    }
    let mut seen = HashSet::new();
    for h in ps.iter().chain(&workers) {
        if !seen.insert(h) {
            return Err(format!("DuplicateEndpoint {h}"));
        }
    }
    let task = tf.task.ok_or("MissingTask")?;
    let len = match task.role {
        Role::Ps => ps.len(),
        Role::Worker => workers.len(),
    };
    if task.index as usize >= len {
        return Err(format!("TaskIndexOutOfRange {task} {len}"));
    }
    Ok((ps, workers, task))
}

fn resolved_as_reference(
    r: &Result<ClusterConfig, ConfigError>,
) -> Result<(Vec<HostPort>, Vec<HostPort>, TaskId), String> {
    match r {
        Ok(c) => Ok((c.spec.ps().to_vec(), c.spec.workers().to_vec(), c.task)),
        Err(ConfigError::EmptyJob { job }) => Err(format!("EmptyJob {job}")),
        Err(ConfigError::DuplicateEndpoint { endpoint, .. }) => {
            Err(format!("DuplicateEndpoint {endpoint}"))
        }
        Err(ConfigError::MissingTask) => Err("MissingTask".into()),
        Err(ConfigError::TaskIndexOutOfRange { task, len }) => {
            Err(format!("TaskIndexOutOfRange {task} {len}"))
        }
        Err(e) => Err(format!("unexpected {e:?}")),
    }
}

/// `TfConfig::parse` and `ClusterConfig::resolve` on `text`.
pub fn check_tf_config(text: &[u8], peak: &mut usize) -> Result<Key, String> {
    // TF_CONFIG is read lossily (`starwire_config::process_env`).
    let s = String::from_utf8_lossy(text);
    let r = measure(peak, || TfConfig::parse(&s));
    let resolved = measure(peak, || {
        ClusterConfig::resolve(&ClusterFlags::default(), Some(&s))
    });
    match &r {
        Ok(tf) => {
            let json = tf_config_json(tf);
            match TfConfig::parse(&json) {
                Ok(again) if again == *tf => {}
                other => return Err(format!("{tf:?} written as {json} parses as {other:?}")),
            }
            let want = reference_resolve(tf);
            let got = resolved_as_reference(&resolved);
            if got != want {
                return Err(format!(
                    "{tf:?} resolves as {resolved:?}; the reference says {want:?}"
                ));
            }
            if let Ok(c) = &resolved {
                if c.spec.endpoint(c.task).is_none() {
                    return Err(format!("{c:?}: the task has no endpoint"));
                }
            }
            let outcome = match &resolved {
                Ok(_) => "resolved",
                Err(e) => config_kind(e),
            };
            let n = tf.ps.as_ref().map_or(0, Vec::len) + tf.workers.as_ref().map_or(0, Vec::len);
            Ok((Kind::TfConfig, "ok", outcome, class(n)))
        }
        Err(e) => {
            let k = config_kind(e);
            if !matches!(k, "TfConfigJson" | "TfConfig" | "UnsupportedJob") {
                return Err(format!("TfConfig::parse fails with {e:?}"));
            }
            let same = match &resolved {
                _ if s.trim().is_empty() => {
                    matches!(resolved, Err(ConfigError::EmptyJob { job: "ps" }))
                }
                Err(e2) => config_kind(e2) == k && e2.to_string() == e.to_string(),
                Ok(_) => false,
            };
            if !same {
                return Err(format!(
                    "TfConfig::parse fails with {e:?}, resolve gives {resolved:?}"
                ));
            }
            Ok((Kind::TfConfig, k, "", 0))
        }
    }
}

// ---------------------------------------------------------------------
// DeepRec settings

/// An environment: `NAME=value` lines, the name exact, the value read
/// lossily (as `starwire_config::process_env` does); the first line
/// naming a variable wins.
fn environment(text: &[u8]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for line in text.split(|&b| b == b'\n') {
        let Some(eq) = line.iter().position(|&b| b == b'=') else {
            continue;
        };
        let name = String::from_utf8_lossy(&line[..eq]).into_owned();
        if env.iter().all(|(n, _)| *n != name) {
            let value = String::from_utf8_lossy(&line[eq + 1..]).into_owned();
            env.push((name, value));
        }
    }
    env
}

fn lookup<'a>(env: &'a [(String, String)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

/// `true`, `false`, `1`, `0` in any case, whitespace around ignored.
fn ref_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    }
}

/// Decimal digits only (whitespace around ignored), at most `max`.
fn ref_digits(s: &str, max: u128) -> Option<u128> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let s = s.trim_start_matches('0');
    if s.len() > 30 {
        return None;
    }
    let v = if s.is_empty() {
        0
    } else {
        s.parse::<u128>().ok()?
    };
    (v <= max).then_some(v)
}

/// One role's values, each with the variable it came from (or none: the
/// default).
type RoleValues = [(u128, Option<&'static str>); 4];

/// The reference of one role: polling, cores, pinning, idle-poll time, in
/// the order they are resolved; `Err` names the first bad variable and
/// its value.
fn reference_role(
    role: Role,
    connections: usize,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<RoleValues, (&'static str, String)> {
    let (polling, cores, pin, max_cores) = match role {
        Role::Ps => (
            vars::PS_ENABLE_POLLING,
            vars::NETWORK_PS_CORE_NUMBER,
            vars::PS_DISABLE_PIN_CORES,
            8,
        ),
        Role::Worker => (
            vars::WORKER_ENABLE_POLLING,
            vars::NETWORK_WORKER_CORE_NUMBER,
            vars::WORKER_DISABLE_PIN_CORES,
            2,
        ),
    };
    let one = |var: &'static str,
               parse: &dyn Fn(&str) -> Option<u128>,
               default: u128|
     -> Result<(u128, Option<&'static str>), (&'static str, String)> {
        match env(var) {
            None => Ok((default, None)),
            Some(v) => parse(&v).map(|x| (x, Some(var))).ok_or((var, v)),
        }
    };
    let b = |s: &str| ref_bool(s).map(u128::from);
    Ok([
        one(polling, &b, 0)?,
        one(
            cores,
            &|s| ref_digits(s, usize::MAX as u128).filter(|&n| (1..=1024).contains(&n)),
            max_cores.min(connections.max(1)) as u128,
        )?,
        // Pinning is the negation of *_DISABLE_PIN_CORES (default true).
        one(pin, &|s| ref_bool(s).map(|d| u128::from(!d)), 0)?,
        one(
            vars::STARWIRE_IDLE_POLL_US,
            &|s| ref_digits(s, u128::from(u64::MAX)),
            0,
        )?,
    ])
}

fn role_values(s: &Settings, role: Role) -> RoleValues {
    let n = s.role(role);
    let src = |s: &Source| match s {
        Source::Environment(v) => Some(*v),
        _ => None,
    };
    [
        (u128::from(n.polling.value), src(&n.polling.source)),
        (n.cores.value as u128, src(&n.cores.source)),
        (u128::from(n.pin_cores.value), src(&n.pin_cores.source)),
        (
            u128::from(n.idle_poll_us.value),
            src(&n.idle_poll_us.source),
        ),
    ]
}

/// `Settings::resolve` on the environment `text`, with `ps` and `worker`
/// connections.
pub fn check_settings(ps: u8, worker: u8, text: &[u8], peak: &mut usize) -> Result<Key, String> {
    let env = environment(text);
    let get = lookup(&env);
    let (pc, wc) = (usize::from(ps), usize::from(worker));
    let r = measure(peak, || {
        Settings::resolve(pc, wc, &get, &Overrides::default())
    });
    let want = reference_role(Role::Ps, pc, &get)
        .and_then(|p| reference_role(Role::Worker, wc, &get).map(|w| (p, w)));
    match (&r, &want) {
        (Ok(s), Ok((p, w))) => {
            let got = (role_values(s, Role::Ps), role_values(s, Role::Worker));
            if got != (*p, *w) {
                return Err(format!("resolved {got:?}, the reference says {want:?}"));
            }
            // The rows, as the variables spell them, read back.
            let rows: Vec<(String, String)> = s
                .rows()
                .into_iter()
                .map(|r| (r.variable.to_string(), r.value))
                .collect();
            let again = Settings::resolve(pc, wc, &lookup(&rows), &Overrides::default())
                .map_err(|e| format!("the rows {rows:?} read back fail: {e}"))?;
            for role in Role::ALL {
                let (a, b) = (role_values(s, role), role_values(&again, role));
                if a.iter().zip(&b).any(|(x, y)| x.0 != y.0 || y.1.is_none()) {
                    return Err(format!("the rows {rows:?} read back as {b:?}, not {a:?}"));
                }
            }
            if s.to_string().lines().count() != 7 {
                return Err(format!("settings display as {s}"));
            }
            let from_env = got.0.iter().chain(&got.1).filter(|v| v.1.is_some()).count();
            Ok((Kind::Settings, "ok", "", class(from_env)))
        }
        (
            Err(ConfigError::InvalidEnv {
                var,
                value,
                expected,
            }),
            Err((wvar, wvalue)),
        ) if var == wvar && value == wvalue && !expected.is_empty() => {
            Ok((Kind::Settings, "InvalidEnv", *var, 0))
        }
        _ => Err(format!("resolved {r:?}, the reference says {want:?}")),
    }
}

// ---------------------------------------------------------------------
// Criteo

/// Longest line, read buffer and batch size choices of the option bytes.
const LINE_LENS: [usize; 8] = [64 * 1024, 0, 16, 40, 100, 200, 400, 1000];
const BUFFERS: [usize; 8] = [1, 2, 7, 16, 64, 300, 4096, 65536];
const BATCHES: [usize; 8] = [1, 2, 3, 7, 16, 64, 1000, usize::MAX];

/// The reader's options from the first option byte: bit 0 skips bad
/// lines, bits 1-2 are workers - 1, bits 3-4 the worker (modulo workers),
/// bits 5-7 the longest line.
pub fn reader_options(o: u8) -> ReaderOptions {
    let workers = 1 + usize::from(o >> 1 & 3);
    ReaderOptions {
        skip_bad_lines: o & 1 == 1,
        workers,
        worker: usize::from(o >> 3 & 3) % workers,
        max_line_len: LINE_LENS[usize::from(o >> 5)],
    }
}

/// The option byte of [`reader_options`] for these options (`line` indexes
/// the longest line choices).
fn options_byte(skip: bool, workers: u8, worker: u8, line: u8) -> u8 {
    u8::from(skip) | (workers - 1) << 1 | worker << 3 | line << 5
}

/// How a read ended.
#[derive(Debug, Clone, PartialEq)]
enum End {
    Eof,
    Bad(u64, BadLineReason),
    Io,
}

/// Everything a reader yielded (the examples of a call that failed
/// included: they are in the batch and counted), how it ended, and the
/// lines it skipped.
#[derive(Debug, Clone, PartialEq)]
struct Read {
    all: Batch,
    end: End,
    skipped: u64,
}

/// One line parsed as the format says, written apart from the reader.
fn reference_line(line: &[u8], b: &mut Batch) -> Result<(), BadLineReason> {
    let cols: Vec<&[u8]> = line.split(|&c| c == b'\t').collect();
    if cols.len() != CRITEO_COLUMNS {
        return Err(BadLineReason::ColumnCount(
            cols.len().min(CRITEO_COLUMNS + 1),
        ));
    }
    let label = match cols[0] {
        b"0" => 0.0,
        b"1" => 1.0,
        _ => return Err(BadLineReason::Label),
    };
    let mut numeric = [0f32; NUM_NUMERIC];
    for (j, x) in numeric.iter_mut().enumerate() {
        let col = cols[1 + j];
        if col.is_empty() {
            continue;
        }
        let v = std::str::from_utf8(col).ok().and_then(|s| {
            let digits = s.strip_prefix('-').unwrap_or(s);
            if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
                None
            } else {
                s.parse::<i64>().ok()
            }
        });
        *x = transform_count(v.ok_or(BadLineReason::Integer(j + 1))?);
    }
    b.labels.push(label);
    b.numeric.extend_from_slice(&numeric);
    for (f, col) in cols[1 + NUM_NUMERIC..].iter().enumerate() {
        b.keys.push(if col.is_empty() {
            MISSING_KEY
        } else {
            feature_hash(f as u32, col)
        });
    }
    b.len += 1;
    Ok(())
}

/// What a reader with `o` must yield from `text`, and the lines it has
/// seen when it stops.
fn reference_read(text: &[u8], o: &ReaderOptions) -> (Read, u64) {
    let mut lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    let mut all = Batch::default();
    let mut skipped = 0;
    for (i, line) in lines.iter().enumerate() {
        if i % o.workers != o.worker {
            continue;
        }
        let r = if line.len() > o.max_line_len {
            Err(BadLineReason::TooLong)
        } else {
            reference_line(line.strip_suffix(b"\r").unwrap_or(line), &mut all)
        };
        match r {
            Ok(()) => {}
            Err(_) if o.skip_bad_lines => skipped += 1,
            Err(reason) => {
                let end = End::Bad(i as u64 + 1, reason);
                return (Read { all, end, skipped }, i as u64 + 1);
            }
        }
    }
    let n = lines.len() as u64;
    let end = End::Eof;
    (Read { all, end, skipped }, n)
}

fn check_batch(b: &Batch, max: usize) -> Result<(), String> {
    if b.len > max
        || b.labels.len() != b.len
        || b.numeric.len() != b.len * NUM_NUMERIC
        || b.keys.len() != b.len * NUM_CATEGORICAL
    {
        return Err(format!(
            "a batch of {} (at most {max}) with {} labels, {} numeric, {} keys",
            b.len,
            b.labels.len(),
            b.numeric.len(),
            b.keys.len()
        ));
    }
    if b.labels.iter().any(|&l| l != 0.0 && l != 1.0) || b.numeric.iter().any(|x| !x.is_finite()) {
        return Err(format!("a batch with labels {:?}", b.labels));
    }
    Ok(())
}

/// Read batches of `max` with `next` to the end or the first error; the
/// examples are kept while `keep`, and the run stops after `most` of them.
fn drive(
    mut next: impl FnMut(&mut Batch) -> Result<usize, DataError>,
    max: usize,
    keep: bool,
    most: usize,
    peak: &mut usize,
) -> Result<(Batch, End), String> {
    let mut all = Batch::default();
    let mut b = Batch::default();
    let mut seen = 0usize;
    loop {
        let r = measure(peak, || next(&mut b));
        check_batch(&b, max)?;
        seen += b.len;
        if keep {
            all.extend_from(&b);
        }
        let end = match r {
            Ok(0) if b.len == 0 => End::Eof,
            Ok(n) if n == b.len && n > 0 => {
                if seen >= most {
                    return Ok((all, End::Eof));
                }
                continue;
            }
            Ok(n) => {
                return Err(format!(
                    "next_batch returned {n} with {} in the batch",
                    b.len
                ))
            }
            Err(DataError::BadLine { line, reason }) => End::Bad(line, reason),
            Err(DataError::Io(_)) => End::Io,
            Err(e) => return Err(format!("reader error {e:?}")),
        };
        return Ok((all, end));
    }
}

fn prefix_of(a: &Batch, b: &Batch) -> bool {
    a.len <= b.len
        && b.labels[..a.len] == a.labels[..]
        && b.numeric[..a.len * NUM_NUMERIC] == a.numeric[..]
        && b.keys[..a.len * NUM_CATEGORICAL] == a.keys[..]
}

/// `CriteoReader` on `text` with the option bytes: against the reference,
/// then again after a rewind.
pub fn check_criteo(opts: [u8; 3], text: &[u8], peak: &mut usize) -> Result<Key, String> {
    let o = reader_options(opts[0]);
    let cap = BUFFERS[usize::from(opts[1] % 8)];
    let max = BATCHES[usize::from(opts[2] % 8)];
    let (want, want_lines) = reference_read(text, &o);
    let input = BufReader::with_capacity(cap, Cursor::new(text));
    let mut r = measure(peak, || CriteoReader::new(input, o))
        .map_err(|e| format!("options {o:?} refused: {e}"))?;
    for epoch in 0..2 {
        let (all, end) = drive(|b| r.next_batch(max, b), max, true, usize::MAX, peak)?;
        let c = r.counters();
        let got = Read {
            all,
            end,
            skipped: c.skipped,
        };
        if got != want {
            return Err(format!(
                "epoch {epoch}: the reader gives {} examples, {} skipped, end {:?}; \
                 the reference {}, {}, {:?}{}",
                got.all.len,
                got.skipped,
                got.end,
                want.all.len,
                want.skipped,
                want.end,
                if got.all.len == want.all.len && got.all != want.all {
                    " (the examples differ)"
                } else {
                    ""
                }
            ));
        }
        if c.lines != want_lines || c.examples != want.all.len as u64 {
            return Err(format!(
                "epoch {epoch}: counters {c:?}, the reference read {want_lines} lines, {} examples",
                want.all.len
            ));
        }
        r.rewind().map_err(|e| format!("rewind: {e}"))?;
        if r.counters() != Default::default() {
            return Err(format!("rewound counters {:?}", r.counters()));
        }
    }
    let (k, detail) = match want.end {
        End::Bad(_, reason) => ("bad", reason_kind(&reason)),
        _ if want.skipped > 0 => ("skipped", ""),
        _ => ("ok", ""),
    };
    Ok((Kind::Criteo, k, detail, class(want.all.len)))
}

/// CRC-32 (IEEE), gzip's.
pub fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                c >> 1 ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// `data` as one gzip member of stored deflate blocks of at most `block`
/// bytes.
pub fn gzip_stored(data: &[u8], block: usize) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    let block = block.clamp(1, 0xffff);
    let mut chunks: Vec<&[u8]> = data.chunks(block).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let last = chunks.len() - 1;
    for (i, c) in chunks.iter().enumerate() {
        out.push(u8::from(i == last));
        let len = c.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(c);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

const GZ_BLOCKS: [usize; 4] = [7, 64, 1000, 0xffff];

/// How the gzip shape byte breaks a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Break {
    None,
    /// The last member's magic.
    Magic,
    /// The last member's CRC.
    Crc,
    /// The last member's length.
    Size,
    /// Cut inside the last member.
    Cut,
    /// The first member's modification time (ignored by readers).
    Mtime,
    /// Bytes after the last member.
    Junk,
}

/// `text` as a gzip file of the shape `g`: bits 0-1 give one to three
/// members (the text cut evenly), bits 2-3 the stored block size, bits 4-6
/// how the stream is broken.
fn gzip_shaped(text: &[u8], g: u8) -> (Vec<u8>, Break) {
    let members = 1 + usize::from(g & 3) % 3;
    let block = GZ_BLOCKS[usize::from(g >> 2 & 3)];
    let brk = [
        Break::None,
        Break::None,
        Break::Magic,
        Break::Crc,
        Break::Size,
        Break::Cut,
        Break::Mtime,
        Break::Junk,
    ][usize::from(g >> 4 & 7)];
    let mut out = Vec::new();
    let mut last_start = 0;
    for m in 0..members {
        let (a, b) = (text.len() * m / members, text.len() * (m + 1) / members);
        last_start = out.len();
        out.extend_from_slice(&gzip_stored(&text[a..b], block));
    }
    let end = out.len();
    match brk {
        Break::None => {}
        Break::Magic => out[last_start + 1] ^= 0x40,
        Break::Crc => out[end - 8] ^= 1,
        Break::Size => out[end - 4] ^= 1,
        Break::Cut => {
            // Strictly inside the last member: whole members before it
            // would be a shorter valid file.
            let span = end - last_start - 1;
            let at = last_start + 1 + (text.len() * 7919 + usize::from(g)) % span;
            out.truncate(at);
        }
        Break::Mtime => out[4] ^= 0x5a,
        Break::Junk => out.extend_from_slice(b"junk\n"),
    }
    (out, brk)
}

/// `CriteoFiles` on the gzip file at `path`, holding `gz`.
fn read_gz(
    path: &Path,
    gz: &[u8],
    o: ReaderOptions,
    max: usize,
    keep: bool,
    peak: &mut usize,
) -> Result<Read, String> {
    std::fs::write(path, gz).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let mut files = measure(peak, || CriteoFiles::open(path, o))
        .map_err(|e| format!("CriteoFiles::open: {e}"))?;
    // What the reader loop cannot say with a `DataError`.
    let mut odd: Option<String> = None;
    let mut skipped = 0;
    let read = drive(
        |b| {
            let r = files.next_batch(max, b);
            if files.skipped() < skipped {
                odd.get_or_insert(format!("skipped {} after {skipped}", files.skipped()));
            }
            skipped = files.skipped();
            r.map_err(|e| match e {
                DataError::InFile { path: p, source } if p == path => *source,
                e => {
                    odd.get_or_insert(format!("an error that does not name the file: {e:?}"));
                    DataError::Options("see the error above")
                }
            })
        },
        max,
        keep,
        100_000,
        peak,
    );
    if let Some(why) = odd {
        return Err(why);
    }
    let (all, end) = read?;
    Ok(Read {
        all,
        end,
        skipped: files.skipped(),
    })
}

/// The Criteo text wrapped in gzip as shape byte `opts[1]` says, read
/// through `CriteoFiles` and compared with the reference.
fn check_criteo_gz(
    dir: &Path,
    opts: [u8; 3],
    text: &[u8],
    peak: &mut usize,
) -> Result<Key, String> {
    let o = reader_options(opts[0]);
    let max = BATCHES[usize::from(opts[2] % 8)];
    let (want, _) = reference_read(text, &o);
    let (gz, brk) = gzip_shaped(text, opts[1]);
    let got = read_gz(&dir.join("in.tsv.gz"), &gz, o, max, true, peak)?;
    let outcome = if got == want {
        "same"
    } else if brk != Break::None
        && brk != Break::Mtime
        && got.end == End::Io
        && prefix_of(&got.all, &want.all)
        && got.skipped <= want.skipped
    {
        "stopped"
    } else {
        return Err(format!(
            "the gzip file ({brk:?}) gives {} examples, {} skipped, end {:?}; \
             the text {}, {}, {:?}",
            got.all.len, got.skipped, got.end, want.all.len, want.skipped, want.end
        ));
    };
    let b = match brk {
        Break::None => "clean",
        Break::Magic => "magic",
        Break::Crc => "crc",
        Break::Size => "size",
        Break::Cut => "cut",
        Break::Mtime => "mtime",
        Break::Junk => "junk",
    };
    Ok((Kind::CriteoGz, outcome, b, class(want.all.len)))
}

/// A gzip file as given, through `CriteoFiles`.
fn check_gz(dir: &Path, opts: [u8; 3], gz: &[u8], peak: &mut usize) -> Result<Key, String> {
    let o = reader_options(opts[0]);
    let max = BATCHES[usize::from(opts[2] % 8)].min(1000);
    let got = read_gz(&dir.join("raw.tsv.gz"), gz, o, max, false, peak)?;
    let k = match got.end {
        End::Eof => "eof",
        End::Bad(_, r) => reason_kind(&r),
        End::Io => "io",
    };
    Ok((Kind::Gz, k, "", class(got.skipped as usize)))
}

// ---------------------------------------------------------------------
// Seeds

fn criteo_line(label: &str, ints: &[&str], cats: &[&str]) -> String {
    let mut cols = vec![label.to_string()];
    cols.extend((0..NUM_NUMERIC).map(|i| ints.get(i).unwrap_or(&"").to_string()));
    cols.extend((0..NUM_CATEGORICAL).map(|i| cats.get(i).unwrap_or(&"").to_string()));
    cols.join("\t")
}

/// The text of [`GZ_CHUNK`]: three good lines, one with an `I4` of
/// `i64::MAX` and a CRLF, a bad line, a good line without a newline.
pub fn gz_chunk_text() -> String {
    let mut cats = ["68fd1e64"; 26];
    cats[25] = "";
    let l1 = criteo_line("1", &["3", "-1"], &cats);
    let mut cats2 = ["a"; 26];
    cats2[..3].copy_from_slice(&["05db9164", "", "38a947a1"]);
    let l2 = criteo_line("0", &["0", "", "12", "9223372036854775807"], &cats2);
    format!("{l1}\n{l1}\n{l1}\n{l2}\r\n2\tnot a line\n{l1}")
}

/// [`gz_chunk_text`] compressed by `gzip -9n`.
pub const GZ_CHUNK: [u8; 112] = [
    0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x03, 0xed, 0x90, 0x3b, 0x0a, 0x80, 0x30,
    0x10, 0x44, 0xeb, 0x09, 0x78, 0x87, 0x5c, 0x40, 0xd8, 0x4f, 0x92, 0x4d, 0x8e, 0x13, 0x51, 0x41,
    0x90, 0xd8, 0x78, 0x7f, 0xb4, 0xd3, 0xd6, 0x56, 0x9d, 0x69, 0xa6, 0x98, 0xe6, 0x3d, 0x86, 0xa2,
    0x67, 0xdc, 0x92, 0xf2, 0x3c, 0xf2, 0x94, 0xc2, 0x6b, 0x87, 0xe3, 0x9f, 0xf9, 0x13, 0xcc, 0x04,
    0x02, 0x58, 0x50, 0x44, 0x54, 0x4d, 0x48, 0x53, 0x8e, 0xc1, 0x2c, 0x66, 0xb2, 0x4b, 0x03, 0xc5,
    0x71, 0x28, 0x7c, 0xde, 0xa1, 0xb9, 0x96, 0x60, 0x95, 0x51, 0x9f, 0xb4, 0x73, 0x82, 0xb6, 0xed,
    0xbe, 0xfa, 0x75, 0x69, 0xd3, 0x17, 0x3d, 0x1f, 0xb6, 0x23, 0x2e, 0xaf, 0x43, 0x04, 0x00, 0x00,
];

fn with(kind: Kind, header: &[u8], text: &[u8]) -> Vec<u8> {
    let mut v = vec![kind as u8];
    v.extend_from_slice(header);
    v.extend_from_slice(text);
    v
}

/// Criteo texts: good lines (missing fields, CRLF, no final newline), bad
/// lines of every reason, a long line.
fn criteo_texts() -> Vec<(u8, String)> {
    let mut cats = ["68fd1e64"; 26];
    cats[25] = "";
    let good = criteo_line("1", &["3", "-1"], &cats);
    let sparse = criteo_line(
        "0",
        &["", "", "", "", "", "", "", "", "", "", "", "", "7"],
        &[],
    );
    let ints = [
        "0",
        "-9223372036854775808",
        "9223372036854775807",
        "00012",
        "4095",
        "4096",
    ];
    let wide = criteo_line("0", &ints, &["05db9164", "38a947a1", "", "x\u{e9}"]);
    let overflow = criteo_line("1", &["9223372036854775808"], &[]);
    let dash = criteo_line("1", &["", "-"], &[]);
    let label = criteo_line("2", &["1"], &[]);
    let extra = format!("{good}\t");
    let short = "1\t2\t3";
    let long = criteo_line("1", &["1"; 13], &["0123456789abcdef"; 26]);
    vec![
        (0, format!("{good}\n{sparse}\r\n{wide}\n{good}")),
        (
            0,
            format!("{good}\n{overflow}\n{dash}\n{label}\n{extra}\n{short}\n\n{wide}\n"),
        ),
        (
            options_byte(true, 2, 1, 0),
            format!("{good}\n{short}\n{sparse}\n{label}\n{good}\n"),
        ),
        (
            options_byte(true, 1, 0, 4),
            format!("{long}\n{good}\n{long}\r\n"),
        ),
        (options_byte(false, 1, 0, 2), format!("{good}\n\n")),
        (0, String::new()),
        (0, format!("{label}\n{good}\n")),
    ]
}

/// The seed corpus: valid and nearly valid inputs of every kind.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for s in [
        "ps0.example:2222",
        " 10.0.0.1:80 ",
        "[::1]:2222",
        "[fe80::1%eth0]:1",
        "[::ffff:10.1.2.3]:65535",
        "[0:0::1]:9",
        "PS0.Example:1",
        "a:65536",
        "h:0",
        "h:+80",
        "::1:80",
        "[::1]",
        "p0:1,p1:1, [::1]:5",
        "a:1,,b:2",
        "w-0_x.local:1,[2001:db8::1]:443",
        "",
    ] {
        out.push(with(Kind::HostPort, &[], s.as_bytes()));
    }
    for s in [
        "# grpc endpoint   = fast endpoint\n\
         ps0.example:2222=ps0.example:3333\n\
         worker0.example:2222=worker0.example:3333   # trailing comment\n\
         [fd00::7]:2222=[fd00::7]:3333\n",
        "# header\n\na:1=a:2\n   \t\nb:1 = b:2   # c\r\n\t# indented\n[::1]:1=[::1]:2\t#tab\nc:1=c:2",
        "a:1=a:2\nb:1=b:2\nA:1=c:2",
        "a:1=a:2#x",
        "a:1=b:1=c:1\n",
        "a:99999=a:1",
        "a:1=a:2\n\nnot a mapping\n",
        "[fe80::1%eth0]:1=[::ffff:1.2.3.4]:65535\n",
        "",
    ] {
        out.push(with(Kind::EndpointMap, &[], s.as_bytes()));
    }
    out.push(with(Kind::EndpointMap, &[], b"a:1=a:2\nb:1=\xff:2\n"));
    for s in [
        r#"{"cluster": {"chief": ["c:1"], "ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1"],
            "evaluator": ["e:1"]}, "task": {"type": "worker", "index": 1},
            "environment": "cloud", "rpc_layer": "grpc"}"#,
        r#"{"cluster":{"ps":["p:1"],"worker":["w0:1","[::1]:2"]},"task":{"type":"ps"}}"#,
        r#"{"cluster":{"ps":["p:1"],"chief":["c:1"]},"task":{"type":"chief","index":0}}"#,
        r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"evaluator","index":0}}"#,
        r#"{"cluster":{"ps":["p:1"],"chief":["c:1"],"worker":["w:1"]},"task":{"type":"worker","index":4294967295}}"#,
        r#"{"cluster":{"ps":["p:1"],"worker":["P:1"]},"task":{"type":"ps","index":4294967296}}"#,
        r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"worker","index":1}}"#,
        r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"ps","index":-1}}"#,
        r#"{"cluster":{"ps":["p:1"],"worker":["w:1"]},"task":{"type":"ps","index":"0"}}"#,
        r#"{"cluster":{"\u0070s":["p:65535"],"worker":["w:1"]},"task":{"\u0074ype":"worker"}}"#,
        r#"{"cluster":{"ps":"p:1"}}"#,
        r#"{"cluster":{"worker":["w:1","nope"]},"task":{"index":1}}"#,
        r#"{"x": [1, {"y": null}], "task": {}}"#,
        "{}",
        "  ",
    ] {
        out.push(with(Kind::TfConfig, &[], s.as_bytes()));
    }
    let good = "WORKER_ENABLE_POLLING=true\nPS_ENABLE_POLLING=0\nNETWORK_PS_CORE_NUMBER= 12 \n\
                NETWORK_WORKER_CORE_NUMBER=2\nWORKER_DISABLE_PIN_CORES=FALSE\n\
                PS_DISABLE_PIN_CORES=1\nSTARWIRE_IDLE_POLL_US=100\n";
    out.push(with(Kind::Settings, &[3, 10], good.as_bytes()));
    out.push(with(Kind::Settings, &[0, 0], b""));
    let values: [(&str, &[&str]); 7] = [
        (vars::WORKER_ENABLE_POLLING, &["\ttrue\r", "yes", ""]),
        (vars::PS_ENABLE_POLLING, &["FaLsE", "2"]),
        (
            vars::NETWORK_PS_CORE_NUMBER,
            &[
                "0",
                "-3",
                "+2",
                "18446744073709551615",
                "18446744073709551616",
            ],
        ),
        (
            vars::NETWORK_WORKER_CORE_NUMBER,
            &["2.5", "007", "99999999999999999999999"],
        ),
        (vars::WORKER_DISABLE_PIN_CORES, &["off", "0"]),
        (vars::PS_DISABLE_PIN_CORES, &["true", "\u{2003}1"]),
        (
            vars::STARWIRE_IDLE_POLL_US,
            &["18446744073709551615", "18446744073709551616", "10us", "0"],
        ),
    ];
    for (var, values) in values {
        for v in values {
            out.push(with(
                Kind::Settings,
                &[9, 1],
                format!("{var}={v}\n").as_bytes(),
            ));
        }
    }
    out.push(with(Kind::Settings, &[1, 2], b"PS_ENABLE_POLLING=\xff\n"));
    for (i, (o, text)) in criteo_texts().into_iter().enumerate() {
        let i = i as u8;
        out.push(with(Kind::Criteo, &[o, i, 5 + i % 3], text.as_bytes()));
        // One, two and three members, several block sizes, every break.
        let shape = (i % 3) | (i % 4) << 2 | (i % 8) << 4;
        out.push(with(Kind::CriteoGz, &[o, shape, 6], text.as_bytes()));
    }
    out.push(with(Kind::Gz, &[1, 0, 4], &GZ_CHUNK));
    let mut two = GZ_CHUNK.to_vec();
    two.extend_from_slice(&GZ_CHUNK);
    out.push(with(Kind::Gz, &[options_byte(true, 2, 0, 0), 0, 2], &two));
    let text = gz_chunk_text();
    out.push(with(
        Kind::Gz,
        &[1, 0, 6],
        &gzip_stored(text.as_bytes(), 100),
    ));
    out
}

// ---------------------------------------------------------------------
// Mutations

const SEPARATORS: &[u8] = b"=:,\t\n\r[]{}\"#% -.0";

const TOKENS: [&[u8]; 58] = [
    b"65535",
    b"65536",
    b"0",
    b"1",
    b"-1",
    b"00",
    b"4294967295",
    b"4294967296",
    b"9223372036854775807",
    b"9223372036854775808",
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"18446744073709551615",
    b"18446744073709551616",
    b"99999999999999999999999",
    b"+1",
    b"1e3",
    b"0x1",
    b"true",
    b"FALSE",
    b"yes",
    b"null",
    b"[]",
    b"{}",
    b"::",
    b"[::1]",
    b"[::ffff:10.0.0.1]",
    b"%eth0",
    b"fe80::1",
    b"\\u0000",
    b"\\\"",
    b"\\u00e9",
    b"\"ps\"",
    b"\"worker\"",
    b"\"chief\"",
    b"\"evaluator\"",
    b"\"index\"",
    b"\"type\"",
    b"\"task\"",
    b"\"cluster\"",
    b" #",
    b"\t#",
    b"\r\n",
    b"\t\t",
    b"\n\n",
    b"==",
    b"\xff",
    b"\xc3\xa9",
    b"\xc3",
    b"\xe2\x80\x83",
    b"\x00",
    b"WORKER_ENABLE_POLLING=",
    b"PS_ENABLE_POLLING=",
    b"NETWORK_PS_CORE_NUMBER=",
    b"NETWORK_WORKER_CORE_NUMBER=",
    b"WORKER_DISABLE_PIN_CORES=",
    b"PS_DISABLE_PIN_CORES=",
    b"STARWIRE_IDLE_POLL_US=",
];

/// Numbers at the parsers' boundaries: ports, u32 indices, i64 counts,
/// u64 microseconds.
const NUMBERS: [&[u8]; 16] = [
    b"0",
    b"1",
    b"65535",
    b"65536",
    b"4294967295",
    b"4294967296",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551615",
    b"18446744073709551616",
    b"000001",
    b"4095",
    b"4096",
    b"99999999999999999999999",
    b"1e2",
    b"1.5",
];

/// Byte-level mutations of a text input, aimed at its separators and
/// numbers: separators (`=`, `:`, `,`, tabs, newlines, brackets, quotes)
/// replaced or inserted, tokens (boundary numbers, JSON keys, variable
/// names, invalid UTF-8) inserted, digit runs set to boundary values or
/// moved by one, fields and lines deleted, duplicated and swapped, bit
/// flips, truncation, splicing, and now and then another parser.
#[derive(Debug)]
pub struct Texts;

/// The spans of ASCII digits in `data[from..]`, at most 64.
fn digit_runs(data: &[u8], from: usize) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = from;
    while i < data.len() && runs.len() < 64 {
        if data[i].is_ascii_digit() {
            let s = i;
            while i < data.len() && data[i].is_ascii_digit() {
                i += 1;
            }
            runs.push((s, i));
        } else {
            i += 1;
        }
    }
    runs
}

/// The line around `at` in `data[from..]`, its newline included.
fn line_at(data: &[u8], from: usize, at: usize) -> (usize, usize) {
    let s = data[from..at]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(from, |p| from + p + 1);
    let e = data[at..]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(data.len(), |p| at + p + 1);
    (s, e)
}

fn mutate_number(rng: &mut SmallRng, data: &mut Vec<u8>, from: usize) {
    let runs = digit_runs(data, from);
    if runs.is_empty() {
        let at = rng.gen_range(from..=data.len());
        let n = NUMBERS[rng.gen_range(0..NUMBERS.len())];
        data.splice(at..at, n.iter().copied());
        return;
    }
    let (s, e) = runs[rng.gen_range(0..runs.len())];
    let new: Vec<u8> = match rng.gen_range(0..4) {
        0 | 1 => NUMBERS[rng.gen_range(0..NUMBERS.len())].to_vec(),
        2 => {
            let v: u128 = std::str::from_utf8(&data[s..e])
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            let v = if rng.gen_bool(0.5) {
                v.saturating_add(1)
            } else {
                v.saturating_sub(1)
            };
            v.to_string().into_bytes()
        }
        _ => {
            let mut v = vec![[b'-', b'+', b'0', b' '][rng.gen_range(0..4)]];
            v.extend_from_slice(&data[s..e]);
            v
        }
    };
    data.splice(s..e, new);
}

impl Mutation for Texts {
    fn apply(rng: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        if data.is_empty() {
            data.push(rng.gen_range(0..Kind::ALL.len() as u8));
        }
        // Keep the selector: the byte after it is the first mutable one.
        let from = 1;
        let len = data.len();
        let text = len > from;
        match rng.gen_range(0..17) {
            0 if text => flip_bit(rng, &mut data[from..]),
            1 if text => {
                let i = rng.gen_range(from..len);
                data[i] = SEPARATORS[rng.gen_range(0..SEPARATORS.len())];
            }
            2 => {
                let at = rng.gen_range(from..=len);
                data.insert(at, SEPARATORS[rng.gen_range(0..SEPARATORS.len())]);
            }
            3 | 4 => {
                let t = TOKENS[rng.gen_range(0..TOKENS.len())];
                let at = rng.gen_range(from..=len);
                let end = if rng.gen_bool(0.5) {
                    at
                } else {
                    (at + rng.gen_range(0..=t.len())).min(len)
                };
                data.splice(at..end, t.iter().copied());
            }
            5 | 6 => mutate_number(rng, data, from),
            7 if text => {
                // A field: the bytes between two separators, with one of
                // them half the time (two fields become one).
                let at = rng.gen_range(from..len);
                let sep = |b: &u8| b"\t,=:\n\"[]".contains(b);
                let s = data[from..at]
                    .iter()
                    .rposition(sep)
                    .map_or(from, |p| from + p + 1);
                let mut e = data[at..].iter().position(sep).map_or(len, |p| at + p);
                if e < len && rng.gen_bool(0.5) {
                    e += 1;
                }
                data.drain(s..e);
            }
            8 if text => {
                let (s, e) = line_at(data, from, rng.gen_range(from..len));
                let line = data[s..e].to_vec();
                if len + line.len() <= max_len {
                    data.splice(e..e, line);
                }
            }
            9 if text => {
                let (s, e) = line_at(data, from, rng.gen_range(from..len));
                data.drain(s..e);
            }
            10 if text => {
                let (s1, e1) = line_at(data, from, rng.gen_range(from..len));
                let (s2, e2) = line_at(data, from, rng.gen_range(from..len));
                if e1 <= s2 {
                    let second = data[s2..e2].to_vec();
                    let first = data[s1..e1].to_vec();
                    data.splice(s2..e2, first);
                    data.splice(s1..e1, second);
                }
            }
            11 if text => truncate(rng, data),
            12 if !corpus.is_empty() => {
                splice(rng, data, corpus);
                if data.is_empty() {
                    data.push(0);
                }
            }
            13 if text => delete(rng, data, from, 16),
            14 if text => duplicate(rng, data, from, 64, max_len),
            15 => insert_random(rng, data, 4),
            16 if rng.gen_bool(0.3) => data[0] = rng.gen_range(0..Kind::ALL.len() as u8),
            _ => {}
        }
        if data.is_empty() {
            data.push(0);
        }
    }
}

// ---------------------------------------------------------------------
// The target

static DIRS: AtomicUsize = AtomicUsize::new(0);

/// See the module documentation.
#[derive(Debug)]
pub struct Text {
    dir: PathBuf,
    made_dir: bool,
    runs: u64,
    by_kind: BTreeMap<Kind, u64>,
    outcomes: BTreeMap<Key, u64>,
    /// The largest allocation the parsers made, and its input's length.
    largest: (usize, usize),
}

impl Default for Text {
    fn default() -> Self {
        let n = DIRS.fetch_add(1, Ordering::Relaxed);
        Self {
            dir: std::env::temp_dir()
                .join(format!("starwire-fuzz-text-{}-{n}", std::process::id())),
            made_dir: false,
            runs: 0,
            by_kind: BTreeMap::new(),
            outcomes: BTreeMap::new(),
            largest: (0, 0),
        }
    }
}

impl Drop for Text {
    fn drop(&mut self) {
        if self.made_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Text {
    /// Run one input through its parser with every check of the module
    /// docs; `Err` says which failed.
    pub fn run_one(&mut self, input: &[u8]) -> Result<Key, String> {
        let (kind, opts, text) = split(input);
        if matches!(kind, Kind::CriteoGz | Kind::Gz) && !self.made_dir {
            std::fs::create_dir_all(&self.dir)
                .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
            self.made_dir = true;
        }
        let mut peak = 0;
        let key = match kind {
            Kind::HostPort => check_hostport(text, &mut peak),
            Kind::EndpointMap => check_endpoint_map(text, &mut peak),
            Kind::TfConfig => check_tf_config(text, &mut peak),
            Kind::Settings => check_settings(opts[0], opts[1], text, &mut peak),
            Kind::Criteo => check_criteo(opts, text, &mut peak),
            Kind::CriteoGz => check_criteo_gz(&self.dir, opts, text, &mut peak),
            Kind::Gz => check_gz(&self.dir, opts, text, &mut peak),
        }
        .map_err(|e| format!("{}: {e}", kind.name()))?;
        if peak > alloc_bound(kind, input.len()) {
            return Err(format!(
                "{}: an allocation of {peak} bytes for an input of {} bytes",
                kind.name(),
                input.len()
            ));
        }
        if peak > self.largest.0 {
            self.largest = (peak, input.len());
        }
        Ok(key)
    }
}

impl Target for Text {
    const SPEC: Spec = Spec {
        name: "fuzz-text",
        seed: 0x5357_5458,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/text"),
        max_len: 8192,
        max_len_flag: true,
        corpus_flags: true,
        max_corpus: 4096,
        failure_prefix: "text",
    };
    type Mutation = Texts;
    type Case = ();
    type Key = Key;

    fn seeds(&self) -> Vec<Vec<u8>> {
        seeds()
    }

    fn prepare(&mut self, m: &mut Mutator<Texts>, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        m.mutate(input, corpus);
    }

    fn run(&mut self, _: &(), input: &[u8]) -> Result<Key, String> {
        self.runs += 1;
        let key = self.run_one(input)?;
        *self.by_kind.entry(key.0).or_default() += 1;
        *self.outcomes.entry(key).or_default() += 1;
        Ok(key)
    }

    fn progress(&self) -> String {
        format!("runs {}  outcomes {}", self.runs, self.outcomes.len())
    }

    fn summary(&self) -> Vec<String> {
        let mut lines = vec![
            format!(
                "runs by parser: {:?}",
                self.by_kind
                    .iter()
                    .map(|(k, n)| (k.name(), *n))
                    .collect::<Vec<_>>()
            ),
            format!(
                "largest allocation by a parser: {} bytes, for an input of {} bytes",
                self.largest.0, self.largest.1
            ),
        ];
        for kind in Kind::ALL {
            let mut by: BTreeMap<String, u64> = BTreeMap::new();
            for ((k, a, b, _), n) in &self.outcomes {
                if *k == kind {
                    let name = if b.is_empty() {
                        a.to_string()
                    } else {
                        format!("{a}/{b}")
                    };
                    *by.entry(name).or_default() += n;
                }
            }
            lines.push(format!("{}: {by:?}", kind.name()));
        }
        lines
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        self.run_one(input).map(drop)
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        let (kind, opts, text) = split(input);
        println!(
            "{} {opts:?} {:?}",
            kind.name(),
            String::from_utf8_lossy(text)
        );
        let r = self.run_one(input);
        println!("{r:?}");
        r.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(input: &[u8]) -> Result<Key, String> {
        Text::default().run_one(input)
    }

    #[test]
    fn every_seed_passes_and_every_kind_has_seeds() {
        let mut t = Text::default();
        let mut kinds = BTreeMap::new();
        for s in seeds() {
            let k = t
                .run_one(&s)
                .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&s)));
            *kinds.entry(k.0).or_insert(0) += 1;
        }
        assert_eq!(kinds.len(), Kind::ALL.len(), "{kinds:?}");
    }

    #[test]
    fn the_seeds_reach_the_outcomes_they_are_for() {
        let keys: Vec<Key> = seeds().iter().map(|s| run(s).unwrap()).collect();
        let has = |kind: Kind, a: &str, b: &str| {
            keys.iter()
                .any(|k| k.0 == kind && k.1 == a && (b.is_empty() || k.2 == b))
        };
        assert!(has(Kind::HostPort, "ipv6", "list"));
        assert!(has(Kind::HostPort, "BadPort", ""));
        assert!(has(Kind::HostPort, "ok", "list"));
        assert!(has(Kind::HostPort, "UnbracketedIpv6", "list-refused"));
        assert!(has(Kind::EndpointMap, "ok", ""));
        assert!(has(Kind::EndpointMap, "DuplicateKey", ""));
        assert!(has(Kind::EndpointMap, "InvalidUtf8", ""));
        assert!(has(Kind::TfConfig, "ok", "resolved"));
        assert!(has(Kind::TfConfig, "ok", "TaskIndexOutOfRange"));
        assert!(has(Kind::TfConfig, "UnsupportedJob", ""));
        assert!(has(Kind::TfConfig, "TfConfigJson", ""));
        assert!(has(Kind::Settings, "ok", ""));
        assert!(has(
            Kind::Settings,
            "InvalidEnv",
            vars::NETWORK_PS_CORE_NUMBER
        ));
        assert!(has(Kind::Criteo, "bad", "Integer"));
        assert!(has(Kind::Criteo, "skipped", ""));
        assert!(has(Kind::Criteo, "bad", "TooLong"));
        assert!(has(Kind::CriteoGz, "same", "clean"));
        assert!(has(Kind::CriteoGz, "stopped", ""));
        assert!(has(Kind::Gz, "eof", ""));
    }

    #[test]
    fn the_compressed_chunk_reads_as_its_text() {
        let dir = Text::default();
        std::fs::create_dir_all(&dir.dir).unwrap();
        let o = reader_options(1);
        let mut peak = 0;
        let got = read_gz(&dir.dir.join("c.gz"), &GZ_CHUNK, o, 3, true, &mut peak).unwrap();
        let (want, _) = reference_read(gz_chunk_text().as_bytes(), &o);
        assert_eq!(got, want);
        assert_eq!((got.all.len, got.skipped), (5, 1));
        std::fs::remove_dir_all(&dir.dir).unwrap();
    }

    #[test]
    fn stored_gzip_is_well_formed() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        let g = gzip_stored(b"hello", 2);
        // header, three blocks of 2, 2, 1 bytes, trailer
        assert_eq!(g.len(), 10 + 3 * 5 + 5 + 8);
        assert_eq!(&g[g.len() - 4..], &5u32.to_le_bytes());
        assert_eq!(gzip_stored(b"", 7).len(), 10 + 5 + 8);
    }

    #[test]
    fn the_checks_catch_what_they_are_for() {
        // The reference differs from the reader if a column is lost.
        let mut cats = ["68fd1e64"; 26];
        cats[3] = "";
        let line = criteo_line("1", &["1"], &cats);
        let (want, _) = reference_read(line.as_bytes(), &reader_options(0));
        let mut wrong = want.clone();
        wrong.all.keys[3] = feature_hash(3, b"68fd1e64");
        assert_ne!(want, wrong);
        assert_eq!(want.all.keys[3], MISSING_KEY);
        // A settings reference that read "+2" as 2 would disagree.
        let env = vec![(vars::NETWORK_PS_CORE_NUMBER.to_string(), "+2".to_string())];
        assert!(reference_role(Role::Ps, 1, &lookup(&env)).is_err());
        // A broken gzip stream is seen.
        let (g, brk) = gzip_shaped(b"0\n", 3 << 4);
        assert_eq!(brk, Break::Crc);
        assert_ne!(g, gzip_stored(b"0\n", 7));
    }

    #[test]
    fn a_short_run_holds_the_checks() {
        let mut t = Text::default();
        let corpus = seeds();
        let mut m = Mutator::<Texts>::new(3, Text::SPEC.max_len);
        for i in 0..6_000 {
            let mut d = corpus[i % corpus.len()].clone();
            t.prepare(&mut m, &mut d, &corpus);
            t.run(&(), &d)
                .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&d)));
        }
        assert_eq!(t.by_kind.len(), Kind::ALL.len());
        assert!(t.outcomes.len() > 60, "{}", t.outcomes.len());
    }
}

//! The `.endpoint_map` file (DeepRec convention).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::cluster::ClusterSpec;
use crate::error::{ConfigError, EndpointMapLineError};
use crate::hostport::HostPort;

/// The endpoint map's file name.
pub const ENDPOINT_MAP_FILE: &str = ".endpoint_map";

/// The largest endpoint map read, in bytes: a line per task is some 50
/// bytes, so this is tens of thousands of tasks. A larger file (or a
/// device such as `/dev/zero`) is refused rather than read whole.
pub const MAX_ENDPOINT_MAP_BYTES: u64 = 1 << 20;

/// Environment variable naming the directory holding [`ENDPOINT_MAP_FILE`].
pub const TF_SEASTAR_ENDPOINT_MAP_PATH: &str = "TF_SEASTAR_ENDPOINT_MAP_PATH";

/// One mapping of an endpoint map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointMapEntry {
    /// The gRPC endpoint, as in the cluster spec (the key).
    pub grpc: HostPort,
    /// The fast endpoint to connect to instead.
    pub fast: HostPort,
    /// 1-based line in the file.
    pub line: usize,
}

/// A parsed `.endpoint_map` (DeepRec convention), keeping file order: which
/// fast-transport endpoint serves each gRPC endpoint of the cluster spec.
///
/// ```text
/// # grpc endpoint   = fast endpoint
/// ps0.example:2222=ps0.example:3333
/// worker0.example:2222=worker0.example:3333   # trailing comment
/// [fd00::7]:2222=[fd00::7]:3333
/// ```
///
/// One `grpc_host:port=fast_host:port` per line. Unlike DeepRec, blank
/// lines and `#` comments are allowed: a line whose first non-blank
/// character is `#`, and a `#` preceded by a space or tab ends the line.
/// Whitespace around either endpoint is ignored, and `\r\n` line ends are
/// accepted.
///
/// The file is `.endpoint_map` in the directory named by
/// `$TF_SEASTAR_ENDPOINT_MAP_PATH`, or in the working directory if that is
/// unset or empty. A missing file means "no map": the cluster spec's
/// endpoints are used as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointMap {
    path: PathBuf,
    entries: Vec<EndpointMapEntry>,
    index: HashMap<HostPort, usize>,
}

impl EndpointMap {
    /// Parses the text of an endpoint map. `path` is used only in error
    /// messages and by [`path`](Self::path).
    pub fn parse(path: impl Into<PathBuf>, text: &str) -> Result<Self, ConfigError> {
        let mut map = EndpointMap {
            path: path.into(),
            entries: Vec::new(),
            index: HashMap::new(),
        };
        for (i, line) in text.split('\n').enumerate() {
            map.add_line(i + 1, line)?;
        }
        Ok(map)
    }

    /// Like [`parse`](Self::parse), for raw file contents: a line that is
    /// not UTF-8 is an error naming that line.
    pub fn parse_bytes(path: impl Into<PathBuf>, bytes: &[u8]) -> Result<Self, ConfigError> {
        let mut map = EndpointMap {
            path: path.into(),
            entries: Vec::new(),
            index: HashMap::new(),
        };
        for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
            match std::str::from_utf8(line) {
                Ok(line) => map.add_line(i + 1, line)?,
                Err(_) => return Err(map.line_error(i + 1, EndpointMapLineError::InvalidUtf8)),
            }
        }
        Ok(map)
    }

    fn line_error(&self, line: usize, reason: EndpointMapLineError) -> ConfigError {
        ConfigError::EndpointMapLine {
            path: self.path.clone(),
            line,
            reason,
        }
    }

    fn add_line(&mut self, line_no: usize, line: &str) -> Result<(), ConfigError> {
        let content = strip_comment(line).trim();
        if content.is_empty() {
            return Ok(());
        }
        let (key, value) = content
            .split_once('=')
            .ok_or_else(|| self.line_error(line_no, EndpointMapLineError::MissingEquals))?;
        if value.contains('=') {
            return Err(self.line_error(line_no, EndpointMapLineError::ExtraEquals));
        }
        let grpc = HostPort::parse(key).map_err(|error| {
            self.line_error(
                line_no,
                EndpointMapLineError::BadKey {
                    text: key.trim().to_owned(),
                    error,
                },
            )
        })?;
        let fast = HostPort::parse(value).map_err(|error| {
            self.line_error(
                line_no,
                EndpointMapLineError::BadValue {
                    text: value.trim().to_owned(),
                    error,
                },
            )
        })?;
        if let Some(&first) = self.index.get(&grpc) {
            let first_line = self.entries[first].line;
            return Err(self.line_error(
                line_no,
                EndpointMapLineError::DuplicateKey {
                    key: grpc,
                    first_line,
                },
            ));
        }
        self.index.insert(grpc.clone(), self.entries.len());
        self.entries.push(EndpointMapEntry {
            grpc,
            fast,
            line: line_no,
        });
        Ok(())
    }

    /// Loads `.endpoint_map` from `dir`, or from the working directory if
    /// `dir` is `None`. A missing file gives `Ok(None)`; anything there
    /// that is not a regular file (a directory, a FIFO, a device) is
    /// [`ConfigError::EndpointMapNotAFile`], and a file of more than
    /// [`MAX_ENDPOINT_MAP_BYTES`] is [`ConfigError::EndpointMapTooLarge`].
    pub fn load(dir: Option<&Path>) -> Result<Option<Self>, ConfigError> {
        let path = match dir {
            Some(d) => d.join(ENDPOINT_MAP_FILE),
            None => std::env::current_dir()
                .unwrap_or_else(|_| PathBuf::from("."))
                .join(ENDPOINT_MAP_FILE),
        };
        match read_bounded(&path) {
            Ok(bytes) => Self::parse_bytes(path, &bytes).map(Some),
            Err(Unread::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::debug!(path = %path.display(), "no endpoint map");
                Ok(None)
            }
            Err(Unread::Io(source)) => Err(ConfigError::EndpointMapIo { path, source }),
            Err(Unread::NotAFile) => Err(ConfigError::EndpointMapNotAFile { path }),
            Err(Unread::TooLarge) => Err(ConfigError::EndpointMapTooLarge {
                path,
                limit: MAX_ENDPOINT_MAP_BYTES,
            }),
        }
    }

    /// [`load`](Self::load) from the directory named by
    /// `$TF_SEASTAR_ENDPOINT_MAP_PATH` as read through `env` (unset or empty:
    /// the working directory).
    pub fn load_from_env(
        env: &impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, ConfigError> {
        let dir = env(TF_SEASTAR_ENDPOINT_MAP_PATH).filter(|d| !d.trim().is_empty());
        Self::load(dir.as_deref().map(Path::new))
    }

    /// [`load_from_env`](Self::load_from_env) with the process environment.
    pub fn from_process_env() -> Result<Option<Self>, ConfigError> {
        Self::load_from_env(&crate::process_env)
    }

    /// The file this map came from (as given).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fast endpoint for a gRPC endpoint.
    pub fn lookup(&self, grpc: &HostPort) -> Option<&HostPort> {
        self.index.get(grpc).map(|&i| &self.entries[i].fast)
    }

    /// `(grpc, fast)` pairs in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&HostPort, &HostPort)> + '_ {
        self.entries.iter().map(|e| (&e.grpc, &e.fast))
    }

    /// The entries in file order, with their line numbers.
    pub fn entries(&self) -> &[EndpointMapEntry] {
        &self.entries
    }

    /// Number of mappings.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map has no mappings.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The cluster spec with every endpoint replaced by its fast endpoint:
    /// the addresses to connect to.
    ///
    /// A present map must cover every task (as in DeepRec, where a missing
    /// entry is fatal): an unmapped endpoint is
    /// [`ConfigError::EndpointNotMapped`], and two tasks mapped to one
    /// fast endpoint is [`ConfigError::DuplicateFastEndpoint`]. Entries for
    /// endpoints not in the spec are ignored.
    pub fn apply(&self, spec: &ClusterSpec) -> Result<ClusterSpec, ConfigError> {
        let (ps, workers) = spec.map_endpoints(|task, hp| {
            self.lookup(hp)
                .cloned()
                .ok_or_else(|| ConfigError::EndpointNotMapped {
                    path: self.path.clone(),
                    endpoint: hp.clone(),
                    task,
                })
        })?;
        ClusterSpec::new(ps, workers).map_err(|e| match e {
            ConfigError::DuplicateEndpoint {
                endpoint,
                first,
                second,
            } => ConfigError::DuplicateFastEndpoint {
                path: self.path.clone(),
                endpoint,
                first,
                second,
            },
            other => other,
        })
    }
}

impl<'a> IntoIterator for &'a EndpointMap {
    type Item = (&'a HostPort, &'a HostPort);
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// Removes a full-line comment or a trailing `#` comment that follows a
/// space or tab.
/// Why [`read_bounded`] read nothing.
enum Unread {
    Io(std::io::Error),
    NotAFile,
    TooLarge,
}

/// The contents of the regular file at `path`, if at most
/// [`MAX_ENDPOINT_MAP_BYTES`]. What is not a regular file is refused
/// before it is opened (opening a FIFO would wait for a writer), and again
/// once open (it may have been replaced in between); at most one byte past
/// the limit is read (a file may grow, a device never ends).
fn read_bounded(path: &Path) -> Result<Vec<u8>, Unread> {
    use std::io::Read;
    let regular = |m: std::fs::Metadata| {
        if !m.is_file() {
            Err(Unread::NotAFile)
        } else if m.len() > MAX_ENDPOINT_MAP_BYTES {
            Err(Unread::TooLarge)
        } else {
            Ok(())
        }
    };
    regular(std::fs::metadata(path).map_err(Unread::Io)?)?;
    let file = std::fs::File::open(path).map_err(Unread::Io)?;
    regular(file.metadata().map_err(Unread::Io)?)?;
    let mut bytes = Vec::new();
    file.take(MAX_ENDPOINT_MAP_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(Unread::Io)?;
    if bytes.len() as u64 > MAX_ENDPOINT_MAP_BYTES {
        return Err(Unread::TooLarge);
    }
    Ok(bytes)
}

fn strip_comment(line: &str) -> &str {
    if line.trim_start().starts_with('#') {
        return "";
    }
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'#' && i > 0 && matches!(bytes[i - 1], b' ' | b'\t') {
            return &line[..i];
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::TaskId;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn hp(s: &str) -> HostPort {
        HostPort::parse(s).unwrap()
    }

    fn line_err(text: &str) -> (usize, EndpointMapLineError, String) {
        match EndpointMap::parse("/etc/x/.endpoint_map", text) {
            Err(e @ ConfigError::EndpointMapLine { .. }) => {
                let msg = e.to_string();
                let ConfigError::EndpointMapLine { path, line, reason } = e else {
                    unreachable!()
                };
                assert_eq!(path, Path::new("/etc/x/.endpoint_map"));
                (line, reason, msg)
            }
            other => panic!("expected a line error for {text:?}, got {other:?}"),
        }
    }

    #[test]
    fn parses_with_comments_blank_lines_and_crlf() {
        let text = "# header\n\
                    \n\
                    a:1=a:2\n   \t\n\
                    b:1 = b:2   # trailing comment\r\n\
                    \t# indented comment\n\
                    [::1]:1=[::1]:2\t#tab comment\n\
                    c:1=c:2";
        let m = EndpointMap::parse("m", text).unwrap();
        assert_eq!(m.len(), 4);
        let pairs: Vec<_> = m
            .iter()
            .map(|(g, f)| (g.to_string(), f.to_string()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("a:1", "a:2"),
                ("b:1", "b:2"),
                ("[::1]:1", "[::1]:2"),
                ("c:1", "c:2")
            ]
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
        );
        let lines: Vec<_> = m.entries().iter().map(|e| e.line).collect();
        assert_eq!(lines, [3, 5, 7, 8]);
        assert_eq!(m.lookup(&hp("B:1")), Some(&hp("b:2")));
        assert_eq!(m.lookup(&hp("z:1")), None);
        assert_eq!((&m).into_iter().count(), 4);
        assert!(EndpointMap::parse("m", "").unwrap().is_empty());
        assert!(EndpointMap::parse("m", "\n# only\n").unwrap().is_empty());
    }

    #[test]
    fn hash_without_preceding_space_is_not_a_comment() {
        let (line, reason, _) = line_err("a:1=a:2#x");
        assert_eq!(line, 1);
        assert!(matches!(
            reason,
            EndpointMapLineError::BadValue {
                error: crate::HostPortError::BadPort(_),
                ..
            }
        ));
    }

    #[test]
    fn errors_name_file_line_and_problem() {
        let (line, reason, msg) = line_err("a:1=a:2\n\nnot a mapping\n");
        assert_eq!(line, 3);
        assert_eq!(reason, EndpointMapLineError::MissingEquals);
        assert!(
            msg.starts_with("/etc/x/.endpoint_map:3: missing '='"),
            "{msg}"
        );

        let (line, reason, msg) = line_err("# c\na:1=a:x");
        assert_eq!(line, 2);
        assert!(matches!(
            reason,
            EndpointMapLineError::BadValue {
                error: crate::HostPortError::BadPort(_),
                ..
            }
        ));
        assert!(msg.contains("bad port"), "{msg}");

        let (line, reason, _) = line_err("a:99999=a:1");
        assert_eq!(line, 1);
        assert!(matches!(reason, EndpointMapLineError::BadKey { .. }));

        let (line, reason, msg) = line_err("a:1=a:2\n:1=b:2");
        assert_eq!(line, 2);
        assert!(matches!(
            reason,
            EndpointMapLineError::BadKey {
                error: crate::HostPortError::EmptyHost,
                ..
            }
        ));
        assert!(msg.contains("empty host"), "{msg}");

        let (_, reason, _) = line_err("a:1=:2");
        assert!(matches!(
            reason,
            EndpointMapLineError::BadValue {
                error: crate::HostPortError::EmptyHost,
                ..
            }
        ));

        let (line, reason, msg) = line_err("a:1=a:2\nb:1=b:2\nA:1=c:2");
        assert_eq!(line, 3);
        assert_eq!(
            reason,
            EndpointMapLineError::DuplicateKey {
                key: hp("a:1"),
                first_line: 1
            }
        );
        assert!(
            msg.contains("duplicate key a:1: already mapped on line 1"),
            "{msg}"
        );

        let (_, reason, _) = line_err("a:1=b:1=c:1");
        assert_eq!(reason, EndpointMapLineError::ExtraEquals);
        let (_, reason, _) = line_err("a:1=");
        assert!(matches!(reason, EndpointMapLineError::BadValue { .. }));
    }

    #[test]
    fn invalid_utf8_names_the_line() {
        let err = EndpointMap::parse_bytes("f", b"a:1=a:2\nb:1=\xff:2\n").unwrap_err();
        assert!(matches!(
            err,
            ConfigError::EndpointMapLine {
                line: 2,
                reason: EndpointMapLineError::InvalidUtf8,
                ..
            }
        ));
    }

    #[test]
    fn load_from_env_dir_and_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        let env = |k: &str| (k == TF_SEASTAR_ENDPOINT_MAP_PATH).then(|| d.clone());

        // Absent file: no map, not an error.
        assert_eq!(EndpointMap::load_from_env(&env).unwrap(), None);

        let file = dir.path().join(ENDPOINT_MAP_FILE);
        std::fs::write(&file, "# map\nw:1=w:2\np:1=p:2\n").unwrap();
        let m = EndpointMap::load_from_env(&env).unwrap().unwrap();
        assert_eq!(m.path(), file);
        assert_eq!(m.lookup(&hp("p:1")), Some(&hp("p:2")));
        assert_eq!(EndpointMap::load(Some(dir.path())).unwrap(), Some(m));

        std::fs::write(&file, "w:1=w:2\nbroken\n").unwrap();
        let err = EndpointMap::load_from_env(&env).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}:2: missing '=': expected grpc_host:port=fast_host:port",
                file.display()
            )
        );

        // A directory where the file should be is an error, not "absent".
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        assert!(matches!(
            EndpointMap::load_from_env(&env),
            Err(ConfigError::EndpointMapNotAFile { .. })
        ));
    }

    #[test]
    fn a_map_past_the_limit_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(ENDPOINT_MAP_FILE);
        // At the limit: read (a comment, then one entry).
        let entry = "w:1=w:2\n";
        let mut text = "#".repeat(MAX_ENDPOINT_MAP_BYTES as usize - entry.len() - 1);
        text.push('\n');
        text.push_str(entry);
        std::fs::write(&file, &text).unwrap();
        let m = EndpointMap::load(Some(dir.path())).unwrap().unwrap();
        assert_eq!(m.len(), 1);
        // One byte more: refused, naming the file and the limit.
        text.push('\n');
        std::fs::write(&file, &text).unwrap();
        let e = EndpointMap::load(Some(dir.path())).unwrap_err();
        assert!(
            matches!(&e, ConfigError::EndpointMapTooLarge { path, limit }
                if *path == file && *limit == MAX_ENDPOINT_MAP_BYTES),
            "{e:?}"
        );
        assert!(e.to_string().contains("1048576 bytes"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_or_fifo_is_refused_without_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(ENDPOINT_MAP_FILE);
        // An endless device: before the fix, read until memory ran out.
        std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        let e = EndpointMap::load(Some(dir.path())).unwrap_err();
        assert!(
            matches!(&e, ConfigError::EndpointMapNotAFile { path } if *path == file),
            "{e:?}"
        );
        assert!(e.to_string().contains("not a regular file"), "{e}");
        // A FIFO with no writer: opening it would wait forever.
        std::fs::remove_file(&file).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&file)
            .status()
            .is_ok_and(|s| s.success());
        if made {
            assert!(matches!(
                EndpointMap::load(Some(dir.path())),
                Err(ConfigError::EndpointMapNotAFile { .. })
            ));
        }
    }

    #[test]
    fn empty_env_dir_means_working_directory() {
        // The working directory of the test process is the crate directory,
        // which has no `.endpoint_map`.
        let env = |_: &str| Some("  ".to_owned());
        assert_eq!(EndpointMap::load_from_env(&env).unwrap(), None);
        let env = |_: &str| None;
        assert_eq!(EndpointMap::load_from_env(&env).unwrap(), None);
    }

    #[test]
    fn apply_maps_every_task() {
        let spec = ClusterSpec::new(vec![hp("p:1")], vec![hp("w0:1"), hp("w1:1")]).unwrap();
        let m = EndpointMap::parse("m", "w1:1=w1:9\np:1=p:9\nw0:1=w0:9\nextra:1=x:9").unwrap();
        let fast = m.apply(&spec).unwrap();
        assert_eq!(fast.ps(), [hp("p:9")]);
        assert_eq!(fast.workers(), [hp("w0:9"), hp("w1:9")]);

        let partial = EndpointMap::parse("m", "p:1=p:9\nw0:1=w0:9").unwrap();
        assert!(matches!(
            partial.apply(&spec),
            Err(ConfigError::EndpointNotMapped { task, .. }) if task == TaskId::worker(1)
        ));

        let clash = EndpointMap::parse("m", "p:1=p:9\nw0:1=x:9\nw1:1=x:9").unwrap();
        assert!(matches!(
            clash.apply(&spec),
            Err(ConfigError::DuplicateFastEndpoint { first, second, .. })
                if first == TaskId::worker(0) && second == TaskId::worker(1)
        ));
    }

    /// Arbitrary input never panics, and what parses is self-consistent.
    #[test]
    fn random_input_never_panics() {
        let mut rng = SmallRng::seed_from_u64(0x5ea_57a2);
        // Bytes biased towards the map's syntax so that deep paths are hit.
        const ALPHABET: &[u8] = b"ab.:=#[]%09 \t\r\n-_fe80:1:\xff\xc3";
        let mut parsed = 0;
        for _ in 0..20_000 {
            let len = rng.gen_range(0..64);
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    if rng.gen_bool(0.8) {
                        ALPHABET[rng.gen_range(0..ALPHABET.len())]
                    } else {
                        rng.gen()
                    }
                })
                .collect();
            if let Ok(m) = EndpointMap::parse_bytes("fuzz", &bytes) {
                parsed += 1;
                for e in m.entries() {
                    assert_eq!(m.lookup(&e.grpc), Some(&e.fast));
                }
            }
            let text = String::from_utf8_lossy(&bytes);
            let _ = EndpointMap::parse("fuzz", &text);
        }
        // The parser does accept well-formed lines; the loop above is not vacuous.
        assert!(EndpointMap::parse("fuzz", "a:1=b:2 # x").is_ok());
        assert!(parsed > 0);
    }
}

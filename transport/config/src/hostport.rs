//! `host:port` endpoints.

use std::fmt;
use std::net::Ipv6Addr;
use std::str::FromStr;

/// A network endpoint written as `host:port`, or `[ipv6]:port` for IPv6.
///
/// Parsing normalizes the host so that equal endpoints compare equal:
/// host names and IPv4 addresses are lower-cased, IPv6 addresses are
/// written in their canonical form (`[0:0::1]` becomes `[::1]`), and an
/// optional IPv6 zone (`[fe80::1%eth0]`) is kept as written.
///
/// ```
/// use starwire_config::HostPort;
/// let hp: HostPort = "[::1]:2222".parse().unwrap();
/// assert_eq!(hp.host(), "::1");
/// assert_eq!(hp.port(), 2222);
/// assert_eq!(hp.to_string(), "[::1]:2222");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPort {
    host: String,
    port: u16,
}

/// Why a string is not a valid `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostPortError {
    /// The string is empty (or only whitespace).
    #[error("empty endpoint")]
    Empty,
    /// There is no `:port` part.
    #[error("missing ':port'")]
    MissingPort,
    /// The host part is empty.
    #[error("empty host")]
    EmptyHost,
    /// The port is not an integer in 1..=65535.
    #[error("bad port {0:?}: expected an integer in 1..=65535")]
    BadPort(String),
    /// An IPv6 address was written without brackets.
    #[error("IPv6 addresses must be written in brackets, e.g. [::1]:2222")]
    UnbracketedIpv6,
    /// A bracketed host is not a valid IPv6 address.
    #[error("bad IPv6 address {0:?}")]
    BadIpv6(String),
    /// The host contains a character not allowed in a host name.
    #[error("bad character {0:?} in host")]
    BadHostChar(char),
}

impl HostPort {
    /// Parses `host:port` or `[ipv6]:port`. Surrounding whitespace is
    /// ignored.
    pub fn parse(s: &str) -> Result<Self, HostPortError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(HostPortError::Empty);
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let Some((inner, after)) = rest.split_once(']') else {
                return Err(HostPortError::BadIpv6(rest.to_owned()));
            };
            let Some(port) = after.strip_prefix(':') else {
                return Err(if after.is_empty() {
                    HostPortError::MissingPort
                } else {
                    HostPortError::BadIpv6(format!("[{inner}]{after}"))
                });
            };
            (normalize_ipv6(inner)?, port)
        } else {
            let Some((host, port)) = s.rsplit_once(':') else {
                return Err(HostPortError::MissingPort);
            };
            if host.contains(':') {
                return Err(HostPortError::UnbracketedIpv6);
            }
            if host.is_empty() {
                return Err(HostPortError::EmptyHost);
            }
            if let Some(c) = host
                .chars()
                .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
            {
                return Err(HostPortError::BadHostChar(c));
            }
            (host.to_ascii_lowercase(), port)
        };
        let port = parse_port(port)?;
        Ok(HostPort { host, port })
    }

    /// The host: a name, an IPv4 address, or an IPv6 address without
    /// brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port (never 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the host is an IPv6 address (displayed in brackets).
    pub fn is_ipv6(&self) -> bool {
        self.host.contains(':')
    }
}

fn parse_port(port: &str) -> Result<u16, HostPortError> {
    // `u16::from_str` accepts a leading '+'; a port is digits only.
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HostPortError::BadPort(port.to_owned()));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(HostPortError::BadPort(port.to_owned())),
    }
}

fn normalize_ipv6(inner: &str) -> Result<String, HostPortError> {
    if inner.is_empty() {
        return Err(HostPortError::EmptyHost);
    }
    let (addr, zone) = match inner.split_once('%') {
        Some((a, z)) => (a, Some(z)),
        None => (inner, None),
    };
    let addr: Ipv6Addr = addr
        .parse()
        .map_err(|_| HostPortError::BadIpv6(inner.to_owned()))?;
    match zone {
        None => Ok(addr.to_string()),
        Some(z)
            if !z.is_empty()
                && z.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')) =>
        {
            Ok(format!("{addr}%{z}"))
        }
        Some(_) => Err(HostPortError::BadIpv6(inner.to_owned())),
    }
}

impl FromStr for HostPort {
    type Err = HostPortError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HostPort::parse(s)
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ipv6() {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(s: &str) -> HostPort {
        HostPort::parse(s).unwrap()
    }

    #[test]
    fn parses_names_ipv4_ipv6() {
        assert_eq!(hp("ps0.example:2222").host(), "ps0.example");
        assert_eq!(hp("ps0.example:2222").port(), 2222);
        assert_eq!(hp(" 10.0.0.1:80 ").to_string(), "10.0.0.1:80");
        assert_eq!(hp("[::1]:2222").to_string(), "[::1]:2222");
        assert_eq!(hp("[fe80::1%eth0]:1").host(), "fe80::1%eth0");
        assert!(hp("[::1]:1").is_ipv6());
        assert!(!hp("a:1").is_ipv6());
    }

    #[test]
    fn normalizes_for_equality() {
        assert_eq!(hp("PS0.Example:1"), hp("ps0.example:1"));
        assert_eq!(hp("[0:0::1]:1"), hp("[::1]:1"));
        assert_ne!(hp("a:1"), hp("a:2"));
    }

    #[test]
    fn rejects_bad_endpoints() {
        use HostPortError::*;
        let cases: &[(&str, HostPortError)] = &[
            ("", Empty),
            ("   ", Empty),
            ("host", MissingPort),
            (":80", EmptyHost),
            ("h:", BadPort(String::new())),
            ("h:0", BadPort("0".into())),
            ("h:65536", BadPort("65536".into())),
            ("h:+80", BadPort("+80".into())),
            ("h:8x", BadPort("8x".into())),
            ("::1:80", UnbracketedIpv6),
            ("[::1]", MissingPort),
            ("[]:1", EmptyHost),
            ("[zz]:1", BadIpv6("zz".into())),
            ("[::1:1", BadIpv6("::1:1".into())),
            ("[::1]x:1", BadIpv6("[::1]x:1".into())),
            ("[::1%]:1", BadIpv6("::1%".into())),
            ("a b:1", BadHostChar(' ')),
            ("a/b:1", BadHostChar('/')),
        ];
        for (input, want) in cases {
            assert_eq!(
                HostPort::parse(input).as_ref(),
                Err(want),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn display_roundtrips() {
        for s in ["a:1", "10.1.2.3:65535", "[::1]:9", "[fe80::1%eth0]:7"] {
            assert_eq!(hp(s).to_string(), s);
            assert_eq!(hp(&hp(s).to_string()), hp(s));
        }
    }
}

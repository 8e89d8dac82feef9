//! Backend names accepted on the command line, and the hint printed for a
//! backend that is not compiled into this binary.

use std::fmt;
use std::str::FromStr;

/// A backend `starwire bench` can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The baseline: plain non-blocking TCP sockets, no starwire code.
    Raw,
    /// starwire sessions over the TCP backend (`starwire-tcp`).
    Tcp,
    /// starwire sessions over the io_uring backend (`starwire-uring`).
    #[cfg(all(feature = "uring", target_os = "linux"))]
    Uring,
    /// The gRPC baseline (`starwire-grpc`): tonic, one HTTP/2 connection.
    #[cfg(feature = "grpc")]
    Grpc,
    /// starwire sessions over DPDK (`starwire-dpdk`): the reliable-datagram
    /// driver over a DPDK port.
    #[cfg(feature = "dpdk")]
    Dpdk,
    /// starwire sessions over RDMA verbs (`starwire-verbs`): needs a
    /// device.
    #[cfg(all(feature = "verbs", target_os = "linux"))]
    Verbs,
}

impl Backend {
    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Raw => "raw",
            Backend::Tcp => "tcp",
            #[cfg(all(feature = "uring", target_os = "linux"))]
            Backend::Uring => "uring",
            #[cfg(feature = "grpc")]
            Backend::Grpc => "grpc",
            #[cfg(feature = "dpdk")]
            Backend::Dpdk => "dpdk",
            #[cfg(all(feature = "verbs", target_os = "linux"))]
            Backend::Verbs => "verbs",
        }
    }

    /// Whether `starwire train` and the report's training section run
    /// over it.
    pub fn trains(self) -> bool {
        match self {
            Backend::Raw => false,
            #[cfg(feature = "dpdk")]
            Backend::Dpdk => false,
            _ => true,
        }
    }

    /// Whether the run's data connections are TCP streams (all but dpdk,
    /// whose data goes through the DPDK port; its TCP connection only
    /// bootstraps).
    pub fn data_over_tcp(self) -> bool {
        match self {
            #[cfg(feature = "dpdk")]
            Backend::Dpdk => false,
            _ => true,
        }
    }

    /// Whether a bench server pins its end of a run to the server core:
    /// all but the grpc baseline, whose tokio runtimes float (as in stock
    /// gRPC).
    pub fn server_pinned(self) -> bool {
        match self {
            #[cfg(feature = "grpc")]
            Backend::Grpc => false,
            _ => true,
        }
    }

    /// Whether a bench run may use several data connections
    /// (`--connections`): the starwire backends; the baselines use one.
    pub fn multi_connection(self) -> bool {
        match self {
            Backend::Tcp => true,
            #[cfg(all(feature = "uring", target_os = "linux"))]
            Backend::Uring => true,
            #[cfg(feature = "dpdk")]
            Backend::Dpdk => true,
            #[cfg(all(feature = "verbs", target_os = "linux"))]
            Backend::Verbs => true,
            _ => false,
        }
    }

    /// Whether the backend runs only where an RDMA device is (left out of
    /// `starwire report`'s default suite).
    pub fn needs_device(self) -> bool {
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        if self == Backend::Verbs {
            return true;
        }
        false
    }

    /// Check at run time that the backend can work on this machine: io_uring
    /// may be compiled in but disabled (old kernel, `io_uring_disabled`,
    /// seccomp in a container).
    pub fn check_available(self) -> Result<(), String> {
        match self {
            #[cfg(all(feature = "uring", target_os = "linux"))]
            Backend::Uring => {
                let why = match starwire_uring::probe() {
                    Ok(f) => f.unusable(),
                    Err(e) => Some(e.to_string()),
                };
                match why {
                    Some(why) => Err(format!("io_uring unavailable: {why}; use the tcp backend")),
                    None => Ok(()),
                }
            }
            #[cfg(all(feature = "verbs", target_os = "linux"))]
            Backend::Verbs => crate::rdma::verbs::open_client().map(drop),
            _ => Ok(()),
        }
    }

    /// Every backend compiled into this binary, baseline first.
    pub fn compiled() -> Vec<Backend> {
        #[allow(unused_mut)]
        let mut v = vec![Backend::Raw, Backend::Tcp];
        #[cfg(all(feature = "uring", target_os = "linux"))]
        v.push(Backend::Uring);
        #[cfg(feature = "grpc")]
        v.push(Backend::Grpc);
        #[cfg(feature = "dpdk")]
        v.push(Backend::Dpdk);
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        v.push(Backend::Verbs);
        v
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Backends known to starwire but not compiled into this binary, with what
/// the user has to do to get them.
pub fn missing_backend_hint(name: &str) -> Option<String> {
    let hint = match name {
        #[cfg(not(all(feature = "uring", target_os = "linux")))]
        "uring" | "io_uring" | "io-uring" => {
            "the uring backend is not compiled in; rebuild with \
             `cargo build --release --features uring` (needs Linux >= 5.19 with \
             io_uring enabled), or use the tcp backend"
        }
        #[cfg(not(all(feature = "verbs", target_os = "linux")))]
        "verbs" | "rdma" | "ibverbs" => {
            "the verbs backend is not compiled in; rebuild with \
             `cargo build --release --features verbs` (needs libibverbs-dev, \
             librdmacm-dev and libclang-dev, and an RDMA device: \
             docs/backends/rdma.md), or use the tcp backend"
        }
        #[cfg(all(feature = "verbs", target_os = "linux"))]
        "rdma" | "ibverbs" => "the verbs backend is called verbs",
        #[cfg(not(feature = "dpdk"))]
        "dpdk" => {
            "the dpdk backend is not compiled in; rebuild with \
             `cargo build --release --features dpdk` (needs DPDK 22.11: \
             libdpdk-dev, pkg-config, libclang-dev), or use the tcp backend"
        }
        #[cfg(not(feature = "grpc"))]
        "grpc" => {
            "the grpc backend is not compiled in; rebuild with \
             `cargo build --release --features grpc` (needs protobuf-compiler), \
             or use the tcp backend"
        }
        _ => return None,
    };
    Some(hint.to_owned())
}

/// The starwire backends of this binary, for messages.
pub fn compiled_in() -> String {
    Backend::compiled()
        .iter()
        .filter(|b| **b != Backend::Raw)
        .map(|b| b.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "raw" => Ok(Backend::Raw),
            "tcp" => Ok(Backend::Tcp),
            #[cfg(all(feature = "uring", target_os = "linux"))]
            "uring" | "io_uring" | "io-uring" => Ok(Backend::Uring),
            #[cfg(feature = "grpc")]
            "grpc" => Ok(Backend::Grpc),
            #[cfg(feature = "dpdk")]
            "dpdk" => Ok(Backend::Dpdk),
            #[cfg(all(feature = "verbs", target_os = "linux"))]
            "verbs" | "rdma" | "ibverbs" => Ok(Backend::Verbs),
            other => Err(missing_backend_hint(other).unwrap_or_else(|| {
                let names: Vec<&str> = Backend::compiled().iter().map(|b| b.name()).collect();
                format!(
                    "unknown backend {other:?}; compiled in: {}",
                    names.join(", ")
                )
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_compiled_backends_and_hints_the_rest() {
        assert_eq!("raw".parse::<Backend>(), Ok(Backend::Raw));
        assert_eq!(" TCP ".parse::<Backend>(), Ok(Backend::Tcp));
        #[cfg(all(feature = "uring", target_os = "linux"))]
        assert_eq!("io_uring".parse::<Backend>(), Ok(Backend::Uring));
        #[cfg(not(all(feature = "uring", target_os = "linux")))]
        {
            let e = "uring".parse::<Backend>().unwrap_err();
            assert!(e.contains("--features uring"), "{e}");
        }
        #[cfg(feature = "verbs")]
        assert_eq!("rdma".parse::<Backend>(), Ok(Backend::Verbs));
        #[cfg(not(feature = "verbs"))]
        {
            let e = "verbs".parse::<Backend>().unwrap_err();
            assert!(e.contains("--features verbs"), "{e}");
        }
        #[cfg(feature = "grpc")]
        assert_eq!("grpc".parse::<Backend>(), Ok(Backend::Grpc));
        #[cfg(not(feature = "grpc"))]
        assert!("grpc"
            .parse::<Backend>()
            .unwrap_err()
            .contains("--features grpc"));
        #[cfg(not(feature = "dpdk"))]
        {
            let e = missing_backend_hint("dpdk").unwrap();
            assert!(e.ends_with("or use the tcp backend"), "{e}");
        }
        #[cfg(feature = "dpdk")]
        assert_eq!(missing_backend_hint("dpdk"), None);
        let e = "carrier-pigeon".parse::<Backend>().unwrap_err();
        assert!(e.contains("unknown backend"), "{e}");
    }
}

//! `--metrics-addr HOST:PORT`: Prometheus metrics over HTTP while a
//! command runs.
//!
//! `GET /metrics` answers with every family of the run's [`Telemetry`]
//! (the cells the PS shards, workers and reactors update with relaxed
//! atomics), the `process_*` families read from `/proc` and, with the
//! `dpdk` feature, the open port's `starwire_dpdk_port_*` families read
//! from DPDK, encoded by
//! prometheus-client in the Prometheus text format. `GET /healthz` answers
//! `ok`. A small bounded HTTP/1.1 server ([`http`]) serves both from one
//! thread of its own: at most 4 connections at once, a request head of at
//! most 8 KiB due within 5 s, one request per connection. A scrape reads
//! the cells and never stops the threads that write them.

#[cfg(feature = "dpdk")]
mod dpdk;
mod http;
mod process;
mod soak;

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};

use clap::Args;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use starwire_telemetry::{Kind, Telemetry, Value};

pub use process::ProcessCollector;
pub use soak::{SoakCells, SoakCounts};

/// The metrics flag of `train`, `ps`, `worker`, `soak` and `bench --listen`.
#[derive(Debug, Clone, Default, Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (and
    /// /healthz) while the command runs; port 0 takes a free port (the
    /// address is logged).
    #[arg(long, value_name = "HOST:PORT", value_parser = crate::failure::host_port)]
    pub metrics_addr: Option<String>,
}

impl MetricsArgs {
    /// Start the endpoint if `--metrics-addr` was given; it serves until
    /// the returned server is dropped.
    pub fn serve(&self, telemetry: &Telemetry) -> Result<Option<MetricsServer>, String> {
        self.metrics_addr
            .as_deref()
            .map(|a| MetricsServer::start(a, telemetry.clone()))
            .transpose()
    }
}

/// The run's cells as prometheus-client families.
#[derive(Debug)]
struct TelemetryCollector(Telemetry);

impl Collector for TelemetryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for f in self.0.families() {
            let kind = match f.kind {
                Kind::Counter => MetricType::Counter,
                Kind::Gauge => MetricType::Gauge,
                Kind::Histogram => MetricType::Histogram,
            };
            // Counters are registered without `_total`; the encoder adds it.
            let mut family = encoder.encode_descriptor(f.name, f.help, None, kind)?;
            for (labels, value) in &f.samples {
                if labels.is_empty() {
                    encode_value(&mut family, value)?;
                } else {
                    encode_value(&mut family.encode_family(labels)?, value)?;
                }
            }
        }
        Ok(())
    }
}

/// `starwire_build_info{version, commit} 1`.
#[derive(Debug)]
struct BuildInfo;

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut e = encoder.encode_descriptor(
            "starwire_build_info",
            "The starwire version and the git commit it was built from",
            None,
            MetricType::Gauge,
        )?;
        let labels = [
            ("version", env!("CARGO_PKG_VERSION")),
            ("commit", env!("STARWIRE_GIT_COMMIT")),
        ];
        e.encode_family(&labels)?.encode_gauge(&1i64)
    }
}

fn encode_value(
    e: &mut prometheus_client::encoding::MetricEncoder<'_>,
    v: &Value,
) -> Result<(), std::fmt::Error> {
    match v {
        Value::Counter(n) => e.encode_counter::<NoLabelSet, _, u64>(n, None),
        Value::Gauge(g) => e.encode_gauge(g),
        Value::Histogram(h) => {
            let buckets: Vec<(f64, u64)> = h.buckets().collect();
            e.encode_histogram::<NoLabelSet>(h.sum_seconds(), h.count(), &buckets, None)
        }
    }
}

/// The exposition: the run's families and the process's, as Prometheus
/// text.
pub fn render(telemetry: &Telemetry) -> Result<String, String> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(TelemetryCollector(telemetry.clone())));
    registry.register_collector(Box::new(BuildInfo));
    registry.register_collector(Box::new(ProcessCollector));
    #[cfg(feature = "dpdk")]
    registry.register_collector(Box::new(dpdk::DpdkPortCollector));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        .map_err(|e| format!("encoding metrics: {e}"))?;
    Ok(out)
}

/// What the endpoint answers to `method` on `target` (the path, with
/// any query).
fn route(telemetry: &Telemetry, method: &str, target: &str) -> http::Reply {
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => match render(telemetry) {
            Ok(body) => http::Reply {
                status: 200,
                content_type: prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                body,
            },
            Err(e) => http::Reply::text(500, e),
        },
        ("GET", "/healthz") => http::Reply::text(200, "ok\n"),
        ("GET", _) => http::Reply::text(404, "not found: try /metrics or /healthz\n"),
        _ => http::Reply::text(405, "GET only\n"),
    }
}

/// The running endpoint; dropping it stops it (within about 100 ms,
/// whatever its clients do).
pub struct MetricsServer {
    server: http::Server,
}

impl MetricsServer {
    /// Listen on `addr` and serve `telemetry` from a thread of its own.
    pub fn start(addr: &str, telemetry: Telemetry) -> Result<Self, String> {
        Self::start_with(addr, telemetry, http::Limits::DEFAULT)
    }

    fn start_with(addr: &str, telemetry: Telemetry, limits: http::Limits) -> Result<Self, String> {
        let bind = addr
            .to_socket_addrs()
            .map_err(|e| format!("--metrics-addr {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("--metrics-addr {addr}: no address"))?;
        let listener = TcpListener::bind(bind)
            .map_err(|e| format!("--metrics-addr {addr}: listening on {bind}: {e}"))?;
        let route = Box::new(move |method: &str, target: &str| route(&telemetry, method, target));
        let server = http::Server::start(listener, "starwire-metrics", limits, route)
            .map_err(|e| format!("starting the metrics server on {bind}: {e}"))?;
        tracing::info!(target: "status", "metrics on http://{}/metrics", server.addr());
        Ok(Self { server })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn families_render_as_prometheus_text() {
        let t = Telemetry::new();
        t.counter(
            "starwire_ps_requests",
            "PS requests",
            &[("shard", "0"), ("kind", "pull")],
        )
        .set(3);
        t.gauge(
            "starwire_ps_rows",
            "rows",
            &[("shard", "0"), ("table", "emb")],
        )
        .set(42.0);
        t.histogram(
            "starwire_step_duration_seconds",
            "steps",
            &[],
            starwire_telemetry::DURATION_BOUNDS,
        )
        .observe(Duration::from_millis(2));
        let s = render(&t).unwrap();
        assert!(
            s.contains("# TYPE starwire_ps_requests_total counter"),
            "{s}"
        );
        assert!(
            s.contains("starwire_ps_requests_total{shard=\"0\",kind=\"pull\"} 3"),
            "{s}"
        );
        assert!(
            s.contains("starwire_ps_rows{shard=\"0\",table=\"emb\"} 42"),
            "{s}"
        );
        assert!(
            s.contains("starwire_step_duration_seconds_bucket{le=\"0.0025\"} 1"),
            "{s}"
        );
        assert!(s.contains("starwire_step_duration_seconds_count 1"), "{s}");
        assert!(s.contains("starwire_build_info{version=\""), "{s}");
        assert!(s.contains("process_resident_memory_bytes "), "{s}");
        assert!(s.contains("process_open_fds "), "{s}");
        assert!(s.contains("process_cpu_seconds_total "), "{s}");
    }

    /// `GET path` (raw request `req`) on `addr`: the head and the body.
    fn ask(addr: SocketAddr, req: &str) -> (String, String) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let (head, body) = resp.split_once("\r\n\r\n").expect("a whole answer");
        (head.to_owned(), body.to_owned())
    }

    /// The lines that do not change between two renders (the `process_*`
    /// families do).
    fn steady(s: &str) -> Vec<&str> {
        s.lines().filter(|l| !l.contains("process_")).collect()
    }

    #[test]
    fn the_endpoint_serves_what_it_served() {
        let t = Telemetry::new();
        t.counter("starwire_ps_requests", "PS requests", &[("kind", "pull")])
            .set(7);
        let srv = MetricsServer::start("127.0.0.1:0", t.clone()).unwrap();
        let addr = srv.addr();
        let get = |path: &str| ask(addr, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n"));
        for path in ["/metrics", "/metrics?name=x"] {
            let (head, body) = get(path);
            assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
            let ctype = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
            assert!(
                head.contains(&format!("\r\nContent-Type: {ctype}")),
                "{head}"
            );
            assert!(
                head.contains(&format!("\r\nContent-Length: {}", body.len())),
                "{head}"
            );
            assert_eq!(steady(&body), steady(&render(&t).unwrap()));
            assert!(
                body.contains("starwire_ps_requests_total{kind=\"pull\"} 7"),
                "{body}"
            );
        }
        let (head, body) = get("/healthz");
        assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
        assert!(
            head.contains("\r\nContent-Type: text/plain; charset=utf-8"),
            "{head}"
        );
        assert_eq!(body, "ok\n");
        let (head, body) = get("/nope");
        assert!(head.starts_with("HTTP/1.1 404 "), "{head}");
        assert_eq!(body, "not found: try /metrics or /healthz\n");
        for method in ["POST", "HEAD", "PUT"] {
            let (head, body) = ask(addr, &format!("{method} /metrics HTTP/1.1\r\n\r\n"));
            assert!(head.starts_with("HTTP/1.1 405 "), "{head}");
            assert_eq!(body, "GET only\n");
        }
        // HTTP/1.0 too.
        let (head, body) = ask(addr, "GET /healthz HTTP/1.0\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
        assert_eq!(body, "ok\n");
    }
}

//! `--metrics-addr HOST:PORT`: Prometheus metrics over HTTP while a
//! command runs.
//!
//! `GET /metrics` answers with every family of the run's [`Telemetry`]
//! (the cells the PS shards, workers and reactors update with relaxed
//! atomics), the `process_*` families read from `/proc` and, with the
//! `dpdk` feature, the open port's `starwire_dpdk_port_*` families read
//! from DPDK, encoded by
//! prometheus-client in the Prometheus text format. `GET /healthz` answers
//! `ok`. tiny_http serves both on one thread of its own; a scrape reads the
//! cells and never stops the threads that write them.

#[cfg(feature = "dpdk")]
mod dpdk;
mod process;
mod soak;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;

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
    #[arg(long, value_name = "HOST:PORT")]
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

/// The running endpoint; dropping it stops it.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listen on `addr` and serve `telemetry` from a thread of its own.
    pub fn start(addr: &str, telemetry: Telemetry) -> Result<Self, String> {
        let bind = addr
            .to_socket_addrs()
            .map_err(|e| format!("--metrics-addr {addr}: {e}"))?
            .next()
            .ok_or_else(|| format!("--metrics-addr {addr}: no address"))?;
        let server = tiny_http::Server::http(bind)
            .map_err(|e| format!("--metrics-addr {addr}: listening on {bind}: {e}"))?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| format!("--metrics-addr {addr}: not an IP listener"))?;
        let server = Arc::new(server);
        let s = server.clone();
        let thread = std::thread::Builder::new()
            .name("starwire-metrics".into())
            .spawn(move || serve(&s, &telemetry))
            .map_err(|e| format!("starting the metrics thread: {e}"))?;
        tracing::info!(target: "status", "metrics on http://{addr}/metrics");
        Ok(Self {
            server,
            addr,
            thread: Some(thread),
        })
    }
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(server: &tiny_http::Server, telemetry: &Telemetry) {
    use tiny_http::{Header, Method, Response};
    let header = |v: &str| Header::from_bytes(&b"Content-Type"[..], v.as_bytes()).ok();
    for req in server.incoming_requests() {
        let path = req.url().split('?').next().unwrap_or("");
        let (status, body, ctype) = match (req.method(), path) {
            (Method::Get, "/metrics") => match render(telemetry) {
                Ok(s) => (
                    200,
                    s,
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                ),
                Err(e) => (500, e, "text/plain; charset=utf-8"),
            },
            (Method::Get, "/healthz") => (200, "ok\n".into(), "text/plain; charset=utf-8"),
            (Method::Get, _) => (
                404,
                "not found: try /metrics or /healthz\n".into(),
                "text/plain; charset=utf-8",
            ),
            _ => (405, "GET only\n".into(), "text/plain; charset=utf-8"),
        };
        let mut resp = Response::from_string(body).with_status_code(status);
        if let Some(h) = header(ctype) {
            resp = resp.with_header(h);
        }
        if let Err(e) = req.respond(resp) {
            tracing::debug!("metrics: answering a scrape: {e}");
        }
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
}

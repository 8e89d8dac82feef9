//! `process_*` families, read from `/proc/self` and `getrusage` at each
//! scrape (the names of the Prometheus client libraries' process
//! collectors).

use nix::sys::resource::{getrlimit, getrusage, Resource, UsageWho};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The process's CPU time, memory, threads and file descriptors.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessCollector;

/// A numeric field of `/proc/self/status` (sizes are in kB).
fn status_number(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: f64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        if let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) {
            let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
            let c = ConstCounter::new(secs(u.user_time()) + secs(u.system_time()));
            c.encode(e.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                c.metric_type(),
            )?)?;
        }
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        if let Some(rss) = status_number(&status, "VmRSS") {
            let help = "Resident memory size in bytes";
            gauge(
                &mut e,
                "process_resident_memory_bytes",
                help,
                (rss * 1024) as f64,
            )?;
        }
        if let Some(vm) = status_number(&status, "VmSize") {
            let help = "Virtual memory size in bytes";
            gauge(
                &mut e,
                "process_virtual_memory_bytes",
                help,
                (vm * 1024) as f64,
            )?;
        }
        if let Some(n) = status_number(&status, "Threads") {
            gauge(&mut e, "process_threads", "Number of OS threads", n as f64)?;
        }
        if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
            let help = "Number of open file descriptors";
            gauge(&mut e, "process_open_fds", help, d.count() as f64)?;
        }
        if let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) {
            let help = "Maximum number of open file descriptors";
            gauge(&mut e, "process_max_fds", help, soft as f64)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse_in_bytes_units() {
        let s = "Name:\tstarwire\nVmSize:\t  1000 kB\nVmRSS:\t   20 kB\nThreads:\t7\n";
        assert_eq!(status_number(s, "VmRSS"), Some(20));
        assert_eq!(status_number(s, "VmSize"), Some(1000));
        assert_eq!(status_number(s, "Threads"), Some(7));
        assert_eq!(status_number(s, "VmSwap"), None);
    }
}

//! Live counters for a metrics endpoint.
//!
//! A hot path owns its cells ([`Counter`], [`Gauge`], [`Histogram`]) and
//! updates them with relaxed atomics, once per request or step (a batch of
//! keys), never taking a lock or allocating. A scraper walks the
//! [`Telemetry`] registry at scrape time and reads every cell.
//!
//! The registry's lock is taken only to register a cell (when a shard,
//! worker or reactor starts) and to scrape. Every registration makes a new
//! cell, so each writer has cells of its own: a shard publishes the totals
//! it already keeps with [`Counter::set`], and the scraper adds up the cells
//! that share a name and labels ([`Telemetry::families`]). Two PS shards and
//! two workers of one process that all count `direction="sent"` bytes are
//! four cells and one sample.
//!
//! This crate knows no exposition format; the `starwire` binary encodes the
//! families as Prometheus text.
#![deny(unsafe_code)]

mod histogram;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

pub use histogram::{Histogram, HistogramSnapshot, DURATION_BOUNDS};

/// A monotonic count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Add `n` (for a cell several threads count into).
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Publish a total its single writer keeps anyway (a plain store).
    #[inline]
    pub fn set(&self, total: u64) {
        self.0.store(total, Ordering::Relaxed);
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down, kept as the bits of an `f64`.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Set the value.
    #[inline]
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    /// The value (0 until set).
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// What kind of metric a family is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic; cells with the same labels add up.
    Counter,
    /// Goes up and down; cells with the same labels add up.
    Gauge,
    /// Observations in buckets; cells with the same labels merge.
    Histogram,
}

/// One registered cell.
#[derive(Debug, Clone)]
enum Cell {
    Counter(Arc<Counter>),
    Gauge(Arc<Gauge>),
    Histogram(Arc<Histogram>),
}

/// Labels as registered: names fixed in the code, values of the run.
pub type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
struct Series {
    name: &'static str,
    help: &'static str,
    labels: Labels,
    cell: Cell,
}

/// A sample of a family: its labels and the value summed over its cells.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A counter's total.
    Counter(u64),
    /// A gauge's sum.
    Gauge(f64),
    /// The merged buckets.
    Histogram(HistogramSnapshot),
}

/// Every sample of one metric name, read at one scrape.
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    /// The metric name (`starwire_...`), without a `_total` suffix.
    pub name: &'static str,
    /// The help text.
    pub help: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// One sample per distinct label set, in registration order.
    pub samples: Vec<(Labels, Value)>,
}

/// The registry of a process's cells. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    series: Arc<Mutex<Vec<Series>>>,
}

impl Telemetry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn register(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
        cell: Cell,
    ) {
        let labels = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        // A scraper that panicked mid-read left the list intact: keep it.
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        series.push(Series {
            name,
            help,
            labels,
            cell,
        });
    }

    /// A new counter cell named `name` with `labels`.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Arc<Counter> {
        let c = Arc::new(Counter::default());
        self.register(name, help, labels, Cell::Counter(c.clone()));
        c
    }

    /// A new gauge cell named `name` with `labels`.
    pub fn gauge(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
    ) -> Arc<Gauge> {
        let g = Arc::new(Gauge::default());
        self.register(name, help, labels, Cell::Gauge(g.clone()));
        g
    }

    /// A new histogram cell named `name` with `labels`, bucketed by
    /// `bounds` (upper bounds in seconds, increasing). Cells that share a
    /// name must share their bounds.
    pub fn histogram(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[(&'static str, &str)],
        bounds: &'static [f64],
    ) -> Arc<Histogram> {
        let h = Arc::new(Histogram::new(bounds));
        self.register(name, help, labels, Cell::Histogram(h.clone()));
        h
    }

    /// Read every cell: one family per name (in the order the names were
    /// first registered), cells with the same labels summed or merged.
    /// A name registered as two kinds keeps the first; the cells of the
    /// other kind are left out.
    pub fn families(&self) -> Vec<Family> {
        let series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<Family> = Vec::new();
        for s in series.iter() {
            let value = match &s.cell {
                Cell::Counter(c) => Value::Counter(c.get()),
                Cell::Gauge(g) => Value::Gauge(g.get()),
                Cell::Histogram(h) => Value::Histogram(h.snapshot()),
            };
            let kind = match value {
                Value::Counter(_) => Kind::Counter,
                Value::Gauge(_) => Kind::Gauge,
                Value::Histogram(_) => Kind::Histogram,
            };
            let i = match out.iter().position(|f| f.name == s.name) {
                Some(i) => i,
                None => {
                    out.push(Family {
                        name: s.name,
                        help: s.help,
                        kind,
                        samples: Vec::new(),
                    });
                    out.len() - 1
                }
            };
            let fam = &mut out[i];
            if fam.kind != kind {
                continue;
            }
            match fam.samples.iter_mut().find(|(l, _)| *l == s.labels) {
                Some((_, v)) => merge(v, value),
                None => fam.samples.push((s.labels.clone(), value)),
            }
        }
        out
    }
}

fn merge(into: &mut Value, v: Value) {
    match (into, v) {
        (Value::Counter(a), Value::Counter(b)) => *a = a.saturating_add(b),
        (Value::Gauge(a), Value::Gauge(b)) => *a += b,
        (Value::Histogram(a), Value::Histogram(b)) => a.merge(&b),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn cells_with_the_same_labels_add_up() {
        let t = Telemetry::new();
        let a = t.counter("starwire_x", "x", &[("direction", "sent")]);
        let b = t.counter("starwire_x", "x", &[("direction", "sent")]);
        let c = t.counter("starwire_x", "x", &[("direction", "received")]);
        a.set(5);
        b.add(2);
        b.add(1);
        c.add(7);
        let f = t.families();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, Kind::Counter);
        assert_eq!(
            f[0].samples,
            vec![
                (vec![("direction", "sent".to_owned())], Value::Counter(8)),
                (
                    vec![("direction", "received".to_owned())],
                    Value::Counter(7)
                ),
            ]
        );
    }

    #[test]
    fn families_keep_registration_order_and_first_kind() {
        let t = Telemetry::new();
        t.gauge("starwire_b", "b", &[]).set(1.5);
        t.counter("starwire_a", "a", &[]).add(1);
        t.counter("starwire_b", "b as a counter", &[]).add(9);
        let h = t.histogram("starwire_h", "h", &[], DURATION_BOUNDS);
        h.observe(Duration::from_millis(3));
        let f = t.families();
        let names: Vec<_> = f.iter().map(|f| f.name).collect();
        assert_eq!(names, ["starwire_b", "starwire_a", "starwire_h"]);
        assert_eq!(f[0].samples, vec![(vec![], Value::Gauge(1.5))]);
        let Value::Histogram(s) = &f[2].samples[0].1 else {
            panic!("not a histogram: {:?}", f[2]);
        };
        assert_eq!(s.count(), 1);
    }

    #[test]
    fn counters_count_across_threads() {
        let t = Telemetry::new();
        let c = t.counter("starwire_n", "n", &[]);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let c = c.clone();
                s.spawn(move || {
                    for _ in 0..1000 {
                        c.add(1);
                    }
                });
            }
        });
        assert_eq!(t.families()[0].samples[0].1, Value::Counter(4000));
    }
}

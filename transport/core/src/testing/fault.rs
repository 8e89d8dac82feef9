//! A fault-injecting wrapper: seeded drop, delay, reorder and corruption of
//! received frames, under any backend.
//!
//! Over a reliable backend nothing repairs these faults, so each must
//! surface: a dropped or reordered message as a gap in the application's
//! sequence numbers (or a request past its deadline), a corrupted header as
//! a framing error that closes the connection, a corrupted body as a
//! checksum failure. Over the reliable-datagram core the same faults are
//! applied to packets instead and are repaired.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use thiserror::Error;

use crate::transport::{Transport, TransportError};

/// Fault rates, each a probability per frame in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FaultSpec {
    /// Drop the frame.
    pub drop: f64,
    /// Flip one random bit of the frame.
    pub corrupt: f64,
    /// Hold the frame back for [`FaultSpec::delay_for`], letting later frames pass it.
    pub delay: f64,
    /// Swap the frame with the next one.
    pub reorder: f64,
    /// How long a delayed frame is held.
    pub delay_for: Duration,
    /// Seed of the fault generator.
    pub seed: u64,
}

/// A `--faults` specification that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("bad fault spec {spec:?}: {why}")]
pub struct FaultSpecError {
    spec: String,
    why: String,
}

impl FromStr for FaultSpec {
    type Err = FaultSpecError;

    /// Parse `drop=0.01,corrupt=0.001,delay=0.01,reorder=0.01,delay_ms=5,seed=7`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |why: String| FaultSpecError {
            spec: s.to_owned(),
            why,
        };
        let mut f = FaultSpec {
            delay_for: Duration::from_millis(1),
            seed: 0x5eed,
            ..FaultSpec::default()
        };
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| err(format!("{item:?} is not key=value")))?;
            let num = |v: &str| -> Result<f64, FaultSpecError> {
                let x: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| err(format!("{k}: {v:?} is not a number")))?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(err(format!("{k}: {x} is not a probability in [0, 1]")));
                }
                Ok(x)
            };
            match k.trim() {
                "drop" => f.drop = num(v)?,
                "corrupt" => f.corrupt = num(v)?,
                "delay" => f.delay = num(v)?,
                "reorder" => f.reorder = num(v)?,
                "delay_ms" => {
                    let ms: u64 = v
                        .trim()
                        .parse()
                        .map_err(|_| err(format!("delay_ms: {v:?} is not an integer")))?;
                    f.delay_for = Duration::from_millis(ms);
                }
                "seed" => {
                    f.seed = v
                        .trim()
                        .parse()
                        .map_err(|_| err(format!("seed: {v:?} is not an integer")))?;
                }
                other => return Err(err(format!("unknown fault {other:?}"))),
            }
        }
        Ok(f)
    }
}

impl fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "drop={},corrupt={},delay={},reorder={},delay_ms={},seed={}",
            self.drop,
            self.corrupt,
            self.delay,
            self.reorder,
            self.delay_for.as_millis(),
            self.seed
        )
    }
}

/// Counts of the faults injected so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultStats {
    /// Frames dropped.
    pub dropped: u64,
    /// Frames corrupted.
    pub corrupted: u64,
    /// Frames delayed.
    pub delayed: u64,
    /// Frames reordered.
    pub reordered: u64,
}

/// Wraps a transport and injects faults into the frames it receives.
#[derive(Debug)]
pub struct Faulty<T> {
    inner: T,
    spec: FaultSpec,
    rng: SmallRng,
    held: VecDeque<(Instant, Vec<u8>)>,
    swap: Option<Vec<u8>>,
    ready: Vec<Vec<u8>>,
    stats: FaultStats,
}

impl<T: Transport> Faulty<T> {
    /// Wrap `inner`.
    pub fn new(inner: T, spec: FaultSpec) -> Self {
        Self {
            inner,
            rng: SmallRng::seed_from_u64(spec.seed),
            spec,
            held: VecDeque::new(),
            swap: None,
            ready: Vec::new(),
            stats: FaultStats::default(),
        }
    }

    /// The faults injected so far.
    pub fn stats(&self) -> FaultStats {
        self.stats
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }
}

/// Faults are injected on the frames, not on readiness: a driver of
/// faulty links waits on the wrapped link's descriptors.
impl<T: crate::driver::Link> crate::driver::Link for Faulty<T> {
    fn read_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner().read_fd()
    }
    fn write_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner().write_fd()
    }
}

impl<T: Transport> Transport for Faulty<T> {
    fn max_frame_len(&self) -> usize {
        self.inner.max_frame_len()
    }
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.inner.tx_reserve(len)
    }
    fn tx_commit(&mut self, len: usize) {
        self.inner.tx_commit(len);
    }
    fn tx_gather(&mut self, head: &[u8], segs: &[bytes::Bytes]) -> Result<bool, TransportError> {
        self.inner.tx_gather(head, segs)
    }
    fn flush(&mut self, now: Instant) -> Result<(), TransportError> {
        self.inner.flush(now)
    }
    fn tx_pending(&self) -> bool {
        self.inner.tx_pending()
    }
    fn poll_timeout(&self) -> Option<Instant> {
        let held = self.held.front().map(|(t, _)| *t);
        match (held, self.inner.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn rx_burst(
        &mut self,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let spec = self.spec;
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        while let Some((t, _)) = self.held.front() {
            if *t > now {
                break;
            }
            if let Some((_, f)) = self.held.pop_front() {
                ready.push(f);
            }
        }
        let rng = &mut self.rng;
        let stats = &mut self.stats;
        let held = &mut self.held;
        let swap = &mut self.swap;
        let res = self.inner.rx_burst(now, max, &mut |frame: &[u8]| {
            if rng.gen_bool(spec.drop) {
                stats.dropped += 1;
                return;
            }
            let mut f = frame.to_vec();
            if rng.gen_bool(spec.corrupt) && !f.is_empty() {
                let bit = rng.gen_range(0..f.len() * 8);
                f[bit / 8] ^= 1 << (bit % 8);
                stats.corrupted += 1;
            }
            if rng.gen_bool(spec.delay) {
                stats.delayed += 1;
                held.push_back((now + spec.delay_for, f));
                return;
            }
            if let Some(prev) = swap.take() {
                ready.push(f);
                ready.push(prev);
                return;
            }
            if rng.gen_bool(spec.reorder) {
                stats.reordered += 1;
                *swap = Some(f);
                return;
            }
            ready.push(f);
        });
        let n = ready.len();
        for f in &ready {
            sink(f);
        }
        self.ready = ready;
        match res {
            Ok(_) => Ok(n),
            // Deliver what was held before reporting the end.
            Err(e) if n == 0 => Err(e),
            Err(_) => Ok(n),
        }
    }
}

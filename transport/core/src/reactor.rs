//! Reactors: one thread per network core, shared-nothing, run-to-completion.
//!
//! A reactor owns a [`Shard`]: the connections bound to it for their life,
//! their sessions, and whatever per-core state the layer above keeps (a
//! parameter server's rows for this shard). Each loop iteration reads the
//! clock once and hands `now` to [`Shard::turn`]; nothing below reads the
//! clock. When a turn finds no work the [`IdlePolicy`] decides: spin
//! (busy-poll), spin for a while then park, or park at once.
//!
//! Parking waits in `poll(2)` on the shard's file descriptors (sockets,
//! completion-queue channels) and on an eventfd, so either network input
//! or a [`ReactorWaker::wake`] from an application thread ends it. The
//! wake-up uses an eventcount handshake so that no wake-up is lost: the
//! reactor announces `sleeping` (SeqCst), runs one more turn to re-check
//! its inputs, and only then sleeps; a producer publishes its item first,
//! then (SeqCst) reads `sleeping` and writes the eventfd if it is set.
//! Either the reactor's re-check sees the item or the producer sees the flag.
//! The eventfd is drained only after a park it ended.
//!
//! A shard whose connections share one io_uring ring parks in the ring
//! instead ([`Shard::park`]): one `io_uring_enter` that waits for a
//! completion, with a poll of the same eventfd among its requests, so the
//! handshake is unchanged.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use thiserror::Error;

/// What a reactor does when a turn found no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Spin: lowest latency, one core fully used (DeepRec's
    /// `*_ENABLE_POLLING=true`).
    BusyPoll,
    /// Spin for the given time after the last work, then park.
    PollThenPark(Duration),
    /// Park at once (DeepRec's default).
    Park,
}

/// The per-core state a reactor drives.
pub trait Shard: Send {
    /// One run-to-completion turn at `now`. Returns true if it did work.
    fn turn(&mut self, now: Instant) -> bool;

    /// The earliest instant a turn has timer work, if any.
    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    /// File descriptors whose readability must wake a parked reactor,
    /// borrowed from the shard for the duration of the park.
    fn wake_fds<'a>(&'a self, _out: &mut Vec<BorrowedFd<'a>>) {}

    /// File descriptors whose writability must wake a parked reactor:
    /// sockets with bytes queued that the kernel did not take (its send
    /// buffer was full). Without them a reactor that parks with a reply
    /// half written sleeps until the next request or `max_park`, while the
    /// peer waits for the rest of the reply.
    fn write_fds<'a>(&'a self, _out: &mut Vec<BorrowedFd<'a>>) {}

    /// True when the shard has finished and the reactor may exit.
    fn finished(&self) -> bool {
        false
    }

    /// Park inside a wait of the shard's own instead of `poll(2)`: until
    /// `waker` (the reactor's eventfd) is readable, input arrives, or
    /// `timeout`. `None` when the shard has no such wait; the reactor then
    /// polls [`wake_fds`](Self::wake_fds) and [`write_fds`](Self::write_fds).
    /// A shard whose connections all share one io_uring ring parks in
    /// that ring ([`park_in_shared_driver`]): one `io_uring_enter` that
    /// submits, waits and runs the completions' work.
    ///
    /// The wait must end at once when `waker` is already readable; the
    /// reactor drains it only after a [`ParkEnd::Waker`].
    fn park(&self, _waker: ParkWaker<'_>, _timeout: Duration) -> Option<ParkEnd> {
        None
    }
}

/// The reactor's eventfd, as a [`Shard::park`] waits on it.
#[derive(Debug, Clone, Copy)]
pub struct ParkWaker<'a> {
    /// Readable once a wake-up was written.
    pub fd: BorrowedFd<'a>,
    /// The waker's identity, unique in the process: a wait that keeps a
    /// request on the eventfd across parks (an io_uring ring's poll) arms
    /// it again when the id changes, since another eventfd may reuse the
    /// old one's number.
    pub id: u64,
}

/// A fresh [`ParkWaker::id`].
fn next_waker_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What ended a park.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkEnd {
    /// The timeout (or a failed wait).
    Timeout,
    /// The reactor's eventfd is readable (perhaps with input too).
    Waker,
    /// Input, or anything else that is not the eventfd.
    Input,
}

/// Park in the driver that every one of `transports` shares (an io_uring
/// ring), if they share one and none has bytes waiting for writability:
/// what a [`Shard::park`] over connections does. `None` when they do not
/// share one, when there are none, or when the backend has no wait of its
/// own (tcp).
pub fn park_in_shared_driver<'a, T: DrivenTransport + 'a>(
    mut transports: impl Iterator<Item = &'a T>,
    waker: ParkWaker<'_>,
    timeout: Duration,
) -> Option<ParkEnd> {
    let first = transports.next()?;
    let key = first.driver_key()?;
    if first.write_fd().is_some()
        || transports.any(|t| t.driver_key() != Some(key) || t.write_fd().is_some())
    {
        return None;
    }
    first.park(waker, timeout)
}

/// A [`Transport`](crate::Transport) as a reactor drives it: what a parked
/// reactor waits on, and the end of a turn. Implemented by the tcp and
/// io_uring backends; the train, bench and soak shards build their
/// [`Shard::wake_fds`] and [`Shard::write_fds`] from it.
pub trait DrivenTransport: crate::Transport {
    /// The descriptor whose readability wakes a parked reactor for this
    /// connection: its socket, or its ring's park descriptor.
    fn wake_fd(&self) -> BorrowedFd<'_>;

    /// The descriptor whose writability a parked reactor must also wait
    /// for: a socket holding queued bytes its full send buffer refused.
    /// `None` when nothing waits, or when the backend wakes
    /// [`wake_fd`](Self::wake_fd) itself once a send completes (an io_uring
    /// ring).
    fn write_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// The end of a turn over every connection sharing this one's driver
    /// (an io_uring ring): its one submission. Call once per turn, on any
    /// one of those connections. Returns true when it did work.
    fn end_turn(&self) -> bool {
        false
    }

    /// Which driver this connection shares with others (an io_uring
    /// ring's identity): connections with the same key are driven by one
    /// submission and may park in one wait. `None` (the default) when each
    /// connection is its own driver (tcp).
    fn driver_key(&self) -> Option<usize> {
        None
    }

    /// Park the reactor in this connection's driver, for every connection
    /// sharing it (see [`Shard::park`]). `None` (the default) when the
    /// backend has no wait of its own.
    fn park(&self, _waker: ParkWaker<'_>, _timeout: Duration) -> Option<ParkEnd> {
        None
    }
}

/// Where and how a reactor runs.
#[derive(Debug, Clone)]
pub struct ReactorSpec {
    /// Reactor index (its shard id).
    pub index: usize,
    /// The CPU to pin to, if pinning.
    pub cpu: Option<usize>,
    /// The idle policy.
    pub idle: IdlePolicy,
    /// Longest single park, so a shard with no timers still re-checks.
    pub max_park: Duration,
}

impl ReactorSpec {
    /// An unpinned, parking reactor.
    pub fn new(index: usize) -> Self {
        Self {
            index,
            cpu: None,
            idle: IdlePolicy::Park,
            max_park: Duration::from_millis(100),
        }
    }
}

/// A reactor that could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReactorError {
    /// The eventfd could not be created.
    #[error("eventfd: {0}")]
    EventFd(#[source] nix::Error),
    /// The thread could not be spawned.
    #[error("spawning reactor thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// Pinning to the CPU failed.
    #[error("pinning reactor {reactor} to CPU {cpu}: {source}")]
    Pin {
        /// Reactor index.
        reactor: usize,
        /// CPU.
        cpu: usize,
        /// Why.
        #[source]
        source: starwire_placement::PlacementError,
    },
    /// The reactor thread panicked.
    #[error("reactor thread panicked")]
    Panicked,
}

#[derive(Debug)]
struct WakeState {
    /// See [`ParkWaker::id`].
    id: u64,
    sleeping: AtomicBool,
    stop: AtomicBool,
    efd: EventFd,
    wakes_sent: AtomicU64,
}

/// Wakes a parked reactor. Cheap to clone; `wake` costs one atomic load
/// when the reactor is not asleep.
#[derive(Debug, Clone)]
pub struct ReactorWaker {
    state: Arc<WakeState>,
}

impl ReactorWaker {
    /// Call after publishing work for the reactor (e.g. a push into its
    /// queue). Wakes it if it is parked or about to park.
    pub fn wake(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.state.sleeping.load(Ordering::SeqCst) {
            self.state.wakes_sent.fetch_add(1, Ordering::Relaxed);
            // An eventfd write only fails on counter overflow (EAGAIN),
            // which still leaves it readable: the reactor wakes either way.
            let _ = self.state.efd.write(1);
        }
    }

    /// Ask the reactor to stop after its current turn.
    pub fn stop(&self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = self.state.efd.write(1);
    }
}

/// Counters of one reactor's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReactorStats {
    /// Turns run.
    pub turns: u64,
    /// Turns that did work.
    pub busy_turns: u64,
    /// Times the reactor parked.
    pub parks: u64,
    /// Parks that ended by the timeout rather than by input or a wake-up.
    pub park_timeouts: u64,
    /// Parks cancelled because the re-check turn found work.
    pub park_cancels: u64,
    /// Parks that a wake-up (the reactor's eventfd) ended, each followed
    /// by one read draining the eventfd; the other parks skip that read.
    pub waker_reads: u64,
    /// Parks in a wait of the shard's own ([`Shard::park`], an io_uring
    /// ring's) rather than `poll(2)`.
    pub shard_parks: u64,
    /// Time spent in turns that did work, in nanoseconds (each measured
    /// from its start to the start of the next turn, so a park after a
    /// busy turn is not counted).
    pub busy_ns: u64,
    /// Time from the first turn to the last, in nanoseconds.
    pub run_ns: u64,
}

/// A running reactor.
#[derive(Debug)]
pub struct Reactor<S> {
    waker: ReactorWaker,
    join: Option<JoinHandle<Result<(S, ReactorStats), ReactorError>>>,
}

impl<S: Shard + 'static> Reactor<S> {
    /// Start a reactor thread that pins itself (if asked), builds its shard
    /// with `make` on its own core, and runs it until the shard finishes or
    /// [`ReactorWaker::stop`] is called.
    pub fn spawn<F>(spec: ReactorSpec, make: F) -> Result<Self, ReactorError>
    where
        F: FnOnce(ReactorWaker) -> S + Send + 'static,
    {
        let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(ReactorError::EventFd)?;
        let state = Arc::new(WakeState {
            id: next_waker_id(),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            efd,
            wakes_sent: AtomicU64::new(0),
        });
        let waker = ReactorWaker { state };
        let w = waker.clone();
        let join = std::thread::Builder::new()
            .name(format!("starwire-reactor-{}", spec.index))
            .spawn(move || {
                if let Some(cpu) = spec.cpu {
                    starwire_placement::pin_current_thread(cpu).map_err(|source| {
                        ReactorError::Pin {
                            reactor: spec.index,
                            cpu,
                            source,
                        }
                    })?;
                }
                let mut shard = make(w.clone());
                let stats = run(&spec, &w.state, &mut shard);
                Ok((shard, stats))
            })
            .map_err(ReactorError::Spawn)?;
        Ok(Self {
            waker,
            join: Some(join),
        })
    }

    /// The reactor's waker.
    pub fn waker(&self) -> ReactorWaker {
        self.waker.clone()
    }

    /// True once the reactor thread has exited (its shard finished, or it
    /// was stopped).
    pub fn is_finished(&self) -> bool {
        self.join.as_ref().map_or(true, JoinHandle::is_finished)
    }

    /// Wait for the reactor to finish and take back its shard.
    pub fn join(mut self) -> Result<(S, ReactorStats), ReactorError> {
        let j = self.join.take().ok_or(ReactorError::Panicked)?;
        j.join().map_err(|_| ReactorError::Panicked)?
    }

    /// Stop the reactor and take back its shard.
    pub fn stop(self) -> Result<(S, ReactorStats), ReactorError> {
        self.waker.stop();
        self.join()
    }
}

/// Run `shard` on the calling thread with the given policy until it
/// finishes or is stopped through a waker made by [`local_waker`]. Useful
/// when the caller's thread is itself the reactor (a benchmark client).
pub fn run_here<S: Shard>(spec: &ReactorSpec, waker: &ReactorWaker, shard: &mut S) -> ReactorStats {
    run(spec, &waker.state, shard)
}

/// A waker for [`run_here`].
pub fn local_waker() -> Result<ReactorWaker, ReactorError> {
    let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
        .map_err(ReactorError::EventFd)?;
    Ok(ReactorWaker {
        state: Arc::new(WakeState {
            id: next_waker_id(),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            efd,
            wakes_sent: AtomicU64::new(0),
        }),
    })
}

fn run<S: Shard>(spec: &ReactorSpec, state: &WakeState, shard: &mut S) -> ReactorStats {
    let mut stats = ReactorStats::default();
    let mut last_work = Instant::now();
    let first = last_work;
    // The start of the last turn, when it did work.
    let mut busy_since: Option<Instant> = None;
    loop {
        if state.stop.load(Ordering::Relaxed) || shard.finished() {
            break;
        }
        let now = Instant::now();
        if let Some(t) = busy_since.take() {
            stats.busy_ns += now.saturating_duration_since(t).as_nanos() as u64;
        }
        stats.run_ns = now.saturating_duration_since(first).as_nanos() as u64;
        stats.turns += 1;
        if shard.turn(now) {
            stats.busy_turns += 1;
            last_work = now;
            busy_since = Some(now);
            continue;
        }
        let park = match spec.idle {
            IdlePolicy::BusyPoll => false,
            IdlePolicy::PollThenPark(d) => now.duration_since(last_work) >= d,
            IdlePolicy::Park => true,
        };
        if !park {
            std::hint::spin_loop();
            continue;
        }
        // Eventcount: announce, re-check, then sleep.
        state.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let now = Instant::now();
        if shard.turn(now) || state.stop.load(Ordering::SeqCst) {
            state.sleeping.store(false, Ordering::SeqCst);
            stats.park_cancels += 1;
            last_work = now;
            continue;
        }
        let mut timeout = spec.max_park;
        if let Some(d) = shard.next_deadline() {
            timeout = timeout.min(d.saturating_duration_since(now));
        }
        stats.parks += 1;
        let waker = ParkWaker {
            fd: state.efd.as_fd(),
            id: state.id,
        };
        let woke = match shard.park(waker, timeout) {
            Some(end) => {
                stats.shard_parks += 1;
                end
            }
            None => {
                let mut fds = Vec::new();
                shard.wake_fds(&mut fds);
                let mut wfds = Vec::new();
                shard.write_fds(&mut wfds);
                park_on(&state.efd, &fds, &wfds, timeout)
            }
        };
        if woke == ParkEnd::Timeout {
            stats.park_timeouts += 1;
        }
        state.sleeping.store(false, Ordering::SeqCst);
        if woke == ParkEnd::Waker {
            // Drain the eventfd. Only when poll saw it readable: most
            // parks end on network input, and a read that finds nothing
            // is a wasted system call per park. A wake written after the
            // poll returned stays in the eventfd and ends the next park at
            // once, so it costs a turn, never a lost wake-up.
            let _ = state.efd.read();
            stats.waker_reads += 1;
        }
        last_work = Instant::now();
    }
    stats
}

/// Sleep until the eventfd or one of `fds` is readable, one of `wfds`
/// writable, or `timeout`.
fn park_on(
    efd: &EventFd,
    fds: &[BorrowedFd<'_>],
    wfds: &[BorrowedFd<'_>],
    timeout: Duration,
) -> ParkEnd {
    let mut pfds: Vec<PollFd<'_>> = Vec::with_capacity(fds.len() + wfds.len() + 1);
    pfds.push(PollFd::new(efd.as_fd(), PollFlags::POLLIN));
    for fd in fds {
        pfds.push(PollFd::new(*fd, PollFlags::POLLIN));
    }
    for fd in wfds {
        pfds.push(PollFd::new(*fd, PollFlags::POLLOUT));
    }
    let ms = u16::try_from(timeout.as_millis().max(1)).unwrap_or(u16::MAX);
    match nix::poll::poll(&mut pfds, PollTimeout::from(ms)) {
        Ok(n) if n > 0 => {
            let waker = pfds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLIN));
            if waker {
                ParkEnd::Waker
            } else {
                ParkEnd::Input
            }
        }
        _ => ParkEnd::Timeout,
    }
}

//! Reactors: one thread per network core, shared-nothing, run-to-completion.
//!
//! A reactor owns a [`ReactorState`]: one [`Driver`] serving every
//! connection bound to the reactor for their life, their sessions, and
//! whatever per-core state the layer above keeps (a parameter server's rows
//! for one PS shard). Each loop iteration reads the clock once and hands
//! `now` to [`ReactorState::turn`]; nothing below reads the clock. When a
//! turn finds no work the [`IdlePolicy`] decides: spin (busy-poll), spin
//! for a while then park, or park at once.
//!
//! How it parks is the driver's to say ([`Driver::sleep`], through
//! [`park_driver`]): in `poll(2)` on the driver's descriptors (sockets) and
//! on an eventfd, in a wait of the driver's own that also watches that
//! eventfd (one `io_uring_enter` of an io_uring ring), or not at all (a
//! driver with no interrupt: the reactor keeps turning). Either network
//! input or a [`ReactorWaker::wake`] from an application thread ends a park.
//! The wake-up uses an eventcount handshake so that no wake-up is lost: the
//! reactor announces `sleeping` (SeqCst), runs one more turn to re-check
//! its inputs, and only then sleeps; a producer publishes its item first,
//! then (SeqCst) reads `sleeping` and writes the eventfd if it is set.
//! Either the reactor's re-check sees the item or the producer sees the flag.
//! The eventfd is drained only after a park it ended.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use thiserror::Error;

use crate::driver::{Driver, Sleep};

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

/// The per-core state a reactor drives: the connections bound to it for
/// their life (one [`Driver`] and its [`Sessions`](crate::Sessions)) and
/// whatever the layer above keeps on that core (a parameter server's rows
/// for one PS shard).
pub trait ReactorState: Send {
    /// One run-to-completion turn at `now`. Returns true if it did work.
    fn turn(&mut self, now: Instant) -> bool;

    /// The earliest instant a turn has timer work, if any.
    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    /// True when the state has finished and the reactor may exit.
    fn finished(&self) -> bool {
        false
    }

    /// Wait until `waker` (the reactor's eventfd) is readable, input
    /// arrives, or `timeout`: how is the driver's to say, so a state over
    /// one driver hands it to [`park_driver`]. A state with no driver waits
    /// with [`park_fds`] on what it has.
    ///
    /// The wait must end at once when `waker` is already readable; the
    /// reactor drains it only after a [`ParkEnd::Waker`].
    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked;
}

/// No state: a reactor whose state could not be made on its thread (its
/// driver failed to start there) finishes at once.
impl<S: ReactorState> ReactorState for Option<S> {
    fn turn(&mut self, now: Instant) -> bool {
        self.as_mut().is_some_and(|s| s.turn(now))
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.as_ref().and_then(S::next_deadline)
    }

    fn finished(&self) -> bool {
        self.as_ref().map_or(true, S::finished)
    }

    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        match self {
            Some(s) => s.park(waker, timeout),
            None => Parked::Poll(park_fds(waker, &[], &[], timeout)),
        }
    }
}

/// The reactor's eventfd, as a park waits on it.
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

/// How a [`ReactorState::park`] waited, and what ended the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parked {
    /// In `poll(2)` ([`park_fds`]).
    Poll(ParkEnd),
    /// In the driver's own wait ([`Driver::park`]).
    Driver(ParkEnd),
    /// Not at all: the driver has nothing to wait on ([`Sleep::Never`]);
    /// the reactor turns again.
    No,
}

/// Park the calling thread the way `driver` says ([`Driver::sleep`]): in
/// `poll(2)` on its descriptors and the waker, in its own wait, or not at
/// all. A driver whose own wait could not be made is polled on its
/// descriptors instead.
pub fn park_driver<D: Driver + ?Sized>(
    driver: &mut D,
    waker: ParkWaker<'_>,
    timeout: Duration,
) -> Parked {
    match driver.sleep() {
        Sleep::Never => return Parked::No,
        Sleep::Own => {
            if let Some(end) = driver.park(waker, timeout) {
                return Parked::Driver(end);
            }
        }
        Sleep::Fds => {}
    }
    let mut read = Vec::new();
    driver.wake_fds(&mut read);
    let mut write = Vec::new();
    driver.write_fds(&mut write);
    Parked::Poll(park_fds(waker, &read, &write, timeout))
}

/// Sleep in `poll(2)` until `waker` or one of `read` is readable, one of
/// `write` writable (a socket holding bytes its full send buffer refused:
/// without it a reactor that parks with a reply half written sleeps until
/// the next request while the peer waits for the rest), or `timeout`.
pub fn park_fds(
    waker: ParkWaker<'_>,
    read: &[BorrowedFd<'_>],
    write: &[BorrowedFd<'_>],
    timeout: Duration,
) -> ParkEnd {
    let mut pfds: Vec<PollFd<'_>> = Vec::with_capacity(read.len() + write.len() + 1);
    pfds.push(PollFd::new(waker.fd, PollFlags::POLLIN));
    for fd in read {
        pfds.push(PollFd::new(*fd, PollFlags::POLLIN));
    }
    for fd in write {
        pfds.push(PollFd::new(*fd, PollFlags::POLLOUT));
    }
    let ms = u16::try_from(timeout.as_millis().max(1)).unwrap_or(u16::MAX);
    match nix::poll::poll(&mut pfds, PollTimeout::from(ms)) {
        Ok(n) if n > 0 => {
            let woke = pfds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLIN));
            if woke {
                ParkEnd::Waker
            } else {
                ParkEnd::Input
            }
        }
        _ => ParkEnd::Timeout,
    }
}

/// Where and how a reactor runs.
#[derive(Debug, Clone)]
pub struct ReactorSpec {
    /// Reactor index.
    pub index: usize,
    /// The CPU to pin to, if pinning.
    pub cpu: Option<usize>,
    /// The idle policy.
    pub idle: IdlePolicy,
    /// Longest single park, so a state with no timers still re-checks.
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

    /// The eventfd as a park waits on it, for a thread that parks its
    /// driver itself ([`park_driver`]) rather than in a [`Reactor`]: a
    /// worker waiting for replies on its own thread.
    pub fn park_waker(&self) -> ParkWaker<'_> {
        ParkWaker {
            fd: self.state.efd.as_fd(),
            id: self.state.id,
        }
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
    /// Parks in a wait of the driver's own ([`Parked::Driver`], an
    /// io_uring ring's) rather than `poll(2)`.
    pub driver_parks: u64,
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

impl<S: ReactorState + 'static> Reactor<S> {
    /// Start a reactor thread that pins itself (if asked), builds its state
    /// with `make` on its own core, and runs it until the state finishes or
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
                let mut state = make(w.clone());
                let stats = run(&spec, &w.state, &mut state);
                Ok((state, stats))
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

    /// True once the reactor thread has exited (its state finished, or it
    /// was stopped).
    pub fn is_finished(&self) -> bool {
        self.join.as_ref().map_or(true, JoinHandle::is_finished)
    }

    /// Wait for the reactor to finish and take back its state.
    pub fn join(mut self) -> Result<(S, ReactorStats), ReactorError> {
        let j = self.join.take().ok_or(ReactorError::Panicked)?;
        j.join().map_err(|_| ReactorError::Panicked)?
    }

    /// Stop the reactor and take back its state.
    pub fn stop(self) -> Result<(S, ReactorStats), ReactorError> {
        self.waker.stop();
        self.join()
    }
}

/// A waker for a thread that parks its driver itself
/// ([`ReactorWaker::park_waker`]).
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

fn run<S: ReactorState>(spec: &ReactorSpec, wake: &WakeState, state: &mut S) -> ReactorStats {
    let mut stats = ReactorStats::default();
    let mut last_work = Instant::now();
    let first = last_work;
    // The start of the last turn, when it did work.
    let mut busy_since: Option<Instant> = None;
    loop {
        if wake.stop.load(Ordering::Relaxed) || state.finished() {
            break;
        }
        let now = Instant::now();
        if let Some(t) = busy_since.take() {
            stats.busy_ns += now.saturating_duration_since(t).as_nanos() as u64;
        }
        stats.turns += 1;
        if state.turn(now) {
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
        wake.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let now = Instant::now();
        if state.turn(now) || wake.stop.load(Ordering::SeqCst) {
            wake.sleeping.store(false, Ordering::SeqCst);
            stats.park_cancels += 1;
            last_work = now;
            continue;
        }
        let mut timeout = spec.max_park;
        if let Some(d) = state.next_deadline() {
            timeout = timeout.min(d.saturating_duration_since(now));
        }
        let waker = ParkWaker {
            fd: wake.efd.as_fd(),
            id: wake.id,
        };
        let woke = match state.park(waker, timeout) {
            Parked::Poll(end) => end,
            Parked::Driver(end) => {
                stats.driver_parks += 1;
                end
            }
            Parked::No => {
                wake.sleeping.store(false, Ordering::SeqCst);
                std::hint::spin_loop();
                continue;
            }
        };
        stats.parks += 1;
        if woke == ParkEnd::Timeout {
            stats.park_timeouts += 1;
        }
        wake.sleeping.store(false, Ordering::SeqCst);
        if woke == ParkEnd::Waker {
            // Drain the eventfd. Only when the park saw it readable: most
            // parks end on network input, and a read that finds nothing
            // is a wasted system call per park. A wake written after the
            // park returned stays in the eventfd and ends the next park at
            // once, so it costs a turn, never a lost wake-up.
            let _ = wake.efd.read();
            stats.waker_reads += 1;
        }
        last_work = Instant::now();
    }
    // Once, not every turn: a busy-polling turn is short.
    stats.run_ns = first.elapsed().as_nanos() as u64;
    stats
}

//! A worker's network reactors (`--worker-handoff on`), DeepRec
//! StarServer's worker path: the compute thread does not turn its
//! connections itself; it hands each exchange's requests to the worker's
//! network reactors through the M:N queue (starwire-queue) and gets the
//! replies back the same way.
//!
//! * The worker's shard connections are partitioned over its reactors:
//!   shard `s` on reactor `s % n`. Each reactor is an [`Endpoint`] whose
//!   [`HandoffService`] holds one [`WorkerService`] (the sans-IO
//!   [`PsClient`](crate::psclient::PsClient) and the map from connection to
//!   shard) per compute thread that hands it requests, all over the same
//!   connections.
//! * [`ComputeEnd::exchange`] splits an exchange by reactor, keeping the
//!   order of each shard's requests (a step's push still leaves before the
//!   next step's pull on its connection), pushes each part to its
//!   reactor's ring and wakes the reactor through its [`ReactorWaker`]: a
//!   reactor parks in its driver's wait (`poll(2)` on its sockets, its
//!   io_uring ring), not on the queue, and the waker's eventcount loses no
//!   wake-up. The reactor starts the part on its next turn and pushes the
//!   replies back as soon as the part's last reply (or its failure) is in.
//! * The compute thread waits on its ring of replies: it spins while its
//!   idle policy says to, then parks on the queue's eventcount, which loses
//!   no wake-up either.
//! * A reactor that ends, whatever ended it, says so to every compute
//!   thread (its service does when it is dropped), so none waits for a
//!   reply that will not come.

use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use starwire_queue::{grid, grid_polling, Consumer, Producer};
use starwire_transport::reactor::{IdlePolicy, Reactor, ReactorSpec, ReactorWaker};
use starwire_transport::{
    ConnConfig, ConnError, ConnId, Connection, Driver, Endpoint, Event, Incoming, Service, Sessions,
};

use starwire_telemetry::Telemetry;

use crate::backend::Backend;
use crate::net::{Exchange, Reply, Request, Traffic, WorkerService};
use crate::telemetry::Published;
use crate::TrainError;

/// Slots of each ring. A compute thread has at most one part in flight
/// per reactor, and a reactor at most one reply per compute thread plus
/// the word that it ended, so two would do.
const RING: usize = 4;

/// How long closing connections may take to send their goodbyes before
/// they are dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// What a compute thread hands a reactor.
#[derive(Debug)]
enum ToReactor {
    /// Part of an exchange of compute thread `lane`: its requests to the
    /// reactor's shards, and buffers for the replies.
    Part {
        lane: usize,
        reqs: Vec<Request>,
        replies: Vec<Reply>,
    },
    /// Compute thread `lane` is done; once every one is, the reactor
    /// closes its connections and ends.
    Close { lane: usize },
}

/// What a reactor hands back to a compute thread.
#[derive(Debug)]
enum FromReactor {
    /// A part is settled: its replies, in the order of its requests.
    Done {
        reactor: usize,
        replies: Vec<Reply>,
        result: Result<(), TrainError>,
        /// Everything this compute thread moved through the reactor so far.
        traffic: Traffic,
    },
    /// The reactor ended.
    Exit { reactor: usize },
}

/// Where a worker's network reactors run and what they serve.
#[derive(Debug, Clone)]
pub struct HandoffConfig {
    /// One per reactor: its CPU and how it idles.
    pub reactors: Vec<ReactorSpec>,
    /// Compute threads handing requests to the reactors.
    pub producers: usize,
    /// How a compute thread waits for its replies.
    pub wait: IdlePolicy,
    /// Whether the reactors' drivers poll (an io_uring ring then receives
    /// in spin mode).
    pub polling: bool,
    /// The settings of every connection.
    pub conn: ConnConfig,
    /// How long the handshakes, and later each request, may take.
    pub timeout: Duration,
    /// Where the reactors publish their drivers' counters.
    pub telemetry: Telemetry,
}

/// One compute thread's [`WorkerService`] on a reactor, and its part.
#[derive(Debug)]
struct Lane {
    service: WorkerService,
    /// A part that waits for the handshakes.
    waiting: Option<(Vec<Request>, Vec<Reply>)>,
    /// A part is in flight.
    active: bool,
    /// The compute thread is done.
    closed: bool,
}

/// The service of one of a worker's network reactors: it takes the parts
/// the compute threads push, sends them on its connections and pushes the
/// replies back. See the module documentation.
#[derive(Debug)]
pub struct HandoffService {
    /// This reactor's position among the worker's reactors.
    reactor: usize,
    rx: Consumer<ToReactor>,
    tx: Producer<FromReactor>,
    /// By compute thread.
    lanes: Vec<Lane>,
    /// Replies their ring had no room for, pushed again at the next turn.
    held: Vec<(usize, FromReactor)>,
    /// Once every compute thread is done: when the connections go,
    /// whether or not they have sent their goodbyes.
    closing: Option<Instant>,
}

impl HandoffService {
    fn new(
        reactor: usize,
        rx: Consumer<ToReactor>,
        tx: Producer<FromReactor>,
        lanes: impl Iterator<Item = WorkerService>,
    ) -> Self {
        Self {
            reactor,
            rx,
            tx,
            lanes: lanes
                .map(|service| Lane {
                    service,
                    waiting: None,
                    active: false,
                    closed: false,
                })
                .collect(),
            held: Vec::new(),
            closing: None,
        }
    }

    fn push(&mut self, lane: usize, m: FromReactor) {
        if let Err(m) = self.tx.push_to(lane, m) {
            self.held.push((lane, m));
        }
    }

    /// Push what was held; true if anything left.
    fn push_held(&mut self) -> bool {
        if self.held.is_empty() {
            return false;
        }
        for (lane, m) in std::mem::take(&mut self.held) {
            self.push(lane, m);
        }
        true
    }

    /// Start lane `l`'s waiting part once its handshakes are done (or
    /// failed). True if it did.
    fn start<D: Driver>(&mut self, l: usize, sessions: &mut Sessions<D>, now: Instant) -> bool {
        let lane = &mut self.lanes[l];
        if lane.active || !lane.service.is_connected_or_failed() {
            return false;
        }
        let Some((reqs, replies)) = lane.waiting.take() else {
            return false;
        };
        // A failure the service holds from before (connecting) fails this
        // part, as it fails the next exchange of a worker that turns its
        // own connections.
        let failed = match lane.service.take_error() {
            Some(e) => Some((replies, e)),
            None => match lane.service.start(sessions, reqs, replies, now) {
                Ok(()) => {
                    lane.active = true;
                    None
                }
                Err(e) => Some((lane.service.finish(), e)),
            },
        };
        if let Some((replies, e)) = failed {
            self.settled(l, replies, Err(e));
        }
        true
    }

    /// Hand back every part that is done or failed.
    fn settle(&mut self) {
        for l in 0..self.lanes.len() {
            let lane = &mut self.lanes[l];
            if !lane.active || !lane.service.is_settled() {
                continue;
            }
            lane.active = false;
            let result = lane.service.take_error().map_or(Ok(()), Err);
            let replies = lane.service.finish();
            self.settled(l, replies, result);
        }
    }

    fn settled(&mut self, l: usize, replies: Vec<Reply>, result: Result<(), TrainError>) {
        let m = FromReactor::Done {
            reactor: self.reactor,
            replies,
            result,
            traffic: self.lanes[l].service.client().traffic(),
        };
        self.push(l, m);
    }

    /// Once every compute thread is done, close every connection; after
    /// [`CLOSE_GRACE`], end those that have not sent their goodbyes.
    fn close<D: Driver>(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        match self.closing {
            None if self.lanes.iter().all(|l| l.closed) => {
                let ids: Vec<ConnId> = sessions.ids().collect();
                for id in ids {
                    if let Some(c) = sessions.conn(id) {
                        c.close();
                    }
                }
                self.closing = Some(now + CLOSE_GRACE);
                true
            }
            Some(t) if now >= t && !sessions.is_empty() => {
                let ids: Vec<ConnId> = sessions.ids().collect();
                for id in ids {
                    sessions.end(id, ConnError::Closed);
                }
                true
            }
            _ => false,
        }
    }
}

impl Drop for HandoffService {
    fn drop(&mut self) {
        for l in 0..self.lanes.len() {
            // The ring has room: it holds at most this reactor's one reply
            // to that compute thread.
            let _ = self.tx.push_to(
                l,
                FromReactor::Exit {
                    reactor: self.reactor,
                },
            );
        }
    }
}

impl<D: Driver> Service<D> for HandoffService {
    fn on_attach(&mut self, id: ConnId, shard: u32, now: Instant) {
        for lane in &mut self.lanes {
            <WorkerService as Service<D>>::on_attach(&mut lane.service, id, shard, now);
        }
    }

    fn on_message(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        now: Instant,
    ) -> Result<(), ConnError> {
        for lane in &mut self.lanes {
            <WorkerService as Service<D>>::on_message(&mut lane.service, id, conn, msg, now)?;
        }
        self.settle();
        Ok(())
    }

    fn on_event(&mut self, id: ConnId, conn: &mut Connection, ev: Event, now: Instant) {
        for lane in &mut self.lanes {
            <WorkerService as Service<D>>::on_event(&mut lane.service, id, conn, ev.clone(), now);
        }
        self.settle();
    }

    fn on_closed(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        error: &ConnError,
        driver: &D,
        now: Instant,
    ) {
        for lane in &mut self.lanes {
            lane.service.on_closed(id, conn, error, driver, now);
        }
        self.settle();
    }

    /// The parts and closes the compute threads pushed, the handshake
    /// deadline, and closing.
    fn poll(&mut self, sessions: &mut Sessions<D>, now: Instant) -> bool {
        let mut busy = self.push_held();
        while let Some(m) = self.rx.pop() {
            busy = true;
            match m {
                ToReactor::Part {
                    lane,
                    reqs,
                    replies,
                } => {
                    if let Some(l) = self.lanes.get_mut(lane) {
                        l.waiting = Some((reqs, replies));
                    }
                }
                ToReactor::Close { lane } => {
                    if let Some(l) = self.lanes.get_mut(lane) {
                        l.closed = true;
                    }
                }
            }
        }
        for l in 0..self.lanes.len() {
            <WorkerService as Service<D>>::poll(&mut self.lanes[l].service, sessions, now);
            busy |= self.start(l, sessions, now);
        }
        self.settle();
        busy | self.close(sessions, now)
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.lanes
            .iter()
            .filter_map(|l| <WorkerService as Service<D>>::next_deadline(&l.service))
            .chain(self.closing)
            .min()
    }

    fn finished(&self) -> bool {
        self.closing.is_some()
    }
}

/// One compute thread's end of the hand-off: an [`Exchange`] over the
/// worker's network reactors. See the module documentation.
#[derive(Debug)]
pub struct ComputeEnd {
    /// This compute thread's index (its lane on every reactor).
    lane: usize,
    tx: Producer<ToReactor>,
    rx: Consumer<FromReactor>,
    wakers: Vec<ReactorWaker>,
    wait: IdlePolicy,
    /// `index[r]`: the positions in the exchange of the requests sent to
    /// reactor `r`.
    index: Vec<Vec<usize>>,
    /// Reply buffers of each reactor's parts, kept between exchanges.
    spare: Vec<Vec<Reply>>,
    /// A part is in flight on reactor `r`.
    pending: Vec<bool>,
    /// What went through each reactor, as it last said.
    traffic: Vec<Traffic>,
    /// Reactor `r` ended.
    gone: Vec<bool>,
    closed: bool,
}

fn ended(r: usize) -> TrainError {
    TrainError::Internal(format!("worker network reactor {r} ended"))
}

impl ComputeEnd {
    /// Wait until every reactor's handshakes are done.
    pub fn connect(&mut self) -> Result<(), TrainError> {
        let mut first_err = None;
        for r in 0..self.wakers.len() {
            if let Err(e) = self.send(r, Vec::new(), Vec::new()) {
                first_err.get_or_insert(e);
            }
        }
        while self.pending.iter().any(|&p| p) {
            if let (_, _, Err(e)) = self.next_done() {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Say to every reactor that this compute thread is done; they close
    /// their connections once every compute thread is.
    pub fn close(&mut self) {
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        for r in 0..self.wakers.len() {
            // The ring has room: nothing else of ours is in it.
            if !self.gone[r]
                && self
                    .tx
                    .push_to(r, ToReactor::Close { lane: self.lane })
                    .is_ok()
            {
                self.wakers[r].wake();
            }
        }
    }

    /// Push a part to reactor `r` and wake it.
    fn send(
        &mut self,
        r: usize,
        reqs: Vec<Request>,
        replies: Vec<Reply>,
    ) -> Result<(), TrainError> {
        if self.closed {
            return Err(TrainError::Internal(
                "the worker's network reactors are closed".into(),
            ));
        }
        if self.gone[r] {
            return Err(ended(r));
        }
        let part = ToReactor::Part {
            lane: self.lane,
            reqs,
            replies,
        };
        if self.tx.push_to(r, part).is_err() {
            return Err(TrainError::Internal(format!(
                "worker network reactor {r}: its ring is full"
            )));
        }
        self.wakers[r].wake();
        self.pending[r] = true;
        Ok(())
    }

    /// The next part settled: its reactor, its replies and its outcome. A
    /// reactor that ended with a part in flight fails that part.
    fn next_done(&mut self) -> (usize, Vec<Reply>, Result<(), TrainError>) {
        loop {
            match self.recv() {
                FromReactor::Done {
                    reactor,
                    replies,
                    result,
                    traffic,
                } => {
                    if let Some(t) = self.traffic.get_mut(reactor) {
                        *t = traffic;
                    }
                    if let Some(p) = self.pending.get_mut(reactor) {
                        *p = false;
                    }
                    return (reactor, replies, result);
                }
                FromReactor::Exit { reactor } => {
                    if let Some(g) = self.gone.get_mut(reactor) {
                        *g = true;
                    }
                    if self.pending.get(reactor) == Some(&true) {
                        self.pending[reactor] = false;
                        return (reactor, Vec::new(), Err(ended(reactor)));
                    }
                }
            }
        }
    }

    /// The next message of a reactor: spin while the wait policy says to,
    /// then park on the ring's eventcount.
    fn recv(&mut self) -> FromReactor {
        let mut idle_since: Option<Instant> = None;
        loop {
            if let Some(m) = self.rx.pop() {
                return m;
            }
            let park = match self.wait {
                IdlePolicy::BusyPoll => false,
                IdlePolicy::PollThenPark(d) => {
                    let now = Instant::now();
                    now.duration_since(*idle_since.get_or_insert(now)) >= d
                }
                IdlePolicy::Park => true,
            };
            if park {
                self.rx.park();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Exchange for ComputeEnd {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        let n = self.wakers.len();
        let Some(first) = reqs.first().map(|q| q.shard % n) else {
            replies.clear();
            return Ok(());
        };
        if reqs.iter().all(|q| q.shard % n == first) {
            // One reactor's part is the whole exchange, replies in order.
            self.send(first, reqs, std::mem::take(replies))?;
            let (_, part, result) = self.next_done();
            *replies = part;
            return result;
        }
        let total = reqs.len();
        let mut parts: Vec<Vec<Request>> = (0..n).map(|_| Vec::new()).collect();
        self.index.iter_mut().for_each(Vec::clear);
        for (i, q) in reqs.into_iter().enumerate() {
            let r = q.shard % n;
            self.index[r].push(i);
            parts[r].push(q);
        }
        let mut first_err = None;
        for (r, part) in parts.into_iter().enumerate() {
            if part.is_empty() {
                continue;
            }
            let spare = std::mem::take(&mut self.spare[r]);
            if let Err(e) = self.send(r, part, spare) {
                first_err.get_or_insert(e);
            }
        }
        replies.truncate(total);
        replies.resize_with(total, Reply::default);
        while self.pending.iter().any(|&p| p) {
            let (r, mut part, result) = self.next_done();
            for (&i, src) in self.index[r].iter().zip(part.iter_mut()) {
                std::mem::swap(&mut replies[i], src);
            }
            self.spare[r] = part;
            if let Err(e) = result {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn traffic(&self) -> Traffic {
        self.traffic
            .iter()
            .fold(Traffic::default(), |a, t| Traffic {
                sent: a.sent + t.sent,
                received: a.received + t.received,
                requests: a.requests + t.requests,
            })
    }
}

/// The state of one network reactor: its endpoint, or none when its
/// driver failed to start (the reactor then finishes at once).
type NetworkState<D> = Published<D, HandoffService>;

/// A worker's running network reactors. Dropping them stops them.
#[derive(Debug)]
pub struct NetworkReactors<D: Driver + Send + 'static> {
    reactors: Vec<Reactor<NetworkState<D>>>,
}

impl<D: Driver + Send + 'static> NetworkReactors<D> {
    /// How many.
    pub fn len(&self) -> usize {
        self.reactors.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.reactors.is_empty()
    }

    /// Wait for every reactor to end: each does once every compute end
    /// has closed ([`ComputeEnd::close`]) and its connections are closed.
    pub fn join(mut self) -> Result<(), TrainError> {
        let mut first_err = None;
        for r in self.reactors.drain(..) {
            if let Err(e) = r.join() {
                first_err
                    .get_or_insert(TrainError::Internal(format!("worker network reactor: {e}")));
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl<D: Driver + Send + 'static> Drop for NetworkReactors<D> {
    fn drop(&mut self) {
        for r in self.reactors.drain(..) {
            // A reactor that panicked has nothing left to stop.
            let _ = r.stop();
        }
    }
}

/// Start a worker's network reactors over `streams` (shard `s`'s
/// connection at position `s`, dialed), shard `s` on reactor
/// `s % cfg.reactors.len()`: one [`ComputeEnd`] per compute thread
/// (`cfg.producers`), to move to its thread, and the reactors. Each
/// reactor makes its driver on its own thread.
pub fn spawn<K: Backend>(
    streams: Vec<TcpStream>,
    cfg: &HandoffConfig,
) -> Result<(Vec<ComputeEnd>, NetworkReactors<K::Driver>), TrainError> {
    let n = cfg.reactors.len();
    if n == 0 || cfg.producers == 0 {
        return Err(TrainError::Config(
            "a worker's hand-off needs at least one network reactor and one compute thread".into(),
        ));
    }
    let shards = streams.len();
    let mut mine: Vec<Vec<(usize, TcpStream)>> = (0..n).map(|_| Vec::new()).collect();
    for (s, stream) in streams.into_iter().enumerate() {
        mine[s % n].push((s, stream));
    }
    // The reactors park on their eventfds, not on the queue, and are woken
    // through their wakers: their rings need no wake-up check.
    let (req_tx, req_rx) = grid_polling::<ToReactor>(cfg.producers, n, RING);
    let (rep_tx, rep_rx) = if cfg.wait == IdlePolicy::BusyPoll {
        grid_polling::<FromReactor>(n, cfg.producers, RING)
    } else {
        grid::<FromReactor>(n, cfg.producers, RING)
    };
    let mut reactors = NetworkReactors {
        reactors: Vec::with_capacity(n),
    };
    for (r, ((streams, rx), tx)) in mine.into_iter().zip(req_rx).zip(rep_tx).enumerate() {
        let spec = cfg.reactors[r].clone();
        let (conn, polling, timeout, lanes) =
            (cfg.conn.clone(), cfg.polling, cfg.timeout, cfg.producers);
        let telemetry = cfg.telemetry.clone();
        let (btx, brx) = mpsc::sync_channel(1);
        let reactor = Reactor::spawn(spec, move |_| {
            let made = (|| {
                let driver = K::driver(polling).map_err(|e| e.to_string())?;
                let now = Instant::now();
                let shards_here: Vec<usize> = streams.iter().map(|(s, _)| *s).collect();
                let services = (0..lanes).map(|_| {
                    WorkerService::for_shards(shards, shards_here.iter().copied(), timeout, now)
                });
                let service = HandoffService::new(r, rx, tx, services);
                let mut endpoint = Endpoint::new(driver, service, conn);
                for (s, stream) in streams {
                    endpoint
                        .attach_stream(stream, s as u32, now)
                        .map_err(|e| e.to_string())?;
                }
                Ok::<_, String>(endpoint)
            })();
            let _ = btx.send(made.as_ref().map(|_| ()).map_err(Clone::clone));
            Published::new(made.ok(), &telemetry, K::NAME)
        })
        .map_err(|e| TrainError::Internal(format!("starting a worker network reactor: {e}")))?;
        reactors.reactors.push(reactor);
        brx.recv()
            .map_err(|_| TrainError::Internal("a worker network reactor died starting".into()))?
            .map_err(|e| TrainError::Backend(K::NAME, e))?;
    }
    let wakers: Vec<ReactorWaker> = reactors.reactors.iter().map(Reactor::waker).collect();
    let ends = req_tx
        .into_iter()
        .zip(rep_rx)
        .enumerate()
        .map(|(lane, (tx, rx))| ComputeEnd {
            lane,
            tx,
            rx,
            wakers: wakers.clone(),
            wait: cfg.wait,
            index: vec![Vec::new(); n],
            spare: (0..n).map(|_| Vec::new()).collect(),
            pending: vec![false; n],
            traffic: vec![Traffic::default(); n],
            gone: vec![false; n],
            closed: false,
        })
        .collect();
    Ok((ends, reactors))
}

/// A worker's [`Exchange`] through its network reactors: one compute
/// thread's end and the reactors, connected.
#[derive(Debug)]
pub struct HandoffNet<D: Driver + Send + 'static> {
    end: ComputeEnd,
    reactors: Option<NetworkReactors<D>>,
}

impl<D: Driver + Send + 'static> HandoffNet<D> {
    /// Start the reactors of `cfg` (one compute thread) over `streams` as
    /// [`spawn`] does, and wait for every handshake.
    pub fn connect<K: Backend<Driver = D>>(
        streams: Vec<TcpStream>,
        cfg: &HandoffConfig,
    ) -> Result<Self, TrainError> {
        let cfg = HandoffConfig {
            producers: 1,
            ..cfg.clone()
        };
        let (mut ends, reactors) = spawn::<K>(streams, &cfg)?;
        let mut end = ends
            .pop()
            .ok_or_else(|| TrainError::Internal("no compute end".into()))?;
        end.connect()?;
        Ok(Self {
            end,
            reactors: Some(reactors),
        })
    }

    /// Close every connection politely and wait for the reactors to end.
    pub fn close(&mut self) {
        self.end.close();
        if let Some(r) = self.reactors.take() {
            if let Err(e) = r.join() {
                tracing::warn!("closing a worker's network reactors: {e}");
            }
        }
    }
}

impl<D: Driver + Send + 'static> Exchange for HandoffNet<D> {
    fn exchange(&mut self, reqs: Vec<Request>, replies: &mut Vec<Reply>) -> Result<(), TrainError> {
        self.end.exchange(reqs, replies)
    }

    fn traffic(&self) -> Traffic {
        self.end.traffic()
    }
}

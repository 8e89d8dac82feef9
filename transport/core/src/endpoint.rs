//! [`Endpoint`]: the session layer every role runs on.
//!
//! An endpoint is one [`Driver`] with the message layer of every
//! connection on it ([`Sessions`]) and a [`Service`]: the role's logic (a
//! PS shard, a worker's client, a load generator). The endpoint does the
//! plumbing that is the same for every role:
//!
//! * it attaches the streams the [`Acceptor`](crate::accept::Acceptor)
//!   routes to it (its inbox, [`Endpoint::with_inbox`]) or that the caller
//!   dialed ([`Endpoint::attach_stream`]), and starts their handshake;
//! * it turns the sessions with the caller's `now` ([`Endpoint::turn`]):
//!   what the service initiates, one receive pass with each message to the
//!   service, timers, one submission; then the events of every
//!   connection, and the connections that ended, to the service;
//! * it ends a connection whose peer said goodbye, or which the service
//!   found breaking its protocol ([`Service::on_message`] returns the
//!   reason);
//! * it parks the way its driver says ([`Endpoint::park`]).
//!
//! An endpoint is a [`ReactorState`], so a [`Reactor`](crate::reactor::Reactor)
//! can own it, and a thread that is not a reactor (a worker's compute
//! thread) turns it itself ([`Endpoint::run_until`]). The handshake and the
//! request deadlines are [`Connection`]'s; the endpoint's timers are the
//! sessions' and the service's ([`Service::next_deadline`]).

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use starwire_queue::Consumer;

use crate::accept::{ConnPermit, Routed};
use crate::auth::Side;
use crate::connection::{ConnConfig, ConnError, Connection, Event, Incoming};
use crate::driver::{ConnId, Driver, StreamDriver};
use crate::reactor::{park_driver, IdlePolicy, ParkWaker, Parked, ReactorState, ReactorWaker};
use crate::session::Sessions;
use crate::transport::TransportError;

/// A role's logic over the connections of an [`Endpoint`]. Every method
/// gets the endpoint's `now`; none does I/O.
pub trait Service<D: Driver> {
    /// Connection `id` is new: a stream routed to the endpoint, or
    /// attached by its owner, for `shard`. Its handshake is queued.
    fn on_attach(&mut self, _id: ConnId, _shard: u32, _now: Instant) {}

    /// A message on connection `id`; answers are queued on `conn`. An
    /// error ends the connection (its peer broke the role's protocol):
    /// the rest of the turn's messages on it are dropped, and it comes
    /// back through [`on_closed`](Self::on_closed) with that reason.
    fn on_message(
        &mut self,
        id: ConnId,
        conn: &mut Connection,
        msg: Incoming<'_>,
        now: Instant,
    ) -> Result<(), ConnError>;

    /// An event of connection `id` (the handshake completed, the peer said
    /// goodbye, a request of ours failed).
    fn on_event(&mut self, _id: ConnId, _conn: &mut Connection, _ev: Event, _now: Instant) {}

    /// Connection `id` ended: it failed, its peer closed it (a goodbye,
    /// [`ConnError::Closed`], after [`Event::PeerClosed`]) or the service
    /// ended it. `conn` holds its last state and its remaining
    /// events (the requests that failed with it); it is still attached to
    /// `driver`, whose counters for it can be read, and goes when this
    /// returns.
    fn on_closed(
        &mut self,
        _id: ConnId,
        _conn: &mut Connection,
        _error: &ConnError,
        _driver: &D,
        _now: Instant,
    ) {
    }

    /// At the start of every turn: what the role initiates (requests,
    /// replies held back, timeouts of its own, closing). Frames it queues
    /// leave in the same turn. Returns true when it did work.
    fn poll(&mut self, _sessions: &mut Sessions<D>, _now: Instant) -> bool {
        false
    }

    /// The earliest instant [`poll`](Self::poll) has timer work, if any.
    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    /// True when the role is done; a reactor then stops once every
    /// connection has sent what it queued.
    fn finished(&self) -> bool {
        false
    }
}

/// How an endpoint's driver makes a routed stream one of its connections.
type AttachFn<D> = Box<dyn FnMut(&mut D, TcpStream) -> Result<ConnId, TransportError> + Send>;

/// The routed streams of one endpoint, and how its driver attaches one.
struct Inbox<D> {
    rx: Consumer<Routed>,
    attach: AttachFn<D>,
}

impl<D> std::fmt::Debug for Inbox<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("rx", &self.rx)
            .finish_non_exhaustive()
    }
}

/// One driver, its sessions and a [`Service`]. See the module
/// documentation.
#[derive(Debug)]
pub struct Endpoint<D, S> {
    sessions: Sessions<D>,
    service: S,
    cfg: ConnConfig,
    inbox: Option<Inbox<D>>,
    /// Connections the service ended in the current turn, with why.
    ended: Vec<(ConnId, ConnError)>,
    /// When the service finished, if it has: what is still queued then
    /// gets [`LINGER`] to leave.
    finished_at: Option<Instant>,
    /// The linger ran out with bytes still queued (a peer that stopped
    /// reading): the endpoint finishes without them.
    lingered: bool,
    /// By [`ConnId::index`]: who dialed a routed connection, and its
    /// place among the task's open connections (given back when it ends).
    routed: Vec<Option<(SocketAddr, ConnPermit)>>,
}

/// How long a finished endpoint waits for its connections to send what
/// they queued (as `SO_LINGER` bounds a close): a peer that stopped
/// reading must not hold a finished reactor forever.
pub const LINGER: Duration = Duration::from_secs(5);

impl<D: Driver, S: Service<D>> Endpoint<D, S> {
    /// No connections yet on `driver`; each one gets `cfg`.
    pub fn new(driver: D, service: S, cfg: ConnConfig) -> Self {
        Self {
            sessions: Sessions::new(driver),
            service,
            cfg,
            inbox: None,
            ended: Vec::new(),
            finished_at: None,
            lingered: false,
            routed: Vec::new(),
        }
    }

    /// Take the streams an [`Acceptor`](crate::accept::Acceptor) routes
    /// here from `rx` (this endpoint's ring of
    /// [`inboxes`](crate::accept::inboxes)), attaching them at the start
    /// of each turn. Each is attached as the accepting end, with the
    /// endpoint's cluster token ([`StreamDriver::attach_stream_as`]).
    pub fn with_inbox(self, rx: Consumer<Routed>) -> Self
    where
        D: StreamDriver + 'static,
    {
        let token = self.cfg.token.clone();
        self.with_inbox_attach(rx, move |d: &mut D, s| {
            d.attach_stream_as(s, Side::Acceptor, token.as_ref())
        })
    }

    /// Like [`with_inbox`](Self::with_inbox), for a driver that is not a
    /// [`StreamDriver`] or whose connections need more than a stream (a
    /// fault injector around each link): `attach` makes each routed stream
    /// a connection of the driver.
    pub fn with_inbox_attach(
        mut self,
        rx: Consumer<Routed>,
        attach: impl FnMut(&mut D, TcpStream) -> Result<ConnId, TransportError> + Send + 'static,
    ) -> Self {
        self.inbox = Some(Inbox {
            rx,
            attach: Box::new(attach),
        });
        self
    }

    /// Attach `stream` (dialed by the caller) as a connection for `shard`:
    /// the dialing end, with the endpoint's cluster token
    /// ([`StreamDriver::attach_stream_as`]).
    pub fn attach_stream(
        &mut self,
        stream: TcpStream,
        shard: u32,
        now: Instant,
    ) -> Result<ConnId, TransportError>
    where
        D: StreamDriver,
    {
        let token = self.cfg.token.as_ref();
        let id = self
            .sessions
            .driver_mut()
            .attach_stream_as(stream, Side::Dialer, token)?;
        self.open(id, shard, now);
        Ok(id)
    }

    /// Start connection `id`, which the caller attached to the driver
    /// (through [`sessions_mut`](Self::sessions_mut)), for `shard`: its
    /// handshake is queued and the service told.
    pub fn open(&mut self, id: ConnId, shard: u32, now: Instant) {
        self.start(id, self.cfg.clone(), now);
        self.service.on_attach(id, shard, now);
    }

    /// Start the message layer of `id` with `cfg`, its handshake timed.
    fn start(&mut self, id: ConnId, cfg: crate::connection::ConnConfig, now: Instant) {
        let timeout = cfg.handshake_timeout;
        self.sessions.insert(id, cfg);
        if let (Some(t), Some(c)) = (timeout, self.sessions.conn(id)) {
            c.set_handshake_deadline(now + t);
        }
    }

    /// The service.
    pub fn service(&self) -> &S {
        &self.service
    }

    /// The service, mutably.
    pub fn service_mut(&mut self) -> &mut S {
        &mut self.service
    }

    /// The sessions (and through them the driver).
    pub fn sessions(&self) -> &Sessions<D> {
        &self.sessions
    }

    /// The sessions, mutably.
    pub fn sessions_mut(&mut self) -> &mut Sessions<D> {
        &mut self.sessions
    }

    /// The service and the sessions at once: for a service method that
    /// queues on connections outside a turn (an exchange a worker starts).
    pub fn parts_mut(&mut self) -> (&mut S, &mut Sessions<D>) {
        (&mut self.service, &mut self.sessions)
    }

    /// The service and the sessions, the endpoint taken apart.
    pub fn into_parts(self) -> (S, Sessions<D>) {
        (self.service, self.sessions)
    }

    /// One turn at `now`: attach the routed streams, let the service
    /// initiate, one receive pass (each message to the service), timers,
    /// one submission; then the events and the ended connections to the
    /// service. Returns true when it did work.
    pub fn turn(&mut self, now: Instant) -> bool {
        let mut busy = self.take_routed(now);
        busy |= self.service.poll(&mut self.sessions, now);
        let Self {
            sessions,
            service,
            ended,
            ..
        } = self;
        busy |= sessions
            .turn(now, &mut |id, conn, msg| {
                // A connection the service ended hears nothing more.
                if ended.iter().any(|(e, _)| *e == id) {
                    return;
                }
                if let Err(e) = service.on_message(id, conn, msg, now) {
                    ended.push((id, e));
                }
            })
            .busy();
        busy |= self.settle(now);
        self.watch_linger(now);
        busy
    }

    /// Start the linger when the service finishes; end it when it runs
    /// out with bytes still queued.
    fn watch_linger(&mut self, now: Instant) {
        if !self.service.finished() || self.lingered {
            return;
        }
        let since = *self.finished_at.get_or_insert(now);
        if now.saturating_duration_since(since) >= LINGER && !self.sessions.is_drained() {
            tracing::warn!(
                connections = self.sessions.len(),
                "finished with bytes still queued after {LINGER:?}: a peer stopped reading"
            );
            self.lingered = true;
        }
    }

    /// Send what the service queued outside a turn, without receiving:
    /// timers, each connection's frames, one submission. Connections that
    /// fail doing so go to the service. Returns true when it did work.
    pub fn flush(&mut self, now: Instant) -> bool {
        let sent = self.sessions.flush(now).busy();
        sent | self.settle(now)
    }

    /// Close every connection politely (a `Goodbye` each) and send what is
    /// queued.
    pub fn close_all(&mut self, now: Instant) {
        let ids: Vec<ConnId> = self.sessions.ids().collect();
        for id in ids {
            if let Some(c) = self.sessions.conn(id) {
                c.close();
            }
        }
        self.flush(now);
    }

    /// The earliest instant a turn has timer work: the sessions' or the
    /// service's.
    pub fn next_deadline(&self) -> Option<Instant> {
        let linger = self
            .finished_at
            .filter(|_| !self.lingered)
            .map(|t| t + LINGER);
        [
            self.sessions.poll_timeout(),
            self.service.next_deadline(),
            linger,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Wait the way the driver says until `waker` is readable, input
    /// arrives, or `timeout`.
    pub fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        park_driver(self.sessions.driver_mut(), waker, timeout)
    }

    /// True once the service is finished and every connection has sent
    /// what it queued, or [`LINGER`] passed since it finished.
    pub fn is_finished(&self) -> bool {
        self.service.finished() && (self.lingered || self.sessions.is_drained())
    }

    /// Turn on the calling thread, which is not a reactor, until
    /// `done(service)`: between turns that move nothing it spins or parks
    /// as `idle` says, a park ending on input, on the next deadline or
    /// after `max_park`. `waker` is what a park also waits on.
    pub fn run_until(
        &mut self,
        waker: &ReactorWaker,
        idle: IdlePolicy,
        max_park: Duration,
        mut done: impl FnMut(&S) -> bool,
    ) {
        let mut last_work = Instant::now();
        while !done(&self.service) {
            let now = Instant::now();
            if self.turn(now) {
                last_work = now;
                continue;
            }
            let park = match idle {
                IdlePolicy::BusyPoll => false,
                IdlePolicy::PollThenPark(d) => now.duration_since(last_work) >= d,
                IdlePolicy::Park => true,
            };
            if !park || done(&self.service) {
                std::hint::spin_loop();
                continue;
            }
            let timeout = self
                .next_deadline()
                .map_or(max_park, |t| t.saturating_duration_since(now).min(max_park));
            if self.park(waker.park_waker(), timeout) == Parked::No {
                std::hint::spin_loop();
            }
        }
    }

    /// Attach the streams routed here; true if there were any.
    fn take_routed(&mut self, now: Instant) -> bool {
        let mut any = false;
        while let Some(inbox) = self.inbox.as_mut() {
            let Some(r) = inbox.rx.pop() else {
                break;
            };
            any = true;
            let attached = (inbox.attach)(self.sessions.driver_mut(), r.stream);
            match attached {
                Ok(id) => {
                    let mut cfg = self.cfg.clone();
                    cfg.side = Side::Acceptor;
                    let i = id.index();
                    if self.routed.len() <= i {
                        self.routed.resize_with(i + 1, || None);
                    }
                    self.routed[i] = Some((r.peer, r.permit));
                    self.start(id, cfg, now);
                    self.service.on_attach(id, r.shard, now);
                }
                Err(e) => {
                    tracing::warn!(peer = %r.peer, shard = r.shard, "attaching a connection: {e}");
                }
            }
        }
        any
    }

    /// After a receive pass or a submission: end what the service ended,
    /// hand out the events (a peer's goodbye ends its connection: nothing
    /// more comes from it, and nothing sent would be read), then the
    /// connections that ended. True when a connection ended.
    fn settle(&mut self, now: Instant) -> bool {
        let Self {
            sessions,
            service,
            ended,
            routed,
            ..
        } = self;
        for (id, why) in ended.drain(..) {
            sessions.end(id, why);
        }
        sessions.poll_events(&mut |id, conn, ev| {
            if matches!(ev, Event::PeerClosed) {
                ended.push((id, ConnError::Closed));
            }
            service.on_event(id, conn, ev, now);
        });
        for (id, why) in ended.drain(..) {
            sessions.end(id, why);
        }
        let mut closed = false;
        while let Some(id) = sessions.poll_failed_with(|id, conn, error, driver| {
            if conn.peer().is_none() {
                if let Some(Some((peer, _))) = routed.get(id.index()) {
                    refused(peer, error);
                }
            }
            service.on_closed(id, conn, error, driver, now);
            id
        }) {
            // Its place among the task's connections is free again.
            if let Some(r) = routed.get_mut(id.index()) {
                *r = None;
            }
            closed = true;
        }
        closed
    }
}

/// Log a routed connection that ended before its handshake completed: at
/// warn when it failed to authenticate or to agree, with who dialed.
fn refused(peer: &SocketAddr, error: &ConnError) {
    match error {
        ConnError::Unauthenticated(_)
        | ConnError::FlagsDiffer(_)
        | ConnError::TimedOut(_)
        | ConnError::Handshake(_) => {
            tracing::warn!(%peer, "closed a connection before serving it: {error}");
        }
        _ => tracing::debug!(%peer, "connection ended during its handshake: {error}"),
    }
}

impl<D, S> ReactorState for Endpoint<D, S>
where
    D: Driver + Send,
    S: Service<D> + Send,
{
    fn turn(&mut self, now: Instant) -> bool {
        Endpoint::turn(self, now)
    }

    fn next_deadline(&self) -> Option<Instant> {
        Endpoint::next_deadline(self)
    }

    fn finished(&self) -> bool {
        self.is_finished()
    }

    fn park(&mut self, waker: ParkWaker<'_>, timeout: Duration) -> Parked {
        Endpoint::park(self, waker, timeout)
    }
}

#[cfg(test)]
mod tests {
    use starwire_wire::{Opcode, Status};

    use super::*;
    use crate::connection::{Payload, PeerInfo, TaskRole};
    use crate::driver::Links;
    use crate::testing::MemTransport;

    type Mem = Links<MemTransport>;

    fn config(role: TaskRole) -> ConnConfig {
        ConnConfig::new(PeerInfo {
            role,
            job: "t".into(),
            task_index: 0,
            incarnation: 1,
            shards: 1,
        })
    }

    /// Echoes requests; a request with opcode `Tensors` breaks its
    /// protocol. Records what the endpoint told it.
    #[derive(Debug, Default)]
    struct Echo {
        attached: Vec<(ConnId, u32)>,
        connected: Vec<ConnId>,
        closed: Vec<(ConnId, String)>,
        served: usize,
    }

    impl Service<Mem> for Echo {
        fn on_attach(&mut self, id: ConnId, shard: u32, _now: Instant) {
            self.attached.push((id, shard));
        }
        fn on_message(
            &mut self,
            _id: ConnId,
            conn: &mut Connection,
            msg: Incoming<'_>,
            _now: Instant,
        ) -> Result<(), ConnError> {
            let Incoming::Request {
                id, opcode, body, ..
            } = msg
            else {
                return Ok(());
            };
            if opcode == Opcode::Tensors {
                return Err(ConnError::Protocol("tensors are not served here"));
            }
            self.served += 1;
            conn.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()))
                .map_err(|_| ConnError::Protocol("reply not queued"))
        }
        fn on_event(&mut self, id: ConnId, _conn: &mut Connection, ev: Event, _now: Instant) {
            if matches!(ev, Event::Connected(_)) {
                self.connected.push(id);
            }
        }
        fn on_closed(
            &mut self,
            id: ConnId,
            conn: &mut Connection,
            error: &ConnError,
            driver: &Mem,
            _now: Instant,
        ) {
            assert!(conn.is_closed());
            assert!(
                driver.link(id).is_some(),
                "detached before the service saw it"
            );
            self.closed.push((id, error.to_string()));
        }
    }

    /// Sends one request per connection per `poll`, counting replies;
    /// finished after `want` replies.
    #[derive(Debug, Default)]
    struct Asker {
        opcode: Option<Opcode>,
        asked: usize,
        answered: usize,
        want: usize,
    }

    impl<D: Driver> Service<D> for Asker {
        fn on_message(
            &mut self,
            _id: ConnId,
            _conn: &mut Connection,
            msg: Incoming<'_>,
            _now: Instant,
        ) -> Result<(), ConnError> {
            if let Incoming::Response { status, body, .. } = msg {
                assert_eq!(status, Status::Ok);
                assert_eq!(body, b"ping");
                self.answered += 1;
            }
            Ok(())
        }
        fn poll(&mut self, sessions: &mut Sessions<D>, _now: Instant) -> bool {
            let Some(op) = self.opcode.take() else {
                return false;
            };
            let ids: Vec<ConnId> = sessions.ids().collect();
            for id in ids {
                if let Some(c) = sessions.conn(id) {
                    c.request(op, 0, Payload::from(b"ping".to_vec()), None)
                        .expect("queued");
                    self.asked += 1;
                }
            }
            true
        }
        fn finished(&self) -> bool {
            self.answered >= self.want
        }
    }

    /// Two endpoints joined by `n` in-memory links.
    fn pair(n: usize) -> (Endpoint<Mem, Asker>, Endpoint<Mem, Echo>) {
        let now = Instant::now();
        let mut a = Endpoint::new(Links::new(1024), Asker::default(), config(TaskRole::Worker));
        let mut b = Endpoint::new(Links::new(1024), Echo::default(), config(TaskRole::Ps));
        for s in 0..n {
            let (la, lb) = MemTransport::pair(1024, 16);
            let ia = a.sessions_mut().driver_mut().attach(la);
            a.open(ia, s as u32, now);
            let ib = b.sessions_mut().driver_mut().attach(lb);
            b.open(ib, s as u32, now);
        }
        (a, b)
    }

    fn turns(a: &mut Endpoint<Mem, Asker>, b: &mut Endpoint<Mem, Echo>, rounds: usize) {
        let now = Instant::now();
        for _ in 0..rounds {
            a.turn(now);
            b.turn(now);
        }
    }

    #[test]
    fn requests_the_service_initiates_are_answered_on_every_connection() {
        let (mut a, mut b) = pair(3);
        let ids: Vec<ConnId> = (0..3).map(ConnId::new).collect();
        assert_eq!(
            b.service().attached,
            ids.iter()
                .map(|&id| (id, id.index() as u32))
                .collect::<Vec<_>>()
        );
        turns(&mut a, &mut b, 3);
        assert_eq!(b.service().connected, ids, "handshakes as events");
        a.service_mut().opcode = Some(Opcode::Rpc);
        a.service_mut().want = 3;
        assert!(!a.is_finished());
        turns(&mut a, &mut b, 3);
        assert_eq!((a.service().asked, a.service().answered), (3, 3));
        assert_eq!(b.service().served, 3);
        assert!(a.is_finished(), "finished and drained");
        assert!(b.service().closed.is_empty());
    }

    #[test]
    fn a_connection_the_service_ends_goes_alone_and_its_peer_sees_it() {
        let (mut a, mut b) = pair(2);
        turns(&mut a, &mut b, 3);
        // A bad request on connection 1 only.
        let c1 = ConnId::new(1);
        a.sessions_mut()
            .conn(c1)
            .expect("held")
            .request(Opcode::Tensors, 0, Payload::empty(), None)
            .expect("queued");
        a.service_mut().opcode = Some(Opcode::Rpc);
        a.service_mut().want = 1;
        turns(&mut a, &mut b, 4);
        let closed = &b.service().closed;
        assert_eq!(closed.len(), 1, "{closed:?}");
        assert_eq!(closed[0].0, c1);
        assert!(closed[0].1.contains("tensors are not served"), "{closed:?}");
        assert_eq!(b.sessions().len(), 1);
        assert!(b.sessions().driver().link(c1).is_none(), "not detached");
        // Its peer lost it; the other connection was answered.
        assert_eq!(a.sessions().len(), 1);
        assert_eq!(a.service().answered, 1);
        // The request queued behind the bad one on connection 1 was never
        // served.
        assert_eq!(b.service().served, 1);
    }

    #[test]
    fn a_finished_endpoint_lingers_for_a_peer_that_stopped_reading_then_goes() {
        let now = Instant::now();
        let mut a = Endpoint::new(Links::new(1024), Asker::default(), config(TaskRole::Worker));
        // One frame in flight at most, and the peer never reads: the
        // handshake fills the link and the goodbye stays queued.
        let (la, _silent_peer) = MemTransport::pair(1024, 1);
        let id = a.sessions_mut().driver_mut().attach(la);
        a.open(id, 0, now);
        a.turn(now);
        a.sessions_mut().conn(id).expect("held").close();
        a.turn(now);
        assert!(
            Service::<Mem>::finished(a.service()),
            "want 0: done at once"
        );
        assert!(!a.is_finished(), "bytes still queued");
        assert_eq!(a.next_deadline(), Some(now + LINGER));
        a.turn(now + LINGER - Duration::from_millis(1));
        assert!(!a.is_finished(), "still lingering");
        a.turn(now + LINGER);
        assert!(a.is_finished(), "the linger ran out");
        assert_eq!(a.next_deadline(), None);
    }

    #[test]
    fn close_all_says_goodbye_to_every_peer() {
        let (mut a, mut b) = pair(2);
        turns(&mut a, &mut b, 3);
        a.close_all(Instant::now());
        turns(&mut a, &mut b, 2);
        let closed = &b.service().closed;
        assert_eq!(closed.len(), 2, "{closed:?}");
        assert!(
            closed.iter().all(|(_, e)| e == "connection closed"),
            "{closed:?}"
        );
        assert!(b.sessions().is_empty());
        // The links went with them, so the closing end lets go too.
        turns(&mut a, &mut b, 1);
        assert!(a.sessions().is_empty());
    }

    /// A stream driver that records how each stream was attached.
    #[derive(Debug, Default)]
    struct Sides {
        attached: Vec<(Side, Option<String>)>,
    }

    impl Driver for Sides {
        fn max_frame_len(&self) -> usize {
            1024
        }
        fn tx_reserve(
            &mut self,
            _conn: ConnId,
            _len: usize,
        ) -> Result<Option<&mut [u8]>, TransportError> {
            Ok(None)
        }
        fn tx_commit(&mut self, _conn: ConnId, _len: usize) {}
        fn tx_pending(&self, _conn: ConnId) -> bool {
            false
        }
        fn rx_burst(
            &mut self,
            _now: Instant,
            _max: usize,
            _sink: &mut dyn FnMut(ConnId, &[u8]),
        ) -> usize {
            0
        }
        fn flush(&mut self, _now: Instant) -> bool {
            false
        }
        fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
            None
        }
        fn detach(&mut self, _conn: ConnId) {}
        fn sleep(&self) -> crate::driver::Sleep {
            crate::driver::Sleep::Never
        }
    }

    impl StreamDriver for Sides {
        fn attach_stream(&mut self, _stream: TcpStream) -> Result<ConnId, TransportError> {
            unreachable!("the endpoint says which end it attaches")
        }
        fn attach_stream_as(
            &mut self,
            _stream: TcpStream,
            side: Side,
            token: Option<&crate::ClusterToken>,
        ) -> Result<ConnId, TransportError> {
            self.attached.push((side, token.map(|t| format!("{t:?}"))));
            Ok(ConnId::new(self.attached.len() as u32 - 1))
        }
    }

    #[test]
    fn a_dialed_stream_is_attached_as_the_dialer_with_the_endpoints_token() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let now = Instant::now();
        let token = crate::ClusterToken::new(b"0123456789abcdef-secret").unwrap();
        let mut cfg = config(TaskRole::Worker);
        cfg.token = Some(token.clone());
        let mut ep = Endpoint::new(Sides::default(), Asker::default(), cfg);
        ep.attach_stream(TcpStream::connect(addr).unwrap(), 0, now)
            .unwrap();
        let mut ep2 = Endpoint::new(Sides::default(), Asker::default(), config(TaskRole::Worker));
        ep2.attach_stream(TcpStream::connect(addr).unwrap(), 0, now)
            .unwrap();
        assert_eq!(
            ep.sessions().driver().attached,
            [(Side::Dialer, Some(format!("{token:?}")))]
        );
        assert_eq!(ep2.sessions().driver().attached, [(Side::Dialer, None)]);
    }
}

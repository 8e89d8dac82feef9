//! The driver contract: one driver per reactor serves every connection of
//! that reactor.
//!
//! Kernel-bypass hardware is per core: an io_uring ring, a DPDK rx/tx queue
//! pair and an RDMA completion queue each serve many connections of one
//! core. A [`Driver`] is that per-core object. A connection is a
//! [`ConnId`], a handle on its driver; the driver owns everything the
//! connection's bytes pass through (its socket or queue pair, its buffers).
//!
//! One reactor turn is one receive pass and one submission:
//! [`Driver::rx_burst`] lends the frames that arrived on any connection,
//! tagged with their connection; the message layer queues what it answers
//! through [`Driver::tx`]; [`Driver::flush`] hands everything queued on
//! every connection to the wire at once (one `io_uring_enter`, one
//! doorbell, one `tx_burst`). Failures of single connections are reported
//! by [`Driver::poll_failure`] and end only that connection.
//!
//! How an idle reactor waits is the driver's to say ([`Driver::sleep`]):
//! on file descriptors with `poll(2)` (TCP sockets), inside a wait of its
//! own (an io_uring ring's `io_uring_enter`), or not at all (a DPDK
//! virtual device has no receive interrupt: its reactor busy-polls).
//!
//! Drivers whose connections are independent point-to-point links (TCP
//! sockets, the in-memory pairs of tests) are [`Links`] of a [`Transport`].

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::auth::{ClusterToken, Side};
use crate::reactor::{ParkEnd, ParkWaker};
use crate::transport::{copy_gather, gather_len, Transport, TransportError};

/// A connection's handle on its driver. Valid from the driver's `attach`
/// until [`Driver::detach`]; the driver may reuse the number afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u32);

impl ConnId {
    /// The handle of slot `index`.
    pub const fn new(index: u32) -> Self {
        Self(index)
    }
    /// The slot index, for tables indexed by connection.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for ConnId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "conn#{}", self.0)
    }
}

/// How a driver's reactor waits when a turn found no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sleep {
    /// In `poll(2)` on [`Driver::wake_fds`] and [`Driver::write_fds`].
    Fds,
    /// In the driver's own wait, [`Driver::park`].
    Own,
    /// Not at all: the driver has no interrupt to wake it (a DPDK virtual
    /// device), so its reactor busy-polls whatever its idle policy says.
    Never,
}

/// The transmit side of one connection: what the message layer
/// ([`Connection::poll_transmit`](crate::Connection::poll_transmit)) writes
/// frames into. Implemented by [`ConnTx`] (a connection of a driver) and by
/// every [`Transport`].
pub trait FrameTx {
    /// The largest frame (header included) the backend carries as one unit.
    fn max_frame_len(&self) -> usize;
    /// Lend `len` bytes to encode one frame in place; `Ok(None)` under
    /// back-pressure (see [`Transport::tx_reserve`]).
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError>;
    /// Commit the frame written into the last reservation.
    fn tx_commit(&mut self, len: usize);
    /// Queue one frame made of `head` followed by `segs`; `Ok(false)` under
    /// back-pressure (see [`Transport::tx_gather`]).
    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError>;
}

impl<T: Transport + ?Sized> FrameTx for T {
    fn max_frame_len(&self) -> usize {
        Transport::max_frame_len(self)
    }
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        Transport::tx_reserve(self, len)
    }
    fn tx_commit(&mut self, len: usize) {
        Transport::tx_commit(self, len);
    }
    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        Transport::tx_gather(self, head, segs)
    }
}

/// One driver per reactor. See the module documentation.
pub trait Driver {
    /// The largest frame (header included) the driver carries as one unit.
    fn max_frame_len(&self) -> usize;

    /// Lend `len` bytes of `conn`'s transmit memory to encode one frame in
    /// place. `Ok(None)` under back-pressure: flush and retry later.
    /// Reserving again without [`tx_commit`](Self::tx_commit) abandons the
    /// earlier reservation.
    fn tx_reserve(&mut self, conn: ConnId, len: usize)
        -> Result<Option<&mut [u8]>, TransportError>;

    /// Commit the frame written into `conn`'s last reservation.
    fn tx_commit(&mut self, conn: ConnId, len: usize);

    /// Queue on `conn` one frame made of `head` followed by the owned
    /// `segs`. Drivers that can keep the segments and send them without a
    /// copy do; the default copies into a reservation. `Ok(false)` under
    /// back-pressure.
    fn tx_gather(
        &mut self,
        conn: ConnId,
        head: &[u8],
        segs: &[Bytes],
    ) -> Result<bool, TransportError> {
        let len = gather_len(head, segs);
        let Some(buf) = self.tx_reserve(conn, len)? else {
            return Ok(false);
        };
        copy_gather(buf, head, segs);
        self.tx_commit(conn, len);
        Ok(true)
    }

    /// True while `conn` has frames queued that the wire has not taken
    /// (or, for reliable-datagram drivers, the peer not acknowledged).
    fn tx_pending(&self, conn: ConnId) -> bool;

    /// The transmit side of `conn`, for the message layer.
    fn tx(&mut self, conn: ConnId) -> ConnTx<'_, Self>
    where
        Self: Sized,
    {
        ConnTx { driver: self, conn }
    }

    /// One receive pass over every connection: lend up to `max` received
    /// frames of each connection to `sink`, in order per connection, each
    /// valid only for the duration of its call. Returns how many frames
    /// were delivered. A connection that failed is reported by
    /// [`poll_failure`](Self::poll_failure), after the frames it delivered
    /// before failing.
    fn rx_burst(&mut self, now: Instant, max: usize, sink: &mut dyn FnMut(ConnId, &[u8])) -> usize;

    /// One submission for every connection: hand everything queued to the
    /// wire (one system call or doorbell where the hardware allows) and
    /// drive the driver's timers (retransmission) with `now`. Returns true
    /// when the reactor must turn again before it parks: the submission
    /// took in completions or input that the next receive pass delivers
    /// (an io_uring enter reaps receives with its sends). A driver may
    /// answer true whenever it did any work: that costs a turn, never a
    /// lost wake-up.
    fn flush(&mut self, now: Instant) -> bool;

    /// A connection found failed or closed by the peer, with the reason,
    /// once each. It stays attached (its handle valid, its frames gone)
    /// until [`detach`](Self::detach).
    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)>;

    /// Release `conn`: its socket or queue pair and its buffers. Frames
    /// still queued are dropped.
    fn detach(&mut self, conn: ConnId);

    /// True while the driver still owes the wire something for
    /// connections already detached (a reliable-datagram core's
    /// acknowledgement of its peer's last packets): a reactor that is done
    /// turns until it is sent.
    fn winding_down(&self) -> bool {
        false
    }

    /// The earliest instant the driver needs a call even if no traffic
    /// arrives (a retransmission timer), if any.
    fn poll_timeout(&self) -> Option<Instant> {
        None
    }

    /// How the reactor waits when idle.
    fn sleep(&self) -> Sleep;

    /// With [`Sleep::Fds`]: descriptors whose readability ends a park.
    fn wake_fds<'a>(&'a self, _out: &mut Vec<BorrowedFd<'a>>) {}

    /// With [`Sleep::Fds`]: descriptors whose writability ends a park
    /// (sockets holding bytes their full send buffer refused).
    fn write_fds<'a>(&'a self, _out: &mut Vec<BorrowedFd<'a>>) {}

    /// With [`Sleep::Own`]: wait until `waker` is readable, input arrives
    /// or `timeout` passes, submitting what is queued first. Must end at
    /// once when `waker` is already readable. `None` when the wait could
    /// not be made; the reactor then polls.
    fn park(&mut self, _waker: ParkWaker<'_>, _timeout: Duration) -> Option<ParkEnd> {
        None
    }

    /// The counters the driver keeps anyway, for the metrics: read by its
    /// reactor a few times a second, never on every turn (some are sums
    /// over the connections). Counters the driver does not keep are `None`.
    fn counters(&self) -> DriverCounters {
        DriverCounters::default()
    }
}

/// What a driver has counted since it was made, as [`Driver::counters`]
/// reports it; `None` where the driver keeps no such count. Sums over
/// connections may count only the connections still attached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCounters {
    /// System calls on the datapath (reads and writes of sockets,
    /// `io_uring_enter`s, completion-channel reads).
    pub syscalls: Option<u64>,
    /// Packets handed to a datagram link.
    pub packets_sent: Option<u64>,
    /// Packets taken from a datagram link.
    pub packets_received: Option<u64>,
    /// Data packets a reliable-datagram core sent again.
    pub retransmits: Option<u64>,
    /// Retransmission timeouts of a reliable-datagram core.
    pub retransmit_timeouts: Option<u64>,
    /// Loss episodes that reduced a reliable-datagram core's congestion
    /// window.
    pub cwnd_reductions: Option<u64>,
    /// In-order data packets a reliable-datagram core dropped
    /// unacknowledged while the frames waiting for the application were
    /// at their bound (its peer resends them).
    pub backlog_drops: Option<u64>,
    /// Doorbells rung (RDMA: at most one per flush).
    pub doorbells: Option<u64>,
    /// RDMA posting passes that left frames queued for lack of ring
    /// credit (the peer had not freed ring space).
    pub credit_stalls: Option<u64>,
    /// RDMA posting passes that left frames queued for lack of the
    /// peer's posted receive work requests.
    pub receive_stalls: Option<u64>,
}

/// A driver of TCP streams (the tcp and io_uring backends): its
/// connections are attached from connected sockets, which it then owns.
pub trait StreamDriver: Driver {
    /// Take `stream` (connected; blocking or not) as a new connection,
    /// served from the next turn on.
    fn attach_stream(&mut self, stream: TcpStream) -> Result<ConnId, TransportError>;

    /// [`attach_stream`](Self::attach_stream) for a caller that knows which
    /// end of `stream` it holds and the cluster token its connections
    /// prove ([`ConnConfig::token`](crate::ConnConfig::token)): the
    /// [`Endpoint`](crate::Endpoint) attaches every stream this way, as
    /// [`Side::Dialer`] what its owner dialed and as [`Side::Acceptor`]
    /// what its inbox routes to it. A driver that sets its connections up
    /// over the stream before the session layer's handshake runs (the
    /// verbs backend's side channel) proves the token on it first, so that
    /// nothing is allocated for a peer without it. By default the side and
    /// the token are not used: the session layer's handshake proves the
    /// token.
    fn attach_stream_as(
        &mut self,
        stream: TcpStream,
        side: Side,
        token: Option<&ClusterToken>,
    ) -> Result<ConnId, TransportError> {
        let _ = (side, token);
        self.attach_stream(stream)
    }
}

/// The transmit side of one connection of a driver.
#[derive(Debug)]
pub struct ConnTx<'d, D> {
    driver: &'d mut D,
    conn: ConnId,
}

impl<D: Driver> FrameTx for ConnTx<'_, D> {
    fn max_frame_len(&self) -> usize {
        self.driver.max_frame_len()
    }
    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        self.driver.tx_reserve(self.conn, len)
    }
    fn tx_commit(&mut self, len: usize) {
        self.driver.tx_commit(self.conn, len);
    }
    fn tx_gather(&mut self, head: &[u8], segs: &[Bytes]) -> Result<bool, TransportError> {
        self.driver.tx_gather(self.conn, head, segs)
    }
}

/// A point-to-point link that [`Links`] can park on: its socket, if any.
pub trait Link: Transport {
    /// The descriptor whose readability means input (a socket); `None`
    /// for links with nothing to wait on (in-memory pairs).
    fn read_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// The descriptor whose writability a park must also wait for: a
    /// socket holding bytes its full send buffer refused.
    fn write_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// A driver whose connections are independent links (TCP sockets, the
/// in-memory pairs of tests): a receive pass visits each link once, a
/// submission flushes each link with bytes queued. It parks in `poll(2)`
/// on the links' sockets; with no socket among them it cannot sleep.
#[derive(Debug)]
pub struct Links<T> {
    links: Vec<Option<T>>,
    free: Vec<u32>,
    failed: VecDeque<(ConnId, TransportError)>,
    /// Failed links: skipped by the passes until detached.
    dead: Vec<bool>,
    max_frame_len: usize,
    /// Where the next receive pass starts, so no link is always first.
    next: usize,
}

impl<T: Link> Links<T> {
    /// A driver carrying frames of up to `max_frame_len` bytes; links
    /// attached must carry at least that.
    pub fn new(max_frame_len: usize) -> Self {
        Self {
            links: Vec::new(),
            free: Vec::new(),
            failed: VecDeque::new(),
            dead: Vec::new(),
            max_frame_len,
            next: 0,
        }
    }

    /// Attach a link; it is served from the next turn on.
    pub fn attach(&mut self, link: T) -> ConnId {
        if let Some(i) = self.free.pop() {
            self.links[i as usize] = Some(link);
            self.dead[i as usize] = false;
            return ConnId(i);
        }
        let i = u32::try_from(self.links.len()).expect("fewer than 2^32 links");
        self.links.push(Some(link));
        self.dead.push(false);
        ConnId(i)
    }

    /// The link behind `conn`, if attached.
    pub fn link(&self, conn: ConnId) -> Option<&T> {
        self.links.get(conn.index()).and_then(Option::as_ref)
    }

    /// The link behind `conn`, mutably, if attached.
    pub fn link_mut(&mut self, conn: ConnId) -> Option<&mut T> {
        self.links.get_mut(conn.index()).and_then(Option::as_mut)
    }

    /// Attached links and their handles.
    pub fn iter(&self) -> impl Iterator<Item = (ConnId, &T)> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.as_ref().map(|l| (ConnId(i as u32), l)))
    }

    /// How many links are attached.
    pub fn len(&self) -> usize {
        self.links.len() - self.free.len()
    }

    /// True when no link is attached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True while `conn` is attached and has not failed.
    pub fn is_live(&self, conn: ConnId) -> bool {
        matches!(self.links.get(conn.index()), Some(Some(_))) && !self.dead[conn.index()]
    }

    /// A receive pass over `conn` alone, as [`Driver::rx_burst`] makes
    /// over each link: for a driver that knows which links have input
    /// (from its own readiness list) and visits only those. Returns how
    /// many frames were delivered; 0 for a link not attached or failed.
    pub fn rx_burst_one(
        &mut self,
        conn: ConnId,
        now: Instant,
        max: usize,
        sink: &mut dyn FnMut(ConnId, &[u8]),
    ) -> usize {
        let i = conn.index();
        if !self.is_live(conn) {
            return 0;
        }
        let Some(link) = self.links[i].as_mut() else {
            return 0;
        };
        match link.rx_burst(now, max, &mut |f: &[u8]| sink(conn, f)) {
            Ok(got) => got,
            Err(e) => {
                self.fail(i, e);
                0
            }
        }
    }

    fn fail(&mut self, i: usize, e: TransportError) {
        if !self.dead[i] {
            self.dead[i] = true;
            self.failed.push_back((ConnId(i as u32), e));
        }
    }

    /// The links not failed.
    fn running(&self) -> impl Iterator<Item = &T> {
        self.links
            .iter()
            .zip(&self.dead)
            .filter_map(|(l, dead)| l.as_ref().filter(|_| !dead))
    }

    fn live(&mut self, conn: ConnId) -> Result<&mut T, TransportError> {
        match self.links.get_mut(conn.index()) {
            Some(Some(l)) if !self.dead[conn.index()] => Ok(l),
            _ => Err(TransportError::Closed),
        }
    }
}

impl<T: Link> Driver for Links<T> {
    fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    fn tx_reserve(
        &mut self,
        conn: ConnId,
        len: usize,
    ) -> Result<Option<&mut [u8]>, TransportError> {
        self.live(conn)?.tx_reserve(len)
    }

    fn tx_commit(&mut self, conn: ConnId, len: usize) {
        if let Ok(l) = self.live(conn) {
            l.tx_commit(len);
        }
    }

    fn tx_gather(
        &mut self,
        conn: ConnId,
        head: &[u8],
        segs: &[Bytes],
    ) -> Result<bool, TransportError> {
        self.live(conn)?.tx_gather(head, segs)
    }

    fn tx_pending(&self, conn: ConnId) -> bool {
        self.link(conn).is_some_and(Transport::tx_pending)
    }

    fn rx_burst(&mut self, now: Instant, max: usize, sink: &mut dyn FnMut(ConnId, &[u8])) -> usize {
        let n = self.links.len();
        if n == 0 {
            return 0;
        }
        let start = self.next % n;
        self.next = start + 1;
        let mut delivered = 0;
        for k in 0..n {
            let i = (start + k) % n;
            if self.dead[i] {
                continue;
            }
            let Some(link) = self.links[i].as_mut() else {
                continue;
            };
            let id = ConnId(i as u32);
            match link.rx_burst(now, max, &mut |f: &[u8]| sink(id, f)) {
                Ok(got) => delivered += got,
                Err(e) => self.fail(i, e),
            }
        }
        delivered
    }

    /// Writes each link with bytes queued (or timers due). Writing takes
    /// in no input, so a turn after it is never needed: false.
    fn flush(&mut self, now: Instant) -> bool {
        for i in 0..self.links.len() {
            if self.dead[i] {
                continue;
            }
            let Some(link) = self.links[i].as_mut() else {
                continue;
            };
            if !link.tx_pending() && link.poll_timeout().is_none() {
                continue;
            }
            if let Err(e) = link.flush(now) {
                self.fail(i, e);
            }
        }
        false
    }

    fn poll_failure(&mut self) -> Option<(ConnId, TransportError)> {
        self.failed.pop_front()
    }

    fn detach(&mut self, conn: ConnId) {
        if let Some(slot) = self.links.get_mut(conn.index()) {
            if slot.take().is_some() {
                self.free.push(conn.0);
                self.failed.retain(|(c, _)| *c != conn);
            }
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.running().filter_map(Transport::poll_timeout).min()
    }

    fn sleep(&self) -> Sleep {
        if self.links.iter().flatten().all(|l| l.read_fd().is_some()) {
            Sleep::Fds
        } else {
            Sleep::Never
        }
    }

    /// A failed link's socket is left out: at EOF or reset it stays
    /// readable, and would end every park until the link is detached.
    fn wake_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        out.extend(self.running().filter_map(Link::read_fd));
    }

    fn write_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        out.extend(self.running().filter_map(Link::write_fd));
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;
    use crate::testing::MemTransport;

    /// An in-memory link that counts its receive passes.
    #[derive(Debug)]
    struct Counted {
        inner: MemTransport,
        rx_calls: Rc<Cell<usize>>,
    }

    impl Transport for Counted {
        fn max_frame_len(&self) -> usize {
            Transport::max_frame_len(&self.inner)
        }
        fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
            Transport::tx_reserve(&mut self.inner, len)
        }
        fn tx_commit(&mut self, len: usize) {
            Transport::tx_commit(&mut self.inner, len);
        }
        fn flush(&mut self, now: Instant) -> Result<(), TransportError> {
            self.inner.flush(now)
        }
        fn rx_burst(
            &mut self,
            now: Instant,
            max: usize,
            sink: &mut dyn FnMut(&[u8]),
        ) -> Result<usize, TransportError> {
            self.rx_calls.set(self.rx_calls.get() + 1);
            self.inner.rx_burst(now, max, sink)
        }
        fn tx_pending(&self) -> bool {
            self.inner.tx_pending()
        }
    }

    impl Link for Counted {}

    /// A driver of `n` counted links, with the far end of each.
    fn links(n: usize) -> (Links<Counted>, Vec<MemTransport>, Vec<Rc<Cell<usize>>>) {
        let mut d = Links::new(64);
        let mut peers = Vec::new();
        let mut calls = Vec::new();
        for i in 0..n {
            let (inner, peer) = MemTransport::pair(64, 16);
            let rx_calls = Rc::new(Cell::new(0));
            assert_eq!(
                d.attach(Counted {
                    inner,
                    rx_calls: rx_calls.clone()
                }),
                ConnId::new(i as u32)
            );
            peers.push(peer);
            calls.push(rx_calls);
        }
        (d, peers, calls)
    }

    /// Send the one-byte frame `[byte]` from `peer`.
    fn send(peer: &mut MemTransport, byte: u8) {
        let buf = Transport::tx_reserve(peer, 1).expect("open").expect("room");
        buf[0] = byte;
        Transport::tx_commit(peer, 1);
        peer.flush(Instant::now()).expect("flush");
    }

    /// One receive pass taking up to `max` frames per link: the links it
    /// got frames from, in order, each frame checked to be its link's.
    fn pass(d: &mut Links<Counted>, max: usize) -> Vec<usize> {
        let mut got = Vec::new();
        let n = d.rx_burst(Instant::now(), max, &mut |id, f| {
            assert_eq!(f, [id.index() as u8], "a frame of another link");
            got.push(id.index());
        });
        assert_eq!(n, got.len());
        got
    }

    #[test]
    fn each_receive_pass_starts_one_link_later() {
        let (mut d, mut peers, _) = links(3);
        for (k, p) in peers.iter_mut().enumerate() {
            for _ in 0..4 {
                send(p, k as u8);
            }
        }
        assert_eq!(pass(&mut d, 1), [0, 1, 2]);
        assert_eq!(pass(&mut d, 1), [1, 2, 0]);
        assert_eq!(pass(&mut d, 1), [2, 0, 1]);
        assert_eq!(pass(&mut d, 1), [0, 1, 2]);
        assert!(pass(&mut d, 1).is_empty());
    }

    #[test]
    fn a_pass_over_one_link_reads_only_it_and_reports_its_failure() {
        let (mut d, mut peers, calls) = links(3);
        send(&mut peers[2], 2);
        let mut got = Vec::new();
        let two = ConnId::new(2);
        let n = d.rx_burst_one(two, Instant::now(), 8, &mut |id, f| got.push((id, f[0])));
        assert_eq!((n, got), (1, vec![(two, 2)]));
        assert_eq!(calls.iter().map(|c| c.get()).collect::<Vec<_>>(), [0, 0, 1]);
        drop(peers.remove(2));
        assert!(d.is_live(two));
        assert_eq!(d.rx_burst_one(two, Instant::now(), 8, &mut |_, _| {}), 0);
        assert!(!d.is_live(two));
        assert!(matches!(d.poll_failure(), Some((id, TransportError::Closed)) if id == two));
        // Failed, detached or never attached: nothing read.
        assert_eq!(d.rx_burst_one(two, Instant::now(), 8, &mut |_, _| {}), 0);
        assert_eq!(calls[2].get(), 2);
        d.detach(two);
        assert!(!d.is_live(two));
        assert!(!d.is_live(ConnId::new(7)));
        assert_eq!(
            d.rx_burst_one(ConnId::new(7), Instant::now(), 8, &mut |_, _| {}),
            0
        );
    }

    #[test]
    fn a_failed_link_is_reported_once_and_then_skipped() {
        let (mut d, mut peers, calls) = links(3);
        send(&mut peers[1], 1);
        drop(peers.remove(1));
        // Its frame first, then the failure.
        assert_eq!(pass(&mut d, 8), [1]);
        assert!(d.poll_failure().is_none());
        assert!(pass(&mut d, 8).is_empty());
        let failed = ConnId::new(1);
        assert!(matches!(
            d.poll_failure(),
            Some((id, TransportError::Closed)) if id == failed
        ));
        assert!(d.poll_failure().is_none());
        let before = calls[1].get();
        send(&mut peers[0], 0);
        send(&mut peers[1], 2);
        let mut got = pass(&mut d, 8);
        got.sort_unstable();
        assert_eq!(got, [0, 2]);
        assert_eq!(calls[1].get(), before, "a failed link was polled");
        assert!(d.poll_failure().is_none(), "reported twice");
        assert!(matches!(
            d.tx_reserve(failed, 1),
            Err(TransportError::Closed)
        ));
        assert!(d.tx_gather(failed, &[0], &[]).is_err());
        // Still attached (its handle valid) until detached.
        assert_eq!(d.len(), 3);
        assert!(d.link(failed).is_some());
        // The others still send.
        let buf = d
            .tx_reserve(ConnId::new(0), 1)
            .expect("open")
            .expect("room");
        buf[0] = 9;
        d.tx_commit(ConnId::new(0), 1);
        assert!(d.tx_pending(ConnId::new(0)));
        assert!(!d.flush(Instant::now()), "writing takes in no input");
        let mut echo = Vec::new();
        peers[0]
            .rx_burst(Instant::now(), 8, &mut |f| echo.push(f.to_vec()))
            .expect("peer open");
        assert_eq!(echo, [vec![9]]);
        assert!(d.poll_failure().is_none());
    }

    #[test]
    fn detach_frees_the_slot_for_the_next_link() {
        let (mut d, mut peers, _) = links(3);
        let gone = ConnId::new(1);
        d.detach(gone);
        d.detach(gone);
        assert_eq!(d.len(), 2);
        assert!(d.link(gone).is_none());
        let ids: Vec<usize> = d.iter().map(|(id, _)| id.index()).collect();
        assert_eq!(ids, [0, 2]);
        assert!(matches!(d.tx_reserve(gone, 1), Err(TransportError::Closed)));
        // Its peer sees the link closed.
        assert!(matches!(
            peers[1].rx_burst(Instant::now(), 8, &mut |_| {}),
            Err(TransportError::Closed)
        ));

        // The next link takes the freed slot (once), then a new one.
        let (inner, mut peer) = MemTransport::pair(64, 16);
        let rx_calls = Rc::new(Cell::new(0));
        let reused = d.attach(Counted { inner, rx_calls });
        assert_eq!(reused, gone);
        send(&mut peer, 1);
        assert_eq!(pass(&mut d, 8), [1]);
        let (inner, _peer) = MemTransport::pair(64, 16);
        let rx_calls = Rc::new(Cell::new(0));
        assert_eq!(d.attach(Counted { inner, rx_calls }), ConnId::new(3));
        assert_eq!(d.len(), 4);

        // A failure not yet polled goes with its link.
        drop(peer);
        assert!(pass(&mut d, 8).is_empty());
        d.detach(reused);
        assert!(d.poll_failure().is_none());
    }
}

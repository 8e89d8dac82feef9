//! Which of a [`TcpDriver`](crate::TcpDriver)'s sockets have input: an
//! epoll set over them, for a driver with many connections.
//!
//! A receive pass that reads every socket costs a `read` system call per
//! connection whether or not it has input, and a park in `poll(2)` on
//! every socket costs the kernel a look at each: a PS reactor serving 64
//! workers would make 65 reads a turn for the one or two connections that
//! have a request. With the sockets in an epoll set (level-triggered), a pass
//! asks the set once (`epoll_wait` with no timeout) and reads only the
//! sockets it names, and a park polls the set's one descriptor.
//!
//! Level-triggered, a socket stays in the ready list while it has unread
//! bytes or has ended, so a pass that leaves input in the kernel finds it
//! again in the next. What the list cannot show is what a pass left in
//! the connection's own buffer: complete frames past the pass's `max`, or
//! a framing error or end of stream found after frames it delivered. Those
//! connections are read again in the next pass.
//!
//! Below [`READY_LIST_FROM`] connections the driver reads every socket and
//! parks on every socket: with so few, the `epoll_wait` a pass adds saves
//! at most a few reads, and a reactor with one connection (the benches'
//! latency runs) would pay a system call a turn for nothing. The sockets
//! join the set only once the driver first has that many connections: a
//! socket in an epoll set calls into the set at each of its wake-ups.

use std::os::fd::{AsFd, BorrowedFd};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use starwire_transport::ConnId;

/// Connections attached from which a receive pass reads only the sockets
/// the epoll set names.
pub const READY_LIST_FROM: usize = 5;

/// Where one connection's socket stands with the set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// No connection in this slot, or a failed one taken out of the set.
    Out,
    /// In the set.
    In,
    /// Attached but not in the set (adding it failed): read every pass.
    Missing,
    /// Attached while the driver has too few connections to use the set:
    /// added when it gets enough ([`Ready::activate`]).
    Idle,
}

/// The epoll set of one driver and what its passes must read again.
#[derive(Debug)]
pub(crate) struct Ready {
    /// `None` when no epoll instance could be made: every pass reads every
    /// socket.
    epoll: Option<Epoll>,
    entries: Vec<Entry>,
    /// Attached connections whose adding to the set failed.
    missing: usize,
    /// The sockets go into the set: the driver reached [`READY_LIST_FROM`]
    /// connections once. Until then none is in it, since a socket in an
    /// epoll set costs its every wake-up a callback into the set, a price
    /// a one-connection latency run would pay for nothing.
    active: bool,
    /// Connections to read in the next pass whatever the set says.
    again: Vec<ConnId>,
    /// The last pass read every socket (or none was made yet): the next
    /// pass that uses the set reads every socket once more, since a pass
    /// over all keeps no [`Self::again`] list.
    scanned: bool,
    events: Vec<EpollEvent>,
    /// This pass's connections, without repeats.
    visit: Vec<ConnId>,
    marked: Vec<bool>,
}

impl Ready {
    pub(crate) fn new() -> Self {
        Self {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).ok(),
            entries: Vec::new(),
            missing: 0,
            active: false,
            again: Vec::new(),
            scanned: true,
            events: Vec::new(),
            visit: Vec::new(),
            marked: Vec::new(),
        }
    }

    /// Whether a pass over `attached` connections reads only the sockets
    /// the set names.
    pub(crate) fn uses_set(&self, attached: usize) -> bool {
        self.active && self.epoll.is_some() && self.missing == 0 && attached >= READY_LIST_FROM
    }

    /// Whether the sockets are in the set (see [`Self::activate`]).
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    /// Put every attached socket (`links`: each connection and its
    /// socket) in the set, and every one attached from now on.
    pub(crate) fn activate<'a>(&mut self, links: impl Iterator<Item = (ConnId, BorrowedFd<'a>)>) {
        self.active = true;
        for (conn, fd) in links {
            if *self.entry_mut(conn) == Entry::Idle {
                self.add(conn, fd);
            }
        }
    }

    fn entry_mut(&mut self, conn: ConnId) -> &mut Entry {
        let i = conn.index();
        if self.entries.len() <= i {
            self.entries.resize(i + 1, Entry::Out);
            self.marked.resize(i + 1, false);
        }
        &mut self.entries[i]
    }

    /// `conn` was attached with socket `fd`.
    pub(crate) fn attached(&mut self, conn: ConnId, fd: BorrowedFd<'_>) {
        if self.active {
            self.add(conn, fd);
        } else {
            *self.entry_mut(conn) = Entry::Idle;
        }
    }

    fn add(&mut self, conn: ConnId, fd: BorrowedFd<'_>) {
        let added = self.epoll.as_ref().map(|ep| {
            ep.add(
                fd,
                EpollEvent::new(EpollFlags::EPOLLIN, conn.index() as u64),
            )
            .is_ok()
        });
        let e = match added {
            Some(true) => Entry::In,
            _ => Entry::Missing,
        };
        *self.entry_mut(conn) = e;
        if e == Entry::Missing {
            self.missing += 1;
        }
        // Bytes may have arrived before it was added.
        self.again.push(conn);
    }

    /// `conn`, whose socket is `fd`, is being detached or has failed: out
    /// of the set (a failed socket stays readable, and would end every
    /// park), and no longer read.
    pub(crate) fn remove(&mut self, conn: ConnId, fd: Option<BorrowedFd<'_>>) {
        let e = *self.entry_mut(conn);
        match e {
            Entry::In => {
                if let (Some(ep), Some(fd)) = (self.epoll.as_ref(), fd) {
                    // Fails only if the socket is not in the set, which is
                    // what this makes sure of.
                    let _ = ep.delete(fd);
                }
            }
            Entry::Missing => self.missing -= 1,
            Entry::Out | Entry::Idle => {}
        }
        *self.entry_mut(conn) = Entry::Out;
        self.again.retain(|c| *c != conn);
    }

    /// A pass that reads every socket is being made.
    pub(crate) fn scanning(&mut self) {
        self.scanned = true;
        self.again.clear();
    }

    /// The connections this pass reads, when it uses the set: those read
    /// again, then those the set names (or every one in `all`, after a pass
    /// over all). Hand the list back with [`Self::done`].
    pub(crate) fn collect(&mut self, all: impl Iterator<Item = ConnId>) -> Vec<ConnId> {
        self.visit.clear();
        let again = std::mem::take(&mut self.again);
        if std::mem::take(&mut self.scanned) {
            for c in all {
                self.push(c);
            }
        }
        for &c in &again {
            self.push(c);
        }
        self.again = again;
        self.again.clear();
        if let Some(ep) = self.epoll.as_ref() {
            let want = self.entries.len().max(16);
            if self.events.len() < want {
                self.events.resize(want, EpollEvent::empty());
            }
            // A failed wait reads nothing this pass; the sockets stay
            // ready for the next.
            let n = ep
                .wait(&mut self.events, EpollTimeout::ZERO)
                .unwrap_or_default();
            for k in 0..n {
                let c = ConnId::new(self.events[k].data() as u32);
                self.push(c);
            }
        }
        let visit = std::mem::take(&mut self.visit);
        for c in &visit {
            self.marked[c.index()] = false;
        }
        visit
    }

    /// The list [`Self::collect`] lent, for its memory.
    pub(crate) fn done(&mut self, visit: Vec<ConnId>) {
        self.visit = visit;
    }

    fn push(&mut self, conn: ConnId) {
        let i = conn.index();
        if self.entries.get(i).is_some_and(|e| *e != Entry::Out) && !self.marked[i] {
            self.marked[i] = true;
            self.visit.push(conn);
        }
    }

    /// `conn` left input in its own buffer: read it in the next pass.
    pub(crate) fn read_again(&mut self, conn: ConnId) {
        self.again.push(conn);
    }

    /// The descriptor a park polls for input, when passes use the set.
    pub(crate) fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.epoll.as_ref().map(|ep| ep.0.as_fd())
    }
}

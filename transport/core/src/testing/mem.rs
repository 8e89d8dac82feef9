//! An in-memory pair of transports: the reference backend for tests.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::transport::{Transport, TransportError};

#[derive(Debug, Default)]
struct Channel {
    frames: VecDeque<Vec<u8>>,
    closed: bool,
}

#[derive(Debug)]
struct Shared {
    /// `dirs[i]` carries frames sent by end `i`.
    dirs: [Mutex<Channel>; 2],
}

/// One end of an in-memory pair. Frames are reliable and ordered; the
/// channel holds at most `capacity` frames in flight, beyond which
/// [`Transport::tx_reserve`] reports back-pressure. Dropping an end closes
/// it: the other end's `rx_burst` returns [`TransportError::Closed`] once
/// it has drained what was sent.
#[derive(Debug)]
pub struct MemTransport {
    shared: Arc<Shared>,
    me: usize,
    max_frame_len: usize,
    capacity: usize,
    outbox: VecDeque<Vec<u8>>,
    recycled: Vec<Vec<u8>>,
    current: Option<Vec<u8>>,
}

impl MemTransport {
    /// A connected pair carrying frames up to `max_frame_len` bytes with at
    /// most `capacity` frames in flight per direction.
    pub fn pair(max_frame_len: usize, capacity: usize) -> (Self, Self) {
        let shared = Arc::new(Shared {
            dirs: [
                Mutex::new(Channel::default()),
                Mutex::new(Channel::default()),
            ],
        });
        let end = |me| Self {
            shared: shared.clone(),
            me,
            max_frame_len,
            capacity,
            outbox: VecDeque::new(),
            recycled: Vec::new(),
            current: None,
        };
        (end(0), end(1))
    }

    fn dir(&self, i: usize) -> MutexGuard<'_, Channel> {
        // A poisoned lock means a test thread panicked; the data is still
        // consistent (every critical section is a push or pop).
        self.shared.dirs[i]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        self.dir(self.me).closed = true;
    }
}

impl Transport for MemTransport {
    fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    fn tx_reserve(&mut self, len: usize) -> Result<Option<&mut [u8]>, TransportError> {
        if len > self.max_frame_len {
            return Err(TransportError::FrameTooLarge {
                len,
                max: self.max_frame_len,
            });
        }
        if self.outbox.len() >= self.capacity {
            return Ok(None);
        }
        let mut buf = self.recycled.pop().unwrap_or_default();
        buf.clear();
        buf.resize(len, 0);
        let buf = self.current.insert(buf);
        Ok(Some(&mut buf[..]))
    }

    fn tx_commit(&mut self, len: usize) {
        if let Some(mut buf) = self.current.take() {
            buf.truncate(len);
            self.outbox.push_back(buf);
        }
    }

    fn flush(&mut self, _now: Instant) -> Result<(), TransportError> {
        if self.outbox.is_empty() {
            return Ok(());
        }
        let other_closed = self.dir(1 - self.me).closed;
        if other_closed {
            return Err(TransportError::Closed);
        }
        let mut ch = self.shared.dirs[self.me]
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        while ch.frames.len() < self.capacity {
            let Some(f) = self.outbox.pop_front() else {
                break;
            };
            ch.frames.push_back(f);
        }
        Ok(())
    }

    fn rx_burst(
        &mut self,
        _now: Instant,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, TransportError> {
        let mut got = Vec::new();
        let closed = {
            let mut ch = self.dir(1 - self.me);
            while got.len() < max {
                match ch.frames.pop_front() {
                    Some(f) => got.push(f),
                    None => break,
                }
            }
            ch.closed && ch.frames.is_empty()
        };
        let n = got.len();
        for f in got {
            sink(&f);
            if self.recycled.len() < 64 {
                self.recycled.push(f);
            }
        }
        if n == 0 && closed {
            return Err(TransportError::Closed);
        }
        Ok(n)
    }

    fn tx_pending(&self) -> bool {
        !self.outbox.is_empty()
    }
}

/// Nothing to wait on: a driver of in-memory links busy-polls.
impl crate::driver::Link for MemTransport {}

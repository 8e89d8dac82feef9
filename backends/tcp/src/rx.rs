//! The receive buffer: one fixed allocation, frames found by the
//! [`Deframer`] and lent in place.

use std::io;

use starwire_transport::TransportError;
use starwire_wire::{Deframer, FrameError, NextFrame};

/// How the byte stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The peer shut down its side in order (read returned 0).
    Eof,
    /// The connection was reset or aborted.
    Reset,
}

/// A fixed-size receive buffer. Independent of the socket so it can be
/// tested against a scripted reader.
pub(crate) struct RxBuffer {
    /// Fixed length; never resized.
    buf: RxMem,
    /// Unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    deframer: Deframer,
    end_of_stream: Option<End>,
    /// A framing error is final: reported on every later call.
    error: Option<FrameError>,
}

impl std::fmt::Debug for RxBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxBuffer")
            .field("capacity", &self.buf.len())
            .field("buffered", &(self.end - self.start))
            .field("end_of_stream", &self.end_of_stream)
            .field("error", &self.error)
            .finish()
    }
}

/// The memory of a receive buffer: an anonymous mapping, whose pages the
/// kernel provides zeroed on first touch, so a connection costs the pages
/// its traffic touched rather than the whole buffer (an idle or refused
/// peer costs a page). The heap (where a freed large block can come back
/// already touched) only when the mapping fails.
enum RxMem {
    Map(memmap2::MmapMut),
    Heap(Vec<u8>),
}

impl RxMem {
    fn new(len: usize) -> Self {
        match memmap2::MmapMut::map_anon(len) {
            Ok(m) => Self::Map(m),
            Err(_) => Self::Heap(vec![0; len]),
        }
    }
}

impl std::ops::Deref for RxMem {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Map(m) => m,
            Self::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for RxMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Map(m) => m,
            Self::Heap(v) => v,
        }
    }
}

impl RxBuffer {
    /// `len >= 2 * deframer.max_frame_len()` (checked by
    /// `TcpConfig::validate`).
    pub(crate) fn new(len: usize, deframer: Deframer) -> Self {
        debug_assert!(len / 2 >= deframer.max_frame_len());
        Self {
            buf: RxMem::new(len),
            start: 0,
            end: 0,
            deframer,
            end_of_stream: None,
            error: None,
        }
    }

    /// Allocated bytes; constant for the life of the buffer.
    pub(crate) fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// True when the next call has something to report without a read:
    /// a framing error or the end of the stream, found while frames before
    /// it were still delivered.
    pub(crate) fn has_final(&self) -> bool {
        self.error.is_some() || self.end_of_stream.is_some()
    }

    /// Received bytes not yet delivered.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Deliver up to `max` frames to `sink`, reading with `read` at most
    /// once (retrying only `Interrupted`) and only when the buffer holds no
    /// complete frame. See `TcpTransport::rx_burst`.
    pub(crate) fn burst<R>(
        &mut self,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
        mut read: R,
    ) -> Result<usize, TransportError>
    where
        R: FnMut(&mut [u8]) -> io::Result<usize>,
    {
        if let Some(e) = &self.error {
            return Err(TransportError::Frame(e.clone()));
        }
        if max == 0 {
            return Ok(0);
        }
        let mut delivered = 0;
        let mut did_read = false;
        loop {
            match self.deliver(max - delivered, sink) {
                Ok(n) => delivered += n,
                Err((n, e)) => {
                    delivered += n;
                    tracing::debug!(error = %e, "tcp: framing error, connection unusable");
                    self.error = Some(e.clone());
                    // Frames before the bad one were delivered: report them
                    // now and the error on the next call.
                    return if delivered > 0 {
                        Ok(delivered)
                    } else {
                        Err(TransportError::Frame(e))
                    };
                }
            }
            if delivered == max {
                return Ok(delivered);
            }
            if let Some(end) = self.end_of_stream {
                return self.finish(delivered, end);
            }
            if did_read {
                return Ok(delivered);
            }
            self.make_room();
            did_read = true;
            loop {
                match read(&mut self.buf[self.end..]) {
                    Ok(0) => {
                        self.end_of_stream = Some(End::Eof);
                        break;
                    }
                    Ok(n) => {
                        self.end += n;
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(delivered),
                    Err(e) if is_reset(&e) => {
                        tracing::debug!(error = %e, "tcp: connection reset");
                        self.end_of_stream = Some(End::Reset);
                        break;
                    }
                    Err(e) => return Err(TransportError::Io(e)),
                }
            }
        }
    }

    /// Lend complete frames in place. On a header error returns how many
    /// were delivered before it, and the error.
    fn deliver(
        &mut self,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<usize, (usize, FrameError)> {
        let scan = self
            .deframer
            .scan(&self.buf[self.start..self.end], max, &mut *sink);
        if let NextFrame::Invalid(e) = scan.next {
            return Err((scan.frames, e));
        }
        self.start += scan.consumed;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(scan.frames)
    }

    /// The stream has ended and no complete frame is buffered.
    fn finish(&mut self, delivered: usize, end: End) -> Result<usize, TransportError> {
        if delivered > 0 {
            return Ok(delivered);
        }
        if end == End::Eof {
            if let Err(e) = self.deframer.end_of_stream(&self.buf[self.start..self.end]) {
                tracing::debug!(error = %e, "tcp: stream ended inside a frame");
                self.error = Some(e.clone());
                return Err(TransportError::Frame(e));
            }
        }
        Err(TransportError::Closed)
    }

    /// Ensure the tail can take the rest of the incomplete frame at
    /// `start`, moving the unconsumed bytes to the front only when the tail
    /// is shorter than one maximum frame.
    ///
    /// Called only when no complete frame is buffered, so the unconsumed
    /// bytes are less than one frame (`< max_frame`). Without the move the
    /// tail is at least `max_frame`, enough for any frame to complete; after
    /// it the tail is at least `len - max_frame >= max_frame`.
    fn make_room(&mut self) {
        if self.start > 0 && self.buf.len() - self.end < self.deframer.max_frame_len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        debug_assert!(self.end < self.buf.len());
    }
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_wire::{Header, Limits, Opcode, HEADER_LEN};

    fn rx(len: usize, max_frame: usize) -> RxBuffer {
        RxBuffer::new(len, Deframer::new(Limits::for_max_frame(max_frame as u32)))
    }

    fn frame(id: u64, body: usize) -> Vec<u8> {
        let h = Header::new(Opcode::Rpc, id, body as u32);
        let mut f = h.to_bytes().to_vec();
        f.extend((0..body).map(|i| (i as u64 ^ id) as u8));
        f
    }

    /// A scripted reader: hands out `data` in pieces of `sizes[i]`
    /// (0 = would block), then EOF when `eof`, else would block forever.
    struct Script {
        data: Vec<u8>,
        at: usize,
        sizes: Vec<usize>,
        calls: usize,
        eof: bool,
    }

    impl Script {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let size = self.sizes.get(self.calls).copied().unwrap_or(usize::MAX);
            self.calls += 1;
            if self.at == self.data.len() {
                return if self.eof {
                    Ok(0)
                } else {
                    Err(io::ErrorKind::WouldBlock.into())
                };
            }
            if size == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = size.min(out.len()).min(self.data.len() - self.at);
            out[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    #[test]
    fn frames_across_odd_reads_with_bounded_buffer() {
        let max_frame = 4096;
        let mut rx = rx(2 * max_frame, max_frame);
        let mut data = Vec::new();
        let mut lens = Vec::new();
        for id in 0..500u64 {
            let body = (id as usize * 37) % (max_frame - HEADER_LEN + 1);
            lens.push(body + HEADER_LEN);
            data.extend(frame(id, body));
        }
        let sizes = (0..100_000)
            .map(|i| [1, 0, 31, 4095, 7, 8192][i % 6])
            .collect();
        let mut s = Script {
            data,
            at: 0,
            sizes,
            calls: 0,
            eof: true,
        };
        let mut got = Vec::new();
        let mut result = Ok(0);
        for _ in 0..100_000 {
            let before = s.calls;
            result = rx.burst(3, &mut |f: &[u8]| got.push(f.to_vec()), |b| s.read(b));
            assert!(s.calls - before <= 1, "more than one read per burst");
            assert_eq!(rx.capacity(), 2 * max_frame);
            if result.is_err() {
                break;
            }
        }
        assert!(matches!(result, Err(TransportError::Closed)), "{result:?}");
        assert_eq!(got.len(), 500);
        for (id, f) in got.iter().enumerate() {
            assert_eq!(f, &frame(id as u64, lens[id] - HEADER_LEN));
        }
    }

    #[test]
    fn bad_header_after_good_frames() {
        let mut rx = rx(1024, 512);
        let mut data = frame(1, 10);
        data.extend(frame(2, 0));
        data.extend(b"garbage garbage garbage garbage garbage");
        let mut s = Script {
            data,
            at: 0,
            sizes: vec![],
            calls: 0,
            eof: false,
        };
        let mut got = 0;
        let r = rx.burst(10, &mut |_: &[u8]| got += 1, |b| s.read(b));
        assert_eq!(r.unwrap(), 2);
        for _ in 0..2 {
            let r = rx.burst(10, &mut |_: &[u8]| got += 1, |b| s.read(b));
            assert!(matches!(
                r,
                Err(TransportError::Frame(FrameError::BadMagic(_)))
            ));
        }
        assert_eq!(got, 2);
    }

    #[test]
    fn truncated_then_eof() {
        let mut rx = rx(1024, 512);
        let f = frame(1, 100);
        let mut s = Script {
            data: f[..60].to_vec(),
            at: 0,
            sizes: vec![],
            calls: 0,
            eof: true,
        };
        let mut r = Ok(0);
        for _ in 0..10 {
            r = rx.burst(10, &mut |_: &[u8]| panic!("no frame expected"), |b| {
                s.read(b)
            });
            if r.is_err() {
                break;
            }
        }
        assert!(matches!(
            r,
            Err(TransportError::Frame(FrameError::Truncated {
                needed: 132,
                have: 60
            }))
        ));
    }

    #[test]
    fn max_zero_does_not_read() {
        let mut rx = rx(1024, 512);
        let r = rx.burst(0, &mut |_: &[u8]| {}, |_| panic!("read with max = 0"));
        assert_eq!(r.unwrap(), 0);
    }
}

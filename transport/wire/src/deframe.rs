//! Finding frames in a received byte stream.
//!
//! A stream backend receives bytes in pieces that need not end on frame
//! boundaries. [`Deframer::scan`] lends each complete frame at the start of
//! a slice to a sink, in place, and says where it stopped: after `max`
//! frames, inside a frame that is not complete yet (with the length that
//! frame needs), or at a header that fails validation. Every header is
//! validated as soon as its 32 bytes are there, so a backend never waits
//! for (or buffers) a body it would reject.
//!
//! The deframer holds only the limits; the bytes stay with the backend. So
//! one deframer serves a ring buffer that `read(2)` fills (tcp) as well as
//! provided buffers with a reassembly buffer for frames that straddle them
//! (io_uring). [`Deframer::end_of_stream`] tells what the bytes left over
//! when the stream ended mean: [`FrameError::Truncated`] inside a frame.

use crate::frame::Limits;
use crate::header::{FrameError, Header, HEADER_LEN};

/// Splits a byte stream into frames, validating every header against its
/// [`Limits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Deframer {
    limits: Limits,
}

/// What one [`Deframer::scan`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Scan {
    /// Complete frames lent to the sink.
    pub frames: usize,
    /// Bytes those frames occupy: the next frame starts at
    /// `bytes[consumed..]`.
    pub consumed: usize,
    /// What the bytes after them hold.
    pub next: NextFrame,
}

/// Where a [`Scan`] stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NextFrame {
    /// `max` frames were lent; the bytes after them were not looked at.
    NotRead,
    /// The bytes end inside the next frame, or just before it. `needed` is
    /// the length of that whole frame: [`HEADER_LEN`] while its header is
    /// not complete, then the length the validated header announces (never
    /// more than [`Limits::max_frame_len`]).
    Incomplete {
        /// Bytes of the frame, header included, to wait for in all.
        needed: usize,
    },
    /// The next frame's header is invalid. The stream cannot be trusted
    /// past `consumed`: the connection must be closed.
    Invalid(FrameError),
}

impl Deframer {
    /// A deframer enforcing `limits` on every header.
    pub const fn new(limits: Limits) -> Self {
        Self { limits }
    }

    /// The limits in force.
    pub const fn limits(&self) -> Limits {
        self.limits
    }

    /// The longest frame, header included, a header may announce.
    pub const fn max_frame_len(&self) -> usize {
        self.limits.max_frame_len()
    }

    /// Bytes the frame at the start of `bytes` has in all: [`HEADER_LEN`]
    /// while fewer are there, then the length its header announces, once
    /// that header is validated (see [`Header::parse`]). `bytes` may hold
    /// less or more than the frame.
    pub fn needed(&self, bytes: &[u8]) -> Result<usize, FrameError> {
        if bytes.len() < HEADER_LEN {
            return Ok(HEADER_LEN);
        }
        let h = Header::parse(bytes, self.limits.max_body, self.limits.max_message)?;
        Ok(h.frame_len())
    }

    /// Lend the complete frames at the start of `bytes` to `sink`, in
    /// order and in place (each slice is one whole frame, header
    /// included), up to `max` of them.
    ///
    /// Stops at the first incomplete or invalid frame; with `max == 0` it
    /// reads nothing. The frames before an invalid header are lent, and
    /// the error is reported in [`Scan::next`].
    pub fn scan<F>(&self, bytes: &[u8], max: usize, mut sink: F) -> Scan
    where
        F: FnMut(&[u8]),
    {
        let mut frames = 0;
        let mut consumed = 0;
        let next = loop {
            if frames == max {
                break NextFrame::NotRead;
            }
            let rest = bytes.get(consumed..).unwrap_or_default();
            let needed = match self.needed(rest) {
                Ok(needed) => needed,
                Err(e) => break NextFrame::Invalid(e),
            };
            let Some(frame) = rest.get(..needed) else {
                break NextFrame::Incomplete { needed };
            };
            sink(frame);
            frames += 1;
            consumed += needed;
        };
        Scan {
            frames,
            consumed,
            next,
        }
    }

    /// Whether the stream may end with `rest` not yet lent (usually what
    /// the last scan left): `Ok` when `rest` is whole frames (usually
    /// none), [`FrameError::Truncated`] when it ends inside a frame (`have`
    /// counts that frame's bytes), or the error of an invalid header.
    pub fn end_of_stream(&self, mut rest: &[u8]) -> Result<(), FrameError> {
        while !rest.is_empty() {
            let needed = self.needed(rest)?;
            let Some(after) = rest.get(needed..) else {
                return Err(FrameError::Truncated {
                    needed,
                    have: rest.len(),
                });
            };
            rest = after;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Frame;
    use crate::header::Opcode;

    const LIMITS: Limits = Limits::new(1024, 1 << 20);

    fn frame(id: u64, body: usize) -> Vec<u8> {
        let mut f = Header::new(Opcode::Rpc, id, body as u32)
            .to_bytes()
            .to_vec();
        f.extend((0..body).map(|i| (i as u64 ^ id) as u8));
        f
    }

    fn stream(n: u64) -> Vec<u8> {
        (0..n)
            .flat_map(|id| frame(id, (id as usize * 29) % 200))
            .collect()
    }

    /// Feed `data` in pieces of `sizes` (cycled) through a buffer the way a
    /// backend does: append, scan up to `max`, drop what was consumed.
    fn feed(data: &[u8], sizes: &[usize], max: usize) -> (Vec<Vec<u8>>, Result<(), FrameError>) {
        let d = Deframer::new(LIMITS);
        let mut buf = Vec::new();
        let mut got = Vec::new();
        let mut at = 0;
        for &size in sizes.iter().cycle() {
            let end = data.len().min(at + size);
            buf.extend_from_slice(&data[at..end]);
            at = end;
            loop {
                let s = d.scan(&buf, max, |f: &[u8]| got.push(f.to_vec()));
                buf.drain(..s.consumed);
                match s.next {
                    NextFrame::NotRead => continue,
                    NextFrame::Incomplete { needed } => {
                        assert!(needed > buf.len(), "complete frame left behind");
                        assert_eq!(needed == HEADER_LEN, buf.len() < HEADER_LEN);
                        break;
                    }
                    NextFrame::Invalid(e) => return (got, Err(e)),
                }
            }
            if at == data.len() {
                break;
            }
        }
        (got, d.end_of_stream(&buf))
    }

    /// The stream parsed frame by frame with everything buffered.
    fn reference(mut data: &[u8]) -> (Vec<Vec<u8>>, Result<(), FrameError>) {
        let mut got = Vec::new();
        while !data.is_empty() {
            match Frame::parse(data, &LIMITS) {
                Ok((_, len)) => {
                    got.push(data[..len].to_vec());
                    data = &data[len..];
                }
                Err(e) => return (got, Err(e)),
            }
        }
        (got, Ok(()))
    }

    #[test]
    fn frames_across_odd_splits() {
        let data = stream(60);
        let want = reference(&data);
        assert_eq!(want.0.len(), 60);
        assert_eq!(want.1, Ok(()));
        for sizes in [
            &[1][..],
            &[7, 31, 1],
            &[32],
            &[33, 0, 5],
            &[4096],
            &[200, 3],
        ] {
            for max in [1, 2, 5, usize::MAX] {
                assert_eq!(feed(&data, sizes, max), want, "sizes {sizes:?} max {max}");
            }
        }
    }

    #[test]
    fn frames_are_lent_in_place() {
        let data = stream(5);
        let range = data.as_ptr_range();
        let d = Deframer::new(LIMITS);
        let mut lens = Vec::new();
        let s = d.scan(&data, usize::MAX, |f: &[u8]| {
            assert!(range.contains(&f.as_ptr()));
            lens.push(f.len());
        });
        assert_eq!(s.frames, 5);
        assert_eq!(s.consumed, data.len());
        assert_eq!(s.consumed, lens.iter().sum::<usize>());
        assert_eq!(s.next, NextFrame::Incomplete { needed: HEADER_LEN });
    }

    #[test]
    fn bad_header_after_good_frames() {
        let mut data = frame(1, 10);
        data.extend(frame(2, 0));
        let good = data.len();
        data.extend(b"garbage garbage garbage garbage garbage");
        let d = Deframer::new(LIMITS);
        let mut n = 0;
        let s = d.scan(&data, 10, |_: &[u8]| n += 1);
        assert_eq!((s.frames, s.consumed, n), (2, good, 2));
        assert!(matches!(
            s.next,
            NextFrame::Invalid(FrameError::BadMagic(_))
        ));
        // Fed a byte at a time, the header fails as soon as it is whole,
        // the same as when the stream was buffered in full.
        let (got, end) = feed(&data, &[1], 1);
        assert_eq!(got.len(), 2);
        assert!(matches!(end, Err(FrameError::BadMagic(_))));
        assert_eq!(feed(&data, &[1], 1), reference(&data));
    }

    #[test]
    fn truncated_at_end_of_stream() {
        let d = Deframer::new(LIMITS);
        let f = frame(1, 100);
        assert_eq!(d.end_of_stream(&[]), Ok(()));
        assert_eq!(d.end_of_stream(&f), Ok(()));
        assert_eq!(
            d.end_of_stream(&f[..60]),
            Err(FrameError::Truncated {
                needed: 132,
                have: 60
            })
        );
        assert_eq!(
            d.end_of_stream(&f[..5]),
            Err(FrameError::Truncated {
                needed: HEADER_LEN,
                have: 5
            })
        );
        // Whole frames before the cut do not count in `have`.
        let mut two = f.clone();
        two.extend_from_slice(&f[..40]);
        assert_eq!(
            d.end_of_stream(&two),
            Err(FrameError::Truncated {
                needed: 132,
                have: 40
            })
        );
        let mut data = stream(3);
        data.extend_from_slice(&f[..99]);
        assert_eq!(feed(&data, &[17], 2), reference(&data));
    }

    #[test]
    fn max_zero_reads_nothing() {
        let d = Deframer::new(LIMITS);
        let s = d.scan(b"not a frame at all, not even close", 0, |_: &[u8]| {
            panic!("a frame lent with max = 0")
        });
        assert_eq!(
            s,
            Scan {
                frames: 0,
                consumed: 0,
                next: NextFrame::NotRead
            }
        );
        let data = stream(3);
        let s = d.scan(&data, 2, |_: &[u8]| {});
        assert_eq!((s.frames, s.next), (2, NextFrame::NotRead));
    }

    #[test]
    fn oversized_header_fails_before_its_body() {
        let d = Deframer::new(LIMITS);
        assert_eq!(d.max_frame_len(), HEADER_LEN + 1024);
        let at_limit = frame(1, 1024);
        let s = d.scan(&at_limit, 5, |_: &[u8]| {});
        assert_eq!((s.frames, s.consumed), (1, at_limit.len()));
        // Only the header of a frame one byte over the limit is there: the
        // error comes now, not once its body was waited for.
        let over = Header::new(Opcode::Rpc, 2, 1025).to_bytes();
        let s = d.scan(&over, 5, |_: &[u8]| panic!("oversized frame lent"));
        assert_eq!(s.frames, 0);
        assert_eq!(
            s.next,
            NextFrame::Invalid(FrameError::Oversized {
                what: "frame body",
                len: 1025,
                limit: 1024
            })
        );
        assert_eq!(d.needed(&over[..31]), Ok(HEADER_LEN));
        assert!(d.needed(&over).is_err());
        assert!(matches!(
            d.end_of_stream(&over),
            Err(FrameError::Oversized { .. })
        ));
    }
}

//! Whole frames: a [`Header`] followed by `body_len` bytes of body.
//!
//! [`Frame::parse`] validates the header against [`Limits`] and then checks
//! that the whole body is present; the returned [`Frame`] borrows its body
//! from the input. [`peek_frame_len`] is the cheap variant for stream
//! backends that only need to know how many bytes to wait for.

use crate::header::{FrameError, Header, HEADER_LEN};

/// Length limits enforced on every received header.
///
/// Defaults: a frame body of at most [`Limits::DEFAULT_MAX_BODY`] bytes
/// (1 MiB − 32, so that a whole frame, header included, fits a 1 MiB buffer)
/// and a message (all chunks together) of at most
/// [`Limits::DEFAULT_MAX_MESSAGE`] bytes (1 GiB). A connection normally
/// lowers `max_body` to what the peer announced in its `Hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Largest `body_len` accepted in one frame.
    pub max_body: u32,
    /// Largest `message_len` accepted (the body of a whole chunked message).
    pub max_message: u32,
}

impl Limits {
    /// Default largest frame body: 1 MiB minus the header.
    pub const DEFAULT_MAX_BODY: u32 = (1 << 20) - HEADER_LEN as u32;
    /// Default largest message: 1 GiB.
    pub const DEFAULT_MAX_MESSAGE: u32 = 1 << 30;

    /// Limits with explicit values.
    pub const fn new(max_body: u32, max_message: u32) -> Self {
        Self {
            max_body,
            max_message,
        }
    }

    /// Limits for a backend whose largest frame, header included, is
    /// `max_frame_len` bytes; the message limit stays at its default.
    pub const fn for_max_frame(max_frame_len: u32) -> Self {
        Self {
            max_body: max_frame_len.saturating_sub(HEADER_LEN as u32),
            max_message: Self::DEFAULT_MAX_MESSAGE,
        }
    }

    /// The largest frame, header included, these limits accept.
    pub const fn max_frame_len(&self) -> usize {
        HEADER_LEN + self.max_body as usize
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::new(Self::DEFAULT_MAX_BODY, Self::DEFAULT_MAX_MESSAGE)
    }
}

/// One frame: its header and the body bytes it carries, borrowed from the
/// input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The validated header.
    pub header: Header,
    /// The `header.body_len` bytes of body of this frame (one chunk of the
    /// message when the frame is chunked).
    pub body: &'a [u8],
}

impl<'a> Frame<'a> {
    /// A frame from a header and its body.
    ///
    /// Fails with [`FrameError::BadLength`] when `header.body_len` is not
    /// `body.len()`.
    pub fn new(header: Header, body: &'a [u8]) -> Result<Self, FrameError> {
        if header.body_len as usize != body.len() {
            return Err(FrameError::BadLength(
                "header body_len differs from the body",
            ));
        }
        Ok(Self { header, body })
    }

    /// Parse the frame at the start of `bytes`.
    ///
    /// Validates the header (see [`Header::parse`]) against `limits`, then
    /// that the whole body is present. Returns the frame and the number of
    /// bytes it occupies (`32 + body_len`); `bytes` may hold more frames
    /// after it. [`FrameError::Truncated`] means more bytes are needed; every
    /// other error is a framing error that ends the connection.
    pub fn parse(bytes: &'a [u8], limits: &Limits) -> Result<(Self, usize), FrameError> {
        let header = Header::parse(bytes, limits.max_body, limits.max_message)?;
        let len = header.frame_len();
        let Some(body) = bytes.get(HEADER_LEN..len) else {
            return Err(FrameError::Truncated {
                needed: len,
                have: bytes.len(),
            });
        };
        Ok((Self { header, body }, len))
    }

    /// Bytes the frame occupies on the wire: header plus body.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body.len()
    }

    /// Write the header into `out[..32]` and return [`HEADER_LEN`]. The body
    /// is written by the caller (or sent as a separate segment).
    ///
    /// # Panics
    /// If `out` is shorter than [`HEADER_LEN`].
    pub fn emit_header(header: &Header, out: &mut [u8]) -> usize {
        crate::le::need(out, HEADER_LEN, "Frame::emit_header");
        header.emit(out);
        HEADER_LEN
    }

    /// Write a single-frame message: a header built by
    /// [`Header::new`]`(opcode, request_id, body_len)`, altered by `edit`
    /// (flags, status, shard, credit), into `out[..32]`. Returns
    /// [`HEADER_LEN`]. The caller writes the `body_len` body bytes after it.
    ///
    /// # Panics
    /// If `out` is shorter than [`HEADER_LEN`].
    pub fn emit_message_header(
        opcode: crate::header::Opcode,
        request_id: u64,
        body_len: u32,
        edit: impl FnOnce(&mut Header),
        out: &mut [u8],
    ) -> usize {
        let mut h = Header::new(opcode, request_id, body_len);
        edit(&mut h);
        Self::emit_header(&h, out)
    }

    /// Write the whole frame (header and body) into `out`; returns
    /// [`Frame::frame_len`].
    ///
    /// # Panics
    /// If `out` is shorter than the frame, or `header.body_len` is not
    /// `body.len()`.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        assert_eq!(
            self.header.body_len as usize,
            self.body.len(),
            "Frame::emit: header body_len differs from the body"
        );
        let len = self.frame_len();
        crate::le::need(out, len, "Frame::emit");
        self.header.emit(out);
        out[HEADER_LEN..len].copy_from_slice(self.body);
        len
    }
}

/// How long the frame at the start of `bytes` is, header included.
///
/// `Ok(None)` when fewer than [`HEADER_LEN`] bytes are buffered. Otherwise
/// the header is fully validated against `limits` (so a stream backend never
/// waits for a body it would reject) and its frame length returned; the body
/// itself need not be present yet.
pub fn peek_frame_len(bytes: &[u8], limits: &Limits) -> Result<Option<usize>, FrameError> {
    if bytes.len() < HEADER_LEN {
        return Ok(None);
    }
    let h = Header::parse(bytes, limits.max_body, limits.max_message)?;
    Ok(Some(h.frame_len()))
}

/// Iterator over the frames of a byte buffer, one after another.
///
/// Yields each frame, then stops at the end of the buffer. On the first
/// error (including a trailing partial frame, reported as
/// [`FrameError::Truncated`]) it yields that error once and then stops.
#[derive(Debug, Clone)]
pub struct Frames<'a> {
    rest: &'a [u8],
    limits: Limits,
    done: bool,
}

impl<'a> Frames<'a> {
    /// Iterate the frames in `bytes`.
    pub fn new(bytes: &'a [u8], limits: Limits) -> Self {
        Self {
            rest: bytes,
            limits,
            done: false,
        }
    }

    /// The bytes not yet consumed.
    pub fn remaining(&self) -> &'a [u8] {
        self.rest
    }
}

impl<'a> Iterator for Frames<'a> {
    type Item = Result<Frame<'a>, FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done || self.rest.is_empty() {
            return None;
        }
        match Frame::parse(self.rest, &self.limits) {
            Ok((frame, used)) => {
                self.rest = self.rest.get(used..).unwrap_or_default();
                Some(Ok(frame))
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::{Flags, Opcode, Status};

    fn frame_bytes(op: Opcode, body: &[u8]) -> Vec<u8> {
        let h = Header::new(op, 7, body.len() as u32);
        let f = Frame::new(h, body).unwrap();
        let mut out = vec![0; f.frame_len()];
        assert_eq!(f.emit(&mut out), out.len());
        out
    }

    #[test]
    fn parse_round_trip_and_consumed() {
        let mut bytes = frame_bytes(Opcode::Rpc, &[1, 2, 3, 4, 5, 6, 7, 8]);
        bytes.extend(frame_bytes(Opcode::Ping, &[]));
        let (f, used) = Frame::parse(&bytes, &Limits::default()).unwrap();
        assert_eq!(used, 40);
        assert_eq!(f.body, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(f.header.opcode, Opcode::Rpc);
        // zero copy: the body lies inside the input
        let r = bytes.as_ptr_range();
        assert!(r.contains(&f.body.as_ptr()));
        let (p, used2) = Frame::parse(&bytes[used..], &Limits::default()).unwrap();
        assert_eq!(used2, 32);
        assert_eq!(p.header.opcode, Opcode::Ping);
        let all: Vec<_> = Frames::new(&bytes, Limits::default()).collect();
        assert_eq!(all.len(), 2);
        assert!(all.iter().all(Result::is_ok));
    }

    #[test]
    fn truncated_body() {
        let bytes = frame_bytes(Opcode::Rpc, &[0; 16]);
        assert_eq!(
            Frame::parse(&bytes[..40], &Limits::default()),
            Err(FrameError::Truncated {
                needed: 48,
                have: 40
            })
        );
        assert_eq!(peek_frame_len(&bytes[..31], &Limits::default()), Ok(None));
        assert_eq!(
            peek_frame_len(&bytes[..32], &Limits::default()),
            Ok(Some(48))
        );
        let mut it = Frames::new(&bytes[..40], Limits::default());
        assert!(matches!(it.next(), Some(Err(FrameError::Truncated { .. }))));
        assert!(it.next().is_none());
    }

    #[test]
    fn limits_enforced() {
        let bytes = frame_bytes(Opcode::Rpc, &[0; 64]);
        let small = Limits::new(32, 1024);
        assert!(matches!(
            Frame::parse(&bytes, &small),
            Err(FrameError::Oversized {
                what: "frame body",
                ..
            })
        ));
        assert!(matches!(
            peek_frame_len(&bytes, &small),
            Err(FrameError::Oversized { .. })
        ));
        let msg = Limits::new(1024, 32);
        assert!(matches!(
            Frame::parse(&bytes, &msg),
            Err(FrameError::Oversized {
                what: "message",
                ..
            })
        ));
        assert_eq!(Limits::for_max_frame(4096).max_frame_len(), 4096);
        assert_eq!(Limits::default().max_frame_len(), 1 << 20);
    }

    #[test]
    fn header_helpers() {
        let mut out = [0u8; 32];
        let n = Frame::emit_message_header(
            Opcode::SparsePull,
            9,
            0,
            |h| {
                h.flags = Flags::RESPONSE;
                h.status = Status::UnknownVariable;
            },
            &mut out,
        );
        assert_eq!(n, 32);
        let (f, _) = Frame::parse(&out, &Limits::default()).unwrap();
        assert_eq!(f.header.status, Status::UnknownVariable);
        assert!(f.header.flags.contains(Flags::RESPONSE));
        assert!(matches!(
            Frame::new(Header::new(Opcode::Rpc, 1, 3), &[0; 2]),
            Err(FrameError::BadLength(_))
        ));
    }
}

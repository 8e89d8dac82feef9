//! Chunking of messages longer than a frame.
//!
//! A message whose body exceeds the backend's largest frame body is sent as
//! several frames with the same opcode, request id, status, shard and
//! `message_len` (the whole body); `body_len` is the chunk carried by each
//! frame. `MORE` is set on every frame but the last, `CONTINUATION` on every
//! frame but the first. Chunks are non-empty and go in order.
//!
//! On one connection direction at most one chunked message is in flight:
//! once its first chunk is sent, the next non-control frame must be its next
//! chunk. Control frames (never chunked) may appear between chunks.
//!
//! [`ChunkPlan`] produces the headers for a sender; [`ChunkAssembler`]
//! checks a receiver's frame sequence without holding any data, telling
//! where each chunk's bytes belong. A receiver that reassembles should grow
//! its buffer as chunks arrive rather than allocate `message_len` up front.

use core::ops::Range;

use crate::header::{Flags, FrameError, Header, Opcode, Status};

/// Headers and body ranges for sending one message of `message_len` bytes
/// in frames of at most `max_body` bytes of body.
#[derive(Debug, Clone)]
pub struct ChunkPlan {
    template: Header,
    message_len: u32,
    max_body: u32,
    sent: u32,
    first: bool,
}

impl ChunkPlan {
    /// Plan the frames for a message. `template` supplies the opcode,
    /// request id, status, shard and `RESPONSE`/`ONEWAY` flags; its credit is
    /// put on the first frame only. A message that fits (including an empty
    /// one) is a single unchunked frame. A `max_body` of 0 is treated as 1.
    ///
    /// Control opcodes must fit one frame: the header parser rejects chunked
    /// control frames.
    pub fn new(template: Header, message_len: u32, max_body: u32) -> Self {
        let flags = template
            .flags
            .without(Flags::MORE)
            .without(Flags::CONTINUATION);
        Self {
            template: Header { flags, ..template },
            message_len,
            max_body: max_body.max(1),
            sent: 0,
            first: true,
        }
    }

    /// Number of frames the plan yields.
    pub fn frame_count(&self) -> usize {
        if self.message_len == 0 {
            1
        } else {
            self.message_len.div_ceil(self.max_body) as usize
        }
    }
}

impl Iterator for ChunkPlan {
    /// A frame header and the range of the message body it carries.
    type Item = (Header, Range<usize>);

    fn next(&mut self) -> Option<Self::Item> {
        if !self.first && self.sent >= self.message_len {
            return None;
        }
        let start = self.sent;
        let len = (self.message_len - start).min(self.max_body);
        let end = start + len;
        let single = self.first && end == self.message_len;
        let mut h = self.template;
        h.body_len = len;
        h.message_len = self.message_len;
        if !single {
            if end < self.message_len {
                h.flags = h.flags.with(Flags::MORE);
            }
            if !self.first {
                h.flags = h.flags.with(Flags::CONTINUATION);
                h.credit = 0;
            }
        }
        self.first = false;
        self.sent = end;
        Some((h, start as usize..end as usize))
    }
}

/// Where a received frame's body belongs in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// An unchunked frame: its body is the whole message.
    Whole,
    /// One chunk of a chunked message.
    Part {
        /// Byte offset of this chunk in the message body.
        offset: u32,
        /// True for the last chunk: the message is complete.
        last: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct InFlight {
    opcode: Opcode,
    request_id: u64,
    status: Status,
    shard_id: u16,
    kind: Flags,
    message_len: u32,
    received: u32,
}

/// Receiver-side check of chunk sequencing, holding no data.
///
/// Every violation is a framing error ([`FrameError::BadLength`]).
#[derive(Debug, Clone, Default)]
pub struct ChunkAssembler {
    in_flight: Option<InFlight>,
}

impl ChunkAssembler {
    /// A fresh assembler with nothing in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// True while a chunked message is partly received.
    pub fn in_progress(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Bytes received so far of the message in flight, and its length.
    pub fn progress(&self) -> Option<(u32, u32)> {
        self.in_flight.map(|m| (m.received, m.message_len))
    }

    /// Account for a received (already header-validated) frame.
    pub fn accept(&mut self, h: &Header) -> Result<Chunk, FrameError> {
        let more = h.flags.contains(Flags::MORE);
        let cont = h.flags.contains(Flags::CONTINUATION);
        if !more && !cont {
            if self.in_flight.is_some() && !h.opcode.is_control() {
                return Err(FrameError::BadLength(
                    "new message while a chunked message is in flight",
                ));
            }
            return Ok(Chunk::Whole);
        }
        if h.body_len == 0 {
            return Err(FrameError::BadLength("empty chunk"));
        }
        let kind = h.flags.without(Flags::MORE).without(Flags::CONTINUATION);
        if !cont {
            // First chunk.
            if self.in_flight.is_some() {
                return Err(FrameError::BadLength(
                    "new message while a chunked message is in flight",
                ));
            }
            if h.body_len >= h.message_len {
                return Err(FrameError::BadLength("first chunk holds the whole message"));
            }
            self.in_flight = Some(InFlight {
                opcode: h.opcode,
                request_id: h.request_id,
                status: h.status,
                shard_id: h.shard_id,
                kind,
                message_len: h.message_len,
                received: h.body_len,
            });
            return Ok(Chunk::Part {
                offset: 0,
                last: false,
            });
        }
        let Some(mut m) = self.in_flight else {
            return Err(FrameError::BadLength("continuation without a first chunk"));
        };
        if m.opcode != h.opcode
            || m.request_id != h.request_id
            || m.status != h.status
            || m.shard_id != h.shard_id
            || m.kind != kind
            || m.message_len != h.message_len
        {
            return Err(FrameError::BadLength(
                "continuation does not match its message",
            ));
        }
        let offset = m.received;
        let end = offset
            .checked_add(h.body_len)
            .filter(|&e| e <= m.message_len)
            .ok_or(FrameError::BadLength("chunks exceed the message length"))?;
        if more {
            if end == m.message_len {
                return Err(FrameError::BadLength(
                    "MORE set on a chunk that completes the message",
                ));
            }
            m.received = end;
            self.in_flight = Some(m);
            Ok(Chunk::Part {
                offset,
                last: false,
            })
        } else {
            if end != m.message_len {
                return Err(FrameError::BadLength(
                    "last chunk ends short of the message length",
                ));
            }
            self.in_flight = None;
            Ok(Chunk::Part { offset, last: true })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_and_assemble() {
        let mut t = Header::new(Opcode::SparsePush, 5, 0);
        t.flags = Flags::ONEWAY;
        t.credit = 3;
        let plan = ChunkPlan::new(t, 25, 10);
        assert_eq!(plan.frame_count(), 3);
        let frames: Vec<_> = plan.collect();
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].1, 0..10);
        assert_eq!(frames[2].1, 20..25);
        assert!(frames[0].0.flags.contains(Flags::MORE));
        assert!(!frames[0].0.flags.contains(Flags::CONTINUATION));
        assert_eq!(frames[0].0.credit, 3);
        assert!(frames[1]
            .0
            .flags
            .contains(Flags::MORE.with(Flags::CONTINUATION)));
        assert_eq!(frames[1].0.credit, 0);
        assert!(!frames[2].0.flags.contains(Flags::MORE));
        assert!(frames[2]
            .0
            .flags
            .contains(Flags::CONTINUATION.with(Flags::ONEWAY)));
        let mut a = ChunkAssembler::new();
        let mut got = Vec::new();
        for (h, r) in &frames {
            // every planned header passes the header parser
            let p = Header::parse(&h.to_bytes(), 10, 100).unwrap();
            got.push(a.accept(&p).unwrap());
            assert_eq!(r.len(), h.body_len as usize);
        }
        assert_eq!(
            got,
            vec![
                Chunk::Part {
                    offset: 0,
                    last: false
                },
                Chunk::Part {
                    offset: 10,
                    last: false
                },
                Chunk::Part {
                    offset: 20,
                    last: true
                }
            ]
        );
        assert!(!a.in_progress());
        // a control frame in between is fine
        let mut a = ChunkAssembler::new();
        a.accept(&frames[0].0).unwrap();
        assert_eq!(a.progress(), Some((10, 25)));
        assert_eq!(a.accept(&Header::new(Opcode::Ping, 0, 0)), Ok(Chunk::Whole));
        a.accept(&frames[1].0).unwrap();
    }

    #[test]
    fn single_frame_plans() {
        let t = Header::new(Opcode::Rpc, 1, 0);
        let f: Vec<_> = ChunkPlan::new(t, 0, 10).collect();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].0.flags, Flags::NONE);
        let f: Vec<_> = ChunkPlan::new(t, 10, 10).collect();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].0.body_len, 10);
        assert_eq!(f[0].0.flags, Flags::NONE);
    }

    #[test]
    fn sequencing_errors() {
        let t = Header::new(Opcode::DensePush, 9, 0);
        let frames: Vec<_> = ChunkPlan::new(t, 30, 10).map(|(h, _)| h).collect();
        let bad = |a: &mut ChunkAssembler, h: &Header| {
            assert!(
                matches!(a.accept(h), Err(FrameError::BadLength(_))),
                "{h:?}"
            );
        };
        let mut a = ChunkAssembler::new();
        bad(&mut a, &frames[1]); // continuation first
        a.accept(&frames[0]).unwrap();
        bad(&mut a.clone(), &frames[0]); // second first chunk
        bad(&mut a.clone(), &Header::new(Opcode::Rpc, 1, 0)); // interleaved message
        let mut other = frames[1];
        other.request_id = 10;
        bad(&mut a.clone(), &other);
        let mut short = frames[2];
        short.body_len = 5;
        bad(&mut a.clone(), &short); // skips the middle: ends short
        let mut long = frames[1];
        long.body_len = 25;
        bad(&mut a.clone(), &long);
        let mut empty = frames[1];
        empty.body_len = 0;
        bad(&mut a.clone(), &empty);
        let mut done_more = frames[1];
        done_more.body_len = 20;
        bad(&mut a.clone(), &done_more);
        let mut whole = frames[0];
        whole.body_len = 30;
        bad(&mut ChunkAssembler::new(), &whole);
    }
}

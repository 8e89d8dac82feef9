//! [`check_deframe`]: the stream deframer against a reference, and
//! [`Deframe`], the target of the driver `fuzz-deframe`.
//!
//! The reference parses the whole stream frame by frame with
//! [`Frame::parse`]. The deframer is fed the same stream in fuzz-chosen
//! pieces, the two ways the backends use it:
//!
//! * buffered (tcp): each piece is appended to one buffer, which is
//!   scanned, up to `max` frames a scan, and drained of what was consumed;
//! * chunked (io_uring): each piece is scanned where it lies; the start of
//!   a frame it does not complete goes to a reassembly buffer, which the
//!   next pieces fill up to [`Deframer::needed`] before it is scanned.
//!
//! Both must lend the same frames, byte for byte, and end with the same
//! error as the reference (a stream cut inside a frame ends with
//! [`FrameError::Truncated`] from [`Deframer::end_of_stream`]).
//!
//! An input is a few control bytes, then the stream:
//!
//! ```text
//! byte 0      bit 0: the small limits; bits 1..4: max frames per scan
//! byte 1      k, the number of piece sizes (k % 16 + 1)
//! bytes 2..   k piece sizes, used in turn (b < 128: b bytes; else
//!             (b - 128) * 64 bytes)
//! the rest    the stream
//! ```

use std::collections::BTreeMap;

use rand::Rng;
use starwire_wire::{Deframer, Frame, FrameError, Limits, NextFrame, HEADER_LEN};

use crate::driver::{Spec, Target};
use crate::{frame_error_kind, seeds, Decode, Frames, Mutator, SMALL_LIMITS};

/// Frames per scan, chosen by bits 1..4 of the first control byte.
const MAX_PER_SCAN: [usize; 8] = [1, 2, 3, 4, 8, 16, 64, usize::MAX];

/// What a stream held, as both the reference and the deframer saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeframeOutcome {
    /// Length of each frame, in order.
    pub frames: Vec<usize>,
    /// How the stream ended: `Ok` after whole frames, else the first
    /// framing error.
    pub end: Result<(), FrameError>,
}

/// The control bytes of an input, decoded.
#[derive(Clone, PartialEq, Eq)]
pub struct Feed<'a> {
    /// Limits of the deframer and of the reference.
    pub limits: Limits,
    /// Frames a scan may lend (at least 1).
    pub max: usize,
    /// Sizes of the pieces, used in turn (a 0 is a receive that got
    /// nothing).
    pub pieces: Vec<usize>,
    /// The byte stream.
    pub stream: &'a [u8],
}

/// The stream by its length: an input may be 64 KiB.
impl std::fmt::Debug for Feed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed")
            .field("limits", &self.limits)
            .field("max", &self.max)
            .field("pieces", &self.pieces)
            .field("stream_len", &self.stream.len())
            .finish()
    }
}

impl<'a> Feed<'a> {
    /// Decode an input (see the module docs); missing control bytes take
    /// defaults, so every input is valid.
    pub fn parse(data: &'a [u8]) -> Self {
        let mode = data.first().copied().unwrap_or(0);
        let k = usize::from(data.get(1).copied().unwrap_or(0) % 16) + 1;
        let sizes = data.get(2..).unwrap_or_default();
        let k = k.min(sizes.len());
        let pieces: Vec<usize> = sizes[..k]
            .iter()
            .map(|&b| {
                if b < 128 {
                    usize::from(b)
                } else {
                    usize::from(b - 128) * 64
                }
            })
            .collect();
        Self {
            limits: if mode & 1 == 1 {
                SMALL_LIMITS
            } else {
                Limits::default()
            },
            max: MAX_PER_SCAN[usize::from(mode >> 1) & 7],
            pieces: if pieces.iter().any(|&p| p > 0) {
                pieces
            } else {
                vec![usize::MAX]
            },
            stream: data.get(2 + k..).unwrap_or_default(),
        }
    }

    /// Control bytes that [`Feed::parse`] decodes into `max` (an index
    /// into the choices), the small or default limits and `pieces` (each
    /// a byte, see the module docs), for building inputs.
    pub fn control(small: bool, max: u8, pieces: &[u8]) -> Vec<u8> {
        let mut c = vec![u8::from(small) | (max & 7) << 1];
        let k = pieces.len().clamp(1, 16);
        c.push((k - 1) as u8);
        c.extend(pieces.iter().take(k));
        c
    }

    /// The stream in pieces, in turn, until it is all handed out.
    fn pieces(&self) -> impl Iterator<Item = &'a [u8]> + '_ {
        let mut at = 0;
        self.pieces.iter().cycle().map_while(move |&size| {
            if at == self.stream.len() {
                return None;
            }
            let end = self.stream.len().min(at.saturating_add(size));
            let piece = &self.stream[at..end];
            at = end;
            Some(piece)
        })
    }
}

/// Run the deframer both ways on the input and compare with the
/// reference. Returns the common outcome, or what differed.
pub fn check_deframe(data: &[u8]) -> Result<DeframeOutcome, String> {
    let feed = Feed::parse(data);
    let want = reference(feed.stream, &feed.limits);
    let buffered = buffered(&feed)?;
    if buffered != want {
        return Err(format!(
            "buffered: {buffered:?}\n reference: {want:?}\n feed: {feed:?}"
        ));
    }
    let chunked = chunked(&feed)?;
    if chunked != want {
        return Err(format!(
            "chunked: {chunked:?}\n reference: {want:?}\n feed: {feed:?}"
        ));
    }
    Ok(want)
}

/// The stream parsed frame by frame with all of it at hand.
fn reference(mut stream: &[u8], limits: &Limits) -> DeframeOutcome {
    let mut frames = Vec::new();
    while !stream.is_empty() {
        match Frame::parse(stream, limits) {
            Ok((_, len)) => {
                frames.push(len);
                stream = &stream[len..];
            }
            Err(e) => {
                return DeframeOutcome {
                    frames,
                    end: Err(e),
                }
            }
        }
    }
    DeframeOutcome {
        frames,
        end: Ok(()),
    }
}

/// Checks each lent frame against the stream (its bytes, the bytes after
/// the frame before it) and records its length.
struct Lent<'a> {
    stream: &'a [u8],
    at: usize,
    frames: Vec<usize>,
    wrong: Option<String>,
}

impl<'a> Lent<'a> {
    fn new(stream: &'a [u8]) -> Self {
        Self {
            stream,
            at: 0,
            frames: Vec::new(),
            wrong: None,
        }
    }

    fn take(&mut self, f: &[u8]) {
        let want = self.stream.get(self.at..self.at + f.len());
        if want != Some(f) && self.wrong.is_none() {
            self.wrong = Some(format!(
                "frame {} ({} bytes at {}) differs from the stream",
                self.frames.len(),
                f.len(),
                self.at
            ));
        }
        self.at += f.len();
        self.frames.push(f.len());
    }

    fn outcome(self, end: Result<(), FrameError>) -> Result<DeframeOutcome, String> {
        match self.wrong {
            Some(w) => Err(w),
            None => Ok(DeframeOutcome {
                frames: self.frames,
                end,
            }),
        }
    }
}

/// An incomplete frame must need more than is there, its header's length
/// only once the header is whole, and never more than the limits allow.
fn check_needed(d: &Deframer, needed: usize, have: usize) -> Result<(), String> {
    if needed <= have || needed > d.max_frame_len() || (have < HEADER_LEN && needed != HEADER_LEN) {
        return Err(format!("incomplete frame needs {needed} with {have} there"));
    }
    Ok(())
}

/// The tcp way: one buffer, appended to and drained.
fn buffered(feed: &Feed<'_>) -> Result<DeframeOutcome, String> {
    let d = Deframer::new(feed.limits);
    let mut lent = Lent::new(feed.stream);
    let mut buf = Vec::new();
    for piece in feed.pieces() {
        buf.extend_from_slice(piece);
        loop {
            let range = buf.as_ptr_range();
            let s = d.scan(&buf, feed.max, |f: &[u8]| {
                if !range.contains(&f.as_ptr()) {
                    lent.wrong = Some("a frame not lent in place".into());
                }
                lent.take(f);
            });
            buf.drain(..s.consumed);
            match s.next {
                NextFrame::NotRead => {}
                NextFrame::Incomplete { needed } => {
                    check_needed(&d, needed, buf.len())?;
                    break;
                }
                NextFrame::Invalid(e) => return lent.outcome(Err(e)),
            }
        }
    }
    let end = d.end_of_stream(&buf);
    lent.outcome(end)
}

/// The io_uring way: pieces scanned in place, a reassembly buffer for a
/// frame that straddles them.
fn chunked(feed: &Feed<'_>) -> Result<DeframeOutcome, String> {
    let d = Deframer::new(feed.limits);
    let mut lent = Lent::new(feed.stream);
    let mut partial: Vec<u8> = Vec::new();
    for mut piece in feed.pieces() {
        while !piece.is_empty() {
            if !partial.is_empty() {
                let want = match d.needed(&partial) {
                    Ok(want) => want,
                    Err(e) => return lent.outcome(Err(e)),
                };
                check_needed(&d, want, partial.len())?;
                let take = (want - partial.len()).min(piece.len());
                partial.extend_from_slice(&piece[..take]);
                piece = &piece[take..];
                let s = d.scan(&partial, 1, |f: &[u8]| lent.take(f));
                match s.next {
                    NextFrame::Invalid(e) => return lent.outcome(Err(e)),
                    _ if s.frames == 1 => partial.clear(),
                    _ => {}
                }
                continue;
            }
            let s = d.scan(piece, feed.max, |f: &[u8]| lent.take(f));
            match s.next {
                NextFrame::NotRead => piece = &piece[s.consumed..],
                NextFrame::Incomplete { needed } => {
                    let rest = &piece[s.consumed..];
                    check_needed(&d, needed, rest.len())?;
                    partial.extend_from_slice(rest);
                    piece = &[];
                }
                NextFrame::Invalid(e) => return lent.outcome(Err(e)),
            }
        }
    }
    let end = d.end_of_stream(&partial);
    lent.outcome(end)
}

/// [`check_deframe`] as a driver target (`fuzz-deframe`). A corpus entry
/// is a stream; a run puts control bytes in front of the mutated stream
/// (the small or default limits, frames per scan, piece sizes). An input
/// joins the corpus when the frames it lent (capped at 4), how it ended
/// and its limits are new. A difference from the reference fails the run.
#[derive(Debug, Default)]
pub struct Deframe {
    frames: u64,
    ends: BTreeMap<&'static str, u64>,
}

/// Piece sizes: mostly short (cuts inside headers and bodies), some long
/// (many frames per piece).
fn piece_sizes(m: &mut Mutator<Frames>) -> Vec<u8> {
    let k = m.rng().gen_range(1..=4);
    (0..k)
        .map(|_| match m.rng().gen_range(0..4) {
            0 | 1 => m.rng().gen_range(0..64),
            2 => m.rng().gen_range(128..=255),
            _ => m.rng().gen(),
        })
        .collect()
}

impl Target for Deframe {
    const SPEC: Spec = Spec {
        name: "fuzz-deframe",
        corpus_flags: false,
        failure_prefix: "deframe",
        ..Decode::SPEC
    };
    type Mutation = Frames;
    /// The small limits.
    type Case = bool;
    type Key = (usize, &'static str, bool);

    fn seeds(&self) -> Vec<Vec<u8>> {
        seeds::corpus()
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<Frames>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> bool {
        // A fifth of the streams unmutated, so long runs of valid frames
        // stay common.
        if m.rng().gen_bool(0.8) {
            m.mutate(input, corpus);
        }
        let small = m.rng().gen_bool(0.5);
        let max = m.rng().gen_range(0..8);
        let pieces = piece_sizes(m);
        input.splice(0..0, Feed::control(small, max, &pieces));
        small
    }

    fn entry<'a>(&self, input: &'a [u8]) -> &'a [u8] {
        Feed::parse(input).stream
    }

    fn run(&mut self, &small: &bool, input: &[u8]) -> Result<Self::Key, String> {
        let out = check_deframe(input).map_err(|diff| format!("DIFFERENCE: {diff}"))?;
        self.frames += out.frames.len() as u64;
        let end = out.end.as_ref().map_or_else(frame_error_kind, |()| "whole");
        *self.ends.entry(end).or_default() += 1;
        Ok((out.frames.len().min(4), end, small))
    }

    fn progress(&self) -> String {
        format!("frames {}", self.frames)
    }

    fn summary(&self) -> Vec<String> {
        vec![
            format!("{} frames lent", self.frames),
            format!("streams ended by kind: {:?}", self.ends),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        // The input holds its own choices (the feed's control bytes).
        let small = Feed::parse(input).limits == SMALL_LIMITS;
        self.run(&small, input).map(drop)
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        println!("{:?}", Feed::parse(input));
        match check_deframe(input) {
            Ok(out) => {
                println!("same as the reference: {out:?}");
                true
            }
            Err(e) => {
                println!("differs: {e}");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_in_every_feed() {
        for (i, s) in seeds::corpus().iter().enumerate() {
            for small in [false, true] {
                for max in 0..8 {
                    for pieces in [&[1][..], &[31, 0, 33], &[200], &[130, 7]] {
                        let mut input = Feed::control(small, max, pieces);
                        input.extend_from_slice(s);
                        let out = check_deframe(&input).unwrap_or_else(|e| panic!("seed {i}: {e}"));
                        if !small {
                            assert_eq!(out.end, Ok(()), "seed {i}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn control_bytes_round_trip() {
        let mut input = Feed::control(true, 5, &[3, 129]);
        input.extend_from_slice(b"stream");
        let f = Feed::parse(&input);
        assert_eq!(f.limits, SMALL_LIMITS);
        assert_eq!(f.max, 16);
        assert_eq!(f.pieces, vec![3, 64]);
        assert_eq!(f.stream, b"stream");
        let pieces: Vec<&[u8]> = f.pieces().collect();
        assert_eq!(pieces, vec![&b"str"[..], b"eam"]);
        // Missing control bytes and all-zero sizes still give a feed that
        // ends.
        assert_eq!(Feed::parse(&[]).stream, b"");
        let zeros = Feed::parse(&[0, 3, 0, 0, 0, 0, 1, 2]);
        assert_eq!(zeros.pieces().count(), 1);
    }

    #[test]
    fn a_cut_stream_ends_truncated_both_ways() {
        let s = &seeds::corpus()[0];
        let mut input = Feed::control(false, 0, &[5]);
        input.extend_from_slice(&s[..s.len() - 1]);
        let out = check_deframe(&input).unwrap();
        assert_eq!(
            out.end,
            Err(FrameError::Truncated {
                needed: s.len(),
                have: s.len() - 1
            })
        );
    }
}

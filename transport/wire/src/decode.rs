//! [`decode_any`]: parse a byte stream of frames end to end, touching every
//! decoded value. It is the fuzzing entry point and a reference for how the
//! pieces fit; it must never panic, whatever the input.
//!
//! A libFuzzer / cargo-fuzz target is a one-liner (not built here, since it
//! needs nightly and `libfuzzer-sys`):
//!
//! ```text
//! // fuzz/fuzz_targets/decode.rs
//! #![no_main]
//! libfuzzer_sys::fuzz_target!(|data: &[u8]| {
//!     let _ = starwire_wire::decode_any(data, &starwire_wire::Limits::new(4096, 1 << 20));
//! });
//! ```

use core::hash::{Hash, Hasher};

use crate::chunk::{Chunk, ChunkAssembler};
use crate::frame::{Frames, Limits};
use crate::header::{FrameError, Header};
use crate::message::{Body, BodyError};
use crate::ps::{Control, F32s, PullItem, PullReply, PushItem, U64s};
use crate::tensor::{DType, TensorView};

/// What [`decode_any`] saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodeSummary {
    /// Frames parsed.
    pub frames: usize,
    /// Complete messages (single frames or reassembled chunks) whose body
    /// was parsed.
    pub messages: usize,
    /// Messages whose body parsed.
    pub bodies_ok: usize,
    /// Messages whose body failed ([`BodyError`]); the stream goes on.
    pub body_errors: usize,
    /// A bit per kind of body error seen (a hash of the variant), for
    /// fuzzers that want a cheap novelty signal.
    pub body_error_kinds: u64,
    /// Tensor elements visited.
    pub elements: u64,
    /// A checksum over everything visited, so no work is optimised away.
    pub checksum: u64,
}

/// Parse every frame of `bytes` in order, reassemble chunked messages
/// (copying their chunks into one buffer that grows only with bytes actually
/// present), parse each message body with the parser for its opcode, and
/// visit every dim and element.
///
/// Returns the first framing error (a trailing partial frame is
/// [`FrameError::Truncated`]); body errors are counted and decoding goes on,
/// as a connection would answer that request with a status and continue.
pub fn decode_any(bytes: &[u8], limits: &Limits) -> Result<DecodeSummary, FrameError> {
    let mut s = DecodeSummary::default();
    let mut chunks = ChunkAssembler::new();
    let mut assembled: Vec<u8> = Vec::new();
    let mut first: Option<Header> = None;
    for frame in Frames::new(bytes, *limits) {
        let frame = frame?;
        s.frames += 1;
        match chunks.accept(&frame.header)? {
            Chunk::Whole => visit_body(&mut s, &frame.header, frame.body),
            Chunk::Part { offset, last } => {
                if offset == 0 {
                    assembled.clear();
                    first = Some(frame.header);
                }
                if assembled.len() != offset as usize {
                    // ChunkAssembler guarantees order; keep going safely.
                    return Err(FrameError::BadLength("chunk offset out of order"));
                }
                assembled.extend_from_slice(frame.body);
                if last {
                    let h = first.take().unwrap_or(frame.header);
                    visit_body(&mut s, &h, &assembled);
                    assembled.clear();
                }
            }
        }
    }
    if chunks.in_progress() {
        let (have, needed) = chunks.progress().unwrap_or((0, 0));
        return Err(FrameError::Truncated {
            needed: needed as usize,
            have: have as usize,
        });
    }
    Ok(s)
}

fn mix(s: &mut DecodeSummary, v: u64) {
    s.checksum = s.checksum.rotate_left(5) ^ v;
}

fn visit_body(s: &mut DecodeSummary, h: &Header, body: &[u8]) {
    s.messages += 1;
    match Body::parse(h, body) {
        Ok(b) => {
            s.bodies_ok += 1;
            visit(s, &b);
        }
        Err(e) => {
            s.body_errors += 1;
            s.body_error_kinds |= 1 << (kind_hash(&e) % 64);
        }
    }
}

fn kind_hash(e: &BodyError) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    core::mem::discriminant(e).hash(&mut h);
    match e {
        BodyError::Layout(inner) => core::mem::discriminant(inner).hash(&mut h),
        BodyError::Ps(inner) => core::mem::discriminant(inner).hash(&mut h),
        BodyError::Control(inner) => core::mem::discriminant(inner).hash(&mut h),
        _ => {}
    }
    h.finish()
}

fn visit(s: &mut DecodeSummary, b: &Body<'_>) {
    match b {
        Body::Empty => {}
        Body::Hello(h) => {
            mix(s, h.incarnation ^ u64::from(h.task_index));
            mix(s, h.job_name.chars().map(u64::from).sum());
            mix(s, h.nonce.iter().map(|&b| u64::from(b)).sum());
        }
        Body::Auth(a) => {
            mix(s, a.proof.iter().map(|&b| u64::from(b)).sum());
            mix(s, a.config.len() as u64);
        }
        Body::Tensors(list) => {
            for t in list.iter() {
                tensor(s, &t);
            }
        }
        Body::Control(c) => mix(
            s,
            match c {
                Control::WaitStep(n) => *n,
                Control::Checkpoint(dir) => dir.len() as u64,
                Control::Stats => 3,
                Control::Done => 4,
                Control::CheckpointAt(c) => c ^ 5,
                Control::ResumeAt(s) => s ^ 6,
                Control::CheckpointVote { step, want } => step ^ (7 + u64::from(*want)),
            },
        ),
        Body::PullRequest(r) => {
            for item in r.items() {
                mix(s, u64::from(item.var()));
                match item {
                    PullItem::Dense { .. } => {}
                    PullItem::Rows { keys, .. } => u64s(s, keys),
                    PullItem::Pooled { offsets, keys, .. } => {
                        mix(s, offsets.iter().map(u64::from).sum());
                        u64s(s, keys);
                    }
                }
            }
        }
        Body::PullResponse(r) => {
            mix(s, r.global_step);
            for item in r.items() {
                match item {
                    PullReply::Dense { var, data }
                    | PullReply::Rows { var, data, .. }
                    | PullReply::Pooled { var, data, .. } => {
                        mix(s, u64::from(var));
                        f32s(s, data);
                    }
                }
            }
        }
        Body::PushRequest(r) => {
            mix(s, u64::from(r.completes_step));
            for item in r.items() {
                mix(s, u64::from(item.var()));
                match item {
                    PushItem::Dense { grad, .. } => f32s(s, grad),
                    PushItem::Rows { keys, grads, .. } => {
                        u64s(s, keys);
                        f32s(s, grads);
                    }
                    PushItem::Pooled {
                        offsets,
                        keys,
                        grads,
                        ..
                    } => {
                        mix(s, offsets.iter().map(u64::from).sum());
                        u64s(s, keys);
                        f32s(s, grads);
                    }
                }
            }
        }
        Body::PushResponse(step) => mix(s, *step),
        Body::Opaque(bytes) => mix(s, bytes.iter().map(|&b| u64::from(b)).sum()),
        Body::Error(text) => mix(s, text.len() as u64),
    }
}

fn u64s(s: &mut DecodeSummary, v: U64s<'_>) {
    s.elements = s.elements.wrapping_add(v.len() as u64);
    mix(s, v.iter().fold(0u64, u64::wrapping_add));
}

fn f32s(s: &mut DecodeSummary, v: F32s<'_>) {
    s.elements = s.elements.wrapping_add(v.len() as u64);
    mix(
        s,
        v.iter()
            .map(|x| u64::from(x.to_bits()))
            .fold(0, u64::wrapping_add),
    );
}

fn tensor(s: &mut DecodeSummary, t: &TensorView<'_>) {
    let dims = t.dims();
    let dim_sum = dims.iter().fold(0u64, u64::wrapping_add);
    mix(s, dim_sum ^ t.key() ^ (dims.len() as u64));
    let mut n = 0u64;
    let mut acc = 0u64;
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => {
            for v in t.widened_f32s().into_iter().flatten() {
                acc = acc.wrapping_add(u64::from(v.to_bits()));
                n += 1;
            }
            if let Some(sl) = t.try_as_f32_slice() {
                acc ^= sl.len() as u64;
            }
        }
        DType::I64 => {
            for v in t.i64s().into_iter().flatten() {
                acc = acc.wrapping_add(v as u64);
                n += 1;
            }
            if let Some(sl) = t.try_as_i64_slice() {
                acc ^= sl.len() as u64;
            }
        }
        DType::U8 => {
            for &b in t.data() {
                acc = acc.wrapping_add(u64::from(b));
                n += 1;
            }
        }
    }
    s.elements = s.elements.wrapping_add(n);
    mix(s, acc ^ t.num_elements());
}

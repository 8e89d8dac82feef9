//! The starwire wire format: frame headers, tensor records, fused tensor lists
//! and the parameter-server protocol.
//!
//! The style follows smoltcp's `wire` module: a checked view over bytes that
//! validates every length before anything is read, a plain `Repr` that is
//! `parse`d from and `emit`ted into a buffer, and explicit little-endian fields.
//! Nothing here allocates on the decode path; decoded tensors borrow the frame.
//!
//! * [`header`]: the fixed 32-byte frame header.
//! * [`frame`]: whole frames, [`Limits`], [`peek_frame_len`].
//! * [`deframe`]: [`Deframer`], complete frames found in a received byte
//!   stream, for stream backends.
//! * [`chunk`]: splitting long messages into frames and checking their order.
//! * [`tensor`]: one tensor record ([`TensorView`] to read, [`TensorRef`] to write).
//! * [`tensors`]: fused tensor lists (opcode `Tensors`).
//! * [`ps`]: the parameter-server protocol: pull, push and control bodies.
//! * [`message`]: `Hello`, and [`Body`] to parse any opcode's body.
//! * [`decode_any`]: parse a whole byte stream; the fuzzing entry point.
//!
//! Errors come in two classes. [`FrameError`] from the header, frame or
//! chunk layer is a framing error: the connection is closed. A body
//! parser's error ([`BodyError`], [`ps::DecodeError`]) is semantic: that
//! one request is answered with an error status and the connection goes
//! on.
//!
//! See `docs/WIRE.md` for the byte layout.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod chunk;
mod decode;
pub mod deframe;
pub mod frame;
pub mod header;
mod le;
pub mod message;
pub mod ps;
pub mod tensor;
pub mod tensors;

pub use chunk::{Chunk, ChunkAssembler, ChunkPlan};
pub use decode::{decode_any, DecodeSummary};
pub use deframe::{Deframer, NextFrame, Scan};
pub use frame::{peek_frame_len, Frame, Frames, Limits};
pub use header::{Flags, FrameError, Header, Opcode, Status, HEADER_LEN, MAGIC, VERSION};
pub use message::{Body, BodyError, Hello, Role};
pub use tensor::{DType, Dims, TensorRecord, TensorRef, TensorView, MAX_RANK};
pub use tensors::{TensorList, TensorListWriter};

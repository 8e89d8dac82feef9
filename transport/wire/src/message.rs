//! Parameter-server message bodies.
//!
//! Each body has a `Repr` with `parse(body)`, `encoded_len()` and
//! `emit(out)`. Reprs that carry tensors are generic over the tensor type:
//! parsing yields `TensorView`s borrowed from the body, and any
//! [`TensorRecord`] (a [`TensorRef`](crate::TensorRef) to encode or a
//! received `TensorView` to forward) can be emitted. Variable ids are the
//! numeric `u32`s agreed at registration. Reserved fields must be zero.
//!
//! Parse errors here are *semantic* ([`BodyError`]): the request that
//! carried the body is answered with [`BodyError::status`] and the connection
//! goes on. Checks that need the variable's metadata (row width, dtype)
//! belong to the server; here only structural ones are made.

use thiserror::Error;

use crate::header::{Flags, FrameError, Header, Opcode, Status};
use crate::le;
use crate::tensor::{DType, TensorRecord, TensorView};
use crate::tensors::TensorList;

/// Why a body does not match its opcode's layout.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BodyError {
    /// A length, record or field is malformed (see the inner error).
    #[error("malformed body: {0}")]
    Layout(#[from] FrameError),
    /// Bytes follow the end of the body's layout.
    #[error("{extra} unexpected bytes after the body")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// A reserved field is not zero.
    #[error("non-zero reserved field `{0}`")]
    Reserved(&'static str),
    /// A tensor has the wrong element type.
    #[error("{what}: expected dtype {expected}, found {found:?}")]
    WrongDType {
        /// Which tensor.
        what: &'static str,
        /// What was expected.
        expected: &'static str,
        /// What arrived.
        found: DType,
    },
    /// A tensor has the wrong rank.
    #[error("{what}: expected rank {expected}, found {found}")]
    WrongRank {
        /// Which tensor.
        what: &'static str,
        /// The rank required.
        expected: usize,
        /// The rank received.
        found: usize,
    },
    /// The gradient rows do not match the number of ids.
    #[error("{ids} ids but {rows} gradient rows")]
    RowMismatch {
        /// Number of ids.
        ids: u64,
        /// First dim of the gradients.
        rows: u64,
    },
    /// A string field is not UTF-8.
    #[error("`{0}` is not valid UTF-8")]
    BadUtf8(&'static str),
    /// The job name is longer than [`MAX_JOB_NAME_LEN`].
    #[error("job name of {0} bytes exceeds {MAX_JOB_NAME_LEN}")]
    JobNameTooLong(usize),
    /// An unknown task role code.
    #[error("unknown task role {0}")]
    UnknownRole(u8),
}

impl BodyError {
    /// The status that answers the request whose body failed:
    /// shape and dtype problems are [`Status::WrongShape`], everything else
    /// is [`Status::BadRequest`].
    pub fn status(&self) -> Status {
        match self {
            Self::WrongDType { .. } | Self::WrongRank { .. } | Self::RowMismatch { .. } => {
                Status::WrongShape
            }
            _ => Status::BadRequest,
        }
    }
}

/// Parse the `variable_id u32, reserved u32` prefix.
fn var_prefix(body: &[u8]) -> Result<(u32, &[u8]), BodyError> {
    let id = le::u32_at(body, 0)?;
    if le::u32_at(body, 4)? != 0 {
        return Err(BodyError::Reserved("reserved"));
    }
    Ok((id, body.get(8..).unwrap_or_default()))
}

fn emit_prefix(out: &mut [u8], a: u32) {
    le::put_u32(out, 0, a);
    le::put_u32(out, 4, 0);
}

fn no_trailing(rest: &[u8]) -> Result<(), BodyError> {
    if rest.is_empty() {
        Ok(())
    } else {
        Err(BodyError::TrailingBytes { extra: rest.len() })
    }
}

/// Parse one tensor record and return it with the bytes after it.
fn tensor(bytes: &[u8]) -> Result<(TensorView<'_>, &[u8]), BodyError> {
    let (v, used) = TensorView::parse(bytes)?;
    Ok((v, bytes.get(used..).unwrap_or_default()))
}

fn check_ids<T: TensorRecord>(ids: &T) -> Result<u64, BodyError> {
    if ids.dtype() != DType::I64 {
        return Err(BodyError::WrongDType {
            what: "ids",
            expected: "I64",
            found: ids.dtype(),
        });
    }
    if ids.rank() != 1 {
        return Err(BodyError::WrongRank {
            what: "ids",
            expected: 1,
            found: ids.rank(),
        });
    }
    Ok(ids.dim(0).unwrap_or(0))
}

fn check_rank2<T: TensorRecord>(t: &T, what: &'static str) -> Result<u64, BodyError> {
    if t.rank() != 2 {
        return Err(BodyError::WrongRank {
            what,
            expected: 2,
            found: t.rank(),
        });
    }
    Ok(t.dim(0).unwrap_or(0))
}

/// Check that a body which must be empty is.
pub fn parse_empty(body: &[u8]) -> Result<(), BodyError> {
    no_trailing(body)
}

/// SparsePull request: which rows of a variable to fetch.
///
/// ```text
/// 0  4  variable_id u32
/// 4  4  reserved    (zero)
/// 8  .. ids         tensor record: I64, rank 1
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparsePullRequest<T> {
    /// Variable id.
    pub variable_id: u32,
    /// Row ids (`I64`, rank 1).
    pub ids: T,
}

impl<'a> SparsePullRequest<TensorView<'a>> {
    /// Parse; `ids` must be `I64` rank 1.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        let (variable_id, rest) = var_prefix(body)?;
        let (ids, rest) = tensor(rest)?;
        no_trailing(rest)?;
        check_ids(&ids)?;
        Ok(Self { variable_id, ids })
    }
}

impl<T: TensorRecord> SparsePullRequest<T> {
    /// The structural checks `parse` makes, for the sender.
    pub fn check(&self) -> Result<(), BodyError> {
        check_ids(&self.ids).map(drop)
    }
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        8usize.saturating_add(self.ids.encoded_len())
    }
    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short or the tensor is invalid.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        le::need(out, self.encoded_len(), "SparsePullRequest::emit");
        emit_prefix(out, self.variable_id);
        8 + self.ids.emit(&mut out[8..])
    }
}

/// SparsePull response (status `Ok`): the rows, one tensor record of rank 2
/// `[n, dim]`, in the order of the requested ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparsePullResponse<T> {
    /// The rows, rank 2.
    pub rows: T,
}

impl<'a> SparsePullResponse<TensorView<'a>> {
    /// Parse; `rows` must be rank 2.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        let (rows, rest) = tensor(body)?;
        no_trailing(rest)?;
        check_rank2(&rows, "rows")?;
        Ok(Self { rows })
    }
}

impl<T: TensorRecord> SparsePullResponse<T> {
    /// The structural checks `parse` makes, for the sender.
    pub fn check(&self) -> Result<(), BodyError> {
        check_rank2(&self.rows, "rows").map(drop)
    }
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        self.rows.encoded_len()
    }
    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short or the tensor is invalid.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        self.rows.emit(out)
    }
}

/// SparsePush request: gradients for some rows of a variable.
///
/// ```text
/// 0  4  variable_id u32
/// 4  4  reserved    (zero)
/// 8  .. ids         tensor record: I64, rank 1, [n]
/// .. .. grads       tensor record: float dtype, rank 2, [n, dim]
/// ```
///
/// The response (status `Ok`) has an empty body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparsePushRequest<T> {
    /// Variable id.
    pub variable_id: u32,
    /// Row ids (`I64`, rank 1).
    pub ids: T,
    /// Gradients (`F32`/`F16`/`BF16`, rank 2, first dim = number of ids).
    pub grads: T,
}

impl<'a> SparsePushRequest<TensorView<'a>> {
    /// Parse, with the structural checks of [`check`](Self::check).
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        let (variable_id, rest) = var_prefix(body)?;
        let (ids, rest) = tensor(rest)?;
        let (grads, rest) = tensor(rest)?;
        no_trailing(rest)?;
        let r = Self {
            variable_id,
            ids,
            grads,
        };
        r.check()?;
        Ok(r)
    }
}

impl<T: TensorRecord> SparsePushRequest<T> {
    /// `ids` must be `I64` rank 1; `grads` a float dtype of rank 2 whose
    /// first dim equals the number of ids.
    pub fn check(&self) -> Result<(), BodyError> {
        let n = check_ids(&self.ids)?;
        if !self.grads.dtype().is_float() {
            return Err(BodyError::WrongDType {
                what: "grads",
                expected: "F32, F16 or BF16",
                found: self.grads.dtype(),
            });
        }
        let rows = check_rank2(&self.grads, "grads")?;
        if rows != n {
            return Err(BodyError::RowMismatch { ids: n, rows });
        }
        Ok(())
    }
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        8usize
            .saturating_add(self.ids.encoded_len())
            .saturating_add(self.grads.encoded_len())
    }
    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short or a tensor is invalid.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        le::need(out, self.encoded_len(), "SparsePushRequest::emit");
        emit_prefix(out, self.variable_id);
        let mut off = 8;
        off += self.ids.emit(&mut out[off..]);
        off += self.grads.emit(&mut out[off..]);
        off
    }
}

/// DensePull request: a whole variable.
///
/// ```text
/// 0  4  variable_id u32
/// 4  4  reserved    (zero)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DensePullRequest {
    /// Variable id.
    pub variable_id: u32,
}

impl DensePullRequest {
    /// Body length: 8.
    pub const LEN: usize = 8;
    /// Parse.
    pub fn parse(body: &[u8]) -> Result<Self, BodyError> {
        let (variable_id, rest) = var_prefix(body)?;
        no_trailing(rest)?;
        Ok(Self { variable_id })
    }
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        Self::LEN
    }
    /// Write the body; returns 8.
    ///
    /// # Panics
    /// If `out` is shorter than 8 bytes.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        le::need(out, Self::LEN, "DensePullRequest::emit");
        emit_prefix(out, self.variable_id);
        Self::LEN
    }
}

/// DensePull response (status `Ok`): one tensor record, any dtype and rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DensePullResponse<T> {
    /// The variable's value.
    pub tensor: T,
}

impl<'a> DensePullResponse<TensorView<'a>> {
    /// Parse.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        let (tensor, rest) = tensor(body)?;
        no_trailing(rest)?;
        Ok(Self { tensor })
    }
}

impl<T: TensorRecord> DensePullResponse<T> {
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        self.tensor.encoded_len()
    }
    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short or the tensor is invalid.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        self.tensor.emit(out)
    }
}

/// DensePush request: a gradient for a whole variable. The response (status
/// `Ok`) has an empty body.
///
/// ```text
/// 0  4  variable_id u32
/// 4  4  reserved    (zero)
/// 8  .. tensor      tensor record, any dtype and rank
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DensePushRequest<T> {
    /// Variable id.
    pub variable_id: u32,
    /// The gradient.
    pub tensor: T,
}

impl<'a> DensePushRequest<TensorView<'a>> {
    /// Parse.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        let (variable_id, rest) = var_prefix(body)?;
        let (tensor, rest) = tensor(rest)?;
        no_trailing(rest)?;
        Ok(Self {
            variable_id,
            tensor,
        })
    }
}

impl<T: TensorRecord> DensePushRequest<T> {
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        8usize.saturating_add(self.tensor.encoded_len())
    }
    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short or the tensor is invalid.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        le::need(out, self.encoded_len(), "DensePushRequest::emit");
        emit_prefix(out, self.variable_id);
        8 + self.tensor.emit(&mut out[8..])
    }
}

/// Generic RPC (request and response alike): a method id and an opaque
/// payload.
///
/// ```text
/// 0  4  method    u32
/// 4  4  reserved  (zero)
/// 8  .. payload   the rest of the body
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rpc<'a> {
    /// Method id.
    pub method: u32,
    /// Opaque payload.
    pub payload: &'a [u8],
}

impl<'a> Rpc<'a> {
    /// Parse.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        let (method, payload) = var_prefix(body)?;
        Ok(Self { method, payload })
    }
    /// Body length.
    pub fn encoded_len(&self) -> usize {
        8usize.saturating_add(self.payload.len())
    }
    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        let len = self.encoded_len();
        le::need(out, len, "Rpc::emit");
        emit_prefix(out, self.method);
        out[8..len].copy_from_slice(self.payload);
        len
    }
}

/// Task role announced in [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    /// Parameter server.
    Ps = 0,
    /// Worker.
    Worker = 1,
}

impl Role {
    /// Decode.
    pub fn from_u8(v: u8) -> Result<Self, BodyError> {
        match v {
            0 => Ok(Self::Ps),
            1 => Ok(Self::Worker),
            other => Err(BodyError::UnknownRole(other)),
        }
    }
}

/// Longest job name in a [`Hello`], in bytes.
pub const MAX_JOB_NAME_LEN: usize = 64;
/// Bytes of a [`Hello`] before the job name.
pub const HELLO_FIXED_LEN: usize = 30;

/// The connection handshake (opcode `Hello`), sent by both sides first.
///
/// ```text
/// offset size field
///  0     2    protocol_version u16
///  2     2    flags            u16 (feature bits; unknown bits are ignored)
///  4     1    role             0 = ps, 1 = worker
///  5     1    reserved         (zero)
///  6     2    job_name_len     u16, at most 64
///  8     4    task_index       u32
/// 12     8    incarnation      u64 (changes on every restart of the task)
/// 20     4    initial_credits  u32
/// 24     4    max_frame_len    u32 (largest frame, header included, the sender accepts)
/// 28     2    shard_count      u16 (reactors / shards of the sender)
/// 30     n    job_name         UTF-8, job_name_len bytes
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello<'a> {
    /// The sender's protocol version.
    pub protocol_version: u16,
    /// Feature bits; receivers ignore bits they do not know.
    pub flags: u16,
    /// The sender's role.
    pub role: Role,
    /// The job name (at most [`MAX_JOB_NAME_LEN`] bytes).
    pub job_name: &'a str,
    /// Task index within the job.
    pub task_index: u32,
    /// Incarnation of the task.
    pub incarnation: u64,
    /// Credits granted to the peer up front.
    pub initial_credits: u32,
    /// Largest frame the sender accepts, header included.
    pub max_frame_len: u32,
    /// Number of shards (reactors) of the sender.
    pub shard_count: u16,
}

impl<'a> Hello<'a> {
    /// Parse; the body must be exactly the fixed part plus the job name.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        if body.len() < HELLO_FIXED_LEN {
            return Err(FrameError::Truncated {
                needed: HELLO_FIXED_LEN,
                have: body.len(),
            }
            .into());
        }
        let protocol_version = le::u16_at(body, 0)?;
        let flags = le::u16_at(body, 2)?;
        let role = Role::from_u8(le::u8_at(body, 4)?)?;
        if le::u8_at(body, 5)? != 0 {
            return Err(BodyError::Reserved("reserved"));
        }
        let name_len = usize::from(le::u16_at(body, 6)?);
        if name_len > MAX_JOB_NAME_LEN {
            return Err(BodyError::JobNameTooLong(name_len));
        }
        let task_index = le::u32_at(body, 8)?;
        let incarnation = le::u64_at(body, 12)?;
        let initial_credits = le::u32_at(body, 20)?;
        let max_frame_len = le::u32_at(body, 24)?;
        let shard_count = le::u16_at(body, 28)?;
        let rest = body.get(HELLO_FIXED_LEN..).unwrap_or_default();
        let Some(name) = rest.get(..name_len) else {
            return Err(FrameError::Truncated {
                needed: HELLO_FIXED_LEN + name_len,
                have: body.len(),
            }
            .into());
        };
        no_trailing(rest.get(name_len..).unwrap_or_default())?;
        let job_name = core::str::from_utf8(name).map_err(|_| BodyError::BadUtf8("job_name"))?;
        Ok(Self {
            protocol_version,
            flags,
            role,
            job_name,
            task_index,
            incarnation,
            initial_credits,
            max_frame_len,
            shard_count,
        })
    }

    /// Check what `parse` checks: the job name fits.
    pub fn check(&self) -> Result<(), BodyError> {
        if self.job_name.len() > MAX_JOB_NAME_LEN {
            return Err(BodyError::JobNameTooLong(self.job_name.len()));
        }
        Ok(())
    }

    /// Body length.
    pub fn encoded_len(&self) -> usize {
        HELLO_FIXED_LEN + self.job_name.len()
    }

    /// Write the body; returns [`encoded_len`](Self::encoded_len).
    ///
    /// # Panics
    /// If `out` is too short or the job name is longer than
    /// [`MAX_JOB_NAME_LEN`].
    pub fn emit(&self, out: &mut [u8]) -> usize {
        if let Err(e) = self.check() {
            panic!("Hello::emit: {e}");
        }
        let len = self.encoded_len();
        le::need(out, len, "Hello::emit");
        le::put_u16(out, 0, self.protocol_version);
        le::put_u16(out, 2, self.flags);
        out[4] = self.role as u8;
        out[5] = 0;
        le::put_u16(out, 6, self.job_name.len() as u16);
        le::put_u32(out, 8, self.task_index);
        le::put_u64(out, 12, self.incarnation);
        le::put_u32(out, 20, self.initial_credits);
        le::put_u32(out, 24, self.max_frame_len);
        le::put_u16(out, 28, self.shard_count);
        out[HELLO_FIXED_LEN..len].copy_from_slice(self.job_name.as_bytes());
        len
    }
}

/// A parsed message body, chosen by opcode and the `RESPONSE` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Body<'a> {
    /// An empty body: control frames other than `Hello`, and `Ok` responses
    /// to pushes.
    Empty,
    /// A handshake.
    Hello(Hello<'a>),
    /// A generic RPC request or response.
    Rpc(Rpc<'a>),
    /// A fused tensor list.
    Tensors(TensorList<'a>),
    /// A sparse pull request.
    SparsePullRequest(SparsePullRequest<TensorView<'a>>),
    /// A sparse pull response.
    SparsePullResponse(SparsePullResponse<TensorView<'a>>),
    /// A sparse push request.
    SparsePushRequest(SparsePushRequest<TensorView<'a>>),
    /// A dense pull request.
    DensePullRequest(DensePullRequest),
    /// A dense pull response.
    DensePullResponse(DensePullResponse<TensorView<'a>>),
    /// A dense push request.
    DensePushRequest(DensePushRequest<TensorView<'a>>),
    /// A response with a non-`Ok` status: its body is an optional UTF-8
    /// diagnostic (possibly empty).
    Error(&'a str),
}

impl<'a> Body<'a> {
    /// Parse the (whole, reassembled) message body described by `header`.
    ///
    /// A response (`RESPONSE` flag) whose status is not `Ok` carries only a
    /// UTF-8 diagnostic. Otherwise the layout follows the opcode; for the
    /// push opcodes an `Ok` response is empty.
    pub fn parse(header: &Header, body: &'a [u8]) -> Result<Self, BodyError> {
        let response = header.flags.contains(Flags::RESPONSE);
        if response && header.status != Status::Ok && !header.opcode.is_control() {
            let text = core::str::from_utf8(body).map_err(|_| BodyError::BadUtf8("diagnostic"))?;
            return Ok(Self::Error(text));
        }
        Ok(match header.opcode {
            Opcode::Hello => Self::Hello(Hello::parse(body)?),
            Opcode::Credit | Opcode::Cancel | Opcode::Goodbye | Opcode::Ping => {
                parse_empty(body)?;
                Self::Empty
            }
            Opcode::Rpc => Self::Rpc(Rpc::parse(body)?),
            Opcode::Tensors => Self::Tensors(TensorList::parse(body)?),
            Opcode::SparsePull if response => {
                Self::SparsePullResponse(SparsePullResponse::parse(body)?)
            }
            Opcode::SparsePull => Self::SparsePullRequest(SparsePullRequest::parse(body)?),
            Opcode::SparsePush | Opcode::DensePush if response => {
                parse_empty(body)?;
                Self::Empty
            }
            Opcode::SparsePush => Self::SparsePushRequest(SparsePushRequest::parse(body)?),
            Opcode::DensePull if response => {
                Self::DensePullResponse(DensePullResponse::parse(body)?)
            }
            Opcode::DensePull => Self::DensePullRequest(DensePullRequest::parse(body)?),
            Opcode::DensePush => Self::DensePushRequest(DensePushRequest::parse(body)?),
        })
    }
}

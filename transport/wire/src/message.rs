//! Message bodies: the handshake ([`Hello`]), and [`Body`], which parses
//! the body of any opcode with its parser (the PS bodies with [`crate::ps`],
//! fused tensor lists with [`crate::tensors`]).
//!
//! Parse errors here are *semantic* ([`BodyError`]): the request that
//! carried the body is answered with [`BodyError::status`] and the connection
//! goes on.

use thiserror::Error;

use crate::header::{Flags, FrameError, Header, Opcode, Status};
use crate::le;
use crate::ps::{self, Control, ControlError, PullRequest, PullResponse, PushRequest};
use crate::tensors::TensorList;

/// Why a body does not match its opcode's layout.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BodyError {
    /// A length, record or field is malformed (see the inner error).
    #[error("malformed body: {0}")]
    Layout(#[from] FrameError),
    /// A pull or push body does not decode.
    #[error("PS body: {0}")]
    Ps(#[from] ps::DecodeError),
    /// A control message does not decode.
    #[error("control message: {0}")]
    Control(#[from] ControlError),
    /// Bytes follow the end of the body's layout.
    #[error("{extra} unexpected bytes after the body")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// A reserved field is not zero.
    #[error("non-zero reserved field `{0}`")]
    Reserved(&'static str),
    /// A string field is not UTF-8.
    #[error("`{0}` is not valid UTF-8")]
    BadUtf8(&'static str),
    /// The job name is longer than [`MAX_JOB_NAME_LEN`].
    #[error("job name of {0} bytes exceeds {MAX_JOB_NAME_LEN}")]
    JobNameTooLong(usize),
    /// An unknown task role code.
    #[error("unknown task role {0}")]
    UnknownRole(u8),
    /// The training flags of an `Auth` are longer than [`MAX_CONFIG_LEN`].
    #[error("training flags of {0} bytes exceed {MAX_CONFIG_LEN}")]
    ConfigTooLong(usize),
}

impl BodyError {
    /// The status that answers the request whose body failed, as a PS
    /// shard answers it: a control message it does not understand is
    /// [`Status::UnknownMethod`], everything else [`Status::BadRequest`].
    pub fn status(&self) -> Status {
        match self {
            Self::Control(_) => Status::UnknownMethod,
            _ => Status::BadRequest,
        }
    }
}

fn no_trailing(rest: &[u8]) -> Result<(), BodyError> {
    if rest.is_empty() {
        Ok(())
    } else {
        Err(BodyError::TrailingBytes { extra: rest.len() })
    }
}

/// Check that a body which must be empty is.
pub fn parse_empty(body: &[u8]) -> Result<(), BodyError> {
    no_trailing(body)
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
pub const HELLO_FIXED_LEN: usize = 46;
/// Bytes of a [`Hello`]'s nonce.
pub const NONCE_LEN: usize = 16;
/// [`Hello::flags`] bit: the sender holds a cluster token and proves it in
/// its [`AuthMsg`]; it talks only to a peer that does too.
pub const HELLO_FLAG_AUTH: u16 = 1;

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
/// 30    16    nonce            random, new for every connection
/// 46     n    job_name         UTF-8, job_name_len bytes
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
    /// The sender's challenge: the peer's [`AuthMsg`] proof covers it.
    pub nonce: [u8; NONCE_LEN],
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
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&body[30..HELLO_FIXED_LEN]);
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
            nonce,
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
        out[30..HELLO_FIXED_LEN].copy_from_slice(&self.nonce);
        out[HELLO_FIXED_LEN..len].copy_from_slice(self.job_name.as_bytes());
        len
    }
}

/// Bytes of an [`AuthMsg`]'s proof (an HMAC-SHA256).
pub const PROOF_LEN: usize = 32;
/// Longest training-flags text in an [`AuthMsg`], in bytes.
pub const MAX_CONFIG_LEN: usize = 4096;
/// Bytes of an [`AuthMsg`] before the flags text.
pub const AUTH_FIXED_LEN: usize = PROOF_LEN + 2;

/// The second step of the handshake (opcode `Auth`), sent by each side
/// once it has the peer's [`Hello`].
///
/// ```text
/// offset size field
///  0    32    proof        HMAC-SHA256 under the cluster token (zero without one)
/// 32     2    config_len   u16, at most 4096
/// 34     n    config       UTF-8 training flags, one `name=value` a line
/// ```
///
/// The proof is over the sender's side, both nonces and the flags text,
/// so it proves the token without showing it, cannot be replayed on
/// another connection and vouches for the flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthMsg<'a> {
    /// The sender's proof.
    pub proof: [u8; PROOF_LEN],
    /// The sender's training flags (empty: it has none to compare).
    pub config: &'a str,
}

impl<'a> AuthMsg<'a> {
    /// Parse; the body must be exactly the fixed part plus the flags.
    pub fn parse(body: &'a [u8]) -> Result<Self, BodyError> {
        if body.len() < AUTH_FIXED_LEN {
            return Err(FrameError::Truncated {
                needed: AUTH_FIXED_LEN,
                have: body.len(),
            }
            .into());
        }
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(&body[..PROOF_LEN]);
        let len = usize::from(le::u16_at(body, PROOF_LEN)?);
        if len > MAX_CONFIG_LEN {
            return Err(BodyError::ConfigTooLong(len));
        }
        let rest = &body[AUTH_FIXED_LEN..];
        let Some(text) = rest.get(..len) else {
            return Err(FrameError::Truncated {
                needed: AUTH_FIXED_LEN + len,
                have: body.len(),
            }
            .into());
        };
        no_trailing(&rest[len..])?;
        let config = core::str::from_utf8(text).map_err(|_| BodyError::BadUtf8("config"))?;
        Ok(Self { proof, config })
    }

    /// Body length.
    pub fn encoded_len(&self) -> usize {
        AUTH_FIXED_LEN + self.config.len()
    }

    /// The body, or why it cannot be one (flags text over
    /// [`MAX_CONFIG_LEN`]).
    pub fn to_vec(&self) -> Result<Vec<u8>, BodyError> {
        if self.config.len() > MAX_CONFIG_LEN {
            return Err(BodyError::ConfigTooLong(self.config.len()));
        }
        let mut out = vec![0u8; self.encoded_len()];
        out[..PROOF_LEN].copy_from_slice(&self.proof);
        le::put_u16(&mut out, PROOF_LEN, self.config.len() as u16);
        out[AUTH_FIXED_LEN..].copy_from_slice(self.config.as_bytes());
        Ok(out)
    }
}

/// A parsed message body, chosen by opcode and the `RESPONSE` flag.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Body<'a> {
    /// An empty body: control frames other than `Hello`.
    Empty,
    /// A handshake.
    Hello(Hello<'a>),
    /// The handshake's proof and training flags.
    Auth(AuthMsg<'a>),
    /// A fused tensor list.
    Tensors(TensorList<'a>),
    /// A PS control request (opcode `Rpc`).
    Control(Control<'a>),
    /// A pull request (opcode `SparsePull`).
    PullRequest(PullRequest<'a>),
    /// A pull response.
    PullResponse(PullResponse<'a>),
    /// A push request (opcode `SparsePush`).
    PushRequest(PushRequest<'a>),
    /// A push response: the shard's global step after the push.
    PushResponse(u64),
    /// A body with no layout to check: the reply to a control request
    /// (its layout depends on the request's method) and the `DensePull` /
    /// `DensePush` opcodes, which carry the benchmarks' payloads.
    Opaque(&'a [u8]),
    /// A response with a non-`Ok` status: its body is an optional UTF-8
    /// diagnostic (possibly empty).
    Error(&'a str),
}

impl<'a> Body<'a> {
    /// Parse the (whole, reassembled) message body described by `header`;
    /// PS bodies are checked against the default [`ps::Limits`].
    ///
    /// A response (`RESPONSE` flag) whose status is not `Ok` carries only a
    /// UTF-8 diagnostic. Otherwise the layout follows the opcode and
    /// whether the body is a request or a response.
    pub fn parse(header: &Header, body: &'a [u8]) -> Result<Self, BodyError> {
        let response = header.flags.contains(Flags::RESPONSE);
        if response && header.status != Status::Ok && !header.opcode.is_control() {
            let text = core::str::from_utf8(body).map_err(|_| BodyError::BadUtf8("diagnostic"))?;
            return Ok(Self::Error(text));
        }
        let limits = ps::Limits::default();
        Ok(match header.opcode {
            Opcode::Hello => Self::Hello(Hello::parse(body)?),
            Opcode::Auth => Self::Auth(AuthMsg::parse(body)?),
            Opcode::Credit | Opcode::Cancel | Opcode::Goodbye | Opcode::Ping => {
                parse_empty(body)?;
                Self::Empty
            }
            Opcode::Tensors => Self::Tensors(TensorList::parse(body)?),
            Opcode::Rpc if response => Self::Opaque(body),
            Opcode::Rpc => Self::Control(Control::parse(body)?),
            Opcode::SparsePull if response => {
                Self::PullResponse(PullResponse::parse(body, &limits)?)
            }
            Opcode::SparsePull => Self::PullRequest(PullRequest::parse(body, &limits)?),
            Opcode::SparsePush if response => Self::PushResponse(ps::parse_push_response(body)?),
            Opcode::SparsePush => Self::PushRequest(PushRequest::parse(body, &limits)?),
            Opcode::DensePull | Opcode::DensePush => Self::Opaque(body),
        })
    }
}

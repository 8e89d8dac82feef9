//! Control messages between workers and PS shards, carried as `Rpc`
//! bodies: one method byte, then the method's fields, little-endian.
//!
//! | method | body after the byte | reply |
//! |---|---|---|
//! | `WAIT_STEP` (1) | `u64` step `n` | `u64` global step, sent once the shard's global step is ≥ `n` |
//! | `CHECKPOINT` (2) | UTF-8 directory path | empty, after the shard file is durably in place |
//! | `STATS` (3) | empty | JSON object of the shard's counters |
//! | `DONE` (4) | empty | empty; the worker will send nothing more |
//! | `CHECKPOINT_AT` (5) | `u64` global step `c` | empty, at once; the shard writes its file into its checkpoint directory's `steps/c/` inside the push that makes its global step `c` |
//! | `RESUME_AT` (6) | `u64` worker step `s` | empty; the sender's next push is the first of its step `s`, and the shard acknowledges without applying each of its pushes it applied before |
//! | `CHECKPOINT_VOTE` (7) | `u64` global step `c`, `u8` want (0 or 1) | `u8` 1 when `c` is a checkpoint step, else 0: the first vote on `c` decides, yes when it or a vote since the last yes wants one |
//!
//! The data path (pull and push) uses its own opcodes, `SparsePull` and
//! `SparsePush`, with the bodies of the [parent module](super).

use thiserror::Error;

/// Wait until the shard's global step reaches a value (the `--sync` barrier).
pub const WAIT_STEP: u8 = 1;
/// Write the shard's checkpoint file into a directory.
pub const CHECKPOINT: u8 = 2;
/// Report the shard's counters.
pub const STATS: u8 = 3;
/// The worker has finished.
pub const DONE: u8 = 4;
/// Write the shard's checkpoint file when the global step reaches a value.
pub const CHECKPOINT_AT: u8 = 5;
/// The sending worker resumes at one of its steps (a restart).
pub const RESUME_AT: u8 = 6;
/// Whether a global step is a checkpoint step (asynchronous
/// `--checkpoint-every-secs`).
pub const CHECKPOINT_VOTE: u8 = 7;

/// A control request, borrowing its path from the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control<'a> {
    /// See [`WAIT_STEP`].
    WaitStep(u64),
    /// See [`CHECKPOINT`].
    Checkpoint(&'a str),
    /// See [`STATS`].
    Stats,
    /// See [`DONE`].
    Done,
    /// See [`CHECKPOINT_AT`].
    CheckpointAt(u64),
    /// See [`RESUME_AT`].
    ResumeAt(u64),
    /// See [`CHECKPOINT_VOTE`].
    CheckpointVote {
        /// The global step voted on.
        step: u64,
        /// The sender wants a checkpoint.
        want: bool,
    },
}

/// A control body that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ControlError {
    /// No method byte.
    #[error("empty control message")]
    Empty,
    /// The method byte is not known.
    #[error("unknown control method {0}")]
    UnknownMethod(u8),
    /// The fields do not match the method.
    #[error("malformed {0} control message")]
    Malformed(&'static str),
}

impl<'a> Control<'a> {
    /// Decode a control body.
    pub fn parse(body: &'a [u8]) -> Result<Self, ControlError> {
        let (&m, rest) = body.split_first().ok_or(ControlError::Empty)?;
        match m {
            WAIT_STEP => {
                let b: [u8; 8] = rest
                    .try_into()
                    .map_err(|_| ControlError::Malformed("WAIT_STEP"))?;
                Ok(Control::WaitStep(u64::from_le_bytes(b)))
            }
            CHECKPOINT_AT => {
                let b: [u8; 8] = rest
                    .try_into()
                    .map_err(|_| ControlError::Malformed("CHECKPOINT_AT"))?;
                Ok(Control::CheckpointAt(u64::from_le_bytes(b)))
            }
            CHECKPOINT_VOTE => match rest {
                [b @ .., want @ (0 | 1)] => {
                    let b: [u8; 8] = b
                        .try_into()
                        .map_err(|_| ControlError::Malformed("CHECKPOINT_VOTE"))?;
                    Ok(Control::CheckpointVote {
                        step: u64::from_le_bytes(b),
                        want: *want == 1,
                    })
                }
                _ => Err(ControlError::Malformed("CHECKPOINT_VOTE")),
            },
            RESUME_AT => {
                let b: [u8; 8] = rest
                    .try_into()
                    .map_err(|_| ControlError::Malformed("RESUME_AT"))?;
                Ok(Control::ResumeAt(u64::from_le_bytes(b)))
            }
            CHECKPOINT => std::str::from_utf8(rest)
                .map(Control::Checkpoint)
                .map_err(|_| ControlError::Malformed("CHECKPOINT")),
            STATS if rest.is_empty() => Ok(Control::Stats),
            DONE if rest.is_empty() => Ok(Control::Done),
            STATS => Err(ControlError::Malformed("STATS")),
            DONE => Err(ControlError::Malformed("DONE")),
            other => Err(ControlError::UnknownMethod(other)),
        }
    }

    /// Encode into a fresh buffer.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Control::WaitStep(n) => {
                let mut v = vec![WAIT_STEP];
                v.extend_from_slice(&n.to_le_bytes());
                v
            }
            Control::Checkpoint(dir) => {
                let mut v = vec![CHECKPOINT];
                v.extend_from_slice(dir.as_bytes());
                v
            }
            Control::Stats => vec![STATS],
            Control::Done => vec![DONE],
            Control::CheckpointAt(c) => {
                let mut v = vec![CHECKPOINT_AT];
                v.extend_from_slice(&c.to_le_bytes());
                v
            }
            Control::ResumeAt(s) => {
                let mut v = vec![RESUME_AT];
                v.extend_from_slice(&s.to_le_bytes());
                v
            }
            Control::CheckpointVote { step, want } => {
                let mut v = vec![CHECKPOINT_VOTE];
                v.extend_from_slice(&step.to_le_bytes());
                v.push(u8::from(*want));
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects() {
        for c in [
            Control::WaitStep(42),
            Control::Checkpoint("/tmp/x"),
            Control::Stats,
            Control::Done,
            Control::CheckpointAt(96),
            Control::ResumeAt(7),
            Control::CheckpointVote {
                step: 64,
                want: true,
            },
            Control::CheckpointVote {
                step: 0,
                want: false,
            },
        ] {
            assert_eq!(Control::parse(&c.encode()), Ok(c));
        }
        assert_eq!(Control::parse(&[]), Err(ControlError::Empty));
        assert_eq!(Control::parse(&[9]), Err(ControlError::UnknownMethod(9)));
        assert_eq!(
            Control::parse(&[WAIT_STEP, 1, 2]),
            Err(ControlError::Malformed("WAIT_STEP"))
        );
        assert_eq!(
            Control::parse(&[CHECKPOINT, 0xff]),
            Err(ControlError::Malformed("CHECKPOINT"))
        );
        assert_eq!(
            Control::parse(&[CHECKPOINT_AT, 1]),
            Err(ControlError::Malformed("CHECKPOINT_AT"))
        );
        let mut vote = Control::CheckpointVote {
            step: 64,
            want: true,
        }
        .encode();
        *vote.last_mut().unwrap() = 2;
        assert_eq!(
            Control::parse(&vote),
            Err(ControlError::Malformed("CHECKPOINT_VOTE"))
        );
        assert_eq!(
            Control::parse(&[CHECKPOINT_VOTE, 1]),
            Err(ControlError::Malformed("CHECKPOINT_VOTE"))
        );
        assert_eq!(
            Control::parse(&[RESUME_AT, 1, 2]),
            Err(ControlError::Malformed("RESUME_AT"))
        );
        assert_eq!(
            Control::parse(&[DONE, 0]),
            Err(ControlError::Malformed("DONE"))
        );
    }
}

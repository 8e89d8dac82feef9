//! What a request's user data says: the op (low byte), the connection
//! (the 40 bits above it) and, for a send, the sequence number its
//! zero-copy notification carries (the top 16 bits).

use super::Conn;

/// Buffer group of the receive pool.
pub(super) const BGID: u16 = 7;
pub(super) const OP_RECV: u64 = 1;
pub(super) const OP_SEND: u64 = 2;
pub(super) const OP_CANCEL: u64 = 3;
/// A one-shot readability poll armed before a park (`RecvMode::Spin`).
pub(super) const OP_POLL: u64 = 4;
/// A single-shot receive straight into a frame buffer.
pub(super) const OP_RECV_DIRECT: u64 = 5;
/// A receive into the connection's own buffer (`RecvMode::Spin`, non-blocking,
/// and `RecvMode::Single`).
pub(super) const OP_RECV_OWN: u64 = 6;
/// A read draining the park eventfd, submitted with the first enter after
/// a park (its user data carries no connection).
pub(super) const OP_EVENTFD: u64 = 7;
/// A one-shot readability poll of the reactor's eventfd, armed by a park
/// in the ring (its user data carries no connection).
pub(super) const OP_WAKER: u64 = 8;

/// Bits of a completion's user data that carry the connection index
/// (above the op byte, below a zero-copy send's sequence number).
pub(super) const CONN_MASK: u64 = (1 << 40) - 1;

pub(super) fn user_data(conn: usize, op: u64) -> u64 {
    (((conn as u64) & CONN_MASK) << 8) | op
}

/// A send's user data: with the connection's sequence number of its
/// zero-copy sends in the top 16 bits, which its notification carries too.
pub(super) fn send_user_data(conn: usize, seq: u16) -> u64 {
    user_data(conn, OP_SEND) | (u64::from(seq) << 48)
}

/// The op of `c`'s armed receive (its user data's low byte), on a ring
/// whose single or spin receives go into the connections' own buffers
/// (`own`) or not (multishot).
pub(super) fn armed_recv_op(c: &Conn, own: bool) -> u64 {
    if c.direct_inflight {
        OP_RECV_DIRECT
    } else if own {
        OP_RECV_OWN
    } else {
        OP_RECV
    }
}

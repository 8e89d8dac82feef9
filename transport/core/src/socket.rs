//! Socket settings shared by the stream backends (TCP and io_uring).

use std::io;
use std::net::TcpStream;

/// The `SO_SNDBUF` the stream backends ask for on a connection to a
/// loopback peer, unless configured otherwise: 512 KiB (the kernel doubles
/// the request for its bookkeeping and clamps it to `net.core.wmem_max`).
///
/// On loopback the round trip is microseconds, so a send queue of several
/// MiB (where autotuning takes a busy stream) holds no more in flight than
/// a short one; it does push the queued bytes out of the core's cache, and
/// the kernel's copy in and the receiver's copy out then run from L3. With
/// this cap a stream of 1 MiB messages ran at about twice the rate on the
/// project's test VM (`docs/backends/tcp.md`).
pub const DEFAULT_LOOPBACK_SEND_BUFFER: usize = 512 << 10;

/// Ask for an `SO_SNDBUF` of `bytes` when `stream`'s peer is a loopback
/// address; leave any other connection to autotuning.
pub fn cap_loopback_send_buffer(stream: &TcpStream, bytes: usize) -> io::Result<()> {
    if peer_is_loopback(stream)? {
        nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::SndBuf, &bytes)?;
    }
    Ok(())
}

/// Whether `stream`'s peer is a loopback address. `to_canonical`: a
/// dual-stack listener sees 127.0.0.1 as ::ffff:127.0.0.1, which
/// `is_loopback` alone does not take.
pub fn peer_is_loopback(stream: &TcpStream) -> io::Result<bool> {
    Ok(stream.peer_addr()?.ip().to_canonical().is_loopback())
}

//! The cluster token on the bench's plain streams: the JSON control
//! connection and the raw baseline's data connection. With a token
//! (`--token-file` or `STARWIRE_CLUSTER_TOKEN`) each runs the token's stream
//! handshake (`starwire_transport::auth::stream`, the data handshake's
//! proofs) before its first byte; without one, nothing. The starwire data
//! connections prove it in their own handshake, the gRPC baseline's in
//! `starwire-grpc`.

use std::net::TcpStream;
use std::time::Duration;

use starwire_transport::auth::stream;

/// What a stream's proofs are made for, so that one kind's proof is no
/// proof for another.
#[derive(Debug, Clone, Copy)]
pub(super) enum Purpose {
    /// The control connection.
    Control,
    /// The raw baseline's data connection.
    Raw,
}

impl Purpose {
    fn label(self) -> &'static str {
        match self {
            Purpose::Control => "bench-control",
            Purpose::Raw => "bench-raw",
        }
    }
}

/// How long a peer may take to prove the token: for the whole exchange,
/// however it trickles it, not per read.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The server end: check the dialer's proof on `s`, if this process has a
/// token. A peer that fails is warned about with its address; the caller
/// closes it.
pub(super) fn accept(s: &TcpStream, purpose: Purpose) -> Result<(), String> {
    let Some(token) = super::sessions::BENCH_TOKEN.get().cloned().flatten() else {
        return Ok(());
    };
    if let Err(e) = stream::accept(s, &token, purpose.label(), TIMEOUT) {
        let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
        tracing::warn!(%peer, "closed a {} connection before serving it: {e}", purpose.label());
        return Err(format!("{} connection from {peer}: {e}", purpose.label()));
    }
    Ok(())
}

/// The client end: prove the token on `s` and check the server's, if this
/// process has a token.
pub(super) fn dial(s: &TcpStream, purpose: Purpose) -> Result<(), String> {
    let Some(token) = super::sessions::BENCH_TOKEN.get().cloned().flatten() else {
        return Ok(());
    };
    stream::dial(s, &token, purpose.label(), TIMEOUT).map_err(|e| {
        format!(
            "the bench server did not prove the cluster token on the {} connection \
             (does it have the same one?): {e}",
            purpose.label()
        )
    })
}

//! The cluster token on the baseline's connections. With a token in the
//! [`GrpcConfig`], every TCP connection runs the token's stream handshake
//! (`starwire_transport::auth::stream`, the frame handshake's proofs) before
//! HTTP/2 starts: a client that cannot prove the token is closed before
//! any call is served, and a client checks the server's proof in turn.
//! Calls carry nothing more, so an authenticated connection costs what an
//! open one does.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use starwire_transport::auth::stream::HELLO_LEN;
use starwire_transport::auth::stream::{self, StreamAcceptor, StreamAuthError, StreamDialer};
use starwire_transport::wire::message::{NONCE_LEN, PROOF_LEN};
use starwire_transport::ClusterToken;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::GrpcConfig;

/// What the proofs of this handshake are made for.
const PURPOSE: &str = "grpc";

async fn accept_steps(s: &mut TcpStream, token: &ClusterToken) -> Result<(), StreamAuthError> {
    let mut a = StreamAcceptor::new(token.clone(), PURPOSE);
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello).await?;
    s.write_all(&a.handle_hello(&hello)?).await?;
    let mut p = [0u8; PROOF_LEN];
    s.read_exact(&mut p).await?;
    s.write_all(&a.handle_proof(&p)?).await?;
    Ok(())
}

async fn dial_steps(s: &mut TcpStream, token: &ClusterToken) -> Result<(), StreamAuthError> {
    let (mut d, hello) = StreamDialer::new(token.clone(), PURPOSE);
    s.write_all(&hello).await?;
    let mut n = [0u8; NONCE_LEN];
    s.read_exact(&mut n).await?;
    s.write_all(&d.handle_nonce(&n)).await?;
    let mut p = [0u8; PROOF_LEN];
    s.read_exact(&mut p).await?;
    d.handle_proof(&p)
}

fn timed_out(t: Duration) -> StreamAuthError {
    StreamAuthError::Io(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("no proof of the cluster token within {} s", t.as_secs_f64()),
    ))
}

/// The server end on an accepted connection, within the handshake timeout.
/// A peer that fails is warned about with its address.
pub(crate) async fn accept(
    s: &mut TcpStream,
    peer: SocketAddr,
    token: &ClusterToken,
    cfg: &GrpcConfig,
) -> Result<(), StreamAuthError> {
    let t = cfg.handshake_timeout;
    let r = match tokio::time::timeout(t, accept_steps(s, token)).await {
        Ok(r) => r,
        Err(_) => Err(timed_out(t)),
    };
    if let Err(e) = &r {
        tracing::warn!(%peer, "closed a gRPC connection before serving it: {e}");
    }
    r
}

/// The client end on a connection to the server, within the handshake
/// timeout.
pub(crate) async fn dial(s: &mut TcpStream, cfg: &GrpcConfig) -> Result<(), StreamAuthError> {
    let Some(token) = &cfg.token else {
        return Ok(());
    };
    let t = cfg.handshake_timeout;
    match tokio::time::timeout(t, dial_steps(s, token)).await {
        Ok(r) => r,
        Err(_) => Err(timed_out(t)),
    }
}

/// Either end on a blocking socket that is already connected (the bench's
/// data connection), within the handshake timeout (for the whole exchange,
/// not per read: [`stream::Deadline`]); nothing without a token.
pub(crate) fn on_std(
    s: &std::net::TcpStream,
    server: bool,
    cfg: &GrpcConfig,
) -> Result<(), StreamAuthError> {
    let Some(token) = &cfg.token else {
        return Ok(());
    };
    let t = cfg.handshake_timeout;
    let r = if server {
        stream::accept(s, token, PURPOSE, t)
    } else {
        stream::dial(s, token, PURPOSE, t)
    };
    if server {
        if let Err(e) = &r {
            let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
            tracing::warn!(%peer, "closed a gRPC connection before serving it: {e}");
        }
    }
    r
}

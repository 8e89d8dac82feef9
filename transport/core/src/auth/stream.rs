//! The cluster token's proof on a plain byte stream, for connections that
//! carry no starwire frames: the bench's JSON control connection, the raw
//! baseline's data connection and the gRPC baseline's HTTP/2 connections.
//!
//! The same proofs as the frame handshake ([`ClusterToken::proof`]), in
//! four fixed-size messages written before the stream's own protocol
//! starts:
//!
//! ```text
//! dialer   -> acceptor  "SWA1" | dialer nonce          (20 bytes)
//! acceptor -> dialer    acceptor nonce                 (16 bytes)
//! dialer   -> acceptor  proof(Dialer, dn, an, purpose) (32 bytes)
//! acceptor -> dialer    proof(Acceptor, an, dn, purpose) (32 bytes)
//! ```
//!
//! As in the frame handshake the token never crosses the wire, the proofs
//! are good for these two nonces only, are compared in constant time, and
//! the acceptor proves the token only after the dialer has. `purpose`
//! names the kind of stream, so that a proof made for one kind is no
//! proof for another.
//!
//! [`StreamDialer`] and [`StreamAcceptor`] hold no I/O: [`dial`] and
//! [`accept`] drive them over a blocking stream; an async caller reads and
//! writes the same fixed lengths itself.

use std::io::{Read, Write};

use starwire_wire::message::{NONCE_LEN, PROOF_LEN};
use thiserror::Error;

use super::{nonce, ClusterToken, Nonce, Side};

/// First bytes of a dialer's hello: a peer that sends anything else does
/// not speak this handshake (a client without the token speaking the
/// stream's own protocol at once).
pub const MAGIC: [u8; 4] = *b"SWA1";

/// Length of the dialer's hello: [`MAGIC`] and its nonce.
pub const HELLO_LEN: usize = MAGIC.len() + NONCE_LEN;

/// Why a stream handshake failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StreamAuthError {
    /// Reading or writing the stream failed (a timeout included).
    #[error("authenticating the stream: {0}")]
    Io(#[from] std::io::Error),
    /// The dialer did not start with the handshake's hello: it has no
    /// token, or speaks another protocol.
    #[error("peer not authenticated: it did not start the token handshake")]
    NoHello,
    /// The peer's proof is not the token's.
    #[error("peer not authenticated: its proof of the cluster token is wrong")]
    BadProof,
}

/// The dialing end of a stream handshake.
#[derive(Debug)]
pub struct StreamDialer {
    token: ClusterToken,
    purpose: &'static str,
    nonce: Nonce,
    peer_nonce: Nonce,
}

impl StreamDialer {
    /// A dialer with a fresh nonce, and the hello it sends first.
    pub fn new(token: ClusterToken, purpose: &'static str) -> (Self, [u8; HELLO_LEN]) {
        let d = Self {
            token,
            purpose,
            nonce: nonce(),
            peer_nonce: [0; NONCE_LEN],
        };
        let mut hello = [0u8; HELLO_LEN];
        hello[..MAGIC.len()].copy_from_slice(&MAGIC);
        hello[MAGIC.len()..].copy_from_slice(&d.nonce);
        (d, hello)
    }

    /// The acceptor's nonce in; this end's proof out, to send.
    pub fn handle_nonce(&mut self, peer_nonce: &Nonce) -> [u8; PROOF_LEN] {
        self.peer_nonce = *peer_nonce;
        self.token
            .proof(Side::Dialer, &self.nonce, &self.peer_nonce, self.purpose)
    }

    /// The acceptor's proof in: whether it holds the token.
    pub fn handle_proof(&self, proof: &[u8; PROOF_LEN]) -> Result<(), StreamAuthError> {
        self.token
            .verify(
                Side::Acceptor,
                &self.peer_nonce,
                &self.nonce,
                self.purpose,
                proof,
            )
            .then_some(())
            .ok_or(StreamAuthError::BadProof)
    }
}

/// The accepting end of a stream handshake.
#[derive(Debug)]
pub struct StreamAcceptor {
    token: ClusterToken,
    purpose: &'static str,
    nonce: Nonce,
    peer_nonce: Nonce,
}

impl StreamAcceptor {
    /// An acceptor with a fresh nonce.
    pub fn new(token: ClusterToken, purpose: &'static str) -> Self {
        Self {
            token,
            purpose,
            nonce: nonce(),
            peer_nonce: [0; NONCE_LEN],
        }
    }

    /// The dialer's hello in; this end's nonce out, to send.
    pub fn handle_hello(&mut self, hello: &[u8; HELLO_LEN]) -> Result<Nonce, StreamAuthError> {
        let (magic, peer_nonce) = hello.split_at(MAGIC.len());
        if magic != MAGIC {
            return Err(StreamAuthError::NoHello);
        }
        self.peer_nonce.copy_from_slice(peer_nonce);
        Ok(self.nonce)
    }

    /// The dialer's proof in; if it holds the token, this end's proof
    /// out, to send.
    pub fn handle_proof(
        &self,
        proof: &[u8; PROOF_LEN],
    ) -> Result<[u8; PROOF_LEN], StreamAuthError> {
        if !self.token.verify(
            Side::Dialer,
            &self.peer_nonce,
            &self.nonce,
            self.purpose,
            proof,
        ) {
            return Err(StreamAuthError::BadProof);
        }
        Ok(self
            .token
            .proof(Side::Acceptor, &self.nonce, &self.peer_nonce, self.purpose))
    }
}

/// Prove the token to the acceptor at the other end of `s`, and check its
/// proof. A read that blocks for ever blocks this: give `s` a read timeout.
pub fn dial<S: Read + Write>(
    s: &mut S,
    token: &ClusterToken,
    purpose: &'static str,
) -> Result<(), StreamAuthError> {
    let (mut d, hello) = StreamDialer::new(token.clone(), purpose);
    s.write_all(&hello)?;
    let mut n = [0u8; NONCE_LEN];
    s.read_exact(&mut n)?;
    s.write_all(&d.handle_nonce(&n))?;
    let mut p = [0u8; PROOF_LEN];
    s.read_exact(&mut p)?;
    d.handle_proof(&p)
}

/// Check the dialer's proof of the token on `s`, and prove it back. A read
/// that blocks for ever blocks this: give `s` a read timeout.
pub fn accept<S: Read + Write>(
    s: &mut S,
    token: &ClusterToken,
    purpose: &'static str,
) -> Result<(), StreamAuthError> {
    let mut a = StreamAcceptor::new(token.clone(), purpose);
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello)?;
    s.write_all(&a.handle_hello(&hello)?)?;
    let mut p = [0u8; PROOF_LEN];
    s.read_exact(&mut p)?;
    s.write_all(&a.handle_proof(&p)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use super::*;

    fn token(s: &str) -> ClusterToken {
        ClusterToken::new(s.as_bytes()).expect("token")
    }

    /// Both ends over a socket pair; the acceptor's outcome and the
    /// dialer's.
    fn run(
        dialer: ClusterToken,
        acceptor: ClusterToken,
        dial_purpose: &'static str,
    ) -> (Result<(), StreamAuthError>, Result<(), StreamAuthError>) {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
        }
        let t = std::thread::spawn(move || {
            let r = accept(&mut b, &acceptor, "test");
            // The dialer's read ends at this end's close.
            drop(b);
            r
        });
        let d = dial(&mut a, &dialer, dial_purpose);
        (t.join().expect("acceptor"), d)
    }

    #[test]
    fn the_same_token_authenticates_both_ends() {
        let (a, d) = run(
            token("0123456789abcdef-secret"),
            token("0123456789abcdef-secret"),
            "test",
        );
        a.expect("acceptor");
        d.expect("dialer");
    }

    #[test]
    fn another_token_or_purpose_is_refused_and_the_acceptor_proves_nothing() {
        for (t, purpose) in [
            ("0123456789abcdef-other", "test"),
            ("0123456789abcdef-secret", "other"),
        ] {
            let (a, d) = run(token(t), token("0123456789abcdef-secret"), purpose);
            assert!(matches!(a, Err(StreamAuthError::BadProof)), "{a:?}");
            // The acceptor closed without a proof of its own.
            assert!(matches!(d, Err(StreamAuthError::Io(_))), "{d:?}");
        }
    }

    #[test]
    fn a_peer_that_speaks_another_protocol_is_refused_at_its_hello() {
        let mut a = StreamAcceptor::new(token("0123456789abcdef-secret"), "test");
        let mut hello = *b"{\"plan\":{\"backends\":";
        assert!(matches!(
            a.handle_hello(&hello),
            Err(StreamAuthError::NoHello)
        ));
        hello[..4].copy_from_slice(&MAGIC);
        assert!(a.handle_hello(&hello).is_ok());
    }

    #[test]
    fn a_reflected_proof_is_no_proof() {
        // An attacker who dials an acceptor and replays to it the proof
        // another acceptor made for the same nonces gets nowhere: the
        // side is in the MAC.
        let t = token("0123456789abcdef-secret");
        let mut acc = StreamAcceptor::new(t.clone(), "test");
        let mut hello = [0u8; HELLO_LEN];
        hello[..4].copy_from_slice(&MAGIC);
        let an = acc.handle_hello(&hello).expect("hello");
        let reflected = t.proof(Side::Acceptor, &[0; NONCE_LEN], &an, "test");
        assert!(matches!(
            acc.handle_proof(&reflected),
            Err(StreamAuthError::BadProof)
        ));
    }
}

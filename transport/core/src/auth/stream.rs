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
//! [`accept`] drive them over a blocking socket within one timeout for the
//! whole exchange ([`Deadline`]), however the peer trickles it; an async
//! caller reads and writes the same fixed lengths itself, under a timeout
//! of its own for the whole exchange.

use std::io::{self, Read, Write};
use std::net::TcpStream;
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

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

/// A blocking socket whose read and write timeouts can be set: what
/// [`Deadline`] bounds each read and write of the exchange with.
pub trait SocketTimeouts {
    /// The socket's read timeout (`SO_RCVTIMEO`).
    fn read_timeout(&self) -> io::Result<Option<Duration>>;
    /// The socket's write timeout (`SO_SNDTIMEO`).
    fn write_timeout(&self) -> io::Result<Option<Duration>>;
    /// Set the read timeout: `None` waits for ever, zero is refused.
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    /// Set the write timeout: `None` waits for ever, zero is refused.
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

macro_rules! socket_timeouts {
    ($t:ty) => {
        impl SocketTimeouts for $t {
            fn read_timeout(&self) -> io::Result<Option<Duration>> {
                <$t>::read_timeout(self)
            }
            fn write_timeout(&self) -> io::Result<Option<Duration>> {
                <$t>::write_timeout(self)
            }
            fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
                <$t>::set_read_timeout(self, t)
            }
            fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
                <$t>::set_write_timeout(self, t)
            }
        }
    };
}

socket_timeouts!(TcpStream);
#[cfg(unix)]
socket_timeouts!(UnixStream);

/// A blocking socket whose reads and writes must all end by one instant:
/// before each, the socket's timeout is set to the time left, and once
/// none is left they fail with [`io::ErrorKind::TimedOut`]. A peer that
/// trickles a byte at a time so gets no more than `timeout` for all of
/// them, where a socket timeout alone bounds each read only.
///
/// It changes the socket's timeouts: [`dial`] and [`accept`] put back
/// what they were.
#[derive(Debug)]
pub struct Deadline<'a, S> {
    s: &'a S,
    until: Instant,
    timeout: Duration,
}

impl<'a, S> Deadline<'a, S>
where
    S: SocketTimeouts,
    &'a S: Read + Write,
{
    /// `s`, its reads and writes to end within `timeout` from now.
    pub fn new(s: &'a S, timeout: Duration) -> Self {
        Self {
            s,
            until: Instant::now() + timeout,
            timeout,
        }
    }

    /// The time left, or the exchange's timeout error.
    fn left(&self) -> io::Result<Duration> {
        match self.until.checked_duration_since(Instant::now()) {
            Some(d) if !d.is_zero() => Ok(d),
            _ => Err(timed_out(self.timeout)),
        }
    }
}

/// The error of an exchange not over within `t`.
fn timed_out(t: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("no proof of the cluster token within {} s", t.as_secs_f64()),
    )
}

/// Whether `e` is a socket timeout's: `WouldBlock` or `TimedOut`, by
/// platform.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl<'a, S> Read for Deadline<'a, S>
where
    S: SocketTimeouts,
    &'a S: Read + Write,
{
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.s.set_read_timeout(Some(self.left()?))?;
            match { self.s }.read(buf) {
                // Timed out at (or, by the clock's grain, just before) the
                // time left: try again with what is left, if any.
                Err(e) if is_timeout(&e) => {}
                r => return r,
            }
        }
    }
}

impl<'a, S> Write for Deadline<'a, S>
where
    S: SocketTimeouts,
    &'a S: Read + Write,
{
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            self.s.set_write_timeout(Some(self.left()?))?;
            match { self.s }.write(buf) {
                Err(e) if is_timeout(&e) => {}
                r => return r,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        { self.s }.flush()
    }
}

/// Run `exchange` on `s` within `timeout` for all of it, then put back the
/// socket's timeouts as they were.
fn within<'a, S>(
    s: &'a S,
    timeout: Duration,
    exchange: impl FnOnce(&mut Deadline<'a, S>) -> Result<(), StreamAuthError>,
) -> Result<(), StreamAuthError>
where
    S: SocketTimeouts,
    &'a S: Read + Write,
{
    let (read, write) = (s.read_timeout()?, s.write_timeout()?);
    let r = exchange(&mut Deadline::new(s, timeout));
    let restored = s
        .set_read_timeout(read)
        .and_then(|()| s.set_write_timeout(write));
    r?;
    Ok(restored?)
}

/// Prove the token to the acceptor at the other end of `s`, and check its
/// proof, all within `timeout` however the peer trickles it (a
/// [`Deadline`]). The socket's timeouts are as they were after.
pub fn dial<'a, S>(
    s: &'a S,
    token: &ClusterToken,
    purpose: &'static str,
    timeout: Duration,
) -> Result<(), StreamAuthError>
where
    S: SocketTimeouts,
    &'a S: Read + Write,
{
    within(s, timeout, |s| dial_steps(s, token, purpose))
}

/// Check the dialer's proof of the token on `s`, and prove it back, all
/// within `timeout` however the peer trickles it (a [`Deadline`]). The
/// socket's timeouts are as they were after.
pub fn accept<'a, S>(
    s: &'a S,
    token: &ClusterToken,
    purpose: &'static str,
    timeout: Duration,
) -> Result<(), StreamAuthError>
where
    S: SocketTimeouts,
    &'a S: Read + Write,
{
    within(s, timeout, |s| accept_steps(s, token, purpose))
}

fn dial_steps<S: Read + Write>(
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

fn accept_steps<S: Read + Write>(
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

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
        let (a, b) = UnixStream::pair().expect("pair");
        let t = std::thread::spawn(move || {
            let r = accept(&b, &acceptor, "test", Duration::from_secs(5));
            // The dialer's read ends at this end's close.
            drop(b);
            r
        });
        let d = dial(&a, &dialer, dial_purpose, Duration::from_secs(5));
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

    #[test]
    fn a_trickling_dialer_fails_the_acceptor_at_the_timeout_for_the_whole_exchange() {
        // A byte every 200 ms keeps each read well within the 1 s timeout:
        // only a bound on the whole exchange stops it.
        let timeout = Duration::from_secs(1);
        let (ours, mut peer) = UnixStream::pair().expect("pair");
        let sent = Arc::new(AtomicUsize::new(0));
        let trickler = {
            let sent = Arc::clone(&sent);
            std::thread::spawn(move || {
                let mut hello = [0x5a; HELLO_LEN];
                hello[..MAGIC.len()].copy_from_slice(&MAGIC);
                let msgs = hello.iter().chain(&[0xa5; PROOF_LEN]);
                for b in msgs {
                    if peer.write_all(&[*b]).is_err() {
                        return;
                    }
                    sent.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        };
        let t0 = Instant::now();
        let r = accept(&ours, &token("0123456789abcdef-secret"), "test", timeout);
        let took = t0.elapsed();
        let got = sent.load(Ordering::SeqCst);
        drop(ours);
        trickler.join().expect("trickler");
        assert!(
            matches!(&r, Err(StreamAuthError::Io(e)) if e.kind() == io::ErrorKind::TimedOut),
            "{r:?}"
        );
        assert!(r.unwrap_err().to_string().contains("within 1 s"));
        // Timed out part way through the hello, not after it all
        // (HELLO_LEN + PROOF_LEN bytes, a read timeout's worth each).
        assert!(got < HELLO_LEN, "{got} bytes were taken before the timeout");
        assert!(
            took < 5 * timeout,
            "took {took:?}, the timeout is {timeout:?}"
        );
    }

    #[test]
    fn a_silent_acceptor_fails_the_dialer_at_the_timeout() {
        let (ours, _peer) = UnixStream::pair().expect("pair");
        let t0 = Instant::now();
        let r = dial(
            &ours,
            &token("0123456789abcdef-secret"),
            "test",
            Duration::from_millis(300),
        );
        assert!(
            matches!(&r, Err(StreamAuthError::Io(e)) if e.kind() == io::ErrorKind::TimedOut),
            "{r:?}"
        );
        assert!(t0.elapsed() < Duration::from_millis(1500));
    }

    #[test]
    fn the_socket_timeouts_are_put_back_after_the_exchange() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (read, write) = (Duration::from_secs(7), Duration::from_secs(9));
        a.set_read_timeout(Some(read)).unwrap();
        a.set_write_timeout(Some(write)).unwrap();
        let t = token("0123456789abcdef-secret");
        let acceptor = {
            let t = t.clone();
            std::thread::spawn(move || accept(&b, &t, "test", Duration::from_secs(5)).map(|()| b))
        };
        dial(&a, &t, "test", Duration::from_secs(5)).expect("dialer");
        let b = acceptor.join().unwrap().expect("acceptor");
        assert_eq!(a.read_timeout().unwrap(), Some(read));
        assert_eq!(a.write_timeout().unwrap(), Some(write));
        assert_eq!(b.read_timeout().unwrap(), None);
        assert_eq!(b.write_timeout().unwrap(), None);
        // And after a failure.
        let (a, _b) = UnixStream::pair().expect("pair");
        assert!(dial(&a, &t, "test", Duration::from_millis(50)).is_err());
        assert_eq!(a.read_timeout().unwrap(), None);
        assert_eq!(a.write_timeout().unwrap(), None);
    }
}

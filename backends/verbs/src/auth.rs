//! [`SideChannelAuth`]: the cluster token's stream proof
//! (`starwire_transport::auth::stream`) on a connection's side channel,
//! stepped without blocking, before anything is allocated for the
//! connection.
//!
//! The four messages have fixed lengths and each read asks for no more
//! than the message still owed, so the bytes that follow the proof (the
//! peer's [`QpEndpoint`](starwire_rdma::QpEndpoint)) stay in the stream
//! for the next step. The exchange needs no verbs: it is tested over
//! socket pairs.

use std::io::{self, Read, Write};
use std::time::Instant;

use starwire_transport::auth::stream::{StreamAcceptor, StreamAuthError, StreamDialer, HELLO_LEN};
use starwire_transport::wire::message::{NONCE_LEN, PROOF_LEN};
use starwire_transport::{ClusterToken, Side};

/// The `purpose` of the proofs on a verbs side channel: a proof made for
/// another kind of stream is none here.
pub const PURPOSE: &str = "verbs-side-channel";

/// The longest message of the exchange.
const MAX_MSG: usize = if HELLO_LEN > PROOF_LEN {
    HELLO_LEN
} else {
    PROOF_LEN
};

#[derive(Debug)]
enum End {
    Dialer(StreamDialer),
    Acceptor(StreamAcceptor),
}

/// What the exchange waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    /// The dialer: the acceptor's nonce. The acceptor: the dialer's hello.
    First,
    /// The peer's proof.
    Proof,
    /// Nothing more to read: the peer proved the token.
    Nothing,
}

/// One end of the cluster token's stream proof over a non-blocking
/// stream. [`step`](Self::step) writes what is owed and reads what has
/// come, never more than the message it waits for; it reports done once
/// the peer has proved the token and this end's last message is written.
/// As the acceptor, this end proves the token only after the dialer has.
#[derive(Debug)]
pub struct SideChannelAuth {
    end: End,
    awaiting: Awaiting,
    out: Vec<u8>,
    got: [u8; MAX_MSG],
    len: usize,
}

impl SideChannelAuth {
    /// The `side` end of the proof of `token`; a dialer's hello is owed at
    /// once.
    pub fn new(side: Side, token: &ClusterToken) -> Self {
        let (end, out) = match side {
            Side::Dialer => {
                let (d, hello) = StreamDialer::new(token.clone(), PURPOSE);
                (End::Dialer(d), hello.to_vec())
            }
            Side::Acceptor => (
                End::Acceptor(StreamAcceptor::new(token.clone(), PURPOSE)),
                Vec::new(),
            ),
        };
        Self {
            end,
            awaiting: Awaiting::First,
            out,
            got: [0; MAX_MSG],
            len: 0,
        }
    }

    /// Which end this is.
    pub fn side(&self) -> Side {
        match self.end {
            End::Dialer(_) => Side::Dialer,
            End::Acceptor(_) => Side::Acceptor,
        }
    }

    /// True once the peer proved the token and everything owed is
    /// written.
    pub fn is_done(&self) -> bool {
        self.awaiting == Awaiting::Nothing && self.out.is_empty()
    }

    /// Length of the message awaited (0: none).
    fn want(&self) -> usize {
        match (self.awaiting, &self.end) {
            (Awaiting::First, End::Dialer(_)) => NONCE_LEN,
            (Awaiting::First, End::Acceptor(_)) => HELLO_LEN,
            (Awaiting::Proof, _) => PROOF_LEN,
            (Awaiting::Nothing, _) => 0,
        }
    }

    /// Write what is owed and read what has come on `s`, which does not
    /// block. `Ok(true)` once [`is_done`](Self::is_done); `Ok(false)` while
    /// waiting for the peer, unless `deadline` has passed at `now` (then a
    /// timeout). A wrong proof, a hello that is not one, or a closed
    /// stream fail at once.
    pub fn step<S: Read + Write>(
        &mut self,
        s: &mut S,
        now: Instant,
        deadline: Option<Instant>,
    ) -> Result<bool, StreamAuthError> {
        loop {
            while !self.out.is_empty() {
                match s.write(&self.out) {
                    Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                    Ok(n) => drop(self.out.drain(..n)),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            let want = self.want();
            if want == 0 {
                break;
            }
            if self.len < want {
                match s.read(&mut self.got[self.len..want]) {
                    Ok(0) => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the peer closed the side channel while proving the cluster token",
                        )
                        .into())
                    }
                    Ok(n) => self.len += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            self.handle()?;
        }
        if self.is_done() {
            return Ok(true);
        }
        if deadline.is_some_and(|d| now >= d) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer did not prove the cluster token on the side channel in time",
            )
            .into());
        }
        Ok(false)
    }

    /// The awaited message is in: act on it.
    fn handle(&mut self) -> Result<(), StreamAuthError> {
        let msg = &self.got[..self.len];
        match (&mut self.end, self.awaiting) {
            (End::Dialer(d), Awaiting::First) => {
                let mut n = [0u8; NONCE_LEN];
                n.copy_from_slice(msg);
                self.out.extend_from_slice(&d.handle_nonce(&n));
                self.awaiting = Awaiting::Proof;
            }
            (End::Dialer(d), Awaiting::Proof) => {
                let mut p = [0u8; PROOF_LEN];
                p.copy_from_slice(msg);
                d.handle_proof(&p)?;
                self.awaiting = Awaiting::Nothing;
            }
            (End::Acceptor(a), Awaiting::First) => {
                let mut h = [0u8; HELLO_LEN];
                h.copy_from_slice(msg);
                self.out.extend_from_slice(&a.handle_hello(&h)?);
                self.awaiting = Awaiting::Proof;
            }
            (End::Acceptor(a), Awaiting::Proof) => {
                let mut p = [0u8; PROOF_LEN];
                p.copy_from_slice(msg);
                self.out.extend_from_slice(&a.handle_proof(&p)?);
                self.awaiting = Awaiting::Nothing;
            }
            (_, Awaiting::Nothing) => {}
        }
        self.len = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use super::*;

    fn token(s: &str) -> ClusterToken {
        ClusterToken::new(s.as_bytes()).expect("token")
    }

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().expect("socket pair");
        a.set_nonblocking(true).expect("nonblocking");
        b.set_nonblocking(true).expect("nonblocking");
        (a, b)
    }

    /// Step both ends in turn until neither moves; their outcomes.
    fn run(
        dialer: &mut SideChannelAuth,
        d: &mut UnixStream,
        acceptor: &mut SideChannelAuth,
        a: &mut UnixStream,
    ) -> (Result<bool, StreamAuthError>, Result<bool, StreamAuthError>) {
        let now = Instant::now();
        let (mut rd, mut ra) = (Ok(false), Ok(false));
        for _ in 0..16 {
            if matches!(rd, Ok(false)) {
                rd = dialer.step(d, now, None);
            }
            if matches!(ra, Ok(false)) {
                ra = acceptor.step(a, now, None);
            }
        }
        (rd, ra)
    }

    #[test]
    fn both_ends_with_the_same_token_pass_and_leave_what_follows() {
        let t = token("0123456789abcdef-secret");
        let (mut d, mut a) = pair();
        let mut dialer = SideChannelAuth::new(Side::Dialer, &t);
        let mut acceptor = SideChannelAuth::new(Side::Acceptor, &t);
        assert_eq!(
            (dialer.side(), acceptor.side()),
            (Side::Dialer, Side::Acceptor)
        );
        let (rd, ra) = run(&mut dialer, &mut d, &mut acceptor, &mut a);
        assert!(rd.expect("dialer"));
        assert!(ra.expect("acceptor"));
        assert!(dialer.is_done() && acceptor.is_done());
        // The exchange read nothing beyond its messages: what each end
        // writes next (its queue pair's endpoint) is the other's to read.
        a.write_all(b"endpoint").unwrap();
        let mut next = [0u8; 8];
        d.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"endpoint");
        assert!(matches!(
            d.read(&mut next),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        ));
    }

    #[test]
    fn bytes_that_follow_the_proof_at_once_stay_in_the_stream() {
        // The acceptor writes its proof and at once what follows; the
        // dialer's reads stop at the proof.
        let t = token("0123456789abcdef-secret");
        let (mut d, mut a) = pair();
        let mut dialer = SideChannelAuth::new(Side::Dialer, &t);
        let mut acceptor = SideChannelAuth::new(Side::Acceptor, &t);
        let now = Instant::now();
        assert!(!dialer.step(&mut d, now, None).unwrap(), "hello written");
        assert!(!acceptor.step(&mut a, now, None).unwrap(), "nonce written");
        assert!(!dialer.step(&mut d, now, None).unwrap(), "proof written");
        assert!(acceptor.step(&mut a, now, None).unwrap(), "proof checked");
        a.write_all(&[7; 40]).unwrap();
        assert!(dialer.step(&mut d, now, None).unwrap());
        let mut rest = [0u8; 64];
        assert_eq!(d.read(&mut rest).unwrap(), 40);
    }

    #[test]
    fn a_wrong_token_fails_on_the_acceptor_which_proves_nothing() {
        let (mut d, mut a) = pair();
        let mut dialer = SideChannelAuth::new(Side::Dialer, &token("0123456789abcdef-other"));
        let mut acceptor = SideChannelAuth::new(Side::Acceptor, &token("0123456789abcdef-secret"));
        let (rd, ra) = run(&mut dialer, &mut d, &mut acceptor, &mut a);
        assert!(matches!(ra, Err(StreamAuthError::BadProof)), "{ra:?}");
        assert!(!acceptor.is_done());
        // The dialer got the nonce but no proof: it still waits.
        assert!(matches!(rd, Ok(false)), "{rd:?}");
        drop(a);
        let rd = dialer.step(&mut d, Instant::now(), None);
        assert!(matches!(rd, Err(StreamAuthError::Io(_))), "{rd:?}");
    }

    #[test]
    fn a_dialer_is_refused_an_acceptor_with_another_token() {
        let (mut d, mut a) = pair();
        let mut dialer = SideChannelAuth::new(Side::Dialer, &token("0123456789abcdef-secret"));
        let mut acceptor = StreamAcceptor::new(token("0123456789abcdef-secret"), PURPOSE);
        let now = Instant::now();
        dialer.step(&mut d, now, None).unwrap();
        let mut hello = [0u8; HELLO_LEN];
        a.read_exact(&mut hello).unwrap();
        a.write_all(&acceptor.handle_hello(&hello).unwrap())
            .unwrap();
        dialer.step(&mut d, now, None).unwrap();
        let mut proof = [0u8; PROOF_LEN];
        a.read_exact(&mut proof).unwrap();
        acceptor
            .handle_proof(&proof)
            .expect("the dialer's proof is good");
        // An acceptor without the token answers with a proof of its own
        // making: the dialer refuses it.
        a.write_all(&[0x5a; PROOF_LEN]).unwrap();
        let r = dialer.step(&mut d, now, None);
        assert!(matches!(r, Err(StreamAuthError::BadProof)), "{r:?}");
    }

    #[test]
    fn a_silent_peer_times_out_at_the_deadline() {
        let t = token("0123456789abcdef-secret");
        for side in [Side::Dialer, Side::Acceptor] {
            let (mut s, _peer) = pair();
            let mut auth = SideChannelAuth::new(side, &t);
            let now = Instant::now();
            let deadline = now + Duration::from_millis(10);
            assert!(!auth.step(&mut s, now, Some(deadline)).unwrap());
            let r = auth.step(&mut s, deadline, Some(deadline));
            assert!(
                matches!(&r, Err(StreamAuthError::Io(e)) if e.kind() == io::ErrorKind::TimedOut),
                "{side:?}: {r:?}"
            );
        }
    }

    #[test]
    fn a_peer_sending_garbage_fails_at_once() {
        let t = token("0123456789abcdef-secret");
        // To an acceptor: anything but the hello.
        let (mut s, mut peer) = pair();
        let mut auth = SideChannelAuth::new(Side::Acceptor, &t);
        peer.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let r = auth.step(&mut s, Instant::now(), None);
        assert!(matches!(r, Err(StreamAuthError::NoHello)), "{r:?}");
        // A hello, then a proof that is none.
        let (mut s, mut peer) = pair();
        let mut auth = SideChannelAuth::new(Side::Acceptor, &t);
        let mut hello = *b"SWA1................";
        hello[..4].copy_from_slice(b"SWA1");
        peer.write_all(&hello).unwrap();
        peer.write_all(&[0xff; PROOF_LEN]).unwrap();
        let r = auth.step(&mut s, Instant::now(), None);
        assert!(matches!(r, Err(StreamAuthError::BadProof)), "{r:?}");
        // The acceptor wrote its nonce and nothing keyed by the token.
        let mut got = [0u8; 64];
        assert_eq!(peer.read(&mut got).unwrap(), NONCE_LEN);
        // A peer that closes part way.
        let (mut s, mut peer) = pair();
        let mut auth = SideChannelAuth::new(Side::Acceptor, &t);
        peer.write_all(b"SWA1").unwrap();
        drop(peer);
        let r = auth.step(&mut s, Instant::now(), None);
        assert!(
            matches!(&r, Err(StreamAuthError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof),
            "{r:?}"
        );
    }
}

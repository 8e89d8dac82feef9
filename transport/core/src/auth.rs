//! The cluster token and the handshake's proof of it.
//!
//! Every task of a cluster is given the same secret, the [`ClusterToken`]
//! (`STARWIRE_CLUSTER_TOKEN` or `--token-file`). The handshake proves it
//! both ways without sending it: each side's `Hello` carries a fresh
//! random nonce, and each side answers the other's with an `Auth` frame
//! whose proof is
//!
//! ```text
//! HMAC-SHA256(token, "starwire-auth-v2" | side | own nonce | peer nonce | flags)
//! ```
//!
//! `side` is the prover's: [`Side::Dialer`] or [`Side::Acceptor`]. A
//! verifier checks for the side opposite its own, so a proof taken from an
//! acceptor can never be reflected back to pass as a dialer's; the nonces
//! make it good for one connection only; `flags`, the prover's training
//! flags, are vouched for by the same MAC. Proofs are compared in constant
//! time. The acceptor sends its proof only after the dialer's checked
//! out, so a peer without the token learns nothing keyed by it, nor the
//! training flags.
//!
//! The flags text also carries the config agreement: each side sends its
//! training flags (`name=value` lines) and a connection whose peer's
//! differ fails at connect, naming them ([`flags_differ`]).
//!
//! The channel is authenticated at connect but not encrypted or
//! integrity-protected after it: TLS (rustls) would wrap the stream
//! between the preamble and the handshake; see docs/SECURITY.md.

use std::fmt;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use starwire_wire::message::{NONCE_LEN, PROOF_LEN};
use thiserror::Error;

pub mod stream;

/// Environment variable that holds the cluster token.
pub const TOKEN_ENV: &str = "STARWIRE_CLUSTER_TOKEN";

/// Fewest bytes a token may have.
pub const MIN_TOKEN_LEN: usize = 16;

/// Most bytes a token file may hold (white space included): a secret is
/// tens of bytes, and a path given by mistake (`/dev/zero`, a log) is
/// refused rather than read whole.
pub const MAX_TOKEN_FILE_LEN: u64 = 4096;

/// Which end of a connection: the one that dialed (a worker) or the one
/// that accepted (a PS shard).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// Connected to the peer (and wrote the preamble).
    Dialer,
    /// Accepted the peer's connection.
    Acceptor,
}

impl Side {
    /// The other end's side.
    pub fn peer(self) -> Self {
        match self {
            Self::Dialer => Self::Acceptor,
            Self::Acceptor => Self::Dialer,
        }
    }

    fn label(self) -> u8 {
        match self {
            Self::Dialer => b'D',
            Self::Acceptor => b'A',
        }
    }
}

/// A token that cannot be used.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The token file could not be read.
    #[error("reading the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Too short to be a secret.
    #[error("the cluster token has {0} bytes; it needs at least {MIN_TOKEN_LEN}")]
    TooShort(usize),
    /// The token file is longer than [`MAX_TOKEN_FILE_LEN`].
    #[error("the token file {0} holds more than {MAX_TOKEN_FILE_LEN} bytes: not a token")]
    TooLong(String),
}

/// The shared secret of a cluster. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken(Arc<[u8]>);

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterToken({} bytes)", self.0.len())
    }
}

impl ClusterToken {
    /// A token of `bytes` (leading and trailing white space removed, as a
    /// file or variable written by hand ends in a newline).
    pub fn new(bytes: &[u8]) -> Result<Self, TokenError> {
        let b = bytes.trim_ascii();
        if b.len() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort(b.len()));
        }
        Ok(Self(b.into()))
    }

    /// The token in the file at `path`.
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let read = |source| TokenError::Read {
            path: path.display().to_string(),
            source,
        };
        // One byte past the limit tells a file that is too long.
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_TOKEN_FILE_LEN + 1).read_to_end(&mut bytes))
            .map_err(read)?;
        if bytes.len() as u64 > MAX_TOKEN_FILE_LEN {
            return Err(TokenError::TooLong(path.display().to_string()));
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(path) {
                if m.permissions().mode() & 0o077 != 0 {
                    tracing::warn!(
                        path = %path.display(),
                        "the cluster token file can be read by other users (chmod 600 it)"
                    );
                }
            }
        }
        Self::new(&bytes)
    }

    /// The token in [`TOKEN_ENV`], if it is set.
    pub fn from_env() -> Result<Option<Self>, TokenError> {
        match std::env::var_os(TOKEN_ENV) {
            None => Ok(None),
            Some(v) => Self::new(v.as_encoded_bytes()).map(Some),
        }
    }

    /// A new random token (32 bytes from the operating system's generator,
    /// as 64 hex digits): what a local cluster makes for itself.
    pub fn random() -> Self {
        let mut b = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut b);
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        Self(hex.as_bytes().into())
    }

    fn mac(
        &self,
        prover: Side,
        prover_nonce: &Nonce,
        verifier_nonce: &Nonce,
        flags: &str,
    ) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        m.update(b"starwire-auth-v2");
        m.update(&[prover.label()]);
        m.update(prover_nonce);
        m.update(verifier_nonce);
        m.update(flags.as_bytes());
        m
    }

    /// The proof `prover` sends: over its nonce, the verifier's and its
    /// flags text.
    pub fn proof(
        &self,
        prover: Side,
        prover_nonce: &Nonce,
        verifier_nonce: &Nonce,
        flags: &str,
    ) -> [u8; PROOF_LEN] {
        self.mac(prover, prover_nonce, verifier_nonce, flags)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the one `prover` would send; compared in
    /// constant time.
    pub fn verify(
        &self,
        prover: Side,
        prover_nonce: &Nonce,
        verifier_nonce: &Nonce,
        flags: &str,
        proof: &[u8; PROOF_LEN],
    ) -> bool {
        self.mac(prover, prover_nonce, verifier_nonce, flags)
            .verify_slice(proof)
            .is_ok()
    }
}

/// A handshake nonce.
pub type Nonce = [u8; NONCE_LEN];

/// A fresh nonce from the thread's CSPRNG (seeded by the operating
/// system).
pub fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

/// The flags whose values differ between two flags texts (`name=value`
/// lines), each with both values: `"--embedding-dim (8 here, 64 at the
/// peer)"`. A flag one side does not name counts as differing.
pub fn flags_differ(ours: &str, theirs: &str) -> Vec<String> {
    fn parse(t: &str) -> Vec<(&str, &str)> {
        let mut v: Vec<(&str, &str)> = t
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.split_once('=').unwrap_or((l, "")))
            .collect();
        v.sort_unstable();
        v
    }
    fn get<'a>(v: &[(&'a str, &'a str)], k: &str) -> Option<&'a str> {
        v.iter().find(|(n, _)| *n == k).map(|(_, x)| *x)
    }
    let (a, b) = (parse(ours), parse(theirs));
    let mut names: Vec<&str> = a.iter().chain(&b).map(|(n, _)| *n).collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .filter_map(|n| {
            let (x, y) = (get(&a, n), get(&b, n));
            (x != y).then(|| {
                format!(
                    "--{n} ({} here, {} at the peer)",
                    x.unwrap_or("unset"),
                    y.unwrap_or("unset")
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(s: &str) -> ClusterToken {
        ClusterToken::new(s.as_bytes()).expect("token")
    }

    #[test]
    fn a_token_file_past_the_limit_is_refused_without_reading_it_whole() {
        let dir = std::env::temp_dir().join(format!("starwire-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok");
        let pad = " ".repeat(MAX_TOKEN_FILE_LEN as usize - 24);
        std::fs::write(&ok, format!("0123456789abcdef-secret\n{pad}")).unwrap();
        assert_eq!(
            ClusterToken::from_file(&ok).unwrap(),
            token("0123456789abcdef-secret")
        );
        let long = dir.join("long");
        std::fs::write(&long, "x".repeat(MAX_TOKEN_FILE_LEN as usize + 1)).unwrap();
        assert!(matches!(
            ClusterToken::from_file(&long),
            Err(TokenError::TooLong(_))
        ));
        // A device without end is refused at the limit, not read forever.
        assert!(matches!(
            ClusterToken::from_file(Path::new("/dev/zero")),
            Err(TokenError::TooLong(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_proof_verifies_only_with_the_same_token_side_nonces_and_flags() {
        let t = token("0123456789abcdef-secret");
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let p = t.proof(Side::Dialer, &a, &b, "x=1\n");
        assert!(t.verify(Side::Dialer, &a, &b, "x=1\n", &p));
        // Another token, side, order of nonces, nonce or flags: refused.
        assert!(!token("0123456789abcdef-other").verify(Side::Dialer, &a, &b, "x=1\n", &p));
        assert!(!t.verify(Side::Acceptor, &a, &b, "x=1\n", &p));
        assert!(!t.verify(Side::Dialer, &b, &a, "x=1\n", &p));
        assert!(!t.verify(Side::Dialer, &a, &[3u8; 16], "x=1\n", &p));
        assert!(!t.verify(Side::Dialer, &a, &b, "x=2\n", &p));
        let mut bad = p;
        bad[31] ^= 1;
        assert!(!t.verify(Side::Dialer, &a, &b, "x=1\n", &bad));
        // The proof is no function of the token alone.
        assert_ne!(p, t.proof(Side::Dialer, &a, &[9u8; 16], "x=1\n"));
    }

    #[test]
    fn tokens_are_trimmed_and_must_be_long_enough() {
        assert_eq!(token("  0123456789abcdef\n"), token("0123456789abcdef"));
        assert!(matches!(
            ClusterToken::new(b"short\n"),
            Err(TokenError::TooShort(5))
        ));
        let r = ClusterToken::random();
        assert_ne!(r, ClusterToken::random());
        assert_eq!(format!("{r:?}"), "ClusterToken(64 bytes)");
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn flags_that_differ_are_named_with_both_values() {
        let ours = "model=wdl\nembedding-dim=8\nlr=0.3\n";
        assert!(flags_differ(ours, "lr=0.3\nembedding-dim=8\nmodel=wdl").is_empty());
        assert_eq!(
            flags_differ(ours, "model=wdl\nembedding-dim=64\nsync=true\nlr=0.3"),
            vec![
                "--embedding-dim (8 here, 64 at the peer)".to_string(),
                "--sync (unset here, true at the peer)".to_string(),
            ]
        );
    }
}

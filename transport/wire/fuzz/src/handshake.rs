//! [`Handshake`]: the PS end of a connection fed a fuzzed frame stream
//! (`fuzz-handshake`).
//!
//! The input is split into frames as a stream driver would (each frame
//! the header's `body_len` long, the last one whatever is left) and
//! handed to [`Connection::handle_frame`] of an acceptor until it fails.
//! Half the runs give the connection a cluster token. Oracles: nothing
//! panics; with a token, no message is delivered and the handshake never
//! completes (a proof of the run's fresh nonce cannot be in the input).

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

use rand::Rng;
use starwire_transport::{
    ClusterToken, ConnConfig, ConnError, Connection, PeerInfo, Side, TaskRole,
};
use starwire_wire::HEADER_LEN;

use crate::driver::{Spec, Target};
use crate::{seeds, Frames, Mutator};

/// Largest frame the fuzzed connection takes.
const MAX_FRAME: usize = 4096;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct Handshake {
    runs: u64,
    established: u64,
    delivered: u64,
    errors: BTreeMap<&'static str, u64>,
}

/// Whether the run's connection has a token.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    token: bool,
}

fn connection(token: bool) -> Connection {
    let mut cfg = ConnConfig::new(PeerInfo {
        role: TaskRole::Ps,
        job: "ps".into(),
        task_index: 0,
        incarnation: 1,
        shards: 1,
    });
    cfg.side = Side::Acceptor;
    cfg.recv_window = 8;
    cfg.max_message_len = 1 << 16;
    cfg.flags = "model=wdl\nembedding-dim=8\n".into();
    if token {
        cfg.token = ClusterToken::new(b"fuzz-handshake-cluster-token").ok();
    }
    Connection::new(cfg, MAX_FRAME)
}

fn error_kind(e: &ConnError) -> &'static str {
    match e {
        ConnError::Frame(_) => "frame",
        ConnError::Handshake(_) => "handshake",
        ConnError::Protocol(_) => "protocol",
        ConnError::Unauthenticated(_) => "unauthenticated",
        ConnError::FlagsDiffer(_) => "flags-differ",
        ConnError::TimedOut(_) => "timed-out",
        ConnError::OverBudget(_) => "over-budget",
        ConnError::Closed => "closed",
        _ => "other",
    }
}

impl Target for Handshake {
    const SPEC: Spec = Spec {
        name: "fuzz-handshake",
        seed: 0x5357_4853,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out"),
        max_len: 1 << 15,
        max_len_flag: true,
        corpus_flags: true,
        max_corpus: 4096,
        failure_prefix: "handshake",
    };
    type Mutation = Frames;
    type Case = Case;
    type Key = u64;

    fn seeds(&self) -> Vec<Vec<u8>> {
        // A hello and an auth, then every other seed behind them.
        let corpus = seeds::corpus();
        let opening: Vec<u8> = corpus
            .iter()
            .filter(|f| f.len() > HEADER_LEN && matches!(f[5], 0x01 | 0x06))
            .take(2)
            .flatten()
            .copied()
            .collect();
        let mut out: Vec<Vec<u8>> = corpus
            .iter()
            .map(|f| [opening.as_slice(), f].concat())
            .collect();
        out.push(opening);
        out
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<Frames>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> Case {
        m.mutate(input, corpus);
        Case {
            token: m.rng().gen_bool(0.5),
        }
    }

    fn run(&mut self, case: &Case, input: &[u8]) -> Result<u64, String> {
        self.runs += 1;
        let mut conn = connection(case.token);
        let mut scratch = Vec::new();
        let mut rest = input;
        let (mut frames, mut delivered) = (0u64, 0u64);
        let mut error = None;
        while !rest.is_empty() {
            let body = rest
                .get(20..24)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
            let n = HEADER_LEN.saturating_add(body).min(rest.len());
            let (frame, tail) = rest.split_at(n);
            rest = tail;
            frames += 1;
            match conn.handle_frame(frame, &mut scratch) {
                Ok(Some(_)) => delivered += 1,
                Ok(None) => {}
                Err(e) => {
                    error = Some(error_kind(&e));
                    break;
                }
            }
        }
        self.delivered += delivered;
        if conn.is_established() {
            self.established += 1;
        }
        if let Some(k) = error {
            *self.errors.entry(k).or_default() += 1;
        }
        if case.token && (delivered > 0 || conn.is_established()) {
            return Err(format!(
                "with a token: {delivered} messages delivered, established {}",
                conn.is_established()
            ));
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (
            case.token,
            frames.min(16),
            delivered.min(4),
            conn.is_established(),
            error,
        )
            .hash(&mut h);
        Ok(h.finish())
    }

    fn describe(&self, case: &Case) -> String {
        format!(" with a token: {}", case.token)
    }

    fn progress(&self) -> String {
        format!(
            "runs {}  established {}  delivered {}",
            self.runs, self.established, self.delivered
        )
    }

    fn summary(&self) -> Vec<String> {
        vec![
            format!(
                "runs {} | established without a token {} | messages delivered {}",
                self.runs, self.established, self.delivered
            ),
            format!("errors by kind: {:?}", self.errors),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        for token in [false, true] {
            self.run(&Case { token }, input)?;
        }
        Ok(())
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        let mut ok = true;
        for token in [false, true] {
            let r = self.run(&Case { token }, input);
            println!("token {token}: {r:?}");
            ok &= r.is_ok();
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_reach_the_handshake_and_a_short_run_keeps_the_oracles() {
        let mut t = Handshake::default();
        let corpus = t.seeds();
        // Without a token a seed completes the handshake and delivers.
        for s in &corpus {
            t.run(&Case { token: false }, s).expect("oracle");
        }
        assert!(t.established > 0 && t.delivered > 0, "{t:?}");
        let mut m = Mutator::<Frames>::new(11, 1 << 15);
        for i in 0..5_000 {
            let mut d = corpus[i % corpus.len()].clone();
            let case = t.prepare(&mut m, &mut d, &corpus);
            t.run(&case, &d).expect("oracle");
        }
        assert!(t.errors.contains_key("unauthenticated"), "{:?}", t.errors);
    }
}

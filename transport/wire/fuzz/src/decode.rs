//! [`Decode`]: [`decode_any`] as a driver target (`fuzz-decode`).

use std::collections::BTreeMap;

use rand::Rng;
use starwire_wire::{decode_any, Limits};

use crate::driver::{Spec, Target};
use crate::{frame_error_kind, outcome_signature, seeds, Frames, Mutator, SMALL_LIMITS};

/// Every wire decoder through [`decode_any`], half the runs with the
/// default limits and half with [`SMALL_LIMITS`]; an input joins the
/// corpus when its [`outcome_signature`] is new. The decoder must never
/// panic.
#[derive(Debug, Default)]
pub struct Decode {
    full: u64,
    body_err: u64,
    frame_err: u64,
    kinds: BTreeMap<&'static str, u64>,
}

impl Target for Decode {
    const SPEC: Spec = Spec {
        name: "fuzz-decode",
        seed: 0x5357_5231,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out"),
        max_len: 1 << 16,
        max_len_flag: true,
        corpus_flags: true,
        max_corpus: 8192,
        failure_prefix: "crash",
    };
    type Mutation = Frames;
    type Case = Limits;
    type Key = u64;

    fn seeds(&self) -> Vec<Vec<u8>> {
        seeds::corpus()
    }

    fn known(&mut self, corpus: &[Vec<u8>]) -> Vec<u64> {
        corpus
            .iter()
            .flat_map(|c| {
                [Limits::default(), SMALL_LIMITS].map(|l| outcome_signature(&decode_any(c, &l)))
            })
            .collect()
    }

    fn prepare(
        &mut self,
        m: &mut Mutator<Frames>,
        input: &mut Vec<u8>,
        corpus: &[Vec<u8>],
    ) -> Limits {
        m.mutate(input, corpus);
        if m.rng().gen_bool(0.5) {
            Limits::default()
        } else {
            SMALL_LIMITS
        }
    }

    fn run(&mut self, limits: &Limits, input: &[u8]) -> Result<u64, String> {
        let r = decode_any(input, limits);
        match &r {
            Ok(s) if s.body_errors == 0 => self.full += 1,
            Ok(_) => self.body_err += 1,
            Err(e) => {
                self.frame_err += 1;
                *self.kinds.entry(frame_error_kind(e)).or_default() += 1;
            }
        }
        Ok(outcome_signature(&r))
    }

    fn describe(&self, limits: &Limits) -> String {
        format!(" with {limits:?}")
    }

    fn progress(&self) -> String {
        format!(
            "ok {}  body-err {}  frame-err {}",
            self.full, self.body_err, self.frame_err
        )
    }

    fn summary(&self) -> Vec<String> {
        vec![
            format!(
                "decoded fully {} | decoded with body errors {} | framing errors {}",
                self.full, self.body_err, self.frame_err
            ),
            format!("framing errors by kind: {:?}", self.kinds),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        for limits in [Limits::default(), SMALL_LIMITS] {
            self.run(&limits, input)?;
        }
        // The acceptor's first bytes: the preamble's parser.
        let _ = starwire_transport::preamble::Preamble::parse(input);
        Ok(())
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        for limits in [Limits::default(), SMALL_LIMITS] {
            println!("{limits:?}: {:?}", decode_any(input, &limits));
        }
        true
    }
}

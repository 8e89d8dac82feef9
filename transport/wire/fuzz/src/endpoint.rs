//! [`Endpoint`]: the RDMA side-channel message
//! ([`starwire_rdma::QpEndpoint`]) as a driver target
//! (`fuzz-qp-endpoint`).

use std::collections::BTreeMap;

use starwire_rdma::{EndpointError, QpEndpoint, RemoteRing};

use crate::driver::{Spec, Target};
use crate::{Frames, Mutator};

/// `QpEndpoint::parse` on mutated messages. It must never panic, and an
/// accepted message must encode back to exactly its bytes (one encoding
/// per endpoint). An input joins the corpus when its outcome (accepted, or
/// which error) is new.
#[derive(Debug, Default)]
pub struct Endpoint {
    accepted: u64,
    rejected: BTreeMap<&'static str, u64>,
}

fn kind(e: &EndpointError) -> &'static str {
    match e {
        EndpointError::Length { .. } => "length",
        EndpointError::Magic { .. } => "magic",
        EndpointError::Version { .. } => "version",
        EndpointError::Field { field, .. } => field,
        _ => "other",
    }
}

/// Valid messages: a RoCE-like and an InfiniBand-like endpoint.
pub fn seeds() -> Vec<Vec<u8>> {
    let ring = RemoteRing {
        rkey: 0x1234,
        addr: 0x7f00_0000_1000,
        len: 1 << 20,
        recv_depth: 128,
    };
    let mut gid = [0u8; 16];
    gid[..2].copy_from_slice(&[0xfe, 0x80]);
    gid[15] = 1;
    vec![
        QpEndpoint {
            qpn: 0x11,
            psn: 0xabcdef,
            lid: 0,
            gid,
            gid_index: 1,
            mtu: 3,
            port: 1,
            ring,
        }
        .to_bytes()
        .to_vec(),
        QpEndpoint {
            qpn: 0xff_fffe,
            psn: 0,
            lid: 7,
            gid: [0; 16],
            gid_index: 0,
            mtu: 5,
            port: 2,
            ring,
        }
        .to_bytes()
        .to_vec(),
    ]
}

impl Target for Endpoint {
    const SPEC: Spec = Spec {
        name: "fuzz-qp-endpoint",
        seed: 0x5357_5150,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/qp-endpoint"),
        max_len: 256,
        max_len_flag: false,
        corpus_flags: false,
        max_corpus: 1024,
        failure_prefix: "crash",
    };
    type Mutation = Frames;
    type Case = ();
    type Key = &'static str;

    fn seeds(&self) -> Vec<Vec<u8>> {
        seeds()
    }

    fn prepare(&mut self, m: &mut Mutator<Frames>, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        m.mutate(input, corpus);
    }

    fn run(&mut self, _case: &(), input: &[u8]) -> Result<&'static str, String> {
        match QpEndpoint::parse(input) {
            Ok(e) => {
                self.accepted += 1;
                if e.to_bytes().as_slice() != input {
                    return Err(format!("accepted {e:?} encodes to other bytes"));
                }
                Ok("accepted")
            }
            Err(e) => {
                let k = kind(&e);
                *self.rejected.entry(k).or_default() += 1;
                Ok(k)
            }
        }
    }

    fn progress(&self) -> String {
        format!(
            "accepted {}  rejected {}",
            self.accepted,
            self.rejected.values().sum::<u64>()
        )
    }

    fn summary(&self) -> Vec<String> {
        vec![
            format!("accepted {}", self.accepted),
            format!("rejected by reason: {:?}", self.rejected),
        ]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        self.run(&(), input).map(drop)
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        println!("{:?}", QpEndpoint::parse(input));
        true
    }
}

//! Stable-toolchain mutation fuzzers for starwire's parsers: every wire
//! decoder through [`starwire_wire::decode_any`] ([`Decode`], driver
//! `fuzz-decode`), the stream [`starwire_wire::Deframer`] ([`Deframe`],
//! driver `fuzz-deframe`), the PS codec through the shard's request
//! handlers ([`ps::Handlers`], driver `fuzz-ps-proto`), the DPDK
//! backend's Ethernet/IPv4/UDP parser ([`Udp`], driver `fuzz-udp`), and
//! the RDMA side-channel message `starwire_rdma::QpEndpoint`
//! ([`endpoint::Endpoint`], driver `fuzz-qp-endpoint`), the PS
//! checkpoint readers, shard files and deltas
//! ([`checkpoint::Checkpoint`], driver `fuzz-checkpoint`), and the
//! reliable-datagram protocol under the DPDK backend, its packet decoder
//! and `ReliableCore::handle_packet` ([`datagram`], driver
//! `fuzz-datagram`), and the text parsers of user and peer input, the
//! `starwire_config` endpoint, endpoint map, `TF_CONFIG` and settings
//! parsers and the `starwire_data` Criteo reader, plain and gzip
//! ([`text::Text`], driver `fuzz-text`), and the receive path of the RDMA
//! backend's ring protocol, `starwire_rdma::RingConn` under an
//! `RdmaDriver` over the crate's simulated NICs, against a scripted peer
//! that writes honest and forged frames and credits
//! ([`rdma_ring::RdmaRing`], driver `fuzz-rdma-ring`).
//!
//! * [`seeds`] builds a seed corpus of valid encoded frames of every opcode,
//!   chunked messages and multi-frame streams.
//! * [`Mutator`] applies stacked mutations of one format; [`Frames`] are
//!   byte-level mutations aimed at a length-prefixed format: bit flips,
//!   interesting bytes, length fields overwritten with boundary values,
//!   truncation, splicing, duplication, and "fix-ups" that make a mutated
//!   body reach the body parsers.
//! * [`fuzz_one`] runs the decoder on one input.
//! * [`check_deframe`] feeds one stream to the deframer in pieces and
//!   compares it with parsing the stream whole.
//! * [`handshake`] feeds frame streams to the PS end of a connection
//!   ([`starwire_transport::Connection::handle_frame`]: the hello and
//!   auth parsers, the token check, reassembly and credits), driver
//!   `fuzz-handshake`.
//! * [`driver`] is what the drivers share: the command line, the
//!   mutate-run-keep loop, saving a failing input, the reports.
//!
//! The frame drivers are the `fuzz-decode` and `fuzz-deframe` binaries:
//!
//! ```text
//! cargo run --release -p starwire-wire-fuzz --bin fuzz-decode -- --seconds 60 --seed 1
//! cargo run --release -p starwire-wire-fuzz --bin fuzz-deframe -- --seconds 60 --seed 1
//! ```
//!
//! For cargo-fuzz / libFuzzer users (nightly, not built here), the same
//! targets are:
//!
//! ```text
//! // fuzz_targets/decode.rs
//! #![no_main]
//! libfuzzer_sys::fuzz_target!(|data: &[u8]| starwire_wire_fuzz::fuzz_one(data));
//!
//! // fuzz_targets/deframe.rs
//! #![no_main]
//! libfuzzer_sys::fuzz_target!(|data: &[u8]| {
//!     if let Err(e) = starwire_wire_fuzz::check_deframe(data) {
//!         panic!("{e}");
//!     }
//! });
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod checkpoint;
pub mod datagram;
pub mod driver;
pub mod endpoint;
pub mod handshake;
pub mod peak;
pub mod ps;
pub mod rdma_ring;
pub mod text;

use std::path::{Path, PathBuf};

use starwire_wire::{decode_any, DecodeSummary, FrameError, Limits};

mod decode;
mod deframe;
mod mutate;
pub mod udp;

pub use decode::Decode;
pub use deframe::{check_deframe, Deframe, DeframeOutcome, Feed};
pub use mutate::{Frames, Mutation, Mutator};
pub use udp::{Packets, Udp};

/// Limits used for half of the runs: small, so chunking and `Oversized`
/// are easy to reach.
pub const SMALL_LIMITS: Limits = Limits::new(256, 1 << 16);

/// Run the target on one input with both the default and the small limits.
pub fn fuzz_one(data: &[u8]) {
    let _ = decode_any(data, &Limits::default());
    let _ = decode_any(data, &SMALL_LIMITS);
}

/// Write `data` to `dir/name` (creating `dir`), reporting failures on
/// stderr: a driver that found a crash still exits with its status.
pub fn save_input(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("cannot create {}: {e}", dir.display());
    }
    let p = dir.join(name);
    if let Err(e) = std::fs::write(&p, data) {
        eprintln!("cannot write {}: {e}", p.display());
    }
    p
}

/// A short name for a framing error's kind (for statistics).
pub fn frame_error_kind(e: &FrameError) -> &'static str {
    match e {
        FrameError::Truncated { .. } => "Truncated",
        FrameError::BadMagic(_) => "BadMagic",
        FrameError::BadVersion(_) => "BadVersion",
        FrameError::UnknownOpcode(_) => "UnknownOpcode",
        FrameError::UnknownFlags(_) => "UnknownFlags",
        FrameError::Oversized { .. } => "Oversized",
        FrameError::BadLength(_) => "BadLength",
        FrameError::Malformed(_) => "Malformed",
        _ => "other",
    }
}

/// A cheap signature of an outcome, used as a novelty signal: inputs that
/// produce a signature not seen before join the corpus.
pub fn outcome_signature(r: &Result<DecodeSummary, FrameError>) -> u64 {
    match r {
        Ok(s) => {
            let frames = s.frames.min(3) as u64;
            let ok = u64::from(s.bodies_ok > 0);
            s.body_error_kinds ^ (frames << 56) ^ (ok << 60) ^ 1
        }
        Err(e) => {
            let k = match e {
                FrameError::BadLength(m) | FrameError::Malformed(m) => m.len() as u64,
                FrameError::Oversized { what, .. } => what.len() as u64,
                _ => 0,
            };
            (frame_error_kind(e).len() as u64) << 8 ^ k ^ (2 << 62)
        }
    }
}

pub mod seeds {
    //! Valid encoded inputs of every opcode.

    use starwire_wire::message::{AuthMsg, Hello, Role};
    use starwire_wire::ps::{
        put_f32s, write_push_response, Control, PullRequestWriter, PullResponseWriter,
        PushRequestWriter,
    };
    use starwire_wire::{
        tensors, ChunkPlan, DType, Flags, Frame, Header, Opcode, Status, TensorRef,
    };

    /// One single-frame message.
    pub fn frame(
        op: Opcode,
        flags: Flags,
        status: Status,
        request_id: u64,
        body: &[u8],
    ) -> Vec<u8> {
        let mut h = Header::new(op, request_id, body.len() as u32);
        h.flags = flags;
        h.status = status;
        let f = Frame { header: h, body };
        let mut out = vec![0; f.frame_len()];
        f.emit(&mut out);
        out
    }

    /// A message split into frames of at most `max_body` bytes of body.
    pub fn chunked(
        op: Opcode,
        flags: Flags,
        request_id: u64,
        body: &[u8],
        max_body: u32,
    ) -> Vec<u8> {
        let mut t = Header::new(op, request_id, 0);
        t.flags = flags;
        let mut out = Vec::new();
        for (h, r) in ChunkPlan::new(t, body.len() as u32, max_body) {
            let f = Frame {
                header: h,
                body: &body[r],
            };
            let start = out.len();
            out.resize(start + f.frame_len(), 0);
            f.emit(&mut out[start..]);
        }
        out
    }

    fn le<T: Copy>(v: &[T], f: fn(T) -> Vec<u8>) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    /// Encode a body with an `emit`-style closure.
    fn body(len: usize, emit: impl FnOnce(&mut [u8]) -> usize) -> Vec<u8> {
        let mut b = vec![0; len];
        let n = emit(&mut b);
        b.truncate(n);
        b
    }

    /// Message bodies of every kind, with the header they go with.
    pub fn messages() -> Vec<(Opcode, Flags, Status, Vec<u8>)> {
        let ids = le(&[3i64, 17, -1, 1 << 40], |x| x.to_le_bytes().to_vec());
        let rows = le(&[0.5f32; 8], |x| x.to_le_bytes().to_vec());
        let halfs = le(&[0x3c00u16, 0x8001, 0x7c00, 0x0400], |x| {
            x.to_le_bytes().to_vec()
        });
        let bytes: Vec<u8> = (0u8..13).collect();
        let ids_t = TensorRef::new(1, DType::I64, &[4], &ids).unwrap();
        let rows_t = TensorRef::new(0, DType::F32, &[4, 2], &rows).unwrap();
        let halfs_t = TensorRef::new(9, DType::F16, &[4, 1], &halfs).unwrap();
        let bf_t = TensorRef::new(9, DType::BF16, &[2, 2], &halfs).unwrap();
        let u8_t = TensorRef::new(2, DType::U8, &[13], &bytes).unwrap();
        let scalar_t = TensorRef::new(3, DType::F32, &[], &rows[..4]).unwrap();
        let empty_t = TensorRef::new(4, DType::F32, &[0, 1 << 20], &[]).unwrap();
        let dims8 = [1u64, 1, 1, 1, 1, 1, 1, 13];
        let rank8_t = TensorRef::new(5, DType::U8, &dims8, &bytes).unwrap();

        let hello = Hello {
            protocol_version: 2,
            flags: 0,
            role: Role::Worker,
            job_name: "worker-é",
            task_index: 3,
            incarnation: 0xdead_beef,
            initial_credits: 64,
            max_frame_len: 1 << 20,
            shard_count: 2,
            nonce: [0x5a; 16],
        };
        let auth = AuthMsg {
            proof: [0xa5; 32],
            config: "model=wdl\nembedding-dim=8\n",
        }
        .to_vec()
        .unwrap_or_default();
        let list = [
            ids_t, rows_t, halfs_t, bf_t, u8_t, scalar_t, empty_t, rank8_t,
        ];
        let keys = [3u64, 17, u64::MAX, 1 << 40];
        let mut pull = Vec::new();
        PullRequestWriter::new(&mut pull)
            .dense(5)
            .rows(11, &keys)
            .pooled(12, &[0, 1, 1, 4], &keys);
        let mut pulled = Vec::new();
        let mut w = PullResponseWriter::new(&mut pulled, 9);
        put_f32s(w.dense(5, 2), &[0.5, -1.0]);
        put_f32s(w.rows(11, 2, 4), &[0.25; 8]);
        put_f32s(w.pooled(12, 2, 3), &[1.5; 6]);
        let mut push = Vec::new();
        PushRequestWriter::new(&mut push, true)
            .dense(5, &[0.1, 0.2])
            .rows(11, 2, &keys, &[0.01; 8])
            .pooled(12, 2, &[0, 1, 1, 4], &keys, &[0.5; 6]);
        let mut pushed = Vec::new();
        write_push_response(&mut pushed, 10);
        let none = Flags::NONE;
        let resp = Flags::RESPONSE;
        let ok = Status::Ok;
        vec![
            (
                Opcode::Hello,
                none,
                ok,
                body(hello.encoded_len(), |o| hello.emit(o)),
            ),
            (Opcode::Auth, none, ok, auth),
            (Opcode::Credit, none, ok, vec![]),
            (Opcode::Cancel, none, ok, vec![]),
            (Opcode::Goodbye, none, ok, vec![]),
            (Opcode::Ping, none, ok, vec![]),
            (Opcode::Rpc, none, ok, Control::WaitStep(7).encode()),
            (
                Opcode::Rpc,
                none,
                ok,
                Control::Checkpoint("/ckpt/é").encode(),
            ),
            (Opcode::Rpc, none, ok, Control::Stats.encode()),
            (Opcode::Rpc, none, ok, Control::Done.encode()),
            (Opcode::Rpc, resp, ok, 7u64.to_le_bytes().to_vec()),
            (
                Opcode::Tensors,
                Flags::ONEWAY,
                ok,
                body(tensors::encoded_len(&list), |o| tensors::emit(&list, o)),
            ),
            (Opcode::SparsePull, none, ok, pull),
            (Opcode::SparsePull, resp, ok, pulled),
            (Opcode::SparsePush, none, ok, push),
            (Opcode::SparsePush, resp, ok, pushed),
            (Opcode::DensePull, none, ok, bytes.clone()),
            (Opcode::DensePush, resp, ok, vec![]),
            (
                Opcode::SparsePull,
                resp,
                Status::WrongShape,
                b"ids must be I64".to_vec(),
            ),
            (Opcode::DensePull, resp, Status::UnknownVariable, vec![]),
        ]
    }

    /// The seed corpus: every message as a single frame, the larger ones
    /// chunked, and a few multi-frame streams.
    pub fn corpus() -> Vec<Vec<u8>> {
        let msgs = messages();
        let mut out = Vec::new();
        let mut stream = Vec::new();
        for (i, (op, flags, status, b)) in msgs.iter().enumerate() {
            let f = frame(*op, *flags, *status, i as u64 + 1, b);
            stream.extend_from_slice(&f);
            out.push(f);
            if !op.is_control() && b.len() > 48 && *status == Status::Ok {
                out.push(chunked(*op, *flags, i as u64 + 100, b, 48));
                out.push(chunked(*op, *flags, i as u64 + 200, b, 7));
            }
        }
        // a chunked message with control frames interleaved
        let Some((op, flags, _, b)) = msgs.iter().find(|m| m.0 == Opcode::Tensors) else {
            return out;
        };
        let c = chunked(*op, *flags, 999, b, 64);
        let ping = frame(Opcode::Ping, Flags::NONE, Status::Ok, 0, &[]);
        let mut inter = Vec::new();
        let mut rest = &c[..];
        while let Ok((f, used)) = Frame::parse(rest, &starwire_wire::Limits::default()) {
            let _ = f;
            inter.extend_from_slice(&rest[..used]);
            inter.extend_from_slice(&ping);
            rest = &rest[used..];
        }
        out.push(inter);
        out.push(stream);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_decode_cleanly() {
        for (i, s) in seeds::corpus().iter().enumerate() {
            let r = decode_any(s, &Limits::default()).unwrap_or_else(|e| panic!("seed {i}: {e}"));
            assert_eq!(r.body_errors, 0, "seed {i}");
            assert!(r.bodies_ok >= 1, "seed {i}");
        }
    }

    #[test]
    fn short_run_does_not_panic() {
        let corpus = seeds::corpus();
        let mut m = Mutator::<Frames>::new(7, 1 << 16);
        for i in 0..20_000 {
            let mut d = corpus[i % corpus.len()].clone();
            m.mutate(&mut d, &corpus);
            fuzz_one(&d);
        }
    }
}

//! `fuzz-rdma-ring`: a mutation fuzzer for the receive path of the RDMA
//! backend's ring protocol (`starwire_rdma::RingConn` under an
//! `RdmaDriver`, over the crate's simulated NICs) that runs on the stable
//! toolchain.
//!
//! ```text
//! fuzz-rdma-ring [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]
//! ```
//!
//! It mutates scripts of what a peer does to one connection (frames written
//! into its ring, honest or with lying immediates, forged writes anywhere,
//! honest and forged credit messages, before and after the connection
//! starts) interleaved with the connection's receive passes, sends and
//! flushes, and checks the connection against a model of the protocol:
//! nothing may panic, every frame lent must be the ring bytes at the offset
//! the protocol gives it, every violation must end the connection with a
//! typed `RingFault` after which nothing is lent, and the counters and
//! credits must agree with what happened. A failing input is saved to
//! `OUT/rdma-ring-<seed>-<iter>.bin` and the driver exits with status 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::driver;
use starwire_wire_fuzz::rdma_ring::RdmaRing;

fn main() -> ExitCode {
    driver::main(RdmaRing::default())
}

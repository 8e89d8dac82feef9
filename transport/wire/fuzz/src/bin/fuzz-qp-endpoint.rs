//! `fuzz-qp-endpoint`: a mutation fuzzer for the RDMA side-channel
//! message parser (`starwire_rdma::QpEndpoint::parse`) that runs on the
//! stable toolchain.
//!
//! ```text
//! fuzz-qp-endpoint [--seconds N | --iters N] [--seed S] [--replay FILE]
//! ```
//!
//! A panic, or an accepted message that does not encode back to its own
//! bytes, writes the input to `corpus-out/qp-endpoint/crash-<seed>-<iter>.bin`
//! in this crate and exits with status 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::driver;
use starwire_wire_fuzz::endpoint::Endpoint;

fn main() -> ExitCode {
    driver::main(Endpoint::default())
}

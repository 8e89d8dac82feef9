//! `fuzz-handshake`: a mutation fuzzer for the PS end of a connection's
//! receive path (`Connection::handle_frame`: the hello and auth parsers,
//! the cluster-token check, credits and reassembly) that runs on the
//! stable toolchain.
//!
//! ```text
//! fuzz-handshake [--seconds N | --iters N] [--seed S] [--corpus DIR]
//!                [--out DIR] [--max-len N] [--save-corpus] [--replay FILE]
//! ```
//!
//! Half the runs give the connection a cluster token: then no message may
//! ever be delivered and the handshake never complete (the input cannot
//! hold a proof of the run's fresh nonce). A panic or a broken oracle
//! writes the input to `OUT/handshake-<seed>-<iter>.bin` and exits 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::{driver, handshake::Handshake};

fn main() -> ExitCode {
    driver::main(Handshake::default())
}

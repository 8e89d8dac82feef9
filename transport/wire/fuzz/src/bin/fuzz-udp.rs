//! `fuzz-udp`: a mutation fuzzer for the DPDK backend's Ethernet/IPv4/UDP
//! parser (`starwire_datagram::udp`) that runs on the stable toolchain.
//!
//! ```text
//! fuzz-udp [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]
//! ```
//!
//! It mutates well-formed packets (header fields, lengths, truncation,
//! the IPv4 checksum fixed up), checks that the parser never panics, that
//! the receive filter agrees with it, and that an accepted packet emits
//! back to itself. A failing input is saved to `OUT/udp-<seed>-<iter>.bin`
//! and the driver exits with status 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::{driver, Udp};

fn main() -> ExitCode {
    driver::main(Udp::default())
}

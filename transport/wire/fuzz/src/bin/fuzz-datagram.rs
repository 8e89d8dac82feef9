//! `fuzz-datagram`: a mutation fuzzer for the DPDK backend's
//! reliable-datagram protocol (`starwire_datagram`: the packet decoder and
//! `ReliableCore::handle_packet`) that runs on the stable toolchain.
//!
//! ```text
//! fuzz-datagram [--seconds N | --iters N] [--seed S] [--out DIR] [--replay FILE]
//! ```
//!
//! It mutates the packets two cores send each other (header fields,
//! sequence numbers and acknowledgements near the window's edges, SACK
//! bits, lengths, the checksum written again), checks the decoder against
//! the format, then hands each packet to one end of a connection in one of
//! a few states and lets the two ends finish their exchange: nothing may
//! panic, the core's counters and state must move as the packet allows,
//! each end must deliver only its peer's frames, in order, once, and a
//! benign packet must leave a connection that completes. A failing input
//! is saved to `OUT/datagram-<seed>-<iter>.bin` and the driver exits with
//! status 1.
#![deny(unsafe_code)]

use std::process::ExitCode;

use starwire_wire_fuzz::datagram::Datagram;
use starwire_wire_fuzz::driver;

fn main() -> ExitCode {
    driver::main(Datagram::default())
}

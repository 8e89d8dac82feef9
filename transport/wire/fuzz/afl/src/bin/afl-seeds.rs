//! Write every target's built-in seeds to `DIR/<target>/` (one file each):
//! the starting corpus of a target whose corpus in the repository is
//! empty (see ci/fuzz-afl.sh).
//!
//! ```text
//! afl-seeds DIR
//! ```
#![deny(unsafe_code)]

use std::path::Path;
use std::process::ExitCode;

use starwire_wire_fuzz::checkpoint::Checkpoint;
use starwire_wire_fuzz::datagram::Datagram;
use starwire_wire_fuzz::driver::Target;
use starwire_wire_fuzz::endpoint::Endpoint;
use starwire_wire_fuzz::handshake::Handshake;
use starwire_wire_fuzz::ps::Handlers;
use starwire_wire_fuzz::rdma_ring::RdmaRing;
use starwire_wire_fuzz::text::Text;
use starwire_wire_fuzz::{Decode, Deframe, Udp};

fn write<T: Target>(t: &T, dir: &Path) -> std::io::Result<usize> {
    let name = T::SPEC.name.trim_start_matches("fuzz-");
    let d = dir.join(name);
    std::fs::create_dir_all(&d)?;
    let seeds = t.seeds();
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(d.join(format!("seed-{i:03}")), s)?;
    }
    Ok(seeds.len())
}

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: afl-seeds DIR");
        return ExitCode::from(2);
    };
    let dir = Path::new(&dir);
    let written = [
        write(&Decode::default(), dir),
        write(&Deframe::default(), dir),
        write(&Handshake::default(), dir),
        write(&Handlers::default(), dir),
        write(&Udp::default(), dir),
        write(&Endpoint::default(), dir),
        write(&Checkpoint::default(), dir),
        write(&RdmaRing::default(), dir),
        write(&Datagram::default(), dir),
        write(&Text::default(), dir),
    ];
    for r in written {
        if let Err(e) = r {
            eprintln!("afl-seeds: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

#!/usr/bin/env bash
# Fuzz smoke runs on the stable toolchain, all from starwire-wire-fuzz: the
# frame and body decoder, the stream deframer against a reference, the PS
# pull/push codec through the shard's request handlers, then the DPDK
# backend's Ethernet/IPv4/UDP parser. SECONDS is split between them.
# Usage: ci/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
third=$(( secs / 3 > 0 ? secs / 3 : 1 ))
# The UDP parser is small: a sixth of the time, taken from the others.
udp=$(( third / 2 > 0 ? third / 2 : 1 ))
third=$(( (secs - udp) / 3 > 0 ? (secs - udp) / 3 : 1 ))
seed="${FUZZ_SEED:-$(date +%s)}"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-decode -- --seconds "$third" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-deframe -- --seconds "$third" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-ps-proto -- --seconds "$third" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-udp -- --seconds "$udp" --seed "$seed"

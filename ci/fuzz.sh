#!/usr/bin/env bash
# Fuzz smoke runs on the stable toolchain, all from starwire-wire-fuzz: the
# frame and body decoder, the stream deframer against a reference, then the
# PS pull/push codec through the shard's request handlers. SECONDS is split
# between them; then 5 s of the RDMA side-channel message parser.
# Usage: ci/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
third=$(( secs / 3 > 0 ? secs / 3 : 1 ))
seed="${FUZZ_SEED:-$(date +%s)}"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-decode -- --seconds "$third" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-deframe -- --seconds "$third" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-ps-proto -- --seconds "$third" --seed "$seed"
# The RDMA side-channel message is 64 bytes: a few seconds cover it.
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-qp-endpoint -- --seconds 5 --seed "$seed"

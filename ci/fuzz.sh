#!/usr/bin/env bash
# Fuzz smoke runs on the stable toolchain, both from starwire-wire-fuzz: the
# frame and body decoder, then the PS pull/push codec through the shard's
# request handlers. SECONDS is split between them.
# Usage: ci/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
half=$(( secs / 2 > 0 ? secs / 2 : 1 ))
seed="${FUZZ_SEED:-$(date +%s)}"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-decode -- --seconds "$half" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-ps-proto -- --seconds "$half" --seed "$seed"

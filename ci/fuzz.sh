#!/usr/bin/env bash
# A fuzz smoke run of the frame decoder on the stable toolchain.
# Usage: ci/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-decode -- --seconds "$secs" --seed "${FUZZ_SEED:-$(date +%s)}"

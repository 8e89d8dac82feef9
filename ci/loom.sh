#!/usr/bin/env bash
# Model-check the M:N queue (including park/wake) with loom.
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="--cfg loom ${RUSTFLAGS:-}" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom" \
    cargo test -p starwire-queue --release --test loom --locked -- --test-threads=2

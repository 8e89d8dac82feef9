#!/usr/bin/env bash
# Fuzz smoke runs on the stable toolchain, all from starwire-wire-fuzz: the
# frame and body decoder, the stream deframer against a reference, the PS
# end of a connection's handshake (hello, auth, the cluster-token check),
# the PS pull/push codec through the shard's request handlers, the PS
# checkpoint readers (shard files, deltas, manifests and worker
# positions), then the DPDK backend's Ethernet/IPv4/UDP parser and its
# bootstrap hello line. SECONDS is
# split between them; then 5 s each of the RDMA side-channel message
# parser, the reliable-datagram protocol (its packet decoder and a
# ReliableCore's packet handling), the text parsers of user and peer input
# (host:port, .endpoint_map, TF_CONFIG, the DeepRec settings variables,
# the Criteo reader, plain and gzip) and the RDMA ring protocol's receive
# path (RingConn under an RdmaDriver over simulated NICs, against a
# scripted peer's frames, immediates and credits).
# Usage: ci/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
share=$(( secs / 5 > 0 ? secs / 5 : 1 ))
# The UDP parser is small: half a share, taken from the others.
udp=$(( share / 2 > 0 ? share / 2 : 1 ))
share=$(( (secs - udp) / 5 > 0 ? (secs - udp) / 5 : 1 ))
seed="${FUZZ_SEED:-$(date +%s)}"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-decode -- --seconds "$share" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-deframe -- --seconds "$share" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-handshake -- --seconds "$share" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-ps-proto -- --seconds "$share" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-checkpoint -- --seconds "$share" --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-udp -- --seconds "$udp" --seed "$seed"
# The RDMA side-channel message is 64 bytes: a few seconds cover it.
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-qp-endpoint -- --seconds 5 --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-datagram -- --seconds 5 --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-text -- --seconds 5 --seed "$seed"
cargo run --release --locked -p starwire-wire-fuzz --bin fuzz-rdma-ring -- --seconds 5 --seed "$seed"

#!/usr/bin/env bash
# Coverage-guided fuzzing with AFL++ (cargo-afl, stable toolchain) of the
# starwire-wire-fuzz targets: each target's one-input body
# (Target::check) under the drivers of transport/wire/fuzz/afl. Not run in
# CI (CI replays the corpus: cargo test -p starwire-wire-fuzz --test corpus).
#
# Usage: ci/fuzz-afl.sh [SECONDS] [TARGET...]
#   SECONDS  per target (default 180); TARGET among decode deframe
#            handshake ps-proto udp qp-endpoint checkpoint rdma-ring
#            datagram text (default: all).
# Environment: FUZZ_EXECS=N stops a target after N executions if that
# comes before SECONDS (the issue's "20 minutes or 10 million executions":
# FUZZ_EXECS=10000000 ci/fuzz-afl.sh 1200); FUZZ_OUT (default
# target/afl), UPDATE_CORPUS=1 to replace
# transport/wire/fuzz/corpus/TARGET with the run's queue entries that found
# new edges, smallest first, up to CORPUS_KB (default 40) KiB a target.
#
# Each target runs on one core without binding it (AFL_NO_AFFINITY), one
# after another, and prints one JSON line from AFL++'s fuzzer_stats:
#   {"target":..,"seconds":..,"execs_per_sec":..,"execs":..,
#    "corpus_count":..,"edges_found":..,"crashes":..,"hangs":..}
# Crashing inputs stay in $AFL_OUT/TARGET/default/crashes; replay one with
# the stable driver: cargo run -p starwire-wire-fuzz --bin fuzz-TARGET --
# --replay FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
secs="${1:-180}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(decode deframe handshake ps-proto udp qp-endpoint checkpoint rdma-ring datagram text)
fi
out="${FUZZ_OUT:-$root/target/afl}"

if ! cargo afl --version >/dev/null 2>&1; then
    cargo install cargo-afl --locked
fi
# Builds AFL++ once per toolchain; it says so when it is built already.
if ! msg=$(cargo afl config --build 2>&1) && ! grep -q "already built" <<<"$msg"; then
    echo "$msg" >&2
    exit 1
fi
(cd transport/wire/fuzz/afl && cargo afl build --release --locked)
bin="$root/transport/wire/fuzz/afl/target/release"
corpus="$root/transport/wire/fuzz/corpus"

# The queue's entries that found new edges (and the starting ones),
# smallest first, within the budget; named by content hash so the same
# queue makes the same files. (afl-cmin finds no tuples in the afl.rs
# drivers' persistent, shared-memory mode.)
update_corpus() {
    local t=$1 q="$out/$1/default/queue" budget=$(( ${CORPUS_KB:-40} * 1024 )) total=0 f size
    rm -rf "${corpus:?}/$t"
    mkdir -p "$corpus/$t"
    for f in $(ls -Sr "$q" | grep -E '\+cov|orig'); do
        size=$(stat -c %s "$q/$f")
        [ $((total + size)) -gt "$budget" ] && break
        cp "$q/$f" "$corpus/$t/$(sha1sum "$q/$f" | cut -c1-16)"
        total=$((total + size))
    done
}

export AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_SKIP_CPUFREQ=1 AFL_QUIET=1
export AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
mkdir -p "$out"
for t in "${targets[@]}"; do
    in="$corpus/$t"
    if [ -z "$(ls -A "$in" 2>/dev/null)" ]; then
        "$bin/afl-seeds" "$out/seeds"
        in="$out/seeds/$t"
    fi
    rm -rf "${out:?}/$t"
    cargo afl fuzz -V "$secs" ${FUZZ_EXECS:+-E "$FUZZ_EXECS"} -i "$in" -o "$out/$t" -- "$bin/afl-$t" >"$out/$t.log" 2>&1 || {
        echo "afl-fuzz failed for $t: see $out/$t.log" >&2
        exit 1
    }
    stats="$out/$t/default/fuzzer_stats"
    get() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$stats"; }
    printf '{"target":"%s","seconds":%s,"execs_per_sec":%s,"execs":%s,"corpus_count":%s,"edges_found":%s,"crashes":%s,"hangs":%s}\n' \
        "$t" "$(get run_time)" "$(get execs_per_sec)" "$(get execs_done)" \
        "$(get corpus_count)" "$(get edges_found)" "$(get saved_crashes)" "$(get saved_hangs)"
    if [ "${UPDATE_CORPUS:-0}" = 1 ]; then
        update_corpus "$t"
    fi
done

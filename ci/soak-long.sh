#!/usr/bin/env bash
# The long soak: 10 minutes, 256 connections, over tcp (and uring where
# io_uring is allowed). Not run by CI, which keeps its short soak
# (ci/test.sh); run it before a release or after a change to a session
# or driver. Each run fails on any lost, duplicated, corrupted or
# reordered message, a failed connection, or RSS growing by more than
# max(5 %, 16 MiB) between 25 % and 100 % of the run; its --json line
# has the figures (messages, lost, duplicated, corrupted, rss_quarter_kb,
# rss_full_kb).
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_LONG="${SOAK_LONG_SECONDS:-600}"
CONNECTIONS="${SOAK_LONG_CONNECTIONS:-256}"
BACKENDS="${SOAK_LONG_BACKENDS:-tcp uring}"

cargo build --release --locked -p starwire --features uring
status=0
for b in $BACKENDS; do
    # grep the whole output: `grep -q` leaving early would break info's
    # pipe and, under pipefail, read as io_uring missing.
    if [ "$b" = uring ] && ! grep -Eq "^ *uring .*usable" <<<"$(./target/release/starwire info)"; then
        echo "=== soak-long: uring skipped: io_uring is not available here"
        continue
    fi
    echo "=== soak-long: $b, $CONNECTIONS connections, $SECONDS_LONG s"
    if ! ./target/release/starwire soak --backend "$b" --connections "$CONNECTIONS" \
        --duration "$SECONDS_LONG" --json; then
        echo "=== soak-long: $b FAILED" >&2
        status=1
    fi
done
exit "$status"

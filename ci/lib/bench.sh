# Sourced by ci/dpdk-netns.sh, ci/dpdk-figures.sh and ci/dpdk-ceiling.sh:
# the server end of a two-process bench.
#
# bench_serve NS ADDR LOG ARGS... starts `$BIN bench --listen ADDR
# --one-off ARGS...` in namespace NS in the background, its output in LOG,
# sets BENCH_SERVER to its pid and returns once it waits for a client (or
# after 10 s; the client's connection then fails and says why). The caller
# runs the client and then `wait "$BENCH_SERVER"`.

bench_serve() { # NS ADDR LOG ARGS...
    local ns=$1 addr=$2 log=$3
    shift 3
    ip netns exec "$ns" timeout 180 "$BIN" bench --listen "$addr" --one-off "$@" >"$log" 2>&1 &
    BENCH_SERVER=$!
    for _ in $(seq 100); do
        grep -qs "waiting for a client" "$log" && return 0
        sleep 0.1
    done
}

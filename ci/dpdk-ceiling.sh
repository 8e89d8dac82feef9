#!/usr/bin/env bash
# starwire's packet rate against the ceiling of the same path, both
# measured on one veth pair whose two ends are in one network namespace
# (not run by CI): a testpmd process opens interfaces of its own namespace
# only, so this is the set-up where one testpmd can forward between both
# ends, as the issue's ceiling wants.
#   * starwire: `bench --listen` on one end and `bench --connect --backends
#     dpdk --mode rate --sizes 64 --inflight 32` on the other, two
#     processes in the namespace (control over its loopback), client
#     reactor on core 0, server reactor on core 1, once for each setting
#     of $POLLING (default "on"): `on` busy-polling reactors (`--polling
#     on`), `off` reactors that nap between polls when idle (`--polling
#     off`), a number N reactors that poll N us after their last work and
#     then nap (`--polling on`, the script sets STARWIRE_IDLE_POLL_US=N
#     for both processes); pps: packets received per second by both
#     ends' drivers, data and acknowledgements;
#   * testpmd: `dpdk-testpmd -l 0,1 --vdev=<one end> --vdev=<the other>
#     -- --total-num-mbufs=8192 --nb-cores=1 --forward-mode=io
#     --tx-first`, both ports in one process; Rx-pps summed over both
#     ports each second, the median of the reports after the first two.
# For net_af_xdp and net_af_packet, starwire (each polling setting) and
# testpmd alternated ROUNDS times; prints one JSON line per measurement and
# the ratio of the medians per polling setting. Needs root.
# DRIVERS (default "af_xdp af_packet") picks the drivers.
# XDP_DEVARGS (default empty) is appended to both net_af_xdp devices, the
# same for starwire and testpmd, e.g. XDP_DEVARGS=",busy_budget=0".
# The namespace is $STARWIRE_NETNS_PREFIX (default swc) plus the pid.
# Usage: [STARWIRE_NETNS_PREFIX=swc] [ROUNDS=2] [DURATION=3] [TESTPMD_SECS=8]
#        [POLLING=on] [DRIVERS="af_xdp af_packet"] [XDP_DEVARGS=]
#        [PROFILE=release] ci/dpdk-ceiling.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=ci/lib/figures.sh
. ci/lib/figures.sh
figures_setup ci/dpdk-ceiling.sh
# shellcheck source=ci/lib/bench.sh
. ci/lib/bench.sh
tag="${STARWIRE_NETNS_PREFIX:-swc}$$"
ROUNDS="${ROUNDS:-2}"
XDP_DEVARGS="${XDP_DEVARGS:-}"
DRIVERS="${DRIVERS:-af_xdp af_packet}"
POLLING="${POLLING:-on}"
netns_one "$tag"

# The median (of an even count, the mean of the two middle values).
median() {
    sort -n | awk '{v[NR]=$1} END {
        if (!NR) print 0; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2 }'
}

port=19100
# starwire's pps over the pair: `starwire_pps VDEV_A VDEV_B SETTING`, the
# setting one of $POLLING's.
starwire_pps() {
    port=$((port + 1))
    # Both processes read STARWIRE_IDLE_POLL_US (each end's reactor).
    local polling=$3
    unset STARWIRE_IDLE_POLL_US
    case $3 in on | off) ;; *) polling=on && export STARWIRE_IDLE_POLL_US=$3 ;; esac
    bench_serve "$NS_S" "127.0.0.1:$port" "$LOG_DIR/server.log" \
        --eal "$EAL --vdev=$1" --dpdk-ip 10.97.2.1
    ip netns exec "$NS_S" timeout 120 "$BIN" bench --connect "127.0.0.1:$port" \
        --backends dpdk --mode rate --sizes 64 --inflight 32 --cores 0,1 --polling "$polling" \
        --duration "$DURATION" --eal "$EAL --vdev=$2" --dpdk-ip 10.97.2.2 --json \
        >"$LOG_DIR/client.json" 2>"$LOG_DIR/client.log" || true
    wait "$BENCH_SERVER" || true
    unset STARWIRE_IDLE_POLL_US
    grep -o '"pps":[0-9.e+-]*' "$LOG_DIR/client.json" | head -1 | cut -d: -f2
}

# testpmd's Rx-pps over both ports of one process: `testpmd_pps VDEV_A VDEV_B`.
testpmd_pps() {
    (sleep "$TESTPMD_SECS" | ip netns exec "$NS_S" timeout $((TESTPMD_SECS + 30)) \
        dpdk-testpmd -l 0,1 $EAL --file-prefix "${tag}tp" --vdev="$1" --vdev="$2" -- \
        --total-num-mbufs=8192 --nb-cores=1 --forward-mode=io --tx-first \
        --stats-period 1 >"$LOG_DIR/testpmd.log" 2>&1) || true
    # Each report lists port 0 then port 1: sum them pairwise.
    grep -o 'Rx-pps: *[0-9]*' "$LOG_DIR/testpmd.log" | awk '{print $2}' |
        paste - - | awk '{print $1 + $2}' | tail -n +3 | median
}

for driver in $DRIVERS; do
    case $driver in
        af_packet)
            vdev_a="net_af_packet0,iface=$SA"
            vdev_b="net_af_packet1,iface=$SB"
            ;;
        af_xdp)
            vdev_a="net_af_xdp0,iface=$SA,start_queue=0,queue_count=1$XDP_DEVARGS"
            vdev_b="net_af_xdp1,iface=$SB,start_queue=0,queue_count=1$XDP_DEVARGS"
            ;;
    esac
    tp=()
    declare -A sw=()
    for round in $(seq "$ROUNDS"); do
        line="{\"figure\":\"ceiling\",\"driver\":\"$driver\",\"round\":$round"
        for p in $POLLING; do
            s=$(starwire_pps "$vdev_a" "$vdev_b" "$p")
            line="$line,\"starwire_pps_polling_$p\":${s:-null}"
            sw[$p]="${sw[$p]:-} ${s:-0}"
        done
        t=$(testpmd_pps "$vdev_a" "$vdev_b")
        echo "$line,\"testpmd_rx_pps\":${t:-null}}"
        tp+=("${t:-0}")
    done
    t=$(printf '%s\n' "${tp[@]}" | median)
    for p in $POLLING; do
        # shellcheck disable=SC2086
        s=$(printf '%s\n' ${sw[$p]} | median)
        echo "{\"figure\":\"ceiling-ratio\",\"driver\":\"$driver\",\"polling\":\"$p\",\"xdp_devargs\":\"$XDP_DEVARGS\",\"starwire_pps\":$s,\"testpmd_rx_pps\":$t,\"ratio\":$(awk -v s="$s" -v t="$t" 'BEGIN {if (t > 0) printf "%.3f", s / t; else print "null"}'),\"load\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
    done
    unset sw
done

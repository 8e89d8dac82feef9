#!/usr/bin/env bash
# The DPDK figures of docs/backends/dpdk.md ("Measured"), in one run on
# one pair of network namespaces (not run by CI):
#   * dpdk over net_af_xdp and over net_af_packet against the tcp backend:
#     round trip p50/p99 at 64 B, rate at 4 KiB x 32 in flight, bandwidth
#     at 1 MiB; two-process bench (`--listen` in A, `--connect` in B),
#     client reactor on core 0, server reactor on core 1, polling on, the
#     backends alternated --repeat times (medians reported);
#   * dpdk's packet rate (`bench --backends dpdk --mode rate --sizes 64
#     --inflight 32`, pps: packets received per second over both ends,
#     data and acknowledgements) against the ceiling of the path:
#     dpdk-testpmd io-forwarding with --tx-first, one process in each
#     namespace on the same vdev (forwarding lcore 1 in A, 0 in B), its
#     Rx-pps summed over both ends.
# The namespaces come from ci/lib/netns.sh, as dpdk-netns.sh's do.
# The DPDK ports take vA/vB (no kernel address); tcp, the control and the
# bootstrap connections run over cA/cB, a second veth pair of the same
# kind between the same namespaces (a DPDK port's interface carries no
# kernel traffic).
# Prints one JSON line per result and a ratio summary. Needs root.
# Namespaces and interfaces are named $STARWIRE_NETNS_PREFIX (default
# swf) plus the pid. The machine's load skews every figure: read ratios.
# Usage: [STARWIRE_NETNS_PREFIX=swf] [REPEAT=3] [DURATION=3]
#        [TESTPMD_SECS=8] [PROFILE=release] ci/dpdk-figures.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=ci/lib/figures.sh
. ci/lib/figures.sh
figures_setup ci/dpdk-figures.sh
# shellcheck source=ci/lib/bench.sh
. ci/lib/bench.sh
tag="${STARWIRE_NETNS_PREFIX:-swf}$$"
REPEAT="${REPEAT:-3}"
STARWIRE_CLUSTER_TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
export STARWIRE_CLUSTER_TOKEN

netns_up "$tag" 10.98

port=18900
# One two-process bench: `bench_pair NAME VDEV_A VDEV_B ARGS...`; the rows
# go to $LOG_DIR/NAME.json.
bench_pair() {
    local name=$1 vdev_a=$2 vdev_b=$3
    shift 3
    port=$((port + 1))
    bench_serve "$NS_A" "$CTL_A:$port" "$LOG_DIR/$name-server.log" \
        --eal "$EAL --vdev=$vdev_a" --dpdk-ip "$DPDK_A"
    local rc=0
    ip netns exec "$NS_B" timeout 180 "$BIN" bench --connect "$CTL_A:$port" \
        --eal "$EAL --vdev=$vdev_b" --dpdk-ip "$DPDK_B" \
        --cores 0,1 --polling on --repeat "$REPEAT" --duration "$DURATION" --json "$@" \
        >"$LOG_DIR/$name.json" 2>"$LOG_DIR/$name.log" || rc=1
    wait "$BENCH_SERVER" || rc=1
    if [ "$rc" != 0 ]; then
        tail -n 5 "$LOG_DIR/$name-server.log" "$LOG_DIR/$name.log" >&2 || true
    fi
    return $rc
}

# A field of the row of BACKEND in FILE.
field() { # file backend field
    grep "\"backend\":\"$2\"" "$1" | head -1 | grep -o "\"$3\":[0-9.e+-]*" | cut -d: -f2
}

# testpmd io-forwarding with --tx-first in each namespace on the same
# vdev; prints the Rx-pps of both ends summed (median of its per-second
# reports, the first two left out).
testpmd_pps() { # vdev_a vdev_b
    local ends=("$NS_A 0,1 $1" "$NS_B 1,0 $2") pids=() i=0
    for e in "${ends[@]}"; do
        set -- $e
        # Fed from a pipe it runs until the pipe closes (from /dev/null it
        # stops after one burst).
        (sleep "$TESTPMD_SECS" | ip netns exec "$1" timeout $((TESTPMD_SECS + 30)) \
            dpdk-testpmd -l "$2" $EAL --file-prefix "${tag}tp$i" --vdev="$3" -- \
            --total-num-mbufs=8192 --nb-cores=1 --forward-mode=io --tx-first \
            --stats-period 1 >"$LOG_DIR/testpmd-$i.log" 2>&1) &
        pids+=($!)
        i=$((i + 1))
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    local total=0
    for i in 0 1; do
        local pps
        pps=$(grep -o 'Rx-pps: *[0-9]*' "$LOG_DIR/testpmd-$i.log" | awk '{print $2}' |
            tail -n +3 | sort -n | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]; else print 0}')
        total=$((total + pps))
    done
    echo "$total"
}

summary=()
for driver in af_xdp af_packet; do
    case $driver in
        af_packet)
            vdev_a="net_af_packet0,iface=$VA"
            vdev_b="net_af_packet0,iface=$VB"
            ;;
        af_xdp)
            vdev_a="net_af_xdp0,iface=$VA,start_queue=0,queue_count=1"
            vdev_b="net_af_xdp0,iface=$VB,start_queue=0,queue_count=1"
            ;;
    esac
    for run in "lat --sizes 64" "rate --sizes 4096 --inflight 32" "bw --sizes 1048576" \
        "pps --sizes 64 --inflight 32"; do
        set -- $run
        what=$1
        shift
        mode=$what backends=tcp,dpdk
        if [ "$what" = pps ]; then mode=rate backends=dpdk; fi
        name="$driver-$what"
        if ! bench_pair "$name" "$vdev_a" "$vdev_b" --backends "$backends" --mode "$mode" "$@"; then
            echo "{\"figure\":\"$what\",\"driver\":\"$driver\",\"error\":true}"
            continue
        fi
        while read -r row; do
            [ -n "$row" ] && echo "{\"figure\":\"$what\",\"driver\":\"$driver\",\"row\":$row}"
        done <"$LOG_DIR/$name.json"
        f="$LOG_DIR/$name.json"
        case $what in
            lat)
                summary+=("$driver lat p50 tcp/dpdk $(field "$f" tcp p50_us)/$(field "$f" dpdk p50_us) us, p99 $(field "$f" tcp p99_us)/$(field "$f" dpdk p99_us) us")
                ;;
            rate)
                summary+=("$driver rate 4KiBx32 dpdk/tcp $(awk -v d="$(field "$f" dpdk msgs_per_s)" -v t="$(field "$f" tcp msgs_per_s)" 'BEGIN {printf "%.2f", d / t}')")
                ;;
            bw)
                summary+=("$driver bw 1MiB dpdk/tcp $(awk -v d="$(field "$f" dpdk gbps)" -v t="$(field "$f" tcp gbps)" 'BEGIN {printf "%.2f", d / t}')")
                ;;
            pps)
                sw=$(field "$f" dpdk pps)
                tp=$(testpmd_pps "$vdev_a" "$vdev_b")
                echo "{\"figure\":\"testpmd\",\"driver\":\"$driver\",\"rx_pps_both_ends\":$tp}"
                summary+=("$driver pps starwire/testpmd ${sw%.*}/$tp = $(awk -v s="$sw" -v t="$tp" 'BEGIN {if (t > 0) printf "%.2f", s / t; else print "n/a"}')")
                ;;
        esac
    done
done

echo "--- ratios (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
for s in "${summary[@]}"; do echo "$s"; done

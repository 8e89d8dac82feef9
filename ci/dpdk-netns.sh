#!/usr/bin/env bash
# The DPDK backend between two network namespaces, over real DPDK ports:
# two veth pairs join namespace A and namespace B, vA/vB for the DPDK
# ports (no kernel address on a DPDK side) and cA/cB with addresses for
# the TCP control and bootstrap connections. For each poll-mode driver,
# net_af_packet and net_af_xdp:
#   * a two-process bench: `bench --listen` in A, `bench --connect
#     --backends dpdk --mode lat,rate` in B, each with its own EAL and port;
#   * a two-process soak: `soak --listen` in A, `soak --connect` in B
#     (each prints its report; both must pass: 0 lost, duplicated,
#     corrupted, out of order, failed);
#   * the kernel-UDP check: a Linux UDP socket in B (vB gets an address
#     for it, and no neighbour entry: the DpdkLink answers the kernel's
#     ARP request) exchanges datagrams with a DpdkLink in A, so the kernel
#     checks our IPv4/UDP headers and checksums
#     (backends/dpdk/tests/kernel_peer.rs);
#   * `starwire info` on a net_af_packet port with two queue pairs: the
#     steering it would get (software: no rte_flow);
#   * a net_tap port with two queue pairs in A: kernel UDP sockets on the
#     tap send to two links, each gets its own datagrams, steered by
#     rte_flow where the kernel has TC flower, else handed over in
#     software (backends/dpdk/tests/net_tap.rs); then a two-process soak
#     over two net_tap ports on a bridge in A, two queue pairs and two
#     reactors a side;
#   * a two-process training run (net_af_packet): `starwire ps` in A,
#     `starwire worker` in B, `--backend dpdk --sync`, the DPDK addresses from an .endpoint_map,
#     whose AUC must be within 0.005 of the same run over tcp (run once, on
#     the cA/cB pair). A PS task ends when every worker has said it is
#     done.
# Prints one JSON line per result and a summary line; exits 0 only if all
# pass. Needs root (ip netns). Cleans up after itself. Namespaces and
# interfaces are named $STARWIRE_NETNS_PREFIX (default sw) plus the
# script's pid, so runs with other prefixes never collide.
# Usage: [STARWIRE_NETNS_PREFIX=sw] ci/dpdk-netns.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "ci/dpdk-netns.sh needs root (ip netns, veth, AF_XDP)" >&2
    exit 1
fi

tag="${STARWIRE_NETNS_PREFIX:-sw}$$"
EAL="--no-huge --no-pci --no-shconf -m 512"
LOG_DIR="$(mktemp -d)"

# shellcheck source=ci/lib/netns.sh
. ci/lib/netns.sh
# shellcheck source=ci/lib/bench.sh
. ci/lib/bench.sh
cleanup() {
    netns_down
    rm -rf "$LOG_DIR"
}
trap cleanup EXIT
# A timeout's or a user's signal ends the script through its EXIT trap too.
trap 'exit 130' INT
trap 'exit 143' TERM

echo "--- building (debug) starwire with --features dpdk and the kernel-peer and net_tap tests" >&2
cargo build --locked -q -p starwire --features dpdk
cargo test --locked -q -p starwire-dpdk --test kernel_peer --test net_tap --no-run
BIN="$PWD/target/debug/starwire"
# The bench server listens on a non-loopback address, so both ends prove a
# cluster token (docs/SECURITY.md): one made for this run.
STARWIRE_CLUSTER_TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
export STARWIRE_CLUSTER_TOKEN

netns_up "$tag" 10.99

passed=0
failed=0
TRAIN_FLAGS="--steps 200 --sync --json --quiet"
# A short soak: sizes up to 64 KiB (bursts of full-size packets), 4
# connections, 3 s.
SOAK_FLAGS="--backend dpdk --connections 4 --duration 3 --max-size 65536 --json"
# A ps in A and a worker in B: `train_pair NAME BACKEND [EAL_A IP_A EAL_B
# IP_B]` leaves the worker's report in $LOG_DIR/NAME-worker.json. The EAL
# arguments go in STARWIRE_EAL_ARGS (one word each); the DPDK addresses in
# an .endpoint_map, whose fast endpoint names each task's DPDK side (its
# IPv4 address and first UDP port) while the cluster spec's addresses carry
# the bootstrap streams.
train_pair() {
    local name=$1 backend=$2 tport=$((port + 50))
    local ps_addr="$CTL_A:$tport" worker_addr="$CTL_B:$((tport + 1))"
    local hosts="--ps-hosts $ps_addr --worker-hosts $worker_addr"
    local map_dir="$LOG_DIR/map-$name"
    mkdir -p "$map_dir"
    if [ -n "${4:-}" ]; then
        printf '%s=%s:21000\n%s=%s:21000\n' "$ps_addr" "$4" "$worker_addr" "$6" \
            >"$map_dir/.endpoint_map"
    fi
    # shellcheck disable=SC2086
    ip netns exec "$NS_A" env STARWIRE_EAL_ARGS="${3:-}" TF_SEASTAR_ENDPOINT_MAP_PATH="$map_dir" \
        timeout 300 "$BIN" ps $hosts --task-index 0 --exit-when-done --backend "$backend" $TRAIN_FLAGS \
        >"$LOG_DIR/$name-ps.json" 2>"$LOG_DIR/$name-ps.log" &
    local ps=$! rc=0
    # shellcheck disable=SC2086
    ip netns exec "$NS_B" env STARWIRE_EAL_ARGS="${5:-}" TF_SEASTAR_ENDPOINT_MAP_PATH="$map_dir" \
        timeout 300 "$BIN" worker $hosts --task-index 0 --backend "$backend" $TRAIN_FLAGS \
        >"$LOG_DIR/$name-worker.json" 2>"$LOG_DIR/$name-worker.log" || rc=1
    wait "$ps" || rc=1
    if [ "$rc" != 0 ]; then
        tail -n 5 "$LOG_DIR/$name-ps.log" "$LOG_DIR/$name-worker.log" >&2 || true
    fi
    return $rc
}
auc_of() { grep -o '"auc":[0-9.]*' "$1" | head -1 | cut -d: -f2; }

result() { # check ok driver [detail-json]
    local ok=$2
    if [ "$ok" = true ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
    echo "{\"check\":\"$1\",\"driver\":\"$3\",\"passed\":$ok${4:+,$4}}"
}

port=18700
# The baseline for the training runs: the same ps and worker over tcp.
ok=true
train_pair tcp tcp || ok=false
TCP_AUC=$(auc_of "$LOG_DIR/tcp-worker.json" || true)
[ -n "$TCP_AUC" ] || ok=false
result train-tcp "$ok" kernel "\"auc\":${TCP_AUC:-null}"
for driver in af_packet af_xdp; do
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

    # Two-process bench: the server in A, the client (with the plan) in B.
    port=$((port + 1))
    bench_serve "$NS_A" "$CTL_A:$port" "$LOG_DIR/server-$driver.log" \
        --eal "$EAL --vdev=$vdev_a" --dpdk-ip "$DPDK_A"
    ok=true
    if ! ip netns exec "$NS_B" timeout 120 "$BIN" bench --connect "$CTL_A:$port" \
        --backends dpdk --eal "$EAL --vdev=$vdev_b" --dpdk-ip "$DPDK_B" \
        --mode lat,rate --iters 5000 --json \
        >"$LOG_DIR/client-$driver.json" 2>"$LOG_DIR/client-$driver.log"; then
        ok=false
    fi
    wait "$BENCH_SERVER" || ok=false
    # Each process stopped its port on the way out: no XDP program is left
    # on the interfaces (`ip link` lists an attached one as prog/xdp...;
    # the interface names may contain "xdp" themselves).
    for end in "$NS_A $VA" "$NS_B $VB"; do
        set -- $end
        if ip -n "$1" link show "$2" | grep -q "prog/xdp"; then
            echo "an XDP program is still attached to $2" >&2
            ok=false
        fi
    done
    rows=$(grep -c '"backend":"dpdk"' "$LOG_DIR/client-$driver.json" || true)
    [ "$rows" = 2 ] || ok=false
    while read -r row; do
        [ -n "$row" ] && echo "{\"check\":\"bench-row\",\"driver\":\"$driver\",\"row\":$row}"
    done <"$LOG_DIR/client-$driver.json"
    if [ "$ok" != true ]; then
        tail -n 5 "$LOG_DIR/server-$driver.log" "$LOG_DIR/client-$driver.log" >&2 || true
    fi
    result bench "$ok" "$driver" "\"rows\":$rows"

    # Two-process soak: the server side in A, the clients in B; each prints
    # its report, and both must pass (the server's counts what it checked
    # on the request path and the connections that did not end in an
    # orderly close).
    port=$((port + 1))
    ok=true
    # shellcheck disable=SC2086
    ip netns exec "$NS_A" timeout 120 "$BIN" soak --listen "$CTL_A:$port" $SOAK_FLAGS \
        --eal "$EAL --vdev=$vdev_a" --dpdk-ip "$DPDK_A" \
        >"$LOG_DIR/soak-server-$driver.json" 2>"$LOG_DIR/soak-server-$driver.log" &
    server=$!
    for _ in $(seq 50); do
        grep -qs "serving" "$LOG_DIR/soak-server-$driver.log" && break
        sleep 0.1
    done
    # shellcheck disable=SC2086
    ip netns exec "$NS_B" timeout 120 "$BIN" soak --connect "$CTL_A:$port" $SOAK_FLAGS \
        --eal "$EAL --vdev=$vdev_b" --dpdk-ip "$DPDK_B" \
        >"$LOG_DIR/soak-client-$driver.json" 2>"$LOG_DIR/soak-client-$driver.log" || ok=false
    wait "$server" || ok=false
    for side in server client; do
        report=$(cat "$LOG_DIR/soak-$side-$driver.json")
        echo "$report" | grep -q '"passed":true' || ok=false
        [ -n "$report" ] && echo "{\"check\":\"soak-report\",\"driver\":\"$driver\",\"report\":$report}"
    done
    if [ "$ok" != true ]; then
        tail -n 5 "$LOG_DIR/soak-server-$driver.log" "$LOG_DIR/soak-client-$driver.log" >&2 || true
    fi
    result soak "$ok" "$driver"

    # The kernel-UDP check: B's kernel gets an address on vB and no
    # neighbour entry for ours: it resolves it by ARP, which the DPDK side
    # answers.
    ip -n "$NS_B" addr add "$KERNEL_B/24" dev "$VB"
    ok=true
    if ! ip netns exec "$NS_A" env \
        STARWIRE_DPDK_TEST_EAL="$EAL --vdev=$vdev_a" \
        STARWIRE_DPDK_TEST_NETNS="/var/run/netns/$NS_B" \
        STARWIRE_DPDK_TEST_LOCAL="$DPDK_A" \
        STARWIRE_DPDK_TEST_PEER="$KERNEL_B" \
        STARWIRE_DPDK_TEST_PEER_MAC="$MAC_B" \
        timeout 120 cargo test --locked -q -p starwire-dpdk --test kernel_peer -- \
        --ignored --nocapture >"$LOG_DIR/kernel-$driver.log" 2>&1; then
        ok=false
        tail -20 "$LOG_DIR/kernel-$driver.log" >&2 || true
    fi
    detail=$(grep -o '"sent":[0-9]*,"received":[0-9]*,"arp_replies":[0-9]*' \
        "$LOG_DIR/kernel-$driver.log" || true)
    result kernel-udp "$ok" "$driver" "$detail"
    # The next driver's run starts from an empty neighbour cache.
    ip -n "$NS_B" neigh flush dev "$VB" 2>/dev/null || true
    ip -n "$NS_B" addr del "$KERNEL_B/24" dev "$VB"

    # Two-process training over dpdk: each connection bootstrapped over
    # its TCP stream on cA/cB, its frames through the DPDK ports. One
    # driver is enough to compare with tcp (and keeps the stage short):
    # net_af_packet.
    [ "$driver" = af_packet ] || continue
    port=$((port + 1))
    ok=true
    train_pair "train-$driver" dpdk "$EAL --vdev=$vdev_a" "$DPDK_A" \
        "$EAL --vdev=$vdev_b" "$DPDK_B" || ok=false
    auc=$(auc_of "$LOG_DIR/train-$driver-worker.json" || true)
    if [ -z "$auc" ] || [ -z "$TCP_AUC" ] ||
        ! awk -v a="$auc" -v b="$TCP_AUC" 'BEGIN { d = a - b; exit !(d < 0.005 && d > -0.005) }'; then
        ok=false
    fi
    result train "$ok" "$driver" "\"auc\":${auc:-null},\"tcp_auc\":${TCP_AUC:-null}"
done

# Several queue pairs: net_af_packet with qpairs=2 offers two, and
# `starwire info` says how they would be steered (software: the PMD has no
# rte_flow). The two-process benches above run one reactor a side, so one
# queue pair each. (net_af_xdp refuses queue_count=2 on a veth: the PMD
# allows one queue on an interface that reports no combined channels.)
ok=true
info=$(ip netns exec "$NS_A" timeout 60 "$BIN" info --json \
    --eal "$EAL --vdev=net_af_packet0,iface=$VA,qpairs=2" --dpdk-queues 2 2>/dev/null) || ok=false
steering=$(echo "$info" | grep -o '"steering":"[a-z_]*"' | head -1 | cut -d'"' -f4)
echo "$info" | grep -q '"max_queues":{"rx":2,"tx":2}' || ok=false
[ "$steering" = software ] || ok=false
result queues "$ok" af_packet "\"steering\":\"${steering:-none}\""

# Two queue pairs on net_tap, whose kernel side picks each packet's queue
# (tun's flow hash): 32 kernel UDP sockets send to two links, each must
# get exactly its own datagrams (backends/dpdk/tests/net_tap.rs). net_tap
# implements rte_flow with TC flower rules: where the kernel has no
# flower classifier (or multiq qdisc) rte_flow_validate still passes but
# the rule cannot be created, and the steering must say software.
ok=true
if ! ip netns exec "$NS_A" env \
    STARWIRE_DPDK_TEST_TAP_EAL="$EAL --vdev=net_tap0,iface=${tag}t" \
    STARWIRE_DPDK_TEST_TAP_IFACE="${tag}t" \
    timeout 120 cargo test --locked -q -p starwire-dpdk --test net_tap -- \
    --ignored --nocapture >"$LOG_DIR/net-tap.log" 2>&1; then
    ok=false
    tail -20 "$LOG_DIR/net-tap.log" >&2 || true
fi
detail=$(grep -o '"steering":"[a-z_]*"' "$LOG_DIR/net-tap.log" | head -1 || true)
detail="$detail${detail:+,}$(grep -o '"datagrams":[0-9]*,"on_own_queue":\[[0-9,]*\],"handed_over":[0-9]*' \
    "$LOG_DIR/net-tap.log" || true)"
result net-tap-queues "$ok" net_tap "$detail"

# A two-process soak over net_tap, two queue pairs and two reactors a
# side: both tap interfaces are ports of one bridge in A (no address on
# the taps; the bootstrap runs over loopback). net_tap gives its kernel
# interface the port's MAC, which a bridge treats as its own (it delivers
# frames for it locally instead of forwarding them), so each tap gets
# another MAC once its port has started. The kernel's tun hash picks each
# packet's queue; the links hand over what lands on the other's.
port=$((port + 1))
ok=true
BR="${tag}br"
ip -n "$NS_A" link add "$BR" type bridge
ip -n "$NS_A" link set "$BR" up
tap_to_bridge() { # IFACE MAC LOG: once the port in LOG has started
    for _ in $(seq 300); do
        if grep -qs "DPDK port started" "$3"; then
            ip -n "$NS_A" link set "$1" address "$2" &&
                ip -n "$NS_A" link set "$1" master "$BR" &&
                ip -n "$NS_A" link set "$1" up
            return
        fi
        sleep 0.1
    done
    return 1
}
TAP_SOAK="$SOAK_FLAGS --server-reactors 2 --client-reactors 2 --dpdk-queues 2"
# shellcheck disable=SC2086
ip netns exec "$NS_A" env RUST_LOG=info timeout 120 "$BIN" soak --listen "127.0.0.1:$port" \
    $TAP_SOAK --eal "$EAL --vdev=net_tap0,iface=${tag}ta" --dpdk-ip 10.99.2.1 \
    >"$LOG_DIR/soak-server-tap.json" 2>"$LOG_DIR/soak-server-tap.log" &
server=$!
tap_to_bridge "${tag}ta" 02:00:00:00:f4:0a "$LOG_DIR/soak-server-tap.log" || ok=false
for _ in $(seq 100); do
    grep -qs "serving" "$LOG_DIR/soak-server-tap.log" && break
    sleep 0.1
done
tap_to_bridge "${tag}tb" 02:00:00:00:f4:0b "$LOG_DIR/soak-client-tap.log" &
attach=$!
# shellcheck disable=SC2086
ip netns exec "$NS_A" env RUST_LOG=info timeout 120 "$BIN" soak --connect "127.0.0.1:$port" \
    $TAP_SOAK --eal "$EAL --vdev=net_tap0,iface=${tag}tb" --dpdk-ip 10.99.2.2 \
    >"$LOG_DIR/soak-client-tap.json" 2>"$LOG_DIR/soak-client-tap.log" || ok=false
wait "$server" || ok=false
wait "$attach" || ok=false
for side in server client; do
    report=$(cat "$LOG_DIR/soak-$side-tap.json")
    echo "$report" | grep -q '"passed":true' || ok=false
    [ -n "$report" ] && echo "{\"check\":\"soak-report\",\"driver\":\"net_tap\",\"report\":$report}"
done
steering=$(grep -ho 'steering="[a-z_]*"' "$LOG_DIR/soak-server-tap.log" "$LOG_DIR/soak-client-tap.log" |
    sort -u | cut -d'"' -f2 | paste -sd, -)
[ -n "$steering" ] || ok=false
if [ "$ok" != true ]; then
    tail -n 5 "$LOG_DIR/soak-server-tap.log" "$LOG_DIR/soak-client-tap.log" >&2 || true
fi
result soak-queues "$ok" net_tap "\"steering\":\"${steering:-none}\""

echo "{\"check\":\"summary\",\"passed\":$passed,\"failed\":$failed}"
[ "$failed" = 0 ]

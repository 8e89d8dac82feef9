# Sourced by ci/dpdk-netns.sh and ci/dpdk-figures.sh: two network
# namespaces, A and B, joined by two veth pairs. vA/vB carry the DPDK
# ports and have no kernel address (with net_af_packet the kernel would
# see every frame too; net_af_xdp's program takes its queue's traffic from
# the kernel); cA/cB have addresses, for the TCP control and bootstrap
# connections and the tcp baseline.
#
# netns_up TAG NET creates them, named TAG plus a, b, va, vb, ca, cb, and
# sets NS_A, NS_B, VA, VB, CA, CB, MAC_A, MAC_B (vA's and vB's MACs) and
# the addresses: CTL_A=NET.0.1 on cA, CTL_B=NET.0.2 on cB, and for the
# DPDK sides DPDK_A=NET.1.1, DPDK_B=NET.1.3, KERNEL_B=NET.1.2 (an address
# the kernel-UDP peer may put on vB). netns_down deletes both namespaces
# (and with them the veth pairs), and netns_one's; call it from the
# script's EXIT trap.

netns_up() { # TAG NET
    local tag=$1 net=$2 l
    NS_A="${tag}a"
    NS_B="${tag}b"
    VA="${tag}va"
    VB="${tag}vb"
    CA="${tag}ca"
    CB="${tag}cb"
    CTL_A="$net.0.1"
    CTL_B="$net.0.2"
    DPDK_A="$net.1.1"
    DPDK_B="$net.1.3"
    KERNEL_B="$net.1.2"
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    ip link add "$VA" netns "$NS_A" type veth peer name "$VB" netns "$NS_B"
    ip link add "$CA" netns "$NS_A" type veth peer name "$CB" netns "$NS_B"
    ip -n "$NS_A" link set lo up
    ip -n "$NS_B" link set lo up
    for l in "$NS_A $VA" "$NS_B $VB" "$NS_A $CA" "$NS_B $CB"; do
        # shellcheck disable=SC2086
        set -- $l
        ip -n "$1" link set "$2" up
    done
    ip -n "$NS_A" addr add "$CTL_A/24" dev "$CA"
    ip -n "$NS_B" addr add "$CTL_B/24" dev "$CB"
    MAC_A=$(ip -n "$NS_A" -br link show "$VA" | awk '{print $3}')
    MAC_B=$(ip -n "$NS_B" -br link show "$VB" | awk '{print $3}')
}

netns_down() {
    local ns
    for ns in "${NS_A:-}" "${NS_B:-}" "${NS_S:-}"; do
        [ -n "$ns" ] || continue
        # Processes still in it (a peer left running by a failed step)
        # would keep it and its veths alive past its deletion.
        { ip netns pids "$ns" 2>/dev/null || true; } | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    return 0
}

# netns_one TAG creates one namespace holding both ends of one veth pair,
# named TAG plus s, sa, sb, and sets NS_S, SA, SB: a process in it can open
# both ends (one testpmd with two ports). netns_down deletes it too.
netns_one() { # TAG
    NS_S="${1}s"
    SA="${1}sa"
    SB="${1}sb"
    ip netns add "$NS_S"
    ip -n "$NS_S" link add "$SA" type veth peer name "$SB"
    ip -n "$NS_S" link set lo up
    ip -n "$NS_S" link set "$SA" up
    ip -n "$NS_S" link set "$SB" up
}

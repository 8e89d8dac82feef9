# Sourced by the DPDK figure scripts (ci/dpdk-figures.sh,
# ci/dpdk-ceiling.sh; not run by CI): what they need before measuring.
#
# figures_setup SCRIPT checks for root and dpdk-testpmd (naming SCRIPT in
# the error), sets EAL (the no-hugepage EAL arguments), DURATION and
# TESTPMD_SECS (from the environment, defaults 3 and 8), PROFILE (default
# release) and LOG_DIR (a new temporary directory), sources
# ci/lib/netns.sh, installs an EXIT trap that deletes the namespaces and
# LOG_DIR, builds starwire with --features dpdk in PROFILE and sets BIN.

figures_setup() { # SCRIPT
    if [ "$(id -u)" != 0 ]; then
        echo "$1 needs root (ip netns, veth, AF_XDP)" >&2
        exit 1
    fi
    command -v dpdk-testpmd >/dev/null || {
        echo "dpdk-testpmd is missing (apt-get install dpdk-dev)" >&2
        exit 1
    }
    EAL="--no-huge --no-pci --no-shconf -m 512"
    DURATION="${DURATION:-3}"
    TESTPMD_SECS="${TESTPMD_SECS:-8}"
    PROFILE="${PROFILE:-release}"
    LOG_DIR="$(mktemp -d)"
    # shellcheck source=ci/lib/netns.sh
    . ci/lib/netns.sh
    trap 'netns_down; rm -rf "$LOG_DIR"' EXIT
    echo "--- building ($PROFILE) starwire with --features dpdk" >&2
    if [ "$PROFILE" = release ]; then
        cargo build --locked -q --release -p starwire --features dpdk
    else
        cargo build --locked -q -p starwire --features dpdk
    fi
    BIN="$PWD/target/$PROFILE/starwire"
}

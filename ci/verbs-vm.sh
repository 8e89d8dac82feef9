#!/usr/bin/env bash
# The kernel features this host lacks, in an emulated guest (QEMU TCG,
# Debian's own kernel):
#   * real verbs: the verbs backend's hardware tests (conformance over 64
#     connections, frames and counters), a soak of many connections on one
#     reactor, polling off, a short bench and a short training run, between
#     the Soft-RoCE devices rxe0 and rxe1 (rdma_rxe over a veth pair);
#   * rte_flow: the dpdk backend's net_tap test
#     (backends/dpdk/tests/net_tap.rs) on a port with two queue pairs, which
#     must be steered by rte_flow (net_tap's TC flower rules, one per link's
#     UDP port), with no packet handed over between the links.
# This host's kernel has no RDMA (ibv_get_device_list: ENOSYS) and no TC
# flower, and KVM cannot boot a stock kernel here, so the guest is fully
# emulated; timings in it mean nothing, correctness does.
#
# Needs: apt (Debian 12 packages: the kernel linux-image-amd64 depends on,
# busybox-static, ibverbs-utils, ibverbs-providers, downloaded with
# `apt-get download`), qemu-system-x86, cpio, xz-utils; the verbs and dpdk
# build packages of ci/test.sh. Downloads and the unpacked guest are cached
# in target/verbs-vm/. Exits 0 only when the guest printed
# "STARWIRE-VERBS-VM: PASS"; non-zero on failure or after VM_TIMEOUT
# seconds (600).
# Usage: ci/verbs-vm.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VM_TIMEOUT="${VM_TIMEOUT:-600}"
VM_SOAK_SECONDS="${VM_SOAK_SECONDS:-20}"
VM_SOAK_CONNECTIONS="${VM_SOAK_CONNECTIONS:-64}"
CACHE="$PWD/target/verbs-vm"
ARCH_LIB=/usr/lib/x86_64-linux-gnu
mkdir -p "$CACHE/debs"

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
need=()
for p in qemu-system-x86 cpio xz-utils; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
fi

# --- Debian packages of the guest (cached).
cd "$CACHE/debs"
KV=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
if [ -z "$KV" ]; then
    $sudo apt-get update -q
    KV=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
fi
for p in "$KV" busybox-static ibverbs-utils ibverbs-providers; do
    ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
for p in busybox-static ibverbs-utils ibverbs-providers; do
    [ -d "x-$p" ] || { rm -rf "x-$p.tmp" && mkdir "x-$p.tmp" && dpkg-deb -x "${p}"_*.deb "x-$p.tmp" && mv "x-$p.tmp" "x-$p"; }
done
# Soft-RoCE's modules, then net_tap's: the tun device, and the qdiscs,
# classifier and actions of its rte_flow rules (TC flower; a QUEUE action
# is skbedit's queue mapping).
MODS="crc32_generic udp_tunnel ip6_udp_tunnel ib_core ib_uverbs rdma_rxe veth"
MODS="$MODS tun sch_multiq sch_ingress cls_flower act_skbedit act_gact act_mirred"
# Of the kernel package only the image and the guest's modules are kept
# (the unpacked package is 400 MB), cached per module list.
K="$CACHE/debs/kernel-$KV-$(echo "$MODS" | md5sum | cut -c1-8)"
if [ ! -d "$K" ]; then
    rm -rf "$K.tmp" x-kernel && mkdir -p "$K.tmp" x-kernel
    dpkg-deb -x "${KV}"_*.deb x-kernel
    cp x-kernel/boot/vmlinuz-* "$K.tmp/"
    for m in $MODS; do
        f=$(find x-kernel/lib/modules -name "$m.ko*" | head -1)
        [ -n "$f" ] || { echo "verbs-vm: module $m not in $KV" >&2; exit 1; }
        case "$f" in
            *.xz) xz -dc "$f" > "$K.tmp/$m.ko" ;;
            *) cp "$f" "$K.tmp/$m.ko" ;;
        esac
    done
    rm -rf x-kernel
    mv "$K.tmp" "$K"
fi
cd - >/dev/null
VMLINUZ=$(ls "$K"/vmlinuz-* | head -1)
KREL=$(basename "$VMLINUZ" | sed 's/^vmlinuz-//')

# --- Release binaries, stripped.
cargo build --release --locked -p starwire --features verbs
HW=$(cargo test --release --locked -p starwire-verbs --test hardware --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
[ -x "$HW" ] || { echo "verbs-vm: no hardware test binary" >&2; exit 1; }
TAP=$(cargo test --release --locked -p starwire-dpdk --test net_tap --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
[ -x "$TAP" ] || { echo "verbs-vm: no net_tap test binary" >&2; exit 1; }
# DPDK's drivers are plugins (a shared build): the guest gets the three
# the net_tap test loads, in the directory the EAL reads.
PMDS=$ARCH_LIB/dpdk/pmds-23.0

# --- The initramfs.
R="$CACHE/root"
rm -rf "$R"
mkdir -p "$R"/{bin,sbin,etc/libibverbs.d,lib/modules,proc,sys,dev,tmp,root,var/run,opt/iproute} \
    "$R$ARCH_LIB/libibverbs" "$R/lib64" "$R$PMDS"
cp "$CACHE/debs/x-busybox-static/bin/busybox" "$R/bin/busybox"
# busybox's shell prefers its own applet to a binary named ip, and
# iproute2 reads argv[0]: the real ip goes in under another name.
cp "$(command -v ip)" "$R/bin/xip"
# The net_tap test runs `ip` itself: the real one, first in its PATH.
cp "$(command -v ip)" "$R/opt/iproute/ip"
cp "$(command -v rdma)" "$R/bin/rdma"
cp "$CACHE/debs/x-ibverbs-utils/usr/bin/ibv_devices" "$R/bin/ibv_devices"
strip -o "$R/bin/starwire" target/release/starwire
strip -o "$R/bin/verbs-hardware" "$HW"
strip -o "$R/bin/dpdk-net-tap" "$TAP"
for p in bus_vdev mempool_ring net_tap; do cp -L "$PMDS/librte_$p.so.23" "$R$PMDS/librte_$p.so"; done
cp "$CACHE/debs/x-ibverbs-providers$ARCH_LIB/libibverbs/librxe-rdmav34.so" "$R$ARCH_LIB/libibverbs/"
echo "driver rxe" > "$R/etc/libibverbs.d/rxe.driver"
for bin in "$R"/bin/xip "$R"/bin/rdma "$R"/bin/ibv_devices "$R"/bin/starwire "$R"/bin/verbs-hardware \
    "$R$ARCH_LIB/libibverbs/librxe-rdmav34.so" "$R"/bin/dpdk-net-tap "$R$PMDS"/*.so; do
    ldd "$bin" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
        [ -e "$R$lib" ] || { mkdir -p "$R$(dirname "$lib")"; cp -L "$lib" "$R$lib"; }
    done
done
for m in $MODS; do cp "$K/$m.ko" "$R/lib/modules/"; done
cat > "$R/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
echo "== guest kernel \$(cat /proc/sys/kernel/osrelease)"
sysctl -w net.ipv6.conf.all.accept_dad=0 >/dev/null; sysctl -w net.ipv6.conf.default.accept_dad=0 >/dev/null
for m in $MODS; do insmod /lib/modules/\$m.ko || echo "insmod \$m failed"; done
xip link set lo up
# One emulated CPU drains the veth backlog late: a deep one keeps
# Soft-RoCE's bursts from being dropped (each drop is an RC retransmission).
sysctl -w net.core.netdev_max_backlog=100000 >/dev/null
xip link add v0 type veth peer name v1 && xip link set v0 up && xip link set v1 up
xip link set v0 txqueuelen 10000; xip link set v1 txqueuelen 10000
rdma link add rxe0 type rxe netdev v0; rdma link add rxe1 type rxe netdev v1
sleep 2
rdma link; ibv_devices
ok=1
echo "== starwire info (RDMA section)"
/bin/starwire info | grep -A12 "RDMA device" || ok=0
echo "== verbs hardware tests: conformance (64 connections) and counters, rxe0 <-> rxe1"
STARWIRE_RDMA_DEVICE=rxe0 STARWIRE_RDMA_PEER_DEVICE=rxe1 RUST_BACKTRACE=1 \\
    /bin/verbs-hardware --ignored --test-threads 1 --nocapture || ok=0
echo "== soak: $VM_SOAK_CONNECTIONS connections on one reactor per side, polling off, rxe0 -> rxe1"
STARWIRE_RDMA_ACK_TIMEOUT=20 RUST_LOG=warn /bin/starwire soak --backend verbs --rdma-device rxe0 --rdma-peer-device rxe1 \\
    --connections $VM_SOAK_CONNECTIONS --client-reactors 1 --server-reactors 1 \\
    --duration $VM_SOAK_SECONDS --polling off --json || ok=0
echo "== bench: latency and rate over verbs, rxe0 -> rxe1, 4 connections, polling off (timings mean nothing here)"
STARWIRE_RDMA_ACK_TIMEOUT=20 RUST_LOG=warn /bin/starwire bench --backends verbs --rdma-device rxe0 --rdma-peer-device rxe1 \\
    --mode lat,rate --sizes 64,65536 --connections 4 --iters 2000 --polling off --json || ok=0
echo "== train: 1 PS and 2 workers in one process over verbs on rxe0, 40 steps"
STARWIRE_RDMA_ACK_TIMEOUT=20 RUST_LOG=warn /bin/starwire train --backend verbs --rdma-device rxe0 \\
    --steps 40 --log-every 0 || ok=0
echo "== dpdk: two queue pairs on net_tap, steered by rte_flow (TC flower), kernel UDP sockets to two links"
PATH=/opt/iproute:\$PATH STARWIRE_DPDK_TEST_TAP_STEERING=rte_flow STARWIRE_DPDK_TEST_TAP_IFACE=dtap0 \\
    STARWIRE_DPDK_TEST_TAP_EAL="--no-huge --no-pci --no-shconf -m 256 --vdev=net_tap0,iface=dtap0" \\
    RUST_BACKTRACE=1 /bin/dpdk-net-tap --ignored --nocapture || ok=0
if [ \$ok = 1 ]; then echo "STARWIRE-VERBS-VM: PASS"; else echo "STARWIRE-VERBS-VM: FAIL"; fi
poweroff -f
EOF
chmod +x "$R/init"
(cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) > "$CACHE/initrd.gz"
echo "verbs-vm: guest kernel $KREL, initramfs $(du -h "$CACHE/initrd.gz" | cut -f1)"

# --- Boot it.
LOG="$CACHE/guest.log"
set +e
timeout "$VM_TIMEOUT" qemu-system-x86_64 -accel tcg -cpu max -m 1536 -smp 1 -nographic -no-reboot \
    -nic none -kernel "$VMLINUZ" -initrd "$CACHE/initrd.gz" \
    -append "console=ttyS0 panic=-1 quiet" < /dev/null 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 124 ]; then
    echo "verbs-vm: the guest did not finish within $VM_TIMEOUT s" >&2
    exit 1
fi
if grep -q "STARWIRE-VERBS-VM: PASS" "$LOG"; then
    echo "verbs-vm: PASS"
    exit 0
fi
echo "verbs-vm: the guest did not pass (log: $LOG)" >&2
exit 1

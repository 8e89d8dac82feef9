#!/usr/bin/env bash
# The figures the issues ask for, in one run: train quality and speed
# (issue 5), gRPC against tcp (issue 6), io_uring against tcp (issue 4),
# the worker hand-off on and off (issue 23).
# Release build with the grpc feature; every figure a ratio of two lines
# of this one run. Usage: bash ci/figures.sh > figures.txt
cd "$(dirname "$0")/.."
cargo build --release --locked -p starwire --features grpc >&2
B="$PWD/target/release/starwire"
OUT="${FIGURES_DIR:-target/figures}"; mkdir -p "$OUT"
cd "$OUT"
echo "=== start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
j() { "$B" "$@" 2>/dev/null | tail -1; }
echo "### 5a lr epochs 2";            j train --model lr --epochs 2 --json
echo "### 5b data";                   "$B" data --out ./train.tsv --examples 200000 2>&1; "$B" data --out ./eval.tsv --stream eval --examples 50000 2>&1
echo "### 5b reference";              j reference --train criteo:./train.tsv --eval criteo:./eval.tsv --json
echo "### 5b train on file";          j train --model lr --train criteo:./train.tsv --eval criteo:./eval.tsv --json
echo "### 5c wdl fuse on";            j train --model wdl --epochs 1 --tensor-fuse on --json
echo "### 5c wdl fuse off";           j train --model wdl --epochs 1 --tensor-fuse off --json
echo "### 5c lr fuse on";             j train --model lr --epochs 1 --tensor-fuse on --json
echo "### 5c lr fuse off";            j train --model lr --epochs 1 --tensor-fuse off --json
echo "### 5d 2 workers";              j train --workers 2 --epochs 1 --train-examples 400000 --json
echo "### 5d 64 workers";             j train --workers 64 --epochs 1 --train-examples 400000 --json
echo "### 5e place";                  "$B" place --ps 4
echo "### 5e place wdl";              "$B" place --ps 4 --model wdl | tail -4
echo "### 5f robust 1w";              j train --workers 1 --epochs 1 --json
echo "### 5f lite 1w";                j train --workers 1 --epochs 1 --protocol star_server_lite --json
echo "### 5f robust 2w";              j train --epochs 1 --json
echo "### 5f lite 2w";                j train --epochs 1 --protocol star_server_lite --json
echo "### 6t tcp fuse on";            j train --backend tcp --model lr --embedding-dim 64 --batch-size 512 --epochs 1 --json
echo "### 6t grpc fuse off";          j train --backend grpc --tensor-fuse off --model lr --embedding-dim 64 --batch-size 512 --epochs 1 --json
echo "### 6t grpc fuse on";           j train --backend grpc --tensor-fuse on --model lr --embedding-dim 64 --batch-size 512 --epochs 1 --json
echo "### 6t inproc (no network)";    j train --backend inproc --model lr --embedding-dim 64 --batch-size 512 --epochs 1 --json
echo "### 6t uring fuse on";          j train --backend uring --model lr --embedding-dim 64 --batch-size 512 --epochs 1 --json
for b in tcp "grpc --tensor-fuse off" inproc; do
  echo "### 6t2 epochs 2 $b";         j train --backend $b --model lr --embedding-dim 64 --batch-size 512 --json
done
# On and off alternating, 3 rounds, per backend and polling setting.
for round in 1 2 3; do
  for b in tcp uring; do
    for poll in false true; do
      for h in on off; do
        echo "### 23 handoff $h $b polling $poll round $round"
        WORKER_ENABLE_POLLING=$poll PS_ENABLE_POLLING=$poll \
          j train --backend $b --epochs 6 --optimizer adagrad --lr 0.3 --worker-handoff $h --json
      done
    done
  done
done
echo "### 6b rate";  "$B" bench --backends grpc,tcp --mode rate --sizes 4096 --inflight 32 --repeat 3 2>&1 | tail -8
echo "### 6b lat";   "$B" bench --backends grpc,tcp --mode lat --sizes 64 --polling on --cores 0,1 --repeat 3 2>&1 | tail -8
echo "### 6b bw";    "$B" bench --backends grpc,tcp --mode bw --sizes 1048576 --repeat 3 2>&1 | tail -8
echo "### 4 rate";   "$B" bench --backends tcp,uring --mode rate --sizes 4096 --inflight 32 --repeat 5 2>&1 | tail -8
echo "### 4 lat";    "$B" bench --backends tcp,uring --mode lat --sizes 64 --polling on --cores 0,1 --repeat 5 2>&1 | tail -8
echo "### 4 bw";     "$B" bench --backends tcp,uring --mode bw --sizes 1048576 --repeat 3 2>&1 | tail -8
if command -v strace >/dev/null; then
  # Syscalls of both ends under strace (slowed down; counts, not times).
  for be in tcp uring; do
    echo "### 4 strace $be"
    strace -c -f -o "strace-$be.txt" "$B" bench --backends "$be" --mode rate --sizes 4096 --inflight 32 --iters 20000 --warmup 1000 >/dev/null 2>&1
    grep -E "io_uring_enter|recvfrom|sendmsg|sendto|writev|readv|total" "strace-$be.txt"
  done
fi
echo "=== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"

#!/usr/bin/env bash
# Choose starwire train's default optimizer and learning rate on data sets
# that were not tuned for: several synthetic sets with other id
# distributions (vocabulary, Zipf exponent) and click rates, written as
# Criteo files so that `train` and `reference` read the same examples.
# For each set: the converged reference's AUC (`starwire reference`,
# L-BFGS), then `train --epochs 3` at the default flags and at each
# candidate, as a ratio to the reference. A candidate holds when every
# ratio is >= 0.97. Not run by CI (minutes per set).
#
#   ci/defaults-sweep.sh                      # default flags only
#   CANDIDATES="adagrad:0.3 adam:0.01" ci/defaults-sweep.sh
#   SETS="default rare" EXAMPLES=100000 ci/defaults-sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="${STARWIRE:-./target/release/starwire}"
EXAMPLES="${EXAMPLES:-200000}"
EVAL="${EVAL:-50000}"
DIR="${DIR:-target/defaults-sweep}"
CANDIDATES="${CANDIDATES:-}"
# name:vocab:zipf:ctr
ALL_SETS="default:100000:1.1:0.25 rare:1000000:1.05:0.03 head:10000:1.4:0.5 flat:300000:0.8:0.12"
SETS="${SETS:-default rare head flat}"

[ -x "$BIN" ] || cargo build --release -p starwire
mkdir -p "$DIR"

field() { grep -o "\"$1\":[^,}]*" | head -1 | cut -d: -f2; }

printf '%-8s %8s %5s %5s  %-14s %7s %7s %6s\n' set vocab zipf ctr run auc ref ratio
for s in $SETS; do
    spec=$(tr ' ' '\n' <<<"$ALL_SETS" | grep "^$s:") || { echo "unknown set $s" >&2; exit 2; }
    IFS=: read -r name vocab zipf ctr <<<"$spec"
    flags=(--vocab "$vocab" --zipf-exponent "$zipf" --ctr "$ctr")
    train="$DIR/$name-train.tsv" eval="$DIR/$name-eval.tsv"
    [ -s "$train" ] || "$BIN" data --out "$train" --examples "$EXAMPLES" "${flags[@]}" 2>/dev/null
    [ -s "$eval" ] || "$BIN" data --out "$eval" --examples "$EVAL" --stream eval "${flags[@]}" 2>/dev/null
    ref_json=$("$BIN" reference --train "criteo:$train" --eval "criteo:$eval" --eval-examples "$EVAL" --json | tail -1)
    ref=$(field auc <<<"$ref_json")
    printf '%-8s %8s %5s %5s  %-14s %7.4f %7s %6s  (converged %s, l2 %s)\n' "$name" "$vocab" "$zipf" "$ctr" reference "$ref" - - \
        "$(field converged <<<"$ref_json")" "$(field l2 <<<"$ref_json")"
    for c in default $CANDIDATES; do
        extra=()
        if [ "$c" != default ]; then extra=(--optimizer "${c%%:*}" --lr "${c#*:}"); fi
        auc=$("$BIN" train --train "criteo:$train" --eval "criteo:$eval" --eval-examples "$EVAL" \
            --epochs 3 --log-every 0 --json "${extra[@]}" 2>/dev/null | tail -1 | field auc)
        ratio=$(awk -v a="$auc" -v r="$ref" 'BEGIN { printf "%.3f", a / r }')
        printf '%-8s %8s %5s %5s  %-14s %7.4f %7.4f %6s%s\n' "$name" "$vocab" "$zipf" "$ctr" "$c" "$auc" "$ref" "$ratio" \
            "$(awk -v x="$ratio" 'BEGIN { if (x < 0.97) print "  < 0.97" }')"
    done
done

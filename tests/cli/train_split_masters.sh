#!/usr/bin/env bash
# --bf16 keeps split fp32 masters (bf16 high half + int16 remainder) by default; with
# --no-store-param-remainders it keeps whole fp32 masters. Both hold the same fp32 values and take
# the same AdamW steps; the compute weights differ only where a master lies exactly halfway
# between two bf16 values (a split rounds it away from zero, a cast to even), so the losses
# of the two runs agree to far below a step's change (CPU).
set -euo pipefail
bin=$1; src=$2; shift 2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
common=(train --config "$src/configs/tiny.yaml" --device cpu --bf16 --train-iters 8 --log-interval 1 --eval-interval 0 "$@")
"$bin" "${common[@]}" --metrics-file "$dir/split.jsonl" >"$dir/split.log" 2>&1 || { cat "$dir/split.log"; exit 1; }
"$bin" "${common[@]}" --no-store-param-remainders --metrics-file "$dir/whole.jsonl" >"$dir/whole.log" 2>&1 || { cat "$dir/whole.log"; exit 1; }
losses() { grep -o '"lm_loss":[^,}]*' "$1" | cut -d: -f2; }
paste <(losses "$dir/split.jsonl") <(losses "$dir/whole.jsonl") | awk '
  { n++; d = $1 - $2; if (d < 0) d = -d; printf "step %d: split %s whole %s\n", n, $1, $2
    if (d > 1e-4 * ($2 < 0 ? -$2 : $2)) bad = 1
    if (n == 1) first = $2; last = $2 }
  END { if (n != 8) { print "FAIL: expected 8 losses, got " n; exit 1 }
        if (bad) { print "FAIL: the losses differ by more than 1e-4 relative"; exit 1 }
        if (first - last < 1e-3) { print "FAIL: the runs did not learn"; exit 1 } }'
echo "PASS"

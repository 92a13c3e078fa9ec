#!/usr/bin/env bash
# The tiny MoE preset on --mock-data halves its loss within 60 iterations (CPU unless the
# extra arguments say otherwise).
set -euo pipefail
bin=$1; src=$2; shift 2  # further arguments go to moecore train
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
"$bin" train --config "$src/configs/tiny.yaml" --device cpu --log-interval 1 "$@" --metrics-file "$dir/m.jsonl" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
losses=$(grep -o '"lm_loss":[^,}]*' "$dir/m.jsonl" | cut -d: -f2)
first=$(echo "$losses" | head -1); last=$(echo "$losses" | tail -1); n=$(echo "$losses" | wc -l)
echo "iterations logged: $n, first loss $first, last loss $last"
[ "$n" -eq 60 ] || { echo "FAIL: expected 60 logged iterations"; exit 1; }
# The first loss is near ln(vocabulary) (a lost or zeroed loss must not pass as halved).
awk -v a="$first" 'BEGIN { exit !(a > 2) }' || { echo "FAIL: first loss $first; expected about ln(vocab)"; exit 1; }
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b <= a / 2) }' || { echo "FAIL: loss did not halve"; exit 1; }
grep -q "load_balancing_loss" "$dir/log" || { echo "FAIL: no load_balancing_loss in the log"; exit 1; }
echo "PASS"

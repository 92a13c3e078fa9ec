#!/usr/bin/env bash
# A learning rate of 1e38 blows the weights up after the first step: every later step has a NaN
# (or Inf) loss or gradient. Each such step is reported and skipped, the log counts them, and the
# run still finishes with exit code 0 (CPU).
set -uo pipefail
bin=$1; src=$2; shift 2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
"$bin" train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --log-interval 1 --lr 1e38 \
  --clip-grad 0 --lr-warmup-iters 0 "$@" >"$dir/log" 2>&1
rc=$?
cat "$dir/log"
[ "$rc" -eq 0 ] || { echo "FAIL: exit code $rc (expected 0)"; exit 1; }
grep -Eq '^iteration [0-9]+: (NaN|Inf) .*step skipped' "$dir/log" || { echo "FAIL: no 'iteration N: NaN/Inf ... step skipped' line"; exit 1; }
last=$(grep -E 'iteration +4/ +4 \|' "$dir/log" | tail -1)
[ -n "$last" ] || { echo "FAIL: no log line for the last iteration"; exit 1; }
nan=$(sed -nE 's/.*number of nan iterations: *([0-9]+) \|.*/\1/p' <<<"$last")
[ -n "$nan" ] || { echo "FAIL: the last log line has no 'number of nan iterations'"; exit 1; }
[ "$nan" -gt 0 ] || { echo "FAIL: the last log line reports $nan nan iterations"; exit 1; }
skipped=$(sed -nE 's/.*number of skipped iterations: *([0-9]+) \|.*/\1/p' <<<"$last")
[ -n "$skipped" ] && [ "$skipped" -gt 0 ] || { echo "FAIL: the last log line reports no skipped iterations"; exit 1; }
echo "PASS ($nan nan iterations, $skipped skipped)"

#!/usr/bin/env bash
# --timing-log-level on the tiny model (CPU). Level 2: the log shows the step's phases and the
# model's parts, each MoE layer's parts fit in its time and the phases in the step's; the MoE
# layers are counted once per layer and micro-batch (validation runs are not timed); the metrics
# file has the same regions. Level 1: the phases only. Level 0 (the default): no timers.
set -uo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
fail() { cat "$dir/log"; echo "FAIL: $*"; exit 1; }
run() {
  "$bin" train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --log-interval 4 --lr-warmup-iters 1 \
    --eval-interval 2 --eval-iters 2 "$@" >"$dir/log" 2>&1 || fail "exit code $? with $*"
}
ms_of() { awk -v n="$1" '$1 == n && $3 == "ms" { print $2; exit }' "$dir/log"; }
calls_of() { awk -v n="$1" '$1 == n && $3 == "ms" { gsub(/\(/, "", $5); print $5; exit }' "$dir/log"; }

run --timing-log-level 2 --metrics-file "$dir/metrics.jsonl"
for name in forward-backward embedding-forward attention-forward moe-forward moe-router moe-dispatch moe-experts \
  moe-combine output-layer output-layer-backward moe-backward moe-combine-backward moe-experts-backward \
  moe-dispatch-backward moe-router-backward attention-backward embedding-backward grads-reduce moe-statistics moe-finish-step \
  grad-norm loss-and-checks optimizer; do
  [ -n "$(ms_of $name)" ] || fail "no timer line for $name"
  grep -q "\"$name\":" "$dir/metrics.jsonl" || fail "the metrics file has no timer $name"
done
step=$(sed -nE 's/.*elapsed time per iteration \(ms\): ([0-9.]+) .*/\1/p' "$dir/log" | tail -1)
# 2 MoE layers x 2 micro-batches x 4 steps; the validation forwards would add more.
[ "$(calls_of moe-forward)" = 16 ] || fail "moe-forward counted $(calls_of moe-forward) times, expected 16"
[ "$(calls_of optimizer)" = 4 ] || fail "optimizer counted $(calls_of optimizer) times, expected 4"
awk -v step="$step" -v fb="$(ms_of forward-backward)" -v opt="$(ms_of optimizer)" -v norm="$(ms_of grad-norm)" \
  -v moe="$(ms_of moe-forward)" -v r="$(ms_of moe-router)" -v d="$(ms_of moe-dispatch)" -v e="$(ms_of moe-experts)" \
  -v c="$(ms_of moe-combine)" 'BEGIN {
    if (fb + opt + norm > step * 1.05 + 0.1) { print "FAIL: phases " fb + opt + norm " ms exceed the step " step " ms"; exit 1 }
    if (r + d + e + c > moe * 1.02 + 0.05) { print "FAIL: MoE parts " r + d + e + c " ms exceed the layer " moe " ms"; exit 1 }
    if (e <= 0 || fb < moe) { print "FAIL: implausible times: experts " e ", forward-backward " fb ", moe " moe; exit 1 }
  }' || fail "inconsistent times"

run --timing-log-level 1
[ -n "$(ms_of optimizer)" ] || fail "level 1 has no optimizer timer"
[ -z "$(ms_of moe-router)" ] || fail "level 1 shows the level-2 timer moe-router"
run
grep -q "timers (ms" "$dir/log" && fail "timers printed without --timing-log-level"
echo "PASS (step $step ms)"

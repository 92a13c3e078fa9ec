#!/usr/bin/env bash
# FP8 checkpoints cross over: an FP8 delayed-scaling checkpoint serves `moecore generate`, `moecore
# eval` and a run without FP8 (its scaling state is skipped), and an fp32 checkpoint resumes under
# --fp8 delayed scaling with empty amax histories (a note says so).
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
common=(--config "$src/configs/tiny.yaml" --device cpu --lr-warmup-iters 1 --lr-decay-iters 4 --eval-interval 0)
ok() {  # log-name command...: must succeed
  local log=$1; shift
  "$@" >"$dir/$log" 2>&1 || { cat "$dir/$log"; echo "FAIL: $*"; exit 1; }
}
ok fp8.log "$bin" train "${common[@]}" --train-iters 2 --fp8 --fp8-amax-history-len 2 --save "$dir/fp8"
ok gen.log "$bin" generate --load "$dir/fp8" --prompt-ids "1 2 3" --max-new-tokens 4 --temperature 0 --device cpu
ok eval.log "$bin" eval "${common[@]}" --load "$dir/fp8" --eval-iters 2
ok resume-plain.log "$bin" train "${common[@]}" --train-iters 4 --load "$dir/fp8"
grep -q "loaded checkpoint" "$dir/resume-plain.log" || { cat "$dir/resume-plain.log"; echo "FAIL: not loaded"; exit 1; }
ok plain.log "$bin" train "${common[@]}" --train-iters 2 --save "$dir/plain"
ok resume-fp8.log "$bin" train "${common[@]}" --train-iters 4 --fp8 --load "$dir/plain"
grep -q "has no FP8 delayed-scaling state" "$dir/resume-fp8.log" || { cat "$dir/resume-fp8.log"; echo "FAIL: no note"; exit 1; }
echo "PASS"

#!/usr/bin/env bash
# Checkpoints hold AdamW's moments in fp32 whatever --exp-avg-dtype says: a run saved with fp32
# states resumes with bf16 states, and that run's checkpoint (fp32 in the file) resumes with
# fp32 states again (CPU).
set -euo pipefail
bin=$1; src=$2; shift 2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
common=(train --config "$src/configs/tiny.yaml" --device cpu --log-interval 1 --eval-interval 0 "$@")
bf16=(--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16)
"$bin" "${common[@]}" --train-iters 8 --lr-decay-iters 12 --save "$dir/a" >"$dir/a.log" 2>&1 || { cat "$dir/a.log"; exit 1; }
"$bin" "${common[@]}" "${bf16[@]}" --train-iters 10 --lr-decay-iters 12 --load "$dir/a" --save "$dir/b" >"$dir/b.log" 2>&1 ||
  { cat "$dir/b.log"; echo "FAIL: fp32-state checkpoint did not resume with bf16 states"; exit 1; }
grep -q "loaded checkpoint" "$dir/b.log" && grep -q "exp_avg in bf16, exp_avg_sq in bf16" "$dir/b.log" ||
  { cat "$dir/b.log"; echo "FAIL: not resumed with bf16 states"; exit 1; }
# The saved moments are F32 in the safetensors header (names end in .exp_avg / .exp_avg_sq).
header=$(head -c 200000 "$dir/b/iter_0000010/model_optim.safetensors" | tr -d '\0' | grep -ao '"[^"]*\.exp_avg[_sq]*":{"dtype":"[A-Z0-9]*"' || true)
[ -n "$header" ] || { echo "FAIL: no moments found in the checkpoint header"; exit 1; }
if grep -q '"dtype":"BF16"' <<<"$header"; then echo "$header" | head -3; echo "FAIL: bf16 moments in the checkpoint"; exit 1; fi
"$bin" "${common[@]}" --train-iters 12 --lr-decay-iters 12 --load "$dir/b" >"$dir/c.log" 2>&1 ||
  { cat "$dir/c.log"; echo "FAIL: bf16-state run's checkpoint did not resume with fp32 states"; exit 1; }
grep -q "loaded checkpoint" "$dir/c.log" || { cat "$dir/c.log"; echo "FAIL: did not load"; exit 1; }
echo "PASS"

#!/usr/bin/env bash
# A run resumed from a checkpoint prints exactly the losses of the uninterrupted run (CPU).
set -euo pipefail
bin=$1; src=$2; shift 2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
common=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 8 --log-interval 1 --eval-interval 0 "$@")
"$bin" "${common[@]}" --save "$dir/full" --save-interval 4 --metrics-file "$dir/full.jsonl" >"$dir/full.log" 2>&1 || { cat "$dir/full.log"; exit 1; }
[ -f "$dir/full/iter_0000004/model_optim.safetensors" ] || { echo "FAIL: no checkpoint at iteration 4"; exit 1; }
[ "$(cat "$dir/full/latest_checkpointed_iteration.txt")" = "8" ] || { echo "FAIL: latest is not 8"; exit 1; }
"$bin" "${common[@]}" --load "$dir/full/iter_0000004" --metrics-file "$dir/resumed.jsonl" >"$dir/resumed.log" 2>&1 || { cat "$dir/resumed.log"; exit 1; }
grep -q "loaded checkpoint" "$dir/resumed.log" || { echo "FAIL: did not load"; exit 1; }
full=$(grep -o '"iteration":[0-9]*,"learning_rate":[^,]*,"lm_loss":[^,]*' "$dir/full.jsonl" | tail -4)
resumed=$(grep -o '"iteration":[0-9]*,"learning_rate":[^,]*,"lm_loss":[^,]*' "$dir/resumed.jsonl")
echo "uninterrupted:"; echo "$full"; echo "resumed:"; echo "$resumed"
[ -n "$resumed" ] && [ "$full" = "$resumed" ] || { echo "FAIL: resumed losses differ"; exit 1; }
# A damaged checkpoint is refused with its name, and the save directory is left intact.
printf 'garbage' > "$dir/full/iter_0000004/model_optim.safetensors"
if "$bin" "${common[@]}" --load "$dir/full/iter_0000004" >"$dir/bad.log" 2>&1; then echo "FAIL: loaded a damaged checkpoint"; exit 1; fi
grep -q "model_optim.safetensors" "$dir/bad.log" || { cat "$dir/bad.log"; echo "FAIL: error does not name the file"; exit 1; }
echo "PASS"

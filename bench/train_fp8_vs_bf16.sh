#!/usr/bin/env bash
# FP8 blockwise training beside bf16 on one GPU, same card, same run (issue 28's targets):
# mixtral-small and finegrained-small for 15 steps each in bf16 and with --fp8 --fp8-recipe
# blockwise (and, with FP8_RECIPES="blockwise tensorwise", more recipes), the average of steps
# 11-15: ms/step, tokens/s, the CUDA allocator's peak, and FP8's tokens/s and peak relative to
# bf16. Prints JSON lines, then a table. Usage: bench/train_fp8_vs_bf16.sh [build-dir]
set -uo pipefail
build=${1:-build}
recipes=${FP8_RECIPES:-blockwise}
status=0
rows=()
run() {  # preset label flags... -> "ms tps peak_bytes"
  local preset=$1 label=$2; shift 2
  local metrics; metrics=$(mktemp)
  if ! CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$build/moecore" train --config "configs/$preset.yaml" --train-iters 15 \
      --log-interval 5 --eval-interval 0 --lr-warmup-iters 1 --metrics-file "$metrics" "$@" > "$metrics.log" 2>&1; then
    echo "$preset $label failed:" >&2; tail -3 "$metrics.log" >&2; rm -f "$metrics" "$metrics.log"; return 1
  fi
  local last; last=$(grep '"iteration":15' "$metrics" | tail -1)
  field() { grep -o "\"$1\":[^,}]*" <<<"$last" | cut -d: -f2; }
  echo "$(field ms_per_iteration) $(field tokens_per_s) $(field mem_max_allocated_bytes) $(field lm_loss)"
  rm -f "$metrics" "$metrics.log"
}
for preset in mixtral-small finegrained-small; do
  out=$(run "$preset" bf16) || { status=1; continue; }
  read -r ms0 tps0 peak0 loss0 <<<"$out"
  rows+=("| $preset | bf16 | $ms0 | $tps0 | $(awk -v p="$peak0" 'BEGIN { printf "%.2f", p / 1e9 }') | 1.00x | 1.00x | $loss0 |")
  echo "{\"bench\":\"train_fp8\",\"preset\":\"$preset\",\"precision\":\"bf16\",\"ms_per_step\":$ms0,\"tokens_per_s\":$tps0,\"peak_bytes\":$peak0,\"lm_loss\":$loss0}"
  for recipe in $recipes; do
    out=$(run "$preset" "fp8 $recipe" --fp8 --fp8-recipe "$recipe") || { status=1; continue; }
    read -r ms tps peak loss <<<"$out"
    speed=$(awk -v a="$tps" -v b="$tps0" 'BEGIN { printf "%.2f", a / b }')
    mem=$(awk -v a="$peak" -v b="$peak0" 'BEGIN { printf "%.2f", a / b }')
    echo "{\"bench\":\"train_fp8\",\"preset\":\"$preset\",\"precision\":\"fp8 $recipe\",\"ms_per_step\":$ms,\"tokens_per_s\":$tps,\"peak_bytes\":$peak,\"lm_loss\":$loss,\"tokens_per_s_vs_bf16\":$speed,\"peak_vs_bf16\":$mem}"
    rows+=("| $preset | fp8 $recipe | $ms | $tps | $(awk -v p="$peak" 'BEGIN { printf "%.2f", p / 1e9 }') | ${speed}x | ${mem}x | $loss |")
  done
done
printf "\n| preset | precision | ms / step | tokens/s | peak GB | tokens/s vs bf16 | peak vs bf16 | lm loss (step 15) |\n|---|---|---|---|---|---|---|---|\n"
printf "%s\n" "${rows[@]}"
cards=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "card: ${cards:-unknown}"
exit $status

#!/usr/bin/env bash
# make bench: every benchmark in build/bench, each printing JSON lines and a table last.
# Extra arguments go to each benchmark (e.g. make bench BENCH_ARGS=--quick).
set -euo pipefail
build=${1:-build}; shift || true
status=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  echo "== $(basename "$b")"
  "$b" ${BENCH_ARGS:-} "$@" || status=1
done
# End to end on one GPU: the two benchmark presets, the average of steps 11-15, beside the
# PyTorch eager figures on an H200 (the baseline of docs/performance.md; measured elsewhere, not in
# this run).
if [ -x "$build/moecore" ] && nvidia-smi -L >/dev/null 2>&1; then
  echo "== end-to-end training, one GPU"
  rows=()
  for entry in "mixtral-small 87300 26" "finegrained-small 92100 39"; do
    read -r preset torch_tps torch_gb <<<"$entry"
    metrics=$(mktemp)
    if ! CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$build/moecore" train --config "configs/$preset.yaml" --train-iters 15 \
        --log-interval 5 --eval-interval 0 --lr-warmup-iters 1 --metrics-file "$metrics" > "$metrics.log" 2>&1; then
      tail -3 "$metrics.log"; status=1; continue
    fi
    last=$(grep '"iteration":15' "$metrics" | tail -1)
    field() { grep -o "\"$1\":[^,}]*" <<<"$last" | cut -d: -f2; }
    tps=$(field tokens_per_s); tflops=$(field tflops_per_gpu); ms=$(field ms_per_iteration); peak=$(field mem_max_allocated_bytes)
    ratio=$(awk -v a="$tps" -v b="$torch_tps" 'BEGIN { printf "%.2f", a / b }')
    peak_gb=$(awk -v p="$peak" 'BEGIN { printf "%.2f", p / 1e9 }')
    echo "{\"bench\":\"train\",\"preset\":\"$preset\",\"ms_per_step\":$ms,\"tokens_per_s\":$tps,\"tflops_per_gpu\":$tflops,\"peak_gb\":$peak_gb,\"pytorch_tokens_per_s\":$torch_tps,\"vs_pytorch\":$ratio}"
    rows+=("| $preset | $ms | $tps | $tflops | $peak_gb (PyTorch $torch_gb) | ${ratio}x |")
    rm -f "$metrics" "$metrics.log"
  done
  printf "\n| preset | ms / step | tokens/s | TFLOP/s | peak GB | vs PyTorch eager tokens/s |\n|---|---|---|---|---|---|\n"
  printf "%s\n" "${rows[@]}"
fi
exit $status

#!/usr/bin/env bash
# FP8 training on one GPU against the CPU's emulation: the fp32 tiny MoE with --fp8-format hybrid
# trained 5 steps per recipe (tensorwise, delayed with a history of 4 and max, blockwise) on cuda
# and on cpu prints the same lm losses within 1e-2 relative, none NaN.
# Why not closer: both quantise the same values to the same codes, but cuBLASLt sums the FP8
# products in another order and with the tensor cores' ~14-bit partial sums (tests/gpu/
# test_gpu_fp8.cpp: ~1e-4 of the sum of |products| per element), and each such difference
# can move a value of the next linear's input across an FP8 rounding boundary (one E4M3 step is
# 6-12% of that value, one E5M2 step of a gradient 12-25%); over a few hundred thousand operand
# values and 5 steps these flips move the loss by ~1e-3 (the CPU's parallel FP8 layouts, which
# differ only by summation order, agree within 5e-3: tests/cli/train_fp8_parallel.sh). A wrong
# scale, factor layout or padding moves it by far more (or gives NaN).
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --train-iters 5 --lr-warmup-iters 1 --log-interval 1 --eval-interval 0
      --num-attention-heads 2 --fp8-format hybrid)  # CUDA attention: head dim 32
losses() { grep -o '"lm_loss":[^,}]*' "$1" | cut -d: -f2; }
for recipe in tensorwise delayed blockwise; do
  extra=(--fp8-recipe "$recipe")
  [ "$recipe" = delayed ] && extra+=(--fp8-amax-history-len 4 --fp8-amax-compute-algo max)
  for dev in cpu cuda; do
    "$bin" "${base[@]}" "${extra[@]}" --device "$dev" --metrics-file "$dir/$recipe-$dev.jsonl" >"$dir/$recipe-$dev.log" 2>&1 ||
      { cat "$dir/$recipe-$dev.log"; echo "FAIL: $recipe on $dev"; exit 1; }
  done
  [ "$(losses "$dir/$recipe-cuda.jsonl" | wc -l)" -eq 5 ] || { echo "FAIL: $recipe: expected 5 logged losses on cuda"; exit 1; }
  ! losses "$dir/$recipe-cuda.jsonl" | grep -qi "nan\|inf" || { echo "FAIL: $recipe: NaN/Inf loss on cuda"; exit 1; }
  echo "$recipe: cpu vs cuda"; paste <(losses "$dir/$recipe-cpu.jsonl") <(losses "$dir/$recipe-cuda.jsonl")
  paste <(losses "$dir/$recipe-cpu.jsonl") <(losses "$dir/$recipe-cuda.jsonl") |
    awk '{ d = $1 - $2; if (d < 0) d = -d; if (NF != 2 || d > 1e-2 * $1) { print "differs: " $1 " vs " $2; bad = 1 } } END { exit bad }' ||
    { echo "FAIL: $recipe: cuda losses differ from the cpu's by more than 1e-2"; exit 1; }
done
echo PASS

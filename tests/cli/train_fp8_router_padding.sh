#!/usr/bin/env bash
# --moe-router-padding-for-fp8: FP8 runs with the routing map padded to 16 rows per expert, EP2
# (alltoall) against one rank within the FP8 layouts' 5e-3 (tests/cli/train_fp8_parallel.sh says
# why not closer), per recipe (blockwise, tensorwise); and the flag takes effect: the tensorwise
# run differs from the same run without it (the added rows enter the expert inputs' amax), while
# its first forward (lm loss of iteration 1) is the unpadded one to 5e-3 (probability-0 rows add
# nothing to the output).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
moe=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
     --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --fp8-format hybrid --moe-router-padding-for-fp8)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=3
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
ep="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
for recipe in blockwise tensorwise; do
  run single 1 "${moe[@]}" --fp8-recipe $recipe
  run ranks 2 "${moe[@]}" --fp8-recipe $recipe $ep
  check 5e-3 "fp8 $recipe --moe-router-padding-for-fp8 EP2"
done
# single.jsonl is the padded tensorwise run: the same without the padding
unpadded=()
for a in "${moe[@]}"; do [ "$a" = --moe-router-padding-for-fp8 ] || unpadded+=("$a"); done
run ranks 1 "${unpadded[@]}" --fp8-recipe tensorwise
if paste <(values "$dir/ranks.jsonl") <(values "$dir/single.jsonl") | agree 0 >/dev/null; then
  echo "FAIL: --moe-router-padding-for-fp8 changed nothing in a tensorwise run"; exit 1
fi
paste <(values "$dir/ranks.jsonl" | head -1) <(values "$dir/single.jsonl" | head -1) | agree 5e-3 ||
  { echo "FAIL: the padded run's first lm loss is not the unpadded one"; exit 1; }
echo "tensorwise with and without the padding: the same first loss, different after (the padded amax)"
echo "PASS"

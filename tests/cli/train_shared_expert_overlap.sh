#!/usr/bin/env bash
# --moe-shared-expert-overlap changes no number: a tiny MoE model with a shared expert (plain and
# gated, and with --recompute-modules shared_experts) trains 3 iterations with and without the flag
# on one rank (EP1) and on two CPU ranks with EP2 (mpirun), with and without the distributed
# optimizer, and logs bit-identical lm loss, balancing loss and grad norm and saves bit-identical
# checkpoints (weights and optimizer state after 3 updates).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-layers 3 --moe-layer-freq "[0,1,1]"
      --moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type alltoall --save-interval 3)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
MIN_LOGGED=9
. "$(dirname "$0")/layout_compare.sh"  # run
same_checkpoints() {  # a b: every saved tensor file bit-identical
  local files
  files=$(cd "$dir/$1" && find . -name '*.safetensors')
  [ -n "$files" ] || { echo "FAIL: no checkpoint saved"; exit 1; }
  for f in $files; do cmp "$dir/$1/$f" "$dir/$2/$f" || { echo "FAIL: checkpoint $f differs"; exit 1; }; done
}
ep="--expert-model-parallel-size 2"
for layout in "1" "1 --moe-shared-expert-gate --recompute-granularity selective --recompute-modules shared_experts" \
              "2 $ep" "2 $ep --use-distributed-optimizer" "2 $ep --use-distributed-optimizer --moe-shared-expert-gate"; do
  read -r -a l <<<"$layout"
  rm -rf "$dir/ckpt_off" "$dir/ckpt_on"
  run off "${l[0]}" "${base[@]}" "${l[@]:1}" --save "$dir/ckpt_off"
  run on "${l[0]}" "${base[@]}" "${l[@]:1}" --save "$dir/ckpt_on" --moe-shared-expert-overlap
  cmp <(values "$dir/off.jsonl") <(values "$dir/on.jsonl") ||
    { echo "FAIL: np ${l[*]}: --moe-shared-expert-overlap changes the logged values"; exit 1; }
  same_checkpoints ckpt_off ckpt_on
  echo "np ${l[*]}: --moe-shared-expert-overlap bit-identical (losses, grad norm, checkpoint)"
done

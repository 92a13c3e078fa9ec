#!/usr/bin/env bash
# Two GPUs, bf16 compute: the distributed optimizer with sharded fp32 masters (DP=2, EP=2; also
# with --overlap-param-gather: the next forward waits for each layer's gathered weights) prints
# the one-GPU bf16 run's lm loss, load_balancing_loss and grad norm within 1e-3 relative (a
# gradient norm summed in another order may flip a bf16 rounding). BIN SRC "MPI launcher".
set -euo pipefail
bin=$1; src=$2; mpi=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --bf16 --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --hidden-size 128 --num-attention-heads 4)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
CUDA_VISIBLE_DEVICES=0 "$bin" "${base[@]}" --metrics-file "$dir/one.jsonl" > "$dir/one.log" 2>&1 || { cat "$dir/one.log"; exit 1; }
for flags in "--use-distributed-optimizer" "--use-distributed-optimizer --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"; do
  rm -f "$dir/two.jsonl"
  # shellcheck disable=SC2086
  $mpi "$bin" "${base[@]}" $flags --metrics-file "$dir/two.jsonl" > "$dir/two.log" 2>&1 || { cat "$dir/two.log"; exit 1; }
  paste <(values "$dir/two.jsonl") <(values "$dir/one.jsonl") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-3 * ($2 < 0 ? -$2 : $2) + 1e-9) { print "differs: " $1 " vs " $2; bad = 1 } } END { exit bad }' ||
    { echo "FAIL: bf16 2 GPUs [$flags] differ from one GPU"; exit 1; }
  echo "bf16 2 GPUs [$flags]: same losses and grad norm as one GPU (1e-3)"
done
echo PASS

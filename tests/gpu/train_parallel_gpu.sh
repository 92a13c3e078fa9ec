#!/usr/bin/env bash
# Two GPUs (NCCL): the fp32 tiny MoE trained by DP=2, EP=2, ETP=2, PP=2, TP=2 (+SP), CP=2 and
# TP=2 + EP=2 (folded) layouts prints the one-GPU run's lm loss, load_balancing_loss and grad
# norm for 3 iterations (within 1e-4 relative: fp32 GPU GEMMs may sum in another order for other
# row counts); in bf16, TP=2, PP=2, CP=2 and TP=2 + EP=2 print the one-GPU bf16 values within
# 1e-2 (bf16 rounding of partial sums). Run by scripts/gpu-dist.sh.
set -euo pipefail
bin=$1; src=$2; mpi=$3  # mpi: the launcher command line, e.g. "mpirun -np 2 -x NCCL_NVLS_ENABLE"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --hidden-size 128 --num-attention-heads 4)  # CUDA attention: head dim 32
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
compare() {  # a b [tolerance, default 1e-4]
  paste <(values "$1") <(values "$2") | awk -v tol="${3:-1e-4}" '{ d = $1 - $2; if (d < 0) d = -d; if (NF != 2 || d > tol * ($2 < 0 ? -$2 : $2) + 1e-9) { print "differs: " $1 " vs " $2; bad = 1 } } END { exit bad }'
}
single() { rm -f "$dir/one.jsonl"; CUDA_VISIBLE_DEVICES=0 "$bin" "${base[@]}" "$@" --metrics-file "$dir/one.jsonl" > "$dir/one.log" 2>&1 || { cat "$dir/one.log"; exit 1; }; }
ranks() { rm -f "$dir/two.jsonl"; $mpi "$bin" "${base[@]}" "$@" --metrics-file "$dir/two.jsonl" > "$dir/two.log" 2>&1 || { cat "$dir/two.log"; exit 1; }; }
single
grep -q "cuda" "$dir/one.log" || { cat "$dir/one.log"; echo "FAIL: not on a GPU"; exit 1; }
[ "$(values "$dir/one.jsonl" | wc -l)" -eq 9 ] || { echo "FAIL: no losses"; exit 1; }
for flags in "" "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
             "--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather --use-distributed-optimizer" \
             "--use-distributed-optimizer" "--overlap-grad-reduce" "--use-distributed-optimizer --overlap-grad-reduce" \
             "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-grad-reduce" \
             "--expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall" \
             "--expert-tensor-parallel-size 2 --moe-token-dispatcher-type allgather" \
             "--tensor-model-parallel-size 2 --sequence-parallel" "--context-parallel-size 2" \
             "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"; do
  # shellcheck disable=SC2086
  ranks $flags
  compare "$dir/two.jsonl" "$dir/one.jsonl" || { echo "FAIL: 2 GPUs [$flags] differ from one GPU"; exit 1; }
  echo "2 GPUs [${flags:-DP=2}]: same losses and grad norm as one GPU"
done
single --moe-router-load-balancing-type global_aux_loss --micro-batch-size 16
ranks --moe-router-load-balancing-type global_aux_loss --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --micro-batch-size 8  # one micro-batch per rank
compare "$dir/two.jsonl" "$dir/one.jsonl" || { echo "FAIL: EP=2 global_aux_loss differs from one GPU"; exit 1; }
echo "2 GPUs [EP=2 global_aux_loss]: same losses and grad norm as one GPU"
# pipeline parallelism on a 4-layer model
single --num-layers 4
for flags in "--pipeline-model-parallel-size 2" "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1" \
             "--pipeline-model-parallel-size 2 --overlap-grad-reduce"; do
  # shellcheck disable=SC2086
  ranks --num-layers 4 $flags
  compare "$dir/two.jsonl" "$dir/one.jsonl" || { echo "FAIL: 2 GPUs [$flags] differ from one GPU"; exit 1; }
  echo "2 GPUs [$flags]: same losses and grad norm as one GPU"
done
# tied embeddings across two stages (the embedding group)
single --num-layers 4 --untie-embeddings-and-output-weights=false
ranks --num-layers 4 --untie-embeddings-and-output-weights=false --pipeline-model-parallel-size 2
compare "$dir/two.jsonl" "$dir/one.jsonl" || { echo "FAIL: 2 GPUs [PP=2 tied embeddings] differ from one GPU"; exit 1; }
echo "2 GPUs [PP=2, tied embeddings]: same losses and grad norm as one GPU"
# bf16: TP=2, PP=2, CP=2 and TP=2 folded with EP=2 against one bf16 GPU
single --bf16 --num-layers 4
for flags in "--tensor-model-parallel-size 2 --sequence-parallel" "--pipeline-model-parallel-size 2" "--context-parallel-size 2" \
             "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"; do
  # shellcheck disable=SC2086
  ranks --bf16 --num-layers 4 $flags
  compare "$dir/two.jsonl" "$dir/one.jsonl" 1e-2 || { echo "FAIL: bf16 2 GPUs [$flags] differ from one GPU"; exit 1; }
  echo "bf16 2 GPUs [$flags]: same losses and grad norm as one GPU (1e-2)"
done
echo PASS

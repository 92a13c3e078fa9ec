#!/usr/bin/env bash
# Two GPUs launched by torchrun (no MPI: the NCCL id travels over TCP, comm/tcp_rendezvous.h):
# the fp32 tiny MoE trained with DP=2 and with EP=2 (alltoall) prints the one-GPU run's lm loss,
# load_balancing_loss and grad norm for 3 iterations (within 1e-4 relative, as
# train_parallel_gpu.sh). Then a torchrun launch with more ranks than GPUs must fail quickly with
# the one-GPU-per-local-rank message, every rank gone.
# Usage: train_torchrun_gpu.sh BIN SRC   (torchrun on PATH, else python3 -m torch.distributed.run;
# TORCHRUN="..." overrides)
set -euo pipefail
bin=$1; src=$2
export NCCL_NVLS_ENABLE=0
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
if [ -n "${TORCHRUN:-}" ]; then read -r -a torchrun <<< "$TORCHRUN"
elif command -v torchrun > /dev/null; then torchrun=(torchrun)
else torchrun=(python3 -m torch.distributed.run); fi
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --hidden-size 128 --num-attention-heads 4)  # CUDA attention: head dim 32
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
compare() {
  [ "$(values "$1" | wc -l)" -eq "$(values "$2" | wc -l)" ] || { echo "different numbers of values"; return 1; }
  paste <(values "$1") <(values "$2") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-4 * ($2 < 0 ? -$2 : $2) + 1e-9) { print "differs: " $1 " vs " $2; bad = 1 } } END { exit bad }'
}
single() { rm -f "$dir/one.jsonl"; CUDA_VISIBLE_DEVICES=0 "$bin" "${base[@]}" "$@" --metrics-file "$dir/one.jsonl" > "$dir/one.log" 2>&1 || { cat "$dir/one.log"; exit 1; }; }
ranks() {
  rm -f "$dir/two.jsonl"
  timeout 300 "${torchrun[@]}" --standalone --nproc-per-node 2 --no-python "$bin" "${base[@]}" "$@" \
    --metrics-file "$dir/two.jsonl" > "$dir/two.log" 2>&1 || { cat "$dir/two.log"; echo "FAIL: torchrun [$*] failed"; exit 1; }
}
"${torchrun[@]}" --help > /dev/null 2>&1 || { echo "FAIL: no torchrun (${torchrun[*]})"; exit 1; }
single
grep -q "cuda" "$dir/one.log" || { cat "$dir/one.log"; echo "FAIL: not on a GPU"; exit 1; }
[ "$(values "$dir/one.jsonl" | wc -l)" -eq 9 ] || { echo "FAIL: no losses"; exit 1; }
# --save: the checkpoint ends with a barrier (an NCCL all-reduce without MPI). EP=2: split()
# through ncclCommSplit.
for flags in "--save $dir/ckpt" "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"; do
  # shellcheck disable=SC2086
  ranks $flags
  grep -q "2 data-parallel rank(s)" "$dir/two.log" || { cat "$dir/two.log"; echo "FAIL: not 2 ranks"; exit 1; }
  compare "$dir/two.jsonl" "$dir/one.jsonl" || { cat "$dir/two.log"; echo "FAIL: torchrun 2 GPUs [$flags] differ from one GPU"; exit 1; }
  echo "torchrun 2 GPUs [${flags/--save $dir\/ckpt/DP=2 + checkpoint}]: same losses and grad norm as one GPU"
done
# With 4 GPUs: EP=2 over 4 ranks splits into two EP groups ({0,1}, {2,3}: two colors) and two
# expert-data-parallel groups ({0,2}, {1,3}).
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ]; then
  rm -f "$dir/two.jsonl"
  CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 300 "${torchrun[@]}" --standalone --nproc-per-node 4 --no-python "$bin" "${base[@]}" \
    --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --metrics-file "$dir/two.jsonl" > "$dir/four.log" 2>&1 ||
    { cat "$dir/four.log"; echo "FAIL: torchrun 4 GPUs EP=2 failed"; exit 1; }
  compare "$dir/two.jsonl" "$dir/one.jsonl" || { cat "$dir/four.log"; echo "FAIL: torchrun 4 GPUs EP=2 differs from one GPU"; exit 1; }
  echo "torchrun 4 GPUs [EP=2, EDP=2]: same losses and grad norm as one GPU"
fi
# More local ranks than visible GPUs: an error, not a hang.
start=$(date +%s)
if CUDA_VISIBLE_DEVICES=0,1 timeout 120 "${torchrun[@]}" --standalone --nproc-per-node 3 --no-python "$bin" "${base[@]}" \
     --global-batch-size 12 > "$dir/three.log" 2>&1; then
  cat "$dir/three.log"; echo "FAIL: 3 ranks on 2 GPUs succeeded"; exit 1
fi
[ $(( $(date +%s) - start )) -lt 110 ] || { cat "$dir/three.log"; echo "FAIL: 3 ranks on 2 GPUs hung"; exit 1; }
grep -q "LOCAL_WORLD_SIZE=3 ranks on this node but 2 CUDA device(s) are visible" "$dir/three.log" ||
  { cat "$dir/three.log"; echo "FAIL: no one-GPU-per-local-rank message"; exit 1; }
echo "torchrun 3 ranks on 2 GPUs: refused with the one-GPU-per-local-rank message"
echo PASS

#!/usr/bin/env bash
# --moe-shared-expert-overlap on the GPU (BIN SRC [MPI]): the shared expert on a side stream gives
# the same numbers. One GPU: a tiny bf16 MoE model with a shared expert (plain; gated with
# --recompute-modules shared_experts) and deepseek-small (2 layers) train with and without the
# flag and log bit-identical lm loss, balancing loss and grad norm and save bit-identical
# checkpoints; with --timing-log-level 2 the shared expert's region is timed on the side stream.
# With MPI (a launcher command line for two GPUs, e.g. "mpirun -np 2 ..."; scripts/gpu-dist.sh):
# EP=2 with the flag against EP=2 without it (bit-identical), and the EP load report's keys.
set -euo pipefail
bin=$1; src=$2; mpi=${3:-}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
tiny=(train --config "$src/configs/tiny.yaml" --device cuda --bf16 --num-attention-heads 2 --train-iters 3
      --lr-warmup-iters 1 --log-interval 1 --eval-interval 0 --micro-batch-size 4 --global-batch-size 16
      --num-layers 3 --moe-layer-freq "[0,1,1]" --moe-shared-expert-intermediate-size 64
      --moe-token-dispatcher-type alltoall --save-interval 3)
deepseek=(train --config "$src/configs/deepseek-small.yaml" --device cuda --num-layers 2 --moe-layer-freq "[0,1]" --train-iters 3
          --lr-warmup-iters 1 --log-interval 1 --eval-interval 0 --global-batch-size 8
          --moe-token-dispatcher-type alltoall --save-interval 3)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
run() {  # name launcher-or-"" flags...
  local name=$1 launcher=$2; shift 2
  rm -rf "$dir/$name.jsonl" "$dir/ckpt_$name"
  $launcher "$bin" "$@" --save "$dir/ckpt_$name" --metrics-file "$dir/$name.jsonl" >"$dir/$name.log" 2>&1 ||
    { cat "$dir/$name.log"; exit 1; }
  [ "$(values "$dir/$name.jsonl" | wc -l)" -ge 6 ] || { cat "$dir/$name.log"; echo "FAIL: $name logged nothing"; exit 1; }
}
same() {  # off on label
  cmp <(values "$dir/$1.jsonl") <(values "$dir/$2.jsonl") || { echo "FAIL: $3: the flag changes the logged values"; exit 1; }
  local files
  files=$(cd "$dir/ckpt_$1" && find . -name '*.safetensors')
  [ -n "$files" ] || { echo "FAIL: $3: no checkpoint"; exit 1; }
  for f in $files; do cmp "$dir/ckpt_$1/$f" "$dir/ckpt_$2/$f" || { echo "FAIL: $3: checkpoint $f differs"; exit 1; }; done
  echo "$3: --moe-shared-expert-overlap bit-identical (losses, grad norm, checkpoint)"
}
run off "" "${tiny[@]}"
run on "" "${tiny[@]}" --moe-shared-expert-overlap
same off on "tiny bf16"
gated=(--moe-shared-expert-gate --recompute-granularity selective --recompute-modules shared_experts)
run off "" "${tiny[@]}" "${gated[@]}"
run on "" "${tiny[@]}" "${gated[@]}" --moe-shared-expert-overlap
same off on "tiny bf16, gated, shared_experts recomputed"
run off "" "${deepseek[@]}"
run on "" "${deepseek[@]}" --moe-shared-expert-overlap
same off on "deepseek-small, 2 layers"
run timed "" "${tiny[@]}" --moe-shared-expert-overlap --timing-log-level 2
grep -q '"moe-shared-expert"' "$dir/timed.jsonl" || { cat "$dir/timed.log"; echo "FAIL: no moe-shared-expert timer"; exit 1; }
grep -E "moe-shared-expert|moe-dispatch " "$dir/timed.log" | tail -n 4
if [ -n "$mpi" ]; then
  ep=(--expert-model-parallel-size 2)
  run off "$mpi" "${tiny[@]}" "${ep[@]}"
  run on "$mpi" "${tiny[@]}" "${ep[@]}" --moe-shared-expert-overlap
  same off on "tiny bf16 EP=2 on two GPUs"
  grep -o '"moe_ep_[a-z_]*":[^,}]*' "$dir/on.jsonl" | tail -n 7
  grep -q '"moe_ep_dispatch_wait_ms"' "$dir/on.jsonl" || { echo "FAIL: no EP load report"; exit 1; }
fi
echo PASS

#!/usr/bin/env bash
# --overlap-moe-expert-parallel-comm on two GPUs (BIN SRC MPI; MPI: a launcher command line for two
# GPUs, e.g. "mpirun -np 2 ..."; scripts/gpu-dist.sh): the schedule that interleaves one
# micro-batch's forward with another's backward, their expert-parallel all-to-alls on a
# communication stream, gives the same numbers. EP=2: a tiny bf16 MoE model (a dense layer and two
# MoE layers; then with an overlapped shared expert) and finegrained-small (2 layers) train with
# and without the flag (and with --delay-wgrad-compute) and log bit-identical lm loss, balancing
# loss and grad norm and save bit-identical checkpoints. With TP=2, and with global_aux_loss over
# DP=2, the flag is refused on GPUs.
set -euo pipefail
bin=$1; src=$2; mpi=${3:?a launcher for two GPUs, e.g. "mpirun -np 2"}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
ep=(--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)
tiny_unsaved=(train --config "$src/configs/tiny.yaml" --device cuda --bf16 --num-attention-heads 2 --train-iters 3
              --lr-warmup-iters 1 --log-interval 1 --eval-interval 0 --micro-batch-size 2 --global-batch-size 16
              --num-layers 3 --moe-layer-freq "[0,1,1]" "${ep[@]}")
tiny=("${tiny_unsaved[@]}" --save-interval 3)
finegrained=(train --config "$src/configs/finegrained-small.yaml" --device cuda --num-layers 2 --train-iters 3
             --lr-warmup-iters 1 --log-interval 1 --eval-interval 0 --micro-batch-size 2 --global-batch-size 8
             --save-interval 3 "${ep[@]}")
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
run() {  # name flags...
  local name=$1; shift
  rm -rf "$dir/$name.jsonl" "$dir/ckpt_$name"
  timeout 600 $mpi "$bin" "$@" --save "$dir/ckpt_$name" --metrics-file "$dir/$name.jsonl" >"$dir/$name.log" 2>&1 ||
    { cat "$dir/$name.log"; echo "FAIL: $name (a hang ends at the timeout)"; exit 1; }
  [ "$(values "$dir/$name.jsonl" | wc -l)" -ge 6 ] || { cat "$dir/$name.log"; echo "FAIL: $name logged nothing"; exit 1; }
}
same() {  # off on label
  cmp <(values "$dir/$1.jsonl") <(values "$dir/$2.jsonl") || { echo "FAIL: $3: the flag changes the logged values"; exit 1; }
  local files
  files=$(cd "$dir/ckpt_$1" && find . -name '*.safetensors')
  [ -n "$files" ] || { echo "FAIL: $3: no checkpoint"; exit 1; }
  for f in $files; do cmp "$dir/ckpt_$1/$f" "$dir/ckpt_$2/$f" || { echo "FAIL: $3: checkpoint $f differs"; exit 1; }; done
  echo "$3: bit-identical (losses, grad norm, checkpoint)"
}
overlap=(--overlap-moe-expert-parallel-comm)
run off "${tiny[@]}"
run on "${tiny[@]}" "${overlap[@]}"
same off on "tiny bf16 EP=2 --overlap-moe-expert-parallel-comm"
run on "${tiny[@]}" "${overlap[@]}" --delay-wgrad-compute
same off on "tiny bf16 EP=2 --overlap-moe-expert-parallel-comm --delay-wgrad-compute"
shared=(--moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap)
run off "${tiny[@]}" "${shared[@]}"
run on "${tiny[@]}" "${shared[@]}" "${overlap[@]}" --delay-wgrad-compute
same off on "tiny bf16 EP=2 shared expert overlapped, --overlap-moe-expert-parallel-comm --delay-wgrad-compute"
run off "${finegrained[@]}"
run on "${finegrained[@]}" "${overlap[@]}" --delay-wgrad-compute
same off on "finegrained-small (2 layers) EP=2 --overlap-moe-expert-parallel-comm --delay-wgrad-compute"
# refused on GPUs for now: a tensor-parallel collective beside the all-to-alls (one emulated rank)
if "$bin" "${tiny_unsaved[@]}" --tensor-model-parallel-size 2 --sequence-parallel --emulate-world-size 4 --emulate-rank 0 \
    "${overlap[@]}" >"$dir/tp.log" 2>&1; then
  echo "FAIL: TP=2 with --overlap-moe-expert-parallel-comm on GPUs was not refused"; exit 1
fi
grep -q -- "--overlap-moe-expert-parallel-comm on GPUs is not yet available with --tensor-model-parallel-size" "$dir/tp.log" ||
  { cat "$dir/tp.log"; echo "FAIL: the TP refusal's message"; exit 1; }
echo "TP=2 with the flag on GPUs: refused by name"
if "$bin" "${tiny_unsaved[@]}" --moe-router-load-balancing-type global_aux_loss --emulate-world-size 2 --emulate-rank 0 \
    "${overlap[@]}" >"$dir/gaux.log" 2>&1; then
  echo "FAIL: global_aux_loss over DP=2 with --overlap-moe-expert-parallel-comm on GPUs was not refused"; exit 1
fi
grep -q -- "--overlap-moe-expert-parallel-comm on GPUs is not yet available with --moe-router-load-balancing-type global_aux_loss" \
  "$dir/gaux.log" || { cat "$dir/gaux.log"; echo "FAIL: the global_aux_loss refusal's message"; exit 1; }
echo "global_aux_loss over DP=2 with the flag on GPUs: refused by name"
echo PASS

#!/usr/bin/env bash
# Activation recomputation changes no number: a tiny MoE model (a dense first layer, a shared
# expert, input jitter, global_aux_loss, z-loss) trains 3 iterations with and without each
# recomputation option -- --recompute-modules moe, mlp, moe_act, core_attn,
# shared_experts, layernorm (alone and with moe / mlp, which rerun from its output), --moe-layer-recompute,
# --recompute-granularity full with --recompute-method uniform and block -- on one rank and under
# TP2+SP, PP2 and EP2 (mpirun, CPU ranks), and logs bit-identical lm loss, balancing loss and grad
# norm. Full recomputation lowers the peak of allocated memory (the metrics' mem_max_allocated_bytes).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-layers 4 --moe-layer-freq "[0,1,1,1]"
      --moe-shared-expert-intermediate-size 32 --moe-input-jitter-eps 0.05
      --moe-router-load-balancing-type global_aux_loss --moe-z-loss-coeff 0.001)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
MIN_LOGGED=9
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
peak() { grep -o '"mem_max_allocated_bytes":[0-9]*' "$1" | cut -d: -f2 | sort -n | tail -n 1; }
options=("--recompute-granularity selective --recompute-modules moe"
         "--recompute-granularity selective --recompute-modules mlp moe_act"
         "--recompute-granularity selective --recompute-modules core_attn shared_experts"
         "--recompute-granularity selective --recompute-modules layernorm"
         "--recompute-granularity selective --recompute-modules layernorm moe core_attn"
         "--recompute-granularity selective --recompute-modules layernorm mlp shared_experts"
         "--moe-layer-recompute"
         "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
         "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"
         "--recompute-granularity full --recompute-method block --recompute-num-layers 1")
tp="--tensor-model-parallel-size 2 --sequence-parallel"
ep="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
for layout in "1" "2 $tp" "2 --pipeline-model-parallel-size 2" "2 $ep"; do
  read -r -a l <<<"$layout"
  run plain "${l[0]}" "${base[@]}" "${l[@]:1}"
  for option in "${options[@]}"; do
    read -r -a o <<<"$option"
    run recomputed "${l[0]}" "${base[@]}" "${l[@]:1}" "${o[@]}"
    cmp <(values "$dir/plain.jsonl") <(values "$dir/recomputed.jsonl") ||
      { echo "FAIL: np ${l[*]} with $option differs from keeping everything"; exit 1; }
    echo "np ${l[*]} $option: bit-identical"
    if [ "${l[0]}" = 1 ] && [[ "$option" == *"granularity full"* ]]; then
      [ "$(peak "$dir/recomputed.jsonl")" -lt "$(peak "$dir/plain.jsonl")" ] ||
        { echo "FAIL: $option peak $(peak "$dir/recomputed.jsonl") not below $(peak "$dir/plain.jsonl")"; exit 1; }
      echo "  peak allocated $(peak "$dir/recomputed.jsonl") < $(peak "$dir/plain.jsonl") bytes"
    fi
  done
done

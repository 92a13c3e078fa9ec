#!/usr/bin/env bash
# --overlap-moe-expert-parallel-comm (and --delay-wgrad-compute) changes no number: a tiny MoE
# model (a dense layer and two MoE layers) trains 3 iterations on two or four CPU ranks (mpirun)
# with EP2 -- alone, with the distributed optimizer, with ETP2, with DP2 and the gradient-reduce
# overlap, with TP2 + SP, with CP2, with DP2 and global_aux_loss, sigmoid routing, expert bias and capacity dropping, with
# padding to capacity, with the recomputation of moe_act, shared_experts, core_attn and mlp (a gated
# shared expert), with tied embeddings and an overlapped shared expert, with tied embeddings
# and the unfused output layer, deepseek-small scaled down (bf16, MLA; mla_up_proj recomputed) -- without the flag, with it and
# with both flags, and logs bit-identical lm loss, balancing loss and grad norm and saves
# bit-identical checkpoints (weights and optimizer state after 3 updates); each layout without
# capacity, global_aux_loss or bf16 also matches the single-rank run of the same model (within the EP
# layouts' usual rounding).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
# tied: the output layer shares the embedding's weight (its gradient gets both passes' parts).
sed '/untie-embeddings-and-output-weights/d' "$src/configs/tiny.yaml" > "$dir/tied.yaml"
common=(train --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1 --eval-interval 0
        --micro-batch-size 2 --global-batch-size 16 --num-layers 3 --moe-layer-freq "[0,1,1]"
        --moe-token-dispatcher-type alltoall --save-interval 3)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=9
. "$(dirname "$0")/layout_compare.sh"  # run, check
same_checkpoints() {  # a b: every saved tensor file bit-identical
  local files
  files=$(cd "$dir/$1" && find . -name '*.safetensors')
  [ -n "$files" ] || { echo "FAIL: no checkpoint saved"; exit 1; }
  for f in $files; do cmp "$dir/$1/$f" "$dir/$2/$f" || { echo "FAIL: checkpoint $f differs"; exit 1; }; done
}
# mla: deepseek-small scaled down (bf16, multi-latent attention, group-limited sigmoid routing with
# expert bias and seq_aux_loss, a shared expert), without MTP
mla=(--vocab-size 256 --seq-length 64 --max-position-embeddings 64 --hidden-size 64 --ffn-hidden-size 128
     --num-attention-heads 4 --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8
     --v-head-dim 16 --num-experts 8 --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk 2
     --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --mtp-num-layers 0)
ep="--expert-model-parallel-size 2"
shared="--moe-shared-expert-intermediate-size 32"
for layout in "untied 2 $ep" "untied 2 $ep --use-distributed-optimizer" \
              "untied 4 $ep --expert-tensor-parallel-size 2" \
              "untied 4 $ep --use-distributed-optimizer --overlap-grad-reduce" \
              "untied 4 $ep --tensor-model-parallel-size 2 --sequence-parallel" "untied 4 $ep --context-parallel-size 2" \
              "untied 4 $ep --moe-router-load-balancing-type global_aux_loss --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-expert-capacity-factor 1.0" \
              "untied 2 $ep --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity" \
              "untied 2 $ep $shared --moe-shared-expert-gate --recompute-granularity selective --recompute-modules moe_act shared_experts core_attn mlp" \
              "tied 2 $ep $shared --moe-shared-expert-overlap" "tied-unfused 2 $ep" \
              "mla 2 $ep --recompute-granularity selective --recompute-modules mla_up_proj moe_act"; do
  read -r -a l <<<"$layout"
  config=("--config" "$src/configs/tiny.yaml")
  [ "${l[0]}" != untied ] && config=("--config" "$dir/tied.yaml")
  [ "${l[0]}" = mla ] && config=("--config" "$src/configs/deepseek-small.yaml" "${mla[@]}")
  # tied-unfused: the output layer's backward in the backward pass (MOECORE_FUSED_HEAD=0)
  if [ "${l[0]}" = tied-unfused ]; then export MOECORE_FUSED_HEAD=0; else unset MOECORE_FUSED_HEAD; fi
  model=("${common[@]}" "${config[@]}")
  # the single-rank reference of this model (EP, ETP and the shared expert's overlap need ranks / a GPU)
  single=()
  for f in "${l[@]:2}"; do
    case "$f" in --expert-model-parallel-size|--expert-tensor-parallel-size|2|--moe-shared-expert-overlap) ;;
                 --tensor-model-parallel-size|--sequence-parallel|--context-parallel-size) ;;
                 --use-distributed-optimizer|--overlap-grad-reduce) ;; *) single+=("$f");; esac
  done
  run single 1 "${model[@]}" "${single[@]}" --save "$dir/ckpt_single"
  rm -rf "$dir"/ckpt_*
  run off "${l[1]}" "${model[@]}" "${l[@]:2}" --save "$dir/ckpt_off"
  run ranks "${l[1]}" "${model[@]}" "${l[@]:2}" --save "$dir/ckpt_on" --overlap-moe-expert-parallel-comm
  run delay "${l[1]}" "${model[@]}" "${l[@]:2}" --save "$dir/ckpt_delay" --overlap-moe-expert-parallel-comm \
    --delay-wgrad-compute
  for v in ranks delay; do
    cmp <(values "$dir/off.jsonl") <(values "$dir/$v.jsonl") ||
      { echo "FAIL: np ${l[*]}: the overlap ($v) changes the logged values"; exit 1; }
  done
  same_checkpoints ckpt_off ckpt_on
  same_checkpoints ckpt_off ckpt_delay
  # Capacity is decided on each rank's tokens and global_aux_loss averages per micro-batch over DP,
  # and bf16 (mla) rounds per layout: there the plain EP run is the reference, not one rank.
  case "$layout" in *capacity*|*global_aux_loss*|mla*) ;; *) check 2e-5 "np ${l[*]} --overlap-moe-expert-parallel-comm";; esac
  echo "np ${l[*]}: --overlap-moe-expert-parallel-comm (and --delay-wgrad-compute) bit-identical (losses, grad norm, checkpoint)"
done

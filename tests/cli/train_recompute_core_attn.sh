#!/usr/bin/env bash
# --recompute-modules core_attn with Multi-Latent Attention and with context parallelism changes
# no number: the attention output and logsumexp are dropped after the forward and rebuilt in the
# backward (CP: from the kept query chunks and gathered K / V). Plain and recomputed runs of 3
# iterations log bit-identical lm loss, balancing loss and grad norm: MLA on one rank, under
# TP2+SP and CP2 (also with mla_up_proj and layernorm where those allow), and the GQA model under
# CP2 and TP2+SP CP2 (mpirun, CPU ranks).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16)
mla=(--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8
     --v-head-dim 10 --qk-layernorm --rope-type yarn --rotary-scaling-factor 4 --original-max-position-embeddings 16)
gqa=(--group-query-attention --num-query-groups 2)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
MIN_LOGGED=9
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
tp="--tensor-model-parallel-size 2 --sequence-parallel"
sel="--recompute-granularity selective --recompute-modules"
compare() {  # model-array-name "np flags" recompute-options...
  local -n model=$1; local name=$1 layout=$2; shift 2
  read -r -a l <<<"$layout"
  run plain "${l[0]}" "${base[@]}" "${model[@]}" "${l[@]:1}"
  for option in "$@"; do
    read -r -a o <<<"$option"
    run recomputed "${l[0]}" "${base[@]}" "${model[@]}" "${l[@]:1}" "${o[@]}"
    cmp <(values "$dir/plain.jsonl") <(values "$dir/recomputed.jsonl") ||
      { echo "FAIL: $name np ${l[*]} with $option differs from keeping everything"; exit 1; }
    echo "$name np ${l[*]} $option: bit-identical"
  done
}
compare mla "1" "$sel core_attn" "$sel core_attn mla_up_proj layernorm"
compare mla "2 $tp" "$sel core_attn mla_up_proj"
compare mla "2 --context-parallel-size 2" "$sel core_attn" "$sel core_attn layernorm"
compare gqa "2 --context-parallel-size 2" "$sel core_attn" "$sel core_attn layernorm moe"
compare gqa "4 $tp --context-parallel-size 2" "$sel core_attn"
echo PASS

#!/usr/bin/env bash
# --tp-comm-overlap under mpirun (CPU ranks): the sequence all-gathers and reduce-scatters in row
# chunks, with the GEMMs per chunk, log bit-identical lm loss, balancing loss and grad norm and
# save bit-identical checkpoints (3 steps of gradients) to the plain collectives, and agree with
# one rank (2e-5). Layouts: a dense model (biases: rank 0's row-parallel bias, LayerNorm, GQA,
# qk-layernorm: the q/k/v dgrads summed per chunk) TP2+SP; the tiny MoE (a shared expert: its MLP
# is overlapped too) TP2+SP, TP2+SP EP2 alltoall, TP2+SP EP2 ETP2 allgather, TP2+SP CP2, TP2+SP
# with --recompute-modules core_attn; uneven chunks: 3 tokens per rank and sequence in TP2
# (chunks of 2 and 1) and TP4 micro-batch 2 (chunks 2, 2, 1, 1, one across two sequences).
# With MOECORE_TP_OVERLAP_GEMMS=chunks (the GEMMs per chunk, as on a GPU) dense TP2+SP, the
# uneven TP4 MoE and TP2+SP CP2 with core_attn recomputed agree with the plain runs (1e-5).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
common=(--device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1 --eval-interval 0 --global-batch-size 16
        --save-interval 3)
moe=(train --config "$src/configs/tiny.yaml" "${common[@]}" --micro-batch-size 4 --moe-shared-expert-intermediate-size 32)
dense=(train --mock-data --vocab-size 128 --seq-length 32 --num-layers 2 --hidden-size 64 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --normalization LayerNorm --qk-layernorm --ffn-hidden-size 96
       --lr 3e-3 --clip-grad 1.0 --micro-batch-size 4 "${common[@]}")
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=3
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
same() {  # label: the run "ranks" (with the flag) against "plain" (without): logs and checkpoints
  cmp <(values "$dir/plain.jsonl") <(values "$dir/ranks.jsonl") ||
    { echo "FAIL: $1: --tp-comm-overlap changes the logged values"; exit 1; }
  local files
  files=$(cd "$dir/ckpt_plain" && find . -name '*.safetensors')
  [ -n "$files" ] || { echo "FAIL: $1: no checkpoint"; exit 1; }
  for f in $files; do cmp "$dir/ckpt_plain/$f" "$dir/ckpt_ranks/$f" || { echo "FAIL: $1: checkpoint $f differs"; exit 1; }; done
  echo "$1: --tp-comm-overlap bit-identical (losses, grad norm, checkpoint)"
}
layouts() {  # model-array-name extra-flags -- layouts (each "np flags...")
  local -n model=$1; local name=$1 extra=$2; shift 3
  read -r -a x <<<"$extra"
  rm -rf "$dir/ckpt_single"; run single 1 "${model[@]}" "${x[@]}" --save "$dir/ckpt_single"
  for layout in "$@"; do
    read -r -a c <<<"$layout"
    rm -rf "$dir/ckpt_plain" "$dir/ckpt_ranks"
    run plain "${c[0]}" "${model[@]}" "${x[@]}" "${c[@]:1}" --save "$dir/ckpt_plain"
    run ranks "${c[0]}" "${model[@]}" "${x[@]}" "${c[@]:1}" --tp-comm-overlap --save "$dir/ckpt_ranks"
    same "$name ${extra:+($extra) }np ${c[*]}"
    check 2e-5 "$name ${extra:+($extra) }np ${c[*]} --tp-comm-overlap"
  done
}
tp="--tensor-model-parallel-size 2 --sequence-parallel"
layouts dense "" -- "2 $tp"
layouts moe "" -- "2 $tp" "4 $tp --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
  "4 $tp --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type allgather" \
  "4 $tp --context-parallel-size 2" "2 $tp --recompute-granularity selective --recompute-modules core_attn"
layouts moe "--seq-length 6 --micro-batch-size 1" -- "2 $tp"
layouts moe "--seq-length 12 --micro-batch-size 2" -- "4 --tensor-model-parallel-size 4 --sequence-parallel"
# MOECORE_TP_OVERLAP_GEMMS=chunks: the GEMMs per chunk, as on a GPU (OpenBLAS may round some rows
# differently with fewer of them, so within 1e-5 of the plain run, not bit for bit)
chunked() {  # label np flags...: the run "plain" before, "ranks" with the GEMMs per chunk
  local label=$1 np=$2; shift 2
  rm -rf "$dir/ckpt_plain" "$dir/ckpt_ranks"
  run plain "$np" "$@" --save "$dir/ckpt_plain"
  MOECORE_TP_OVERLAP_GEMMS=chunks run ranks "$np" "$@" --tp-comm-overlap --save "$dir/ckpt_ranks"
  paste <(values "$dir/ranks.jsonl") <(values "$dir/plain.jsonl") | agree 1e-5 ||
    { echo "FAIL: $label: the GEMMs per chunk differ from the plain run"; exit 1; }
  echo "$label: --tp-comm-overlap with the GEMMs per chunk within 1e-5 of the plain run"
}
chunked "dense np 2 TP2+SP" 2 "${dense[@]}" $tp
chunked "moe np 4 TP4+SP, uneven chunks" 4 "${moe[@]}" --seq-length 12 --micro-batch-size 2 \
  --tensor-model-parallel-size 4 --sequence-parallel
chunked "moe np 4 TP2+SP CP2, core_attn recomputed" 4 "${moe[@]}" $tp --context-parallel-size 2 \
  --recompute-granularity selective --recompute-modules core_attn
echo PASS

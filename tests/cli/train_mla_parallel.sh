#!/usr/bin/env bash
# Multi-Latent Attention (q-lora with the latent norms, YaRN) in a tiny MoE model with DeepSeek's
# routing (sigmoid, expert bias, groups, shared expert, a dense first layer), under mpirun (CPU
# ranks): TP2+SP, CP2, PP2, EP2, TP2+SP CP2 and TP2+SP PP2 EP2 print the single-rank run's lm
# loss, load_balancing_loss and grad norm (2e-5 relative) for 3 iterations; the plain query
# projection (--q-lora-rank 0) and --recompute-modules mla_up_proj likewise under TP2+SP. A
# checkpoint saved by TP2+SP CP2 EP2 resumes on one rank to the uninterrupted losses, and one
# rank's resumes bit-identically on one rank; `generate` reads both to the same tokens.
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
mla=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
     --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-layers 4 --moe-layer-freq "[0,1,1,1]"
     --multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8
     --v-head-dim 10 --qk-layernorm --rope-type yarn --rotary-scaling-factor 4 --original-max-position-embeddings 16
     --mscale 0.9 --mscale-all-dim 0.7 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
     --moe-router-num-groups 2 --moe-router-group-topk 1 --moe-shared-expert-intermediate-size 32
     --moe-router-load-balancing-type seq_aux_loss)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=3
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
layouts() {  # extra-flags -- layouts (each "np flags...")
  local extra=$1; shift 2
  read -r -a x <<<"$extra"
  run single 1 "${mla[@]}" "${x[@]}"
  for layout in "$@"; do
    read -r -a c <<<"$layout"
    run ranks "${c[0]}" "${mla[@]}" "${x[@]}" "${c[@]:1}"
    check 2e-5 "mla ${extra:+($extra) }np ${c[*]}"
  done
}
tp="--tensor-model-parallel-size 2 --sequence-parallel"
ep="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
layouts "" -- "2 $tp" "2 --context-parallel-size 2" "2 --pipeline-model-parallel-size 2" "2 $ep" \
  "4 $tp --context-parallel-size 2" "8 $tp --pipeline-model-parallel-size 2 $ep"
layouts "--q-lora-rank 0" -- "2 $tp" "2 --context-parallel-size 2"
layouts "--recompute-granularity selective --recompute-modules mla_up_proj" -- "2 $tp"
# checkpoints: TP2+SP CP2 EP2 saves after 2 of 4 iterations; one rank resumes
sched=(--lr-decay-iters 4)
run single 1 "${mla[@]}" "${sched[@]}" --train-iters 4
run save 4 "${mla[@]}" "${sched[@]}" --train-iters 2 $tp --context-parallel-size 2 $ep --save "$dir/ckpt-tp"
run resumed 1 "${mla[@]}" "${sched[@]}" --train-iters 4 --load "$dir/ckpt-tp"
paste <(values "$dir/resumed.jsonl" | tail -n 6) <(values "$dir/single.jsonl" | tail -n 6) | agree 2e-5 ||
  { echo "FAIL: the TP2+SP CP2 EP2 checkpoint resumed on one rank differs from the uninterrupted run"; exit 1; }
echo "mla TP2+SP CP2 EP2 checkpoint resumed on one rank: same losses as one rank"
run save 1 "${mla[@]}" "${sched[@]}" --train-iters 2 --save "$dir/ckpt-one"
run resumed 1 "${mla[@]}" "${sched[@]}" --train-iters 4 --load "$dir/ckpt-one"
cmp <(values "$dir/resumed.jsonl" | tail -n 6) <(values "$dir/single.jsonl" | tail -n 6) ||
  { echo "FAIL: the one-rank checkpoint did not resume bit-identically"; exit 1; }
echo "mla one-rank checkpoint resumed on one rank: bit-identical losses"
# generation reads the TP2+SP CP2 EP2 checkpoint on one rank: the one-rank checkpoint's tokens
# (the KV cache against the full recompute: tests/cli/generate_kv_cache.sh)
for c in ckpt-tp ckpt-one; do
  "$bin" generate --load "$dir/$c" --prompt-ids "1 2 3" --max-new-tokens 8 --temperature 0 --device cpu > "$dir/gen-$c.txt" 2>&1 ||
    { cat "$dir/gen-$c.txt"; echo "FAIL: generate from $c"; exit 1; }
done
cmp -s "$dir/gen-ckpt-tp.txt" "$dir/gen-ckpt-one.txt" || { diff "$dir/gen-ckpt-tp.txt" "$dir/gen-ckpt-one.txt"; echo "FAIL: generations differ"; exit 1; }
echo "mla generate from the TP2+SP CP2 EP2 checkpoint: the one-rank checkpoint's tokens"
echo "PASS"

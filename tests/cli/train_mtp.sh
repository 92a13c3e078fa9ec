#!/usr/bin/env bash
# Multi-token prediction (--mtp-num-layers) on the tiny MoE preset (untied output layer), CPU:
# - one rank: each depth's loss in the log line ("mtp_1 loss") and metrics.jsonl ("mtp_1_loss");
# - TP2+SP, CP2, PP2 (the modules on the last stage, the word embedding's copy there summed with
#   the first stage's; tied or not; virtual stages), EP2 (alltoall and allgather), TP2+SP CP2
#   PP2 EP2 on 8 ranks (also with Multi-Latent Attention), and the distributed optimizer with
#   overlap on PP2: the single-rank run's
#   lm loss, every depth's MTP loss, load_balancing_loss and grad norm (2e-5 relative) for 3
#   iterations, with 2 depths;
# - a checkpoint saved at iteration 2 resumes bit-identically on one rank, and a PP2 one on one
#   rank to the uninterrupted losses; `moecore generate` reads an MTP checkpoint; the HF export
#   refuses its MTP tensors.
# (--mtp-loss-scaling-factor 0 still trains the main model differently: the MTP layer's MoE
# balancing loss reaches the main model through hnorm, as in Megatron.)
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
moe=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
     --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3)
values() {
  grep -o '"lm_loss":[^,}]*\|"mtp_[0-9]_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2
}
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
check() {  # label: the last run's values against the single-rank one's
  paste <(values "$dir/ranks.jsonl") <(values "$dir/single.jsonl") | agree 2e-5 ||
    { echo "FAIL: $1 differs from one rank"; exit 1; }
  echo "$1: same lm, mtp_1, mtp_2 and balancing losses and grad norm as one rank"
}

# one rank: the losses logged, 5 values an iteration (lm, mtp_1, mtp_2, balancing, grad norm)
run single 1 "${moe[@]}"
[ "$(values "$dir/single.jsonl" | wc -l)" -eq 15 ] || { cat "$dir/single.log"; echo "FAIL: expected 5 values x 3 iterations"; exit 1; }
grep -q "lm loss: [^|]* | mtp_1 loss: [^|]* | mtp_2 loss: [^|]* |" "$dir/single.log" ||
  { cat "$dir/single.log"; echo "FAIL: no mtp_1 / mtp_2 loss in the log line"; exit 1; }
echo "one rank: mtp_1 and mtp_2 losses in the log line and metrics"

# the layouts, against the single-rank run
tp="--tensor-model-parallel-size 2 --sequence-parallel"
for layout in "2 $tp" "2 --context-parallel-size 2" "2 --pipeline-model-parallel-size 2" \
              "2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
              "2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather" \
              "8 $tp --context-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
              "4 --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"; do
  read -r -a c <<<"$layout"
  run ranks "${c[0]}" "${moe[@]}" "${c[@]:1}"
  check "np ${c[*]}"
done
# tied output layer on PP2 (the copy serves both the output layer and the MTP modules)
grep -v "untie-embeddings" "$src/configs/tiny.yaml" > "$dir/tied.yaml"
tiny="$src/configs/tiny.yaml"
tied=("${moe[@]/"$tiny"/"$dir/tied.yaml"}")
run single 1 "${tied[@]}"
run ranks 2 "${tied[@]}" --pipeline-model-parallel-size 2
check "tied embeddings, np 2 --pipeline-model-parallel-size 2"
# virtual pipeline stages (4 layers, PP2 x 2 chunks: the modules in rank 1's second chunk)
run single 1 "${moe[@]}" --num-layers 4
run ranks 2 "${moe[@]}" --num-layers 4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2
check "4 layers, np 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
# Multi-Latent Attention (the MTP layers' attention is MLA too) on 8 ranks, TP2+SP CP2 PP2 EP2
mla=(--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
     --v-head-dim 16 --qk-layernorm)
run single 1 "${moe[@]}" "${mla[@]}"
run ranks 8 "${moe[@]}" "${mla[@]}" $tp --context-parallel-size 2 --pipeline-model-parallel-size 2 \
  --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
check "MLA, np 8 TP2+SP CP2 PP2 EP2"

# checkpoints: one rank saves at 2 and resumes to 4 bit-identically; PP2 saves, one rank resumes
sched=(--lr-decay-iters 4 --train-iters 4)
run single 1 "${moe[@]}" "${sched[@]}" --save "$dir/ckpt-one" --save-interval 2
run resumed 1 "${moe[@]}" "${sched[@]}" --load "$dir/ckpt-one/iter_0000002"
cmp -s <(values "$dir/resumed.jsonl") <(values "$dir/single.jsonl" | tail -n 10) ||
  { paste <(values "$dir/resumed.jsonl") <(values "$dir/single.jsonl" | tail -n 10); echo "FAIL: resume differs"; exit 1; }
echo "one-rank checkpoint: the resumed iterations are bit-identical"
run save 2 "${moe[@]}" "${sched[@]}" --pipeline-model-parallel-size 2 --save "$dir/ckpt-pp" --save-interval 2
run resumed 1 "${moe[@]}" "${sched[@]}" --load "$dir/ckpt-pp/iter_0000002"
paste <(values "$dir/resumed.jsonl") <(values "$dir/single.jsonl" | tail -n 10) | agree 2e-5 ||
  { echo "FAIL: the PP2 checkpoint resumed on one rank differs"; exit 1; }
echo "PP2 checkpoint resumed on one rank: the uninterrupted losses"
"$bin" generate --load "$dir/ckpt-one" --prompt-ids "1 2 3" --max-new-tokens 4 --temperature 0 --device cpu \
  > "$dir/gen.txt" 2>&1 || { cat "$dir/gen.txt"; echo "FAIL: generate from an MTP checkpoint"; exit 1; }
echo "generate reads an MTP checkpoint"
# the HF export has no MTP names for these architectures: refused, naming the tensor
if out=$("$bin" convert --from moecore --to hf --input "$dir/ckpt-one" --output "$dir/hf" 2>&1); then
  echo "FAIL: exported an MTP checkpoint to HF"; exit 1; fi
grep -q "tensor 'mtp.layers.0.enorm.weight' that has no" <<<"$out" || { echo "$out"; echo "FAIL: no message naming the MTP tensor"; exit 1; }
echo "HF export of an MTP checkpoint refused, naming the tensor"

echo "PASS"

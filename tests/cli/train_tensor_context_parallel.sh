#!/usr/bin/env bash
# Tensor, sequence and context parallelism, folded with expert and pipeline parallelism, under
# mpirun (CPU ranks). Every layout prints the single-rank run's lm loss, load_balancing_loss and
# grad norm (2e-5 relative; bf16 1e-3) for 3 iterations:
#   MoE (configs/tiny.yaml, micro-batch 4: the sequence gathers reorder): TP2+SP; CP2; TP2+SP
#   with EP4 ETP1 (EP folded over TP, alltoall) and EP2 allgather; TP2+SP CP2; TP2 CP2 PP2 with
#   EP4 on 8 ranks; overlap and the distributed optimizer with TP and CP, and both together (with
#   EP, TP, PP, tied embeddings across stages); seq_aux_loss + z-loss,
#   global_aux_loss, input jitter (drawn by global token index), shared expert with gate +
#   sigmoid router + expert bias, all on TP2+SP CP2;
#   the 16-rank worked example TP2 CP2 DP2 PP2 / ETP1 EP4 EDP2 PP2.
#   Dense (biases, LayerNorm, learned positions, GQA 4/2, qk-layernorm, tied embeddings): TP2
#   without SP, TP2+SP CP2, CP2 with DP2, bf16 with the distributed optimizer.
# A checkpoint saved by TP2+SP CP2 EP2 resumes on one rank and on TP2 PP2, and one rank's on
# TP2+SP CP2, to the uninterrupted single-rank losses; `moecore generate` reads the TP/CP
# checkpoint on one rank (the same greedy tokens). The fused output layer in several chunks and the
# plain one agree under TP2+SP CP2. Refusals name their flags (and a mixed MOECORE_FUSED_HEAD).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
moe=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
     --eval-interval 0 --micro-batch-size 4 --global-batch-size 16)
dense=(train --mock-data --vocab-size 128 --seq-length 32 --num-layers 2 --hidden-size 64 --num-attention-heads 4
       --group-query-attention --num-query-groups 2 --normalization LayerNorm --position-embedding-type learned_absolute
       --qk-layernorm --ffn-hidden-size 96 --device cpu --train-iters 3 --lr 3e-3 --lr-warmup-iters 1 --log-interval 1
       --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --clip-grad 1.0)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=3
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
layouts() {  # model-array-name extra-flags -- layouts (each "np flags...")
  local -n model=$1; local name=$1 extra=$2; shift 3
  read -r -a x <<<"$extra"
  run single 1 "${model[@]}" "${x[@]}"
  for layout in "$@"; do
    read -r -a c <<<"$layout"
    run ranks "${c[0]}" "${model[@]}" "${x[@]}" "${c[@]:1}"
    check 2e-5 "$name ${extra:+($extra) }np ${c[*]}"
  done
}
tp="--tensor-model-parallel-size 2 --sequence-parallel"
layouts moe "" -- "2 $tp" "2 --context-parallel-size 2" "4 $tp --context-parallel-size 2" \
  "4 $tp --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall" \
  "4 $tp --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather" \
  "8 $tp --context-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall" \
  "4 $tp --overlap-grad-reduce" "4 --context-parallel-size 2 --use-distributed-optimizer" \
  "4 --context-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-grad-reduce" \
  "2 --context-parallel-size 2 --overlap-grad-reduce" "2 $tp --overlap-grad-reduce" \
  "4 --use-distributed-optimizer --overlap-grad-reduce" \
  "4 --use-distributed-optimizer --overlap-grad-reduce --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
  "4 $tp --use-distributed-optimizer --overlap-grad-reduce" \
  "8 --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
# the fused output layer in several uneven chunks (5 rows) and the plain one, under TP2+SP CP2
run single 1 "${moe[@]}"
MOECORE_FUSED_HEAD_ROWS=5 run ranks 4 "${moe[@]}" $tp --context-parallel-size 2
check 2e-5 "moe, fused output layer in chunks of 5 rows, np 4 $tp --context-parallel-size 2"
MOECORE_FUSED_HEAD=0 run ranks 4 "${moe[@]}" $tp --context-parallel-size 2
check 2e-5 "moe, plain output layer, np 4 $tp --context-parallel-size 2"
for extra in "--moe-router-load-balancing-type seq_aux_loss --moe-z-loss-coeff 1e-3" \
             "--moe-router-load-balancing-type global_aux_loss" "--moe-input-jitter-eps 0.1" \
             "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate --moe-router-score-function sigmoid --moe-router-enable-expert-bias"; do
  layouts moe "$extra" -- "4 $tp --context-parallel-size 2"
done
# the worked example of 16 ranks: TP2 CP2 DP2 PP2 for attention, ETP1 EP4 EDP2 PP2 for experts
layouts moe "" -- "16 $tp --context-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall"
grep -q "tensor-parallel size 2 (sequence parallel), context-parallel size 2" "$dir/ranks.log" ||
  { cat "$dir/ranks.log"; echo "FAIL: layout not logged"; exit 1; }
layouts dense "" -- "2 --tensor-model-parallel-size 2" "4 $tp --context-parallel-size 2" "4 --context-parallel-size 2" \
  "4 --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce"
layouts dense "--untie-embeddings-and-output-weights" -- "4 --tensor-model-parallel-size 2 --context-parallel-size 2"
# bf16 (fp32 masters, distributed optimizer sharding the masters): against one bf16 rank, 1e-3
run single 1 "${dense[@]}" --bf16
run ranks 4 "${dense[@]}" --bf16 $tp --use-distributed-optimizer
check 1e-3 "dense bf16 np 4 $tp --use-distributed-optimizer"
# checkpoints hold full tensors: TP2+SP CP2 EP2 saves; one rank and TP2 PP2 resume; a single
# rank's checkpoint resumes on TP2+SP CP2
sched=(--lr-decay-iters 4)
run single 1 "${moe[@]}" "${sched[@]}" --train-iters 4
tail_values() { values "$1" | tail -n 6; }
resume_check() {  # label checkpoint np flags...
  local label=$1 ckpt=$2 np=$3; shift 3
  run resumed "$np" "${moe[@]}" "${sched[@]}" --train-iters 4 --load "$ckpt" "$@"
  paste <(tail_values "$dir/resumed.jsonl") <(tail_values "$dir/single.jsonl") | agree 2e-5 ||
    { echo "FAIL: $label resumed on np $np $* differs from the uninterrupted run"; exit 1; }
  echo "$label resumed on np $np $*: same losses as one rank"
}
run save 4 "${moe[@]}" "${sched[@]}" --train-iters 2 $tp --context-parallel-size 2 --expert-model-parallel-size 2 \
  --moe-token-dispatcher-type alltoall --save "$dir/ckpt-tp"
resume_check "TP2+SP CP2 EP2 checkpoint" "$dir/ckpt-tp" 1
resume_check "TP2+SP CP2 EP2 checkpoint" "$dir/ckpt-tp" 4 $tp --pipeline-model-parallel-size 2
# generation reads the TP2+SP CP2 checkpoint on one rank: the same tokens as from the one-rank
# checkpoint of the same run (greedy)
"$bin" generate --load "$dir/ckpt-tp" --prompt-ids "1 2 3" --max-new-tokens 8 --temperature 0 --device cpu \
  > "$dir/gen-tp.txt" 2>&1 || { cat "$dir/gen-tp.txt"; echo "FAIL: generate from a TP/CP checkpoint"; exit 1; }
# pipeline stages with TP, the distributed optimizer and overlap save; one rank resumes
run save 8 "${moe[@]}" "${sched[@]}" --train-iters 2 $tp --pipeline-model-parallel-size 2 --use-distributed-optimizer \
  --overlap-grad-reduce --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --save "$dir/ckpt-pp-tp"
resume_check "TP2+SP PP2 EP2 distributed-optimizer checkpoint" "$dir/ckpt-pp-tp" 1
run save 1 "${moe[@]}" "${sched[@]}" --train-iters 2 --save "$dir/ckpt-one"
"$bin" generate --load "$dir/ckpt-one" --prompt-ids "1 2 3" --max-new-tokens 8 --temperature 0 --device cpu \
  > "$dir/gen-one.txt" 2>&1 || { cat "$dir/gen-one.txt"; exit 1; }
cmp -s "$dir/gen-tp.txt" "$dir/gen-one.txt" || { diff "$dir/gen-tp.txt" "$dir/gen-one.txt"; echo "FAIL: generations differ"; exit 1; }
echo "generate from the TP2+SP CP2 checkpoint: the one-rank checkpoint's tokens"
resume_check "single-rank checkpoint" "$dir/ckpt-one" 4 $tp --context-parallel-size 2
# refusals name the flag
refuse() {  # expected-text np flags...
  local want=$1 np=$2; shift 2
  if out=$(timeout 60 "$mpiexec" -np "$np" "$bin" "$@" 2>&1); then echo "FAIL: ran: $*"; exit 1; fi
  grep -q -- "$want" <<<"$out" || { echo "$out"; echo "FAIL: no message '$want'"; exit 1; }
}
refuse "need --sequence-parallel" 2 "${moe[@]}" --tensor-model-parallel-size 2
refuse "must be divisible by 2 x --context-parallel-size" 2 "${moe[@]}" --context-parallel-size 2 --seq-length 30
refuse "must divide --num-attention-heads" 4 "${dense[@]}" --tensor-model-parallel-size 4
refuse "does not divide the vocabulary" 2 "${dense[@]}" --tensor-model-parallel-size 2 --vocab-size 127
refuse "does not divide the 3 launched ranks" 3 "${moe[@]}" $tp
# ranks that disagree on an environment switch that changes the collectives are refused
if out=$(timeout 60 "$mpiexec" -np 1 env MOECORE_FUSED_HEAD=0 "$bin" "${moe[@]}" --context-parallel-size 2 : \
    -np 1 "$bin" "${moe[@]}" --context-parallel-size 2 2>&1); then echo "FAIL: mixed MOECORE_FUSED_HEAD ran"; exit 1; fi
grep -q "MOECORE_FUSED_HEAD" <<<"$out" || { echo "$out"; echo "FAIL: no message naming MOECORE_FUSED_HEAD"; exit 1; }
echo "PASS"

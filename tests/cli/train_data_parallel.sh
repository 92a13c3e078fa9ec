#!/usr/bin/env bash
# Data, expert, expert-tensor and pipeline parallelism under mpirun (CPU ranks). DP=2 and DP=4
# (dense and MoE), EP=4, EP=2 with the distributed optimizer, EP=2 with the allgather
# dispatcher, EP=4 with global_aux_loss, --overlap-grad-reduce (DP=4, EP=2), ETP=2 and
# EP=2 x ETP=2 (both dispatchers, distributed optimizer) print the single-rank run's lm loss,
# load_balancing_loss and grad norm (within 2e-5 relative) for 3 iterations; checkpoints saved
# by EP=2 + distributed optimizer and by EP=2 x ETP=2 resume under other layouts to the
# single-rank losses; ranks started with different flags are refused;
# a rank that fails stops every rank with its message; a killed rank stops every rank;
# PP=2, PP=4, virtual stages, PP x EP and PP x DP print the single-rank values (validation too)
# and PP checkpoints resume under other layouts; so do uneven stages (--decoder-first/last-
# pipeline-num-layers, with virtual stages too) and tied embeddings across the stages (PP=2, PP=4,
# PP x DP with the distributed optimizer or overlap; a tied PP checkpoint resumes on one rank and PP=4);
# generate opens a checkpoint trained with --overlap-param-gather.
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
. "$(dirname "$0")/layout_compare.sh"  # agree TOL: two values a line within TOL relative (a missing one fails)
compare() {  # file_a file_b [relative tolerance, default 2e-5]
  paste <(values "$1") <(values "$2") | agree "${3:-2e-5}"
}
for variant in moe "moe-sigmoid-bias" dense; do
  extra=()
  [ "$variant" = "moe-sigmoid-bias" ] && extra=(--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-z-loss-coeff 1e-3)
  [ "$variant" = dense ] && extra=(--num-experts 0)
  rm -f "$dir/single.jsonl"  # the metrics file is appended to
  "$bin" "${base[@]}" "${extra[@]}" --metrics-file "$dir/single.jsonl" > "$dir/single.log" 2>&1 || { cat "$dir/single.log"; exit 1; }
  [ "$(values "$dir/single.jsonl" | wc -l)" -ge 3 ] || { echo "FAIL: no losses logged"; exit 1; }
  for np in 2 4; do
    rm -f "$dir/dp.jsonl"
    "$mpiexec" -np $np "$bin" "${base[@]}" "${extra[@]}" --metrics-file "$dir/dp.jsonl" > "$dir/dp.log" 2>&1 || { cat "$dir/dp.log"; exit 1; }
    grep -q "$np data-parallel rank(s)" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: not $np ranks"; exit 1; }
    compare "$dir/dp.jsonl" "$dir/single.jsonl" || { echo "FAIL: $variant DP=$np differs from one rank"; exit 1; }
    echo "$variant DP=$np: same losses as one rank"
  done
done
# different flags on different ranks
if out=$(timeout 60 "$mpiexec" -np 1 "$bin" "${base[@]}" --seed 1 : -np 1 "$bin" "${base[@]}" --seed 2 2>&1); then
  echo "FAIL: ranks with different flags ran"; exit 1; fi
grep -q "started with different flags" <<<"$out" || { echo "$out"; echo "FAIL: no message"; exit 1; }
# one rank fails after start-up (same flags; its working directory lacks the dataset): every
# rank stops, with that rank's message
mkdir -p "$dir/with" "$dir/without"
echo '{"text": "one two three four five six seven eight nine ten eleven twelve"}' > "$dir/c.jsonl"
for i in $(seq 1 50); do echo "{\"text\": \"line $i of a small corpus for the data-parallel failure test\"}"; done >> "$dir/c.jsonl"
"$bin" preprocess --input "$dir/c.jsonl" --json-keys text --tokenizer-type ByteTokenizer --output-prefix "$dir/with/c" --append-eod > /dev/null
text=(train --device cpu --train-iters 2 --data-path c_text_document --tokenizer-type ByteTokenizer --seq-length 16
      --num-layers 1 --hidden-size 16 --num-attention-heads 2 --micro-batch-size 1 --global-batch-size 2)
start=$(date +%s)
if out=$(timeout 60 "$mpiexec" -np 1 --wdir "$dir/with" "$bin" "${text[@]}" : -np 1 --wdir "$dir/without" "$bin" "${text[@]}" 2>&1); then
  echo "$out"; echo "FAIL: a failing rank did not fail the job"; exit 1; fi
[ $(( $(date +%s) - start )) -lt 50 ] || { echo "FAIL: took too long (hang?)"; exit 1; }
grep -q "c_text_document" <<<"$out" && grep -q "rank 1 failed; stopping every rank" <<<"$out" ||
  { echo "$out"; echo "FAIL: the failing rank's message is missing"; exit 1; }
# expert parallelism: name, ranks, flags; each against the single-rank run of the same model
run_single() {  # extra flags...
  rm -f "$dir/single.jsonl"
  "$bin" "${base[@]}" "$@" --metrics-file "$dir/single.jsonl" > "$dir/single.log" 2>&1 || { cat "$dir/single.log"; exit 1; }
}
run_ranks() {  # np extra flags...
  local np=$1; shift
  rm -f "$dir/dp.jsonl"
  "$mpiexec" -np "$np" "$bin" "${base[@]}" "$@" --metrics-file "$dir/dp.jsonl" > "$dir/dp.log" 2>&1 || { cat "$dir/dp.log"; exit 1; }
}
run_single
for case in "4 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall" \
            "4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer" \
            "2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather" \
            "4 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather --use-distributed-optimizer" \
            "4 --use-distributed-optimizer" \
            "4 --overlap-grad-reduce" \
            "4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
            "4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-grad-reduce" \
            "2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall" \
            "4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer" \
            "4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"; do
  read -r -a c <<<"$case"
  run_ranks "${c[@]}"
  grep -q "expert-parallel size ${c[2]:-1}" "$dir/dp.log" || [ "${c[1]}" != --expert-model-parallel-size ] ||
    { cat "$dir/dp.log"; echo "FAIL: EP not in use"; exit 1; }
  grep -q "expert-tensor-parallel size ${c[2]:-1}" "$dir/dp.log" || [ "${c[1]}" != --expert-tensor-parallel-size ] || { cat "$dir/dp.log"; echo "FAIL: EP not in use"; exit 1; }
  compare "$dir/dp.jsonl" "$dir/single.jsonl" || { echo "FAIL: np=$case differs from one rank"; exit 1; }
  echo "np=$case: same losses and grad norm as one rank"
done
# global_aux_loss balances over the whole global batch: one rank with the batch as one
# micro-batch is the reference.
run_single --moe-router-load-balancing-type global_aux_loss --micro-batch-size 16
run_ranks 4 --moe-router-load-balancing-type global_aux_loss --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
compare "$dir/dp.jsonl" "$dir/single.jsonl" || { echo "FAIL: EP=4 global_aux_loss differs from one rank"; exit 1; }
echo "np=4 EP=4 global_aux_loss: same losses and grad norm as one rank"
# MOECORE_COMM_TIMERS=1 (measurements: a barrier of the group and device synchronisations around
# every dispatch collective) changes no value and logs the last step's dispatch time (> 0) with
# its waiting part (part of the total by construction: only its presence is checked); with ETP
# the EP, ETP and ETP x EP groups' barriers pair up.
run_single
for case in "4 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall" \
            "4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
            "4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"; do
  read -r -a c <<<"$case"
  MOECORE_COMM_TIMERS=1 run_ranks "${c[@]}"
  compare "$dir/dp.jsonl" "$dir/single.jsonl" || { echo "FAIL: np=$case with MOECORE_COMM_TIMERS=1 differs from one rank"; exit 1; }
  timed=$(grep -o "dispatch communication (ms, last step): [0-9.]* ([0-9]*% of the average step; waiting for the slowest rank: [0-9.]*)" "$dir/dp.log" | tail -1)
  [ -n "$timed" ] || { cat "$dir/dp.log"; echo "FAIL: np=$case: no dispatch time in the log"; exit 1; }
  total=$(sed 's/.*step): \([0-9.]*\) .*/\1/' <<<"$timed")
  awk -v t="$total" 'BEGIN { exit !(t > 0) }' || { echo "FAIL: np=$case: no dispatch time measured: $timed"; exit 1; }
  echo "np=$case, MOECORE_COMM_TIMERS=1: same losses; $timed"
done
# checkpoints hold full tensors: EP=2 + distributed optimizer saves, EP=2 on 2 ranks and one
# rank resume; both continue exactly as an uninterrupted single-rank run.
sched=(--lr-decay-iters 4)
rm -f "$dir/single.jsonl"
"$bin" "${base[@]}" "${sched[@]}" --train-iters 4 --metrics-file "$dir/single.jsonl" > "$dir/single.log" 2>&1 || { cat "$dir/single.log"; exit 1; }
"$mpiexec" -np 4 "$bin" "${base[@]}" "${sched[@]}" --train-iters 2 --expert-model-parallel-size 2 \
  --use-distributed-optimizer --save "$dir/ckpt" > "$dir/save.log" 2>&1 || { cat "$dir/save.log"; exit 1; }
tail_values() { values "$1" | tail -n 6; }
for layout in "2 --expert-model-parallel-size 2 --use-distributed-optimizer" "1" \
              "4 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2"; do
  read -r -a c <<<"$layout"
  rm -f "$dir/resumed.jsonl"
  "$mpiexec" -np "${c[0]}" "$bin" "${base[@]}" "${sched[@]}" "${c[@]:1}" --train-iters 4 --load "$dir/ckpt" \
    --metrics-file "$dir/resumed.jsonl" > "$dir/resume.log" 2>&1 || { cat "$dir/resume.log"; exit 1; }
  paste <(tail_values "$dir/resumed.jsonl") <(tail_values "$dir/single.jsonl") | agree 2e-5 ||
    { echo "FAIL: resumed (np ${c[*]}) differs from the uninterrupted run"; exit 1; }
  echo "checkpoint of EP=2 + distributed optimizer resumed on np ${c[*]}: same losses as one rank"
done
# ... and one saved by EP=2 x ETP=2 resumes on one rank
"$mpiexec" -np 4 "$bin" "${base[@]}" "${sched[@]}" --train-iters 2 --expert-model-parallel-size 2 \
  --expert-tensor-parallel-size 2 --save "$dir/ckpt-etp" > "$dir/save.log" 2>&1 || { cat "$dir/save.log"; exit 1; }
rm -f "$dir/resumed.jsonl"
"$bin" "${base[@]}" "${sched[@]}" --train-iters 4 --load "$dir/ckpt-etp" --metrics-file "$dir/resumed.jsonl" > "$dir/resume.log" 2>&1 ||
  { cat "$dir/resume.log"; exit 1; }
paste <(tail_values "$dir/resumed.jsonl") <(tail_values "$dir/single.jsonl") | agree 2e-5 ||
  { echo "FAIL: the EP=2 x ETP=2 checkpoint resumed on one rank differs"; exit 1; }
echo "checkpoint of EP=2 x ETP=2 resumed on one rank: same losses as one rank"
# bf16 compute (fp32 masters): the distributed optimizer shards the masters too and all-gathers
# bf16 weights; DP=4 and EP=2 (+ PP=2) against one bf16 rank, and a checkpoint round trip; EP=2 on
# 2 ranks (expert shards of one rank: no gather) with whole and split masters.
# Tolerance 1e-3: a gradient norm summed in another order (per pipeline stage) changes the
# clipping factor in its last bits, which can flip a bf16 rounding of a weight (fp32 layouts
# above agree to 2e-5; a wrong shard would be off by far more).
run_single --bf16
for case in "4 --bf16 --use-distributed-optimizer" \
            "4 --bf16 --use-distributed-optimizer --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
            "4 --bf16 --use-distributed-optimizer --pipeline-model-parallel-size 2 --expert-model-parallel-size 2" \
            "2 --bf16 --use-distributed-optimizer --no-store-param-remainders --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall" \
            "4 --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
            "4 --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --pipeline-model-parallel-size 2 --expert-model-parallel-size 2"; do
  read -r -a c <<<"$case"
  run_ranks "${c[@]}"
  compare "$dir/dp.jsonl" "$dir/single.jsonl" 1e-3 || { echo "FAIL: np=$case differs from one bf16 rank"; exit 1; }
  echo "np=$case: same losses and grad norm as one bf16 rank"
done
# A checkpoint trained with --overlap-param-gather opens for generation: the run's flags that do
# not describe the model are not applied there (this one was, and its check then refused).
run_ranks 2 --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --save "$dir/ckpt-opg"
"$bin" generate --load "$dir/ckpt-opg" --prompt-ids "1 2 3" --max-new-tokens 4 --temperature 0 --device cpu \
  > "$dir/gen-opg.txt" 2>&1 || { cat "$dir/gen-opg.txt"; echo "FAIL: generate from an --overlap-param-gather checkpoint"; exit 1; }
echo "generate reads a checkpoint trained with --overlap-param-gather"
# The CPU's fp64 router with bf16 compute: its weight is the (whole or split) fp32 master widened,
# kept whole beside the shards by the distributed optimizer.
for masters in "" "--no-store-param-remainders"; do
  # shellcheck disable=SC2086
  run_single --bf16 --moe-router-dtype fp64 $masters
  # shellcheck disable=SC2086
  run_ranks 2 --bf16 --moe-router-dtype fp64 $masters --use-distributed-optimizer
  compare "$dir/dp.jsonl" "$dir/single.jsonl" 1e-3 || { echo "FAIL: fp64 router, bf16, distributed [$masters] differs"; exit 1; }
  echo "np=2 bf16 + fp64 router + distributed optimizer [${masters:-split masters}]: same losses and grad norm as one rank"
done
# bf16 AdamW states (precision-aware optimizer): sharded by the distributed optimizer as on one rank.
bf16_states=(--bf16 --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16)
run_single "${bf16_states[@]}"
run_ranks 4 "${bf16_states[@]}" --use-distributed-optimizer --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
grep -q "exp_avg in bf16, exp_avg_sq in bf16" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: bf16 states not in use"; exit 1; }
compare "$dir/dp.jsonl" "$dir/single.jsonl" 1e-3 || { echo "FAIL: bf16 AdamW states on 4 ranks differ from one rank"; exit 1; }
echo "np=4 bf16 AdamW states + distributed optimizer + EP=2: same losses and grad norm as one rank"
rm -f "$dir/single.jsonl"
"$bin" "${base[@]}" --bf16 "${sched[@]}" --train-iters 4 --metrics-file "$dir/single.jsonl" > "$dir/single.log" 2>&1 || { cat "$dir/single.log"; exit 1; }
"$mpiexec" -np 4 "$bin" "${base[@]}" --bf16 "${sched[@]}" --train-iters 2 --use-distributed-optimizer \
  --expert-model-parallel-size 2 --save "$dir/ckpt-bf16" > "$dir/save.log" 2>&1 || { cat "$dir/save.log"; exit 1; }
for layout in "1" "4 --use-distributed-optimizer"; do
  read -r -a c <<<"$layout"
  rm -f "$dir/resumed.jsonl"
  "$mpiexec" -np "${c[0]}" "$bin" "${base[@]}" --bf16 "${sched[@]}" "${c[@]:1}" --train-iters 4 --load "$dir/ckpt-bf16" \
    --metrics-file "$dir/resumed.jsonl" > "$dir/resume.log" 2>&1 || { cat "$dir/resume.log"; exit 1; }
  paste <(tail_values "$dir/resumed.jsonl") <(tail_values "$dir/single.jsonl") | agree 1e-3 ||
    { echo "FAIL: bf16 sharded-master checkpoint resumed on np ${c[*]} differs"; exit 1; }
  echo "bf16 checkpoint of EP=2 + distributed optimizer resumed on np ${c[*]}: same losses as one rank"
done
# pipeline parallelism (4 layers): PP=2, PP=4, PP=2 with virtual stages, PP=2 x EP=2 with the
# distributed optimizer, PP=2 x DP=2 with virtual stages and overlap, against one rank;
# validation losses too
pipe=(--num-layers 4 --micro-batch-size 2 --eval-interval 2 --eval-iters 2)
values_all() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*\|"valid_lm_loss":[^,}]*' "$1" | cut -d: -f2; }
run_single "${pipe[@]}"
[ "$(values_all "$dir/single.jsonl" | wc -l)" -eq 11 ] || { cat "$dir/single.jsonl"; echo "FAIL: expected 9 training and 2 validation values"; exit 1; }
for case in "2 --pipeline-model-parallel-size 2" "4 --pipeline-model-parallel-size 4" \
            "2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1" \
            "4 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer" \
            "4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --overlap-grad-reduce" \
            "8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall --use-distributed-optimizer"; do
  read -r -a c <<<"$case"
  run_ranks "${c[@]}" "${pipe[@]}"
  grep -q "pipeline stages" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: no pipeline"; exit 1; }
  paste <(values_all "$dir/dp.jsonl") <(values_all "$dir/single.jsonl") | agree 2e-5 ||
    { echo "FAIL: np=$case differs from one rank"; exit 1; }
  echo "np=$case: same losses, grad norm and validation loss as one rank"
done
# the virtual-stage schedules: interleaved 1F1B when the micro-batches divide by the stages
# (above), all-forward-all-backward otherwise (3 micro-batches on 2 stages)
odd=(--global-batch-size 6)
run_single "${pipe[@]}" "${odd[@]}"
run_ranks 2 "${pipe[@]}" "${odd[@]}" --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2
grep -q "all-forward-all-backward" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: not the fallback schedule"; exit 1; }
paste <(values_all "$dir/dp.jsonl") <(values_all "$dir/single.jsonl") | agree 2e-5 ||
  { echo "FAIL: all-forward-all-backward virtual stages differ from one rank"; exit 1; }
echo "np=2 PP=2 x 2 virtual stages, 3 micro-batches (all-forward-all-backward): same as one rank"
run_ranks 2 "${pipe[@]}" --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2
grep -q "interleaved 1F1B" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: not the interleaved schedule"; exit 1; }
# a checkpoint saved by PP=2 x EP=2 resumes on one rank and on PP=4
rm -f "$dir/single.jsonl"
"$bin" "${base[@]}" "${pipe[@]}" "${sched[@]}" --train-iters 4 --metrics-file "$dir/single.jsonl" > "$dir/single.log" 2>&1 || { cat "$dir/single.log"; exit 1; }
"$mpiexec" -np 4 "$bin" "${base[@]}" "${pipe[@]}" "${sched[@]}" --train-iters 2 --pipeline-model-parallel-size 2 \
  --expert-model-parallel-size 2 --save "$dir/ckpt-pp" > "$dir/save.log" 2>&1 || { cat "$dir/save.log"; exit 1; }
for layout in "1" "4 --pipeline-model-parallel-size 4"; do
  read -r -a c <<<"$layout"
  rm -f "$dir/resumed.jsonl"
  "$mpiexec" -np "${c[0]}" "$bin" "${base[@]}" "${pipe[@]}" "${sched[@]}" "${c[@]:1}" --train-iters 4 --load "$dir/ckpt-pp" \
    --metrics-file "$dir/resumed.jsonl" > "$dir/resume.log" 2>&1 || { cat "$dir/resume.log"; exit 1; }
  paste <(values_all "$dir/resumed.jsonl" | tail -n 7) <(values_all "$dir/single.jsonl" | tail -n 7) | agree 2e-5 ||
    { echo "FAIL: PP checkpoint resumed on np ${c[*]} differs"; exit 1; }
  echo "checkpoint of PP=2 x EP=2 resumed on np ${c[*]}: same losses as one rank"
done
# pipeline layouts against one rank of the same model: pipe_cases "reference flags" "np flags"...
compare_all() {
  paste <(values_all "$1") <(values_all "$2") | agree 2e-5
}
pipe_cases() {
  read -r -a ref <<<"$1"; shift
  run_single "${pipe[@]}" "${ref[@]}"
  for case in "$@"; do
    read -r -a c <<<"$case"
    run_ranks "${c[@]}" "${pipe[@]}" "${ref[@]}"
    grep -q "pipeline stages" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: no pipeline"; exit 1; }
    compare_all "$dir/dp.jsonl" "$dir/single.jsonl" || { echo "FAIL: np=$case (${ref[*]}) differs from one rank"; exit 1; }
    echo "np=$case ${ref[*]}: same losses, grad norm and validation loss as one rank"
  done
}
# uneven stages: 4 layers as 1/3 and 3/1; 6 layers as 1/2/2/1, and 2/4 in two chunks per rank
pipe_cases "" "2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1" \
              "2 --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 1"
grep -q "layers per stage 3/1" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: not 3/1 layers"; exit 1; }
pipe_cases "--num-layers 6" \
  "4 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1" \
  "2 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 --num-virtual-stages-per-pipeline-rank 2"
grep -q "2 model chunks, layers per stage 2/4" "$dir/dp.log" || { cat "$dir/dp.log"; echo "FAIL: not 2/4 layers"; exit 1; }
# tied embeddings (the tiny preset unties them): the last stage's copy follows the first's
tied=(--untie-embeddings-and-output-weights=false)
pipe_cases "${tied[*]}" "2 --pipeline-model-parallel-size 2" "4 --pipeline-model-parallel-size 4" \
  "4 --pipeline-model-parallel-size 2 --use-distributed-optimizer" \
  "4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --overlap-grad-reduce" \
  "4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
  "4 --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 1 --decoder-first-pipeline-num-layers 1"
# a tied checkpoint saved by PP=2 x DP=2 (the word embedding once) resumes on one rank and on PP=4
rm -f "$dir/single.jsonl"
"$bin" "${base[@]}" "${pipe[@]}" "${tied[@]}" "${sched[@]}" --train-iters 4 --metrics-file "$dir/single.jsonl" > "$dir/single.log" 2>&1 || { cat "$dir/single.log"; exit 1; }
"$mpiexec" -np 4 "$bin" "${base[@]}" "${pipe[@]}" "${tied[@]}" "${sched[@]}" --train-iters 2 --pipeline-model-parallel-size 2 \
  --use-distributed-optimizer --save "$dir/ckpt-tied" > "$dir/save.log" 2>&1 || { cat "$dir/save.log"; exit 1; }
[ "$(grep -ao '"embedding.word_embeddings.weight"' "$dir"/ckpt-tied/iter_*/model_optim.safetensors | wc -l)" -eq 1 ] ||
  { echo "FAIL: the tied word embedding is not in the checkpoint exactly once"; exit 1; }
for layout in "1" "4 --pipeline-model-parallel-size 4"; do
  read -r -a c <<<"$layout"
  rm -f "$dir/resumed.jsonl"
  "$mpiexec" -np "${c[0]}" "$bin" "${base[@]}" "${pipe[@]}" "${tied[@]}" "${sched[@]}" "${c[@]:1}" --train-iters 4 --load "$dir/ckpt-tied" \
    --metrics-file "$dir/resumed.jsonl" > "$dir/resume.log" 2>&1 || { cat "$dir/resume.log"; exit 1; }
  paste <(values_all "$dir/resumed.jsonl" | tail -n 7) <(values_all "$dir/single.jsonl" | tail -n 7) | agree 2e-5 ||
    { echo "FAIL: tied PP checkpoint resumed on np ${c[*]} differs"; exit 1; }
  echo "tied checkpoint of PP=2 x DP=2 resumed on np ${c[*]}: same losses as one rank"
done
if out=$("$mpiexec" -np 2 "$bin" "${base[@]}" --pipeline-model-parallel-size 2 --num-layers 3 2>&1); then echo "FAIL: uneven PP accepted"; exit 1; fi
grep -q "num-layers 3 is not divisible by --pipeline-model-parallel-size 2" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$mpiexec" -np 2 "$bin" "${base[@]}" --pipeline-model-parallel-size 2 --num-layers 4 --decoder-first-pipeline-num-layers 1 \
         --decoder-last-pipeline-num-layers 2 2>&1); then echo "FAIL: 1 + 2 layers of 4 accepted"; exit 1; fi
grep -q "expected them to sum to --num-layers 4" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$mpiexec" -np 2 "$bin" "${base[@]}" --pipeline-model-parallel-size 2 --num-layers 4 --decoder-first-pipeline-num-layers 2 \
         --num-layers-per-virtual-pipeline-stage 1 2>&1); then echo "FAIL: uneven + layers per virtual stage accepted"; exit 1; fi
grep -q "use --num-virtual-stages-per-pipeline-rank" <<<"$out" || { echo "$out"; exit 1; }
# a rank killed mid-training (SIGKILL: no message of its own): every rank stops, non-zero, quickly
"$mpiexec" -np 2 "$bin" "${base[@]}" --train-iters 100000 --lr-decay-iters 100000 --metrics-file "$dir/kill.jsonl" > "$dir/kill.log" 2>&1 &
launcher=$!
for _ in $(seq 1 150); do [ -s "$dir/kill.jsonl" ] && break; sleep 0.2; done
[ -s "$dir/kill.jsonl" ] || { cat "$dir/kill.log"; echo "FAIL: the run to kill did not start"; kill "$launcher"; exit 1; }
victim=$(pgrep -f -- "--metrics-file $dir/kill.jsonl" | grep -vx "$launcher" | sort -n | tail -1)
kill -9 "$victim"
start=$(date +%s)
if wait "$launcher"; then echo "FAIL: the job succeeded after a rank was killed"; exit 1; fi
[ $(( $(date +%s) - start )) -lt 30 ] || { echo "FAIL: the other rank took too long to stop"; exit 1; }
sleep 1
if pgrep -f -- "--metrics-file $dir/kill.jsonl" > /dev/null; then echo "FAIL: a rank outlived the job"; exit 1; fi
echo "a killed rank stops the job in $(( $(date +%s) - start )) s"
# layouts that do not fit the ranks are refused clearly
if out=$("$mpiexec" -np 2 "$bin" "${base[@]}" --expert-model-parallel-size 4 2>&1); then echo "FAIL: EP 4 on 2 ranks accepted"; exit 1; fi
grep -q "expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 x --pipeline-model-parallel-size 1 does not divide the 2 launched ranks" <<<"$out" || { echo "$out"; exit 1; }
if out=$("$bin" "${base[@]}" --moe-token-dispatcher-type flex 2>&1); then echo "FAIL: flex accepted"; exit 1; fi
grep -q "flex (DeepEP kernels) is not available" <<<"$out" || { echo "$out"; exit 1; }
echo PASS

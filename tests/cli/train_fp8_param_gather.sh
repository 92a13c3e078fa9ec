#!/usr/bin/env bash
# --fp8-param-gather (train/fp8_param_gather.h): the distributed optimizer all-gathers the FP8
# linears' weights as FP8 codes, quantised shard by shard with the whole matrices' scales, so the
# run equals the same run without the flag bit for bit: lm loss, load_balancing_loss and grad norm
# of 4 iterations printed identically, per recipe (blockwise, delayed with history 4 and max,
# tensorwise), on DP2, DP2 x EP2 (alltoall) and DP2 x TP2+SP, all with --bf16 and the distributed
# optimizer (split masters; DP2 also with --no-store-param-remainders).
# The gathered volume (MOECORE_COMM_TIMERS=1): with the flag the FP8 weights' elements cross as one
# byte each and the rest as bf16; without it every element as bf16 (2 bytes).
# A checkpoint written at iteration 2 with the flag resumes (with and without it) to the same values.
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
moe=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --lr-warmup-iters 1 --log-interval 1
     --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --fp8-format hybrid --bf16
     --use-distributed-optimizer)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=12
. "$(dirname "$0")/layout_compare.sh"  # run
same() {  # a b label: identical printed values
  cmp -s <(values "$dir/$1.jsonl") <(values "$dir/$2.jsonl") ||
    { paste <(values "$dir/$1.jsonl") <(values "$dir/$2.jsonl"); echo "FAIL: $3"; exit 1; }
}
tp="--tensor-model-parallel-size 2 --sequence-parallel"
ep="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
for recipe in blockwise "delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max" tensorwise; do
  read -r -a r <<<"--fp8-recipe $recipe"
  for layout in "2" "2 --no-store-param-remainders" "4 $ep" "4 $tp"; do
    read -r -a c <<<"$layout"
    run plain "${c[0]}" "${moe[@]}" "${r[@]}" "${c[@]:1}"
    run gathered "${c[0]}" "${moe[@]}" "${r[@]}" "${c[@]:1}" --fp8-param-gather
    same gathered plain "--fp8-param-gather ($recipe) np ${c[*]} differs from the run without it"
    echo "fp8 $recipe np ${c[*]}: --fp8-param-gather gives the same values bit for bit"
  done
done

# the volume: FP8 elements at one byte, the rest in bf16
volume() { grep -o 'parameter all-gather (last step): [0-9]* FP8 weight elements in [0-9]* bytes, [0-9]* bf16 elements in [0-9]* bytes' "$dir/$1.log" | tail -1 | awk '{ print $5, $10, $12, $16 }'; }
MOECORE_COMM_TIMERS=1 run plain 2 "${moe[@]}" --fp8-recipe blockwise
read -r pf pfb pb pbb <<<"$(volume plain)"
MOECORE_COMM_TIMERS=1 run gathered 2 "${moe[@]}" --fp8-recipe blockwise --fp8-param-gather
read -r gf gfb gb gbb <<<"$(volume gathered)"
echo "without the flag: $pf FP8 elements ($pfb bytes), $pb bf16 elements ($pbb bytes)"
echo "with the flag:    $gf FP8 elements ($gfb bytes), $gb bf16 elements ($gbb bytes)"
[ "${pf:-x}" = 0 ] && [ "$pbb" = $((2 * pb)) ] || { echo "FAIL: without the flag every element should cross as bf16"; exit 1; }
[ "${gf:-0}" -gt 0 ] && [ "$gfb" = "$gf" ] && [ "$gbb" = $((2 * gb)) ] && [ $((gf + gb)) = "$pb" ] ||
  { echo "FAIL: with the flag the FP8 weights should cross at one byte per element, the rest as bf16"; exit 1; }
echo "parameter all-gather: $((pbb)) bytes without --fp8-param-gather, $((gfb + gbb)) with it"

# resume: a checkpoint of a gathered run (fp32 masters, as always) continues bit-identically
run whole 2 "${moe[@]}" --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-param-gather --lr-decay-iters 4
MIN_LOGGED=6 run save 2 "${moe[@]}" --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-param-gather --lr-decay-iters 4 \
  --train-iters 2 --save "$dir/ckpt"
for flag in --fp8-param-gather ""; do
  MIN_LOGGED=6 run resumed 2 "${moe[@]}" --fp8-recipe delayed --fp8-amax-history-len 4 --lr-decay-iters 4 \
    --load "$dir/ckpt" $flag
  cmp -s <(values "$dir/resumed.jsonl" | tail -n 6) <(values "$dir/whole.jsonl" | tail -n 6) ||
    { paste <(values "$dir/resumed.jsonl" | tail -n 6) <(values "$dir/whole.jsonl" | tail -n 6);
      echo "FAIL: resumed ${flag:-without the flag} differs from the uninterrupted run"; exit 1; }
  echo "checkpoint of a --fp8-param-gather run resumed ${flag:-without the flag}: bit-identical"
done
echo PASS

#!/usr/bin/env bash
# FP8 dispatch (moe/token_dispatcher.h, Fp8Dispatch): with FP8 training under EP the tokens cross
# the dispatch's all-to-all / all-gather as E4M3 codes and fp32 factors.
# 1. Bytes (MOECORE_COMM_TIMERS=1 logs the forward token dispatch's bytes and rows): EP2 alltoall
#    with --bf16 (hidden 64) sends 2*64 + 4 (the row's f32 probability) = 132 bytes a row in bf16,
#    64 + 4 (its 1x128 factor) + 4 = 72 with --fp8-recipe blockwise (0.55 of bf16), and 64 + 4
#    a row plus one 4-byte factor per rank and collective with tensorwise.
# 2. Layouts (8 experts): EP2 (alltoall, allgather) and EP4 (alltoall) against one rank (which
#    quantises nothing: no collective) within the FP8 layouts' 5e-3 (tests/cli/train_fp8_parallel.sh
#    says why not closer), per recipe (delayed: EP2 only).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
moe=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
     --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --bf16)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
MIN_LOGGED=3
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
ep2="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
volume() {  # log -> "bytes rows" of the last step
  grep -o 'forward token dispatch (last step): [0-9]* bytes for [0-9]* rows' "$1" | tail -1 | awk '{ print $6, $9 }'
}
MOECORE_COMM_TIMERS=1 run bf16 2 "${moe[@]}" $ep2
MOECORE_COMM_TIMERS=1 run blockwise 2 "${moe[@]}" $ep2 --fp8 --fp8-recipe blockwise
MOECORE_COMM_TIMERS=1 run tensorwise 2 "${moe[@]}" $ep2 --fp8 --fp8-recipe tensorwise
read -r b16 r16 <<<"$(volume "$dir/bf16.log")"
read -r bbw rbw <<<"$(volume "$dir/blockwise.log")"
read -r btw rtw <<<"$(volume "$dir/tensorwise.log")"
echo "bytes per dispatched row: bf16 $((b16 / r16)), fp8 blockwise $((bbw / rbw)), tensorwise $((btw / rtw)) (rows $r16 $rbw $rtw)"
[ "$r16" -gt 0 ] && [ "$r16" = "$rbw" ] && [ "$r16" = "$rtw" ] || { echo "FAIL: the runs dispatched different rows"; exit 1; }
[ "$b16" = $((132 * r16)) ] || { echo "FAIL: bf16 dispatch $b16 bytes, expected 132 a row"; exit 1; }
[ "$bbw" = $((72 * rbw)) ] || { echo "FAIL: fp8 blockwise dispatch $bbw bytes, expected 72 a row"; exit 1; }
[ "$btw" -ge $((68 * rtw)) ] && [ "$btw" -le $((68 * rtw + 4096)) ] ||
  { echo "FAIL: fp8 tensorwise dispatch $btw bytes, expected 68 a row and a factor per rank and collective"; exit 1; }
awk -v a="$bbw" -v b="$b16" 'BEGIN { exit !(a <= 0.55 * b) }' || { echo "FAIL: fp8 does not halve the bytes"; exit 1; }
ep2_ag="2 --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
ep4="4 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall"
layouts() {  # recipe -- layouts (each "np flags...")
  local recipe=$1; shift 2
  read -r -a r <<<"$recipe"
  for layout in "$@"; do
    read -r -a c <<<"$layout"
    run single 1 "${moe[@]}" --fp8 "${r[@]}" --num-experts 8
    run ranks "${c[0]}" "${moe[@]}" --fp8 "${r[@]}" --num-experts 8 "${c[@]:1}"
    check 5e-3 "fp8 $recipe dispatch np ${c[*]}"
  done
}
layouts "--fp8-recipe blockwise" -- "2 $ep2" "$ep2_ag" "$ep4"
layouts "--fp8-recipe tensorwise" -- "2 $ep2" "$ep2_ag" "$ep4"
# (delayed under EP4 differs from one rank by 0.65% in the first grad norm without FP8 dispatch too)
layouts "--fp8-recipe delayed --fp8-amax-history-len 4" -- "2 $ep2" "$ep2_ag"
echo "PASS"

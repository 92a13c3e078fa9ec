#!/usr/bin/env bash
# The EP load-imbalance report (moe/dispatch_load.h) with each dispatcher on two CPU ranks
# (mpirun, EP2): with --moe-router-force-load-balancing every rank's experts receive the same
# rows (min = max, imbalance 1) and the losses are finite; without it the report is there too
# (imbalance >= 1). Both runs log the dispatch collectives' time and the wait for the slowest rank
# (>= 0, at most the collectives' time).
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 2 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-layers 2 --moe-layer-freq "[0,1]"
      --expert-model-parallel-size 2)
values() { grep -o '"lm_loss":[^,}]*' "$1"; }
MIN_LOGGED=2
. "$(dirname "$0")/layout_compare.sh"  # run
key() { { grep -o "\"$2\":[^,}]*" "$dir/$1.jsonl" || true; } | tail -n 1 | cut -d: -f2; }
for dispatcher in alltoall allgather; do
  for forced in "" "--moe-router-force-load-balancing"; do
    run load 2 "${base[@]}" --moe-token-dispatcher-type "$dispatcher" $forced
    lo=$(key load moe_ep_received_rows_min); hi=$(key load moe_ep_received_rows_max)
    ratio=$(key load moe_ep_imbalance); loss=$(key load lm_loss)
    comm=$(key load moe_ep_dispatch_comm_ms); wait=$(key load moe_ep_dispatch_wait_ms)
    grep -q "EP received rows (last step) min/mean/max" "$dir/load.log" || { cat "$dir/load.log"; echo "FAIL: no report in the log line"; exit 1; }
    [ -n "$lo" ] && [ -n "$hi" ] && [ -n "$ratio" ] && [ -n "$comm" ] && [ -n "$wait" ] ||
      { cat "$dir/load.jsonl"; echo "FAIL: $dispatcher $forced: report keys missing"; exit 1; }
    awk -v l="$loss" 'BEGIN { exit !(l == l + 0 && l > 0 && l < 100) }' || { echo "FAIL: $dispatcher $forced: lm loss $loss"; exit 1; }
    awk -v c="$comm" -v w="$wait" 'BEGIN { exit !(w >= 0 && w <= c + 1e-9 && c > 0) }' ||
      { echo "FAIL: $dispatcher $forced: wait $wait ms not within [0, collectives $comm ms]"; exit 1; }
    if [ -n "$forced" ]; then
      awk -v a="$lo" -v b="$hi" -v r="$ratio" 'BEGIN { exit !(a == b && a > 0 && r == 1) }' ||
        { echo "FAIL: $dispatcher forced balance: rows min $lo max $hi imbalance $ratio"; exit 1; }
    else
      awk -v a="$lo" -v b="$hi" -v r="$ratio" 'BEGIN { exit !(a <= b && r >= 1) }' ||
        { echo "FAIL: $dispatcher: rows min $lo max $hi imbalance $ratio"; exit 1; }
    fi
    echo "$dispatcher ${forced:-(learned routing)}: received rows $lo..$hi, imbalance $ratio, collectives $comm ms, wait $wait ms"
  done
done

#!/usr/bin/env bash
# --optimizer-cpu-offload changes no number: a tiny MoE model trains 3 iterations with the
# optimizer state wholly on the "device" and with --optimizer-offload-fraction 0.5 and 1.0 (the
# host part updated by the threaded host AdamW), on one rank (fp32, and bf16 with whole masters)
# and under DP2, DP2 with the distributed optimizer (fp32, and bf16: sharded masters; also with
# --overlap-param-gather), TP2+SP, PP2 and EP2 (mpirun, CPU ranks): bit-identical lm loss, balancing loss, grad norm and params norm.
# A run with offload 0.5 resumes bit-identically from its checkpoint, also without offload (and a
# run without it from one with it). --memory-report shows the state moved to host memory: the
# device's optimizer_state shrinks, a host line lists the offloaded part, the check stays within 3%.
set -euo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
base=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 3 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*\|"params_norm":[^,}]*' "$1"; }
MIN_LOGGED=12
. "$(dirname "$0")/layout_compare.sh"  # agree, run, check
tp="--tensor-model-parallel-size 2 --sequence-parallel"
ep="--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
bf16="--bf16 --no-store-param-remainders"
overlap="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
for layout in "1" "1 $bf16" "2" "2 --use-distributed-optimizer" "2 --use-distributed-optimizer $bf16" "2 $overlap $bf16" \
              "2 $tp" "2 --pipeline-model-parallel-size 2" "2 $ep"; do
  read -r -a l <<<"$layout"
  run plain "${l[0]}" "${base[@]}" "${l[@]:1}"
  for fraction in 0.5 1.0; do
    run offloaded "${l[0]}" "${base[@]}" "${l[@]:1}" --optimizer-cpu-offload --optimizer-offload-fraction "$fraction"
    grep -qE "optimizer CPU offload: [1-9][0-9]* of this rank's [0-9]+ optimizer-state elements on the host" \
      "$dir/offloaded.log" || { cat "$dir/offloaded.log"; echo "FAIL: np ${l[*]}: nothing offloaded"; exit 1; }
    cmp <(values "$dir/plain.jsonl") <(values "$dir/offloaded.jsonl") ||
      { echo "FAIL: np ${l[*]} with offload fraction $fraction differs from no offload"; exit 1; }
    echo "np ${l[*]} offload $fraction: bit-identical ($(grep -o "[0-9]* of this rank.s [0-9]*" "$dir/offloaded.log") elements on the host)"
  done
done

# Resume: 4 iterations with offload 0.5, saved at 2; resumed with and without offload.
resume=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --lr-warmup-iters 1 --log-interval 1
        --eval-interval 0)
losses() { grep -o '"iteration":[0-9]*,"learning_rate":[^,]*,"lm_loss":[^,]*\|"grad_norm":[^,}]*\|"params_norm":[^,}]*' "$1" | tail -n "$2"; }
MIN_LOGGED=1
run full 1 "${resume[@]}" --optimizer-cpu-offload --optimizer-offload-fraction 0.5 --save "$dir/ckpt" --save-interval 2
for offload in "--optimizer-cpu-offload --optimizer-offload-fraction 0.5" ""; do
  read -r -a o <<<"$offload"
  run resumed 1 "${resume[@]}" "${o[@]}" --load "$dir/ckpt/iter_0000002"
  grep -q "loaded checkpoint" "$dir/resumed.log" || { echo "FAIL: did not load"; exit 1; }
  cmp <(losses "$dir/full.jsonl" 6) <(losses "$dir/resumed.jsonl" 6) ||
    { echo "FAIL: resumed (${offload:-no offload}) differs from the uninterrupted offloaded run"; exit 1; }
  echo "resumed ${offload:-without offload}: bit-identical"
done
run plainsave 1 "${resume[@]}" --save "$dir/plainckpt" --save-interval 2
run resumed 1 "${resume[@]}" --optimizer-cpu-offload --load "$dir/plainckpt/iter_0000002"
cmp <(losses "$dir/plainsave.jsonl" 6) <(losses "$dir/resumed.jsonl" 6) ||
  { echo "FAIL: an offloaded run resumed from a plain checkpoint differs"; exit 1; }
echo "plain checkpoint resumed with offload: bit-identical"

# The memory report: the optimizer state leaves the device.
report=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 2 --lr-warmup-iters 1 --log-interval 2 --eval-interval 0
        --memory-report)
run plainmem 1 "${report[@]}"
run offmem 1 "${report[@]}" --optimizer-cpu-offload --optimizer-offload-fraction 0.5
grep -q "host memory (not in the peak)" "$dir/plainmem.log" && { echo "FAIL: a host line without offload"; exit 1; }
grep -q "check: the parts sum to .*(within 3%)" "$dir/offmem.log" || { cat "$dir/offmem.log"; echo "FAIL: check line"; exit 1; }
python3 - "$dir/plainmem.jsonl" "$dir/offmem.jsonl" <<'PY'
import json, sys
def report(path):
    return next(json.loads(l) for l in open(path) if "memory_report" in l)["memory_report"][0]
plain, off = report(sys.argv[1]), report(sys.argv[2])
host = off["host"]
print("device optimizer_state:", plain["optimizer_state"], "->", off["optimizer_state"], "host:", host)
assert off["optimizer_state"] < 0.75 * plain["optimizer_state"], "the device optimizer state did not shrink"
assert abs(off["optimizer_state"] + host["optimizer_state"] - plain["optimizer_state"]) <= 0.05 * plain["optimizer_state"], \
    "device + host optimizer state is not the whole"
assert host["weights"] > 0 and host["gradients"] > 0, host
parts = ["weights", "gradients", "optimizer_state", "activations", "communication", "workspace", "untagged",
         "allocator_overhead"]
total = sum(off[p] for p in parts)
assert abs(total / off["peak_reserved_bytes"] - 1) <= 0.03, (total, off["peak_reserved_bytes"])
PY
echo PASS

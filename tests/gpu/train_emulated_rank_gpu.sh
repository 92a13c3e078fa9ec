#!/usr/bin/env bash
# --emulate-world-size on a GPU (BIN SRC [MPI]): the emulated communicator on device tensors.
# One GPU (no MPI given): rank 0 of an emulated DP=2 job with twice the global batch does exactly
# the one-GPU run's work per rank, so its --memory-report peak (CUDA allocator, reserved) must be
# the one-GPU run's within 2%. Two GPUs (MPI: the launcher command line, e.g. "mpirun -np 2 -x
# NCCL_NVLS_ENABLE"; scripts/gpu-dist.sh passes it): for EP=2 (alltoall, padded to capacity), TP=2+SP, PP=2 and DP=2
# with the distributed optimizer, each rank emulated alone on cuda:0 must have the real 2-GPU
# run's peak for that rank within 2%.
set -euo pipefail
bin=$1; src=$2; mpi=${3:-}
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --device cuda --train-iters 3 --lr-warmup-iters 1 --log-interval 2
      --eval-interval 0 --micro-batch-size 4 --num-layers 4 --hidden-size 128 --num-attention-heads 4 --memory-report)
peak() {  # metrics.jsonl rank
  python3 -c 'import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if "memory_report" in l][0]["memory_report"]
print(next(x["peak_reserved_bytes"] for x in r if x["rank"] == int(sys.argv[2])))' "$1" "$2"
}
within() {  # label real emulated
  python3 -c 'import sys
real, emu = int(sys.argv[2]), int(sys.argv[3])
print(f"{sys.argv[1]}: real peak {real / 1e6:.2f} MB, emulated {emu / 1e6:.2f} MB ({100 * (emu / real - 1):+.2f}%)")
sys.exit(0 if abs(emu / real - 1) <= 0.02 else 1)' "$@" || { echo "FAIL: $1 off by more than 2%"; exit 1; }
}
emulate() {  # world rank flags...: the emulated rank's peak
  local world=$1 rank=$2; shift 2
  rm -f "$dir/emu.jsonl"
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$bin" "${base[@]}" "$@" --emulate-world-size "$world" \
    --emulate-rank "$rank" --metrics-file "$dir/emu.jsonl" >"$dir/emu.log" 2>&1 || { cat "$dir/emu.log"; exit 1; }
  grep -q "EMULATING rank $rank of $world" "$dir/emu.log" || { cat "$dir/emu.log"; echo "FAIL: no notice"; exit 1; }
  peak "$dir/emu.jsonl" "$rank"
}
if [ -z "$mpi" ]; then
  "$bin" "${base[@]}" --global-batch-size 8 --metrics-file "$dir/one.jsonl" >"$dir/one.log" 2>&1 ||
    { cat "$dir/one.log"; exit 1; }
  within "emulated DP=2 rank 0 vs one GPU" "$(peak "$dir/one.jsonl" 0)" "$(emulate 2 0 --global-batch-size 16)"
  echo PASS
  exit 0
fi
# EP padded to capacity: a dropless real rank's expert rows vary with the other ranks' routing.
for flags in "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity" \
             "--tensor-model-parallel-size 2 --sequence-parallel" "--pipeline-model-parallel-size 2" \
             "--use-distributed-optimizer"; do
  rm -f "$dir/real.jsonl"
  # shellcheck disable=SC2086
  $mpi "$bin" "${base[@]}" --global-batch-size 16 $flags --metrics-file "$dir/real.jsonl" >"$dir/real.log" 2>&1 ||
    { cat "$dir/real.log"; exit 1; }
  for r in 0 1; do
    # shellcheck disable=SC2086
    within "2 GPUs [$flags] rank $r" "$(peak "$dir/real.jsonl" "$r")" "$(emulate 2 "$r" --global-batch-size 16 $flags)"
  done
done
echo PASS

#!/usr/bin/env bash
# make gpu-scaling: the scaling runs on the GPUs of one host (4 or 8), each next to its one-GPU
# baseline in the same call. Usage: scripts/gpu-scaling.sh [build-dir] [gpus]
#   G = gpus (default: all present, 4 or 8). Global batch 4 * G sequences (micro-batches of 4:
#   one per rank for the expert layouts), bf16, 10 steps, the averages of steps 6-10.
#   - NCCL bus bandwidth on G ranks (bench_comm: the all-to-all at both presets' dispatch sizes)
#   - mixtral-small: one GPU; EP=G; EP=G/2 x EDP=2; DP=G; TP=2+SP with EP=G (ETP=1: the folded
#     layout, attention TP=2 x DP=G/2); EP=G with the dispatch timers (their share of the step)
#   - finegrained-small: one GPU; EP=G; EP=G with the dispatch timers
#   - mixtral-small with 16 layers: PP=4 (1F1B) and PP=4 x 2 virtual stages (interleaved), with
#     DP=G/4, at 4 and at 1 sequence per micro-batch
# Prints one markdown table (tokens/s per GPU, scaling efficiency against the one-GPU row of the
# same model, the dispatch share: the last step's dispatch collectives and, of that, the wait for
# the group's slowest rank) and the last line: gpu-scaling: N runs, N failed on <cards>
set -uo pipefail
build=${1:-build}
export PATH=$PATH:/usr/local/cuda/bin NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
present=$(nvidia-smi -L 2>/dev/null | wc -l)
G=${2:-$present}
if [ "$G" -ne 4 ] && [ "$G" -ne 8 ]; then echo "gpu-scaling: runs on 4 or 8 GPUs (asked for $G)"; exit 1; fi
[ "$present" -ge "$G" ] || { echo "gpu-scaling: needs $G GPUs, found $present"; exit 1; }
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOECORE_CUDA=ON >/dev/null || exit 1
cmake --build "$build" -j "$(nproc)" --target moecore_app bench_comm >"$build/build-scaling.log" 2>&1 ||
  { grep -E "error" -A3 "$build/build-scaling.log" | head -40; echo "gpu-scaling: build failed"; exit 1; }
gbs=$((4 * G))
runs=0; failed=0
results="$build/scaling.jsonl"; : > "$results"

echo "== bench_comm, $G GPUs"
mpirun --allow-run-as-root -np "$G" -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 "$build/bench/bench_comm" | sed -n '/^$/,$p'

# run model label gpus timers flags...: one training run; its last metrics line goes to $results.
run() {
  local model=$1 label=$2 np=$3 timers=$4; shift 4
  local metrics="$build/scaling-run.jsonl" log="$build/scaling-run.log"
  rm -f "$metrics"
  local args=(train --config "configs/$model.yaml" --global-batch-size "$gbs" --train-iters 10 --log-interval 5
    --eval-interval 0 --lr-warmup-iters 1 --metrics-file "$metrics" "$@")
  runs=$((runs + 1))
  local ok=1
  if [ "$np" -eq 1 ]; then
    CUDA_VISIBLE_DEVICES=0 MOECORE_COMM_TIMERS=$timers "$build/moecore" "${args[@]}" >"$log" 2>&1 || ok=0
  else
    mpirun --allow-run-as-root -np "$np" -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 -x MOECORE_COMM_TIMERS="$timers" \
      "$build/moecore" "${args[@]}" >"$log" 2>&1 || ok=0
  fi
  if [ "$ok" = 0 ] || [ ! -s "$metrics" ]; then
    failed=$((failed + 1)); echo "FAIL $model $label"; tail -5 "$log"; return
  fi
  local timed dispatch wait
  timed=$(grep "iteration       10/" "$log" | grep -o "dispatch communication (ms, last step): [^|]*")
  dispatch=$(grep -o "step): [0-9.]*" <<<"$timed" | grep -o "[0-9.]*$")
  wait=$(grep -o "slowest rank: [0-9.]*" <<<"$timed" | grep -o "[0-9.]*$")
  python3 - "$model" "$label" "$np" "${dispatch:-}" "${wait:-}" "$(tail -1 "$metrics")" >>"$results" <<'PY'
import json, sys
model, label, np, dispatch, wait, line = sys.argv[1:7]
m = json.loads(line)
print(json.dumps({"model": model, "layout": label, "gpus": int(np), "ms": m["ms_per_iteration"],
                  "tokens_per_s": m["tokens_per_s"], "peak_gb": m["mem_max_allocated_bytes"] / 1e9,
                  "lm_loss": m["lm_loss"], "dispatch_ms": float(dispatch) if dispatch else None,
                  "wait_ms": float(wait) if wait else None}))
PY
  echo "done $model $label"
}

half=$((G / 2)); dp_pp=$((G / 4))
run mixtral-small "one GPU" 1 0
run mixtral-small "EP=$G alltoall" "$G" 0 --expert-model-parallel-size "$G" --moe-token-dispatcher-type alltoall
run mixtral-small "EP=$half x EDP=2 alltoall" "$G" 0 --expert-model-parallel-size "$half" --moe-token-dispatcher-type alltoall
run mixtral-small "DP=$G" "$G" 0
run mixtral-small "TP=2+SP x DP=$half attention, EP=$G ETP=1 experts (folded)" "$G" 0 --tensor-model-parallel-size 2 \
  --sequence-parallel --expert-model-parallel-size "$G" --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall
run mixtral-small "EP=$G alltoall, dispatch timers on" "$G" 1 --expert-model-parallel-size "$G" --moe-token-dispatcher-type alltoall
run finegrained-small "one GPU" 1 0 --micro-batch-size 4
run finegrained-small "EP=$G alltoall" "$G" 0 --micro-batch-size 4 --expert-model-parallel-size "$G" --moe-token-dispatcher-type alltoall
run finegrained-small "EP=$G alltoall, dispatch timers on" "$G" 1 --micro-batch-size 4 --expert-model-parallel-size "$G" \
  --moe-token-dispatcher-type alltoall
for mb in 4 1; do
  run mixtral-small "16 layers, PP=4 x DP=$dp_pp (1F1B), micro-batch $mb" "$G" 0 --num-layers 16 \
    --pipeline-model-parallel-size 4 --micro-batch-size "$mb"
  run mixtral-small "16 layers, PP=4 x DP=$dp_pp x 2 virtual stages, micro-batch $mb" "$G" 0 --num-layers 16 \
    --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --micro-batch-size "$mb"
done

python3 - "$results" "$gbs" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = {r["model"]: r["tokens_per_s"] for r in rows if r["gpus"] == 1}
print(f"\nglobal batch {sys.argv[2]} sequences; efficiency = tokens/s per GPU / the one-GPU row's tokens/s")
print("| model | layout | GPUs | ms / step | tokens/s | tokens/s per GPU | efficiency | dispatch share | peak GB | lm loss |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    per = r["tokens_per_s"] / r["gpus"]
    eff = f'{per / base[r["model"]]:.2f}' if r["model"] in base and "16 layers" not in r["layout"] else "-"
    share = "-"
    if r["dispatch_ms"] is not None:
        share = f'{100 * r["dispatch_ms"] / r["ms"]:.0f}% ({r["dispatch_ms"]:.1f} ms, of which {r["wait_ms"]:.1f} waiting)'

    print(f'| {r["model"]} | {r["layout"]} | {r["gpus"]} | {r["ms"]:.1f} | {r["tokens_per_s"] / 1e3:.1f}k | '
          f'{per / 1e3:.1f}k | {eff} | {share} | {r["peak_gb"]:.2f} | {r["lm_loss"]:.4f} |')
PY
cards=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -"$G" | sort | uniq -c | sed 's/^ *//' | tr '\n' ' ')
echo "gpu-scaling: $runs runs, $failed failed on $cards"
[ "$failed" -eq 0 ]

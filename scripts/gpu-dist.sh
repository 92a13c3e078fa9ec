#!/usr/bin/env bash
# make gpu-dist: on a machine with 2+ GPUs, the NCCL tier, multi-GPU training checks and a
# throughput table. Usage: scripts/gpu-dist.sh [build-dir] [all|check|perf]
#   check: the dist test binary under mpirun -np 2 (CommNccl.* incl. the token dispatchers on
#          device tensors); tests/gpu/train_parallel_gpu.sh (fp32 tiny MoE: DP=2, EP=2 and PP=2
#          layouts print the one-GPU losses); tests/gpu/train_nccl_timeout_gpu.sh
#          (--distributed-timeout-minutes: a stopped GPU rank ends the job with the watchdog's
#          message); tests/gpu/train_torchrun_gpu.sh (the same under
#          torchrun, NCCL bootstrapped over TCP); tests/gpu/train_emulated_rank_gpu.sh (each
#          rank of EP=2, TP=2, PP=2, DP=2 layouts emulated alone has the real rank's peak);
#          tests/gpu/train_fp8_parallel_gpu.sh (FP8 training in EP=2, TP=2, DP=2 against one GPU);
#          tests/gpu/train_tp_comm_overlap_gpu.sh (TP=2+SP with and without --tp-comm-overlap)
#          tests/gpu/train_ep_overlap_gpu.sh (--overlap-moe-expert-parallel-comm at EP=2: bit-identical)
#   perf:  bench_comm (NCCL all-to-all / all-reduce / all-gather bus bandwidth at dispatch sizes)
#          on 2 and, with 4+ GPUs, 4 ranks; mixtral-small (bf16, global batch 16) on one GPU,
#          DP=2, EP=2 (alltoall, allgather), PP=2, TP=2+SP (also --tp-comm-overlap), CP=2, TP=2+SP
#          with EP=2, and with 4+
#          GPUs TP=2 with EP=4 (and CP=2), DP=4, EP=4 (+ distributed
#          optimizer, + dispatch timers); finegrained-small one GPU vs EP=4 / EP=2.
# The last line: gpu-dist: N passed, N failed on <cards>
set -uo pipefail
build=${1:-build}; what=${2:-all}
export PATH=$PATH:/usr/local/cuda/bin NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || { echo "gpu-dist: needs 2 GPUs, found $gpus"; exit 1; }
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOECORE_CUDA=ON >/dev/null || exit 1
cmake --build "$build" -j "$(nproc)" --target moecore_app moecore_dist_tests bench_comm >"$build/build-dist.log" 2>&1 ||
  { grep -E "error" -A3 "$build/build-dist.log" | head -40; echo "gpu-dist: build failed"; exit 1; }
# OMP_NUM_THREADS=4 per rank unless perf_default_threads=1 (then moecore's own default).
mpi() {
  local np=$1; shift
  if [ "${perf_default_threads:-0}" = 1 ]; then
    env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS mpirun --allow-run-as-root -np "$np" -x NCCL_NVLS_ENABLE -x MOECORE_COMM_TIMERS "$@"
  else
    mpirun --allow-run-as-root -np "$np" -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 -x MOECORE_COMM_TIMERS "$@"
  fi
}
export MOECORE_COMM_TIMERS=${MOECORE_COMM_TIMERS:-0}
passed=0; failed=0
step() {  # name command...
  local name=$1; shift
  if "$@" > "$build/$name.log" 2>&1; then passed=$((passed + 1)); echo "PASS $name"; else
    failed=$((failed + 1)); echo "FAIL $name"; tail -40 "$build/$name.log"; fi
}
if [ "$what" != perf ]; then
  step nccl_dist_tests env CUDA_VISIBLE_DEVICES=0,1 mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES \
    "$build/tests/moecore_dist_tests" --gtest_filter='CommNccl*'
  grep -E "^\[  (PASSED|FAILED) " "$build/nccl_dist_tests.log" || true
  step train_parallel_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_parallel_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "same|differ" "$build/train_parallel_gpu.log" || true
  step train_bf16_sharded_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_bf16_sharded_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "same|differ" "$build/train_bf16_sharded_gpu.log" || true
  step train_nccl_timeout_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_nccl_timeout_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "same losses|waited|PASS" "$build/train_nccl_timeout_gpu.log" || true
  step train_shared_expert_overlap_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_shared_expert_overlap_gpu.sh \
    "$build/moecore" . "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "bit-identical|moe_ep_|FAIL" "$build/train_shared_expert_overlap_gpu.log" || true
  step train_ep_overlap_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_ep_overlap_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "bit-identical|FAIL" "$build/train_ep_overlap_gpu.log" || true
  step train_fp8_parallel_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_fp8_parallel_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "same|differ" "$build/train_fp8_parallel_gpu.log" || true
  step train_tp_comm_overlap_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_tp_comm_overlap_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "tp-comm-overlap|FAIL" "$build/train_tp_comm_overlap_gpu.log" || true
  step train_torchrun_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_torchrun_gpu.sh "$build/moecore" .
  step train_emulated_rank_gpu env CUDA_VISIBLE_DEVICES=0,1 tests/gpu/train_emulated_rank_gpu.sh "$build/moecore" . \
    "mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES"
  grep -E "emulated|FAIL" "$build/train_emulated_rank_gpu.log" || true
  grep -E "same|differ|torchrun" "$build/train_torchrun_gpu.log" | tail -8 || true
fi
if [ "$what" != check ]; then
  for np in 2 4; do
    [ "$gpus" -ge "$np" ] || continue
    echo "== bench_comm, $np GPUs"; mpi "$np" "$build/bench/bench_comm" | sed -n '/^$/,$p'
  done
  # the log line of the last 5 of 10 steps
  line() { grep "iteration       10/" "$1" | grep -o "elapsed time per iteration (ms): [0-9.]*\|lm loss: [^|]*\|tokens/s: [0-9]*\|mem allocated/peak (GB): [0-9./]*\|dispatch communication[^|]*" | sed 's/elapsed time per iteration (ms)/ms/' | tr '\n' ' '; }
  perf() {  # label np config extra flags...
    local label=$1 np=$2 config=$3; shift 3
    local args=(train --config "configs/$config.yaml" --global-batch-size 16 --train-iters 10 --log-interval 5 --eval-interval 0 --lr-warmup-iters 1 "$@")
    if [ "$np" -eq 1 ]; then CUDA_VISIBLE_DEVICES=0 "$build/moecore" "${args[@]}" > "$build/perf.log" 2>&1
    else mpi "$np" "$build/moecore" "${args[@]}" > "$build/perf.log" 2>&1; fi || { tail -5 "$build/perf.log"; }
    echo "| $config | $label | $(line "$build/perf.log") |"
  }
  printf "\n| model | layout | log line (average of steps 6-10) |\n|---|---|---|\n"
  perf "one GPU" 1 mixtral-small
  perf "DP=2" 2 mixtral-small
  perf "DP=2 --overlap-grad-reduce" 2 mixtral-small --overlap-grad-reduce
  perf "DP=2 distributed optimizer --overlap-grad-reduce" 2 mixtral-small --use-distributed-optimizer --overlap-grad-reduce
  perf "DP=2 distributed optimizer --overlap-grad-reduce --overlap-param-gather" 2 mixtral-small --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  perf "EP=2 alltoall" 2 mixtral-small --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
  perf "EP=2 alltoall --overlap-moe-expert-parallel-comm --delay-wgrad-compute" 2 mixtral-small --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm --delay-wgrad-compute
  perf "EP=2 alltoall --overlap-grad-reduce" 2 mixtral-small --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-grad-reduce
  perf "EP=2 allgather" 2 mixtral-small --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather
  perf "PP=2 (1F1B)" 2 mixtral-small --pipeline-model-parallel-size 2
  perf "TP=2 +SP" 2 mixtral-small --tensor-model-parallel-size 2 --sequence-parallel
  perf "TP=2 +SP --tp-comm-overlap" 2 mixtral-small --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap
  perf "CP=2" 2 mixtral-small --context-parallel-size 2
  perf "DP=2, micro-batch 2 (the tokens per rank and micro-batch of TP=2/CP=2 with 4)" 2 mixtral-small --micro-batch-size 2
  perf "CP=2, micro-batch 8 (DP=2's tokens per rank and micro-batch)" 2 mixtral-small --context-parallel-size 2 --micro-batch-size 8
  perf "TP=2 +SP, micro-batch 8" 2 mixtral-small --tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 8
  perf "TP=2 +SP, EP=2 alltoall (folded)" 2 mixtral-small --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
  if [ "$gpus" -ge 4 ]; then
    perf "DP=4" 4 mixtral-small
    perf "DP=4 --overlap-grad-reduce" 4 mixtral-small --overlap-grad-reduce
    perf "EP=4 alltoall" 4 mixtral-small --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
    perf "EP=4 alltoall --overlap-grad-reduce" 4 mixtral-small --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --overlap-grad-reduce
    perf "EP=4 alltoall + distributed optimizer" 4 mixtral-small --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --use-distributed-optimizer
    perf "EP=2 DP=2 (EDP=2) alltoall" 4 mixtral-small --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
    perf "PP=2 x EP=2 alltoall" 4 mixtral-small --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
    perf "PP=4 (1F1B)" 4 mixtral-small --pipeline-model-parallel-size 4
    perf "EP=2 x ETP=2 alltoall" 4 mixtral-small --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-token-dispatcher-type alltoall
    perf "TP=2 +SP, EP=4 alltoall (folded)" 4 mixtral-small --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
    perf "TP=2 +SP, CP=2, EP=4 alltoall" 4 mixtral-small --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
    perf "16 layers, PP=4 (1F1B)" 4 mixtral-small --num-layers 16 --pipeline-model-parallel-size 4
    perf "16 layers, PP=4 x 2 virtual stages" 4 mixtral-small --num-layers 16 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2
    perf "16 layers, PP=4 (1F1B), 16 micro-batches" 4 mixtral-small --num-layers 16 --pipeline-model-parallel-size 4 --micro-batch-size 1
    perf "16 layers, PP=4 x 2 virtual stages (interleaved), 16 micro-batches" 4 mixtral-small --num-layers 16 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --micro-batch-size 1
    perf_default_threads=1 perf "EP=4 alltoall, default host threads" 4 mixtral-small --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
    MOECORE_COMM_TIMERS=1 perf "EP=4 alltoall, dispatch timers on" 4 mixtral-small --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
    perf "one GPU" 1 finegrained-small --micro-batch-size 4
    perf "EP=4 alltoall" 4 finegrained-small --micro-batch-size 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
    MOECORE_COMM_TIMERS=1 perf "EP=4 alltoall, dispatch timers on" 4 finegrained-small --micro-batch-size 4 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall
  else
    perf "one GPU" 1 finegrained-small --micro-batch-size 4
    perf "EP=2 alltoall" 2 finegrained-small --micro-batch-size 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
    perf "EP=2 alltoall --overlap-moe-expert-parallel-comm --delay-wgrad-compute" 2 finegrained-small --micro-batch-size 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm --delay-wgrad-compute
  fi
fi
cards=$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^ *//' | tr '\n' ' ')
echo "gpu-dist: $passed passed, $failed failed on $cards"
[ "$failed" -eq 0 ]

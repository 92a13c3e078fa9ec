#!/usr/bin/env bash
# make gpu-test: CUDA build, then the gpu test tier. The last line is one summary:
#   gpu-test: N passed, N failed, N skipped on <card>
set -uo pipefail
build=${1:-build}
jobs=$(nproc)
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "gpu-test: no CUDA compiler (nvcc) on this machine: the gpu tier needs a CUDA build"; exit 1
fi
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOECORE_CUDA=ON >/dev/null || exit 1
if ! cmake --build "$build" -j "$jobs" >"$build/build.log" 2>&1; then
  grep -E "error|Error" -A3 "$build/build.log" | head -60
  echo "gpu-test: build failed (log: $build/build.log)"; exit 1
fi
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
log="$build/gpu-test.log"
# With several GPUs the tests run as that many shards in parallel (ctest -I start,,stride), one
# GPU each (CUDA_VISIBLE_DEVICES); GPU_TEST_SHARDS=1 runs them one after another on GPU 0.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
shards=${GPU_TEST_SHARDS:-$gpus}
[ "$shards" -ge 1 ] 2>/dev/null || shards=1
total=0; failed=0; skipped=0; unfinished=0
# The gpu tests are discovered when ctest first runs (DISCOVERY_MODE PRE_TEST): once here, since
# shards starting together would race to write the same lists (a shard then runs nothing).
(cd "$build" && ctest -N -L gpu >/dev/null 2>&1)
for i in $(seq 1 "$shards"); do
  (cd "$build" && CUDA_VISIBLE_DEVICES=$((i - 1)) ctest -L gpu -I "$i,,$shards" --output-on-failure --timeout 600) \
    > "$log.$i" 2>&1 &
done
wait
# A shard without ctest's summary line ran nothing (or stopped): a failure, with its log's end.
for i in $(seq 1 "$shards"); do
  if ! grep -qE "^[0-9]+% tests passed" "$log.$i"; then
    echo "gpu-test: shard $i of $shards did not finish its tests:"; tail -20 "$log.$i"
    unfinished=$((unfinished + 1))
  fi
done
cat "$log".* > "$log"; rm -f "$log".*
grep -E "Test +#|tests passed|tests failed|\*\*\*Failed|Skipped" "$log"
for n in $(grep -Eo "out of [0-9]+" "$log" | grep -Eo "[0-9]+"); do total=$((total + n)); done
for n in $(grep -Eo "[0-9]+ tests failed" "$log" | grep -Eo "^[0-9]+"); do failed=$((failed + n)); done
skipped=$(grep -c "\*\*\*Skipped\| Skipped " "$log")
passed=$((total - failed - skipped))
# An unfinished shard counts as one failure: its tests did not run.
echo "gpu-test: ${passed} passed, $((failed + unfinished)) failed, ${skipped} skipped on ${card:-no GPU}"
[ "$total" -gt 0 ] && [ "$failed" -eq 0 ] && [ "$unfinished" -eq 0 ] && [ "$skipped" -eq 0 ]

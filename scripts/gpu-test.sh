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
(cd "$build" && ctest -L gpu --output-on-failure --timeout 600) 2>&1 | tee "$log"
total=$(grep -Eo "out of [0-9]+" "$log" | tail -1 | grep -Eo "[0-9]+")
failed=$(grep -Eo "[0-9]+ tests failed" "$log" | tail -1 | grep -Eo "^[0-9]+")
skipped=$(grep -c "\*\*\*Skipped\| Skipped " "$log")
total=${total:-0}; failed=${failed:-0}
passed=$((total - failed - skipped))
echo "gpu-test: ${passed} passed, ${failed} failed, ${skipped} skipped on ${card:-no GPU}"
[ "$total" -gt 0 ] && [ "$failed" -eq 0 ] && [ "$skipped" -eq 0 ]

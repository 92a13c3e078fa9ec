#!/usr/bin/env bash
# gpu tier: tools/kernel_trace, loaded through CUDA_INJECTION64_PATH, prints the kernels a CUDA
# program ran: the grouped GEMV test's kernel by name, with a count and times, in KERNEL_TRACE_OUT.
#   kernel_trace_gpu.sh GPU_TEST_BINARY TRACE_LIBRARY
set -euo pipefail
bin=$1 lib=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
CUDA_INJECTION64_PATH=$lib KERNEL_TRACE_OUT=$out "$bin" --gtest_filter=GroupedGemv.MatchesCpuLoop > /dev/null
cat "$out"
grep -q "^kernel_trace: [1-9][0-9]* kernels" "$out" || { echo "FAIL: no summary line"; exit 1; }
grep -qE "^ *[0-9.]+% +[1-9][0-9]* +[0-9.]+ .*grouped_gemv_kernel" "$out" || { echo "FAIL: the GEMV kernel is not listed"; exit 1; }
echo "PASS"

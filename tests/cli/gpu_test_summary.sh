#!/usr/bin/env bash
# scripts/gpu-test.sh's summary, on any machine: fake nvidia-smi (two GPUs), cmake (no-op) and
# ctest (each shard passes two tests, or the shard named by FAIL_SHARD prints what a failed test
# discovery prints and runs nothing) stand in for the GPU machine's tools. A shard that ran
# nothing must fail the tier; a shard with a failed test must count it; two good shards pass.
# Usage: gpu_test_summary.sh <source-dir>
set -uo pipefail
src=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/bin" "$dir/build"
cat > "$dir/bin/nvidia-smi" <<'FAKE'
#!/bin/sh
case "$*" in *query*) echo "Fake GPU" ;; *) echo "GPU 0: Fake"; echo "GPU 1: Fake" ;; esac
FAKE
printf '#!/bin/sh\nexit 0\n' > "$dir/bin/cmake"
cat > "$dir/bin/ctest" <<'FAKE'
#!/bin/sh
case "$*" in *-N*) exit 0 ;; esac
shard=$((CUDA_VISIBLE_DEVICES + 1))
if [ "$shard" = "${FAIL_SHARD:-0}" ]; then echo "discover_tests failed to run command:"; exit 1; fi
if [ "$shard" = "${RED_SHARD:-0}" ]; then
  echo " 1/2 Test #1: A ...   Passed    1.00 sec"; echo " 2/2 Test #2: B ...***Failed    1.00 sec"
  echo "50% tests passed, 1 tests failed out of 2"; exit 8
fi
echo " 1/2 Test #1: A ...   Passed    1.00 sec"; echo " 2/2 Test #2: B ...   Passed    1.00 sec"
echo "100% tests passed out of 2"
FAKE
chmod +x "$dir/bin/"*
run() { (cd "$src" && env PATH="$dir/bin:$PATH" "$@" scripts/gpu-test.sh "$dir/build" 2>&1 | tail -1; exit "${PIPESTATUS[0]}"); }
line=$(run env) || { echo "FAIL: two good shards: exit $? ($line)"; exit 1; }
[ "$line" = "gpu-test: 4 passed, 0 failed, 0 skipped on Fake GPU" ] || { echo "FAIL: two good shards: $line"; exit 1; }
echo "two good shards: $line"
if line=$(run env FAIL_SHARD=2); then echo "FAIL: a shard that ran nothing passed: $line"; exit 1; fi
[ "$line" = "gpu-test: 2 passed, 1 failed, 0 skipped on Fake GPU" ] || { echo "FAIL: unfinished shard: $line"; exit 1; }
echo "a shard that ran nothing: $line"
if line=$(run env RED_SHARD=1); then echo "FAIL: a failed test passed: $line"; exit 1; fi
[ "$line" = "gpu-test: 3 passed, 1 failed, 0 skipped on Fake GPU" ] || { echo "FAIL: failed test: $line"; exit 1; }
echo "a failed test: $line"

#!/usr/bin/env bash
# moecore plan --calibrate on the CPU (BIN SRC): the tiny preset's kernels timed on this machine
# into a profile that `moecore plan --profile` reads, and the step it then predicts against the
# step `moecore train` measures here. Tolerance: within a factor of 3 either way. The two runs are
# separate processes on a CPU other jobs share (under ctest -j2 their times move by up to 2x
# between runs), and the model prices the embedding, the output layer and the optimizer without
# measuring them; a wrong unit or a missing term (the small kernels are most of a tiny layer)
# is off by far more. The calibrated prediction must differ from the CPU profile's nominal one, so
# the test fails if the profile's measured fields stop reaching the model. (Whether it is closer
# than the nominal one is not asserted: on some machines the nominal CPU figures happen to be
# close, and the comparison then turns on timing noise.)
set -uo pipefail
bin=$1; src=$2
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
cfg=(--config "$src/configs/tiny.yaml")
fail() { echo "FAIL: $*"; exit 1; }
out=$("$bin" plan --calibrate "${cfg[@]}" --gpus 1 --gpu cpu --device cpu --out "$d/p.json" 2>&1) || { echo "$out"; fail "calibrate exited non-zero"; }
echo "$out" | tail -n 2
python3 - "$d/p.json" <<'PY' || fail "the written profile lacks a measured field"
import json, sys
p = json.load(open(sys.argv[1]))
for k in ("gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency", "small_kernel_efficiency", "grouped_gemm_reference_rows"):
    assert p[k] > 0, k
assert p["measured"]["layer"]["fwd_bwd_ms"] > 0
assert p["grouped_gemm_reference_rows"] == 8 * 32 * 2 / 4, p["grouped_gemm_reference_rows"]  # micro-batch x seq x top-k / experts
PY
pred=$("$bin" plan "${cfg[@]}" --gpus 1 --gpu cpu --profile "$d/p.json" 2>&1 | tail -n 1 |
       python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["step_s"])') || fail "plan --profile did not run"
nominal=$("$bin" plan "${cfg[@]}" --gpus 1 --gpu cpu 2>&1 | tail -n 1 |
          python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["step_s"])') || fail "plan did not run"
"$bin" train "${cfg[@]}" --device cpu --train-iters 12 --log-interval 1 --eval-interval 0 >"$d/train.log" 2>&1 ||
  { cat "$d/train.log"; fail "train exited non-zero"; }
python3 - "$pred" "$nominal" "$d/train.log" <<'PY' || fail "prediction out of tolerance"
import re, statistics, sys
pred, nominal = float(sys.argv[1]), float(sys.argv[2])
ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", open(sys.argv[3]).read())][2:]
measured = statistics.median(ms) / 1e3
print(f"predicted {pred*1e3:.2f} ms (uncalibrated {nominal*1e3:.2f} ms), measured {measured*1e3:.2f} ms (median of {len(ms)} steps)")
assert 1 / 3 <= pred / measured <= 3, "calibrated prediction not within a factor of 3"
assert abs(pred - nominal) > 1e-3 * nominal, "the calibrated profile did not change the prediction"
PY
echo PASS

#!/usr/bin/env bash
# moecore plan --calibrate on the CPU (BIN SRC): the tiny preset's kernels timed on this machine
# into a profile that `moecore plan --profile` reads, and the step it then predicts against the
# step `moecore train` measures here. Tolerance: within a factor of 2 either way. The two runs are
# separate processes on a CPU other jobs share (their times move by tens of percent between
# runs), and the model prices the embedding, the output layer and the optimizer without
# measuring them; a wrong unit or a missing term (the small kernels are most of a tiny layer)
# is off by far more. Without the calibration the CPU profile's nominal figures are checked to be
# further off than the calibrated ones, so the test fails if calibrating stops mattering.
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
import math, re, statistics, sys
pred, nominal = float(sys.argv[1]), float(sys.argv[2])
ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", open(sys.argv[3]).read())][2:]
measured = statistics.median(ms) / 1e3
print(f"predicted {pred*1e3:.2f} ms (uncalibrated {nominal*1e3:.2f} ms), measured {measured*1e3:.2f} ms (median of {len(ms)} steps)")
assert 0.5 <= pred / measured <= 2, "calibrated prediction not within a factor of 2"
assert abs(math.log(pred / measured)) < abs(math.log(nominal / measured)), "calibration did not bring the prediction closer"
PY
echo PASS

#!/usr/bin/env bash
# bench/plan_vs_measured.sh's own logic on the CPU (BIN SRC): a stand-in nvidia-smi names an H200
# and one GPU, the layouts file holds the tiny preset on one rank, so the script plans it and
# trains it here: it must print one JSON line with the plan's peak and the measured peaks and step,
# and a table row (the figures themselves mean nothing on a CPU).
set -uo pipefail
bin=$1; src=$2
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
mkdir -p "$d/bin" "$d/build"
printf '#!/bin/sh\ncase "$1" in -L) echo "GPU 0: NVIDIA H200 (stand-in)";; *) echo "NVIDIA H200";; esac\n' > "$d/bin/nvidia-smi"
chmod +x "$d/bin/nvidia-smi"
ln -s "$bin" "$d/build/moecore"
printf '# a comment line\n1 | --config configs/tiny.yaml --global-batch-size 16\n4 | --config configs/tiny.yaml --expert-model-parallel-size 4\n' > "$d/layouts.txt"
out=$(cd "$src" && PATH="$d/bin:$PATH" bench/plan_vs_measured.sh "$d/build" "$d/layouts.txt" 2>&1) || { echo "$out"; echo "FAIL: the script exited non-zero"; exit 1; }
echo "$out"
python3 - "$out" <<'PY' || { echo "FAIL: no JSON line with the peaks and the step"; exit 1; }
import json, sys
rows = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith('{"bench":"plan_vs_measured"')]
assert len(rows) == 1, rows
r = rows[0]
assert r["layout"] == 1 and r["gpus"] == 1, r
assert r["predicted_peak_bytes"] > 0 and r["measured_peak_bytes"] > 0 and r["measured_reserved_bytes"] > 0, r
assert r["measured_step_ms"] > 0, r
# the plan and the memory report agree on the tiny preset (docs/planning.md: the CPU layouts within 5%)
assert abs(r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1) < 0.05, r
PY
grep -q "layout 2: needs 4 GPUs, skipped" <<<"$out" || { echo "FAIL: the 4-GPU layout was not skipped"; exit 1; }
grep -qE '^\| 1 \| 1 \| ' <<<"$out" || { echo "FAIL: no table row"; exit 1; }
echo PASS

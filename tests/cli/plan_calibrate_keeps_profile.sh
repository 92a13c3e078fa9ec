#!/usr/bin/env bash
# moecore plan --calibrate --out FILE (BIN SRC): a refused calibration (here CP, which is not
# calibrated) exits non-zero and leaves an existing FILE as it was, with no temporary file behind;
# the profile is written only after the measurement, through FILE.tmp renamed over FILE.
set -uo pipefail
bin=$1; src=$2
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
echo '{"name": "kept"}' > "$d/p.json"
if "$bin" plan --config "$src/configs/tiny.yaml" --gpus 2 --gpu cpu --device cpu --calibrate \
     --context-parallel-size 2 --out "$d/p.json" > "$d/out.log" 2>&1; then
  cat "$d/out.log"; echo "FAIL: the refused calibration exited 0"; exit 1
fi
grep -q "is not calibrated" "$d/out.log" || { cat "$d/out.log"; echo "FAIL: not the CP refusal"; exit 1; }
[ "$(cat "$d/p.json")" = '{"name": "kept"}' ] || { echo "FAIL: the existing profile changed:"; cat "$d/p.json"; exit 1; }
[ ! -e "$d/p.json.tmp" ] || { echo "FAIL: a temporary file was left"; exit 1; }
# a calibration that runs replaces the file (and removes the temporary)
"$bin" plan --config "$src/configs/tiny.yaml" --gpus 1 --gpu cpu --device cpu --calibrate --out "$d/p.json" \
  > "$d/ok.log" 2>&1 || { cat "$d/ok.log"; echo "FAIL: calibrate exited non-zero"; exit 1; }
grep -q '"small_kernel_efficiency"' "$d/p.json" || { echo "FAIL: the profile was not replaced"; exit 1; }
[ ! -e "$d/p.json.tmp" ] || { echo "FAIL: a temporary file was left after writing"; exit 1; }
echo PASS

#!/usr/bin/env bash
# One GPU: --optimizer-cpu-offload with --optimizer-offload-fraction 0.5 and 1.0 (the host AdamW
# updates that part from pinned host memory while the GPU updates the rest) prints exactly the
# lm loss, load_balancing_loss, grad norm and params norm of the run that keeps everything on the
# GPU, in bf16 (whole masters: --no-store-param-remainders) and in fp32; a run with offload 0.5
# resumes bit-identically from its checkpoint; --memory-report shows a host line. BIN SRC.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --device cuda --train-iters 4 --lr-warmup-iters 1 --log-interval 1
      --eval-interval 0 --micro-batch-size 4 --global-batch-size 16 --num-attention-heads 2)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*\|"params_norm":[^,}]*' "$1"; }
run() {  # name args...
  local name=$1; shift
  "$bin" "${base[@]}" "$@" --metrics-file "$dir/$name.jsonl" > "$dir/$name.log" 2>&1 || { cat "$dir/$name.log"; exit 1; }
  # 4 values per logged step: 4 steps, or the 2 after the checkpoint for a resumed run
  [ "$(values "$dir/$name.jsonl" | wc -l)" -ge "${min_values:-16}" ] || { cat "$dir/$name.log"; echo "FAIL: $name logged too little"; exit 1; }
}
# (each run its own metrics file: the trainer appends to an existing one)
case_no=0
for precision in "--bf16 --no-store-param-remainders" "--bf16 --no-store-param-remainders --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" ""; do
  read -r -a p <<<"$precision"
  case_no=$((case_no + 1))
  run "plain$case_no" "${p[@]}"
  for fraction in 0.5 1.0; do
    run "offloaded${case_no}_$fraction" "${p[@]}" --optimizer-cpu-offload --optimizer-offload-fraction "$fraction"
    a="$dir/plain$case_no.jsonl" b="$dir/offloaded${case_no}_$fraction.jsonl"
    cmp <(values "$a") <(values "$b") ||
      { paste <(values "$a") <(values "$b"); echo "FAIL: [${precision:-fp32}] offload $fraction differs"; exit 1; }
    echo "[${precision:-fp32}] offload $fraction: bit-identical to no offload"
  done
done
bf16=(--bf16 --no-store-param-remainders --optimizer-cpu-offload --optimizer-offload-fraction 0.5)
run full "${bf16[@]}" --save "$dir/ckpt" --save-interval 2
min_values=8 run resumed "${bf16[@]}" --load "$dir/ckpt/iter_0000002"
cmp <(values "$dir/full.jsonl" | tail -n 8) <(values "$dir/resumed.jsonl" | tail -n 8) ||
  { echo "FAIL: the resumed offloaded run differs"; exit 1; }
echo "offload 0.5 resumed: bit-identical"
run report "${bf16[@]}" --memory-report
grep -q "host memory (not in the peak)" "$dir/report.log" || { cat "$dir/report.log"; echo "FAIL: no host line"; exit 1; }
grep -q "check: the parts sum to .*(within 3%)" "$dir/report.log" || { cat "$dir/report.log"; echo "FAIL: check line"; exit 1; }
echo PASS

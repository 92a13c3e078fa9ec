#!/usr/bin/env bash
# Activation offloading through the trainer on one GPU (BIN SRC): a tiny bf16 MoE model (4 layers,
# 4 micro-batches a step) trains 3 steps with and without --fine-grained-activation-offloading
# (every module; expert_fc1 + moe_act with moe_act recomputed) and logs bit-identical lm loss,
# balancing loss and grad norm; with --memory-report the parts still sum to the peak within 3%
# and a host_offloaded line names the offloaded modules. Prints both runs' peaks.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
base=(train --config "$src/configs/tiny.yaml" --device cuda --bf16 --num-attention-heads 2 --train-iters 3
      --lr-warmup-iters 1 --log-interval 1 --eval-interval 0 --micro-batch-size 4 --global-batch-size 16
      --num-layers 4 --memory-report)
values() { grep -o '"lm_loss":[^,}]*\|"load_balancing_loss":[^,}]*\|"grad_norm":[^,}]*' "$1"; }
peak() { grep -o '"mem_max_allocated_bytes":[0-9]*' "$1" | cut -d: -f2 | sort -n | tail -n 1; }
run() {  # name flags...
  local name=$1; shift
  "$bin" "${base[@]}" --metrics-file "$dir/$name.jsonl" "$@" >"$dir/$name.log" 2>&1 || { cat "$dir/$name.log"; exit 1; }
  [ "$(values "$dir/$name.jsonl" | wc -l)" -ge 9 ] || { cat "$dir/$name.log"; echo "FAIL: $name logged nothing"; exit 1; }
  grep -q 'check: the parts sum to .*(within 3%)' "$dir/$name.log" || { cat "$dir/$name.log"; echo "FAIL: $name check line"; exit 1; }
}
offload=(--fine-grained-activation-offloading --offload-modules)
run plain
run every "${offload[@]}" attn_norm core_attn attn_proj mlp_norm expert_fc1 moe_act
run plain_recompute --recompute-granularity selective --recompute-modules moe_act
run experts "${offload[@]}" expert_fc1 moe_act --recompute-granularity selective --recompute-modules moe_act
cmp <(values "$dir/plain.jsonl") <(values "$dir/every.jsonl") || { echo "FAIL: every module offloaded differs"; exit 1; }
cmp <(values "$dir/plain_recompute.jsonl") <(values "$dir/experts.jsonl") ||
  { echo "FAIL: expert_fc1 + moe_act offloaded with moe_act recomputed differs"; exit 1; }
grep -qE '^ +host_offloaded [0-9.]+ MB at most in host memory, not in the peak \(expert_fc1 [0-9.]+, moe_act [0-9.]+\)' \
  "$dir/experts.log" || { cat "$dir/experts.log"; echo "FAIL: no host_offloaded line"; exit 1; }
echo "peak allocated: plain $(peak "$dir/plain.jsonl"), every module offloaded $(peak "$dir/every.jsonl");" \
     "moe_act recomputed $(peak "$dir/plain_recompute.jsonl"), + expert_fc1 moe_act offloaded $(peak "$dir/experts.jsonl")"
echo PASS

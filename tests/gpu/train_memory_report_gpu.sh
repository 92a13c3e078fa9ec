#!/usr/bin/env bash
# --memory-report on one GPU (BIN SRC CONFIG [flags...]): the record in metrics.jsonl has parts
# (weights, gradients, optimizer state, activations by module, communication, workspace,
# untagged, allocator overhead) that sum to the CUDA allocator's peak (reserved bytes) within
# 3%, at most 3% of the peak untagged, named activation modules (core_attn, expert_fc1,
# moe_act), and the peak it reports handed out equals the log's mem_max_allocated_bytes.
set -euo pipefail
bin=$1; src=$2; config=$3; shift 3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
"$bin" train --config "$src/configs/$config" --device cuda --train-iters 3 --lr-warmup-iters 1 --log-interval 2 \
  --eval-interval 0 --memory-report --metrics-file "$dir/m.jsonl" "$@" >"$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
sed -n '/memory report at/,/check:/p' "$dir/log"
python3 - "$dir/m.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
r = [l for l in lines if "memory_report" in l][0]["memory_report"][0]
logged = next(l for l in lines if l.get("iteration") == 2 and "lm_loss" in l)["mem_max_allocated_bytes"]
parts = ["weights", "gradients", "optimizer_state", "activations", "communication", "workspace", "untagged",
         "allocator_overhead"]
total = sum(r[p] for p in parts)
peak = r["peak_reserved_bytes"]
print(f"parts {total / 1e9:.4f} GB, allocator peak {peak / 1e9:.4f} GB reserved ({total / peak * 100:.2f}%), "
      f"untagged {r['untagged'] / peak * 100:.2f}%")
assert abs(total / peak - 1) <= 0.03, "the parts do not sum to the peak within 3%"
assert r["untagged"] <= 0.03 * peak, "more than 3% untagged"
assert r["peak_allocated_bytes"] == logged, (r["peak_allocated_bytes"], logged)
for m in ("core_attn", "expert_fc1", "moe_act"):
    assert r["activation_modules"].get(m, 0) > 0, f"no {m}"
print("PASS")
PY

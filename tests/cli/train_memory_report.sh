#!/usr/bin/env bash
# --memory-report on the tiny model (CPU): one rank, PP2 and EP2 under mpirun. At the first log
# step the logging rank prints every rank's report: the categories, the saved activations by
# module name (core_attn, attn_norm; expert_fc1 and moe_act where the rank holds MoE layers), a
# check line per rank within 3%; metrics.jsonl gets one memory_report record whose parts sum to
# the logged peak (mem_max_allocated_bytes of the logging rank) within 3% and to each rank's
# allocator peak, with at most 3% of the peak untagged. Only once per run; none without the flag.
# With --recompute-modules layernorm the norms' rows shrink and the peak drops.
set -uo pipefail
bin=$1; src=$2; mpiexec=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
fail() { cat "$dir/log"; echo "FAIL: $*"; exit 1; }
train=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --log-interval 2 --lr-warmup-iters 1
       --eval-interval 0 --micro-batch-size 4 --global-batch-size 16)
run() {  # np args...
  local np=$1; shift
  rm -f "$dir/metrics.jsonl"
  if [ "$np" = 1 ]; then
    "$bin" "${train[@]}" --metrics-file "$dir/metrics.jsonl" "$@" >"$dir/log" 2>&1 || fail "exit code $? with $*"
  else
    "$mpiexec" -np "$np" "$bin" "${train[@]}" --metrics-file "$dir/metrics.jsonl" "$@" >"$dir/log" 2>&1 ||
      fail "exit code $? with np $np $*"
  fi
}
check() {  # np modules...: the printed report and the record
  local np=$1; shift
  [ "$(grep -c 'memory report at iteration 2 ' "$dir/log")" = 1 ] || fail "np $np: not one report at iteration 2"
  [ "$(grep -c '^   rank [0-9]*: peak' "$dir/log")" = "$np" ] || fail "np $np: not $np ranks in the report"
  [ "$(grep -c 'check: the parts sum to .*(within 3%)' "$dir/log")" = "$np" ] || fail "np $np: a check line is off"
  for name in weights gradients optimizer_state activations communication workspace untagged allocator_overhead "$@"; do
    grep -qE "^ +$name +[0-9.]+ MB" "$dir/log" || fail "np $np: no report line for $name"
  done
  python3 - "$dir/metrics.jsonl" "$np" <<'PY' || fail "np $np: the metrics record"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
reports = [l for l in lines if "memory_report" in l]
assert len(reports) == 1 and reports[0]["iteration"] == 2, f"expected one memory_report record at iteration 2: {reports}"
ranks = reports[0]["memory_report"]
assert len(ranks) == int(sys.argv[2]), ranks
logged = next(l for l in lines if l.get("iteration") == 2 and "lm_loss" in l)["mem_max_allocated_bytes"]
parts = ["weights", "gradients", "optimizer_state", "activations", "communication", "workspace", "untagged",
         "allocator_overhead"]
for r in ranks:
    total = sum(r[p] for p in parts)
    assert total == r["parts_sum_bytes"], (total, r)
    assert sum(r["activation_modules"].values()) == r["activations"], r
    assert abs(total / r["peak_reserved_bytes"] - 1) <= 0.03, f"rank {r['rank']}: parts {total} vs peak {r['peak_reserved_bytes']}"
    assert r["untagged"] <= 0.03 * r["peak_reserved_bytes"], f"rank {r['rank']}: {r['untagged']} bytes untagged"
    for p in ("weights", "gradients", "optimizer_state", "activations"):
        assert r[p] > 0, f"rank {r['rank']}: no {p}"
last = ranks[-1]  # the logging rank
assert abs(last["parts_sum_bytes"] / logged - 1) <= 0.03, f"parts {last['parts_sum_bytes']} vs the logged peak {logged}"
print("ranks:", [(r["rank"], r["parts_sum_bytes"], r["peak_reserved_bytes"], r["untagged"]) for r in ranks])
PY
}

run 1 --memory-report
check 1 core_attn attn_norm residual expert_fc1 moe_act router moe_dispatch output_layer batch
run 2 --memory-report --pipeline-model-parallel-size 2
check 2 core_attn attn_norm expert_fc1 moe_act
python3 -c 'import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if "memory_report" in l][0]["memory_report"]
sys.exit(0 if any(x["communication"] > 0 for x in r) else 1)' "$dir/metrics.jsonl" ||
  fail "PP2: no rank shows its pipeline buffers as communication"
run 2 --memory-report --expert-model-parallel-size 2
check 2 core_attn expert_fc1 moe_act moe_dispatch
# --recompute-modules layernorm: the norms' outputs leave the activations (the rerun is charged to
# attn_norm / mlp_norm again while the backward holds it), the check stays within 3%, the peak drops.
run 1 --memory-report
cp "$dir/metrics.jsonl" "$dir/kept.jsonl"
run 1 --memory-report --recompute-granularity selective --recompute-modules layernorm
check 1 core_attn expert_fc1 moe_act
python3 - "$dir/kept.jsonl" "$dir/metrics.jsonl" <<'PY' || fail "--recompute-modules layernorm: the report"
import json, sys
def report(path):
    return next(json.loads(l) for l in open(path) if "memory_report" in l)["memory_report"][0]
kept, rerun = report(sys.argv[1]), report(sys.argv[2])
norms = lambda r: r["activation_modules"].get("attn_norm", 0) + r["activation_modules"].get("mlp_norm", 0)
print("norms at the peak:", norms(kept), "->", norms(rerun), "; peak:", kept["peak_reserved_bytes"], "->", rerun["peak_reserved_bytes"])
assert norms(rerun) < 0.6 * norms(kept), "the norms' outputs are still kept"
assert rerun["peak_reserved_bytes"] < kept["peak_reserved_bytes"], "the peak did not drop"
PY
run 1
grep -q "memory report" "$dir/log" && fail "a report without --memory-report"
grep -q memory_report "$dir/metrics.jsonl" && fail "a memory_report record without --memory-report"
echo PASS

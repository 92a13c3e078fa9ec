#!/usr/bin/env bash
# bench/offload_table.sh BIN [PRESET...]: the cost of fine-grained activation offloading on one
# GPU (make bench-offload builds moecore and runs it). For each preset (default: the two benchmark
# models, configs/mixtral-small.yaml and finegrained-small.yaml) it trains 15 steps plain and with
# --fine-grained-activation-offloading --offload-modules expert_fc1 moe_act (the default in-flight
# window, and MOECORE_OFFLOAD_WINDOW=1: less memory, more waiting), and with mlp_norm added.
# Each run: the step time and tokens/s of steps 11-15 (metrics.jsonl at iteration 15, log
# interval 5), the peak of allocated memory, and whether its logged losses and gradient norms are
# bit-identical to the plain run's. One JSON line per run, then a table.
# OFFLOAD_ITERS changes the steps (default 15, a multiple of 5 above 5).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BIN [PRESET...]" >&2; exit 2; }
bin=$1; shift
presets=("$@"); [ ${#presets[@]} -gt 0 ] || presets=(mixtral-small finegrained-small)
iters=${OFFLOAD_ITERS:-15}
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
off="--fine-grained-activation-offloading --offload-modules"
# label | MOECORE_OFFLOAD_WINDOW (empty: unset) | flags
cases=("plain||"
       "expert_fc1 moe_act||$off expert_fc1 moe_act"
       "expert_fc1 moe_act, window 1|1|$off expert_fc1 moe_act"
       "mlp_norm expert_fc1 moe_act||$off mlp_norm expert_fc1 moe_act")
values() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    j=json.loads(l); print(j.get("iteration"), *[repr(j.get(k)) for k in ("lm_loss","load_balancing_loss","grad_norm")])' "$1"; }
field() { python3 -c 'import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if json.loads(l).get("iteration") == int(sys.argv[3])]
print(rows[-1].get(sys.argv[2]) if rows else "-")' "$1" "$2" "$iters"; }
status=0; rows=()
for preset in "${presets[@]}"; do
  base_ms=""
  for c in "${cases[@]}"; do
    IFS='|' read -r label window flags <<<"$c"
    m="$work/$preset.$(tr -c 'a-z0-9' _ <<<"$label").jsonl"
    # shellcheck disable=SC2086
    if ! env ${window:+MOECORE_OFFLOAD_WINDOW=$window} "$bin" train --config "$src/configs/$preset.yaml" \
        --train-iters "$iters" --log-interval 5 --eval-interval 0 --lr-warmup-iters 1 $flags --metrics-file "$m" \
        > "$m.log" 2>&1; then
      echo "offload_table: $preset ($label) failed:"; tail -5 "$m.log"; status=1; continue
    fi
    ms=$(field "$m" ms_per_iteration | awk '{ printf "%.2f", $1 }')
    tps=$(field "$m" tokens_per_s | awk '{ printf "%.0f", $1 }'); peak=$(field "$m" mem_max_allocated_bytes)
    peak_gb=$(awk -v p="$peak" 'BEGIN { printf "%.2f", p / 1e9 }')
    same=-; cost=-
    if [ "$label" = plain ]; then
      base_ms=$ms; plain="$m"
    else
      if cmp -s <(values "$plain") <(values "$m"); then same=yes; else same=NO; status=1; fi
      cost=$(awk -v a="$base_ms" -v b="$ms" 'BEGIN { if (a + 0 > 0) printf "%+.1f%%", 100 * (b - a) / a; else print "-" }')
    fi
    echo "{\"bench\":\"offload\",\"preset\":\"$preset\",\"case\":\"$label\",\"ms_per_step\":$ms,\"tokens_per_s\":$tps,\"peak_gb\":$peak_gb,\"bit_identical\":\"$same\"}"
    rows+=("| $preset | $label | $ms | $tps | $cost | $peak_gb | $same |")
  done
done
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
printf "\n%s, steps %s-%s of %s, on %s\n" "$bin" $((iters - 4)) "$iters" "$iters" "${card:-no GPU}"
printf "| preset | offloaded | ms/step | tokens/s | cost | peak GB | losses bit-identical |\n|---|---|---|---|---|---|---|\n"
printf "%s\n" "${rows[@]}"
exit $status

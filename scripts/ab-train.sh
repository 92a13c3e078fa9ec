#!/usr/bin/env bash
# ab-train.sh BIN_A BIN_B [ROUNDS] [PRESET...]: two moecore binaries (e.g. before and after a
# change) train the same presets on one GPU, alternating A, B, A, B, ... ROUNDS times (default 3),
# so that clock and power drift hit both alike. Each run: 20 steps, the step time of steps 11-20
# (metrics.jsonl's ms_per_iteration at iteration 20, log interval 10).
# Prints one JSON line per run, then a table: median and min ms/step of each binary, B's change,
# the peaks of allocated and reserved memory, and whether the two binaries logged bit-identical losses and gradient norms
# (every logged step's lm_loss, load_balancing_loss, z_loss, grad_norm, params_norm).
# Presets default to the two benchmark models (configs/mixtral-small.yaml, finegrained-small.yaml).
# AB_LAUNCH prefixes each run (e.g. "mpirun -np 2 -x NCCL_NVLS_ENABLE" for several GPUs) and
# AB_FLAGS adds flags to both (e.g. "--expert-model-parallel-size 2"), AB_FLAGS_B to B only: one
# binary twice compares an option's cost, e.g. activation offloading's step time and peak:
#   AB_FLAGS_B="--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act" \
#     scripts/ab-train.sh build/moecore build/moecore
# or CUDA graphs (steps 5-9 and 11-19 replay the graph captured at step 4; the timed steps 11-20
# are nine replays and the eager log step):
#   AB_FLAGS_B="--cuda-graph-impl local --cuda-graph-scope full_iteration" scripts/ab-train.sh build/moecore build/moecore
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BIN_A BIN_B [ROUNDS] [PRESET...]" >&2; exit 2; }
bin_a=$1; bin_b=$2; shift 2
rounds=3
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then rounds=$1; shift; fi
presets=("$@"); [ ${#presets[@]} -gt 0 ] || presets=(mixtral-small finegrained-small)
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
status=0; rows=()
# the values that must agree between the binaries, one line per logged step
values() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    j=json.loads(l); print(j.get("iteration"), *[repr(j.get(k)) for k in ("lm_loss","load_balancing_loss","z_loss","grad_norm","params_norm")])' "$1"; }
field() { python3 -c 'import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]; print(rows[-1].get(sys.argv[2]))' "$1" "$2"; }
for preset in "${presets[@]}"; do
  for r in $(seq 1 "$rounds"); do
    for side in a b; do
      bin=$bin_a; side_flags=""
      [ $side = b ] && { bin=$bin_b; side_flags=${AB_FLAGS_B:-}; }
      m="$work/$preset.$side.$r.jsonl"
      if ! ${AB_LAUNCH:-} "$bin" train --config "$src/configs/$preset.yaml" --train-iters 20 --log-interval 10 \
          --eval-interval 0 --lr-warmup-iters 2 ${AB_FLAGS:-} $side_flags --metrics-file "$m" > "$m.log" 2>&1; then
        echo "ab-train: $preset ($side, round $r) failed:"; tail -5 "$m.log"; status=1; continue
      fi
      echo "{\"bench\":\"ab_train\",\"preset\":\"$preset\",\"binary\":\"$side\",\"round\":$r,\"ms_per_step\":$(field "$m" ms_per_iteration),\"peak_bytes\":$(field "$m" mem_max_allocated_bytes),\"peak_reserved_bytes\":$(field "$m" mem_max_reserved_bytes)}"
    done
  done
  stats() {  # side -> "median min peak_gb"
    for f in "$work/$preset.$1".*.jsonl; do field "$f" ms_per_iteration; done | sort -g |
      awk '{ v[NR] = $1 } END { if (NR == 0) { print "- - -"; exit } m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.2f %.2f", m, v[1] }'
    local first; first=$(ls "$work/$preset.$1".*.jsonl | head -1)
    printf " %.2f/%.2f\n" "$(field "$first" mem_max_allocated_bytes | awk '{ print $1 / 1e9 }')" \
      "$(field "$first" mem_max_reserved_bytes | awk '{ print ($1 == "None" ? 0 : $1) / 1e9 }')"
  }
  read -r med_a min_a peak_a <<<"$(stats a)"; read -r med_b min_b peak_b <<<"$(stats b)"
  same=yes
  for r in $(seq 1 "$rounds"); do
    cmp -s <(values "$work/$preset.a.$r.jsonl") <(values "$work/$preset.a.1.jsonl") || same="no (A varies between runs)"
    cmp -s <(values "$work/$preset.b.$r.jsonl") <(values "$work/$preset.a.1.jsonl") || { [ "$same" = yes ] && same=no; }
  done
  [ "$same" = yes ] || { diff <(values "$work/$preset.a.1.jsonl") <(values "$work/$preset.b.1.jsonl") | head -4; }
  change=$(awk -v a="$med_a" -v b="$med_b" 'BEGIN { if (a + 0 > 0) printf "%+.1f%%", 100 * (b - a) / a; else print "-" }')
  rows+=("| $preset | $med_a ($min_a) | $med_b ($min_b) | $change | $peak_a ; $peak_b | $same |")
done
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
printf "\nA = %s, B = %s, %s rounds alternating, on %s%s\n" "$bin_a" "$bin_b" "$rounds" "${card:-no GPU}" \
  "${AB_LAUNCH:+, launched with $AB_LAUNCH}${AB_FLAGS:+, flags $AB_FLAGS}${AB_FLAGS_B:+, B adds $AB_FLAGS_B}"
printf "| preset | A ms/step median (min) | B ms/step median (min) | B vs A | peak GB allocated/reserved: A ; B | losses bit-identical |\n|---|---|---|---|---|---|\n"
printf "%s\n" "${rows[@]}"
exit $status

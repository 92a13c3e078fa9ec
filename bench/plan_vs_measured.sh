#!/usr/bin/env bash
# The planner against the card (issue 33): for each layout of bench/plan_layouts.txt that fits
# the machine's GPU count, `moecore plan` (the card's profile, or --profile FILE from PLAN_PROFILE)
# beside `moecore train` for 8 steps with --memory-report: the largest rank's peak of allocated
# bytes (the memory report, written at the first log step: the first step's peak, optimizer state
# included) against the plan's largest stage (the largest
# reserved peak beside it: the allocator's cached blocks, which the plan leaves out), and the median
# step time of steps 4-8 against the plan's step. Prints a JSON line per layout, then a table.
# PLAN_CALIBRATE=1: each layout's kernels are first timed on GPU 0 (`moecore plan --calibrate` at
# its rank-local shapes; a CP layout without CP) and the plan uses that profile.
# PLAN_FORCE_BALANCE=1: the training runs route with --moe-router-force-load-balancing, the
# balanced routing the plan assumes (without it, the measured step includes the imbalance's wait).
# Usage: bench/plan_vs_measured.sh [build-dir] [layouts-file]
set -uo pipefail
build=${1:-build}; layouts=${2:-bench/plan_layouts.txt}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$card" in *H200*) profile=h200 ;; *H100*) profile=h100 ;; *) echo "plan_vs_measured: no H100/H200 here ($card)"; exit 1 ;; esac
plan_extra=()
[ -n "${PLAN_PROFILE:-}" ] && plan_extra=(--profile "$PLAN_PROFILE")
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
rows=(); status=0; n=0
while IFS='|' read -r np flags; do
  np=$(echo "$np" | tr -d ' '); [ -z "$np" ] && continue; case "$np" in \#*) continue ;; esac
  n=$((n + 1))
  [ "$np" -le "$gpus" ] || { echo "layout $n: needs $np GPUs, skipped"; continue; }
  read -r -a f <<<"$flags"
  layout_profile=("${plan_extra[@]}")
  if [ "${PLAN_CALIBRATE:-0}" = 1 ]; then
    read -r -a fc <<<"$(sed -E 's/--context-parallel-size [0-9]+//' <<<"$flags")"
    if ! CUDA_VISIBLE_DEVICES=0 "$build/moecore" plan --calibrate "${fc[@]}" --gpus "$np" --gpu "$profile" \
        --out "$work/p$n.json" < /dev/null > "$work/c$n.log" 2>&1; then
      echo "layout $n: calibrate failed:"; tail -3 "$work/c$n.log"; status=1; continue
    fi
    layout_profile=(--profile "$work/p$n.json")
  fi
  train_extra=()
  [ "${PLAN_FORCE_BALANCE:-0}" = 1 ] && train_extra=(--moe-router-force-load-balancing)
  plan=$("$build/moecore" plan "${f[@]}" --gpus "$np" --gpu "$profile" "${layout_profile[@]}" 2>&1 < /dev/null | tail -1)
  pred_peak=$(grep -o '"peak_bytes":[^,}]*' <<<"$plan" | head -1 | cut -d: -f2)
  pred_step=$(grep -o '"step_s":[^,}]*' <<<"$plan" | cut -d: -f2)
  [ -n "$pred_peak" ] && [ -n "$pred_step" ] || { echo "layout $n: plan failed: $plan"; status=1; continue; }
  m="$work/m$n.jsonl"
  launch=(); [ "$np" -gt 1 ] && launch=(mpirun --allow-run-as-root -np "$np" -x NCCL_NVLS_ENABLE)
  if ! timeout 300 "${launch[@]}" "$build/moecore" train "${f[@]}" "${train_extra[@]}" --train-iters 8 --log-interval 1 --eval-interval 0 \
      --memory-report --metrics-file "$m" < /dev/null > "$work/t$n.log" 2>&1; then
    echo "layout $n: train failed:"; tail -5 "$work/t$n.log"; status=1; continue
  fi
  meas_peak=$(grep '"memory_report"' "$m" | tail -1 | grep -o '"peak_allocated_bytes":[^,}]*' | cut -d: -f2 | sort -g | tail -1)
  meas_reserved=$(grep '"memory_report"' "$m" | tail -1 | grep -o '"peak_reserved_bytes":[^,}]*' | cut -d: -f2 | sort -g | tail -1)
  meas_step=$(grep -o '"ms_per_iteration":[^,}]*' "$m" | tail -5 | cut -d: -f2 | sort -g | sed -n 3p)
  line=$(awk -v n="$n" -v np="$np" -v pp="$pred_peak" -v mp="$meas_peak" -v ps="$pred_step" -v ms="$meas_step" 'BEGIN {
    printf "%d %d %.2f %.2f %+.1f %.1f %.1f %+.1f", n, np, pp / 1e9, mp / 1e9, 100 * (pp / mp - 1), ps * 1e3, ms, 100 * (ps * 1e3 / ms - 1) }')
  read -r _ _ ppg mpg perr psm msm serr <<<"$line"
  echo "{\"bench\":\"plan_vs_measured\",\"layout\":$n,\"calibrated\":${PLAN_CALIBRATE:-0},\"forced_balance\":${PLAN_FORCE_BALANCE:-0},\"gpus\":$np,\"flags\":\"${flags# }\",\"predicted_peak_bytes\":$pred_peak,\"measured_peak_bytes\":$meas_peak,\"measured_reserved_bytes\":$meas_reserved,\"predicted_step_ms\":$psm,\"measured_step_ms\":$meas_step}"
  rows+=("| $n | $np | $ppg / $mpg | ${perr}% | $(awk -v r="$meas_reserved" 'BEGIN { printf "%.2f", r / 1e9 }') | $psm / $msm | ${serr}% |")
done < "$layouts"
printf "\n| # | GPUs | peak GB predicted / measured | error | reserved peak GB | step ms predicted / measured | error |\n|---|---|---|---|---|---|---|\n"
printf "%s\n" "${rows[@]}"
echo "plan_vs_measured: ${#rows[@]} layouts on $gpus x $card (profile $profile${PLAN_PROFILE:+ + $PLAN_PROFILE}$([ "${PLAN_CALIBRATE:-0}" = 1 ] && echo ", calibrated per layout")$([ "${PLAN_FORCE_BALANCE:-0}" = 1 ] && echo ", forced balanced routing"))"
exit $status

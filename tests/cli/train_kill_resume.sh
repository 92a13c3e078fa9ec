#!/usr/bin/env bash
# Kill -9 during training and checkpoint writes, then resume (CPU, one rank, --save-interval 1):
# a run killed at several points (after a delay, and right after a checkpoint's iter_N.tmp-PID
# directory appears, i.e. mid-write) and resumed each time with --load from the newest complete
# checkpoint ends with exactly the losses of an uninterrupted run (every metrics.jsonl line of
# every attempt equals the uninterrupted run's line of that iteration, bit for bit), and no
# temp directory of a dead writer is left after the later saves.
set -uo pipefail
bin=$1; src=$2
iters=60
dir=$(mktemp -d); pid=""
trap 'if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null; fi; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
common=(train --config "$src/configs/tiny.yaml" --device cpu --train-iters "$iters" --log-interval 1 --eval-interval 0
        --lr-warmup-iters 2 --save-interval 1)
# iteration, learning rate and loss of each complete metrics line (a killed writer may leave half a line)
losses() { grep -h '^{.*}$' "$@" | grep -o '"iteration":[0-9]*,"learning_rate":[^,]*,"lm_loss":[^,]*'; }

"$bin" "${common[@]}" --save "$dir/full" --metrics-file "$dir/full.jsonl" >"$dir/full.log" 2>&1 ||
  { cat "$dir/full.log"; fail "the uninterrupted run failed"; }
[ "$(losses "$dir/full.jsonl" | wc -l)" -eq "$iters" ] || fail "the uninterrupted run logged no $iters losses"

ckpt="$dir/ckpt"
latest() { local v=0; [ -f "$ckpt/latest_checkpointed_iteration.txt" ] && read -r v <"$ckpt/latest_checkpointed_iteration.txt"; echo "${v:-0}"; }
mid_write=0
# Kills, counted in checkpoints so that each attempt makes progress whatever the machine's speed:
# odd attempts as soon as a checkpoint's temp directory appears after one more save (mid-write;
# after 8 more saves at the latest), even ones a moment after 3 more saves.
for attempt in 1 2 3 4 5 6; do
  start=$(latest)
  "$bin" "${common[@]}" --save "$ckpt" --load "$ckpt" --metrics-file "$dir/run-$attempt.jsonl" \
    >"$dir/run-$attempt.log" 2>&1 &
  pid=$!
  deadline=$((SECONDS + 60))
  if (( attempt % 2 == 1 )); then
    until (( $(latest) > start )) || (( SECONDS > deadline )) || ! kill -0 "$pid" 2>/dev/null; do sleep 0.01; done
    while (( SECONDS < deadline )) && (( $(latest) < start + 8 )) && kill -0 "$pid" 2>/dev/null; do
      compgen -G "$ckpt/iter_*.tmp-*" >/dev/null && break
    done
  else
    until (( $(latest) >= start + 3 )) || (( SECONDS > deadline )) || ! kill -0 "$pid" 2>/dev/null; do sleep 0.01; done
    sleep "0.0$((attempt * 2))"
  fi
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=""
  hit=""; compgen -G "$ckpt/iter_*.tmp-*" >/dev/null && { mid_write=$((mid_write + 1)); hit=" (mid-write)"; }
  echo "attempt $attempt: resumed at iteration $start, killed at checkpoint $(latest)$hit"
  (( $(latest) > start )) || { cat "$dir/run-$attempt.log"; fail "attempt $attempt saved no checkpoint"; }
  (( $(latest) < iters )) || fail "attempt $attempt finished before it was killed; the test needs more --train-iters"
done
(( mid_write >= 1 )) || fail "no kill hit a checkpoint write"
"$bin" "${common[@]}" --save "$ckpt" --load "$ckpt" --metrics-file "$dir/run-final.jsonl" >"$dir/final.log" 2>&1 ||
  { cat "$dir/final.log"; fail "the final resumed run failed"; }
grep -q "loaded checkpoint" "$dir/final.log" || { cat "$dir/final.log"; fail "the final run did not resume"; }
[ "$(latest)" = "$iters" ] || fail "the final run did not reach iteration $iters"

# every logged loss of every attempt equals the uninterrupted run's, and together they cover each iteration
losses "$dir/full.jsonl" | sort -u >"$dir/full.txt"
losses "$dir"/run-*.jsonl | sort -u >"$dir/killed.txt"
if ! diff "$dir/full.txt" "$dir/killed.txt"; then fail "the killed and resumed runs' losses differ from the uninterrupted run's"; fi
# no temp directory (or pointer temp file) of a dead writer is left after the later saves
leftovers=$(ls -a "$ckpt" | grep -F '.tmp-')
[ -z "$leftovers" ] || fail "temp files of dead writers remain: $leftovers"
echo "PASS ($mid_write of 6 kills mid-write)"

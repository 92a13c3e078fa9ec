#!/usr/bin/env bash
# The --save directory's guards (CPU, one rank):
#  - a second run on a --save another live run holds is refused before any work, naming the
#    holder's host and pid and the directory; a lock left by a killed run is taken over with a note
#  - an unwritable --save / --metrics-file / --tensorboard-dir fails before the first iteration,
#    naming its flag
#  - without latest_checkpointed_iteration.txt, --load finds the newest complete iter_* checkpoint
#  - iter_N.tmp-PID directories and pointer temp files of dead writers go at the next save
set -uo pipefail
bin=$1; src=$2
holder=""
dir=$(mktemp -d); trap 'if [ -n "$holder" ]; then kill -9 "$holder" 2>/dev/null; fi; rm -rf "$dir"' EXIT
common=(train --config "$src/configs/tiny.yaml" --device cpu --log-interval 1 --eval-interval 0 --lr-warmup-iters 1)
fail() { echo "FAIL: $*"; exit 1; }

# 1. a live holder: a long run in the background holds the lock
"$bin" "${common[@]}" --train-iters 100000 --save "$dir/save" >"$dir/holder.log" 2>&1 &
holder=$!
for _ in $(seq 100); do grep -q "pid=$holder" "$dir/save/.moecore.lock" 2>/dev/null && break; sleep 0.1; done
grep -q "pid=$holder" "$dir/save/.moecore.lock" || { cat "$dir/holder.log"; fail "the first run wrote no lock"; }
"$bin" "${common[@]}" --train-iters 1 --save "$dir/save" >"$dir/second.log" 2>&1 && fail "a second run on a held --save ran"
cat "$dir/second.log"
grep -q -- "--save '$dir/save' is in use by another run (host $(hostname), pid $holder" "$dir/second.log" ||
  fail "the message does not name the directory, the host and the pid"
grep -q "iteration" "$dir/second.log" && fail "the second run trained before refusing"
# a killed holder leaves its lock file: the next run takes it over with a note
kill -9 "$holder"; wait "$holder" 2>/dev/null
"$bin" "${common[@]}" --train-iters 2 --save "$dir/save" >"$dir/takeover.log" 2>&1 || { cat "$dir/takeover.log"; fail "no takeover"; }
grep -q "note: --save $dir/save: taking over the lock left by pid $holder on $(hostname) (that process is gone)" \
  "$dir/takeover.log" || { cat "$dir/takeover.log"; fail "no takeover note"; }
holder=""

# 2. unwritable paths fail before the first iteration, naming their flags
touch "$dir/file"
for flag in --save --metrics-file --tensorboard-dir; do
  extra=("$flag" "$dir/file/sub")
  [ "$flag" = --save ] || extra+=(--save "$dir/ok-$flag")
  [ "$flag" = --save ] && extra+=(--metrics-file "$dir/elsewhere.jsonl")
  "$bin" "${common[@]}" --train-iters 2 "${extra[@]}" >"$dir/probe.log" 2>&1 && fail "$flag on a file's child was accepted"
  cat "$dir/probe.log"
  grep -q -- "$flag '$dir/file/sub'.*cannot create" "$dir/probe.log" || fail "the message does not name $flag"
  grep -q "iteration" "$dir/probe.log" && fail "$flag: trained before failing"
done

# 4. the pointer file gone: --load takes the newest complete checkpoint (not iteration 0)
"$bin" "${common[@]}" --train-iters 6 --save-interval 2 --save "$dir/ckpt" >"$dir/ckpt.log" 2>&1 || { cat "$dir/ckpt.log"; fail "save"; }
rm -r "$dir/ckpt/latest_checkpointed_iteration.txt" "$dir/ckpt/iter_0000006"
mkdir -p "$dir/ckpt/iter_0000006.tmp-999999"   # a dead writer's partial checkpoint (no meta.json)
echo 6 > "$dir/ckpt/latest_checkpointed_iteration.txt.tmp-999999"
sleep 300 & live=$!                              # a live process's temp directory stays
mkdir -p "$dir/ckpt/iter_0000007.tmp-$live"
"$bin" "${common[@]}" --train-iters 6 --save-interval 2 --load "$dir/ckpt" --save "$dir/ckpt" >"$dir/resume.log" 2>&1 ||
  { cat "$dir/resume.log"; kill $live; fail "resume without the pointer file"; }
cat "$dir/resume.log"
grep -q "using the newest complete checkpoint $dir/ckpt/iter_0000004" "$dir/resume.log" || { kill $live; fail "no note"; }
grep -q "loaded checkpoint from $dir/ckpt at iteration 4" "$dir/resume.log" || { kill $live; fail "did not resume at 4"; }
grep -q "training from scratch" "$dir/resume.log" && { kill $live; fail "trained from scratch"; }
[ -e "$dir/ckpt/iter_0000006.tmp-999999" ] && { kill $live; fail "a dead writer's temp directory stayed"; }
[ -e "$dir/ckpt/latest_checkpointed_iteration.txt.tmp-999999" ] && { kill $live; fail "a dead writer's temp file stayed"; }
grep -q "note: --save $dir/ckpt: removed iter_0000006.tmp-999999, left by writer pid 999999" "$dir/resume.log" ||
  { kill $live; fail "no note of the removal"; }
[ -d "$dir/ckpt/iter_0000007.tmp-$live" ] || { kill $live; fail "a live process's temp directory was removed"; }
kill $live
echo PASS

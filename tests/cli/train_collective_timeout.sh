#!/usr/bin/env bash
# --distributed-timeout-minutes (MPI ranks on CPU): rank 0 is stopped (SIGSTOP) in the middle of a
# run; the other rank's watchdog ends the job with a message naming the collective and its group
# within the timeout plus a few seconds.
set -uo pipefail
bin=$1; src=$2; mpiexec=$3
job=""; stopped=""
cleanup() {
  if [ -n "$stopped" ]; then kill -CONT "$stopped" 2>/dev/null; fi
  if [ -n "$job" ] && kill -0 "$job" 2>/dev/null; then kill -TERM "$job"; sleep 1; kill -9 "$job" 2>/dev/null; fi
  rm -rf "$dir"
}
dir=$(mktemp -d); trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
fail() { echo "FAIL: $*"; cat "$dir/job.log"; exit 1; }
"$mpiexec" -np 2 "$bin" train --config "$src/configs/tiny.yaml" --device cpu --train-iters 100000 \
  --log-interval 1 --eval-interval 0 --save "$dir/save" --distributed-timeout-minutes 0.05 >"$dir/job.log" 2>&1 &
job=$!
# rank 0 holds the --save lock: its pid is in the lock file; wait for a few iterations first
for _ in $(seq 300); do grep -q "iteration *3/" "$dir/job.log" 2>/dev/null && break; sleep 0.1; done
grep -q "iteration *3/" "$dir/job.log" || fail "the job did not train"
stopped=$(sed -n 's/.*pid=\([0-9]*\).*/\1/p' "$dir/save/.moecore.lock")
[ -n "$stopped" ] || fail "no rank-0 pid in the lock file"
kill -STOP "$stopped"
start=$(date +%s)
for _ in $(seq 600); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
kill -0 "$job" 2>/dev/null && fail "the job did not end within 60 s of the stop"
wait "$job"; rc=$?
took=$(( $(date +%s) - start ))
job=""
[ "$rc" -ne 0 ] || fail "the job exited 0"
grep -q "moecore: error: rank 1: [a-z_ ]* on the [a-z_/]* *group of world ranks [0-9,]* waited .* more than --distributed-timeout-minutes 0.05" \
  "$dir/job.log" || fail "no message naming the collective and the group"
[ "$took" -le 15 ] || fail "the job took ${took} s to end after the stop (timeout 3 s)"
grep "waited" "$dir/job.log"
echo "PASS: the job ended ${took} s after rank 0 stopped"

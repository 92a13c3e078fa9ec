#!/usr/bin/env bash
# Two GPUs (NCCL), --distributed-timeout-minutes on GPU ranks (comm/nccl_in_flight.h):
#  1. DP=2 x EP=2 alltoall with the flag given trains 3 iterations with the losses of the run
#     without it (within 1e-4; the watchdog's events change nothing and raise no false alarm);
#  2. rank 0 is stopped (SIGSTOP) in the middle of a run: rank 1's watchdog finds its collective
#     in flight longer than the timeout, prints the message naming the collective, the group, the
#     rank, the wait and the flag, aborts NCCL and exits 1, and the launcher ends the job, within
#     the timeout plus a few seconds.
# Run by scripts/gpu-dist.sh: tests/gpu/train_nccl_timeout_gpu.sh BIN SRC "mpirun -np 2 -x ...".
set -uo pipefail
bin=$1; src=$2; mpi=$3
job=""; stopped=""
cleanup() {
  if [ -n "$stopped" ]; then kill -CONT "$stopped" 2>/dev/null; fi
  if [ -n "$job" ] && kill -0 "$job" 2>/dev/null; then kill -TERM "$job"; sleep 1; kill -9 "$job" 2>/dev/null; fi
  rm -rf "$dir"
}
dir=$(mktemp -d); trap cleanup EXIT
fail() { echo "FAIL: $*"; cat "$dir"/*.log; exit 1; }
base=(train --config "$src/configs/tiny.yaml" --lr-warmup-iters 1 --log-interval 1 --eval-interval 0
      --micro-batch-size 4 --global-batch-size 16 --hidden-size 128 --num-attention-heads 4
      --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall)
values() { grep -o '"lm_loss":[^,}]*\|"grad_norm":[^,}]*' "$1" | cut -d: -f2; }
same() {  # a b: within 1e-4 relative (GPU reductions may use atomics)
  paste <(values "$1") <(values "$2") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (NF != 2 || d > 1e-4 * ($2 < 0 ? -$2 : $2) + 1e-9) { print "differs: " $1 " vs " $2; bad = 1 } } END { exit bad }'
}
# 1. same losses with and without the watchdog
$mpi "$bin" "${base[@]}" --train-iters 3 --metrics-file "$dir/off.jsonl" > "$dir/off.log" 2>&1 || fail "the run without the flag failed"
$mpi "$bin" "${base[@]}" --train-iters 3 --metrics-file "$dir/on.jsonl" --distributed-timeout-minutes 0.1 \
  > "$dir/on.log" 2>&1 || fail "the run with --distributed-timeout-minutes 0.1 failed"
grep -q "cuda" "$dir/on.log" || fail "not on GPUs"
[ "$(values "$dir/on.jsonl" | wc -l)" -eq 6 ] || fail "no losses"
same "$dir/on.jsonl" "$dir/off.jsonl" || fail "the watchdog changed the losses"
echo "same losses with and without --distributed-timeout-minutes"
# 2. a stopped rank ends the job
$mpi "$bin" "${base[@]}" --train-iters 100000 --save "$dir/save" --save-interval 1000000 \
  --distributed-timeout-minutes 0.1 > "$dir/job.log" 2>&1 &
job=$!
for _ in $(seq 1200); do grep -q "iteration *5/" "$dir/job.log" 2>/dev/null && break; sleep 0.1; done
grep -q "iteration *5/" "$dir/job.log" || fail "the job did not train"
stopped=$(sed -n 's/.*pid=\([0-9]*\).*/\1/p' "$dir/save/.moecore.lock")  # rank 0 holds the --save lock
[ -n "$stopped" ] || fail "no rank-0 pid in the lock file"
kill -STOP "$stopped"
start=$(date +%s)
for _ in $(seq 900); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
kill -0 "$job" 2>/dev/null && fail "the job did not end within 90 s of the stop (a silent hang)"
wait "$job"; rc=$?
took=$(( $(date +%s) - start ))
job=""
[ "$rc" -ne 0 ] || fail "the job exited 0"
grep -q "moecore: error: rank 1: [a-z_ ]* on the [a-z_/]* *group of world ranks [0-9,]* waited .* more than --distributed-timeout-minutes 0.1" \
  "$dir/job.log" || fail "no message naming the collective, the group and the flag"
[ "$took" -le 20 ] || fail "the job took ${took} s to end after the stop (timeout 6 s)"
grep "waited" "$dir/job.log"
echo "PASS: the job ended ${took} s after rank 0 stopped"

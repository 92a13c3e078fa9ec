#!/usr/bin/env bash
# make bench: every benchmark in build/bench, each printing JSON lines and a table last.
# Extra arguments go to each benchmark (e.g. make bench BENCH_ARGS=--quick).
set -euo pipefail
build=${1:-build}; shift || true
status=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  echo "== $(basename "$b")"
  "$b" ${BENCH_ARGS:-} "$@" || status=1
done
exit $status

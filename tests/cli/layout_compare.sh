# Sourced by the cli tests that compare parallel layouts (or options) with a single-rank run.
# The caller sets bin (moecore), mpiexec, dir (a scratch folder) and defines values FILE (the
# metrics it compares, one per line); MIN_LOGGED (default 1) is how many values a run must log.

agree() {  # every stdin line: two values within $1 relative (a missing value fails)
  awk -v tol="$1" '{ d = $1 - $2; if (d < 0) d = -d; if (NF != 2 || d > tol * ($2 < 0 ? -$2 : $2) + 1e-12) { print "differs: " $0; bad = 1 } } END { exit bad }'
}

run() {  # out np args...: mpirun (np > 1) or one process; metrics in $dir/out.jsonl, log in $dir/out.log
  local out=$1 np=$2; shift 2
  rm -f "$dir/$out.jsonl"
  if [ "$np" = 1 ]; then
    "$bin" "$@" --metrics-file "$dir/$out.jsonl" > "$dir/$out.log" 2>&1 || { cat "$dir/$out.log"; exit 1; }
  else
    "$mpiexec" -np "$np" "$bin" "$@" --metrics-file "$dir/$out.jsonl" > "$dir/$out.log" 2>&1 || { cat "$dir/$out.log"; exit 1; }
  fi
  [ "$(values "$dir/$out.jsonl" | wc -l)" -ge "${MIN_LOGGED:-1}" ] || { cat "$dir/$out.log"; echo "FAIL: nothing logged"; exit 1; }
}

check() {  # tolerance label: the last run ("ranks") against the single-rank one ("single")
  paste <(values "$dir/ranks.jsonl") <(values "$dir/single.jsonl") | agree "$1" ||
    { echo "FAIL: $2 differs from one rank"; exit 1; }
  echo "$2: same losses and grad norm as one rank"
}

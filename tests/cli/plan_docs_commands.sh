#!/usr/bin/env bash
# Runs every `moecore plan` command docs/planning.md and README.md show (BIN SRC): each must exit 0
# and end with its JSON line (--search: the {"fitting": ...} object).
set -uo pipefail
bin=$1; src=$2
n=0
while IFS= read -r cmd; do
  args=${cmd#moecore }
  out=$(cd "$src" && eval "\"$bin\" $args" 2>&1) || { echo "$out"; echo "FAIL: exit code of: $cmd"; exit 1; }
  tail -n 1 <<<"$out" | python3 -c 'import json, sys; j = json.loads(sys.stdin.read()); assert "peak_bytes" in j or "fitting" in j' ||
    { echo "$out"; echo "FAIL: no JSON last line from: $cmd"; exit 1; }
  n=$((n + 1))
done < <(grep -h '^moecore plan ' "$src/docs/planning.md" "$src/README.md")
[ "$n" -ge 3 ] || { echo "FAIL: only $n moecore plan commands found in the docs"; exit 1; }
echo "PASS: $n commands"

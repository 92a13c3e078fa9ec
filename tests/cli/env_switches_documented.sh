#!/usr/bin/env bash
# env_switches_documented.sh MOECORE_BINARY SOURCE_DIR: every environment switch in the table
# `moecore env --json` prints (core/env_switches.cpp) has a row in docs/environment.md, and every
# row there is in the table.
set -u
bin=$1; src=$2
doc=$src/docs/environment.md
json=$("$bin" env --json) || { echo "FAIL: moecore env --json"; exit 1; }
table=$(grep -o '"name":"MOECORE_[A-Z0-9_]*"' <<<"$json" | sed 's/"name":"\(.*\)"/\1/' | sort -u)
[ -n "$table" ] || { echo "FAIL: no environment_switches in: $json"; exit 1; }
documented=$(grep -o '^| `MOECORE_[A-Z0-9_]*`' "$doc" | sed 's/^| `\(.*\)`/\1/' | sort -u)
rc=0
for name in $table; do
  grep -qx "$name" <<<"$documented" || { echo "FAIL: $name is in core/env_switches.cpp but has no row in docs/environment.md"; rc=1; }
done
for name in $documented; do
  grep -qx "$name" <<<"$table" || { echo "FAIL: docs/environment.md lists $name, which core/env_switches.cpp does not"; rc=1; }
done
[ $rc -eq 0 ] && echo "$(wc -w <<<"$table") switches, all documented"
exit $rc

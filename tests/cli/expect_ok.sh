#!/usr/bin/env bash
# expect_ok.sh REGEX CMD...: passes when CMD exits 0 and its output matches REGEX.
regex=$1; shift
out=$("$@" 2>&1); rc=$?
echo "$out"
if [ "$rc" -ne 0 ]; then echo "FAIL: exit code $rc from: $*"; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$out"; then echo "FAIL: output does not match /$regex/"; exit 1; fi
exit 0

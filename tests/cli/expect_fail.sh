#!/usr/bin/env bash
# expect_fail.sh REGEX CMD...: passes when CMD exits non-zero and its output matches REGEX.
regex=$1; shift
out=$("$@" 2>&1); rc=$?
echo "$out"
if [ "$rc" -eq 0 ]; then echo "FAIL: expected a non-zero exit from: $*"; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$out"; then echo "FAIL: output does not match /$regex/"; exit 1; fi
if grep -q "terminate called\|Aborted\|Segmentation" <<<"$out"; then echo "FAIL: crashed instead of a clean error"; exit 1; fi
exit 0

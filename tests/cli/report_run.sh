#!/usr/bin/env bash
# moecore report end to end: tiny trains a few steps on the CPU with per-layer MoE logging and
# evaluations, report writes one self-contained HTML page (charts, the expert-load heatmap, no
# scripts), --output puts it elsewhere, and a missing directory, a missing metrics.jsonl and a
# malformed line each fail with one message naming the directory, the file or the line.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
"$bin" train --config "$src/configs/tiny.yaml" --device cpu --train-iters 6 --lr-warmup-iters 1 --log-interval 1 \
  --eval-interval 3 --eval-iters 2 --moe-per-layer-logging --save "$dir/run" >"$dir/train.log" 2>&1 \
  || { cat "$dir/train.log"; fail "training failed"; }
out=$("$bin" report "$dir/run" 2>&1) || { echo "$out"; fail "report failed"; }
echo "$out"
grep -q "wrote $dir/run/report.html" <<<"$out" || fail "report did not say where it wrote the page"
page="$dir/run/report.html"
[ -s "$page" ] || fail "no $page"
head -c 15 "$page" | grep -q '<!DOCTYPE html>' || fail "not an HTML page"
svgs=$(grep -o '<svg ' "$page" | wc -l)
[ "$svgs" -ge 9 ] || fail "expected at least 9 charts (6 training, balancing, heatmap, imbalance), found $svgs"
grep -q 'class="heatmap"' "$page" || fail "no expert-load heatmap"
grep -q 'MoE layer 1' "$page" || fail "the heatmap lacks the second MoE layer"
grep -q 'linearGradient' "$page" || fail "no colour legend"
grep -q '>validation</text>' "$page" || fail "no validation series in the loss chart"
grep -q 'Best validation loss</th><td>[0-9]' "$page" || fail "no best validation loss in the summary"
grep -q 'Iterations</th><td>6 ' "$page" || fail "the summary does not say 6 iterations"
if grep -qi '<script' "$page"; then fail "the page has a script"; fi
if grep -o 'https\?://[^"]*' "$page" | grep -v '^http://www.w3.org/2000/svg$' | grep -q .; then
  fail "the page links outside itself"
fi
"$bin" report "$dir/run" --output "$dir/elsewhere.html" >/dev/null || fail "--output failed"
[ -s "$dir/elsewhere.html" ] || fail "--output wrote nothing"
expect_fail() {  # REGEX CMD...
  local regex=$1; shift
  local o rc=0
  o=$("$@" 2>&1) || rc=$?
  echo "$o"
  [ "$rc" -eq 1 ] || fail "expected exit 1 from: $* (got $rc)"
  grep -Eq -- "$regex" <<<"$o" || fail "output does not match /$regex/"
}
expect_fail "moecore: error: '$dir/nope' is not a directory" "$bin" report "$dir/nope"
mkdir "$dir/empty"
expect_fail "'$dir/empty/metrics.jsonl' not found: train with --save" "$bin" report "$dir/empty"
mkdir "$dir/bad" && { head -2 "$dir/run/metrics.jsonl"; echo '{"iteration": 3, "lm_loss": '; } >"$dir/bad/metrics.jsonl"
expect_fail "$dir/bad/metrics.jsonl:3: not JSON" "$bin" report "$dir/bad"
o=$("$bin" report 2>&1) && fail "report without a directory succeeded" || true
grep -q "expected one run directory" <<<"$o" || { echo "$o"; fail "no usage message without a directory"; }
echo "PASS"

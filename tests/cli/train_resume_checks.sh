#!/usr/bin/env bash
# Resuming checks the flags: another model is refused naming the flag (the position embedding by
# what --position-embedding-type and --no-position-embedding make), other learning-rate
# settings are refused unless --override-opt-param-scheduler, a --load directory without a
# checkpoint starts from scratch, and a 'latest' file naming a missing checkpoint falls back to
# the newest complete one.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
run() { "$bin" train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --lr-warmup-iters 1 --lr-decay-iters 10 --log-interval 1 --eval-interval 0 "$@"; }
expect_fail() { local re=$1; shift; if out=$("$@" 2>&1); then echo "FAIL: should have failed: $*"; exit 1; fi
  grep -Eq -- "$re" <<<"$out" || { echo "$out"; echo "FAIL: no /$re/"; exit 1; }; }

run --save "$dir/a" --load "$dir/a" > "$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
grep -q "no checkpoint in --load" "$dir/log" || { cat "$dir/log"; echo "FAIL: scratch note"; exit 1; }
expect_fail "trained with --hidden-size 64; this run has 96" run --load "$dir/a" --hidden-size 96
expect_fail "trained with --moe-router-topk 2; this run has 1" run --load "$dir/a" --moe-router-topk 1
expect_fail "--override-opt-param-scheduler" run --load "$dir/a" --lr 1e-3 --train-iters 6
# --no-position-embedding changes nothing with RoPE (resumes); with learned_absolute it removes the
# table (refused, naming both flags)
run --load "$dir/a" --no-position-embedding --train-iters 5 > "$dir/log" 2>&1 || { cat "$dir/log"; echo "FAIL: rope + --no-position-embedding"; exit 1; }
run --save "$dir/learned" --position-embedding-type learned_absolute > /dev/null 2>&1
expect_fail "position embedding 'learned_absolute' .*this run's has 'none'" \
  run --load "$dir/learned" --position-embedding-type learned_absolute --no-position-embedding --train-iters 5
out=$(run --load "$dir/a" --lr 1e-3 --train-iters 6 --override-opt-param-scheduler 2>&1)
grep -q "note: --lr changed" <<<"$out" || { echo "$out"; echo "FAIL: change not listed"; exit 1; }
grep -q "iteration        6/" <<<"$out" || { echo "$out"; echo "FAIL: did not continue"; exit 1; }
# bool flags from a config can be switched off on the command line
expect_fail "needs exactly one data source" run --mock-data=false
# the latest checkpoint is gone: fall back to the newest complete one
run --save "$dir/b" --save-interval 2 > /dev/null 2>&1
rm -rf "$dir/b/iter_0000004"
out=$(run --load "$dir/b" --train-iters 4 2>&1)
grep -q "using .*iter_0000002" <<<"$out" || { echo "$out"; echo "FAIL: no fallback"; exit 1; }
# a resume needs no model flags: the ones left out come from the checkpoint (given ones must agree)
m=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-experts 4 --moe-router-topk 2 --disable-bias-linear
   --swiglu --vocab-size 64 --seq-length 16 --moe-router-score-function sigmoid)
plain() { "$bin" train --mock-data --device cpu --lr-warmup-iters 1 --lr-decay-iters 10 --log-interval 1 "$@"; }
plain "${m[@]}" --train-iters 2 --save "$dir/m" > "$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
out=$(plain --train-iters 3 --load "$dir/m" 2>&1) || { echo "$out"; echo "FAIL: resume without model flags"; exit 1; }
grep -q "iteration        3/" <<<"$out" || { echo "$out"; echo "FAIL: did not continue"; exit 1; }
expect_fail "trained with --num-experts 4; this run has 8" plain --train-iters 3 --load "$dir/m" --num-experts 8
# generate needs a tokenizer for text prompts
expect_fail "trained without a tokenizer" "$bin" generate --load "$dir/a" --prompt "hi" --device cpu
echo PASS

#!/usr/bin/env bash
# moecore eval reproduces the trainer's logged validation loss: a tiny run on text data with
# --eval-interval saves its checkpoint; `moecore eval --load CK --data-path ...` with no other
# flags (the model, the tokenizer and the validation settings come from the checkpoint) prints
# the same loss as the run's last validation in metrics.jsonl, exactly (same weights, same
# samples, same forward). --whole-dataset reads every sample of the validation split; a missing
# --load and a blend with --whole-dataset are refused. With MPIEXEC (third argument) a pipeline
# x data-parallel run is evaluated under the same layout and under another.
set -euo pipefail
bin=$1; src=$2; mpiexec=${3:-}
dir=$(mktemp -d); trap '[ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT  # KEEP=1 keeps it
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
expect_fail() { local re=$1; shift; if out=$("$@" 2>&1); then echo "FAIL: should have failed: $*"; exit 1; fi
  grep -Eq -- "$re" <<<"$out" || { echo "$out"; echo "FAIL: no /$re/"; exit 1; }; }
for i in $(seq 1 300); do
  echo "{\"text\": \"Line $i: the quick brown fox jumps over the lazy dog ($((i * 7 % 13))).\"}"
done > "$dir/c.jsonl"
"$bin" preprocess --input "$dir/c.jsonl" --json-keys text --tokenizer-type ByteTokenizer --output-prefix "$dir/c" --append-eod > /dev/null
data="$dir/c_text_document"
train=(train --config "$src/configs/tiny-text.yaml" --data-path "$data" --device cpu --seq-length 32 --hidden-size 32
       --moe-ffn-hidden-size 32 --micro-batch-size 4 --global-batch-size 8 --lr-warmup-iters 1 --log-interval 1
       --train-iters 4 --eval-interval 2 --eval-iters 3 --split 90,10,0)
last_valid() { grep -o '"valid_lm_loss":[^,}]*' "$1" | tail -1 | cut -d: -f2; }
eval_loss() { tail -1 "$1" | grep -o '"lm_loss":[^,}]*' | cut -d: -f2; }

"$bin" "${train[@]}" --save "$dir/ck" --metrics-file "$dir/m.jsonl" > "$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
"$bin" eval --load "$dir/ck" --data-path "$data" --device cpu > "$dir/eval" 2>&1 || { cat "$dir/eval"; exit 1; }
want=$(last_valid "$dir/m.jsonl"); got=$(eval_loss "$dir/eval")
[ -n "$want" ] && [ "$want" = "$got" ] || { cat "$dir/eval"; echo "FAIL: eval $got != the trainer's validation $want"; exit 1; }
grep -q '"samples":12' "$dir/eval" || { cat "$dir/eval"; echo "FAIL: 3 x 4 samples expected"; exit 1; }
# --eval-iters given: fewer samples, another loss
"$bin" eval --load "$dir/ck" --data-path "$data" --device cpu --eval-iters 1 > "$dir/eval1" 2>&1 || { cat "$dir/eval1"; exit 1; }
grep -q '"samples":4' "$dir/eval1" || { cat "$dir/eval1"; echo "FAIL: --eval-iters 1"; exit 1; }
# the whole validation split (and the whole dataset as validation with --split 0,1,0)
"$bin" eval --load "$dir/ck" --data-path "$data" --device cpu --whole-dataset --micro-batch-size 5 > "$dir/whole" 2>&1 || { cat "$dir/whole"; exit 1; }
grep -Eq '"samples":[0-9]+' "$dir/whole" && ! grep -q '"samples":12[,}]' "$dir/whole" || { cat "$dir/whole"; echo "FAIL: whole split"; exit 1; }
"$bin" eval --load "$dir/ck" --data-path "$data" --device cpu --whole-dataset --split 0,1,0 > "$dir/all" 2>&1 || { cat "$dir/all"; exit 1; }
expect_fail "moecore eval needs --load" "$bin" eval --data-path "$data" --device cpu
expect_fail "--whole-dataset reads one dataset" "$bin" eval --load "$dir/ck" --data-path 1 "$data" 1 "$data" --device cpu --whole-dataset
expect_fail "--whole-dataset needs --data-path \(mock data has no end\)" "$bin" eval --load "$dir/ck" --mock-data --device cpu --whole-dataset
expect_fail "the validation split of --split 1,0,0 is empty" "$bin" eval --load "$dir/ck" --data-path "$data" --device cpu --split 1,0,0
expect_fail "moecore eval writes no checkpoint" "$bin" eval --load "$dir/ck" --data-path "$data" --device cpu --save "$dir/x"
if [ -n "$mpiexec" ]; then
  # PP=2 x DP=2: trained and evaluated under that layout, exactly; evaluated on one rank, closely
  "$mpiexec" -np 4 "$bin" "${train[@]}" --pipeline-model-parallel-size 2 --save "$dir/pp" --metrics-file "$dir/pp.jsonl" > "$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
  "$mpiexec" -np 4 "$bin" eval --load "$dir/pp" --data-path "$data" --device cpu --pipeline-model-parallel-size 2 > "$dir/ppeval" 2>&1 || { cat "$dir/ppeval"; exit 1; }
  want=$(last_valid "$dir/pp.jsonl"); got=$(eval_loss "$dir/ppeval")
  [ -n "$want" ] && [ "$want" = "$got" ] || { cat "$dir/ppeval"; echo "FAIL: PP eval $got != $want"; exit 1; }
  "$bin" eval --load "$dir/pp" --data-path "$data" --device cpu > "$dir/one" 2>&1 || { cat "$dir/one"; exit 1; }
  awk -v a="$want" -v b="$(eval_loss "$dir/one")" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 2e-5 * a) }' \
    || { cat "$dir/one"; echo "FAIL: one-rank eval of the PP checkpoint differs from $want"; exit 1; }
fi
echo PASS

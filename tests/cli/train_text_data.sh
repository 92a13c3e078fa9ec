#!/usr/bin/env bash
# Real data end to end: JSONL -> moecore preprocess (byte tokenizer) -> dataset-info ->
# moecore train --data-path (the tiny-text preset, a few steps, with validation) -> resume
# from the checkpoint -> generate text.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
for i in $(seq 1 400); do
  echo "{\"text\": \"Line $i: the quick brown fox jumps over the lazy dog, again and again ($((i * 7 % 13))).\"}"
done > "$dir/c.jsonl"
"$bin" preprocess --input "$dir/c.jsonl" --json-keys text --tokenizer-type ByteTokenizer --output-prefix "$dir/c" --append-eod
info=$("$bin" dataset-info "$dir/c_text_document" | tail -1)
echo "$info"
grep -q '"documents":400' <<<"$info" || { echo "FAIL: expected 400 documents"; exit 1; }
common=(train --config "$src/configs/tiny-text.yaml" --data-path "$dir/c_text_document" --device cpu
        --seq-length 32 --hidden-size 32 --moe-ffn-hidden-size 32 --micro-batch-size 4 --global-batch-size 8
        --lr-warmup-iters 1 --log-interval 1 --eval-interval 3 --eval-iters 2)
"$bin" "${common[@]}" --train-iters 6 --save "$dir/ck" --save-interval 3 --metrics-file "$dir/full.jsonl" > "$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }
grep -q "validation loss at iteration 3" "$dir/log" || { cat "$dir/log"; echo "FAIL: no validation"; exit 1; }
"$bin" "${common[@]}" --train-iters 6 --load "$dir/ck/iter_0000003" --metrics-file "$dir/resumed.jsonl" > "$dir/log2" 2>&1 || { cat "$dir/log2"; exit 1; }
full=$(grep -o '"iteration":[4-6],"learning_rate":[^,]*,"lm_loss":[^,]*' "$dir/full.jsonl")
resumed=$(grep -o '"iteration":[4-6],"learning_rate":[^,]*,"lm_loss":[^,]*' "$dir/resumed.jsonl")
[ -n "$full" ] && [ "$full" = "$resumed" ] || { echo "FAIL: resumed losses differ:"; echo "$full"; echo "$resumed"; exit 1; }
"$bin" generate --load "$dir/ck" --prompt "The " --max-new-tokens 20 --device cpu | grep -q "^text: The " || { echo "FAIL: generate"; exit 1; }
echo PASS

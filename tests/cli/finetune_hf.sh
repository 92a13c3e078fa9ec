#!/usr/bin/env bash
# Fine-tuning an imported model, as a new user does it: a tiny HF Mixtral folder with a
# tokenizer.json -> moecore convert (the tokenizer travels into <ckpt>/tokenizer/) -> preprocess
# with that tokenizer -> train --finetune --data-path with no model flags (they and the tokenizer
# come from the checkpoint) -> resume with no model flags -> convert --to hf (the tokenizer comes
# back beside config.json). A plain resume of the model-only checkpoint, data of another
# vocabulary and another tokenizer are refused by name; --no-load-optim restarts the moments.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
expect_fail() { local re=$1; shift; if out=$("$@" 2>&1); then echo "FAIL: should have failed: $*"; exit 1; fi
  grep -Eq -- "$re" <<<"$out" || { echo "$out"; echo "FAIL: no /$re/"; exit 1; }; }
ok() { "$@" > "$dir/log" 2>&1 || { cat "$dir/log"; echo "FAIL: $*"; exit 1; }; }

python3 "$src/tests/data/write_hf_checkpoint.py" "$dir/hf" --arch mixtral --dtype bf16
cp "$src/tests/data/tiny_bpe_tokenizer.json" "$dir/hf/tokenizer.json"
echo '{"eos_token": "<|endoftext|>", "tokenizer_class": "GPT2Tokenizer"}' > "$dir/hf/tokenizer_config.json"
ok "$bin" convert --from hf --to moecore --input "$dir/hf" --output "$dir/ck"
cmp "$dir/hf/tokenizer.json" "$dir/ck/tokenizer/tokenizer.json"
cmp "$dir/hf/tokenizer_config.json" "$dir/ck/tokenizer/tokenizer_config.json"
grep -A1 '"tokenizer-type"' "$dir/ck/iter_0000000/meta.json" | grep -q '"HuggingFaceTokenizer"' || { echo "FAIL: tokenizer-type"; exit 1; }
grep -A1 '"tokenizer-model"' "$dir/ck/iter_0000000/meta.json" | grep -q '"tokenizer/tokenizer.json"' || { echo "FAIL: tokenizer-model"; exit 1; }

# the user's data, in the tiny tokenizer's alphabet
words=(hello he ll abc dd cab bed sell 12 oh lobe ada)
for i in $(seq 1 300); do
  echo "{\"text\": \"${words[$((i % 12))]} ${words[$((i * 7 % 12))]} ${words[$((i * 5 % 12))]}'s ${words[$((i * 3 % 12))]}!\"}"
done > "$dir/c.jsonl"
ok "$bin" preprocess --input "$dir/c.jsonl" --json-keys text --tokenizer-type HuggingFaceTokenizer \
  --tokenizer-model "$dir/ck/tokenizer/tokenizer.json" --output-prefix "$dir/c" --append-eod
ok "$bin" preprocess --input "$dir/c.jsonl" --json-keys text --tokenizer-type ByteTokenizer --output-prefix "$dir/bytes" --append-eod

run=(train --device cpu --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 1 --lr-decay-iters 10 --log-interval 1)
# a converted checkpoint has no optimizer state or iteration: a plain resume points at --finetune
expect_fail "model-only checkpoint .*cannot be resumed; pass --finetune" "$bin" "${run[@]}" --load "$dir/ck" --data-path "$dir/c_text_document" --train-iters 2
expect_fail "--finetune needs --load" "$bin" "${run[@]}" --finetune --mock-data --vocab-size 16 --train-iters 2
# data of another vocabulary, and another tokenizer, are refused by name
expect_fail "--data-path .*bytes_text_document: token id 256 is outside the vocabulary of 40 of the model in --load" \
  "$bin" "${run[@]}" --finetune --load "$dir/ck" --data-path "$dir/bytes_text_document" --train-iters 2
expect_fail "--tokenizer-type ByteTokenizer: the checkpoint in --load .* was trained with --tokenizer-type HuggingFaceTokenizer" \
  "$bin" "${run[@]}" --finetune --load "$dir/ck" --data-path "$dir/bytes_text_document" --tokenizer-type ByteTokenizer --train-iters 2
expect_fail "--tokenizer-model .*gpt2_style.tokenizer.json is not the tokenizer the checkpoint in --load" \
  "$bin" "${run[@]}" --finetune --load "$dir/ck" --data-path "$dir/c_text_document" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$src/tests/data/hf/gpt2_style.tokenizer.json" --train-iters 2

# fine-tune with no model flags: they and the tokenizer come from the checkpoint
ok "$bin" "${run[@]}" --finetune --no-load-rng --load "$dir/ck" --data-path "$dir/c_text_document" --train-iters 3 --save "$dir/ft"
grep -q "at iteration 0 (--finetune" "$dir/log" || { cat "$dir/log"; echo "FAIL: finetune note"; exit 1; }
grep -q "iteration        3/" "$dir/log" || { cat "$dir/log"; echo "FAIL: finetune did not train"; exit 1; }
cmp "$dir/hf/tokenizer.json" "$dir/ft/tokenizer/tokenizer.json"
# resume the fine-tuned run with no model flags (they come from its checkpoint)
ok "$bin" "${run[@]}" --load "$dir/ft" --data-path "$dir/c_text_document" --train-iters 5 --save "$dir/ft"
grep -q "loaded checkpoint from .* at iteration 3$" "$dir/log" || { cat "$dir/log"; echo "FAIL: resume"; exit 1; }
grep -q "iteration        5/" "$dir/log" || { cat "$dir/log"; echo "FAIL: resume did not continue"; exit 1; }
# --no-load-optim: the iteration continues, the moments and the schedule start afresh
ok "$bin" "${run[@]}" --load "$dir/ft" --no-load-optim --data-path "$dir/c_text_document" --train-iters 6
grep -q "at iteration 5 (--no-load-optim" "$dir/log" || { cat "$dir/log"; echo "FAIL: no-load-optim"; exit 1; }
grep -q "iteration        6/" "$dir/log" || { cat "$dir/log"; echo "FAIL: no-load-optim did not continue"; exit 1; }
# back to HF: the tokenizer files come back beside config.json
ok "$bin" convert --from moecore --to hf --input "$dir/ft" --output "$dir/hf2"
cmp "$dir/hf/tokenizer.json" "$dir/hf2/tokenizer.json"
cmp "$dir/hf/tokenizer_config.json" "$dir/hf2/tokenizer_config.json"
[ -f "$dir/hf2/config.json" ] || { echo "FAIL: no config.json"; exit 1; }
echo PASS

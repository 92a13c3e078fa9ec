#!/usr/bin/env bash
# `moecore generate` with the KV cache against the full recompute (--no-kv-cache), greedy, on the
# CPU in fp32, for a tiny MoE model trained a few steps (GQA; RoPE and learned positions with
# q/k norms; Multi-Latent Attention with YaRN): the same tokens for one prompt, every row of a
# batch of prompts of different lengths equals its single-prompt run, top-p -> 0 equals greedy,
# --no-cuda-graph changes nothing on the CPU (the summary's decode_path), --eod-id stops a row; bad
# --prompt-file lines and flags are refused naming them.
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
train() { "$bin" train --config "$src/configs/tiny.yaml" --device cpu --train-iters 4 --lr-warmup-iters 1 \
  --lr-decay-iters 10 --log-interval 4 --eval-interval 0 --group-query-attention --num-query-groups 2 "$@" > "$dir/log" 2>&1 || { cat "$dir/log"; exit 1; }; }
gen() { "$bin" generate --device cpu --temperature 0 "$@"; }
ids() { sed -n 's/^generated ids: //p'; }
expect_fail() { local re=$1; shift; if out=$("$@" 2>&1); then echo "FAIL: should have failed: $*"; exit 1; fi
  grep -Eq -- "$re" <<<"$out" || { echo "$out"; echo "FAIL: no /$re/"; exit 1; }; }

train --save "$dir/rope"
train --save "$dir/learned" --position-embedding-type learned_absolute --qk-layernorm
train --save "$dir/mla" --num-query-groups 4 --multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 12 \
  --qk-pos-emb-head-dim 8 --v-head-dim 10 --qk-layernorm --rope-type yarn --rotary-scaling-factor 4 \
  --original-max-position-embeddings 16 --mscale-all-dim 1
prompts=("5 9 17" "3" "40 41 42 43 44 45 46" "7 7")
for m in rope learned mla; do
  printf '' > "$dir/$m.jsonl"; : > "$dir/$m.expected"
  for i in "${!prompts[@]}"; do
    p=${prompts[$i]}
    ref=$(gen --load "$dir/$m" --prompt-ids "$p" --max-new-tokens 12 --no-kv-cache | ids)
    kv=$(gen --load "$dir/$m" --prompt-ids "$p" --max-new-tokens 12 | ids)
    [ "$ref" = "$kv" ] || { echo "FAIL: $m prompt '$p': KV cache '$kv', full recompute '$ref'"; exit 1; }
    nucleus=$(gen --load "$dir/$m" --prompt-ids "$p" --max-new-tokens 12 --temperature 1 --top-p 1e-9 | ids)
    [ "$nucleus" = "$ref" ] || { echo "FAIL: $m top-p 1e-9 '$nucleus' != greedy '$ref'"; exit 1; }
    echo "{\"prompt_ids\": [${p// /, }]}" >> "$dir/$m.jsonl"
    echo "{\"prompt_index\": $i, \"ids\": [$(echo $ref | sed 's/ /, /g')], \"new_tokens\": 12}" >> "$dir/$m.expected"
  done
  for cache in "" --no-kv-cache; do
    gen --load "$dir/$m" --prompt-file "$dir/$m.jsonl" --max-new-tokens 12 $cache > "$dir/out"
    grep -q '"summary": true.*"decode_tokens_per_s"' "$dir/out" || { cat "$dir/out"; echo "FAIL: no summary"; exit 1; }
    grep -v summary "$dir/out" | diff - "$dir/$m.expected" || { echo "FAIL: $m batch ($cache) differs from single runs"; exit 1; }
  done
  echo "$m: KV cache = full recompute, batch rows = single runs, top-p -> 0 = greedy"
done
# --no-cuda-graph (GPU only: the CPU decodes eagerly either way): the same tokens; the summary names the path
gen --load "$dir/rope" --prompt-file "$dir/rope.jsonl" --max-new-tokens 12 --no-cuda-graph > "$dir/out"
grep -v summary "$dir/out" | diff - "$dir/rope.expected" || { echo "FAIL: --no-cuda-graph changed the tokens"; exit 1; }
grep -q '"decode_path": "eager"}' "$dir/out" || { cat "$dir/out"; echo "FAIL: no decode_path eager"; exit 1; }
gen --load "$dir/rope" --prompt-file "$dir/rope.jsonl" --max-new-tokens 12 --no-kv-cache > "$dir/out"
grep -q '"decode_path": "full-recompute"}' "$dir/out" || { cat "$dir/out"; echo "FAIL: no decode_path full-recompute"; exit 1; }
# --eod-id: a row stops after its first eod (kept), the others run on
ref=$(gen --load "$dir/rope" --prompt-ids "5 9 17" --max-new-tokens 12 --no-kv-cache | ids)
eod=$(echo $ref | cut -d' ' -f4)
want=$(echo $ref | awk -v e="$eod" '{for (i = 1; i <= NF; i++) { printf "%s%s", (i > 1 ? ", " : ""), $i; if ($i == e) break }}')
gen --load "$dir/rope" --prompt-file "$dir/rope.jsonl" --max-new-tokens 12 --eod-id "$eod" > "$dir/out"
grep -q "^{\"prompt_index\": 0, \"ids\": \[$want\]" "$dir/out" || { cat "$dir/out"; echo "FAIL: eod $eod did not stop row 0 at [$want]"; exit 1; }
grep -q '"new_tokens": 12}' "$dir/out" || { cat "$dir/out"; echo "FAIL: every row stopped"; exit 1; }
echo "--eod-id $eod stops row 0 after [$want]"
# bad input
echo '{"prompt": "hi"}' > "$dir/text.jsonl"
expect_fail "line 1: a text prompt, but the checkpoint was trained without a tokenizer" gen --load "$dir/rope" --prompt-file "$dir/text.jsonl"
echo '{"prompt_ids": [1, "x"]}' > "$dir/bad.jsonl"
expect_fail "line 1: \"prompt_ids\" must be an array of integers" gen --load "$dir/rope" --prompt-file "$dir/bad.jsonl"
printf '{"prompt_ids": [1]}\n{"text": 3}\n' > "$dir/bad.jsonl"
expect_fail "line 2: missing key 'prompt'" gen --load "$dir/rope" --prompt-file "$dir/bad.jsonl"
echo '{"prompt_ids": [1, 999]}' > "$dir/bad.jsonl"
expect_fail "line 1: '999' is not a token id in \[0, 128\)" gen --load "$dir/rope" --prompt-file "$dir/bad.jsonl"
expect_fail "no such file|cannot open" gen --load "$dir/rope" --prompt-file "$dir/missing.jsonl"
expect_fail "exactly one of --prompt, --prompt-ids and --prompt-file" gen --load "$dir/rope" --prompt-ids 1 --prompt-file "$dir/bad.jsonl"
expect_fail "--top-p 0: expected a probability in \(0, 1\]" gen --load "$dir/rope" --prompt-ids 1 --top-p 0
expect_fail "exceed the model's --seq-length 32 .*--no-kv-cache" gen --load "$dir/rope" --prompt-ids "1 2 3" --max-new-tokens 30
gen --load "$dir/rope" --prompt-ids "1 2 3" --max-new-tokens 30 --no-kv-cache | grep -q "generated ids" || { echo "FAIL: sliding window"; exit 1; }
echo "bad prompt files and flags are refused"

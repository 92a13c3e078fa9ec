#!/usr/bin/env bash
# gpu tier: head dims the CUDA attention used to refuse (16 as an imported Qwen3-MoE's, 48, 96)
# train a few bf16 steps on the GPU and `moecore generate --device cuda` runs with them: the KV
# cache (ops::decode_attention) gives the same greedy tokens as the full recompute (prefill
# through ops::attention_forward).
set -euo pipefail
bin=$1; src=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
ids() { sed -n 's/^generated ids: //p'; }
for hd in 16 48 96; do
  "$bin" train --config "$src/configs/tiny.yaml" --device cuda --bf16 --train-iters 4 --lr-warmup-iters 1 \
    --lr-decay-iters 10 --log-interval 4 --eval-interval 0 --group-query-attention --num-query-groups 2 \
    --kv-channels "$hd" --save "$dir/hd$hd" > "$dir/log" 2>&1 || { cat "$dir/log"; echo "FAIL: train, head dim $hd"; exit 1; }
  ref=$("$bin" generate --device cuda --load "$dir/hd$hd" --temperature 0 --prompt-ids "5 9 17" --max-new-tokens 12 \
    --no-kv-cache 2>&1 | tee "$dir/gen" | ids) || { cat "$dir/gen"; exit 1; }
  kv=$("$bin" generate --device cuda --load "$dir/hd$hd" --temperature 0 --prompt-ids "5 9 17" --max-new-tokens 12 \
    2>&1 | tee "$dir/gen" | ids) || { cat "$dir/gen"; exit 1; }
  [ -n "$ref" ] || { cat "$dir/gen"; echo "FAIL: no generated ids, head dim $hd"; exit 1; }
  [ "$ref" = "$kv" ] || { echo "FAIL: head dim $hd: KV cache '$kv', full recompute '$ref'"; exit 1; }
  echo "head dim $hd: generate --device cuda: $kv"
done
echo PASS

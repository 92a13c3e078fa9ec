#!/usr/bin/env bash
# Imported DeepSeek-V3 and DeepSeek-V2 models compute what DeepSeek's modeling code computes: tiny
# f32 HF folders (tests/data/write_hf_checkpoint.py) -> moecore convert -> tools/hf_reference's
# logits on the CPU, held to an independent fp64 forward of the HF weights as stored
# (tests/data/deepseek_reference.py: RoPE on interleaved pairs, YaRN, sigmoid group routing with
# the correction bias, softmax group_limited_greedy, shared experts, a dense first layer), to 1e-5
# of the largest logit. A V3 folder that says rope_interleave false (so its RoPE rows are not
# reordered) is caught. The imported models evaluate and generate.
set -euo pipefail
bin=$1; ref=$2; src=$3
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
ok() { "$@" > "$dir/log" 2>&1 || { cat "$dir/log"; echo "FAIL: $*"; exit 1; }; }
ids=(3 17 5 29 11 2 38 7)
echo "1 ${#ids[@]}" > "$dir/tokens"; echo "${ids[*]}" >> "$dir/tokens"
for arch in deepseek_v3 deepseek_v2; do
  python3 "$src/tests/data/write_hf_checkpoint.py" "$dir/$arch" --arch "$arch" --dtype f32 --seed 3
  ok "$bin" convert --from hf --to moecore --input "$dir/$arch" --output "$dir/$arch.ck"
  ok "$ref" --load "$dir/$arch.ck" --tokens "$dir/tokens" --out "$dir/$arch.logits.safetensors" --device cpu
  python3 "$src/tests/data/deepseek_reference.py" "$dir/$arch" "$dir/$arch.logits.safetensors" "${ids[@]}"
  ok "$bin" eval --load "$dir/$arch.ck" --device cpu --mock-data --seq-length 16 --eval-iters 2
  grep -q '"lm_loss"' "$dir/log" || { cat "$dir/log"; echo "FAIL: eval"; exit 1; }
  ok "$bin" generate --load "$dir/$arch.ck" --prompt-ids "1 2 3" --max-new-tokens 4 --device cpu
  grep -q "generated ids:" "$dir/log" || { cat "$dir/log"; echo "FAIL: generate"; exit 1; }
done
# Without the RoPE row reordering the logits differ: the comparison sees it.
cp -r "$dir/deepseek_v3" "$dir/flat"
python3 -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); c['rope_interleave'] = False; json.dump(c, open(p, 'w'))" "$dir/flat/config.json"
ok "$bin" convert --from hf --to moecore --input "$dir/flat" --output "$dir/flat.ck"
ok "$ref" --load "$dir/flat.ck" --tokens "$dir/tokens" --out "$dir/flat.logits.safetensors" --device cpu
if python3 "$src/tests/data/deepseek_reference.py" "$dir/deepseek_v3" "$dir/flat.logits.safetensors" "${ids[@]}"; then
  echo "FAIL: logits without the RoPE row reordering matched the reference"; exit 1
fi
echo PASS

#!/usr/bin/env bash
# make demo: a real English corpus from a Debian package (fortunes), converted to JSONL,
# preprocessed into a Megatron .bin/.idx dataset with the byte tokenizer, a tiny MoE trained on
# it on the CPU (about two minutes on two cores), text sampled from the checkpoint, and the run's
# HTML report (curves and expert loads). The validation loss ends well below the corpus's unigram
# entropy (printed first).
set -euo pipefail
build=${1:-build}
out=${DEMO_DIR:-$build/demo}
corpus=/usr/share/games/fortunes
if [ ! -d "$corpus" ]; then
  echo "demo: installing the Debian package 'fortunes' (the English corpus)"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq fortunes >/dev/null
fi
rm -rf "$out" && mkdir -p "$out"
"$build"/moecore env
echo
echo "== corpus: $corpus -> $out/fortunes.jsonl (one fortune per line)"
# Fortunes are separated by lines holding '%'; JSON-escape backslashes, quotes and control
# characters. (.dat files are indexes, .u8 links duplicate the text.)
for f in "$corpus"/*; do
  case $f in *.dat|*.u8) ;; *) cat "$f"; echo "%" ;; esac
done | awk 'BEGIN { RS = "\n%\n" } {
  gsub(/\\/, "&&"); gsub(/"/, "\\\""); gsub(/\t/, "\\t"); gsub(/\r/, "");
  gsub(/[\001-\010\013\014\016-\037\177]/, ""); gsub(/\n/, "\\n");
  if (length($0) > 0) printf "{\"text\": \"%s\"}\n", $0 }' > "$out/fortunes.jsonl"
"$build"/moecore preprocess --input "$out/fortunes.jsonl" --json-keys text --tokenizer-type ByteTokenizer \
  --output-prefix "$out/fortunes" --append-eod --workers 2 --skip-bad-lines
"$build"/moecore dataset-info "$out/fortunes_text_document" --unigram-entropy | grep -v '^{'
echo
echo "== training configs/tiny-text.yaml on the CPU (a 2-layer MoE, 4 experts, top-2, over bytes)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$build"/moecore train --config configs/tiny-text.yaml \
  --data-path "$out/fortunes_text_document" --device cpu --save "$out/checkpoints" \
  --tensorboard-dir "$out/tensorboard" --moe-per-layer-logging
echo
echo "== sampling from the checkpoint"
# 300 new tokens run past the model's 128 positions: the KV cache holds whole sequences, so the
# sample slides a window over the text instead (--no-kv-cache)
"$build"/moecore generate --load "$out/checkpoints" --prompt "The " --max-new-tokens 300 \
  --temperature 0.7 --top-k 20 --device cpu --no-kv-cache
echo
echo "== the run's report"
"$build"/moecore report "$out/checkpoints"
echo
echo "demo: metrics in $out/checkpoints/metrics.jsonl, TensorBoard events in $out/tensorboard"
echo "demo: report in $(cd "$out/checkpoints" && pwd)/report.html (open it in a browser; no network needed)"

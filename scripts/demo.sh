#!/usr/bin/env bash
# make demo: train the tiny MoE preset on synthetic data on the CPU (a few seconds), then sample
# from the checkpoint. Real text corpora arrive with the data work (Megatron .bin/.idx,
# tokenizers); until then the data is --mock-data: arithmetic progressions modulo the
# vocabulary, so a trained model continues "3 6 9 12" with "15 18 21 ...".
set -euo pipefail
build=${1:-build}
out=${DEMO_DIR:-$build/demo}
rm -rf "$out"
"$build"/moecore env
echo
echo "== training configs/tiny.yaml on the CPU (a 2-layer MoE, 4 experts, top-2)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$build"/moecore train --config configs/tiny.yaml --device cpu \
  --train-iters 120 --log-interval 20 --eval-interval 60 --save "$out/checkpoints" --tensorboard-dir "$out/tensorboard"
echo
echo "== sampling from the checkpoint (greedy): the prompt is an arithmetic progression"
"$build"/moecore generate --load "$out/checkpoints" --prompt-ids "3 6 9 12" --max-new-tokens 16 --temperature 0 --device cpu
echo
echo "demo: metrics in $out/checkpoints/metrics.jsonl, TensorBoard events in $out/tensorboard"

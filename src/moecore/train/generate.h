// `moecore generate`: sampling from a checkpoint.
//
// The model is rebuilt from the train flags saved in the checkpoint (on the CPU in fp32, on a
// GPU in the checkpoint's precision), on one rank. Prompts are token ids (--prompt-ids "3 5 7",
// any model), text (--prompt), encoded and decoded with the tokenizer the checkpoint records
// (so not for --mock-data models), or a JSON Lines file (--prompt-file: one {"prompt": "..."}
// or {"prompt_ids": [..]} per line) generated as one batch. The token loop, the KV cache and the
// sampling are in train/generation.h (rows of different lengths are not padded: each keeps its
// own length). --no-kv-cache re-runs the model over the whole sequence for every token (the
// reference the cache is tested against).
#pragma once

#include <string>
#include <vector>

#include "moecore/train/arguments.h"

namespace moecore {

struct GenerateArgs {
  std::string load, prompt, prompt_ids, prompt_file, device;
  int64_t max_new_tokens = 32;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  double top_p = 1.0;        // nucleus sampling; 1: off
  int64_t seed = 1;
  int64_t eod_id = -2;       // -2: the tokenizer's end-of-document id (none without one); -1: none
  bool no_kv_cache = false;
  bool no_cuda_graph = false;  // GPU decoding steps without CUDA graphs (GenerationOptions::cuda_graph)
};

// Rebuilds the model from the checkpoint at g.load (its recorded flags, through `codec`), samples
// and prints: for --prompt / --prompt-ids the ids (and the text with a tokenizer) as lines
// "prompt ids:", "generated ids:", "text:"; for --prompt-file one JSON line per prompt and a
// summary line with the tokens/s. Returns 0; errors throw.
// The flags of `moecore generate` are in apps/generate_command.cpp.
int generate(const GenerateArgs& g, const TrainFlagCodec& codec);

}  // namespace moecore

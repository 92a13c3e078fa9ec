// `moecore generate`: sampling from a checkpoint, to look at what a model learned.
//
// The model is rebuilt from the train flags saved in the checkpoint (on the CPU in fp32, on a
// GPU in the checkpoint's precision). Prompts are token ids (--prompt-ids "3 5 7", any model) or
// text (--prompt), encoded and decoded with the tokenizer the model was trained with (so not
// for --mock-data models). Each new token re-runs the model over the last seq-length tokens (no
// KV cache): fine for looking, not for serving.
#pragma once

#include <string>
#include <vector>

#include "moecore/train/arguments.h"

namespace moecore {

struct GenerateArgs {
  std::string load, prompt, prompt_ids, device;
  int64_t max_new_tokens = 32;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  int64_t seed = 1;
};

// Rebuilds the model from the checkpoint at g.load (its recorded flags, through `codec`), samples
// g.max_new_tokens tokens and prints the ids (and the text with a tokenizer). Returns 0; errors throw.
// The flags of `moecore generate` are in apps/generate_command.cpp.
int generate(const GenerateArgs& g, const TrainFlagCodec& codec);

}  // namespace moecore

// `moecore generate`: sampling from a checkpoint, to look at what a model learned.
//
// The model is rebuilt from the train flags saved in the checkpoint. Prompts are token ids
// (--prompt-ids "3 5 7", any vocabulary) or text (--prompt), encoded as UTF-8 bytes (ids 0-255;
// the byte tokenizer's vocabulary is 257 with end-of-document 256) for models whose vocabulary
// holds them. Each new token re-runs the model over the last seq-length tokens (no KV cache):
// fine for looking, not for serving.
#pragma once

#include <string>
#include <vector>

namespace moecore {

struct GenerateArgs {
  std::string load, prompt, prompt_ids, device;
  int64_t max_new_tokens = 32;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  int64_t seed = 1;
};

int run_generate(const std::vector<std::string>& argv);

}  // namespace moecore

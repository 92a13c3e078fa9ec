// The token loop of `moecore generate` (and bench/bench_generate): prompts of token ids in, new
// token ids out, on the model's device, one rank.
//
// With the KV cache (the default) each prompt is prefilled once (alone, its own length: rows
// are never padded), then every step runs the model on one new token per prompt, batched:
// projections, MoE layers (evaluation mode, the new tokens only) and the output layer see the
// batch's R tokens at once; attention reads each row's own cached keys (ops::decode_attention:
// one kernel for every row on a GPU, row by row on the CPU), so each row keeps its own length
// and position and no padded position exists to change a row's tokens.
// The decoding steps run through train/decode_step.h: on a GPU one CUDA graph replay per step
// (unless cuda_graph is off); the per-step host work is the upload of the R sampled ids and
// positions and the read of R token ids (greedy: the argmax runs on the device) or of the
// [R, V] f32 logits (sampling on the host); the cache is allocated once (per layer [R, longest
// prompt + new tokens, Hkv, D]).
// Without it (kv_cache = false, the reference) each new token re-runs the model over the last
// seq-length tokens of its prompt alone.
// Sampling: greedy (temperature 0: the first largest logit), else softmax(logits / T) over the
// top_k largest (0: all) cut to the smallest prefix of probability >= top_p (nucleus; 1: off),
// drawn from Philox(seed, "generate", step + (prompt index << 32)). A prompt stops at the eod id
// (kept in its output) or after max_new_tokens; the batch runs until every prompt stopped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/model/gpt.h"

namespace moecore {

struct GenerationOptions {
  int64_t max_new_tokens = 32;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  double top_p = 1.0;        // (0, 1]; 1: off
  uint64_t seed = 1;
  int64_t eod = -1;          // < 0: none
  bool kv_cache = true;
  bool cuda_graph = true;    // on a GPU, replay each decoding step as a CUDA graph (train/decode_step.h)
};

struct GenerationOutput {
  std::vector<std::vector<int32_t>> new_tokens;  // per prompt (the eod that stopped it included)
  int64_t prefill_tokens = 0;   // prompt tokens run through the model
  int64_t decode_tokens = 0;    // tokens sampled after each prompt's first one
  double prefill_seconds = 0;   // until the first tokens are sampled
  double decode_seconds = 0;    // the rest
  std::string decode_path;      // with the KV cache: DecodeStep::graph_status() ("cuda-graph", "eager", ...)
};

// One token from a row of logits (see the header comment); `counter` selects the random draw.
int32_t sample_token(const float* logits, int64_t vocab, const GenerationOptions& opt, uint64_t counter);

GenerationOutput generate_tokens(GPTModel& model, Device device, const std::vector<std::vector<int32_t>>& prompts,
                                 const GenerationOptions& opt);

}  // namespace moecore

// Token embedding (a row gather) and its backward (a row scatter-add), for the whole
// vocabulary or for one rank's part of it (vocabulary-parallel, Megatron's
// VocabParallelEmbedding).
//
// Shapes and dtypes (V rows held here, H hidden size, T tokens):
//   table  [V, H]  f32 or bf16 (f64 on the CPU only): rows [vocab_start, vocab_start + V) of a
//                  vocab_total-row embedding (defaults: vocab_start = 0, vocab_total = -1 =
//                  V, the whole vocabulary; otherwise 0 <= vocab_start, vocab_start + V <=
//                  vocab_total)
//   ids    [T]     i32 in [0, vocab_total); any other value raises an Error naming the position
//                  and value. Ids outside this part are valid and belong to other ranks.
//   out    [T, H]  table's dtype:  out[t, :] = table[ids[t] - vocab_start, :] for ids in this
//                  part, 0 otherwise
//   dout   [T, H]  f32 or bf16 (f64 on the CPU)
//   dtable [V, H]  f32 (f64 for f64 dout); ACCUMULATES: dtable[ids[t] - vocab_start, :] +=
//                  dout[t, :] for ids in this part; other tokens add nothing
// Vocabulary-parallel usage: each of the P ranks holds a part and calls embedding_forward;
// an all-reduce (sum) of the outputs over the group gives the whole-vocabulary output (each
// token has exactly one nonzero term). Backward: every rank calls embedding_backward with the
// same (full) dout and its own part.
// Backward adds, for each vocabulary row, its tokens' gradients in increasing t, starting from
// dtable's current value: the CPU and CUDA perform the very same fp32 additions in the same
// order (results agree bit for bit) and CUDA uses no atomics (deterministic). CUDA sorts
// (id, t) pairs with a stable radix sort, then one block per run of equal ids (and column
// chunk) sums the run; work is O(T * H + sort), independent of V.
// Invalid ids: the CPU checks before touching any output; CUDA's forward records the first
// bad position in a device flag read after the kernel, and its backward checks (one
// device-to-host synchronisation) before dtable is modified.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, int64_t vocab_start = 0,
                       int64_t vocab_total = -1);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, int64_t vocab_start = 0,
                        int64_t vocab_total = -1);

// The rows a backend works with: this part is [start, start + rows) of a `total`-row vocabulary
// (start = 0, total = rows for the whole vocabulary).
struct EmbeddingPart {
  int64_t start;
  int64_t rows;
  int64_t total;
};

// Backends return the first position t whose id is outside [0, part.total) (the dispatcher
// raises the Error), or -1 when all are valid.
namespace cpu {
int64_t embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, EmbeddingPart part, int64_t tokens,
                          int64_t hidden);
int64_t embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, EmbeddingPart part, int64_t tokens,
                           int64_t hidden);
}  // namespace cpu
namespace cuda {
int64_t embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, EmbeddingPart part, int64_t tokens,
                          int64_t hidden);
int64_t embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, EmbeddingPart part, int64_t tokens,
                           int64_t hidden);
}  // namespace cuda

}  // namespace moecore::ops

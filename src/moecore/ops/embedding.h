// Token embedding (a row gather) and its backward (a row scatter-add).
//
// Shapes and dtypes (V vocabulary rows, H hidden size, T tokens):
//   table  [V, H]  f32 or bf16 (f64 on the CPU only)
//   ids    [T]     i32 in [0, V); any other value raises an Error naming the position and value
//   out    [T, H]  table's dtype:             out[t, :] = table[ids[t], :]
//   dout   [T, H]  f32 or bf16 (f64 on the CPU)
//   dtable [V, H]  f32 (f64 for f64 dout); ACCUMULATES: dtable[ids[t], :] += dout[t, :]
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

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

// Backends return the first position t whose id is outside [0, V) (the dispatcher raises the
// Error), or -1 when all are valid.
namespace cpu {
int64_t embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, int64_t vocab, int64_t tokens,
                          int64_t hidden);
int64_t embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, int64_t vocab, int64_t tokens,
                           int64_t hidden);
}  // namespace cpu
namespace cuda {
int64_t embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, int64_t vocab, int64_t tokens,
                          int64_t hidden);
int64_t embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, int64_t vocab, int64_t tokens,
                           int64_t hidden);
}  // namespace cuda

}  // namespace moecore::ops

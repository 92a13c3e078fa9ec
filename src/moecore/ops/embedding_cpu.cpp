#include <algorithm>
#include <cstring>

#include "moecore/ops/common.h"
#include "moecore/ops/embedding.h"

namespace moecore::ops::cpu {

namespace {
int64_t first_bad_id(const int32_t* ids, int64_t tokens, int64_t vocab) {
  for (int64_t t = 0; t < tokens; ++t)
    if (ids[t] < 0 || ids[t] >= vocab) return t;
  return -1;
}
}  // namespace

int64_t embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, EmbeddingPart part, int64_t tokens,
                          int64_t hidden) {
  const int32_t* pid = ids.data<int32_t>();
  const int64_t bad = first_bad_id(pid, tokens, part.total);
  if (bad >= 0) return bad;
  // A row copy: the same dtype on both sides, so bytes are copied unchanged. Ids of other
  // parts give zero rows (all-zero bytes are 0 in every floating dtype).
  const size_t row_bytes = static_cast<size_t>(hidden) * dtype_size(table.dtype());
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = pid[t] - part.start;
    char* d = dst + static_cast<size_t>(t) * row_bytes;
    if (row >= 0 && row < part.rows)
      std::memcpy(d, src + static_cast<size_t>(row) * row_bytes, row_bytes);
    else
      std::memset(d, 0, row_bytes);
  }
  return -1;
}

int64_t embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, EmbeddingPart part, int64_t tokens,
                           int64_t hidden) {
  const int32_t* pid = ids.data<int32_t>();
  const int64_t bad = first_bad_id(pid, tokens, part.total);
  if (bad >= 0) return bad;
  dispatch_floating(dout.dtype(), "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;  // dtable's type: f32, or f64 for f64
    const T* pd = dout.data<T>();
    C* pg = dtable.data<C>();
    // Threads own column chunks and walk the tokens in order: repeated ids accumulate in
    // increasing t (the order CUDA uses too) with no races.
    constexpr int64_t kChunk = 256;
    const int64_t chunks = (hidden + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t c0 = k * kChunk, c1 = std::min(hidden, c0 + kChunk);
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t row = pid[t] - part.start;
        if (row < 0 || row >= part.rows) continue;  // another part's token
        const T* src = pd + t * hidden;
        C* dst = pg + row * hidden;
        for (int64_t c = c0; c < c1; ++c) dst[c] = dst[c] + load(src[c]);
      }
    }
  });
  return -1;
}

}  // namespace moecore::ops::cpu

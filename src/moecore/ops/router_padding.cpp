// The routing-map padding for FP8 GEMM alignment (ops/router_padding.h).
#include "moecore/ops/router_padding.h"

#include <algorithm>
#include <vector>

#include "moecore/core/error.h"

namespace moecore::ops {
namespace {

template <typename P>
Tensor widen_probs(const Tensor& probs, int64_t tokens, int64_t topk, int64_t width) {
  const std::vector<P> src = probs.to_vector<P>();
  std::vector<P> out(static_cast<size_t>(tokens * width), P(0));
  for (int64_t t = 0; t < tokens; ++t)
    std::copy_n(src.begin() + t * topk, topk, out.begin() + t * width);
  return Tensor::from_vector(out, {tokens, width}, probs.device());
}

}  // namespace

PaddedRouting pad_routing_map(const Tensor& indices, const Tensor& probs, const Tensor& kept, int64_t num_experts,
                              int64_t multiple) {
  MC_CHECK(indices.ndim() == 2 && indices.dtype() == DType::I32, "pad_routing_map: indices ", indices.describe(),
           ": expected [T, k] i32");
  MC_CHECK(probs.shape() == indices.shape() && (probs.dtype() == DType::F32 || probs.dtype() == DType::F64),
           "pad_routing_map: probs ", probs.describe(), ": expected f32/f64 of the indices' shape");
  MC_CHECK(!kept.defined() || (kept.shape() == indices.shape() && kept.dtype() == DType::U8),
           "pad_routing_map: kept ", kept.describe(), ": expected u8 of the indices' shape");
  MC_CHECK(multiple >= 1 && num_experts >= 1, "pad_routing_map: multiple ", multiple, ", experts ", num_experts);
  const int64_t tokens = indices.size(0), topk = indices.size(1);
  const std::vector<int32_t> idx = indices.to_vector<int32_t>();
  const std::vector<uint8_t> keep = kept.defined() ? kept.to_vector<uint8_t>() : std::vector<uint8_t>();

  // The routing map [T, E] after capacity dropping and each expert's count.
  std::vector<uint8_t> routed(static_cast<size_t>(tokens * num_experts), 0);
  std::vector<int64_t> count(static_cast<size_t>(num_experts), 0);
  for (int64_t i = 0; i < tokens * topk; ++i) {
    const int64_t e = idx[static_cast<size_t>(i)];
    MC_CHECK(e >= 0 && e < num_experts, "pad_routing_map: expert index ", e, " at (", i / topk, ", ", i % topk,
             ") outside [0, ", num_experts, ")");
    if (!keep.empty() && !keep[static_cast<size_t>(i)]) continue;
    routed[static_cast<size_t>(i / topk * num_experts + e)] = 1;
    ++count[static_cast<size_t>(e)];
  }
  // Each expert's padding: the first unrouted tokens in token order.
  std::vector<std::vector<int32_t>> extra(static_cast<size_t>(tokens));
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t need = (multiple - count[static_cast<size_t>(e)] % multiple) % multiple;
    for (int64_t t = 0; t < tokens && need > 0; ++t)
      if (!routed[static_cast<size_t>(t * num_experts + e)]) {
        extra[static_cast<size_t>(t)].push_back(static_cast<int32_t>(e));
        --need;
      }
  }
  size_t p = 0;
  for (const auto& x : extra) p = std::max(p, x.size());
  PaddedRouting out;
  out.topk = topk;
  if (p == 0) {
    out.indices = indices;
    out.probs = probs;
    out.kept = kept;
    return out;
  }
  const int64_t width = topk + static_cast<int64_t>(p);
  std::vector<int32_t> new_idx(static_cast<size_t>(tokens * width), 0);
  std::vector<uint8_t> new_keep(static_cast<size_t>(tokens * width), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      const size_t from = static_cast<size_t>(t * topk + j), to = static_cast<size_t>(t * width + j);
      new_idx[to] = idx[from];
      new_keep[to] = keep.empty() ? 1 : keep[from];
    }
    const auto& x = extra[static_cast<size_t>(t)];
    for (size_t j = 0; j < x.size(); ++j) {
      const size_t to = static_cast<size_t>(t * width + topk) + j;
      new_idx[to] = x[j];
      new_keep[to] = 1;
    }
  }
  out.indices = Tensor::from_vector(new_idx, {tokens, width}, indices.device());
  out.kept = Tensor::from_vector(new_keep, {tokens, width}, indices.device());
  out.probs = probs.dtype() == DType::F64 ? widen_probs<double>(probs, tokens, topk, width)
                                          : widen_probs<float>(probs, tokens, topk, width);
  return out;
}

}  // namespace moecore::ops

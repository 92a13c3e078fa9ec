// CPU reference for MoE dispatch: plain loops in token order, OpenMP over tokens.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "moecore/ops/common.h"
#include "moecore/ops/permute.h"

namespace moecore::ops::cpu {

namespace {

// Validates every index and returns them grouped by expert: for each expert the flat positions
// t * k + j of its assignments in token order (only kept ones when kept is given).
std::vector<std::vector<int64_t>> group_by_expert(const char* op, const Tensor& indices, const uint8_t* kept,
                                                  int64_t num_experts) {
  const int32_t* idx = indices.data<int32_t>();
  const int64_t n = indices.numel(), k = indices.size(1);
  std::vector<std::vector<int64_t>> groups(static_cast<size_t>(num_experts));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = idx[i];
    if (e < 0 || e >= num_experts) detail::fail_bad_expert_index(op, i / k, i % k, e, num_experts);
    if (kept == nullptr || kept[i]) groups[static_cast<size_t>(e)].push_back(i);
  }
  return groups;
}

// Accumulation type: double when either operand is double.
template <typename T, typename P>
using Acc = std::conditional_t<std::is_same_v<T, double> || std::is_same_v<P, double>, double, float>;

template <typename F>
void dispatch_probs(DType t, const char* op, F&& f) {
  if (t == DType::F64) {
    f(double{});
  } else {
    f(float{});
  }
}

void zero(Tensor& t) { std::memset(t.data_ptr(), 0, t.nbytes()); }

}  // namespace

void capacity_mask(const Tensor& indices, const Tensor& probs, int64_t num_experts, int64_t capacity,
                   DropPolicy policy, Tensor& kept) {
  auto groups = group_by_expert("capacity_mask", indices, nullptr, num_experts);
  uint8_t* out = kept.data<uint8_t>();
  std::fill(out, out + kept.numel(), uint8_t{0});
  dispatch_probs(probs.dtype(), "capacity_mask", [&](auto tag) {
    using P = decltype(tag);
    const P* p = probs.data<P>();
    for (auto& g : groups) {
      if (policy == DropPolicy::Probs) {
        // Highest probability first; stable, so ties keep token order (t, then j).
        std::stable_sort(g.begin(), g.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
      }
      const size_t keep = std::min(g.size(), static_cast<size_t>(capacity));
      for (size_t i = 0; i < keep; ++i) out[g[i]] = 1;
    }
  });
}

void make_moe_routing(const Tensor& indices, const Tensor& kept, MoeRouting& r) {
  const uint8_t* kp = kept.defined() ? kept.data<uint8_t>() : nullptr;
  const auto groups = group_by_expert("make_moe_routing", indices, kp, r.num_experts);
  const int64_t E = r.num_experts, C = r.capacity;
  r.row_map = Tensor::empty({r.num_tokens, r.topk}, DType::I32);
  r.tokens_per_expert = Tensor::empty({E}, DType::I32);
  r.host_tokens_per_expert.assign(static_cast<size_t>(E), 0);
  int32_t* rm = r.row_map.data<int32_t>();
  std::fill(rm, rm + r.row_map.numel(), -1);
  int64_t base = 0;
  for (int64_t e = 0; e < E; ++e) {
    const auto& g = groups[static_cast<size_t>(e)];
    const int64_t n = static_cast<int64_t>(g.size());
    if (C > 0 && n > C) detail::fail_over_capacity(e, n, C);
    if (C > 0) base = e * C;
    for (int64_t i = 0; i < n; ++i) rm[g[static_cast<size_t>(i)]] = static_cast<int32_t>(base + i);
    base += n;
    r.host_tokens_per_expert[static_cast<size_t>(e)] = C > 0 ? C : n;
    r.tokens_per_expert.data<int32_t>()[e] = static_cast<int32_t>(C > 0 ? C : n);
  }
  r.num_rows = C > 0 ? E * C : base;
  r.row_offsets = Tensor::empty({E + 1}, DType::I32);
  r.kept_per_expert = Tensor::empty({E}, DType::I32);
  int32_t* off = r.row_offsets.data<int32_t>();
  off[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    off[e + 1] = static_cast<int32_t>(off[e] + r.host_tokens_per_expert[static_cast<size_t>(e)]);
    r.kept_per_expert.data<int32_t>()[e] = static_cast<int32_t>(groups[static_cast<size_t>(e)].size());
  }
}

void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out) {
  if (r.capacity > 0) zero(out);  // padding rows
  const int64_t T = r.num_tokens, k = r.topk, H = x.size(1);
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(x.dtype());
  const int32_t* rm = r.row_map.data<int32_t>();
  const char* px = static_cast<const char*>(x.data_ptr());
  char* po = static_cast<char*>(out.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = rm[t * k + j];
      if (row >= 0 && row_bytes > 0) std::memcpy(po + row * row_bytes, px + t * row_bytes, row_bytes);
    }
}

void moe_permute_backward(const Tensor& dout, const MoeRouting& r, Tensor& dx) {
  dispatch_floating(dout.dtype(), "moe_permute_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const int64_t T_ = r.num_tokens, k = r.topk, H = dout.size(1);
    const int32_t* rm = r.row_map.data<int32_t>();
    const T* pd = dout.data<T>();
    T* px = dx.data<T>();
#pragma omp parallel
    {
      std::vector<C> acc(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T_; ++t) {
        std::fill(acc.begin(), acc.end(), C(0));
        for (int64_t j = 0; j < k; ++j) {
          const int32_t row = rm[t * k + j];
          if (row < 0) continue;
          for (int64_t h = 0; h < H; ++h) acc[h] += load(pd[row * H + h]);
        }
        for (int64_t h = 0; h < H; ++h) px[t * H + h] = store<T>(acc[h]);
      }
    }
  });
}

void moe_unpermute_forward(const Tensor& y, const Tensor& probs, const MoeRouting& r, Tensor& out) {
  dispatch_floating(y.dtype(), "moe_unpermute_forward", [&](auto tag) {
    dispatch_probs(probs.dtype(), "moe_unpermute_forward", [&](auto ptag) {
      using T = decltype(tag);
      using P = decltype(ptag);
      using A = Acc<T, P>;
      const int64_t T_ = r.num_tokens, k = r.topk, H = y.size(1);
      const int32_t* rm = r.row_map.data<int32_t>();
      const T* py = y.data<T>();
      const P* pp = probs.data<P>();
      T* po = out.data<T>();
#pragma omp parallel
      {
        std::vector<A> acc(static_cast<size_t>(H));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T_; ++t) {
          std::fill(acc.begin(), acc.end(), A(0));
          for (int64_t j = 0; j < k; ++j) {
            const int32_t row = rm[t * k + j];
            if (row < 0) continue;
            const A p = static_cast<A>(pp[t * k + j]);
            for (int64_t h = 0; h < H; ++h) acc[h] += p * static_cast<A>(load(py[row * H + h]));
          }
          for (int64_t h = 0; h < H; ++h) po[t * H + h] = store<T>(acc[h]);
        }
      }
    });
  });
}

void moe_unpermute_backward(const Tensor& y, const Tensor& probs, const MoeRouting& r, const Tensor& dout,
                            Tensor& dy, Tensor& dprobs) {
  if (r.capacity > 0) zero(dy);  // padding rows
  dispatch_floating(y.dtype(), "moe_unpermute_backward", [&](auto tag) {
    dispatch_probs(probs.dtype(), "moe_unpermute_backward", [&](auto ptag) {
      using T = decltype(tag);
      using P = decltype(ptag);
      using A = Acc<T, P>;
      const int64_t T_ = r.num_tokens, k = r.topk, H = y.size(1);
      const int32_t* rm = r.row_map.data<int32_t>();
      const T* py = y.data<T>();
      const T* pd = dout.data<T>();
      const P* pp = probs.data<P>();
      T* pdy = dy.data<T>();
      P* pdp = dprobs.data<P>();
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t row = rm[t * k + j];
          if (row < 0) {
            pdp[t * k + j] = P(0);
            continue;
          }
          const A p = static_cast<A>(pp[t * k + j]);
          A dot = 0;
          for (int64_t h = 0; h < H; ++h) {
            const A d = static_cast<A>(load(pd[t * H + h]));
            dot += d * static_cast<A>(load(py[row * H + h]));
            pdy[row * H + h] = store<T>(p * d);
          }
          pdp[t * k + j] = static_cast<P>(dot);
        }
    });
  });
}

void moe_permute_probs_forward(const Tensor& probs, const MoeRouting& r, Tensor& out) {
  if (r.capacity > 0) zero(out);  // padding rows
  dispatch_probs(probs.dtype(), "moe_permute_probs_forward", [&](auto ptag) {
    using P = decltype(ptag);
    const int32_t* rm = r.row_map.data<int32_t>();
    const P* pp = probs.data<P>();
    P* po = out.data<P>();
    for (int64_t i = 0; i < r.num_tokens * r.topk; ++i)
      if (rm[i] >= 0) po[rm[i]] = pp[i];
  });
}

void moe_permute_probs_backward(const Tensor& dout, const MoeRouting& r, Tensor& dprobs) {
  dispatch_probs(dout.dtype(), "moe_permute_probs_backward", [&](auto ptag) {
    using P = decltype(ptag);
    const int32_t* rm = r.row_map.data<int32_t>();
    const P* pd = dout.data<P>();
    P* pp = dprobs.data<P>();
    for (int64_t i = 0; i < r.num_tokens * r.topk; ++i) pp[i] = rm[i] >= 0 ? pd[rm[i]] : P(0);
  });
}

}  // namespace moecore::ops::cpu

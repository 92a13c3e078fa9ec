// CPU router: one token row at a time, in the logits' precision (float or double).
#include <cmath>
#include <limits>
#include <vector>

#include "moecore/ops/common.h"
#include "moecore/ops/router.h"

namespace moecore::ops::cpu {

namespace {

// Router-sized tensors are small: threads only pay off above this many elements.
constexpr int64_t kParallelMin = 1 << 15;

template <typename C>
C sigmoid(C x) {
  return C(1) / (C(1) + std::exp(-x));
}

// Picks the k best of sc[0, n) into out, best first; ties go to the lower index.
template <typename C>
void topk_indices(const C* sc, int64_t n, int64_t k, int32_t* out, std::vector<char>& taken) {
  taken.assign(static_cast<size_t>(n), 0);
  for (int64_t i = 0; i < k; ++i) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e)
      if (!taken[e] && (best < 0 || sc[e] > sc[best])) best = e;
    taken[best] = 1;
    out[i] = static_cast<int32_t>(best);
  }
}

// Group-limited routing: masks to -inf the experts outside the best group_topk groups.
template <typename C>
void mask_groups(C* sc, const RouterConfig& cfg, std::vector<char>& taken, std::vector<int32_t>& tmp) {
  const int64_t G = cfg.num_groups, per = cfg.num_experts / G, m = cfg.topk / cfg.group_topk;
  std::vector<C> gscore(static_cast<size_t>(G));
  tmp.resize(static_cast<size_t>(std::max(m, G)));
  for (int64_t g = 0; g < G; ++g) {
    topk_indices(sc + g * per, per, m, tmp.data(), taken);
    C s = 0;  // summed best first (the CUDA kernel uses the same order)
    for (int64_t i = 0; i < m; ++i) s += sc[g * per + tmp[i]];
    gscore[g] = s;
  }
  topk_indices(gscore.data(), G, cfg.group_topk, tmp.data(), taken);
  std::vector<char> keep(static_cast<size_t>(G), 0);
  for (int64_t i = 0; i < cfg.group_topk; ++i) keep[tmp[i]] = 1;
  for (int64_t e = 0; e < cfg.num_experts; ++e)
    if (!keep[e / per]) sc[e] = -std::numeric_limits<C>::infinity();
}

template <typename C>
void softmax_stats(const C* l, int64_t E, C& mx, C& z) {
  mx = -std::numeric_limits<C>::infinity();
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
  z = 0;
  for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - mx);
}

template <typename C>
void forward_impl(const Tensor& logits, const Tensor& bias, const Tensor& sel, const RouterConfig& cfg, Tensor& probs,
                  Tensor& indices) {
  const int64_t T = logits.size(0), E = cfg.num_experts, k = cfg.topk;
  const C* pl = logits.data<C>();
  const C* pb = bias.defined() ? bias.data<C>() : nullptr;
  const C* ps = sel.defined() ? sel.data<C>() : nullptr;
  C* pp = probs.data<C>();
  int32_t* pi = indices.data<int32_t>();
  const bool sigmoid_score = cfg.score == RouterScore::Sigmoid;
  const C scale = cfg.scaling_factor != 0 ? static_cast<C>(cfg.scaling_factor) : C(1);
#pragma omp parallel if (T * E >= kParallelMin)
  {
    std::vector<C> sc(static_cast<size_t>(E));
    std::vector<char> taken;
    std::vector<int32_t> tmp;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const C* l = pl + t * E;
      int32_t* idx = pi + t * k;
      C* p = pp + t * k;
      C mx = 0, z = 1;
      if (cfg.pre_softmax || (cfg.sinkhorn && k > 1)) softmax_stats(l, E, mx, z);
      // Selection scores.
      for (int64_t e = 0; e < E; ++e) {
        C s;
        if (cfg.sinkhorn) s = ps[t * E + e];
        else if (sigmoid_score) s = sigmoid(l[e]);
        else if (cfg.pre_softmax) s = std::exp(l[e] - mx) / z;
        else s = l[e];
        sc[e] = pb ? s + pb[e] : s;
      }
      if (cfg.num_groups > 0) mask_groups(sc.data(), cfg, taken, tmp);
      topk_indices(sc.data(), E, k, idx, taken);
      // Probabilities (unbiased scores).
      if (cfg.sinkhorn) {
        for (int64_t i = 0; i < k; ++i) p[i] = k > 1 ? std::exp(l[idx[i]] - mx) / z : sigmoid(l[idx[i]]);
      } else if (sigmoid_score) {
        C sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += sigmoid(l[idx[i]]);
        for (int64_t i = 0; i < k; ++i) p[i] = k > 1 ? sigmoid(l[idx[i]]) / (sum + C(1e-20)) : sigmoid(l[idx[i]]);
      } else if (cfg.pre_softmax) {
        for (int64_t i = 0; i < k; ++i) p[i] = std::exp(l[idx[i]] - mx) / z;
      } else {
        const C top = l[idx[0]];  // the largest selected logit
        C sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += std::exp(l[idx[i]] - top);
        for (int64_t i = 0; i < k; ++i) p[i] = std::exp(l[idx[i]] - top) / sum;
      }
      for (int64_t i = 0; i < k; ++i) p[i] *= scale;
    }
  }
}

template <typename C>
void backward_impl(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                   Tensor& dlogits) {
  const int64_t T = logits.size(0), E = cfg.num_experts, k = cfg.topk;
  const C* pl = logits.data<C>();
  const int32_t* pi = indices.data<int32_t>();
  const C* pdp = dprobs.data<C>();
  C* pdl = dlogits.data<C>();
  const C scale = cfg.scaling_factor != 0 ? static_cast<C>(cfg.scaling_factor) : C(1);
  const bool full_softmax = cfg.pre_softmax || (cfg.sinkhorn && k > 1);
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
  for (int64_t t = 0; t < T; ++t) {
    const C* l = pl + t * E;
    const int32_t* idx = pi + t * k;
    const C* dp = pdp + t * k;
    C* dl = pdl + t * E;
    for (int64_t e = 0; e < E; ++e) dl[e] = 0;
    if (full_softmax) {
      // p_i = y[idx_i] with y = softmax(l): dl = y * (dy - <dy, y>), dy scattered to the selection.
      C mx, z;
      softmax_stats(l, E, mx, z);
      C dot = 0;
      for (int64_t i = 0; i < k; ++i) dot += dp[i] * scale * (std::exp(l[idx[i]] - mx) / z);
      for (int64_t e = 0; e < E; ++e) dl[e] = -(std::exp(l[e] - mx) / z) * dot;
      for (int64_t i = 0; i < k; ++i) dl[idx[i]] += (std::exp(l[idx[i]] - mx) / z) * dp[i] * scale;
    } else if (cfg.score == RouterScore::Sigmoid || cfg.sinkhorn) {
      if (k == 1) {
        const C s = sigmoid(l[idx[0]]);
        dl[idx[0]] = dp[0] * scale * s * (C(1) - s);
      } else {
        // p_i = s_i / D, D = sum s + 1e-20: ds_j = dy_j / D - <dy, s> / D^2.
        C sum = 0, q = 0;
        for (int64_t i = 0; i < k; ++i) sum += sigmoid(l[idx[i]]);
        for (int64_t i = 0; i < k; ++i) q += dp[i] * scale * sigmoid(l[idx[i]]);
        const C d = sum + C(1e-20);
        for (int64_t i = 0; i < k; ++i) {
          const C s = sigmoid(l[idx[i]]);
          dl[idx[i]] = (dp[i] * scale / d - q / (d * d)) * s * (C(1) - s);
        }
      }
    } else {
      // Softmax over the selected logits.
      C top = l[idx[0]];
      for (int64_t i = 1; i < k; ++i) top = std::max(top, l[idx[i]]);
      C sum = 0, dot = 0;
      for (int64_t i = 0; i < k; ++i) sum += std::exp(l[idx[i]] - top);
      for (int64_t i = 0; i < k; ++i) dot += dp[i] * scale * (std::exp(l[idx[i]] - top) / sum);
      for (int64_t i = 0; i < k; ++i) {
        const C y = std::exp(l[idx[i]] - top) / sum;
        dl[idx[i]] = y * (dp[i] * scale - dot);
      }
    }
  }
}

}  // namespace

void router_topk_forward(const Tensor& logits, const Tensor& expert_bias, const Tensor& sel_scores,
                         const RouterConfig& cfg, Tensor& probs, Tensor& indices) {
  if (logits.dtype() == DType::F64) forward_impl<double>(logits, expert_bias, sel_scores, cfg, probs, indices);
  else forward_impl<float>(logits, expert_bias, sel_scores, cfg, probs, indices);
}

void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                          Tensor& dlogits) {
  if (logits.dtype() == DType::F64) backward_impl<double>(logits, indices, dprobs, cfg, dlogits);
  else backward_impl<float>(logits, indices, dprobs, cfg, dlogits);
}

}  // namespace moecore::ops::cpu

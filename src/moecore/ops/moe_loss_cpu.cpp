// CPU load-balancing losses and Sinkhorn, in the tensors' precision with double accumulators
// for sums over tokens.
#include <cmath>
#include <limits>
#include <vector>

#include "moecore/ops/common.h"
#include "moecore/ops/moe_loss.h"

namespace moecore::ops::cpu {

namespace {

// Router-sized tensors are small: threads only pay off above this many elements.
constexpr int64_t kParallelMin = 1 << 15;

template <typename F>
void dispatch_router(DType t, F&& f) {
  if (t == DType::F64) f(double{});
  else f(float{});
}

template <typename C>
C sigmoid(C x) {
  return C(1) / (C(1) + std::exp(-x));
}

// Writes the aux scores of one row into a.
template <typename C>
void aux_row(const C* l, int64_t E, RouterScore score, C* a) {
  if (score == RouterScore::Softmax) {
    C mx = -std::numeric_limits<C>::infinity(), z = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
    for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - mx);
    for (int64_t e = 0; e < E; ++e) a[e] = std::exp(l[e] - mx) / z;
  } else {
    C z = 0;
    for (int64_t e = 0; e < E; ++e) z += sigmoid(l[e]);
    for (int64_t e = 0; e < E; ++e) a[e] = sigmoid(l[e]) / (z + C(1e-20));
  }
}

double get(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}

// The per-group weight coeff / G * E / (k Tg^2).
double group_weight(int64_t T, int64_t G, int64_t E, int64_t k, double coeff) {
  const double tg = static_cast<double>(T / G);
  return coeff / static_cast<double>(G) * static_cast<double>(E) / (static_cast<double>(k) * tg * tg);
}

}  // namespace

void aux_scores_forward(const Tensor& logits, RouterScore score, Tensor& aux_scores) {
  dispatch_router(logits.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = logits.size(0), E = logits.size(1);
    const C* pl = logits.data<C>();
    C* pa = aux_scores.data<C>();
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
    for (int64_t t = 0; t < T; ++t) aux_row(pl + t * E, E, score, pa + t * E);
  });
}

void aux_scores_backward(const Tensor& logits, RouterScore score, const Tensor& daux_scores, Tensor& dlogits) {
  dispatch_router(logits.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = logits.size(0), E = logits.size(1);
    const C* pl = logits.data<C>();
    const C* pda = daux_scores.data<C>();
    C* pdl = dlogits.data<C>();
#pragma omp parallel if (T * E >= kParallelMin)
    {
      std::vector<C> a(static_cast<size_t>(E));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        const C* l = pl + t * E;
        const C* da = pda + t * E;
        C* dl = pdl + t * E;
        if (score == RouterScore::Softmax) {
          aux_row(l, E, score, a.data());
          C dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += da[e] * a[e];
          for (int64_t e = 0; e < E; ++e) dl[e] += a[e] * (da[e] - dot);
        } else {
          // a = s / D, D = sum s + 1e-20: ds_j = da_j / D - <da, s> / D^2; ds/dl = s (1 - s).
          C z = 0, q = 0;
          for (int64_t e = 0; e < E; ++e) {
            const C s = sigmoid(l[e]);
            z += s;
            q += da[e] * s;
          }
          const C d = z + C(1e-20);
          for (int64_t e = 0; e < E; ++e) {
            const C s = sigmoid(l[e]);
            dl[e] += (da[e] / d - q / (d * d)) * s * (C(1) - s);
          }
        }
      }
    }
  });
}

void counts_from_indices(const Tensor& indices, int64_t groups, Tensor& counts) {
  const int64_t T = indices.size(0), k = indices.size(1), E = counts.size(1), tg = T / groups;
  const int32_t* pi = indices.data<int32_t>();
  float* pc = counts.data<float>();
  for (int64_t i = 0; i < groups * E; ++i) pc[i] = 0.0f;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) pc[(t / tg) * E + pi[t * k + i]] += 1.0f;
}

void switch_aux_loss_forward(const Tensor& aux_scores, const Tensor& counts, int64_t topk, double coeff, Tensor& loss) {
  dispatch_router(aux_scores.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = aux_scores.size(0), E = aux_scores.size(1), G = counts.size(0), tg = T / G;
    const C* pa = aux_scores.data<C>();
    double total = 0;
    std::vector<double> colsum(static_cast<size_t>(E));
    for (int64_t g = 0; g < G; ++g) {
      colsum.assign(static_cast<size_t>(E), 0.0);
      for (int64_t t = g * tg; t < (g + 1) * tg; ++t)
        for (int64_t e = 0; e < E; ++e) colsum[e] += static_cast<double>(pa[t * E + e]);
      for (int64_t e = 0; e < E; ++e) total += colsum[e] * get(counts, g * E + e);
    }
    loss.data<C>()[0] = static_cast<C>(total * group_weight(T, G, E, topk, coeff));
  });
}

void switch_aux_loss_backward(const Tensor& counts, int64_t topk, double coeff, double dloss, Tensor& daux_scores) {
  dispatch_router(daux_scores.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = daux_scores.size(0), E = daux_scores.size(1), G = counts.size(0), tg = T / G;
    const double w = dloss * group_weight(T, G, E, topk, coeff);
    C* pd = daux_scores.data<C>();
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) pd[t * E + e] = static_cast<C>(w * get(counts, (t / tg) * E + e));
  });
}

namespace {
template <typename C>
C logsumexp_row(const C* l, int64_t E) {
  C mx = -std::numeric_limits<C>::infinity(), z = 0;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
  for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - mx);
  return mx + std::log(z);
}
}  // namespace

void z_loss_forward(const Tensor& logits, double coeff, Tensor& loss) {
  dispatch_router(logits.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = logits.size(0), E = logits.size(1);
    const C* pl = logits.data<C>();
    double total = 0;
    for (int64_t t = 0; t < T; ++t) {
      const double lse = static_cast<double>(logsumexp_row(pl + t * E, E));
      total += lse * lse;
    }
    loss.data<C>()[0] = static_cast<C>(coeff * total / static_cast<double>(T));
  });
}

void z_loss_backward(const Tensor& logits, double coeff, double dloss, Tensor& dlogits) {
  dispatch_router(logits.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = logits.size(0), E = logits.size(1);
    const C* pl = logits.data<C>();
    C* pdl = dlogits.data<C>();
    const C w = static_cast<C>(dloss * coeff * 2.0 / static_cast<double>(T));
#pragma omp parallel for schedule(static) if (T * E >= kParallelMin)
    for (int64_t t = 0; t < T; ++t) {
      const C* l = pl + t * E;
      const C lse = logsumexp_row(l, E);
      for (int64_t e = 0; e < E; ++e) pdl[t * E + e] += w * lse * std::exp(l[e] - lse);
    }
  });
}

void sinkhorn(const Tensor& logits, Tensor& out) {
  dispatch_router(logits.dtype(), [&](auto tag) {
    using C = decltype(tag);
    const int64_t T = logits.size(0), E = logits.size(1);
    const C* pl = logits.data<C>();
    C* c = out.data<C>();  // exp(logits), scaled in place at the end
    for (int64_t i = 0; i < T * E; ++i) c[i] = std::exp(pl[i]);
    std::vector<C> d0(static_cast<size_t>(T), C(1)), d1(static_cast<size_t>(E), C(1)), d1_old = d1;
    std::vector<double> col(static_cast<size_t>(E));
    const C eps = C(1e-8);
    double error = 1e9;
    for (int it = 0; it < kSinkhornMaxIters && error > kSinkhornTol; ++it) {
      for (int64_t t = 0; t < T; ++t) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += static_cast<double>(d1[e] * c[t * E + e]);
        d0[t] = C(1) / static_cast<C>(T) / (static_cast<C>(s) + eps);
      }
      col.assign(static_cast<size_t>(E), 0.0);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e) col[e] += static_cast<double>(d0[t] * c[t * E + e]);
      double err = 0;
      for (int64_t e = 0; e < E; ++e) {
        d1[e] = C(1) / static_cast<C>(E) / (static_cast<C>(col[e]) + eps);
        err += std::fabs(static_cast<double>(d1_old[e] - d1[e]));
      }
      error = err / static_cast<double>(E);  // NaN ends the loop, as `while error > tol` does
      d1_old = d1;
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) c[t * E + e] = d1[e] * c[t * E + e] * d0[t];
  });
}

}  // namespace moecore::ops::cpu

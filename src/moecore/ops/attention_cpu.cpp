// CPU attention: the formulas of attention.h evaluated row by row in Compute<T>. Each
// parallel iteration owns the rows it writes (dq per query row, dk/dv per key row), so there
// are no shared accumulators and results do not depend on the thread count. With o = Sk - Sq
// (attention.h), query s sees keys t <= s + o and key t is seen by queries s >= t - o.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "moecore/ops/attention.h"
#include "moecore/ops/common.h"

namespace moecore::ops::cpu {

namespace {

// Element offsets: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], out-like
// [B, Sq, Hq, Dv] and lse [B, Hq, Sq].
struct Layout {
  int64_t Sq, Sk, Hq, Hkv, D, Dv;
  int64_t q(int64_t b, int64_t s, int64_t h) const { return ((b * Sq + s) * Hq + h) * D; }
  int64_t kv(int64_t b, int64_t t, int64_t h) const { return ((b * Sk + t) * Hkv + h) * D; }
  int64_t v(int64_t b, int64_t t, int64_t h) const { return ((b * Sk + t) * Hkv + h) * Dv; }
  int64_t o(int64_t b, int64_t s, int64_t h) const { return ((b * Sq + s) * Hq + h) * Dv; }
  int64_t row(int64_t b, int64_t h, int64_t s) const { return (b * Hq + h) * Sq + s; }
};

template <typename T>
Compute<T> dot(const T* a, const T* b, int64_t n) {
  Compute<T> acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += load(a[i]) * load(b[i]);
  return acc;
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                       const AttentionDims& d) {
  dispatch_floating(q.dtype(), "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T *pq = q.data<T>(), *pk = k.data<T>(), *pv = v.data<T>();
    T* po = out.data<T>();
    C* plse = lse.data<C>();
    const Layout L{d.seq, d.keys(), d.q_heads, d.kv_heads, d.head_dim, d.value_dim()};
    const int64_t B = d.batch, S = d.seq, Hq = d.q_heads, D = d.head_dim, Dv = d.value_dim(), G = d.group(),
                  o = d.offset();
    const C c = static_cast<C>(scale);
#pragma omp parallel
    {
      std::vector<C> p(d.keys()), acc(Dv);  // scores of one row, its output accumulator
#pragma omp for collapse(3) schedule(dynamic, 16)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t s = 0; s < S; ++s) {
            const T* qs = pq + L.q(b, s, h);
            const int64_t hk = h / G;
            C mx = -std::numeric_limits<C>::infinity();
            for (int64_t t = 0; t <= s + o; ++t) {
              p[t] = c * dot(qs, pk + L.kv(b, t, hk), D);
              mx = std::max(mx, p[t]);
            }
            C sum = 0;
            for (int64_t t = 0; t <= s + o; ++t) sum += (p[t] = std::exp(p[t] - mx));
            std::fill(acc.begin(), acc.end(), C(0));
            for (int64_t t = 0; t <= s + o; ++t) {
              const T* vt = pv + L.v(b, t, hk);
              for (int64_t i = 0; i < Dv; ++i) acc[i] += p[t] * load(vt[i]);
            }
            const C inv = C(1) / sum;
            T* os = po + L.o(b, s, h);
            for (int64_t i = 0; i < Dv; ++i) os[i] = store<T>(acc[i] * inv);
            plse[L.row(b, h, s)] = mx + std::log(sum);
          }
    }
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d) {
  dispatch_floating(q.dtype(), "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T *pq = q.data<T>(), *pk = k.data<T>(), *pv = v.data<T>(), *po = out.data<T>(), *pdo = dout.data<T>();
    const C* plse = lse.data<C>();
    T *pdq = dq.data<T>(), *pdk = dk.data<T>(), *pdv = dv.data<T>();
    const Layout L{d.seq, d.keys(), d.q_heads, d.kv_heads, d.head_dim, d.value_dim()};
    const int64_t B = d.batch, S = d.seq, Sk = d.keys(), Hq = d.q_heads, Hkv = d.kv_heads, D = d.head_dim,
                  Dv = d.value_dim(), G = d.group(), o = d.offset();
    const C c = static_cast<C>(scale);

    // Dr[b, h, s] = dO_s . O_s (from the stored, possibly rounded, output).
    std::vector<C> dr(static_cast<size_t>(B * Hq * S));
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t s = 0; s < S; ++s) dr[L.row(b, h, s)] = dot(pdo + L.o(b, s, h), po + L.o(b, s, h), Dv);

    // P[s, t] and dS[s, t] for one (b, h); recomputed by both passes below.
    auto p_and_ds = [&](int64_t b, int64_t h, int64_t s, int64_t t, C& p, C& ds) {
      const int64_t hk = h / G;
      p = std::exp(c * dot(pq + L.q(b, s, h), pk + L.kv(b, t, hk), D) - plse[L.row(b, h, s)]);
      const C dp = dot(pdo + L.o(b, s, h), pv + L.v(b, t, hk), Dv);
      ds = p * (dp - dr[L.row(b, h, s)]);
    };

    // dQ_s = c sum_{t<=s+o} dS[s, t] K_t, one query row per iteration.
#pragma omp parallel
    {
      std::vector<C> acc(D);
#pragma omp for collapse(3) schedule(dynamic, 16)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t s = 0; s < S; ++s) {
            std::fill(acc.begin(), acc.end(), C(0));
            for (int64_t t = 0; t <= s + o; ++t) {
              C p, ds;
              p_and_ds(b, h, s, t, p, ds);
              const T* kt = pk + L.kv(b, t, h / G);
              for (int64_t i = 0; i < D; ++i) acc[i] += ds * load(kt[i]);
            }
            T* out_row = pdq + L.q(b, s, h);
            for (int64_t i = 0; i < D; ++i) out_row[i] = store<T>(c * acc[i]);
          }
    }

    // dK_t = c sum_{h in group} sum_{s>=t-o} dS[s, t] Q_s;  dV_t = sum_h sum_{s>=t-o} P[s, t] dO_s.
#pragma omp parallel
    {
      std::vector<C> acc_k(D), acc_v(Dv);
#pragma omp for collapse(3) schedule(dynamic, 16)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hk = 0; hk < Hkv; ++hk)
          for (int64_t t = 0; t < Sk; ++t) {
            std::fill(acc_k.begin(), acc_k.end(), C(0));
            std::fill(acc_v.begin(), acc_v.end(), C(0));
            for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
              for (int64_t s = std::max<int64_t>(0, t - o); s < S; ++s) {
                C p, ds;
                p_and_ds(b, h, s, t, p, ds);
                const T* qs = pq + L.q(b, s, h);
                const T* dos = pdo + L.o(b, s, h);
                for (int64_t i = 0; i < D; ++i) acc_k[i] += ds * load(qs[i]);
                for (int64_t i = 0; i < Dv; ++i) acc_v[i] += p * load(dos[i]);
              }
            T* kr = pdk + L.kv(b, t, hk);
            T* vr = pdv + L.v(b, t, hk);
            for (int64_t i = 0; i < D; ++i) kr[i] = store<T>(c * acc_k[i]);
            for (int64_t i = 0; i < Dv; ++i) vr[i] = store<T>(acc_v[i]);
          }
    }
  });
}

}  // namespace moecore::ops::cpu

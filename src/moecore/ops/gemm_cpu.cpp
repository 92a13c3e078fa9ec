// CPU GEMM. f32 goes to OpenBLAS (row-major cblas). f64 uses plain loops: it is the
// reference for gradient checks, where clarity beats speed. bf16 converts to f32, runs sgemm,
// and rounds the result once, which is what a bf16 GEMM with fp32 accumulation computes.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/ops/gemm.h"

namespace moecore::ops::cpu {

namespace {

template <typename T>
void gemm_loops(const T* a, const T* b, T* c, int64_t m, int64_t n, int64_t k, bool ta, bool tb, T alpha, T beta) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    std::vector<T> acc(static_cast<size_t>(n), T(0));
    for (int64_t p = 0; p < k; ++p) {
      const T av = ta ? a[p * m + i] : a[i * k + p];
      if (tb) {
        for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] += av * b[j * k + p];
      } else {
        const T* brow = b + p * n;
        for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] += av * brow[j];
      }
    }
    T* crow = c + i * n;
    for (int64_t j = 0; j < n; ++j)
      crow[j] = alpha * acc[static_cast<size_t>(j)] + (beta == T(0) ? T(0) : beta * crow[j]);
  }
}

void sgemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k, bool ta, bool tb, float alpha,
           float beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS leaves C alone when k == 0; the definition says C = beta * C.
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  if (beta == 0.0f) std::fill(c, c + m * n, 0.0f);  // a NaN in C times 0 must not survive
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), alpha, a, ta ? static_cast<int>(m) : static_cast<int>(k), b,
              tb ? static_cast<int>(k) : static_cast<int>(n), beta, c, static_cast<int>(n));
}

std::vector<float> bf16_to_f32(const bf16* p, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<float>(p[i]);
  return out;
}

}  // namespace

void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool ta, bool tb, float alpha, float beta) {
  const GemmShape s = gemm_shape(a, b, c, ta, tb);
  switch (a.dtype()) {
    case DType::F32:
      sgemm(a.data<float>(), b.data<float>(), c.data<float>(), s.m, s.n, s.k, ta, tb, alpha, beta);
      return;
    case DType::F64:
      gemm_loops<double>(a.data<double>(), b.data<double>(), c.data<double>(), s.m, s.n, s.k, ta, tb, alpha, beta);
      return;
    case DType::BF16: {
      const std::vector<float> af = bf16_to_f32(a.data<bf16>(), a.numel());
      const std::vector<float> bf = bf16_to_f32(b.data<bf16>(), b.numel());
      if (c.dtype() == DType::F32) {
        sgemm(af.data(), bf.data(), c.data<float>(), s.m, s.n, s.k, ta, tb, alpha, beta);
        return;
      }
      std::vector<float> cf = beta == 0.0f ? std::vector<float>(static_cast<size_t>(c.numel()))
                                           : bf16_to_f32(c.data<bf16>(), c.numel());
      sgemm(af.data(), bf.data(), cf.data(), s.m, s.n, s.k, ta, tb, alpha, beta);
      bf16* out = c.data<bf16>();
      for (int64_t i = 0; i < c.numel(); ++i) out[i] = bf16(cf[static_cast<size_t>(i)]);
      return;
    }
    default: MC_FAIL("gemm: unsupported dtype ", dtype_name(a.dtype()), " on the CPU");
  }
}

}  // namespace moecore::ops::cpu

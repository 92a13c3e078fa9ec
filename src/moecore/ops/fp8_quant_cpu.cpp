// CPU FP8 quantisation (core/float_formats.h conversions) and the emulated FP8 GEMM: code
// products summed by sgemm per 128-wide K block, promoted into an fp32 accumulator with the two
// operands' factors (fp8_quant.h).
#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "moecore/ops/fp8_quant.h"

namespace moecore::ops::cpu {

namespace {
constexpr int64_t B = kFp8BlockSize;

// Reads x (f32 or bf16) as floats.
std::vector<float> as_floats(const Tensor& x) {
  std::vector<float> v(static_cast<size_t>(x.numel()));
  if (x.dtype() == DType::F32) {
    std::copy(x.data<float>(), x.data<float>() + x.numel(), v.begin());
  } else {
    const bf16* p = x.data<bf16>();
    for (int64_t i = 0; i < x.numel(); ++i) v[static_cast<size_t>(i)] = static_cast<float>(p[i]);
  }
  return v;
}

uint8_t encode(float v, Fp8Format f) { return f == Fp8Format::E4M3 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v); }

const std::array<float, 256>& decode_table(Fp8Format f) {
  static const std::array<float, 256> e4m3 = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[static_cast<size_t>(i)] = e4m3_bits_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  static const std::array<float, 256> e5m2 = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[static_cast<size_t>(i)] = e5m2_bits_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  return f == Fp8Format::E4M3 ? e4m3 : e5m2;
}

uint8_t* codes(const Fp8Tensor& t) { return static_cast<uint8_t*>(t.data.data_ptr()); }

// max |v| with NaN propagated.
float amax_of(const float* v, int64_t n, int64_t stride = 1) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i * stride]);
    if (std::isnan(a)) return a;
    m = std::max(m, a);
  }
  return m;
}

// The factor of element (row, kblock) of an operand whose K runs along its columns.
float factor(const Fp8Tensor& t, int64_t row, int64_t kb) {
  const float* s = t.scale_inv.data<float>();
  switch (t.scaling) {
    case Fp8Scaling::PerTensor: return s[0];
    case Fp8Scaling::Tile1x128: return s[row * t.scale_inv.size(1) + kb];
    case Fp8Scaling::Block128: return s[(row / B) * t.scale_inv.size(1) + kb];
  }
  return 0.0f;
}
}  // namespace

float amax(const Tensor& x) {
  const std::vector<float> v = as_floats(x);
  return amax_of(v.data(), x.numel());
}

void quantize_per_tensor(const Tensor& x, float scale, Fp8Tensor& out) {
  const std::vector<float> v = as_floats(x);
  const Fp8Format f = out.format();
  uint8_t* q = codes(out);
  for (size_t i = 0; i < v.size(); ++i) q[i] = encode(v[i] * scale, f);
  out.scale_inv.data<float>()[0] = 1.0f / scale;
}

void quantize_tiles(const Tensor& x, bool transpose, Fp8Tensor& out) {
  const std::vector<float> v = as_floats(x);
  const int64_t xc = x.size(1);
  // Output row r of `out` reads x's row r (x's column r when transposing): stride 1 or xc.
  const int64_t rows = out.rows(), cols = out.cols(), tiles = out.scale_inv.size(1);
  const int64_t step = transpose ? xc : 1;
  const Fp8Format f = out.format();
  uint8_t* q = codes(out);
  float* s = out.scale_inv.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = transpose ? v.data() + r : v.data() + r * xc;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t c0 = t * B, n = std::min(B, cols - c0);
      const float scale = fp8_scale_from_amax(amax_of(src + c0 * step, n, step), f, true);
      for (int64_t c = c0; c < c0 + n; ++c) q[r * cols + c] = encode(src[c * step] * scale, f);
      s[r * tiles + t] = 1.0f / scale;
    }
  }
}

namespace {
// The 128x128 blocks of x: each block's amax into amax_out (if not null), and (out not null) its
// codes and factor with the scale from `given` (if not null: an amax per block) or from its own amax.
void blocks(const Tensor& x, const float* given, float* amax_out, Fp8Tensor* out) {
  const std::vector<float> v = as_floats(x);
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t br = (rows + B - 1) / B, bc = (cols + B - 1) / B;
  for (int64_t i = 0; i < br; ++i)
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t r0 = i * B, r1 = std::min(rows, r0 + B), c0 = j * B, n = std::min(B, cols - c0);
      float m = 0.0f;
      if (!given || amax_out)
        for (int64_t r = r0; r < r1; ++r) {
          const float a = amax_of(v.data() + r * cols + c0, n);
          m = std::isnan(a) || std::isnan(m) ? a + m : std::max(m, a);
        }
      if (amax_out) amax_out[i * bc + j] = m;
      if (!out) continue;
      const Fp8Format f = out->format();
      const float scale = fp8_scale_from_amax(given ? given[i * bc + j] : m, f, true);
      uint8_t* q = codes(*out);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c0 + n; ++c) q[r * cols + c] = encode(v[static_cast<size_t>(r * cols + c)] * scale, f);
      out->scale_inv.data<float>()[i * bc + j] = 1.0f / scale;
    }
}
}  // namespace

void quantize_blocks(const Tensor& x, Fp8Tensor& out) { blocks(x, nullptr, nullptr, &out); }
void block_amax(const Tensor& x, Tensor& out) { blocks(x, nullptr, out.data<float>(), nullptr); }
void quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Tensor& out) {
  blocks(x, block_amax.data<float>(), nullptr, &out);
}

void fp8_transpose(const Fp8Tensor& t, Fp8Tensor& out) {
  const int64_t rows = t.rows(), cols = t.cols();
  const uint8_t* src = codes(t);
  uint8_t* dst = codes(out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  const float* s = t.scale_inv.data<float>();
  float* d = out.scale_inv.data<float>();
  if (t.scaling == Fp8Scaling::PerTensor) {
    d[0] = s[0];
    return;
  }
  const int64_t sr = t.scale_inv.size(0), sc = t.scale_inv.size(1);
  for (int64_t i = 0; i < sr; ++i)
    for (int64_t j = 0; j < sc; ++j) d[j * sr + i] = s[i * sc + j];
}

void dequantize(const Fp8Tensor& t, Tensor& out) {
  const std::array<float, 256>& table = decode_table(t.format());
  const int64_t rows = t.rows(), cols = t.cols();
  const uint8_t* q = codes(t);
  float* o = out.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      o[r * cols + c] = table[q[r * cols + c]] * factor(t, r, c / B);
    }
}

void fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c, float beta) {
  const int64_t m = a.rows(), n = b.rows(), k = a.cols();
  const bool one_block = a.scaling == Fp8Scaling::PerTensor && b.scaling == Fp8Scaling::PerTensor;
  const int64_t kw_max = one_block ? std::max<int64_t>(k, 1) : B;
  const std::array<float, 256>& ta = decode_table(a.format());
  const std::array<float, 256>& tb = decode_table(b.format());
  std::vector<float> acc(static_cast<size_t>(m * n), 0.0f), p(static_cast<size_t>(m * n));
  std::vector<float> ab(static_cast<size_t>(m * kw_max)), bb(static_cast<size_t>(n * kw_max));
  const uint8_t* qa = codes(a);
  const uint8_t* qb = codes(b);
  for (int64_t k0 = 0, kb = 0; k0 < k; k0 += kw_max, ++kb) {
    const int64_t kw = std::min(kw_max, k - k0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < kw; ++j) ab[static_cast<size_t>(i * kw + j)] = ta[qa[i * k + k0 + j]];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < kw; ++j) bb[static_cast<size_t>(i * kw + j)] = tb[qb[i * k + k0 + j]];
    if (m > 0 && n > 0)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
                  static_cast<int>(kw), 1.0f, ab.data(), static_cast<int>(kw), bb.data(), static_cast<int>(kw), 0.0f,
                  p.data(), static_cast<int>(n));
    for (int64_t i = 0; i < m; ++i) {
      const float sa = factor(a, i, kb);
      for (int64_t j = 0; j < n; ++j)
        acc[static_cast<size_t>(i * n + j)] += p[static_cast<size_t>(i * n + j)] * (sa * factor(b, j, kb));
    }
  }
  if (c.dtype() == DType::F32) {
    float* o = c.data<float>();
    for (int64_t i = 0; i < m * n; ++i) o[i] = acc[static_cast<size_t>(i)] + (beta == 0.0f ? 0.0f : beta * o[i]);
  } else {
    bf16* o = c.data<bf16>();
    for (int64_t i = 0; i < m * n; ++i)
      o[i] = bf16(acc[static_cast<size_t>(i)] + (beta == 0.0f ? 0.0f : beta * static_cast<float>(o[i])));
  }
}

}  // namespace moecore::ops::cpu

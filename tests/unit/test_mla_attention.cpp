// Multi-Latent Attention's forward (model/mla_attention.h) against the formulas written out
// here in double loops from the parameters: the latent projections and RMSNorms, each head's
// [q_nope, q_pe] and [k_nope, k_pe] with the one RoPE key shared by the heads, YaRN's
// frequencies and cos/sin magnitude, the softmax scale mscale^2 / sqrt(D), causal attention
// with value head dim Dv != D, the output projection. (Gradients: ModelGradients.Mla*.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "moecore/model/mla_attention.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

using Vec = std::vector<double>;

// y [rows, out] = x [rows, in] W^T, W [out, in]
Vec linear(const Vec& x, const Vec& w, int64_t rows, int64_t in, int64_t out) {
  Vec y(static_cast<size_t>(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[r * out + o] += x[r * in + i] * w[o * in + i];
  return y;
}

Vec rmsnorm(const Vec& x, const Vec& w, int64_t rows, int64_t width, double eps) {
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < width; ++i) ss += x[r * width + i] * x[r * width + i];
    const double inv = 1.0 / std::sqrt(ss / width + eps);
    for (int64_t i = 0; i < width; ++i) y[r * width + i] = x[r * width + i] * inv * w[i];
  }
  return y;
}

double mscale_of(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

// Rotate-half RoPE with YaRN of the r values at p (position pos), in place.
void rope_yarn(double* p, int64_t r, int64_t pos, double base, const ops::RopeScaling& s) {
  const int64_t h = r / 2;
  auto corr = [&](double rot) { return r * std::log(s.original_max_position / (rot * 2 * M_PI)) / (2 * std::log(base)); };
  double low = std::max(std::floor(corr(s.beta_fast)), 0.0), high = std::min(std::ceil(corr(s.beta_slow)), r - 1.0);
  if (low == high) high += 0.001;
  const double magnitude = mscale_of(s.factor, s.mscale) / mscale_of(s.factor, s.mscale_all_dim);
  for (int64_t i = 0; i < h; ++i) {
    const double extrapolated = std::pow(base, -2.0 * i / r), interpolated = extrapolated / s.factor;
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double angle = pos * (interpolated * ramp + extrapolated * (1 - ramp));
    const double c = std::cos(angle) * magnitude, sn = std::sin(angle) * magnitude;
    const double a = p[i], b = p[i + h];
    p[i] = a * c - b * sn;
    p[i + h] = b * c + a * sn;
  }
}

}  // namespace

TEST(MlaAttention, ForwardMatchesTheFormulas) {
  ModelConfig c;
  c.num_layers = 1;
  c.hidden_size = 12;
  c.num_attention_heads = 3;
  c.seq_length = 7;
  c.vocab_size = 5;
  c.add_bias_linear = false;
  c.qk_layernorm = true;
  c.init_method_std = 0.4;
  c.rotary_base = 50;
  c.mla = {.enabled = true, .q_lora_rank = 5, .kv_lora_rank = 4, .qk_head_dim = 3, .qk_pos_emb_head_dim = 4,
           .v_head_dim = 2};
  c.rope_yarn = true;
  c.rope_scaling = {.factor = 3, .original_max_position = 40, .beta_fast = 4, .beta_slow = 1, .mscale = 0.8,
                    .mscale_all_dim = 0.6};
  finalize_model_config(c, "1");
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 5);
  const MlaAttention mla(store, "a", c);
  store.initialize();
  auto w = [&](const std::string& n) { return store.get("a." + n + ".weight").weight.to_vector<double>(); };
  const int64_t B = 2, S = c.seq_length, T = B * S, H = c.hidden_size, N = 3, qk = 3, r = 4, D = 7, Dv = 2, kl = 4;
  Tensor x = random_tensor({T, H}, DType::F64);
  MlaAttention::Ctx ctx;
  const Vec got = mla.forward(x, B, ctx).to_vector<double>();

  const Vec xs = x.to_vector<double>();
  const Vec q = linear(rmsnorm(linear(xs, w("linear_q_down_proj"), T, H, 5), w("q_layernorm"), T, 5, c.norm_epsilon),
                       w("linear_q_up_proj"), T, 5, N * D);
  const Vec kv_a = linear(xs, w("linear_kv_down_proj"), T, H, kl + r);
  Vec c_kv(static_cast<size_t>(T * kl));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < kl; ++i) c_kv[t * kl + i] = kv_a[t * (kl + r) + i];
  const Vec kv = linear(rmsnorm(c_kv, w("kv_layernorm"), T, kl, c.norm_epsilon), w("linear_kv_up_proj"), T, kl, N * (qk + Dv));
  const double m = mscale_of(3, 0.6), scale = m * m / std::sqrt(static_cast<double>(D));
  Vec attn(static_cast<size_t>(T * N * Dv), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < N; ++h)
      for (int64_t s = 0; s < S; ++s) {
        Vec qh(q.begin() + ((b * S + s) * N + h) * D, q.begin() + ((b * S + s) * N + h + 1) * D);
        rope_yarn(qh.data() + qk, r, s, c.rotary_base, c.rope_scaling);
        Vec scores;
        for (int64_t t = 0; t <= s; ++t) {
          const int64_t tok = b * S + t;
          Vec kh(static_cast<size_t>(D));
          for (int64_t i = 0; i < qk; ++i) kh[i] = kv[(tok * N + h) * (qk + Dv) + i];
          for (int64_t i = 0; i < r; ++i) kh[qk + i] = kv_a[tok * (kl + r) + kl + i];  // shared by the heads
          rope_yarn(kh.data() + qk, r, t, c.rotary_base, c.rope_scaling);
          double dot = 0;
          for (int64_t i = 0; i < D; ++i) dot += qh[i] * kh[i];
          scores.push_back(dot * scale);
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (double& e : scores) sum += (e = std::exp(e - top));
        for (int64_t t = 0; t <= s; ++t)
          for (int64_t i = 0; i < Dv; ++i)
            attn[((b * S + s) * N + h) * Dv + i] += scores[t] / sum * kv[((b * S + t) * N + h) * (qk + Dv) + qk + i];
      }
  const Vec want = linear(attn, w("linear_proj"), T, N * Dv, H);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  EXPECT_LT(worst, 1e-12);
  EXPECT_GT(*std::max_element(want.begin(), want.end()), 1e-3);  // not trivially zero
}

// Causal GQA attention on the CPU: values against an explicit softmax written here, f64
// gradient checks, the first-token property, and argument errors; keys longer than queries
// (Sk > Sq, bottom-right aligned) against the last rows of a full Sk x Sk attention.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moecore/ops/attention.h"
#include "moecore/ops/decode_attention.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

struct Dims {
  int64_t B, S, Hq, Hkv, D;
};

// The reference: for every (b, s, h), scores over t <= s, a max-shifted softmax, the weighted
// sum of v and logsumexp, all in double. out [B, S, Hq, D], lse [B, Hq, S].
void reference_attention(const Dims& d, const std::vector<double>& q, const std::vector<double>& k,
                         const std::vector<double>& v, double scale, std::vector<double>& out,
                         std::vector<double>& lse) {
  out.assign(d.B * d.S * d.Hq * d.D, 0.0);
  lse.assign(d.B * d.Hq * d.S, 0.0);
  const int64_t group = d.Hq / d.Hkv;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t s = 0; s < d.S; ++s) {
        const int64_t hk = h / group;
        std::vector<double> score(s + 1);
        double mx = -INFINITY;
        for (int64_t t = 0; t <= s; ++t) {
          double acc = 0;
          for (int64_t i = 0; i < d.D; ++i)
            acc += q[((b * d.S + s) * d.Hq + h) * d.D + i] * k[((b * d.S + t) * d.Hkv + hk) * d.D + i];
          score[t] = scale * acc;
          mx = std::max(mx, score[t]);
        }
        double sum = 0;
        for (int64_t t = 0; t <= s; ++t) sum += std::exp(score[t] - mx);
        for (int64_t t = 0; t <= s; ++t) {
          const double p = std::exp(score[t] - mx) / sum;
          for (int64_t i = 0; i < d.D; ++i)
            out[((b * d.S + s) * d.Hq + h) * d.D + i] += p * v[((b * d.S + t) * d.Hkv + hk) * d.D + i];
        }
        lse[(b * d.Hq + h) * d.S + s] = mx + std::log(sum);
      }
}

DType lse_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

// MHA (Hkv == Hq), GQA 4:2 and MQA (Hkv == 1); odd S and D.
const std::vector<Dims> kShapes = {{2, 7, 4, 2, 5}, {1, 9, 3, 3, 4}, {2, 6, 4, 1, 8}, {1, 33, 2, 1, 16}};

}  // namespace

TEST(Attention, ForwardMatchesExplicitSoftmax) {
  for (const Dims& d : kShapes)
    for (DType t : {DType::F32, DType::F64, DType::BF16}) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
      // Inputs in [-2, 2) so that the softmax is far from uniform.
      Tensor q = random_tensor({d.B, d.S, d.Hq, d.D}, t, Device::cpu(), -2, 2);
      Tensor k = random_tensor({d.B, d.S, d.Hkv, d.D}, t, Device::cpu(), -2, 2);
      Tensor v = random_tensor({d.B, d.S, d.Hkv, d.D}, t);
      Tensor out = poisoned(q.shape(), t), lse = poisoned({d.B, d.Hq, d.S}, lse_dtype(t));
      ops::attention_forward(q, k, v, scale, out, lse);
      ASSERT_TRUE(all_written(out));
      ASSERT_TRUE(all_written(lse));
      std::vector<double> ref_out, ref_lse;
      reference_attention(d, to_doubles(q), to_doubles(k), to_doubles(v), scale, ref_out, ref_lse);
      // Inputs are exact in every dtype (to_doubles reads the stored values): the only
      // differences are fp32 arithmetic (f32, bf16) and the bf16 rounding of out.
      const Tolerance out_tol = t == DType::BF16 ? Tolerance{1e-3, 1e-2} : default_tolerance(t);
      const Tolerance lse_tol = t == DType::F64 ? default_tolerance(t) : Tolerance{1e-5, 1e-5};
      EXPECT_TRUE(allclose(out, Tensor::from_vector(ref_out, out.shape()), out_tol))
          << dtype_name(t) << " Hq=" << d.Hq << " Hkv=" << d.Hkv;
      EXPECT_TRUE(allclose(lse, Tensor::from_vector(ref_lse, lse.shape()), lse_tol))
          << dtype_name(t) << " Hq=" << d.Hq << " Hkv=" << d.Hkv;
    }
}

TEST(Attention, FirstTokenAttendsOnlyToItself) {
  const Dims d{3, 6, 4, 2, 7};
  const double scale = 0.37;
  Tensor q = random_tensor({d.B, d.S, d.Hq, d.D}, DType::F32, Device::cpu(), -3, 3);
  Tensor k = random_tensor({d.B, d.S, d.Hkv, d.D}, DType::F32, Device::cpu(), -3, 3);
  Tensor v = random_tensor({d.B, d.S, d.Hkv, d.D}, DType::F32);
  Tensor out = poisoned(q.shape(), DType::F32), lse = poisoned({d.B, d.Hq, d.S}, DType::F32);
  ops::attention_forward(q, k, v, scale, out, lse);
  const std::vector<float> o = out.to_vector<float>(), vv = v.to_vector<float>(), qq = q.to_vector<float>(),
                           kk = k.to_vector<float>(), l = lse.to_vector<float>();
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t hk = h / (d.Hq / d.Hkv);
      double qk = 0;
      for (int64_t i = 0; i < d.D; ++i) {
        // softmax over one key is exactly 1: out[b, 0, h] is v[b, 0, hk] bit for bit.
        EXPECT_EQ(o[(b * d.S * d.Hq + h) * d.D + i], vv[(b * d.S * d.Hkv + hk) * d.D + i]) << b << " " << h;
        qk += static_cast<double>(qq[(b * d.S * d.Hq + h) * d.D + i]) * kk[(b * d.S * d.Hkv + hk) * d.D + i];
      }
      EXPECT_NEAR(l[(b * d.Hq + h) * d.S], scale * qk, 1e-5 * (1 + std::fabs(scale * qk))) << "lse of the first token is its only score";
    }
}

TEST(Attention, LaterKeysDoNotChangeEarlierOutputs) {
  // Causality: changing k and v at position 4 leaves outputs 0..3 unchanged.
  const Dims d{2, 8, 4, 2, 6};
  Tensor q = random_tensor({d.B, d.S, d.Hq, d.D}, DType::F64);
  Tensor k = random_tensor({d.B, d.S, d.Hkv, d.D}, DType::F64), v = random_tensor(k.shape(), DType::F64);
  Tensor out1 = Tensor::empty(q.shape(), DType::F64), lse = Tensor::empty({d.B, d.Hq, d.S}, DType::F64);
  ops::attention_forward(q, k, v, 0.5, out1, lse);
  Tensor k2 = k.clone(), v2 = v.clone();
  k2.slice(1, 4, 5).copy_from(random_tensor({d.B, 1, d.Hkv, d.D}, DType::F64));
  v2.slice(1, 4, 5).copy_from(random_tensor({d.B, 1, d.Hkv, d.D}, DType::F64));
  Tensor out2 = Tensor::empty(q.shape(), DType::F64);
  ops::attention_forward(q, k2, v2, 0.5, out2, lse);
  EXPECT_TRUE(allclose(out2.slice(1, 0, 4), out1.slice(1, 0, 4), {0, 0}));
  EXPECT_FALSE(allclose(out2.slice(1, 4, 8), out1.slice(1, 4, 8), {1e-6, 0})) << "position 4 should change";
}

// Gradient checks in f64 for dq, dk, dv; L = sum <w, out>.
class AttentionGrad : public ::testing::TestWithParam<Dims> {};

TEST_P(AttentionGrad, BackwardMatchesFiniteDifferences) {
  const Dims d = GetParam();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  Tensor q = random_tensor({d.B, d.S, d.Hq, d.D}, DType::F64, Device::cpu(), -2, 2);
  Tensor k = random_tensor({d.B, d.S, d.Hkv, d.D}, DType::F64, Device::cpu(), -2, 2);
  Tensor v = random_tensor({d.B, d.S, d.Hkv, d.D}, DType::F64);
  const Shape lse_shape{d.B, d.Hq, d.S};
  GradCheckOptions opt;
  opt.max_elements = 1000;  // every element of these small inputs
  expect_gradients_match(
      {q, k, v},
      [&](const std::vector<Tensor>& in) {
        Tensor out = Tensor::empty(in[0].shape(), DType::F64), lse = Tensor::empty(lse_shape, DType::F64);
        ops::attention_forward(in[0], in[1], in[2], scale, out, lse);
        return std::vector<Tensor>{out};
      },
      [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor out = Tensor::empty(in[0].shape(), DType::F64), lse = Tensor::empty(lse_shape, DType::F64);
        ops::attention_forward(in[0], in[1], in[2], scale, out, lse);
        // Poisoned gradients: the op overwrites them.
        Tensor dq = poisoned(in[0].shape(), DType::F64), dk = poisoned(in[1].shape(), DType::F64),
               dv = poisoned(in[2].shape(), DType::F64);
        ops::attention_backward(in[0], in[1], in[2], out, lse, dout[0], scale, dq, dk, dv);
        return std::vector<Tensor>{dq, dk, dv};
      },
      opt);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionGrad,
                         ::testing::Values(Dims{2, 5, 4, 2, 3}, Dims{2, 5, 4, 4, 3}, Dims{1, 6, 3, 1, 4},
                                           Dims{1, 1, 2, 1, 2}),
                         [](const ::testing::TestParamInfo<Dims>& i) {
                           return "S" + std::to_string(i.param.S) + "_Hq" + std::to_string(i.param.Hq) + "_Hkv" +
                                  std::to_string(i.param.Hkv) + "_D" + std::to_string(i.param.D);
                         });

// A value head dim Dv unlike D (Multi-Latent Attention): the output equals the Dv = D op run
// with v zero-padded to D, first Dv columns; gradients against f64 finite differences.
TEST(Attention, ValueHeadDimMayDiffer) {
  for (const auto& [D, Dv] : std::vector<std::pair<int64_t, int64_t>>{{5, 3}, {3, 6}}) {
    const Dims d{2, 6, 4, 2, D};
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    Tensor q = random_tensor({d.B, d.S, d.Hq, D}, DType::F64, Device::cpu(), -2, 2);
    Tensor k = random_tensor({d.B, d.S, d.Hkv, D}, DType::F64, Device::cpu(), -2, 2);
    Tensor v = random_tensor({d.B, d.S, d.Hkv, Dv}, DType::F64);
    const Shape out_shape{d.B, d.S, d.Hq, Dv}, lse_shape{d.B, d.Hq, d.S};
    Tensor out = Tensor::empty(out_shape, DType::F64), lse = Tensor::empty(lse_shape, DType::F64);
    ops::attention_forward(q, k, v, scale, out, lse);
    // The reference pads (or truncates) v to D columns; with Dv > D the wide value is split in
    // two D-wide halves that share P.
    const std::vector<double> vv = to_doubles(v);
    std::vector<double> expect(static_cast<size_t>(d.B * d.S * d.Hq * Dv));
    for (int64_t c0 = 0; c0 < Dv; c0 += D) {
      std::vector<double> vpad(static_cast<size_t>(d.B * d.S * d.Hkv * D), 0.0);
      for (int64_t r = 0; r < d.B * d.S * d.Hkv; ++r)
        for (int64_t i = 0; i < D && c0 + i < Dv; ++i) vpad[r * D + i] = vv[r * Dv + c0 + i];
      std::vector<double> ref_out, ref_lse;
      reference_attention(d, to_doubles(q), to_doubles(k), vpad, scale, ref_out, ref_lse);
      for (int64_t r = 0; r < d.B * d.S * d.Hq; ++r)
        for (int64_t i = 0; i < D && c0 + i < Dv; ++i) expect[r * Dv + c0 + i] = ref_out[r * D + i];
      EXPECT_TRUE(allclose(lse, Tensor::from_vector(ref_lse, lse_shape), {1e-12, 1e-12}));
    }
    EXPECT_TRUE(allclose(out, Tensor::from_vector(expect, out_shape), {1e-12, 1e-12})) << "D " << D << " Dv " << Dv;

    GradCheckOptions opt;
    opt.max_elements = 1000;
    expect_gradients_match(
        {q, k, v},
        [&](const std::vector<Tensor>& in) {
          Tensor o = Tensor::empty(out_shape, DType::F64), l = Tensor::empty(lse_shape, DType::F64);
          ops::attention_forward(in[0], in[1], in[2], scale, o, l);
          return std::vector<Tensor>{o};
        },
        [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
          Tensor o = Tensor::empty(out_shape, DType::F64), l = Tensor::empty(lse_shape, DType::F64);
          ops::attention_forward(in[0], in[1], in[2], scale, o, l);
          Tensor dq = poisoned(in[0].shape(), DType::F64), dk = poisoned(in[1].shape(), DType::F64),
                 dv = poisoned(in[2].shape(), DType::F64);
          ops::attention_backward(in[0], in[1], in[2], o, l, dout[0], scale, dq, dk, dv);
          return std::vector<Tensor>{dq, dk, dv};
        },
        opt);
  }
}

TEST(Attention, LowPrecisionBackwardAgreesWithF64) {
  // f32 and bf16 backward against the f64 one on the same (exactly representable) inputs.
  const Dims d{2, 17, 4, 2, 8};
  const double scale = 1.0 / std::sqrt(8.0);
  for (DType t : {DType::F32, DType::BF16}) {
    Tensor q = random_tensor({d.B, d.S, d.Hq, d.D}, t), k = random_tensor({d.B, d.S, d.Hkv, d.D}, t);
    Tensor v = random_tensor(k.shape(), t), dout = random_tensor(q.shape(), t);
    auto run = [&](DType dt, std::vector<Tensor>& grads) {
      auto as = [&](const Tensor& x) {
        return dt == DType::F64 ? Tensor::from_vector(to_doubles(x), x.shape()) : x;
      };
      Tensor qq = as(q), kk = as(k), vv = as(v), dd = as(dout);
      Tensor out = Tensor::empty(q.shape(), dt), lse = Tensor::empty({d.B, d.Hq, d.S}, lse_dtype(dt));
      ops::attention_forward(qq, kk, vv, scale, out, lse);
      grads = {poisoned(q.shape(), dt), poisoned(k.shape(), dt), poisoned(k.shape(), dt)};
      ops::attention_backward(qq, kk, vv, out, lse, dd, scale, grads[0], grads[1], grads[2]);
    };
    std::vector<Tensor> lo, ref;
    run(t, lo);
    run(DType::F64, ref);
    // f32: fp32 arithmetic over <= 17 * 2 terms. bf16: the stored out (rounded, used in Dr) and
    // the rounding of each gradient: about 1% relative, atol for gradients that cancel to ~0.
    const Tolerance tol = t == DType::F32 ? Tolerance{1e-5, 1e-4} : Tolerance{1e-2, 2e-2};
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(all_written(lo[i]));
      EXPECT_TRUE(allclose(lo[i], ref[i], tol)) << dtype_name(t) << " gradient " << "qkv"[i];
    }
  }
}

TEST(Attention, RejectsBadShapes) {
  const auto f32 = DType::F32;
  Tensor q = Tensor::zeros({2, 5, 4, 8}, f32), k = Tensor::zeros({2, 5, 2, 8}, f32), v = k.clone();
  Tensor out = Tensor::zeros(q.shape(), f32), lse = Tensor::zeros({2, 4, 5}, f32);
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no Error; expected one containing: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Hq % Hkv != 0
  Tensor k3 = Tensor::zeros({2, 5, 3, 8}, f32);
  expect_error([&] { ops::attention_forward(q, k3, k3, 0.3, out, lse); },
               "attention_forward: query heads Hq = 4 must be a multiple of kv heads Hkv = 3");
  // B, S, D mismatches between q and k
  expect_error([&] { ops::attention_forward(q, Tensor::zeros({1, 5, 2, 8}, f32), v, 0.3, out, lse); },
               "attention_forward: batch size B differs: 'q' has shape (2, 5, 4, 8) but 'k' has shape (1, 5, 2, 8)");
  // Sk < Sq (Sk > Sq is allowed: see AttentionKvLonger below)
  Tensor k_short = Tensor::zeros({2, 4, 2, 8}, f32);
  expect_error([&] { ops::attention_forward(q, k_short, k_short, 0.3, out, lse); },
               "attention_forward: key/value sequence length Sk = 4 must be >= query sequence length Sq = 5");
  expect_error([&] { ops::attention_forward(q, Tensor::zeros({2, 5, 2, 4}, f32), v, 0.3, out, lse); },
               "head dim D differs");
  // v unlike k in [B, Sk, Hkv]; out not shaped by v's head dim; wrong ranks; outputs of the
  // wrong shape or dtype
  expect_error([&] { ops::attention_forward(q, k, Tensor::zeros({2, 5, 1, 8}, f32), 0.3, out, lse); },
               "'k' and 'v' must agree in [B, Sk, Hkv]: 'k' has shape (2, 5, 2, 8) but 'v' has shape (2, 5, 1, 8)");
  expect_error([&] { ops::attention_forward(q, k, Tensor::zeros({2, 5, 2, 7}, f32), 0.3, out, lse); },
               "argument 'out' has shape (2, 5, 4, 8); expected (2, 5, 4, 7)");
  expect_error([&] { ops::attention_forward(Tensor::zeros({10, 4, 8}, f32), k, v, 0.3, out, lse); },
               "'q' must be [B, S, Hq, D]");
  Tensor bad_lse = Tensor::zeros({2, 5, 4}, f32);
  expect_error([&] { ops::attention_forward(q, k, v, 0.3, out, bad_lse); },
               "argument 'lse' has shape (2, 5, 4); expected (2, 4, 5)");
  Tensor lse64 = Tensor::zeros({2, 4, 5}, DType::F64);
  expect_error([&] { ops::attention_forward(q, k, v, 0.3, out, lse64); }, "'lse' has dtype f64; expected f32");
  Tensor kb = Tensor::zeros(k.shape(), DType::BF16);
  expect_error([&] { ops::attention_forward(q, kb, kb, 0.3, out, lse); }, "'q' is f32 but 'k' is bf16");
  // backward: gradients must be shaped like their inputs
  Tensor dq = Tensor::zeros(q.shape(), f32), dk = Tensor::zeros(k.shape(), f32), dv_bad = Tensor::zeros(q.shape(), f32);
  expect_error([&] { ops::attention_backward(q, k, v, out, lse, out, 0.3, dq, dk, dv_bad); },
               "attention_backward: argument 'dv' has shape (2, 5, 4, 8); expected (2, 5, 2, 8)");
  expect_error([&] { ops::attention_backward(q, k3, k3, out, lse, out, 0.3, dq, dk, dk); },
               "attention_backward: query heads Hq = 4 must be a multiple of kv heads Hkv = 3");
}

// Keys longer than queries (Sk > Sq): the Sq queries are the last Sq positions of a sequence of
// Sk, so the op must equal rows [Sk - Sq, Sk) of the full causal attention over Sk positions
// whose first Sk - Sq query rows are arbitrary. The reference is reference_attention above on
// that full problem (it knows nothing of offsets).
namespace {

struct KvDims {
  int64_t B, Sq, Sk, Hq, Hkv, D;
};

const std::vector<KvDims> kKvShapes = {{2, 5, 13, 4, 2, 3}, {2, 1, 7, 2, 1, 5}, {1, 9, 10, 3, 3, 4},
                                       {2, 6, 6, 4, 1, 8}, {2, 70, 133, 4, 2, 16}};

// Rows [o, Sk) of a [B, Sk, H, D] tensor (o = Sk - Sq), contiguous.
Tensor last_rows(const Tensor& full, int64_t Sq) {
  return full.slice(1, full.size(1) - Sq, full.size(1)).clone();
}

}  // namespace

TEST(AttentionKvLonger, ForwardMatchesLastRowsOfFullAttention) {
  for (const KvDims& d : kKvShapes)
    for (DType t : {DType::F64, DType::F32, DType::BF16}) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
      // The full problem: Sk queries (the first Sk - Sq arbitrary), Sk keys.
      Tensor q_full = random_tensor({d.B, d.Sk, d.Hq, d.D}, t, Device::cpu(), -2, 2);
      Tensor k = random_tensor({d.B, d.Sk, d.Hkv, d.D}, t, Device::cpu(), -2, 2);
      Tensor v = random_tensor(k.shape(), t);
      Tensor q = last_rows(q_full, d.Sq);
      Tensor out = poisoned(q.shape(), t), lse = poisoned({d.B, d.Hq, d.Sq}, lse_dtype(t));
      ops::attention_forward(q, k, v, scale, out, lse);
      ASSERT_TRUE(all_written(out));
      ASSERT_TRUE(all_written(lse));

      std::vector<double> full_out, full_lse;
      reference_attention({d.B, d.Sk, d.Hq, d.Hkv, d.D}, to_doubles(q_full), to_doubles(k), to_doubles(v), scale,
                          full_out, full_lse);
      Tensor ref_out = last_rows(Tensor::from_vector(full_out, q_full.shape()), d.Sq);
      Tensor ref_lse = Tensor::from_vector(full_lse, {d.B, d.Hq, d.Sk}).slice(2, d.Sk - d.Sq, d.Sk).clone();
      const Tolerance out_tol = t == DType::BF16 ? Tolerance{1e-3, 1e-2} : default_tolerance(t);
      const Tolerance lse_tol = t == DType::F64 ? default_tolerance(t) : Tolerance{1e-5, 1e-5};
      EXPECT_TRUE(allclose(out, ref_out, out_tol)) << dtype_name(t) << " Sq=" << d.Sq << " Sk=" << d.Sk;
      EXPECT_TRUE(allclose(lse, ref_lse, lse_tol)) << dtype_name(t) << " Sq=" << d.Sq << " Sk=" << d.Sk;
    }
}

TEST(AttentionKvLonger, BackwardMatchesFullAttentionWithZeroGradOnExtraRows) {
  // dq equals the full attention's last Sq rows of dq, and dk, dv the full attention's dk, dv,
  // when the full problem's dout is zero on its first Sk - Sq rows (those queries do not exist).
  for (const KvDims& d : kKvShapes)
    for (DType t : {DType::F64, DType::F32}) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
      const int64_t o = d.Sk - d.Sq;
      Tensor q_full = random_tensor({d.B, d.Sk, d.Hq, d.D}, t, Device::cpu(), -2, 2);
      Tensor k = random_tensor({d.B, d.Sk, d.Hkv, d.D}, t, Device::cpu(), -2, 2);
      Tensor v = random_tensor(k.shape(), t);
      Tensor dout_full = random_tensor(q_full.shape(), t);
      if (o > 0) dout_full.slice(1, 0, o).copy_from(Tensor::zeros({d.B, o, d.Hq, d.D}, t));
      Tensor q = last_rows(q_full, d.Sq), dout = last_rows(dout_full, d.Sq);

      // The op under test (Sk > Sq).
      Tensor out = Tensor::empty(q.shape(), t), lse = Tensor::empty({d.B, d.Hq, d.Sq}, lse_dtype(t));
      ops::attention_forward(q, k, v, scale, out, lse);
      Tensor dq = poisoned(q.shape(), t), dk = poisoned(k.shape(), t), dv = poisoned(k.shape(), t);
      ops::attention_backward(q, k, v, out, lse, dout, scale, dq, dk, dv);
      for (const Tensor* g : {&dq, &dk, &dv}) ASSERT_TRUE(all_written(*g));

      // The full Sk x Sk problem (Sq == Sk: the path the existing tests hold to the formulas).
      Tensor out_f = Tensor::empty(q_full.shape(), t), lse_f = Tensor::empty({d.B, d.Hq, d.Sk}, lse_dtype(t));
      ops::attention_forward(q_full, k, v, scale, out_f, lse_f);
      Tensor dq_f = Tensor::empty(q_full.shape(), t), dk_f = Tensor::empty(k.shape(), t),
             dv_f = Tensor::empty(k.shape(), t);
      ops::attention_backward(q_full, k, v, out_f, lse_f, dout_full, scale, dq_f, dk_f, dv_f);

      // Same terms in the same order for every row, except that Dr of a row comes from the out
      // each run computed (identical formulas): agreement to rounding.
      const Tolerance tol = t == DType::F64 ? default_tolerance(t) : Tolerance{1e-5, 1e-4};
      const std::string where = std::string(dtype_name(t)) + " Sq=" + std::to_string(d.Sq) +
                                " Sk=" + std::to_string(d.Sk);
      EXPECT_TRUE(allclose(out, last_rows(out_f, d.Sq), tol)) << where;
      EXPECT_TRUE(allclose(dq, last_rows(dq_f, d.Sq), tol)) << where << " dq";
      EXPECT_TRUE(allclose(dk, dk_f, tol)) << where << " dk";
      EXPECT_TRUE(allclose(dv, dv_f, tol)) << where << " dv";
    }
}

TEST(AttentionKvLonger, EveryQuerySeesThePrefixKeys) {
  // Keys t <= o are visible to every query: changing key/value o (the last prefix key) changes
  // every output row; changing key/value o + 1 leaves query row 0 unchanged.
  const KvDims d{2, 4, 9, 2, 1, 6};
  const int64_t o = d.Sk - d.Sq;
  Tensor q = random_tensor({d.B, d.Sq, d.Hq, d.D}, DType::F64);
  Tensor k = random_tensor({d.B, d.Sk, d.Hkv, d.D}, DType::F64), v = random_tensor(k.shape(), DType::F64);
  auto run = [&](const Tensor& kk, const Tensor& vv) {
    Tensor out = Tensor::empty(q.shape(), DType::F64), lse = Tensor::empty({d.B, d.Hq, d.Sq}, DType::F64);
    ops::attention_forward(q, kk, vv, 0.5, out, lse);
    return out;
  };
  const Tensor base = run(k, v);
  for (int64_t t : {o, o + 1}) {
    Tensor k2 = k.clone(), v2 = v.clone();
    k2.slice(1, t, t + 1).copy_from(random_tensor({d.B, 1, d.Hkv, d.D}, DType::F64));
    v2.slice(1, t, t + 1).copy_from(random_tensor({d.B, 1, d.Hkv, d.D}, DType::F64));
    const Tensor changed = run(k2, v2);
    for (int64_t s = 0; s < d.Sq; ++s) {
      const bool visible = t <= s + o;
      if (visible)
        EXPECT_FALSE(allclose(changed.slice(1, s, s + 1), base.slice(1, s, s + 1), {1e-9, 0}))
            << "query " << s << " should see key " << t;
      else
        EXPECT_TRUE(allclose(changed.slice(1, s, s + 1), base.slice(1, s, s + 1), {0, 0}))
            << "query " << s << " should not see key " << t;
    }
  }
}

// f64 finite differences for q, k, v with Sk > Sq.
class AttentionKvLongerGrad : public ::testing::TestWithParam<KvDims> {};

TEST_P(AttentionKvLongerGrad, BackwardMatchesFiniteDifferences) {
  const KvDims d = GetParam();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.D));
  Tensor q = random_tensor({d.B, d.Sq, d.Hq, d.D}, DType::F64, Device::cpu(), -2, 2);
  Tensor k = random_tensor({d.B, d.Sk, d.Hkv, d.D}, DType::F64, Device::cpu(), -2, 2);
  Tensor v = random_tensor(k.shape(), DType::F64);
  const Shape lse_shape{d.B, d.Hq, d.Sq};
  GradCheckOptions opt;
  opt.max_elements = 1000;  // every element of these small inputs
  expect_gradients_match(
      {q, k, v},
      [&](const std::vector<Tensor>& in) {
        Tensor out = Tensor::empty(in[0].shape(), DType::F64), lse = Tensor::empty(lse_shape, DType::F64);
        ops::attention_forward(in[0], in[1], in[2], scale, out, lse);
        return std::vector<Tensor>{out};
      },
      [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor out = Tensor::empty(in[0].shape(), DType::F64), lse = Tensor::empty(lse_shape, DType::F64);
        ops::attention_forward(in[0], in[1], in[2], scale, out, lse);
        Tensor dq = poisoned(in[0].shape(), DType::F64), dk = poisoned(in[1].shape(), DType::F64),
               dv = poisoned(in[2].shape(), DType::F64);
        ops::attention_backward(in[0], in[1], in[2], out, lse, dout[0], scale, dq, dk, dv);
        return std::vector<Tensor>{dq, dk, dv};
      },
      opt);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionKvLongerGrad,
                         ::testing::Values(KvDims{2, 5, 13, 4, 2, 3}, KvDims{2, 3, 8, 2, 2, 3},
                                           KvDims{1, 1, 6, 3, 1, 4}),
                         [](const ::testing::TestParamInfo<KvDims>& i) {
                           return "Sq" + std::to_string(i.param.Sq) + "_Sk" + std::to_string(i.param.Sk) + "_Hq" +
                                  std::to_string(i.param.Hq) + "_Hkv" + std::to_string(i.param.Hkv);
                         });

TEST(AttentionKvLonger, RejectsKeysShorterThanQueries) {
  const auto f32 = DType::F32;
  Tensor q = Tensor::zeros({1, 6, 2, 4}, f32), k = Tensor::zeros({1, 5, 1, 4}, f32), v = k.clone();
  Tensor out = Tensor::zeros(q.shape(), f32), lse = Tensor::zeros({1, 2, 6}, f32);
  Tensor dq = Tensor::zeros(q.shape(), f32), dk = Tensor::zeros(k.shape(), f32), dv = Tensor::zeros(k.shape(), f32);
  for (bool backward : {false, true}) {
    try {
      if (backward)
        ops::attention_backward(q, k, v, out, lse, out, 0.5, dq, dk, dv);
      else
        ops::attention_forward(q, k, v, 0.5, out, lse);
      ADD_FAILURE() << "Sk = 5 < Sq = 6 did not raise";
    } catch (const Error& e) {
      const std::string op = backward ? "attention_backward" : "attention_forward";
      EXPECT_NE(std::string(e.what()).find(op + ": key/value sequence length Sk = 5 must be >= query sequence "
                                                "length Sq = 6: 'q' has shape (1, 6, 2, 4) but 'k' has shape "
                                                "(1, 5, 1, 4)"),
                std::string::npos)
          << e.what();
    }
  }
  // dk/dv must follow k's (longer) shape, not q's sequence length.
  Tensor k9 = Tensor::zeros({1, 9, 1, 4}, f32), dk_bad = Tensor::zeros({1, 6, 1, 4}, f32);
  Tensor dv9 = Tensor::zeros(k9.shape(), f32);
  try {
    ops::attention_backward(q, k9, k9, out, lse, out, 0.5, dq, dk_bad, dv9);
    ADD_FAILURE() << "dk of the query length did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'dk' has shape (1, 6, 1, 4); expected (1, 9, 1, 4)"),
              std::string::npos)
        << e.what();
  }
}

// decode_attention with a value head dim Dv != D (MLA's narrower values): the new value rows land
// in the [R, max_len, Hkv, Dv] cache at each row's position and out [R, 1, Hq, Dv] is attention
// over the keys 0..p of the row; a v_new of the wrong width is refused by name.
TEST(DecodeAttention, ValueHeadDimMayDiffer) {
  const int64_t R = 2, Hq = 4, Hkv = 2, D = 6, Dv = 4, max_len = 8;
  Tensor q = random_tensor({R, 1, Hq, D}, DType::F64), k = random_tensor({R, 1, Hkv, D}, DType::F64);
  Tensor v = random_tensor({R, 1, Hkv, Dv}, DType::F64);
  Tensor kc = random_tensor({R, max_len, Hkv, D}, DType::F64), vc = random_tensor({R, max_len, Hkv, Dv}, DType::F64);
  const std::vector<int32_t> pos{3, 7};
  const Tensor positions = Tensor::from_vector(pos, {R});
  Tensor out = Tensor::empty({R, 1, Hq, Dv}, DType::F64), lse = Tensor::empty({R, Hq, 1}, DType::F64);
  const Tensor q0 = q.clone();
  ops::decode_attention(q, k, v, kc, vc, positions, false, 10000.0, 0.4, out, lse);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t keys = pos[static_cast<size_t>(r)] + 1;
    const Tensor vrow = vc.slice(0, r, r + 1).view({max_len, Hkv, Dv}).slice(0, keys - 1, keys);
    EXPECT_EQ(to_doubles(vrow), to_doubles(v.slice(0, r, r + 1))) << "row " << r;
    Tensor o = Tensor::empty({1, 1, Hq, Dv}, DType::F64), l = Tensor::empty({1, Hq, 1}, DType::F64);
    ops::attention_forward(q0.slice(0, r, r + 1), kc.slice(0, r, r + 1).view({max_len, Hkv, D}).slice(0, 0, keys).view({1, keys, Hkv, D}),
                           vc.slice(0, r, r + 1).view({max_len, Hkv, Dv}).slice(0, 0, keys).view({1, keys, Hkv, Dv}), 0.4,
                           o, l);
    EXPECT_EQ(to_doubles(out.slice(0, r, r + 1)), to_doubles(o)) << "row " << r;
  }
  Tensor bad_v = random_tensor({R, 1, Hkv, D}, DType::F64);
  try {
    ops::decode_attention(q, k, bad_v, kc, vc, positions, false, 10000.0, 0.4, out, lse);
    FAIL() << "a v_new of width D != Dv did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decode_attention: k_new must be (2, 1, 2, 6) and v_new (2, 1, 2, 4)"),
              std::string::npos)
        << e.what();
  }
}

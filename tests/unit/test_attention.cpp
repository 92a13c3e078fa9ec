// Causal GQA attention on the CPU: values against an explicit softmax written here, f64
// gradient checks, the first-token property, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moecore/ops/attention.h"
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
  expect_error([&] { ops::attention_forward(q, Tensor::zeros({2, 6, 2, 8}, f32), v, 0.3, out, lse); },
               "sequence length S differs");
  expect_error([&] { ops::attention_forward(q, Tensor::zeros({2, 5, 2, 4}, f32), v, 0.3, out, lse); },
               "head dim D differs");
  // v unlike k, wrong ranks, outputs of the wrong shape or dtype
  expect_error([&] { ops::attention_forward(q, k, Tensor::zeros({2, 5, 2, 7}, f32), 0.3, out, lse); },
               "'k' has shape (2, 5, 2, 8) but 'v' has shape (2, 5, 2, 7)");
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

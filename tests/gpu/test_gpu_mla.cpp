// gpu tier: the value-head-dim shim of model/core_attention.h that Multi-Latent Attention uses on
// CUDA (V zero-padded to the query/key head dim where the CUDA attention refuses Dv != D) against
// the CPU attention op, which takes Dv != D itself. (The whole MLA model on a GPU:
// train.gpu_bf16_tiny_mla_halves_loss.)
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/model/core_attention.h"
#include "moecore/ops/attention.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

// Tolerances as the attention tests' (tests/gpu/test_gpu_attention.cpp): fp32 sums in other orders.
TEST(GpuMla, ValueHeadDimShimMatchesCpu) {
  MC_REQUIRE_CUDA();
  for (DType t : {DType::F32, DType::BF16}) {
    const int64_t B = 2, S = 70, H = 4, D = 32, Dv = 16;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    Tensor q = random_tensor({B, S, H, D}, t, Device::cpu(), -2, 2), k = random_tensor({B, S, H, D}, t, Device::cpu(), -2, 2);
    Tensor v = random_tensor({B, S, H, Dv}, t), dout = random_tensor({B, S, H, Dv}, t);
    Tensor out = Tensor::empty({B, S, H, Dv}, t), lse = Tensor::empty({B, H, S}, DType::F32);
    ops::attention_forward(q, k, v, scale, out, lse);
    const Tolerance lse_tol{1e-5, 1e-5};
    const std::vector<Tolerance> tol = t == DType::BF16
        ? std::vector<Tolerance>{{4e-3, 2e-2}, lse_tol, {2e-3, 2e-2}, {2e-3, 2e-2}, {2e-3, 2e-2}}
        : std::vector<Tolerance>{{5e-6, 1e-5}, lse_tol, {2e-5, 1e-4}, {2e-5, 1e-4}, {2e-5, 1e-4}};
    expect_cuda_matches_cpu({q, k, v, out, lse, dout},
                            {{out.shape(), t}, {lse.shape(), DType::F32}, {q.shape(), t}, {k.shape(), t}, {v.shape(), t}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& o) {
                              attention_forward_any_value_dim(in[0], in[1], in[2], scale, o[0], o[1]);
                              attention_backward_any_value_dim(in[0], in[1], in[2], in[3], in[4], in[5], scale, o[2],
                                                               o[3], o[4]);
                            },
                            tol);
    if (HasFailure()) FAIL() << dtype_name(t);
  }
}

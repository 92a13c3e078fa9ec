// Exhaustive check of moecore's float -> bf16 / fp8 conversions (core/float_formats.h)
// against CUDA's own intrinsics, over all 2^32 float bit patterns, on the GPU; and of the
// fp8 -> float decodes over all 256 codes.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "moecore/core/cuda_check.h"
#include "moecore/core/float_formats.h"
#include "op_harness.h"

using namespace moecore;

namespace {

struct Mismatch {
  unsigned long long count;
  unsigned first_bits;
};

// kind 0: bf16, 1: e4m3, 2: e5m2
__global__ void compare_all_floats(int kind, unsigned long long* count, unsigned* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (1ull << 32); i += stride) {
    const unsigned bits = static_cast<unsigned>(i);
    const float f = __uint_as_float(bits);
    bool ok;
    if (kind == 0) {
      const __nv_bfloat16 ref = __float2bfloat16_rn(f);
      const unsigned short rb = *reinterpret_cast<const unsigned short*>(&ref);
      const unsigned short ours = float_to_bf16_bits(f);
      // NaN: CUDA returns its canonical positive NaN, we keep the sign; both must be NaN.
      const bool both_nan = isnan(f) && ((rb & 0x7fff) > 0x7f80) && ((ours & 0x7fff) > 0x7f80);
      ok = rb == ours || both_nan;
    } else {
      const __nv_fp8_interpretation_t interp = kind == 1 ? __NV_E4M3 : __NV_E5M2;
      const unsigned char ref = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, interp);
      const unsigned char ours = kind == 1 ? float_to_e4m3_bits(f) : float_to_e5m2_bits(f);
      ok = ref == ours || (isnan(f) && (ref & 0x7f) == 0x7f && (ours & 0x7f) == 0x7f);
    }
    if (!ok) {
      if (atomicAdd(count, 1ull) == 0) *first = bits;
    }
  }
}

__global__ void decode_all_fp8(float* out_e4m3_ref, float* out_e4m3, float* out_e5m2_ref, float* out_e5m2) {
  const int i = threadIdx.x;
  __nv_fp8_e4m3 a;
  a.__x = static_cast<__nv_fp8_storage_t>(i);
  __nv_fp8_e5m2 b;
  b.__x = static_cast<__nv_fp8_storage_t>(i);
  out_e4m3_ref[i] = static_cast<float>(a);
  out_e5m2_ref[i] = static_cast<float>(b);
  out_e4m3[i] = e4m3_bits_to_float(static_cast<uint8_t>(i));
  out_e5m2[i] = e5m2_bits_to_float(static_cast<uint8_t>(i));
}

Mismatch run_compare(int kind) {
  unsigned long long* count;
  unsigned* first;
  MC_CUDA_CHECK(cudaMalloc(&count, sizeof(unsigned long long)));
  MC_CUDA_CHECK(cudaMalloc(&first, sizeof(unsigned)));
  MC_CUDA_CHECK(cudaMemset(count, 0, sizeof(unsigned long long)));
  MC_CUDA_CHECK(cudaMemset(first, 0, sizeof(unsigned)));
  compare_all_floats<<<4096, 256>>>(kind, count, first);
  MC_CUDA_CHECK_LAUNCH();
  Mismatch m{};
  MC_CUDA_CHECK(cudaMemcpy(&m.count, count, sizeof m.count, cudaMemcpyDeviceToHost));
  MC_CUDA_CHECK(cudaMemcpy(&m.first_bits, first, sizeof m.first_bits, cudaMemcpyDeviceToHost));
  cudaFree(count);
  cudaFree(first);
  return m;
}

}  // namespace

TEST(GpuDtype, Bf16RoundingMatchesCudaIntrinsicForEveryFloat) {
  MC_REQUIRE_CUDA();
  const Mismatch m = run_compare(0);
  EXPECT_EQ(m.count, 0u) << "first mismatch at float bits 0x" << std::hex << m.first_bits;
}

TEST(GpuDtype, E4m3RoundingMatchesCudaIntrinsicForEveryFloat) {
  MC_REQUIRE_CUDA();
  const Mismatch m = run_compare(1);
  EXPECT_EQ(m.count, 0u) << "first mismatch at float bits 0x" << std::hex << m.first_bits;
}

TEST(GpuDtype, E5m2RoundingMatchesCudaIntrinsicForEveryFloat) {
  MC_REQUIRE_CUDA();
  const Mismatch m = run_compare(2);
  EXPECT_EQ(m.count, 0u) << "first mismatch at float bits 0x" << std::hex << m.first_bits;
}

TEST(GpuDtype, Fp8DecodeMatchesCudaForAllCodes) {
  MC_REQUIRE_CUDA();
  float* d;
  MC_CUDA_CHECK(cudaMalloc(&d, 4 * 256 * sizeof(float)));
  decode_all_fp8<<<1, 256>>>(d, d + 256, d + 512, d + 768);
  MC_CUDA_CHECK_LAUNCH();
  std::vector<float> h(1024);
  MC_CUDA_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(d);
  for (int i = 0; i < 256; ++i) {
    for (int f = 0; f < 2; ++f) {
      const float ref = h[f * 512 + i], ours = h[f * 512 + 256 + i];
      const float host = f == 0 ? e4m3_bits_to_float(static_cast<uint8_t>(i)) : e5m2_bits_to_float(static_cast<uint8_t>(i));
      if (std::isnan(ref)) {
        EXPECT_TRUE(std::isnan(ours) && std::isnan(host)) << (f ? "e5m2" : "e4m3") << " code " << i;
      } else {
        EXPECT_EQ(ref, ours) << (f ? "e5m2" : "e4m3") << " code " << i;
        EXPECT_EQ(ref, host) << (f ? "e5m2" : "e4m3") << " code " << i << " (host decode)";
      }
    }
  }
}

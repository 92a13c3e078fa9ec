// CUDA RoPE. A first kernel fills a [2, S, D/2] f32 table of cos and sin, computed in double
// exactly as the CPU does (so the two agree to the last float bit but for rare roundings of
// device vs glibc double cos/sin); a second kernel rotates one (i, i + D/2) pair per thread,
// consecutive threads on consecutive i. The rotation uses explicitly rounded multiplies and
// adds (no fused multiply-add), the same arithmetic as the CPU reference. bf16 tensors whose
// half head dim is a multiple of 8 take a vectorised kernel (8 pairs per thread).
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/rope.h"

namespace moecore::ops::cuda {

namespace {

__global__ void rope_table_kernel(float* cos_t, float* sin_t, int64_t S, int64_t h, RopeFrequencies f,
                                  int64_t position_offset, bool inverse) {
  const int64_t n = S * h;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = k / h, i = k % h;
    const double angle = static_cast<double>(s + position_offset) * rope_inv_freq(f, i);
    double sn, cs;
    sincos(angle, &sn, &cs);
    if (f.yarn) cs *= f.attention, sn *= f.attention;  // YaRN's magnitude (plain RoPE: untouched)
    cos_t[k] = static_cast<float>(cs);
    sin_t[k] = static_cast<float>(inverse ? -sn : sn);
  }
}

template <typename T>
__global__ void rope_kernel(const T* in, T* out, const float* cos_t, const float* sin_t, int64_t pairs, int64_t S,
                            int64_t N, int64_t h) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % h, row = p / h;  // row = (b * S + s) * N + n
    const int64_t t = ((row / N) % S) * h + i;
    const float c = cos_t[t], sn = sin_t[t];
    const int64_t o = row * 2 * h + i;
    const float a = load(in[o]), b = load(in[o + h]);  // both read before either is written (in place)
    out[o] = store<T>(__fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, sn)));
    out[o + h] = store<T>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn)));
  }
}

// bf16 with D/2 a multiple of 8: each thread rotates 8 consecutive pairs of one head row, with
// 16-byte loads and stores of both halves and of the table (the scalar kernel above moves 2
// bytes per access and divides 64-bit indices for every pair). The same rounded arithmetic.
// (kVec = 8: cuda_common.cuh.)

__global__ void rope_bf16x8_kernel(const bf16* in, bf16* out, const float* cos_t, const float* sin_t,
                                   int64_t vectors, int64_t S, int64_t N, int64_t h) {
  const int64_t per_row = h / kVec;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = v / per_row, i = (v - row * per_row) * kVec;  // row = (b * S + s) * N + n
    const int64_t t = ((row / N) % S) * h + i;
    const int64_t o = row * 2 * h + i;
    float a[kVec], b[kVec], c[kVec], sn[kVec];
    load_bf16x8(in + o, a);  // both halves read before either is written
    load_bf16x8(in + o + h, b);
    const float4* cv = reinterpret_cast<const float4*>(cos_t + t);
    const float4* sv = reinterpret_cast<const float4*>(sin_t + t);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float4 cc = cv[j], ss = sv[j];
      c[4 * j] = cc.x, c[4 * j + 1] = cc.y, c[4 * j + 2] = cc.z, c[4 * j + 3] = cc.w;
      sn[4 * j] = ss.x, sn[4 * j + 1] = ss.y, sn[4 * j + 2] = ss.z, sn[4 * j + 3] = ss.w;
    }
    float ra[kVec], rb[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      ra[j] = __fadd_rn(__fmul_rn(a[j], c[j]), -__fmul_rn(b[j], sn[j]));
      rb[j] = __fadd_rn(__fmul_rn(b[j], c[j]), __fmul_rn(a[j], sn[j]));
    }
    store_bf16x8(out + o, ra);
    store_bf16x8(out + o + h, rb);
  }
}

}  // namespace

void rope(const Tensor& in, Tensor& out, const RopeFrequencies& f, int64_t position_offset, bool inverse) {
  const int64_t B = in.size(0), S = in.size(1), N = in.size(2), D = in.size(3), h = D / 2;
  const int64_t pairs = B * S * N * h;
  if (pairs == 0) return;
  cudaStream_t s = prepare(in);
  // Freed at return: the caching allocator reuses it only in this stream's order.
  Tensor table = Tensor::empty({2, S, h}, DType::F32, in.device());
  float* cos_t = table.data<float>();
  float* sin_t = cos_t + S * h;
  rope_table_kernel<<<grid_for(S * h), 256, 0, s>>>(cos_t, sin_t, S, h, f, position_offset, inverse);
  MC_CUDA_CHECK_LAUNCH();
  // The tables are a fresh allocation (256-byte aligned) of rows of h floats: with h % 8 == 0 each
  // thread's 8 cos / sin values start on a 32-byte boundary, so their float4 reads are aligned too.
  const bool aligned = aligned16(in.data_ptr()) && aligned16(out.data_ptr()) && aligned16(cos_t) && aligned16(sin_t);
  if (in.dtype() == DType::BF16 && h % kVec == 0 && aligned) {
    const int64_t vectors = pairs / kVec;
    rope_bf16x8_kernel<<<grid_for(vectors), 256, 0, s>>>(in.data<bf16>(), out.data<bf16>(), cos_t, sin_t, vectors,
                                                        S, N, h);
  } else {
    dispatch_cuda_floating(in.dtype(), "rope", [&](auto tag) {
      using T = decltype(tag);
      rope_kernel<T><<<grid_for(pairs), 256, 0, s>>>(in.data<T>(), out.data<T>(), cos_t, sin_t, pairs, S, N, h);
    });
  }
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda

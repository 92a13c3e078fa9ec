// CUDA decode attention (ops/decode_attention.h): a kernel that rotates q and the new k (RoPE at
// each row's position, angles in double and the rotation in explicitly rounded fp32, as
// rope_cuda.cu) and writes k and v into the caches; then one block per (row, query head): the
// query in shared memory, one thread per key for the scores (kept in shared memory), block
// max and sum; the weighted sum of the values split over the block's warps by key (each warp
// reads a key's value row, Dv wide, coalesced, lanes by feature), the warps' partial sums added in order.
#include <algorithm>

#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/decode_attention.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxFeaturesPerLane = 8;  // value head dims up to 256 (decode_attention.cpp falls back above)

template <typename T>
__global__ void decode_rope_write_kernel(T* q, const T* k, const T* v, T* kc, T* vc, const int32_t* pos, int64_t R,
                                         int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t max_len, double base,
                                         bool rope) {
  const int64_t values = R * Hkv * Dv;  // the value rows go to the cache as they are
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < values; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / (Hkv * Dv), rest = idx % (Hkv * Dv);
    vc[(r * max_len + pos[r]) * Hkv * Dv + rest] = v[idx];
  }
  const int64_t h = D / 2, heads = Hq + Hkv, pairs = R * heads * h;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < pairs; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / (heads * h), n = (idx / h) % heads, i = idx % h, p = pos[r];
    float c = 1.f, sn = 0.f;
    if (rope) {
      const double inv_freq = pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
      double sd, cd;
      sincos(static_cast<double>(p) * inv_freq, &sd, &cd);
      c = static_cast<float>(cd);
      sn = static_cast<float>(sd);
    }
    const T* src = n < Hq ? q + (r * Hq + n) * D : k + (r * Hkv + (n - Hq)) * D;
    T* dst = n < Hq ? q + (r * Hq + n) * D : kc + ((r * max_len + p) * Hkv + (n - Hq)) * D;
    const float a = load(src[i]), b = load(src[i + h]);
    dst[i] = rope ? store<T>(__fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, sn))) : src[i];
    dst[i + h] = rope ? store<T>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn))) : src[i + h];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(const T* q, const T* kc, const T* vc,
                                                                    const int32_t* pos, T* out, float* lse, int64_t Hq,
                                                                    int64_t Hkv, int64_t D, int64_t Dv, int64_t max_len,
                                                                    float scale) {
  extern __shared__ float smem[];
  float* qs = smem;       // D
  float* sc = smem + D;   // keys; then the warps' partial outputs (kWarps x Dv)
  const int64_t r = blockIdx.x / Hq, hq = blockIdx.x % Hq, kv = hq / (Hq / Hkv);
  const int64_t keys = static_cast<int64_t>(pos[r]) + 1, stride = Hkv * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) qs[d] = load(q[(r * Hq + hq) * D + d]);
  __syncthreads();
  const T* krow = kc + (r * max_len * Hkv + kv) * D;
  const T* vrow = vc + (r * max_len * Hkv + kv) * Dv;
  float m = -INFINITY;
  for (int64_t t = threadIdx.x; t < keys; t += blockDim.x) {
    const T* kt = krow + t * stride;
    float s = 0.f;
#pragma unroll 8
    for (int64_t d = 0; d < D; ++d) s += qs[d] * load(kt[d]);
    s *= scale;
    sc[t] = s;
    m = fmaxf(m, s);
  }
  m = block_max(m);
  float l = 0.f;
  for (int64_t t = threadIdx.x; t < keys; t += blockDim.x) {
    const float e = __expf(sc[t] - m);
    sc[t] = e;
    l += e;
  }
  l = block_sum(l);  // its barriers also order the sc writes before the reads below
  // The weighted sum of the values: warp w takes keys w, w + kWarps, ...; lane i features
  // i, i + 32, ... (each key's row read by the warp in coalesced pieces; the loads of several
  // keys in flight at once), then the kWarps partial sums are added in warp order.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float acc[kMaxFeaturesPerLane] = {};
#pragma unroll 4
  for (int64_t t = warp; t < keys; t += kWarps) {
    const float p = sc[t];
    const T* vt = vrow + t * Hkv * Dv;
#pragma unroll
    for (int j = 0; j < kMaxFeaturesPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < Dv) acc[j] += p * load(vt[d]);
    }
  }
  __syncthreads();  // every warp has read its probabilities: sc becomes the partial sums
#pragma unroll
  for (int j = 0; j < kMaxFeaturesPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < Dv) sc[warp * Dv + d] = acc[j];
  }
  __syncthreads();
  const float inv = 1.f / l;
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += sc[w * Dv + d];
    out[(r * Hq + hq) * Dv + d] = store<T>(sum * inv);
  }
  if (threadIdx.x == 0) lse[r * Hq + hq] = m + logf(l);
}

}  // namespace

void decode_attention(Tensor& q, const Tensor& k_new, const Tensor& v_new, Tensor& k_cache, Tensor& v_cache,
                      const Tensor& positions, bool rope, double rope_base, double scale, Tensor& out, Tensor& lse) {
  const int64_t R = q.size(0), Hq = q.size(2), D = q.size(3), Dv = v_cache.size(3), max_len = k_cache.size(1),
                Hkv = k_cache.size(2);
  cudaStream_t s = prepare(q);
  dispatch_cuda_floating(q.dtype(), "decode_attention", [&](auto tag) {
    using T = decltype(tag);
    const int64_t pairs = R * (Hq + Hkv) * (D / 2);
    decode_rope_write_kernel<T><<<grid_for(std::max(pairs, R * Hkv * Dv)), 256, 0, s>>>(
        q.data<T>(), k_new.data<T>(), v_new.data<T>(), k_cache.data<T>(), v_cache.data<T>(), positions.data<int32_t>(),
        R, Hq, Hkv, D, Dv, max_len, rope_base, rope);
    MC_CUDA_CHECK_LAUNCH();
    const size_t shared = static_cast<size_t>(D + std::max<int64_t>(max_len, kWarps * Dv)) * sizeof(float);
    decode_attention_kernel<T><<<static_cast<unsigned>(R * Hq), kThreads, shared, s>>>(
        q.data<T>(), k_cache.data<T>(), v_cache.data<T>(), positions.data<int32_t>(), out.data<T>(), lse.data<float>(),
        Hq, Hkv, D, Dv, max_len, static_cast<float>(scale));
    MC_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace moecore::ops::cuda

// CUDA decode attention (ops/decode_attention.h): a kernel that rotates q and the new k (RoPE at
// each row's position, angles in double and the rotation in explicitly rounded fp32, as
// rope_cuda.cu) and writes k and v into the caches; then the attention split over the keys
// (flash-decoding: one block per (row, query head, key chunk), so a single row keeps the whole
// GPU busy) and a kernel merging the chunks' partial softmax sums.
#include <algorithm>
#include <type_traits>

#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/decode_attention.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxFeaturesPerLane = 8;  // value head dims up to 256 (decode_attention.cpp falls back above)
constexpr int kMaxCombineSplits = 1024;  // chunks one (row, head) may have: the combine kernel's shared weights

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

// The packed paths (bf16, D and Dv multiples of 8): a lane holds 8 features (one 16-byte load),
// a group of `width` lanes (the power of two >= features / 8) one key, so a warp works on
// 32 / width keys at once and, unrolled, has several keys' loads in flight.
__device__ __forceinline__ int lanes_per_key(int64_t features) {
  int w = 1;
  while (w * 8 < features) w <<= 1;
  return w;
}

// sc[t] = scale * q . k_t for the chunk's n keys (k_t at krow + t * stride).
template <typename T>
__device__ void key_scores_bf16x8(const float* qs, const T* krow, int64_t stride, int64_t n, int64_t D, float scale,
                                  float* sc) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, width = lanes_per_key(D), per_warp = 32 / width;
  const int group = lane / width, f = (lane % width) * 8;
  const bool active = f < D;
  float qv[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) qv[j] = active ? qs[f + j] : 0.f;
#pragma unroll 4
  for (int64_t base = warp * per_warp; base < n; base += kWarps * per_warp) {
    const int64_t t = base + group;
    float s = 0.f;
    if (active && t < n) {
      float kv[8];
      load_bf16x8(reinterpret_cast<const bf16*>(krow + t * stride) + f, kv);
#pragma unroll
      for (int j = 0; j < 8; ++j) s = fmaf(qv[j], kv[j], s);
    }
    for (int o = width / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (t < n && lane % width == 0) sc[t] = s * scale;
  }
}

// The warp's part of sum_t p_t v_t over its keys (p_t = sc[t]); true for the lanes that then hold
// features lane * 8 .. lane * 8 + 7 of the warp's sum in acc (the first group's active lanes).
template <typename T>
__device__ bool value_sum_bf16x8(const float* sc, const T* vrow, int64_t vstride, int64_t n, int64_t Dv,
                                 float (&acc)[8]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, width = lanes_per_key(Dv), per_warp = 32 / width;
  const int group = lane / width, f = (lane % width) * 8;
  const bool active = f < Dv;
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
#pragma unroll 4
  for (int64_t base = warp * per_warp; base < n; base += kWarps * per_warp) {
    const int64_t t = base + group;
    if (active && t < n) {
      const float p = sc[t];
      float vv[8];
      load_bf16x8(reinterpret_cast<const bf16*>(vrow + t * vstride) + f, vv);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, vv[j], acc[j]);
    }
  }
  for (int o = width; o < 32; o <<= 1)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  return group == 0 && active;
}

// Split over the keys (flash-decoding): block (rh, s) of the grid [R * Hq, splits] takes the
// s-th of `splits` equal key chunks of row r's p + 1 keys (the chunk length follows p on the
// device, so the grid stays fixed inside a CUDA graph), and writes its chunk's max m_s, sum l_s
// and unnormalised value sum o_s to the workspace; decode_combine_kernel merges them.
// In a block: the query in shared memory; the scores with the warps taking turns over the keys
// (packed, when the caches are bf16 with 16-byte aligned rows: several keys per warp, 8 features
// per lane; else one key per warp, lane i features i,
// i + 32, ..., then a warp sum); the chunk's max and exp-sum over the block; the value sum split
// the same way over the keys, and the warps' partial sums added in warp order.
template <typename T>
__global__ void __launch_bounds__(kThreads) decode_attention_split_kernel(const T* q, const T* kc, const T* vc,
                                                                          const int32_t* pos, float* part, int64_t Hq,
                                                                          int64_t Hkv, int64_t D, int64_t Dv,
                                                                          int64_t max_len, float scale, bool packed) {
  extern __shared__ float smem[];
  const int64_t splits = gridDim.y, split = blockIdx.y;
  float* qs = smem;      // D
  float* sc = smem + D;  // the chunk's scores; then the warps' partial sums (kWarps x Dv)
  const int64_t r = blockIdx.x / Hq, hq = blockIdx.x % Hq, kv = hq / (Hq / Hkv);
  const int64_t keys = static_cast<int64_t>(pos[r]) + 1, chunk = (keys + splits - 1) / splits;
  const int64_t begin = split * chunk, end = begin + chunk < keys ? begin + chunk : keys;
  const int64_t n = end > begin ? end - begin : 0;
  float* out = part + (blockIdx.x * splits + split) * (Dv + 2);  // [o (Dv), m, l]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) qs[d] = load(q[(r * Hq + hq) * D + d]);
  __syncthreads();
  const int64_t stride = Hkv * D;
  const T* krow = kc + (r * max_len * Hkv + kv) * D + begin * stride;
  const T* vrow = vc + (r * max_len * Hkv + kv) * Dv + begin * Hkv * Dv;
  if (packed) {
    key_scores_bf16x8(qs, krow, stride, n, D, scale, sc);
  } else {
    for (int64_t t = warp; t < n; t += kWarps) {
      const T* kt = krow + t * stride;
      float s = 0.f;
      for (int64_t d = lane; d < D; d += 32) s += qs[d] * load(kt[d]);
      s = warp_sum(s) * scale;
      if (lane == 0) sc[t] = s;
    }
  }
  __syncthreads();
  float m = -INFINITY;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) m = fmaxf(m, sc[t]);
  m = block_max(m);  // its barriers order the score writes before the reads below
  float l = 0.f;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    const float e = __expf(sc[t] - m);
    sc[t] = e;
    l += e;
  }
  l = block_sum(l);
  if (packed) {
    float acc[8];
    const bool writer = value_sum_bf16x8(sc, vrow, Hkv * Dv, n, Dv, acc);
    __syncthreads();  // every warp has read its probabilities: sc becomes the partial sums
    if (writer) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sc[warp * Dv + lane * 8 + j] = acc[j];
    }
  } else {
    float acc[kMaxFeaturesPerLane] = {};
#pragma unroll 4
    for (int64_t t = warp; t < n; t += kWarps) {
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
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += sc[w * Dv + d];
    out[d] = sum;
  }
  if (threadIdx.x == 0) {
    out[Dv] = m;  // -inf for an empty chunk (its l and o are 0)
    out[Dv + 1] = l;
  }
}

// Merges the chunks of block rh (a row and query head): M = max m_s, L = sum l_s e^(m_s - M),
// out = sum o_s e^(m_s - M) / L, lse = M + log L. One thread per chunk finds M and the chunk's
// weight e^(m_s - M) (0 for an empty chunk); L is a block sum, the outputs' sums run in chunk order.
template <typename T>
__global__ void __launch_bounds__(kThreads) decode_combine_kernel(const float* part, int64_t splits, int64_t Dv,
                                                                  T* out, float* lse) {
  __shared__ float weight[kMaxCombineSplits];
  const float* p = part + blockIdx.x * splits * (Dv + 2);
  float m = -INFINITY;
  for (int64_t s = threadIdx.x; s < splits; s += blockDim.x) m = fmaxf(m, p[s * (Dv + 2) + Dv]);
  const float M = block_max(m);
  float l = 0.f;
  for (int64_t s = threadIdx.x; s < splits; s += blockDim.x) {
    const float ms = p[s * (Dv + 2) + Dv], ls = p[s * (Dv + 2) + Dv + 1];
    weight[s] = ls > 0.f ? __expf(ms - M) : 0.f;
    l += ls * weight[s];
  }
  const float L = block_sum(l);  // its barriers also order the weights' writes before the reads below
  const float inv = 1.f / L;
  for (int64_t d = threadIdx.x; d < Dv; d += blockDim.x) {
    float sum = 0.f;
#pragma unroll 16
    for (int64_t s = 0; s < splits; ++s) sum += p[s * (Dv + 2) + d] * weight[s];
    out[blockIdx.x * Dv + d] = store<T>(sum * inv);
  }
  if (threadIdx.x == 0) lse[blockIdx.x] = M + logf(L);
}

// Chunks per (row, query head): enough blocks to fill the GPU a few times over at any batch
// (at most kMaxSplits), and enough that a chunk's scores fit kMaxChunkKeys floats of shared memory.
constexpr int64_t kMaxSplits = 64, kTargetBlocks = 2048, kMaxChunkKeys = 4096;
static_assert(kMaxSplits <= kMaxCombineSplits);

int64_t decode_splits(int64_t heads, int64_t max_len) {
  int64_t s = std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, kTargetBlocks / std::max<int64_t>(heads, 1)));
  s = std::max<int64_t>(s, (max_len + kMaxChunkKeys - 1) / kMaxChunkKeys);
  return std::min<int64_t>(s, max_len);
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
    const int64_t splits = decode_splits(R * Hq, max_len), chunk = (max_len + splits - 1) / splits;
    MC_CHECK(splits <= kMaxCombineSplits, "decode_attention: a cache of ", max_len, " keys needs ", splits,
             " chunks per head, more than the ", kMaxCombineSplits, " the kernels take");
    Tensor part = Tensor::empty({R * Hq, splits, Dv + 2}, DType::F32, q.device());
    const size_t shared = static_cast<size_t>(D + std::max<int64_t>(chunk, kWarps * Dv)) * sizeof(float);
    // The packed loads read 16 bytes at a time: every cache row must start 16-byte aligned.
    const bool packed = std::is_same_v<T, bf16> && D % 8 == 0 && Dv % 8 == 0 && aligned16(k_cache.data<T>()) &&
                        aligned16(v_cache.data<T>());
    decode_attention_split_kernel<T><<<dim3(static_cast<unsigned>(R * Hq), static_cast<unsigned>(splits)), kThreads,
                                       shared, s>>>(q.data<T>(), k_cache.data<T>(), v_cache.data<T>(),
                                                    positions.data<int32_t>(), part.data<float>(), Hq, Hkv, D, Dv,
                                                    max_len, static_cast<float>(scale), packed);
    MC_CUDA_CHECK_LAUNCH();
    decode_combine_kernel<T><<<static_cast<unsigned>(R * Hq), kThreads, 0, s>>>(part.data<float>(), splits, Dv,
                                                                               out.data<T>(), lse.data<float>());
    MC_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace moecore::ops::cuda

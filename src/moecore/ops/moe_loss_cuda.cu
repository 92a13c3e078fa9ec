// CUDA load-balancing losses (f32). Row kernels use one warp per token row (4 rows a block);
// sums over tokens use fixed-order column kernels (a 32x8 block covers 32 experts of one
// group, 8 row-strided partial sums added in a fixed order) and ops::sum_all, so every result
// is reproducible run to run (no atomics).
// Sinkhorn: one 1024-thread block iterates on the device until convergence: no host sync.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/moe_loss.h"
#include "moecore/ops/reduce.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

unsigned row_blocks(int64_t T) {
  const int64_t b = (T + kWarps - 1) / kWarps;
  MC_CHECK(b <= 0x7fffffff, "moe_loss: too many tokens (", T, ")");
  return static_cast<unsigned>(b);
}

// Row softmax statistics (max, sum of exp) across the warp.
__device__ void row_softmax_stats(const float* l, int E, int lane, float& mx, float& z) {
  mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  z = 0.0f;
  for (int e = lane; e < E; e += 32) z += expf(l[e] - mx);
  z = warp_sum(z);
}

__global__ void aux_forward_kernel(const float* logits, float* aux, int64_t T, int E, bool softmax) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* l = logits + t * E;
  float* a = aux + t * E;
  if (softmax) {
    float mx, z;
    row_softmax_stats(l, E, lane, mx, z);
    for (int e = lane; e < E; e += 32) a[e] = expf(l[e] - mx) / z;
  } else {
    float z = 0.0f;
    for (int e = lane; e < E; e += 32) z += sigmoidf(l[e]);
    z = warp_sum(z);
    for (int e = lane; e < E; e += 32) a[e] = sigmoidf(l[e]) / (z + 1e-20f);
  }
}

__global__ void aux_backward_kernel(const float* logits, const float* daux, float* dlogits, int64_t T, int E,
                                    bool softmax) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* l = logits + t * E;
  const float* da = daux + t * E;
  float* dl = dlogits + t * E;
  if (softmax) {
    float mx, z;
    row_softmax_stats(l, E, lane, mx, z);
    float dot = 0.0f;
    for (int e = lane; e < E; e += 32) dot += da[e] * (expf(l[e] - mx) / z);
    dot = warp_sum(dot);
    for (int e = lane; e < E; e += 32) dl[e] += (expf(l[e] - mx) / z) * (da[e] - dot);
  } else {
    float z = 0.0f, q = 0.0f;
    for (int e = lane; e < E; e += 32) {
      const float s = sigmoidf(l[e]);
      z += s;
      q += da[e] * s;
    }
    z = warp_sum(z);
    q = warp_sum(q);
    const float d = z + 1e-20f;
    for (int e = lane; e < E; e += 32) {
      const float s = sigmoidf(l[e]);
      dl[e] += (da[e] / d - q / (d * d)) * s * (1.0f - s);
    }
  }
}

// grid (ceil(E/32), G), block (32, 8): counts[g, e] = #{t in g : e in indices[t, :]}.
__global__ void counts_kernel(const int32_t* indices, float* counts, int64_t tg, int k, int E) {
  __shared__ float part[8][33];
  const int e = blockIdx.x * 32 + threadIdx.x;
  const int64_t g = blockIdx.y;
  float acc = 0.0f;
  if (e < E)
    for (int64_t t = g * tg + threadIdx.y; t < (g + 1) * tg; t += 8)
      for (int i = 0; i < k; ++i) acc += indices[t * k + i] == e ? 1.0f : 0.0f;
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) s += part[y][threadIdx.x];
    counts[g * E + e] = s;
  }
}

// counts by token chunks: grid (chunks per group, G), 256 threads; each block histograms its
// tokens' selections in shared memory and adds the histogram to icounts[g, :] with integer atomics
// (exact, so the result does not depend on the order); then to_float_kernel writes the f32 counts.
constexpr int64_t kCountChunk = 512;  // tokens per block
constexpr int kCountMaxExperts = 8192;

__global__ void chunk_counts_kernel(const int32_t* indices, int32_t* icounts, int64_t tg, int k, int E) {
  extern __shared__ int hist[];
  const int64_t g = blockIdx.y, begin = g * tg + blockIdx.x * kCountChunk, end = min((g + 1) * tg, begin + kCountChunk);
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t i = begin * k + threadIdx.x; i < end * k; i += blockDim.x) {
    const int v = indices[i];
    if (v >= 0 && v < E) atomicAdd(&hist[v], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (hist[e] != 0) atomicAdd(&icounts[g * E + e], hist[e]);
}

__global__ void to_float_kernel(const int32_t* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = static_cast<float>(in[i]);
}

// grid (chunks, G), block (32, 8): partial[g, chunk, e] = sum of a_te over the chunk's tokens
// (fixed order: 8 row-strided sums, then added y = 0..7); aux_loss_chunk_terms_kernel adds the
// chunks in order and forms the terms.
constexpr int64_t kAuxChunk = 256;

__global__ void aux_partial_kernel(const float* aux, float* partial, int64_t tg, int64_t chunks, int E) {
  __shared__ float part[8][33];
  const int e = blockIdx.z * 32 + threadIdx.x;
  const int64_t g = blockIdx.y, c = blockIdx.x;
  const int64_t begin = g * tg + c * kAuxChunk, end = min((g + 1) * tg, begin + kAuxChunk);
  float acc = 0.0f;
  if (e < E)
    for (int64_t t = begin + threadIdx.y; t < end; t += 8) acc += aux[t * E + e];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) s += part[y][threadIdx.x];
    partial[(g * chunks + c) * E + e] = s;
  }
}

__global__ void aux_chunk_terms_kernel(const float* partial, const float* counts, float* prod, int64_t chunks, int E,
                                       int64_t G, float w) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < G * E; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i / E, e = i % E;
    float s = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) s += partial[(g * chunks + c) * E + e];
    prod[i] = w * s * counts[i];
  }
}

// grid (ceil(E/32), G), block (32, 8): prod[g, e] = w * (sum_{t in g} a_te) * c_ge.
__global__ void aux_loss_terms_kernel(const float* aux, const float* counts, float* prod, int64_t tg, int E, float w) {
  __shared__ float part[8][33];
  const int e = blockIdx.x * 32 + threadIdx.x;
  const int64_t g = blockIdx.y;
  float acc = 0.0f;
  if (e < E)
    for (int64_t t = g * tg + threadIdx.y; t < (g + 1) * tg; t += 8) acc += aux[t * E + e];
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) s += part[y][threadIdx.x];
    prod[g * E + e] = w * s * counts[g * E + e];
  }
}

__global__ void aux_loss_backward_kernel(const float* counts, float* daux, int64_t T, int E, int64_t tg, float w) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * E; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / E, e = i % E;
    daux[i] = w * counts[(t / tg) * E + e];
  }
}

__global__ void z_terms_kernel(const float* logits, float* terms, int64_t T, int E, float w) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  float mx, z;
  row_softmax_stats(logits + t * E, E, lane, mx, z);
  const float lse = mx + logf(z);
  if (lane == 0) terms[t] = w * lse * lse;
}

__global__ void z_backward_kernel(const float* logits, float* dlogits, int64_t T, int E, float w) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* l = logits + t * E;
  float mx, z;
  row_softmax_stats(l, E, lane, mx, z);
  const float lse = mx + logf(z);
  for (int e = lane; e < E; e += 32) dlogits[t * E + e] += w * lse * expf(l[e] - lse);
}

// One block of 1024 threads (32 warps). scratch: d0 [T], d1 [E], d1_old [E].
__global__ void sinkhorn_kernel(const float* logits, float* c, float* scratch, int64_t T, int E, float tol,
                                int max_iters) {
  __shared__ float part[32][33];
  __shared__ float shared_error;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* d0 = scratch;
  float* d1 = scratch + T;
  float* d1_old = d1 + E;
  for (int64_t i = threadIdx.x; i < T * E; i += blockDim.x) c[i] = expf(logits[i]);
  for (int e = threadIdx.x; e < E; e += blockDim.x) d1[e] = d1_old[e] = 1.0f;
  __syncthreads();
  const float inv_t = 1.0f / static_cast<float>(T), inv_e = 1.0f / static_cast<float>(E);
  float error = 1e9f;
  for (int it = 0; it < max_iters && error > tol; ++it) {  // NaN ends the loop, as in Megatron
    // d0[t] = (1/T) / (sum_e d1[e] c[t, e] + eps): a warp per row.
    for (int64_t t = warp; t < T; t += 32) {
      float s = 0.0f;
      for (int e = lane; e < E; e += 32) s += d1[e] * c[t * E + e];
      s = warp_sum(s);
      if (lane == 0) d0[t] = inv_t / (s + 1e-8f);
    }
    __syncthreads();
    // d1[e] = (1/E) / (sum_t d0[t] c[t, e] + eps): 32 columns at a time, warps stride the rows.
    float err = 0.0f;
    for (int cb = 0; cb < E; cb += 32) {
      const int e = cb + lane;
      float acc = 0.0f;
      if (e < E)
        for (int64_t t = warp; t < T; t += 32) acc += d0[t] * c[t * E + e];
      part[warp][lane] = acc;
      __syncthreads();
      if (warp == 0 && e < E) {
        float s = 0.0f;
        for (int y = 0; y < 32; ++y) s += part[y][lane];
        const float nd1 = inv_e / (s + 1e-8f);
        err += fabsf(d1_old[e] - nd1);
        d1[e] = nd1;
        d1_old[e] = nd1;
      }
      __syncthreads();
    }
    if (warp == 0) {
      err = warp_sum(err);
      if (lane == 0) shared_error = err / static_cast<float>(E);
    }
    __syncthreads();
    error = shared_error;
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < T * E; i += blockDim.x) c[i] = d1[i % E] * c[i] * d0[i / E];
}

}  // namespace

void aux_scores_forward(const Tensor& logits, RouterScore score, Tensor& aux_scores) {
  cudaStream_t s = prepare(logits);
  const int64_t T = logits.size(0);
  aux_forward_kernel<<<row_blocks(T), 32 * kWarps, 0, s>>>(logits.data<float>(), aux_scores.data<float>(), T,
                                                          static_cast<int>(logits.size(1)),
                                                          score == RouterScore::Softmax);
  MC_CUDA_CHECK_LAUNCH();
}

void aux_scores_backward(const Tensor& logits, RouterScore score, const Tensor& daux_scores, Tensor& dlogits) {
  cudaStream_t s = prepare(logits);
  const int64_t T = logits.size(0);
  aux_backward_kernel<<<row_blocks(T), 32 * kWarps, 0, s>>>(logits.data<float>(), daux_scores.data<float>(),
                                                           dlogits.data<float>(), T, static_cast<int>(logits.size(1)),
                                                           score == RouterScore::Softmax);
  MC_CUDA_CHECK_LAUNCH();
}

void counts_from_indices(const Tensor& indices, int64_t groups, Tensor& counts) {
  cudaStream_t s = prepare(indices);
  const int64_t T = indices.size(0);
  const int E = static_cast<int>(counts.size(1));
  const int64_t tg = T / groups;
  if (E <= kCountMaxExperts && tg > 0 && groups <= 65535) {
    Tensor icounts = Tensor::empty({groups, E}, DType::I32, indices.device());
    MC_CUDA_CHECK(cudaMemsetAsync(icounts.data_ptr(), 0, icounts.nbytes(), s));
    const dim3 grid(static_cast<unsigned>((tg + kCountChunk - 1) / kCountChunk), static_cast<unsigned>(groups));
    chunk_counts_kernel<<<grid, 256, sizeof(int) * static_cast<size_t>(E), s>>>(
        indices.data<int32_t>(), icounts.data<int32_t>(), tg, static_cast<int>(indices.size(1)), E);
    MC_CUDA_CHECK_LAUNCH();
    to_float_kernel<<<grid_for(groups * E), 256, 0, s>>>(icounts.data<int32_t>(), counts.data<float>(), groups * E);
    MC_CUDA_CHECK_LAUNCH();
    return;
  }
  const dim3 grid(static_cast<unsigned>((E + 31) / 32), static_cast<unsigned>(groups));
  counts_kernel<<<grid, dim3(32, 8), 0, s>>>(indices.data<int32_t>(), counts.data<float>(), tg,
                                             static_cast<int>(indices.size(1)), E);
  MC_CUDA_CHECK_LAUNCH();
}

void switch_aux_loss_forward(const Tensor& aux_scores, const Tensor& counts, int64_t topk, double coeff, Tensor& loss) {
  cudaStream_t s = prepare(aux_scores);
  const int64_t T = aux_scores.size(0), G = counts.size(0), tg = T / G;
  const int E = static_cast<int>(aux_scores.size(1));
  const double w = coeff / static_cast<double>(G) * E / (static_cast<double>(topk) * tg * tg);
  Tensor terms = Tensor::empty({G, E}, DType::F32, aux_scores.device());
  const int64_t chunks = (tg + kAuxChunk - 1) / kAuxChunk;
  if (chunks > 1 && G <= 65535 && (E + 31) / 32 <= 65535) {
    // Many token chunks in parallel, then a fixed-order sum over the chunks.
    Tensor partial = Tensor::empty({G, chunks, E}, DType::F32, aux_scores.device());
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(G), static_cast<unsigned>((E + 31) / 32));
    aux_partial_kernel<<<grid, dim3(32, 8), 0, s>>>(aux_scores.data<float>(), partial.data<float>(), tg, chunks, E);
    MC_CUDA_CHECK_LAUNCH();
    aux_chunk_terms_kernel<<<grid_for(G * E), 256, 0, s>>>(partial.data<float>(), counts.data<float>(),
                                                           terms.data<float>(), chunks, E, G, static_cast<float>(w));
  } else {
    const dim3 grid(static_cast<unsigned>((E + 31) / 32), static_cast<unsigned>(G));
    aux_loss_terms_kernel<<<grid, dim3(32, 8), 0, s>>>(aux_scores.data<float>(), counts.data<float>(),
                                                       terms.data<float>(), tg, E, static_cast<float>(w));
  }
  MC_CUDA_CHECK_LAUNCH();
  ops::sum_all(terms, loss);
}

void switch_aux_loss_backward(const Tensor& counts, int64_t topk, double coeff, double dloss, Tensor& daux_scores) {
  cudaStream_t s = prepare(daux_scores);
  const int64_t T = daux_scores.size(0), G = counts.size(0), tg = T / G;
  const int E = static_cast<int>(daux_scores.size(1));
  const double w = dloss * coeff / static_cast<double>(G) * E / (static_cast<double>(topk) * tg * tg);
  aux_loss_backward_kernel<<<grid_for(T * E), 256, 0, s>>>(counts.data<float>(), daux_scores.data<float>(), T, E, tg,
                                                           static_cast<float>(w));
  MC_CUDA_CHECK_LAUNCH();
}

void z_loss_forward(const Tensor& logits, double coeff, Tensor& loss) {
  cudaStream_t s = prepare(logits);
  const int64_t T = logits.size(0);
  Tensor terms = Tensor::empty({T}, DType::F32, logits.device());
  z_terms_kernel<<<row_blocks(T), 32 * kWarps, 0, s>>>(logits.data<float>(), terms.data<float>(), T,
                                                      static_cast<int>(logits.size(1)),
                                                      static_cast<float>(coeff / static_cast<double>(T)));
  MC_CUDA_CHECK_LAUNCH();
  ops::sum_all(terms, loss);
}

void z_loss_backward(const Tensor& logits, double coeff, double dloss, Tensor& dlogits) {
  cudaStream_t s = prepare(logits);
  const int64_t T = logits.size(0);
  z_backward_kernel<<<row_blocks(T), 32 * kWarps, 0, s>>>(logits.data<float>(), dlogits.data<float>(), T,
                                                         static_cast<int>(logits.size(1)),
                                                         static_cast<float>(dloss * coeff * 2.0 / static_cast<double>(T)));
  MC_CUDA_CHECK_LAUNCH();
}

void sinkhorn(const Tensor& logits, Tensor& out) {
  cudaStream_t s = prepare(logits);
  const int64_t T = logits.size(0), E = logits.size(1);
  MC_CHECK(E <= 0x7fffffff, "sinkhorn: too many experts (", E, ")");
  Tensor scratch = Tensor::empty({T + 2 * E}, DType::F32, logits.device());
  sinkhorn_kernel<<<1, 1024, 0, s>>>(logits.data<float>(), out.data<float>(), scratch.data<float>(), T,
                                     static_cast<int>(E), static_cast<float>(kSinkhornTol), kSinkhornMaxIters);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda

// CUDA router (f32): one warp per token row, kWarps rows per block. Each warp keeps its row's
// selection scores in shared memory and picks the top k by k passes of a warp arg-max (ties:
// lower expert id). Group-limited routing runs in the same kernel: lane j scores groups
// j, j+32, ... (sum of the group's best k/group_topk scores, best first, as the CPU does), the
// best group_topk groups are kept and the other experts' scores set to -inf.
// Shared memory per warp: sel[E] f32, gscore[G] f32, idx[k] i32, taken[E] and gtaken[G] bytes.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/router.h"

namespace moecore::ops::cuda {

namespace {

enum Mode : int { kDefault = 0, kPreSoftmax = 1, kSigmoid = 2, kSinkhorn = 3 };

struct Params {
  const float* logits;
  const float* bias;  // may be null
  const float* sel;   // sinkhorn scores, may be null
  float* probs;
  int32_t* indices;
  const float* dprobs;
  float* dlogits;
  float* aux;        // router_topk_aux_forward: aux scores [T, E], or null
  int32_t* aux_idx;  // and the top-k of each aux row [T, k]
  bool aux_softmax;
  int64_t T;
  int E, k, G, gk;
  int mode;
  float scale;
};

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// Is (v, i) better than (bv, bi)? bi < 0 means "nothing yet".
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// Warp arg-max over sc[0, n) among entries not yet taken; marks the winner taken and returns it
// (the same value in every lane).
__device__ int warp_argmax(const float* sc, unsigned char* taken, int n, int lane) {
  float bv = -INFINITY;
  int bi = -1;
  for (int e = lane; e < n; e += 32)
    if (!taken[e] && better(sc[e], e, bv, bi)) {
      bv = sc[e];
      bi = e;
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  __syncwarp();
  if (lane == 0) taken[bi] = 1;
  __syncwarp();
  return bi;
}

// Shared-memory layout of one warp, in bytes.
struct Layout {
  int sel, gscore, idx, taken, gtaken, stride;
};
__host__ __device__ inline Layout layout(int E, int G, int k) {
  Layout L;
  L.sel = 0;
  L.gscore = L.sel + 4 * E;
  L.idx = L.gscore + 4 * G;
  L.taken = L.idx + 4 * k;
  L.gtaken = L.taken + E;
  L.stride = (L.gtaken + G + 15) / 16 * 16;
  return L;
}

__global__ void topk_forward_kernel(Params p, int warps) {
  extern __shared__ unsigned char smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + w;
  if (t >= p.T) return;  // whole warps leave together
  const Layout L = layout(p.E, p.G, p.k);
  unsigned char* base = smem + static_cast<size_t>(w) * L.stride;
  float* sel = reinterpret_cast<float*>(base + L.sel);
  float* gscore = reinterpret_cast<float*>(base + L.gscore);
  int* idx = reinterpret_cast<int*>(base + L.idx);
  unsigned char* taken = base + L.taken;
  unsigned char* gtaken = base + L.gtaken;
  const int E = p.E, k = p.k;
  const float* l = p.logits + t * E;

  float mx = 0.0f, z = 1.0f;
  if (p.mode == kPreSoftmax || (p.mode == kSinkhorn && k > 1)) {
    mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    z = 0.0f;
    for (int e = lane; e < E; e += 32) z += expf(l[e] - mx);
    z = warp_sum(z);
  }
  for (int e = lane; e < E; e += 32) {
    float s;
    if (p.mode == kSinkhorn) s = p.sel[t * E + e];
    else if (p.mode == kSigmoid) s = sigmoidf(l[e]);
    else if (p.mode == kPreSoftmax) s = expf(l[e] - mx) / z;
    else s = l[e];
    sel[e] = p.bias ? s + p.bias[e] : s;
    taken[e] = 0;
  }
  __syncwarp();

  if (p.G > 0) {
    const int per = E / p.G, m = k / p.gk;
    // Lane j scores groups j, j+32, ...: m passes of a sequential arg-max inside the group.
    for (int g = lane; g < p.G; g += 32) {
      const float* sg = sel + g * per;
      unsigned char* tg = taken + g * per;
      float s = 0.0f;
      for (int i = 0; i < m; ++i) {
        int bi = -1;
        for (int e = 0; e < per; ++e)
          if (!tg[e] && (bi < 0 || sg[e] > sg[bi])) bi = e;
        tg[bi] = 1;
        s += sg[bi];
      }
      for (int e = 0; e < per; ++e) tg[e] = 0;
      gscore[g] = s;
      gtaken[g] = 0;
    }
    __syncwarp();
    for (int i = 0; i < p.gk; ++i) warp_argmax(gscore, gtaken, p.G, lane);
    for (int e = lane; e < E; e += 32)
      if (!gtaken[e / per]) sel[e] = -INFINITY;
    __syncwarp();
  }

  for (int i = 0; i < k; ++i) {
    const int b = warp_argmax(sel, taken, E, lane);
    if (lane == 0) idx[i] = b;
  }
  __syncwarp();

  // Probabilities: lane i < k writes p_i; the sums over the selection run in selection order.
  float sum = 0.0f;
  if (p.mode == kDefault) {
    const float top = l[idx[0]];
    for (int i = 0; i < k; ++i) sum += expf(l[idx[i]] - top);
  } else if (p.mode == kSigmoid) {
    for (int i = 0; i < k; ++i) sum += sigmoidf(l[idx[i]]);
  }
  for (int i = lane; i < k; i += 32) {
    const float v = l[idx[i]];
    float pr;
    if (p.mode == kDefault) pr = expf(v - l[idx[0]]) / sum;
    else if (p.mode == kSigmoid) pr = k > 1 ? sigmoidf(v) / (sum + 1e-20f) : sigmoidf(v);
    else if (p.mode == kPreSoftmax || k > 1) pr = expf(v - mx) / z;
    else pr = sigmoidf(v);  // sinkhorn, k == 1
    p.probs[t * k + i] = pr * p.scale;
    p.indices[t * k + i] = idx[i];
  }
  if (p.aux == nullptr) return;

  // Aux scores with the arithmetic (and lane order) of moe_loss_cuda.cu's aux_forward_kernel,
  // then their plain top-k with the same warp arg-max (topk_counts' selection).
  __syncwarp();  // idx is read above and rewritten below
  float* a = p.aux + t * E;
  if (p.aux_softmax) {
    float amx = -INFINITY;
    for (int e = lane; e < E; e += 32) amx = fmaxf(amx, l[e]);
    amx = warp_max(amx);
    float az = 0.0f;
    for (int e = lane; e < E; e += 32) az += expf(l[e] - amx);
    az = warp_sum(az);
    for (int e = lane; e < E; e += 32) {
      const float v = expf(l[e] - amx) / az;
      a[e] = v;
      sel[e] = v;
      taken[e] = 0;
    }
  } else {
    float az = 0.0f;
    for (int e = lane; e < E; e += 32) az += sigmoidf(l[e]);
    az = warp_sum(az);
    for (int e = lane; e < E; e += 32) {
      const float v = sigmoidf(l[e]) / (az + 1e-20f);
      a[e] = v;
      sel[e] = v;
      taken[e] = 0;
    }
  }
  __syncwarp();
  for (int i = 0; i < k; ++i) {
    const int b = warp_argmax(sel, taken, E, lane);
    if (lane == 0) idx[i] = b;
  }
  __syncwarp();
  for (int i = lane; i < k; i += 32) p.aux_idx[t * k + i] = idx[i];
}

// One warp per row; each lane writes the experts e = lane, lane + 32, ... once.
__global__ void topk_backward_kernel(Params p, int warps) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + w;
  if (t >= p.T) return;
  const int E = p.E, k = p.k;
  const float* l = p.logits + t * E;
  const int32_t* idx = p.indices + t * k;
  const float* dp = p.dprobs + t * k;
  float* dl = p.dlogits + t * E;
  const bool full_softmax = p.mode == kPreSoftmax || (p.mode == kSinkhorn && k > 1);

  if (full_softmax) {
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    float z = 0.0f;
    for (int e = lane; e < E; e += 32) z += expf(l[e] - mx);
    z = warp_sum(z);
    float dot = 0.0f;
    for (int i = 0; i < k; ++i) dot += dp[i] * p.scale * (expf(l[idx[i]] - mx) / z);
    for (int e = lane; e < E; e += 32) {
      float dy = 0.0f;
      for (int i = 0; i < k; ++i)
        if (idx[i] == e) dy = dp[i] * p.scale;
      dl[e] = (expf(l[e] - mx) / z) * (dy - dot);
    }
  } else if (p.mode == kSigmoid || p.mode == kSinkhorn) {
    float sum = 0.0f, q = 0.0f;
    for (int i = 0; i < k; ++i) {
      const float s = sigmoidf(l[idx[i]]);
      sum += s;
      q += dp[i] * p.scale * s;
    }
    const float d = sum + 1e-20f;
    for (int e = lane; e < E; e += 32) {
      float g = 0.0f;
      for (int i = 0; i < k; ++i)
        if (idx[i] == e) {
          const float s = sigmoidf(l[e]);
          const float ds = k > 1 ? dp[i] * p.scale / d - q / (d * d) : dp[i] * p.scale;
          g = ds * s * (1.0f - s);
        }
      dl[e] = g;
    }
  } else {
    float top = l[idx[0]];
    for (int i = 1; i < k; ++i) top = fmaxf(top, l[idx[i]]);
    float sum = 0.0f, dot = 0.0f;
    for (int i = 0; i < k; ++i) sum += expf(l[idx[i]] - top);
    for (int i = 0; i < k; ++i) dot += dp[i] * p.scale * (expf(l[idx[i]] - top) / sum);
    for (int e = lane; e < E; e += 32) {
      float g = 0.0f;
      for (int i = 0; i < k; ++i)
        if (idx[i] == e) g = (expf(l[e] - top) / sum) * (dp[i] * p.scale - dot);
      dl[e] = g;
    }
  }
}

Params make_params(const Tensor& logits, const RouterConfig& cfg) {
  Params p{};
  p.logits = logits.data<float>();
  p.T = logits.size(0);
  p.E = static_cast<int>(cfg.num_experts);
  p.k = static_cast<int>(cfg.topk);
  p.G = static_cast<int>(cfg.num_groups);
  p.gk = static_cast<int>(cfg.group_topk);
  p.mode = cfg.sinkhorn ? kSinkhorn
           : cfg.score == RouterScore::Sigmoid ? kSigmoid
           : cfg.pre_softmax ? kPreSoftmax
                             : kDefault;
  p.scale = cfg.scaling_factor != 0 ? static_cast<float>(cfg.scaling_factor) : 1.0f;
  return p;
}

constexpr int kWarps = 4;

}  // namespace

void router_topk_forward(const Tensor& logits, const Tensor& expert_bias, const Tensor& sel_scores,
                         const RouterConfig& cfg, Tensor& probs, Tensor& indices) {
  cudaStream_t s = prepare(logits);
  Params p = make_params(logits, cfg);
  p.bias = expert_bias.defined() ? expert_bias.data<float>() : nullptr;
  p.sel = sel_scores.defined() ? sel_scores.data<float>() : nullptr;
  p.probs = probs.data<float>();
  p.indices = indices.data<int32_t>();
  // Fewer rows per block when E is large, to stay within 48 KiB of shared memory.
  const int stride = layout(p.E, p.G, p.k).stride;
  int warps = kWarps;
  while (warps > 1 && warps * stride > 48 * 1024) warps /= 2;
  const int64_t blocks = (p.T + warps - 1) / warps;
  MC_CHECK(blocks <= 0x7fffffff, "router_topk_forward: too many tokens (", p.T, ")");
  topk_forward_kernel<<<static_cast<unsigned>(blocks), 32 * warps, static_cast<size_t>(warps) * stride, s>>>(p, warps);
  MC_CUDA_CHECK_LAUNCH();
}

void router_topk_aux_forward(const Tensor& logits, const Tensor& expert_bias, const RouterConfig& cfg, Tensor& probs,
                             Tensor& indices, Tensor& aux_scores, Tensor& aux_indices) {
  cudaStream_t s = prepare(logits);
  Params p = make_params(logits, cfg);
  p.bias = expert_bias.defined() ? expert_bias.data<float>() : nullptr;
  p.probs = probs.data<float>();
  p.indices = indices.data<int32_t>();
  p.aux = aux_scores.data<float>();
  p.aux_idx = aux_indices.data<int32_t>();
  p.aux_softmax = cfg.score == RouterScore::Softmax;
  const int stride = layout(p.E, p.G, p.k).stride;
  int warps = kWarps;
  while (warps > 1 && warps * stride > 48 * 1024) warps /= 2;
  const int64_t blocks = (p.T + warps - 1) / warps;
  MC_CHECK(blocks <= 0x7fffffff, "router_topk_aux_forward: too many tokens (", p.T, ")");
  topk_forward_kernel<<<static_cast<unsigned>(blocks), 32 * warps, static_cast<size_t>(warps) * stride, s>>>(p, warps);
  MC_CUDA_CHECK_LAUNCH();
}

void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                          Tensor& dlogits) {
  cudaStream_t s = prepare(logits);
  Params p = make_params(logits, cfg);
  p.indices = indices.data<int32_t>();
  p.dprobs = dprobs.data<float>();
  p.dlogits = dlogits.data<float>();
  const int64_t blocks = (p.T + kWarps - 1) / kWarps;
  MC_CHECK(blocks <= 0x7fffffff, "router_topk_backward: too many tokens (", p.T, ")");
  topk_backward_kernel<<<static_cast<unsigned>(blocks), 32 * kWarps, 0, s>>>(p, kWarps);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda

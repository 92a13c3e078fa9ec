// CUDA AdamW: grid-stride elementwise kernels, 8 elements per iteration where the pointers allow
// (f32 params or split masters; moments f32 or bf16); the per-step coefficients (bias corrections
// included) come from the host, or from device memory (AdamWDeviceStep: the step decided on the
// device, its skip flag included); the per-element update is adamw.h's adamw_update. One tiny
// kernel makes that decision (decide_adamw_step).
#include "moecore/ops/adamw.h"
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/master_split.h"

namespace moecore::ops::cuda {

namespace {

// M and V: float or bf16 (the moments' storage; the update runs in f32 either way).
// w (may be null): the updated param rounded to bf16 (the compute weight), written in the same pass.
// packed: every pointer is aligned to its Pack (cuda_common.cuh): kVec elements per iteration.
template <typename M, typename V>
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g, M* __restrict__ m,
                             V* __restrict__ v, bf16* __restrict__ w, int64_t n, bool packed, AdamWCoefficients<float> k,
                             const AdamWDeviceStep* __restrict__ device_step, int decay) {
  if (device_step) {
    if (device_step->skip) return;
    k = device_step->k32[decay];
  }
  const int64_t packs = packed ? n / kVec : 0;
  MC_GRID_STRIDE(i, packs) {
    VecPack<float> pp = reinterpret_cast<const VecPack<float>*>(p)[i];
    const VecPack<float> gp = reinterpret_cast<const VecPack<float>*>(g)[i];
    VecPack<M> mp = reinterpret_cast<const VecPack<M>*>(m)[i];
    VecPack<V> vp = reinterpret_cast<const VecPack<V>*>(v)[i];
    VecPack<bf16> wp;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float mi = static_cast<float>(mp.v[j]), vi = static_cast<float>(vp.v[j]);
      adamw_update<float>(pp.v[j], gp.v[j], mi, vi, k);
      mp.v[j] = M(mi);
      vp.v[j] = V(vi);
      wp.v[j] = bf16(pp.v[j]);
    }
    reinterpret_cast<VecPack<float>*>(p)[i] = pp;
    reinterpret_cast<VecPack<M>*>(m)[i] = mp;
    reinterpret_cast<VecPack<V>*>(v)[i] = vp;
    if (w) reinterpret_cast<VecPack<bf16>*>(w)[i] = wp;
  }
  MC_GRID_STRIDE(t, n - packs * kVec) {
    const int64_t i = packs * kVec + t;
    float pi = p[i], mi = static_cast<float>(m[i]), vi = static_cast<float>(v[i]);
    adamw_update<float>(pi, g[i], mi, vi, k);
    p[i] = pi;
    m[i] = M(mi);
    v[i] = V(vi);
    if (w) w[i] = bf16(pi);
  }
}

template <typename M, typename V>
void launch(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWCoefficients<float>& k,
            bf16* w, int64_t n, cudaStream_t s, const AdamWDeviceStep* device_step, int decay) {
  const bool packed = packable({{param.data_ptr(), 4}, {grad.data_ptr(), 4}, {exp_avg.data_ptr(), sizeof(M)},
                                {exp_avg_sq.data_ptr(), sizeof(V)}, {w, 2}});
  adamw_kernel<M, V><<<grid_for(packed ? (n + kVec - 1) / kVec : n), 256, 0, s>>>(
      param.data<float>(), grad.data<float>(), exp_avg.data<M>(), exp_avg_sq.data<V>(), w, n, packed, k, device_step, decay);
}

// The master as (high, remainder) halves (master_split.h): joined, updated, split back.
template <typename M, typename V>
__global__ void adamw_split_kernel(uint16_t* __restrict__ h, int16_t* __restrict__ r, const float* __restrict__ g,
                                   M* __restrict__ m, V* __restrict__ v, int64_t n, bool packed,
                                   AdamWCoefficients<float> k, const AdamWDeviceStep* __restrict__ device_step,
                                   int decay) {
  if (device_step) {
    if (device_step->skip) return;
    k = device_step->k32[decay];
  }
  const int64_t packs = packed ? n / kVec : 0;
  MC_GRID_STRIDE(i, packs) {
    VecPack<uint16_t> hp = reinterpret_cast<const VecPack<uint16_t>*>(h)[i];
    VecPack<int16_t> rp = reinterpret_cast<const VecPack<int16_t>*>(r)[i];
    const VecPack<float> gp = reinterpret_cast<const VecPack<float>*>(g)[i];
    VecPack<M> mp = reinterpret_cast<const VecPack<M>*>(m)[i];
    VecPack<V> vp = reinterpret_cast<const VecPack<V>*>(v)[i];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float pi = join_master_value(hp.v[j], rp.v[j]), mi = static_cast<float>(mp.v[j]), vi = static_cast<float>(vp.v[j]);
      adamw_update<float>(pi, gp.v[j], mi, vi, k);
      split_master_value(pi, hp.v[j], rp.v[j]);
      mp.v[j] = M(mi);
      vp.v[j] = V(vi);
    }
    reinterpret_cast<VecPack<uint16_t>*>(h)[i] = hp;
    reinterpret_cast<VecPack<int16_t>*>(r)[i] = rp;
    reinterpret_cast<VecPack<M>*>(m)[i] = mp;
    reinterpret_cast<VecPack<V>*>(v)[i] = vp;
  }
  MC_GRID_STRIDE(t, n - packs * kVec) {
    const int64_t i = packs * kVec + t;
    float pi = join_master_value(h[i], r[i]), mi = static_cast<float>(m[i]), vi = static_cast<float>(v[i]);
    adamw_update<float>(pi, g[i], mi, vi, k);
    split_master_value(pi, h[i], r[i]);
    m[i] = M(mi);
    v[i] = V(vi);
  }
}

template <typename M, typename V>
void launch_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWCoefficients<float>& k, int64_t n, cudaStream_t s, const AdamWDeviceStep* device_step,
                  int decay) {
  const bool packed = packable({{high.data_ptr(), 2}, {remainder.data_ptr(), 2}, {grad.data_ptr(), 4},
                                {exp_avg.data_ptr(), sizeof(M)}, {exp_avg_sq.data_ptr(), sizeof(V)}});
  adamw_split_kernel<M, V><<<grid_for(packed ? (n + kVec - 1) / kVec : n), 256, 0, s>>>(
      reinterpret_cast<uint16_t*>(high.data<bf16>()), remainder.data<int16_t>(), grad.data<float>(), exp_avg.data<M>(),
      exp_avg_sq.data<V>(), n, packed, k, device_step, decay);
}

}  // namespace

void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const AdamWCoefficients<float>& k, const AdamWDeviceStep* device_step, int decay) {
  const int64_t n = high.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(high);
  const bool m16 = exp_avg.dtype() == DType::BF16, v16 = exp_avg_sq.dtype() == DType::BF16;
  if (m16 && v16) launch_split<bf16, bf16>(high, remainder, grad, exp_avg, exp_avg_sq, k, n, s, device_step, decay);
  else if (m16) launch_split<bf16, float>(high, remainder, grad, exp_avg, exp_avg_sq, k, n, s, device_step, decay);
  else if (v16) launch_split<float, bf16>(high, remainder, grad, exp_avg, exp_avg_sq, k, n, s, device_step, decay);
  else launch_split<float, float>(high, remainder, grad, exp_avg, exp_avg_sq, k, n, s, device_step, decay);
  MC_CUDA_CHECK_LAUNCH();
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<float>& k, Tensor* compute_weight, const AdamWDeviceStep* device_step,
                int decay) {
  const int64_t n = param.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(param);
  const bool m16 = exp_avg.dtype() == DType::BF16, v16 = exp_avg_sq.dtype() == DType::BF16;
  bf16* w = compute_weight ? compute_weight->data<bf16>() : nullptr;
  if (m16 && v16) launch<bf16, bf16>(param, grad, exp_avg, exp_avg_sq, k, w, n, s, device_step, decay);
  else if (m16) launch<bf16, float>(param, grad, exp_avg, exp_avg_sq, k, w, n, s, device_step, decay);
  else if (v16) launch<float, bf16>(param, grad, exp_avg, exp_avg_sq, k, w, n, s, device_step, decay);
  else launch<float, float>(param, grad, exp_avg, exp_avg_sq, k, w, n, s, device_step, decay);
  MC_CUDA_CHECK_LAUNCH();
}

namespace {
// One thread: the step's decision (adamw.h: adamw_detail::decide).
template <typename G, typename L>
__global__ void decide_kernel(const G* __restrict__ parts, int64_t num_parts, const L* __restrict__ loss,
                              const double* __restrict__ candidates, int64_t rows, AdamWCoefficients<double> base,
                              double clip_grad, double* skips, AdamWDeviceStep* step, double* report) {
  double grad_sq = 0.0;
  for (int64_t i = 0; i < num_parts; ++i) grad_sq = __dadd_rn(grad_sq, static_cast<double>(parts[i]));
  adamw_detail::decide(grad_sq, loss != nullptr, loss ? static_cast<double>(loss[0]) : 0.0, candidates, rows, base,
                       clip_grad, skips, step, report);
}

template <typename G, typename L>
void launch_decide(const Tensor& parts, const Tensor& loss, const Tensor& candidates,
                   const AdamWCoefficients<double>& base, double clip_grad, Tensor& skips, Tensor& step, Tensor& report,
                   cudaStream_t s) {
  decide_kernel<G, L><<<1, 1, 0, s>>>(parts.data<G>(), parts.numel(), loss.defined() ? loss.data<L>() : nullptr,
                                      candidates.data<double>(), candidates.size(0), base, clip_grad,
                                      skips.data<double>(), reinterpret_cast<AdamWDeviceStep*>(step.data<double>()),
                                      report.data<double>());
}
}  // namespace

void decide_adamw_step(const Tensor& grad_sq_parts, const Tensor& loss, const Tensor& candidates,
                       const AdamWCoefficients<double>& base, double clip_grad, Tensor& skips, Tensor& step,
                       Tensor& report) {
  cudaStream_t s = prepare(grad_sq_parts);
  const bool g64 = grad_sq_parts.dtype() == DType::F64, l64 = loss.defined() && loss.dtype() == DType::F64;
  if (g64 && l64) launch_decide<double, double>(grad_sq_parts, loss, candidates, base, clip_grad, skips, step, report, s);
  else if (g64) launch_decide<double, float>(grad_sq_parts, loss, candidates, base, clip_grad, skips, step, report, s);
  else if (l64) launch_decide<float, double>(grad_sq_parts, loss, candidates, base, clip_grad, skips, step, report, s);
  else launch_decide<float, float>(grad_sq_parts, loss, candidates, base, clip_grad, skips, step, report, s);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda

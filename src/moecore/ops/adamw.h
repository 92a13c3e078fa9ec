// AdamW optimizer step (PyTorch's torch.optim.AdamW: decoupled weight decay), in place on
// fp32 master weights.
//   g = grad * grad_scale
//   p = p * (1 - lr * weight_decay)                 (PyTorch: param.mul_(1 - lr * wd))
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step
// (= p - lr * (m / bc1) / (sqrt(v / bc2) + eps), in PyTorch's order of operations).
// param, grad, exp_avg (m), exp_avg_sq (v): one shape, contiguous, all f32 (all f64 allowed
// on the CPU); with f32 param and grad, m and/or v may be bf16 (the precision-aware optimizer,
// --exp-avg-dtype / --exp-avg-sq-dtype bf16): they are read into f32, updated by the same
// function and rounded to bf16 (nearest even) when stored. step is 1-based. The scalar coefficients (1 - lr*wd, 1 - beta, lr / bc1,
// sqrt(bc2)) are computed once on the host in double and rounded to the compute type, and
// both backends apply the same per-element function (adamw_update, MC_HD).
// Bad configs raise an Error: lr, eps or weight_decay negative (or NaN), beta1 or beta2
// outside [0, 1), step < 1.
#pragma once

#include <cmath>
#include <math.h>
#include <cstdint>
#include <type_traits>

#include "moecore/core/host_device.h"
#include "moecore/core/tensor.h"

namespace moecore::ops {

struct AdamWConfig {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based
};

// compute_weight (optional, f32 param only): a bf16 tensor of param's shape that receives the
// updated param rounded to bf16 in the same pass (bit-identical to ops::cast afterwards; saves
// re-reading the fp32 masters to refresh the compute weights).
// parallel false (CPU tensors): the update runs on the calling thread only (ops/adamw_host.h).
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWConfig& config,
                float grad_scale = 1.0f, Tensor* compute_weight = nullptr, bool parallel = true);

// AdamW on a master kept as a bf16 high half and an int16 remainder (master_split.h): each
// element is joined into its f32 master, updated as adamw_step updates an f32 param
// (adamw_update<float>) and split back, so `high` is also the fresh bf16 compute weight. grad f32; the moments f32 or bf16; all one shape, contiguous, one device.
void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const AdamWConfig& config, float grad_scale = 1.0f);

// Per-step coefficients in the compute type C (float or double).
template <typename C>
struct AdamWCoefficients {
  C decay;             // 1 - lr * weight_decay
  C beta1, one_minus_beta1;
  C beta2, one_minus_beta2;
  C step_size;         // lr / (1 - beta1^step)
  C bc2_sqrt;          // sqrt(1 - beta2^step)
  C eps;
  C grad_scale;
};

// ---- Decided on the device (a training step without host waits) ----
// The step's AdamW scalars in the parameters' memory (an f64 tensor of kAdamWDeviceStepWords
// elements, make_adamw_device_step, or such a slice of a larger one), written by decide_adamw_step and read by the adamw_step /
// adamw_step_split overloads that take them: skip != 0 (a NaN or Inf in the loss or the gradients)
// leaves every parameter, moment and compute weight as it is; else the coefficients of parameters
// without ([0]) and with ([1]) weight decay, grad_scale = the clip coefficient.
struct AdamWDeviceStep {
  AdamWCoefficients<double> k64[2];
  AdamWCoefficients<float> k32[2];
  int32_t skip;
};
constexpr int64_t kAdamWDeviceStepWords = (sizeof(AdamWDeviceStep) + 7) / 8;
Tensor make_adamw_device_step(Device device);

// What the host fixes for the run: the betas, eps and --clip-grad (<= 0: no clipping).
struct AdamWDecision {
  double beta1, beta2, eps, clip_grad;
};

// The learning rate and the step count depend on how many earlier steps were skipped, which the
// device knows first: row c of `candidates` (f64 [C, 4], written by the host: adamw_candidate)
// holds the step's coefficients in double, {1 - lr * 0, 1 - lr * weight_decay, lr / bc1,
// sqrt(bc2)}, for the case that c of the steps since the host last reset the skip counter were
// skipped. decide_adamw_step, on the device (one tiny kernel; CPU tensors: on the host):
//   grad_sq   = the f32 or f64 parts of `grad_sq_parts` widened to double and summed in order
//   skip      = loss (a [1] f32 / f64, or undefined: none on this rank) or grad_sq not finite
//   grad_norm = sqrt(grad_sq); clip = clip_grad > 0 && grad_norm > clip_grad ? clip_grad / (grad_norm + 1e-6) : 1
//   skipped: skips[0] += 1 (f64 [1]: the counter the host reads and resets); else `step` gets the
//   coefficients of row c = skips[0], each rounded to float for k32, grad_scale = (float)clip.
//   report (f64 [3]) = {loss or 0, grad_sq, skip}.
// Bitwise the host's decision and adamw_coefficients on the same inputs.
void decide_adamw_step(const Tensor& grad_sq_parts, const Tensor& loss, const Tensor& candidates,
                       const AdamWDecision& d, Tensor& skips, Tensor& step, Tensor& report);
// One row of `candidates` (above) for a step of learning rate lr and 1-based count step.
void adamw_candidate(double lr, int64_t step, const AdamWDecision& d, double weight_decay, double* row);

// AdamW with the coefficients and skip flag of `device_step` (above); weight_decay picks [1].
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& device_step,
                bool weight_decay, Tensor* compute_weight = nullptr, bool parallel = true);
void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const Tensor& device_step, bool weight_decay);

template <typename C>
AdamWCoefficients<C> adamw_coefficients(const AdamWConfig& c, float grad_scale) {
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(c.step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(c.step));
  return {static_cast<C>(1.0 - c.lr * c.weight_decay), static_cast<C>(c.beta1), static_cast<C>(1.0 - c.beta1),
          static_cast<C>(c.beta2), static_cast<C>(1.0 - c.beta2), static_cast<C>(c.lr / bc1),
          static_cast<C>(std::sqrt(bc2)), static_cast<C>(c.eps), static_cast<C>(grad_scale)};
}

// Each product, sum and quotient of the update rounded on its own on both backends: nvcc would
// otherwise fuse a * b + c into one FMA on the GPU, which the CPU build (no FMA target) never
// does, so a host AdamW (--optimizer-cpu-offload) gives the device's bits exactly.
namespace adamw_detail {
template <typename C>
MC_HD C mul(C a, C b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) return __fmul_rn(a, b); else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
template <typename C>
MC_HD C add(C a, C b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) return __fadd_rn(a, b); else return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
template <typename C>
MC_HD C sub(C a, C b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) return __fsub_rn(a, b); else return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
template <typename C>
MC_HD C div(C a, C b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) return __fdiv_rn(a, b); else return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
template <typename C>
MC_HD C sqrt_rn(C a) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<C, float>) return __fsqrt_rn(a); else return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
MC_HD bool finite(double x) { return x - x == 0.0; }  // false for NaN and +-Inf (std::isfinite)

// decide_adamw_step on raw values (both backends): base holds the run's constants (betas, eps).
MC_HD void decide(double grad_sq, bool has_loss, double loss, const double* candidates, int64_t rows,
                  AdamWCoefficients<double> base, double clip_grad, double* skips, AdamWDeviceStep* step,
                  double* report) {
  const bool skip = (has_loss && !finite(loss)) || !finite(grad_sq);
  report[0] = has_loss ? loss : 0.0;
  report[1] = grad_sq;
  report[2] = skip ? 1.0 : 0.0;
  step->skip = skip ? 1 : 0;
  if (skip) {
    skips[0] = add(skips[0], 1.0);
    return;
  }
  const double grad_norm = sqrt_rn(grad_sq);
  const double clip = clip_grad > 0 && grad_norm > clip_grad ? div(clip_grad, add(grad_norm, 1e-6)) : 1.0;
  int64_t c = static_cast<int64_t>(skips[0]);
  if (c >= rows) c = rows - 1;  // cannot happen: the host writes a row for every count
  const double* row = candidates + 4 * c;
  for (int w = 0; w < 2; ++w) {
    AdamWCoefficients<double> k = base;
    k.decay = row[w];
    k.step_size = row[2];
    k.bc2_sqrt = row[3];
    k.grad_scale = static_cast<double>(static_cast<float>(clip));
    step->k64[w] = k;
    step->k32[w] = {static_cast<float>(k.decay), static_cast<float>(k.beta1), static_cast<float>(k.one_minus_beta1),
                    static_cast<float>(k.beta2), static_cast<float>(k.one_minus_beta2),
                    static_cast<float>(k.step_size), static_cast<float>(k.bc2_sqrt), static_cast<float>(k.eps),
                    static_cast<float>(clip)};
  }
}
}  // namespace adamw_detail

// One element's update, shared by the CPU and CUDA backends:
//   g = grad * grad_scale;  p = p * decay;  m = beta1 * m + (1 - beta1) * g;
//   v = beta2 * v + (1 - beta2) * (g * g);  p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps).
template <typename C>
MC_HD void adamw_update(C& p, C grad, C& m, C& v, const AdamWCoefficients<C>& k) {
  using namespace adamw_detail;
  const C g = mul(grad, k.grad_scale);
  p = mul(p, k.decay);
  m = add(mul(k.beta1, m), mul(k.one_minus_beta1, g));
  v = add(mul(k.beta2, v), mul(k.one_minus_beta2, mul(g, g)));
  C root;  // sqrtf for float: the same correctly rounded square root on the CPU and the GPU
  if constexpr (std::is_same_v<C, float>) {
    root = sqrtf(v);
  } else {
    root = sqrt(v);
  }
  p = sub(p, div(mul(k.step_size, m), add(div(root, k.bc2_sqrt), k.eps)));
}

namespace cpu {
// parallel false: on the calling thread only (the host optimizer's threads each run a chunk).
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<double>& k64, const AdamWCoefficients<float>& k32, Tensor* compute_weight,
                bool parallel = true);
void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const AdamWCoefficients<float>& k);
}  // namespace cpu
namespace cuda {
// device_step (may be null): the coefficients [weight_decay] and the skip flag from device memory
// (AdamWDeviceStep) instead of k.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<float>& k, Tensor* compute_weight,
                const AdamWDeviceStep* device_step = nullptr, int weight_decay = 0);
void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const AdamWCoefficients<float>& k, const AdamWDeviceStep* device_step = nullptr,
                      int weight_decay = 0);
void decide_adamw_step(const Tensor& grad_sq_parts, const Tensor& loss, const Tensor& candidates,
                       const AdamWCoefficients<double>& base, double clip_grad, Tensor& skips, Tensor& step,
                       Tensor& report);
}  // namespace cuda

}  // namespace moecore::ops

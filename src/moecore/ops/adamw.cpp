#include "moecore/ops/adamw.h"

#include <tuple>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

// bf16_ok: the moments may also be bf16 when param is f32.
void check_state(const char* op, const char* name, const Tensor& t, const Tensor& param, bool bf16_ok = false) {
  check_contiguous(op, name, t);
  check_same_device(op, param, t);
  check_same_shape(op, "param", param, name, t);
  const bool ok = t.dtype() == param.dtype() || (bf16_ok && t.dtype() == DType::BF16 && param.dtype() == DType::F32);
  MC_CHECK(ok, op, ": '", name, "' has dtype ", dtype_name(t.dtype()), "; expected param's dtype ",
           dtype_name(param.dtype()), bf16_ok && param.dtype() == DType::F32 ? " or bf16" : "");
}

// The comparisons are written so that NaN fails them too.
void check_config(const char* op, const AdamWConfig& c) {
  MC_CHECK(c.lr >= 0, op, ": lr = ", c.lr, "; expected lr >= 0");
  MC_CHECK(c.eps >= 0, op, ": eps = ", c.eps, "; expected eps >= 0");
  MC_CHECK(c.weight_decay >= 0, op, ": weight_decay = ", c.weight_decay, "; expected weight_decay >= 0");
  MC_CHECK(c.beta1 >= 0 && c.beta1 < 1, op, ": beta1 = ", c.beta1, "; expected 0 <= beta1 < 1");
  MC_CHECK(c.beta2 >= 0 && c.beta2 < 1, op, ": beta2 = ", c.beta2, "; expected 0 <= beta2 < 1");
  MC_CHECK(c.step >= 1, op, ": step = ", c.step, "; expected step >= 1 (steps count from 1)");
}

// The tensors of adamw_step (plain) and adamw_step_split, checked.
void check_plain(const char* op, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const Tensor* compute_weight) {
  check_contiguous(op, "param", param);
  check_dtype(op, "param", param, {DType::F32, DType::F64});
  MC_CHECK(!(param.device().is_cuda() && param.dtype() == DType::F64), op, ": f64 is CPU-only");
  check_state(op, "grad", grad, param);
  check_state(op, "exp_avg", exp_avg, param, true);
  check_state(op, "exp_avg_sq", exp_avg_sq, param, true);
  if (compute_weight) {
    check_contiguous(op, "compute_weight", *compute_weight);
    check_same_device(op, param, *compute_weight);
    check_same_shape(op, "param", param, "compute_weight", *compute_weight);
    MC_CHECK(compute_weight->dtype() == DType::BF16 && param.dtype() == DType::F32, op, ": 'compute_weight' is ",
             dtype_name(compute_weight->dtype()), " with param ", dtype_name(param.dtype()),
             "; expected bf16 with an f32 param");
  }
}

void check_split(const char* op, const Tensor& high, const Tensor& remainder, const Tensor& grad,
                 const Tensor& exp_avg, const Tensor& exp_avg_sq) {
  check_contiguous(op, "high", high);
  check_dtype(op, "high", high, {DType::BF16});
  check_contiguous(op, "remainder", remainder);
  check_dtype(op, "remainder", remainder, {DType::I16});
  check_same_device(op, high, remainder);
  check_same_shape(op, "high", high, "remainder", remainder);
  // The halves stand for an f32 master: f32 gradients, f32 or bf16 moments.
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"grad", &grad}, {"exp_avg", &exp_avg},
                                {"exp_avg_sq", &exp_avg_sq}}) {
    check_contiguous(op, name, *t);
    check_same_device(op, high, *t);
    check_same_shape(op, "high", high, name, *t);
    const bool ok = t->dtype() == DType::F32 || (t != &grad && t->dtype() == DType::BF16);
    MC_CHECK(ok, op, ": '", name, "' has dtype ", dtype_name(t->dtype()), "; expected f32",
             t != &grad ? " or bf16" : "");
  }
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWConfig& config,
                float grad_scale, Tensor* compute_weight, bool parallel) {
  constexpr const char* op = "adamw_step";
  check_plain(op, param, grad, exp_avg, exp_avg_sq, compute_weight);
  check_config(op, config);
  const AdamWCoefficients<float> k32 = adamw_coefficients<float>(config, grad_scale);
  if (param.device().is_cpu()) {
    cpu::adamw_step(param, grad, exp_avg, exp_avg_sq, adamw_coefficients<double>(config, grad_scale), k32,
                    compute_weight, parallel);
  } else {
    MC_CUDA_BACKEND(op, cuda::adamw_step(param, grad, exp_avg, exp_avg_sq, k32, compute_weight));
  }
}

void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const AdamWConfig& config, float grad_scale) {
  constexpr const char* op = "adamw_step_split";
  check_split(op, high, remainder, grad, exp_avg, exp_avg_sq);
  check_config(op, config);
  const AdamWCoefficients<float> k = adamw_coefficients<float>(config, grad_scale);
  if (high.device().is_cpu()) {
    cpu::adamw_step_split(high, remainder, grad, exp_avg, exp_avg_sq, k);
  } else {
    MC_CUDA_BACKEND(op, cuda::adamw_step_split(high, remainder, grad, exp_avg, exp_avg_sq, k));
  }
}

Tensor make_adamw_device_step(Device device) {
  return Tensor::zeros({kAdamWDeviceStepWords}, DType::F64, device);
}

void adamw_candidate(double lr, int64_t step, const AdamWDecision& d, double weight_decay, double* row) {
  const AdamWConfig without{lr, d.beta1, d.beta2, d.eps, 0.0, step}, with{lr, d.beta1, d.beta2, d.eps, weight_decay, step};
  check_config("adamw_candidate", with);
  const AdamWCoefficients<double> k0 = adamw_coefficients<double>(without, 1.0f);
  const AdamWCoefficients<double> k1 = adamw_coefficients<double>(with, 1.0f);
  row[0] = k0.decay;
  row[1] = k1.decay;
  row[2] = k1.step_size;
  row[3] = k1.bc2_sqrt;
}

namespace {
void check_device_step(const char* op, const Tensor& step, const Tensor& like) {
  check_contiguous(op, "device_step", step);
  check_same_device(op, like, step);
  MC_CHECK(step.dtype() == DType::F64 && step.numel() == kAdamWDeviceStepWords, op, ": 'device_step' is ",
           dtype_name(step.dtype()), " [", step.numel(), "]; expected f64 [", kAdamWDeviceStepWords,
           "] (make_adamw_device_step)");
}

double read_double(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data<double>()[i] : static_cast<double>(t.data<float>()[i]);
}
}  // namespace

void decide_adamw_step(const Tensor& grad_sq_parts, const Tensor& loss, const Tensor& candidates,
                       const AdamWDecision& d, Tensor& skips, Tensor& step, Tensor& report) {
  constexpr const char* op = "decide_adamw_step";
  check_contiguous(op, "grad_sq_parts", grad_sq_parts);
  check_dtype(op, "grad_sq_parts", grad_sq_parts, {DType::F32, DType::F64});
  MC_CHECK(grad_sq_parts.numel() >= 1, op, ": 'grad_sq_parts' is empty; expected at least one part");
  if (loss.defined()) {
    check_same_device(op, grad_sq_parts, loss);
    check_dtype(op, "loss", loss, {DType::F32, DType::F64});
    MC_CHECK(loss.numel() == 1, op, ": 'loss' has ", loss.numel(), " elements; expected 1");
  }
  for (const auto& [name, t, n] : {std::tuple<const char*, const Tensor*, int64_t>{"skips", &skips, 1},
                                   {"report", &report, 3}}) {
    check_contiguous(op, name, *t);
    check_same_device(op, grad_sq_parts, *t);
    check_dtype(op, name, *t, {DType::F64});
    MC_CHECK(t->numel() == n, op, ": '", name, "' has ", t->numel(), " elements; expected ", n);
  }
  check_contiguous(op, "candidates", candidates);
  check_same_device(op, grad_sq_parts, candidates);
  check_dtype(op, "candidates", candidates, {DType::F64});
  MC_CHECK(candidates.ndim() == 2 && candidates.size(1) == 4 && candidates.size(0) >= 1, op,
           ": 'candidates' must be f64 [C >= 1, 4]");
  check_device_step(op, step, grad_sq_parts);
  const AdamWConfig constants{0.0, d.beta1, d.beta2, d.eps, 0.0, 1};
  check_config(op, constants);
  const AdamWCoefficients<double> base = adamw_coefficients<double>(constants, 1.0f);
  if (grad_sq_parts.device().is_cpu()) {
    double grad_sq = 0.0;
    for (int64_t i = 0; i < grad_sq_parts.numel(); ++i) grad_sq = grad_sq + read_double(grad_sq_parts, i);
    adamw_detail::decide(grad_sq, loss.defined(), loss.defined() ? read_double(loss, 0) : 0.0,
                         candidates.data<double>(), candidates.size(0), base, d.clip_grad, skips.data<double>(),
                         reinterpret_cast<AdamWDeviceStep*>(step.data<double>()), report.data<double>());
  } else {
    MC_CUDA_BACKEND(op, cuda::decide_adamw_step(grad_sq_parts, loss, candidates, base, d.clip_grad, skips, step, report));
  }
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& device_step,
                bool weight_decay, Tensor* compute_weight, bool parallel) {
  constexpr const char* op = "adamw_step";
  check_plain(op, param, grad, exp_avg, exp_avg_sq, compute_weight);
  check_device_step(op, device_step, param);
  const int w = weight_decay ? 1 : 0;
  if (param.device().is_cpu()) {
    const AdamWDeviceStep& s = *reinterpret_cast<const AdamWDeviceStep*>(device_step.data<double>());
    if (!s.skip) cpu::adamw_step(param, grad, exp_avg, exp_avg_sq, s.k64[w], s.k32[w], compute_weight, parallel);
  } else {
    MC_CUDA_BACKEND(op, cuda::adamw_step(param, grad, exp_avg, exp_avg_sq, AdamWCoefficients<float>{}, compute_weight,
                                         reinterpret_cast<const AdamWDeviceStep*>(device_step.data<double>()), w));
  }
}

void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const Tensor& device_step, bool weight_decay) {
  constexpr const char* op = "adamw_step_split";
  check_split(op, high, remainder, grad, exp_avg, exp_avg_sq);
  check_device_step(op, device_step, high);
  const int w = weight_decay ? 1 : 0;
  if (high.device().is_cpu()) {
    const AdamWDeviceStep& s = *reinterpret_cast<const AdamWDeviceStep*>(device_step.data<double>());
    if (!s.skip) cpu::adamw_step_split(high, remainder, grad, exp_avg, exp_avg_sq, s.k32[w]);
  } else {
    MC_CUDA_BACKEND(op, cuda::adamw_step_split(high, remainder, grad, exp_avg, exp_avg_sq, AdamWCoefficients<float>{},
                                               reinterpret_cast<const AdamWDeviceStep*>(device_step.data<double>()), w));
  }
}

}  // namespace moecore::ops

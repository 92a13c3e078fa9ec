#include "moecore/ops/adamw.h"

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

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWConfig& config,
                float grad_scale, Tensor* compute_weight, bool parallel) {
  constexpr const char* op = "adamw_step";
  check_contiguous(op, "param", param);
  check_dtype(op, "param", param, {DType::F32, DType::F64});
  MC_CHECK(!(param.device().is_cuda() && param.dtype() == DType::F64), op, ": f64 is CPU-only");
  check_state(op, "grad", grad, param);
  check_state(op, "exp_avg", exp_avg, param, true);
  check_state(op, "exp_avg_sq", exp_avg_sq, param, true);
  check_config(op, config);
  if (compute_weight) {
    check_contiguous(op, "compute_weight", *compute_weight);
    check_same_device(op, param, *compute_weight);
    check_same_shape(op, "param", param, "compute_weight", *compute_weight);
    MC_CHECK(compute_weight->dtype() == DType::BF16 && param.dtype() == DType::F32, op, ": 'compute_weight' is ",
             dtype_name(compute_weight->dtype()), " with param ", dtype_name(param.dtype()),
             "; expected bf16 with an f32 param");
  }
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
  check_config(op, config);
  const AdamWCoefficients<float> k = adamw_coefficients<float>(config, grad_scale);
  if (high.device().is_cpu()) {
    cpu::adamw_step_split(high, remainder, grad, exp_avg, exp_avg_sq, k);
  } else {
    MC_CUDA_BACKEND(op, cuda::adamw_step_split(high, remainder, grad, exp_avg, exp_avg_sq, k));
  }
}

}  // namespace moecore::ops

// Per-tensor FP8 scaling state on the tensors' device (fp8_quant.h, "Per-tensor scaling state"):
// argument checks, the CPU implementations (the host arithmetic the model used before these ops
// existed, so CPU runs stay bit-identical) and the dispatch to the CUDA kernels (fp8_quant_cuda.cu).
#include <algorithm>
#include <cmath>

#include "moecore/ops/common.h"
#include "moecore/ops/fp8_quant.h"

namespace moecore::ops {

namespace {
float max_nan(float a, float b) { return std::isnan(a) || std::isnan(b) ? a + b : std::max(a, b); }

// Transformer Engine's delayed-scaling update of one tensor's history h [len] and scale.
void update_delayed(float* h, int64_t len, float& scale, float fp8_max, const DelayedScalingUpdate& u) {
  float amax = h[0];
  if (u.amax_compute_max)
    for (int64_t i = 1; i < len; ++i) amax = max_nan(amax, h[i]);
  const float prev = scale == 0.0f ? 1.0f : scale;
  const float sf = fp8_max / amax / std::ldexp(1.0f, static_cast<int>(u.margin));
  scale = amax > 0.0f && std::isfinite(amax) ? sf : prev;
  std::rotate(h, h + 1, h + len);  // torch.roll(h, -1): h[i] = h[i + 1], the newest to the end
  h[0] = 0.0f;
}

void check_f32(const char* op, const char* name, const Tensor& t, int64_t ndim) {
  check_defined(op, name, t);
  check_contiguous(op, name, t);
  check_dtype(op, name, t, {DType::F32});
  MC_CHECK(t.ndim() == ndim, op, ": ", name, " must be ", ndim, "-D; got ", t.describe());
}

void check_history(const char* op, const Tensor& history) {
  check_f32(op, "history", history, 2);
  MC_CHECK(history.size(1) >= 1, op, ": history ", history.describe(), " has no columns");
}
}  // namespace

Tensor amax_tensor(const Tensor& x) {
  constexpr const char* op = "fp8 amax_tensor";
  check_defined(op, "x", x);
  check_contiguous(op, "x", x);
  check_dtype(op, "x", x, {DType::F32, DType::BF16});
  if (x.device().is_cpu()) return Tensor::from_vector(std::vector<float>{cpu::amax(x)}, {1});
  Tensor out = Tensor::zeros({1}, DType::F32, x.device());
  MC_CUDA_BACKEND(op, cuda::amax_into(x, out));
  return out;
}

Fp8Tensor quantize_per_tensor(const Tensor& x, const Tensor& src, Fp8ScaleFrom from, Fp8Format f) {
  constexpr const char* op = "fp8 quantize_per_tensor (device scale)";
  check_defined(op, "src", src);
  check_dtype(op, "src", src, {DType::F32});
  MC_CHECK(src.numel() == 1 && src.is_contiguous(), op, ": src must hold one f32; got ", src.describe());
  check_same_device(op, x, src);
  if (x.device().is_cpu()) {
    const float v = src.data<float>()[0];
    const float scale = from == Fp8ScaleFrom::Amax ? fp8_scale_from_amax(v, f, false) : v == 0.0f ? 1.0f : v;
    return quantize_per_tensor(x, scale, f);
  }
  MC_CHECK(x.defined() && x.is_contiguous() && x.ndim() == 2 && (x.dtype() == DType::F32 || x.dtype() == DType::BF16),
           op, ": x must be a contiguous 2-D f32 or bf16 tensor; got ", x.describe());
  Fp8Tensor t;
  t.scaling = Fp8Scaling::PerTensor;
  t.data = Tensor::empty({x.size(0), x.size(1)}, fp8_dtype(f), x.device());
  t.scale_inv = Tensor::empty({1}, DType::F32, x.device());
  MC_CUDA_BACKEND(op, cuda::quantize_per_tensor(x, src, from == Fp8ScaleFrom::Amax, t));
  return t;
}

void record_amax(const Tensor& x, Tensor& history, int64_t row) {
  constexpr const char* op = "fp8 record_amax";
  check_defined(op, "x", x);
  check_contiguous(op, "x", x);
  check_dtype(op, "x", x, {DType::F32, DType::BF16});
  check_history(op, history);
  check_same_device(op, x, history);
  MC_CHECK(row >= 0 && row < history.size(0), op, ": row ", row, " is outside history ", history.describe());
  if (x.device().is_cpu()) {
    float& newest = history.data<float>()[row * history.size(1)];
    newest = max_nan(newest, cpu::amax(x));
    return;
  }
  MC_CUDA_BACKEND(op, cuda::record_amax(x, history, row));
}

void history_newest(const Tensor& history, Tensor& out) {
  constexpr const char* op = "fp8 history_newest";
  check_history(op, history);
  check_f32(op, "out", out, 1);
  check_same_device(op, history, out);
  MC_CHECK(out.size(0) == history.size(0), op, ": out ", out.describe(), " for history ", history.describe());
  if (history.device().is_cpu()) {
    const float* h = history.data<float>();
    float* o = out.data<float>();
    for (int64_t r = 0; r < history.size(0); ++r) o[r] = h[r * history.size(1)];
    return;
  }
  MC_CUDA_BACKEND(op, cuda::history_newest(history, out));
}

void delayed_scaling_update(Tensor& history, Tensor& scale, const Tensor& newest, const DelayedScalingUpdate& u) {
  constexpr const char* op = "fp8 delayed_scaling_update";
  check_history(op, history);
  check_f32(op, "scale", scale, 1);
  check_f32(op, "newest", newest, 1);
  check_same_device(op, history, scale);
  check_same_device(op, history, newest);
  MC_CHECK(scale.size(0) == history.size(0) && newest.size(0) == history.size(0), op, ": scale ", scale.describe(),
           " and newest ", newest.describe(), " for history ", history.describe(), ": expected one per row");
  MC_CHECK(u.margin >= 0 && u.margin <= 64, op, ": margin ", u.margin, ": expected 0 to 64");
  if (history.device().is_cpu()) {
    const int64_t len = history.size(1);
    float* h = history.data<float>();
    float* sc = scale.data<float>();
    const float* n = newest.data<float>();
    for (int64_t r = 0; r < history.size(0); ++r) {
      h[r * len] = n[r];
      update_delayed(h + r * len, len, sc[r], r % 3 == 2 ? u.grad_fp8_max : u.x_w_fp8_max, u);
    }
    return;
  }
  MC_CUDA_BACKEND(op, cuda::delayed_scaling_update(history, scale, newest, u));
}

}  // namespace moecore::ops

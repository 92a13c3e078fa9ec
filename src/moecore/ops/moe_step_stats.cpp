#include "moecore/ops/moe_step_stats.h"

#include "moecore/core/float_formats.h"
#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {
double loss_value(const Tensor& t) {  // as the host read it: f32 unless f64, widened
  if (t.dtype() == DType::F64) return t.data<double>()[0];
  if (t.dtype() == DType::BF16) return static_cast<double>(static_cast<float>(t.data<bf16>()[0]));
  return static_cast<double>(t.data<float>()[0]);
}
}  // namespace

void pack_moe_step_stats(const Tensor& aux, const Tensor& z, const Tensor& counts, const Tensor& host_counts,
                         double aux_coeff, double z_coeff, Tensor& packed) {
  constexpr const char* op = "pack_moe_step_stats";
  check_contiguous(op, "packed", packed);
  check_dtype(op, "packed", packed, {DType::F64});
  const int64_t e = packed.numel() - 4;
  MC_CHECK(e >= 1, op, ": 'packed' has ", packed.numel(), " elements; expected E + 4 with E >= 1");
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"aux", &aux}, {"z", &z}}) {
    if (!t->defined()) continue;
    check_same_device(op, packed, *t);
    check_dtype(op, name, *t, {DType::F32, DType::BF16, DType::F64});
    MC_CHECK(t->numel() == 1, op, ": '", name, "' has ", t->numel(), " elements; expected 1");
  }
  if (counts.defined()) {
    check_same_device(op, packed, counts);
    check_dtype(op, "counts", counts, {DType::I64});
    MC_CHECK(counts.numel() == e + 2, op, ": 'counts' has ", counts.numel(), " elements; expected E + 2 = ", e + 2);
  }
  if (host_counts.defined()) {
    check_same_device(op, packed, host_counts);
    check_dtype(op, "host_counts", host_counts, {DType::F64});
    MC_CHECK(host_counts.numel() == e, op, ": 'host_counts' has ", host_counts.numel(), " elements; expected E = ", e);
  }
  if (packed.device().is_cuda()) {
    MC_CHECK((!aux.defined() || aux.dtype() != DType::F64) && (!z.defined() || z.dtype() != DType::F64), op,
             ": f64 losses are CPU-only");
    MC_CUDA_BACKEND(op, cuda::pack_moe_step_stats(aux, z, counts, host_counts, aux_coeff, z_coeff, packed));
    return;
  }
  double* p = packed.data<double>();
  p[0] = aux.defined() ? 0.0 + loss_value(aux) / aux_coeff : 0.0;
  p[1] = z.defined() ? 0.0 + loss_value(z) / z_coeff : 0.0;
  const int64_t* c = counts.defined() ? counts.data<int64_t>() : nullptr;
  const double* h = host_counts.defined() ? host_counts.data<double>() : nullptr;
  for (int64_t i = 0; i < e; ++i) p[2 + i] = (h ? h[i] : 0.0) + (c ? static_cast<double>(c[i]) : 0.0);
  p[2 + e] = c ? static_cast<double>(c[e]) : 0.0;
  p[3 + e] = c ? static_cast<double>(c[e + 1]) : 0.0;
}

void finish_moe_step_stats(Tensor& packed, double dp_size, Tensor& bias, double rate) {
  constexpr const char* op = "finish_moe_step_stats";
  check_contiguous(op, "packed", packed);
  check_dtype(op, "packed", packed, {DType::F64});
  const int64_t e = packed.numel() - 4;
  MC_CHECK(e >= 1, op, ": 'packed' has ", packed.numel(), " elements; expected E + 4 with E >= 1");
  if (bias.defined()) {
    check_contiguous(op, "bias", bias);
    check_same_device(op, packed, bias);
    check_dtype(op, "bias", bias, {DType::F32, DType::F64});
    MC_CHECK(bias.numel() == e, op, ": 'bias' has ", bias.numel(), " elements; expected E = ", e);
  }
  if (packed.device().is_cuda()) {
    MC_CHECK(!bias.defined() || bias.dtype() == DType::F32, op, ": an f64 bias is CPU-only");
    MC_CUDA_BACKEND(op, cuda::finish_moe_step_stats(packed, dp_size, bias, rate));
    return;
  }
  double* p = packed.data<double>();
  if (dp_size != 1.0) {
    p[0] = p[0] / dp_size;
    p[1] = p[1] / dp_size;
  }
  if (!bias.defined()) return;
  if (bias.dtype() == DType::F64) moe_stats_detail::update_bias(p + 2, e, rate, bias.data<double>());
  else moe_stats_detail::update_bias(p + 2, e, rate, bias.data<float>());
}

}  // namespace moecore::ops

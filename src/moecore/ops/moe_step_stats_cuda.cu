// CUDA side of ops/moe_step_stats.h: one thread each (a layer's E + 4 numbers), in double in the
// host's order.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/moe_step_stats.h"

namespace moecore::ops::cuda {

namespace {
template <typename T>
__device__ double loss_value(const T* t) {  // as the host read it: f32 unless f64, widened
  if constexpr (std::is_same_v<T, double>) return t[0]; else return static_cast<double>(static_cast<float>(t[0]));
}

template <typename A, typename Z>
__global__ void pack_kernel(const A* aux, const Z* z, const int64_t* counts, const double* host_counts, double aux_coeff,
                            double z_coeff, double* p, int64_t e) {
  p[0] = aux ? __dadd_rn(0.0, __ddiv_rn(loss_value(aux), aux_coeff)) : 0.0;
  p[1] = z ? __dadd_rn(0.0, __ddiv_rn(loss_value(z), z_coeff)) : 0.0;
  for (int64_t i = 0; i < e; ++i)
    p[2 + i] = __dadd_rn(host_counts ? host_counts[i] : 0.0, counts ? static_cast<double>(counts[i]) : 0.0);
  p[2 + e] = counts ? static_cast<double>(counts[e]) : 0.0;
  p[3 + e] = counts ? static_cast<double>(counts[e + 1]) : 0.0;
}

template <typename A>
void launch_pack(const Tensor& aux, const Tensor& z, const int64_t* c, const double* h, double aux_coeff, double z_coeff,
                 Tensor& packed, int64_t e, cudaStream_t s) {
  const A* a = aux.defined() ? aux.data<A>() : nullptr;
  if (!z.defined()) {
    pack_kernel<A, float><<<1, 1, 0, s>>>(a, nullptr, c, h, aux_coeff, z_coeff, packed.data<double>(), e);
  } else if (z.dtype() == DType::BF16) {
    pack_kernel<A, bf16><<<1, 1, 0, s>>>(a, z.data<bf16>(), c, h, aux_coeff, z_coeff, packed.data<double>(), e);
  } else {
    pack_kernel<A, float><<<1, 1, 0, s>>>(a, z.data<float>(), c, h, aux_coeff, z_coeff, packed.data<double>(), e);
  }
}

template <typename B>
__global__ void finish_kernel(double* p, int64_t e, double dp_size, B* bias, double rate) {
  if (dp_size != 1.0) {
    p[0] = __ddiv_rn(p[0], dp_size);
    p[1] = __ddiv_rn(p[1], dp_size);
  }
  if (bias) moe_stats_detail::update_bias(p + 2, e, rate, bias);
}
}  // namespace

void pack_moe_step_stats(const Tensor& aux, const Tensor& z, const Tensor& counts, const Tensor& host_counts,
                         double aux_coeff, double z_coeff, Tensor& packed) {
  cudaStream_t s = prepare(packed);
  const int64_t e = packed.numel() - 4;
  const int64_t* c = counts.defined() ? counts.data<int64_t>() : nullptr;
  const double* h = host_counts.defined() ? host_counts.data<double>() : nullptr;
  if (aux.defined() && aux.dtype() == DType::BF16) launch_pack<bf16>(aux, z, c, h, aux_coeff, z_coeff, packed, e, s);
  else launch_pack<float>(aux, z, c, h, aux_coeff, z_coeff, packed, e, s);
  MC_CUDA_CHECK_LAUNCH();
}

void finish_moe_step_stats(Tensor& packed, double dp_size, Tensor& bias, double rate) {
  cudaStream_t s = prepare(packed);
  const int64_t e = packed.numel() - 4;
  finish_kernel<float><<<1, 1, 0, s>>>(packed.data<double>(), e, dp_size, bias.defined() ? bias.data<float>() : nullptr,
                                       rate);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda

#include "moecore/ops/gemm.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

GemmShape gemm_shape(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b) {
  MC_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm: A, B and C must be 2-D; got ", a.describe(), ", ",
           b.describe(), ", ", c.describe());
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  const int64_t kb = trans_b ? b.size(1) : b.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  MC_CHECK(k == kb, "gemm: inner dimensions differ: op(A) is [", m, ", ", k, "] (trans_a=", trans_a, "), op(B) is [",
           kb, ", ", n, "] (trans_b=", trans_b, ")");
  MC_CHECK(c.size(0) == m && c.size(1) == n, "gemm: C has shape ", shape_str(c.shape()), "; expected (", m, ", ", n,
           ")");
  return {m, n, k};
}

void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha, float beta) {
  constexpr const char* op = "gemm";
  check_contiguous(op, "A", a);
  check_contiguous(op, "B", b);
  check_contiguous(op, "C", c);
  check_same_device(op, a, b);
  check_same_device(op, a, c);
  gemm_shape(a, b, c, trans_a, trans_b);
  MC_CHECK(a.dtype() == b.dtype(), "gemm: A is ", dtype_name(a.dtype()), " but B is ", dtype_name(b.dtype()));
  if (a.dtype() == DType::BF16) {
    check_dtype(op, "C", c, {DType::BF16, DType::F32});
  } else {
    check_dtype(op, "A", a, {DType::F32, DType::F64});
    MC_CHECK(c.dtype() == a.dtype(), "gemm: C is ", dtype_name(c.dtype()), "; expected ", dtype_name(a.dtype()),
             " like A and B");
  }
  if (a.device().is_cpu()) {
    cpu::gemm(a, b, c, trans_a, trans_b, alpha, beta);
  } else {
    MC_CHECK(a.dtype() != DType::F64, "gemm: f64 is CPU-only (it exists for gradient checks)");
    MC_CUDA_BACKEND(op, cuda::gemm(a, b, c, trans_a, trans_b, alpha, beta));
  }
}

}  // namespace moecore::ops

#include "moecore/ops/cross_entropy.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

// The dtype of loss, lse and dloss for these logits.
DType row_dtype(const Tensor& logits) { return logits.dtype() == DType::F64 ? DType::F64 : DType::F32; }

void check_row_tensor(const char* op, const char* name, const Tensor& t, const Tensor& logits) {
  check_contiguous(op, name, t);
  check_same_device(op, logits, t);
  check_shape(op, name, t, {logits.size(0)});
  check_dtype(op, name, t, {row_dtype(logits)});
}

// Checks logits and targets; returns nothing, the caller reads T and V from logits.
void check_logits_targets(const char* op, const Tensor& logits, const Tensor& targets) {
  check_contiguous(op, "logits", logits);
  check_dtype(op, "logits", logits, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(!(logits.device().is_cuda() && logits.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(logits.ndim() == 2 && logits.size(1) > 0, op, ": argument 'logits' ", logits.describe(),
           " must have shape [T, V] with V > 0");
  check_contiguous(op, "targets", targets);
  check_same_device(op, logits, targets);
  check_dtype(op, "targets", targets, {DType::I32});
  check_shape(op, "targets", targets, {logits.size(0)});
}

// Raises the Error for the first out-of-range target a backend reported.
void check_bad_row(const char* op, const Tensor& targets, int64_t bad_row, int64_t classes) {
  if (bad_row < 0) return;
  const int32_t value = targets.slice(0, bad_row, bad_row + 1).to(Device::cpu()).to_vector<int32_t>()[0];
  MC_FAIL(op, ": targets[", bad_row, "] = ", value, " is out of range for ", classes,
          " classes (expected 0 <= target < ", classes, ", or negative to ignore the row)");
}

}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse) {
  constexpr const char* op = "cross_entropy_forward";
  check_logits_targets(op, logits, targets);
  check_row_tensor(op, "loss", loss, logits);
  check_row_tensor(op, "lse", lse, logits);
  const int64_t rows = logits.size(0), classes = logits.size(1);
  int64_t bad = -1;
  if (logits.device().is_cpu()) {
    bad = cpu::cross_entropy_forward(logits, targets, loss, lse, rows, classes);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::cross_entropy_forward(logits, targets, loss, lse, rows, classes));
  }
  check_bad_row(op, targets, bad, classes);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                            Tensor& dlogits) {
  constexpr const char* op = "cross_entropy_backward";
  check_logits_targets(op, logits, targets);
  check_row_tensor(op, "lse", lse, logits);
  check_row_tensor(op, "dloss", dloss, logits);
  check_contiguous(op, "dlogits", dlogits);
  check_same_device(op, logits, dlogits);
  check_same_shape(op, "logits", logits, "dlogits", dlogits);
  MC_CHECK(dlogits.dtype() == logits.dtype(), op, ": 'dlogits' has dtype ", dtype_name(dlogits.dtype()),
           "; expected logits' dtype ", dtype_name(logits.dtype()));
  // dlogits may be logits itself, but not a shifted view of the same memory: each element
  // is read and then written by the same thread, which only works when the two coincide.
  const char* a = static_cast<const char*>(logits.data_ptr());
  const char* b = static_cast<const char*>(dlogits.data_ptr());
  const size_t n = logits.nbytes();
  MC_CHECK(a == b || a + n <= b || b + n <= a, op,
           ": 'dlogits' partially overlaps 'logits'; it must be logits itself or separate memory");
  const int64_t rows = logits.size(0), classes = logits.size(1);
  int64_t bad = -1;
  if (logits.device().is_cpu()) {
    bad = cpu::cross_entropy_backward(logits, targets, lse, dloss, dlogits, rows, classes);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::cross_entropy_backward(logits, targets, lse, dloss, dlogits, rows, classes));
  }
  check_bad_row(op, targets, bad, classes);
}

}  // namespace moecore::ops

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

// Checks this rank's part [vocab_start, vocab_start + classes) of vocab_total classes and
// returns vocab_total (classes for the defaults: the whole vocabulary).
int64_t check_part(const char* op, int64_t classes, int64_t vocab_start, int64_t vocab_total) {
  if (vocab_total < 0) {
    MC_CHECK(vocab_total == -1 && vocab_start == 0, op, ": vocab_start = ", vocab_start, ", vocab_total = ",
             vocab_total, "; expected vocab_total >= 0, or vocab_total = -1 (the whole vocabulary) with "
             "vocab_start = 0");
    return classes;
  }
  MC_CHECK(vocab_start >= 0 && vocab_start + classes <= vocab_total, op, ": the part [", vocab_start, ", ",
           vocab_start + classes, ") of ", classes, " classes does not fit in a vocabulary of ", vocab_total,
           " classes (expected 0 <= vocab_start and vocab_start + V <= vocab_total)");
  return vocab_total;
}

// A [T] statistics tensor of the combine functions: f32, or f64 on the CPU.
void check_stat(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  check_contiguous(op, name, t);
  check_same_device(op, like, t);
  check_dtype(op, name, t, {DType::F32, DType::F64});
  MC_CHECK(!(t.device().is_cuda() && t.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(t.dtype() == like.dtype(), op, ": '", name, "' has dtype ", dtype_name(t.dtype()), "; expected ",
           dtype_name(like.dtype()), " (all statistics share one dtype)");
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
                            Tensor& dlogits, int64_t vocab_start, int64_t vocab_total) {
  constexpr const char* op = "cross_entropy_backward";
  check_logits_targets(op, logits, targets);
  const int64_t total = check_part(op, logits.size(1), vocab_start, vocab_total);
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
    bad = cpu::cross_entropy_backward(logits, targets, lse, dloss, dlogits, rows, classes, vocab_start, total);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::cross_entropy_backward(logits, targets, lse, dloss, dlogits, rows, classes,
                                                           vocab_start, total));
  }
  check_bad_row(op, targets, bad, total);
}

void cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, const Tensor& dloss, Tensor& loss,
                                    Tensor& lse, Tensor& dlogits) {
  constexpr const char* op = "cross_entropy_forward_backward";
  check_logits_targets(op, logits, targets);
  check_row_tensor(op, "loss", loss, logits);
  check_row_tensor(op, "lse", lse, logits);
  check_row_tensor(op, "dloss", dloss, logits);
  check_contiguous(op, "dlogits", dlogits);
  check_same_device(op, logits, dlogits);
  check_same_shape(op, "logits", logits, "dlogits", dlogits);
  MC_CHECK(dlogits.dtype() == logits.dtype(), op, ": 'dlogits' has dtype ", dtype_name(dlogits.dtype()),
           "; expected logits' dtype ", dtype_name(logits.dtype()));
  const char* a = static_cast<const char*>(logits.data_ptr());
  const char* b = static_cast<const char*>(dlogits.data_ptr());
  const size_t n = logits.nbytes();
  MC_CHECK(a == b || a + n <= b || b + n <= a, op,
           ": 'dlogits' partially overlaps 'logits'; it must be logits itself or separate memory");
  const int64_t rows = logits.size(0), classes = logits.size(1);
  int64_t bad = -1;
  if (logits.device().is_cpu()) {  // the two passes in turn (the forward has read every row before dlogits is written)
    bad = cpu::cross_entropy_forward(logits, targets, loss, lse, rows, classes);
    check_bad_row(op, targets, bad, classes);
    bad = cpu::cross_entropy_backward(logits, targets, lse, dloss, dlogits, rows, classes, 0, classes);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::cross_entropy_forward_backward(logits, targets, dloss, loss, lse, dlogits, rows,
                                                                   classes));
  }
  check_bad_row(op, targets, bad, classes);
}

void cross_entropy_part_forward(const Tensor& logits, const Tensor& targets, int64_t vocab_start,
                                int64_t vocab_total, Tensor& lse_part, Tensor& target_logit) {
  constexpr const char* op = "cross_entropy_part_forward";
  check_logits_targets(op, logits, targets);
  const int64_t total = check_part(op, logits.size(1), vocab_start, vocab_total);
  check_row_tensor(op, "lse_part", lse_part, logits);
  check_row_tensor(op, "target_logit", target_logit, logits);
  const int64_t rows = logits.size(0), classes = logits.size(1);
  int64_t bad = -1;
  if (logits.device().is_cpu()) {
    bad = cpu::cross_entropy_part_forward(logits, targets, lse_part, target_logit, rows, classes, vocab_start, total);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::cross_entropy_part_forward(logits, targets, lse_part, target_logit, rows, classes,
                                                               vocab_start, total));
  }
  check_bad_row(op, targets, bad, total);
}

void logsumexp_combine(const Tensor& parts, Tensor& lse) {
  constexpr const char* op = "logsumexp_combine";
  check_stat(op, "parts", parts, parts);
  MC_CHECK(parts.ndim() == 2 && parts.size(0) > 0, op, ": argument 'parts' ", parts.describe(),
           " must have shape [P, T] with P > 0");
  check_stat(op, "lse", lse, parts);
  const int64_t num_parts = parts.size(0), rows = parts.size(1);
  check_shape(op, "lse", lse, {rows});
  if (parts.device().is_cpu()) {
    cpu::logsumexp_combine(parts, lse, num_parts, rows);
  } else {
    MC_CUDA_BACKEND(op, cuda::logsumexp_combine(parts, lse, num_parts, rows));
  }
}

void cross_entropy_combined_loss(const Tensor& lse, const Tensor& target_logit, const Tensor& targets, Tensor& loss) {
  constexpr const char* op = "cross_entropy_combined_loss";
  check_stat(op, "lse", lse, lse);
  MC_CHECK(lse.ndim() == 1, op, ": argument 'lse' ", lse.describe(), " must have shape [T]");
  const int64_t rows = lse.size(0);
  check_stat(op, "target_logit", target_logit, lse);
  check_shape(op, "target_logit", target_logit, {rows});
  check_stat(op, "loss", loss, lse);
  check_shape(op, "loss", loss, {rows});
  check_contiguous(op, "targets", targets);
  check_same_device(op, lse, targets);
  check_dtype(op, "targets", targets, {DType::I32});
  check_shape(op, "targets", targets, {rows});
  if (lse.device().is_cpu()) {
    cpu::cross_entropy_combined_loss(lse, target_logit, targets, loss, rows);
  } else {
    MC_CUDA_BACKEND(op, cuda::cross_entropy_combined_loss(lse, target_logit, targets, loss, rows));
  }
}

}  // namespace moecore::ops

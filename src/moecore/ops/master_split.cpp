#include "moecore/ops/master_split.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {
void check_halves(const char* op, const Tensor& master, const Tensor& high, const Tensor& remainder) {
  check_contiguous(op, "master", master);
  check_contiguous(op, "high", high);
  check_contiguous(op, "remainder", remainder);
  check_dtype(op, "master", master, {DType::F32});
  check_dtype(op, "high", high, {DType::BF16});
  check_dtype(op, "remainder", remainder, {DType::I16});
  check_same_device(op, master, high);
  check_same_device(op, master, remainder);
  check_same_shape(op, "master", master, "high", high);
  check_same_shape(op, "master", master, "remainder", remainder);
}
}  // namespace

void split_master(const Tensor& master, Tensor& high, Tensor& remainder) {
  constexpr const char* op = "split_master";
  check_halves(op, master, high, remainder);
  if (master.device().is_cpu()) {
    cpu::split_master(master, high, remainder);
  } else {
    MC_CUDA_BACKEND(op, cuda::split_master(master, high, remainder));
  }
}

void join_master(const Tensor& high, const Tensor& remainder, Tensor& master) {
  constexpr const char* op = "join_master";
  check_halves(op, master, high, remainder);
  if (master.device().is_cpu()) {
    cpu::join_master(high, remainder, master);
  } else {
    MC_CUDA_BACKEND(op, cuda::join_master(high, remainder, master));
  }
}

}  // namespace moecore::ops

// Shared argument checks and dtype dispatch for ops.
//
// Every public op validates its arguments here (same device, contiguity, dtypes, shapes) and
// raises one Error naming the op, the argument and what was expected; the backend functions
// then trust their inputs.
#pragma once

#include <initializer_list>
#include <string>

#include "moecore/core/error.h"
#include "moecore/core/tensor.h"

namespace moecore::ops {

void check_defined(const char* op, const char* name, const Tensor& t);
void check_contiguous(const char* op, const char* name, const Tensor& t);
void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<DType> allowed);
void check_same_device(const char* op, const Tensor& a, const Tensor& b);
void check_same_shape(const char* op, const char* name_a, const Tensor& a, const char* name_b, const Tensor& b);
void check_shape(const char* op, const char* name, const Tensor& t, const Shape& expected);
[[noreturn]] void fail_no_cuda(const char* op);

// A scope in which the caller vouches that every class target passed to the cross-entropy ops is
// in range (it validated them on the host): their CUDA backends skip the device->host read of
// the out-of-range flag, one synchronisation per call (the model reads its labels to the host
// once per micro-batch anyway and checks them there). Thread-local; scopes nest.
class TargetsValidated {
 public:
  TargetsValidated();
  ~TargetsValidated();
  TargetsValidated(const TargetsValidated&) = delete;
  TargetsValidated& operator=(const TargetsValidated&) = delete;
  static bool active();
};

// A scope in which the caller vouches that the ids passed to embedding_forward and
// embedding_backward are in range (the trainer checked the batch on the host, or the embedding
// forward checked the same ids): their CUDA backends skip the device->host read of the
// out-of-range flag, one synchronisation per call. Thread-local; scopes nest.
class EmbeddingIdsValidated {
 public:
  EmbeddingIdsValidated();
  ~EmbeddingIdsValidated();
  EmbeddingIdsValidated(const EmbeddingIdsValidated&) = delete;
  EmbeddingIdsValidated& operator=(const EmbeddingIdsValidated&) = delete;
  static bool active();
};

// Calls f(T{}) with T the C++ type of a floating dtype (float, double, bf16, fp8e4m3, fp8e5m2).
template <typename F>
void dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::F64: f(double{}); return;
    case DType::BF16: f(bf16{}); return;
    case DType::FP8E4M3: f(fp8e4m3{}); return;
    case DType::FP8E5M2: f(fp8e5m2{}); return;
    default: MC_FAIL(op, ": dtype ", dtype_name(t), " is not a floating type");
  }
}

}  // namespace moecore::ops

// In an op's dispatcher: runs `call` on the CUDA backend, or fails clearly without it.
#if MOECORE_WITH_CUDA
#define MC_CUDA_BACKEND(op, call) call
#else
#define MC_CUDA_BACKEND(op, call) ::moecore::ops::fail_no_cuda(op)
#endif

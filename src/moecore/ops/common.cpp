#include "moecore/ops/common.h"

#include <sstream>

namespace moecore::ops {

namespace {
thread_local int targets_validated_depth = 0;
thread_local int embedding_ids_validated_depth = 0;
}  // namespace

TargetsValidated::TargetsValidated() { ++targets_validated_depth; }
TargetsValidated::~TargetsValidated() { --targets_validated_depth; }
bool TargetsValidated::active() { return targets_validated_depth > 0; }
EmbeddingIdsValidated::EmbeddingIdsValidated() { ++embedding_ids_validated_depth; }
EmbeddingIdsValidated::~EmbeddingIdsValidated() { --embedding_ids_validated_depth; }
bool EmbeddingIdsValidated::active() { return embedding_ids_validated_depth > 0; }

void check_defined(const char* op, const char* name, const Tensor& t) {
  MC_CHECK(t.defined(), op, ": argument '", name, "' is an undefined tensor");
}

void check_contiguous(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  MC_CHECK(t.is_contiguous(), op, ": argument '", name, "' ", t.describe(), " must be contiguous");
}

void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype() == d) return;
  std::ostringstream os;
  bool first = true;
  for (DType d : allowed) {
    os << (first ? "" : ", ") << dtype_name(d);
    first = false;
  }
  MC_FAIL(op, ": argument '", name, "' has dtype ", dtype_name(t.dtype()), "; expected one of ", os.str());
}

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  MC_CHECK(a.device() == b.device(), op, ": tensors on different devices (", a.device().str(), " and ",
           b.device().str(), ")");
}

void check_same_shape(const char* op, const char* name_a, const Tensor& a, const char* name_b, const Tensor& b) {
  MC_CHECK(a.shape() == b.shape(), op, ": '", name_a, "' has shape ", shape_str(a.shape()), " but '", name_b,
           "' has shape ", shape_str(b.shape()));
}

void check_shape(const char* op, const char* name, const Tensor& t, const Shape& expected) {
  MC_CHECK(t.shape() == expected, op, ": argument '", name, "' has shape ", shape_str(t.shape()), "; expected ",
           shape_str(expected));
}

void fail_no_cuda(const char* op) { MC_FAIL(op, " on a CUDA tensor: ", cuda_unavailable_reason()); }

}  // namespace moecore::ops

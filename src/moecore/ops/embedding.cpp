#include "moecore/ops/embedding.h"

#include <cstdint>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

void check_ids(const char* op, const Tensor& ids) {
  check_contiguous(op, "ids", ids);
  check_dtype(op, "ids", ids, {DType::I32});
  MC_CHECK(ids.ndim() == 1, op, ": argument 'ids' ", ids.describe(), " must have shape [T]");
}

void check_matrix(const char* op, const char* name, const Tensor& t) {
  check_contiguous(op, name, t);
  check_dtype(op, name, t, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(!(t.device().is_cuda() && t.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(t.ndim() == 2, op, ": argument '", name, "' ", t.describe(), " must be 2-dimensional");
}

// Raises the Error for the first invalid id a backend reported.
void check_bad_position(const char* op, const Tensor& ids, int64_t bad, int64_t vocab) {
  if (bad < 0) return;
  const int32_t value = ids.slice(0, bad, bad + 1).to(Device::cpu()).to_vector<int32_t>()[0];
  MC_FAIL(op, ": ids[", bad, "] = ", value, " is out of range for a vocabulary of ", vocab,
          " rows (expected 0 <= id < ", vocab, ")");
}

// The part [vocab_start, vocab_start + rows) of a vocab_total-row vocabulary (vocab_total = -1:
// the whole vocabulary, which needs vocab_start = 0).
EmbeddingPart make_part(const char* op, int64_t rows, int64_t vocab_start, int64_t vocab_total) {
  if (vocab_total < 0) {
    MC_CHECK(vocab_total == -1 && vocab_start == 0, op, ": vocab_start = ", vocab_start, ", vocab_total = ",
             vocab_total, "; expected vocab_total >= 0, or vocab_total = -1 (the whole vocabulary) with "
             "vocab_start = 0");
    return {0, rows, rows};
  }
  MC_CHECK(vocab_start >= 0 && vocab_start + rows <= vocab_total, op, ": the part [", vocab_start, ", ",
           vocab_start + rows, ") of ", rows, " rows does not fit in a vocabulary of ", vocab_total,
           " rows (expected 0 <= vocab_start and vocab_start + V <= vocab_total)");
  MC_CHECK(vocab_total <= INT32_MAX, op, ": vocab_total = ", vocab_total, " does not fit i32 ids");
  return {vocab_start, rows, vocab_total};
}

}  // namespace

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out, int64_t vocab_start,
                       int64_t vocab_total) {
  constexpr const char* op = "embedding_forward";
  check_matrix(op, "table", table);
  check_ids(op, ids);
  check_contiguous(op, "out", out);
  check_same_device(op, table, ids);
  check_same_device(op, table, out);
  const int64_t hidden = table.size(1), tokens = ids.size(0);
  const EmbeddingPart part = make_part(op, table.size(0), vocab_start, vocab_total);
  check_shape(op, "out", out, {tokens, hidden});
  MC_CHECK(out.dtype() == table.dtype(), op, ": 'out' has dtype ", dtype_name(out.dtype()),
           "; expected table's dtype ", dtype_name(table.dtype()));
  int64_t bad = -1;
  if (table.device().is_cpu()) {
    bad = cpu::embedding_forward(table, ids, out, part, tokens, hidden);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::embedding_forward(table, ids, out, part, tokens, hidden));
  }
  check_bad_position(op, ids, bad, part.total);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, int64_t vocab_start,
                        int64_t vocab_total) {
  constexpr const char* op = "embedding_backward";
  check_ids(op, ids);
  check_matrix(op, "dout", dout);
  check_contiguous(op, "dtable", dtable);
  check_same_device(op, ids, dout);
  check_same_device(op, ids, dtable);
  const int64_t tokens = ids.size(0), hidden = dout.size(1);
  check_shape(op, "dout", dout, {tokens, hidden});
  MC_CHECK(dtable.ndim() == 2 && dtable.size(1) == hidden, op, ": argument 'dtable' has shape ",
           shape_str(dtable.shape()), "; expected [V, ", hidden, "] (dout's hidden size)");
  check_dtype(op, "dtable", dtable, {dout.dtype() == DType::F64 ? DType::F64 : DType::F32});
  const EmbeddingPart part = make_part(op, dtable.size(0), vocab_start, vocab_total);
  int64_t bad = -1;
  if (ids.device().is_cpu()) {
    bad = cpu::embedding_backward(ids, dout, dtable, part, tokens, hidden);
  } else {
    MC_CUDA_BACKEND(op, bad = cuda::embedding_backward(ids, dout, dtable, part, tokens, hidden));
  }
  check_bad_position(op, ids, bad, part.total);
}

}  // namespace moecore::ops

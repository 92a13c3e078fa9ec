#include "moecore/ops/moe_loss.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

// A [T, E] router tensor: f32, or f64 on the CPU.
void check_matrix(const char* op, const char* name, const Tensor& t) {
  check_contiguous(op, name, t);
  check_dtype(op, name, t, {DType::F32, DType::F64});
  MC_CHECK(!(t.device().is_cuda() && t.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(t.ndim() == 2 && t.size(1) > 0, op, ": argument '", name, "' ", t.describe(),
           " must be 2-D [tokens, experts] with at least one expert");
}

void check_like(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  check_contiguous(op, name, t);
  check_same_device(op, ref, t);
  check_same_shape(op, ref_name, ref, name, t);
  MC_CHECK(t.dtype() == ref.dtype(), op, ": '", name, "' is ", dtype_name(t.dtype()), " but '", ref_name, "' is ",
           dtype_name(ref.dtype()));
}

void check_loss(const char* op, const Tensor& loss, const Tensor& ref) {
  check_contiguous(op, "loss", loss);
  check_same_device(op, ref, loss);
  check_shape(op, "loss", loss, {1});
  check_dtype(op, "loss", loss, {ref.dtype()});
}

// counts [G, E]: f32 (f64 accepted on the CPU); G >= 1 divides T.
void check_counts(const char* op, const Tensor& counts, int64_t tokens, int64_t experts, Device device) {
  check_contiguous(op, "counts", counts);
  MC_CHECK(counts.device() == device, op, ": 'counts' is on ", counts.device().str(), " but the scores are on ",
           device.str());
  if (counts.device().is_cpu()) check_dtype(op, "counts", counts, {DType::F32, DType::F64});
  else check_dtype(op, "counts", counts, {DType::F32});
  MC_CHECK(counts.ndim() == 2 && counts.size(0) >= 1 && counts.size(1) == experts, op, ": argument 'counts' has shape ",
           shape_str(counts.shape()), "; expected [groups >= 1, ", experts, "]");
  MC_CHECK(tokens % counts.size(0) == 0, op, ": ", tokens, " tokens do not split into ", counts.size(0),
           " groups (sequences) of equal length");
}

}  // namespace

void aux_scores_forward(const Tensor& logits, RouterScore score, Tensor& aux_scores) {
  constexpr const char* op = "aux_scores_forward";
  check_matrix(op, "logits", logits);
  check_like(op, "aux_scores", aux_scores, "logits", logits);
  if (logits.numel() == 0) return;
  if (logits.device().is_cpu()) cpu::aux_scores_forward(logits, score, aux_scores);
  else MC_CUDA_BACKEND(op, cuda::aux_scores_forward(logits, score, aux_scores));
}

void aux_scores_backward(const Tensor& logits, RouterScore score, const Tensor& daux_scores, Tensor& dlogits) {
  constexpr const char* op = "aux_scores_backward";
  check_matrix(op, "logits", logits);
  check_like(op, "daux_scores", daux_scores, "logits", logits);
  check_like(op, "dlogits", dlogits, "logits", logits);
  if (logits.numel() == 0) return;
  if (logits.device().is_cpu()) cpu::aux_scores_backward(logits, score, daux_scores, dlogits);
  else MC_CUDA_BACKEND(op, cuda::aux_scores_backward(logits, score, daux_scores, dlogits));
}

void topk_counts(const Tensor& aux_scores, int64_t topk, int64_t groups, Tensor& counts) {
  constexpr const char* op = "topk_counts";
  check_matrix(op, "aux_scores", aux_scores);
  const int64_t T = aux_scores.size(0), E = aux_scores.size(1);
  MC_CHECK(topk >= 1 && topk <= E, op, ": --moe-router-topk ", topk, " must be in [1, ", E, "]");
  MC_CHECK(groups >= 1 && T % groups == 0, op, ": groups ", groups, " must be >= 1 and divide the ", T, " tokens");
  check_contiguous(op, "counts", counts);
  check_same_device(op, aux_scores, counts);
  check_shape(op, "counts", counts, {groups, E});
  check_dtype(op, "counts", counts, {DType::F32});
  // The selection is the router's plain top-k (default softmax selects topk of its input).
  RouterConfig cfg;
  cfg.num_experts = E;
  cfg.topk = topk;
  Tensor probs = Tensor::empty({T, topk}, aux_scores.dtype(), aux_scores.device());
  Tensor indices = Tensor::empty({T, topk}, DType::I32, aux_scores.device());
  router_topk_forward(aux_scores, Tensor(), cfg, probs, indices);
  if (aux_scores.device().is_cpu()) cpu::counts_from_indices(indices, groups, counts);
  else MC_CUDA_BACKEND(op, cuda::counts_from_indices(indices, groups, counts));
}

void topk_counts_from_indices(const Tensor& topk_indices, int64_t groups, Tensor& counts) {
  constexpr const char* op = "topk_counts_from_indices";
  check_contiguous(op, "topk_indices", topk_indices);
  check_dtype(op, "topk_indices", topk_indices, {DType::I32});
  MC_CHECK(topk_indices.ndim() == 2, op, ": argument 'topk_indices' ", topk_indices.describe(),
           " must be 2-D [tokens, topk]");
  const int64_t T = topk_indices.size(0);
  MC_CHECK(groups >= 1 && T % groups == 0, op, ": groups ", groups, " must be >= 1 and divide the ", T, " tokens");
  check_contiguous(op, "counts", counts);
  check_same_device(op, topk_indices, counts);
  check_dtype(op, "counts", counts, {DType::F32});
  MC_CHECK(counts.ndim() == 2 && counts.size(0) == groups && counts.size(1) >= 1, op, ": argument 'counts' has shape ",
           shape_str(counts.shape()), "; expected [", groups, ", experts]");
  const int64_t E = counts.size(1);
  if (topk_indices.device().is_cpu()) {
    // The CUDA kernel skips values outside [0, E); the CPU checks them (no device sync there).
    const int32_t* pi = topk_indices.data<int32_t>();
    for (int64_t i = 0; i < topk_indices.numel(); ++i)
      MC_CHECK(pi[i] >= 0 && pi[i] < E, op, ": topk_indices[", i / topk_indices.size(1), ", ",
               i % topk_indices.size(1), "] = ", pi[i], " is out of range [0, ", E, ")");
    cpu::counts_from_indices(topk_indices, groups, counts);
  } else {
    MC_CUDA_BACKEND(op, cuda::counts_from_indices(topk_indices, groups, counts));
  }
}

void switch_aux_loss_forward(const Tensor& aux_scores, const Tensor& counts, int64_t topk, double coeff, Tensor& loss) {
  constexpr const char* op = "switch_aux_loss_forward";
  check_matrix(op, "aux_scores", aux_scores);
  MC_CHECK(aux_scores.size(0) > 0, op, ": needs at least one token");
  MC_CHECK(topk >= 1, op, ": --moe-router-topk must be >= 1, got ", topk);
  check_counts(op, counts, aux_scores.size(0), aux_scores.size(1), aux_scores.device());
  check_loss(op, loss, aux_scores);
  if (aux_scores.device().is_cpu()) cpu::switch_aux_loss_forward(aux_scores, counts, topk, coeff, loss);
  else MC_CUDA_BACKEND(op, cuda::switch_aux_loss_forward(aux_scores, counts, topk, coeff, loss));
}

void switch_aux_loss_backward(const Tensor& counts, int64_t topk, double coeff, double dloss, int64_t num_tokens,
                              Tensor& daux_scores) {
  constexpr const char* op = "switch_aux_loss_backward";
  check_matrix(op, "daux_scores", daux_scores);
  MC_CHECK(num_tokens > 0 && daux_scores.size(0) == num_tokens, op, ": 'daux_scores' has ", daux_scores.size(0),
           " rows; expected num_tokens = ", num_tokens, " (> 0)");
  MC_CHECK(topk >= 1, op, ": --moe-router-topk must be >= 1, got ", topk);
  check_counts(op, counts, num_tokens, daux_scores.size(1), daux_scores.device());
  if (daux_scores.device().is_cpu()) cpu::switch_aux_loss_backward(counts, topk, coeff, dloss, daux_scores);
  else MC_CUDA_BACKEND(op, cuda::switch_aux_loss_backward(counts, topk, coeff, dloss, daux_scores));
}

void z_loss_forward(const Tensor& logits, double coeff, Tensor& loss) {
  constexpr const char* op = "z_loss_forward";
  check_matrix(op, "logits", logits);
  MC_CHECK(logits.size(0) > 0, op, ": needs at least one token");
  check_loss(op, loss, logits);
  if (logits.device().is_cpu()) cpu::z_loss_forward(logits, coeff, loss);
  else MC_CUDA_BACKEND(op, cuda::z_loss_forward(logits, coeff, loss));
}

void z_loss_backward(const Tensor& logits, double coeff, double dloss, Tensor& dlogits) {
  constexpr const char* op = "z_loss_backward";
  check_matrix(op, "logits", logits);
  check_like(op, "dlogits", dlogits, "logits", logits);
  if (logits.size(0) == 0) return;
  if (logits.device().is_cpu()) cpu::z_loss_backward(logits, coeff, dloss, dlogits);
  else MC_CUDA_BACKEND(op, cuda::z_loss_backward(logits, coeff, dloss, dlogits));
}

void sinkhorn(const Tensor& logits, Tensor& out) {
  constexpr const char* op = "sinkhorn";
  check_matrix(op, "logits", logits);
  check_like(op, "out", out, "logits", logits);
  if (logits.size(0) == 0) return;
  if (logits.device().is_cpu()) cpu::sinkhorn(logits, out);
  else MC_CUDA_BACKEND(op, cuda::sinkhorn(logits, out));
}

}  // namespace moecore::ops

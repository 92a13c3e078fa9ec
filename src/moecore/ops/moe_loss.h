// MoE load-balancing losses (Megatron-Core semantics) and Sinkhorn normalisation.
//
// Shapes: logits and aux_scores [T, E]; counts [G, E] f32 (tokens per expert in each of G
// groups of T/G consecutive tokens); loss [1]. Dtypes: f32 (f64 on the CPU for gradient
// checks); CUDA is f32 only. Gradients named d* that ACCUMULATE say so.
//   aux_scores:  softmax(logits) over E (softmax and sinkhorn routers);
//                sigmoid router: a = s / (sum_e s + 1e-20), s = sigmoid(logits).
//   topk_counts: counts[g, e] = #{t in group g : e in topk(aux_scores[t])} (ties: lower id).
//   switch aux loss over G groups (G = 1: aux_loss; G = B: seq_aux_loss, tokens ordered
//                sequence by sequence), Tg = T / G:
//                L = coeff / G * sum_g E / (k Tg^2) * sum_e (sum_{t in g} a_te) * c_ge
//                counts may be fractional (global_aux_loss passes averaged counts).
//                dL/da_te = coeff / G * E / (k Tg^2) * c_{g(t) e}.
//   z-loss:      L = coeff * mean_t (logsumexp_e logits_te)^2
//                dL/dlogits_te = coeff * 2 lse_t / T * softmax(logits_t)_e.
//   sinkhorn:    Megatron's sinkhorn(), tol 1e-4: c = exp(logits) (no max shift, as Megatron);
//                d0 = 1, d1 = 1; repeat d0 = (1/T) / (c d1 + 1e-8), d1 = (1/E) / (d0^T c + 1e-8)
//                while mean|d1 - d1_old| > tol (at most kSinkhornMaxIters rounds; Megatron has no
//                cap); out = d1 * c * d0 (column and row scaling). Not differentiable.
// CUDA: row kernels plus deterministic fixed-order reductions (no float atomics; the counts use
// integer atomics, exact in any order). Sinkhorn runs
// as one 1024-thread block that iterates on the device (no host synchronisation); it is meant for
// router-sized inputs (T x E up to a few million elements).
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"
#include "moecore/ops/router.h"

namespace moecore::ops {

void aux_scores_forward(const Tensor& logits, RouterScore score, Tensor& aux_scores);
// dlogits += d aux_scores / d logits applied to daux_scores.
void aux_scores_backward(const Tensor& logits, RouterScore score, const Tensor& daux_scores, Tensor& dlogits);

void topk_counts(const Tensor& aux_scores, int64_t topk, int64_t groups, Tensor& counts);
// The same counts from a selection already made: topk_indices [T, k] i32 with values in [0, E)
// (e.g. router_topk_aux_forward's aux_indices), counts [G, E] f32.
void topk_counts_from_indices(const Tensor& topk_indices, int64_t groups, Tensor& counts);

void switch_aux_loss_forward(const Tensor& aux_scores, const Tensor& counts, int64_t topk, double coeff, Tensor& loss);
// daux_scores (overwritten) = dloss * dL/da.
void switch_aux_loss_backward(const Tensor& counts, int64_t topk, double coeff, double dloss, int64_t num_tokens,
                              Tensor& daux_scores);

void z_loss_forward(const Tensor& logits, double coeff, Tensor& loss);
// dlogits += dloss * dL/dlogits.
void z_loss_backward(const Tensor& logits, double coeff, double dloss, Tensor& dlogits);

inline constexpr double kSinkhornTol = 1e-4;
inline constexpr int kSinkhornMaxIters = 10000;
void sinkhorn(const Tensor& logits, Tensor& out);

namespace cpu {
void aux_scores_forward(const Tensor& logits, RouterScore score, Tensor& aux_scores);
void aux_scores_backward(const Tensor& logits, RouterScore score, const Tensor& daux_scores, Tensor& dlogits);
// counts[g, e] from the top-k indices [T, k] of each row.
void counts_from_indices(const Tensor& indices, int64_t groups, Tensor& counts);
void switch_aux_loss_forward(const Tensor& aux_scores, const Tensor& counts, int64_t topk, double coeff, Tensor& loss);
void switch_aux_loss_backward(const Tensor& counts, int64_t topk, double coeff, double dloss, Tensor& daux_scores);
void z_loss_forward(const Tensor& logits, double coeff, Tensor& loss);
void z_loss_backward(const Tensor& logits, double coeff, double dloss, Tensor& dlogits);
void sinkhorn(const Tensor& logits, Tensor& out);
}  // namespace cpu
namespace cuda {
void aux_scores_forward(const Tensor& logits, RouterScore score, Tensor& aux_scores);
void aux_scores_backward(const Tensor& logits, RouterScore score, const Tensor& daux_scores, Tensor& dlogits);
void counts_from_indices(const Tensor& indices, int64_t groups, Tensor& counts);
void switch_aux_loss_forward(const Tensor& aux_scores, const Tensor& counts, int64_t topk, double coeff, Tensor& loss);
void switch_aux_loss_backward(const Tensor& counts, int64_t topk, double coeff, double dloss, Tensor& daux_scores);
void z_loss_forward(const Tensor& logits, double coeff, Tensor& loss);
void z_loss_backward(const Tensor& logits, double coeff, double dloss, Tensor& dlogits);
void sinkhorn(const Tensor& logits, Tensor& out);
}  // namespace cuda

}  // namespace moecore::ops
